"""The headline family at B8 N4096 causal: forward and backward TF/s for bf16 and fp16 at head dims
64, 128 and 256, SDPA cuDNN beside (same run). The no-regression check of kernel-schedule changes.

    python tools/no_regression.py     # JSON lines appended to $OUT/no_regression.jsonl (OUT: default .)
"""

import argparse
import dataclasses
import json
import os
import sys


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    from hstu_cute import bench

    out = os.path.join(os.environ.get("OUT", "."), "no_regression.jsonl")
    print(f"GEMM bf16 8192^3: {bench.gemm_tflops():.1f} TF/s", flush=True)
    for dtype in ("bfloat16", "float16"):
        for d in (64, 128, 256):
            w = dataclasses.replace(bench.headline(), name=f"full B8 N4096 D{d} {dtype}", head_dim=d, dtype=dtype)
            for run in (bench.run_workload, bench.run_workload_bwd):
                row = run(w)
                cudnn = row.get("sdpa_cudnn") or 0
                print(f"{row['workload']:<36} {row['tflops']:7.1f} TF/s  cuDNN {cudnn:7.1f}", flush=True)
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
