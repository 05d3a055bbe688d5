"""The serving benchmark on the GPU, one JSON line per workload (``--out``), printed as it goes."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from hstu_cute.bench_serving import run_serving, serving_grid


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[32])
    args = parser.parse_args()
    for w in [w for ps in args.page_sizes for w in serving_grid(ps)[: args.limit]]:
        row = run_serving(w)
        row["gpu"] = torch.cuda.get_device_name()
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
