"""Does the dQ kernel pay for its side stream? The 16-bit backward's device time (CUDA-graph
replays, so host time does not count) with the dQ kernel on a side stream beside the dK/dV
kernel, and with both on one stream, on the recsys shapes, a tiny one and the headline; same
run, interleaved. Needs a GPU.

    python scripts/side_stream_ab.py [--reps 30]
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from hstu_cute import launch
from hstu_cute.bench import Workload, backward_call, time_graphed

WORKLOADS = (
    Workload("tiny B2 N128 H2 D64", 2, 128, heads=2, head_dim=64),
    Workload("full B1024 N256", 1024, 256),
    Workload("full B128 N512", 128, 512),
    Workload("full B32 N1024", 32, 1024),
    Workload("jagged u[1,N] B128 N2048 tgt32", 128, 2048, lengths="uniform1", targets=32),
    Workload("short jagged u[1,256] B4096 tgt8", 4096, 256, lengths="uniform1", targets=8),
    Workload("full B8 N4096 (headline)", 8, 4096),
)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    beside = launch._beside
    print(f"{'workload':36s} {'side stream ms':>15s} {'one stream ms':>14s} {'one / side':>10s}")
    for w in WORKLOADS:
        calls = [backward_call(w, seed)[0] for seed in range(2)]
        rows = {}
        for _ in range(2):  # interleaved repeats
            for name, switch in (("side", beside), ("one", lambda device: contextlib.nullcontext())):
                launch._beside = switch
                try:
                    ms, _, how = time_graphed(calls, reps=args.reps)
                finally:
                    launch._beside = beside
                rows.setdefault(name, []).append(ms)
        side, one = min(rows["side"]), min(rows["one"])
        print(f"{w.name:36s} {side:15.4f} {one:14.4f} {one / side:10.3f}  ({how})", flush=True)
        del calls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
