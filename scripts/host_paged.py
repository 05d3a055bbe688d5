"""Host time per public paged KV-cache call beside the 16-bit call without a cache (tiny batch,
so the calls run at the host's pace): the launcher's cost of the cache arguments (and of the
rab gathered among the new tokens)."""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys

import torch

from hstu_cute import hstu_attn_varlen_func
from hstu_cute.bench import host_us_per_call
from hstu_cute.testing import random_jagged_batch, random_paged_batch


def main(n: int = 1000, repeats: int = 5, profile: bool = False) -> None:
    plain = random_jagged_batch(4, 2, 128, 64, window_size=(-1, 0), device="cuda", seed=0)
    paged, _ = random_paged_batch([40, 17, 64, 5], [8, 8, 8, 8], 2, 128, 16, device="cuda", seed=0)
    paged_rab, _ = random_paged_batch([40, 17, 64, 5], [8, 8, 8, 8], 2, 128, 16, device="cuda", rab_heads=2, seed=0)
    calls = {"16-bit, no cache (reference line)": plain, "paged": paged, "paged + rab": paged_rab}
    with torch.no_grad():
        for kw in calls.values():  # compile, then check that a call never syncs the host
            hstu_attn_varlen_func(**kw)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        for kw in calls.values():
            hstu_attn_varlen_func(**kw)
        torch.cuda.set_sync_debug_mode("default")
        print("no host sync in any call (torch.cuda.set_sync_debug_mode('error'))")
        for name, kw in calls.items():
            samples = [host_us_per_call(lambda kw=kw: hstu_attn_varlen_func(**kw), n) for _ in range(repeats)]
            print(f"{name}: {statistics.median(samples):.1f} us per call (median of {repeats} x {n})", flush=True)
        if profile:
            # Where the rab case's host time goes: the functions with the most time of their own.
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n):
                hstu_attn_varlen_func(**paged_rab)
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main(profile="--profile" in sys.argv)
