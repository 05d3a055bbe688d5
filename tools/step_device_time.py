"""Device time of a training step (autograd forward + backward of the public call) replayed from a
CUDA graph, bf16 beside FP8 quant modes, B8 N4096 H4 causal: what the step costs the GPU once the
host is out of the way (``bench``'s training-step rows queue launches from Python, and at D128 the
FP8 step's host time is close to its device time, docs/dev/perf-log.md sessions 24-27). Captured with
torch.cuda.graph after warm-up calls; the L2 is not flushed between replays (both lines alike).

    python tools/step_device_time.py [--dims 128 256] [--modes -1 2 5]
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--modes", type=int, nargs="+", default=[-1, 2, 5, -1, 2, 5])
    args = ap.parse_args()
    import torch

    from hstu_cute import bench, hstu_attn_varlen_func

    for d in args.dims:
        w = bench.Workload(f"full B8 N4096 D{d}", 8, 4096, head_dim=d)
        full = bench.make_inputs(w, seed=0)
        kw = {k: v for k, v in full.items() if not k.startswith("_")}
        for name in "qkv":
            kw[name].requires_grad_(True)
        dout = torch.rand_like(kw["q"])
        f, _ = bench.flops(w, full["_lens_q"], full["_lens_k"])
        base = None
        for mode in args.modes:
            call = lambda mode=mode: torch.autograd.grad(hstu_attn_varlen_func(**kw, quant_mode=mode),
                                                         (kw["q"], kw["k"], kw["v"]), dout)
            ms, iqr, how = bench.time_graphed([call])
            if mode < 0:
                base = ms
            ratio = f" ({base / ms:.2f}x bf16)" if base else ""
            print(f"D{d} {'bf16' if mode < 0 else f'fp8 mode {mode}':10s} step {ms:.3f} ms (IQR {iqr:.3f}, {how}) "
                  f"{3.5 * f / ms / 1e9:.0f} TF/s{ratio}", flush=True)


if __name__ == "__main__":
    main()
