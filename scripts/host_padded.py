"""Host time of the padded entry beside the jagged call and the operator on the padded layout
(tiny batch: the host's pace), and a profile of the padded entry: where its host time goes."""

from __future__ import annotations

import cProfile
import pstats

import torch

from hstu_cute import hstu_attn_varlen_func
from hstu_cute.bench import host_us_per_call
from hstu_cute.padded import hstu_attn_padded, to_jagged


def main(n: int = 500) -> None:
    B, N, H, D = 4, 64, 2, 64
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, N + 1, (B,), generator=gen)
    q, k, v = (torch.randn(B, N, H, D, generator=gen).to(torch.bfloat16).cuda() for _ in range(3))
    lengths_dev = lengths.to(torch.int32).cuda()
    (qj, offsets), (kj, _), (vj, _) = (to_jagged(x, lengths) for x in (q, k, v))
    flat = [t.flatten(0, 1) for t in (q, k, v)]
    uniform = torch.arange(B + 1, dtype=torch.int32, device="cuda") * N
    calls = {
        "jagged": lambda: hstu_attn_varlen_func(qj, kj, vj, offsets, offsets, N, N, window_size=(-1, 0), alpha=0.125),
        "operator on the padded layout (seqused)": lambda: hstu_attn_varlen_func(
            *flat, uniform, uniform, N, N, window_size=(-1, 0), alpha=0.125, seqused_q=lengths_dev,
            seqused_k=lengths_dev),
        "hstu_attn_padded": lambda: hstu_attn_padded(q, k, v, lengths_dev, alpha=0.125),
    }
    with torch.no_grad():
        for name, fn in calls.items():
            print(f"{name}: {host_us_per_call(fn, n):.1f} us per call", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            calls["hstu_attn_padded"]()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
