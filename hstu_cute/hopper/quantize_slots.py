"""The quantizer of FP8 quant modes 0-5: several tensors in one launch.

A slot is one input tensor, its role and the copies it writes: ``plain`` (T, H, D) e4m3 and/or
``transposed`` V^T (H, D, W); a slot that writes both reads its input once. One CTA per (block
of 128 tokens, sequence, slot and head); each block is quantized by
:class:`~hstu_cute.hopper.quantize.BlockQuantizer`'s body (roles and layouts there), with shared
memory allocated once for the largest slot. What a call quantizes, by quant mode and
purpose, is :func:`hstu_cute.fp8_recipe.quant_launches`: a training call's forward writes q, k and
v with both copies (the backward's Q^T, K^T and e4m3 V come from the same pass), the backward
then quantizes dO alone.

Why: each launch costs the host ~15 us (H100 host, docs/dev/perf-log.md session 18), and a mode-0 or
mode-2 training step made 8 quantizer launches (3 in the forward, 5 in the backward) with one
tensor per launch where slots make 2. H100, B8 N4096 H4 D128 causal, same lease (session 21):
mode-2 training step 0.945 ms against 1.026, mode 5 1.039 against 1.976; host time of a tiny
mode-2 step 763 us against 1132.

Role ``"group"`` (modes 3-5): a group's scale needs every block of the tensor before any block can
be cast, which took two launches (an amax pass over q, k and v, then a cast pass reading them
again from HBM: ~240 MB at B8 N4096 H4 D128). With any "group" slot the launch is cooperative
(the driver starts every CTA at once or fails the launch, so a grid-wide barrier cannot hang) and
persistent (:func:`ctas_per_sm`); per slot in order its CTAs max the scales of all its
blocks, meet at a grid barrier, and cast the blocks in the reverse order, so that the cast reads
the tensor (32 MB in bf16 there) while the 50 MB L2 still holds most of it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..fp8_format import BLOCK_TOKENS, QUANT_MAX_SLOTS
from .quantize import _ROW_PAD, QUANT_ROLES, BlockQuantizer


def ctas_per_sm(head_dim: int) -> int:
    """Persistent CTAs per SM of a cooperative ("group") launch, 256 threads each, also the
    launch's minimum CTAs per SM (ptxas keeps the registers within it): a thread holds D / 2
    elements; D <= 128 fits two CTAs in 128 registers, D256 takes up to 255 (one). H100, mode 5
    at D128 (ncu, docs/dev/perf-log.md session 25): 86 us with two CTAs, 107 with three and 139 with
    four (ptxas spills at 85 and 64 registers). A cooperative launch larger than the GPU holds
    fails instead of starting."""
    return 2 if head_dim <= 128 else 1


def check_slot(role: str, plain: bool, transposed: bool) -> None:
    """What each role may write: token only (T, H, D), column only V^T, the others either or
    both."""
    assert role in QUANT_ROLES, role
    if role == "token":
        assert plain and not transposed
    elif role == "column":
        assert transposed and not plain
    else:
        assert plain or transposed


class QuantizeSlotsSm90(BlockQuantizer):
    """256 threads per CTA, a block as :class:`BlockQuantizer` holds it.

    ``slots``: up to :data:`~hstu_cute.fp8_format.QUANT_MAX_SLOTS` ``(role, plain,
    transposed)``; the grid's z runs over slot-major (slot, head) pairs, so the hardware starts
    the slots in order. Per slot ``i`` the arguments are its input ``mX{i}`` (T, H, D), its
    sequence offsets, its scale table, its (T, H, D) and V^T outputs (None where not written) and
    its block count (0 skips the slot; the grid covers the largest). All slots share H and the
    batch size."""

    def __init__(self, dtype, head_dim: int, slots: tuple):
        assert 1 <= len(slots) <= QUANT_MAX_SLOTS == 4
        for slot in slots:
            check_slot(*slot)
        super().__init__(dtype, head_dim)
        self.slots = tuple(tuple(s) for s in slots)
        self.warps = self.num_threads // 32
        self.any_transposed = any(t for _, _, t in self.slots)
        self.any_column = any(role == "column" for role, _, _ in self.slots)
        self.cooperative = any(role == "group" for role, _, _ in self.slots)
        assert not self.cooperative or all(role == "group" for role, _, _ in self.slots)

    @cute.jit
    def __call__(self, mX0, mOffsets0, mScale0, mO0, mVt0, num_blocks0,
                 mX1, mOffsets1, mScale1, mO1, mVt1, num_blocks1,
                 mX2, mOffsets2, mScale2, mO2, mVt2, num_blocks2,
                 mX3, mOffsets3, mScale3, mO3, mVt3, num_blocks3, mBarrier, num_sms, stream):
        kernel = self.kernel(mX0, mOffsets0, mScale0, mO0, mVt0, num_blocks0, mX1, mOffsets1, mScale1, mO1, mVt1,
                             num_blocks1, mX2, mOffsets2, mScale2, mO2, mVt2, num_blocks2, mX3, mOffsets3, mScale3,
                             mO3, mVt3, num_blocks3, mBarrier)
        if const_expr(self.cooperative):
            # A carveout given keeps the DSL from querying the device for its smem per SM when
            # min_blocks_per_mp > 1 (the compile runs on machines without a GPU).
            kernel.launch(grid=[num_sms * ctas_per_sm(self.head_dim), 1, 1], block=[self.num_threads, 1, 1],
                          stream=stream, cooperative=True, min_blocks_per_mp=ctas_per_sm(self.head_dim),
                          preferred_smem_carveout=100)
        else:
            blocks = num_blocks0
            for count in (num_blocks1, num_blocks2, num_blocks3)[:len(self.slots) - 1]:
                blocks = cutlass.max(blocks, count)
            grid = [blocks, mOffsets0.shape[0] - 1, len(self.slots) * mX0.shape[1]]
            kernel.launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX0, mOffsets0, mScale0, mO0, mVt0, num_blocks0,
               mX1, mOffsets1, mScale1, mO1, mVt1, num_blocks1,
               mX2, mOffsets2, mScale2, mO2, mVt2, num_blocks2,
               mX3, mOffsets3, mScale3, mO3, mVt3, num_blocks3, mBarrier):
        tidx, _, _ = cute.arch.thread_idx()
        D = self.head_dim
        stride = BLOCK_TOKENS + _ROW_PAD

        @cute.struct
        class Storage:
            warp_max: cute.struct.MemRange[Float32, self.warps]
            dim_max: cute.struct.MemRange[Float32, self.warps * D if self.any_column else 1]
            sT: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN,
                                                       D * stride if self.any_transposed else 16], 16]

        storage = cutlass.memory.SmemAllocator().allocate(Storage)
        warp_max = storage.warp_max.get_tensor(cute.make_layout(self.warps))
        dim_max = storage.dim_max.get_tensor(cute.make_layout((D, self.warps))) if const_expr(self.any_column) else None
        sT = (storage.sT.get_tensor(cute.make_layout((D, stride), stride=(stride, 1)))
              if const_expr(self.any_transposed) else None)
        args = ((mX0, mOffsets0, mScale0, mO0, mVt0, num_blocks0), (mX1, mOffsets1, mScale1, mO1, mVt1, num_blocks1),
                (mX2, mOffsets2, mScale2, mO2, mVt2, num_blocks2), (mX3, mOffsets3, mScale3, mO3, mVt3, num_blocks3))
        if const_expr(self.cooperative):
            self.group_slots(args, mBarrier, warp_max, dim_max, sT, tidx)
        else:
            block, batch, slot_head = cute.arch.block_idx()
            heads = mX0.shape[1]
            slot = slot_head // heads
            head = slot_head - slot * heads
            for i in cutlass.range_constexpr(len(self.slots)):
                if slot == i:
                    if block < args[i][5]:
                        mX, mOffsets, mScale, mO, mVt, _ = args[i]
                        self.quantize_block(*self.slots[i], mX, mOffsets, mScale, mO, mVt, warp_max, dim_max, sT,
                                            tidx, block, batch, head)

    @cute.jit
    def group_slots(self, args: tuple, mBarrier, warp_max, dim_max, sT, tidx: Int32):
        """The persistent body of a cooperative launch: per slot, every CTA maxes the scales of
        the blocks it strides over, all meet at a grid barrier, then each casts the same blocks in
        the reverse order: its SM reads them again from the L2 partition that cached them for it
        (an SM's misses fill its own half of the L2). A block is ((sequence * blocks) + block) * H
        + head: neighbouring CTAs read neighbouring rows.

        The scale pass keeps a running max per thread while the CTA's blocks share a group (the
        table entry they max into; mode 5: the whole pass) and reduces it across the CTA when the
        group changes: one atomic per CTA and group, and no CTA barrier between blocks."""
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        chunk = tidx % self.chunks
        row_in_pass = tidx // self.chunks
        for i in cutlass.range_constexpr(len(self.slots)):
            mX, mOffsets, mScale, mO, mVt, blocks = args[i]
            _, plain, transposed = self.slots[i]
            heads = mX.shape[1]
            units = blocks * (mOffsets.shape[0] - 1) * heads
            group = Int32(-1)
            amax = Float32(0.0)
            for unit in cutlass.range(cta, units, ctas):
                block, batch, head = self.unit_coords(unit, blocks, heads)
                entry = Int32(cute.crd2idx((batch, block, head), mScale.layout))
                if entry != group:
                    if group >= 0:
                        self.max_into(mScale, group, amax, tidx, warp_max)
                    group = entry
                    amax = Float32(0.0)
                seq_start, row0, rows = self.block_rows(mOffsets, batch, block)
                amax = self.thread_amax(self.load_block(mX, seq_start + row0, rows, head, chunk, row_in_pass), amax)
            if group >= 0:
                self.max_into(mScale, group, amax, tidx, warp_max)
            self.grid_barrier(mBarrier, ctas * (i + 1), tidx)
            count = (units - cta + ctas - 1) // ctas
            for j in cutlass.range(count):
                block, batch, head = self.unit_coords(cta + (count - 1 - j) * ctas, blocks, heads)
                self.quantize_block("cast", plain, transposed, mX, mOffsets, mScale, mO, mVt, warp_max, dim_max,
                                    sT, tidx, block, batch, head)
                if const_expr(transposed):
                    cute.arch.sync_threads()  # sT is rewritten by the next block

    @cute.jit
    def max_into(self, mScale, entry: Int32, amax: Float32, tidx: Int32, warp_max: cute.Tensor):
        """The scale of the CTA's max of ``amax``, maxed atomically into ``mScale``'s ``entry``."""
        amax = self.cta_max(amax, tidx, warp_max)
        if tidx == 0:
            cute.arch.atomic_max_float32(mScale.iterator + entry, self.scale_of(amax))
        cute.arch.sync_threads()  # warp_max is rewritten by the next reduction

    @staticmethod
    @cute.jit
    def unit_coords(unit: Int32, blocks: Int32, heads: Int32):
        """(block, sequence, head) of a block's flat index."""
        row = unit // heads
        batch = row // blocks
        return row - batch * blocks, batch, unit - row * heads

    @staticmethod
    @cute.jit
    def grid_barrier(mBarrier, target: Int32, tidx: Int32):
        """Every CTA's writes and scale maxima before it, visible to every CTA after it: thread 0
        counts its CTA in (release) and waits for ``target`` arrivals (acquire)."""
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            cute.arch.atomic_add(mBarrier.iterator, Int32(1), sem="release", scope="gpu")
            arrived = Int32(0)
            while arrived < target:
                arrived = cute.arch.load(mBarrier.iterator, Int32, sem="acquire", scope="gpu")
            cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
