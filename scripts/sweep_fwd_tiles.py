"""Forward tile sweep on the short rows of the recsys grid (H100): TF/s per (tile_m, tile_n,
num_stages, q_stages). Usage: python scripts/sweep_fwd_tiles.py; JSON lines to $OUT/fwd_tiles.jsonl."""

import json
import os

from hstu_cute import bench

SHAPES = [w for w in bench.recsys_grid() if w.max_len <= 512 or w.lengths != "full"]
TILES = [(128, 128, 2, 2), (128, 64, 2, 2), (128, 64, 3, 2), (128, 64, 4, 2), (128, 96, 2, 2)]
out = os.path.join(os.environ.get("OUT", "."), "fwd_tiles.jsonl")
for w in SHAPES:
    w = bench.replace(w, sdpa=False)
    for tile_m, tile_n, stages, q_stages in TILES:
        tiles = dict(tile_m=tile_m, tile_n=tile_n, num_stages=stages, q_stages=q_stages, ptxas_opt=2,
                     dynamic_tiles=True)
        try:
            row = bench.run_workload(w, tiles)
        except Exception as e:  # a shape the kernel does not take: record it and go on
            print(f"{w.name:<36} {tile_m}x{tile_n} s{stages} q{q_stages}: {type(e).__name__}: {str(e)[:120]}")
            continue
        print(f"{w.name:<36} {tile_m}x{tile_n} s{stages} q{q_stages} {row['tflops']:7.1f} TF/s", flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
