"""Host (CPU) time of the public call on a tiny problem, where the GPU work is negligible: an eager
forward, and an autograd forward + backward step, each timed over many calls with no sync inside
the loop; then a cProfile of the step, top functions by own time. Needs a GPU.

    python scripts/profile_host.py [--calls 2000] [--head-dim 64] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from hstu_cute import hstu_attn_varlen_func
from hstu_cute.bench import host_us_per_call as per_call_us


def _inputs(head_dim: int, requires_grad: bool):
    gen = torch.Generator(device="cpu").manual_seed(0)
    lengths = [100, 128]
    offsets = torch.tensor([0, 100, 228], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(228, 2, head_dim, generator=gen).to("cuda", torch.bfloat16).requires_grad_(requires_grad)
               for _ in range(3))
    return dict(q=q, k=k, v=v, seq_offsets_q=offsets, seq_offsets_k=offsets, max_seqlen_q=max(lengths),
                max_seqlen_k=max(lengths), window_size=(-1, 0), alpha=0.125)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)

    fwd = _inputs(args.head_dim, False)
    train = _inputs(args.head_dim, True)
    dout = torch.ones_like(train["q"])

    def forward():
        hstu_attn_varlen_func(**fwd)

    def step():
        hstu_attn_varlen_func(**train).backward(dout)

    print(f"eager forward: {per_call_us(forward, args.calls):.1f} us of CPU per call")
    print(f"forward + backward step: {per_call_us(step, args.calls):.1f} us of CPU per call")
    with torch.no_grad():
        print(f"forward under no_grad with requires_grad inputs: "
              f"{per_call_us(lambda: hstu_attn_varlen_func(**train), args.calls):.1f} us")

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        step()
    profile.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print("\n=== cProfile of 200 steps, by own time ===")
    print(out.getvalue())
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.top)
    print("\n=== by cumulative time ===")
    print(out.getvalue())


if __name__ == "__main__":
    main()
