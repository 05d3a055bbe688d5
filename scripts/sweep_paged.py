"""Paged forward against contiguous keys under build/tile choices, one JSON line per case.

    python scripts/sweep_paged.py --page-sizes 16 32 --stages 3 --q-stages 1

Each case: the serving grid's 64-user workload at one page size, paged and contiguous calls with
the launcher's tiles (``--stages`` / ``--q-stages`` override both calls' defaults), device time
from CUDA-graph replays (median of 20, L2 flushed) and eager time (launches queued)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from hstu_cute import variants
from hstu_cute.bench import time_flushed
from hstu_cute.bench_serving import _graphed, make_serving_inputs, serving_calls, serving_grid


def _overridden(default_tiles, args):
    def tiles(head_dim, has_rab):
        t = dict(default_tiles(head_dim, has_rab))
        if args.stages:
            t["num_stages"] = args.stages
        if args.q_stages:
            t["q_stages"] = args.q_stages
        return t
    return tiles


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--stages", type=int, default=None)
    parser.add_argument("--q-stages", type=int, default=None)
    parser.add_argument("--workload", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    for name in ("default_hopper_fwd_tiles", "default_hopper_paged_fwd_tiles"):
        setattr(variants, name, _overridden(getattr(variants, name), args))
    for page_size in args.page_sizes:
        w = serving_grid(page_size)[args.workload]
        x = make_serving_inputs(w)
        calls = serving_calls(w, x)
        row = dict(workload=w.name, page_size=page_size, stages=args.stages, q_stages=args.q_stages)
        with torch.no_grad():
            row["max_abs_diff"] = (calls["paged"]().float() - calls["contiguous"]().float()).abs().max().item()
            for name in ("paged", "contiguous"):
                row[f"{name}_ms"], _ = time_flushed([calls[name]])
                row[f"{name}_graph_ms"], _ = time_flushed([_graphed(calls[name])])
        row["ratio_graph"] = row["paged_graph_ms"] / row["contiguous_graph_ms"]
        row["ratio"] = row["paged_ms"] / row["contiguous_ms"]
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
