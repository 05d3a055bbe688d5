"""One block-sparse forward timed three ways in one process: CUDA events per call (bench's
time_cuda), wall clock over queued calls, and the profiler's kernel time; N calls each."""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hstu_cute import hstu_attn_varlen_func
from hstu_cute.bench import time_cuda
from hstu_cute.bench_sparse import SparseWorkload, kept_blocks
from hstu_cute.block_mask import BlockMask

n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
w = SparseWorkload("x", 8, n, 0.10)
q, k, v = (torch.rand(8 * n, 32, 128, device="cuda").mul(2).sub(1).to(torch.bfloat16) for _ in range(3))
offsets = torch.arange(0, 9, dtype=torch.int32, device="cuda") * n
bm = BlockMask.from_dense(kept_blocks(w), 128, 128)
kw = dict(seq_offsets_q=offsets, seq_offsets_k=offsets, max_seqlen_q=n, max_seqlen_k=n, window_size=(-1, 0),
          alpha=128 ** -0.5)
for label, extra in (("sparse", dict(block_mask=bm)), ("dense", {})):
    def call():
        with torch.no_grad():
            hstu_attn_varlen_func(q, k, v, **kw, **extra)
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    ev = time_cuda([call], reps=30)[0]
    t = time.perf_counter()
    for _ in range(30):
        call()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / 30 * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(30):
            call()
        torch.cuda.synchronize()
    kern = sum(e.device_time_total for e in prof.key_averages() if "kernel_cutlass" in e.key) / 30 / 1e3
    print(f"{label} N{n}: events {ev:.3f} ms, wall {wall:.3f} ms, profiler kernel {kern:.3f} ms")
