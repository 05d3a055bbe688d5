"""Benchmarks: the workload grid of docs/operator.md with reference lines timed in the same run.

FLOP counts (the peers' convention, docs/operator.md):
  * ``causal``: ``2 * H * D * sum(n^2)`` for causal-family masks (context/target included), no
    subtraction of masked entries;
  * ``dense``: twice that (no mask);
  * ``allowed``: ``4 * H * D * (number of allowed (i, j) pairs)`` for local windows and delta_q,
    where the convention has no closed form. The table names the count used for every row.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    max_len: int
    heads: int = 4
    head_dim: int = 128
    lengths: str = "full"  # full | uniform90 (uniform [0.9 N, N)) | uniform1 (uniform [1, N]) | zipf
    window: tuple = (-1, 0)
    contexts: int | None = None
    targets: int | None = None
    group: int = 1
    delta_q: int | None = None  # queries per sequence (the last Lq keys)
    rab_heads: int | None = None
    dtype: str = "bfloat16"
    sdpa: bool = field(default=False)  # also time torch SDPA (dense, same shape)
    func: str | None = None  # an FBGEMM func mask instead of the window: a FUNC_PATTERNS name


def default_grid() -> list[Workload]:
    g = []
    for d in (64, 128, 256):
        for b, n in ((32, 1024), (16, 2048), (8, 4096), (4, 8192)):
            g.append(Workload(f"full B{b} N{n} D{d}", b, n, head_dim=d, sdpa=True))
    g += [
        Workload("zipf1.2 B64 N4096", 64, 4096, lengths="zipf"),
        Workload("uniform90 B512 N1024", 512, 1024, lengths="uniform90"),
        Workload("ctx8+tgt64 g1 B8 N4096", 8, 4096, contexts=8, targets=64, group=1),
        Workload("ctx8+tgt64 g8 B8 N4096", 8, 4096, contexts=8, targets=64, group=8),
        Workload("local(256,0) B8 N4096", 8, 4096, window=(256, 0)),
        Workload("delta_q Lq256 B8 N4096", 8, 4096, delta_q=256),
        Workload("rab H_rab=1 B8 N2048", 8, 2048, rab_heads=1),
        Workload("rab H_rab=H B8 N2048", 8, 2048, rab_heads=4),
        Workload("short B1024 N128", 1024, 128),
        Workload("short B1024 N512", 1024, 512),
    ]
    return g


def recsys_grid() -> list[Workload]:
    """Where recommenders live: short full-length batches and jagged user histories with targets
    (D128 bf16 causal, H4). On jagged rows the SDPA line runs the padded dense batch: what a user
    pays by padding, as effective TFLOP/s on the jagged FLOPs."""
    return [
        Workload("full B1024 N256", 1024, 256, sdpa=True),
        Workload("full B128 N512", 128, 512, sdpa=True),
        Workload("full B32 N1024", 32, 1024, sdpa=True),
        Workload("jagged u[1,N] B128 N2048 tgt32", 128, 2048, lengths="uniform1", targets=32, sdpa=True),
        Workload("short jagged u[1,256] B4096 tgt8", 4096, 256, lengths="uniform1", targets=8, sdpa=True),
        Workload("zipf B512 N1024 ctx8 tgt16", 512, 1024, lengths="zipf", contexts=8, targets=16, sdpa=True),
    ]


def func_grid() -> list[Workload]:
    """FBGEMM's arbitrary ``func`` masks beside our own encoding of the same mask: causal spelled
    as one interval per row and as three bounds, and a two-interval pattern (its own FLOPs)."""
    g = []
    for name, b, n, lengths in (("B8 N4096", 8, 4096, "full"), ("jagged u[1,N] B128 N2048", 128, 2048, "uniform1")):
        g += [Workload(f"causal {name}", b, n, lengths=lengths),
              Workload(f"func causal n_func=1 {name}", b, n, lengths=lengths, func="causal1"),
              Workload(f"func causal n_func=3 {name}", b, n, lengths=lengths, func="causal3"),
              Workload(f"func [0,i/2)+[i-256,i] {name}", b, n, lengths=lengths, func="two_interval")]
    return g


#: Per-row bounds of the bench's func masks, from the row's position i in its sequence.
FUNC_PATTERNS = {
    "causal1": lambda i: (i + 1,),
    "causal3": lambda i: (i + 1, i + 1, i + 1),
    "two_interval": lambda i: (i // 2, torch.maximum(i // 2, i - 256), i + 1),
}


def func_tensor(pattern: str, lens_q, device) -> torch.Tensor:
    """(1, n_func, T_q + 256) int32 of a :data:`FUNC_PATTERNS` mask over sequences of ``lens_q``."""
    from .masks import FUNC_ROW_PADDING

    i = torch.cat([torch.arange(n) for n in lens_q] + [torch.zeros(FUNC_ROW_PADDING, dtype=torch.int64)])
    return torch.stack(FUNC_PATTERNS[pattern](i))[None].to(device=device, dtype=torch.int32)


def headline() -> Workload:
    return Workload("full B8 N4096 D128", 8, 4096, head_dim=128, sdpa=True)


def _lengths(w: Workload, gen: torch.Generator) -> list[int]:
    if w.lengths == "full":
        return [w.max_len] * w.batch
    if w.lengths == "uniform90":
        lo = int(0.9 * w.max_len)
        return torch.randint(lo, w.max_len, (w.batch,), generator=gen).tolist()
    if w.lengths == "uniform1":
        return torch.randint(1, w.max_len + 1, (w.batch,), generator=gen).tolist()
    if w.lengths == "zipf":
        # Zipf(1.2) over 1..max_len by inverse-CDF sampling of the truncated distribution.
        ranks = torch.arange(1, w.max_len + 1, dtype=torch.float64)
        pmf = ranks.pow(-1.2)
        idx = torch.multinomial(pmf / pmf.sum(), w.batch, replacement=True, generator=gen)
        return (idx + 1).tolist()
    raise ValueError(w.lengths)


def make_inputs(w: Workload, device="cuda", seed=0) -> dict:
    """Inputs of one workload. The lengths depend only on the workload (so every rotated input
    set has the same FLOP count); ``seed`` draws the values."""
    dtype = getattr(torch, w.dtype)
    lens_k = _lengths(w, torch.Generator().manual_seed(0))
    # Values drawn on the device: a CPU draw of the B4096 rows took ~10 s per input set.
    gen = torch.Generator(device=device).manual_seed(seed)
    lens_q = [min(n, w.delta_q) for n in lens_k] if w.delta_q else lens_k

    def offsets(lens):
        return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)

    tq, tk = sum(lens_q), sum(lens_k)

    def rnd(*shape):
        return (torch.rand(shape, generator=gen, device=device) * 2 - 1).to(dtype)

    kw = dict(
        q=rnd(tq, w.heads, w.head_dim), k=rnd(tk, w.heads, w.head_dim), v=rnd(tk, w.heads, w.head_dim),
        seq_offsets_q=offsets(lens_q), seq_offsets_k=offsets(lens_k),
        max_seqlen_q=min(w.max_len, w.delta_q) if w.delta_q else w.max_len, max_seqlen_k=w.max_len,
        window_size=w.window, is_delta_q=bool(w.delta_q),
    )
    b = w.batch
    if w.contexts is not None:
        kw["num_contexts"] = torch.tensor([min(w.contexts, n) for n in lens_k], dtype=torch.int32, device=device)
    if w.targets is not None:
        c = [min(w.contexts or 0, n) for n in lens_k]
        kw["num_targets"] = torch.tensor([min(w.targets, n - ci) for n, ci in zip(lens_k, c)], dtype=torch.int32,
                                         device=device)
        kw["target_group_size"] = w.group
    if w.rab_heads:
        kw["rab"] = rnd(b, w.rab_heads, w.max_len, w.max_len)
    if w.func:
        kw["func"], kw["window_size"] = func_tensor(w.func, lens_q, device), (-1, -1)
    kw["_lens_q"], kw["_lens_k"] = lens_q, lens_k
    return kw


def flops(w: Workload, lens_q, lens_k) -> tuple[float, str]:
    hd = w.heads * w.head_dim
    kind = w.window
    if w.func and w.func.startswith("causal"):
        kind = (-1, 0)  # the same mask, the same convention
    elif w.func:
        from . import masks

        func = func_tensor(w.func, lens_q, "cpu")
        pairs, row = 0, 0
        for lq, lk in zip(lens_q, lens_k):
            pairs += int(masks.func_dense_mask(func, row, lq, lk).sum())
            row += lq
        return 4.0 * hd * pairs, "allowed"
    if w.delta_q or (kind[0] >= 0 and kind != (-1, 0)) or (kind[1] > 0):
        from . import masks

        spec_kind, wl, wr = masks.normalize_window(kind, w.max_len)
        spec = masks.MaskSpec(spec_kind, is_delta_q=bool(w.delta_q))
        pairs = 0
        for lq, lk in zip(lens_q, lens_k):
            seq = masks.seq_mask_from_lengths(spec, lq, lk, wl, wr)
            pairs += int(masks.dense_mask(spec, seq).sum()) if lq * lk < 2**26 else _band_pairs(spec, seq)
        return 4.0 * hd * pairs, "allowed"
    sq = sum(n * n for n in lens_k)
    if kind == (-1, 0):
        return 2.0 * hd * sq, "causal"
    return 4.0 * hd * sq, "dense"


def _band_pairs(spec, seq) -> int:
    from . import masks

    total = 0
    for i in range(int(seq.seqlen_q)):
        r = i + seq.row_offset
        lo = max(0, r - seq.window_left) if spec.kind == masks.MaskKind.LOCAL else 0
        hi = min(seq.seqlen_k - 1, r + seq.window_right) if spec.kind == masks.MaskKind.LOCAL else r
        total += max(0, hi - lo + 1)
    return total


# Each call's events are queued behind the previous call (no synchronization in between), so the
# host time a call needs to launch its kernels overlaps the device work of the previous one, as in
# a training loop; True restores the per-call synchronization used before 2026-11-21 (session 5),
# which also counted ~40-60 us of host launch time into every backward sample.
SYNC_EACH_CALL = False


def time_cuda(fns, warmup: int = 5, reps: int = 30) -> tuple[float, float]:
    """Median and IQR (ms) of single-call device times, rotating over ``fns`` (one per input set
    so repeated runs do not just re-read L2)."""
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    events = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fns[i % len(fns)]()
        end.record()
        if SYNC_EACH_CALL:
            end.synchronize()
        events.append((start, end))
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    q1, q3 = times[len(times) // 4], times[(3 * len(times)) // 4]
    return statistics.median(times), q3 - q1


def time_interleaved(lines: dict, rounds: int = 3, warmup: int = 3, reps: int = 10, pause_s: float = 1.0) -> dict:
    """``{name: (ms, IQR ms)}`` of each line's :func:`time_cuda`, the lines timed in turn, round
    after round, the device idle for ``pause_s`` before each; a line's time is its fastest round.
    One line's time moves between rounds by more than lines differ (the block-sparse forward read
    3.64, 3.98 and 4.24 ms in three rounds a second apart on the H200, docs/dev/perf-log.md
    session 37): lines timed one after the other, once each, compare the moments as much as the
    kernels. The pause: a line timed right after seconds of the dense call ran 10-12 % slower
    (FlexAttention 6.28-6.61 ms there, 5.65-5.66 after one idle second; ours 3.90-4.36 against
    3.49), whichever line it was (session 38)."""
    best: dict = {}
    for _ in range(rounds):
        for name, fn in lines.items():
            if pause_s:
                torch.cuda.synchronize()
                time.sleep(pause_s)
            ms, iqr = time_cuda([fn], warmup=warmup, reps=reps)
            if name not in best or ms < best[name][0]:
                best[name] = (ms, iqr)
    return best


def gemm_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms, _ = time_cuda([lambda: a @ b], warmup=5, reps=20)
    return 2 * 8192**3 / ms / 1e9


def _flush_l2():
    """A buffer whose zeroing evicts the 50 MB L2 (H100) before a timed sample."""
    global _L2_FLUSH
    if _L2_FLUSH is None:
        _L2_FLUSH = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")
    return _L2_FLUSH


_L2_FLUSH = None


def time_graphed(fns, reps: int = 30) -> tuple[float, float, str]:
    """(median ms, IQR ms, "graph") of CUDA-graph replays of each of ``fns`` (each captured once,
    after a call outside capture): the device time of a sequence of short launches that Python
    issues more slowly than the GPU runs them (the quantizers alone: 59 us of device time timed
    as 77-273 us when queued from Python, docs/dev/perf-log.md session 21). Where capture fails, the
    queued timing of :func:`time_cuda`, marked "queued"."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    try:
        graphs = []
        for fn in fns:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graphs.append(graph)
    except RuntimeError:
        return (*time_cuda(fns, reps=reps), "queued")
    return (*time_cuda([g.replay for g in graphs], reps=reps), "graph")


def time_flushed(fns, warmup: int = 3, reps: int = 20) -> tuple[float, float]:
    """Median and IQR (ms) of samples rotating over ``fns``, L2 flushed before each sample (outside
    the events), launches queued with no host sync inside the loop."""
    flush = _flush_l2()
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    events = []
    for i in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fns[i % len(fns)]()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return statistics.median(times), times[(3 * len(times)) // 4] - times[len(times) // 4]


def graphed_step(fn, inputs: tuple, dout: torch.Tensor):
    """A training step of ``fn(*inputs)`` (gradients of ``inputs``) replayed from CUDA graphs:
    ``torch.cuda.make_graphed_callables`` captures its forward and backward once, so a step costs
    two graph launches of host time. What a model that graphs its layers gets (issue 40: the
    eager step waits on Python, docs/dev/perf-log.md session 32)."""
    graphed = torch.cuda.make_graphed_callables(fn, inputs)
    return lambda: torch.autograd.grad(graphed(*inputs), inputs, dout)


def sdpa_ms(w: Workload, backend: str, mode: str = "fwd") -> float | None:
    """torch SDPA (softmax) on the dense (padded) shape of ``w``, in ms: ``fwd``, ``bwd`` (the
    gradient pass alone, from a saved forward), ``step`` (autograd forward + backward, L2
    flushed before each sample) or ``graph`` (that step replayed from CUDA graphs,
    :func:`graphed_step`). None where the backend cannot run the shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    dtype = getattr(torch, w.dtype)
    causal = w.window == (-1, 0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fns = []
    try:
        with sdpa_kernel([be]):
            for _ in range(3):
                q, k, v = (torch.randn(w.batch, w.heads, w.max_len, w.head_dim, device="cuda", dtype=dtype,
                                       requires_grad=mode != "fwd") for _ in range(3))
                if mode == "bwd":
                    out = sdpa(q, k, v, is_causal=causal)
                    fns.append(lambda out=out, q=q, k=k, v=v, dout=torch.randn_like(out): torch.autograd.grad(
                        out, (q, k, v), dout, retain_graph=True))
                elif mode == "step":
                    fns.append(lambda q=q, k=k, v=v, dout=torch.randn_like(q): torch.autograd.grad(
                        sdpa(q, k, v, is_causal=causal), (q, k, v), dout))
                elif mode == "graph":
                    fns.append(graphed_step(lambda q, k, v: sdpa(q, k, v, is_causal=causal), (q, k, v),
                                            torch.randn_like(q)))
                else:
                    fns.append(lambda q=q, k=k, v=v: sdpa(q, k, v, is_causal=causal))
            ms, _ = time_flushed(fns) if mode in ("step", "graph") else time_cuda(fns)
    except RuntimeError:
        return None
    return ms


_STEP_FLOPS = {"fwd": 1.0, "bwd": 2.5, "step": 3.5, "graph": 3.5}


def sdpa_tflops(w: Workload, backend: str, mode: str = "fwd", flop_count: float | None = None) -> float | None:
    """TFLOP/s of :func:`sdpa_ms`: by default on the dense shape's FLOPs (the reference lines);
    with ``flop_count`` (a jagged workload's forward FLOPs) the effective rate of padding."""
    ms = sdpa_ms(w, backend, mode)
    if ms is None:
        return None
    causal = w.window == (-1, 0)
    f = flop_count if flop_count is not None else (
        2.0 * w.heads * w.head_dim * w.batch * w.max_len**2 * (1 if causal else 2))
    return _STEP_FLOPS[mode] * f / ms / 1e9


def _sdpa_lines(w: Workload, row: dict, f: float, mode: str) -> None:
    """The SDPA reference lines of ``row``: the dense shape, or for jagged workloads the padded
    batch as effective TFLOP/s on the jagged FLOPs."""
    if not w.sdpa:
        return
    jagged = None if w.lengths == "full" else f
    row["sdpa_flash"] = sdpa_tflops(w, "flash", mode=mode, flop_count=jagged) if mode in ("fwd", "bwd") else None
    row["sdpa_cudnn"] = sdpa_tflops(w, "cudnn", mode=mode, flop_count=jagged)
    if jagged is not None:
        row["sdpa_padded"] = True


def run_workload(w: Workload, tiles: dict | None = None, sets: int = 3, path: str | None = None) -> dict:
    """Forward kernel on ``w`` (``path``: 'hopper' or 'ampere'; default: the device's own)."""
    from . import arch, launch
    from .testing import call_record

    inputs = [make_inputs(w, seed=s) for s in range(sets)]
    lens_q, lens_k = inputs[0]["_lens_q"], inputs[0]["_lens_k"]
    calls = []
    for kw in inputs:
        call, rab = call_record(**kw)
        calls.append(lambda kw=kw, c=call, rab=rab: launch.forward(kw["q"], kw["k"], kw["v"], rab, c, tiles,
                                                                   path=path))
    calls[0]()  # compile (or load from the module cache) outside the timing
    ms, iqr = time_cuda(calls)
    f, convention = flops(w, lens_q, lens_k)
    row = dict(workload=w.name, ms=ms, iqr_ms=iqr, tflops=f / ms / 1e9, flops=convention,
               tiles=tiles or "default", path=path or arch.kernel_path(inputs[0]["q"].device))
    _sdpa_lines(w, row, f, "fwd")
    return row


FP8_ENTRIES = ("kernel", "prequantized", "mode0", "kernel1", "quant1", "mode1", "kernel2", "quant2", "mode2", "kernel5",
               "quant5", "mode5")


def run_workload_fp8(w: Workload, entry: str = "kernel", tiles: dict | None = None, sets: int = 3) -> dict:
    """The FP8 forward on ``w`` (FLOPs as for 16-bit). ``entry``: "kernel" (e4m3 q, k and V^T
    made beforehand: the P-cast kernel alone), "prequantized" (e4m3 q, k, v with descales: V^T
    is made per call), "modeN" (16-bit inputs, quant_mode N: quantizers, V^T and kernel per
    call), "kernelN" (mode N's kernel alone, N >= 1) or "quantN" (mode N's quantizers and V^T
    alone, timed as CUDA-graph replays (:func:`time_graphed`): the row adds ``gbps``, 16-bit q,
    k, v read and e4m3 q, k, V^T written once)."""
    from . import launch
    from .quantize import QuantMode, quantize_batch
    from .testing import call_record

    inputs = [make_inputs(w, seed=s) for s in range(sets)]
    lens_q, lens_k = inputs[0]["_lens_q"], inputs[0]["_lens_k"]
    mode = int(entry[-1]) if entry[-1].isdigit() else -1
    calls = []
    for kw in inputs:
        kw = {k: v for k, v in kw.items() if not k.startswith("_")}
        if mode >= 0:
            args, fp8_kw = (kw["q"], kw["k"], kw["v"]), dict(quant_mode=mode)
        else:
            quantized = quantize_batch(kw, QuantMode.PER_TENSOR)
            args = tuple(x.data for x in quantized)
            fp8_kw = dict(zip(("descale_q", "descale_k", "descale_v"), (x.scale for x in quantized)))
            if kw.get("rab") is not None:
                fp8_kw["rab"] = kw["rab"].to(torch.bfloat16)
        call, rab = call_record(**dict(kw, q=args[0], k=args[1], v=args[2], **fp8_kw))
        if entry.startswith("kernel"):
            q8, k8, fp8 = launch.prepare_fp8(*args, call)
            calls.append(lambda q8=q8, k8=k8, c=call, rab=rab, fp8=fp8: launch.forward(q8, k8, None, rab, c, tiles,
                                                                                      fp8=fp8))
        elif entry.startswith("quant"):
            calls.append(lambda a=args, c=call: launch.prepare_fp8(*a, c))
        else:
            calls.append(lambda a=args, c=call, rab=rab: launch.forward_fp8(*a, rab, c, tiles=tiles))
    calls[0]()
    ms, iqr, timing = time_graphed(calls) if entry.startswith("quant") else (*time_cuda(calls), "queued")
    f, convention = flops(w, lens_q, lens_k)
    row = dict(workload=w.name, entry=f"fp8 {entry}", ms=ms, iqr_ms=iqr, tflops=f / ms / 1e9, flops=convention,
               tiles=tiles or "default", path="hopper", timing=timing)
    if entry.startswith("quant"):
        q, k, v = (inputs[0][n] for n in "qkv")
        moved = sum(x.numel() * (x.element_size() + 1) for x in (q, k, v))
        row.update(tflops=0.0, gbps=moved / ms / 1e6)
    return row


def backward_call(w: Workload, seed: int = 0, tiles_dq: dict | None = None, tiles_dkdv: dict | None = None,
                  path: str | None = None, deterministic: bool = False):
    """(call, lens_q, lens_k): ``call()`` runs the backward kernels alone (dq, dk, dv[, drab]) on
    one random input set of ``w``."""
    from . import launch
    from .testing import call_record

    full = make_inputs(w, seed=seed)
    kw = {k: v for k, v in full.items() if not k.startswith("_")}
    record, rab = call_record(**kw, has_drab=kw.get("rab") is not None, deterministic=deterministic)
    dout = torch.rand_like(kw["q"])

    def call():
        return launch.backward(dout, kw["q"], kw["k"], kw["v"], rab, record, tiles_dq, tiles_dkdv, path)

    return call, full["_lens_q"], full["_lens_k"]


def run_workload_bwd(w: Workload, sets: int = 3, tiles_dq: dict | None = None, tiles_dkdv: dict | None = None,
                     path: str | None = None, deterministic: bool = False) -> dict:
    """Backward kernels alone (dq, dk, dv[, drab]) on the workload; FLOPs = 2.5 x forward. With
    ``w.sdpa`` the torch SDPA (flash, cuDNN) backward lines of the same shape are added."""
    from . import arch

    calls = []
    for s in range(sets):
        call, lens_q, lens_k = backward_call(w, s, tiles_dq, tiles_dkdv, path, deterministic)
        calls.append(call)
    calls[0]()
    ms, iqr = time_cuda(calls)
    f, convention = flops(w, lens_q, lens_k)
    tiles = "bwd default" if not (tiles_dq or tiles_dkdv) else f"dq {tiles_dq} dkdv {tiles_dkdv}"
    if deterministic:
        tiles += " deterministic"
    row = dict(workload=w.name + " bwd", ms=ms, iqr_ms=iqr, tflops=2.5 * f / ms / 1e9, flops=convention + " x2.5",
               tiles=tiles, path=path or arch.kernel_path(torch.device("cuda")))
    _sdpa_lines(w, row, f, "bwd")
    return row


#: The FP8 backward's rows of ``bench --fp8`` (quant mode, entry of :func:`run_workload_bwd_fp8`):
#: the two kernels alone and end to end (quantizers and copies included), mode 2 and mode 1.
FP8_BWD_ENTRIES = ((2, "kernel"), (2, "end2end"), (1, "kernel"), (1, "end2end"))
#: The quant modes of the FP8 training-step rows of ``bench --fp8``.
FP8_STEP_MODES = (2,)


def run_workload_bwd_fp8(w: Workload, mode: int, entry: str = "kernel", sets: int = 3, tiles: dict | None = None,
                         kernels=("dkdv", "dq"), fused: bool | None = None) -> dict:
    """The FP8 backward (quant ``mode`` 0-5) on ``w``; FLOPs = 2.5 x forward, as for 16-bit.
    ``entry``: "kernel" (quantized operands and copies made beforehand: the kernels alone),
    "quant" (the quantizers and copies alone, q, k and v quantized as a training forward does,
    timed as CUDA-graph replays: the row adds ``gbps``, 16-bit q, k, v, dO read and each one's
    e4m3 data and token-contiguous copy written once) or "end2end" (both, per call). ``fused``: force
    the fused kernel (True) or the pair (False); None: the default choice."""
    from . import launch
    from .testing import call_record

    from .fp8_recipe import recipe

    calls = []
    for s in range(sets):
        full = make_inputs(w, seed=s)
        kw = {k: v for k, v in full.items() if not k.startswith("_")}
        call, rab = call_record(**kw, quant_mode=mode)
        dout = (torch.rand_like(kw["q"]) - 0.5) * 0.02
        operands = launch.fp8_backward_operands(dout, kw["q"], kw["k"], kw["v"], call)
        args = (dout, kw["q"], kw["k"], kw["v"], rab, call)
        if entry == "kernel":
            calls.append(lambda a=args, o=operands: launch.backward_fp8(*a, operands=o, tiles=tiles, kernels=kernels,
                                                                       fused=fused))
        elif entry == "quant":
            calls.append(lambda a=args: launch.fp8_backward_operands(*a[:4], a[5]))
        else:
            calls.append(lambda a=args: launch.backward_fp8(*a, fused=fused))
    calls[0]()
    ms, iqr, timing = time_graphed(calls) if entry == "quant" else (*time_cuda(calls), "queued")
    f, convention = flops(w, full["_lens_q"], full["_lens_k"])
    if fused is None:
        fused = launch.fp8_backward_fused(w.head_dim, recipe(mode), kw["max_seqlen_k"], kw.get("rab") is not None, False,
                                          False)
    path = "fused" if fused else "pair"
    row = dict(workload=w.name + " bwd", entry=f"fp8 bwd mode{mode} {entry} ({path})", ms=ms, iqr_ms=iqr,
               tflops=2.5 * f / ms / 1e9, flops=convention + " x2.5", tiles=f"{tiles or 'default'} {'+'.join(kernels)}",
               path="hopper", timing=timing)
    if entry == "quant":
        moved = sum(x.numel() * (x.element_size() + 1) for x in (kw["q"], kw["k"], kw["v"], dout))
        # the token-contiguous Q^T, K^T, dO^T, and the V^T a training forward's pass also writes
        moved += sum(x.numel() for x in (kw["q"], kw["k"], kw["v"], dout))
        if recipe(mode).two_direction:  # its token-contiguous copies take a second read of each input
            moved += sum(x.numel() * x.element_size() for x in (kw["q"], kw["k"], kw["v"], dout))
        row.update(tflops=0.0, gbps=moved / ms / 1e6)
    return row


def run_training_step(w: Workload, sets: int = 3, quant_mode: int = -1, has_drab: bool = False,
                      graphed: bool = False) -> dict:
    """A training step as a model runs it: autograd forward + backward of the public call per
    sample (gradients of q, k, v, and rab with ``has_drab``: ``w`` needs rab), L2 flushed before
    each sample, launches queued with no host sync inside; FLOPs 3.5 x the forward's.
    ``quant_mode`` >= 0: the FP8 path (quantizers included). ``graphed``: the step replayed from
    CUDA graphs (:func:`graphed_step`), beside cuDNN's step graphed the same way."""
    from .api import hstu_attn_varlen_func

    calls = []
    for s in range(sets):
        full = make_inputs(w, seed=s)
        kw = {k: v for k, v in full.items() if not k.startswith("_")}
        if quant_mode >= 0:
            kw["quant_mode"] = quant_mode
        names = ("q", "k", "v", "rab") if has_drab else ("q", "k", "v")
        kw["has_drab"] = has_drab
        for name in names:
            kw[name].requires_grad_(True)
        dout = torch.rand_like(kw["q"])
        if graphed:
            calls.append(graphed_step(lambda *xs, kw=kw, names=names: hstu_attn_varlen_func(
                **{**kw, **dict(zip(names, xs))}), tuple(kw[n] for n in names), dout))
        else:
            calls.append(lambda kw=kw, dout=dout, names=names: torch.autograd.grad(
                hstu_attn_varlen_func(**kw), tuple(kw[n] for n in names), dout))
    ms, iqr = time_flushed(calls)
    f, convention = flops(w, full["_lens_q"], full["_lens_k"])
    row = dict(workload=w.name + (" step, CUDA graph" if graphed else " step"), ms=ms, iqr_ms=iqr,
               tflops=3.5 * f / ms / 1e9, flops=convention + " x3.5",
               tiles="training step" + (f" fp8 mode{quant_mode}" if quant_mode >= 0 else "") + (
                   " +drab" if has_drab else "") + (" graphed" if graphed else ""))
    _sdpa_lines(w, row, f, "graph" if graphed else "step")
    return row


def host_us_per_call(fn, calls: int, warmup: int = 20) -> float:
    """CPU microseconds per ``fn()`` over ``calls`` calls queued with no sync inside the loop (the
    GPU work of a tiny problem is negligible, so this is the host path)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def host_overhead_us(n: int = 2000) -> dict:
    """Host time per call on a tiny problem (no sync inside the loop): the public API, its
    validation alone, and the bare compiled launch with prepared arguments."""
    from . import api, arch, launch, validation
    from .cache import default_cache
    from .compile import build
    from .kernel_args import ordered

    w = Workload("tiny", 1, 128, heads=1, head_dim=64)
    kw = {k: v for k, v in make_inputs(w).items() if not k.startswith("_")}
    p = validation.validate(kw["q"], kw["k"], kw["v"], kw["seq_offsets_q"], kw["seq_offsets_k"], kw["max_seqlen_q"],
                            kw["max_seqlen_k"], None, None, 1, kw["window_size"], 1.0, None, False, False,
                            None, None, None, None, -1, -1, None, None)
    key = launch.fwd_key(p, arch.device_arch(kw["q"].device), None)
    compiled = default_cache().get(key, lambda: build(key))
    out = torch.empty_like(kw["q"])
    used = torch.full((1,), 2**31 - 1, dtype=torch.int32, device="cuda")
    launch_args = ordered(key, dict(
        mQ=kw["q"], mK=kw["k"], mV=kw["v"], mO=out, mOffsetsQ=kw["seq_offsets_q"], mOffsetsK=kw["seq_offsets_k"],
        mSeqUsedQ=used, mSeqUsedK=used, mNumContexts=None, mNumTargets=None, mRab=None, alpha=1.0,
        inv_scale=1.0 / 128, window_left=p.window_left, window_right=p.window_right, group_size=1, is_delta_q=0,
        num_m_blocks=1))

    def per_call(fn):
        return host_us_per_call(fn, n)

    train = {**kw, **{n: kw[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v")}}
    dout = torch.ones_like(kw["q"])
    return {
        "api_us": per_call(lambda: api.hstu_attn_varlen_func(**kw)),
        "fwd_bwd_step_us": per_call(lambda: torch.autograd.grad(api.hstu_attn_varlen_func(**train),
                                                                (train["q"], train["k"], train["v"]), dout)),
        "validate_us": per_call(lambda: validation.validate(
            kw["q"], kw["k"], kw["v"], kw["seq_offsets_q"], kw["seq_offsets_k"], kw["max_seqlen_q"],
            kw["max_seqlen_k"], None, None, 1, kw["window_size"], 1.0, None, False, False,
            None, None, None, None, -1, -1, None, None)),
        "launch_us": per_call(lambda: compiled(*launch_args)),
        "empty_like_us": per_call(lambda: torch.empty_like(kw["q"])),
    }


# ---------------------------------------------------------------------------------------------
# Host time per call (bench --host)
# ---------------------------------------------------------------------------------------------
class NullAttention(torch.autograd.Function):
    """PyTorch's own floor of an attention step: an autograd node that only allocates its output
    and its three gradients."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        return torch.empty_like(dout), torch.empty_like(dout), torch.empty_like(dout)


def tiny_batch(requires_grad: bool, batch: int = 2, seqlen: int = 128, heads: int = 2, head_dim: int = 64,
               device="cuda") -> tuple[list, dict]:
    """([q, k, v], the public call's other keyword arguments) of the host measurements' tiny causal
    bf16 problem (``bench --host``, tools/host.py): full sequences, GPU work negligible."""
    tokens = batch * seqlen
    qkv = [torch.randn(tokens, heads, head_dim, device=device, dtype=torch.bfloat16, requires_grad=requires_grad)
           for _ in range(3)]
    offsets = torch.arange(0, tokens + 1, seqlen, device=device, dtype=torch.int32)
    return qkv, dict(seq_offsets_q=offsets, seq_offsets_k=offsets, max_seqlen_q=seqlen, max_seqlen_k=seqlen,
                     window_size=(-1, 0), alpha=1.0 / head_dim**0.5)


def _host_lines(batch: int, seqlen: int, heads: int, head_dim: int) -> dict:
    """name -> (forward(), step()) on a tiny causal bf16 problem: the null node, SDPA cuDNN on the
    padded (B, H, N, D) batch, ours bf16 and FP8 quant_mode 2 (Hopper only), FlashAttention-4
    when it imports."""
    from .api import hstu_attn_varlen_func
    from .arch import kernel_path

    dev = torch.device("cuda")

    def jagged(requires_grad):
        return tiny_batch(requires_grad, batch, seqlen, heads, head_dim)[0]

    _, kw = tiny_batch(False, batch, seqlen, heads, head_dim)
    lines = {}

    def add(name, fn, inputs, grad_inputs):
        dout = torch.randn_like(fn(*inputs))
        lines[name] = (lambda: fn(*inputs),
                       lambda: torch.autograd.grad(fn(*grad_inputs), grad_inputs, dout))

    add("null autograd.Function", NullAttention.apply, jagged(False), jagged(True))

    from torch.nn.attention import SDPBackend, sdpa_kernel

    def dense(requires_grad):
        return [torch.randn(batch, heads, seqlen, head_dim, device=dev, dtype=torch.bfloat16,
                            requires_grad=requires_grad) for _ in range(3)]

    def cudnn(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    try:
        add("SDPA cuDNN", cudnn, dense(False), dense(True))
    except RuntimeError:
        pass
    try:  # a comparison line only, never a dependency
        from flash_attn.cute.interface import flash_attn_func

        def fa4(q, k, v):
            out = flash_attn_func(q, k, v, causal=True)
            return out[0] if isinstance(out, tuple) else out

        def padded(requires_grad):
            return [torch.randn(batch, seqlen, heads, head_dim, device=dev, dtype=torch.bfloat16,
                                requires_grad=requires_grad) for _ in range(3)]

        add("FlashAttention-4", fa4, padded(False), padded(True))
    except Exception:  # noqa: BLE001 - not installed, or no kernel for this GPU
        lines.pop("FlashAttention-4", None)
    add("hstu_cute bf16", lambda q, k, v: hstu_attn_varlen_func(q, k, v, **kw), jagged(False), jagged(True))
    if kernel_path(dev) == "hopper":
        add("hstu_cute quant_mode=2", lambda q, k, v: hstu_attn_varlen_func(q, k, v, **kw, quant_mode=2),
            jagged(False), jagged(True))
    return lines


def host_table(batch: int = 2, seqlen: int = 128, heads: int = 2, head_dim: int = 64, calls: int = 1000,
               repeats: int = 5) -> list[dict]:
    """Host (CPU) microseconds per call, tiny causal bf16 problem (GPU work negligible), ``calls``
    calls queued with no sync inside the loop, ``repeats`` times interleaved over the lines: the
    forward under ``torch.no_grad`` and the autograd step (forward + ``torch.autograd.grad``).
    One row per line with the repeats' min and max."""
    lines = _host_lines(batch, seqlen, heads, head_dim)
    samples: dict = {name: ([], []) for name in lines}
    for _ in range(repeats):
        for name, (forward, step) in lines.items():
            with torch.no_grad():
                samples[name][0].append(host_us_per_call(forward, calls))
            samples[name][1].append(host_us_per_call(step, calls))
    return [dict(line=name, fwd_us=(min(f), max(f)), step_us=(min(s), max(s)),
                 shape=f"B{batch} N{seqlen} H{heads} D{head_dim} bf16 causal")
            for name, (f, s) in samples.items()]
