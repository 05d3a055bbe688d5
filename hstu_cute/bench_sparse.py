"""``bench --grid blocksparse``: the block-sparse forward (hstu_cute.BlockMask) beside our dense
call on the same inputs and FlexAttention (softmax) with the same kept blocks, timed in one run.
TF/s count the allowed pairs only (4 * H * D per pair): the kept blocks, cut by the causal mask.

Masks: each block kept with probability ``density``; a causal mask draws among the causal blocks
and always keeps the diagonal, so no row is empty (HBSA's and FlexAttention's benchmarks do the
same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_mask import BlockMask, blocks_for


@dataclass(frozen=True)
class SparseWorkload:
    name: str
    batch: int
    seqlen: int
    density: float
    causal: bool = True
    heads: int = 32
    head_dim: int = 128
    block: int = 128


def sparse_grid() -> list[SparseWorkload]:
    """The acceptance shape first (B8 H32 N16384 D128, block 128, causal, ~10%), then the
    densities and lengths around it."""
    g = [SparseWorkload("B8 N16384 causal 10%", 8, 16384, 0.10)]
    g += [SparseWorkload(f"B8 N16384 causal {int(100 * d)}%", 8, 16384, d) for d in (0.05, 0.30)]
    g += [SparseWorkload("B8 N16384 full 10%", 8, 16384, 0.10, causal=False),
          SparseWorkload("B8 N8192 causal 10%", 8, 8192, 0.10),
          SparseWorkload("B2 N32768 causal 10%", 2, 32768, 0.10),
          SparseWorkload("B8 N16384 causal 100%", 8, 16384, 1.0)]
    return g


def kept_blocks(w: SparseWorkload, seed: int = 0) -> torch.Tensor:
    """(B, 1, M, M) bool on the GPU: the workload's kept blocks."""
    m = blocks_for(w.seqlen, w.block)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kept = torch.rand((w.batch, 1, m, m), generator=gen, device="cuda") < w.density
    if w.causal:
        i = torch.arange(m, device="cuda")
        kept = (kept & (i[None, :] <= i[:, None])) | (i[None, :] == i[:, None])
    return kept


def allowed_pairs(w: SparseWorkload, kept: torch.Tensor) -> int:
    """Pairs (row, key) inside kept blocks that the mask allows (square blocks, full lengths)."""
    if not w.causal:
        return int(kept.sum()) * w.block * w.block
    m = kept.shape[-1]
    i = torch.arange(m, device=kept.device)
    below = int((kept & (i[None, :] < i[:, None])).sum())
    diagonal = int((kept & (i[None, :] == i[:, None])).sum())
    return below * w.block * w.block + diagonal * w.block * (w.block + 1) // 2


def _flex_line(w: SparseWorkload, kept: torch.Tensor, q, k, v):
    """ms of FlexAttention's forward with the same kept blocks (diagonal blocks partial under a
    causal mask_mod, the others full), or None when it is not importable here."""
    try:
        from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    from .bench import time_cuda

    m = kept.shape[-1]
    i = torch.arange(m, device=kept.device)
    heads = kept.expand(w.batch, w.heads, m, m)
    diag = heads & (i[None, :] == i[:, None]) if w.causal else torch.zeros_like(heads)
    full = heads & ~diag
    partial_lists = BlockMask.from_dense(diag, w.block, w.block)
    full_lists = BlockMask.from_dense(full, w.block, w.block)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    fbm = FlexBlockMask.from_kv_blocks(partial_lists.kv_count, partial_lists.kv_index, full_lists.kv_count,
                                       full_lists.kv_index, BLOCK_SIZE=w.block,
                                       mask_mod=causal if w.causal else None)
    flex = torch.compile(flex_attention)
    qt, kt, vt = (x.view(w.batch, w.seqlen, w.heads, w.head_dim).transpose(1, 2) for x in (q, k, v))
    flex(qt, kt, vt, block_mask=fbm)
    ms, _ = time_cuda([lambda: flex(qt, kt, vt, block_mask=fbm)])
    return ms


def run_sparse(w: SparseWorkload, flex: bool = True) -> dict:
    """One row: ours sparse, ours dense (the same inputs, no block mask), FlexAttention."""
    from .api import hstu_attn_varlen_func
    from .bench import time_cuda

    tokens = w.batch * w.seqlen
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = ((torch.rand((tokens, w.heads, w.head_dim), generator=gen, device="cuda") * 2 - 1).to(torch.bfloat16)
               for _ in range(3))
    offsets = torch.arange(0, w.batch + 1, dtype=torch.int32, device="cuda") * w.seqlen
    kept = kept_blocks(w)
    bm = BlockMask.from_dense(kept, w.block, w.block)
    kw = dict(seq_offsets_q=offsets, seq_offsets_k=offsets, max_seqlen_q=w.seqlen, max_seqlen_k=w.seqlen,
              window_size=(-1, 0) if w.causal else (-1, -1), alpha=1.0 / w.head_dim ** 0.5)
    with torch.no_grad():
        sparse = lambda: hstu_attn_varlen_func(q, k, v, **kw, block_mask=bm)  # noqa: E731
        dense = lambda: hstu_attn_varlen_func(q, k, v, **kw)  # noqa: E731
        sparse(), dense()
        ms_sparse, iqr = time_cuda([sparse])
        ms_dense, _ = time_cuda([dense])
        ms_flex = _flex_line(w, kept, q, k, v) if flex else None
    pairs = allowed_pairs(w, kept)
    dense_pairs = w.batch * (w.seqlen * (w.seqlen + 1) // 2 if w.causal else w.seqlen * w.seqlen)
    per_ms = 4.0 * w.heads * w.head_dim * pairs / 1e9
    return dict(workload=w.name, density=pairs / dense_pairs, ms=ms_sparse, iqr_ms=iqr, tflops=per_ms / ms_sparse,
                dense_ms=ms_dense, dense_tflops=4.0 * w.heads * w.head_dim * dense_pairs / 1e9 / ms_dense,
                flex_ms=ms_flex, flex_tflops=per_ms / ms_flex if ms_flex else None,
                x_dense=ms_dense / ms_sparse, x_flex=(ms_flex / ms_sparse) if ms_flex else None)
