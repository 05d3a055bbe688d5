"""HSTU attention backward for sm80+ (mma.sync, cp.async, ldmatrix).

Two kernels, no atomics, so results are bitwise identical run to run (``deterministic`` costs
nothing):

* :class:`HstuBackwardDkDvSm80` -- one CTA per (head, batch, n-block) owns K_j, V_j and walks the
  m-blocks that attend to it, in the transposed orientation (rows = keys):
  S^T = rab^T + K Q^T, dP^T = V dO^T, dV += P^T dO, dK += G^T Q.
* :class:`HstuBackwardDqSm80` -- one CTA per (head, batch, m-block) owns Q_i, dO_i and walks the
  forward's n-block schedule: S = rab + Q K^T, dP = dO V^T, dQ += G K, drab = G. With one rab
  head shared by all heads (H_rab = 1) a CTA loops over the heads and sums G in an fp32
  workspace in a fixed order.

With Z = alpha * S, P = silu(Z) / S_len and G = alpha * silu'(Z) * dP / S_len on allowed
entries (spec section 2); masked entries are selected to exact zeros.

Both kernels share one shape (:class:`_BackwardBase`): the CTA owns two tiles of one side (Q and
dO, or K and V) and double-buffers the two tiles (and rab) of the other side, one cp.async group
per block; per block the two score GEMMs (S and dP, A from the owned side), SiLU and its gradient,
the mask, then the GEMMs into the head-dim-wide outputs (B from the streamed side).
"""


# No ``from __future__ import annotations`` here: _plan's @cute.struct needs its field
# annotations evaluated, not kept as strings.
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .. import masks
from ..common.mask_apply import KERNEL_OPS, mask_dropped_blocks
from ..common.key_blocks import KeyBlocks
from ..common.seqinfo import BlockSparseArgs, BlockTiles, ScoreScalars, SequenceArgs, walked_block
from ..common.silu import silu_and_grad_inplace
from ..common.sm80 import (acc_to_operand_a, gemm_rs, gemm_ss, ldmatrix_copies, mma_acc_rows_cols, scores_init,
                           smem_layout_atom, smem_operands, transposed_view)
from .base import Sm80Kernel


class _ScoreOperands(NamedTuple):
    """The score GEMMs' operands (S and dP): A from the owned tiles, B from stage 0 of the
    streamed ones (``parts_b`` cover every stage)."""

    thr_mma: object
    copy_a: object
    copy_b: object
    copy_c: object  # ldmatrix into the accumulator layout (rab)
    frags_a: list
    frags_b: list
    parts_a: list
    parts_b: list


class _OutputOperands(NamedTuple):
    """The B operands (MN-major views of the streamed tiles) of the GEMMs into the head-dim-wide
    outputs; with ``warps_d`` > 1 also the 16-bit score tiles in smem that are their A operands
    (``score_smem``: the 32-bit store copy, its destinations, the A fragments and partitions)."""

    thr_mma: object
    copy_a: object
    copy_bt: object
    frags_b: list
    parts_b: list
    score_smem: object


class _BackwardBase(Sm80Kernel):
    # rab elements per cp.async: the launcher pads rab rows to 16 bytes, so always 8.
    rab_vec = 8

    def __init__(self, dtype, head_dim: int, mask: masks.MaskSpec, has_rab: bool, has_drab: bool, rab_sum_heads: bool,
                 tile_m: int, tile_n: int, num_warps: int, fast_silu: bool, warps_d: int = 1,
                 block_sparse: bool = False):
        super().__init__(dtype, head_dim, mask, has_rab, tile_m, tile_n, num_warps, fast_silu)
        self.has_drab, self.rab_sum_heads, self.warps_d = has_drab, rab_sum_heads, warps_d
        # A block mask (hstu_cute.block_mask): dQ walks each query tile's list of key tiles
        # (KeyBlocks.of_list), dK/dV each key tile's list of query tiles (seqinfo.walked_block).
        self.block_sparse = block_sparse

    def with_blocks(self, seqs, seq, batch, head):
        """``seq`` with its block-sparse tables (block-sparse kernels; others unchanged)."""
        if const_expr(self.block_sparse):
            seq.sparse = BlockTiles.of(seqs.blocks, batch, head)
        return seq

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    def _split_mmas(self, tiled_mma, score_rows: int, score_cols: int):
        """(tiled MMA of the score tiles S/dP, tiled MMA of the head-dim-wide outputs, smem layout
        of a 16-bit score tile or None). With ``warps_d`` > 1 the outputs are split over warps
        along the head dim, so no warp holds whole rows of the scores that feed them: those go
        through smem. The score GEMMs put warps along their rows first (16 each)."""
        if self.warps_d == 1:
            return tiled_mma, tiled_mma, None
        warps_m = min(self.num_warps, score_rows // 16)
        score_layout = cute.tile_to_shape(smem_layout_atom(self.dtype, score_cols), (score_rows, score_cols), (0, 1))
        return (self._mma(warps_m, self.num_warps // warps_m),
                self._mma(self.num_warps // self.warps_d, self.warps_d), score_layout)

    def _plan(self, score_rows: int, score_cols: int, q_stages, kv_stages, score_tiles: int = 1):
        """The kernel's static arguments: (sQ_layout, sK_layout, sRab_layout, score_layout,
        gmem_copy, gmem_store, gmem_copy_rab, tiled_mma, tiled_mma_out, SharedStorage). Q/dO
        tiles have tile_m rows, K/V tiles tile_n (``*_stages`` None: a single, unstaged tile),
        rab always two stages; SharedStorage holds them, with G (and P when ``score_tiles`` is 2)
        in ``score_layout`` tiles when the outputs are split (``warps_d`` > 1)."""
        atom, gmem_copy, gmem_store, gmem_copy_rab, tiled_mma = self._atoms()
        tiled_mma, tiled_mma_out, score_layout = self._split_mmas(tiled_mma, score_rows, score_cols)
        sQ_layout = self._tile_layout(atom, self.tile_m, q_stages)
        sK_layout = self._tile_layout(atom, self.tile_n, kv_stages)
        sRab_layout = self._rab_layout(2)
        rab_elems = cute.cosize(sRab_layout) if const_expr(self.has_rab) else 8

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sRab: cute.struct.Align[cute.struct.MemRange[self.dtype, rab_elems], 1024]
            if score_layout is not None:
                sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(score_layout)], 1024]
                if score_tiles == 2:
                    sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(score_layout)], 1024]

        return (sQ_layout, sK_layout, sRab_layout, score_layout, gmem_copy, gmem_store, gmem_copy_rab, tiled_mma,
                tiled_mma_out, SharedStorage)

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    def _smem_tiles(self, SharedStorage, sQ_layout, sK_layout):
        """(storage, sQ, sdO, sK, sV)."""
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        return (storage, storage.sQ.get_tensor(sQ_layout), storage.sdO.get_tensor(sQ_layout),
                storage.sK.get_tensor(sK_layout), storage.sV.get_tensor(sK_layout))

    def _score_operands(self, tiled_mma, tidx, a_tiles, b_tiles) -> _ScoreOperands:
        thr_mma = tiled_mma.get_slice(tidx)
        copy_a, copy_b, _, copy_c = ldmatrix_copies(self.dtype, tiled_mma, tidx)
        operands = smem_operands(thr_mma, copy_a, copy_b, a_tiles, b_tiles)
        return _ScoreOperands(thr_mma, copy_a, copy_b, copy_c, *operands)

    def _output_operands(self, tiled_mma, tiled_mma_out, tidx, b_tiles, storage, score_layout,
                         score_fields) -> _OutputOperands:
        """``b_tiles``: staged MN-major views; ``score_fields``: the SharedStorage fields of the
        score tiles, in the order of the scores passed to :meth:`output_gemms`."""
        thr_mma = tiled_mma_out.get_slice(tidx)
        copy_a, _, copy_bt, _ = ldmatrix_copies(self.dtype, tiled_mma_out, tidx)
        _, frags_b, _, parts_b = smem_operands(thr_mma, copy_a, copy_bt, [], b_tiles)
        score_smem = None
        if const_expr(self.warps_d > 1):
            tiles = [getattr(storage, field).get_tensor(score_layout) for field in score_fields]
            frags_a, _, parts_a, _ = smem_operands(thr_mma, copy_a, copy_bt, tiles, [])
            # Two adjacent accumulator columns per 32-bit store.
            store = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), tiled_mma
            ).get_slice(tidx)
            score_smem = (store, [store.partition_D(t) for t in tiles], frags_a, parts_a)
        return _OutputOperands(thr_mma, copy_a, copy_bt, frags_b, parts_b, score_smem)

    @cute.jit
    def load_block(self, gmem_copy, gmem_copy_rab, tiles, tXcX, tRgR, tRsR, tRcR, block: Int32, stage: Int32,
                   seqlen: Int32, along_keys: cutlass.Constexpr[bool], rab_limits):
        """Block ``block`` (of keys, or of queries) of the streamed side into smem stage
        ``stage``: each ``(tXgX, tXsX, zero_fill)`` of ``tiles`` (rows past ``seqlen``
        zero-filled or left alone) and its rab tile (``rab_limits(block)``: its row and column
        limits, a callable so that they are traced here, after the tile loads)."""
        tile = self.tile_n if const_expr(along_keys) else self.tile_m
        rows = seqlen - block * tile
        for tXgX, tXsX, zero_fill in tiles:
            self.load_rows(gmem_copy, tXgX[None, None, None, block], tXsX[None, None, None, stage], tXcX, rows,
                           zero_fill)
        if const_expr(self.has_rab):
            # Out-of-range chunks are zero-filled: in the dK/dV kernel a query row past seqlen_q
            # is only neutralized by its zero dO row, and 0 * (stale NaN) would not be 0.
            self.load_rab(gmem_copy_rab, tRgR[None, None, None, block], tRsR[None, None, None, stage], tRcR,
                          *rab_limits(block), True)

    def score_grads(self, tiled_mma, ops: _ScoreOperands, acc_S, stage, shape_mn, scalars) -> cute.Tensor:
        """S += A0 B0 on ``acc_S`` (rab or zeros), dP = A1 B1, then S -> P and dP -> G in place.
        Returns dP (now G)."""
        gemm_ss(tiled_mma, acc_S, ops.frags_a[0], ops.frags_b[0], ops.parts_a[0],
                ops.parts_b[0][None, None, None, stage], ops.copy_a, ops.copy_b)
        acc_dP = cute.make_rmem_tensor(ops.thr_mma.partition_shape_C(shape_mn), Float32)
        acc_dP.fill(0.0)
        gemm_ss(tiled_mma, acc_dP, ops.frags_a[1], ops.frags_b[1], ops.parts_a[1],
                ops.parts_b[1][None, None, None, stage], ops.copy_a, ops.copy_b)
        silu_and_grad_inplace(acc_S, acc_dP, scalars.alpha, scalars.inv_scale, self.fast_silu)
        return acc_dP

    @cute.jit
    def mask_tile(self, seq, m_block: Int32, n_block: Int32, row_first: Int32, col0: Int32, tScS,
                  key_major: cutlass.Constexpr[bool], accs):
        """Zero the masked elements of each accumulator of ``accs`` unless the tile is full.
        ``tScS``: each element's tile coordinate, (query, key), or (key, query) when key-major."""
        spec = self.mask
        is_full = masks.tile_is_full(spec, seq, m_block, n_block, self.tile_m, self.tile_n, KERNEL_OPS)
        if not is_full:
            for i in cutlass.range(cute.size(accs[0]), unroll_full=True):
                row, key = (tScS[i][1], tScS[i][0]) if const_expr(key_major) else (tScS[i][0], tScS[i][1])
                keep = masks.allowed(spec, seq, row_first + row, col0 + key, KERNEL_OPS)
                for acc in accs:
                    acc[i] = cutlass.select_(keep, acc[i], Float32(0.0))
        if const_expr(self.block_sparse):
            views = [cute.make_tensor(x.iterator, mma_acc_rows_cols(x.layout)) for x in (*accs, tScS)]
            mask_dropped_blocks(tuple(views[:-1]), views[-1], seq, m_block, n_block, row_first, col0, key_major,
                                rows_cols=self.tile_m if const_expr(key_major) else self.tile_n)

    def output_gemms(self, tiled_mma, tiled_mma_out, out: _OutputOperands, stage, scores, accs):
        """accs[i] += scores[i] (in dtype) @ B_i. With ``warps_d`` > 1 the scores go through smem
        first: every warp's rows are there before any warp reads them, and the next overwrite
        waits for the barrier at the top of the next block."""
        if const_expr(self.warps_d > 1):
            store, dsts, frags_a, parts_a = out.score_smem
            regs = [self._to_dtype(s) for s in scores]
            for r, dst in zip(regs, dsts):
                cute.copy(store, store.retile(r), dst)
            cute.arch.barrier()
            for acc, fa, pa, fb, pb in zip(accs, frags_a, parts_a, out.frags_b, out.parts_b):
                gemm_ss(tiled_mma_out, acc, fa, fb, pa, pb[None, None, None, stage], out.copy_a, out.copy_bt)
        else:
            for acc, s, fb, pb in zip(accs, scores, out.frags_b, out.parts_b):
                gemm_rs(tiled_mma, acc, acc_to_operand_a(self._to_dtype(s)), fb, pb[None, None, None, stage],
                        out.copy_bt)


class HstuBackwardDqSm80(_BackwardBase):
    """dQ (and drab) kernel. Grid (heads, batch, m-blocks), or (1, batch, m-blocks) with the head
    loop inside when one rab head is shared (rab_sum_heads).

    Warp roles: none (all warps load with cp.async and compute with mma.sync).
    Pipeline: per n-block one cp.async group (K, V, rab), wait_group(0) + CTA barrier, compute,
    barrier before the next group overwrites smem. Barriers: bar 0 only.

    With ``warps_d`` > 1 (head dim 256) the dQ accumulator is split over warps along the head
    dim: G goes through smem (sdS) as the A operand of dQ += G K, one more CTA barrier per n-block.
    """

    @cute.jit
    def __call__(self, mQ, mK, mV, mdO, mdQ, mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts,
                 mNumTargets, mFunc, mFuncBlocks, mRab, mdRab, mdRabAccum, alpha: Float32, inv_scale: Float32,
                 window_left: Int32, window_right: Int32, group_size: Int32, is_delta_q: Int32,
                 num_m_blocks: Int32, mBlockCount, mBlockIndex, mBlockState, mBlockKept, q_block, k_block, stream):
        # K, V (and rab) are double-buffered: the next n-block loads while this one computes.
        plan = self._plan(self.tile_m, self.tile_n, q_stages=None, kv_stages=2)
        heads_in_grid = 1 if const_expr(self.rab_sum_heads) else mQ.shape[1]
        blocks = None
        if const_expr(self.block_sparse):
            blocks = BlockSparseArgs(mBlockCount, mBlockIndex, mBlockState, mBlockKept, q_block, k_block)
        self._launch(
            mQ, mK, mV, mdO, mdQ, SequenceArgs(mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets, mFunc, mFuncBlocks,
                                               blocks),
            mRab, mdRab, mdRabAccum, ScoreScalars(alpha, inv_scale, window_left, window_right, group_size, is_delta_q),
            *plan, grid=[heads_in_grid, mOffsetsQ.shape[0] - 1, num_m_blocks], stream=stream,
        )

    @cute.kernel
    def kernel(self, mQ, mK, mV, mdO, mdQ, seqs, mRab, mdRab, mdRabAccum, scalars, sQ_layout, sK_layout,
               sRab_layout, sdS_layout, gmem_copy, gmem_store, gmem_copy_rab, tiled_mma, tiled_mma_dq,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        head_idx, batch, m_block_rev = cute.arch.block_idx()
        _, _, num_m_blocks = cute.arch.grid_dim()
        m_block = num_m_blocks - 1 - m_block_rev
        q_start, k_start, seqlen_q, seqlen_k, mask_of = self._sequence(seqs, scalars, mQ, mK, batch)
        if m_block * self.tile_m < seqlen_q:
            spec = self.mask
            # With rab_sum_heads one CTA walks every head: the launcher allows that only for a mask
            # shared by the heads (head_idx is 0 then).
            seq = self.with_blocks(seqs, mask_of(batch, seqlen_q, seqlen_k), batch, head_idx)
            if const_expr(self.block_sparse):
                blocks = KeyBlocks.of_list(spec, seq, m_block, self.tile_m, self.tile_n)
            else:
                blocks = KeyBlocks.of_tile(spec, seq, m_block, self.tile_m, self.tile_n)
            # No method call on a name inside the loops below (it would be carried through them).
            n_count, block_at = blocks.count, blocks.at
            row_first = seq.row_offset + m_block * self.tile_m
            q_rows = seqlen_q - m_block * self.tile_m

            storage, sQ, sdO, sK, sV = self._smem_tiles(SharedStorage, sQ_layout, sK_layout)
            sKt = transposed_view(sK, self.tile_n, self.head_dim, 2)
            ops = self._score_operands(tiled_mma, tidx, [sQ, sdO], [sK, sV])
            thr_mma, copy_c = ops.thr_mma, ops.copy_c
            # dQ += G K (the same tiled MMA as S unless split).
            out = self._output_operands(tiled_mma, tiled_mma_dq, tidx, [sKt], storage, sdS_layout, ["sdS"])
            cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
            tScS = thr_mma.partition_C(cS)
            thr_copy = gmem_copy.get_slice(tidx)
            tKVcKV = thr_copy.partition_S(cute.make_identity_tensor((self.tile_n, self.head_dim)))
            tQcQ = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
            if const_expr(self.has_rab):
                sRab = storage.sRab.get_tensor(sRab_layout)
                thr_copy_rab = gmem_copy_rab.get_slice(tidx)
                tRsR = thr_copy_rab.partition_D(sRab)
                tRcR = thr_copy_rab.partition_S(cS)
                tSsRab = copy_c.partition_S(sRab)
                rab_rows = cutlass.min(seq.row_offset + seqlen_q, mRab.shape[2]) - row_first
                rab_cols = cutlass.min(seqlen_k, mRab.shape[3])
            else:
                tRsR = tRcR = None
                rab_rows = rab_cols = Int32(0)
            rab_limits = lambda n_block: (rab_rows, rab_cols - n_block * self.tile_n)  # noqa: E731

            head_begin = head_idx
            head_end = head_idx + 1
            if const_expr(self.rab_sum_heads):
                head_begin = Int32(0)
                head_end = mQ.shape[1]
            for head in cutlass.range(head_begin, head_end, unroll=1):
                gQ, gdO, gdQ = [self._head_tile(t, q_start, head, self.tile_m, m_block) for t in (mQ, mdO, mdQ)]
                # GQA / MQA: k and v hold H_q / group heads; query head h reads key head h // group.
                kv_head = head // (mQ.shape[1] // mK.shape[1])
                gK, gV = [self._head_tile(t, k_start, kv_head, self.tile_n, None) for t in (mK, mV)]
                # K is dQ's B operand: rows past seqlen_k must be finite (G is 0 there).
                kv_tiles = ((thr_copy.partition_S(gK), thr_copy.partition_D(sK), True),
                            (thr_copy.partition_S(gV), thr_copy.partition_D(sV), False))
                self.load_rows(gmem_copy, thr_copy.partition_S(gQ), thr_copy.partition_D(sQ), tQcQ, q_rows, False)
                self.load_rows(gmem_copy, thr_copy.partition_S(gdO), thr_copy.partition_D(sdO), tQcQ, q_rows, False)
                tRgR = None
                if const_expr(self.has_rab):
                    gRab = self._rab_tiles(self._rab_slab(mRab, batch, head), seq.row_offset, (m_block, None))
                    tRgR = thr_copy_rab.partition_S(gRab)
                if const_expr(self.has_drab):
                    gdRab = self._rab_tiles(self._rab_slab(mdRab, batch, head), seq.row_offset, (m_block, None))
                    if const_expr(self.rab_sum_heads):
                        gdRabAcc = self._rab_tiles(mdRabAccum[batch, None, None], seq.row_offset, (m_block, None))
                acc_dQ = self._zero_acc(out.thr_mma, (self.tile_m, self.head_dim))
                if n_count > 0:
                    self.load_block(gmem_copy, gmem_copy_rab, kv_tiles, tKVcKV, tRgR, tRsR, tRcR,
                                    block_at(n_count - 1)[1], 0, seqlen_k,
                                    True, rab_limits)
                cute.arch.cp_async_commit_group()
                for it in cutlass.range(n_count, unroll=1):
                    stage = it % 2
                    n_block = block_at(n_count - 1 - it)[1]
                    # This stage's group has landed, and every thread is done with the other stage.
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.barrier()
                    if it + 1 < n_count:
                        self.load_block(gmem_copy, gmem_copy_rab, kv_tiles, tKVcKV, tRgR, tRsR, tRcR,
                                        block_at(n_count - 2 - it)[1],
                                        1 - stage, seqlen_k, True, rab_limits)
                    cute.arch.cp_async_commit_group()

                    acc_S = scores_init(
                        thr_mma, (self.tile_m, self.tile_n), self.dtype, copy_c,
                        tSsRab[None, None, None, stage] if const_expr(self.has_rab) else None,
                    )
                    acc_dP = self.score_grads(tiled_mma, ops, acc_S, stage, (self.tile_m, self.tile_n), scalars)
                    col0 = n_block * self.tile_n
                    self.mask_tile(seq, m_block, n_block, row_first, col0, tScS, False, [acc_dP])
                    if const_expr(self.has_drab):
                        tCgdR = thr_mma.partition_C(gdRab[None, None, n_block])
                        if const_expr(self.rab_sum_heads):
                            tCgdA = thr_mma.partition_C(gdRabAcc[None, None, n_block])
                        for i in cutlass.range_constexpr(cute.size(acc_dP)):
                            if tScS[i][0] < q_rows and tScS[i][1] < rab_cols - col0:
                                if const_expr(self.rab_sum_heads):
                                    total = tCgdA[i] + acc_dP[i]
                                    tCgdA[i] = total
                                    if head == head_end - 1:
                                        tCgdR[i] = total.to(self.dtype)
                                else:
                                    tCgdR[i] = acc_dP[i].to(self.dtype)
                    self.output_gemms(tiled_mma, tiled_mma_dq, out, stage, [acc_dP], [acc_dQ])
                # Drain every group (with no n-block, the Q/dO loads too) before staging in sQ.
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                self.store_rows(gmem_store, tiled_mma_dq, acc_dQ, sQ, gdQ, tidx, q_rows)
                cute.arch.barrier()


class HstuBackwardDkDvSm80(_BackwardBase):
    """dK, dV kernel. Grid (heads, batch, n-blocks); n-block 0 first (with causal masks the early
    keys are attended by the most queries).

    Warp roles: none. Pipeline: per m-block one cp.async group (Q, dO, rab), wait_group(0) + CTA
    barrier, compute, barrier. Barriers: bar 0 only.

    With ``warps_d`` > 1 (head dim 256) the dK/dV accumulators are split over warps along the
    head dim: no warp then holds whole rows of P^T and G^T, so they are written to smem (sP,
    sdS) and read back as the A operand, one more CTA barrier per m-block.
    """

    @cute.jit
    def __call__(self, mQ, mK, mV, mdO, mdK, mdV, mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts,
                 mNumTargets, mFunc, mFuncBlocks, mRab, alpha: Float32, inv_scale: Float32, window_left: Int32, window_right: Int32,
                 group_size: Int32, is_delta_q: Int32, num_n_blocks: Int32, mBlockCount, mBlockIndex, mBlockState,
                 mBlockKept, q_block, k_block, stream):
        # Q, dO (and rab) are double-buffered: the next m-block loads while this one computes.
        plan = self._plan(self.tile_n, self.tile_m, q_stages=2, kv_stages=None, score_tiles=2)
        blocks = None
        if const_expr(self.block_sparse):
            blocks = BlockSparseArgs(mBlockCount, mBlockIndex, mBlockState, mBlockKept, q_block, k_block)
        self._launch(
            mQ, mK, mV, mdO, mdK, mdV, SequenceArgs(mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts,
                                                    mNumTargets, mFunc, mFuncBlocks, blocks),
            mRab, ScoreScalars(alpha, inv_scale, window_left, window_right, group_size, is_delta_q),
            *plan, grid=[mQ.shape[1], mOffsetsQ.shape[0] - 1, num_n_blocks], stream=stream,
        )

    @cute.kernel
    def kernel(self, mQ, mK, mV, mdO, mdK, mdV, seqs, mRab, scalars, sQ_layout, sK_layout, sRab_layout, sP_layout,
               gmem_copy, gmem_store, gmem_copy_rab, tiled_mma, tiled_mma_dkv, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        head, batch, n_block = cute.arch.block_idx()
        q_start, k_start, seqlen_q, seqlen_k, mask_of = self._sequence(seqs, scalars, mQ, mK, batch)
        if n_block * self.tile_n < seqlen_k:
            spec = self.mask
            seq = self.with_blocks(seqs, mask_of(batch, seqlen_q, seqlen_k), batch, head)
            m_lo, m_hi = masks.m_block_range(spec, seq, n_block, self.tile_m, self.tile_n, KERNEL_OPS)
            if const_expr(self.block_sparse):
                # The walk takes the key block's list of query blocks inside [m_lo, m_hi) (the
                # launcher passes the transposed lists to this kernel).
                first, count = seq.sparse.list_range(n_block, m_lo, m_hi)
                m_lo, m_hi = first, first + count
            k_rows = seqlen_k - n_block * self.tile_n
            col0 = n_block * self.tile_n  # key coordinate of this CTA's first key

            storage, sQ, sdO, sK, sV = self._smem_tiles(SharedStorage, sQ_layout, sK_layout)
            sQt = transposed_view(sQ, self.tile_m, self.head_dim, 2)
            sdOt = transposed_view(sdO, self.tile_m, self.head_dim, 2)

            # GQA / MQA: k and v hold H_q / group heads (query head h reads key head h // group);
            # dK and dV stay per query head, the launcher sums each group.
            kv_head = head // (mQ.shape[1] // mK.shape[1])
            gK, gV = [self._head_tile(t, k_start, kv_head, self.tile_n, n_block) for t in (mK, mV)]
            gdK, gdV = [self._head_tile(t, k_start, head, self.tile_n, n_block) for t in (mdK, mdV)]
            gQ, gdO = [self._head_tile(t, q_start, head, self.tile_m, None) for t in (mQ, mdO)]

            thr_copy = gmem_copy.get_slice(tidx)
            tKVcKV = thr_copy.partition_S(cute.make_identity_tensor((self.tile_n, self.head_dim)))
            tQcQ = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
            # Q and dO rows past seqlen_q are zero-filled: then their dP (hence G) and their dO
            # are 0, so they add nothing to dK and dV.
            qdo_tiles = ((thr_copy.partition_S(gQ), thr_copy.partition_D(sQ), True),
                         (thr_copy.partition_S(gdO), thr_copy.partition_D(sdO), True))
            # K/V rows past seqlen_k only feed dK/dV rows that are never stored.
            self.load_rows(gmem_copy, thr_copy.partition_S(gK), thr_copy.partition_D(sK), tKVcKV, k_rows, False)
            self.load_rows(gmem_copy, thr_copy.partition_S(gV), thr_copy.partition_D(sV), tKVcKV, k_rows, False)
            # Commit now: wait_group only covers committed groups, and with no m-block (a sequence
            # without queries) these loads would otherwise land in the dK/dV staging buffers.
            cute.arch.cp_async_commit_group()

            ops = self._score_operands(tiled_mma, tidx, [sK, sV], [sQ, sdO])
            thr_mma = ops.thr_mma
            # dV += P^T dO and dK += G^T Q (the same tiled MMA as S^T unless split).
            out = self._output_operands(tiled_mma, tiled_mma_dkv, tidx, [sdOt, sQt], storage, sP_layout,
                                        ["sP", "sdS"])
            # Transposed orientation: accumulator rows are keys, columns are queries.
            cST = cute.make_identity_tensor((self.tile_n, self.tile_m))
            tScST = thr_mma.partition_C(cST)
            if const_expr(self.has_rab):
                sRab = storage.sRab.get_tensor(sRab_layout)
                sRabT = transposed_view(sRab, self.tile_m, self.tile_n, 2)
                thr_copy_rab = gmem_copy_rab.get_slice(tidx)
                tRsR = thr_copy_rab.partition_D(sRab)
                tRcR = thr_copy_rab.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_n)))
                gRab = self._rab_tiles(self._rab_slab(mRab, batch, head), seq.row_offset, (None, n_block))
                tRgR = thr_copy_rab.partition_S(gRab)
                rab_cols = cutlass.min(seqlen_k, mRab.shape[3]) - col0
            else:
                tRgR = tRsR = tRcR = None
                rab_cols = Int32(0)

            acc_dK = self._zero_acc(out.thr_mma, (self.tile_n, self.head_dim))
            acc_dV = self._zero_acc(out.thr_mma, (self.tile_n, self.head_dim))
            rab_row_end = Int32(0)
            if const_expr(self.has_rab):
                rab_row_end = cutlass.min(seq.row_offset + seqlen_q, mRab.shape[2])
            rab_limits = lambda m_block: (rab_row_end - seq.row_offset - m_block * self.tile_m, rab_cols)  # noqa: E731
            if m_lo < m_hi:
                self.load_block(gmem_copy, gmem_copy_rab, qdo_tiles, tQcQ, tRgR, tRsR, tRcR,
                                walked_block(self.block_sparse, seq, n_block, m_lo), 0, seqlen_q, False, rab_limits)
            cute.arch.cp_async_commit_group()
            for step in cutlass.range(m_lo, m_hi, unroll=1):
                m_block = walked_block(self.block_sparse, seq, n_block, step)
                stage = (step - m_lo) % 2
                # This stage's group has landed, and every thread is done with the other stage.
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                if step + 1 < m_hi:
                    self.load_block(gmem_copy, gmem_copy_rab, qdo_tiles, tQcQ, tRgR, tRsR, tRcR,
                                    walked_block(self.block_sparse, seq, n_block, step + 1), 1 - stage, seqlen_q,
                                    False, rab_limits)
                cute.arch.cp_async_commit_group()
                if masks.tile_nonempty(spec, seq, m_block, n_block, self.tile_m, self.tile_n, KERNEL_OPS):
                    row_first = seq.row_offset + m_block * self.tile_m
                    acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_n, self.tile_m)), Float32)
                    if const_expr(self.has_rab):
                        # Element loads: the transposed view of the swizzled tile has no vector path.
                        tSsRabT = thr_mma.partition_C(sRabT[None, None, stage])
                        for i in cutlass.range(cute.size(acc_S), unroll_full=True):
                            acc_S[i] = tSsRabT[i].to(Float32)
                    else:
                        acc_S.fill(0.0)
                    acc_dP = self.score_grads(tiled_mma, ops, acc_S, stage, (self.tile_n, self.tile_m), scalars)
                    self.mask_tile(seq, m_block, n_block, row_first, col0, tScST, True, [acc_S, acc_dP])
                    self.output_gemms(tiled_mma, tiled_mma_dkv, out, stage, [acc_S, acc_dP], [acc_dV, acc_dK])
            # No m-block may have run: drain the K/V group before sK/sV become staging buffers.
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            self.store_rows(gmem_store, tiled_mma_dkv, acc_dK, sK, gdK, tidx, k_rows)
            self.store_rows(gmem_store, tiled_mma_dkv, acc_dV, sV, gdV, tidx, k_rows)
