"""The per-block table of a ``func`` mask (:func:`hstu_cute.masks.func_key_ranges` is its
definition and the tests' reference): for each sequence and each ``FUNC_BLOCK_ROWS`` query rows, the
keys any row allows and the keys every row allows (``masks.FUNC_TABLE_COLUMNS``). The attention
kernels read it to skip key blocks and to leave tiles unmasked.

One launch and no host sync: built from torch ops, the same table cost ~450 us of host time and
two contended ``scatter_reduce`` passes (~175 us on the H200 at 32K query rows), more than the
attention it served (B8 N4096 D128 causal, session 30 of docs/dev/perf-log.md). Plain loads and
warp shuffles: sm80 and later.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .. import masks
from ..common.seqinfo import clamp_range

_LANES = 32


class FuncTableSm80:
    """One warp per (block of ``FUNC_BLOCK_ROWS`` query rows, sequence); lane ``l`` reads rows
    ``l`` and ``l + 32`` of the block, then butterfly shuffles combine the warp's five columns and
    lane 0 writes them. Rows past the sequence contribute the neutral value of each column. Then
    the lanes stride over the key blocks the block's key range meets, folding the block's index
    into their two columns with atomic max (the launcher zeroes the table)."""

    def __init__(self, n_func: int):
        assert n_func in (1, 3), n_func
        self.n_func = n_func

    @cute.jit
    def __call__(self, mFunc, mOffsetsQ, mTable, stream):
        grid = [mTable.shape[1], mTable.shape[0], 1]
        self.kernel(mFunc, mOffsetsQ, mTable).launch(grid=grid, block=[_LANES, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mFunc, mOffsetsQ, mTable):
        lane, _, _ = cute.arch.thread_idx()
        block, batch, _ = cute.arch.block_idx()
        rows_total = mFunc.shape[2] - masks.FUNC_ROW_PADDING
        q_start, q_end = clamp_range(mOffsetsQ[batch], mOffsetsQ[batch + 1], rows_total)
        big = Int32(masks.FUNC_TABLE_BIG)
        # (key_lo, key_hi, common_end, common2_lo, common2_hi), each column's neutral value first.
        key_lo, key_hi, common_end, common2_lo, common2_hi = big, Int32(0), big, -big, big
        if cutlass.const_expr(self.n_func == 1):
            common2_lo, common2_hi = big, -big
        for half in cutlass.range_constexpr(masks.FUNC_BLOCK_ROWS // _LANES):
            row = q_start + block * masks.FUNC_BLOCK_ROWS + half * _LANES + lane
            if row < q_end:
                f0 = cutlass.min(cutlass.max(mFunc[0, 0, row], -big), big)
                if f0 > 0:
                    key_lo = Int32(0)
                key_hi = cutlass.max(key_hi, f0)
                common_end = cutlass.min(common_end, f0)
                if cutlass.const_expr(self.n_func == 3):
                    f1 = cutlass.min(cutlass.max(mFunc[0, 1, row], -big), big)
                    f2 = cutlass.min(cutlass.max(mFunc[0, 2, row], -big), big)
                    if f2 > f1:
                        key_lo = cutlass.min(key_lo, cutlass.max(f1, Int32(0)))
                        key_hi = cutlass.max(key_hi, f2)
                    common2_lo = cutlass.max(common2_lo, f1)
                    common2_hi = cutlass.min(common2_hi, f2)
        for shift in cutlass.range_constexpr(5):
            offset = 1 << shift
            key_lo = cutlass.min(key_lo, cute.arch.shuffle_sync_bfly(key_lo, offset))
            key_hi = cutlass.max(key_hi, cute.arch.shuffle_sync_bfly(key_hi, offset))
            common_end = cutlass.min(common_end, cute.arch.shuffle_sync_bfly(common_end, offset))
            common2_lo = cutlass.max(common2_lo, cute.arch.shuffle_sync_bfly(common2_lo, offset))
            common2_hi = cutlass.min(common2_hi, cute.arch.shuffle_sync_bfly(common2_hi, offset))
        if lane == 0:
            mTable[batch, block, 0] = key_lo
            mTable[batch, block, 1] = key_hi
            mTable[batch, block, 2] = common_end
            mTable[batch, block, 3] = common2_lo
            mTable[batch, block, 4] = common2_hi
        key_block_lo = cutlass.max(key_lo, Int32(0)) // masks.FUNC_BLOCK_ROWS
        key_block_hi = cutlass.min((key_hi + masks.FUNC_BLOCK_ROWS - 1) // masks.FUNC_BLOCK_ROWS, mTable.shape[1])
        for key_block in cutlass.range(key_block_lo + lane, key_block_hi, _LANES, unroll=1):
            first = mTable.iterator + cute.crd2idx((batch, key_block, 5), mTable.layout)
            past = mTable.iterator + cute.crd2idx((batch, key_block, 6), mTable.layout)
            cute.arch.atomic_max(first, big - block, sem="relaxed", scope="gpu")
            cute.arch.atomic_max(past, block + 1, sem="relaxed", scope="gpu")
