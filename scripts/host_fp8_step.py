"""Host time of an FP8 training step (quant_mode 2) on a tiny batch, with a cProfile of where it
goes (top functions by own time), beside the bf16 step. Usage on the GPU machine:
python scripts/host_fp8_step.py [--mode 2] [--calls 200]"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from hstu_cute import bench as B
from hstu_cute import hstu_attn_varlen_func


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    tiny = B.make_inputs(B.Workload("tiny B2 N128 D128", 2, 128, head_dim=128))
    kw = {k: v for k, v in tiny.items() if not k.startswith("_")}
    for name in "qkv":
        kw[name].requires_grad_(True)
    dout = torch.rand_like(kw["q"])

    def step(mode):
        return torch.autograd.grad(hstu_attn_varlen_func(**kw, quant_mode=mode), (kw["q"], kw["k"], kw["v"]), dout)

    for mode in (-1, args.mode):
        print(f"mode {mode}: {B.host_us_per_call(lambda: step(mode), args.calls):.0f} us per step", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        step(args.mode)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
