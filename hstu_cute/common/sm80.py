"""sm80 (mma.sync, ldmatrix) fragment helpers."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import warp


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

def smem_operands(thr_mma, copy_a, copy_b, a_tiles, b_tiles):
    """([A fragment per a_tiles tile], [B fragment per b_tiles tile, shaped as its stage 0],
    [ldmatrix source partition per a_tiles tile], [the same per b_tiles tile, every stage]).
    Every fragment is made before the first partition: the kernels' PTX follows this order."""
    return ([thr_mma.make_fragment_A(thr_mma.partition_A(t)) for t in a_tiles],
            [thr_mma.make_fragment_B(thr_mma.partition_B(t[None, None, 0])) for t in b_tiles],
            [copy_a.partition_S(t) for t in a_tiles],
            [copy_b.partition_S(t) for t in b_tiles])

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

def transposed_view(tile: cute.Tensor, rows: int, cols: int, stages: int) -> cute.Tensor:
    """The (cols, rows, stages) view of a (rows, cols, stages) smem tile: an MN-major
    operand (V for P V, K for G K, Q and dO for the dK/dV GEMMs) or a key-major score tile."""
    return cute.composition(tile, cute.make_layout((cols, rows, stages), stride=(rows, 1, rows * cols)))


def mma_acc_rows_cols(layout: cute.Layout) -> cute.Layout:
    """(4, M, N) mma.sync accumulator layout (value ``v = col_pair + 2 * row_half`` of each m16n8
    atom) -> ((2, M), (2, N)): mode 0 walks the thread's rows, mode 1 its columns (as
    :func:`common.sm90.wgmma_acc_rows_cols` does for WGMMA)."""
    m, n = cute.size(layout.shape[1]), cute.size(layout.shape[2])
    return cute.composition(layout, cute.make_layout(((2, m), (2, n)), stride=((2, 4), (1, 4 * m))))
