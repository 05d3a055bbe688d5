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
"""


# No ``from __future__ import annotations`` here: _smem_plan's @cute.struct needs its field
# annotations evaluated, not kept as strings.
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp

from .. import masks
from ..common.mask_apply import KERNEL_OPS
from ..common.seqinfo import sequence_bounds, sequence_mask
from ..common.silu import silu_and_grad_inplace
from ..common.sm80 import acc_to_operand_a, gemm_rs, gemm_ss, ldmatrix_copies, scores_init, smem_layout_atom


class _BackwardBase:
    # rab elements per cp.async: the launcher pads rab rows to 16 bytes, so always 8.
    rab_vec = 8

    def __init__(self, dtype, head_dim: int, mask: masks.MaskSpec, has_rab: bool, has_drab: bool, rab_sum_heads: bool, tile_m: int, tile_n: int, num_warps: int,
                 fast_silu: bool, warps_d: int = 1):
        self.dtype = dtype
        self.head_dim = head_dim
        self.mask = mask
        self.has_rab = has_rab
        self.has_drab = has_drab
        self.rab_sum_heads = rab_sum_heads
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_warps = num_warps
        self.num_threads = num_warps * 32
        self.fast_silu = fast_silu
        self.warps_d = warps_d

    def _mma(self, warps_m: int, warps_n: int):
        # Each warp covers 16 x 16 of the tile per step (two n8 atoms), so ldmatrix x4 feeds it.
        return cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)),
            (warps_m, warps_n, 1),
            permutation_mnk=(warps_m * 16, warps_n * 16, 16),
        )

    def _atoms(self):
        D = self.head_dim
        atom = smem_layout_atom(self.dtype, D)
        vec = 128 // self.dtype.width
        copy_g2s = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype, num_bits_per_copy=128
        )
        threads_per_row = atom.outer.shape[1] // vec
        thr_layout = cute.make_ordered_layout((self.num_threads // threads_per_row, threads_per_row), order=(1, 0))
        gmem_copy = cute.make_tiled_copy_tv(copy_g2s, thr_layout, cute.make_layout((1, vec)))
        copy_r2g = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        gmem_store = cute.make_tiled_copy_tv(copy_r2g, thr_layout, cute.make_layout((1, vec)))
        gmem_copy_rab = None
        if const_expr(self.has_rab):
            rab_atom = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), self.dtype,
                num_bits_per_copy=self.rab_vec * self.dtype.width,
            )
            rab_threads_per_row = min(self.tile_n // self.rab_vec, self.num_threads)
            gmem_copy_rab = cute.make_tiled_copy_tv(
                rab_atom,
                cute.make_ordered_layout((self.num_threads // rab_threads_per_row, rab_threads_per_row), order=(1, 0)),
                cute.make_layout((1, self.rab_vec)),
            )
        tiled_mma = self._mma(self.num_warps, 1)
        return atom, gmem_copy, gmem_store, gmem_copy_rab, tiled_mma

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

    def _smem_plan(self, atom, q_stages: int, kv_stages: int, score_layout=None, score_tiles: int = 1):
        """Layouts of the Q/dO tiles (tile_m rows), K/V tiles (tile_n rows) and the rab tile
        (always two stages), and the SharedStorage struct that holds them (with G, and P when
        ``score_tiles`` is 2, in ``score_layout`` tiles when given)."""

        def tiles(rows, stages):
            if stages == 1:
                return cute.tile_to_shape(atom, (rows, self.head_dim), (0, 1))
            return cute.tile_to_shape(atom, (rows, self.head_dim, stages), (0, 1, 2))

        sQ_layout, sK_layout = tiles(self.tile_m, q_stages), tiles(self.tile_n, kv_stages)
        sRab_layout = None
        rab_elems = 8
        if const_expr(self.has_rab):
            sRab_layout = cute.tile_to_shape(smem_layout_atom(self.dtype, self.tile_n),
                                             (self.tile_m, self.tile_n, 2), (0, 1, 2))
            rab_elems = cute.cosize(sRab_layout)

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

        return sQ_layout, sK_layout, sRab_layout, SharedStorage

    @cute.jit
    def load_rows(self, gmem_copy, tXgX, tXsX, tXcX, row_limit: Int32, zero_fill: cutlass.Constexpr[bool]):
        """Rows < row_limit of a tile; the others zero-filled (finite) or left alone."""
        for m in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
            if tXcX[0, m, 0][0] < row_limit:
                cute.copy(gmem_copy, tXgX[None, m, None], tXsX[None, m, None])
            elif const_expr(zero_fill):
                tXsX[None, m, None].fill(0)

    @cute.jit
    def load_rab(self, gmem_copy, tRgR, tRsR, tRcR, row_limit: Int32, col_limit: Int32):
        # Out-of-range chunks are zero-filled: in the dK/dV kernel a query row past seqlen_q
        # is only neutralized by its zero dO row, and 0 * (stale NaN) would not be 0.
        if row_limit < self.tile_m or col_limit < self.tile_n:
            for m in cutlass.range_constexpr(cute.size(tRsR.shape[1])):
                for n in cutlass.range_constexpr(cute.size(tRsR.shape[2])):
                    if tRcR[0, m, n][0] < row_limit and tRcR[0, m, n][1] < col_limit:
                        cute.copy(gmem_copy, tRgR[None, m, n], tRsR[None, m, n])
                    else:
                        tRsR[None, m, n].fill(0)
        else:
            cute.copy(gmem_copy, tRgR, tRsR)

    @cute.jit
    def store_rows(self, gmem_store, tiled_mma, acc, sStage, gOut, tidx, row_limit: Int32):
        """acc (fp32, C layout) -> dtype -> smem staging -> 128-bit stores of rows < row_limit.
        The caller barriers before (sStage free) and after (sStage reusable)."""
        rO = cute.make_fragment_like(acc, self.dtype)
        rO.store(acc.load().to(self.dtype))
        smem_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), tiled_mma
        ).get_slice(tidx)
        cute.copy(smem_copy, smem_copy.retile(rO), smem_copy.partition_D(sStage))
        cute.arch.barrier()
        thr = gmem_store.get_slice(tidx)
        tOsO = thr.partition_S(sStage)
        tOgO = thr.partition_D(gOut)
        tOcO = thr.partition_D(cute.make_identity_tensor(gOut.shape))
        tOrO = cute.make_fragment_like(tOgO, self.dtype)
        cute.copy(gmem_store, tOsO, tOrO)
        for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
            if tOcO[0, m, 0][0] < row_limit:
                cute.copy(gmem_store, tOrO[None, m, None], tOgO[None, m, None])


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
                 mNumTargets, mRab, mdRab, mdRabAccum, alpha: Float32, inv_scale: Float32,
                 window_left: Int32, window_right: Int32, group_size: Int32, is_delta_q: Int32,
                 num_m_blocks: Int32, stream):
        atom, gmem_copy, gmem_store, gmem_copy_rab, tiled_mma = self._atoms()
        tiled_mma, tiled_mma_dq, sdS_layout = self._split_mmas(tiled_mma, self.tile_m, self.tile_n)
        # K, V (and rab) are double-buffered: the next n-block loads while this one computes.
        sQ_layout, sK_layout, sRab_layout, SharedStorage = self._smem_plan(atom, q_stages=1, kv_stages=2,
                                                                           score_layout=sdS_layout)

        heads_in_grid = 1 if const_expr(self.rab_sum_heads) else mQ.shape[1]
        self.kernel(
            mQ, mK, mV, mdO, mdQ, mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets, mRab,
            mdRab, mdRabAccum, alpha, inv_scale, window_left, window_right, group_size, is_delta_q,
            sQ_layout, sK_layout, sRab_layout, sdS_layout, gmem_copy, gmem_store, gmem_copy_rab, tiled_mma,
            tiled_mma_dq, SharedStorage,
        ).launch(
            grid=[heads_in_grid, mOffsetsQ.shape[0] - 1, num_m_blocks],
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.jit
    def load_k_v(self, gmem_copy, gmem_copy_rab, tKgK, tKsK, tVgV, tVsV, tKVcKV, tRgR, tRsR, tRcR,
                 n_block: Int32, stage: Int32, seqlen_k: Int32, rab_rows: Int32, rab_cols: Int32):
        k_rows = seqlen_k - n_block * self.tile_n
        # K is dQ's B operand: rows past seqlen_k must be finite (G is 0 there).
        self.load_rows(gmem_copy, tKgK[None, None, None, n_block], tKsK[None, None, None, stage], tKVcKV, k_rows, True)
        self.load_rows(gmem_copy, tVgV[None, None, None, n_block], tVsV[None, None, None, stage], tKVcKV, k_rows,
                       False)
        if const_expr(self.has_rab):
            self.load_rab(gmem_copy_rab, tRgR[None, None, None, n_block], tRsR[None, None, None, stage], tRcR,
                          rab_rows, rab_cols - n_block * self.tile_n)

    @cute.kernel
    def kernel(self, mQ, mK, mV, mdO, mdQ, mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets,
               mRab, mdRab, mdRabAccum, alpha: Float32, inv_scale: Float32, window_left: Int32,
               window_right: Int32, group_size: Int32, is_delta_q: Int32, sQ_layout, sK_layout, sRab_layout,
               sdS_layout, gmem_copy, gmem_store, gmem_copy_rab, tiled_mma, tiled_mma_dq,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        head_idx, batch, m_block_rev = cute.arch.block_idx()
        _, _, num_m_blocks = cute.arch.grid_dim()
        m_block = num_m_blocks - 1 - m_block_rev
        q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(
            mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mQ.shape[0], mK.shape[0], batch)
        if m_block * self.tile_m < seqlen_q:
            spec = self.mask
            seq = sequence_mask(spec, seqlen_q, seqlen_k, mNumContexts, mNumTargets, batch, window_left,
                                window_right, group_size, is_delta_q)
            n_lo, hole_lo, hole_size, n_count = masks.n_block_schedule(
                spec, seq, m_block, self.tile_m, self.tile_n, KERNEL_OPS)
            row_first = seq.row_offset + m_block * self.tile_m
            q_rows = seqlen_q - m_block * self.tile_m

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sdO = storage.sdO.get_tensor(sQ_layout)
            sK = storage.sK.get_tensor(sK_layout)
            sV = storage.sV.get_tensor(sK_layout)
            sKt = cute.composition(sK, cute.make_layout((self.head_dim, self.tile_n, 2),
                                                        stride=(self.tile_n, 1, self.tile_n * self.head_dim)))

            thr_mma = tiled_mma.get_slice(tidx)
            copy_a, copy_b, _, copy_c = ldmatrix_copies(self.dtype, tiled_mma, tidx)
            tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
            tSrdO = thr_mma.make_fragment_A(thr_mma.partition_A(sdO))
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
            tSrV = thr_mma.make_fragment_B(thr_mma.partition_B(sV[None, None, 0]))
            tSsQ, tSsdO = copy_a.partition_S(sQ), copy_a.partition_S(sdO)
            tSsK, tSsV = copy_b.partition_S(sK), copy_b.partition_S(sV)
            # dQ += G K (the same tiled MMA as S unless split).
            thr_mma_dq = tiled_mma_dq.get_slice(tidx)
            copy_dq_a, _, copy_dq_bt, _ = ldmatrix_copies(self.dtype, tiled_mma_dq, tidx)
            tQrKt = thr_mma_dq.make_fragment_B(thr_mma_dq.partition_B(sKt[None, None, 0]))
            tQsKt = copy_dq_bt.partition_S(sKt)
            if const_expr(self.warps_d > 1):
                sdS = storage.sdS.get_tensor(sdS_layout)
                tQrdS = thr_mma_dq.make_fragment_A(thr_mma_dq.partition_A(sdS))
                tQsdS = copy_dq_a.partition_S(sdS)
                # Two adjacent accumulator columns per 32-bit store.
                g_store = cute.make_tiled_copy_C(
                    cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), tiled_mma
                ).get_slice(tidx)
                tGsdS = g_store.partition_D(sdS)
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

            head_begin = head_idx
            head_end = head_idx + 1
            if const_expr(self.rab_sum_heads):
                head_begin = Int32(0)
                head_end = mQ.shape[1]
            for head in cutlass.range(head_begin, head_end, unroll=1):
                gQ = cute.local_tile(cute.domain_offset((q_start, 0), mQ[None, head, None]),
                                     (self.tile_m, self.head_dim), (m_block, 0))
                gdO = cute.local_tile(cute.domain_offset((q_start, 0), mdO[None, head, None]),
                                      (self.tile_m, self.head_dim), (m_block, 0))
                gdQ = cute.local_tile(cute.domain_offset((q_start, 0), mdQ[None, head, None]),
                                      (self.tile_m, self.head_dim), (m_block, 0))
                gK = cute.local_tile(cute.domain_offset((k_start, 0), mK[None, head, None]),
                                     (self.tile_n, self.head_dim), (None, 0))
                gV = cute.local_tile(cute.domain_offset((k_start, 0), mV[None, head, None]),
                                     (self.tile_n, self.head_dim), (None, 0))
                tKgK, tKsK = thr_copy.partition_S(gK), thr_copy.partition_D(sK)
                tVgV, tVsV = thr_copy.partition_S(gV), thr_copy.partition_D(sV)
                self.load_rows(gmem_copy, thr_copy.partition_S(gQ), thr_copy.partition_D(sQ), tQcQ, q_rows, False)
                self.load_rows(gmem_copy, thr_copy.partition_S(gdO), thr_copy.partition_D(sdO), tQcQ, q_rows, False)
                if const_expr(self.has_rab):
                    rab_head = cutlass.select_(mRab.shape[1] > 1, head, Int32(0))
                    gRab = cute.local_tile(cute.domain_offset((seq.row_offset, 0), mRab[batch, rab_head, None, None]),
                                           (self.tile_m, self.tile_n), (m_block, None))
                    tRgR = thr_copy_rab.partition_S(gRab)
                else:
                    tRgR = None
                if const_expr(self.has_drab):
                    drab_head = cutlass.select_(mdRab.shape[1] > 1, head, Int32(0))
                    gdRab = cute.local_tile(cute.domain_offset((seq.row_offset, 0), mdRab[batch, drab_head, None, None]),
                                            (self.tile_m, self.tile_n), (m_block, None))
                    if const_expr(self.rab_sum_heads):
                        gdRabAcc = cute.local_tile(
                            cute.domain_offset((seq.row_offset, 0), mdRabAccum[batch, None, None]),
                            (self.tile_m, self.tile_n), (m_block, None))
                acc_dQ = cute.make_rmem_tensor(thr_mma_dq.partition_shape_C((self.tile_m, self.head_dim)), Float32)
                acc_dQ.fill(0.0)
                if n_count > 0:
                    self.load_k_v(gmem_copy, gmem_copy_rab, tKgK, tKsK, tVgV, tVsV, tKVcKV, tRgR, tRsR, tRcR,
                                  masks.n_block_at(n_count - 1, n_lo, hole_lo, hole_size, KERNEL_OPS), 0, seqlen_k,
                                  rab_rows, rab_cols)
                cute.arch.cp_async_commit_group()
                for it in cutlass.range(n_count, unroll=1):
                    stage = it % 2
                    n_block = masks.n_block_at(n_count - 1 - it, n_lo, hole_lo, hole_size, KERNEL_OPS)
                    # This stage's group has landed, and every thread is done with the other stage.
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.barrier()
                    if it + 1 < n_count:
                        self.load_k_v(gmem_copy, gmem_copy_rab, tKgK, tKsK, tVgV, tVsV, tKVcKV, tRgR, tRsR, tRcR,
                                      masks.n_block_at(n_count - 2 - it, n_lo, hole_lo, hole_size, KERNEL_OPS),
                                      1 - stage, seqlen_k, rab_rows, rab_cols)
                    cute.arch.cp_async_commit_group()

                    acc_S = scores_init(
                        thr_mma, (self.tile_m, self.tile_n), self.dtype, copy_c,
                        tSsRab[None, None, None, stage] if const_expr(self.has_rab) else None,
                    )
                    gemm_ss(tiled_mma, acc_S, tSrQ, tSrK, tSsQ, tSsK[None, None, None, stage], copy_a, copy_b)
                    acc_dP = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.tile_n)), Float32)
                    acc_dP.fill(0.0)
                    gemm_ss(tiled_mma, acc_dP, tSrdO, tSrV, tSsdO, tSsV[None, None, None, stage], copy_a, copy_b)
                    silu_and_grad_inplace(acc_S, acc_dP, alpha, inv_scale, self.fast_silu)
                    col0 = n_block * self.tile_n
                    is_full = masks.tile_is_full(spec, seq, m_block, n_block, self.tile_m, self.tile_n, KERNEL_OPS)
                    if not is_full:
                        for i in cutlass.range(cute.size(acc_dP), unroll_full=True):
                            keep = masks.allowed(spec, seq, row_first + tScS[i][0], col0 + tScS[i][1], KERNEL_OPS)
                            acc_dP[i] = cutlass.select_(keep, acc_dP[i], Float32(0.0))
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
                    rG = cute.make_fragment_like(acc_dP, self.dtype)
                    rG.store(acc_dP.load().to(self.dtype))
                    if const_expr(self.warps_d > 1):
                        cute.copy(g_store, g_store.retile(rG), tGsdS)
                        # Every warp's rows of G are in smem before any warp reads them; the next
                        # overwrite waits for the barrier at the top of the next n-block.
                        cute.arch.barrier()
                        gemm_ss(tiled_mma_dq, acc_dQ, tQrdS, tQrKt, tQsdS, tQsKt[None, None, None, stage], copy_dq_a,
                                copy_dq_bt)
                    else:
                        gemm_rs(tiled_mma, acc_dQ, acc_to_operand_a(rG), tQrKt, tQsKt[None, None, None, stage],
                                copy_dq_bt)
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
    head dim: no warp then holds whole rows of P^T and G^T, so they are written to smem (sPt,
    sdSt) and read back as the A operand, one more CTA barrier per m-block.
    """

    @cute.jit
    def __call__(self, mQ, mK, mV, mdO, mdK, mdV, mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts,
                 mNumTargets, mRab, alpha: Float32, inv_scale: Float32, window_left: Int32, window_right: Int32,
                 group_size: Int32, is_delta_q: Int32, num_n_blocks: Int32, stream):
        atom, gmem_copy, gmem_store, gmem_copy_rab, tiled_mma = self._atoms()
        tiled_mma, tiled_mma_dkv, sP_layout = self._split_mmas(tiled_mma, self.tile_n, self.tile_m)
        # Q, dO (and rab) are double-buffered: the next m-block loads while this one computes.
        sQ_layout, sK_layout, sRab_layout, SharedStorage = self._smem_plan(atom, q_stages=2, kv_stages=1,
                                                                           score_layout=sP_layout, score_tiles=2)

        self.kernel(
            mQ, mK, mV, mdO, mdK, mdV, mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets, mRab,
            alpha, inv_scale, window_left, window_right, group_size, is_delta_q,
            sQ_layout, sK_layout, sRab_layout, sP_layout, gmem_copy, gmem_store, gmem_copy_rab, tiled_mma,
            tiled_mma_dkv, SharedStorage,
        ).launch(
            grid=[mQ.shape[1], mOffsetsQ.shape[0] - 1, num_n_blocks],
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.jit
    def load_q_do(self, gmem_copy, gmem_copy_rab, tQgQ, tQsQ, tQgdO, tQsdO, tQcQ, tRgR, tRsR, tRcR,
                  m_block: Int32, stage: Int32, seqlen_q: Int32, row_offset: Int32, rab_row_end: Int32,
                  rab_cols: Int32):
        # Q and dO rows past seqlen_q are zero-filled: then their dP (hence G) and their dO are 0,
        # so they add nothing to dK and dV.
        q_rows = seqlen_q - m_block * self.tile_m
        self.load_rows(gmem_copy, tQgQ[None, None, None, m_block], tQsQ[None, None, None, stage], tQcQ, q_rows, True)
        self.load_rows(gmem_copy, tQgdO[None, None, None, m_block], tQsdO[None, None, None, stage], tQcQ, q_rows,
                       True)
        if const_expr(self.has_rab):
            self.load_rab(gmem_copy_rab, tRgR[None, None, None, m_block], tRsR[None, None, None, stage], tRcR,
                          rab_row_end - row_offset - m_block * self.tile_m, rab_cols)

    @cute.kernel
    def kernel(self, mQ, mK, mV, mdO, mdK, mdV, mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts,
               mNumTargets, mRab, alpha: Float32, inv_scale: Float32, window_left: Int32, window_right: Int32,
               group_size: Int32, is_delta_q: Int32, sQ_layout, sK_layout, sRab_layout, sP_layout, gmem_copy,
               gmem_store, gmem_copy_rab, tiled_mma, tiled_mma_dkv, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        head, batch, n_block = cute.arch.block_idx()
        q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(
            mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mQ.shape[0], mK.shape[0], batch)
        if n_block * self.tile_n < seqlen_k:
            spec = self.mask
            seq = sequence_mask(spec, seqlen_q, seqlen_k, mNumContexts, mNumTargets, batch, window_left,
                                window_right, group_size, is_delta_q)
            m_lo, m_hi = masks.m_block_range(spec, seq, n_block, self.tile_m, self.tile_n, KERNEL_OPS)
            k_rows = seqlen_k - n_block * self.tile_n
            col0 = n_block * self.tile_n  # key coordinate of this CTA's first key

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sdO = storage.sdO.get_tensor(sQ_layout)
            sK = storage.sK.get_tensor(sK_layout)
            sV = storage.sV.get_tensor(sK_layout)
            qt_view = cute.make_layout((self.head_dim, self.tile_m, 2), stride=(self.tile_m, 1, self.tile_m * self.head_dim))
            sQt = cute.composition(sQ, qt_view)
            sdOt = cute.composition(sdO, qt_view)

            gK = cute.local_tile(cute.domain_offset((k_start, 0), mK[None, head, None]), (self.tile_n, self.head_dim), (n_block, 0))
            gV = cute.local_tile(cute.domain_offset((k_start, 0), mV[None, head, None]), (self.tile_n, self.head_dim), (n_block, 0))
            gdK = cute.local_tile(cute.domain_offset((k_start, 0), mdK[None, head, None]), (self.tile_n, self.head_dim), (n_block, 0))
            gdV = cute.local_tile(cute.domain_offset((k_start, 0), mdV[None, head, None]), (self.tile_n, self.head_dim), (n_block, 0))
            gQ = cute.local_tile(cute.domain_offset((q_start, 0), mQ[None, head, None]), (self.tile_m, self.head_dim), (None, 0))
            gdO = cute.local_tile(cute.domain_offset((q_start, 0), mdO[None, head, None]), (self.tile_m, self.head_dim), (None, 0))

            thr_copy = gmem_copy.get_slice(tidx)
            tKVcKV = thr_copy.partition_S(cute.make_identity_tensor((self.tile_n, self.head_dim)))
            tQcQ = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
            tQgQ, tQsQ = thr_copy.partition_S(gQ), thr_copy.partition_D(sQ)
            tQgdO, tQsdO = thr_copy.partition_S(gdO), thr_copy.partition_D(sdO)
            # K/V rows past seqlen_k only feed dK/dV rows that are never stored.
            self.load_rows(gmem_copy, thr_copy.partition_S(gK), thr_copy.partition_D(sK), tKVcKV, k_rows, False)
            self.load_rows(gmem_copy, thr_copy.partition_S(gV), thr_copy.partition_D(sV), tKVcKV, k_rows, False)
            # Commit now: wait_group only covers committed groups, and with no m-block (a sequence
            # without queries) these loads would otherwise land in the dK/dV staging buffers.
            cute.arch.cp_async_commit_group()

            thr_mma = tiled_mma.get_slice(tidx)
            copy_a, copy_b, _, _ = ldmatrix_copies(self.dtype, tiled_mma, tidx)
            tSrK = thr_mma.make_fragment_A(thr_mma.partition_A(sK))
            tSrV = thr_mma.make_fragment_A(thr_mma.partition_A(sV))
            tSrQ = thr_mma.make_fragment_B(thr_mma.partition_B(sQ[None, None, 0]))
            tSrdO = thr_mma.make_fragment_B(thr_mma.partition_B(sdO[None, None, 0]))
            tSsK, tSsV = copy_a.partition_S(sK), copy_a.partition_S(sV)
            tSsQ, tSsdO = copy_b.partition_S(sQ), copy_b.partition_S(sdO)
            # dV += P^T dO and dK += G^T Q (the same tiled MMA as S^T unless split).
            thr_mma_dkv = tiled_mma_dkv.get_slice(tidx)
            copy_dkv_a, _, copy_dkv_bt, _ = ldmatrix_copies(self.dtype, tiled_mma_dkv, tidx)
            tDrQt = thr_mma_dkv.make_fragment_B(thr_mma_dkv.partition_B(sQt[None, None, 0]))
            tDrdOt = thr_mma_dkv.make_fragment_B(thr_mma_dkv.partition_B(sdOt[None, None, 0]))
            tDsQt, tDsdOt = copy_dkv_bt.partition_S(sQt), copy_dkv_bt.partition_S(sdOt)
            if const_expr(self.warps_d > 1):
                sPt = storage.sP.get_tensor(sP_layout)
                sdSt = storage.sdS.get_tensor(sP_layout)
                tDrPt = thr_mma_dkv.make_fragment_A(thr_mma_dkv.partition_A(sPt))
                tDrdSt = thr_mma_dkv.make_fragment_A(thr_mma_dkv.partition_A(sdSt))
                tDsPt, tDsdSt = copy_dkv_a.partition_S(sPt), copy_dkv_a.partition_S(sdSt)
                # Two adjacent accumulator columns per 32-bit store.
                p_store = cute.make_tiled_copy_C(
                    cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), tiled_mma
                ).get_slice(tidx)
                tPsPt, tPsdSt = p_store.partition_D(sPt), p_store.partition_D(sdSt)
            # Transposed orientation: accumulator rows are keys, columns are queries.
            cST = cute.make_identity_tensor((self.tile_n, self.tile_m))
            tScST = thr_mma.partition_C(cST)
            if const_expr(self.has_rab):
                sRab = storage.sRab.get_tensor(sRab_layout)
                sRabT = cute.composition(sRab, cute.make_layout((self.tile_n, self.tile_m, 2),
                                                                stride=(self.tile_m, 1, self.tile_m * self.tile_n)))
                thr_copy_rab = gmem_copy_rab.get_slice(tidx)
                tRsR = thr_copy_rab.partition_D(sRab)
                tRcR = thr_copy_rab.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_n)))
                rab_head = cutlass.select_(mRab.shape[1] > 1, head, Int32(0))
                gRab = cute.local_tile(cute.domain_offset((seq.row_offset, 0), mRab[batch, rab_head, None, None]),
                                       (self.tile_m, self.tile_n), (None, n_block))
                tRgR = thr_copy_rab.partition_S(gRab)
                rab_cols = cutlass.min(seqlen_k, mRab.shape[3]) - col0
            else:
                tRgR = tRsR = tRcR = None
                rab_cols = Int32(0)

            acc_dK = cute.make_rmem_tensor(thr_mma_dkv.partition_shape_C((self.tile_n, self.head_dim)), Float32)
            acc_dV = cute.make_rmem_tensor(thr_mma_dkv.partition_shape_C((self.tile_n, self.head_dim)), Float32)
            acc_dK.fill(0.0)
            acc_dV.fill(0.0)
            rab_row_end = Int32(0)
            if const_expr(self.has_rab):
                rab_row_end = cutlass.min(seq.row_offset + seqlen_q, mRab.shape[2])
            if m_lo < m_hi:
                self.load_q_do(gmem_copy, gmem_copy_rab, tQgQ, tQsQ, tQgdO, tQsdO, tQcQ, tRgR, tRsR, tRcR, m_lo, 0,
                               seqlen_q, seq.row_offset, rab_row_end, rab_cols)
            cute.arch.cp_async_commit_group()
            for m_block in cutlass.range(m_lo, m_hi, unroll=1):
                stage = (m_block - m_lo) % 2
                # This stage's group has landed, and every thread is done with the other stage.
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                if m_block + 1 < m_hi:
                    self.load_q_do(gmem_copy, gmem_copy_rab, tQgQ, tQsQ, tQgdO, tQsdO, tQcQ, tRgR, tRsR, tRcR,
                                   m_block + 1, 1 - stage, seqlen_q, seq.row_offset, rab_row_end, rab_cols)
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
                    gemm_ss(tiled_mma, acc_S, tSrK, tSrQ, tSsK, tSsQ[None, None, None, stage], copy_a, copy_b)
                    acc_dP = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_n, self.tile_m)), Float32)
                    acc_dP.fill(0.0)
                    gemm_ss(tiled_mma, acc_dP, tSrV, tSrdO, tSsV, tSsdO[None, None, None, stage], copy_a, copy_b)
                    silu_and_grad_inplace(acc_S, acc_dP, alpha, inv_scale, self.fast_silu)
                    is_full = masks.tile_is_full(spec, seq, m_block, n_block, self.tile_m, self.tile_n, KERNEL_OPS)
                    if not is_full:
                        for i in cutlass.range(cute.size(acc_S), unroll_full=True):
                            keep = masks.allowed(spec, seq, row_first + tScST[i][1], col0 + tScST[i][0], KERNEL_OPS)
                            acc_S[i] = cutlass.select_(keep, acc_S[i], Float32(0.0))
                            acc_dP[i] = cutlass.select_(keep, acc_dP[i], Float32(0.0))
                    rP = cute.make_fragment_like(acc_S, self.dtype)
                    rP.store(acc_S.load().to(self.dtype))
                    if const_expr(self.warps_d > 1):
                        rG = cute.make_fragment_like(acc_dP, self.dtype)
                        rG.store(acc_dP.load().to(self.dtype))
                        cute.copy(p_store, p_store.retile(rP), tPsPt)
                        cute.copy(p_store, p_store.retile(rG), tPsdSt)
                        # Every warp's rows of P^T and G^T are in smem before any warp reads them;
                        # the next overwrite waits for the barrier at the top of the next m-block.
                        cute.arch.barrier()
                        gemm_ss(tiled_mma_dkv, acc_dV, tDrPt, tDrdOt, tDsPt, tDsdOt[None, None, None, stage],
                                copy_dkv_a, copy_dkv_bt)
                        gemm_ss(tiled_mma_dkv, acc_dK, tDrdSt, tDrQt, tDsdSt, tDsQt[None, None, None, stage],
                                copy_dkv_a, copy_dkv_bt)
                    else:
                        gemm_rs(tiled_mma, acc_dV, acc_to_operand_a(rP), tDrdOt, tDsdOt[None, None, None, stage],
                                copy_dkv_bt)
                        rG = cute.make_fragment_like(acc_dP, self.dtype)
                        rG.store(acc_dP.load().to(self.dtype))
                        gemm_rs(tiled_mma, acc_dK, acc_to_operand_a(rG), tDrQt, tDsQt[None, None, None, stage],
                                copy_dkv_bt)
            # No m-block may have run: drain the K/V group before sK/sV become staging buffers.
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            self.store_rows(gmem_store, tiled_mma_dkv, acc_dK, sK, gdK, tidx, k_rows)
            self.store_rows(gmem_store, tiled_mma_dkv, acc_dV, sV, gdV, tidx, k_rows)
