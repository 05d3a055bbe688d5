"""The FP8 backward on the GPU in one call: precompile (parallel) the FP8 forward and backward
variants the tests and benchmark use, run tests/test_fp8_backward_gpu.py, then the benchmark: the
16-bit backward (default and deterministic pair) beside the FP8 backward (kernels alone, quantizers
alone, end to end) and the training step bf16 vs FP8, same run. JSON lines to ``--out``.

Usage on the GPU machine: python tools/gpu_fp8_bwd.py [--stages warmup tests bench] [--out F]
(stage "fused": the opt-in fused kernel beside the pair; "steps": the training steps alone)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

STAGES = ("warmup", "tests", "sanitize", "sweep", "bench", "steps", "drab", "fused")


def warmup() -> None:
    from hstu_cute import variants
    from hstu_cute.warmup import warmup as compile_all

    keys = (variants.shipped_hopper_fp8_bwd_keys("sm_90a")
            + variants.shipped_hopper_fp8_fwd_keys("sm_90a", head_dims=variants.FP8_BWD_HEAD_DIMS))
    t0 = time.time()
    results = compile_all("sm_90a", keys, workers=os.cpu_count(), raise_errors=False)
    bad = [r for r in results if not r["ok"]]
    print(f"warmup: {len(results)} keys, {len(bad)} failed, {time.time() - t0:.0f} s", flush=True)
    for r in bad[:5]:
        print("  FAILED", r["variant"], r["error"], flush=True)


def run_steps(steps, name: str, out, rows=None, tag: str = "") -> None:
    """Run each benchmark step (a row-returning call; a failure becomes an error row and the rest
    still runs), print its row as JSON (after ``tag``), append it to ``out`` and to ``rows``."""
    import torch

    for step in steps:
        try:
            row = step()
        except Exception as e:  # keep the rest of the run
            row = dict(workload=name, error=f"{type(e).__name__}: {e}")
        row["gpu"] = torch.cuda.get_device_name()
        if rows is not None:
            rows.append(row)
        print(tag + json.dumps(row), flush=True)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")


def bench(out) -> None:
    import torch

    from hstu_cute import bench as B

    rows = []
    for d in (128, 64, 256):
        w = B.Workload(f"full B8 N4096 D{d}", 8, 4096, head_dim=d)
        steps = [lambda: B.run_workload_bwd(w), lambda: B.run_workload_bwd(w, deterministic=True)]
        steps += [lambda m=m: B.run_workload_bwd_fp8(w, m, "kernel") for m in (2, 5, 0, 1)]
        steps += [lambda m=m, e=e: B.run_workload_bwd_fp8(w, m, e) for m in (2, 1) for e in ("quant", "end2end")]
        steps += [lambda: B.run_training_step(w), lambda: B.run_training_step(w, quant_mode=2),
                  lambda: B.run_training_step(w, quant_mode=5), lambda: B.run_training_step(w, quant_mode=1)]
        run_steps(steps, w.name, out, rows)
    # Host time of a training step on a tiny batch (the GPU work is negligible): bf16 and FP8 mode 2.
    from hstu_cute import hstu_attn_varlen_func

    tiny = B.make_inputs(B.Workload("tiny B2 N128 D128", 2, 128, head_dim=128))
    kw = {k: v for k, v in tiny.items() if not k.startswith("_")}
    for name in "qkv":
        kw[name].requires_grad_(True)
    dout = torch.rand_like(kw["q"])
    for mode in (-1, 2):
        def step(mode=mode):
            return torch.autograd.grad(hstu_attn_varlen_func(**kw, quant_mode=mode), (kw["q"], kw["k"], kw["v"]), dout)
        row = dict(workload="tiny B2 N128 D128 step host", entry=f"mode{mode}", us=B.host_us_per_call(step, 300),
                   gpu=torch.cuda.get_device_name())
        rows.append(dict(row, ms=row["us"] / 1e3, tflops=0.0))
        print(json.dumps(row), flush=True)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
    print("=== summary ===")
    for r in rows:
        if "error" in r:
            print(f"{r['workload']:<22} ERROR {r['error']}")
        else:
            extra = f" {r['gbps']:.0f} GB/s" if "gbps" in r else ""
            print(f"{r['workload']:<26} {r.get('entry', r.get('tiles', '')):<28} {r['ms']:.3f} ms "
                  f"{r['tflops']:.1f} TF{extra}")


def steps(out) -> None:
    """Training steps only (bf16 and FP8 modes 2 and 5, B8 N4096 H4 causal at D128 and D256, same
    run): the check after a forward change, without the backward's kernel rows."""
    from hstu_cute import bench as B

    for d in (128, 256):
        w = B.Workload(f"full B8 N4096 D{d}", 8, 4096, head_dim=d)
        run_steps([lambda m=m: B.run_training_step(w, quant_mode=m) for m in (-1, 2, 5, -1, 2, 5)], w.name, out,
                  tag="STEP ")


def sweep(out) -> None:
    """Each FP8 kernel alone and a few tile choices (B8 N4096 D128 causal, mode 2), beside the
    16-bit backward of the same run."""
    from hstu_cute import bench as B

    w = B.Workload("full B8 N4096 D128", 8, 4096, head_dim=128)
    dq64 = dict(tile_m=128, tile_n=64, persistent=True, dynamic_tiles=True)  # the former default
    kv3 = dict(tile_m=64, tile_n=128, num_stages=3, persistent=True, dynamic_tiles=True)
    steps = [lambda: B.run_workload_bwd(w), lambda: B.run_workload_bwd(w, deterministic=True),
             lambda: B.run_workload_bwd_fp8(w, 2), lambda: B.run_workload_bwd_fp8(w, 2, kernels=("dkdv",)),
             lambda: B.run_workload_bwd_fp8(w, 2, kernels=("dq",)),
             lambda: B.run_workload_bwd_fp8(w, 2, tiles=dict(dq=dq64), kernels=("dq",)),  # 64-key blocks
             lambda: B.run_workload_bwd_fp8(w, 2, tiles=dict(dkdv=kv3), kernels=("dkdv",)),
             lambda: B.run_workload_bwd_fp8(w, 2, tiles=dict(dq=dq64)),
             lambda: B.run_workload_bwd_fp8(w, 2, tiles=dict(dq=dq64, dkdv=kv3))]
    run_steps(steps, w.name, out, tag="SWEEP ")


def fused(out) -> None:
    """The opt-in fused FP8 kernel beside the pair (kernels alone, modes 2 and 5) and the 16-bit
    backward, B8 N4096 D128 causal, same run."""
    from hstu_cute import bench as B

    w = B.Workload("full B8 N4096 D128", 8, 4096, head_dim=128)
    steps = [lambda: B.run_workload_bwd(w)]
    steps += [lambda m=m, f=f: B.run_workload_bwd_fp8(w, m, fused=f) for m in (2, 5) for f in (False, True)]
    run_steps(steps, w.name, out, tag="FUSED ")


def drab(out) -> None:
    """Training steps with a learned rab (has_drab), bf16 and FP8 mode 2, beside the same steps
    without drab: what writing drab costs (B8 N2048 H4 D128 causal, rab with H heads)."""
    import torch

    from hstu_cute import bench as B

    w = B.Workload("rab H_rab=H B8 N2048 D128", 8, 2048, rab_heads=4)
    for mode in (-1, 2):
        for has_drab in (False, True):
            row = dict(B.run_training_step(w, quant_mode=mode, has_drab=has_drab), gpu=torch.cuda.get_device_name())
            print(f"{row['workload']:<30} {row['tiles']:<32} {row['ms']:.3f} ms {row['tflops']:.1f} TF", flush=True)
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", nargs="*", default=list(STAGES), choices=STAGES)
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments of the tests stage")
    args = parser.parse_args()
    rc = 0
    if "warmup" in args.stages:
        warmup()
    if "tests" in args.stages:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fp8_backward_gpu.py",
               *args.pytest_args.split()]
        rc = subprocess.call(cmd)
        print(f"tests rc={rc}", flush=True)
    if "sanitize" in args.stages:
        t0 = time.time()
        log = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "9", sys.executable,
                              "tools/sanitize.py", "fp8-bwd"], capture_output=True, text=True)
        summary = [line for line in (log.stdout + log.stderr).splitlines() if "ERROR SUMMARY" in line or "Error" in line]
        print(f"sanitize rc={log.returncode} {time.time() - t0:.0f} s: {summary[-3:]}", flush=True)
    if "sweep" in args.stages:
        sweep(args.out)
    if "bench" in args.stages:
        bench(args.out)
    if "steps" in args.stages:
        steps(args.out)
    if "drab" in args.stages:
        drab(args.out)
    if "fused" in args.stages:
        fused(args.out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
