"""Tile claims (dynamic) against the static snake, H100: forward and backward (kernels alone) TF/s
per workload of the recsys grid and the headline family, same run. Usage: python
scripts/sweep_dynamic.py [fwd|bwd|both]; JSON lines to $OUT/dynamic.jsonl."""

import json
import os
import sys

from hstu_cute import bench, variants

MODE = sys.argv[1] if len(sys.argv) > 1 else "both"
SHAPES = bench.recsys_grid() + [bench.Workload("full B16 N2048", 16, 2048), bench.headline(),
                                 bench.Workload("full B8 N4096 D256", 8, 4096, head_dim=256)]
out = os.path.join(os.environ.get("OUT", "."), "dynamic.jsonl")


def record(w, direction, name, row):
    row.update(scheduler=name, direction=direction)
    print(f"{w.name:<36} {direction} {name:<8} {row['tflops']:7.1f} TF/s", flush=True)
    with open(out, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


for w in SHAPES:
    w = bench.replace(w, sdpa=False)
    for name, dynamic in (("static", False), ("dynamic", True)):
        if MODE in ("fwd", "both"):
            tiles = dict(variants.default_hopper_fwd_tiles(w.head_dim, False), dynamic_tiles=dynamic)
            record(w, "fwd", name, bench.run_workload(w, tiles))
        # Backward rows where the dK/dV + dQ pair runs (D128 keys below the fused kernel's length).
        if MODE in ("bwd", "both") and w.head_dim == 128 and w.max_len < variants.FUSED_MIN_SEQLEN_K:
            tiles = {r: dict(variants.hopper_bwd_tiles(r, w.head_dim, False), dynamic_tiles=dynamic)
                     for r in ("dq", "dkdv")}
            record(w, "bwd", name, bench.run_workload_bwd(w, tiles_dq=tiles["dq"], tiles_dkdv=tiles["dkdv"]))
