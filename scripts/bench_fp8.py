"""FP8 forward lines beside the bf16 forward, same run (issue 16): B8 N4096 H4 causal at head dims
64, 128, 256. The P-cast kernel alone, the pre-quantized entry (V^T made per call), quant_mode 0,
and for modes 1, 2 and 5 the kernel alone, the quantizers alone (GB/s) and both (end to end).
Usage: python scripts/bench_fp8.py [D ...]; JSON lines to $OUT/fp8.jsonl."""

import json
import os
import sys

from hstu_cute import bench

out = os.path.join(os.environ.get("OUT", "."), "fp8.jsonl")
dims = [int(a) for a in sys.argv[1:]] or [64, 128, 256]
entries = os.environ.get("FP8_ENTRIES", ",".join(bench.FP8_ENTRIES)).split(",")
for d in dims:
    w = bench.replace(bench.headline(), name=f"full B8 N4096 D{d}", head_dim=d)
    rows = [bench.run_workload(w)] + [bench.run_workload_fp8(w, e) for e in entries]
    base = rows[0]["tflops"]
    for row in rows:
        extra = f"  {row['gbps']:.0f} GB/s" if "gbps" in row else ""
        print(f"{row['workload']:<24} {row.get('entry', 'bf16'):<18} {row['tflops']:7.1f} TF/s "
              f"({row['tflops'] / base:4.2f}x bf16)  {row['ms']:.3f} ms{extra}", flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
