"""Host cost of going through the torch dispatcher (torch.ops.hstu_cute.fwd / bwd) instead of
calling the ops' Python bodies directly, as the eager fast path of hstu_attn_varlen_func does.

Runs anywhere: the kernel launch (api.forward / api.backward) is replaced by a no-op that returns
preallocated tensors, so what is timed is the dispatch alone, on CPU tensors. With a GPU it also
times the public function end to end (real kernel, tiny problem) with the fast path on and off.

    python scripts/measure_dispatch.py [--n 20000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hstu_cute import api


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="calls per timing")
    args = ap.parse_args()
    rows = {}
    if torch.cuda.is_available():
        rows.update(public_api_on_gpu(args.n))  # before dispatch_only() stubs the launches out
    rows.update(dispatch_only(args.n))
    width = max(map(len, rows))
    for name, us in rows.items():
        print(f"{name:<{width}}  {us:7.2f} us/call")


if __name__ == "__main__":
    main()
