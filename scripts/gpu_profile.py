"""Where the backward time goes: per-kernel device times (torch.profiler) of the default backward
at B8 N4096 H4 causal bf16, D128 (fused) and D256 (wide + dQ). With ``ncu`` as argument it runs
one backward inside an NVTX range named ``prof`` for an outer ``ncu --nvtx-include prof/``."""

import sys

import torch

from hstu_cute import bench

head_dims = [int(d) for d in (sys.argv[2] if len(sys.argv) > 2 else "128,256").split(",")]
calls = {d: bench.backward_call(bench.replace(bench.headline(), head_dim=d))[0] for d in head_dims}
for fn in calls.values():
    fn()
torch.cuda.synchronize()

if len(sys.argv) > 1 and sys.argv[1] == "ncu":
    for d, fn in calls.items():
        torch.cuda.nvtx.range_push("prof")
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    sys.exit(0)

from torch.profiler import ProfilerActivity, profile

for d, fn in calls.items():
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    print(f"=== D{d} backward, 5 calls ===")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
