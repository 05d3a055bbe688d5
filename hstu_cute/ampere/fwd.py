"""HSTU attention forward for sm80+ (mma.sync, cp.async, ldmatrix): runs on Ampere, Ada, Hopper."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .. import masks
from ..common.key_blocks import KeyBlocks, PagedArgs, cache_row, page_span
from ..common.mask_apply import KERNEL_OPS, apply_mask_inplace, mask_dropped_blocks
from ..common.seqinfo import BlockSparseArgs, BlockTiles, ScoreScalars, SequenceArgs
from ..common.silu import silu_scaled_inplace
from ..common.sm80 import (acc_to_operand_a, gemm_rs, gemm_ss, ldmatrix_copies, mma_acc_rows_cols, scores_init,
                           transposed_view)
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

    ``paged`` (a paged KV cache ahead of each sequence's new keys; common.key_blocks): the mask
    covers the whole key sequence (C cached tokens, then the new ones; queries aligned to its end)
    and a tile's key blocks come in two segments, the cache's first (:class:`KeyBlocks`), each
    block masked in its segment's coordinates. A cache block's K/V rows are gathered with
    per-row cp.async copies from their pages (page ids clamped into the cache), rows past C not
    loaded (V's zero-filled). Every load checks its segment's end at run time (the last block of
    each segment crosses it). A new block's rab comes from the rab among the new tokens (mRabNew,
    its columns start 16-byte aligned; rab's own would start at column C).

    ``split_keys``: each tile's key blocks come in ``num_splits`` parts (a runtime argument;
    the grid's m-blocks count every part, :meth:`KeyBlocks.part`), one CTA each, so few query
    tiles over long keys (one user's serving call) fill the GPU. Each part stores its fp32
    output (times 1/S) to its slab of the partials and counts its arrival (acq_rel atomic); the
    CTA that arrives last adds the parts up in part order (the same sum whichever ends last) and
    stores the output, then zeroes the count for the next launch.
    """

    def __init__(self, dtype, head_dim: int, mask: masks.MaskSpec, has_rab: bool, rab_vec: int, tile_m: int,
                 tile_n: int, num_warps: int, num_stages: int, fast_silu: bool, lpt_grid: bool = False,
                 paged: bool = False, split_keys: bool = False, block_sparse: bool = False):
        super().__init__(dtype, head_dim, mask, has_rab, tile_m, tile_n, num_warps, fast_silu)
        self.rab_vec, self.num_stages, self.lpt_grid = rab_vec, num_stages, lpt_grid
        # Keys of a paged KV cache ahead of each sequence's new keys (common.key_blocks).
        self.paged = paged
        self.split_keys = split_keys
        # A block mask (hstu_cute.block_mask): each tile walks its list of key tiles
        # (common.key_blocks.KeyBlocks.of_list) and masks by block where its blocks are mixed.
        self.block_sparse = block_sparse
        assert not (block_sparse and (paged or split_keys)), "block-sparse: plain tiles only"
        assert tile_m % (16 * num_warps) == 0
        assert head_dim % 32 == 0 and tile_n % 16 == 0

    # ------------------------------------------------------------------------------------------
    # Host side: layouts, atoms, launch
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ, mK, mV, mO, mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets, mFunc, mFuncBlocks, mRab,
                 alpha: Float32, inv_scale: Float32, window_left: Int32, window_right: Int32, group_size: Int32,
                 is_delta_q: Int32, num_m_blocks: Int32, mCache, mPageOffsets, mPageIds, mLastPageLens, log2_page_size,
                 mRabNew, mPartials, mArrivals, num_splits, mBlockCount, mBlockIndex, mBlockState, mBlockKept, q_block,
                 k_block, stream):
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
            # Split keys: the CTA's arrival count, for its threads.
            sArrived: cute.struct.MemRange[Int32, 1]

        num_batch = mOffsetsQ.shape[0] - 1
        num_heads = mQ.shape[1]
        if const_expr(self.lpt_grid):
            grid = [num_heads, num_batch, num_m_blocks]
        else:
            grid = [num_m_blocks, num_heads, num_batch]
        paged = None
        if const_expr(self.paged):
            paged = PagedArgs(mCache, mPageOffsets, mPageIds, mLastPageLens, log2_page_size, mRabNew)
        self._launch(
            mQ, mK, mV, mO, SequenceArgs(mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets, mFunc, mFuncBlocks,
                                         BlockSparseArgs(mBlockCount, mBlockIndex, mBlockState, mBlockKept, q_block,
                                                         k_block) if const_expr(self.block_sparse) else None), mRab,
            ScoreScalars(alpha, inv_scale, window_left, window_right, group_size, is_delta_q), paged,
            (mPartials, mArrivals, num_splits) if const_expr(self.split_keys) else None,
            sQ_layout, sKV_layout, sRab_layout, gmem_copy_qkv, gmem_copy_o, gmem_copy_rab, tiled_mma,
            SharedStorage, grid=grid, stream=stream,
        )

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, seqs, mRab,
               scalars, paged, split, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout, sRab_layout,
               gmem_copy_qkv: cute.TiledCopy, gmem_copy_o: cute.TiledCopy, gmem_copy_rab,
               tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr):
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
        part = Int32(0)
        if const_expr(self.split_keys):
            part, m_block = m_block % split[2], m_block // split[2]

        q_start, k_start, seqlen_q, seqlen_k, mask_of = self._sequence(seqs, scalars, mQ, mK, batch)
        alpha, inv_scale = scalars.alpha, scalars.inv_scale

        if m_block * self.tile_m < seqlen_q:
            spec = self.mask
            span = None
            if const_expr(self.paged):
                # The whole key sequence: the cached tokens, then the new ones.
                span = page_span(paged, batch)
                seq = mask_of(batch, seqlen_q, seqlen_k + span.cached_len)
            else:
                seq = mask_of(batch, seqlen_q, seqlen_k)
            if const_expr(self.block_sparse):
                seq.sparse = BlockTiles.of(seqs.blocks, batch, head)
                blocks = KeyBlocks.of_list(spec, seq, m_block, self.tile_m, self.tile_n)
            else:
                blocks = KeyBlocks.of_tile(spec, seq, m_block, self.tile_m, self.tile_n, span)
            if const_expr(self.split_keys):
                blocks = blocks.part(part, split[2])
            # No method call on a name inside the runtime branches and loops below (it would be
            # carried through them).
            n_count, block_at = blocks.count, blocks.at
            row_first = seq.row_offset + m_block * self.tile_m

            gQ, gO = self._head_tiles(head, (mQ, q_start, self.tile_m, m_block), (mO, q_start, self.tile_m, m_block))
            # GQA / MQA: k and v hold H_q / group heads; query head h reads key head h // group.
            kv_head = head // (mQ.shape[1] // mK.shape[1])
            gK, gV = self._head_tiles(kv_head, (mK, k_start, self.tile_n, None), (mV, k_start, self.tile_n, None))

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
            cache = None
            if const_expr(self.paged):
                cache = self._cache_view(paged, span, head, thr_copy)

            rab_new = None
            if const_expr(self.has_rab):
                slab = self._rab_slab(mRab, batch, head)
                rab_rows = cutlass.min(seq.row_offset + seqlen_q, mRab.shape[2])
                # Whole-sequence columns (paged: the cached keys, then the new ones).
                rab_cols = cutlass.min(seq.seqlen_k, mRab.shape[3])
                gRab = self._rab_tiles(slab, seq.row_offset, (m_block, None))
                sRab = storage.sRab.get_tensor(sRab_layout)
                thr_copy_rab = gmem_copy_rab.get_slice(tidx)
                tRgR = thr_copy_rab.partition_S(gRab)
                tRsR = thr_copy_rab.partition_D(sRab)
                tRcR = thr_copy_rab.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_n)))
                rab_row_limit = rab_rows - row_first
                if const_expr(self.paged):
                    rab_new = self._new_segment_rab(paged.mRabNew, batch, head, blocks.seq, m_block, thr_copy_rab)
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

            kv_loads = (gmem_copy_qkv, ((tKgK, tKsK), (tVgV, tVsV)), tKVcKV, seqlen_k, blocks, cache)
            rab_loads = (gmem_copy_rab, tRgR, tRsR, tRcR, rab_new, rab_row_limit, rab_cols)

            # ---- prologue ----
            # Rows past the sequence are not loaded: their outputs are never stored.
            self.load_rows(gmem_copy_qkv, tQgQ, tQsQ, tQcQ, seqlen_q - m_block * self.tile_m, False)
            cute.arch.cp_async_commit_group()
            for stage in cutlass.range_constexpr(self.num_stages):
                if n_count - 1 - stage >= 0:
                    self.load_key_block(0, n_count - 1 - stage, stage, stage == 0, kv_loads, rab_loads)
                cute.arch.cp_async_commit_group()
                if const_expr(stage < self.num_stages - 1):
                    if n_count - 1 - stage >= 0:
                        self.load_key_block(1, n_count - 1 - stage, stage, stage == 0, kv_loads, rab_loads)
                    cute.arch.cp_async_commit_group()

            # ---- main loop over non-empty n-blocks, last to first ----
            read_stage = Int32(0)
            write_stage = Int32(self.num_stages - 1)
            for it in cutlass.range(n_count, unroll=1):
                idx = n_count - 1 - it
                seg, n_block = block_at(idx)

                cute.arch.cp_async_wait_group(self.num_stages * 2 - 2)
                cute.arch.barrier()
                if idx - (self.num_stages - 1) >= 0:
                    self.load_key_block(1, idx - (self.num_stages - 1), write_stage, self.num_stages == 1, kv_loads,
                                        rab_loads)
                cute.arch.cp_async_commit_group()

                acc_S = scores_init(
                    thr_mma, (self.tile_m, self.tile_n), self.dtype, smem_copy_rab,
                    tSsRab[None, None, None, read_stage] if const_expr(self.has_rab) else None,
                )
                gemm_ss(
                    tiled_mma, acc_S, tSrQ, tSrK, tSsQ, tSsK[None, None, None, read_stage], smem_copy_q, smem_copy_k
                )
                silu_scaled_inplace(acc_S, alpha, self.fast_silu)
                # The block's segment (paged: the cache's keys or the new ones, each in its own
                # coordinates; common.key_blocks) sets its mask.
                seg_row_first = self._rows_of(seg, m_block, row_first)
                is_full = masks.tile_is_full(spec, seg, m_block, n_block, self.tile_m, self.tile_n, KERNEL_OPS)
                if not is_full:
                    apply_mask_inplace(acc_S, tScS, spec, seg, seg_row_first, n_block * self.tile_n)
                if const_expr(self.block_sparse):
                    mask_dropped_blocks((cute.make_tensor(acc_S.iterator, mma_acc_rows_cols(acc_S.layout)),),
                                        cute.make_tensor(tScS.iterator, mma_acc_rows_cols(tScS.layout)), seg, m_block,
                                        n_block, seg_row_first, n_block * self.tile_n, rows_cols=self.tile_n)
                rP = self._to_dtype(acc_S)

                if const_expr(self.num_stages > 1):
                    write_stage = (write_stage + 1) % self.num_stages
                cute.arch.cp_async_wait_group(self.num_stages * 2 - 2)
                cute.arch.barrier()
                if idx - self.num_stages >= 0:
                    self.load_key_block(0, idx - self.num_stages, write_stage, False, kv_loads, rab_loads)
                cute.arch.cp_async_commit_group()

                gemm_rs(tiled_mma, acc_O, acc_to_operand_a(rP), tOrVt, tOsVt[None, None, None, read_stage], smem_copy_v)
                if const_expr(self.num_stages > 1):
                    read_stage = (read_stage + 1) % self.num_stages

            # ---- epilogue: scale by 1/S, stage through sQ, predicated 128-bit stores ----
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            if const_expr(self.split_keys):
                slot = (batch * mQ.shape[1] + head) * (num_m_blocks // split[2]) + m_block
                self.store_split_tile(gmem_copy_o, tiled_mma, acc_O, sQ, gO, tidx, seqlen_q - m_block * self.tile_m,
                                      inv_scale, split, storage.sArrived.get_tensor(cute.make_layout(1)), head,
                                      q_start, m_block, part, slot)
            else:
                self.store_rows(gmem_copy_o, tiled_mma, acc_O, sQ, gO, tidx, seqlen_q - m_block * self.tile_m,
                                inv_scale)

    @cute.jit
    def store_split_tile(self, gmem_copy_o, tiled_mma, acc_O, sQ, gO, tidx, rows: Int32, inv_scale: Float32, split,
                         sArrived, head: Int32, q_start: Int32, m_block: Int32, part: Int32, slot: Int32):
        """Split keys: this part's fp32 output (times 1/S) to its slab of the partials (rows <
        ``rows``), the CTA's arrival counted (release: every thread's stores fenced first); the
        CTA that arrives last sums the parts in part order and stores the output through sQ."""
        mPartials, mArrivals, num_splits = split
        thr_mma = tiled_mma.get_slice(tidx)
        partials = mPartials[None, head, None]
        part_rows, tile_shape = mPartials.shape[0] // num_splits, (self.tile_m, self.head_dim)
        tOcO = thr_mma.partition_C(cute.make_identity_tensor(tile_shape))
        tPgP = thr_mma.partition_C(cute.local_tile(cute.domain_offset((q_start + part * part_rows, 0), partials),
                                                   tile_shape, (m_block, 0)))
        for e in cutlass.range_constexpr(cute.size(acc_O)):
            if tOcO[e][0] < rows:
                tPgP[e] = acc_O[e] * inv_scale
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()
        if tidx == 0:
            sArrived[0] = cute.arch.atomic_add(mArrivals.iterator + slot, Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.barrier()
        if sArrived[0] == num_splits - 1:
            cute.arch.fence_acq_rel_gpu()
            total = cute.make_fragment_like(acc_O, Float32)
            total.fill(0.0)
            for p in cutlass.range(num_splits, unroll=1):
                tXgP = thr_mma.partition_C(cute.local_tile(cute.domain_offset((q_start + p * part_rows, 0), partials),
                                                           tile_shape, (m_block, 0)))
                for e in cutlass.range_constexpr(cute.size(total)):
                    if tOcO[e][0] < rows:
                        total[e] = total[e] + tXgP[e]
            self.store_rows(gmem_copy_o, tiled_mma, total, sQ, gO, tidx, rows)
            if tidx == 0:
                mArrivals[slot] = Int32(0)

    # ------------------------------------------------------------------------------------------
    # cp.async tile loads
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load_key_block(self, kind: cutlass.Constexpr[int], i: Int32, stage, may_cross_end: cutlass.Constexpr[bool],
                       kv_loads, rab_loads):
        """K (``kind`` 0, with its rab) or V (1) of the ``i``-th visited key block into ``stage``.
        ``kv_loads``: the copy, (K, V) partitions, their coordinates, seqlen_k, the tile's
        KeyBlocks and the paged cache view; ``rab_loads``: rab's copy, partitions and bounds.
        ``may_cross_end``: see :meth:`load_kv` (paged blocks check the end at run time)."""
        gmem_copy, tiles, tXcX, seqlen_k, blocks, cache = kv_loads
        tXgX, tXsX = tiles[kind]
        gmem_copy_rab, tRgR, tRsR, tRcR, rab_new, rab_row_limit, rab_cols = rab_loads
        seg, n_block = blocks.at(i)
        if const_expr(self.paged):
            cached = blocks.in_cache(i)
            self.load_paged_kv(gmem_copy, cache, kind, cached, tXgX, tXsX, tXcX, n_block, stage, seg.seqlen_k,
                               kind == 1)
            if const_expr(kind == 0 and self.has_rab):
                self.load_paged_rab(gmem_copy_rab, tRgR, tRsR, tRcR, rab_new, cached, n_block, stage, rab_row_limit,
                                    rab_cols)
        else:
            self.load_kv(gmem_copy, tXgX, tXsX, tXcX, n_block, stage, seqlen_k, may_cross_end, kind == 1)
            if const_expr(kind == 0 and self.has_rab):
                self.load_rab_block(gmem_copy_rab, tRgR, tRsR, tRcR, n_block, stage, rab_row_limit, rab_cols)

    @cute.jit
    def load_kv(
        self, gmem_copy, tXgX, tXsX, tXcX, n_block: Int32, stage: Int32, seqlen_k: Int32,
        may_cross_end: cutlass.Constexpr[bool], zero_fill: cutlass.Constexpr[bool],
    ):
        # n-blocks are visited from the last one down, so only the first block loaded (prologue
        # stage 0, or the in-loop V load when there is a single stage) can cross seqlen_k; the
        # other call sites are traced without the predicated path (less IR, faster compiles).
        # Paged tiles have two segments, each with a block that crosses its end: their loads
        # (load_paged_kv) always take the checked path.
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

    # ------------------------------------------------------------------------------------------
    # Paged KV cache (common.key_blocks)
    # ------------------------------------------------------------------------------------------
    def _rows_of(self, seg, m_block, row_first):
        """The first row of the m-block in the coordinates of a key block's segment: a paged
        tile's new segment is shifted by the cached length."""
        if const_expr(self.paged):
            return seg.row_offset + m_block * self.tile_m
        return row_first

    def _cache_view(self, paged: PagedArgs, span, head: Int32, thr_copy):
        """What a cache block's loads read (:meth:`load_cache_rows`): the thread's partition of a
        (rows, D) view, this head's cache rows, the tables and the sequence's pages, the last page
        id of the cache, and the cached rows that may be read (none when the cache has no page)."""
        num_pages = paged.mCache.shape[0] >> (paged.log2_page_size + 1)
        cached_rows = cutlass.select_(num_pages > 0, span.cached_len, Int32(0))
        return thr_copy.partition_S, paged.mCache[None, head, None], paged, span, num_pages - 1, cached_rows

    def _new_segment_rab(self, mRabNew, batch: Int32, head: Int32, new_seq, m_block: Int32, thr_copy_rab):
        """The new segment's rab: (its tiles' partition for the rab copy, their row limit, their
        column limit before the block offset), from the rab among the new tokens: rows by query
        index (the gather applied the row offset; history queries sit before the target keys, at
        negative segment rows that no load may address)."""
        row_first = m_block * self.tile_m
        gRab_new = self._rab_tiles(self._rab_slab(mRabNew, batch, head), Int32(0), (m_block, None))
        row_limit = cutlass.min(new_seq.seqlen_q, mRabNew.shape[2]) - row_first
        return thr_copy_rab.partition_S(gRab_new), row_limit, cutlass.min(new_seq.seqlen_k, mRabNew.shape[3])

    @cute.jit
    def load_paged_kv(self, gmem_copy, cache, kind: cutlass.Constexpr[int], cached, tXgX, tXsX, tXcX,
                      n_block: Int32, stage: Int32, seg_len: Int32, zero_fill: cutlass.Constexpr[bool]):
        """K (``kind`` 0) or V (1) of a paged tile's block: gathered from the cache's pages
        (``cached``), else the new keys' tile. The last block of either segment crosses its end
        (``seg_len``), so every load checks it at run time."""
        cached_rows = cache[5]
        if cached:
            self.load_cache_rows(gmem_copy, cache, kind, tXsX, tXcX, n_block, stage,
                                 cached_rows - n_block * self.tile_n, zero_fill)
        else:
            self.load_kv(gmem_copy, tXgX, tXsX, tXcX, n_block, stage, seg_len, True, zero_fill)

    @cute.jit
    def load_cache_rows(self, gmem_copy, cache, kind: cutlass.Constexpr[int], tXsX, tXcX, n_block: Int32,
                        stage: Int32, row_limit: Int32, zero_fill: cutlass.Constexpr[bool]):
        """Rows < row_limit of a cache block, each from its page (cp.async, 16 bytes per copy);
        the others zero-filled or left alone (as :meth:`load_rows`). Key position p = n_block *
        tile_n + row lives at :func:`common.key_blocks.cache_row`, the page id clamped into the
        cache (no TMA bounds the reads here), so that no input reads outside it."""
        partition, mCacheH, paged, span, last_id, _ = cache
        stage_idx = stage if const_expr(self.num_stages > 1) else 0
        num_rows = cute.size(tXsX.shape[1])
        # Every row's page-table read first, so that they are in flight together; then the
        # predicated copies.
        shifts = []
        for m in cutlass.range_constexpr(num_rows):
            r = tXcX[0, m, 0][0]
            # Tile row r is read from the cache row of key position n_block * tile_n + r.
            shifts.append(cache_row(paged, span, n_block * self.tile_n + r, kind, rows=1, last_id=last_id) - r)
        for m in cutlass.range_constexpr(num_rows):
            shift = shifts[m]
            if tXcX[0, m, 0][0] < row_limit:
                # The thread's copy of row m, its view moved by the row's shift (64-bit offsets:
                # the cache's row stride is Int64).
                tile = cute.local_tile(cute.domain_offset((shift, 0), mCacheH), (self.tile_n, self.head_dim), (0, 0))
                cute.copy(gmem_copy, partition(tile)[None, m, None], tXsX[None, m, None, stage_idx])
            elif const_expr(zero_fill):
                tXsX[None, m, None, stage_idx].fill(0)

    @cute.jit
    def load_paged_rab(self, gmem_copy, tRgR, tRsR, tRcR, rab_new, cached, n_block: Int32, stage: Int32,
                       row_limit: Int32, rab_cols: Int32):
        """rab of a paged tile's block: a cache block's tiles from rab (columns n_block * tile_n),
        a new block's from the rab among the new tokens (:meth:`_new_segment_rab`)."""
        stage_idx = stage if const_expr(self.num_stages > 1) else 0
        tRgR_new, new_row_limit, new_cols = rab_new
        if cached:
            self.load_rab(gmem_copy, tRgR, tRsR, tRcR, row_limit, rab_cols - n_block * self.tile_n, False,
                          (n_block,), (stage_idx,))
        else:
            self.load_rab(gmem_copy, tRgR_new, tRsR, tRcR, new_row_limit, new_cols - n_block * self.tile_n, False,
                          (n_block,), (stage_idx,))
