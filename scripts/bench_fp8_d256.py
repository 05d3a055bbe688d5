"""FP8 backward at D256 beside bf16, same run (H100 acceptance shape of issue 18: B8 N4096 H4 D256
causal): the 16-bit backward, the FP8 kernels (mode 2, 0 and 1; each kernel alone for mode 2),
end to end, and the training steps. ``--sweep``: mode 2's kernels with other stage counts
(compiled on the fly), between two default lines."""

import sys

from hstu_cute import bench as B

w = B.Workload("full B8 N4096 D256", 8, 4096, head_dim=256)
if "--sweep" in sys.argv:
    kv3 = dict(tile_m=64, tile_n=128, num_stages=3, persistent=True, dynamic_tiles=True)
    dq3 = dict(tile_m=128, tile_n=64, num_stages=3, persistent=True, dynamic_tiles=True)
    rows = [B.run_workload_bwd(w), B.run_workload_bwd_fp8(w, 2)]
    for tiles, kernels in ((dict(dkdv=kv3), ("dkdv",)), (None, ("dkdv",)), (dict(dq=dq3), ("dq",)), (None, ("dq",)),
                           (dict(dkdv=kv3, dq=dq3), ("dkdv", "dq"))):
        try:
            rows.append(B.run_workload_bwd_fp8(w, 2, tiles=tiles, kernels=kernels))
        except Exception as exc:  # e.g. shared memory over the limit
            print("failed", tiles, type(exc).__name__, str(exc)[:200])
    rows += [B.run_workload_bwd_fp8(w, 2), B.run_workload_bwd(w)]
else:
    rows = [B.run_workload_bwd(w)]
    for mode in (2, 0, 1):
        rows.append(B.run_workload_bwd_fp8(w, mode))
    rows += [B.run_workload_bwd_fp8(w, 2, kernels=("dkdv",)), B.run_workload_bwd_fp8(w, 2, kernels=("dq",)),
             B.run_workload_bwd_fp8(w, 2, "end2end"), B.run_training_step(w), B.run_training_step(w, quant_mode=2)]
for r in rows:
    print(f"{r['workload']:<24} {r.get('entry', ''):<24} {r['tiles']:<40} {r['ms']:.3f} ms {r['tflops']:.1f} TF")
