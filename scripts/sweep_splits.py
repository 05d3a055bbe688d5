"""Split keys: device time (CUDA graph replays, L2 flushed) of serving calls at several part
counts, paged and contiguous, in one run; one JSON line per (workload, parts)."""

from __future__ import annotations

import json
import sys

import torch

from hstu_cute import launch
from hstu_cute.bench import time_flushed
from hstu_cute.bench_serving import ServingWorkload, _graphed, make_serving_inputs, serving_calls

WORKLOADS = [
    ServingWorkload("1 user x (4096 + 256), 64 targets", 1, 4096, 256, 64),
    ServingWorkload("1 user x (4096 + 1)", 1, 4096, 1, 0),
    ServingWorkload("1 user x (16384 + 256), 64 targets", 1, 16384, 256, 64),
    ServingWorkload("8 users x (4096 + 64), 16 targets", 8, 4096, 64, 16),
]


def main() -> int:
    chosen = launch.key_splits
    for w in WORKLOADS:
        x = make_serving_inputs(w)
        calls = serving_calls(w, x)
        with torch.no_grad():
            for parts in (1, 4, 8, 12, 16, 24):
                launch.key_splits = lambda *a, parts=parts: parts
                row = dict(workload=w.name, parts=parts)
                for name in ("paged", "contiguous"):
                    ms, _ = time_flushed([_graphed(calls[name])], reps=30)
                    row[f"{name}_graph_us"] = round(ms * 1e3, 1)
                print(json.dumps(row), flush=True)
    launch.key_splits = chosen
    return 0


if __name__ == "__main__":
    sys.exit(main())
