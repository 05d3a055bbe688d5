"""Device time per kernel of one block-sparse call (torch.profiler), forward and forward +
backward, on bench --grid blocksparse workloads: how much of a call is the block mask's table
building and how much the attention kernels. Usage: python tools/sparse_profile.py [N ...]"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from hstu_cute import hstu_attn_varlen_func
from hstu_cute.bench_sparse import SparseWorkload, kept_blocks
from hstu_cute.block_mask import BlockMask


def main(seqlens):
    for n in seqlens:
        w = SparseWorkload(f"B8 N{n} causal 10%", 8, n, 0.10)
        tokens = w.batch * n
        q, k, v = (torch.randn(tokens, w.heads, w.head_dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        offsets = torch.arange(0, w.batch + 1, dtype=torch.int32, device="cuda") * n
        bm = BlockMask.from_dense(kept_blocks(w), w.block, w.block)
        kw = dict(seq_offsets_q=offsets, seq_offsets_k=offsets, max_seqlen_q=n, max_seqlen_k=n, window_size=(-1, 0),
                  alpha=0.1, block_mask=bm)
        g = torch.randn_like(q)
        for direction in ("fwd", "fwd+bwd"):
            def call():
                if direction == "fwd":
                    with torch.no_grad():
                        hstu_attn_varlen_func(q, k, v, **kw)
                else:
                    hstu_attn_varlen_func(q, k, v, **kw).backward(g)
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            from hstu_cute.bench import time_cuda
            if direction == "fwd":
                from hstu_cute.bench_sparse import run_sparse
                print(f"N{n} {direction}: time_cuda {time_cuda([call])[0]:.3f} ms;",
                      {k: round(x, 3) for k, x in run_sparse(w, flex=False).items() if k in ("ms", "dense_ms")})
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    call()
                torch.cuda.synchronize()
            print(f"=== N{n} {direction} (5 calls) ===")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [8192, 16384])
