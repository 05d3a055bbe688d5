"""HSTU attention backward for sm90a (TMA loads, WGMMA, a producer warp and two consumer
warpgroups): the dK/dV kernel, fused with a dQ reduction by default at D128, and the dQ kernel of
the deterministic pair. With drab below D256 the pair's dQ kernel is the sm80 one
(:mod:`hstu_cute.ampere.bwd`); at D256 drab comes from :mod:`hstu_cute.hopper.bwd_wide`."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from .. import masks
from ..common.barriers import NamedBarrier
from ..common.mask_apply import KERNEL_OPS, apply_mask_rows_cols
from ..common.seqinfo import BlockSparseArgs, BlockTiles, ScoreScalars, SequenceArgs, walked_block
from ..common.silu import silu_and_grad
from ..common.sm90 import (
    acc_coords,
    advanced,
    L2_EVICT_LAST,
    rows_zero_copy,
    score_operands,
    shared_storage,
    sm90_bwd_pipelines,
    sm90_smem_layout,
    sm90_tma_atom_tokens,
    smem_tensors,
    store_acc_16bit_sw128_64cols,
    store_acc_fp32_sw128,
    transposed_view,
    trivial_mma,
    wgmma,
    wgmma_acc_as_operand_a,
    wgmma_acc_rows_cols,
    zero_smem_rows_past,
)
from ..common.tile_scheduler import SectionWalk
from ..fp8_format import vt_column_start
from .base import StagedEpilogue, store_rows_staged
from .dq_ahead import wait_zeroed, zero_ahead
from .bwd_base import (
    HstuBackwardSm90Base,
    KeyBlockProducer,
    load_ring_stage,
    rab_tiles,
    store_dk_dv,
    store_dq,
    token_tiles,
    transposed_tiles,
)


class HstuBackwardDkDvSm90(StagedEpilogue, KeyBlockProducer, HstuBackwardSm90Base):
    """dK, dV kernel. Tiles are (n-block, head, batch), n-block 0 first (with causal masks the
    first keys are attended by the most queries): one CTA per tile, or with ``persistent`` one CTA
    per SM walking them in a snake order (the producer then loads a tile's K and V after its
    first Q/dO stage, once the consumers have released sK/sV). A CTA owns K_j and V_j
    (``tile_n`` keys, 64 per consumer warpgroup) and walks the m-blocks that attend to them, in
    the transposed orientation (accumulator rows are keys, columns are queries):
    S^T = K Q^T (+ rab^T), dP^T = V dO^T, then P^T and G^T (spec section 2), dV += P^T dO and
    dK += G^T Q with P^T / G^T as the register A operand.

    Warp roles (384 threads): warpgroup 0, warp 0 is the producer (TMA: K and V once, then Q, dO
    and rab per m-block; 24 registers); warpgroups 1-2 are consumers (240 registers).
    Pipelines (mbarrier + TMA transaction counts): K+V (1 stage), Q+dO(+rab) (``num_stages``).
    Barriers: named 4/5 after a warpgroup zeroes the Q/dO rows past seqlen_q in smem (TMA reads
    the next sequence there; its G and P are 0, but 0 * NaN would be NaN).
    Epilogue: a warpgroup's 64 rows of dK and dV through swizzled smem tiles and TMA stores
    (:class:`~hstu_cute.hopper.base.StagedEpilogue`): in tiles of their own where they fit beside
    the rest, else (the fused kernel, one tile per CTA) in sK and sV once both warpgroups' GEMMs
    reading them have retired (named barrier 12). Register stores (pairs of columns) were a
    quarter of the fused block-sparse backward's warp samples on one-block walks (H200 ncu,
    docs/dev/perf-log.md session 40). A warpgroup whose rows cross seqlen_k keeps the register
    stores, rows past it skipped.

    ``fuse_dq`` (the default backward; the 5-GEMM schedule): the warpgroups also write G^T to
    smem (sdS, queries contiguous), and dQ_i = G K_j (SS WGMMA, A = sdS read MN-major, B = sK
    read MN-major) is reduced into an fp32 (T_q, H, D) accumulator with a TMA reduce-add
    (atomic per element in L2: the summation order over n-blocks is not fixed, so
    ``deterministic=True`` keeps the two-kernel path). By default the warpgroups take turns by
    m-block parity: the owner computes all of dQ_i (N = D: fewer smem operand bytes per FLOP than
    two N = D/2 halves) while the other runs ahead into the next m-block, so one warpgroup's
    SiLU overlaps the other's GEMMs. sdS has two buffers; barrier 6 + parity is bar.sync for the
    owner and bar.arrive for the other (alternating ids keep a warpgroup that runs ahead from
    completing a barrier generation alone). With rab at D >= 128 that smem does not fit: both
    warpgroups then compute half of dQ's columns each, in lockstep (barriers 6: sdS free,
    7: sdS written). Barriers 8/9: a warpgroup's sdQ buffer free, then written and fenced.
    Rows of sK past seqlen_k are zeroed (0 * NaN); dQ rows past seqlen_q are exact zeros, so
    adding them into the next sequence's rows is harmless, and the TMA clips rows past T_q.
    ``zero_ahead`` (fused, one tile per CTA): warps 1-3 of warpgroup 0 zero the accumulator rows
    of the walk section ``zero_lead`` ahead (a runtime argument; 0: the launcher zeroed them all)
    and count themselves (named barrier 13); a warpgroup's first reduce-add waits for its
    section's count (:mod:`hstu_cute.hopper.dq_ahead`).
    """

    native_kv_heads = True

    def __init__(self, dtype, head_dim: int, mask: masks.MaskSpec, has_rab: bool, tile_m: int, tile_n: int,
                 num_stages: int, fast_silu: bool, fuse_dq: bool = False, persistent: bool = False,
                 dynamic_tiles: bool = False, block_sparse: bool = False, zero_ahead: bool = False):
        super().__init__(dtype, head_dim, mask, has_rab, tile_m, tile_n, num_stages, fast_silu, tile_n // 64,
                         persistent, dynamic_tiles)
        self.fuse_dq = fuse_dq
        # The dQ accumulator zeroed by the kernel one walk section ahead (hopper.dq_ahead): the
        # sections' order needs one tile per CTA.
        self.zero_ahead = zero_ahead
        assert not zero_ahead or (fuse_dq and not persistent and head_dim == 128)
        # A block mask (hstu_cute.block_mask): the m-block walk takes the key block's list of
        # query blocks (seqinfo.walked_block) and masks the mixed tiles by block.
        self.block_sparse = block_sparse
        # Column halves only where smem is short (rab ring) and a half is whole 128-byte swizzle atoms.
        self.dq_split = fuse_dq and has_rab and head_dim >= 128
        self.dq_cols = head_dim // 2 if self.dq_split else head_dim
        # sdS rows are one 128-byte swizzle atom wide (store_acc_16bit_sw128_64cols).
        assert not fuse_dq or tile_m == 64, tile_m
        # The fused dQ was built with two consumer warpgroups: on 64-key tiles (one) its dQ came
        # out wrong on the H200 (a block-sparse call, docs/dev/perf-log.md session 38).
        assert not fuse_dq or tile_n == 128, tile_n
        assert tile_n % 64 == 0 and tile_m % 16 == 0

    @cute.jit
    def __call__(self, mQ, mK, mV, mdO, mdK, mdV, mdQaccum, mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK,
                 mNumContexts, mNumTargets, mFunc, mFuncBlocks, mRab, alpha, inv_scale, window_left, window_right, group_size, is_delta_q,
                 num_n_blocks, num_sms, bh_per_section, mTileCounter, mBlockCount, mBlockIndex, mBlockState, mBlockKept,
                 q_block, k_block, mZeroDone, zero_lead, stream):
        D = self.head_dim
        blocks = None
        if const_expr(self.block_sparse):
            blocks = BlockSparseArgs(mBlockCount, mBlockIndex, mBlockState, mBlockKept, q_block, k_block)
        self.sK_layout = sm90_smem_layout(self.dtype, self.tile_n, D, None)
        self.sQ_layout = sm90_smem_layout(self.dtype, self.tile_m, D, self.num_stages)
        self.sRab_layout = self.rab_ring_layout()
        # S^T / dP^T: (keys, queries) = K Q^T, both operands K-major in smem.
        self.tiled_mma_s = trivial_mma(self.dtype, self.tile_m, False, self.num_mma_wg)
        # dV / dK: (keys, D) += P^T / G^T (registers) x dO / Q (smem, MN-major as (D, queries)).
        self.tiled_mma_d = trivial_mma(self.dtype, D, True, self.num_mma_wg, a_in_registers=True)
        self.key_block_bytes()
        loads = self.token_load_atoms(mQ, mK, mV, mdO, mRab, cute.slice_(self.sQ_layout, (None, None, 0)),
                                      self.sK_layout, self.sRab_layout)
        self.sdS_layout = self.sdQ_layout = self.tiled_mma_dq = tma_atom_dq = tma_dq = None
        if const_expr(self.fuse_dq):
            # G^T as (keys, queries), queries contiguous: the dQ GEMM reads it as an MN-major A.
            self.sdS_layout = sm90_smem_layout(self.dtype, self.tile_n, self.tile_m, 1 if self.dq_split else 2)
            self.sdQ_layout = sm90_smem_layout(Float32, self.tile_m, self.dq_cols, 2)  # one buffer per warpgroup
            self.tiled_mma_dq = trivial_mma(self.dtype, self.dq_cols, True, 1, atom_layout=(1, 1, 1), a_mn_major=True)
            tma_atom_dq, tma_dq = sm90_tma_atom_tokens(cpasync.CopyReduceBulkTensorTileS2GOp(), mdQaccum,
                                                       cute.slice_(self.sdQ_layout, (None, None, 0)), self.tile_m,
                                                       self.dq_cols)
        self.zero_copy = rows_zero_copy(self.dtype, D)
        tile = (self.dtype, cute.cosize(self.sK_layout))
        ring = (self.dtype, cute.cosize(self.sQ_layout))
        ring_barriers, ring_words = self.tile_ring_storage()
        barriers = dict(mbar_kv=2, mbar_q=2 * self.num_stages, **ring_barriers)
        buffers = dict(sK=tile, sV=tile, sQ=ring, sdO=ring, sRab=(self.dtype, self.smem_elems(self.sRab_layout)),
                       sdS=(self.dtype, self.smem_elems(self.sdS_layout)),
                       sdQ=(Float32, self.smem_elems(self.sdQ_layout)))
        storage_of = lambda extra: shared_storage(barriers, dict(buffers, **extra), words=ring_words)  # noqa: E731
        self.shared_storage, self.sEpi_layout, epi_atoms = self.staged_epilogue(storage_of, (mdK, mdV), D, self.dtype)
        staged = D % 64 == 0  # D32 keeps the register stores (StagedEpilogue.staged_epilogue)
        # Without room for staging tiles of their own, a CTA with one tile stages in sK and sV: four
        # 64 x D tiles, as many bytes as sK and sV, which lie back to back (1024-byte aligned
        # fields of 1024-byte multiples). A persistent CTA's producer reloads them for its next tile.
        self.epilogue_in_kv = staged and self.sEpi_layout is None and not self.persistent
        if const_expr(self.epilogue_in_kv):
            assert self.tile_n == 128 and (cute.cosize(self.sK_layout) * self.dtype.width // 8) % 1024 == 0
            self.sEpi_layout, epi_atoms = self.staged_tiles((mdK, mdV), D, self.dtype)
        num_ctas = num_n_blocks * mQ.shape[1] * (mOffsetsQ.shape[0] - 1)
        if const_expr(self.persistent):
            num_ctas = cutlass.min(num_ctas, num_sms)
        self.launch(*loads, tma_atom_dq, tma_dq, mQ, mK, mdK, mdV,
                    SequenceArgs(mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets, mFunc, mFuncBlocks,
                                 blocks), mRab,
                    ScoreScalars(alpha, inv_scale, window_left, window_right, group_size, is_delta_q), num_n_blocks,
                    bh_per_section, mTileCounter, epi_atoms, mdQaccum, mZeroDone, zero_lead,
                    statics=dict(sK_layout=self.sK_layout, sQ_layout=self.sQ_layout, sRab_layout=self.sRab_layout,
                                 sEpi_layout=self.sEpi_layout,
                                 sdS_layout=self.sdS_layout, sdQ_layout=self.sdQ_layout, tiled_mma_s=self.tiled_mma_s,
                                 tiled_mma_d=self.tiled_mma_d, tiled_mma_dq=self.tiled_mma_dq,
                                 zero_copy=self.zero_copy),
                    grid=[num_ctas, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_rab,
               tma_rab, tma_atom_dq, tma_dq, mQ, mK, mdK, mdV, seqs, mRab, scalars, num_n_blocks: Int32,
               bh_per_section: Int32, mTileCounter, epi_atoms, mdQaccum, mZeroDone, zero_lead, statics):
        self.bind(statics)
        self.kv_group = mQ.shape[1] // mK.shape[1]
        tidx, warp_idx = self.prologue(tma_atom_k, tma_atom_v, tma_atom_q, tma_atom_do, tma_atom_rab, tma_atom_dq)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        pipe_kv, pipe_q = sm90_bwd_pipelines(storage.mbar_kv, storage.mbar_q, self.kv_bytes,
                                              self.q_bytes, self.num_stages, self.num_mma_threads)
        s = smem_tensors(storage, dict(sK=self.sK_layout, sV=self.sK_layout, sQ=self.sQ_layout, sdO=self.sQ_layout,
                                       sRab=self.sRab_layout, sdS=self.sdS_layout, sdQ=self.sdQ_layout))
        epilogue = None
        if const_expr(self.sEpi_layout is not None):
            sEpi = storage.sK if const_expr(self.epilogue_in_kv) else storage.sEpi
            epilogue = (sEpi.get_tensor(self.sEpi_layout.outer, swizzle=self.sEpi_layout.inner), epi_atoms)
        walk = SectionWalk(num_n_blocks, mQ.shape[1], seqs.mOffsetsQ.shape[0] - 1, bh_per_section, reverse=False)
        seqinfo = self.sequence_info(seqs, scalars, mQ, mK)
        claims = self.tile_claims(storage, walk, mTileCounter)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce((tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_q, tma_q, tma_atom_do, tma_do,
                              tma_atom_rab, tma_rab, s["sK"], s["sV"], s["sQ"], s["sdO"], s["sRab"], pipe_kv, pipe_q,
                              mRab), walk, seqinfo, claims)
            if const_expr(self.zero_ahead):
                if warp_idx > 0:
                    zero_ahead(mdQaccum, mZeroDone, seqs.mOffsetsQ, cute.arch.block_idx()[0], bh_per_section,
                               num_n_blocks, mQ.shape[1] * (seqs.mOffsetsQ.shape[0] - 1), mQ.shape[1], warp_idx,
                               zero_lead)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consume(tidx - 128, mdK, mdV, s["sK"], s["sV"], s["sQ"], s["sdO"], s["sRab"], s["sdS"], s["sdQ"],
                         tma_atom_dq, tma_dq, pipe_kv, pipe_q, scalars.alpha, scalars.inv_scale, walk, seqinfo,
                         claims, epilogue,
                         (mZeroDone, cute.arch.block_idx()[0], bh_per_section, num_n_blocks, zero_lead)
                         if const_expr(self.zero_ahead) else None)

    @cute.jit
    def tile_problem(self, tiles, seqinfo, tile: Int32):
        """(live, (n_block, head, batch, q_start, k_start, seq, m_lo, m_hi)) of a linear tile;
        ``live``: the n-block starts inside its sequence (else the tile is skipped). With
        ``dim_parts`` > 1 (the FP8 kernel at D256) the walk counts that many tiles per key block
        and the coordinates end with the tile's part of D."""
        n_block, head, batch = tiles.coords(tile)
        n_part = n_block
        if const_expr(self.dim_parts > 1):
            n_block = n_part // self.dim_parts
        q_start, k_start, seq = seqinfo.at(batch)
        m_lo, m_hi = masks.m_block_range(self.mask, seq, n_block, self.tile_m, self.tile_n, KERNEL_OPS)
        if const_expr(self.block_sparse):
            # The walk takes the entries of the key block's list of query blocks inside [m_lo, m_hi)
            # (seqinfo.walked_block); the launcher passes the transposed lists.
            seq.sparse = BlockTiles.of(seqinfo.seqs.blocks, batch, head)
            first, count = seq.sparse.list_range(n_block, m_lo, m_hi)
            m_lo, m_hi = first, first + count
        live = n_block * self.tile_n < seq.seqlen_k
        coords = (n_block, head, batch, q_start, k_start, seq, m_lo, m_hi)
        if const_expr(self.dim_parts > 1):
            coords = (*coords, n_part % self.dim_parts)
        return live, coords

    @cute.jit
    def produce(self, loads, walk, seqinfo, claims):
        states = ()
        if const_expr(self.persistent):
            states = self.pipeline_states(pipeline.PipelineUserType.Producer)
        self.for_each_tile(walk, seqinfo, self.produce_tile, loads, states, claims=claims, producer=True)

    def produce_tile(self, *args):
        # Plain Python (traced inline): what the producer does per tile (the FP8 kernel adds its part of D).
        return self.produce_key_block(*args)

    @cute.jit
    def consume(self, tidx: Int32, mdK, mdV, sK, sV, sQ, sdO, sRab, sdS, sdQ, tma_atom_dq, tma_dq, pipe_kv,
                pipe_q, alpha: Float32, inv_scale: Float32, walk, seqinfo, claims, epilogue=None, zero_wait=None):
        D = self.head_dim
        tiled_mma_s, tiled_mma_d, tiled_mma_dq = self.tiled_mma_s, self.tiled_mma_d, self.tiled_mma_dq
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma_s = tiled_mma_s.get_slice(tidx)
        wg_mma_s = tiled_mma_s.get_slice(wg * 128)
        wg_mma_d = tiled_mma_d.get_slice(wg * 128)
        tSrK, tSrV, tSrQ, tSrdO = score_operands(wg_mma_s, (sK, sV), (sQ, sdO))
        # Q and dO are (queries, D) with D contiguous: as B of (keys, D) += (keys, queries) x (queries, D)
        # they are (N = D, K = queries), MN-major.
        qt = (D, self.tile_m, self.num_stages)
        tDrQt = wg_mma_d.make_fragment_B(wg_mma_d.partition_B(transposed_view(sQ, qt)))
        tDrdOt = wg_mma_d.make_fragment_B(wg_mma_d.partition_B(transposed_view(sdO, qt)))
        tScS = thr_mma_s.partition_C(cute.make_identity_tensor((self.tile_n, self.tile_m)))
        tSsRabT = None
        if const_expr(self.has_rab):
            # rab tiles are (queries, keys) in smem; the accumulator reads them transposed.
            sRabT = transposed_view(sRab, (self.tile_n, self.tile_m, self.num_stages))
            tSsRabT = thr_mma_s.partition_C(sRabT)
        tid_in_wg = tidx % 128
        tdQrdS = tdQrKt = tdQsdQ = sdQ_wg = None
        dq_col_block = 0
        if const_expr(self.fuse_dq):
            thr_mma_dq = tiled_mma_dq.get_slice(tid_in_wg)
            # dS as (queries, keys) and K as (D, keys): both contiguous along their first mode.
            sdSt = transposed_view(sdS, (self.tile_m, self.tile_n, cute.size(sdS, mode=[2])))
            sKt = transposed_view(sK, (D, self.tile_n))
            tdQrdS = thr_mma_dq.make_fragment_A(thr_mma_dq.partition_A(sdSt))
            dq_col_block = wg if const_expr(self.dq_split) else 0
            sKt_cols = cute.local_tile(sKt, (self.dq_cols, self.tile_n), (dq_col_block, 0))
            tdQrKt = thr_mma_dq.make_fragment_B(thr_mma_dq.partition_B(sKt_cols))
            sdQ_wg = sdQ[None, None, wg]
            tdQsdQ = thr_mma_dq.partition_C(sdQ_wg)

        kv_state, q_state = self.pipeline_states(pipeline.PipelineUserType.Consumer)
        # Counts m-blocks over all of this CTA's tiles: its parity picks the sdS buffer and the
        # dQ owner, and the alternating barrier ids must keep alternating across tiles.
        blocks_done = Int32(0)
        tile_args = (tidx, mdK, mdV, sK, sQ, sdO, tma_atom_dq, tma_dq, pipe_kv, pipe_q, alpha, inv_scale, tSrK,
                     tSrV, tSrQ, tSrdO, tDrQt, tDrdOt, tScS, tSsRabT, sdS, tdQrdS, tdQrKt, tdQsdQ, sdQ_wg, dq_col_block,
                     epilogue, zero_wait)
        self.for_each_tile(walk, seqinfo, self.consume_tile, tile_args, (q_state, kv_state, blocks_done),
                           claims=claims)
        if const_expr(self.fuse_dq or epilogue is not None):
            # The last reduce-adds and stores must have read smem before the CTA's smem goes away
            # (their writes land before the grid completes).
            if tid_in_wg < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def consume_tile(self, tidx: Int32, mdK, mdV, sK, sQ, sdO, tma_atom_dq, tma_dq, pipe_kv, pipe_q,
                     alpha: Float32, inv_scale: Float32, tSrK, tSrV, tSrQ, tSrdO, tDrQt, tDrdOt, tScS, tSsRabT, sdS,
                     tdQrdS, tdQrKt, tdQsdQ, sdQ_wg, dq_col_block, epilogue, zero_wait, n_block: Int32, head: Int32,
                     batch: Int32,
                     q_start: Int32, k_start: Int32, seq, m_lo: Int32, m_hi: Int32, q_state, kv_state,
                     blocks_done: Int32):
        """One n-block: dK and dV (and dQ's reduce-adds) of its keys. Returns the advanced
        pipeline states and the m-block count."""
        D = self.head_dim
        tiled_mma_s, tiled_mma_d, tiled_mma_dq = self.tiled_mma_s, self.tiled_mma_d, self.tiled_mma_dq
        zero_copy = self.zero_copy
        spec = self.mask
        wg = cute.arch.make_warp_uniform(tidx // 128)
        tid_in_wg = tidx % 128
        thr_mma_d = tiled_mma_d.get_slice(tidx)
        wg_mma_d = tiled_mma_d.get_slice(wg * 128)
        shape_S = tiled_mma_s.get_slice(wg * 128).partition_shape_C((self.tile_n, self.tile_m))
        col0 = n_block * self.tile_n
        k_rows = seq.seqlen_k - n_block * self.tile_n
        acc_dK = cute.make_rmem_tensor(wg_mma_d.partition_shape_C((self.tile_n, D)), Float32)
        acc_dV = cute.make_rmem_tensor(wg_mma_d.partition_shape_C((self.tile_n, D)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        tdQsdQ_tma = tdQgdQ = None
        if const_expr(self.fuse_dq):
            gdQ = cute.local_tile(cute.domain_offset((q_start, 0), tma_dq[None, None, head]),
                                  (self.tile_m, self.dq_cols), (None, dq_col_block))
            tdQsdQ_tma, tdQgdQ = cpasync.tma_partition(tma_atom_dq, 0, cute.make_layout(1),
                                                       cute.group_modes(sdQ_wg, 0, 2), cute.group_modes(gdQ, 0, 2))
        pipe_kv.consumer_wait(kv_state)
        if const_expr(self.fuse_dq):
            if k_rows < self.tile_n:
                zero_smem_rows_past(zero_copy, (sK,), (self.tile_n, D), tid_in_wg, wg, k_rows)
        for step in cutlass.range(m_lo, m_hi, unroll=1):
            m_block = walked_block(self.block_sparse, seq, n_block, step)
            if masks.tile_nonempty(spec, seq, m_block, n_block, self.tile_m, self.tile_n, KERNEL_OPS):
                tile_full = mixed = None
                if const_expr(spec.kind == masks.MaskKind.FUNC):
                    tile_full = masks.tile_is_full(spec, seq, m_block, n_block, self.tile_m, self.tile_n, KERNEL_OPS)
                if const_expr(self.block_sparse):
                    mixed = seq.sparse.tile_mixed(m_block, n_block)  # ahead of the waits, as tile_full
                q_rows = self.wait_query_stage(pipe_q, q_state, seq, m_block, (sQ, sdO), zero_copy, tid_in_wg, wg)
                acc_S = cute.make_rmem_tensor(shape_S, Float32)
                acc_dP = cute.make_rmem_tensor(shape_S, Float32)
                wgmma(tiled_mma_s, acc_S, tSrK, tSrQ[None, None, None, q_state.index], True, -1)
                wgmma(tiled_mma_s, acc_dP, tSrV, tSrdO[None, None, None, q_state.index], True, 1)
                if const_expr(self.has_rab):
                    rRab = cute.make_rmem_tensor(shape_S, self.dtype)
                    cute.autovec_copy(tSsRabT[None, None, None, q_state.index], rRab)
                    warpgroup.wait_group(1)
                    acc_S.store(acc_S.load() + rRab.load().to(Float32))
                warpgroup.wait_group(0)
                silu_and_grad(acc_S, acc_dP, alpha, inv_scale, self.fast_silu, self.unscaled_grad)
                self.mask_key_major(acc_S, acc_dP, tScS, seq, m_block, n_block, col0, q_rows, tile_full, mixed)
                rP = wg_mma_d.make_fragment_A(wg_mma_d.partition_shape_A((self.tile_n, self.tile_m)))
                rP.store(cute.make_tensor(acc_S.iterator, wgmma_acc_as_operand_a(acc_S.layout)).load().to(self.dtype))
                rG = wg_mma_d.make_fragment_A(wg_mma_d.partition_shape_A((self.tile_n, self.tile_m)))
                if const_expr(self.fuse_dq):
                    rG_acc = cute.make_rmem_tensor(acc_dP.layout, self.dtype)
                    rG_acc.store(acc_dP.load().to(self.dtype))
                    rG.store(cute.make_tensor(rG_acc.iterator, wgmma_acc_as_operand_a(rG_acc.layout)).load())
                    if const_expr(self.dq_split):
                        cute.arch.barrier(barrier_id=NamedBarrier.DS, number_of_threads=self.num_mma_threads)
                    store_acc_16bit_sw128_64cols(rG_acc, sdS[None, None, self.ds_buffer(blocks_done)], tid_in_wg,
                                                 wg * 64)
                else:
                    rG.store(cute.make_tensor(acc_dP.iterator, wgmma_acc_as_operand_a(acc_dP.layout)).load().to(self.dtype))
                wgmma(tiled_mma_d, acc_dV, rP, tDrdOt[None, None, None, q_state.index], False, -1)
                if const_expr(not self.fuse_dq):
                    wgmma(tiled_mma_d, acc_dK, rG, tDrQt[None, None, None, q_state.index], False, 0)
                else:
                    wgmma(tiled_mma_d, acc_dK, rG, tDrQt[None, None, None, q_state.index], False, -1)
                    cute.arch.fence_view_async_shared()
                    self.reduce_dq(tiled_mma_dq, tdQrdS, tdQrKt, tdQsdQ, sdQ_wg, tdQsdQ_tma, tdQgdQ, tma_atom_dq,
                                   tid_in_wg, wg, m_block, blocks_done, alpha * inv_scale * Float32(0.5),
                                   zero_wait=zero_wait)
                pipe_q.consumer_release(q_state)
                q_state = advanced(q_state)
                blocks_done += 1

        # Every WGMMA reading sK/sV has retired (the last dK or dQ GEMM waited for all).
        pipe_kv.consumer_release(kv_state)
        if const_expr(self.unscaled_grad):
            acc_dV.store(acc_dV.load() * inv_scale)
            acc_dK.store(acc_dK.load() * (alpha * inv_scale * Float32(0.5)))
        if const_expr(epilogue is None):
            store_dk_dv(thr_mma_d, acc_dK, acc_dV, mdK, mdV, self.dtype, self.tile_n, D, k_start, head, n_block, k_rows)
        else:
            if const_expr(self.epilogue_in_kv):
                cute.arch.barrier(barrier_id=NamedBarrier.EPILOGUE_KV, number_of_threads=self.num_mma_threads)
            if k_rows - wg * 64 >= 64:
                store_rows_staged((acc_dK, acc_dV), *epilogue, self.dtype, tid_in_wg, wg, k_start + col0 + wg * 64,
                                  head)
            else:
                store_dk_dv(thr_mma_d, acc_dK, acc_dV, mdK, mdV, self.dtype, self.tile_n, D, k_start, head, n_block,
                            k_rows)
        return q_state, advanced(kv_state), blocks_done

    def ds_buffer(self, blocks_done: Int32):
        return 0 if const_expr(self.dq_split) else blocks_done % 2

    @cute.jit
    def reduce_dq(self, tiled_mma_dq, tdQrdS, tdQrKt, tdQsdQ, sdQ_wg, tdQsdQ_tma, tdQgdQ, tma_atom_dq, tid_in_wg: Int32,
                  wg: Int32, m_block: Int32, blocks_done: Int32, dq_scale: Float32, zero_wait=None):
        """dQ_i (all columns, or this warpgroup's half) = dS K_j, then a TMA reduce-add into the
        fp32 accumulator. Waits for every WGMMA this warpgroup has in flight (dV and dK too), and
        (``zero_wait``: :func:`~hstu_cute.hopper.dq_ahead.wait_zeroed`'s arguments) before its
        first reduce-add until the accumulator rows of its section are zero."""
        buf = self.ds_buffer(blocks_done)
        mine = True
        if const_expr(self.dq_split):
            cute.arch.barrier(barrier_id=NamedBarrier.DS + 1, number_of_threads=self.num_mma_threads)
        else:
            mine = buf == wg
            if not mine:
                cute.arch.barrier_arrive(barrier_id=NamedBarrier.DS + buf, number_of_threads=self.num_mma_threads)
                warpgroup.wait_group(0)
        if mine:
            if const_expr(not self.dq_split):
                # dV and dK retire first: their register A operands (P^T, G^T) and a 64 x D dQ
                # accumulator do not fit together (ptxas serialized every WGMMA, C7512).
                warpgroup.wait_group(0)
                cute.arch.barrier(barrier_id=NamedBarrier.DS + buf, number_of_threads=self.num_mma_threads)
            acc_dQ = self.dq_partial(tiled_mma_dq, tdQrdS, tdQrKt, tdQsdQ.shape, buf, dq_scale)
            # The TMA copy elects its issuing lane (elect.sync): a whole warp must reach it. Its
            # previous reduce from this buffer must have finished reading smem.
            if tid_in_wg < 32:
                if const_expr(zero_wait is not None):
                    if blocks_done < 2:
                        wait_zeroed(*zero_wait)
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=NamedBarrier.DQ_WG0 + wg, number_of_threads=128)
            store_acc_fp32_sw128(acc_dQ, sdQ_wg, tid_in_wg, self.tile_m, self.dq_cols)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=NamedBarrier.DQ_WG0 + wg, number_of_threads=128)
            if tid_in_wg < 32:
                # Keep the accumulator's lines in L2: each is added into by every n-block that
                # sees its m-block (up to 32 at N4096). H100 D128 causal: 446.5-449.3 TF vs
                # 437.4-441.4 without the hint (evict_first 442.6).
                cute.copy(tma_atom_dq, tdQsdQ_tma, tdQgdQ[None, m_block], cache_policy=cutlass.Int64(L2_EVICT_LAST))
                cute.arch.cp_async_bulk_commit_group()

    def dq_partial(self, tiled_mma_dq, tdQrdS, tdQrKt, shape, buf: Int32, dq_scale: Float32):
        # Plain Python (traced inline): dQ_i = dS K_j from sdS buffer ``buf``, retired (the FP8
        # kernel's takes its two warpgroups' halves of the keys, each with its own scale).
        acc_dQ = cute.make_rmem_tensor(shape, Float32)
        wgmma(tiled_mma_dq, acc_dQ, tdQrdS[None, None, None, buf], tdQrKt, True, 0)
        if const_expr(self.unscaled_grad):
            acc_dQ.store(acc_dQ.load() * dq_scale)
        return acc_dQ


class HstuBackwardDqSm90(StagedEpilogue, HstuBackwardSm90Base):
    """dQ kernel (no drab: with ``has_drab`` the sm80 dQ kernel runs). Tiles are (m-block, head,
    batch), longest causal rows first: one CTA per tile, or with ``persistent`` one CTA per SM
    walking them in a snake order (Q and dO then load after the tile's first K/V stage). A CTA
    owns Q_i and dO_i (``tile_m`` queries, 64 per consumer warpgroup) and walks the forward's
    n-block schedule (target hole skipped):
    S = Q K^T (+ rab), dP = dO V^T (SS WGMMA), G (spec section 2) in registers as the A operand
    of dQ += G K (RS WGMMA, K read MN-major).

    Warp roles (384 threads): warpgroup 0, warp 0 is the producer (TMA: Q and dO once, then K, V
    (+rab) per n-block; 24 registers); warpgroups 1-2 are consumers (240 registers).
    Pipelines: Q+dO (1 stage), K+V(+rab) (``num_stages``). Barriers: named 4/5 after a warpgroup
    zeroes the K rows past seqlen_k (TMA reads the next sequence there; G is 0 for them, but
    0 * NaN would be NaN). Epilogue: dQ through staged smem tiles and a TMA store where they fit
    (:class:`~hstu_cute.hopper.base.StagedEpilogue`, head dims 64k), else from registers; a
    warpgroup whose rows cross seqlen_q keeps the register stores, rows past it skipped.
    """

    native_kv_heads = True

    # The FP8 kernel's K^T loads (atom, tensor, smem ring): they go with K and V.
    transposed_k_loads = None

    def __init__(self, dtype, head_dim: int, mask: masks.MaskSpec, has_rab: bool, tile_m: int, tile_n: int,
                 num_stages: int, fast_silu: bool, persistent: bool = False, dynamic_tiles: bool = False):
        super().__init__(dtype, head_dim, mask, has_rab, tile_m, tile_n, num_stages, fast_silu, tile_m // 64,
                         persistent, dynamic_tiles)
        assert tile_m % 64 == 0 and tile_n % 16 == 0

    @cute.jit
    def __call__(self, mQ, mK, mV, mdO, mdQ, mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets, mFunc, mFuncBlocks,
                 mRab, alpha, inv_scale, window_left, window_right, group_size, is_delta_q, num_m_blocks, num_sms,
                 bh_per_section, mTileCounter, stream):
        D = self.head_dim
        self.sQ_layout = sm90_smem_layout(self.dtype, self.tile_m, D, None)
        self.sK_layout = sm90_smem_layout(self.dtype, self.tile_n, D, self.num_stages)
        self.sRab_layout = self.rab_ring_layout()
        self.tiled_mma_s = trivial_mma(self.dtype, self.tile_n, False, self.num_mma_wg)
        self.tiled_mma_dq = trivial_mma(self.dtype, D, True, self.num_mma_wg, a_in_registers=True)
        loads = self.token_load_atoms(mQ, mK, mV, mdO, mRab, self.sQ_layout,
                                      cute.slice_(self.sK_layout, (None, None, 0)), self.sRab_layout)
        elem = self.dtype.width // 8
        self.q_bytes = 2 * self.tile_m * D * elem
        self.kv_bytes = 2 * self.tile_n * D * elem + (self.tile_m * self.tile_n * elem if const_expr(self.has_rab) else 0)
        self.zero_copy = rows_zero_copy(self.dtype, D)
        tile = (self.dtype, cute.cosize(self.sQ_layout))
        ring = (self.dtype, cute.cosize(self.sK_layout))
        ring_barriers, ring_words = self.tile_ring_storage()
        barriers = dict(mbar_q=2, mbar_kv=2 * self.num_stages, **ring_barriers)
        buffers = dict(sQ=tile, sdO=tile, sK=ring, sV=ring, sRab=(self.dtype, self.smem_elems(self.sRab_layout)))
        storage_of = lambda extra: shared_storage(barriers, dict(buffers, **extra), words=ring_words)  # noqa: E731
        self.shared_storage, self.sEpi_layout, epi_atoms = self.staged_epilogue(storage_of, (mdQ,), D, self.dtype)
        num_ctas = num_m_blocks * mQ.shape[1] * (mOffsetsQ.shape[0] - 1)
        if const_expr(self.persistent):
            num_ctas = cutlass.min(num_ctas, num_sms)
        # The producer takes Q, dO once and K, V per n-block: the atoms in that order.
        k_v, q_do, rab = loads[0:4], loads[4:8], loads[8:10]
        self.launch(*q_do, *k_v, *rab, mQ, mK, mdQ,
                    SequenceArgs(mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets, mFunc, mFuncBlocks), mRab,
                    ScoreScalars(alpha, inv_scale, window_left, window_right, group_size, is_delta_q), num_m_blocks,
                    bh_per_section, mTileCounter, epi_atoms,
                    statics=dict(sQ_layout=self.sQ_layout, sK_layout=self.sK_layout, sRab_layout=self.sRab_layout,
                                 sEpi_layout=self.sEpi_layout, tiled_mma_s=self.tiled_mma_s,
                                 tiled_mma_dq=self.tiled_mma_dq, zero_copy=self.zero_copy),
                    grid=[num_ctas, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_rab,
               tma_rab, mQ, mK, mdQ, seqs, mRab, scalars, num_m_blocks: Int32,
               bh_per_section: Int32, mTileCounter, epi_atoms, statics):
        self.bind(statics)
        self.kv_group = mQ.shape[1] // mK.shape[1]
        tidx, warp_idx = self.prologue(tma_atom_q, tma_atom_do, tma_atom_k, tma_atom_v, tma_atom_rab)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        pipe_q, pipe_kv = sm90_bwd_pipelines(storage.mbar_q, storage.mbar_kv, self.q_bytes,
                                              self.kv_bytes, self.num_stages, self.num_mma_threads)
        s = smem_tensors(storage, dict(sQ=self.sQ_layout, sdO=self.sQ_layout, sK=self.sK_layout, sV=self.sK_layout,
                                       sRab=self.sRab_layout, sEpi=self.sEpi_layout))
        epilogue = None
        if const_expr(self.sEpi_layout is not None):
            epilogue = (s["sEpi"], epi_atoms)
        walk = SectionWalk(num_m_blocks, mQ.shape[1], seqs.mOffsetsQ.shape[0] - 1, bh_per_section, reverse=True)
        seqinfo = self.sequence_info(seqs, scalars, mQ, mK)
        claims = self.tile_claims(storage, walk, mTileCounter)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce((tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_k, tma_k, tma_atom_v, tma_v,
                              tma_atom_rab, tma_rab, s["sQ"], s["sdO"], s["sK"], s["sV"], s["sRab"], pipe_q, pipe_kv,
                              mRab), walk, seqinfo, claims)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consume(tidx - 128, mdQ, s["sQ"], s["sdO"], s["sK"], s["sV"], s["sRab"], pipe_q, pipe_kv,
                         scalars.alpha, scalars.inv_scale, walk, seqinfo, claims, epilogue)

    @cute.jit
    def tile_problem(self, tiles, seqinfo, tile: Int32):
        """(live, (m_block, head, batch, q_start, k_start, seq, n-block schedule)) of a linear tile;
        ``live``: the m-block starts inside its sequence (else the tile is skipped)."""
        m_block, head, batch = tiles.coords(tile)
        q_start, k_start, seq = seqinfo.at(batch)
        sched = masks.n_block_schedule(self.mask, seq, m_block, self.tile_m, self.tile_n, KERNEL_OPS)
        live = m_block * self.tile_m < seq.seqlen_q
        return live, (m_block, head, batch, q_start, k_start, seq, sched)

    @cute.jit
    def produce(self, loads, walk, seqinfo, claims):
        states = ()
        if const_expr(self.persistent):
            states = self.pipeline_states(pipeline.PipelineUserType.Producer)
        self.for_each_tile(walk, seqinfo, self.produce_query_block, loads, states, claims=claims, producer=True)

    @cute.jit
    def produce_query_block(self, tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_k, tma_k, tma_atom_v, tma_v,
                            tma_atom_rab, tma_rab, sQ, sdO, sK, sV, sRab, pipe_q, pipe_kv, mRab, m_block: Int32,
                            head: Int32, batch: Int32, q_start: Int32, k_start: Int32, seq, sched, q_state=None,
                            kv_state=None):
        """TMA loads of one m-block: Q and dO (1-stage pipeline) and K, V (and rab) of its n-block
        schedule into the ring. Returns the advanced pipeline states. Without states (one m-block
        per CTA) Q and dO go first; a persistent CTA passes its states and loads Q and dO after
        the first K/V: the previous m-block's consumers hold sQ/sdO until their last GEMM, and
        a K/V stage frees up earlier."""
        D = self.head_dim
        q_after_kv = q_state is not None
        if const_expr(not q_after_kv):
            q_state, kv_state = self.pipeline_states(pipeline.PipelineUserType.Producer)
        n_lo, hole_lo, hole_size, n_count = sched
        if n_count > 0:
            tQsQ, tQgQ = token_tiles(tma_atom_q, tma_q, sQ, q_start, head, (self.tile_m, D), (m_block, 0))
            tOsO, tOgO = token_tiles(tma_atom_do, tma_do, sdO, q_start, head, (self.tile_m, D), (m_block, 0))
            kv_head = head // self.kv_group if const_expr(self.native_kv_heads) else head
            tKsK, tKgK = token_tiles(tma_atom_k, tma_k, sK, k_start, kv_head, (self.tile_n, D), (None, 0))
            tVsV, tVgV = token_tiles(tma_atom_v, tma_v, sV, k_start, kv_head, (self.tile_n, D), (None, 0))
            # What each n-block loads into the ring.
            copies = [(tma_atom_k, tKgK, tKsK), (tma_atom_v, tVgV, tVsV)]
            if const_expr(self.has_rab):
                tRsR, tRgR = rab_tiles(tma_atom_rab, tma_rab, sRab, mRab, seq, head, batch,
                                       (self.tile_m, self.tile_n), (m_block, None))
                copies.append((tma_atom_rab, tRgR, tRsR))
            transposed = self.transposed_k_loads
            if const_expr(transposed is not None):
                atom_kt, tma_kt, sKt = transposed
                tKtsKt, tKtgKt = transposed_tiles(atom_kt, tma_kt, sKt, head, vt_column_start(k_start, batch), D,
                                                  self.tile_n)
                copies.append((atom_kt, tKtgKt, tKtsKt))
            if const_expr(not q_after_kv):
                self.load_q(tma_atom_q, tQgQ, tQsQ, tma_atom_do, tOgO, tOsO, pipe_q, q_state)
            for it in cutlass.range(n_count, unroll=1):
                n_block = masks.n_block_at(n_count - 1 - it, n_lo, hole_lo, hole_size, KERNEL_OPS)
                kv_state = load_ring_stage(pipe_kv, kv_state, n_block, copies)
                if const_expr(q_after_kv):
                    if it == 0:
                        self.load_q(tma_atom_q, tQgQ, tQsQ, tma_atom_do, tOgO, tOsO, pipe_q, q_state)
            if const_expr(q_after_kv):
                q_state = advanced(q_state)
        return q_state, kv_state

    @cute.jit
    def load_q(self, tma_atom_q, tQgQ, tQsQ, tma_atom_do, tOgO, tOsO, pipe_q, q_state):
        pipe_q.producer_acquire(q_state)
        bar_q = pipe_q.producer_get_barrier(q_state)
        cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=bar_q)
        cute.copy(tma_atom_do, tOgO, tOsO, tma_bar_ptr=bar_q)

    @cute.jit
    def consume(self, tidx: Int32, mdQ, sQ, sdO, sK, sV, sRab, pipe_q, pipe_kv, alpha: Float32, inv_scale: Float32,
                walk, seqinfo, claims, epilogue=None):
        block_args = (tidx, mdQ, sQ, sdO, sK, sV, sRab, pipe_q, pipe_kv, alpha, inv_scale, epilogue)
        states = ()
        if const_expr(self.persistent):
            states = self.pipeline_states(pipeline.PipelineUserType.Consumer)
        self.for_each_tile(walk, seqinfo, self.consume_query_block, block_args, states, claims=claims)
        if const_expr(epilogue is not None):
            # The last TMA stores must have read their tiles before the CTA's smem goes away.
            if tidx % 128 < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def consume_query_block(self, tidx: Int32, mdQ, sQ, sdO, sK, sV, sRab, pipe_q, pipe_kv, alpha: Float32,
                            inv_scale: Float32, epilogue, m_block: Int32, head: Int32, batch: Int32, q_start: Int32,
                            k_start: Int32, seq, sched, q_state=None, kv_state=None):
        """dQ of one m-block; returns the advanced pipeline states (persistent CTAs pass theirs)."""
        persistent = q_state is not None
        tiled_mma_s, tiled_mma_dq, zero_copy = self.tiled_mma_s, self.tiled_mma_dq, self.zero_copy
        D = self.head_dim
        spec = self.mask
        n_lo, hole_lo, hole_size, n_count = sched
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma_s = tiled_mma_s.get_slice(tidx)
        thr_mma_dq = tiled_mma_dq.get_slice(tidx)
        wg_mma_s = tiled_mma_s.get_slice(wg * 128)
        wg_mma_dq = tiled_mma_dq.get_slice(wg * 128)
        tSrQ, tSrdO, tSrK, tSrV = score_operands(wg_mma_s, (sQ, sdO), (sK, sV))
        # K is (keys, D) with D contiguous: as B of (queries, D) += (queries, keys) x (keys, D) it is
        # (N = D, K = keys), MN-major.
        tDrKt = wg_mma_dq.make_fragment_B(wg_mma_dq.partition_B(transposed_view(sK, (D, self.tile_n, self.num_stages))))
        shape_S = wg_mma_s.partition_shape_C((self.tile_m, self.tile_n))
        acc_dQ = cute.make_rmem_tensor(wg_mma_dq.partition_shape_C((self.tile_m, D)), Float32)
        acc_dQ.fill(0.0)
        tScS, tScS_rc = acc_coords(thr_mma_s, (self.tile_m, self.tile_n))
        tSsRab = None
        if const_expr(self.has_rab):
            tSsRab = thr_mma_s.partition_C(sRab)
        row_first = seq.row_offset + m_block * self.tile_m

        if const_expr(not persistent):
            q_state, kv_state = self.pipeline_states(pipeline.PipelineUserType.Consumer)
        if n_count > 0:
            pipe_q.consumer_wait(q_state)
            for it in cutlass.range(n_count, unroll=1):
                n_block = masks.n_block_at(n_count - 1 - it, n_lo, hole_lo, hole_size, KERNEL_OPS)
                pipe_kv.consumer_wait(kv_state)
                k_rows = seq.seqlen_k - n_block * self.tile_n
                if k_rows < self.tile_n:
                    zero_smem_rows_past(zero_copy, (sK[None, None, kv_state.index],), (self.tile_n, D), tidx % 128,
                                        wg, k_rows)
                acc_S = cute.make_rmem_tensor(shape_S, Float32)
                acc_dP = cute.make_rmem_tensor(shape_S, Float32)
                wgmma(tiled_mma_s, acc_S, tSrQ, tSrK[None, None, None, kv_state.index], True, -1)
                wgmma(tiled_mma_s, acc_dP, tSrdO, tSrV[None, None, None, kv_state.index], True, 1)
                if const_expr(self.has_rab):
                    rRab = cute.make_rmem_tensor(shape_S, self.dtype)
                    cute.autovec_copy(tSsRab[None, None, None, kv_state.index], rRab)
                    acc_S.store(acc_S.load() + rRab.load().to(Float32))
                warpgroup.wait_group(0)
                silu_and_grad(acc_S, acc_dP, alpha, inv_scale, self.fast_silu, self.unscaled_grad)
                if not masks.tile_is_full(spec, seq, m_block, n_block, self.tile_m, self.tile_n, KERNEL_OPS):
                    acc_rc = cute.make_tensor(acc_dP.iterator, wgmma_acc_rows_cols(acc_dP.layout))
                    apply_mask_rows_cols(acc_rc, tScS_rc, spec, seq, row_first, n_block * self.tile_n)
                rG = wg_mma_dq.make_fragment_A(wg_mma_dq.partition_shape_A((self.tile_m, self.tile_n)))
                rG.store(cute.make_tensor(acc_dP.iterator, wgmma_acc_as_operand_a(acc_dP.layout)).load().to(self.dtype))
                wgmma(tiled_mma_dq, acc_dQ, rG, tDrKt[None, None, None, kv_state.index], False, 0)
                pipe_kv.consumer_release(kv_state)
                kv_state = advanced(kv_state)
            if const_expr(persistent):
                # The last dQ GEMM waited for every WGMMA: sQ / sdO are free for the next m-block.
                pipe_q.consumer_release(q_state)
                q_state = advanced(q_state)

        if const_expr(self.unscaled_grad):
            acc_dQ.store(acc_dQ.load() * (alpha * inv_scale * Float32(0.5)))
        if const_expr(epilogue is None):
            store_dq(thr_mma_dq, acc_dQ, mdQ, self.dtype, self.tile_m, D, q_start, head, m_block, seq)
        else:
            row0 = m_block * self.tile_m + wg * 64
            if seq.seqlen_q - row0 >= 64:
                store_rows_staged((acc_dQ,), *epilogue, self.dtype, tidx % 128, wg, q_start + row0, head)
            else:
                store_dq(thr_mma_dq, acc_dQ, mdQ, self.dtype, self.tile_m, D, q_start, head, m_block, seq)
        return q_state, kv_state
