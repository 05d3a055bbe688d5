"""Timing run on the GPU: reference lines, the headline shape with a tile sweep, the grid.
Writes JSON lines to $OUT/perf.jsonl (or ./perf.jsonl) and prints a short table last.

    python tools/gpu_perf.py [MODES]     # comma-separated; tools/gpu_check.sh passes "all"

Modes: headline (default), grid, bwd, ptxas, sweep (forward tiles), all (= those five); and the
experiments kept for reruns: hopper, bwdsweep, bwdpersist, fusedpersist, dqpersist, bwdquick,
fusedvspair, fusedthreshold, fp16, timing, bwd256, bwd256sm80, gqa, headdims, hd96tiles, semilocal,
shorttiles, bstiles, fusedshort (read the code for what each times).
"""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modes", nargs="?", default="headline", help="comma-separated modes (default: headline)")
    args = parser.parse_args(argv)
    import dataclasses
    import json
    import os

    import torch

    from hstu_cute import bench, hstu_attn_varlen_func, launch
    from hstu_cute.testing import call_record

    out_dir = os.environ.get("OUT", ".")
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(out_dir, "perf.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")

    emit({"ref": "gemm_bf16_8192", "tflops": bench.gemm_tflops(), "device": torch.cuda.get_device_name()})
    modes = set(args.modes.split(","))
    if "all" in modes:
        modes |= {"ptxas", "sweep", "headline", "grid", "bwd"}
    SWEEP = {
        64: ((128, 64, 4, 2), (128, 128, 4, 2), (64, 128, 4, 2), (128, 128, 8, 2), (64, 64, 4, 2)),
        128: ((128, 64, 4, 2), (128, 32, 4, 2), (64, 64, 4, 2)),
        256: ((64, 64, 4, 1), (64, 64, 4, 2), (128, 64, 8, 1), (64, 32, 4, 2), (128, 32, 8, 2)),
    }
    if "ptxas" in modes:
        from hstu_cute.variants import default_fwd_tiles
        for d in (64, 128, 256):
            w = dataclasses.replace(bench.headline(), name=f"full B8 N4096 D{d}", head_dim=d, sdpa=False)
            for rep in range(2):  # interleaved, twice: the difference must beat the run-to-run spread
                for opt in (3, 2):
                    tiles = dict(default_fwd_tiles(d), lpt_grid=True, ptxas_opt=opt)
                    emit(bench.run_workload(w, tiles))
    if "sweep" in modes:
        for d, configs in SWEEP.items():
            w = dataclasses.replace(bench.headline(), name=f"full B8 N4096 D{d}", head_dim=d, sdpa=False)
            for tm, tn, nw, st in configs:
                tiles = dict(tile_m=tm, tile_n=tn, num_warps=nw, num_stages=st, lpt_grid=True)
                try:
                    emit(bench.run_workload(w, tiles))
                except Exception as e:  # a config may not fit smem/registers
                    emit({"workload": w.name, "tiles": tiles, "error": repr(e)[:300]})
    if "hopper" in modes:
        # Hopper forward defaults vs one tile per CTA, interleaved (the spread between repeats is the
        # noise), the Ampere path and cuDNN in the same run.
        from hstu_cute.variants import default_hopper_fwd_tiles

        head = bench.headline()
        for d in (128, 256, 64):
            w = dataclasses.replace(head, name=f"full B8 N4096 D{d}", head_dim=d)
            emit(bench.run_workload(w, path="hopper"))
            w = dataclasses.replace(w, sdpa=False)
            for rep in range(2):
                emit(bench.run_workload(w, dict(default_hopper_fwd_tiles(d, False), persistent=False),
                                        path="hopper"))
                emit(bench.run_workload(w, path="hopper"))
        emit(bench.run_workload(dataclasses.replace(head, sdpa=False), path="ampere"))
        short = bench.Workload("uniform90 B1024 N256", 1024, 256, lengths="uniform90", sdpa=True)
        emit(bench.run_workload(short, path="hopper"))
        emit(bench.run_workload(dataclasses.replace(short, sdpa=False), path="ampere"))
    if "gqa" in modes:
        # Issue 46's GQA bar: B8 N4096 H16 D128 causal, k and v with 16 heads (MHA) against 4
        # (group 4): the forward without autograd (native key heads), the training step (expanded,
        # gradients summed by autograd); same run, interleaved, L2 flushed before each sample.
        w = dataclasses.replace(bench.headline(), name="full B8 N4096 H16 D128", heads=16, sdpa=False)
        sets = [bench.make_inputs(w, seed=s) for s in range(2)]
        f_fwd, kind = bench.flops(w, [w.max_len] * w.batch, [w.max_len] * w.batch)
        for rep in range(2):
            for h_kv in (16, 4):
                calls, steps = [], []
                for b in sets:
                    kw = {n: x for n, x in b.items() if not n.startswith("_")}
                    kw["k"], kw["v"] = b["k"][:, :h_kv].contiguous(), b["v"][:, :h_kv].contiguous()
                    calls.append(lambda kw=kw: hstu_attn_varlen_func(**kw))
                    leaves = {n: kw[n].detach().clone().requires_grad_() for n in ("q", "k", "v")}
                    dout = torch.randn_like(kw["q"])
                    steps.append(lambda kw=kw, leaves=leaves, dout=dout: torch.autograd.grad(
                        hstu_attn_varlen_func(**dict(kw, **leaves)), tuple(leaves.values()), dout))
                ms, iqr = bench.time_flushed(calls)
                step_ms, step_iqr = bench.time_flushed(steps)
                emit({"workload": w.name, "mode": "gqa", "h_kv": h_kv, "rep": rep, "fwd_ms": ms, "fwd_iqr": iqr,
                      "fwd_tflops": f_fwd / ms / 1e9, "step_ms": step_ms, "step_iqr": step_iqr,
                      "step_tflops": 3.5 * f_fwd / step_ms / 1e9, "flops": kind})
    if "hd96tiles" in modes:
        # D96 at 0.83x of D128 on D128's tiles (session 35). Wider key tiles (smem fits 2 Q and 2
        # K/V stages up to 192), and FlashAttention-3's answer for small head dims: three consumer
        # warpgroups (192-row tiles; at 160 registers each, 192 x 80 and 192 x 96 compile without
        # spills at D96, per tools/sass_counts.py). Each configuration's output is compared with the
        # default's on the same inputs (max_diff: a gross error shows there; the tests decide
        # correctness). D128 beside them, two rounds. Session 36: every one slower than the default
        # (0.86-0.93x); 192 x 96 at D64 ended in an illegal address and is left out (no default or
        # shipped key runs three consumer warpgroups).
        from hstu_cute.variants import default_hopper_fwd_tiles

        def output(w, tiles):
            kw = {n: x for n, x in bench.make_inputs(w, seed=0).items() if not n.startswith("_")}
            call, rab = call_record(**kw)
            return launch.forward(kw["q"], kw["k"], kw["v"], rab, call, tiles, path="hopper")

        head = dataclasses.replace(bench.headline(), sdpa=False)
        sweeps = {96: [dict(tile_n=n) for n in (144, 160, 176, 192)] + [dict(tile_m=192, tile_n=n) for n in (80, 96)]}
        for rep in range(2):
            emit(dict(bench.run_workload(dataclasses.replace(head, name="full B8 N4096 D128"), path="hopper"),
                      mode="hd96tiles", rep=rep))
            for d, configs in sweeps.items():
                w = dataclasses.replace(head, name=f"full B8 N4096 D{d}", head_dim=d)
                emit(dict(bench.run_workload(w, path="hopper"), mode="hd96tiles", rep=rep))
                reference = output(w, None)
                for config in configs:
                    tiles = dict(default_hopper_fwd_tiles(d, False), **config)
                    try:
                        row = dict(bench.run_workload(w, tiles, path="hopper"), mode="hd96tiles", rep=rep)
                        row["max_diff"] = float((output(w, tiles).float() - reference.float()).abs().max())
                        emit(row)
                    except Exception as e:  # a config may not fit smem or registers
                        emit({"workload": w.name, "tiles": tiles, "mode": "hd96tiles", "error": repr(e)[:300]})
    if "shorttiles" in modes:
        # Issue 45's "tile shapes chosen by length": the short jagged recsys forward (u[1,256] B4096,
        # 8 targets) on the default 128 x 128 persistent tiles against 64-row tiles (one consumer
        # warpgroup; non-persistent ones let smem decide how many CTAs share an SM) and 128 x 64.
        # Two CTAs per SM at 64 x 64 (a min_blocks_per_mp key field, session 35) lost too, 1.29x and
        # 2.24x the default's time on the H200, and was taken out again (perf-log, session 36).
        from hstu_cute.variants import default_hopper_fwd_tiles

        short = [x for x in bench.recsys_grid() if x.name.startswith("short jagged")][0]
        short = dataclasses.replace(short, sdpa=False)
        configs = [{}, dict(tile_m=64, tile_n=128, persistent=False, dynamic_tiles=False),
                   dict(tile_m=64, tile_n=64, persistent=False, dynamic_tiles=False, q_stages=1),
                   dict(tile_m=64, tile_n=128), dict(tile_m=128, tile_n=64)]
        for rep in range(2):
            for config in configs:
                tiles = dict(default_hopper_fwd_tiles(short.head_dim, False), **config) if config else None
                try:
                    emit(dict(bench.run_workload(short, tiles, path="hopper"), mode="shorttiles", rep=rep))
                except Exception as e:  # a config may not fit smem or registers
                    emit({"workload": short.name, "tiles": tiles, "mode": "shorttiles", "error": repr(e)[:300]})
    if "bstiles" in modes:
        # Issues 43 / 44: the block-sparse fused backward's tiles on the 10 % rows (blocks of 128
        # and of 64, B8 H32 N16384 causal): one CTA per key block (default) against persistent
        # CTAs claiming key blocks, whose prologue and epilogue (K / V loads, dK / dV stores)
        # then overlap the next walk: about 6 query blocks per key block at 10 %. Lines timed in
        # turn (bench.time_interleaved); dQ, dK and dV checked against the default's.
        from hstu_cute.block_mask import BlockMask
        from hstu_cute.bench_sparse import _seq_lengths, kept_blocks, sparse_grid

        grid = sparse_grid()
        for w in (grid[0], grid[7]):
            lengths = _seq_lengths(w)
            gen = torch.Generator(device="cuda").manual_seed(1)
            q, k, v, do = ((torch.rand((sum(lengths), w.heads, w.head_dim), generator=gen, device="cuda") * 2 - 1)
                           .to(torch.bfloat16) for _ in range(4))
            offsets = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
            call, _ = call_record(q=q, k=k, v=v, seq_offsets_q=offsets, seq_offsets_k=offsets,
                                  max_seqlen_q=w.seqlen, max_seqlen_k=w.seqlen, window_size=(-1, 0),
                                  alpha=w.head_dim ** -0.5,
                                  block_mask=BlockMask.from_dense(kept_blocks(w), w.block, w.block))
            configs = {"default": None, "persistent": dict(tile_m=64, tile_n=128, persistent=True, dynamic_tiles=True),
                       "persistent static": dict(tile_m=64, tile_n=128, persistent=True)}
            ref = launch.backward(do, q, k, v, None, call)[:3]
            lines = {}
            for name, tiles in configs.items():
                try:
                    got = launch.backward(do, q, k, v, None, call, tiles_dkdv=tiles)[:3]
                except Exception as e:  # a config the kernel does not build
                    emit({"workload": w.name, "mode": "bstiles", "config": name, "error": repr(e)[:300]})
                    continue
                diff = [float((g.float() - r.float()).abs().max()) for g, r in zip(got, ref)]
                emit({"workload": w.name, "mode": "bstiles", "config": name, "max_diff_dq_dk_dv": diff})
                lines[name] = (lambda tiles=tiles: launch.backward(do, q, k, v, None, call, tiles_dkdv=tiles))
            for name, (ms, iqr) in bench.time_interleaved(lines).items():
                emit({"workload": w.name, "mode": "bstiles", "config": name, "bwd_ms": ms, "iqr_ms": iqr})
    if "bsfixed" in modes:
        # Issue 43: what a key block's CTA costs besides its m-blocks. The fused backward alone
        # (zero-fill and conversion included) on B8 H32 N16384 causal, block 128, at densities from
        # the diagonal alone up, one CTA per key block against persistent claimed CTAs: the
        # intercept at zero density is the per-CTA work (K / V loads, dK / dV stores, launch).
        import dataclasses as dc

        from hstu_cute.block_mask import BlockMask
        from hstu_cute.bench_sparse import kept_blocks, sparse_grid

        base = sparse_grid()[0]
        gen = torch.Generator(device="cuda").manual_seed(1)
        q, k, v, do = ((torch.rand((base.batch * base.seqlen, base.heads, base.head_dim), generator=gen,
                                   device="cuda") * 2 - 1).to(torch.bfloat16) for _ in range(4))
        offsets = torch.arange(base.batch + 1, device="cuda", dtype=torch.int32) * base.seqlen
        configs = {"default": None, "persistent": dict(tile_m=64, tile_n=128, persistent=True, dynamic_tiles=True)}
        for density in (0.0, 0.05, 0.10, 0.20):
            w = dc.replace(base, density=density)
            kept = kept_blocks(w)
            call, _ = call_record(q=q, k=k, v=v, seq_offsets_q=offsets, seq_offsets_k=offsets,
                                  max_seqlen_q=w.seqlen, max_seqlen_k=w.seqlen, window_size=(-1, 0),
                                  alpha=w.head_dim ** -0.5, block_mask=BlockMask.from_dense(kept, w.block, w.block))
            lines = {name: (lambda tiles=tiles, call=call: launch.backward(do, q, k, v, None, call, tiles_dkdv=tiles))
                     for name, tiles in configs.items()}
            for name, (ms, iqr) in bench.time_interleaved(lines, rounds=2, pause_s=0.5).items():
                emit({"workload": "B8 H32 N16384 causal", "mode": "bsfixed", "density": density,
                      "kept_pairs": int(kept.sum()), "config": name, "bwd_ms": ms, "iqr_ms": iqr})
    if "packed" in modes:
        # Issue 45: short jagged users packed into 128-row tiles, spelled with what exists: the
        # whole batch as ONE sequence (offsets [0, T]) whose func mask gives row r of user b the
        # keys [start_b, r + 1) (block-diagonal causal), against the jagged causal call on the
        # same tensors. scaling_seqlen keeps S. Forward alone and forward + backward (autograd),
        # lines timed in turn; outputs and gradients compared with the jagged call's.
        for batch, seqlen in ((2048, 256), (4096, 256), (512, 1024)):
            w = bench.Workload(f"u[1,{seqlen}] B{batch} causal", batch, seqlen, lengths="uniform1")
            full = bench.make_inputs(w, seed=0)
            kw = {k: v for k, v in full.items() if not k.startswith("_")}
            offsets = kw["seq_offsets_q"]
            total = int(offsets[-1])
            lens = offsets[1:] - offsets[:-1]
            seq_of_row = torch.repeat_interleave(torch.arange(batch, device="cuda"), lens)
            rows_ = torch.arange(total, device="cuda", dtype=torch.int32)
            func = torch.zeros((1, 3, total + 256), dtype=torch.int32, device="cuda")
            func[0, 1, :total] = offsets[seq_of_row]
            func[0, 2, :total] = rows_ + 1
            whole = torch.tensor([0, total], dtype=torch.int32, device="cuda")
            packed = dict(kw, seq_offsets_q=whole, seq_offsets_k=whole, max_seqlen_q=total, max_seqlen_k=total,
                          window_size=(-1, -1), func=func, scaling_seqlen=seqlen)
            for name in ("q", "k", "v"):
                kw[name].requires_grad_(True)
            dout = torch.rand_like(kw["q"])
            outs = {}
            for label, args in (("jagged", kw), ("packed", packed)):
                o = hstu_attn_varlen_func(**args)
                outs[label] = (o.detach(), *torch.autograd.grad(o, (kw["q"], kw["k"], kw["v"]), dout))
            diff = [float((a.float() - b.float()).abs().max()) for a, b in zip(outs["jagged"], outs["packed"])]
            emit({"workload": w.name, "mode": "packed", "tokens": total, "max_diff_o_dq_dk_dv": diff,
                  "max_abs": [float(a.float().abs().max()) for a in outs["jagged"]]})
            lines = {}
            for label, args in (("jagged", kw), ("packed", packed)):
                def fwd(args=args):
                    with torch.no_grad():
                        hstu_attn_varlen_func(**args)
                lines[label + " fwd"] = fwd
                lines[label + " fwd+bwd"] = (lambda args=args: torch.autograd.grad(
                    hstu_attn_varlen_func(**args), (kw["q"], kw["k"], kw["v"]), dout))
            for label, (ms, iqr) in bench.time_interleaved(lines, rounds=2, pause_s=0.3).items():
                emit({"workload": w.name, "mode": "packed", "line": label, "ms": ms, "iqr_ms": iqr})
    if "zerolead" in modes:
        # The fused backward's dQ accumulator zeroed in the kernel `lead` walk sections ahead
        # (hopper.dq_ahead; 0: the launcher zero-fills it): the backward call alone at leads 0, 1
        # and 2, lines timed in turn, gradients checked against lead 0's.
        from hstu_cute.launch import bwd as launch_bwd

        # (Block masks compile without it: HopperBwdKey.zeroes_dq_ahead.)
        cases = [("B8 H4 N4096 causal", 8, 4096, 4), ("B32 H4 N1024 causal", 32, 1024, 4)]
        for name, batch, seqlen, heads in cases:
            gen = torch.Generator(device="cuda").manual_seed(1)
            q, k, v, do = ((torch.rand((batch * seqlen, heads, 128), generator=gen, device="cuda") * 2 - 1)
                           .to(torch.bfloat16) for _ in range(4))
            offsets = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * seqlen
            call, _ = call_record(q=q, k=k, v=v, seq_offsets_q=offsets, seq_offsets_k=offsets, max_seqlen_q=seqlen,
                                  max_seqlen_k=seqlen, window_size=(-1, 0), alpha=128 ** -0.5)

            def at_lead(lead):
                launch_bwd.DQ_ZERO_LEAD = lead
                return launch.backward(do, q, k, v, None, call)[:3]

            ref = at_lead(0)
            lines = {}
            for lead in (0, 1, 2):
                got = at_lead(lead)
                diff = [float((g.float() - r.float()).abs().max()) for g, r in zip(got, ref)]
                emit({"workload": name, "mode": "zerolead", "lead": lead, "max_diff_dq_dk_dv": diff})
                lines[lead] = (lambda lead=lead: at_lead(lead))
            for lead, (ms, iqr) in bench.time_interleaved(lines).items():
                emit({"workload": name, "mode": "zerolead", "lead": lead, "bwd_ms": ms, "iqr_ms": iqr})
        launch_bwd.DQ_ZERO_LEAD = 1
    if "bsfwdtiles" in modes:
        # Issue 43: the block-sparse forward (B8 H32 N16384 causal 10 %, block 128) is bound by
        # memory (ncu, session 39): deeper K/V rings against the default 128 x 128, 2 stages, 2 Q
        # stages. Lines timed in turn; outputs checked against the default's.
        from hstu_cute.block_mask import BlockMask
        from hstu_cute.bench_sparse import kept_blocks, sparse_grid
        from hstu_cute.variants import block_sparse_hopper_fwd_tiles

        w = sparse_grid()[0]
        gen = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = ((torch.rand((w.batch * w.seqlen, w.heads, 128), generator=gen, device="cuda") * 2 - 1)
                   .to(torch.bfloat16) for _ in range(3))
        offsets = torch.arange(w.batch + 1, device="cuda", dtype=torch.int32) * w.seqlen
        call, _ = call_record(q=q, k=k, v=v, seq_offsets_q=offsets, seq_offsets_k=offsets, max_seqlen_q=w.seqlen,
                              max_seqlen_k=w.seqlen, window_size=(-1, 0), alpha=128 ** -0.5,
                              block_mask=BlockMask.from_dense(kept_blocks(w), w.block, w.block))
        base = block_sparse_hopper_fwd_tiles(128, False, w.block, w.block)
        configs = {"default": None, "3 K/V stages, 1 Q stage": dict(base, num_stages=3, q_stages=1),
                   "128 x 64, 4 stages": dict(base, tile_n=64, num_stages=4)}
        ref = launch.forward(q, k, v, None, call)
        lines = {}
        for name, tiles in configs.items():
            try:
                got = launch.forward(q, k, v, None, call, tiles=tiles)
            except Exception as e:  # a config the kernel does not build
                emit({"workload": w.name, "mode": "bsfwdtiles", "config": name, "error": repr(e)[:300]})
                continue
            emit({"workload": w.name, "mode": "bsfwdtiles", "config": name,
                  "max_diff": float((got.float() - ref.float()).abs().max())})
            lines[name] = (lambda tiles=tiles: launch.forward(q, k, v, None, call, tiles=tiles))
        for name, (ms, iqr) in bench.time_interleaved(lines).items():
            emit({"workload": w.name, "mode": "bsfwdtiles", "config": name, "fwd_ms": ms, "iqr_ms": iqr})
    if "semilocal" in modes:
        # Issue 46's window bar at the recsys jagged shape with 8 contexts and 32 targets: a causal
        # band (window_size=(W, 0)) with contexts and targets against causal + contexts + targets,
        # forward kernel and training step; W = N - 1 covers every sequence (bar: >= 0.9x of causal's
        # speed, i.e. time <= causal / 0.9; normalize_window makes it causal), W = N - 8 is the same
        # mask on the semi-local kernels, shorter W must be faster. Two rounds.
        base = bench.Workload("jagged u[1,N] B128 N2048 ctx8 tgt32", 128, 2048, lengths="uniform1", contexts=8,
                              targets=32)
        for rep in range(2):
            for window in ((-1, 0), (2047, 0), (2040, 0), (1024, 0), (256, 0), (64, 0)):
                w = dataclasses.replace(base, name=f"{base.name} window {window}", window=window)
                emit(dict(bench.run_workload(w), mode="semilocal", rep=rep, window=list(window)))
                emit(dict(bench.run_training_step(w), mode="semilocal", rep=rep, window=list(window)))
    if "headline" in modes:
        emit(bench.run_workload(bench.headline()))
    if "grid" in modes:
        for w in bench.default_grid():
            emit(bench.run_workload(w))
    if "bwdsweep" in modes:
        w = dataclasses.replace(bench.headline(), sdpa=False)
        t = dict(tile_m=64, tile_n=128)
        configs = [None, dict(t, ptxas_opt=2), dict(t, num_stages=1)]
        for rep in range(2):
            for tkv in configs:
                try:
                    emit(bench.run_workload_bwd(w, tiles_dkdv=tkv))
                except Exception as e:
                    emit({"workload": w.name + " bwd", "tiles": f"dkdv {tkv}", "error": repr(e)[:300]})
        q = torch.randn(8 * 4096, 4, 128, device="cuda", dtype=torch.bfloat16)
        ms, _ = bench.time_cuda([lambda: torch.zeros(q.shape, dtype=torch.float32, device="cuda").to(q.dtype)])
        print(f"fp32 dQ accumulator zero + cast, B8 N4096 H4 D128: {ms * 1e3:.1f} us", flush=True)
    if "bwdpersist" in modes:
        # The dK/dV kernel of the pair, persistent (the default: one CTA per SM walking the n-blocks)
        # against one CTA per n-block; the fused D128 default beside them.
        t = dict(tile_m=64, tile_n=128)
        emit(bench.run_workload_bwd(bench.headline()))
        for d in (128, 64, 32):
            w = dataclasses.replace(bench.headline(), name=f"full B8 N4096 D{d}", head_dim=d, sdpa=False)
            for tkv in (None, dict(t, persistent=False)):
                emit(bench.run_workload_bwd(w, tiles_dkdv=tkv, deterministic=d == 128))
        emit(bench.run_workload_bwd(bench.headline()))
    if "fusedpersist" in modes:
        # The fused D128 kernel: one CTA per n-block (default) against persistent.
        t = dict(tile_m=64, tile_n=128)
        w = dataclasses.replace(bench.headline(), sdpa=False)
        for rep in range(2):
            emit(bench.run_workload_bwd(bench.headline()))
            emit(bench.run_workload_bwd(w, tiles_dkdv=dict(t, persistent=True)))
    if "dqpersist" in modes:
        # The pair's dQ kernel persistent (one CTA per SM walking the m-blocks) against one CTA per m-block.
        w = dataclasses.replace(bench.headline(), sdpa=False)
        cases = [(w, dict(tile_m=128, tile_n=64), True),
                 (dataclasses.replace(w, name="full B8 N4096 D64", head_dim=64), dict(tile_m=128, tile_n=64), False),
                 (dataclasses.replace(w, name="full B8 N4096 D256", head_dim=256), dict(tile_m=128, tile_n=48, num_stages=2),
                  False)]
        for rep in range(2):
            emit(bench.run_workload_bwd(bench.headline()))
            for wl, tq, det in cases:
                for pers in (False, True):
                    emit(bench.run_workload_bwd(wl, tiles_dq=dict(tq, persistent=pers), deterministic=det))
    if "bwdquick" in modes:
        # One line each: D128 default (with the SDPA lines), D128 deterministic pair, D64, D32.
        w = dataclasses.replace(bench.headline(), sdpa=False)
        emit(bench.run_workload_bwd(bench.headline()))
        emit(bench.run_workload_bwd(w, deterministic=True))
        for d in (64, 32):
            emit(bench.run_workload_bwd(dataclasses.replace(w, name=f"full B8 N4096 D{d}", head_dim=d)))
    if "fusedvspair" in modes:
        # The fused D128 kernel against the deterministic pair over shapes, interleaved twice.
        shapes = [dataclasses.replace(bench.headline(), sdpa=False),
                  bench.Workload("noncausal B8 N4096", 8, 4096, window=(-1, -1)),
                  bench.Workload("uniform90 B1024 N256", 1024, 256, lengths="uniform90"),
                  bench.Workload("zipf1.2 B64 N4096", 64, 4096, lengths="zipf"),
                  bench.Workload("full B32 N1024", 32, 1024),
                  bench.Workload("ctx8+tgt64 g1 B8 N4096", 8, 4096, contexts=8, targets=64, group=1)]
        for rep in range(2):
            for wl in shapes:
                for det in (False, True):
                    emit(bench.run_workload_bwd(wl, deterministic=det))
    if "fusedshort" in modes:
        # Issue 45: the short jagged backward call through the pair (the default below
        # FUSED_MIN_SEQLEN_K) against the fused kernel forced, with the launcher's dQ fill (lead 0)
        # and zeroing one section ahead (lead 1). Lines in turn; gradients against the pair's.
        from hstu_cute.launch import bwd as launch_bwd

        for wl in (bench.Workload("short jagged u[1,256] B2048 tgt64", 2048, 256, lengths="uniform1", targets=64),
                   bench.Workload("short jagged u[1,256] B4096 tgt8", 4096, 256, lengths="uniform1", targets=8)):
            kw = {a: b for a, b in bench.make_inputs(wl).items() if not a.startswith("_")}
            call, _ = call_record(**kw)
            dout = torch.rand_like(kw["q"])

            def run(kind, lead=1):
                launch.heuristics.FUSED_MIN_SEQLEN_K = 0 if kind == "fused" else default_min
                launch_bwd.DQ_ZERO_LEAD = lead
                try:
                    return launch.backward(dout, kw["q"], kw["k"], kw["v"], None, call)[:3]
                finally:
                    launch.heuristics.FUSED_MIN_SEQLEN_K, launch_bwd.DQ_ZERO_LEAD = default_min, 1

            default_min = launch.heuristics.FUSED_MIN_SEQLEN_K
            lines = {"pair": lambda: run("pair"), "fused lead 0": lambda: run("fused", 0),
                     "fused lead 1": lambda: run("fused", 1)}
            ref = run("pair")
            for label, fn in lines.items():
                diff = [float((g.float() - r.float()).abs().max()) for g, r in zip(fn(), ref)]
                emit({"workload": wl.name, "mode": "fusedshort", "line": label, "max_diff_dq_dk_dv": diff})
            for label, (ms, iqr) in bench.time_interleaved(lines, rounds=2, pause_s=0.3).items():
                emit({"workload": wl.name, "mode": "fusedshort", "line": label, "bwd_ms": ms, "iqr_ms": iqr})
    if "fusedthreshold" in modes:
        # Around launch.heuristics.FUSED_MIN_SEQLEN_K: the fused kernel (forced) against the pair.
        from hstu_cute import launch

        default_min = launch.heuristics.FUSED_MIN_SEQLEN_K
        for wl in (bench.Workload("full B16 N2048", 16, 2048), bench.Workload("full B32 N1024", 32, 1024),
                   bench.Workload("uniform90 B16 N2048", 16, 2048, lengths="uniform90"),
                   bench.Workload("full B64 N512", 64, 512)):
            launch.heuristics.FUSED_MIN_SEQLEN_K = 0
            row = bench.run_workload_bwd(wl)
            row["tiles"] += " fused (forced)"
            emit(row)
            emit(bench.run_workload_bwd(wl, deterministic=True))
        launch.heuristics.FUSED_MIN_SEQLEN_K = default_min
    if "fp16" in modes:
        # fp16 forward and backward (precise SiLU: ex2 + reciprocal) with the SDPA lines.
        for d in (128, 64, 256):
            w = dataclasses.replace(bench.headline(), name=f"fp16 B8 N4096 D{d}", head_dim=d, dtype="float16")
            emit(bench.run_workload(w, path="hopper"))
            emit(bench.run_workload_bwd(w))
    if "bwd" in modes:
        for w in (bench.headline(), dataclasses.replace(bench.headline(), name="full B8 N4096 D64", head_dim=64),
                  bench.Workload("rab H_rab=1 B8 N2048", 8, 2048, rab_heads=1)):
            emit(bench.run_workload_bwd(w))
            if torch.cuda.get_device_capability()[0] == 9:
                emit(bench.run_workload_bwd(dataclasses.replace(w, sdpa=False), deterministic=True))
                emit(bench.run_workload_bwd(dataclasses.replace(w, sdpa=False), path="ampere"))
        emit(bench.run_workload_bwd(dataclasses.replace(bench.headline(), sdpa=False)))
    if "timing" in modes:
        # The two timing methods side by side (bench.SYNC_EACH_CALL): per-call synchronization adds the
        # host launch time of every call to its sample.
        for sync_each in (True, False, True, False):
            bench.SYNC_EACH_CALL = sync_each
            row = bench.run_workload_bwd(bench.headline())
            row["tiles"] += " sync-each-call" if sync_each else " queued"
            emit(row)
        bench.SYNC_EACH_CALL = False
    if "bwd256" in modes:
        d256 = dataclasses.replace(bench.headline(), name="full B8 N4096 D256", head_dim=256)
        for w in (d256, d256, bench.Workload("rab H_rab=1 B8 N2048 D256", 8, 2048, head_dim=256, rab_heads=1),
                  bench.Workload("rab H_rab=H B8 N2048 D256", 8, 2048, head_dim=256, rab_heads=4)):
            try:
                emit(bench.run_workload_bwd(w))
            except Exception as e:
                emit({"workload": w.name + " bwd", "tiles": "-", "error": repr(e)[:300]})
    if "bwd256sm80" in modes:
        # The sm80 D256 backward: defaults, then the 4-warp register-resident dQ kernel (spills only
        # for fp16 with drab summed over heads) for comparison.
        d256 = dataclasses.replace(bench.headline(), name="full B8 N4096 D256", head_dim=256, sdpa=False)
        rab1 = bench.Workload("rab H_rab=1 B8 N2048 D256", 8, 2048, head_dim=256, rab_heads=1)
        for tiles_dq in (None, dict(tile_m=64, tile_n=32, num_warps=4, warps_d=1, ptxas_opt=2)):
            for w in (d256, rab1):
                try:
                    emit(bench.run_workload_bwd(w, tiles_dq=tiles_dq, path="ampere"))
                except Exception as e:
                    emit({"workload": w.name + " bwd", "tiles": str(tiles_dq), "error": repr(e)[:300]})
    emit({"host_overhead": bench.host_overhead_us()})

    print("\n=== summary ===")
    for r in rows:
        if "workload" in r and "tflops" in r:
            extra = ""
            if r.get("sdpa_flash"):
                extra = f"  sdpa flash {r['sdpa_flash']:.0f}  cudnn {r['sdpa_cudnn'] or 0:.0f}"
            print(f"{r['workload']:28s} {r.get('path', ''):7s} {str(r['tiles']):60s} {r['tflops']:7.1f} TF ({r['flops']}) {r['ms']:.3f} ms{extra}")
        elif "ref" in r:
            print(f"{r['ref']:28s} {r['tflops']:.0f} TF")
        elif "host_overhead" in r:
            print("host overhead", r["host_overhead"])
        elif "error" in r:
            print(f"{r['workload']:28s} {r['tiles']} ERROR {r['error'][:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
