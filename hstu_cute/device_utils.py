"""Device-side helpers shared by the kernels (traced inside ``@cute.jit`` / ``@cute.kernel``)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warp

from . import masks

# The mask engine's helpers, bound to DSL scalar ops for use while tracing a kernel.
KERNEL_OPS = masks.Ops(min=cutlass.min, max=cutlass.max, select=cutlass.select_)


def smem_layout_atom(dtype, k_extent: int) -> cute.ComposedLayout:
    """Swizzled smem atom for a row-major (rows, k_extent) 16-bit tile.

    The swizzle permutes 16-byte chunks inside the widest power-of-two row segment (up to 128 B)
    so that the 8 rows an ldmatrix phase reads land in distinct banks.
    """
    row_bytes = k_extent * dtype.width // 8
    seg_bytes = 128 if row_bytes % 128 == 0 else (64 if row_bytes % 64 == 0 else 32)
    seg_elems = seg_bytes * 8 // dtype.width
    swizzle_bits = {128: 3, 64: 2, 32: 1}[seg_bytes]
    return cute.make_composed_layout(
        cute.make_swizzle(swizzle_bits, 3, 3),
        0,
        cute.make_ordered_layout((8, seg_elems), order=(1, 0)),
    )


def ldmatrix_copies(dtype, tiled_mma, tidx):
    """Per-thread smem->register copies (ldmatrix x4) laid out for ``tiled_mma``'s A operand,
    B operand, transposed B operand (an MN-major tile, e.g. V for P.V) and C accumulator."""
    ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
    ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), dtype)
    return (
        cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx),
        cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx),
        cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx),
        cute.make_tiled_copy_C(ldsm, tiled_mma).get_slice(tidx),
    )


def scores_init(thr_mma, shape_mn, dtype, smem_copy_rab=None, tSsRab=None) -> cute.Tensor:
    """A fresh fp32 score accumulator: the rab tile read from smem (ldmatrix into the accumulator
    layout), or zeros without rab -- Q K^T is then accumulated on top (spec: scores include rab)."""
    acc = cute.make_rmem_tensor(thr_mma.partition_shape_C(shape_mn), Float32)
    if const_expr(tSsRab is not None):
        rRab = cute.make_rmem_tensor(thr_mma.partition_shape_C(shape_mn), dtype)
        cute.copy(smem_copy_rab, tSsRab, smem_copy_rab.retile(rRab))
        acc.store(rRab.load().to(Float32))
    else:
        acc.fill(0.0)
    return acc


@cute.jit
def gemm_ss(tiled_mma, acc, tCrA, tCrB, tCsA, tCsB, smem_thr_copy_A, smem_thr_copy_B):
    """acc += A @ B with both operands read from smem by ldmatrix, one k-slice ahead."""
    tCrA_view = smem_thr_copy_A.retile(tCrA)
    tCrB_view = smem_thr_copy_B.retile(tCrB)
    cute.copy(smem_thr_copy_A, tCsA[None, None, 0], tCrA_view[None, None, 0])
    cute.copy(smem_thr_copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    num_k = cute.size(tCsA.shape[2])
    for k in cutlass.range_constexpr(num_k):
        if const_expr(k < num_k - 1):
            cute.copy(smem_thr_copy_A, tCsA[None, None, k + 1], tCrA_view[None, None, k + 1])
            cute.copy(smem_thr_copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def gemm_rs(tiled_mma, acc, tCrA, tCrB, tCsB, smem_thr_copy_B):
    """acc += A @ B with A already in registers and B read from smem one k-slice ahead."""
    tCrB_view = smem_thr_copy_B.retile(tCrB)
    cute.copy(smem_thr_copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    num_k = cute.size(tCrA.shape[2])
    for k in cutlass.range_constexpr(num_k):
        if const_expr(k < num_k - 1):
            cute.copy(smem_thr_copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


def acc_to_operand_a(rP: cute.Tensor) -> cute.Tensor:
    """View an m16n8k16 accumulator fragment (4, M, N) as an A-operand fragment ((4, 2), M, N/2):
    two adjacent n8 accumulator tiles form one k16 slice of the next GEMM."""
    divided = cute.logical_divide(rP.layout, (None, None, 2))
    layout = cute.make_layout(
        ((divided.shape[0], divided.shape[2][0]), divided.shape[1], divided.shape[2][1]),
        stride=((divided.stride[0], divided.stride[2][0]), divided.stride[1], divided.stride[2][1]),
    )
    return cute.make_tensor(rP.iterator, layout)


def _mufu_f32(instruction: str, x: Float32) -> Float32:
    """One single-operand f32 PTX instruction (a MUFU op) on ``x``."""
    return Float32(
        llvm.inline_asm(
            Float32.mlir_type,
            [Float32(x).ir_value()],
            f"{instruction} $0, $1;",
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def tanh_approx(x: Float32) -> Float32:
    # One MUFU op (sm_75+); max relative error ~2^-11, below bf16 rounding of P.
    return _mufu_f32("tanh.approx.f32", x)


@cute.jit
def rcp_approx(x: Float32) -> Float32:
    # One MUFU op, ~1 ulp. The IEEE division it replaces (div.rn.f32) is a dozen instructions plus
    # a slow-path branch per element: fp16 forward D128 249 TF against bf16's 646 with it.
    return _mufu_f32("rcp.approx.ftz.f32", x)


@cute.jit
def silu_scaled_inplace(acc: cute.Tensor, alpha: Float32, fast: cutlass.Constexpr[bool]):
    """acc <- silu(alpha * acc), elementwise, in fp32."""
    if const_expr(fast):
        # silu(z) = z * sigmoid(z) = h + h * tanh(h) with h = z / 2.
        half_alpha = alpha * Float32(0.5)
        # unroll_full: traced once, unrolled by the compiler (the DSL warns that a 64-128 step
        # range_constexpr is slow to trace); the PTX is the same (64 tanh.approx, no local memory).
        for i in cutlass.range(cute.size(acc), unroll_full=True):
            h = acc[i] * half_alpha
            acc[i] = h + h * tanh_approx(h)
    else:
        neg_alpha_log2e = alpha * Float32(-1.4426950408889634)
        for i in cutlass.range(cute.size(acc), unroll_full=True):
            s = acc[i]
            acc[i] = (s * alpha) * rcp_approx(Float32(1.0) + cute.math.exp2(s * neg_alpha_log2e, fastmath=True))


@cute.jit
def silu_and_grad_unscaled(acc_s: cute.Tensor, acc_dp: cute.Tensor, half_alpha: Float32):
    """acc_s <- S_len * P, acc_dp <- (2 S_len / alpha) * G (spec section 2, tanh SiLU): the caller
    scales dV by 1 / S_len and dK, dQ by alpha / (2 S_len) once per tile.

    With h = alpha s / 2 and t = tanh(h): silu(2h) = h (1 + t) and
    2 silu'(2h) = (1 + t)(1 + h - h t), so an element costs one MUFU op and six FP32 ops
    (eleven with the scales and the sigmoid formed per element)."""
    for i in cutlass.range(cute.size(acc_s), unroll_full=True):
        h = acc_s[i] * half_alpha
        t = tanh_approx(h)
        acc_s[i] = h + h * t
        w = acc_dp[i] * ((h + Float32(1.0)) - h * t)
        acc_dp[i] = w + w * t


@cute.jit
def apply_mask_inplace(acc: cute.Tensor, tScS: cute.Tensor, spec: cutlass.Constexpr, seq, row0: Int32, col0: Int32):
    """Zero every accumulator element whose (row0 + row, col0 + col) is masked (spec section 4).

    An m16n8 accumulator fragment holds, per thread, values v = col_pair + 2 * row_half: two rows
    (r, r + 8) per m-atom. Each row's allowed intervals are computed once (masks.row_intervals)
    and shifted to tile columns, so an element costs three compares and a select.
    """
    assert cute.size(acc.shape[0]) == 4
    for m in cutlass.range_constexpr(cute.size(acc.shape[1])):
        for half in cutlass.range_constexpr(2):
            r = row0 + tScS[2 * half, m, 0][0]
            lo_end, hi_start, hi_end = masks.row_intervals(spec, seq, r, KERNEL_OPS)
            lo_end, hi_start, hi_end = lo_end - col0, hi_start - col0, hi_end - col0
            col_limit = seq.seqlen_k - col0
            for n in cutlass.range_constexpr(cute.size(acc.shape[2])):
                for col_pair in cutlass.range_constexpr(2):
                    v = col_pair + 2 * half
                    keep = masks.in_row_intervals(spec, tScS[v, m, n][1], lo_end, hi_start, hi_end, col_limit)
                    acc[v, m, n] = cutlass.select_(keep, acc[v, m, n], Float32(0.0))


def clamp_range(start, end, limit):
    """Clamp [start, end) into [0, limit] so corrupt offsets can never address outside a tensor."""
    s = cutlass.min(cutlass.max(start, Int32(0)), limit)
    e = cutlass.min(cutlass.max(end, s), limit)
    return s, e


def sequence_bounds(mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, tokens_q, tokens_k, batch):
    """(q_start, k_start, seqlen_q, seqlen_k) of one sequence: offsets clamped to the tensors,
    lengths clamped by seqused (INT32_MAX when the caller has none)."""
    q_start, q_end = clamp_range(mOffsetsQ[batch], mOffsetsQ[batch + 1], tokens_q)
    k_start, k_end = clamp_range(mOffsetsK[batch], mOffsetsK[batch + 1], tokens_k)
    seqlen_q = cutlass.max(cutlass.min(mSeqUsedQ[batch], q_end - q_start), Int32(0))
    seqlen_k = cutlass.max(cutlass.min(mSeqUsedK[batch], k_end - k_start), Int32(0))
    return q_start, k_start, seqlen_q, seqlen_k


def sequence_mask(spec, seqlen_q, seqlen_k, mNumContexts, mNumTargets, batch, window_left, window_right,
                  group_size, is_delta_q):
    """The runtime :class:`masks.SeqMask` of one sequence inside a kernel."""
    num_context = Int32(0)
    history_end = seqlen_k
    if const_expr(spec.has_context):
        num_context = mNumContexts[batch]
    if const_expr(spec.has_target):
        history_end = seqlen_k - cutlass.min(cutlass.max(mNumTargets[batch], Int32(0)), seqlen_k)
    return masks.SeqMask(
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, window_left=window_left, window_right=window_right,
        num_context=num_context, history_end=history_end, group_size=group_size,
        row_offset=cutlass.select_(is_delta_q != 0, seqlen_k - seqlen_q, Int32(0)),
    )


# ---------------------------------------------------------------------------------------------
# sm90 (WGMMA) fragments. A warpgroup accumulator m64nNk16 holds, per thread, values
# ((2 cols, 2 row halves, N/8 col groups), MMA_M, MMA_N).
# ---------------------------------------------------------------------------------------------
def wgmma_acc_rows_cols(layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) accumulator layout -> ((2, M), (2, V, N)): mode 0 walks the thread's
    rows, mode 1 its columns, so a row's mask intervals are computed once per row."""
    flat = cute.make_layout(layout.shape)
    (c2, r2, v), m, n = flat.shape
    (sc2, sr2, sv), sm, sn = flat.stride
    rows_cols = cute.make_layout(((r2, m), (c2, v, n)), stride=((sr2, sm), (sc2, sv, sn)))
    return cute.composition(layout, rows_cols)


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
def wgmma(tiled_mma, acc, tCrA, tCrB, zero_init: cutlass.Constexpr[bool], wg_wait: cutlass.Constexpr[int]):
    """acc (+)= A @ B over all k slices as one WGMMA group; waits until at most ``wg_wait`` groups
    are in flight (-1: do not wait)."""
    from cutlass.cute.nvgpu import warpgroup

    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
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


@cute.jit
def apply_mask_rows_cols(acc_rc: cute.Tensor, coord_rc: cute.Tensor, spec: cutlass.Constexpr, seq, row0: Int32,
                         col0: Int32):
    """Zero every masked element of an accumulator seen as (rows, cols) (``coord_rc``: its tile
    coordinates in the same view); one interval computation per row, a select per element."""
    col_limit = seq.seqlen_k - col0
    # A column's coordinate is the same in every row: read each once (fewer traced ops).
    cols = [coord_rc[0, j][1] for j in range(cute.size(acc_rc.shape[1]))]
    for i in cutlass.range_constexpr(cute.size(acc_rc.shape[0])):
        lo_end, hi_start, hi_end = masks.row_intervals(spec, seq, row0 + coord_rc[i, 0][0], KERNEL_OPS)
        lo_end, hi_start, hi_end = lo_end - col0, hi_start - col0, hi_end - col0
        for j in cutlass.range_constexpr(cute.size(acc_rc.shape[1])):
            keep = masks.in_row_intervals(spec, cols[j], lo_end, hi_start, hi_end, col_limit)
            acc_rc[i, j] = cutlass.select_(keep, acc_rc[i, j], Float32(0.0))


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
def store_acc_rows(rOut: cute.Tensor, tOg: cute.Tensor, tOc_rc: cute.Tensor, row_limit: Int32):
    """Store a WGMMA-layout register tile to global memory, two adjacent columns per store,
    skipping the thread's rows at and past ``row_limit`` (``tOc_rc``: tile coordinates seen as
    (rows, cols))."""
    rc = cute.make_tensor(rOut.iterator, wgmma_acc_rows_cols(rOut.layout))
    g_rc = cute.make_tensor(tOg.iterator, wgmma_acc_rows_cols(tOg.layout))
    for i in cutlass.range_constexpr(cute.size(rc.shape[0])):
        if tOc_rc[i, 0][0] < row_limit:
            # One copy per row: autovec_copy splits it into the column pairs (what a row's
            # registers and global addresses have in common), as a copy per pair did.
            cute.autovec_copy(rc[i, None], g_rc[i, None])



@cute.jit
def red_add_f32(ptr: cute.Pointer, value: Float32):
    """*ptr += value in global memory (red.global.add.f32: no value comes back)."""
    llvm.inline_asm(None, [ptr.toint().ir_value(), Float32(value).ir_value()], "red.global.add.f32 [$0], $1;",
                    "l,f", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


# ---------------------------------------------------------------------------------------------
# sm90 kernel scaffolding shared by the Hopper forward and backward kernels
# ---------------------------------------------------------------------------------------------
# Named barrier ids 4 + warpgroup (4, 5): a consumer warpgroup's own barrier after it zeroes smem
# rows (each of the two has its own).
BAR_ZERO_ROWS_WG0 = 4


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
    from cutlass.utils import LayoutEnum

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
    threads_per_row = min(cols // vec, 16)
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
    cute.arch.barrier(barrier_id=BAR_ZERO_ROWS_WG0 + wg, number_of_threads=128)


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
