"""Measure on a GPU what notebooks/quickstart.ipynb shows as stored results when it runs without
one, and write them to a small JSON file (default notebooks/gpu_results.json).

    python tools/notebook_results.py --commit $(git rev-parse --short HEAD) \
        --example-eager eager.json --example-compiled compiled.json --out notebooks/gpu_results.json

Sections: the forward TFLOP/s of a few ``hstu_cute.bench`` workloads beside torch SDPA (the
notebook's performance plot); the padded entry against the jagged call (and against converting to
jagged and back); the module cache (a cold compile, a load from the disk cache in a fresh process,
an in-memory call; a parallel warmup); the training example's step times, eager and compiled
(read from the example's ``--out`` files).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# A fresh process's first call of one variant: compile (empty cache) or disk load (warm cache).
FIRST_CALL = """
import time, torch
x = torch.randn(512, 2, 64, device="cuda", dtype=torch.bfloat16)
offsets = torch.tensor([0, 256, 512], dtype=torch.int32, device="cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
import cutlass.cute, hstu_cute.api
from hstu_cute import hstu_attn_varlen_func
t_import = time.perf_counter() - t0
times = []
for _ in range(2):
    t0 = time.perf_counter()
    hstu_attn_varlen_func(x, x, x, offsets, offsets, 256, 256, window_size=(16, 16))
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
print(t_import, *times)
"""


# A parallel warmup, in a fresh process and an empty cache: every Hopper forward variant of one
# head dim and dtype (what a job would precompile before it starts).
WARMUP = """
import json, os, time
from hstu_cute import variants, warmup
keys = variants.shipped_hopper_fwd_keys("sm_90a", ("bfloat16",), (128,))
t0 = time.perf_counter()
results = warmup(arch="sm_90a", keys=keys, workers=os.cpu_count())
print(json.dumps({"variants": len(results), "workers": os.cpu_count(), "wall_s": time.perf_counter() - t0,
                  "compile_s_sum": sum(r["seconds"] for r in results if r["source"] == "compile"),
                  "what": "every Hopper forward variant (masks x rab), bf16, head dim 128"}))
"""


def perf_rows() -> list[dict]:
    from hstu_cute import bench

    shapes = [bench.Workload(f"B{b} N{n} D{d}", b, n, head_dim=d, sdpa=True)
              for b, n, d in ((16, 2048, 64), (8, 4096, 128), (4, 8192, 128), (8, 4096, 256))]
    rows = []
    for w in shapes:
        r = bench.run_workload(w)
        rows.append({k: r.get(k) for k in ("workload", "ms", "tflops", "sdpa_flash", "sdpa_cudnn")})
        print("perf", rows[-1], flush=True)
    return rows


def padded_rows() -> dict:
    import torch

    from hstu_cute import bench, hstu_attn_varlen_func
    from hstu_cute.padded import hstu_attn_padded, to_jagged, to_padded

    B, N, H, D = 64, 512, 4, 64
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, N + 1, (B,), generator=gen)
    q, k, v = (torch.randn(B, N, H, D, generator=gen).to(torch.bfloat16).cuda() for _ in range(3))
    lengths_dev = lengths.to(torch.int32).cuda()
    qj, offsets = to_jagged(q, lengths)
    kj, _ = to_jagged(k, lengths)
    vj, _ = to_jagged(v, lengths)

    def padded():
        return hstu_attn_padded(q, k, v, lengths_dev, alpha=0.125)

    def jagged():
        return hstu_attn_varlen_func(qj, kj, vj, offsets, offsets, N, N, window_size=(-1, 0), alpha=0.125)

    def convert():  # what a user without the padded entry would do
        return to_padded(hstu_attn_varlen_func(to_jagged(q, lengths_dev)[0], to_jagged(k, lengths_dev)[0],
                                               to_jagged(v, lengths_dev)[0], offsets, offsets, N, N,
                                               window_size=(-1, 0), alpha=0.125), offsets, N)

    flat = [t.flatten(0, 1) for t in (q, k, v)]
    uniform = torch.arange(B + 1, dtype=torch.int32, device="cuda") * N

    def padded_layout_op():  # the operator alone on the padded layout (what hstu_attn_padded calls)
        return hstu_attn_varlen_func(*flat, uniform, uniform, N, N, window_size=(-1, 0), alpha=0.125,
                                     seqused_q=lengths_dev, seqused_k=lengths_dev)

    same = (to_jagged(padded(), lengths)[0].float() - jagged().float()).abs().max().item()
    result = {"shape": f"B{B} N{N} H{H} D{D}, lengths uniform[1, {N}], causal, bf16",
              "max_abs_diff_padded_vs_jagged": same}
    for name, fn in (("padded_ms", padded), ("padded_layout_op_ms", padded_layout_op), ("jagged_ms", jagged),
                     ("convert_and_back_ms", convert)):
        result[name] = bench.time_cuda([fn], warmup=3, reps=20)[0]
    # Host time per call (queued, no sync): what each entry costs the CPU.
    for name, fn in (("padded_host_us", padded), ("jagged_host_us", jagged)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        result[name] = (time.perf_counter() - t0) / 50 * 1e6
        torch.cuda.synchronize()
    print("padded", result, flush=True)
    return result


def cache_rows() -> dict:
    """First call of one variant in fresh processes: empty cache (compile), then the same cache
    (disk load); a parallel warmup of every Hopper forward variant of one head dim and dtype."""
    result = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, HSTU_CUTE_CACHE_DIR=cache)
        for label in ("cold_compile", "disk_load"):
            out = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True, text=True,
                                 cwd=ROOT, timeout=300)
            if out.returncode != 0:
                raise RuntimeError(out.stderr[-2000:])
            t_import, first, second = (float(x) for x in out.stdout.split()[-3:])
            result[label] = {"import_s": t_import, "first_call_s": first, "second_call_s": second,
                             "what": "fresh process: import of the DSL and hstu_cute.api, then two calls of one "
                                     "variant (bf16 D64 local window)"}
            print("cache", label, result[label], flush=True)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, HSTU_CUTE_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, "-c", WARMUP], env=env, capture_output=True, text=True, cwd=ROOT,
                             timeout=400)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        result["warmup"] = json.loads(out.stdout.strip().splitlines()[-1])
        print("warmup", result["warmup"], flush=True)
    return result


def example_rows(eager: str | None, compiled: str | None) -> dict:
    rows = {}
    for label, path in (("eager", eager), ("compiled", compiled)):
        if path and Path(path).exists():
            data = json.loads(Path(path).read_text())
            rows[label] = {k: data[k] for k in ("steps", "median_step_ms_second_half", "tokens_per_step")}
            rows[label]["first_loss"], rows[label]["last_loss"] = data["losses"][0], data["losses"][-1]
            rows[label]["losses"] = [round(x, 4) for x in data["losses"]]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    parser.add_argument("--example-eager")
    parser.add_argument("--example-compiled")
    parser.add_argument("--out", default=str(ROOT / "notebooks" / "gpu_results.json"))
    parser.add_argument("--skip", nargs="*", default=[], choices=["perf", "padded", "cache"])
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    import cutlass

    data = {
        "note": "Stored results of tools/notebook_results.py on a GPU; notebooks/quickstart.ipynb shows them "
                "when it runs without one.",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": args.commit,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cutlass_dsl": getattr(cutlass, "__version__", "unknown"),
    }
    if "perf" not in args.skip:
        data["forward_tflops"] = perf_rows()
    if "padded" not in args.skip:
        data["padded"] = padded_rows()
    data["training_example"] = example_rows(args.example_eager, args.example_compiled)
    if "cache" not in args.skip:
        data["module_cache"] = cache_rows()
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
