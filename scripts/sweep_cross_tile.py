"""Forward with one n-block stream across a CTA's tiles (cross_tile) against the per-tile loop, H100,
kernels alone, same run, two interleaved repeats: the recsys grid and the headline family.
Usage: python scripts/sweep_cross_tile.py; JSON lines to $OUT/cross_tile.jsonl."""

import json
import os

from hstu_cute import bench, variants

SHAPES = bench.recsys_grid() + [bench.headline(), bench.Workload("full B8 N4096 D64", 8, 4096, head_dim=64),
                                 bench.Workload("full B8 N4096 D256", 8, 4096, head_dim=256),
                                 bench.Workload("full B8 N4096 D128 fp16", 8, 4096, dtype="float16")]
out = os.path.join(os.environ.get("OUT", "."), "cross_tile.jsonl")
for w in SHAPES:
    w = bench.replace(w, sdpa=False)
    base = variants.default_hopper_fwd_tiles(w.head_dim, False)
    res = {False: [], True: []}
    for _ in range(2):
        for cross in res:
            row = bench.run_workload(w, dict(base, cross_tile=cross))
            res[cross].append(row["tflops"])
            with open(out, "a") as f:
                f.write(json.dumps(dict(row, cross_tile=cross), default=str) + "\n")
    print(f"{w.name:<36} per-tile " + " ".join(f"{t:.1f}" for t in res[False]) + " | across tiles "
          + " ".join(f"{t:.1f}" for t in res[True]), flush=True)
