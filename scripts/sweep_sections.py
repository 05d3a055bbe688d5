"""Sweep the L2 budget of the persistent kernels' tile-walk sections (launch.L2_SECTION_BYTES)
over the recsys grid and the headline shape: forward and backward kernels, TF/s per budget.

    python scripts/sweep_sections.py [budget_mb ...]      (0: one (batch, head) pair per section;
                                                          -1: one section over every pair)
Writes JSON lines to $OUT/sections.jsonl (or ./sections.jsonl)."""

import json
import os
import sys

from hstu_cute import bench, launch

budgets = [float(a) for a in sys.argv[1:]] or [0, 8, 32, -1]
workloads = [bench.replace(w, sdpa=False) for w in bench.recsys_grid()] + [bench.replace(bench.headline(), sdpa=False)]
out = os.path.join(os.environ.get("OUT", "."), "sections.jsonl")
for w in workloads:
    for mb in budgets:
        launch.L2_SECTION_BYTES = 2**62 if mb < 0 else int(mb * 2**20)
        for run in (bench.run_workload, bench.run_workload_bwd):
            row = dict(run(w), l2_section_mb=mb)
            print(f"{row['workload']:<44} budget {mb:>5} MB  {row['tflops']:7.1f} TF/s  {row['ms']:.3f} ms", flush=True)
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
