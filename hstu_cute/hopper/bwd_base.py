"""What the sm90 backward kernels share beyond :mod:`hstu_cute.hopper.base`: TMA load atoms of Q,
dO, K, V and rab, the dK/dV and dQ register stores, and the key-block producer of the dK/dV kernels."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .. import masks
from ..common.mask_apply import (KERNEL_OPS, apply_mask_key_major, apply_mask_key_major_by_query,
                                 mask_dropped_blocks)
from ..common.seqinfo import walked_block
from ..common.sm90 import (
    advanced,
    copy_acc_rows,
    red_add_f32,
    sm90_tma_atom_tokens,
    sm90_tma_atom_rab,
    wgmma_acc_rows_cols,
    zero_smem_rows_past,
)
from ..fp8_format import vt_column_start
from .base import HstuSm90Base


@cute.jit
def store_dk_dv(thr_mma, acc_dK, acc_dV, mdK, mdV, dtype: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                head_dim: cutlass.Constexpr, k_start: Int32, head: Int32, n_block: Int32, k_rows: Int32,
                dim_block=0):
    """dK and dV of one n-block from WGMMA accumulators (this thread's slice of ``thr_mma``) to
    (T_k, H, D) global memory, key rows at and past ``k_rows`` skipped; ``head_dim`` columns,
    block ``dim_block`` of them (the FP8 D256 kernel's part of D)."""
    tKcK = thr_mma.partition_C(cute.make_identity_tensor((tile_n, head_dim)))
    tKcK_rc = cute.make_tensor(tKcK.iterator, wgmma_acc_rows_cols(tKcK.layout))
    for acc, mOut in ((acc_dK, mdK), (acc_dV, mdV)):
        rOut = cute.make_rmem_tensor(acc.layout, dtype)
        rOut.store(acc.load().to(dtype))
        gOut = cute.local_tile(cute.domain_offset((k_start, 0), mOut[None, head, None]), (tile_n, head_dim),
                               (n_block, dim_block))
        copy_acc_rows(rOut, thr_mma.partition_C(gOut), tKcK_rc, k_rows)


@cute.jit
def store_dq(thr_mma, acc_dQ, mdQ, dtype: cutlass.Constexpr, tile_m: cutlass.Constexpr, head_dim: cutlass.Constexpr,
             q_start: Int32, head: Int32, m_block: Int32, seq):
    """dQ of one m-block from WGMMA accumulators (this thread's slice of ``thr_mma``) to (T_q, H,
    D) global memory in ``dtype``, query rows past the sequence (``seq.seqlen_q``) skipped."""
    rOut = cute.make_rmem_tensor(acc_dQ.layout, dtype)
    rOut.store(acc_dQ.load().to(dtype))
    gOut = cute.local_tile(cute.domain_offset((q_start, 0), mdQ[None, head, None]), (tile_m, head_dim), (m_block, 0))
    tQc = thr_mma.partition_C(cute.make_identity_tensor((tile_m, head_dim)))
    tQc_rc = cute.make_tensor(tQc.iterator, wgmma_acc_rows_cols(tQc.layout))
    copy_acc_rows(rOut, thr_mma.partition_C(gOut), tQc_rc, seq.seqlen_q - m_block * tile_m)


class HstuBackwardSm90Base(HstuSm90Base):
    """The sm90 backward kernels: two TMA pipelines, a 1-stage one for the tiles the CTA owns
    (K+V in the dK/dV kernels, Q+dO in the dQ kernel) and a ``num_stages`` ring for the tiles it
    walks; P and G unscaled in the block loop on the tanh SiLU path."""

    # A block mask: the dK/dV kernels walk a key block's list of query blocks (set by the kernels
    # that take one; common.seqinfo.walked_block).
    block_sparse = False
    # GQA / MQA: the 16-bit kernels read k and v with H_q / group heads, query head h reading key
    # head h // group (``kv_group``, set in their kernel bodies from mQ and mK); the FP8 kernels
    # take k and v expanded to H_q heads.
    native_kv_heads = False

    def __init__(self, *config, **kw):
        super().__init__(*config, **kw)
        # bf16 (tanh SiLU): P and G unscaled in the block loop, the scales applied per tile
        # (common.silu.silu_and_grad).
        self.unscaled_grad = self.fast_silu

    def token_load_atoms(self, mQ, mK, mV, mdO, mRab, sQ_tile, sK_tile, sRab_layout):
        """TMA load atoms: K and V tiles of ``tile_n`` keys into ``sK_tile``, Q and dO tiles of
        ``tile_m`` queries into ``sQ_tile`` (one stage each), rab tiles with ``sRab_layout``.
        Returns (atom, tensor) pairs k, v, q, do, rab flattened."""
        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_k, tma_k = sm90_tma_atom_tokens(tma_load, mK, sK_tile, self.tile_n)
        tma_atom_v, tma_v = sm90_tma_atom_tokens(tma_load, mV, sK_tile, self.tile_n)
        tma_atom_q, tma_q = sm90_tma_atom_tokens(tma_load, mQ, sQ_tile, self.tile_m)
        tma_atom_do, tma_do = sm90_tma_atom_tokens(tma_load, mdO, sQ_tile, self.tile_m)
        tma_atom_rab, tma_rab = None, None
        if sRab_layout is not None:
            tma_atom_rab, tma_rab = sm90_tma_atom_rab(mRab, sRab_layout, self.tile_m, self.tile_n)
        return tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_rab, tma_rab

    @cute.jit
    def wait_query_stage(self, pipe_q, q_state, seq, m_block: Int32, rings, zero_copy, tid_in_wg: Int32, wg: Int32,
                         zero_more=None) -> Int32:
        """Wait for ``m_block``'s stage (``q_state``) of the (``tile_m``, D) smem ``rings`` (Q and
        dO) and zero its rows past the sequence (TMA read the next sequence there: its P and G are
        0, but 0 * NaN is NaN), and what ``zero_more(stage, q_rows)`` zeroes with them. Returns the
        m-block's rows inside the sequence."""
        pipe_q.consumer_wait(q_state)
        q_rows = seq.seqlen_q - m_block * self.tile_m
        if q_rows < self.tile_m:
            zero_smem_rows_past(zero_copy, tuple(ring[None, None, q_state.index] for ring in rings),
                                (self.tile_m, self.head_dim), tid_in_wg, wg, q_rows)
            if const_expr(zero_more is not None):
                zero_more(q_state.index, q_rows)
        return q_rows

    @cute.jit
    def mask_key_major(self, acc_S, acc_dP, tScS, seq, m_block: Int32, n_block: Int32, col0: Int32, q_rows: Int32,
                       tile_full=None, mixed=None):
        """Mask a key-major pair (S^T, dP^T) of the tile (``m_block``, ``n_block``), whose keys
        start at ``col0``, unless the mask allows all of it and its ``tile_m`` queries lie inside
        the sequence. ``tile_full``: :func:`masks.tile_is_full` of the tile, computed by the caller
        ahead of the tile's MMAs (func masks: its table loads then wait behind them); ``mixed`` the
        same for the block-sparse tile's mixed flag."""
        row_first = seq.row_offset + m_block * self.tile_m
        if const_expr(tile_full is None):
            tile_full = masks.tile_is_full(self.mask, seq, m_block, n_block, self.tile_m, self.tile_n, KERNEL_OPS)
        is_full = tile_full & (q_rows >= self.tile_m)
        if not is_full:
            if const_expr(self.mask.kind == masks.MaskKind.FUNC):
                apply_mask_key_major_by_query(
                    cute.make_tensor(acc_S.iterator, wgmma_acc_rows_cols(acc_S.layout)),
                    cute.make_tensor(acc_dP.iterator, wgmma_acc_rows_cols(acc_dP.layout)),
                    cute.make_tensor(tScS.iterator, wgmma_acc_rows_cols(tScS.layout)), self.mask, seq, row_first,
                    col0, q_rows)
            else:
                apply_mask_key_major(acc_S, acc_dP, tScS, self.mask, seq, row_first, col0, q_rows)
        mask_dropped_blocks(tuple(cute.make_tensor(a.iterator, wgmma_acc_rows_cols(a.layout)) for a in (acc_S, acc_dP)),
                            cute.make_tensor(tScS.iterator, wgmma_acc_rows_cols(tScS.layout)), seq, m_block, n_block,
                            row_first, col0, key_major=True, mixed=mixed, query_rows=self.tile_m)

    def pipeline_states(self, user_type):
        """Fresh states of the two pipelines: the 1-stage one of the tiles the CTA owns, then
        the ``num_stages`` ring of those it walks."""
        return (pipeline.make_pipeline_state(user_type, 1), pipeline.make_pipeline_state(user_type, self.num_stages))

    def drab_slab(self, mdRab, batch: Int32, head: Int32):
        """drab's (L_q, L_k) slab of sequence ``batch`` and ``head``: its rab head's (rab with one
        head), or with ``rab_sum_heads`` the fp32 sum over heads every head adds into."""
        if const_expr(self.rab_sum_heads):
            return mdRab[batch, None, None]
        return mdRab[batch, cutlass.select_(mdRab.shape[1] > 1, head, Int32(0)), None, None]

    @cute.jit
    def write_drab(self, acc_G, tSgdRab, tScS, rows: Int32, cols: Int32, g_scale: Float32,
                   key_major: cutlass.Constexpr[bool]):
        """drab = G (``g_scale`` times ``acc_G`` when G is unscaled) on this thread's elements
        inside rab's bounds (``rows`` queries, ``cols`` keys; ``tScS`` gives (key, query) with
        ``key_major``, else (query, key)): stored in rab's dtype, or added to the fp32 sum over
        heads (``rab_sum_heads``)."""
        for i in cutlass.range(cute.size(acc_G), unroll_full=True):
            if const_expr(key_major):
                key, query = tScS[i]
            else:
                query, key = tScS[i]
            if (query < rows) & (key < cols):
                g = acc_G[i] * g_scale if const_expr(self.unscaled_grad) else acc_G[i]
                if const_expr(self.rab_sum_heads):
                    red_add_f32(tSgdRab.iterator + cute.crd2idx(i, tSgdRab.layout), g)
                else:
                    tSgdRab[i] = g.to(self.rab_dtype)


@cute.jit
def transposed_tiles(tma_atom, tma_xt, sXt, head: Int32, column0: Int32, rows: cutlass.Constexpr,
                     tile: cutlass.Constexpr, row_block=0):
    """(smem, global) TMA partitions of the (``rows``, ``tile``) tiles of an FP8 token-contiguous
    copy (H, D, W) (:func:`hstu_cute.launch.transposed_for_pv`) of one head, the sequence's
    columns starting at ``column0`` (16-byte aligned: :func:`hstu_cute.fp8_format.vt_column_start`);
    ``row_block``: which ``rows`` dims (a part of D)."""
    gXt = cute.local_tile(cute.domain_offset((0, column0), tma_xt[None, None, head]), (rows, tile),
                          (row_block, None))
    return cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(sXt, 0, 2),
                                 cute.group_modes(gXt, 0, 2))


def token_tiles(tma_atom, tma_x, sX, start: Int32, head: Int32, tile, block):
    """(smem, global) TMA partitions of the ``tile``-shaped tiles of a (T, D, H) token tensor's
    ``head``, its rows from the sequence's ``start``; ``block``: the tile coordinate (None in a
    mode: all of them)."""
    gX = cute.local_tile(cute.domain_offset((start, 0), tma_x[None, None, head]), tile, block)
    return cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                 cute.group_modes(gX, 0, 2))


def rab_tiles(tma_atom_rab, tma_rab, sRab, mRab, seq, head: Int32, batch: Int32, tile, block):
    """(smem, global) TMA partitions of rab's tiles of sequence ``batch`` and ``head`` (rab's
    only head when it has one), rows in whole-sequence coordinates (delta_q)."""
    rab_head = cutlass.select_(mRab.shape[1] > 1, head, Int32(0))
    gRab = cute.local_tile(cute.domain_offset((seq.row_offset, 0), tma_rab[None, None, rab_head, batch]), tile, block)
    return cpasync.tma_partition(tma_atom_rab, 0, cute.make_layout(1), cute.group_modes(sRab, 0, 2),
                                 cute.group_modes(gRab, 0, 2))


def load_ring_stage(pipe, state, block: Int32, copies):
    """TMA loads of tile ``block`` of each (atom, global partitions, smem ring partitions) of
    ``copies`` into the stage of ``state``, on its barrier. Returns the advanced state."""
    pipe.producer_acquire(state)
    bar = pipe.producer_get_barrier(state)
    for atom, tXgX, tXsX in copies:
        cute.copy(atom, tXgX[None, block], tXsX[None, state.index], tma_bar_ptr=bar)
    return advanced(state)


class KeyBlockProducer:
    """The producer of the dK/dV kernels: K and V of one n-block (1-stage pipeline ``pipe_kv``),
    then Q, dO (and rab) of every m-block that sees it into the ring ``pipe_q``; the FP8 kernel
    sets ``transposed_q_loads`` (Q^T and dO^T atoms, tensors and smem rings) and they go with them;
    its fused form sets ``transposed_k_load`` (the K^T atom, tensor and smem tile), loaded with K
    and V."""

    transposed_q_loads = None
    transposed_k_load = None
    transposed_q_tiles = False
    # The FP8 kernel at D256: each CTA takes dK and dV of one part of D.
    dim_parts = 1

    def key_block_bytes(self):
        """Transaction bytes of the two pipelines: ``kv_bytes`` (K+V), ``q_bytes`` (Q+dO+rab)."""
        D = self.head_dim
        elem = self.dtype.width // 8
        # FP8: Q^T and dO^T (the CTA's part of D) with Q and dO
        q_dims = 2 * D + (2 * D // self.dim_parts if const_expr(self.transposed_q_tiles) else 0)
        self.kv_bytes = 2 * self.tile_n * D * elem
        self.q_bytes = q_dims * self.tile_m * elem + (
            self.tile_m * self.tile_n * (self.rab_dtype.width // 8) if const_expr(self.has_rab) else 0)

    @cute.jit
    def produce_key_block(self, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_q, tma_q, tma_atom_do, tma_do,
                          tma_atom_rab, tma_rab, sK, sV, sQ, sdO, sRab, pipe_kv, pipe_q, mRab, n_block: Int32,
                          head: Int32, batch: Int32, q_start: Int32, k_start: Int32, seq, m_lo: Int32, m_hi: Int32,
                          kv_state=None, q_state=None, dim_part=0):
        """TMA loads of one n-block. Returns the advanced pipeline states. Without states (a CTA
        with one n-block) K and V go first; a persistent CTA passes its states and loads K and V
        after the first Q/dO: the previous n-block's consumers read sK/sV until their last
        m-block, and a Q/dO stage frees up earlier. ``dim_part``: which ``D / dim_parts`` dims of
        the transposed copies the CTA's dK and dV take."""
        D = self.head_dim
        kv_after_q = kv_state is not None
        if const_expr(not kv_after_q):
            kv_state, q_state = self.pipeline_states(pipeline.PipelineUserType.Producer)
        kv_head = head // self.kv_group if const_expr(self.native_kv_heads) else head
        tKsK, tKgK = token_tiles(tma_atom_k, tma_k, sK, k_start, kv_head, (self.tile_n, D), (n_block, 0))
        tVsV, tVgV = token_tiles(tma_atom_v, tma_v, sV, k_start, kv_head, (self.tile_n, D), (n_block, 0))
        tQsQ, tQgQ = token_tiles(tma_atom_q, tma_q, sQ, q_start, head, (self.tile_m, D), (None, 0))
        tOsO, tOgO = token_tiles(tma_atom_do, tma_do, sdO, q_start, head, (self.tile_m, D), (None, 0))
        # What each m-block loads into the ring.
        copies = [(tma_atom_q, tQgQ, tQsQ), (tma_atom_do, tOgO, tOsO)]
        if const_expr(self.has_rab):
            tRsR, tRgR = rab_tiles(tma_atom_rab, tma_rab, sRab, mRab, seq, head, batch, (self.tile_m, self.tile_n),
                                   (None, n_block))
            copies.append((tma_atom_rab, tRgR, tRsR))
        transposed = self.transposed_q_loads
        if const_expr(transposed is not None):
            atom_qt, tma_qt, atom_dot, tma_dot, sQt, sdOt = transposed
            column0 = vt_column_start(q_start, batch)
            dims = D // self.dim_parts
            tQtsQt, tQtgQt = transposed_tiles(atom_qt, tma_qt, sQt, head, column0, dims, self.tile_m, dim_part)
            tOtsOt, tOtgOt = transposed_tiles(atom_dot, tma_dot, sdOt, head, column0, dims, self.tile_m, dim_part)
            copies += [(atom_qt, tQtgQt, tQtsQt), (atom_dot, tOtgOt, tOtsOt)]
        kt = None
        if const_expr(self.transposed_k_load is not None):
            atom_kt, tma_kt, sKt = self.transposed_k_load
            tKtsKt, tKtgKt = transposed_tiles(atom_kt, tma_kt, sKt, head, vt_column_start(k_start, batch), D,
                                              self.tile_n)
            kt = (atom_kt, tKtgKt[None, n_block], tKtsKt)
        kv_pending = Int32(1)
        if const_expr(not kv_after_q):
            self.load_kv(tma_atom_k, tKgK, tKsK, tma_atom_v, tVgV, tVsV, pipe_kv, kv_state, kt)
        for step in cutlass.range(m_lo, m_hi, unroll=1):
            m_block = walked_block(self.block_sparse, seq, n_block, step)
            if masks.tile_nonempty(self.mask, seq, m_block, n_block, self.tile_m, self.tile_n, KERNEL_OPS):
                q_state = load_ring_stage(pipe_q, q_state, m_block, copies)
                if const_expr(kv_after_q):
                    if kv_pending != 0:
                        self.load_kv(tma_atom_k, tKgK, tKsK, tma_atom_v, tVgV, tVsV, pipe_kv, kv_state, kt)
                        kv_pending = Int32(0)
        if const_expr(kv_after_q):
            if kv_pending != 0:  # no m-block sees this n-block: its consumers still wait for K/V
                self.load_kv(tma_atom_k, tKgK, tKsK, tma_atom_v, tVgV, tVsV, pipe_kv, kv_state, kt)
        return advanced(kv_state), q_state

    @cute.jit
    def load_kv(self, tma_atom_k, tKgK, tKsK, tma_atom_v, tVgV, tVsV, pipe_kv, kv_state, kt=None):
        # ``kt``: (atom, global tile, smem tile) of K^T, or None.
        pipe_kv.producer_acquire(kv_state)
        cute.copy(tma_atom_k, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        cute.copy(tma_atom_v, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        if const_expr(kt is not None):
            cute.copy(kt[0], kt[1], kt[2], tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
