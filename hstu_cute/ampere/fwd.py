"""HSTU attention forward for sm80+ (mma.sync, cp.async, ldmatrix): runs on Ampere, Ada, Hopper."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .. import masks
from ..common.mask_apply import KERNEL_OPS, apply_mask_inplace
from ..common.seqinfo import ScoreScalars, SequenceArgs
from ..common.silu import silu_scaled_inplace
from ..common.sm80 import acc_to_operand_a, gemm_rs, gemm_ss, ldmatrix_copies, scores_init, transposed_view
from .base import Sm80Kernel


class HstuForwardSm80(Sm80Kernel):
    """Forward kernel: out = sum_j mask(silu(alpha * (q.k + rab))) v / S over one jagged batch.

    Grid: (m-blocks of max_seqlen_q, heads, batch), or (heads, batch, m-blocks) with ``lpt_grid``;
    m-blocks run in reverse order so the longest causal rows start first. CTAs whose m-block starts
    past the sequence's query length exit.

    Warp roles: none -- all ``num_warps`` warps load (cp.async) and compute (mma.sync m16n8k16);
    each warp owns 16-row slices of the ``tile_m`` query rows.

    Pipeline (cp.async groups, ``num_stages`` smem stages for K(+rab) and V):
      prologue: Q | K(+rab)[0] | V[0] | K(+rab)[1] ...;  per n-block: wait K -> barrier ->
      issue V[next] -> S = rab + Q K^T -> SiLU -> mask (partial tiles only) -> wait V -> barrier ->
      issue K[next+1] -> O += P V.  n-blocks walk from the last non-empty block down, skipping the
      target hole, so empty tiles are never loaded.
    Barriers: ``cute.arch.barrier()`` (bar 0, whole CTA) after every cp.async wait and before sQ
    is reused as the output staging buffer.
    """

    def __init__(self, dtype, head_dim: int, mask: masks.MaskSpec, has_rab: bool, rab_vec: int, tile_m: int,
                 tile_n: int, num_warps: int, num_stages: int, fast_silu: bool, lpt_grid: bool = False):
        super().__init__(dtype, head_dim, mask, has_rab, tile_m, tile_n, num_warps, fast_silu)
        self.rab_vec, self.num_stages, self.lpt_grid = rab_vec, num_stages, lpt_grid
        assert tile_m % (16 * num_warps) == 0
        assert head_dim % 32 == 0 and tile_n % 16 == 0

    # ------------------------------------------------------------------------------------------
    # Host side: layouts, atoms, launch
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ, mK, mV, mO, mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets, mRab,
                 alpha: Float32, inv_scale: Float32, window_left: Int32, window_right: Int32, group_size: Int32,
                 is_delta_q: Int32, num_m_blocks: Int32, stream):
        atom, gmem_copy_qkv, gmem_copy_o, gmem_copy_rab, tiled_mma = self._atoms()
        sQ_layout = self._tile_layout(atom, self.tile_m)
        # K, V and rab keep their stage mode with a single stage too.
        sKV_layout = self._tile_layout(atom, self.tile_n, self.num_stages)
        sRab_layout = self._rab_layout(self.num_stages)

        q_elems = cute.cosize(sQ_layout)
        kv_elems = cute.cosize(sKV_layout)
        rab_elems = cute.cosize(sRab_layout) if const_expr(self.has_rab) else 8

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, q_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, kv_elems], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, kv_elems], 1024]
            sRab: cute.struct.Align[cute.struct.MemRange[self.dtype, rab_elems], 1024]

        num_batch = mOffsetsQ.shape[0] - 1
        num_heads = mQ.shape[1]
        if const_expr(self.lpt_grid):
            grid = [num_heads, num_batch, num_m_blocks]
        else:
            grid = [num_m_blocks, num_heads, num_batch]
        self._launch(
            mQ, mK, mV, mO, SequenceArgs(mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets), mRab,
            ScoreScalars(alpha, inv_scale, window_left, window_right, group_size, is_delta_q),
            sQ_layout, sKV_layout, sRab_layout, gmem_copy_qkv, gmem_copy_o, gmem_copy_rab, tiled_mma, SharedStorage,
            grid=grid, stream=stream,
        )

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, seqs, mRab,
               scalars, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout, sRab_layout,
               gmem_copy_qkv: cute.TiledCopy, gmem_copy_o: cute.TiledCopy, gmem_copy_rab, tiled_mma: cute.TiledMma,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        if const_expr(self.lpt_grid):
            # m-blocks vary slowest, heaviest (longest causal rows) first for every (head, batch):
            # the last wave holds only the lightest tiles.
            head, batch, m_block_rev = cute.arch.block_idx()
            _, _, num_m_blocks = cute.arch.grid_dim()
        else:
            # m-blocks vary fastest: CTAs resident together share one (head, batch)'s K/V in L2.
            m_block_rev, head, batch = cute.arch.block_idx()
            num_m_blocks, _, _ = cute.arch.grid_dim()
        m_block = num_m_blocks - 1 - m_block_rev

        q_start, k_start, seqlen_q, seqlen_k, mask_of = self._sequence(seqs, scalars, mQ, mK, batch)
        alpha, inv_scale = scalars.alpha, scalars.inv_scale

        if m_block * self.tile_m < seqlen_q:
            spec = self.mask
            seq = mask_of(batch, seqlen_q, seqlen_k)
            n_lo, hole_lo, hole_size, n_count = masks.n_block_schedule(
                spec, seq, m_block, self.tile_m, self.tile_n, KERNEL_OPS
            )
            row_first = seq.row_offset + m_block * self.tile_m

            gQ, gO, gK, gV = self._head_tiles(head, (mQ, q_start, self.tile_m, m_block),
                                              (mO, q_start, self.tile_m, m_block), (mK, k_start, self.tile_n, None),
                                              (mV, k_start, self.tile_n, None))

            storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sK = storage.sK.get_tensor(sKV_layout)
            sV = storage.sV.get_tensor(sKV_layout)
            sVt = transposed_view(sV, self.tile_n, self.head_dim, self.num_stages)

            thr_copy = gmem_copy_qkv.get_slice(tidx)
            tQgQ = thr_copy.partition_S(gQ)
            tQsQ = thr_copy.partition_D(sQ)
            tKgK = thr_copy.partition_S(gK)
            tKsK = thr_copy.partition_D(sK)
            tVgV = thr_copy.partition_S(gV)
            tVsV = thr_copy.partition_D(sV)
            cKV = cute.make_identity_tensor((self.tile_n, self.head_dim))
            tKVcKV = thr_copy.partition_S(cKV)
            cQ = cute.make_identity_tensor((self.tile_m, self.head_dim))
            tQcQ = thr_copy.partition_S(cQ)

            if const_expr(self.has_rab):
                slab = self._rab_slab(mRab, batch, head)
                rab_rows = cutlass.min(seq.row_offset + seqlen_q, mRab.shape[2])
                rab_cols = cutlass.min(seqlen_k, mRab.shape[3])
                gRab = self._rab_tiles(slab, seq.row_offset, (m_block, None))
                sRab = storage.sRab.get_tensor(sRab_layout)
                thr_copy_rab = gmem_copy_rab.get_slice(tidx)
                tRgR = thr_copy_rab.partition_S(gRab)
                tRsR = thr_copy_rab.partition_D(sRab)
                tRcR = thr_copy_rab.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_n)))
                rab_row_limit = rab_rows - row_first
            else:
                tRgR = tRsR = tRcR = None
                rab_row_limit = rab_cols = Int32(0)

            # ---- MMA partitions ----
            thr_mma = tiled_mma.get_slice(tidx)
            tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
            tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0]))
            acc_O = self._zero_acc(thr_mma, (self.tile_m, self.head_dim))

            smem_copy_q, smem_copy_k, smem_copy_v, smem_copy_rab = ldmatrix_copies(self.dtype, tiled_mma, tidx)
            tSsQ = smem_copy_q.partition_S(sQ)
            tSsK = smem_copy_k.partition_S(sK)
            tOsVt = smem_copy_v.partition_S(sVt)
            if const_expr(self.has_rab):
                tSsRab = smem_copy_rab.partition_S(sRab)
            tScS = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))

            # ---- prologue ----
            # Rows past the sequence are not loaded: their outputs are never stored.
            self.load_rows(gmem_copy_qkv, tQgQ, tQsQ, tQcQ, seqlen_q - m_block * self.tile_m, False)
            cute.arch.cp_async_commit_group()
            for stage in cutlass.range_constexpr(self.num_stages):
                if n_count - 1 - stage >= 0:
                    n_pre = masks.n_block_at(n_count - 1 - stage, n_lo, hole_lo, hole_size, KERNEL_OPS)
                    self.load_kv(gmem_copy_qkv, tKgK, tKsK, tKVcKV, n_pre, stage, seqlen_k, stage == 0, False)
                    if const_expr(self.has_rab):
                        self.load_rab_block(gmem_copy_rab, tRgR, tRsR, tRcR, n_pre, stage, rab_row_limit, rab_cols)
                cute.arch.cp_async_commit_group()
                if const_expr(stage < self.num_stages - 1):
                    if n_count - 1 - stage >= 0:
                        n_pre = masks.n_block_at(n_count - 1 - stage, n_lo, hole_lo, hole_size, KERNEL_OPS)
                        self.load_kv(gmem_copy_qkv, tVgV, tVsV, tKVcKV, n_pre, stage, seqlen_k, stage == 0, True)
                    cute.arch.cp_async_commit_group()

            # ---- main loop over non-empty n-blocks, last to first ----
            read_stage = Int32(0)
            write_stage = Int32(self.num_stages - 1)
            for it in cutlass.range(n_count, unroll=1):
                idx = n_count - 1 - it
                n_block = masks.n_block_at(idx, n_lo, hole_lo, hole_size, KERNEL_OPS)

                cute.arch.cp_async_wait_group(self.num_stages * 2 - 2)
                cute.arch.barrier()
                if idx - (self.num_stages - 1) >= 0:
                    n_next = masks.n_block_at(idx - (self.num_stages - 1), n_lo, hole_lo, hole_size, KERNEL_OPS)
                    self.load_kv(gmem_copy_qkv, tVgV, tVsV, tKVcKV, n_next, write_stage, seqlen_k,
                                 self.num_stages == 1, True)
                cute.arch.cp_async_commit_group()

                acc_S = scores_init(
                    thr_mma, (self.tile_m, self.tile_n), self.dtype, smem_copy_rab,
                    tSsRab[None, None, None, read_stage] if const_expr(self.has_rab) else None,
                )
                gemm_ss(
                    tiled_mma, acc_S, tSrQ, tSrK, tSsQ, tSsK[None, None, None, read_stage], smem_copy_q, smem_copy_k
                )
                silu_scaled_inplace(acc_S, alpha, self.fast_silu)
                is_full = masks.tile_is_full(spec, seq, m_block, n_block, self.tile_m, self.tile_n, KERNEL_OPS)
                if not is_full:
                    apply_mask_inplace(acc_S, tScS, spec, seq, row_first, n_block * self.tile_n)
                rP = self._to_dtype(acc_S)

                if const_expr(self.num_stages > 1):
                    write_stage = (write_stage + 1) % self.num_stages
                cute.arch.cp_async_wait_group(self.num_stages * 2 - 2)
                cute.arch.barrier()
                if idx - self.num_stages >= 0:
                    n_next = masks.n_block_at(idx - self.num_stages, n_lo, hole_lo, hole_size, KERNEL_OPS)
                    self.load_kv(gmem_copy_qkv, tKgK, tKsK, tKVcKV, n_next, write_stage, seqlen_k, False, False)
                    if const_expr(self.has_rab):
                        self.load_rab_block(gmem_copy_rab, tRgR, tRsR, tRcR, n_next, write_stage, rab_row_limit,
                                            rab_cols)
                cute.arch.cp_async_commit_group()

                gemm_rs(tiled_mma, acc_O, acc_to_operand_a(rP), tOrVt, tOsVt[None, None, None, read_stage], smem_copy_v)
                if const_expr(self.num_stages > 1):
                    read_stage = (read_stage + 1) % self.num_stages

            # ---- epilogue: scale by 1/S, stage through sQ, predicated 128-bit stores ----
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            self.store_rows(gmem_copy_o, tiled_mma, acc_O, sQ, gO, tidx, seqlen_q - m_block * self.tile_m, inv_scale)

    # ------------------------------------------------------------------------------------------
    # cp.async tile loads
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load_kv(
        self, gmem_copy, tXgX, tXsX, tXcX, n_block: Int32, stage: Int32, seqlen_k: Int32,
        may_cross_end: cutlass.Constexpr[bool], zero_fill: cutlass.Constexpr[bool],
    ):
        # n-blocks are visited from the last one down, so only the first block loaded (prologue
        # stage 0, or the in-loop V load when there is a single stage) can cross seqlen_k; the
        # other call sites are traced without the predicated path (less IR, faster compiles).
        # V rows past the end must be finite (zero_fill): P is 0 there, and 0 * NaN = NaN. K rows
        # need nothing: their scores are masked with a select.
        stage_idx = stage if const_expr(self.num_stages > 1) else 0
        if const_expr(may_cross_end):
            if (n_block + 1) * self.tile_n > seqlen_k:
                self.load_rows(gmem_copy, tXgX, tXsX, tXcX, seqlen_k - n_block * self.tile_n, zero_fill, (n_block,),
                               (stage_idx,))
            else:
                cute.copy(gmem_copy, tXgX[None, None, None, n_block], tXsX[None, None, None, stage_idx])
        else:
            cute.copy(gmem_copy, tXgX[None, None, None, n_block], tXsX[None, None, None, stage_idx])

    @cute.jit
    def load_rab_block(self, gmem_copy, tRgR, tRsR, tRcR, n_block: Int32, stage: Int32, row_limit: Int32,
                       rab_cols: Int32):
        # rab_vec divides the slab's row stride, so a chunk that straddles seqlen_k stays inside
        # its row (the extra columns are masked).
        stage_idx = stage if const_expr(self.num_stages > 1) else 0
        self.load_rab(gmem_copy, tRgR, tRsR, tRcR, row_limit, rab_cols - n_block * self.tile_n, False, (n_block,),
                      (stage_idx,))
