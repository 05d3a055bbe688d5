"""sm90 (WGMMA, TMA, mbarrier pipelines) helpers shared by the Hopper kernels. A warpgroup
accumulator m64nNk16 holds, per thread, values ((2 cols, 2 row halves, N/8 col groups), MMA_M,
MMA_N)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm

from .barriers import NamedBarrier


def wgmma_acc_rows_cols(layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) accumulator layout -> ((2, M), (2, V, N)): mode 0 walks the thread's
    rows, mode 1 its columns, so a row's mask intervals are computed once per row."""
    flat = cute.make_layout(layout.shape)
    (c2, r2, v), m, n = flat.shape
    (sc2, sr2, sv), sm, sn = flat.stride
    rows_cols = cute.make_layout(((r2, m), (c2, v, n)), stride=((sr2, sm), (sc2, sv, sn)))
    return cute.composition(layout, rows_cols)


def acc_coords(thr_mma, shape: tuple) -> tuple:
    """A thread's (row, col) coordinates of its WGMMA accumulator over a ``shape`` tile, and the
    same viewed as rows x cols (:func:`wgmma_acc_rows_cols`)."""
    tXcX = thr_mma.partition_C(cute.make_identity_tensor(shape))
    return tXcX, cute.make_tensor(tXcX.iterator, wgmma_acc_rows_cols(tXcX.layout))


def transposed_view(sX: cute.Tensor, shape: tuple) -> cute.Tensor:
    """``sX``, stored contiguous along the second mode of ``shape`` (its first two modes swapped;
    a third mode is the pipeline stage), viewed as ``shape``: the MN-major view a WGMMA operand or
    a transposed accumulator read takes."""
    return cute.composition(sX, cute.make_ordered_layout(shape, order=(1, 0, 2)[:len(shape)]))


def score_operands(wg_mma, a_tiles: tuple, b_tiles: tuple) -> tuple:
    """A warpgroup's fragments for its score GEMMs: each of ``a_tiles`` as the A operand, then each
    of ``b_tiles`` as B."""
    return (tuple(wg_mma.make_fragment_A(wg_mma.partition_A(s)) for s in a_tiles)
            + tuple(wg_mma.make_fragment_B(wg_mma.partition_B(s)) for s in b_tiles))


def wgmma_acc_as_operand_a(layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) fp32 accumulator layout -> ((2, 2, 2), M, (V/2, N)): for 16-bit types
    two adjacent n8 column groups of an accumulator are exactly one k16 slice of an RS WGMMA's
    register A operand, so P feeds the P.V GEMM without any data movement."""
    assert layout.shape[0][2] % 2 == 0
    split = cute.logical_divide(layout, ((None, None, 2), None, None))
    return cute.make_layout(
        ((split.shape[0][0], split.shape[0][1], split.shape[0][2][0]), split.shape[1],
         (split.shape[0][2][1], split.shape[2])),
        stride=((split.stride[0][0], split.stride[0][1], split.stride[0][2][0]), split.stride[1],
                (split.stride[0][2][1], split.stride[2])),
    )

@cute.jit
def wgmma(tiled_mma, acc, tCrA, tCrB, zero_init: cutlass.Constexpr[bool], wg_wait: cutlass.Constexpr[int],
          k_slices: cutlass.Constexpr = None):
    """acc (+)= A @ B over all k slices (or slices ``k_slices`` = (first, stop)) as one WGMMA
    group; waits until at most ``wg_wait`` groups are in flight (-1: do not wait)."""
    from cutlass.cute.nvgpu import warpgroup

    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    first, stop = 0, cute.size(tCrA.shape[2])
    if const_expr(k_slices is not None):
        first, stop = k_slices
    for k in cutlass.range_constexpr(first, stop):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wg_wait >= 0):
        warpgroup.wait_group(wg_wait)

def wgmma_replace_operand_a(frag: cute.Tensor, new: cute.Tensor):
    """``frag`` <- ``new``, where ``frag`` is the register A operand of an RS WGMMA retired just
    before (call it after that ``wait_group``) and ``new`` was computed while it was in flight.

    LLVM ends a value's live range at its last use, the WGMMA instruction, and does not know that
    the tensor cores read the registers later: it may compute ``new`` into ``frag``'s registers
    while the WGMMA still reads them. ptxas serializes the WGMMAs when it sees that (C7513), but
    not when the WGMMA sits in a conditional block: then it reads a mix of old and new values.
    One empty asm reads the old registers (they stay allocated up to here) and passes ``new``
    through (so ``new`` is computed before here and is not sunk past the next WGMMA's fence);
    ``warpgroup_fence_operand`` in CUTLASS C++. The asm is empty; the old and new values now
    live in distinct registers, so a loop carrying ``frag`` may get register moves after it."""
    old_regs = cute.recast_tensor(frag, Int32)
    new_regs = cute.recast_tensor(new, Int32)
    n = cute.size(old_regs)
    operands = [new_regs[i].ir_value() for i in range(n)] + [old_regs[i].ir_value() for i in range(n)]
    constraints = ",".join(["=r"] * n + [str(i) for i in range(n)] + ["r"] * n)
    res = llvm.inline_asm(llvm.StructType.get_literal([Int32.mlir_type] * n), operands, "", constraints,
                          has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    for i in range(n):
        old_regs[i] = Int32(llvm.extractvalue(Int32.mlir_type, res, [i]))

# L2 cache-policy operand for TMA copies (``cache_policy=``): the whole access marked evict_last
# (a createpolicy.fractional value with fraction 1.0).
L2_EVICT_LAST = 0x14F0000000000000

@cute.jit
def store_acc_fp32_sw128(acc: cute.Tensor, sX: cute.Tensor, tid_in_wg: Int32, rows: cutlass.Constexpr,
                         cols: cutlass.Constexpr):
    """A warpgroup's (64, ``cols``) fp32 WGMMA accumulator into ``sX``: (``rows`` >= 64, ``cols``)
    fp32 in the 128-byte swizzled TMA layout of :func:`sm90_smem_layout` (8-row x 32-column
    atoms, rows first), at its row 0, 1024-byte aligned.

    Addresses are formed by hand: a thread's 16-byte chunk index within a 128-byte row is
    (column chunk) xor (row % 8), so its stores need only 4 base registers plus immediates
    (one per column chunk pair mod 4). The generic swizzled-tensor copy gave ptxas one hoisted
    address per store (32 at D128), which it spilled inside the m-block loop of the persistent
    fused backward kernel."""
    assert rows % 8 == 0 and cols % 32 == 0
    warp_in_wg = tid_in_wg // 32
    lane = tid_in_wg % 32
    row8 = lane // 4
    half = (lane % 4) // 2
    base = sX.iterator.toint() + row8 * 128 + warp_in_wg * 2048 + (lane % 2) * 8
    # acc ((2, 2, cols / 8)): (column pair, row + 8, column block of 8), compact in registers.
    num_col_atoms = cols // 32
    for jj in cutlass.range_constexpr(4):
        ptr = cute.make_ptr(Float32, base + (((half + 2 * jj) ^ row8) * 16), cute.AddressSpace.smem,
                            assumed_align=8)
        dst = cute.make_tensor(ptr, cute.make_layout((2, 2, num_col_atoms), stride=(1, 256, 32 * rows)))
        src = cute.make_tensor(acc.iterator + 4 * jj, cute.make_layout((2, 2, num_col_atoms), stride=(1, 2, 16)))
        cute.autovec_copy(src, dst)

@cute.jit
def store_acc_16bit_sw128_64cols(acc: cute.Tensor, sX: cute.Tensor, tid_in_wg: Int32, row0: Int32):
    """A warpgroup's (64, 64) WGMMA accumulator, already converted to a 16-bit type, into rows
    ``row0``.. of ``sX``: (rows, 64) 16-bit in the 128-byte swizzled layout of
    :func:`sm90_smem_layout` (one 128-byte row per row), 1024-byte aligned. As in
    :func:`store_acc_fp32_sw128`, the chunk index is (column block) xor (row % 8): 8 per-thread
    offsets plus immediates instead of one hoisted address per store."""
    warp_in_wg = tid_in_wg // 32
    lane = tid_in_wg % 32
    row8 = lane // 4
    base = sX.iterator.toint() + (row0 + warp_in_wg * 16 + row8) * 128 + (lane % 4) * 4
    # acc ((2, 2, 8)): (column pair, row + 8, column block of 8), compact in registers.
    for block in cutlass.range_constexpr(8):
        ptr = cute.make_ptr(acc.element_type, base + ((block ^ row8) * 16), cute.AddressSpace.smem, assumed_align=4)
        dst = cute.make_tensor(ptr, cute.make_layout((2, 2), stride=(1, 512)))
        src = cute.make_tensor(acc.iterator + 4 * block, cute.make_layout((2, 2), stride=(1, 2)))
        cute.autovec_copy(src, dst)

@cute.jit
def copy_acc_rows(src: cute.Tensor, dst: cute.Tensor, tOc_rc: cute.Tensor, row_limit: Int32):
    """Copy a WGMMA-layout tile between registers and its global-memory partition (either way:
    both sides share the accumulator layout), two adjacent columns per access, skipping the
    thread's rows at and past ``row_limit`` (``tOc_rc``: tile coordinates seen as (rows, cols))."""
    src_rc = cute.make_tensor(src.iterator, wgmma_acc_rows_cols(src.layout))
    dst_rc = cute.make_tensor(dst.iterator, wgmma_acc_rows_cols(dst.layout))
    for i in cutlass.range_constexpr(cute.size(src_rc.shape[0])):
        if tOc_rc[i, 0][0] < row_limit:
            # One copy per row: autovec_copy splits it into the column pairs (what a row's
            # registers and global addresses have in common), as a copy per pair did.
            cute.autovec_copy(src_rc[i, None], dst_rc[i, None])


@cute.jit
def red_add_f32(ptr: cute.Pointer, value: Float32):
    """*ptr += value in global memory (red.global.add.f32: no value comes back)."""
    llvm.inline_asm(None, [ptr.toint().ir_value(), Float32(value).ir_value()], "red.global.add.f32 [$0], $1;",
                    "l,f", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)

def sm90_register_split(num_mma_wg: int) -> tuple[int, int]:
    """(producer, consumer) registers per thread after ``setmaxnreg``, for one producer warpgroup
    and ``num_mma_wg`` consumer warpgroups. The CTA launches with 65536 / threads registers
    (rounded down to 8) and setmaxnreg only moves them between roles: with 2 consumer warpgroups
    (64512 - 24 * 128) / 256 = 240 exactly (a 32-register producer deadlocked the consumers'
    increase on the H100)."""
    producer, consumer = (24, 240) if num_mma_wg == 2 else (32, 160)
    threads = 128 * (1 + num_mma_wg)
    launch = 65536 // threads // 8 * 8
    assert launch * threads - producer * 128 >= consumer * 128 * num_mma_wg, (num_mma_wg, producer, consumer)
    return producer, consumer

def sm90_smem_layout(dtype, rows: int, cols: int, stages: int | None = None):
    """Row-major (rows, cols[, stages]) smem tile in the swizzled WGMMA / TMA layout."""
    import cutlass.utils.hopper_helpers as sm90_helpers
    from cutlass.cute.nvgpu import warpgroup
    from cutlass.tensor_utils import LayoutEnum

    atom = warpgroup.make_smem_layout_atom(sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))

def sm90_tma_atom_tokens(op, mX: cute.Tensor, smem_tile, rows: int, cols: int | None = None):
    """TMA atom over a (T, H, D) token tensor seen as (T, D, H): a tile is (``rows``, ``cols``; default
    all of D) at a token coordinate with the head as an index. ``smem_tile``: one stage of smem."""
    from cutlass.cute.nvgpu import cpasync

    mXt = cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[0, 2, 1]))
    return cpasync.make_tiled_tma_atom(op, mXt, smem_tile, (rows, mX.shape[2] if cols is None else cols))

def sm90_tma_atom_rab(mRab: cute.Tensor, sRab_layout, tile_m: int, tile_n: int):
    """TMA load atom over rab (B, H_rab, L_q, L_k) seen as (L_q, L_k, H_rab, B); rows past L_q and
    columns past L_k read 0. ``sRab_layout`` is the staged smem layout."""
    from cutlass.cute.nvgpu import cpasync

    mRabt = cute.make_tensor(mRab.iterator, cute.select(mRab.layout, mode=[2, 3, 1, 0]))
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mRabt,
                                       cute.slice_(sRab_layout, (None, None, 0)), (tile_m, tile_n))

def rows_zero_copy(dtype, cols: int) -> cute.TiledCopy:
    """128 threads (one warpgroup) storing 16-byte zero vectors over (rows, cols) smem tiles."""
    vec = 128 // dtype.width
    vectors = cols // vec
    # The copy tile must divide the smem tile: a row's threads are the largest power of two (at most
    # 16) dividing its vectors. min(vectors, 16) put 16 threads on D192's 24 vectors, and they wrote
    # past the tile into the next buffer.
    threads_per_row = min(vectors & -vectors, 16)
    return cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128),
        cute.make_ordered_layout((128 // threads_per_row, threads_per_row), order=(1, 0)),
        cute.make_layout((1, vec)),
    )

@cute.jit
def zero_smem_rows_past(zero_copy, tiles, tile_shape: cutlass.Constexpr, tid_in_wg: Int32, wg: Int32,
                        row_limit: Int32):
    """Zero the rows at and past ``row_limit`` of each smem tile in ``tiles`` (one warpgroup;
    the other consumer warpgroup may write the same zeros), then make the generic-proxy stores
    visible to WGMMA (async proxy) reads and sync the warpgroup. TMA reads whatever follows a
    sequence: P or G is 0 against those rows, but 0 * NaN would be NaN."""
    thr = zero_copy.get_slice(tid_in_wg)
    tZc = thr.partition_D(cute.make_identity_tensor(tile_shape))
    for sX in tiles:
        tZs = thr.partition_D(sX)
        zeros = cute.make_fragment_like(tZs[None, 0, None], sX.element_type)
        zeros.fill(0.0)
        for m in cutlass.range_constexpr(cute.size(tZs.shape[1])):
            if tZc[0, m, 0][0] >= row_limit:
                # 16-byte vectors as with the tiled copy's atom, with fewer traced ops.
                cute.autovec_copy(zeros, tZs[None, m, None])
    cute.arch.fence_view_async_shared()
    cute.arch.barrier(barrier_id=NamedBarrier.ZERO_ROWS_WG0 + wg, number_of_threads=128)

def sm90_bwd_pipelines(mbar_once, mbar_ring, once_bytes: int, ring_bytes: int, ring_stages: int,
                       num_mma_threads: int):
    """The two TMA pipelines of an sm90 backward kernel: one 1-stage pipeline for the tiles the CTA
    owns (K+V, or Q+dO), one ring for the tiles it walks; one producer thread, consumer warps
    release. Initialized, fenced and CTA-synced (call once, by every thread, before role split)."""
    import cutlass.pipeline as pipeline

    producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
    consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, num_mma_threads // 32)
    pipe_once = pipeline.PipelineTmaAsync.create(
        barrier_storage=mbar_once.data_ptr(), num_stages=1, producer_group=producer, consumer_group=consumers,
        tx_count=once_bytes, defer_sync=True,
    )
    pipe_ring = pipeline.PipelineTmaAsync.create(
        barrier_storage=mbar_ring.data_ptr(), num_stages=ring_stages, producer_group=producer,
        consumer_group=consumers, tx_count=ring_bytes, defer_sync=True,
    )
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    return pipe_once, pipe_ring


def advanced(state):
    """The next pipeline state, as a new value: reassigning it lets the DSL carry it out of
    runtime ``if``/``for``/``while`` bodies."""
    nxt = state.clone()
    nxt.advance()
    return nxt


def shared_storage(barriers: dict, buffers: dict, words: dict | None = None):
    """The CTA's shared memory as a ``cute.struct``: the mbarrier arrays (name -> count of Int64),
    small Int32 arrays (``words``: name -> count; they share the barriers' first 1024 bytes),
    then the tiles (name -> (element type, elements)), each 1024-byte aligned (the 128-byte
    swizzle repeats every 8 rows of 128 bytes), in the order given."""
    fields = {name: cute.struct.MemRange[cutlass.Int64, count] for name, count in barriers.items()}
    fields.update({name: cute.struct.MemRange[cutlass.Int32, count] for name, count in (words or {}).items()})
    fields.update({name: cute.struct.Align[cute.struct.MemRange[elem, count], 1024]
                   for name, (elem, count) in buffers.items()})
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


def smem_tensors(storage, layouts: dict) -> dict:
    """name -> the smem tensor of ``storage``'s field ``name`` in its (swizzled) layout; None
    layouts give None (an absent tile)."""
    return {name: None if layout is None else getattr(storage, name).get_tensor(layout.outer, swizzle=layout.inner)
            for name, layout in layouts.items()}


def prefetch_tma_descriptors(*atoms):
    """Prefetch the TMA descriptors of the atoms given (None: absent); one warp calls it."""
    from cutlass.cute.nvgpu import cpasync

    for atom in atoms:
        if const_expr(atom is not None):
            cpasync.prefetch_descriptor(atom)


def trivial_mma(dtype, n: int, b_mn_major: bool, num_mma_wg: int, atom_layout=None, a_in_registers: bool = False,
                a_mn_major: bool = False):
    """A warpgroup tiled MMA with 64-row atoms and ``n`` columns: A K-major (or ``a_mn_major``) in
    smem or (``a_in_registers``) in registers, B K-major or ``b_mn_major``; fp32 accumulators."""
    import cutlass.utils.hopper_helpers as sm90_helpers
    from cutlass.cute.nvgpu import warpgroup

    major = cute.nvgpu.OperandMajorMode
    return sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype, major.MN if a_mn_major else major.K, major.MN if b_mn_major else major.K, Float32,
        atom_layout_mnk=atom_layout or (num_mma_wg, 1, 1), tiler_mn=(64, n),
        a_source=warpgroup.OperandSource.RMEM if a_in_registers else warpgroup.OperandSource.SMEM,
    )
