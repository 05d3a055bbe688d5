"""Where the host time of a call goes: each piece of the eager forward and backward timed alone on a
tiny problem (CPU us per call, no sync inside the loop), beside the floor PyTorch itself sets (an
empty autograd.Function step, a torch.empty). Needs a GPU.

    python scripts/host_breakdown.py [--calls 2000]
"""

from __future__ import annotations

import argparse

import torch

from hstu_cute import arch, hstu_attn_varlen_func, launch, validation
from hstu_cute.kernel_args import ordered

from hstu_cute.bench import host_us_per_call as per_call_us
from profile_host import _inputs


class AllocOnly(torch.autograd.Function):
    """An autograd node that only allocates: PyTorch's own cost of a forward + backward step."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        return torch.empty_like(dout), torch.empty_like(dout), torch.empty_like(dout)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    n = args.calls
    kw = _inputs(64, False)
    train = _inputs(64, True)
    dout = torch.ones_like(train["q"])
    q, k, v, off = kw["q"], kw["k"], kw["v"], kw["seq_offsets_q"]
    L = kw["max_seqlen_q"]
    vargs = (q, k, v, off, off, L, L, None, None, 1, (-1, 0), 0.125, None, False, False, None, None, None, None, -1,
             -1, None, None)
    p = validation.validate(*vargs)
    dev = q.device
    key = launch.fwd_key(p, arch.device_arch(dev), None, None, arch.kernel_path(dev))
    compiled = launch._compiled(key)
    out = torch.empty_like(q)
    values = dict(mQ=q, mK=k, mV=v, mO=out, mRab=None, num_m_blocks=-(-L // key.tile_m),
                  **launch._sequence_args(p, dev, off, off, None, None, None, None, False),
                  **launch._scalar_args(p, 0.125, 1), num_sms=arch.num_sms(dev), bh_per_section=1)
    fwd_args = ordered(key, values)

    def beside():
        with launch._beside(dev):
            pass

    def device_context():
        with torch.cuda.device(dev):
            pass
    rows = {
        "public forward (eager)": lambda: hstu_attn_varlen_func(**kw),
        "validate": lambda: validation.validate(*vargs),
        "launch.forward (validated)": lambda: launch.forward(q, k, v, off, off, L, L, None, None, 1, 0.125, None,
                                                             None, None, p),
        "compiled kernel call (args ready)": lambda: compiled(*fwd_args),
        "kernel_args.ordered": lambda: ordered(key, values),
        "module cache lookup (launch._compiled)": lambda: launch._compiled(key),
        "torch.empty (T, H, D)": lambda: torch.empty(q.shape, dtype=q.dtype, device=dev),
        "arch.kernel_path": lambda: arch.kernel_path(dev),
        "launch.backward (validated)": lambda: launch.backward(dout, q, k, v, off, off, L, L, None, None, 1, 0.125,
                                                               None, False, None, None, p),
        "launch._beside (empty body)": beside,
        "torch.cuda.device(dev) (empty body)": device_context,
        "public forward, inputs requiring grad": lambda: hstu_attn_varlen_func(**train),
        "fwd + bwd step (public)": lambda: hstu_attn_varlen_func(**train).backward(dout),
        "floor: empty autograd.Function fwd + bwd": lambda: AllocOnly.apply(train["q"], train["k"], train["v"]).backward(
            dout),
        "floor: torch q * 2 fwd + bwd": lambda: (train["q"] * 2).backward(dout),
    }
    for name, fn in rows.items():
        print(f"{name:45s} {per_call_us(fn, n):8.1f} us")

    # GPU time of the step: if it is as long as the loop's wall time per call, that loop measures
    # the GPU (the launch queue fills and the host waits), not the host.
    step = rows["fwd + bwd step (public)"]
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        step()
    end.record()
    torch.cuda.synchronize()
    print(f"{'GPU time per fwd + bwd step (200 queued)':45s} {start.elapsed_time(end) / 200 * 1e3:8.1f} us")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))

    # The autograd wrapper alone: the same step with the backward launch stubbed out.
    from hstu_cute import api

    grads = (torch.empty_like(q), torch.empty_like(q), torch.empty_like(q), None)
    real_backward = api.backward
    api.backward = lambda *a, **kw: grads
    try:
        print(f"{'fwd + bwd step, backward launch stubbed':45s} "
              f"{per_call_us(lambda: hstu_attn_varlen_func(**train).backward(dout), n):8.1f} us")
        print(f"{'same, autograd.grad (no accumulation)':45s} "
              f"{per_call_us(lambda: torch.autograd.grad(hstu_attn_varlen_func(**train), (train['q'], train['k'], train['v']), dout), n):8.1f} us")
    finally:
        api.backward = real_backward
    import threading

    result = {}
    bwd = rows["launch.backward (validated)"]
    fwd_launch = rows["launch.forward (validated)"]
    worker = threading.Thread(target=lambda: result.update(bwd=per_call_us(bwd, n), fwd=per_call_us(fwd_launch, n)))
    worker.start()
    worker.join()
    print(f"{'launch.backward from another thread':45s} {result['bwd']:8.1f} us")
    print(f"{'launch.forward from another thread':45s} {result['fwd']:8.1f} us")
    print(f"{'fwd + bwd, autograd.grad (no accumulation)':45s} "
          f"{per_call_us(lambda: torch.autograd.grad(hstu_attn_varlen_func(**train), (train['q'], train['k'], train['v']), dout), n):8.1f} us")


if __name__ == "__main__":
    main()
