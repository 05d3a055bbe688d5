"""Forward tile claims (dynamic) against the static snake, H100: TF/s per workload of the recsys
grid and the headline family, kernels alone, same run. Usage: python scripts/sweep_dynamic.py;
JSON lines to $OUT/dynamic.jsonl."""

import json
import os

from hstu_cute import bench, variants

SHAPES = bench.recsys_grid() + [bench.Workload("full B16 N2048", 16, 2048), bench.headline(),
                                 bench.Workload("full B8 N4096 D256", 8, 4096, head_dim=256)]
out = os.path.join(os.environ.get("OUT", "."), "dynamic.jsonl")
for w in SHAPES:
    w = bench.replace(w, sdpa=False)
    base = variants.default_hopper_fwd_tiles(w.head_dim, False)
    for name, tiles in (("static", dict(base, dynamic_tiles=False)), ("dynamic", dict(base, dynamic_tiles=True))):
        row = bench.run_workload(w, tiles)
        row["scheduler"] = name
        print(f"{w.name:<36} {name:<8} {row['tflops']:7.1f} TF/s", flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
