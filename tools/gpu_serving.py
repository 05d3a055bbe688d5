"""The serving benchmark on the GPU (hstu_cute.bench_serving's grid: paged KV-cache calls beside the
contiguous ones, same run), one JSON line per workload (``--out``), printed as it goes.
tools/gpu_check.sh runs it as its ``serving`` stage.

    python tools/gpu_serving.py [--page-sizes 16 32] [--limit N] [--out serving.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    parser.add_argument("--limit", type=int, default=None, help="the first N workloads of each page size")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[32])
    args = parser.parse_args()
    import torch

    from hstu_cute.bench_serving import run_serving, serving_grid

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
