"""Host (CPU) time of the public FP8 forward per quant_mode on a tiny problem (the GPU work is a
few microseconds, so calls queue at the host's pace), then a cProfile of the given modes' calls,
top functions by own time; with ``--step`` an autograd forward + backward step instead (mode -1:
bf16). Needs an sm90 GPU.

    python scripts/profile_host_fp8.py [--modes 2,5] [--calls 1000] [--top 15] [--step]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from hstu_cute import hstu_attn_varlen_func
from hstu_cute.bench import host_us_per_call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="2,5")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--step", action="store_true")
    args = ap.parse_args()
    offsets = torch.tensor([0, 100, 228], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(228, 2, 128, device="cuda", dtype=torch.bfloat16).requires_grad_(args.step)
               for _ in range(3))
    dout = torch.randn(228, 2, 128, device="cuda", dtype=torch.bfloat16)
    for mode in [int(m) for m in args.modes.split(",")]:
        def call():
            out = hstu_attn_varlen_func(q, k, v, offsets, offsets, 128, 128, window_size=(-1, 0), quant_mode=mode)
            if args.step:
                out.backward(dout)
            return out

        print(f"quant_mode {mode}: {host_us_per_call(call, args.calls):.1f} us per call", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            call()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
        print(text.getvalue(), flush=True)


if __name__ == "__main__":
    main()
