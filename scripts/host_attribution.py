"""Where the host time of the tiny training step goes, by attribution: the step of ``bench --host``
(B2 N128 H2 D64 bf16 causal) run ``--calls`` times with the launch layer's pieces wrapped in
timers (perf_counter_ns; a wrapper costs ~0.2 us), printed as us per step, beside the step's own
wall time and the time from ``torch.autograd.grad`` to the entry of our backward node. Needs a GPU.

    python scripts/host_attribution.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

import torch

from hstu_cute import api, launch
from hstu_cute.bench import NullAttention, tiny_batch

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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
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

    for _ in range(args.calls):
        measured_step()
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(args.calls):
        null_step()
    TOTALS["null autograd.Function step"] = time.perf_counter_ns() - t0
    for name, total in sorted(TOTALS.items(), key=lambda kv: -kv[1]):
        calls = COUNTS.get(name)
        per = f"  ({calls // args.calls} calls per step)" if calls else ""
        print(f"{name:44s} {total / args.calls / 1e3:8.1f} us per step{per}")


if __name__ == "__main__":
    main()
