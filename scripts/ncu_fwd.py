"""Drive one forward workload of the recsys grid for Nsight Compute (H100).

Usage: python scripts/ncu_fwd.py NAME_SUBSTRING [TILE_M TILE_N STAGES Q_STAGES] [--backward]
Runs the forward (or the backward kernels) three times: the first compiles or loads the module, so
profile with ``ncu --launch-skip 2 --launch-count 1 -k regex:Forward``.
"""

import sys

import torch

from hstu_cute import bench

args = [a for a in sys.argv[1:] if not a.startswith("--")]
w = next(w for w in bench.recsys_grid() if args[0] in w.name)
w = bench.replace(w, sdpa=False)
tiles = None
if len(args) >= 5:
    tm, tn, st, qs = map(int, args[1:5])
    tiles = dict(tile_m=tm, tile_n=tn, num_stages=st, q_stages=qs, ptxas_opt=2)
if "--backward" in sys.argv:
    call, _, _ = bench.backward_call(w)
    for _ in range(3):
        call()
else:
    row = bench.run_workload(w, tiles, sets=1)
    print(f"{w.name} tiles={tiles}: {row['tflops']:.1f} TF/s")
torch.cuda.synchronize()
