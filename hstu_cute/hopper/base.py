"""What every sm90 kernel shares: static config, the statics bundle, the kernel prologue, the
tile loop over single or persistent CTAs, and the staged (smem + TMA) epilogue."""

from __future__ import annotations

from collections import namedtuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .. import masks
from ..common.barriers import NamedBarrier
from ..common.seqinfo import SEQ_WORDS, SequenceInfo
from ..common.sm90 import (
    prefetch_tma_descriptors,
    sm90_register_split,
    sm90_smem_layout,
    sm90_tma_atom_tokens,
    store_acc_16bit_sw128_64cols,
)
from ..common.tile_scheduler import TILE_RING_STAGES, TileClaims, TileScheduler


class HstuSm90Base:
    """Static config (the compile key's fields) and shared plumbing of the sm90 kernels: one
    producer warp (warpgroup 0, warp 0; TMA loads) and ``num_mma_wg`` consumer warpgroups.

    The host-built objects a kernel body reads (smem layouts, tiled MMAs and copies) go to the
    kernel as one bundle parameter (:meth:`launch`) and are bound back to ``self`` inside it
    (:meth:`bind`): values of the host function cannot be used inside the kernel. The
    shared-storage struct type stays on ``self``."""

    def __init__(self, dtype, head_dim: int, mask: masks.MaskSpec, has_rab: bool, tile_m: int, tile_n: int,
                 num_stages: int, fast_silu: bool, num_mma_wg: int, persistent: bool = False,
                 dynamic_tiles: bool = False):
        self.dtype = dtype
        self.rab_dtype = dtype
        self.head_dim = head_dim
        self.mask = mask
        self.has_rab = has_rab
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_stages = num_stages
        self.fast_silu = fast_silu
        self.persistent = persistent
        # Persistent CTAs claim their tiles (common.tile_scheduler.TileClaims) instead of the snake.
        self.dynamic_tiles = dynamic_tiles and persistent
        # With claims, the producer also publishes each tile's sequence words (common.seqinfo
        # SEQ_WORDS) and the consumers read them from smem instead of global memory (kernels that
        # use them set this).
        self.publishes_seq = False
        # The Int32 words published with each claimed tile (common.seqinfo SEQ_WORDS; kernels
        # that publish more set this).
        self.tile_words = SEQ_WORDS
        self.num_mma_wg = num_mma_wg
        self.num_threads = 128 * (1 + num_mma_wg)
        self.num_mma_threads = 128 * num_mma_wg
        self.producer_regs, self.mma_regs = sm90_register_split(num_mma_wg)

    # ------------------------------------------------------------------------------------------
    # Host side (called from __call__ while tracing)
    # ------------------------------------------------------------------------------------------
    def rab_ring_layout(self):
        """The staged smem layout of rab tiles (queries, keys), or None without rab."""
        if const_expr(self.has_rab):
            return sm90_smem_layout(self.rab_dtype, self.tile_m, self.tile_n, self.num_stages)
        return None

    def tile_ring_storage(self) -> tuple[dict, dict]:
        """(barriers, words) of the claimed-tile ring for :func:`common.sm90.shared_storage` (a
        one-slot placeholder without claims)."""
        stages = TILE_RING_STAGES if const_expr(self.dynamic_tiles) else 1
        words = dict(sTile=stages)
        if const_expr(self.publishes_seq):
            words["sTileSeq"] = stages * self.tile_words
        return dict(mbar_tile=2 * stages), words

    def smem_elems(self, layout) -> int:
        """Elements of a smem tile; an absent tile keeps a small placeholder field."""
        return cute.cosize(layout) if layout is not None else 8

    def launch(self, *kernel_args, statics: dict, grid, stream):
        """Launch ``self.kernel(*kernel_args, statics)`` (``statics``: the host-built objects the
        kernel body reads, by attribute name; see the class docstring)."""
        bundle = namedtuple("KernelStatics", list(statics))(**statics)
        self.kernel(*kernel_args, bundle).launch(grid=grid, block=[self.num_threads, 1, 1],
                                                 smem=self.shared_storage.size_in_bytes(), stream=stream,
                                                 min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    def bind(self, statics):
        """Inside the kernel: the kernel-side values of the host-built objects, as attributes."""
        for name, value in zip(statics._fields, statics):
            setattr(self, name, value)

    @cute.jit
    def prologue(self, *tma_atoms):
        """(tidx, warp_idx): warp 0 prefetches the TMA descriptors."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            prefetch_tma_descriptors(*tma_atoms)
        return tidx, warp_idx

    def tile_claims(self, storage, walk, mTileCounter):
        """Every thread, before the warp roles split: the :class:`TileClaims` of this CTA (None
        without claims). Initializes the ring's mbarriers and syncs the CTA."""
        if const_expr(not self.dynamic_tiles):
            return None
        ring = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar_tile.data_ptr(), num_stages=TILE_RING_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads))
        sWords = None
        if const_expr(self.publishes_seq):
            sWords = storage.sTileSeq.get_tensor(cute.make_layout((TILE_RING_STAGES, self.tile_words), stride=(self.tile_words, 1)))
        return TileClaims(walk, mTileCounter, ring, storage.sTile.get_tensor(cute.make_layout(TILE_RING_STAGES)),
                          sWords)

    def sequence_info(self, seqs, scalars, mQ, mK) -> SequenceInfo:
        return SequenceInfo(self.mask, seqs, scalars, mQ.shape[0], mK.shape[0])

    @cute.jit
    def for_each_tile(self, walk, seqinfo, visit, args, states, claims=None, producer=False, visit_if=None):
        """``visit(*args, *tile, *states)`` on each live tile of this CTA (``live, tile`` as
        :meth:`tile_problem` returns them) for which ``visit_if(tile)`` holds (default: all).
        Persistent CTAs thread the states (pipeline states, counters) returned by ``visit`` from
        tile to tile. One tile per CTA: no tile loop (around the fused backward's m-block loop a
        tile loop made that loop slower, H100 D128 402-418 TF against 443-448).

        With ``claims`` (:class:`TileClaims`) the ``producer`` warp claims the tiles and publishes
        every live one (the consumers visit what it publishes), visiting those ``visit_if`` keeps."""
        problem = self.tile_problem
        if const_expr(claims is not None):
            if const_expr(producer):
                self.claim_tiles(claims, seqinfo, visit, args, states, visit_if)
            else:
                num_tiles, next_tile, walk = claims.num_tiles, claims.consumer_next, claims.walk
                tile, ring_state = claims.consumer_first()
                while tile < num_tiles:
                    live, coords = problem(walk, seqinfo, tile)
                    states = visit(*args, *coords, *states)
                    tile, ring_state = next_tile(tile, ring_state)
            return
        tiles = TileScheduler(walk)
        if const_expr(self.persistent):
            num_tiles, next_tile = tiles.num_tiles, tiles.next  # no method call on a loop-carried name
            tile = tiles.first()
            while tile < num_tiles:
                live, coords = problem(tiles, seqinfo, tile)
                if self.kept(live, coords, visit_if):
                    states = visit(*args, *coords, *states)
                tile = next_tile(tile)
        else:
            live, coords = problem(tiles, seqinfo, tiles.first())
            if self.kept(live, coords, visit_if):
                visit(*args, *coords, *states)

    def extra_tile_words(self, coords):
        """Words published with a claimed tile after its sequence's (none here; see
        :attr:`tile_words`)."""
        return ()

    def kept(self, live, coords, visit_if):
        """``live``, and ``visit_if(coords)`` where given."""
        if const_expr(visit_if is None):
            return live
        return live & visit_if(coords)

    @cute.jit
    def claim_tiles(self, claims, seqinfo, visit, args, states, visit_if=None):
        """The producer warp's side of :meth:`for_each_tile` with claims: the next claim goes out
        before this tile's loads, so its latency hides behind them."""
        ring_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, TILE_RING_STAGES)
        # No method call on a loop-carried name: the bound methods are taken out first.
        num_tiles, claim, claimed, publish, walk = (claims.num_tiles, claims.claim, claims.claimed, claims.publish,
                                                     claims.walk)
        to_words = seqinfo.to_words
        tile = claims.first()
        while tile < num_tiles:
            ticket = claim()
            live, coords = self.tile_problem(walk, seqinfo, tile)
            if live:
                words = ()
                if const_expr(self.publishes_seq):
                    words = to_words(coords[3], coords[4], coords[5]) + self.extra_tile_words(coords)
                ring_state = publish(ring_state, tile, words)
                if const_expr(visit_if is None):
                    states = visit(*args, *coords, *states)
                else:
                    if visit_if(coords):
                        states = visit(*args, *coords, *states)
            tile = claimed(ticket)
        publish(ring_state, num_tiles)
        claims.finish()


#: Shared memory a CTA may use on sm90.
SMEM_LIMIT = 227 * 1024


class StagedEpilogue:
    """Output tiles stored through shared memory and TMA (the forward and the FP8 backward
    kernels): a warpgroup's 64 rows of each output are written to a swizzled smem tile and one
    TMA store takes them to global memory, in the background of the next tile. Register stores
    (two columns per store, 16 bytes per row and instruction) wait on the store queue: 12 % of
    the FP8 dK/dV kernel's warp samples (H100 ncu, B8 N4096 D128 causal, session 19), and ~1900
    cycles of each forward tile's epilogue (clock trace, session 23). Tiles whose rows run past
    the sequence keep the register stores: a TMA store would write the next sequence's rows."""

    def staged_epilogue(self, storage_of, outputs: tuple, cols: int, dtype):
        """Plain Python, in ``__call__``: ``storage_of(extra)`` builds the shared storage with the
        ``extra`` buffers. Where one 64 x ``cols`` tile of ``dtype`` per warpgroup and output fits
        beside the rest: (storage, smem layout (64, cols, 2 len(outputs)), ((atom, tma tensor) per
        output)); else, and where ``cols`` is not a multiple of 64 (the tile is written in 128-byte
        swizzled blocks of 64 16-bit columns: D32 keeps the register stores), (storage, None, None)."""
        storage = storage_of({})
        if cols % 64 != 0:
            return storage, None, None
        elem = dtype.width // 8
        tiles = 2 * len(outputs)
        # 1024: room for the new buffer's alignment.
        if storage.size_in_bytes() + tiles * 64 * cols * elem > SMEM_LIMIT - 1024:
            return storage, None, None
        layout, atoms = self.staged_tiles(outputs, cols, dtype)
        return storage_of(dict(sEpi=(dtype, cute.cosize(layout)))), layout, atoms

    @staticmethod
    def staged_tiles(outputs: tuple, cols: int, dtype):
        """Plain Python, in ``__call__``: the staged tiles' smem layout (64, ``cols``, 2
        len(``outputs``)), one 64-row tile per warpgroup and output, and the TMA store (atom, tma
        tensor) of each output; wherever the tiles lie in smem."""
        layout = sm90_smem_layout(dtype, 64, cols, 2 * len(outputs))
        stage = cute.slice_(layout, (None, None, 0))
        atoms = tuple(sm90_tma_atom_tokens(cpasync.CopyBulkTensorTileS2GOp(), m, stage, 64, cols) for m in outputs)
        return layout, atoms


@cute.jit
def copy_staged_rows(sTile, mOut, row0: Int32, head: Int32, rows: Int32, tid_in_wg: Int32, cols: cutlass.Constexpr,
                     col_block=0):
    """The first ``rows`` (< 64) rows of a warpgroup's staged tile ``sTile`` (64 rows, ``cols``
    16-bit columns in 64-column blocks of 128-byte swizzled rows, as :func:`store_rows_staged`
    writes it) to rows ``row0``.. of head ``head`` of the (T, H, D) ``mOut``, columns block
    ``col_block``: what the TMA store writes, cut at the sequence's end. 16 bytes per thread and
    step, a warp's steps on whole rows."""
    base = sTile.iterator.toint()
    chunks = cols // 8  # 16-byte chunks per row
    for i in cutlass.range_constexpr(64 * chunks // 128):
        chunk = tid_in_wg + 128 * i
        row = chunk // chunks
        c8 = chunk % chunks
        if row < rows:
            saddr = base + (c8 // 8) * (64 * 128) + row * 128 + ((c8 % 8) ^ (row % 8)) * 16
            src = cute.make_tensor(cute.make_ptr(Int32, saddr, cute.AddressSpace.smem, assumed_align=16),
                                   cute.make_layout(4))
            gaddr = (mOut.iterator + ((row0 + row) * mOut.stride[0] + head * mOut.stride[1] + col_block * cols
                                      + c8 * 8)).toint()
            dst = cute.make_tensor(cute.make_ptr(Int32, gaddr, cute.AddressSpace.gmem, assumed_align=16),
                                   cute.make_layout(4))
            cute.autovec_copy(src, dst)


@cute.jit
def store_rows_staged(accs, sEpi, epi_atoms, dtype: cutlass.Constexpr, tid_in_wg: Int32, wg: Int32, row0: Int32,
                      head: Int32, col_block=0, rows=None, outputs=None):
    """:class:`StagedEpilogue`: this warpgroup's (64, cols) fp32 accumulators ``accs`` (one per
    output of ``epi_atoms``) in ``dtype`` to rows ``row0``.. of their (T, H, D) outputs, columns
    block ``col_block``. Waits until the warpgroup's previous TMA stores have read its tiles.
    ``rows`` (with ``outputs``, the (T, H, D) tensors): the warpgroup's rows inside the sequence;
    below 64 the rows go out through :func:`copy_staged_rows` instead of the TMA store."""
    cols = cute.size(sEpi, mode=[1])
    if tid_in_wg < 32:
        cute.arch.cp_async_bulk_wait_group(0, read=True)
    cute.arch.barrier(barrier_id=NamedBarrier.ZERO_ROWS_WG0 + wg, number_of_threads=128)
    for t in cutlass.range_constexpr(len(accs)):
        rOut = cute.make_rmem_tensor(accs[t].layout, dtype)
        rOut.store(accs[t].load().to(dtype))
        base = sEpi[None, None, 2 * t + wg].iterator.toint()
        # 64-column blocks of the tile lie one after another (64 rows x 128 bytes each).
        for h in cutlass.range_constexpr(cols // 64):
            block = cute.make_tensor(cute.make_ptr(dtype, base + h * 64 * 128, cute.AddressSpace.smem,
                                                   assumed_align=1024), cute.make_layout(1))
            store_acc_16bit_sw128_64cols(cute.make_tensor(rOut.iterator + 32 * h, cute.make_layout((2, 2, 8))),
                                         block, tid_in_wg, 0)
    cute.arch.fence_view_async_shared()
    cute.arch.barrier(barrier_id=NamedBarrier.ZERO_ROWS_WG0 + wg, number_of_threads=128)
    if const_expr(rows is None):
        tma_store_staged(sEpi, epi_atoms, len(accs), tid_in_wg, wg, row0, head, col_block, cols)
    else:
        if rows >= 64:
            tma_store_staged(sEpi, epi_atoms, len(accs), tid_in_wg, wg, row0, head, col_block, cols)
        else:
            for t in cutlass.range_constexpr(len(accs)):
                copy_staged_rows(sEpi[None, None, 2 * t + wg], outputs[t], row0, head, rows, tid_in_wg, cols,
                                 col_block)


@cute.jit
def tma_store_staged(sEpi, epi_atoms, count: cutlass.Constexpr, tid_in_wg: Int32, wg: Int32, row0: Int32,
                     head: Int32, col_block, cols: cutlass.Constexpr):
    """The TMA stores of :func:`store_rows_staged` (one warp issues them), committed as one group."""
    if tid_in_wg < 32:
        for t in cutlass.range_constexpr(count):
            atom, tma_out = epi_atoms[t]
            gOut = cute.local_tile(cute.domain_offset((row0, 0), tma_out[None, None, head]), (64, cols), (0, col_block))
            tSs, tGg = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                             cute.group_modes(sEpi[None, None, 2 * t + wg], 0, 2),
                                             cute.group_modes(gOut, 0, 2))
            cute.copy(atom, tSs, tGg)
        cute.arch.cp_async_bulk_commit_group()
