"""The fused FP8 backward on the GPU in one call: precompile the D128 FP8 variants it needs, run its
tests, then time it beside the FP8 pair and the 16-bit backward (same run). JSON lines to --out.

Usage on the GPU machine: python scripts/gpu_fp8_fused.py [--stages warmup tests bench] [--out F]"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time


def warmup() -> None:
    from hstu_cute import variants
    from hstu_cute.warmup import warmup as compile_all

    pattern = r"^hopper_bwd_fp8_(fused|dkdv|dq) .* d128 |^hopper_fwd_(fp8|vt|cast|quant) |^hopper_bwd_(fused|dkdv|dq) .* d128 "
    keys = [k for k in variants.shipped_keys("sm_90a") if re.search(pattern, k.describe())
            and "two-direction" not in k.describe()]
    t0 = time.time()
    results = compile_all("sm_90a", keys, workers=os.cpu_count(), raise_errors=False)
    bad = [r for r in results if not r["ok"]]
    print(f"warmup: {len(results)} keys, {len(bad)} failed, {time.time() - t0:.0f} s", flush=True)
    for r in bad[:5]:
        print("  FAILED", r["variant"], r["error"], flush=True)


def bench(out, workloads) -> None:
    import torch

    from hstu_cute import bench as B

    for name, batch, n, kw in workloads:
        w = B.Workload(name, batch, n, head_dim=128, **kw)
        steps = [lambda: B.run_workload_bwd(w)]
        steps += [lambda m=m, f=f: B.run_workload_bwd_fp8(w, m, "kernel", fused=f) for m in (2, 5) for f in (False, True)]
        steps += [lambda: B.run_workload_bwd_fp8(w, 2, "end2end", fused=True)]
        steps += [lambda: B.run_training_step(w), lambda: B.run_training_step(w, quant_mode=2)]
        for step in steps:
            try:
                row = step()
            except Exception as e:  # keep the rest of the run
                row = dict(workload=w.name, error=f"{type(e).__name__}: {e}")
            row["gpu"] = torch.cuda.get_device_name()
            print(json.dumps(row), flush=True)
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", nargs="+", default=["warmup", "tests", "bench"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--tests", default="fused")
    args = parser.parse_args()
    if "warmup" in args.stages:
        warmup()
    if "tests" in args.stages:
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                              "tests/test_fp8_backward_gpu.py", "-k", args.tests])
        print(f"tests rc={rc}", flush=True)
    if "bench" in args.stages:
        bench(args.out, [("full B8 N4096", 8, 4096, {})])


if __name__ == "__main__":
    main()
