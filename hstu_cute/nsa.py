"""Sparse HSTU for long histories, NSA-style (docs/nsa.md): three branches over a jagged batch,
each HSTU attention (SiLU, no normalization), gated per token and head and summed.

* **compressed:** keys and values mean-pooled over blocks of ``cmp_block`` keys every
  ``cmp_stride``; query ``i`` attends the compressed token of block ``c`` once the block is
  complete (``c * cmp_stride + cmp_block - 1 <= i``);
* **selected:** per query block of ``sel_block`` rows, the ``top_n`` key blocks of ``sel_block``
  keys with the largest importance (the compressed branch's SiLU scores, summed over the block's
  rows and over the compressed tokens that overlap each key block), the first ``num_initial``
  and the last ``num_local`` causal blocks always among them; attended in full under the causal
  mask through the block-sparse kernels (:class:`hstu_cute.BlockMask`);
* **window:** the last ``window`` keys up to and including the query.

``out = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa``. Every branch divides its SiLU by the same
``scaling_seqlen`` (default ``max_seqlen``), so the branches add as parts of one HSTU attention.
Gradients reach q, k, v (through the pooling too) and the gates; the selection is a discrete
choice and passes none, as in NSA.

The pieces are public: :func:`compress_kv`, :func:`compressed_attention` (its output and the
block importance), :func:`select_blocks` (a BlockMask), and :func:`hstu_nsa_attn` composes them
with the selected and window branches (:func:`hstu_cute.nn.hstu_attention`: the kernels on CUDA,
the PyTorch reference on CPU). :func:`hstu_nsa_reference` is the oracle, written from the
definitions above with dense masks.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .block_mask import BLOCK_MULTIPLE, BlockMask, blocks_for
from .nn import CAUSAL, HSTUBlock, hstu_attention
from .validation import fail

__all__ = ["NSAConfig", "PAPER", "SEED", "compress_kv", "compressed_attention", "select_blocks", "hstu_nsa_attn",
           "hstu_nsa_reference", "HSTUSparseBlock", "hstu_nsa_block_reference"]


@dataclasses.dataclass(frozen=True)
class NSAConfig:
    """The branches' block sizes and budgets (defaults: the NSA paper's configuration)."""

    cmp_block: int = 32
    cmp_stride: int = 16
    sel_block: int = 64
    top_n: int = 16
    window: int = 512
    num_initial: int = 1
    num_local: int = 2

    def __post_init__(self):
        for name in ("cmp_block", "cmp_stride", "sel_block", "top_n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(ValueError, f"NSAConfig.{name}", "a positive int", repr(value))
        for name in ("window", "num_initial", "num_local"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                fail(ValueError, f"NSAConfig.{name}", "an int >= 0", repr(value))
        if self.cmp_stride > self.cmp_block:
            fail(ValueError, "NSAConfig.cmp_stride", f"<= cmp_block ({self.cmp_block}): every key in a block",
                 self.cmp_stride)
        if self.sel_block % BLOCK_MULTIPLE:
            fail(ValueError, "NSAConfig.sel_block", f"a multiple of {BLOCK_MULTIPLE} (the kernels' tiles)",
                 self.sel_block)
        if self.num_initial + self.num_local > self.top_n:
            fail(ValueError, "NSAConfig.num_initial + num_local", f"<= top_n ({self.top_n})",
                 self.num_initial + self.num_local)


#: The NSA paper's configuration (compression 32 / stride 16, selection 64, top-16, window 512).
PAPER = NSAConfig()
#: The founding Triton BSA design's (block 32, top-4, no window).
SEED = NSAConfig(cmp_block=32, cmp_stride=32, sel_block=32, top_n=4, window=0, num_initial=1, num_local=1)


def _lengths(seq_offsets: torch.Tensor) -> torch.Tensor:
    return (seq_offsets[1:] - seq_offsets[:-1]).to(torch.int64)


def compressed_counts(lengths: torch.Tensor, cfg: NSAConfig) -> torch.Tensor:
    """Compressed tokens per sequence: the complete blocks, ``(L - cmp_block) // cmp_stride + 1``
    (0 below one block)."""
    return torch.where(lengths >= cfg.cmp_block, (lengths - cfg.cmp_block) // cfg.cmp_stride + 1,
                       torch.zeros_like(lengths))


def _token_positions(seq_offsets: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position) of each of ``tokens`` jagged rows, on the device without a sync."""
    lengths = _lengths(seq_offsets)
    batch = torch.repeat_interleave(torch.arange(lengths.numel(), device=seq_offsets.device), lengths,
                                    output_size=tokens)
    return batch, torch.arange(tokens, device=seq_offsets.device) - seq_offsets[batch].to(torch.int64)


def _padded(x: torch.Tensor, batch: torch.Tensor, pos: torch.Tensor, sequences: int, rows: int) -> torch.Tensor:
    """Jagged ``(T, ...)`` -> zero-padded ``(B, rows, ...)`` (differentiable; no sync). Where
    ``T == B * rows`` every sequence is ``rows`` long (``rows`` bounds them), so the result is a
    reshape (a view of a contiguous ``x``): the copy and its backward's gather took 0.5 ms of the
    64K forward (H200, session 38)."""
    if x.shape[0] == sequences * rows:
        return x.reshape((sequences, rows) + tuple(x.shape[1:]))
    out = x.new_zeros((sequences, rows) + tuple(x.shape[1:]))
    return out.index_put((batch, pos), x)


def compress_kv(k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor, max_seqlen: int,
                cfg: NSAConfig = PAPER) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean-pooled keys and values, padded: ``(k_cmp, v_cmp, counts)`` with ``k_cmp (B, C, H, D)``
    (``C = max(0, (max_seqlen - cmp_block) // cmp_stride + 1)``), compressed token ``c`` the mean of
    keys ``[c * cmp_stride, c * cmp_stride + cmp_block)``, and ``counts (B,)`` each sequence's
    compressed tokens (the rows past them are zero). Differentiable."""
    sequences = seq_offsets.numel() - 1
    batch, pos = _token_positions(seq_offsets, k.shape[0])
    kp = _padded(k, batch, pos, sequences, max_seqlen)
    vp = _padded(v, batch, pos, sequences, max_seqlen)
    c_max = max(0, (max_seqlen - cfg.cmp_block) // cfg.cmp_stride + 1)
    counts = compressed_counts(_lengths(seq_offsets), cfg)
    if c_max == 0:
        empty = kp.new_zeros((sequences, 0) + tuple(k.shape[1:]))
        return empty, vp.new_zeros((sequences, 0) + tuple(v.shape[1:])), counts

    def pool(x):  # (B, N, H, D) -> (B, C, H, D): windows of cmp_block rows every cmp_stride
        if cfg.cmp_block % cfg.cmp_stride:
            return x.unfold(1, cfg.cmp_block, cfg.cmp_stride).mean(dim=-1)  # (B, C, H, D, cmp_block) windows
        # A window is cmp_block / cmp_stride whole runs of cmp_stride rows: sum the runs (wide),
        # then the windows' runs. unfold's backward over every row took 0.39 ms per tensor of the
        # 64K step (H200, session 38); a run's sum has an expand for its backward.
        runs = c_max + cfg.cmp_block // cfg.cmp_stride - 1
        wide = torch.promote_types(x.dtype, torch.float32)
        run_sums = x[:, :runs * cfg.cmp_stride].unflatten(1, (runs, cfg.cmp_stride)).sum(2, dtype=wide)
        windows = run_sums.unfold(1, cfg.cmp_block // cfg.cmp_stride, 1).sum(-1)
        return (windows / cfg.cmp_block).to(x.dtype)

    live = (torch.arange(c_max, device=k.device)[None, :] < counts[:, None])[..., None, None]
    return pool(kp) * live, pool(vp) * live, counts


def _key_blocks_of_tokens(c_max: int, cfg: NSAConfig, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(first, last, span): the selection key blocks compressed token c's keys
    ``[c * cmp_stride, c * cmp_stride + cmp_block)`` overlap, ``first[c] .. last[c]``, and the most
    blocks any token overlaps (a Python int)."""
    c = torch.arange(c_max, device=device)
    first = c * cfg.cmp_stride // cfg.sel_block
    last = (c * cfg.cmp_stride + cfg.cmp_block - 1) // cfg.sel_block
    span = -(-(cfg.cmp_block - 1) // cfg.sel_block) + 1
    return first, last, span


_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def _scaled_scores(q: torch.Tensor, k: torch.Tensor, alpha: float, wide: torch.dtype) -> torch.Tensor:
    """``alpha * einsum("blhd,bchd->bhlc", q, k)`` in ``wide`` precision, alpha applied in the GEMM's
    epilogue (one pass over the (B, H, rows, C) scores fewer than a separate multiply), with
    :func:`_tf32_exact_einsum`'s TF32 rule for 16-bit CUDA inputs."""
    sequences, rows, heads, dim = q.shape
    a = q.to(wide).permute(0, 2, 1, 3).reshape(sequences * heads, rows, dim)
    b = k.to(wide).permute(0, 2, 3, 1).reshape(sequences * heads, dim, k.shape[1])
    flag = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = flag or (q.is_cuda and q.dtype in _SIXTEEN_BIT and k.dtype in _SIXTEEN_BIT)
    try:
        s = torch.baddbmm(a.new_zeros(()), a, b, beta=0, alpha=alpha)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = flag
    return s.view(sequences, heads, rows, k.shape[1])


def _tf32_exact_einsum(spec: str, a: torch.Tensor, b: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """``einsum(spec, a, b)`` in ``wide`` precision. 16-bit CUDA inputs take TF32 tensor cores: TF32
    holds bf16's and fp16's significands exactly (10 stored bits against their 7 and 10), so the
    products are exact and the sums fp32, the fp32 einsum's result at tensor-core speed."""
    if a.is_cuda and a.dtype in _SIXTEEN_BIT and b.dtype in _SIXTEEN_BIT:
        flag = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            return torch.einsum(spec, a.to(wide), b.to(wide))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = flag
    return torch.einsum(spec, a.to(wide), b.to(wide))


def compressed_attention(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, counts: torch.Tensor,
                         seq_offsets: torch.Tensor, max_seqlen: int, *, alpha: float, scaling_seqlen: int,
                         cfg: NSAConfig = PAPER, rows_per_chunk: int = 4096,
                         backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed branch: ``(o_cmp (T, H, D), importance (B, H, M, M))`` with ``M =
    ceil(max_seqlen / sel_block)``. Query ``i`` attends compressed token ``c`` iff
    ``c * cmp_stride + cmp_block - 1 <= i`` and ``c < counts[b]``; the scores are
    ``silu(alpha * q.k_cmp) / scaling_seqlen``. ``importance[b, h, qb, kb]`` sums the scores of the rows
    of query block ``qb`` over the compressed tokens overlapping key block ``kb`` (no gradient).

    Where the attention kernels serve (CUDA, 16-bit, ``backend`` not "reference") both run on them:
    ``o_cmp`` with the compressed tokens in each sequence's first rows and a ``func`` mask giving
    row ``i`` the tokens ``[0, min(counts[b], (i + 1 - cmp_block) // cmp_stride + 1))``, the
    importance as :func:`_importance_on_kernels` says. Elsewhere rows run in chunks of
    ``rows_per_chunk`` (bounded memory; each chunk is recomputed in the backward)."""
    sequences = seq_offsets.numel() - 1
    heads = q.shape[1]
    m_blocks = blocks_for(max_seqlen, cfg.sel_block)
    c_max = k_cmp.shape[1]
    importance = q.new_zeros((sequences, heads, m_blocks, m_blocks), dtype=torch.float32)
    if c_max == 0 or q.shape[0] == 0:
        return q.new_zeros(q.shape[:2] + v_cmp.shape[-1:]), importance
    batch, pos = _token_positions(seq_offsets, q.shape[0])
    if _kernels_serve(q, v_cmp, backend):
        return (_compressed_output_on_kernels(q, k_cmp, v_cmp, counts, seq_offsets, max_seqlen, batch, pos, alpha,
                                              scaling_seqlen, cfg),
                _importance_on_kernels(q, k_cmp, counts, seq_offsets, max_seqlen, batch, pos, alpha, scaling_seqlen,
                                       cfg))
    qp = _padded(q, batch, pos, sequences, max_seqlen)  # (B, N, H, D)
    lengths = _lengths(seq_offsets)
    block_end = torch.arange(c_max, device=q.device) * cfg.cmp_stride + cfg.cmp_block - 1
    live_c = torch.arange(c_max, device=q.device)[None, :] < counts[:, None]  # (B, C)
    wide = torch.promote_types(q.dtype, torch.float32)

    def allowed(r0: int, r1: int, tokens: int) -> torch.Tensor:
        """(B, rows, C') bool: row ``i`` of [r0, r1) sees compressed token ``c < C'``."""
        rows = torch.arange(r0, r1, device=q.device)
        return (block_end[None, None, :tokens] <= rows[None, :, None]) & live_c[:, None, :tokens] & (
            rows[None, :, None] < lengths[:, None, None])

    def scores(r0: int, r1: int, qc, kc):
        """(B, H, rows, C') SiLU scores of rows [r0, r1) against the first C' tokens, masked."""
        s = _tf32_exact_einsum("blhd,bchd->bhlc", qc, kc, wide) * alpha
        return F.silu(s) / scaling_seqlen * allowed(r0, r1, kc.shape[1])[:, None].to(s.dtype)

    def unscaled_scores_in_place(r0: int, r1: int, qc, kc):
        """:func:`scores` times ``scaling_seqlen``, without autograd and in place: two passes over
        the (B, H, rows, C') block (the importance's cost is these passes). The rows past a
        sequence (zero q rows of ``qp``) and the tokens past its count (zeroed in ``k_live``) score
        silu(0) = 0, so only the causal staircase, the tokens that some rows of [r0, r1) see and
        others not, needs masking: the H200 64K forward spent 1.9 ms per call masking every token
        (docs/dev/perf-log.md, session 36). alpha rides in the GEMM's epilogue, not on the
        16-bit operands: scaled, they would leave TF32's exact products for a full fp32 GEMM
        (1.7x its time there), and a separate multiply took 1.1 ms of the 64K forward."""
        tokens = kc.shape[1]
        s = _scaled_scores(qc, kc, alpha, wide)
        F.silu(s, inplace=True)
        seen_by_all = min(tokens, max(0, (r0 + 1 - cfg.cmp_block) // cfg.cmp_stride + 1))
        if seen_by_all < tokens:
            rows = torch.arange(r0, r1, device=q.device)
            hidden = block_end[None, seen_by_all:tokens] > rows[:, None]  # (rows, C'')
            s[..., seen_by_all:].masked_fill_(hidden, 0.0)
        return s

    # Importance: per chunk of whole query blocks, the scores summed over each block's rows, then
    # scattered onto the (at most ``span``) key blocks each token overlaps. Only the tokens that
    # some row of the chunk can see are scored (causal: half of them on average).
    first, last, span = _key_blocks_of_tokens(c_max, cfg, q.device)
    k_live = k_cmp * live_c[:, :, None, None].to(k_cmp.dtype)  # the tokens past each count score 0
    step = max(cfg.sel_block, rows_per_chunk // cfg.sel_block * cfg.sel_block)
    with torch.no_grad():
        for r0 in range(0, max_seqlen, step):
            r1 = min(r0 + step, max_seqlen)
            visible = min(c_max, (r1 - cfg.cmp_block) // cfg.cmp_stride + 1) if r1 >= cfg.cmp_block else 0
            if visible == 0:
                continue
            p = unscaled_scores_in_place(r0, r1, qp[:, r0:r1], k_live[:, :visible])
            whole = (r1 - r0) // cfg.sel_block
            per_query_block = p[:, :, :whole * cfg.sel_block].unflatten(2, (whole, cfg.sel_block)).sum(dim=3)
            if whole * cfg.sel_block < r1 - r0:  # the last chunk's partial query block
                per_query_block = torch.cat([per_query_block, p[:, :, whole * cfg.sel_block:].sum(2, keepdim=True)], 2)
            q_blocks = per_query_block.shape[2]
            part = torch.zeros((sequences, heads, q_blocks, m_blocks), dtype=per_query_block.dtype, device=q.device)
            for o in range(span):
                kb = first[:visible] + o
                part.index_add_(3, kb.clamp(max=m_blocks - 1), per_query_block * (kb <= last[:visible]))
            qb0 = r0 // cfg.sel_block
            importance[:, :, qb0:qb0 + q_blocks] += (part / scaling_seqlen).to(importance.dtype)

    def chunk(r0: int, r1: int, qc, kc, vc):
        return torch.einsum("bhlc,bchd->blhd", scores(r0, r1, qc, kc).to(vc.dtype), vc)

    outs = []
    for r0 in range(0, max_seqlen, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, max_seqlen)
        qc = qp[:, r0:r1]
        if torch.is_grad_enabled() and (qc.requires_grad or k_cmp.requires_grad or v_cmp.requires_grad):
            from torch.utils.checkpoint import checkpoint

            o = checkpoint(lambda a, b_, c_, r0=r0, r1=r1: chunk(r0, r1, a, b_, c_), qc, k_cmp, v_cmp,
                           use_reentrant=False)
        else:
            o = chunk(r0, r1, qc, k_cmp, v_cmp)
        outs.append(o)
    o_padded = torch.cat(outs, dim=1)
    return o_padded[batch, pos].to(q.dtype), importance


def _kernels_serve(q: torch.Tensor, v_cmp: torch.Tensor, backend: str) -> bool:
    """The compressed branch's output on the attention kernels: CUDA, 16-bit, v's head dim q's."""
    return (backend != "reference" and q.is_cuda and q.dtype in _SIXTEEN_BIT and v_cmp.dtype == q.dtype
            and v_cmp.shape[-1] == q.shape[-1])


def _visible_tokens(batch: torch.Tensor, pos: torch.Tensor, counts: torch.Tensor, cfg: NSAConfig) -> torch.Tensor:
    """Per jagged row, how many of its sequence's compressed tokens it sees (a prefix):
    ``min(counts[b], (i + 1 - cmp_block) // cmp_stride + 1)``, at least 0."""
    bound = torch.div(pos + 1 - cfg.cmp_block, cfg.cmp_stride, rounding_mode="floor") + 1
    return torch.minimum(bound.clamp(min=0), counts[batch])


def _entry_starts(seq_offsets: torch.Tensor, chunks: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's rows in ``chunks`` entries of ``rows`` (the last ones short or empty):
    ``(starts (B, chunks), offsets (B x chunks + 1,) int32)``, the entries' first rows within
    their sequences and their offsets into the jagged rows (the rows stay in place)."""
    starts = torch.minimum(torch.arange(chunks, device=seq_offsets.device) * rows, _lengths(seq_offsets)[:, None])
    offsets = torch.cat([(seq_offsets[:-1, None].to(torch.int64) + starts).flatten(), seq_offsets[-1:].to(torch.int64)])
    return starts, offsets.to(torch.int32)


def _attend_in_entries(q, seq_offsets, max_seqlen, rows_per_entry: int, keys_per_entry: int, prefix, key_entries,
                       alpha, scaling_seqlen) -> torch.Tensor:
    """One ``hstu_attn_varlen_func`` call with each sequence's query rows in entries of
    ``rows_per_entry`` (q's rows in place) and ``keys_per_entry`` keys per entry, which
    ``key_entries(chunks)`` returns as ``(k, v)`` of ``B x chunks x keys_per_entry`` rows; query row
    ``i`` is allowed the keys ``[0, prefix[i])`` of its entry (a ``func`` mask). A backward CTA owns
    a key tile of one entry and walks that entry's query tiles, so no CTA walks a whole long
    sequence. No host sync."""
    from .api import hstu_attn_varlen_func
    from .masks import FUNC_ROW_PADDING

    sequences = seq_offsets.numel() - 1
    rows = max(1, min(rows_per_entry, max_seqlen))
    chunks = -(-max_seqlen // rows)
    device = q.device
    with torch.no_grad():
        _, q_offsets = _entry_starts(seq_offsets, chunks, rows)
        k_offsets = (torch.arange(sequences * chunks + 1, device=device) * keys_per_entry).to(torch.int32)
        func = torch.zeros((1, 1, q.shape[0] + FUNC_ROW_PADDING), dtype=torch.int32, device=device)
        func[0, 0, :q.shape[0]] = prefix.to(torch.int32)
    k_entries, v_entries = key_entries(chunks)
    bound = max(keys_per_entry, rows)
    return hstu_attn_varlen_func(q, k_entries, v_entries, q_offsets, k_offsets, bound, bound, alpha=alpha,
                                 scaling_seqlen=scaling_seqlen, func=func)


# Query rows per entry of the compressed branch's kernel call: the backward's CTAs each own a key
# tile of compressed tokens and walk the entry's query tiles, so a whole 64K sequence as one entry
# left token tile 0 to one CTA walking all 1024 query tiles (3.0 ms of the paper settings' 12.4 ms
# step on the H200, docs/dev/perf-log.md session 39).
_CMP_ROWS_PER_ENTRY = 4096


def _compressed_output_on_kernels(q, k_cmp, v_cmp, counts, seq_offsets, max_seqlen, batch, pos, alpha,
                                  scaling_seqlen, cfg: NSAConfig, rows_per_entry: int | None = None) -> torch.Tensor:
    """``o_cmp`` on the attention kernels (:func:`_attend_in_entries`): every entry has a copy of
    its sequence's compressed tokens as keys, row ``i`` allowed ``[0, visible)`` of them
    (:func:`_visible_tokens`). The copies' gradients add up through the expand. Differentiable in
    q, k_cmp and v_cmp."""
    sequences, c_max = k_cmp.shape[:2]
    with torch.no_grad():
        visible = _visible_tokens(batch, pos, counts, cfg)

    def key_entries(chunks):  # (B, C, H, D) -> (B x chunks x C, H, D): one copy of the tokens per entry
        return tuple(x.to(q.dtype)[:, None].expand((sequences, chunks) + tuple(x.shape[1:])).flatten(0, 2)
                     for x in (k_cmp, v_cmp))

    return _attend_in_entries(q, seq_offsets, max_seqlen, rows_per_entry or _CMP_ROWS_PER_ENTRY, c_max, visible,
                              key_entries, alpha, scaling_seqlen)


def _importance_on_kernels(q, k_cmp, counts, seq_offsets, max_seqlen, batch, pos, alpha, scaling_seqlen,
                           cfg: NSAConfig) -> torch.Tensor:
    """:func:`compressed_attention`'s importance ``(B, H, M, M)`` on the attention kernels, in one
    call with the roles of rows and keys exchanged: the compressed tokens are the query rows and
    q's rows the keys, so the scores' sums over each query block's rows are the output of an
    attention whose values are indicators, ``V[i, col] = 1`` where row ``i`` lies in query block
    ``col`` of its chunk. The values have q's head dim ``D`` columns, so each sequence's rows go in
    chunks of ``D`` query blocks, one batch entry per (sequence, chunk): its keys are the chunk's
    rows of q in place (offsets into q, no copy), its rows the sequence's tokens, token ``c``
    allowed the chunk's rows ``i >= c * cmp_stride + cmp_block - 1`` (a ``func`` interval). The
    per-token sums then add onto the key blocks each token overlaps. The score work is the
    output's once more, in one launch with rows of only ``C`` tokens per entry: with q's rows as
    the kernel's rows instead (``D`` key blocks per call), the 64K forward took 8-16 launches that
    each wrote an output the size of q (the seed's settings: 18.8 ms against 13.6 for the PyTorch
    path, H200, docs/dev/perf-log.md session 38). P reaches the GEMM in q's 16-bit type and the
    output is stored in it, so an entry carries that rounding (relative ~2^-9), which may reorder
    near ties of the selection; the PyTorch path (one fp32 score matrix per row chunk) stays for
    CPU tensors and the reference backend. No gradient, no host sync."""
    from .api import hstu_attn_varlen_func
    from .masks import FUNC_ROW_PADDING

    sequences, c_max, heads, dim = k_cmp.shape
    m_blocks = blocks_for(max_seqlen, cfg.sel_block)
    importance = torch.zeros((sequences, heads, m_blocks, m_blocks), dtype=torch.float32, device=q.device)
    if c_max == 0 or q.shape[0] == 0:
        return importance
    width = dim * cfg.sel_block  # rows of q per chunk: D query blocks
    chunks = -(-max_seqlen // width)
    device = q.device
    with torch.no_grad():
        starts, key_offsets = _entry_starts(seq_offsets, chunks, width)  # the chunks' rows of q as keys
        row_offsets = (torch.arange(sequences * chunks + 1, device=device) * c_max).to(torch.int32)
        rows = k_cmp.to(q.dtype)[:, None].expand(sequences, chunks, c_max, heads, dim).reshape(-1, heads, dim)
        # Token c of entry (b, j) sees the chunk's rows from c's last key on (local coordinates).
        c = torch.arange(c_max, device=device)
        token_end = c * cfg.cmp_stride + cfg.cmp_block - 1
        lo = (token_end[None, :] - starts[:, :, None]).clamp(min=0)  # (B, chunks, C)
        live = (c[None, :] < counts[:, None])[:, None, :].expand(sequences, chunks, c_max)
        func = torch.zeros((1, 3, rows.shape[0] + FUNC_ROW_PADDING), dtype=torch.int32, device=device)
        func[0, 1, :rows.shape[0]] = torch.where(live, lo, 0).flatten().to(torch.int32)
        func[0, 2, :rows.shape[0]] = torch.where(live, width, 0).flatten().to(torch.int32)
        column = (torch.remainder(pos, width) // cfg.sel_block)[:, None, None].expand(q.shape[0], heads, 1)
        values = q.new_zeros(q.shape[:2] + (dim,)).scatter_(2, column, 1)
        # Rows and keys aligned at the start (no delta_q): the func bounds are per-entry key
        # positions either way, and an entry may hold more tokens than keys.
        bound = max(c_max, min(width, max_seqlen))
        out = hstu_attn_varlen_func(rows, q, values, row_offsets, key_offsets, bound, bound, alpha=alpha,
                                    scaling_seqlen=scaling_seqlen, func=func)
        # Token c's sums (fp32 from here on) add onto key blocks first[c] .. last[c], in the
        # output's own (B, chunks, C, H x D) layout; then (B, chunks, M, H, D) -> (B, H, M_q, M).
        # A token's offsets past its last block go to a spare block m_blocks, dropped after.
        per_token = out.view(sequences, chunks, c_max, heads * dim).float()
        by_key_block = per_token.new_zeros((sequences, chunks, m_blocks + 1, heads * dim))
        first, last, span = _key_blocks_of_tokens(c_max, cfg, device)
        for o in range(span):
            by_key_block.index_add_(2, torch.where(first + o <= last, first + o, m_blocks), per_token)
        per_query_block = by_key_block[:, :, :m_blocks].view(sequences, chunks, m_blocks, heads, dim).permute(0, 3, 1, 4, 2)
        importance.copy_(per_query_block.reshape(sequences, heads, chunks * dim, m_blocks)[:, :, :m_blocks])
    return importance


def _selected_indices(importance: torch.Tensor, seq_offsets: torch.Tensor, cfg: NSAConfig) -> torch.Tensor:
    """The selection of :func:`select_blocks` as top-k key-block indices ``(B, H, M, top)``, -1
    for unused slots."""
    sequences, heads, m_blocks, _ = importance.shape
    device = importance.device
    nblocks = -(-_lengths(seq_offsets) // cfg.sel_block)  # (B,)
    qb = torch.arange(m_blocks, device=device)[:, None]
    kb = torch.arange(m_blocks, device=device)[None, :]
    candidate = (kb <= qb)[None] & (kb[None] < nblocks[:, None, None]) & (qb[None] < nblocks[:, None, None])
    forced = (kb < cfg.num_initial) | (kb > qb - cfg.num_local)
    score = importance.float().masked_fill(forced[None, None], float("inf"))
    score = score.masked_fill(~candidate[:, None], float("-inf"))
    top = min(cfg.top_n, m_blocks)
    values, indices = score.topk(top, dim=-1)
    return torch.where(values == float("-inf"), torch.full_like(indices, -1), indices)


def select_blocks(importance: torch.Tensor, seq_offsets: torch.Tensor, cfg: NSAConfig = PAPER) -> BlockMask:
    """The selected branch's :class:`BlockMask` (``q_block = k_block = sel_block``): per (sequence,
    head, query block ``qb``) the causal key blocks ``kb <= qb`` inside the sequence; the first
    ``num_initial`` and the last ``num_local`` of them always, then the highest ``importance`` up to
    ``top_n`` in all (all of them where there are fewer). On the device, no sync."""
    m_blocks = importance.shape[2]
    return BlockMask.from_topk(_selected_indices(importance, seq_offsets, cfg), cfg.sel_block, cfg.sel_block, m_blocks)


# Query rows per entry of the initial blocks' kernel call (:func:`_initial_blocks_on_kernels`).
_INITIAL_ROWS_PER_ENTRY = 4096


def _initial_blocks_on_kernels(q, k, v, seq_offsets, max_seqlen, alpha, scaling_seqlen, cfg: NSAConfig,
                               rows_per_entry: int | None = None) -> torch.Tensor:
    """The selected branch's part from the forced initial blocks, apart from the block-sparse call:
    every query block keeps them, so in that call key tile 0 made one backward CTA walk every
    query tile of a sequence (3.6 ms of the 64K paper step's 12.4 on the H200, docs/dev/perf-log.md
    session 39). On the attention kernels in entries of query rows (:func:`_attend_in_entries`),
    every entry with a copy of the sequence's first ``num_initial * sel_block`` keys, row ``i``
    allowed keys ``j <= i`` of them: what the causal HSTU mask allows in those blocks. The copies'
    gradients add up through the gather."""
    sequences = seq_offsets.numel() - 1
    width = cfg.num_initial * cfg.sel_block
    with torch.no_grad():
        _, pos = _token_positions(seq_offsets, q.shape[0])
        # Token j of sequence b (clamped into the tensor: keys past a sequence are never allowed).
        key_rows = (seq_offsets[:-1, None].to(torch.int64) + torch.arange(width, device=q.device)[None, :])
        key_rows = key_rows.clamp(max=k.shape[0] - 1)

    def key_entries(chunks):
        rows = key_rows[:, None].expand(sequences, chunks, width).flatten()
        return k[rows], v[rows]

    return _attend_in_entries(q, seq_offsets, max_seqlen, rows_per_entry or _INITIAL_ROWS_PER_ENTRY, width,
                              torch.clamp(pos + 1, max=width), key_entries, alpha, scaling_seqlen)


def _check(q, k, v, seq_offsets, max_seqlen, gates):
    for name, x in (("q", q), ("k", k), ("v", v), ("gates", gates)):
        if not isinstance(x, torch.Tensor):
            fail(TypeError, name, "a torch.Tensor", type(x).__name__)
    if q.dim() != 3 or k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        fail(ValueError, "q, k, v", "(T, H, D) each, k like q, v (T, H, Dv)",
             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if gates.shape != q.shape[:2] + (3,):
        fail(ValueError, "gates", f"(T, H, 3) = {tuple(q.shape[:2]) + (3,)} (g_cmp, g_slc, g_swa)", tuple(gates.shape))
    if not isinstance(seq_offsets, torch.Tensor) or seq_offsets.dim() != 1 or seq_offsets.numel() < 2:
        fail(ValueError, "seq_offsets", "a 1-D tensor of B+1 offsets", getattr(seq_offsets, "shape", seq_offsets))
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 1:
        fail(ValueError, "max_seqlen", "a positive Python int", repr(max_seqlen))


def hstu_nsa_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor, max_seqlen: int,
                  gates: torch.Tensor, *, alpha: float = 1.0, scaling_seqlen: int = -1, cfg: NSAConfig = PAPER,
                  backend: str = "auto", return_block_mask: bool = False):
    """Sparse HSTU attention (module doc) over one jagged batch, causal: ``q, k (T, H, D)``,
    ``v (T, H, Dv)``, ``seq_offsets (B+1,)``, ``gates (T, H, 3)`` (g_cmp, g_slc, g_swa, used as
    given: a gate model's sigmoid, say). Returns ``(T, H, Dv)`` in q's dtype, and with
    ``return_block_mask`` also the selected branch's :class:`BlockMask`. ``backend`` as in
    :func:`hstu_cute.nn.hstu_attention` (the kernels on CUDA, the PyTorch reference on CPU)."""
    _check(q, k, v, seq_offsets, max_seqlen, gates)
    scale = max_seqlen if scaling_seqlen == -1 else scaling_seqlen
    k_cmp, v_cmp, counts = compress_kv(k, v, seq_offsets, max_seqlen, cfg)
    o_cmp, importance = compressed_attention(q, k_cmp, v_cmp, counts, seq_offsets, max_seqlen, alpha=alpha,
                                             scaling_seqlen=scale, cfg=cfg, backend=backend)
    indices = _selected_indices(importance, seq_offsets, cfg)
    m_blocks = importance.shape[2]
    kw = dict(alpha=alpha, scaling_seqlen=scale, backend=backend)
    selection = None
    if _initial_blocks_apart(q, v, backend, cfg):
        # Every query block keeps the initial blocks (top_n covers all the forced ones): they run
        # as their own call in entries of query rows, the other selected blocks block-sparse.
        rest = BlockMask.from_topk(torch.where(indices < cfg.num_initial, -1, indices), cfg.sel_block, cfg.sel_block,
                                   m_blocks)
        o_slc = (hstu_attention(q, k, v, seq_offsets, max_seqlen, window_size=CAUSAL, block_mask=rest, **kw)
                 + _initial_blocks_on_kernels(q, k, v, seq_offsets, max_seqlen, alpha, scale, cfg))
    else:
        selection = BlockMask.from_topk(indices, cfg.sel_block, cfg.sel_block, m_blocks)
        o_slc = hstu_attention(q, k, v, seq_offsets, max_seqlen, window_size=CAUSAL, block_mask=selection, **kw)
    out = torch.addcmul(gates[..., 0:1] * o_cmp, gates[..., 1:2], o_slc)
    if cfg.window > 0:
        o_swa = hstu_attention(q, k, v, seq_offsets, max_seqlen, window_size=(cfg.window - 1, 0), **kw)
        out = torch.addcmul(out, gates[..., 2:3], o_swa)
    out = out.to(q.dtype)
    if return_block_mask:
        if selection is None:
            selection = BlockMask.from_topk(indices, cfg.sel_block, cfg.sel_block, m_blocks)
        return out, selection
    return out


def _initial_blocks_apart(q: torch.Tensor, v: torch.Tensor, backend: str, cfg: NSAConfig) -> bool:
    """Whether the selected branch's initial blocks run apart (:func:`_initial_blocks_on_kernels`):
    on the kernels, where every query block keeps them (``top_n`` covers the forced blocks)."""
    return (_kernels_serve(q, v, backend) and q.shape[0] > 0 and cfg.num_initial > 0
            and cfg.top_n >= cfg.num_initial + cfg.num_local)


def hstu_nsa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor, max_seqlen: int,
                       gates: torch.Tensor, *, alpha: float = 1.0, scaling_seqlen: int = -1, cfg: NSAConfig = PAPER,
                       block_mask: BlockMask | None = None,
                       compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle, one sequence at a time with dense masks, written from the module doc's
    definitions: ``(out (T, H, Dv), importance (B, H, M, M))``. ``block_mask``: the selected
    blocks to use (a kernel run's, so that a near tie in importance cannot pick other blocks);
    without it the oracle selects by sorting each query block's candidates."""
    scale = max_seqlen if scaling_seqlen == -1 else scaling_seqlen
    sequences, heads = seq_offsets.numel() - 1, q.shape[1]
    m_blocks = blocks_for(max_seqlen, cfg.sel_block)
    importance = torch.zeros((sequences, heads, m_blocks, m_blocks), dtype=torch.float64, device=q.device)
    out = torch.zeros(q.shape[:2] + v.shape[2:], dtype=compute_dtype, device=q.device)
    offsets = [int(x) for x in seq_offsets.tolist()]
    for b in range(sequences):
        lo, hi = offsets[b], offsets[b + 1]
        length = hi - lo
        if length == 0:
            continue
        qs, ks, vs = (x[lo:hi].to(compute_dtype).transpose(0, 1) for x in (q, k, v))  # (H, L, D)
        g = gates[lo:hi].to(compute_dtype).transpose(0, 1)  # (H, L, 3)
        rows = torch.arange(length, device=q.device)

        def attend(keys, values, allowed):
            p = F.silu(alpha * qs @ keys.transpose(1, 2)) / scale
            return (p * allowed).to(compute_dtype) @ values, p * allowed

        # compressed
        count = (length - cfg.cmp_block) // cfg.cmp_stride + 1 if length >= cfg.cmp_block else 0
        o_cmp = torch.zeros_like(qs[..., :1].expand(-1, -1, vs.shape[-1]))
        if count:
            starts = [c * cfg.cmp_stride for c in range(count)]
            kc = torch.stack([ks[:, s:s + cfg.cmp_block].mean(dim=1) for s in starts], dim=1)
            vc = torch.stack([vs[:, s:s + cfg.cmp_block].mean(dim=1) for s in starts], dim=1)
            ends = torch.tensor([s + cfg.cmp_block - 1 for s in starts], device=q.device)
            o_cmp, p = attend(kc, vc, (ends[None, :] <= rows[:, None]).to(compute_dtype))
            for c, s in enumerate(starts):
                for kb in range(s // cfg.sel_block, (s + cfg.cmp_block - 1) // cfg.sel_block + 1):
                    for qb in range(blocks_for(length, cfg.sel_block)):
                        importance[b, :, qb, kb] += p[:, qb * cfg.sel_block:(qb + 1) * cfg.sel_block, c].sum(
                            dim=1).detach().double()  # a discrete choice: no gradient
        # selected
        nblocks = blocks_for(length, cfg.sel_block)
        kept = torch.zeros((heads, nblocks, nblocks), dtype=torch.bool, device=q.device)
        if block_mask is not None:
            dense = block_mask.to_dense()[b]
            kept = dense.expand(heads, -1, -1)[:, :nblocks, :nblocks]
        else:
            for h in range(heads):
                for qb in range(nblocks):
                    forced = [kb for kb in range(qb + 1) if kb < cfg.num_initial or kb > qb - cfg.num_local]
                    rest = sorted((kb for kb in range(qb + 1) if kb not in forced),
                                  key=lambda kb: -float(importance[b, h, qb, kb]))
                    for kb in (forced + rest)[:cfg.top_n]:
                        kept[h, qb, kb] = True
        block_of = rows // cfg.sel_block
        causal = rows[None, :] <= rows[:, None]
        selected = kept[:, block_of][:, :, block_of] & causal
        o_slc, _ = attend(ks, vs, selected.to(compute_dtype))
        total = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc
        if cfg.window > 0:
            window = causal & (rows[:, None] - rows[None, :] < cfg.window)
            o_swa, _ = attend(ks, vs, window.to(compute_dtype))
            total = total + g[..., 2:3] * o_swa
        out[lo:hi] = total.transpose(0, 1)
    return out, importance.float()


class HSTUSparseBlock(HSTUBlock):
    """An HSTU layer (:class:`hstu_cute.HSTUBlock`: layer norm, UVQK projection, u gating, output
    projection, residual) whose attention is :func:`hstu_nsa_attn`, causal. The gates come from a
    gate model on the normalized input, ``sigmoid(h W_gate + b_gate)``, one per branch and head.
    ``cfg`` sets the branches (:data:`PAPER` by default). Contexts, targets and rab are not taken
    (the window branch would need a local window with targets: docs/nsa.md).

    ``hstu_nsa_block_reference`` is its math on the oracle."""

    def __init__(self, d_model: int, num_heads: int, head_dim: int, hidden_dim: int | None = None, *,
                 cfg: NSAConfig = PAPER, alpha: float | None = None, scaling_seqlen: int = -1, dropout: float = 0.0,
                 eps: float = 1e-6, attention_dtype: torch.dtype = torch.bfloat16, backend: str = "auto", device=None,
                 dtype=None):
        super().__init__(d_model, num_heads, head_dim, hidden_dim, alpha=alpha, scaling_seqlen=scaling_seqlen,
                         dropout=dropout, eps=eps, attention_dtype=attention_dtype, backend=backend, device=device,
                         dtype=dtype)
        if not isinstance(cfg, NSAConfig):
            fail(TypeError, "cfg", "an hstu_cute.nsa.NSAConfig", type(cfg).__name__)
        self.cfg = cfg
        self.gate = torch.nn.Linear(d_model, num_heads * 3, device=device, dtype=dtype)

    def gates(self, h: torch.Tensor) -> torch.Tensor:
        """(T, H, 3) gates of the normalized input ``h``."""
        return torch.sigmoid(self.gate(h)).unflatten(-1, (self.num_heads, 3))

    def forward(self, x: torch.Tensor, seq_offsets: torch.Tensor, max_seqlen: int, num_contexts=None,
                num_targets=None, rab=None) -> torch.Tensor:
        for name, value in (("num_contexts", num_contexts), ("num_targets", num_targets), ("rab", rab)):
            if value is not None:
                raise NotImplementedError(f"{name}: HSTUSparseBlock takes causal attention only; expected None")
        if not isinstance(x, torch.Tensor):
            fail(TypeError, "x", "a torch.Tensor", type(x).__name__)
        if x.dim() != 2 or x.shape[1] != self.d_model:
            fail(ValueError, "x.shape", f"(T, {self.d_model}) (tokens, d_model)", tuple(x.shape))
        h = self.input_norm(x)
        u, v, q, k = self.split_uvqk(h)
        u = F.silu(u)
        gates = self.gates(h)
        if self._kernel_path(x) and q.dtype not in (torch.bfloat16, torch.float16):
            q, k, v, gates = (t.to(self.attention_dtype) for t in (q, k, v, gates))
        a = hstu_nsa_attn(q, k, v, seq_offsets.to(torch.int32), max_seqlen, gates, alpha=self.attention.alpha,
                          scaling_seqlen=self.attention.scaling_seqlen, cfg=self.cfg, backend=self.attention.backend)
        a = a.reshape(a.shape[0], -1).to(u.dtype)
        y = u.flatten(1) * self.output_norm(a)
        return x + self.output(F.dropout(y, self.dropout, self.training))


def hstu_nsa_block_reference(block: HSTUSparseBlock, x: torch.Tensor, seq_offsets: torch.Tensor, max_seqlen: int,
                             block_mask: BlockMask | None = None) -> torch.Tensor:
    """The math of :class:`HSTUSparseBlock` in fp32 on ``block``'s parameters (no dropout), the
    attention from :func:`hstu_nsa_reference` (``block_mask``: the selected blocks to use)."""
    f32 = torch.promote_types(x.dtype, torch.float32)

    def cast(t):
        return t.to(f32)

    H, dv, da = block.num_heads, block.hidden_dim, block.head_dim
    x = cast(x)
    norm_in, norm_out = block.input_norm, block.output_norm
    h = F.layer_norm(x, (block.d_model,), cast(norm_in.weight), cast(norm_in.bias), norm_in.eps)
    u, v, q, k = (h @ cast(block.uvqk.weight).t() + cast(block.uvqk.bias)).split([H * dv, H * dv, H * da, H * da],
                                                                                  dim=-1)
    gates = torch.sigmoid(h @ cast(block.gate.weight).t() + cast(block.gate.bias)).unflatten(-1, (H, 3))
    a, _ = hstu_nsa_reference(q.unflatten(-1, (H, da)), k.unflatten(-1, (H, da)), v.unflatten(-1, (H, dv)),
                              seq_offsets, max_seqlen, gates, alpha=block.attention.alpha,
                              scaling_seqlen=block.attention.scaling_seqlen, cfg=block.cfg, block_mask=block_mask,
                              compute_dtype=f32)
    y = F.silu(u) * F.layer_norm(a.reshape(a.shape[0], -1), (H * dv,), cast(norm_out.weight), cast(norm_out.bias),
                                 norm_out.eps)
    return x + y @ cast(block.output.weight).t()
