"""The key blocks of one query tile, and the paged KV cache as the kernels see it.

Without a cache a tile's keys are the non-empty n-blocks of :func:`masks.n_block_schedule` over
one key sequence. With a paged cache (docs/operator.md, "Paged KV cache"; FBGEMM's meaning) sequence
b's keys are its C cached tokens (the new history included), read from pages, followed by its t
targets, read from k/v (the launcher points the key offsets and seqused_k at the target rows); the
n queries (new history, then targets) are aligned to the end, so the first n - t sit inside the
cache. The key blocks then come in two segments, each tiled from its own start so that no block
mixes the two sources:

* the cache segment: whole-sequence coordinates with the key range cut at C (blocks of keys
  ``[n * tile_n, (n + 1) * tile_n)``; the last one crosses C and is masked past it);
* the new segment: every coordinate shifted by C (blocks of keys ``[C + n * tile_n, ...)``); the
  history queries' rows are negative there, before every key, and see none of it.

Both are plain :class:`masks.SeqMask` values: the mask rules depend only on differences of
positions and on the context / history / target boundaries, which shift along (masks.row_intervals),
so one mask engine serves both. HSTU has no softmax: the two segments' contributions simply add
into one accumulator.

:class:`KeyBlocks` lists a tile's blocks by index ``i`` in ``[0, count)``, ascending (cache
segment first); :meth:`KeyBlocks.at` gives the block's segment mask and n-block. With split keys
(few query tiles over long keys: a decode-like serving call) :meth:`KeyBlocks.part` cuts that
range into parts that separate CTAs reduce; HSTU has no softmax, so their partial outputs add.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, NamedTuple

import cutlass
from cutlass import Int32, const_expr

from .. import masks
from .mask_apply import KERNEL_OPS
from .seqinfo import clamp_range

#: Rows per page load: every supported page size is a multiple of it, so a chunk of this many
#: keys never leaves its page.
PAGE_CHUNK = 16


class PagedArgs(NamedTuple):
    """The paged cache's runtime arguments (hstu_cute.kernel_args, in this order)."""

    mCache: Any  # (R, H, D): kv_cache (pages, 2, page_size, H, D) seen as rows (page * 2 + kind) * page_size + row
    mPageOffsets: Any  # (B + 1,) int32
    mPageIds: Any  # (P,) int32; entries past page_offsets[B] are ignored
    mLastPageLens: Any  # (B,) int32
    log2_page_size: Any  # Int32
    mRabNew: Any = None  # (B, H_rab, W, W): rab[b, h, S_b + i, C_b + j], S_b query 0's row (with rab only)


class PageSpan(NamedTuple):
    """One sequence's pages: ``page_ids[first : first + count]``, and its cached tokens."""

    first: Any
    count: Any
    cached_len: Any


def page_span(paged: PagedArgs, batch) -> PageSpan:
    """Sequence ``batch``'s pages, offsets clamped into page_ids and the last page's length into
    [1, page_size], so that no input can address outside the tables."""
    first, end = clamp_range(paged.mPageOffsets[batch], paged.mPageOffsets[batch + 1], paged.mPageIds.shape[0])
    count = end - first
    page_size = Int32(1) << paged.log2_page_size
    last_len = cutlass.min(cutlass.max(paged.mLastPageLens[batch], Int32(1)), page_size)
    cached_len = cutlass.select_(count > 0, ((count - 1) << paged.log2_page_size) + last_len, Int32(0))
    return PageSpan(first, count, cached_len)


def cache_row(paged: PagedArgs, span: PageSpan, position, kind: int, rows: int = PAGE_CHUNK, last_id=None):
    """The cache row of key ``position`` (a multiple of ``rows``, which divides the page size) of
    K (``kind`` 0) or V (1), in units of ``rows`` rows, for a sequence with pages. Positions past
    the last page read the last page (their keys are masked and their V rows zeroed). A page id
    outside the cache makes TMA read zeros; loads that no TMA bounds pass ``last_id`` (the
    cache's last page) to clamp it."""
    page = cutlass.min(position >> paged.log2_page_size, span.count - 1)
    page_id = paged.mPageIds[span.first + page]
    if last_id is not None:
        page_id = cutlass.max(cutlass.min(page_id, last_id), Int32(0))
    in_page = position & ((Int32(1) << paged.log2_page_size) - 1)
    return (((page_id * 2 + kind) << paged.log2_page_size) + in_page) // rows


def cache_segment(seq: masks.SeqMask, cached_len) -> masks.SeqMask:
    """The cache segment of a whole-sequence mask: keys cut at ``cached_len``."""
    return dataclasses.replace(seq, seqlen_k=cached_len)


def new_segment(seq: masks.SeqMask, cached_len) -> masks.SeqMask:
    """The new-token segment of a whole-sequence mask: every coordinate shifted by ``cached_len``."""
    return dataclasses.replace(seq, seqlen_k=seq.seqlen_k - cached_len, num_context=seq.num_context - cached_len,
                               history_end=seq.history_end - cached_len, row_offset=seq.row_offset - cached_len)


class KeyBlocks:
    """The non-empty key blocks of one (m-block, head, sequence) tile, by index in [0, count).

    ``seq`` is the key sequence's mask (paged: of the new-token segment) and ``sched`` its
    :func:`masks.n_block_schedule`; with a cache, ``cache_seq`` / ``cache_sched`` describe the
    cache segment, which comes first, and ``span`` its pages."""

    def __init__(self, seq, sched, cache_seq=None, cache_sched=None, span=None):
        self.seq, self.sched = seq, sched
        self.cache_seq, self.cache_sched, self.span = cache_seq, cache_sched, span
        self.count = sched[3] if cache_sched is None else cache_sched[3] + sched[3]
        # A part of the blocks (:meth:`part`): its first block among the tile's, and its index.
        self.first = self.part_index = None
        # Block-sparse (:meth:`of_list`): (the sequence's BlockTiles, m-block, first list entry).
        self.listed = None

    @staticmethod
    def of_tile(spec: masks.MaskSpec, seq: masks.SeqMask, m_block, tile_m: int, tile_n: int, span=None):
        """The blocks of ``seq`` (the whole sequence's mask), split at the cache when ``span``
        (:class:`PageSpan`) is given."""
        if const_expr(span is None):
            return KeyBlocks(seq, masks.n_block_schedule(spec, seq, m_block, tile_m, tile_n, KERNEL_OPS))
        cached, new = cache_segment(seq, span.cached_len), new_segment(seq, span.cached_len)
        return KeyBlocks(new, masks.n_block_schedule(spec, new, m_block, tile_m, tile_n, KERNEL_OPS), cached,
                         masks.n_block_schedule(spec, cached, m_block, tile_m, tile_n, KERNEL_OPS), span)

    @staticmethod
    def of_list(spec: masks.MaskSpec, seq: masks.SeqMask, m_block, tile_m: int, tile_n: int):
        """A block-sparse tile's blocks: the entries of its list (``seq.sparse``, a
        :class:`~hstu_cute.common.seqinfo.BlockTiles`) inside the HSTU mask's key range; those in
        a target hole stay (computed, then masked to zero)."""
        n_lo, n_hi = masks.n_block_range(spec, seq, m_block, tile_m, tile_n, KERNEL_OPS)
        first, count = seq.sparse.list_range(m_block, n_lo, n_hi)
        return KeyBlocks.of_list_range(seq, m_block, first, count)

    @staticmethod
    def of_list_range(seq: masks.SeqMask, m_block, first, count):
        """The blocks of :meth:`of_list` from its list range (``first``, ``count``), as a
        producer publishes them with a claimed tile (:meth:`list_words`)."""
        blocks = KeyBlocks(seq, (Int32(0), Int32(0), Int32(0), count))
        blocks.listed = (seq.sparse, m_block, first)
        return blocks

    def list_words(self):
        """A block-sparse tile's list range, (first entry, count): the words a producer publishes
        beside the tile (:meth:`of_list_range`)."""
        return (self.listed[2], self.count)

    def part(self, index, parts):
        """Part ``index`` of ``parts``: the blocks ``[count * index // parts, count * (index + 1) //
        parts)``, renumbered from 0 (a part may be empty)."""
        lo = self.count * index // parts
        view = copy.copy(self)
        view.first, view.part_index = lo, index
        view.count = self.count * (index + 1) // parts - lo
        return view

    def _tile_index(self, i):
        return i if const_expr(self.first is None) else i + self.first

    def in_cache(self, i):
        """Whether block ``i`` is read from the cache's pages (paged tiles only)."""
        return self._tile_index(i) < self.cache_sched[3]

    def at(self, i):
        """(segment mask, n-block) of block ``i``."""
        i = self._tile_index(i)
        if const_expr(self.listed is not None):
            tiles, m_block, first = self.listed
            return self.seq, tiles.at(m_block, first + i)
        n_lo, hole_lo, hole_size, _ = self.sched
        if const_expr(self.cache_sched is None):
            return self.seq, masks.n_block_at(i, n_lo, hole_lo, hole_size, KERNEL_OPS)
        c_lo, c_hole_lo, c_hole_size, c_count = self.cache_sched
        cached = i < c_count
        n_new = masks.n_block_at(i - c_count, n_lo, hole_lo, hole_size, KERNEL_OPS)
        n_cached = masks.n_block_at(i, c_lo, c_hole_lo, c_hole_size, KERNEL_OPS)
        a, b = self.cache_seq, self.seq

        def pick(x, y):
            return cutlass.select_(cached, x, y)

        seg = masks.SeqMask(seqlen_q=b.seqlen_q, seqlen_k=pick(a.seqlen_k, b.seqlen_k), window_left=b.window_left,
                            window_right=b.window_right, num_context=pick(a.num_context, b.num_context),
                            history_end=pick(a.history_end, b.history_end), group_size=b.group_size,
                            row_offset=pick(a.row_offset, b.row_offset))
        return seg, pick(n_cached, n_new)
