import json, sys, torch
from hstu_cute import bench as B
w = B.Workload("full B8 N4096 D128", 8, 4096, head_dim=128)
rows = [B.run_workload_bwd(w)]
for m in (2, 1):
    for ks in (("dkdv", "dq"), ("dkdv",), ("dq",)):
        rows.append(B.run_workload_bwd_fp8(w, m, kernels=ks))
    rows.append(B.run_workload_bwd_fp8(w, m, "end2end"))
rows += [B.run_training_step(w), B.run_training_step(w, quant_mode=2), B.run_training_step(w, quant_mode=1)]
for r in rows:
    print(f"{r['workload']:<24} {r.get('entry',''):<26} {r['tiles'][-12:]:<12} {r['ms']:.3f} ms {r['tflops']:.1f} TF")
