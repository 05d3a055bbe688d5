"""How the slot quantizer (:mod:`hstu_cute.hopper.quantize_slots`) quantizes one block of 128
tokens of one sequence and head for FP8 quant modes 0-5: a block's sequence is known from the
grid (no search) and its scale group is one CTA (or, mode 1, lies inside one).

Roles (``hstu_cute.quantize`` is the PyTorch description they match bit for bit):

* ``"fused"`` (mode 2, a group is the block): the block's amax, its scale
  ``max(amax * (1 / 448), 1e-6)`` written to the (B, blocks, H) table, and the cast
  ``e4m3(x * (1 / scale))``, in one pass over the input;
* ``"cast"`` (modes 3-5): the cast by the group's scale, read from its table (the descale table
  the kernels read: no second table), once the cooperative launch of
  :class:`~hstu_cute.hopper.quantize_slots.QuantizeSlotsSm90` has maxed every block of the tensor
  into it (slot role ``"group"``; :func:`BlockQuantizer.load_block` and
  :func:`BlockQuantizer.thread_amax` are that pass's pieces);
* ``"token"`` (mode 1, q and k): a scale per (token, head) over D, written to a (T, H) table, and
  the cast, in one pass (a token's D / 16 chunks are neighbouring lanes of one warp);
* ``"column"`` (mode 1, V, transposed only): a scale per (block, head, dim) over the block's
  tokens, written with its reciprocal to a (B, blocks, H, 2, D) table (the forward rescales its
  output's columns by dv_old / dv_new without a division), and the cast to V^T, in one pass;
* ``"unit"`` (mode 0): the saturating cast, no scale.

A block writes its (T, H, D) e4m3 copy (``plain``), V^T (H, D, W) (``transposed``) or both from
one read. The forward reads V only through V^T (layout, key order included:
:mod:`hstu_cute.hopper.vt`; a block starts 16-aligned in its sequence), the FP8 backward reads the
token-contiguous Q^T, K^T and dO^T in the same layout. The block goes through shared memory as
(D, 128 tokens) and leaves as 16-byte runs of keys; the columns past the sequence inside its last
run are zeros. The runs of a staging row are swizzled by the row's 16-row group: the 16 rows a
thread writes (one per byte of its chunk) would otherwise share a bank with every other chunk's
(D128 V^T 29 us against 19 for the (T, H, D) cast, D256 100 against 37).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..common.fp8 import div_rn
from ..fp8_format import BLOCK_TOKENS, E4M3_MAX, SCALE_FLOOR, vt_column_start, vt_key_column

# Elements per thread and chunk: 16 e4m3 bytes out (two 16-byte loads of a 16-bit input).
VEC = 16
# (D, tokens) staging rows padded to keep 16-byte alignment and spread the banks.
_ROW_PAD = 16
# The slot roles of a launch (hstu_cute.hopper.quantize_slots); a block is quantized by "cast"
# for "group" and by its own role otherwise.
QUANT_ROLES = ("fused", "group", "token", "column", "unit")


class BlockQuantizer:
    """The block body of the slot quantizer (256 threads per CTA; no kernel of its own): each row
    of the block (a token) is ``D / 16`` chunks of 16 elements, ``4096 / D`` rows per pass,
    ``D / 32`` passes: a thread holds ``D / 2`` input elements."""

    def __init__(self, dtype, head_dim: int):
        self.dtype = dtype
        self.head_dim = head_dim
        self.num_threads = 256
        self.chunks = head_dim // VEC
        self.rows_per_pass = self.num_threads // self.chunks
        self.passes = BLOCK_TOKENS // self.rows_per_pass
        # Butterfly offsets between the lanes of one token (its chunks) and between the lanes of
        # one chunk (the warp's tokens).
        self.token_lanes = tuple(self.chunks >> b for b in range(1, self.chunks.bit_length()))
        self.column_lanes = tuple(self.chunks << b for b in range((32 // self.chunks).bit_length() - 1))

    @cute.jit
    def quantize_block(self, role: cutlass.Constexpr, plain: cutlass.Constexpr, transposed: cutlass.Constexpr, mX,
                       mOffsets, mScale, mO, mVt, warp_max, dim_max, sT, tidx: Int32, block: Int32, batch: Int32,
                       head: Int32):
        """One block: load, scale, cast, store the (T, H, D) copy (``plain``) and/or V^T
        (``transposed``). ``warp_max`` (one fp32 per warp), ``dim_max`` ((D, warps) fp32; role
        "column") and ``sT`` ((D, 128 + pad) e4m3; ``transposed``): the shared memory to use."""
        seq_start, row0, rows = self.block_rows(mOffsets, batch, block)
        chunk = tidx % self.chunks
        row_in_pass = tidx // self.chunks
        values = self.load_block(mX, seq_start + row0, rows, head, chunk, row_in_pass)

        # The multiplier of each element: one per group, (passes,) per token or (VEC,) per dim.
        if const_expr(role == "token"):
            inverse = self.token_inverse_scales(values, mScale, row_in_pass, chunk, seq_start + row0, rows, head)
        elif const_expr(role == "column"):
            inverse = self.column_inverse_scales(values, mScale, tidx, chunk, row_in_pass, batch, block, head,
                                                 dim_max)
        elif const_expr(role == "cast"):
            scale = mScale[batch, block, head]
        elif const_expr(role == "fused"):
            scale = self.scale_of(self.block_amax(values, tidx, warp_max))
            if tidx == 0:
                mScale[batch, block, head] = scale
        out = cute.make_rmem_tensor(cute.make_layout((VEC, self.passes)), cutlass.Float8E4M3FN)
        if const_expr(role == "token"):
            for i in cutlass.range_constexpr(self.passes):
                out[None, i].store((values[None, i].load().to(Float32) * inverse[i]).to(cutlass.Float8E4M3FN))
        elif const_expr(role == "column"):
            scaled = cute.make_rmem_tensor(cute.make_layout((VEC, self.passes)), Float32)
            for i in cutlass.range_constexpr(self.passes):
                for e in cutlass.range_constexpr(VEC):
                    scaled[e, i] = Float32(values[e, i]) * inverse[e]
            out.store(scaled.load().to(cutlass.Float8E4M3FN))
        elif const_expr(role == "unit"):
            # quant_mode 0: the saturating cast, as torch's clamp-and-cast (tests: bit for bit).
            out.store(values.load().to(cutlass.Float8E4M3FN))
        else:
            # x * (1 / scale), as hstu_cute.quantize computes it (a division per element was
            # the quantizers' main cost).
            out.store((values.load().to(Float32) * div_rn(Float32(1.0), scale)).to(cutlass.Float8E4M3FN))
        if const_expr(plain):
            for i in cutlass.range_constexpr(self.passes):
                r = row_in_pass + i * self.rows_per_pass
                if r < rows:
                    cute.autovec_copy(out[None, i],
                                      cute.local_tile(mO[seq_start + row0 + r, head, None], (VEC,), (chunk,)))
        if const_expr(transposed):
            self.store_transposed(out, mVt, tidx, chunk, row_in_pass, seq_start, batch, head, row0, rows, sT)

    @staticmethod
    @cute.jit
    def block_rows(mOffsets, batch: Int32, block: Int32):
        """(its sequence's first token, the block's first row in it, its token count: <= 0 past
        the sequence) of a block."""
        seq_start = mOffsets[batch]
        row0 = block * BLOCK_TOKENS
        return seq_start, row0, cutlass.min(mOffsets[batch + 1] - seq_start - row0, BLOCK_TOKENS)

    @cute.jit
    def load_block(self, mX, token0: Int32, rows: Int32, head: Int32, chunk: Int32, row_in_pass: Int32) -> cute.Tensor:
        """The thread's (VEC, passes) elements of the block's ``rows`` tokens from ``token0``
        (zeros past them)."""
        values = cute.make_rmem_tensor(cute.make_layout((VEC, self.passes)), self.dtype)
        values.fill(0.0)
        for i in cutlass.range_constexpr(self.passes):
            r = row_in_pass + i * self.rows_per_pass
            if r < rows:
                cute.autovec_copy(cute.local_tile(mX[token0 + r, head, None], (VEC,), (chunk,)), values[None, i])
        return values

    @staticmethod
    def scale_of(amax: Float32) -> Float32:
        return cute.arch.fmax(amax * Float32(1.0 / E4M3_MAX), Float32(SCALE_FLOOR))

    @cute.jit
    def token_inverse_scales(self, values: cute.Tensor, mScale, row_in_pass: Int32, chunk: Int32, token0: Int32,
                             rows: Int32, head: Int32) -> cute.Tensor:
        """Mode 1, q and k: each of the thread's tokens' scale (amax over its D / 16 chunks, held by
        ``chunks`` neighbouring lanes) into the (T, H) table; returns 1 / scale per pass."""
        inverse = cute.make_rmem_tensor(cute.make_layout(self.passes), Float32)
        for i in cutlass.range_constexpr(self.passes):
            amax = Float32(0.0)
            for e in cutlass.range_constexpr(VEC):
                x = Float32(values[e, i])
                amax = cute.arch.fmax(amax, cute.arch.fmax(x, -x))
            for offset in self.token_lanes:
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset))
            scale = self.scale_of(amax)
            r = row_in_pass + i * self.rows_per_pass
            if chunk == 0 and r < rows:
                mScale[token0 + r, head] = scale
            inverse[i] = div_rn(Float32(1.0), scale)
        return inverse

    @cute.jit
    def column_inverse_scales(self, values: cute.Tensor, mScale, tidx: Int32, chunk: Int32, row_in_pass: Int32,
                              batch: Int32, block: Int32, head: Int32, dim_max: cute.Tensor) -> cute.Tensor:
        """Mode 1, V: the scale of each of the thread's 16 dims over the block's tokens (lanes with
        the same chunk in a warp, then the 8 warps through shared memory) and 1 / scale into the
        (B, blocks, H, 2, D) table; returns 1 / scale per dim. ``dim_max``: a (D, warps) fp32
        smem tensor."""
        amax = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
        for e in cutlass.range_constexpr(VEC):
            m = Float32(0.0)
            for i in cutlass.range_constexpr(self.passes):
                x = Float32(values[e, i])
                m = cute.arch.fmax(m, cute.arch.fmax(x, -x))
            for offset in self.column_lanes:
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset))
            amax[e] = m
        warps = self.num_threads // 32
        lane = tidx % 32
        if lane < self.chunks:
            for e in cutlass.range_constexpr(VEC):
                dim_max[chunk * VEC + e, tidx // 32] = amax[e]
        cute.arch.sync_threads()
        inverse = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
        for e in cutlass.range_constexpr(VEC):
            m = dim_max[chunk * VEC + e, 0]
            for w in cutlass.range_constexpr(1, warps):
                m = cute.arch.fmax(m, dim_max[chunk * VEC + e, w])
            scale = self.scale_of(m)
            inverse[e] = div_rn(Float32(1.0), scale)
            if row_in_pass == 0:
                mScale[batch, block, head, 0, chunk * VEC + e] = scale
                mScale[batch, block, head, 1, chunk * VEC + e] = inverse[e]
        return inverse

    @cute.jit
    def block_amax(self, values: cute.Tensor, tidx: Int32, warp_max: cute.Tensor) -> Float32:
        """max |x| over the CTA's block (rows past the sequence hold zeros). ``warp_max``: an
        fp32 smem tensor of one entry per warp."""
        return self.cta_max(self.thread_amax(values, Float32(0.0)), tidx, warp_max)

    @staticmethod
    @cute.jit
    def thread_amax(values: cute.Tensor, amax: Float32) -> Float32:
        """max(amax, max |x| over the thread's ``values``)."""
        for i in cutlass.range_constexpr(cute.size(values)):
            x = Float32(values[i])
            amax = cute.arch.fmax(amax, cute.arch.fmax(x, -x))
        return amax

    @cute.jit
    def cta_max(self, amax: Float32, tidx: Int32, warp_max: cute.Tensor) -> Float32:
        """The max of every thread's ``amax`` (``warp_max``: one fp32 smem entry per warp)."""
        for offset in (16, 8, 4, 2, 1):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset))
        if tidx % 32 == 0:
            warp_max[tidx // 32] = amax
        cute.arch.sync_threads()
        amax = warp_max[0]
        for w in cutlass.range_constexpr(1, self.num_threads // 32):
            amax = cute.arch.fmax(amax, warp_max[w])
        return amax

    @cute.jit
    def store_transposed(self, out: cute.Tensor, mVt, tidx: Int32, chunk: Int32, row_in_pass: Int32,
                         seq_start: Int32, batch: Int32, head: Int32, row0: Int32, rows: Int32, sT: cute.Tensor):
        """The block's e4m3 values (zeros past the sequence) to V^T through a (D, 128) smem tile
        (``sT``, (D, 128 + pad) e4m3): 16-byte runs of keys, the runs
        that start inside the sequence."""
        D = self.head_dim
        stride = BLOCK_TOKENS + _ROW_PAD
        for i in cutlass.range_constexpr(self.passes):
            r = row_in_pass + i * self.rows_per_pass
            for e in cutlass.range_constexpr(VEC):
                sT[chunk * VEC + e, vt_key_column(r) ^ ((chunk % 8) * VEC)] = out[e, i]
        cute.arch.sync_threads()
        runs = BLOCK_TOKENS // VEC
        column0 = vt_column_start(seq_start, batch) + row0
        for i in cutlass.range_constexpr(D * runs // self.num_threads):
            item = tidx + i * self.num_threads
            d = item // runs
            run = item - d * runs
            if run * VEC < rows:
                src = cute.make_tensor(sT.iterator + d * stride + (run ^ ((d // VEC) % 8)) * VEC,
                                       cute.make_layout(VEC))
                dst_addr = (mVt.iterator + (head * mVt.stride[0] + d * mVt.stride[1] + column0 + run * VEC)).toint()
                dst = cute.make_tensor(cute.make_ptr(cutlass.Float8E4M3FN, dst_addr, cute.AddressSpace.gmem,
                                                     assumed_align=16), cute.make_layout(VEC))
                cute.autovec_copy(src, dst)
