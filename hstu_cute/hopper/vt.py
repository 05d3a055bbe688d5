"""V^T for the pre-quantized FP8 forward: e4m3 V (T, H, D) -> (H, D, W), keys contiguous, in one
launch (quant modes write V^T in their quantizer's pass: :mod:`hstu_cute.hopper.quantize_slots`).

An 8-bit WGMMA reads its shared-memory B operand K-major only, so the FP8 forward's P.V needs V with
keys contiguous, and a TMA box must start 16-byte aligned along that dimension: sequence b's keys
start at column ``vt_column_start(off_b, b) = roundup16(off_b) + 16 b`` (a closed form the forward
recomputes, so no offsets tensor is made; every sequence fits before the next one's start; the
width is ``vt_width``; both in hstu_cute.fp8_format). Within every 16-key group of a sequence the keys are
stored in ``hstu_cute.fp8_format.KEY_AT_COLUMN`` order, the order in which the forward packs P into
its register operand (no shuffles there). The columns between sequences are never read unmasked:
the forward zeroes the key columns past a sequence in shared memory.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..fp8_format import vt_column_start, vt_key_column

# Tokens per CTA; rows of the staging tile are padded by 4 bytes so that reading one dim across
# the tokens (stride D + 4 bytes) hits 32 different banks.
VT_TOKENS = 64
_ROW_PAD = 4


class VTransposeSm90:
    """One CTA of 128 threads per (64 tokens, head): coalesced loads of the tokens' rows into a
    padded smem tile, a binary search of each token's sequence in the offsets (hence its column),
    then stores along the key columns of V^T."""

    def __init__(self, dtype, head_dim: int):
        assert dtype == cutlass.Float8E4M3FN, dtype
        self.dtype = dtype
        self.head_dim = head_dim
        self.num_threads = 128

    @cute.jit
    def __call__(self, mV, mVt, mOffsets, stream):
        grid = [(mV.shape[0] + VT_TOKENS - 1) // VT_TOKENS, mV.shape[1], 1]
        self.kernel(mV, mVt, mOffsets).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mV, mVt, mOffsets):
        D = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        chunk, head, _ = cute.arch.block_idx()
        tokens = mV.shape[0]
        batch = mOffsets.shape[0] - 1
        t0 = chunk * VT_TOKENS

        @cute.struct
        class Storage:
            sV: cute.struct.MemRange[cutlass.Float8E4M3FN, VT_TOKENS * (D + _ROW_PAD)]
            sColumn: cute.struct.MemRange[Int32, VT_TOKENS]

        storage = cutlass.memory.SmemAllocator().allocate(Storage)
        sV = storage.sV.get_tensor(cute.make_layout((VT_TOKENS, D), stride=(D + _ROW_PAD, 1)))
        sColumn = storage.sColumn.get_tensor(cute.make_layout(VT_TOKENS))

        for i in cutlass.range(tidx, VT_TOKENS * D, self.num_threads, unroll=4):
            j = i // D
            d = i - j * D
            t = t0 + j
            value = cutlass.Float8E4M3FN(0.0)
            if t < tokens:
                value = mV[t, head, d]
            sV[j, d] = value
        if tidx < VT_TOKENS:
            # The sequence of token t: the first b with offsets[b + 1] > t (b == batch: no owner).
            t = t0 + tidx
            lo, hi = Int32(0), batch
            while lo < hi:
                mid = (lo + hi) // 2
                if mOffsets[mid + 1] <= t:
                    lo = mid + 1
                else:
                    hi = mid
            column = Int32(-1)
            if lo < batch and t < tokens:
                start = mOffsets[lo]
                column = vt_column_start(start, lo) + vt_key_column(t - start)
            sColumn[tidx] = column
        cute.arch.sync_threads()
        for i in cutlass.range(tidx, VT_TOKENS * D, self.num_threads, unroll=4):
            d = i // VT_TOKENS
            j = i - d * VT_TOKENS
            column = sColumn[j]
            if column >= 0:
                mVt[head, d, column] = sV[j, d]
