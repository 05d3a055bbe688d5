"""HSTU attention backward for sm90a at head dim 256: the dK, dV (and drab) kernel. dQ comes from
:class:`~hstu_cute.hopper.bwd.HstuBackwardDqSm90` (128 x 32 tiles there)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from .. import masks
from ..common.barriers import NamedBarrier
from ..common.mask_apply import KERNEL_OPS
from ..common.seqinfo import ScoreScalars, SequenceArgs
from ..common.silu import silu_and_grad
from ..common.sm90 import (
    advanced,
    prefetch_tma_descriptors,
    rows_zero_copy,
    score_operands,
    shared_storage,
    sm90_bwd_pipelines,
    sm90_smem_layout,
    smem_tensors,
    transposed_view,
    trivial_mma,
    wgmma,
)
from .base import SMEM_LIMIT
from .bwd_base import HstuBackwardSm90Base, KeyBlockProducer, store_dk_dv


def wide_smem_bytes(elem_bytes: int, head_dim: int, tile_m: int, tile_n: int, num_stages: int, has_rab: bool,
                    pds_buffers: int) -> int:
    kv = 2 * tile_n * head_dim * elem_bytes
    q_do = num_stages * 2 * tile_m * head_dim * elem_bytes
    rab = num_stages * tile_m * tile_n * elem_bytes if has_rab else 0
    p_ds = pds_buffers * 2 * tile_n * tile_m * elem_bytes
    return kv + q_do + rab + p_ds + 1024  # barriers and 1024-byte alignment


class HstuBackwardWideSm90(KeyBlockProducer, HstuBackwardSm90Base):
    """dK, dV (and drab) at head dims where one warpgroup cannot hold dK and dV of 64 keys
    (D = 256: 2 x 128 fp32 registers per thread). One CTA per (n-block of ``tile_n`` = 64 keys,
    head, batch), the n-blocks of one sequence and head adjacent in launch order (they read the
    same Q and dO through L2); it walks the m-blocks (``tile_m`` = 64 queries) that attend to its
    keys, in the transposed orientation (accumulator rows are keys):

    * S^T = K Q^T (+ rab^T), dP^T = V dO^T: warpgroup w computes queries [32 w, 32 w + 32);
      P^T and G^T (spec section 2) go to smem (sP, sdS: keys x queries, queries contiguous).
    * dV[:, half w] += P^T dO[:, half w] and dK[:, half w] += G^T Q[:, half w]: each warpgroup
      owns half of D for all 64 keys (SS WGMMA, A = sP / sdS K-major, B = dO / Q MN-major).
    * drab = G: stored per head (H_rab = H; each element has exactly one writer) or added with
      red.global.add.f32 into an fp32 (B, L_q, L_k) slab (H_rab = 1 < H).

    Warp roles (384 threads): warpgroup 0, warp 0 is the producer (TMA: K and V once, then Q, dO
    and rab per m-block; 24 registers); warpgroups 1-2 are consumers (240 registers).
    Pipelines (mbarrier + TMA transaction counts): K+V (1 stage), Q+dO(+rab) (``num_stages``).
    Barriers: named 4/5 after a warpgroup zeroes the rows of a tile past the sequence (TMA reads
    the next sequence there; P and G are 0 against them, but 0 * NaN would be NaN); 6 after both
    warpgroups wrote sP/sdS; 7 (with one sP/sdS buffer, when rab's ring takes the smem of the
    second) before either overwrites them.

    Why no dQ here (docs/dev/perf-log.md 2026-11-21, H100, B8 N4096 causal): adding dQ = G K into
    fp32 with red.global from this kernel ran at 165-242 TF; its 64 KB of atomics per m-block
    (64 keys per CTA: twice D128's per FLOP) saturate L2. The same kernel without them runs at
    512, and beside the dQ kernel (which recomputes S and dP) the pair reaches 356.
    """

    native_kv_heads = True

    def __init__(self, dtype, head_dim: int, mask: masks.MaskSpec, has_rab: bool, has_drab: bool,
                 rab_sum_heads: bool, tile_m: int, tile_n: int, num_stages: int, fast_silu: bool):
        assert tile_n == 64 and tile_m % 64 == 0 and head_dim % 128 == 0, (tile_m, tile_n, head_dim)
        assert has_rab or not has_drab
        super().__init__(dtype, head_dim, mask, has_rab, tile_m, tile_n, num_stages, fast_silu, 2)
        self.has_drab = has_drab
        self.rab_sum_heads = rab_sum_heads
        elem = dtype.width // 8
        self.pds_buffers = 2
        if wide_smem_bytes(elem, head_dim, tile_m, tile_n, num_stages, has_rab, 2) > SMEM_LIMIT:
            self.pds_buffers = 1
        assert wide_smem_bytes(elem, head_dim, tile_m, tile_n, num_stages, has_rab, self.pds_buffers) <= SMEM_LIMIT

    @cute.jit
    def __call__(self, mQ, mK, mV, mdO, mdK, mdV, mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts,
                 mNumTargets, mFunc, mFuncBlocks, mRab, mdRab, alpha, inv_scale, window_left, window_right, group_size, is_delta_q,
                 num_n_blocks, stream):
        D = self.head_dim
        self.sK_layout = sm90_smem_layout(self.dtype, self.tile_n, D, None)
        self.sQ_layout = sm90_smem_layout(self.dtype, self.tile_m, D, self.num_stages)
        self.sP_layout = sm90_smem_layout(self.dtype, self.tile_n, self.tile_m, self.pds_buffers)
        self.sRab_layout = self.rab_ring_layout()
        # S^T / dP^T (keys, queries): the two warpgroups split the queries (N).
        self.tiled_mma_s = trivial_mma(self.dtype, self.tile_m // 2, False, 1, atom_layout=(1, 2, 1))
        # dV / dK (keys, D) += P^T / G^T (smem, K-major) x dO / Q (smem, MN-major): split along D.
        self.tiled_mma_dkv = trivial_mma(self.dtype, D // 2, True, 1, atom_layout=(1, 2, 1))
        self.key_block_bytes()
        loads = self.token_load_atoms(mQ, mK, mV, mdO, mRab, cute.slice_(self.sQ_layout, (None, None, 0)),
                                      self.sK_layout, self.sRab_layout)
        self.zero_copy = rows_zero_copy(self.dtype, D)
        tile = (self.dtype, cute.cosize(self.sK_layout))
        ring = (self.dtype, cute.cosize(self.sQ_layout))
        p_ds = (self.dtype, cute.cosize(self.sP_layout))
        self.shared_storage = shared_storage(
            dict(mbar_kv=2, mbar_q=2 * self.num_stages),
            dict(sK=tile, sV=tile, sQ=ring, sdO=ring, sP=p_ds, sdS=p_ds,
                 sRab=(self.dtype, self.smem_elems(self.sRab_layout))))
        self.launch(*loads, mQ, mK, mdK, mdV,
                    SequenceArgs(mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets, mFunc, mFuncBlocks), mRab,
                    mdRab, ScoreScalars(alpha, inv_scale, window_left, window_right, group_size, is_delta_q),
                    statics=dict(sK_layout=self.sK_layout, sQ_layout=self.sQ_layout, sP_layout=self.sP_layout,
                                 sRab_layout=self.sRab_layout, tiled_mma_s=self.tiled_mma_s,
                                 tiled_mma_dkv=self.tiled_mma_dkv, zero_copy=self.zero_copy),
                    grid=[num_n_blocks, mQ.shape[1], mOffsetsQ.shape[0] - 1], stream=stream)

    @cute.kernel
    def kernel(self, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_rab,
               tma_rab, mQ, mK, mdK, mdV, seqs, mRab, mdRab, scalars, statics):
        self.bind(statics)
        self.kv_group = mQ.shape[1] // mK.shape[1]
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_block, head, batch = cute.arch.block_idx()
        seqinfo = self.sequence_info(seqs, scalars, mQ, mK)
        q_start, k_start, seqlen_q, seqlen_k = seqinfo.bounds(batch)
        mask_of = seqinfo.mask  # a method call on a name inside a runtime `if` makes it branch-carried
        # Uniform over the CTA, before any barrier is initialized.
        if n_block * self.tile_n < seqlen_k:
            if warp_idx == 0:
                prefetch_tma_descriptors(tma_atom_k, tma_atom_v, tma_atom_q, tma_atom_do, tma_atom_rab)
            spec = self.mask
            seq = mask_of(batch, seqlen_q, seqlen_k)
            m_lo, m_hi = masks.m_block_range(spec, seq, n_block, self.tile_m, self.tile_n, KERNEL_OPS)

            storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
            pipe_kv, pipe_q = sm90_bwd_pipelines(storage.mbar_kv, storage.mbar_q, self.kv_bytes, self.q_bytes,
                                                 self.num_stages, self.num_mma_threads)
            s = smem_tensors(storage, dict(sK=self.sK_layout, sV=self.sK_layout, sQ=self.sQ_layout,
                                           sdO=self.sQ_layout, sP=self.sP_layout, sdS=self.sP_layout,
                                           sRab=self.sRab_layout))

            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    self.produce_key_block(tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_q, tma_q, tma_atom_do,
                                           tma_do, tma_atom_rab, tma_rab, s["sK"], s["sV"], s["sQ"], s["sdO"],
                                           s["sRab"], pipe_kv, pipe_q, mRab, n_block, head, batch, q_start, k_start,
                                           seq, m_lo, m_hi)
            else:
                cute.arch.setmaxregister_increase(self.mma_regs)
                self.consume(tidx - 128, mdK, mdV, mdRab, s["sK"], s["sV"], s["sQ"], s["sdO"], s["sP"], s["sdS"],
                             s["sRab"], pipe_kv, pipe_q, scalars.alpha, scalars.inv_scale, q_start, k_start, head,
                             batch, n_block, seq, m_lo, m_hi)

    @cute.jit
    def consume(self, tidx: Int32, mdK, mdV, mdRab, sK, sV, sQ, sdO, sP, sdS, sRab, pipe_kv, pipe_q,
                alpha: Float32, inv_scale: Float32, q_start: Int32, k_start: Int32, head: Int32, batch: Int32,
                n_block: Int32, seq, m_lo: Int32, m_hi: Int32):
        D = self.head_dim
        tiled_mma_s, tiled_mma_dkv, zero_copy = self.tiled_mma_s, self.tiled_mma_dkv, self.zero_copy
        spec = self.mask
        wg = cute.arch.make_warp_uniform(tidx // 128)
        tid_in_wg = tidx % 128
        thr_mma_s = tiled_mma_s.get_slice(tidx)
        thr_mma_dkv = tiled_mma_dkv.get_slice(tidx)
        wg_mma_s = tiled_mma_s.get_slice(wg * 128)
        wg_mma_dkv = tiled_mma_dkv.get_slice(wg * 128)
        tSrK, tSrV, tSrQ, tSrdO = score_operands(wg_mma_s, (sK, sV), (sQ, sdO))
        # Q and dO are (queries, D) with D contiguous: as B of (keys, D) += (keys, queries) x (queries, D)
        # they are (N = D, K = queries), MN-major.
        qt = (D, self.tile_m, self.num_stages)
        tDrP = wg_mma_dkv.make_fragment_A(wg_mma_dkv.partition_A(sP))
        tDrdS = wg_mma_dkv.make_fragment_A(wg_mma_dkv.partition_A(sdS))
        tDrQt = wg_mma_dkv.make_fragment_B(wg_mma_dkv.partition_B(transposed_view(sQ, qt)))
        tDrdOt = wg_mma_dkv.make_fragment_B(wg_mma_dkv.partition_B(transposed_view(sdO, qt)))
        shape_S = wg_mma_s.partition_shape_C((self.tile_n, self.tile_m))
        acc_dK = cute.make_rmem_tensor(wg_mma_dkv.partition_shape_C((self.tile_n, D)), Float32)
        acc_dV = cute.make_rmem_tensor(wg_mma_dkv.partition_shape_C((self.tile_n, D)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        tScS = thr_mma_s.partition_C(cute.make_identity_tensor((self.tile_n, self.tile_m)))
        tSsP = thr_mma_s.partition_C(sP)
        tSsdS = thr_mma_s.partition_C(sdS)
        tSsRabT = None
        if const_expr(self.has_rab):
            # rab tiles are (queries, keys) in smem; the accumulator reads them transposed.
            sRabT = transposed_view(sRab, (self.tile_n, self.tile_m, self.num_stages))
            tSsRabT = thr_mma_s.partition_C(sRabT)
        tSgdRab = None
        drab_rows = drab_cols = Int32(0)
        if const_expr(self.has_drab):
            # drab tiles are (queries, keys) in global memory; seen transposed like rab.
            mdRab_seq = self.drab_slab(mdRab, batch, head)
            gdRab = cute.local_tile(cute.domain_offset((seq.row_offset, 0), mdRab_seq), (self.tile_m, self.tile_n),
                                    (None, n_block))
            tSgdRab = thr_mma_s.partition_C(cute.make_tensor(gdRab.iterator, cute.select(gdRab.layout,
                                                                                        mode=[1, 0, 2])))
            drab_cols = cutlass.min(seq.seqlen_k, mdRab_seq.shape[1]) - n_block * self.tile_n
            drab_rows = cutlass.min(seq.seqlen_q + seq.row_offset, mdRab_seq.shape[0]) - seq.row_offset
        col0 = n_block * self.tile_n
        k_rows = seq.seqlen_k - col0
        g_scale = alpha * inv_scale * Float32(0.5)  # G from _silu_and_grad when unscaled_grad

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        blocks_done = Int32(0)
        for m_block in cutlass.range(m_lo, m_hi, unroll=1):
            if masks.tile_nonempty(spec, seq, m_block, n_block, self.tile_m, self.tile_n, KERNEL_OPS):
                q_rows = self.wait_query_stage(pipe_q, q_state, seq, m_block, (sQ, sdO), zero_copy, tid_in_wg, wg)
                stage = q_state.index
                acc_S = cute.make_rmem_tensor(shape_S, Float32)
                acc_dP = cute.make_rmem_tensor(shape_S, Float32)
                wgmma(tiled_mma_s, acc_S, tSrK, tSrQ[None, None, None, stage], True, -1)
                wgmma(tiled_mma_s, acc_dP, tSrV, tSrdO[None, None, None, stage], True, 1)
                if const_expr(self.has_rab):
                    rRab = cute.make_rmem_tensor(shape_S, self.dtype)
                    cute.autovec_copy(tSsRabT[None, None, None, stage], rRab)
                    acc_S.store(acc_S.load() + rRab.load().to(Float32))
                warpgroup.wait_group(0)
                silu_and_grad(acc_S, acc_dP, alpha, inv_scale, self.fast_silu, self.unscaled_grad)
                self.mask_key_major(acc_S, acc_dP, tScS, seq, m_block, n_block, col0, q_rows)
                if const_expr(self.has_drab):
                    self.write_drab(acc_dP, tSgdRab[None, None, None, m_block], tScS,
                                    drab_rows - m_block * self.tile_m, drab_cols, g_scale, True)
                rP = cute.make_rmem_tensor(acc_S.layout, self.dtype)
                rP.store(acc_S.load().to(self.dtype))
                rG = cute.make_rmem_tensor(acc_dP.layout, self.dtype)
                rG.store(acc_dP.load().to(self.dtype))
                buf = 0
                if const_expr(self.pds_buffers == 1):
                    cute.arch.barrier(barrier_id=NamedBarrier.PDS_FREE, number_of_threads=self.num_mma_threads)
                else:
                    buf = blocks_done % 2
                cute.autovec_copy(rP, tSsP[None, None, None, buf])
                cute.autovec_copy(rG, tSsdS[None, None, None, buf])
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=NamedBarrier.PDS_WRITTEN, number_of_threads=self.num_mma_threads)
                wgmma(tiled_mma_dkv, acc_dV, tDrP[None, None, None, buf], tDrdOt[None, None, None, stage], False, -1)
                wgmma(tiled_mma_dkv, acc_dK, tDrdS[None, None, None, buf], tDrQt[None, None, None, stage], False, 0)
                pipe_q.consumer_release(q_state)
                q_state = advanced(q_state)
                blocks_done += 1

        if const_expr(self.unscaled_grad):
            acc_dV.store(acc_dV.load() * inv_scale)
            acc_dK.store(acc_dK.load() * g_scale)
        store_dk_dv(thr_mma_dkv, acc_dK, acc_dV, mdK, mdV, self.dtype, self.tile_n, D, k_start, head, n_block,
                    k_rows)
