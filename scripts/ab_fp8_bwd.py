"""FP8 backward kernels alone (quant modes 2 and 5) beside the bf16 backward, B8 N4096 H4 causal
at D128 and D256: one arm of an A/B of a trace-time code switch (run once per arm, each with its
own HSTU_CUTE_CACHE_DIR; ``--arm`` tags the rows). JSON lines to $OUT/ab_fp8_bwd.jsonl.

    HSTU_CUTE_CACHE_DIR=/tmp/a python scripts/ab_fp8_bwd.py --arm base
"""

import argparse
import json
import os

from hstu_cute import bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", required=True)
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 256])
    args = ap.parse_args()
    out = os.path.join(os.environ.get("OUT", "."), "ab_fp8_bwd.jsonl")
    for d in args.dims:
        w = bench.Workload(f"full B8 N4096 D{d}", 8, 4096, head_dim=d)
        rows = [bench.run_workload_bwd(w)] + [bench.run_workload_bwd_fp8(w, m, "kernel") for m in (2, 5)]
        for row in rows:
            row["arm"] = args.arm
            print(f"{args.arm:6s} D{d} {row.get('entry', 'bf16 bwd'):32s} {row['ms']:.4f} ms (IQR {row['iqr_ms']:.4f}) "
                  f"{row['tflops']:.1f} TF/s", flush=True)
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
