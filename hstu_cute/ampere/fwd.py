"""HSTU attention forward for sm80+ (mma.sync, cp.async, ldmatrix): runs on Ampere, Ada, Hopper."""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warp

from .. import masks
from ..common.mask_apply import KERNEL_OPS, apply_mask_inplace
from ..common.seqinfo import sequence_bounds, sequence_mask
from ..common.silu import silu_scaled_inplace
from ..common.sm80 import acc_to_operand_a, gemm_rs, gemm_ss, ldmatrix_copies, scores_init, smem_layout_atom


class HstuForwardSm80:
    """Forward kernel: out = sum_j mask(silu(alpha * (q.k + rab))) v / S over one jagged batch.

    Grid: (m-blocks of max_seqlen_q, heads, batch), or (heads, batch, m-blocks) with ``lpt_grid``;
    m-blocks run in reverse order so the longest causal rows start first. CTAs whose m-block starts past the sequence's query length exit.

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

    def __init__(
        self,
        dtype,
        head_dim: int,
        mask: masks.MaskSpec,
        has_rab: bool,
        rab_vec: int,
        tile_m: int,
        tile_n: int,
        num_warps: int,
        num_stages: int,
        fast_silu: bool,
        lpt_grid: bool = False,
    ):
        self.dtype = dtype
        self.head_dim = head_dim
        self.mask = mask
        self.has_rab = has_rab
        self.rab_vec = rab_vec
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_warps = num_warps
        self.num_threads = num_warps * 32
        self.num_stages = num_stages
        self.fast_silu = fast_silu
        self.lpt_grid = lpt_grid
        assert tile_m % (16 * num_warps) == 0
        assert head_dim % 32 == 0 and tile_n % 16 == 0

    # ------------------------------------------------------------------------------------------
    # Host side: layouts, atoms, launch
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (T_q, H, D)
        mK: cute.Tensor,  # (T_k, H, D)
        mV: cute.Tensor,  # (T_k, H, D)
        mO: cute.Tensor,  # (T_q, H, D)
        mOffsetsQ: cute.Tensor,  # (B + 1,) int32
        mOffsetsK: cute.Tensor,  # (B + 1,) int32
        mSeqUsedQ: cute.Tensor,  # (B,) int32 valid prefix (INT32_MAX when unused)
        mSeqUsedK: cute.Tensor,  # (B,) int32
        mNumContexts,  # (B,) int32 or None
        mNumTargets,  # (B,) int32 or None
        mRab,  # (B, H_rab, L, L) or None
        alpha: Float32,
        inv_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        group_size: Int32,
        is_delta_q: Int32,
        num_m_blocks: Int32,
        stream,
    ):
        D = self.head_dim
        atom_qkv = smem_layout_atom(self.dtype, D)
        sQ_layout = cute.tile_to_shape(atom_qkv, (self.tile_m, D), (0, 1))
        sKV_layout = cute.tile_to_shape(atom_qkv, (self.tile_n, D, self.num_stages), (0, 1, 2))

        vec = 128 // self.dtype.width
        copy_g2s = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype, num_bits_per_copy=128
        )
        seg = atom_qkv.outer.shape[1]
        threads_per_row = seg // vec
        thr_layout = cute.make_ordered_layout((self.num_threads // threads_per_row, threads_per_row), order=(1, 0))
        val_layout = cute.make_layout((1, vec))
        gmem_copy_qkv = cute.make_tiled_copy_tv(copy_g2s, thr_layout, val_layout)
        copy_r2g = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        gmem_copy_o = cute.make_tiled_copy_tv(copy_r2g, thr_layout, val_layout)

        if const_expr(self.has_rab):
            atom_rab = smem_layout_atom(self.dtype, self.tile_n)
            sRab_layout = cute.tile_to_shape(atom_rab, (self.tile_m, self.tile_n, self.num_stages), (0, 1, 2))
            if const_expr(self.rab_vec >= 2):
                rab_atom = cute.make_copy_atom(
                    cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS),
                    self.dtype,
                    num_bits_per_copy=self.rab_vec * self.dtype.width,
                )
            else:
                rab_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=self.dtype.width)
            rab_threads_per_row = self.tile_n // self.rab_vec
            if const_expr(rab_threads_per_row > self.num_threads):
                rab_threads_per_row = self.num_threads
            rab_thr_layout = cute.make_ordered_layout(
                (self.num_threads // rab_threads_per_row, rab_threads_per_row), order=(1, 0)
            )
            gmem_copy_rab = cute.make_tiled_copy_tv(rab_atom, rab_thr_layout, cute.make_layout((1, self.rab_vec)))
        else:
            sRab_layout = None
            gmem_copy_rab = None

        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)),
            (self.num_warps, 1, 1),
            permutation_mnk=(self.num_warps * 16, 16, 16),
        )

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
        self.kernel(
            mQ, mK, mV, mO, mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets, mRab,
            alpha, inv_scale, window_left, window_right, group_size, is_delta_q,
            sQ_layout, sKV_layout, sRab_layout, gmem_copy_qkv, gmem_copy_o, gmem_copy_rab, tiled_mma,
            SharedStorage,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mOffsetsQ: cute.Tensor,
        mOffsetsK: cute.Tensor,
        mSeqUsedQ: cute.Tensor,
        mSeqUsedK: cute.Tensor,
        mNumContexts,
        mNumTargets,
        mRab,
        alpha: Float32,
        inv_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        group_size: Int32,
        is_delta_q: Int32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sRab_layout,
        gmem_copy_qkv: cute.TiledCopy,
        gmem_copy_o: cute.TiledCopy,
        gmem_copy_rab,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
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

        # ---- sequence geometry (offsets clamped to the tensors: no input can address outside) ----
        q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(
            mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mQ.shape[0], mK.shape[0], batch
        )

        if m_block * self.tile_m < seqlen_q:
            spec = self.mask
            seq = sequence_mask(spec, seqlen_q, seqlen_k, mNumContexts, mNumTargets, batch, window_left,
                                window_right, group_size, is_delta_q)
            n_lo, hole_lo, hole_size, n_count = masks.n_block_schedule(
                spec, seq, m_block, self.tile_m, self.tile_n, KERNEL_OPS
            )
            row_first = seq.row_offset + m_block * self.tile_m
            n_total = (seqlen_k + self.tile_n - 1) // self.tile_n

            # ---- global tiles: token offsets are formed in 64-bit (stride mode 0 is Int64) ----
            mQh = cute.domain_offset((q_start, 0), mQ[None, head, None])
            mOh = cute.domain_offset((q_start, 0), mO[None, head, None])
            mKh = cute.domain_offset((k_start, 0), mK[None, head, None])
            mVh = cute.domain_offset((k_start, 0), mV[None, head, None])
            gQ = cute.local_tile(mQh, (self.tile_m, self.head_dim), (m_block, 0))
            gO = cute.local_tile(mOh, (self.tile_m, self.head_dim), (m_block, 0))
            gK = cute.local_tile(mKh, (self.tile_n, self.head_dim), (None, 0))
            gV = cute.local_tile(mVh, (self.tile_n, self.head_dim), (None, 0))

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sK = storage.sK.get_tensor(sKV_layout)
            sV = storage.sV.get_tensor(sKV_layout)
            sVt = cute.composition(
                sV,
                cute.make_layout(
                    (self.head_dim, self.tile_n, self.num_stages),
                    stride=(self.tile_n, 1, self.tile_n * self.head_dim),
                ),
            )

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

            # rab slab rows are key coordinates: query i reads row row_offset + i.
            if const_expr(self.has_rab):
                rab_head = cutlass.select_(mRab.shape[1] > 1, head, Int32(0))
                mRabBH = mRab[batch, rab_head, None, None]
                rab_rows = cutlass.min(seq.row_offset + seqlen_q, mRab.shape[2])
                rab_cols = cutlass.min(seqlen_k, mRab.shape[3])
                gRab = cute.local_tile(
                    cute.domain_offset((seq.row_offset, 0), mRabBH), (self.tile_m, self.tile_n), (m_block, None)
                )
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
            acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.head_dim)), Float32)
            acc_O.fill(0.0)

            smem_copy_q, smem_copy_k, smem_copy_v, smem_copy_rab = ldmatrix_copies(self.dtype, tiled_mma, tidx)
            tSsQ = smem_copy_q.partition_S(sQ)
            tSsK = smem_copy_k.partition_S(sK)
            tOsVt = smem_copy_v.partition_S(sVt)
            if const_expr(self.has_rab):
                tSsRab = smem_copy_rab.partition_S(sRab)
            tScS = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))

            # ---- prologue ----
            self.load_q(gmem_copy_qkv, tQgQ, tQsQ, tQcQ, seqlen_q - m_block * self.tile_m)
            cute.arch.cp_async_commit_group()
            for stage in cutlass.range_constexpr(self.num_stages):
                if n_count - 1 - stage >= 0:
                    n_pre = masks.n_block_at(n_count - 1 - stage, n_lo, hole_lo, hole_size, KERNEL_OPS)
                    self.load_kv(gmem_copy_qkv, tKgK, tKsK, tKVcKV, n_pre, stage, seqlen_k, stage == 0, False)
                    if const_expr(self.has_rab):
                        self.load_rab(gmem_copy_rab, tRgR, tRsR, tRcR, n_pre, stage, rab_row_limit, rab_cols)
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
                rP = cute.make_fragment_like(acc_S, self.dtype)
                rP.store(acc_S.load().to(self.dtype))

                if const_expr(self.num_stages > 1):
                    write_stage = (write_stage + 1) % self.num_stages
                cute.arch.cp_async_wait_group(self.num_stages * 2 - 2)
                cute.arch.barrier()
                if idx - self.num_stages >= 0:
                    n_next = masks.n_block_at(idx - self.num_stages, n_lo, hole_lo, hole_size, KERNEL_OPS)
                    self.load_kv(gmem_copy_qkv, tKgK, tKsK, tKVcKV, n_next, write_stage, seqlen_k, False, False)
                    if const_expr(self.has_rab):
                        self.load_rab(gmem_copy_rab, tRgR, tRsR, tRcR, n_next, write_stage, rab_row_limit, rab_cols)
                cute.arch.cp_async_commit_group()

                gemm_rs(tiled_mma, acc_O, acc_to_operand_a(rP), tOrVt, tOsVt[None, None, None, read_stage], smem_copy_v)
                if const_expr(self.num_stages > 1):
                    read_stage = (read_stage + 1) % self.num_stages

            # ---- epilogue: scale by 1/S, stage through sQ, predicated 128-bit stores ----
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            rO = cute.make_fragment_like(acc_O, self.dtype)
            rO.store((acc_O.load() * inv_scale).to(self.dtype))
            sO = sQ
            smem_copy_o = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), tiled_mma
            ).get_slice(tidx)
            cute.copy(smem_copy_o, smem_copy_o.retile(rO), smem_copy_o.partition_D(sO))
            cute.arch.barrier()
            thr_copy_o = gmem_copy_o.get_slice(tidx)
            tOsO = thr_copy_o.partition_S(sO)
            tOgO = thr_copy_o.partition_D(gO)
            tOrO = cute.make_fragment_like(tOgO, self.dtype)
            cute.copy(gmem_copy_o, tOsO, tOrO)
            row_limit = seqlen_q - m_block * self.tile_m
            for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
                if tQcQ[0, m, 0][0] < row_limit:
                    cute.copy(gmem_copy_o, tOrO[None, m, None], tOgO[None, m, None])

    # ------------------------------------------------------------------------------------------
    # cp.async tile loads
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load_q(self, gmem_copy, tQgQ, tQsQ, tQcQ, row_limit: Int32):
        # Rows past the sequence are not loaded: their outputs are never stored.
        for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
            if tQcQ[0, m, 0][0] < row_limit:
                cute.copy(gmem_copy, tQgQ[None, m, None], tQsQ[None, m, None])

    @cute.jit
    def load_kv(
        self, gmem_copy, tXgX, tXsX, tXcX, n_block: Int32, stage: Int32, seqlen_k: Int32,
        may_cross_end: cutlass.Constexpr[bool], zero_fill: cutlass.Constexpr[bool],
    ):
        # n-blocks are visited from the last one down, so only the first block loaded (prologue
        # stage 0, or the in-loop V load when there is a single stage) can cross seqlen_k; the
        # other call sites are traced without the predicated path (less IR, faster compiles).
        stage_idx = stage if const_expr(self.num_stages > 1) else 0
        if const_expr(may_cross_end):
            if (n_block + 1) * self.tile_n > seqlen_k:
                row_limit = seqlen_k - n_block * self.tile_n
                for m in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
                    if tXcX[0, m, 0][0] < row_limit:
                        cute.copy(gmem_copy, tXgX[None, m, None, n_block], tXsX[None, m, None, stage_idx])
                    elif const_expr(zero_fill):
                        # V rows past the end must be finite: P is 0 there, and 0 * NaN = NaN.
                        # K rows need nothing: their scores are masked with a select.
                        tXsX[None, m, None, stage_idx].fill(0)
            else:
                cute.copy(gmem_copy, tXgX[None, None, None, n_block], tXsX[None, None, None, stage_idx])
        else:
            cute.copy(gmem_copy, tXgX[None, None, None, n_block], tXsX[None, None, None, stage_idx])

    @cute.jit
    def load_rab(self, gmem_copy, tRgR, tRsR, tRcR, n_block: Int32, stage: Int32, row_limit: Int32, rab_cols: Int32):
        # Chunks are predicated on their first column; rab_vec divides the slab's row stride, so a
        # chunk that straddles seqlen_k stays inside its row (the extra columns are masked).
        stage_idx = stage if const_expr(self.num_stages > 1) else 0
        col_limit = rab_cols - n_block * self.tile_n
        if row_limit < self.tile_m or col_limit < self.tile_n:
            for m in cutlass.range_constexpr(cute.size(tRsR.shape[1])):
                for n in cutlass.range_constexpr(cute.size(tRsR.shape[2])):
                    if tRcR[0, m, n][0] < row_limit and tRcR[0, m, n][1] < col_limit:
                        cute.copy(gmem_copy, tRgR[None, m, n, n_block], tRsR[None, m, n, stage_idx])
        else:
            cute.copy(gmem_copy, tRgR[None, None, None, n_block], tRsR[None, None, None, stage_idx])
