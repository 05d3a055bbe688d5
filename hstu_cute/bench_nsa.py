"""``bench --grid nsa``: sparse HSTU (hstu_cute.nsa) beside our dense causal HSTU on the same
inputs, forward and forward + backward, timed in one run; the lines are times (the branches' FLOPs
differ from dense attention's, so the ratio to dense is the measure: issue 44's bar is 6x at 64K
forward + backward).

Workloads: N 8K / 16K / 32K / 64K with as many sequences as make 64K tokens, H4 D128 bf16, in the
NSA paper's configuration and the founding Triton design's (hstu_cute.nsa.PAPER, SEED).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .nsa import PAPER, SEED, NSAConfig

TOKENS = 65536


@dataclass(frozen=True)
class NSAWorkload:
    name: str
    seqlen: int
    cfg: NSAConfig
    heads: int = 4
    head_dim: int = 128

    @property
    def batch(self) -> int:
        return max(1, TOKENS // self.seqlen)


def nsa_grid() -> list[NSAWorkload]:
    """The acceptance shape first (64K, the paper's configuration), then shorter and the seed's."""
    grid = [NSAWorkload(f"N{n // 1024}K paper", n, PAPER) for n in (65536, 32768, 16384, 8192)]
    return grid + [NSAWorkload(f"N{n // 1024}K seed", n, SEED) for n in (65536, 16384)]


def run_nsa(w: NSAWorkload, direction: str = "fwd") -> dict:
    """One row: ours sparse and ours dense (causal) on the same inputs; ``fwd`` (no grad) or
    ``fwd+bwd`` (autograd, the output's gradient random, the inputs' gradients dropped each call)."""
    from .bench import time_interleaved
    from .nn import hstu_attention
    from .nsa import hstu_nsa_attn

    gen = torch.Generator(device="cuda").manual_seed(2)
    backward = direction == "fwd+bwd"
    tokens = w.batch * w.seqlen
    q, k, v = ((torch.rand((tokens, w.heads, w.head_dim), generator=gen, device="cuda") * 2 - 1)
               .to(torch.bfloat16).requires_grad_(backward) for _ in range(3))
    gates = torch.rand((tokens, w.heads, 3), generator=gen, device="cuda").to(torch.bfloat16).requires_grad_(backward)
    offsets = torch.arange(0, w.batch + 1, dtype=torch.int32, device="cuda") * w.seqlen
    alpha = w.head_dim ** -0.5
    grad = torch.randn_like(q) if backward else None

    def timed(call):
        def run():
            if backward:
                q.grad = k.grad = v.grad = gates.grad = None
                call().backward(grad)
            else:
                with torch.no_grad():
                    call()
        return run

    sparse = timed(lambda: hstu_nsa_attn(q, k, v, offsets, w.seqlen, gates, alpha=alpha, cfg=w.cfg))
    dense = timed(lambda: hstu_attention(q, k, v, offsets, w.seqlen, alpha=alpha))
    sparse(), dense()
    times = time_interleaved(dict(sparse=sparse, dense=dense), rounds=2, warmup=2, reps=5)
    (ms_sparse, iqr), (ms_dense, _) = times["sparse"], times["dense"]
    return dict(workload=w.name, direction=direction, batch=w.batch, seqlen=w.seqlen, heads=w.heads,
                head_dim=w.head_dim, cfg=vars(w.cfg), ms=ms_sparse, iqr_ms=iqr, dense_ms=ms_dense,
                x_dense=ms_dense / ms_sparse)
