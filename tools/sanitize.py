"""Small jagged batches through every mask family (and rab, delta_q, seqused), run under
compute-sanitizer by tools/gpu_check.sh (and tools/gpu_fp8_bwd.py's sanitize stage):

    compute-sanitizer --tool memcheck --error-exitcode 9 python tools/sanitize.py cases
    compute-sanitizer --tool memcheck --error-exitcode 9 python tools/sanitize.py fp8
    compute-sanitizer --tool memcheck --error-exitcode 9 python tools/sanitize.py fp8-bwd

``cases``: the 16-bit kernels. On a compute capability 9.x GPU every case runs the forward on both
kernel paths (hopper, then ampere, forced through HSTU_CUTE_ARCH). The backward runs on both paths
too, three ways per case: the default (on hopper at D128 forced to the fused dK/dV/dQ kernel, which
these short keys would not take by default; rab without drab included), deterministic=True (the
dK/dV + dQ pair; not at D256) and, with rab, has_drab=True (on hopper at D256 all of them run the
one wide kernel). A multi-query case gives k and v one head for q's two. ``--forward``: the
forward only; ``--hopper``: the hopper path only (a quick check of a forward change);
``--head-dim``: other head dims than 32, 128 and 256; ``--only TEXT``: the cases named so.

``fp8``: the Hopper FP8 forward, every entry (pre-quantized e4m3 with descales; quant_mode 0;
quant_mode 1, 2 and 4: the per-token and per-dim descales, the quantizer's one-pass and cooperative
forms). Lengths are random, so sequences start at tokens that are not multiples of 16.

``fp8-bwd``: the Hopper FP8 backward at D64, D128 and D256 (quant modes 0, 1, 2 and 4: the cast, the
two-direction, the one-pass and the cooperative quantizers; drab with modes 1 and 2 where the case
has rab), gradients by autograd; lengths random, so sequences start at tokens that are not multiples
of 16 (the token-contiguous copies' padding). Then the opt-in fused kernel at D128 on a batch with a
2100-token sequence.

The FP8 commands skip (exit 0) without a compute capability 9.x GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

CASES = {
    "none": dict(window_size=(-1, -1)),
    "causal": dict(window_size=(-1, 0)),
    "local": dict(window_size=(13, 5)),
    "context+target": dict(window_size=(-1, 0), num_contexts=9, num_targets=40, target_group_size=3),
    "target": dict(window_size=(-1, 0), num_targets=60, target_group_size=1),
    "delta_q causal": dict(window_size=(-1, 0), is_delta_q=True, max_seqlen_k=150),
    "delta_q local": dict(window_size=(20, 3), is_delta_q=True, max_seqlen_k=150),
    "delta_q none": dict(window_size=(-1, -1), is_delta_q=True, max_seqlen_k=150),
    "rab H_rab=1 (odd row stride)": dict(window_size=(-1, 0), rab_heads=1),
    "rab H_rab=H, seqused": dict(window_size=(-1, 0), rab_heads=2, seqused=True),
    # k and v with one head for q's two (MQA): query head h reads key head h // 2
    "MQA, context+target": dict(window_size=(-1, 0), num_contexts=9, num_targets=40, kv_heads=1),
}

FP8_CASES = {
    "none": dict(window_size=(-1, -1)),
    "causal": dict(window_size=(-1, 0)),
    "local": dict(window_size=(13, 5)),
    "context+target": dict(window_size=(-1, 0), num_contexts=9, num_targets=40, target_group_size=3),
    "delta_q causal": dict(window_size=(-1, 0), is_delta_q=True, max_seqlen_k=150),
    "delta_q local": dict(window_size=(20, 3), is_delta_q=True, max_seqlen_k=150),
    "rab H_rab=1": dict(window_size=(-1, 0), rab_heads=1),
    "rab H_rab=H, seqused": dict(window_size=(-1, 0), rab_heads=2, seqused=True),
}
FP8_BWD_CASES = {name: kw for name, kw in FP8_CASES.items() if name != "delta_q local"}


def cases(forward_only: bool, hopper_only: bool, head_dims=(32, 128, 256), only: str = "") -> None:
    import torch

    from hstu_cute import arch, hstu_attn_varlen_func, launch, testing

    launch.heuristics.FUSED_MIN_SEQLEN_K = 0
    paths = ("hopper", "ampere") if torch.cuda.get_device_capability()[0] == 9 else ("ampere",)
    if hopper_only:
        paths = paths[:1]
    for path in paths:
        os.environ["HSTU_CUTE_ARCH"] = {"hopper": "sm90", "ampere": "sm80"}[path]
        arch._kernel_path.cache_clear()
        for name, kw in CASES.items():
            if only not in name:
                continue
            kw = dict(kw)
            kv_heads = kw.pop("kv_heads", None)
            for head_dim in head_dims:
                b = testing.random_jagged_batch(5, 2, head_dim, 99 if kw.get("is_delta_q") else 131,
                                                device="cuda", seed=7, **kw)
                if kv_heads is not None:
                    b["k"], b["v"] = b["k"][:, :kv_heads].contiguous(), b["v"][:, :kv_heads].contiguous()
                hstu_attn_varlen_func(**b)
                if forward_only:
                    continue
                for t in ("q", "k", "v"):
                    b[t].requires_grad_(True)
                modes = [dict()] + ([dict(deterministic=True)] if head_dim <= 128 else [])
                if b["rab"] is not None:
                    modes.append(dict(has_drab=True))
                for mode in modes:
                    if b["rab"] is not None:
                        b["rab"].requires_grad_(mode.get("has_drab", False))
                    out = hstu_attn_varlen_func(**b, **mode)
                    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
                    out.backward(dout)
            torch.cuda.synchronize()
            print("ran", path, name, flush=True)


def _no_sm90() -> bool:
    import torch

    if torch.cuda.get_device_capability()[0] != 9:
        print("no sm90 GPU: the FP8 kernels do not run here; skipped")
        return True
    return False


def fp8_forward() -> None:
    import torch

    from hstu_cute import hstu_attn_varlen_func, testing
    from hstu_cute.quantize import QuantMode, quantize_batch

    if _no_sm90():
        return
    for name, kw in FP8_CASES.items():
        for head_dim in (64, 128, 256):
            b = testing.random_jagged_batch(7, 2, head_dim, 99 if kw.get("is_delta_q") else 131, device="cuda",
                                            seed=7, **kw)
            rest = {k: v for k, v in b.items() if k not in ("q", "k", "v")}
            with torch.no_grad():
                out0 = hstu_attn_varlen_func(b["q"], b["k"], b["v"], **rest, quant_mode=0)
                scaled = [hstu_attn_varlen_func(b["q"], b["k"], b["v"], **rest, quant_mode=m) for m in (1, 2, 4)]
                quantized = dict(zip("qkv", quantize_batch(b, QuantMode.PER_TENSOR)))
                out8 = hstu_attn_varlen_func(*(quantized[n].data for n in "qkv"), **rest,
                                             descale_q=quantized["q"].scale, descale_k=quantized["k"].scale,
                                             descale_v=quantized["v"].scale)
            torch.cuda.synchronize()
            assert all(torch.isfinite(o).all() for o in (out0, out8, *scaled)), (name, head_dim)
            print(f"fp8 {name} D{head_dim}: ok", flush=True)


def fp8_backward() -> None:
    import torch

    from hstu_cute import hstu_attn_varlen_func, launch, testing
    from hstu_cute.fp8_recipe import recipe

    if _no_sm90():
        return
    for name, kw in FP8_BWD_CASES.items():
        for head_dim in (64, 128, 256):
            b = testing.random_jagged_batch(7, 2, head_dim, 99 if kw.get("is_delta_q") else 131, device="cuda",
                                            seed=7, **kw)
            rest = {k: v for k, v in b.items() if k not in ("q", "k", "v")}
            for mode in (0, 1, 2, 4):
                q, k, v = (b[n].detach().clone().requires_grad_() for n in "qkv")
                out = hstu_attn_varlen_func(q, k, v, **rest, quant_mode=mode)
                grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out) * 1e-2)
                torch.cuda.synchronize()
                assert all(torch.isfinite(g).all() for g in grads), (name, head_dim, mode)
            if rest.get("rab") is not None:
                # has_drab: the dQ kernel's drab stores (per head) or fp32 atomics (one rab head).
                for mode in (1, 2):
                    rab = rest["rab"].detach().clone().requires_grad_()
                    out = hstu_attn_varlen_func(b["q"], b["k"], b["v"], **dict(rest, rab=rab), has_drab=True,
                                                quant_mode=mode)
                    drab = torch.autograd.grad(out, rab, torch.randn_like(out) * 1e-2)[0]
                    torch.cuda.synchronize()
                    assert torch.isfinite(drab).all(), (name, head_dim, "drab", mode)
            print(f"fp8 backward {name} D{head_dim}: ok", flush=True)

    # The fused FP8 kernel (opt-in; D128, modes 0 and 2-5, no rab, keys of at least FUSED_MIN_SEQLEN_K
    # tokens): lengths from 1 to 2100, so key blocks end inside K^T's padding and the next sequence.
    launch.heuristics.FP8_FUSED_BY_DEFAULT = True
    for name, kw in FP8_BWD_CASES.items():
        if "rab" in name:
            continue
        b = testing.random_jagged_batch(3, 2, 128, 2100, device="cuda", seed=8, lengths=[2100, 1, 1500],
                                        **{k: v for k, v in kw.items() if k != "max_seqlen_k"})
        rest = {k: v for k, v in b.items() if k not in ("q", "k", "v")}
        if not launch.fp8_backward_fused(128, recipe(2), rest["max_seqlen_k"], False, False, False):
            continue
        for mode in (0, 2, 4):
            q, k, v = (b[n].detach().clone().requires_grad_() for n in "qkv")
            out = hstu_attn_varlen_func(q, k, v, **rest, quant_mode=mode)
            grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out) * 1e-2)
            torch.cuda.synchronize()
            assert all(torch.isfinite(g).all() for g in grads), (name, "fused", mode)
        print(f"fp8 backward (fused) {name} D128: ok", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("cases", help="the 16-bit forward and backward, both kernel paths")
    p.add_argument("--forward", action="store_true", help="the forward only")
    p.add_argument("--hopper", action="store_true", help="the hopper path only")
    p.add_argument("--head-dim", type=int, action="append", default=None,
                   help="this head dim; repeatable (default: 32, 128 and 256)")
    p.add_argument("--only", default="", metavar="TEXT", help="only the cases whose name contains TEXT")
    sub.add_parser("fp8", help="the Hopper FP8 forward, every entry (skips without sm90)")
    sub.add_parser("fp8-bwd", help="the Hopper FP8 backward, then the opt-in fused kernel (skips without sm90)")
    args = parser.parse_args(argv)
    if args.command == "cases":
        cases(args.forward, args.hopper, tuple(args.head_dim or (32, 128, 256)), args.only)
    elif args.command == "fp8":
        fp8_forward()
    else:
        fp8_backward()
    return 0


if __name__ == "__main__":
    sys.exit(main())
