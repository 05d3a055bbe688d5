"""Drive the FP8 backward kernels for Nsight Compute (issue 18): B8 N4096 H4 D128 causal, quant
mode 2 (or the mode given), the dK/dV and dQ kernels (or with ``fused`` the fused kernel) three
times on operands made beforehand.

    ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:DkDvFp8 \\
        --section WarpStateStats --section SourceCounters python scripts/ncu_fp8_bwd.py [MODE [fused]]
"""

import sys

import torch

from hstu_cute import bench, launch
from hstu_cute.testing import call_record

MODE = int(sys.argv[1]) if len(sys.argv) > 1 else 2
FUSED = len(sys.argv) > 2 and sys.argv[2] == "fused"
w = bench.Workload("full B8 N4096 D128", 8, 4096, head_dim=128)
kw = {k: v for k, v in bench.make_inputs(w).items() if not k.startswith("_")}
call, rab = call_record(**kw, quant_mode=MODE)
dout = (torch.rand_like(kw["q"]) - 0.5) * 0.02
operands = launch.fp8_backward_operands(dout, kw["q"], kw["k"], kw["v"], call)
for _ in range(3):
    launch.backward_fp8(dout, kw["q"], kw["k"], kw["v"], rab, call, operands=operands, fused=FUSED)
torch.cuda.synchronize()
