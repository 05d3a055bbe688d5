"""One sequence of a jagged batch, as the kernels see it.

:class:`SequenceArgs` bundles the per-sequence runtime arguments (the run of the same names in
:mod:`hstu_cute.kernel_args`) and :class:`ScoreScalars` the scalars of the score and mask math,
so that a ``@cute.kernel`` takes each run as one parameter (flattened in the same order: the
kernel's parameters are unchanged). :class:`SequenceInfo` is built inside the kernel from them and
answers, per batch index, where the sequence starts, how long it is and what its mask is.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .. import masks


class SequenceArgs(NamedTuple):
    mOffsetsQ: Any  # (B + 1,) int32
    mOffsetsK: Any  # (B + 1,) int32
    mSeqUsedQ: Any  # (B,) int32 valid prefix (INT32_MAX when unused)
    mSeqUsedK: Any  # (B,) int32
    mNumContexts: Any  # (B,) int32 or None
    mNumTargets: Any  # (B,) int32 or None
    mFunc: Any = None  # (1, n_func, T_q + 256) int32 per-row key intervals (MaskKind.FUNC only)
    mFuncBlocks: Any = None  # (B, blocks, 7) int32 per FUNC_BLOCK_ROWS query rows: masks.FUNC_TABLE_COLUMNS
    blocks: Any = None  # BlockSparseArgs of a block-sparse call (hstu_cute.block_mask), else None


class BlockSparseArgs(NamedTuple):
    """A block-sparse call's tables (:meth:`hstu_cute.BlockMask.tile_lists` at the kernel's tile,
    and the dense kept blocks for masking inside partial tiles)."""

    mCount: Any  # (B, H_mask, M_t) int32: key tiles per query tile
    mIndex: Any  # (B, H_mask, M_t, N_t) int32: those key tiles, ascending
    mState: Any  # (B, H_mask, M_t, N_t) uint8: 0 no kept block, 1 all kept, 2 mixed (masked by block)
    mKept: Any  # (B, H_mask, M_q, M_k) uint8: the kept blocks
    q_block: Any  # Int32
    k_block: Any  # Int32


@cute.jit
def lower_bound(values, count, target):
    """The first ``i`` in ``[0, count)`` with ``values[i] >= target`` (``count`` if none), for
    ascending ``values``: a binary search."""
    lo, hi = Int32(0), count
    while lo < hi:
        mid = (lo + hi) // 2
        if values[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo


@cute.jit
def list_cut(values, count, lo, hi):
    """(first, past): the entries of the ascending ``values[:count]`` inside ``[lo, hi)``, by
    binary search only at an end outside it."""
    first, past = Int32(0), count
    if count > 0:
        if values[0] < lo:
            first = lower_bound(values, count, lo)
        if values[count - 1] >= hi:
            past = lower_bound(values, count, hi)
    return first, past


def walked_block(block_sparse: bool, seq, owner, step):
    """The tile at step ``step`` of a walk over the tiles of one ``owner`` tile (a key block's query
    blocks, in the dK/dV kernels): the step itself, or with a block mask entry ``step`` of the
    owner's list (the kernel's ``tile_problem`` turned the walk's range into the list's)."""
    return seq.sparse.at(owner, step) if block_sparse else step


@dataclasses.dataclass
class BlockTiles:
    """One (sequence, head)'s block-sparse tables inside a kernel (:class:`BlockSparseArgs`), sliced
    to that sequence and head once: its key-tile lists, which tiles need masking by block, and the
    kept test of one element. A dataclass carried field by field through dynamic loops, inside a
    SeqMask (``sparse``); the slices carry 2-D layouts where the whole tables carried 4-D ones."""

    mCount: Any  # (M_t,)
    mIndex: Any  # (M_t, N_t)
    mState: Any  # (M_t, N_t)
    mKept: Any  # (M_q, M_k)
    q_block: Any
    k_block: Any

    @staticmethod
    def of(args: BlockSparseArgs, batch, head):
        # The mask's head: the call's head, or 0 for a mask shared by all heads.
        h = cutlass.min(head, args.mCount.shape[1] - 1)
        return BlockTiles(args.mCount[batch, h, None], args.mIndex[batch, h, None, None],
                          args.mState[batch, h, None, None], args.mKept[batch, h, None, None], args.q_block,
                          args.k_block)

    def list_range(self, m_block, n_lo, n_hi):
        """(first, count): the entries of query tile ``m_block``'s list inside key tiles
        ``[n_lo, n_hi)`` (the HSTU mask's range; the list is ascending). A list inside the range
        (the usual case: a causal user mask lists causal blocks) costs the count's load and then
        its two end entries' loads side by side; the binary searches, seven dependent loads each
        at 128 tiles, run only for an end outside: run at every tile, they cost the 10%-density
        causal forward about a fifth of its speed (docs/dev/perf-log.md, session 31)."""
        total = cutlass.min(cutlass.max(self.mCount[m_block], Int32(0)), self.mIndex.shape[1])
        row = self.mIndex[m_block, None]
        first, past = list_cut(row, total, n_lo, n_hi)
        return first, cutlass.max(past - first, Int32(0))

    def at(self, m_block, i):
        """Key tile ``i`` of query tile ``m_block``'s list."""
        return self.mIndex[m_block, i]

    def tile_mixed(self, m_block, n_block):
        """The tile mixes kept and dropped blocks (masked by block, after the HSTU mask)."""
        return self.mState[m_block, n_block] == 2

    def kept_probe(self):
        """What :func:`block_kept` reads, as a tuple of plain values: taken outside the staged
        branch that tests elements (fields of this dataclass read inside that branch fail the
        compile: the branch re-creates them, and they do not dominate later uses)."""
        return (self.mKept, self.q_block, self.k_block, self.mKept.shape[0], self.mKept.shape[1])


def block_kept(probe, row, key):
    """Element (key-coordinate ``row``, ``key``) lies in a kept block (``probe``:
    :meth:`BlockTiles.kept_probe`)."""
    mKept, q_block, k_block, q_blocks, k_blocks = probe
    qb = row // q_block
    kb = key // k_block
    inside = (qb >= 0) & (qb < q_blocks) & (kb >= 0) & (kb < k_blocks)
    qb = cutlass.min(cutlass.max(qb, Int32(0)), q_blocks - 1)
    kb = cutlass.min(cutlass.max(kb, Int32(0)), k_blocks - 1)
    return inside & (mKept[qb, kb] != 0)


def floor_div(x, d, inv_d):
    """``x // d`` for ``0 <= x < 2^24`` and ``d >= 16`` (block sizes; ``inv_d`` = 1 / d in fp32),
    -1 for a negative ``x``: a float multiply estimates the quotient within one there (x / d <
    2^20, the estimate's error below 2^-2), one correction each way makes it exact. In the
    forward's per-row and per-column lookups this compiled shorter than ``//`` (SASS, session 37);
    per element, where ptxas hoists the divisor's reciprocal, ``//`` is shorter."""
    q = Int32(Float32(x) * inv_d)
    q = cutlass.select_(q * d > x, q - 1, q)
    q = cutlass.select_((q + 1) * d <= x, q + 1, q)
    return cutlass.select_(x < 0, Int32(-1), q)


def block_index(b, blocks):
    """(block ``b`` clamped into a table of ``blocks``, and whether it lies inside)."""
    inside = (b >= 0) & (b < blocks)
    return cutlass.min(cutlass.max(b, Int32(0)), blocks - 1), inside


@dataclasses.dataclass
class FuncRows:
    """A sequence's ``func`` intervals as :func:`masks.row_intervals` reads them: bound ``i`` of
    key-coordinate row ``r`` is ``mFunc[0, min(i, n_func - 1), base + r]``, ``base`` the global q
    row of key-coordinate row 0 (q_start - row_offset: func rows index the jagged q). Rows up to a
    tile past the sequence read the tensor's 256 rows of padding (FBGEMM's layout). A dataclass:
    the DSL carries it through dynamic loops field by field, inside a SeqMask."""

    mFunc: Any
    base: Any
    mBlocks: Any  # (B, blocks, 7): per masks.FUNC_BLOCK_ROWS query rows, masks.FUNC_TABLE_COLUMNS
    batch: Any

    def bound(self, i: int, r):
        last = self.mFunc.shape[1] - 1
        return self.mFunc[0, cutlass.min(Int32(i), last), self.base + r]

    def _reduce(self, block, tile: int, columns):
        """The table's ``columns`` (index, combine) over the entries tile ``block`` (``tile`` query
        rows or keys, a multiple or a divisor of masks.FUNC_BLOCK_ROWS) spans."""
        rows = masks.FUNC_BLOCK_ROWS
        assert tile % rows == 0 or rows % tile == 0, tile
        first = block * tile // rows
        values = [self.mBlocks[self.batch, first, c] for c, _ in columns]
        for j in range(1, max(tile // rows, 1)):
            values = [combine(x, self.mBlocks[self.batch, first + j, c]) for x, (c, combine) in zip(values, columns)]
        return values

    def key_range(self, m_block, tile_m: int):
        """[lo, hi): the keys any row of query tile ``m_block`` allows."""
        lo, hi = self._reduce(m_block, tile_m, ((0, cutlass.min), (1, cutlass.max)))
        return lo, hi

    def common_keys(self, m_block, tile_m: int):
        """(end, lo2, hi2): every row of query tile ``m_block`` allows the keys ``[0, end)`` and
        ``[lo2, hi2)``."""
        end, lo2, hi2 = self._reduce(m_block, tile_m, ((2, cutlass.min), (3, cutlass.max), (4, cutlass.min)))
        return end, lo2, hi2

    def query_rows(self, n_block, tile_n: int):
        """[lo, hi): the query rows (multiples of masks.FUNC_BLOCK_ROWS) whose key ranges meet key
        tile ``n_block`` (``tile_n`` keys)."""
        first_from_big, past = self._reduce(n_block, tile_n, ((5, cutlass.max), (6, cutlass.max)))
        first = cutlass.min(Int32(masks.FUNC_TABLE_BIG) - first_from_big, past)
        return first * masks.FUNC_BLOCK_ROWS, past * masks.FUNC_BLOCK_ROWS


class ScoreScalars(NamedTuple):
    alpha: Any  # Float32
    inv_scale: Any  # Float32, 1 / S
    window_left: Any  # Int32
    window_right: Any  # Int32
    group_size: Any  # Int32
    is_delta_q: Any  # Int32, 0 or 1


def clamp_range(start, end, limit):
    """Clamp [start, end) into [0, limit] so corrupt offsets can never address outside a tensor."""
    s = cutlass.min(cutlass.max(start, Int32(0)), limit)
    e = cutlass.min(cutlass.max(end, s), limit)
    return s, e

def sequence_bounds(mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, tokens_q, tokens_k, batch):
    """(q_start, k_start, seqlen_q, seqlen_k) of one sequence: offsets clamped to the tensors,
    lengths clamped by seqused (INT32_MAX when the caller has none)."""
    q_start, q_end = clamp_range(mOffsetsQ[batch], mOffsetsQ[batch + 1], tokens_q)
    k_start, k_end = clamp_range(mOffsetsK[batch], mOffsetsK[batch + 1], tokens_k)
    seqlen_q = cutlass.max(cutlass.min(mSeqUsedQ[batch], q_end - q_start), Int32(0))
    seqlen_k = cutlass.max(cutlass.min(mSeqUsedK[batch], k_end - k_start), Int32(0))
    return q_start, k_start, seqlen_q, seqlen_k

def sequence_mask(spec, seqlen_q, seqlen_k, mNumContexts, mNumTargets, batch, window_left, window_right,
                  group_size, is_delta_q):
    """The runtime :class:`masks.SeqMask` of one sequence inside a kernel."""
    num_context = Int32(0)
    history_end = seqlen_k
    if const_expr(spec.has_context):
        num_context = mNumContexts[batch]
    if const_expr(spec.has_target):
        history_end = seqlen_k - cutlass.min(cutlass.max(mNumTargets[batch], Int32(0)), seqlen_k)
    return sequence_mask_of(seqlen_q, seqlen_k, num_context, history_end, window_left, window_right, group_size,
                            is_delta_q)


def sequence_mask_of(seqlen_q, seqlen_k, num_context, history_end, window_left, window_right, group_size,
                     is_delta_q):
    """The :class:`masks.SeqMask` of one sequence from its loaded values (delta_q: query 0 sits at
    key ``seqlen_k - seqlen_q``)."""
    return masks.SeqMask(
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, window_left=window_left, window_right=window_right,
        num_context=num_context, history_end=history_end, group_size=group_size,
        row_offset=cutlass.select_(is_delta_q != 0, seqlen_k - seqlen_q, Int32(0)),
    )


#: Int32 words of one sequence as a producer warp publishes them with a claimed tile
#: (:meth:`SequenceInfo.to_words`, :meth:`SequenceInfo.from_words`).
SEQ_WORDS = 6


class SequenceInfo:
    """The sequences of one call inside a kernel: ``at(batch)`` gives ``(q_start, k_start, seq)``,
    the first query and key token of sequence ``batch`` and its :class:`masks.SeqMask` (lengths
    clamped to the tensors and to seqused). ``to_words`` / ``from_words``: the same, as the
    :data:`SEQ_WORDS` words a producer publishes beside a tile index, so that the consumers skip
    the global loads (common.tile_scheduler.TileClaims)."""

    def __init__(self, spec: masks.MaskSpec, seqs: SequenceArgs, scalars: ScoreScalars, tokens_q, tokens_k):
        self.spec = spec
        self.seqs = seqs
        self.scalars = scalars
        self.tokens_q = tokens_q
        self.tokens_k = tokens_k

    def bounds(self, batch):
        """(q_start, k_start, seqlen_q, seqlen_k) of sequence ``batch``."""
        s = self.seqs
        return sequence_bounds(s.mOffsetsQ, s.mOffsetsK, s.mSeqUsedQ, s.mSeqUsedK, self.tokens_q, self.tokens_k, batch)

    def mask(self, batch, seqlen_q, seqlen_k) -> masks.SeqMask:
        """The runtime mask of sequence ``batch`` (reads its context and target counts; a FUNC
        mask also its first query row)."""
        c = self.scalars
        seq = sequence_mask(self.spec, seqlen_q, seqlen_k, self.seqs.mNumContexts, self.seqs.mNumTargets, batch,
                            c.window_left, c.window_right, c.group_size, c.is_delta_q)
        if const_expr(self.spec.kind == masks.MaskKind.FUNC):
            q_start, _ = clamp_range(self.seqs.mOffsetsQ[batch], self.seqs.mOffsetsQ[batch + 1], self.tokens_q)
            seq = self.with_func(q_start, batch, seq)
        return seq

    def to_words(self, q_start, k_start, seq) -> tuple:
        return (q_start, k_start, seq.seqlen_q, seq.seqlen_k, seq.num_context, seq.history_end)

    def from_words(self, words, batch):
        """``(q_start, k_start, seq)`` of sequence ``batch`` from :meth:`to_words`' words."""
        q_start, k_start, seqlen_q, seqlen_k, num_context, history_end = words
        c = self.scalars
        return q_start, k_start, self.with_func(q_start, batch, sequence_mask_of(
            seqlen_q, seqlen_k, num_context, history_end, c.window_left, c.window_right, c.group_size, c.is_delta_q))

    def at(self, batch, cached_len=None):
        """``cached_len``: a paged cache's tokens ahead of the sequence's keys (common.key_blocks):
        the mask then spans them too."""
        q_start, k_start, seqlen_q, seqlen_k = self.bounds(batch)
        if cached_len is not None:
            seqlen_k = seqlen_k + cached_len
        return q_start, k_start, self.mask(batch, seqlen_q, seqlen_k)

    def with_func(self, q_start, batch, seq: masks.SeqMask) -> masks.SeqMask:
        """``seq`` with its :class:`FuncRows` (MaskKind.FUNC; other kinds unchanged)."""
        if const_expr(self.spec.kind == masks.MaskKind.FUNC):
            seq.func = FuncRows(self.seqs.mFunc, q_start - seq.row_offset, self.seqs.mFuncBlocks, batch)
        return seq
