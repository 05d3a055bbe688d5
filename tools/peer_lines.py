"""Same-run reference lines from peers whose code stays out of this repository. Measurement only.

* ``triton-hstu`` (default): Meta's Triton HSTU attention (generative-recommenders'
  ``triton_hstu_mha``) against hstu-cute on the jagged rows of ``hstu_cute.bench.recsys_grid()``.
* ``--hbsa``: HBSA's block-sparse forward (zhengqigao/hbsattn, Triton, softmax) against our
  block-sparse forward on ``bench --grid blocksparse``'s uniform-length workloads, the same kept
  blocks (HBSA's jagged layout: one (H, total query blocks, total key blocks) bool, block-diagonal
  over the batch). HBSA's package lives in ``$HBSA_DIR`` (default ``<repo>/.peer/hbsattn``, the
  repository's root: ``hbsattn/hbsa_interface.py``). TF/s count the same allowed pairs for both.
* ``--nsa``: an open NSA (XunhaoLai/native-sparse-attention-triton, Triton, softmax): its average-pooled
  compression, compressed attention with top-k selection and top-k sparse attention, forward and
  forward + backward, beside ``hstu_cute.nsa`` on ``bench --grid nsa``'s workloads in the same
  configuration without the window branch (that NSA's window runs on the flash_attn package). Its
  package lives in ``$NSA_DIR`` (default ``<repo>/.peer/nsa``, the repository's root).

The Triton module is NOT part of this repository and never a dependency: a copy of its files lives in
a git-ignored directory, ``$TRITON_HSTU_DIR`` (default ``<repo>/.triton_hstu``), laid out as the
``generative_recommenders`` package (``ops/triton/triton_hstu_attention.py`` and what it imports).

Usage (GPU machine, repo root):  python tools/peer_lines.py [--hbsa | --nsa] [--limit N]
Output: JSON lines on stdout, appended to ``$OUT/<ref>.jsonl`` (``triton_hstu.jsonl``, ``hbsa.jsonl``;
OUT defaults to '.'); progress with
elapsed seconds on stderr.

Order: for every jagged workload, (1) Triton forward: all autotune configs compiled in parallel
threads, then Triton's own autotuning (first call), then timing; (2) ours (``bench.run_workload``) in
the same process; (3) an output check, Triton vs ``hstu_attn_varlen_func``. Then our backward
(``bench.run_workload_bwd``). Last, the Triton backward of every workload, each in its own
subprocess so that a crash (illegal memory access, ...) is recorded instead of killing this run.

Environment:
  TRITON_HSTU_DIR        where the copied ``generative_recommenders`` package lives
  OUT                    output folder for the JSON lines (default '.')
  HBSA_DIR               where HBSA's repository lives (--hbsa; default <repo>/.peer/hbsattn)
  NSA_DIR                where the open NSA's repository lives (--nsa; default <repo>/.peer/nsa)
  TRITON_HSTU_FWD_CONFIGS, TRITON_HSTU_BWD_CONFIGS
                         comma-separated indices into the upstream autotune config lists (29 forward,
                         20 backward on CUDA >= 12.8) to autotune over only those; the JSON rows report
                         the index of the config Triton picked, so a rerun can pin it
  TRITON_HSTU_SORT       1 (default): ``sort_by_length=True`` as generative-recommenders' own benchmark
                         calls it (a torch.sort of the lengths per call, included in the time); 0: off
  TRITON_HSTU_TMA        0 (default) / 1: ``enable_tma`` (upstream default off)
  TRITON_HSTU_WORKLOADS  comma-separated indices into the jagged rows (default: all)
  TRITON_HSTU_BWD        1 (default) / 0: the Triton backward subprocesses
  TRITON_HSTU_OURS_BWD   1 (default) / 0: our backward line
  TRITON_HSTU_BWD_CHECK  1 (default) / 0: gradient check of Triton vs ours in the backward subprocess
  TRITON_HSTU_BWD_TIMEOUT  seconds per backward subprocess (default 300)
  TRITON_HSTU_COMPILE_THREADS  threads for the parallel precompile (default: CPU count)

Call convention (what maps to what), our operator -> ``triton_hstu_mha``:
  q, k, v (T, H, D) bf16        -> q, k, v (same tensors; Triton requires k rows == q rows)
  seq_offsets_q == seq_offsets_k (int32) -> seq_offsets (int64, as the upstream benchmark builds it)
  max_seqlen_q (= divisor S)    -> N (its divisor: silu(.) / N, and the grid's row bound)
  alpha = 1.0                   -> alpha = 1.0 (``bench.run_workload`` times ours with alpha 1.0)
  window (-1, 0) (causal)       -> always causal
  num_targets (B,) int32        -> num_targets (B,) int32, target_group_size must be 1 (no groups)
  num_contexts (B,) = min(c, Lk)-> contextual_seq_len = c (a scalar for the whole batch)
Semantic differences (documented, not hidden):
  * contexts: Triton's scalar ``contextual_seq_len`` equals our per-sequence ``min(c, Lk)`` except for
    sequences shorter than c: there ours is dense within the sequence (every row a context row) while
    Triton lets each row see only itself. The output check excludes those sequences' rows and reports
    how many it excluded; the FLOP count is the same convention for both lines.
  * rounding: Triton multiplies silu by 1/N before rounding P to bf16; ours rounds P, then scales the
    fp32 accumulator by 1/S (docs/operator.md section 3). Differences are rounding-level.
  * Triton's dq is accumulated in bf16 across key blocks (its backward), ours in fp32.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import argparse
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Environment: see the module docstring "
                                     "(TRITON_HSTU_DIR, OUT, TRITON_HSTU_*).")
    parser.add_argument("--hbsa", action="store_true",
                        help="HBSA's block-sparse forward beside ours instead of the Triton HSTU line")
    parser.add_argument("--nsa", action="store_true",
                        help="an open NSA's forward and forward + backward beside hstu_cute.nsa")
    parser.add_argument("--limit", type=int, default=None, help="with --hbsa / --nsa: the first N workloads")
    # Internal: the Triton backward of one workload, run in a subprocess by backward_row().
    parser.add_argument("--bwd-child", nargs="+", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before the heavy imports below: --help stays fast

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRITON_HSTU_DIR = os.environ.get("TRITON_HSTU_DIR", os.path.join(REPO, ".triton_hstu"))
OUT = os.environ.get("OUT", ".")
ALPHA = 1.0  # what bench.run_workload / run_workload_bwd pass to our kernels
SORT = os.environ.get("TRITON_HSTU_SORT", "1") != "0"
TMA = os.environ.get("TRITON_HSTU_TMA", "0") == "1"
T0 = time.time()

if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from hstu_cute import bench  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def emit(row: dict) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"{row['ref']}.jsonl"), "a") as f:
        f.write(line + "\n")


def jagged_workloads() -> list:
    ws = [w for w in bench.recsys_grid() if w.lengths != "full"]
    sel = os.environ.get("TRITON_HSTU_WORKLOADS")
    if sel:
        ws = [ws[int(i)] for i in sel.split(",")]
    return ws


# ---------------------------------------------------------------------------------------------
# The Triton module: import, config restriction, parallel precompile
# ---------------------------------------------------------------------------------------------

ALL_CONFIGS: dict = {}  # kernel attribute name -> the upstream autotune config list


def load_triton_hstu():
    if not os.path.isdir(os.path.join(TRITON_HSTU_DIR, "generative_recommenders")):
        raise SystemExit(f"no generative_recommenders package under TRITON_HSTU_DIR={TRITON_HSTU_DIR}")
    sys.path.insert(0, TRITON_HSTU_DIR)
    warnings.filterwarnings("ignore", message="Logical operators 'and' and 'or'")
    warnings.filterwarnings("ignore", message="warmup, rep, and use_cuda_graph")
    # The module prints a notice at import (config lists); keep stdout for JSON lines.
    with contextlib.redirect_stdout(sys.stderr):
        from generative_recommenders import common
        from generative_recommenders.ops.triton import triton_hstu_attention as m
    # Autotune per max_seq_len bucket (upstream's default key folds every N into 1); the rows here
    # differ in batch size anyway, which is also in the key.
    common.set_use_runtime_max_seq_len(True)
    for name, env in (("_hstu_attn_fwd", "TRITON_HSTU_FWD_CONFIGS"), ("_hstu_attn_bwd", "TRITON_HSTU_BWD_CONFIGS")):
        at = getattr(m, name)
        ALL_CONFIGS[name] = list(at.configs)
        sel = os.environ.get(env)
        if sel:
            at.configs = [ALL_CONFIGS[name][int(i)] for i in sel.split(",")]
    return m


def config_index(m, name: str):
    cfg = getattr(getattr(m, name), "best_config", None)
    if cfg is None:
        return None, None
    try:
        return ALL_CONFIGS[name].index(cfg), str(cfg)
    except ValueError:
        return None, str(cfg)


def precompile(m, name: str, call) -> float:
    """Compile every autotune config of kernel ``m.<name>`` in parallel threads (Triton releases the
    GIL while compiling), so that the autotuner's sequential loop finds them compiled. The launch
    arguments are captured by running ``call`` once with a stand-in for the kernel."""
    at = getattr(m, name)
    seen: dict = {}

    class _Capture:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.update(grid=grid, args=args, kwargs=kwargs)

            return launch

    setattr(m, name, _Capture())
    try:
        call()
    finally:
        setattr(m, name, at)
    if not seen or len(at.configs) <= 1:  # nothing to capture, or nothing to tune
        return 0.0
    t = time.time()
    try:
        from triton.runtime._async_compile import AsyncCompileMode

        workers = int(os.environ.get("TRITON_HSTU_COMPILE_THREADS", os.cpu_count() or 8))
        with ThreadPoolExecutor(workers) as ex, AsyncCompileMode(ex, ignore_errors=True):
            at.warmup(*seen["args"], grid=seen["grid"], **seen["kwargs"])
    except Exception as e:  # the autotuner compiles (sequentially) whatever is missing
        log(f"precompile of {name} failed, the autotuner compiles instead: {e!r}"[:300])
    return time.time() - t


def triton_args(w, kw: dict) -> dict:
    """``triton_hstu_mha`` keyword arguments for one ``bench.make_inputs`` set (see the module doc)."""
    assert w.window == (-1, 0) and not w.delta_q and not w.rab_heads, w
    assert w.group == 1, "Triton HSTU has no target groups"
    assert torch.equal(kw["seq_offsets_q"], kw["seq_offsets_k"]) and kw["max_seqlen_q"] == kw["max_seqlen_k"]
    return dict(
        N=kw["max_seqlen_q"], alpha=ALPHA, q=kw["q"], k=kw["k"], v=kw["v"],
        seq_offsets=kw["seq_offsets_k"].to(torch.int64),
        num_targets=kw.get("num_targets"),  # int32 (B,), as upstream's benchmark passes it
        max_attn_len=0, contextual_seq_len=w.contexts or 0, sort_by_length=SORT, enable_tma=TMA,
    )


def agreeing_rows(w, lens, device) -> torch.Tensor:
    """Rows whose sequence has the same mask under both conventions (all but sequences shorter than
    the scalar contextual_seq_len)."""
    c = w.contexts or 0
    keep = torch.tensor([n >= c for n in lens], dtype=torch.bool)
    return torch.repeat_interleave(keep, torch.tensor(lens)).to(device)


def rel_err(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> float:
    """max |a - b| / max |b| over ``rows``."""
    a, b = a.float()[rows], b.float()[rows]
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# Forward (main process)
# ---------------------------------------------------------------------------------------------


def tune_and_time(m, name: str, fns, label: str):
    """Precompile ``m.<name>``'s autotune configs, let its autotuner pick one on ``fns[0]``, then
    time ``fns`` (rotated): (ms, iqr_ms, config index, config, autotune s, precompile s)."""
    pc = precompile(m, name, fns[0])
    log(f"{label}: Triton precompile {pc:.1f}s ({len(getattr(m, name).configs)} configs)")
    t = time.time()
    fns[0]()
    torch.cuda.synchronize()
    tune_s = time.time() - t
    idx, cfg = config_index(m, name)
    log(f"{label}: Triton autotune {tune_s:.1f}s -> config #{idx}: {cfg}")
    ms, iqr = bench.time_cuda(fns)
    log(f"{label}: Triton {ms:.4f} ms")
    return ms, iqr, idx, cfg, tune_s, pc


def forward_row(m, w) -> dict:
    from hstu_cute import hstu_attn_varlen_func

    t_w = time.time()
    inputs = [bench.make_inputs(w, seed=s) for s in range(3)]
    lens_q, lens_k = inputs[0]["_lens_q"], inputs[0]["_lens_k"]
    f, convention = bench.flops(w, lens_q, lens_k)
    targs = [triton_args(w, kw) for kw in inputs]
    fns = [lambda a=a: m.triton_hstu_mha(**a) for a in targs]
    log(f"{w.name}: inputs {time.time() - t_w:.1f}s (T={inputs[0]['q'].shape[0]})")

    with torch.no_grad():
        tri_ms, tri_iqr, idx, cfg, tune_s, pc = tune_and_time(m, "_hstu_attn_fwd", fns, f"{w.name} fwd")

        # Output check on input set 0: Triton vs our public call (alpha 1.0, S = max_seqlen_q).
        kw = {k: v for k, v in inputs[0].items() if not k.startswith("_")}
        ours_out = hstu_attn_varlen_func(**kw)
        tri_out = fns[0]()
        torch.cuda.synchronize()
        rows = agreeing_rows(w, lens_k, ours_out.device)
        check = rel_err(tri_out, ours_out, rows)
        excluded = int((~rows).sum())
        log(f"{w.name}: check max|tri-ours|/max|ours| = {check:.3e} ({excluded} rows excluded)")
    del inputs, targs, fns, ours_out, tri_out

    t = time.time()
    ours = bench.run_workload(replace(w, sdpa=False))
    log(f"{w.name}: ours fwd {time.time() - t:.1f}s: {ours['ms']:.4f} ms")
    tri_tf = f / tri_ms / 1e9
    return dict(
        ref="triton_hstu", workload=w.name, mode="fwd", flops=convention,
        triton_ms=tri_ms, triton_iqr_ms=tri_iqr, triton_tflops=tri_tf,
        ours_ms=ours["ms"], ours_iqr_ms=ours["iqr_ms"], ours_tflops=ours["tflops"],
        ours_over_triton=ours["tflops"] / tri_tf,
        check_rel_err=check, check_ok=check < 2e-2, check_rows_excluded=excluded,
        triton_config_index=idx, triton_config=cfg, triton_autotune_s=tune_s, triton_precompile_s=pc,
        sort_by_length=SORT, enable_tma=TMA, contextual_seq_len=w.contexts or 0,
        elapsed_s=time.time() - t_w,
    )


# ---------------------------------------------------------------------------------------------
# Backward (one subprocess per workload, last)
# ---------------------------------------------------------------------------------------------

MARK = "TRITON_HSTU_BWD_RESULT "


def backward_child(wi: int, fwd_cfg: int | None) -> None:
    """Runs in the subprocess: the Triton backward of workload ``wi``; prints MARK + JSON."""
    m = load_triton_hstu()
    if fwd_cfg is not None:  # the forward's autotuning was done by the parent: pin its choice
        m._hstu_attn_fwd.configs = [ALL_CONFIGS["_hstu_attn_fwd"][fwd_cfg]]
    w = jagged_workloads()[wi]
    t_w = time.time()
    sets = []
    for s in range(3):
        full = bench.make_inputs(w, seed=s)
        kw = {k: v for k, v in full.items() if not k.startswith("_")}
        for n in ("q", "k", "v"):
            kw[n].requires_grad_(True)
        out = m.triton_hstu_mha(**triton_args(w, kw))
        sets.append((kw, out, torch.rand_like(out)))  # dout as bench.backward_call draws it
    lens_q, lens_k = full["_lens_q"], full["_lens_k"]
    f, convention = bench.flops(w, lens_q, lens_k)
    torch.cuda.synchronize()
    log(f"{w.name} bwd: inputs + forwards {time.time() - t_w:.1f}s")

    def grad(kw, out, dout):
        return torch.autograd.grad(out, (kw["q"], kw["k"], kw["v"]), dout, retain_graph=True)

    fns = [lambda s=s: grad(*s) for s in sets]
    ms, iqr, idx, cfg, tune_s, pc = tune_and_time(m, "_hstu_attn_bwd", fns, f"{w.name} bwd")
    row = dict(triton_ms=ms, triton_iqr_ms=iqr, triton_tflops=2.5 * f / ms / 1e9, flops=convention + " x2.5",
               triton_config_index=idx, triton_config=cfg, triton_autotune_s=tune_s, triton_precompile_s=pc,
               child_elapsed_s=time.time() - t_w)
    print(MARK + json.dumps(row), flush=True)  # the timing survives a failure of the check below
    if os.environ.get("TRITON_HSTU_BWD_CHECK", "1") != "0":
        from hstu_cute import hstu_attn_varlen_func

        kw, out, dout = sets[0]
        tri = grad(kw, out, dout)
        ours = torch.autograd.grad(hstu_attn_varlen_func(**kw), (kw["q"], kw["k"], kw["v"]), dout)
        rows = agreeing_rows(w, lens_k, out.device)
        row["check_rel_err"] = {n: rel_err(a, b, rows) for n, a, b in zip(("dq", "dk", "dv"), tri, ours)}
        log(f"{w.name} bwd: check {row['check_rel_err']}")
        row["child_elapsed_s"] = time.time() - t_w
        print(MARK + json.dumps(row), flush=True)


def backward_row(wi: int, w, fwd_cfg, ours_bwd: dict | None) -> dict:
    row = dict(ref="triton_hstu", workload=w.name, mode="bwd", sort_by_length=SORT, enable_tma=TMA)
    if ours_bwd is not None:
        row.update(ours_ms=ours_bwd["ms"], ours_iqr_ms=ours_bwd["iqr_ms"], ours_tflops=ours_bwd["tflops"])
    cmd = [sys.executable, os.path.abspath(__file__), "--bwd-child", str(wi), "" if fwd_cfg is None else str(fwd_cfg)]
    timeout = float(os.environ.get("TRITON_HSTU_BWD_TIMEOUT", "300"))
    t = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    sys.stderr.write("".join("    | " + ln + "\n" for ln in err.splitlines() if ln.startswith("[")))
    result = [ln[len(MARK):] for ln in out.splitlines() if ln.startswith(MARK)]
    if result:  # timed (the check may still have failed after it: then "crash" says so too)
        row.update(json.loads(result[-1]))
        if ours_bwd is not None:
            row["ours_over_triton"] = row["ours_tflops"] / row["triton_tflops"]
    if rc != 0 or not result:
        row["crash"] = dict(rc=rc, after_timing=bool(result), stderr_tail=err.strip().splitlines()[-15:])
    row["elapsed_s"] = time.time() - t
    return row


# ---------------------------------------------------------------------------------------------


def main() -> None:
    import triton

    m = load_triton_hstu()
    prov = os.path.join(TRITON_HSTU_DIR, "PROVENANCE.txt")
    source = None
    if os.path.exists(prov):
        source = [ln for ln in open(prov).read().splitlines() if ln.startswith(("Source", "Commit"))]
    emit(dict(ref="triton_hstu", mode="header", device=torch.cuda.get_device_name(), torch=torch.__version__,
              triton=triton.__version__, source=source,
              fwd_configs=len(m._hstu_attn_fwd.configs), bwd_configs=len(m._hstu_attn_bwd.configs),
              sort_by_length=SORT, enable_tma=TMA, alpha=ALPHA))
    ws = jagged_workloads()
    fwd_cfg = {}
    for wi, w in enumerate(ws):
        try:
            row = forward_row(m, w)
        except Exception as e:  # a Python-level failure (compile error, ...); a CUDA fault ends the run
            log(f"{w.name}: forward failed: {e!r}"[:500])
            emit(dict(ref="triton_hstu", workload=w.name, mode="fwd", error=repr(e)[:1000]))
            continue
        fwd_cfg[wi] = row["triton_config_index"]
        emit(row)
    ours_bwd = {}
    if os.environ.get("TRITON_HSTU_OURS_BWD", "1") != "0":
        for wi, w in enumerate(ws):
            t = time.time()
            ours_bwd[wi] = bench.run_workload_bwd(replace(w, sdpa=False))
            log(f"{w.name}: ours bwd {time.time() - t:.1f}s: {ours_bwd[wi]['ms']:.4f} ms")
    if os.environ.get("TRITON_HSTU_BWD", "1") != "0":
        torch.cuda.empty_cache()  # leave the device memory to the subprocesses
        for wi, w in enumerate(ws):  # last: a crash here must not cost the rows above
            log(f"{w.name}: Triton bwd subprocess")
            emit(backward_row(wi, w, fwd_cfg.get(wi), ours_bwd.get(wi)))
    log("done")


def hbsa_main(limit: int | None) -> None:
    """One row per uniform-length blocksparse workload: HBSA's forward and ours, same inputs and blocks."""
    hbsa_dir = os.environ.get("HBSA_DIR", os.path.join(REPO, ".peer", "hbsattn"))
    if hbsa_dir not in sys.path:
        sys.path.insert(0, hbsa_dir)
    from hbsattn.hbsa_interface import HBSAttention

    from hstu_cute.bench_sparse import allowed_pairs, kept_blocks, run_sparse, sparse_grid

    emit(dict(ref="hbsa", mode="header", device=torch.cuda.get_device_name(), torch=torch.__version__,
              source=hbsa_dir))
    for w in [w for w in sparse_grid() if not w.lengths][:limit]:
        kept = kept_blocks(w)  # (B, 1, M, M), the bench's own draw
        batch, m = w.batch, kept.shape[-1]
        jagged = torch.zeros((w.heads, batch * m, batch * m), dtype=torch.bool, device="cuda")
        for b in range(batch):
            jagged[:, b * m:(b + 1) * m, b * m:(b + 1) * m] = kept[b, 0]
        gen = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = ((torch.rand((batch * w.seqlen, w.heads, w.head_dim), generator=gen, device="cuda") * 2 - 1)
                   .to(torch.bfloat16) for _ in range(3))
        cu = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * w.seqlen
        scale = w.head_dim ** -0.5

        def call():
            with torch.no_grad():
                return HBSAttention(q, k, v, cu, cu, jagged, w.block, w.block, w.causal, scale)

        t = time.time()
        try:
            call()
            ms, iqr = bench.time_cuda([call])
        except Exception as e:  # a Python-level failure; a CUDA fault ends the run
            emit(dict(ref="hbsa", workload=w.name, error=repr(e)[:1000]))
            continue
        ours = run_sparse(w, "fwd", flex=False)
        per_ms = 4.0 * w.heads * w.head_dim * allowed_pairs(w, kept) / 1e9
        row = dict(ref="hbsa", workload=w.name, mode="fwd", hbsa_ms=ms, hbsa_iqr_ms=iqr, hbsa_tflops=per_ms / ms,
                   ours_ms=ours["ms"], ours_kernel_ms=ours["kernel_ms"], ours_tflops=ours["tflops"],
                   x_hbsa=ms / ours["ms"])
        log(f"{w.name}: HBSA {ms:.3f} ms, ours {ours['ms']:.3f} ms ({time.time() - t:.1f}s)")
        emit(row)
    log("done")


def nsa_main(limit: int | None) -> None:
    """One row per bench --grid nsa workload and direction: the open NSA's three kernels and ours,
    the same inputs and configuration (no window branch on either side)."""
    nsa_dir = os.environ.get("NSA_DIR", os.path.join(REPO, ".peer", "nsa"))
    if nsa_dir not in sys.path:
        sys.path.insert(0, nsa_dir)
    try:
        import einops  # noqa: F401  (its package imports it; the three kernels timed here never call it)
    except ImportError:
        import types

        def absent(*args, **kwargs):
            raise RuntimeError("einops is not installed on this machine")

        sys.modules["einops"] = types.SimpleNamespace(einsum=absent, rearrange=absent)
    from native_sparse_attention.ops.triton.compressed_attention import compressed_attention
    from native_sparse_attention.ops.triton.topk_sparse_attention import topk_sparse_attention
    from native_sparse_attention.ops.triton.weighted_pool import avgpool_compress

    from hstu_cute.bench_nsa import nsa_grid, run_nsa

    emit(dict(ref="nsa", mode="header", device=torch.cuda.get_device_name(), torch=torch.__version__, source=nsa_dir))
    for w in nsa_grid()[:limit]:
        cfg = replace(w.cfg, window=0)
        ours_w = replace(w, cfg=cfg)
        tokens = w.batch * w.seqlen
        cu = torch.arange(0, w.batch + 1, dtype=torch.int32, device="cuda") * w.seqlen
        for direction in ("fwd", "fwd+bwd"):
            backward = direction == "fwd+bwd"
            gen = torch.Generator(device="cuda").manual_seed(2)
            q, k, v = ((torch.rand((tokens, w.heads, w.head_dim), generator=gen, device="cuda") * 2 - 1)
                       .to(torch.bfloat16).requires_grad_(backward) for _ in range(3))
            grad = torch.randn_like(q) if backward else None

            def step():
                ck, cu_c = avgpool_compress(k, None, cu, cfg.cmp_block, cfg.cmp_stride)
                cv, _ = avgpool_compress(v, None, cu, cfg.cmp_block, cfg.cmp_stride)
                max_c = int((cu_c[1:] - cu_c[:-1]).max())
                o_cmp, top = compressed_attention(q, ck, cv, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.top_n,
                                                  cu, cu_c, w.seqlen, max_c, None, cfg.num_initial, cfg.num_local)
                o = o_cmp + topk_sparse_attention(q, k, v, top, cfg.sel_block, cu)
                if backward:
                    q.grad = k.grad = v.grad = None
                    o.backward(grad)

            def run():
                if backward:
                    step()
                else:
                    with torch.no_grad():
                        step()

            t = time.time()
            try:
                run()
                ms, iqr = bench.time_cuda([run], warmup=2, reps=10)
            except Exception as e:  # a Python-level failure; a CUDA fault ends the run
                emit(dict(ref="nsa", workload=w.name, mode=direction, error=repr(e)[:1000]))
                continue
            q = k = v = grad = None  # noqa: F841  (free the inputs before our line allocates its own)
            ours = run_nsa(ours_w, direction)
            emit(dict(ref="nsa", workload=w.name, mode=direction, nsa_ms=ms, nsa_iqr_ms=iqr, ours_ms=ours["ms"],
                      ours_dense_ms=ours["dense_ms"], x_nsa=ms / ours["ms"], cfg=vars(cfg)))
            log(f"{w.name} {direction}: open NSA {ms:.3f} ms, ours {ours['ms']:.3f} ms ({time.time() - t:.1f}s)")
    log("done")


if __name__ == "__main__":
    if ARGS.hbsa:
        hbsa_main(ARGS.limit)
    elif ARGS.nsa:
        nsa_main(ARGS.limit)
    elif ARGS.bwd_child:
        child = ARGS.bwd_child
        backward_child(int(child[0]), int(child[1]) if len(child) > 1 and child[1] else None)
    else:
        main()
