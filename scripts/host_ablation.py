"""Where the host time of a training step goes, by ablation: the tiny step of ``bench --host``
(B2 N128 H2 D64 bf16 causal) timed whole, then with one piece at a time replaced by nothing (the
TVM-FFI kernel calls, the gradient allocations, the backward launcher, the whole
backward), beside the null autograd.Function. Each row is min-max over interleaved repeats of
``--calls`` calls queued with no sync. Needs a GPU.

    python scripts/host_ablation.py [--calls 1000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from hstu_cute import api, launch
from hstu_cute.bench import NullAttention, host_us_per_call, tiny_batch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    (q, k, v), kw = tiny_batch(True)
    dout = torch.randn_like(q)
    grads = tuple(torch.empty_like(q) for _ in range(3)) + (None,)

    def step():
        torch.autograd.grad(api.hstu_attn_varlen_func(q, k, v, **kw), (q, k, v), dout)

    def forward():
        with torch.no_grad():
            api.hstu_attn_varlen_func(q, k, v, **kw)

    def null_step():
        torch.autograd.grad(NullAttention.apply(q, k, v), (q, k, v), dout)

    owners = dict(launch_prepared=(launch.prepared, "_launch_prepared"), backward=(api, "backward"),
                  gradient_buffers=(launch.bwd, "_gradient_buffers"))
    real = {name: getattr(*owners[name]) for name in owners}

    @contextlib.contextmanager
    def patched(**changes):
        for name, value in changes.items():
            setattr(*owners[name], value)
        try:
            yield
        finally:
            for name in changes:
                setattr(*owners[name], real[name])

    def no_launch(prepared, values):
        pass

    rows = {
        "null autograd.Function step": (null_step, {}),
        "step": (step, {}),
        "step, no TVM-FFI kernel calls": (step, dict(launch_prepared=no_launch)),
        "step, gradients from a pool": (step, dict(gradient_buffers=lambda *a: grads[:3])),
        "step, backward launcher stubbed": (step, dict(backward=lambda *a, **k: grads)),
        "forward (no grad)": (forward, {}),
        "forward (no grad), no TVM-FFI kernel call": (forward, dict(launch_prepared=no_launch)),
    }
    samples = {name: [] for name in rows}
    for fn, changes in rows.values():
        with patched(**changes):
            fn()
    for _ in range(args.repeats):
        for name, (fn, changes) in rows.items():
            with patched(**changes):
                samples[name].append(host_us_per_call(fn, args.calls))
    for name, s in samples.items():
        print(f"{name:48s} {min(s):7.1f} - {max(s):7.1f} us")
    # GPU time per queued step: if it matches the host time, the loop waits on the GPU.
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        step()
    end.record()
    torch.cuda.synchronize()
    print(f"{'GPU wall time per queued step':48s} {start.elapsed_time(end) / 200 * 1e3:7.1f} us")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))


if __name__ == "__main__":
    main()
