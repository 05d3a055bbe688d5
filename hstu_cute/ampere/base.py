"""What the sm80 kernels (:mod:`.fwd`, :mod:`.bwd`) share: their static config, the host-side
atoms (the mma.sync tiled MMA, 128-bit cp.async loads and stores, the rab chunk copy, swizzled
smem layouts), the launch, and the device-side tile loads and staged stores."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp

from .. import masks
from ..common.seqinfo import ScoreScalars, SequenceArgs, SequenceInfo
from ..common.sm80 import smem_layout_atom


class Sm80Kernel:
    """Static config of an sm80 kernel: ``num_warps`` warps, all of which load (cp.async) and
    compute (mma.sync m16n8k16); ``rab_vec`` rab elements per load (a class or instance field)."""

    def __init__(self, dtype, head_dim: int, mask: masks.MaskSpec, has_rab: bool, tile_m: int, tile_n: int,
                 num_warps: int, fast_silu: bool):
        self.dtype, self.head_dim, self.mask, self.has_rab = dtype, head_dim, mask, has_rab
        self.tile_m, self.tile_n, self.fast_silu = tile_m, tile_n, fast_silu
        self.num_warps, self.num_threads = num_warps, num_warps * 32

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    def _mma(self, warps_m: int, warps_n: int):
        # Each warp covers 16 x 16 of the tile per step (two n8 atoms), so ldmatrix x4 feeds it.
        return cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)),
            (warps_m, warps_n, 1),
            permutation_mnk=(warps_m * 16, warps_n * 16, 16),
        )

    def _atoms(self):
        """(smem atom of the (rows, head_dim) tiles, their 128-bit cp.async tiled copy, the
        128-bit register -> global tiled copy of the outputs, the rab tiled copy or None, the
        tiled MMA with all warps along M)."""
        atom = smem_layout_atom(self.dtype, self.head_dim)
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
            if const_expr(self.rab_vec >= 2):
                rab_atom = cute.make_copy_atom(
                    cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), self.dtype,
                    num_bits_per_copy=self.rab_vec * self.dtype.width,
                )
            else:
                rab_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                               num_bits_per_copy=self.dtype.width)
            rab_threads_per_row = min(self.tile_n // self.rab_vec, self.num_threads)
            gmem_copy_rab = cute.make_tiled_copy_tv(
                rab_atom,
                cute.make_ordered_layout((self.num_threads // rab_threads_per_row, rab_threads_per_row), order=(1, 0)),
                cute.make_layout((1, self.rab_vec)),
            )
        return atom, gmem_copy, gmem_store, gmem_copy_rab, self._mma(self.num_warps, 1)

    def _tile_layout(self, atom, rows: int, stages: int | None = None):
        """Smem layout of a (rows, head_dim) tile, or of ``stages`` of them."""
        if stages is None:
            return cute.tile_to_shape(atom, (rows, self.head_dim), (0, 1))
        return cute.tile_to_shape(atom, (rows, self.head_dim, stages), (0, 1, 2))

    def _rab_layout(self, stages: int):
        """Smem layout of ``stages`` (tile_m, tile_n) rab tiles, or None without rab."""
        if const_expr(not self.has_rab):
            return None
        return cute.tile_to_shape(smem_layout_atom(self.dtype, self.tile_n), (self.tile_m, self.tile_n, stages),
                                  (0, 1, 2))

    def _launch(self, *kernel_args, grid, stream):
        """Launch ``self.kernel``; its last argument is the SharedStorage struct."""
        self.kernel(*kernel_args).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=kernel_args[-1].size_in_bytes(), stream=stream
        )

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    def _sequence(self, seqs: SequenceArgs, scalars: ScoreScalars, mQ: cute.Tensor, mK: cute.Tensor, batch: Int32):
        """(q_start, k_start, seqlen_q, seqlen_k, mask_of) of sequence ``batch`` (offsets clamped
        to the tensors: no input can address outside). ``mask_of(batch, seqlen_q, seqlen_k)``
        gives its mask: a bound method, so that a runtime branch calls no method on a local."""
        seqinfo = SequenceInfo(self.mask, seqs, scalars, mQ.shape[0], mK.shape[0])
        return (*seqinfo.bounds(batch), seqinfo.mask)

    def _head_tiles(self, head: Int32, *tiles):
        """Per ``(mX, start, rows, block)``: the (rows, head_dim) tiles of one head of a (tokens,
        heads, head_dim) tensor from token ``start`` on, tile ``block`` or all of them (``block``
        None). Token offsets are formed in 64 bits (stride mode 0 is Int64), all of them before
        the tiles."""
        views = [cute.domain_offset((start, 0), mX[None, head, None]) for mX, start, _, _ in tiles]
        return [cute.local_tile(v, (rows, self.head_dim), (block, 0)) for v, (_, _, rows, block) in zip(views, tiles)]

    def _head_tile(self, mX: cute.Tensor, start: Int32, head: Int32, rows: int, block):
        return self._head_tiles(head, (mX, start, rows, block))[0]

    def _rab_slab(self, mRab: cute.Tensor, batch: Int32, head: Int32) -> cute.Tensor:
        """The (L, L) slab of rab (or drab) for (batch, head): its only head when it has one."""
        return mRab[batch, cutlass.select_(mRab.shape[1] > 1, head, Int32(0)), None, None]

    def _rab_tiles(self, slab: cute.Tensor, row_offset: Int32, coord):
        """The (tile_m, tile_n) tiles ``coord`` of a slab, whose rows are key coordinates: query i
        reads row row_offset + i."""
        return cute.local_tile(cute.domain_offset((row_offset, 0), slab), (self.tile_m, self.tile_n), coord)

    def _to_dtype(self, acc: cute.Tensor) -> cute.Tensor:
        """An fp32 accumulator converted to the 16-bit dtype (same layout)."""
        r = cute.make_fragment_like(acc, self.dtype)
        r.store(acc.load().to(self.dtype))
        return r

    def _zero_acc(self, thr_mma, shape_mn) -> cute.Tensor:
        """A zeroed fp32 accumulator of ``thr_mma``'s C layout for a ``shape_mn`` tile."""
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C(shape_mn), Float32)
        acc.fill(0.0)
        return acc

    @cute.jit
    def load_rows(self, gmem_copy, tXgX, tXsX, tXcX, row_limit: Int32, zero_fill: cutlass.Constexpr[bool],
                  src=(), dst=()):
        """Rows < row_limit of a tile (``src`` and ``dst`` index the modes past the copy's: the
        n-block, the stage); the others zero-filled (finite) or left alone."""
        for m in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
            if tXcX[0, m, 0][0] < row_limit:
                cute.copy(gmem_copy, tXgX[(None, m, None) + src], tXsX[(None, m, None) + dst])
            elif const_expr(zero_fill):
                tXsX[(None, m, None) + dst].fill(0)

    @cute.jit
    def load_rab(self, gmem_copy, tRgR, tRsR, tRcR, row_limit: Int32, col_limit: Int32,
                 zero_fill: cutlass.Constexpr[bool], src=(), dst=()):
        """The rab chunks of a tile that lie in rows < row_limit and columns < col_limit, each
        predicated on its first column; the others zero-filled or left alone. ``src`` / ``dst``
        as in :meth:`load_rows`."""
        if row_limit < self.tile_m or col_limit < self.tile_n:
            for m in cutlass.range_constexpr(cute.size(tRsR.shape[1])):
                for n in cutlass.range_constexpr(cute.size(tRsR.shape[2])):
                    if tRcR[0, m, n][0] < row_limit and tRcR[0, m, n][1] < col_limit:
                        cute.copy(gmem_copy, tRgR[(None, m, n) + src], tRsR[(None, m, n) + dst])
                    elif const_expr(zero_fill):
                        tRsR[(None, m, n) + dst].fill(0)
        else:
            cute.copy(gmem_copy, tRgR[(None, None, None) + src] if const_expr(len(src) > 0) else tRgR,
                      tRsR[(None, None, None) + dst] if const_expr(len(dst) > 0) else tRsR)

    @cute.jit
    def store_rows(self, gmem_store, tiled_mma, acc, sStage, gOut, tidx, row_limit: Int32, scale=None):
        """acc (fp32, C layout; times ``scale`` when given) -> dtype -> smem staging -> 128-bit
        stores of rows < row_limit. The caller barriers before (sStage free) and after (sStage
        reusable)."""
        rO = cute.make_fragment_like(acc, self.dtype)
        if const_expr(scale is None):
            rO.store(acc.load().to(self.dtype))
        else:
            rO.store((acc.load() * scale).to(self.dtype))
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
