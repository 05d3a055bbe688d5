"""``bench --grid blocksparse``: the block-sparse forward (hstu_cute.BlockMask), and forward +
backward, beside our dense call on the same inputs and FlexAttention (softmax) with the same kept
blocks, timed in one run. TF/s count the allowed pairs only (4 * H * D per pair, 3.5x that forward +
backward): the kept blocks, cut by the causal mask.

Masks: each block kept with probability ``density``; a causal mask draws among the causal blocks
and always keeps the diagonal, so no row is empty (HBSA's and FlexAttention's benchmarks do the
same).
"""

from __future__ import annotations

import warnings
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
    # A jagged batch: each sequence's length (multiples of ``block``; ``seqlen`` is the longest),
    # its targets, and the kept blocks as a local band of ``band`` blocks plus a global prefix of
    # ``prefix`` blocks (causal) instead of random ones.
    lengths: tuple = ()
    num_targets: int = 0
    band: int = 0
    prefix: int = 0


def recsys_workload(batch: int = 64, longest: int = 16384, heads: int = 4, seed: int = 0) -> SparseWorkload:
    """The recommender shape: jagged users up to ``longest`` events (uniform in whole 128-key
    blocks from 1K), 256 targets each, H4 D128, a 1K local band plus a 512-key global prefix."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(8, longest // 128 + 1, (batch,), generator=gen)
    blocks[0] = longest // 128
    return SparseWorkload(f"B{batch} jagged <={longest // 1024}K H{heads} band+prefix targets", batch, longest, 0.0,
                          heads=heads, lengths=tuple(int(b) * 128 for b in blocks), num_targets=256, band=8,
                          prefix=4)


def sparse_grid() -> list[SparseWorkload]:
    """The acceptance shape first (B8 H32 N16384 D128, block 128, causal, ~10%), then the
    densities and lengths around it."""
    g = [SparseWorkload("B8 N16384 causal 10%", 8, 16384, 0.10)]
    g += [SparseWorkload(f"B8 N16384 causal {int(100 * d)}%", 8, 16384, d) for d in (0.05, 0.30)]
    g += [SparseWorkload("B8 N16384 full 10%", 8, 16384, 0.10, causal=False),
          SparseWorkload("B8 N8192 causal 10%", 8, 8192, 0.10),
          SparseWorkload("B2 N32768 causal 10%", 2, 32768, 0.10),
          SparseWorkload("B8 N16384 causal 100%", 8, 16384, 1.0),
          # Blocks smaller than the kernels' 128 x 128 tiles: most kept tiles mix kept and
          # dropped blocks and are masked by block (NSA's selection makes such masks).
          SparseWorkload("B8 N16384 causal 10% block 64", 8, 16384, 0.10, block=64),
          recsys_workload()]
    return g


def kept_blocks(w: SparseWorkload, seed: int = 0) -> torch.Tensor:
    """(B, 1, M, M) bool on the GPU: the workload's kept blocks."""
    m = blocks_for(w.seqlen, w.block)
    i = torch.arange(m, device="cuda")
    if w.band or w.prefix:
        pattern = ((i[:, None] - i[None, :]) < w.band) | (i[None, :] < w.prefix)
        return (pattern & (i[None, :] <= i[:, None])).expand(w.batch, 1, m, m).contiguous()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kept = torch.rand((w.batch, 1, m, m), generator=gen, device="cuda") < w.density
    if w.causal:
        kept = (kept & (i[None, :] <= i[:, None])) | (i[None, :] == i[:, None])
    return kept


def _seq_lengths(w: SparseWorkload) -> list[int]:
    return list(w.lengths) if w.lengths else [w.seqlen] * w.batch


def allowed_pairs(w: SparseWorkload, kept: torch.Tensor) -> int:
    """Pairs (row, key) inside kept blocks that the mask allows (square blocks, lengths in whole
    blocks; a jagged batch's targets are not taken off: they cut a few hundred rows per user)."""
    if w.lengths:
        m = kept.shape[-1]
        live = torch.arange(m, device=kept.device)[None, :] < torch.tensor(w.lengths, device=kept.device)[:, None] // w.block
        kept = kept & live[:, None, :, None] & live[:, None, None, :]
    if not w.causal:
        return int(kept.sum()) * w.block * w.block
    m = kept.shape[-1]
    i = torch.arange(m, device=kept.device)
    below = int((kept & (i[None, :] < i[:, None])).sum())
    diagonal = int((kept & (i[None, :] == i[:, None])).sum())
    return below * w.block * w.block + diagonal * w.block * (w.block + 1) // 2


def _flex_call(w: SparseWorkload, kept: torch.Tensor, q, k, v):
    """A closure running FlexAttention with the same kept blocks (diagonal blocks partial under a
    causal mask_mod, the others full) on (B, H, N, D) views of ``q, k, v``, or None when it is not
    importable here."""
    try:
        from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
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
    # Compiled afresh for each workload with static shapes: after a few shapes torch.compile turns
    # them dynamic, and its dynamic-shape backward ran 1.25x slower (H200, session 31: 28.9 ms
    # against 23.0 ms at B8 N16384 10%), which would flatter our ratio.
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (x.view(w.batch, w.seqlen, w.heads, w.head_dim).transpose(1, 2) for x in (q, k, v))
    return lambda: flex(qt, kt, vt, block_mask=fbm).transpose(1, 2).reshape(q.shape)


def _kernel_ms(call, reps: int = 10) -> float:
    """Device time per call of our kernels alone (the profiler's sum over kernels named
    ``kernel_cutlass*``): the call's CUDA-event time also holds whatever else it queues (the mask's
    tables on a first call, autograd's accumulations, gaps), 0.2 ms at B8 N16384 10% (session 31)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if e.key.startswith("kernel_cutlass")) / reps / 1e3


def run_sparse(w: SparseWorkload, direction: str = "fwd", flex: bool = True) -> dict:
    """One row: ours sparse, ours dense (the same inputs, no block mask), FlexAttention; the
    forward alone (``fwd``, no grad) or forward + backward (``fwd+bwd``: autograd, the output's
    gradient random, the inputs' gradients dropped before each call)."""
    from .api import hstu_attn_varlen_func
    from .bench import _STEP_FLOPS, time_interleaved

    lengths = _seq_lengths(w)
    tokens = sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(1)
    backward = direction == "fwd+bwd"
    q, k, v = ((torch.rand((tokens, w.heads, w.head_dim), generator=gen, device="cuda") * 2 - 1).to(torch.bfloat16)
               .requires_grad_(backward) for _ in range(3))
    grad = torch.randn_like(q) if backward else None
    offsets = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    kept = kept_blocks(w)
    bm = BlockMask.from_dense(kept, w.block, w.block)
    kw = dict(seq_offsets_q=offsets, seq_offsets_k=offsets, max_seqlen_q=w.seqlen, max_seqlen_k=w.seqlen,
              window_size=(-1, 0) if w.causal else (-1, -1), alpha=1.0 / w.head_dim ** 0.5)
    if w.num_targets:
        kw["num_targets"] = torch.full((w.batch,), w.num_targets, dtype=torch.int32, device="cuda")

    def timed(call):
        if not backward:
            def run():
                with torch.no_grad():
                    call()
            return run

        def step():
            q.grad = k.grad = v.grad = None
            call().backward(grad)
        return step

    sparse = timed(lambda: hstu_attn_varlen_func(q, k, v, **kw, block_mask=bm))
    dense = timed(lambda: hstu_attn_varlen_func(q, k, v, **kw))
    lines = dict(sparse=sparse, dense=dense)
    flex_call = _flex_call(w, kept, q, k, v) if flex and not w.lengths else None
    if flex_call is not None:
        lines["flex"] = timed(flex_call)
    for name, fn in list(lines.items()):
        try:
            fn()
        except Exception as e:  # a reference line that cannot run the shape is left out, not the row
            if name != "flex":
                raise
            warnings.warn(f"{w.name}: FlexAttention did not run ({type(e).__name__}: {e}); no Flex line")
            del lines[name]
    times = time_interleaved(lines)
    (ms_sparse, iqr), (ms_dense, _) = times["sparse"], times["dense"]
    ms_flex = times["flex"][0] if "flex" in times else None
    kernel_ms = _kernel_ms(sparse)
    pairs = allowed_pairs(w, kept)
    dense_pairs = sum(n * (n + 1) // 2 if w.causal else n * n for n in lengths)
    # The forward's FLOPs, or a training step's (3.5x: bench's convention, docs/operator.md).
    per_pair = 4.0 * w.heads * w.head_dim * _STEP_FLOPS["step" if backward else "fwd"] / 1e9
    return dict(workload=w.name, direction=direction, density=pairs / dense_pairs, ms=ms_sparse, iqr_ms=iqr,
                kernel_ms=kernel_ms,
                tflops=per_pair * pairs / ms_sparse, dense_ms=ms_dense, dense_tflops=per_pair * dense_pairs / ms_dense,
                flex_ms=ms_flex, flex_tflops=per_pair * pairs / ms_flex if ms_flex else None,
                x_dense=ms_dense / ms_sparse, x_flex=(ms_flex / ms_sparse) if ms_flex else None)
