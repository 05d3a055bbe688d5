"""Host time of the split-key forward's pieces (one user's serving call), and a profile of the
call: what the launcher adds around the kernel when it splits the keys."""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from hstu_cute import launch
from hstu_cute.bench_serving import ServingWorkload, make_serving_inputs, serving_calls


def per_call_us(fn, n=2000):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return round(elapsed / n * 1e6, 2)


def main():
    w = ServingWorkload("1 user x (4096 + 256)", 1, 4096, 256, 64)
    x = make_serving_inputs(w)
    calls = serving_calls(w, x)
    parts = torch.empty(16 * 256, 4, 128, dtype=torch.float32, device="cuda")
    out = torch.empty(256, 4, 128, dtype=torch.bfloat16, device="cuda")
    print("empty fp32 parts", per_call_us(lambda: torch.empty(16 * 256, 4, 128, dtype=torch.float32, device="cuda")))
    print("sum out=bf16", per_call_us(lambda: torch.sum(parts.view(16, 256, 4, 128), dim=0, out=out)))
    print("copy_(sum)", per_call_us(lambda: out.copy_(parts.view(16, 256, 4, 128).sum(0))))
    with torch.no_grad():
        for label, chooser in (("split", launch.key_splits), ("one", lambda *a: 1)):
            saved = launch.key_splits
            launch.key_splits = chooser
            print(label, "paged", per_call_us(calls["paged"], 300), "contiguous", per_call_us(calls["contiguous"], 300))
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                calls["contiguous"]()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
            launch.key_splits = saved


if __name__ == "__main__":
    main()
