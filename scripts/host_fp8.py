"""Host time per public FP8 call (issue 16), beside the 16-bit call: a tiny jagged batch (the GPU
work is a few microseconds, so back-to-back calls queue on the host's pace), every quant_mode.
Mean wall time per call over ``--n`` calls (median of 5 repeats), synchronized before and after.

    python scripts/host_fp8.py [--n 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hstu_cute import hstu_attn_varlen_func
from hstu_cute.testing import random_jagged_batch


def per_call_us(fn, n: int, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    results = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        results.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(results)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2000)
    args = parser.parse_args()
    b = random_jagged_batch(4, 2, 128, 128, device="cuda", seed=0, window_size=(-1, 0))
    rest = {k: v for k, v in b.items() if k not in ("q", "k", "v")}
    with torch.no_grad():
        for mode in (-1, 0, 1, 2, 3, 5):
            us = per_call_us(lambda: hstu_attn_varlen_func(b["q"], b["k"], b["v"], **rest, quant_mode=mode), args.n)
            print(f"quant_mode {mode:>2}: {us:7.1f} us per call", flush=True)


if __name__ == "__main__":
    main()
