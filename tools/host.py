"""Host-time probes of the public call (the host table of ``python -m hstu_cute bench --host``
explained): one subcommand each.

    python tools/host.py attribution [--calls 2000]   # GPU: where the tiny step's host time goes
    python tools/host.py primitives [--calls 2000]    # GPU: each host-side primitive alone
    python tools/host.py standin [--profile [--mode M]]  # CPU: the eager path with launches stubbed
    python tools/host.py dispatch [--n 20000]         # CPU (+GPU): the torch dispatcher's cost
    python tools/host.py profile [--modes -1,2,5] [--step] [--calls 1000] [--top 15] [--head-dim 128]

``attribution``: the step of ``bench --host`` (B2 N128 H2 D64 bf16 causal) run ``--calls`` times
with the launch layer's pieces wrapped in timers (perf_counter_ns; a wrapper costs ~0.2 us), printed
as us per step, beside the step's own wall time and the time from ``torch.autograd.grad`` to the
entry of our backward node. Needs a GPU.

``primitives``: what each host-side primitive of a call costs alone, on the main thread and on a
second thread (autograd runs CUDA backward nodes on its own device thread): the pieces of the same
tiny step in tight loops, beside PyTorch's own (torch.empty, an autograd.Function). Min over repeats
of us per call. Needs a GPU.

``standin``: host time of the eager path on a machine without a GPU: CPU tensors, with the kernel
launches, streams and device queries stubbed, so only our Python and PyTorch's autograd are timed
(the CPU stand-in rows of docs/dev/perf-log.md, session 9). The H100 host reads 2-5x these numbers;
compare rows of one run only. ``--profile``: a cProfile of the forward + backward step instead.

``dispatch``: host cost of going through the torch dispatcher (torch.ops.hstu_cute.fwd / bwd)
instead of calling the ops' Python bodies directly, as the eager fast path of hstu_attn_varlen_func
does. The kernel launch (api.forward / api.backward) is replaced by a no-op that returns
preallocated tensors, so what is timed is the dispatch alone, on CPU tensors. With a GPU it also
times the public function end to end (real kernel, tiny problem) with the fast path on and off.

``profile``: host (CPU) time of the public call per quant_mode (-1: bf16; FP8 modes need an sm90
GPU) on a tiny problem (the GPU work is a few microseconds, so calls queue at the host's pace), then
a cProfile of each mode's calls, top functions by own time; with ``--step`` an autograd forward +
backward step instead.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time


# --- attribution

TOTALS: collections.Counter = collections.Counter()
COUNTS: collections.Counter = collections.Counter()


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter_ns() - t0
            COUNTS[name] += 1

    return wrapper


def attribution(calls: int) -> None:
    """Where the tiny step's host time goes, by attribution (timers around the launch layer's pieces)."""
    import torch

    from hstu_cute import api, launch
    from hstu_cute.bench import NullAttention, tiny_batch

    (q, k, v), kw = tiny_batch(True)
    dout = torch.randn_like(q)
    marks = {}

    def step():
        out = api.hstu_attn_varlen_func(q, k, v, **kw)
        marks["grad"] = time.perf_counter_ns()
        torch.autograd.grad(out, (q, k, v), dout)
        TOTALS["autograd.grad (whole)"] += time.perf_counter_ns() - marks["grad"]

    def null_step():
        torch.autograd.grad(NullAttention.apply(q, k, v), (q, k, v), dout)

    real_backward = api._HstuAttnEager.backward

    def backward_node(ctx, dout):
        TOTALS["grad() -> our backward node"] += time.perf_counter_ns() - marks["grad"]
        t0 = time.perf_counter_ns()
        result = real_backward(ctx, dout)
        marks["node_end"] = time.perf_counter_ns()
        TOTALS["our backward node"] += marks["node_end"] - t0
        return result

    for _ in range(50):
        step()
        null_step()
    torch.cuda.synchronize()
    modules = (launch.buffers, launch.prepared, launch.fwd, launch.bwd, api)
    for name in ("forward", "backward", "_gradient_buffers", "aligned_16", "_aligned_rab_and_drab", "_plan",
                 "_launch_prepared", "tile_counter", "_on_device", "kernel_path", "_call_tensors"):
        wrapped = None
        for module in modules:  # each module holds its own reference to what it imports
            if hasattr(module, name):
                wrapped = wrapped or timed(name, getattr(module, name))
                setattr(module, name, wrapped)
    api.validate_memoized = timed("validate_memoized", api.validate_memoized)
    api._HstuAttnEager.backward = staticmethod(backward_node)
    public = timed("hstu_attn_varlen_func", api.hstu_attn_varlen_func)
    TOTALS.clear()
    COUNTS.clear()

    def measured_step():
        t0 = time.perf_counter_ns()
        out = public(q, k, v, **kw)
        marks["grad"] = time.perf_counter_ns()
        torch.autograd.grad(out, (q, k, v), dout)
        t1 = time.perf_counter_ns()
        TOTALS["autograd.grad (whole)"] += t1 - marks["grad"]
        TOTALS["our backward node end -> grad() returns"] += t1 - marks["node_end"]
        TOTALS["step (whole)"] += t1 - t0

    for _ in range(calls):
        measured_step()
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        null_step()
    TOTALS["null autograd.Function step"] = time.perf_counter_ns() - t0
    for name, total in sorted(TOTALS.items(), key=lambda kv: -kv[1]):
        count = COUNTS.get(name)
        per = f"  ({count // calls} calls per step)" if count else ""
        print(f"{name:44s} {total / calls / 1e3:8.1f} us per step{per}")


# --- primitives

def per_call(fn, calls: int, repeats: int = 5) -> float:
    import torch

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def primitives(calls: int) -> None:
    """What each host-side primitive of a call costs alone, on the main thread and on a second one."""
    import threading

    import torch

    from hstu_cute import api, launch, validation
    from hstu_cute.arch import kernel_path
    from hstu_cute.bench import NullAttention, tiny_batch

    (q, k, v), kw = tiny_batch(False)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    dev = q.device
    offsets, N = kw["seq_offsets_q"], kw["max_seqlen_q"]
    vargs = (q, k, v, offsets, offsets, N, N, None, None, 1, (-1, 0), 0.125, None, False, False, None, None, None,
             None, -1, -1, None, None, None, None, None, None)
    p, plans = validation.validate_memoized(*vargs)
    call = api.Call(p, offsets, offsets, N, N, alpha=kw["alpha"], plans=plans)
    out = launch.forward(q, k, v, None, call)
    dout = torch.randn_like(q)
    launch.backward(dout, q, k, v, None, call)
    (prepared, _), = [plan for key, plan in plans.items() if key[0] == "fwd"]
    values = dict(mQ=q, mK=k, mV=v, mO=out, mRab=None, **launch.prepared._call_tensors(call))
    torch.cuda.synchronize()
    rows = {
        "torch.empty (T, H, D)": lambda: torch.empty(q.shape, dtype=q.dtype, device=dev),
        "torch.empty (3, T, H, D) + unbind": lambda: torch.empty((3,) + tuple(q.shape), dtype=q.dtype,
                                                                  device=dev).unbind(0),
        "3 x torch.empty (T, H, D)": lambda: [torch.empty(q.shape, dtype=q.dtype, device=dev) for _ in range(3)],
        "prepared forward launch (TVM-FFI call)": lambda: prepared(dict(values), dev),
        "launch.forward (validated call)": lambda: launch.forward(q, k, v, None, call),
        "launch.backward (validated call)": lambda: launch.backward(dout, q, k, v, None, call),
        "validate_memoized (hit)": lambda: validation.validate_memoized(*vargs),
        "Call(...) record": lambda: api.Call(p, offsets, offsets, N, N, None, None, None, None, 1, 0.125, False, False,
                                             (None, None, None), None, plans),
        "tile_counter": lambda: launch.tile_counter(dev),
        "kernel_path": lambda: kernel_path(dev),
        "aligned_16": lambda: launch.aligned_16(q),
        "q.device": lambda: q.device,
        "public forward (no grad)": lambda: api.hstu_attn_varlen_func(q, k, v, **kw),
        "null autograd.Function forward (grad)": lambda: NullAttention.apply(qg, kg, vg),
        "null autograd.Function step": lambda: torch.autograd.grad(NullAttention.apply(qg, kg, vg), (qg, kg, vg),
                                                                   dout),
        "public step": lambda: torch.autograd.grad(api.hstu_attn_varlen_func(qg, kg, vg, **kw), (qg, kg, vg), dout),
    }
    main_thread = {name: per_call(fn, calls) for name, fn in rows.items()}
    other = {}
    worker = threading.Thread(target=lambda: other.update(
        {name: per_call(fn, calls) for name, fn in rows.items() if "step" not in name}))
    worker.start()
    worker.join()
    print(f"{'primitive':44s} {'main thread':>12s} {'other thread':>13s}  (us per call, min of 5)")
    for name in rows:
        print(f"{name:44s} {main_thread[name]:12.2f} {other.get(name, float('nan')):13.2f}")


# --- standin

def us_per_call(fn, calls: int = 3000) -> float:
    for _ in range(200):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def standin(cprofile: bool, profile_mode: int = -1, count_row: str | None = None, steps: int = 0) -> None:
    """Host time of the eager path without a GPU (CPU tensors, launches and device queries stubbed);
    ``cprofile``: a cProfile of the training step instead (``profile_mode``: its quant_mode, -1 bf16);
    ``count_row``: only that row, 20 times then ``steps`` times, silently (run it under callgrind
    with 0 and N steps: the difference over N is the row's instructions, whatever the host's noise)."""
    import contextlib
    import functools

    import torch

    import hstu_cute.api as api
    import hstu_cute.launch as launch
    import hstu_cute.validation as validation
    from hstu_cute.bench import NullAttention as AllocOnly  # the floor: an autograd node that only allocates
    from hstu_cute.testing import call_record

    api._eager = lambda t: type(t) is torch.Tensor and not torch.compiler.is_compiling()
    _counter = torch.zeros(2, dtype=torch.int32)
    STUBS = dict(kernel_path=lambda device: "hopper", device_arch=lambda device: "sm_90a", num_sms=lambda device: 132,
                 _compiled=lambda key: (lambda *args: None),
                 _on_device=lambda device: contextlib.nullcontext(), tile_counter=lambda device: _counter)
    LAUNCH_MODULES = (launch.buffers, launch.prepared, launch.fwd, launch.bwd, launch.fp8)

    def stub(name, value):
        """``name`` replaced in every launch module that holds it (each imports its own reference)."""
        for module in LAUNCH_MODULES:
            if hasattr(module, name):
                setattr(module, name, value)

    for _name, _value in STUBS.items():
        stub(_name, _value)
    torch.cuda.is_current_stream_capturing = lambda: False
    torch._C._cuda_isCurrentStreamCapturing = lambda: False
    torch._C._cuda_getDevice = lambda: 0
    # Validation insists on CUDA tensors: it runs once per signature, on meta stand-ins.
    _validate = validation.validate
    validation.validate = functools.wraps(_validate)(
        lambda *a: _validate(*[x.to("meta") if isinstance(x, torch.Tensor) else x for x in a]))

    B, N, H, D = 2, 114, 2, 64
    q, k, v = (torch.randn(B * N, H, D, dtype=torch.bfloat16) for _ in range(3))
    offsets = torch.tensor([0, N, B * N], dtype=torch.int32)
    kw = dict(seq_offsets_q=offsets, seq_offsets_k=offsets, max_seqlen_q=N, max_seqlen_k=N, window_size=(-1, 0))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    dout = torch.ones_like(q)
    args = (q, k, v, offsets, offsets, N, N, None, None, 1, (-1, 0), 1.0, None, False, False, None, None, None, None,
            -1, -1, None, None)
    call, _ = call_record(q=q, k=k, v=v, **kw)

    def step():
        torch.autograd.grad(api.hstu_attn_varlen_func(qg, kg, vg, **kw), (qg, kg, vg), dout)

    def fp8_step(mode: int):
        """An FP8 training step (quant_mode ``mode``)."""

        def run():
            torch.autograd.grad(api.hstu_attn_varlen_func(qg, kg, vg, **kw, quant_mode=mode), (qg, kg, vg), dout)

        return run

    ROWS = {
        "validate (memo hit)": lambda: validation.validate_memoized(*args),
        "launch.forward": lambda: launch.forward(q, k, v, None, call),
        "launch.backward": lambda: launch.backward(dout, q, k, v, None, call),
        "public forward": lambda: api.hstu_attn_varlen_func(q, k, v, **kw),
        "public forward, FP8 quant_mode 0": lambda: api.hstu_attn_varlen_func(q, k, v, **kw, quant_mode=0),
        "public forward, FP8 pre-quantized e4m3": lambda: api.hstu_attn_varlen_func(q8, k8, v8, **kw),
        "forward + backward step": step,
        **{f"FP8 step, quant_mode {m}": fp8_step(m) for m in (2, 5, 1, 0)},
        "floor: allocating autograd.Function step": lambda: torch.autograd.grad(AllocOnly.apply(qg, kg, vg),
                                                                                (qg, kg, vg), dout),
    }

    if count_row is not None and not cprofile:  # for an instruction count (valgrind --tool=callgrind): no timing, no output
        fn = ROWS[count_row]
        for _ in range(20):
            fn()
        for _ in range(steps):
            fn()
        return
    if cprofile:
        import cProfile
        import pstats

        profiled = ROWS[count_row] if count_row else step if profile_mode == -1 else fp8_step(profile_mode)
        for _ in range(200):
            profiled()
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [profiled() for _ in range(2000)])
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    else:
        launches = []
        stub("_launch", lambda key, compiled, values: launches.append(values))
        stub("_launch_prepared", lambda prepared, values: launches.append(values))
        for name, fn in ROWS.items():
            launches.clear()
            fn()
            count = len(launches)
            print(f"{name:<56} {us_per_call(fn):7.1f} us  {count:2d} launches", flush=True)


# --- dispatch

def per_call_us(fn, n: int, repeats: int = 5, sync=None) -> float:
    """Median over ``repeats`` of the mean time per call of ``n`` back-to-back calls."""
    fn()
    results = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        if sync:
            sync()
        results.append((t1 - t0) / n * 1e6)
    return statistics.median(results)


def dispatch_only(n: int) -> dict:
    import torch

    from hstu_cute import api

    T, H, D, B, L = 256, 2, 64, 2, 128
    q, k, v = (torch.zeros(T, H, D, dtype=torch.bfloat16) for _ in range(3))
    off = torch.tensor([0, L, T], dtype=torch.int32)
    targets = torch.tensor([4, 4], dtype=torch.int32)
    rab = torch.zeros(B, 1, L, L, dtype=torch.bfloat16)
    out, dq, dk, dv, drab = (torch.empty_like(t) for t in (q, q, k, v, rab))

    api.forward = lambda *a, **kw: out  # no kernel: only the call path is timed
    api.backward = lambda *a, **kw: (dq, dk, dv, drab)
    fwd_args = (q, k, v, off, off, L, L, None, targets, 1, L, 0, 0.5, rab, False, -1, None, None)
    bwd_args = (q,) + fwd_args + (True, False)
    fwd_default, bwd_default = torch.ops.hstu_cute.fwd.default, torch.ops.hstu_cute.bwd.default
    return {
        "fwd: direct Python body (_fwd_impl)": per_call_us(lambda: api._fwd_impl(*fwd_args), n),
        "fwd: torch.ops.hstu_cute.fwd": per_call_us(lambda: torch.ops.hstu_cute.fwd(*fwd_args), n),
        "fwd: torch.ops.hstu_cute.fwd.default": per_call_us(lambda: fwd_default(*fwd_args), n),
        "bwd: direct Python body (_bwd_impl)": per_call_us(lambda: api._bwd_impl(*bwd_args), n),
        "bwd: torch.ops.hstu_cute.bwd": per_call_us(lambda: torch.ops.hstu_cute.bwd(*bwd_args), n),
        "bwd: torch.ops.hstu_cute.bwd.default": per_call_us(lambda: bwd_default(*bwd_args), n),
        "fast-path gate (_eager)": per_call_us(lambda: api._eager(q), n),
    }


def public_api_on_gpu(n: int) -> dict:
    import torch

    from hstu_cute import api
    from hstu_cute.testing import random_jagged_batch

    b = random_jagged_batch(1, 1, 64, 128, lengths="full", device="cuda", window_size=(-1, 0), seed=0)
    call = lambda: api.hstu_attn_varlen_func(**b)  # noqa: E731
    fast = per_call_us(call, n, sync=torch.cuda.synchronize)
    eager = api._eager
    api._eager = lambda t: False  # every call through torch.ops.hstu_cute.fwd
    try:
        slow = per_call_us(call, n, sync=torch.cuda.synchronize)
    finally:
        api._eager = eager
    return {"public API, eager fast path": fast, "public API, through the dispatcher": slow}


def dispatch(n: int) -> None:
    """Host cost of the torch dispatcher against the ops' Python bodies (CPU; the public call too with a GPU)."""
    import torch

    rows = {}
    if torch.cuda.is_available():
        rows.update(public_api_on_gpu(n))  # before dispatch_only() stubs the launches out
    rows.update(dispatch_only(n))
    width = max(map(len, rows))
    for name, us in rows.items():
        print(f"{name:<{width}}  {us:7.2f} us/call")


# --- profile

def profile(modes: str, calls: int, top: int, step: bool, head_dim: int) -> None:
    """Host time per public call per quant_mode (-1: bf16) on a tiny problem, then a cProfile of each."""
    import cProfile
    import io
    import pstats

    import torch

    from hstu_cute import hstu_attn_varlen_func
    from hstu_cute.bench import host_us_per_call

    offsets = torch.tensor([0, 100, 228], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(228, 2, head_dim, device="cuda", dtype=torch.bfloat16).requires_grad_(step)
               for _ in range(3))
    dout = torch.randn(228, 2, head_dim, device="cuda", dtype=torch.bfloat16)
    for mode in [int(m) for m in modes.split(",")]:
        def call():
            out = hstu_attn_varlen_func(q, k, v, offsets, offsets, 128, 128, window_size=(-1, 0), quant_mode=mode)
            if step:
                out.backward(dout)
            return out

        print(f"quant_mode {mode}: {host_us_per_call(call, calls):.1f} us per call", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            call()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
        print(text.getvalue(), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("attribution", help="GPU: where the tiny training step's host time goes (timers)")
    p.add_argument("--calls", type=int, default=2000)
    p = sub.add_parser("primitives", help="GPU: each host-side primitive alone, main and second thread")
    p.add_argument("--calls", type=int, default=2000)
    p = sub.add_parser("standin", help="CPU: the eager path's host time with the launches stubbed")
    p.add_argument("--profile", action="store_true", help="a cProfile of the training step instead")
    p.add_argument("--mode", type=int, default=-1, help="with --profile: the step's quant_mode (-1: bf16)")
    p.add_argument("--count", default=None, metavar="ROW", help="run only this row (for callgrind), --steps times; with --profile: profile this row")
    p.add_argument("--steps", type=int, default=0)
    p = sub.add_parser("dispatch", help="CPU (+GPU): the torch dispatcher against the direct call")
    p.add_argument("--n", type=int, default=20000, help="calls per timing")
    p = sub.add_parser("profile", help="GPU: host us per call per quant_mode, then a cProfile of each")
    p.add_argument("--modes", default="2,5", help="comma-separated quant_mode values (-1: bf16)")
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--top", type=int, default=15, help="functions printed per profile")
    p.add_argument("--step", action="store_true", help="an autograd forward + backward step per call")
    p.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    if args.command == "attribution":
        attribution(args.calls)
    elif args.command == "primitives":
        primitives(args.calls)
    elif args.command == "standin":
        standin(args.profile, args.mode, args.count, args.steps)
    elif args.command == "dispatch":
        dispatch(args.n)
    else:
        profile(args.modes, args.calls, args.top, args.step, args.head_dim)
    return 0


if __name__ == "__main__":
    sys.exit(main())
