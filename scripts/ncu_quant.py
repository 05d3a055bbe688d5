"""DRAM bytes, L2 hit rate and duration of the slot quantizer's launches for one quant mode at
B8 N4096 H4 (the acceptance shape), for ncu (modes 3-5: did the cooperative launch read each
tensor's second pass from L2?):

    ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum \
        -k regex:Quantize python scripts/ncu_quant.py [MODE] [D]
"""

import sys

import torch

from hstu_cute import bench as B
from hstu_cute import launch

mode, dim = (int(a) for a in (sys.argv[1:3] + ["5", "128"][len(sys.argv[1:3]):]))
kw = B.make_inputs(B.Workload(f"full B8 N4096 D{dim}", 8, 4096, head_dim=dim))
offsets = (kw["seq_offsets_q"], kw["seq_offsets_k"], kw["seq_offsets_k"])
lens = (kw["max_seqlen_q"], kw["max_seqlen_k"], kw["max_seqlen_k"])
for _ in range(2):
    launch.quantize_for(mode, "forward", (kw["q"], kw["k"], kw["v"]), offsets, lens)
torch.cuda.synchronize()
