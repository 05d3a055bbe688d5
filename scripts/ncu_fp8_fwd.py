"""Drive the FP8 forward kernel for Nsight Compute (issue 16): B8 N4096 H4 causal, head dim D
(default 128), the P-cast kernel (pre-quantized per-tensor e4m3 inputs, V^T made beforehand) or
with ``scaled`` quant mode 2's scaled-P kernel, three times.

    ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:ForwardFp8 \\
        --section ComputeWorkloadAnalysis --section InstructionStats python scripts/ncu_fp8_fwd.py [D [scaled]]
"""

import sys

import torch

from hstu_cute import bench, launch
from hstu_cute.quantize import QuantMode, quantize_batch
from hstu_cute.testing import call_record

D = int(sys.argv[1]) if len(sys.argv) > 1 else 128
SCALED = len(sys.argv) > 2 and sys.argv[2] == "scaled"
w = bench.Workload(f"full B8 N4096 D{D}", 8, 4096, head_dim=D)
kw = {k: v for k, v in bench.make_inputs(w).items() if not k.startswith("_")}
if SCALED:
    args, descales, mode = (kw["q"], kw["k"], kw["v"]), (None, None, None), int(QuantMode.PER_BLOCK)
else:
    quantized = quantize_batch(kw, QuantMode.PER_TENSOR)
    args, descales, mode = tuple(x.data for x in quantized), tuple(x.scale for x in quantized), -1
call, rab = call_record(**dict(kw, q=args[0], k=args[1], v=args[2]), quant_mode=mode,
                        **dict(zip(("descale_q", "descale_k", "descale_v"), descales)))
q8, k8, fp8 = launch.prepare_fp8(*args, call)
for _ in range(3):
    launch.forward(q8, k8, None, rab, call, fp8=fp8)
torch.cuda.synchronize()
