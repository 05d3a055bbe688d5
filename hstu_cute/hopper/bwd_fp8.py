"""FP8 (e4m3) backward for sm90a: the deterministic pair of the 16-bit backward
(:mod:`hstu_cute.hopper.bwd`) with 8-bit WGMMAs (docs/design/fp8-backward.md, option A).

Every operand of an 8-bit WGMMA in shared memory is K-major. The score products (S^T = K Q^T,
dP^T = V dO^T in the dK/dV kernel, S = Q K^T, dP = dO V^T in the dQ kernel) read the (T, H, D)
e4m3 tensors as they are; the token-reduction products take their B operand from a
token-contiguous copy (Q^T, dO^T, K^T: (H, D, W), :func:`hstu_cute.launch.transposed_for_pv`)
whose tokens sit in ``fp8_format.KEY_AT_COLUMN`` order within every 16-token group, so that
P^T, G^T and G go from the fp32 accumulator into the register A operand with no data movement
(:func:`hstu_cute.common.fp8.scaled_fp8_words`). Those three are re-quantized per accumulator
row with a running power-of-two scale (the rule of :func:`hstu_cute.reference.running_scale_e4m3`);
the descale of the GEMM's other operand is folded into the multiplier, the accumulated rows are
rescaled when a row's scale grows, and the epilogue multiplies by the final scale.

Descales: (B, blocks, H) fp32 tables of q, k, v and dO (quant modes 2-5; blocks of
``fp8_format.BLOCK_TOKENS`` tokens from each sequence start; mode 0 passes tables of ones). A
dK/dV tile (128 keys) is one key block; its m-blocks (64 queries) lie inside one query block,
and so do the dQ kernel's n-blocks (64 keys) inside one key block.

``two_direction`` (quant mode 1): q, k, v and dO carry (T, H) per-token descales, which scale the
score products' rows and columns before the SiLU; the token-contiguous copies carry their own
(B, blocks, H, 2, D) per-(block, dim) descales (:func:`hstu_cute.launch.quantize_for`), which
scale the columns of the accumulator their GEMM feeds. That accumulator is kept in units of the
current block's descales: when the walk enters another block its columns take old / new
(:func:`hstu_cute.common.fp8.dim_descales`), and the epilogue multiplies by the last block's.
P^T, G^T and G are re-quantized with no descale folded in (the scores already hold them).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from .. import masks
from ..common.barriers import NamedBarrier
from ..common.fp8 import (
    G_SCALE_SLOTS,
    column_descale,
    dim_descales,
    g_to_smem_keys_contiguous,
    pow2_reciprocal,
    rescale_rows_if_needed,
    row_token_descales,
    scale_columns,
    scale_rows,
    scaled_fp8_words,
    tile_token_descales,
    words_to_operand_a,
    zero_smem_cols_past,
)
from ..common.mask_apply import KERNEL_OPS, apply_mask_rows_cols
from ..common.seqinfo import ScoreScalars, SequenceArgs
from ..common.silu import scale_scores_by_tokens, silu_and_grad_token_scaled, silu_and_grad_unscaled
from ..common.sm90 import (
    acc_coords,
    advanced,
    rows_zero_copy,
    score_operands,
    shared_storage,
    sm90_bwd_pipelines,
    sm90_smem_layout,
    sm90_tma_atom_tokens,
    smem_tensors,
    transposed_view,
    trivial_mma,
    wgmma,
    wgmma_acc_rows_cols,
)
from ..common.tile_scheduler import SectionWalk
from ..fp8_format import BLOCK_TOKENS, P_AMAX_FLOOR
from .bwd import HstuBackwardDkDvSm90, HstuBackwardDqSm90
from .base import store_rows_staged
from .bwd_base import store_dk_dv, store_dq

# G has no natural floor (dO can be any size): a row of zeros keeps common.fp8.MIN_ROW_SCALE.
G_AMAX_FLOOR = 0.0


def transposed_atom(mXt, stage_layout, rows: int, cols: int):
    """TMA load atom over an FP8 token-contiguous copy (H, D, W) seen as (D, W, H): (``rows`` dims,
    ``cols`` tokens) tiles of one head."""
    view = cute.make_tensor(mXt.iterator, cute.select(mXt.layout, mode=[1, 2, 0]))
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), view, stage_layout, (rows, cols))


@cute.jit
def block_descale(mTable, batch: Int32, token: Int32, head: Int32) -> Float32:
    """The descale of the quantizer block holding ``token`` (counted from its sequence's start)
    in a (B, blocks, H) table (block index clamped into the table: modes 3-5 have one)."""
    return mTable[batch, cutlass.min(token // BLOCK_TOKENS, mTable.shape[1] - 1), head]


def column_rows_layout(dims: int, tables: int):
    """two_direction: per warpgroup two buffers (walk steps alternate) of 2 ``tables`` (``dims``,)
    fp32 rows (the CTA's part of D): per column table, a block's scales then the next block's
    reciprocals."""
    return cute.make_layout((dims, 2 * tables, 2, 2))


@cute.jit
def prefetch_column_rows(sRows, tables, batch: Int32, head: Int32, block_prev: Int32, block: Int32, tid_in_wg: Int32,
                         dim_part=0):
    """cp.async into ``sRows`` (D, 2 len(tables)), one 16-byte chunk per thread of the warpgroup,
    the rows that move accumulators from ``block_prev``'s column units to ``block``'s: issued
    before the step's GEMMs, so their latency hides behind them (loaded when needed, after the
    GEMMs, they took half the dK/dV kernel's stall samples: H100 ncu, quant mode 1)."""
    chunks = sRows.shape[0] // 4
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=128)
    row, chunk = tid_in_wg // chunks, tid_in_wg % chunks
    blocks = (block_prev, block)
    for t in cutlass.range_constexpr(len(tables)):
        for slot in cutlass.range_constexpr(2):
            if row == 2 * t + slot:
                src = cute.local_tile(tables[t][batch, blocks[slot], head, slot, None], (sRows.shape[0],),
                                      (dim_part,))
                cute.copy(atom, cute.local_tile(src, (4,), (chunk,)),
                          cute.local_tile(sRows[None, 2 * t + slot], (4,), (chunk,)))
    cute.arch.cp_async_commit_group()


@cute.jit
def move_column_units(accs, sRows, wg: Int32):
    """Each accumulator of ``accs`` (their column tables' order in :func:`prefetch_column_rows`)
    times its column ratios, once the warpgroup's rows have landed."""
    cute.arch.cp_async_wait_group(0)
    cute.arch.barrier(barrier_id=NamedBarrier.ZERO_ROWS_WG0 + wg, number_of_threads=128)
    for t in cutlass.range_constexpr(len(accs)):
        acc, tAcc_rc = accs[t]
        scale_columns(acc, dim_descales(sRows[None, 2 * t], tAcc_rc, sRows[None, 2 * t + 1]))


@cute.jit
def epilogue_columns(acc, mColumnTable, batch: Int32, head: Int32, block_last: Int32, tAcc_rc, dims: cutlass.Constexpr,
                     dim_part=0):
    """two_direction: the accumulator's columns (``dims`` of them, part ``dim_part`` of D) times
    the column descales of the last block it accumulated (a tile that visited none holds zeros)."""
    row = mColumnTable[batch, cutlass.max(block_last, 0), head, 0, None]
    scale_columns(acc, dim_descales(cute.local_tile(row, (dims,), (dim_part,)), tAcc_rc))


def column_block(mColumnTable, first_token: Int32) -> Int32:
    """The block of a (B, blocks, H, 2, D) column table holding ``first_token`` (from the
    sequence start), clamped into the table."""
    return cutlass.min(first_token // BLOCK_TOKENS, mColumnTable.shape[1] - 1)


def p_and_g(kernel, acc_S, acc_dP, sRab, shape_S, alpha: Float32, qk_descales=None, tokens=None):
    """P and G (the unscaled SiLU and its gradient, :mod:`hstu_cute.common.silu`) in place, once
    the S and dP GEMMs are issued (S retired: the dP GEMM waited for one group); waits for dP.
    Quant modes 0, 2-5: ``qk_descales`` (dq, dk: scalars) scale the scores before rab, or enter
    the SiLU's factor (their product formed at each use, as the kernels were measured).
    ``two_direction``: ``tokens`` = (score row descales, held score column descales, dP row
    descales, held dP column descales) (:func:`common.fp8.tile_token_descales`).
    ``sRab``: the stage's rab tile in the accumulator's partition, or None. Plain Python (traced
    inline): the dK/dV kernel (key-major) and the dQ kernel share it."""
    if const_expr(kernel.two_direction):
        s_rows, s_held, dp_rows, dp_held = tokens
        if const_expr(kernel.has_rab):
            rRab = cute.make_rmem_tensor(shape_S, kernel.rab_dtype)
            cute.autovec_copy(sRab, rRab)
            scale_scores_by_tokens(acc_S, s_rows, lambda j: column_descale(s_held, j), rRab)
            s_rows = None
        warpgroup.wait_group(0)
        silu_and_grad_token_scaled(acc_S, acc_dP, alpha * Float32(0.5), s_rows, lambda j: column_descale(s_held, j),
                                   dp_rows, lambda j: column_descale(dp_held, j))
    else:
        dq, dk = qk_descales
        half_alpha = alpha * (dq * dk) * Float32(0.5)
        if const_expr(kernel.has_rab):
            rRab = cute.make_rmem_tensor(shape_S, kernel.rab_dtype)
            cute.autovec_copy(sRab, rRab)
            acc_S.store(acc_S.load() * (dq * dk) + rRab.load().to(Float32))
            half_alpha = alpha * Float32(0.5)
        warpgroup.wait_group(0)
        silu_and_grad_unscaled(acc_S, acc_dP, half_alpha)


def stage_of(tSsRab, stage):
    # Plain Python: rab's stage tile, or None without rab.
    return None if tSsRab is None else tSsRab[None, None, None, stage]


@cute.jit
def epilogue_rows(acc, row_scale, factor: Float32):
    """Multiply the thread's two accumulator rows by their final running scale times ``factor``."""
    factors = cute.make_rmem_tensor(cute.make_layout(2), Float32)
    for i in cutlass.range_constexpr(2):
        factors[i] = row_scale[i] * factor
    scale_rows(acc, factors)


class HstuBackwardDkDvFp8Sm90(HstuBackwardDkDvSm90):
    """dK, dV kernel of the FP8 backward: the 16-bit dK/dV kernel's tiles, walk and warp roles, with
    e4m3 K, V (the CTA's, 1-stage pipeline) and Q, dO, Q^T, dO^T (+ 16-bit rab) per m-block in the
    ring. Per m-block: S^T = K Q^T and dP^T = V dO^T (SS, descaled by dq dk and ddO dv), P^T and G^T
    (tanh SiLU, unscaled as in bf16), then dV += P^T8 dO^T8 and dK += G^T8 Q^T8 (RS, the register
    operands re-quantized per key row: P^T with ddO folded in, G^T with ddO dv dq).

    Warp roles, pipelines and barriers as :class:`~hstu_cute.hopper.bwd.HstuBackwardDkDvSm90` (not
    fused). Named barriers 4/5: a warpgroup zeroes the Q/dO rows and Q^T/dO^T columns past
    seqlen_q (TMA reads the next sequence, or the copies' padding, there), and (staged epilogue)
    its tiles are free, then written and fenced. Epilogue: dK and dV times each row's final scale,
    in ``grad_dtype``; a warpgroup whose 64 keys lie inside the sequence stores them through smem
    and a TMA store where the tiles fit (:class:`~hstu_cute.hopper.bwd_base.StagedEpilogue`).

    ``fuse_dq`` (option B, opt-in; D128, quant modes 0 and 2-5, no rab, one CTA per key block): K^T
    (D, keys) loads with K and V. Each warpgroup stores its G as e4m3 G[query, key] into sG (keys
    contiguous in K^T's order, :func:`~hstu_cute.common.fp8.g_to_smem_keys_contiguous`; its four
    warps' maxima meet behind barrier 4/5 for one power-of-two scale per warpgroup tile), and the
    16-bit fused kernel's dQ owner (barriers 6 + parity, 8/9) forms dQ_i = G K_j from the two key
    halves, smaller scale first (:meth:`dq_partial`), and reduce-adds it through TMA."""

    native_kv_heads = False  # FP8 takes k and v expanded to H_q heads

    transposed_q_tiles = True

    def __init__(self, head_dim: int, mask: masks.MaskSpec, has_rab: bool, tile_m: int, tile_n: int,
                 num_stages: int, grad_dtype, persistent: bool = False, dynamic_tiles: bool = False,
                 two_direction: bool = False, dim_parts: int = 1, fuse_dq: bool = False):
        super().__init__(cutlass.Float8E4M3FN, head_dim, mask, has_rab, tile_m, tile_n, num_stages, True,
                         fuse_dq=fuse_dq, persistent=persistent, dynamic_tiles=dynamic_tiles)
        self.grad_dtype = self.rab_dtype = grad_dtype
        self.two_direction = two_direction
        # Fused: the dK GEMM does not wait; the dQ step after it waits for every WGMMA in flight.
        self.dk_gemm_wait = -1 if fuse_dq else 0
        assert not fuse_dq or not (has_rab or two_direction or dim_parts > 1 or persistent)
        # dim_parts CTAs per key block (variants.HopperFp8BwdKey.dim_parts), each with dK and dV of
        # dims columns of D; the score GEMMs and the SiLU run in each.
        self.dim_parts = dim_parts
        self.dims = head_dim // dim_parts
        assert tile_n == BLOCK_TOKENS and BLOCK_TOKENS % tile_m == 0 and tile_m % 32 == 0

    @cute.jit
    def __call__(self, mQ, mK, mV, mdO, mQt, mdOt, mKt, mdK, mdV, mdQaccum, mOffsetsQ, mOffsetsK, mSeqUsedQ,
                 mSeqUsedK, mNumContexts, mNumTargets, mFunc, mFuncBlocks, mRab, alpha, inv_scale, window_left, window_right, group_size,
                 is_delta_q, num_n_blocks, num_sms, bh_per_section, mTileCounter, mDescaleQ, mDescaleK, mDescaleV,
                 mDescaleDO, mDescaleQt, mDescaleDOt, stream):
        D = self.head_dim
        self.sK_layout = sm90_smem_layout(self.dtype, self.tile_n, D, None)
        self.sQ_layout = sm90_smem_layout(self.dtype, self.tile_m, D, self.num_stages)
        # Q^T / dO^T stages (D, queries), queries contiguous: the K-major B operands of the dV and dK GEMMs.
        self.sQt_layout = sm90_smem_layout(self.dtype, self.dims, self.tile_m, self.num_stages)
        self.sRab_layout = self.rab_ring_layout()
        self.tiled_mma_s = trivial_mma(self.dtype, self.tile_m, False, self.num_mma_wg)
        self.tiled_mma_d = trivial_mma(self.dtype, self.dims, False, self.num_mma_wg, a_in_registers=True)
        self.key_block_bytes()
        loads = self.token_load_atoms(mQ, mK, mV, mdO, mRab, cute.slice_(self.sQ_layout, (None, None, 0)),
                                      self.sK_layout, self.sRab_layout)
        sQt_stage = cute.slice_(self.sQt_layout, (None, None, 0))
        tma_atom_qt, tma_qt = transposed_atom(mQt, sQt_stage, self.dims, self.tile_m)
        tma_atom_dot, tma_dot = transposed_atom(mdOt, sQt_stage, self.dims, self.tile_m)
        self.sKt_layout = self.sG_layout = self.sdQ_layout = self.tiled_mma_dq = None
        tma_atom_kt = tma_kt = tma_atom_dq = tma_dq = zero_keys = None
        fused_storage = {}
        if const_expr(self.fuse_dq):
            zero_keys = rows_zero_copy(self.dtype, self.tile_n)
            # K^T (D, keys), keys contiguous: the K-major B operand of dQ_i = G K_j, loaded with K and V.
            self.sKt_layout = sm90_smem_layout(self.dtype, D, self.tile_n)
            tma_atom_kt, tma_kt = transposed_atom(mKt, self.sKt_layout, D, self.tile_n)
            self.kv_bytes += D * self.tile_n
            # G as (queries, keys), keys contiguous in K^T's order: the K-major A operand; two buffers.
            self.sG_layout = sm90_smem_layout(self.dtype, self.tile_m, self.tile_n, 2)
            self.sdQ_layout = sm90_smem_layout(Float32, self.tile_m, D, 2)  # one buffer per warpgroup
            self.tiled_mma_dq = trivial_mma(self.dtype, D, False, 1, atom_layout=(1, 1, 1))
            tma_atom_dq, tma_dq = sm90_tma_atom_tokens(cpasync.CopyReduceBulkTensorTileS2GOp(), mdQaccum,
                                                       cute.slice_(self.sdQ_layout, (None, None, 0)), self.tile_m, D)
            fused_storage = dict(sKt=(self.dtype, cute.cosize(self.sKt_layout)),
                                 sG=(self.dtype, cute.cosize(self.sG_layout)),
                                 sdQ=(Float32, cute.cosize(self.sdQ_layout)),
                                 sGScales=(Float32, cute.size(G_SCALE_SLOTS)))
        tile = (self.dtype, cute.cosize(self.sK_layout))
        ring = (self.dtype, cute.cosize(self.sQ_layout))
        ring_t = (self.dtype, cute.cosize(self.sQt_layout))
        ring_barriers, ring_words = self.tile_ring_storage()
        barriers = dict(mbar_kv=2, mbar_q=2 * self.num_stages, **ring_barriers)
        buffers = dict(sK=tile, sV=tile, sQ=ring, sdO=ring, sQt=ring_t, sdOt=ring_t,
                       sRab=(self.rab_dtype, self.smem_elems(self.sRab_layout)), **self.column_rows_storage(2),
                       **fused_storage)
        self.shared_storage, self.sEpi_layout, epi_atoms = self.staged_epilogue(
            lambda extra: shared_storage(barriers, dict(buffers, **extra), words=ring_words), (mdK, mdV), self.dims,
            self.grad_dtype)
        num_ctas = num_n_blocks * mQ.shape[1] * (mOffsetsQ.shape[0] - 1)
        if const_expr(self.persistent):
            num_ctas = cutlass.min(num_ctas, num_sms)
        self.launch(*loads, tma_atom_qt, tma_qt, tma_atom_dot, tma_dot, tma_atom_kt, tma_kt, tma_atom_dq, tma_dq, mQ,
                    mK, mdK, mdV, SequenceArgs(mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets, mFunc, mFuncBlocks),
                    mRab, ScoreScalars(alpha, inv_scale, window_left, window_right, group_size, is_delta_q),
                    num_n_blocks, bh_per_section, mTileCounter,
                    self.descale_tables(mDescaleQ, mDescaleK, mDescaleV, mDescaleDO, mDescaleQt, mDescaleDOt),
                    epi_atoms, statics=dict(sEpi_layout=self.sEpi_layout, sK_layout=self.sK_layout,
                                 sQ_layout=self.sQ_layout, sQt_layout=self.sQt_layout, sRab_layout=self.sRab_layout,
                                 tiled_mma_s=self.tiled_mma_s, tiled_mma_d=self.tiled_mma_d,
                                 zero_rows=rows_zero_copy(self.dtype, D),
                                 zero_cols=rows_zero_copy(self.dtype, self.tile_m), sKt_layout=self.sKt_layout,
                                 sG_layout=self.sG_layout, sdQ_layout=self.sdQ_layout, tiled_mma_dq=self.tiled_mma_dq,
                                 zero_keys=zero_keys),
                    grid=[num_ctas, 1, 1], stream=stream)

    def descale_tables(self, *tables):
        # Plain Python: the column tables exist with two_direction only (None is no kernel argument).
        return tables if self.two_direction else tables[:4]

    def column_rows_storage(self, tables: int) -> dict:
        if not self.two_direction:
            return {}
        return dict(sColumnRows=(Float32, cute.cosize(column_rows_layout(self.dims, tables))))

    def column_rows(self, storage, tables: int):
        if not self.two_direction:
            return None
        return storage.sColumnRows.get_tensor(column_rows_layout(self.dims, tables))

    def tile_problem(self, tiles, seqinfo, tile):
        # Plain Python: every tile's coordinates end with its part of D (0 with one part).
        live, coords = HstuBackwardDkDvSm90.tile_problem(self, tiles, seqinfo, tile)
        return live, coords if self.dim_parts > 1 else (*coords, 0)

    def produce_tile(self, *args):
        # Plain Python: the tile's part of D (its last coordinate, before the states) goes to the
        # transposed loads.
        n_states = 2 if self.persistent else 0
        tile_args, states = args[:len(args) - n_states], args[len(args) - n_states:]
        return self.produce_key_block(*tile_args[:-1], *states, dim_part=tile_args[-1])

    @cute.kernel
    def kernel(self, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_rab,
               tma_rab, tma_atom_qt, tma_qt, tma_atom_dot, tma_dot, tma_atom_kt, tma_kt, tma_atom_dq, tma_dq, mQ, mK,
               mdK, mdV, seqs, mRab, scalars, num_n_blocks: Int32, bh_per_section: Int32, mTileCounter, descales,
               epi_atoms, statics):
        self.bind(statics)
        tidx, warp_idx = self.prologue(tma_atom_k, tma_atom_v, tma_atom_q, tma_atom_do, tma_atom_rab, tma_atom_qt,
                                       tma_atom_dot, tma_atom_kt, tma_atom_dq)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        pipe_kv, pipe_q = sm90_bwd_pipelines(storage.mbar_kv, storage.mbar_q, self.kv_bytes,
                                              self.q_bytes, self.num_stages, self.num_mma_threads)
        s = smem_tensors(storage, dict(sK=self.sK_layout, sV=self.sK_layout, sQ=self.sQ_layout, sdO=self.sQ_layout,
                                       sQt=self.sQt_layout, sdOt=self.sQt_layout, sRab=self.sRab_layout,
                                       sKt=self.sKt_layout, sG=self.sG_layout, sdQ=self.sdQ_layout,
                                       sEpi=self.sEpi_layout))
        epilogue = None
        if const_expr(self.sEpi_layout is not None):
            epilogue = (s["sEpi"], epi_atoms)
        fused = None
        if const_expr(self.fuse_dq):
            self.transposed_k_load = (tma_atom_kt, tma_kt, s["sKt"])
            fused = (s["sKt"], s["sG"], s["sdQ"], storage.sGScales.get_tensor(cute.make_layout(G_SCALE_SLOTS)),
                     tma_atom_dq, tma_dq)
        walk = SectionWalk(num_n_blocks, mQ.shape[1], seqs.mOffsetsQ.shape[0] - 1, bh_per_section, reverse=False)
        seqinfo = self.sequence_info(seqs, scalars, mQ, mK)
        claims = self.tile_claims(storage, walk, mTileCounter)
        self.descales = descales
        self.sColumnRows = self.column_rows(storage, 2)
        self.transposed_q_loads = (tma_atom_qt, tma_qt, tma_atom_dot, tma_dot, s["sQt"], s["sdOt"])

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce((tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_q, tma_q, tma_atom_do, tma_do,
                              tma_atom_rab, tma_rab, s["sK"], s["sV"], s["sQ"], s["sdO"], s["sRab"], pipe_kv, pipe_q,
                              mRab), walk, seqinfo, claims)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consume_fp8(tidx - 128, mdK, mdV, s["sK"], s["sV"], s["sQ"], s["sdO"], s["sQt"], s["sdOt"],
                             s["sRab"], pipe_kv, pipe_q, scalars.alpha, scalars.inv_scale, walk, seqinfo, claims, fused,
                             epilogue)

    @cute.jit
    def consume_fp8(self, tidx: Int32, mdK, mdV, sK, sV, sQ, sdO, sQt, sdOt, sRab, pipe_kv, pipe_q, alpha: Float32,
                    inv_scale: Float32, walk, seqinfo, claims, fused=None, epilogue=None):
        tiled_mma_s, tiled_mma_d = self.tiled_mma_s, self.tiled_mma_d
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma_s = tiled_mma_s.get_slice(tidx)
        wg_mma_s = tiled_mma_s.get_slice(wg * 128)
        wg_mma_d = tiled_mma_d.get_slice(wg * 128)
        tSrK, tSrV, tSrQ, tSrdO = score_operands(wg_mma_s, (sK, sV), (sQ, sdO))
        # Q^T / dO^T (D, queries) are already the (N, K) B operands, K-major.
        tDrQt = wg_mma_d.make_fragment_B(wg_mma_d.partition_B(sQt))
        tDrdOt = wg_mma_d.make_fragment_B(wg_mma_d.partition_B(sdOt))
        tScS, tScS_rc = acc_coords(thr_mma_s, (self.tile_n, self.tile_m))
        tDcD, tDcD_rc = acc_coords(tiled_mma_d.get_slice(tidx), (self.tile_n, self.dims))
        tSsRabT = None
        if const_expr(self.has_rab):
            sRabT = transposed_view(sRab, (self.tile_n, self.tile_m, self.num_stages))
            tSsRabT = thr_mma_s.partition_C(sRabT)
        kv_state, q_state = self.pipeline_states(pipeline.PipelineUserType.Consumer)
        dq_parts = None
        if const_expr(self.fuse_dq):
            sKt, sG, sdQ, sGScales, tma_atom_dq, tma_dq = fused
            thr_mma_dq = self.tiled_mma_dq.get_slice(tidx % 128)
            sdQ_wg = sdQ[None, None, wg]
            dq_parts = (sKt, sG, sGScales, thr_mma_dq.make_fragment_A(thr_mma_dq.partition_A(sG)),
                        thr_mma_dq.make_fragment_B(thr_mma_dq.partition_B(sKt)), thr_mma_dq.partition_C(sdQ_wg), sdQ_wg,
                        tma_atom_dq, tma_dq)
        tile_args = (tidx, mdK, mdV, sQ, sdO, sQt, sdOt, pipe_kv, pipe_q, alpha, inv_scale, tSrK, tSrV, tSrQ, tSrdO,
                     tDrQt, tDrdOt, tScS, tScS_rc, tDcD_rc, tSsRabT, dq_parts, epilogue)
        self.for_each_tile(walk, seqinfo, self.consume_key_block, tile_args, (q_state, kv_state), claims=claims)
        if const_expr(epilogue is not None or self.fuse_dq):
            # The last TMA stores (or dQ reduce-adds) must have read smem before the CTA's smem goes away.
            if tidx % 128 < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def consume_key_block(self, tidx: Int32, mdK, mdV, sQ, sdO, sQt, sdOt, pipe_kv, pipe_q, alpha: Float32,
                          inv_scale: Float32, tSrK, tSrV, tSrQ, tSrdO, tDrQt, tDrdOt, tScS, tScS_rc, tDcD_rc, tSsRabT,
                          dq_parts, epilogue, n_block: Int32, head: Int32, batch: Int32, q_start: Int32,
                          k_start: Int32, seq, m_lo: Int32, m_hi: Int32, dim_part, q_state, kv_state):
        """One n-block: dK and dV of its keys (of part ``dim_part`` of D), and with ``fuse_dq`` the
        reduce-adds of dQ (``dq_parts``: K^T, sG, the G scales, their fragments, sdQ, the TMA
        reduce). Returns the advanced pipeline states."""
        D = self.head_dim
        tiled_mma_s, tiled_mma_d = self.tiled_mma_s, self.tiled_mma_d
        spec = self.mask
        wg = cute.arch.make_warp_uniform(tidx // 128)
        tid_in_wg = tidx % 128
        thr_mma_d = tiled_mma_d.get_slice(tidx)
        wg_mma_d = tiled_mma_d.get_slice(wg * 128)
        shape_S = tiled_mma_s.get_slice(wg * 128).partition_shape_C((self.tile_n, self.tile_m))
        col0 = n_block * self.tile_n
        k_rows = seq.seqlen_k - col0
        mDescaleQ, mDescaleK, mDescaleV, mDescaleDO = self.descales[:4]
        dk = dv = dk_rows = dv_rows = None
        if const_expr(self.two_direction):
            q_last = q_start + seq.seqlen_q - 1
            q_block_prev = Int32(-1)
            moves = Int32(0)
            dk_rows = row_token_descales(mDescaleK, k_start + col0, k_start + seq.seqlen_k - 1, head, tScS_rc)
            dv_rows = row_token_descales(mDescaleV, k_start + col0, k_start + seq.seqlen_k - 1, head, tScS_rc)
        else:
            dk = block_descale(mDescaleK, batch, col0, head)
            dv = block_descale(mDescaleV, batch, col0, head)
        acc_dK = cute.make_rmem_tensor(wg_mma_d.partition_shape_C((self.tile_n, self.dims)), Float32)
        acc_dV = cute.make_rmem_tensor(wg_mma_d.partition_shape_C((self.tile_n, self.dims)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        # The register operands, written only after the WGMMAs reading them retired (words_to_operand_a).
        rP = wg_mma_d.make_fragment_A(wg_mma_d.partition_shape_A((self.tile_n, self.tile_m)))
        rG = wg_mma_d.make_fragment_A(wg_mma_d.partition_shape_A((self.tile_n, self.tile_m)))
        p_scale = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        g_scale = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        p_scale.fill(0.0)
        g_scale.fill(0.0)
        p_rescale = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        g_rescale = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        tdQsdQ_tma = tdQgdQ = None
        if const_expr(self.fuse_dq):
            sKt, sG, sGScales, tdQrG, tdQrKt, tdQsdQ, sdQ_wg, tma_atom_dq, tma_dq = dq_parts
            gdQ = cute.local_tile(cute.domain_offset((q_start, 0), tma_dq[None, None, head]), (self.tile_m, D),
                                  (None, 0))
            tdQsdQ_tma, tdQgdQ = cpasync.tma_partition(tma_atom_dq, 0, cute.make_layout(1),
                                                       cute.group_modes(sdQ_wg, 0, 2), cute.group_modes(gdQ, 0, 2))
        # m-blocks done (fused: their parity picks the sG buffer and the dQ owner).
        blocks_done = Int32(0)
        pipe_kv.consumer_wait(kv_state)
        if const_expr(self.fuse_dq):
            if k_rows < self.tile_n:
                zero_smem_cols_past(self.zero_keys, sKt, (D, self.tile_n), tid_in_wg, wg, k_rows)

        def zero_transposed_cols_past(stage, q_rows):
            # Q^T and dO^T hold the stage's queries as columns.
            for ring in (sQt, sdOt):
                zero_smem_cols_past(self.zero_cols, ring[None, None, stage], (self.dims, self.tile_m), tid_in_wg, wg,
                                    q_rows)

        for m_block in cutlass.range(m_lo, m_hi, unroll=1):
            if masks.tile_nonempty(spec, seq, m_block, n_block, self.tile_m, self.tile_n, KERNEL_OPS):
                q_rows = self.wait_query_stage(pipe_q, q_state, seq, m_block, (sQ, sdO), self.zero_rows, tid_in_wg, wg,
                                               zero_transposed_cols_past)
                stage = q_state.index
                if const_expr(self.two_direction):
                    q_block = column_block(self.descales[5], m_block * self.tile_m)
                    moving = (q_block_prev >= 0) & (q_block != q_block_prev)
                    if moving:
                        prefetch_column_rows(self.sColumnRows[None, None, moves % 2, wg],
                                             (self.descales[5], self.descales[4]), batch, head, q_block_prev, q_block,
                                             tid_in_wg, dim_part)
                else:
                    dq = block_descale(mDescaleQ, batch, m_block * self.tile_m, head)
                    ddo = block_descale(mDescaleDO, batch, m_block * self.tile_m, head)
                acc_S = cute.make_rmem_tensor(shape_S, Float32)
                acc_dP = cute.make_rmem_tensor(shape_S, Float32)
                wgmma(tiled_mma_s, acc_S, tSrK, tSrQ[None, None, None, stage], True, -1)
                wgmma(tiled_mma_s, acc_dP, tSrV, tSrdO[None, None, None, stage], True, 1)
                if const_expr(self.two_direction):
                    # Descales per token: the scores' columns are this m-block's queries.
                    q0 = q_start + m_block * self.tile_m
                    columns = cute.size(tScS_rc.shape[1])
                    tokens = (dk_rows, tile_token_descales(mDescaleQ, q0, q_last, head, columns), dv_rows,
                              tile_token_descales(mDescaleDO, q0, q_last, head, columns))
                    p_and_g(self, acc_S, acc_dP, stage_of(tSsRabT, stage), shape_S, alpha, tokens=tokens)
                else:
                    p_and_g(self, acc_S, acc_dP, stage_of(tSsRabT, stage), shape_S, alpha, qk_descales=(dq, dk))
                self.mask_key_major(acc_S, acc_dP, tScS, seq, m_block, n_block, col0, q_rows)
                if const_expr(self.two_direction):
                    p_words = scaled_fp8_words(acc_S, Float32(1.0), Float32(P_AMAX_FLOOR), p_scale, p_rescale)
                    g_words = scaled_fp8_words(acc_dP, Float32(1.0), Float32(G_AMAX_FLOOR), g_scale, g_rescale)
                else:
                    p_words = scaled_fp8_words(acc_S, ddo, Float32(P_AMAX_FLOOR), p_scale, p_rescale)
                    g_words = scaled_fp8_words(acc_dP, ddo * dv * dq, Float32(G_AMAX_FLOOR), g_scale, g_rescale)
                if const_expr(self.fuse_dq):
                    g_to_smem_keys_contiguous(acc_dP, ddo * dv * dk, sG[None, None, blocks_done % 2], sGScales,
                                              blocks_done % 2, wg, tid_in_wg)
                # The previous m-block's dV and dK GEMMs retired (wait_group(0) below).
                rescale_rows_if_needed(acc_dV, p_rescale)
                rescale_rows_if_needed(acc_dK, g_rescale)
                if const_expr(self.two_direction):
                    if moving:
                        move_column_units(((acc_dV, tDcD_rc), (acc_dK, tDcD_rc)),
                                          self.sColumnRows[None, None, moves % 2, wg], wg)
                        moves += 1
                    q_block_prev = q_block
                words_to_operand_a(p_words, rP)
                words_to_operand_a(g_words, rG)
                wgmma(tiled_mma_d, acc_dV, rP, tDrdOt[None, None, None, stage], False, -1)
                wgmma(tiled_mma_d, acc_dK, rG, tDrQt[None, None, None, stage], False, self.dk_gemm_wait)
                if const_expr(self.fuse_dq):
                    cute.arch.fence_view_async_shared()
                    self.reduce_dq(self.tiled_mma_dq, (tdQrG, sGScales), tdQrKt, tdQsdQ, sdQ_wg, tdQsdQ_tma, tdQgdQ,
                                   tma_atom_dq, tid_in_wg, wg, m_block, blocks_done, alpha * inv_scale * Float32(0.5))
                    blocks_done += 1
                pipe_q.consumer_release(q_state)
                q_state = advanced(q_state)

        # Every WGMMA reading sK/sV has retired (the last dK GEMM waited for all).
        pipe_kv.consumer_release(kv_state)
        epilogue_rows(acc_dV, p_scale, inv_scale)
        epilogue_rows(acc_dK, g_scale, alpha * inv_scale * Float32(0.5))
        if const_expr(self.two_direction):
            epilogue_columns(acc_dV, self.descales[5], batch, head, q_block_prev, tDcD_rc, self.dims, dim_part)
            epilogue_columns(acc_dK, self.descales[4], batch, head, q_block_prev, tDcD_rc, self.dims, dim_part)
        if const_expr(epilogue is not None):
            if k_rows - wg * 64 >= 64:
                store_rows_staged((acc_dK, acc_dV), *epilogue, self.grad_dtype, tid_in_wg, wg, k_start + col0 + wg * 64,
                                  head, dim_part)
            else:
                store_dk_dv(thr_mma_d, acc_dK, acc_dV, mdK, mdV, self.grad_dtype, self.tile_n, self.dims, k_start,
                            head, n_block, k_rows, dim_part)
        else:
            store_dk_dv(thr_mma_d, acc_dK, acc_dV, mdK, mdV, self.grad_dtype, self.tile_n, self.dims, k_start, head,
                        n_block, k_rows, dim_part)
        return q_state, advanced(kv_state)


    def dq_partial(self, tiled_mma_dq, tdQrG_scales, tdQrKt, shape, buf: Int32, dq_scale: Float32):
        # Plain Python (traced inline): dQ_i = G K_j from sG buffer ``buf``, whose two key halves
        # (one per warpgroup) carry their own power-of-two scales (common.fp8.g_to_smem_keys_contiguous):
        # the half with the smaller scale first, its sum times small / large (at most 1: no
        # overflow when a half is all zeros and keeps the least scale), then the other half.
        tdQrG, sGScales = tdQrG_scales
        half = cute.size(tdQrKt.shape[2]) // 2
        s0, s1 = sGScales[4, 0, buf], sGScales[4, 1, buf]
        first = cutlass.select_(s0 <= s1, Int32(0), Int32(half))
        acc_dQ = cute.make_rmem_tensor(shape, Float32)
        for part in range(2):
            start = first if part == 0 else half - first
            warpgroup.fence()
            atom = cute.make_mma_atom(tiled_mma_dq.op)
            atom.set(warpgroup.Field.ACCUMULATE, part > 0)
            for k in range(half):
                cute.gemm(atom, acc_dQ, tdQrG[None, None, start + k, buf], tdQrKt[None, None, start + k], acc_dQ)
                atom.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            if part == 0:
                acc_dQ.store(acc_dQ.load() * (cute.arch.fmin(s0, s1) * pow2_reciprocal(cute.arch.fmax(s0, s1))))
        acc_dQ.store(acc_dQ.load() * (cute.arch.fmax(s0, s1) * dq_scale))
        return acc_dQ


class HstuBackwardDqFp8Sm90(HstuBackwardDqSm90):
    """dQ kernel of the FP8 backward: the 16-bit dQ kernel's tiles, walk and warp roles, with e4m3
    Q, dO (the CTA's) and K, V, K^T (+ 16-bit rab) per n-block in the ring. Per n-block: S = Q K^T
    and dP = dO V^T (SS, descaled by dq dk and ddO dv), G (tanh SiLU, unscaled), dQ += G8 K^T8 (RS,
    G re-quantized per query row with ddO dv dk folded in).

    Warp roles, pipelines and barriers as :class:`~hstu_cute.hopper.bwd.HstuBackwardDqSm90`; named
    barriers 4/5 after a warpgroup zeroes the K^T columns past seqlen_k (and around the staged
    epilogue's tile). Epilogue: dQ times each row's final scale, in ``grad_dtype``, query rows past
    seqlen_q skipped; through smem and a TMA store where a warpgroup's 64 rows lie inside the
    sequence and the tiles fit (:class:`~hstu_cute.hopper.bwd_base.StagedEpilogue`). ``has_drab``: drab = G
    in fp32 before its re-quantization, stored per head (each element has one writer) or, with
    ``rab_sum_heads``, added over the heads into an fp32 (B, L_q, L_k) sum (red.global.add)."""

    native_kv_heads = False  # FP8 takes k and v expanded to H_q heads

    def __init__(self, head_dim: int, mask: masks.MaskSpec, has_rab: bool, tile_m: int, tile_n: int,
                 num_stages: int, grad_dtype, persistent: bool = False, dynamic_tiles: bool = False,
                 has_drab: bool = False, rab_sum_heads: bool = False, two_direction: bool = False):
        super().__init__(cutlass.Float8E4M3FN, head_dim, mask, has_rab, tile_m, tile_n, num_stages, True,
                         persistent=persistent, dynamic_tiles=dynamic_tiles)
        self.grad_dtype = self.rab_dtype = grad_dtype
        self.has_drab, self.rab_sum_heads = has_drab, rab_sum_heads
        self.two_direction = two_direction
        self.dims = head_dim  # dQ's columns: all of D
        assert has_rab or not has_drab
        assert tile_m == BLOCK_TOKENS and BLOCK_TOKENS % tile_n == 0 and tile_n % 32 == 0

    @cute.jit
    def __call__(self, mQ, mK, mV, mdO, mKt, mdQ, mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts,
                 mNumTargets, mFunc, mFuncBlocks, mRab, alpha, inv_scale, window_left, window_right, group_size, is_delta_q, num_m_blocks,
                 num_sms, bh_per_section, mTileCounter, mDescaleQ, mDescaleK, mDescaleV, mDescaleDO, mDescaleKt, mdRab,
                 stream):
        D = self.head_dim
        self.sQ_layout = sm90_smem_layout(self.dtype, self.tile_m, D, None)
        self.sK_layout = sm90_smem_layout(self.dtype, self.tile_n, D, self.num_stages)
        # K^T stages (D, keys), keys contiguous: the K-major B operand of dQ += G K.
        self.sKt_layout = sm90_smem_layout(self.dtype, D, self.tile_n, self.num_stages)
        self.sRab_layout = self.rab_ring_layout()
        self.tiled_mma_s = trivial_mma(self.dtype, self.tile_n, False, self.num_mma_wg)
        self.tiled_mma_dq = trivial_mma(self.dtype, D, False, self.num_mma_wg, a_in_registers=True)
        loads = self.token_load_atoms(mQ, mK, mV, mdO, mRab, self.sQ_layout,
                                      cute.slice_(self.sK_layout, (None, None, 0)), self.sRab_layout)
        tma_atom_kt, tma_kt = transposed_atom(mKt, cute.slice_(self.sKt_layout, (None, None, 0)), D, self.tile_n)
        self.q_bytes = 2 * self.tile_m * D
        self.kv_bytes = 3 * self.tile_n * D + (
            self.tile_m * self.tile_n * (self.rab_dtype.width // 8) if const_expr(self.has_rab) else 0)
        tile = (self.dtype, cute.cosize(self.sQ_layout))
        ring = (self.dtype, cute.cosize(self.sK_layout))
        ring_barriers, ring_words = self.tile_ring_storage()
        barriers = dict(mbar_q=2, mbar_kv=2 * self.num_stages, **ring_barriers)
        buffers = dict(sQ=tile, sdO=tile, sK=ring, sV=ring, sKt=(self.dtype, cute.cosize(self.sKt_layout)),
                       sRab=(self.rab_dtype, self.smem_elems(self.sRab_layout)), **self.column_rows_storage(1))
        self.shared_storage, self.sEpi_layout, epi_atoms = self.staged_epilogue(
            lambda extra: shared_storage(barriers, dict(buffers, **extra), words=ring_words), (mdQ,), D, self.grad_dtype)
        num_ctas = num_m_blocks * mQ.shape[1] * (mOffsetsQ.shape[0] - 1)
        if const_expr(self.persistent):
            num_ctas = cutlass.min(num_ctas, num_sms)
        k_v, q_do, rab = loads[0:4], loads[4:8], loads[8:10]
        self.launch(*q_do, *k_v, *rab, tma_atom_kt, tma_kt, mQ, mK, mdQ,
                    SequenceArgs(mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets, mFunc, mFuncBlocks), mRab,
                    ScoreScalars(alpha, inv_scale, window_left, window_right, group_size, is_delta_q), num_m_blocks,
                    bh_per_section, mTileCounter, self.descale_tables(mDescaleQ, mDescaleK, mDescaleV, mDescaleDO,
                                                                      mDescaleKt), mdRab, epi_atoms,
                    statics=dict(sEpi_layout=self.sEpi_layout, sQ_layout=self.sQ_layout, sK_layout=self.sK_layout,
                                 sKt_layout=self.sKt_layout, sRab_layout=self.sRab_layout, tiled_mma_s=self.tiled_mma_s,
                                 tiled_mma_dq=self.tiled_mma_dq, zero_cols=rows_zero_copy(self.dtype, self.tile_n)),
                    grid=[num_ctas, 1, 1], stream=stream)

    descale_tables = HstuBackwardDkDvFp8Sm90.descale_tables
    column_rows_storage = HstuBackwardDkDvFp8Sm90.column_rows_storage
    column_rows = HstuBackwardDkDvFp8Sm90.column_rows

    @cute.kernel
    def kernel(self, tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_rab,
               tma_rab, tma_atom_kt, tma_kt, mQ, mK, mdQ, seqs, mRab, scalars, num_m_blocks: Int32,
               bh_per_section: Int32, mTileCounter, descales, mdRab, epi_atoms, statics):
        self.bind(statics)
        tidx, warp_idx = self.prologue(tma_atom_q, tma_atom_do, tma_atom_k, tma_atom_v, tma_atom_rab, tma_atom_kt)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        pipe_q, pipe_kv = sm90_bwd_pipelines(storage.mbar_q, storage.mbar_kv, self.q_bytes,
                                              self.kv_bytes, self.num_stages, self.num_mma_threads)
        s = smem_tensors(storage, dict(sQ=self.sQ_layout, sdO=self.sQ_layout, sK=self.sK_layout, sV=self.sK_layout,
                                       sKt=self.sKt_layout, sRab=self.sRab_layout, sEpi=self.sEpi_layout))
        epilogue = None
        if const_expr(self.sEpi_layout is not None):
            epilogue = (s["sEpi"], epi_atoms)
        walk = SectionWalk(num_m_blocks, mQ.shape[1], seqs.mOffsetsQ.shape[0] - 1, bh_per_section, reverse=True)
        seqinfo = self.sequence_info(seqs, scalars, mQ, mK)
        claims = self.tile_claims(storage, walk, mTileCounter)
        self.descales = descales
        self.sColumnRows = self.column_rows(storage, 1)
        self.mdRab = mdRab
        self.transposed_k_loads = (tma_atom_kt, tma_kt, s["sKt"])

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce((tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_k, tma_k, tma_atom_v, tma_v,
                              tma_atom_rab, tma_rab, s["sQ"], s["sdO"], s["sK"], s["sV"], s["sRab"], pipe_q, pipe_kv,
                              mRab), walk, seqinfo, claims)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            block_args = (tidx - 128, mdQ, s["sQ"], s["sdO"], s["sK"], s["sV"], s["sKt"], s["sRab"], pipe_q, pipe_kv,
                          scalars.alpha, scalars.inv_scale, epilogue)
            states = ()
            if const_expr(self.persistent):
                states = self.pipeline_states(pipeline.PipelineUserType.Consumer)
            self.for_each_tile(walk, seqinfo, self.consume_query_block_fp8, block_args, states, claims=claims)
            if const_expr(epilogue is not None):
                # The last TMA stores must have read their tiles before the CTA's smem goes away.
                if (tidx - 128) % 128 < 32:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def consume_query_block_fp8(self, tidx: Int32, mdQ, sQ, sdO, sK, sV, sKt, sRab, pipe_q, pipe_kv, alpha: Float32,
                                inv_scale: Float32, epilogue, m_block: Int32, head: Int32, batch: Int32, q_start: Int32,
                                k_start: Int32, seq, sched, q_state=None, kv_state=None):
        """dQ of one m-block; returns the advanced pipeline states (persistent CTAs pass theirs)."""
        persistent = q_state is not None
        tiled_mma_s, tiled_mma_dq = self.tiled_mma_s, self.tiled_mma_dq
        D = self.head_dim
        spec = self.mask
        n_lo, hole_lo, hole_size, n_count = sched
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma_s = tiled_mma_s.get_slice(tidx)
        thr_mma_dq = tiled_mma_dq.get_slice(tidx)
        wg_mma_s = tiled_mma_s.get_slice(wg * 128)
        wg_mma_dq = tiled_mma_dq.get_slice(wg * 128)
        tSrQ, tSrdO, tSrK, tSrV = score_operands(wg_mma_s, (sQ, sdO), (sK, sV))
        tDrKt = wg_mma_dq.make_fragment_B(wg_mma_dq.partition_B(sKt))
        shape_S = wg_mma_s.partition_shape_C((self.tile_m, self.tile_n))
        acc_dQ = cute.make_rmem_tensor(wg_mma_dq.partition_shape_C((self.tile_m, D)), Float32)
        acc_dQ.fill(0.0)
        rG = wg_mma_dq.make_fragment_A(wg_mma_dq.partition_shape_A((self.tile_m, self.tile_n)))
        g_scale = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        g_scale.fill(0.0)
        g_rescale = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        tScS, tScS_rc = acc_coords(thr_mma_s, (self.tile_m, self.tile_n))
        tSsRab = None
        if const_expr(self.has_rab):
            tSsRab = thr_mma_s.partition_C(sRab)
        row_first = seq.row_offset + m_block * self.tile_m
        mDescaleQ, mDescaleK, mDescaleV, mDescaleDO = self.descales[:4]
        dq = ddo = None
        if const_expr(self.two_direction):
            tDcD, tDcD_rc = acc_coords(thr_mma_dq, (self.tile_m, D))
            q_last = q_start + seq.seqlen_q - 1
            dq_rows = row_token_descales(mDescaleQ, q_start + m_block * self.tile_m, q_last, head, tScS_rc)
            ddo_rows = row_token_descales(mDescaleDO, q_start + m_block * self.tile_m, q_last, head, tScS_rc)
            k_last = k_start + seq.seqlen_k - 1
            k_block_prev = Int32(-1)
            moves = Int32(0)
        else:
            dq = block_descale(mDescaleQ, batch, m_block * self.tile_m, head)
            ddo = block_descale(mDescaleDO, batch, m_block * self.tile_m, head)
        tSgdRab = None
        drab_rows = drab_cols = Int32(0)
        if const_expr(self.has_drab):
            mdRab_seq = self.drab_slab(self.mdRab, batch, head)
            # (queries, keys) tiles of this m-block; rows in whole-sequence coordinates (delta_q).
            tSgdRab = thr_mma_s.partition_C(cute.local_tile(cute.domain_offset((seq.row_offset, 0), mdRab_seq),
                                                            (self.tile_m, self.tile_n), (m_block, None)))
            drab_rows = cutlass.min(seq.seqlen_q + seq.row_offset, mdRab_seq.shape[0]) - row_first
            drab_cols = cutlass.min(seq.seqlen_k, mdRab_seq.shape[1])

        if const_expr(not persistent):
            q_state, kv_state = self.pipeline_states(pipeline.PipelineUserType.Consumer)
        if n_count > 0:
            pipe_q.consumer_wait(q_state)
            for it in cutlass.range(n_count, unroll=1):
                n_block = masks.n_block_at(n_count - 1 - it, n_lo, hole_lo, hole_size, KERNEL_OPS)
                pipe_kv.consumer_wait(kv_state)
                stage = kv_state.index
                k_rows = seq.seqlen_k - n_block * self.tile_n
                if k_rows < self.tile_n:
                    zero_smem_cols_past(self.zero_cols, sKt[None, None, stage], (D, self.tile_n), tidx % 128, wg,
                                        k_rows)
                if const_expr(self.two_direction):
                    k_block = column_block(self.descales[4], n_block * self.tile_n)
                    moving = (k_block_prev >= 0) & (k_block != k_block_prev)
                    if moving:
                        prefetch_column_rows(self.sColumnRows[None, None, moves % 2, wg], (self.descales[4],), batch,
                                             head, k_block_prev, k_block, tidx % 128)
                else:
                    dk = block_descale(mDescaleK, batch, n_block * self.tile_n, head)
                    dv = block_descale(mDescaleV, batch, n_block * self.tile_n, head)
                acc_S = cute.make_rmem_tensor(shape_S, Float32)
                acc_dP = cute.make_rmem_tensor(shape_S, Float32)
                wgmma(tiled_mma_s, acc_S, tSrQ, tSrK[None, None, None, stage], True, -1)
                wgmma(tiled_mma_s, acc_dP, tSrdO, tSrV[None, None, None, stage], True, 1)
                if const_expr(self.two_direction):
                    # Descales per token: the scores' columns are this n-block's keys.
                    k0 = k_start + n_block * self.tile_n
                    columns = cute.size(tScS_rc.shape[1])
                    tokens = (dq_rows, tile_token_descales(mDescaleK, k0, k_last, head, columns), ddo_rows,
                              tile_token_descales(mDescaleV, k0, k_last, head, columns))
                    p_and_g(self, acc_S, acc_dP, stage_of(tSsRab, stage), shape_S, alpha, tokens=tokens)
                else:
                    p_and_g(self, acc_S, acc_dP, stage_of(tSsRab, stage), shape_S, alpha, qk_descales=(dq, dk))
                if not masks.tile_is_full(spec, seq, m_block, n_block, self.tile_m, self.tile_n, KERNEL_OPS):
                    acc_rc = cute.make_tensor(acc_dP.iterator, wgmma_acc_rows_cols(acc_dP.layout))
                    apply_mask_rows_cols(acc_rc, tScS_rc, spec, seq, row_first, n_block * self.tile_n)
                if const_expr(self.has_drab and self.two_direction):
                    self.write_drab(acc_dP, tSgdRab[None, None, None, n_block], tScS, drab_rows,
                                    drab_cols - n_block * self.tile_n, alpha * inv_scale * Float32(0.5), False)
                elif const_expr(self.has_drab):
                    self.write_drab(acc_dP, tSgdRab[None, None, None, n_block], tScS, drab_rows,
                                    drab_cols - n_block * self.tile_n, ddo * dv * alpha * inv_scale * Float32(0.5),
                                    False)
                if const_expr(self.two_direction):
                    words = scaled_fp8_words(acc_dP, Float32(1.0), Float32(G_AMAX_FLOOR), g_scale, g_rescale)
                else:
                    words = scaled_fp8_words(acc_dP, ddo * dv * dk, Float32(G_AMAX_FLOOR), g_scale, g_rescale)
                # The previous n-block's dQ GEMM retired (wait_group(0) below).
                rescale_rows_if_needed(acc_dQ, g_rescale)
                if const_expr(self.two_direction):
                    if moving:
                        move_column_units(((acc_dQ, tDcD_rc),), self.sColumnRows[None, None, moves % 2, wg], wg)
                        moves += 1
                    k_block_prev = k_block
                words_to_operand_a(words, rG)
                wgmma(tiled_mma_dq, acc_dQ, rG, tDrKt[None, None, None, stage], False, 0)
                pipe_kv.consumer_release(kv_state)
                kv_state = advanced(kv_state)
            if const_expr(persistent):
                # The last dQ GEMM waited for every WGMMA: sQ / sdO are free for the next m-block.
                pipe_q.consumer_release(q_state)
                q_state = advanced(q_state)

        epilogue_rows(acc_dQ, g_scale, alpha * inv_scale * Float32(0.5))
        if const_expr(self.two_direction):
            epilogue_columns(acc_dQ, self.descales[4], batch, head, k_block_prev, tDcD_rc, D)
        if const_expr(epilogue is not None):
            row0 = m_block * self.tile_m + wg * 64
            if seq.seqlen_q - row0 >= 64:
                store_rows_staged((acc_dQ,), *epilogue, self.grad_dtype, tidx % 128, wg, q_start + row0, head)
            else:
                store_dq(thr_mma_dq, acc_dQ, mdQ, self.grad_dtype, self.tile_m, D, q_start, head, m_block, seq)
        else:
            store_dq(thr_mma_dq, acc_dQ, mdQ, self.grad_dtype, self.tile_m, D, q_start, head, m_block, seq)
        return q_state, kv_state
