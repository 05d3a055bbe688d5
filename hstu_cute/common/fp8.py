"""FP8 (e4m3) pieces of the sm90 forward: P from the fp32 score accumulator into the register A
operand of an 8-bit RS WGMMA, and zeroing the key columns of a staged V^T tile past a sequence.

Register layouts (PTX ISA, wgmma register fragments; docs/design/fp8-forward.md section 2), for
lane l of a warp, g = l / 4 and q = l % 4:

* fp32 accumulator, n8 column group j: ``d[4j + 2i + c] = S[g + 8i, 8j + 2q + c]``;
* 8-bit A operand, k32 slice: ``a[v0 + 4 v1 + 8 v2] = P[g + 8 v1, 16 v2 + 4q + v0]``.

A thread holds columns 2q, 2q+1 of every n8 group in rows g and g + 8; the operand register for
row g of a 16-column half h wants four of them. Packing the register from the row's pairs of
groups 2h and 2h + 1 (columns 2q, 2q+1, 8+2q, 9+2q) needs no data movement at all, provided V^T's
keys are stored in that order within every 16-key group (``hstu_cute.fp8_format.KEY_AT_COLUMN``;
the V^T writers do it): recipe B of the design note. The mask, rab and the P scale work on the fp32
scores in their natural order, before the packing.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm

from ..fp8_format import E4M3_MAX, P_AMAX_FLOOR, key_at_column
from .barriers import NamedBarrier
from .sm90 import wgmma_acc_rows_cols


def _asm(result, args: list, code: str, constraints: str, ordered: bool = False):
    """One PTX snippet as an inline asm value of type ``result`` (Uint32 or Float32); ``ordered``:
    kept in program order (side effects), else free for the scheduler."""
    return result(
        llvm.inline_asm(
            result.mlir_type,
            [a.ir_value() for a in args],
            code,
            constraints,
            has_side_effects=ordered,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def prmt(a: Uint32, b: Uint32, selector: Uint32, ordered: bool = False) -> Uint32:
    """Byte permute of the pair (b:a) (``prmt.b32``; bytes 0-3 from ``a``, 4-7 from ``b``); with
    ``ordered`` kept in program order (side effects)."""
    return _asm(Uint32, [Uint32(a), Uint32(b), Uint32(selector)], "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", ordered)


def silu_e4m3x4(h0: Float32, h1: Float32, h2: Float32, h3: Float32) -> Uint32:
    """e4m3(silu(2 h)) of four values, packed low to high, computed as h + h tanh(h) in fp32: one
    MUFU per value, the fp32 -> e4m3x2 conversions writing the word's halves. The f16x2 form it
    replaced took as many MUFU ops (``tanh.approx.f16x2`` is two MUFU.TANH.F16 in SASS, then a byte
    permute to pair them) and two conversions more per four values: 354 instructions per n-block
    against 323, 4-7 % slower at D64-D256 (docs/dev/perf-log.md, session 22). A huge score saturates to
    +-448 in the e4m3 conversion; a hugely negative one gives h - h = 0 (tanh.approx is -1
    there), never inf - inf."""
    return _asm(
        Uint32, [Float32(h) for h in (h0, h1, h2, h3)],
        "{\n"
        ".reg .f32 t0, t1, t2, t3;\n"
        ".reg .b16 e01, e23;\n"
        "tanh.approx.f32 t0, $1;\n"
        "tanh.approx.f32 t1, $2;\n"
        "tanh.approx.f32 t2, $3;\n"
        "tanh.approx.f32 t3, $4;\n"
        "fma.rn.f32 t0, $1, t0, $1;\n"
        "fma.rn.f32 t1, $2, t1, $2;\n"
        "fma.rn.f32 t2, $3, t2, $3;\n"
        "fma.rn.f32 t3, $4, t3, $4;\n"
        "cvt.rn.satfinite.e4m3x2.f32 e01, t1, t0;\n"
        "cvt.rn.satfinite.e4m3x2.f32 e23, t3, t2;\n"
        "mov.b32 $0, {e01, e23};\n"
        "}",
        "=r,f,f,f,f")


def silu_f16x2(h0: Float32, h1: Float32) -> Uint32:
    """silu(2 h) of two values as f16x2 (low = h0), the SiLU in fp32 as in :func:`silu_e4m3x4`,
    for the scaled P of quant modes >= 1: its row maximum and the multiplication by the row's
    multiplier stay in f16x2, half the instructions of fp32 (measured: an fp32 maximum tree was 2 %
    faster at D128 and 10 % slower at D256). P saturates at f16's +-65504 here, a limit of scaled
    P since its first version."""
    return _asm(
        Uint32, [Float32(h0), Float32(h1)],
        "{\n"
        ".reg .f32 t0, t1;\n"
        "tanh.approx.f32 t0, $1;\n"
        "tanh.approx.f32 t1, $2;\n"
        "fma.rn.f32 t0, $1, t0, $1;\n"
        "fma.rn.f32 t1, $2, t1, $2;\n"
        "cvt.rn.satfinite.f16x2.f32 $0, t1, t0;\n"
        "}",
        "=r,f,f")


def max_f16x2(a: Uint32, b: Uint32) -> Uint32:
    return _asm(Uint32, [Uint32(a), Uint32(b)], "max.f16x2 $0, $1, $2;", "=r,r,r")


def scaled_e4m3x4(pair_lo: Uint32, pair_hi: Uint32, multiplier: Uint32) -> Uint32:
    """e4m3 of two f16x2 pairs of P of one row times the row's multiplier (f16x2, the same value
    twice), packed as :func:`silu_e4m3x4` packs (``pair_lo`` in the low bytes)."""
    return _asm(
        Uint32, [Uint32(pair_lo), Uint32(pair_hi), Uint32(multiplier), Uint32(multiplier)],
        "{\n"
        ".reg .b32 a, b;\n"
        ".reg .b16 ea, eb;\n"
        "mul.rn.f16x2 a, $1, $3;\n"
        "mul.rn.f16x2 b, $2, $4;\n"
        "cvt.rn.satfinite.e4m3x2.f16x2 ea, a;\n"
        "cvt.rn.satfinite.e4m3x2.f16x2 eb, b;\n"
        "mov.b32 $0, {ea, eb};\n"
        "}",
        "=r,r,r,r,r")


def f16_half_to_f32(x: Uint32, high: bool) -> Float32:
    half = "hi" if high else "lo"
    return _asm(Float32, [Uint32(x)],
                "{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $1;\ncvt.f32.f16 $0, " + half + ";\n}", "=f,r")


def f32_to_f16x2_twice(x: Float32) -> Uint32:
    return _asm(Uint32, [Float32(x)], "cvt.rn.f16x2.f32 $0, $1, $1;", "=r,f")


def div_rn(a: Float32, b: Float32) -> Float32:
    """a / b correctly rounded (``div.rn.f32``), as PyTorch divides: the quantizers' 1 / scale
    matches hstu_cute.quantize bit for bit."""
    return _asm(Float32, [Float32(a), Float32(b)], "div.rn.f32 $0, $1, $2;", "=f,f,f")


def pow2_ceil(x: Float32) -> Float32:
    """The least power of two >= x (x positive and normal): round the exponent up unless the
    mantissa is zero."""
    return _asm(Float32, [Float32(x)],
                "{\n.reg .b32 b;\nmov.b32 b, $1;\nadd.u32 b, b, 0x7FFFFF;\nand.b32 b, b, 0xFF800000;\n"
                "mov.b32 $0, b;\n}", "=f,f")


def pow2_reciprocal(x: Float32) -> Float32:
    """1 / x for a normal power of two x, exactly (exponent 254 - e)."""
    return _asm(Float32, [Float32(x)],
                "{\n.reg .b32 b;\nmov.b32 b, $1;\nsub.u32 b, 0x7F000000, b;\nmov.b32 $0, b;\n}", "=f,f")


# Accumulator registers of the four values of one operand register: in each 16-column half (eight
# registers), row g takes pairs 0 and 2 (n8 groups 2h, 2h + 1), row g + 8 pairs 1 and 3.
ROW_G_SLOTS = (0, 1, 4, 5)
ROW_G8_SLOTS = (2, 3, 6, 7)


def _operand_words(acc: cute.Tensor, pack) -> cute.Tensor:
    """Words in operand order of a warpgroup's fp32 accumulator ((2, 2, K / 8), 1, 1; compact):
    word 2h is row g of 16-column half h, word 2h + 1 row g + 8 (module docstring), each
    ``pack`` of its four values. Traced inline."""
    n_words = cute.size(acc) // 4
    flat = cute.make_tensor(acc.iterator, cute.make_layout(cute.size(acc)))
    words = cute.make_rmem_tensor(cute.make_layout(n_words), Uint32)
    for h in range(n_words // 2):
        for r, slots in enumerate((ROW_G_SLOTS, ROW_G8_SLOTS)):
            words[2 * h + r] = pack(*(flat[8 * h + i] for i in slots))
    return words


@cute.jit
def silu_to_fp8_words(acc_S: cute.Tensor, half_alpha: Float32) -> cute.Tensor:
    """e4m3(silu(alpha * acc_S)) of a score accumulator (masked scores already 0, and
    silu(0) = 0), in operand order (:func:`_operand_words`)."""
    return _operand_words(acc_S, lambda *four: silu_e4m3x4(*(x * half_alpha for x in four)))


@cute.jit
def fp8_words(acc_P: cute.Tensor) -> cute.Tensor:
    """The operand-order words of :func:`silu_to_fp8_words` for a P computed already (the SiLU in
    place, masked): e4m3 of each value."""
    return _operand_words(acc_P, e4m3x4)


def _tree(values: list, combine):
    while len(values) > 1:
        values = [combine(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


@cute.jit
def silu_to_scaled_fp8_words(acc_S: cute.Tensor, half_alpha: Float32, dv: Float32, row_scale: cute.Tensor,
                             rescale: cute.Tensor) -> cute.Tensor:
    """The operand-order words of :func:`silu_to_fp8_words` for scaled P (quant modes >= 1; the rule is in
    :mod:`hstu_cute.fp8_format`): P in f16x2, each row's maximum over the quad (the quad's four
    lanes hold the whole row: two shuffles for both rows), then P * (dv / s) to e4m3.
    ``row_scale`` (2,): the running power-of-two scale of the thread's rows g and g + 8, updated;
    ``rescale`` (2,) <- s_old / s_new, what the accumulated output of each row must be multiplied
    by (0 where s was 0: a fresh tile)."""
    n_pairs = cute.size(acc_S) // 2
    flat = cute.make_tensor(acc_S.iterator, cute.make_layout(cute.size(acc_S)))
    pairs = cute.make_rmem_tensor(cute.make_layout(n_pairs), Uint32)
    for w in cutlass.range_constexpr(n_pairs):
        pairs[w] = silu_f16x2(flat[2 * w] * half_alpha, flat[2 * w + 1] * half_alpha)
    # Accumulator order: even pairs are row g, odd pairs row g + 8.
    row = _tree([pairs[w] for w in range(0, n_pairs, 2)], max_f16x2)
    row8 = _tree([pairs[w] for w in range(1, n_pairs, 2)], max_f16x2)
    both = max_f16x2(prmt(row, row8, Uint32(0x5410)), prmt(row, row8, Uint32(0x7632)))
    both = max_f16x2(both, cute.arch.shuffle_sync_bfly(both, 1))
    both = max_f16x2(both, cute.arch.shuffle_sync_bfly(both, 2))
    multipliers = []
    for i in cutlass.range_constexpr(2):
        amax = cute.arch.fmax(f16_half_to_f32(both, i == 1), Float32(P_AMAX_FLOOR))
        scale = cute.arch.fmax(row_scale[i], pow2_ceil(amax * dv * Float32(1.0 / E4M3_MAX)))
        inverse = pow2_reciprocal(scale)
        rescale[i] = row_scale[i] * inverse
        row_scale[i] = scale
        multipliers.append(f32_to_f16x2_twice(dv * inverse))
    words = cute.make_rmem_tensor(cute.make_layout(n_pairs // 2), Uint32)
    for h in cutlass.range_constexpr(n_pairs // 4):
        for r in cutlass.range_constexpr(2):
            words[2 * h + r] = scaled_e4m3x4(pairs[4 * h + r], pairs[4 * h + 2 + r], multipliers[r])
    return words


def e4m3x4(x0: Float32, x1: Float32, x2: Float32, x3: Float32) -> Uint32:
    """e4m3 of four fp32 values (round to nearest, saturating at +-448), packed low to high."""
    return _asm(
        Uint32, [Float32(x) for x in (x0, x1, x2, x3)],
        "{\n"
        ".reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
        "mov.b32 $0, {lo, hi};\n"
        "}",
        "=r,f,f,f,f")


#: The least running scale of a re-quantized row (the backward's P^T, G^T and G): a row that is all
#: zeros (masked) keeps a normal power of two, so its reciprocal stays exact and finite.
MIN_ROW_SCALE = 2.0 ** -100


@cute.jit
def scaled_fp8_words(acc: cute.Tensor, base: Float32, floor: Float32, row_scale: cute.Tensor,
                     rescale: cute.Tensor) -> cute.Tensor:
    """e4m3 words in operand order (as :func:`silu_to_fp8_words` packs them) of ``acc * base``, a
    fp32 WGMMA accumulator of any sign re-quantized per row with a running power-of-two scale
    (the FP8 backward's P^T, G^T and G; ``base``: the descale of the other operand of the GEMM the
    words feed, folded in here). Each row's ``max(max |x|, floor) * base / 448`` (the quad's four
    lanes hold the whole row) sets ``need``; ``row_scale`` (2,) <- max(row_scale, pow2_ceil(need)),
    and ``rescale`` (2,) <- s_old / s_new, what the rows accumulated so far must be multiplied by
    (0 where s was 0). The values are scaled in fp32: G can be far below f16's normal range."""
    n = cute.size(acc)
    flat = cute.make_tensor(acc.iterator, cute.make_layout(n))
    magnitudes = [cute.arch.fmax(flat[k], -flat[k]) for k in range(n)]
    # Accumulator order: flat[4j + 2i + c] is row g + 8i.
    row_max = [_tree([magnitudes[k] for k in range(n) if (k % 4) // 2 == i], cute.arch.fmax) for i in (0, 1)]
    multipliers = []
    for i in cutlass.range_constexpr(2):
        amax = cute.arch.fmax(row_max[i], cute.arch.shuffle_sync_bfly(row_max[i], 1))
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 2))
        need = cute.arch.fmax(cute.arch.fmax(amax, floor) * base * Float32(1.0 / E4M3_MAX), Float32(MIN_ROW_SCALE))
        scale = cute.arch.fmax(row_scale[i], pow2_ceil(need))
        inverse = pow2_reciprocal(scale)
        rescale[i] = row_scale[i] * inverse
        row_scale[i] = scale
        multipliers.append(base * inverse)
    words = cute.make_rmem_tensor(cute.make_layout(n // 4), Uint32)
    for h in cutlass.range_constexpr(n // 8):
        for r in cutlass.range_constexpr(2):
            slots = (ROW_G_SLOTS, ROW_G8_SLOTS)[r]
            words[2 * h + r] = e4m3x4(*(flat[8 * h + s] * multipliers[r] for s in slots))
    return words


@cute.jit
def scale_rows(acc: cute.Tensor, factors: cute.Tensor):
    """Multiply the thread's rows (g, g + 8) of a WGMMA accumulator by ``factors`` (2,)."""
    rc = cute.make_tensor(acc.iterator, wgmma_acc_rows_cols(acc.layout))
    for i in cutlass.range_constexpr(cute.size(rc.shape[0])):
        for j in cutlass.range_constexpr(cute.size(rc.shape[1])):
            rc[i, j] = rc[i, j] * factors[i]


@cute.jit
def scale_columns(acc: cute.Tensor, factors: cute.Tensor):
    """Multiply the thread's columns of a WGMMA accumulator by ``factors`` (one per column, in
    the order of :func:`common.sm90.wgmma_acc_rows_cols`'s column mode)."""
    rc = cute.make_tensor(acc.iterator, wgmma_acc_rows_cols(acc.layout))
    for j in cutlass.range_constexpr(cute.size(rc.shape[1])):
        for i in cutlass.range_constexpr(cute.size(rc.shape[0])):
            rc[i, j] = rc[i, j] * factors[j]


@cute.jit
def rescale_rows_if_needed(acc: cute.Tensor, rescale: cute.Tensor):
    """:func:`scale_rows` by the ``rescale`` of :func:`silu_to_scaled_fp8_words`, skipped (one vote
    per warp) when no row of the warp changed scale: after the first key blocks it rarely does."""
    if cute.arch.vote_any_sync((rescale[0] < Float32(1.0)) | (rescale[1] < Float32(1.0))):
        scale_rows(acc, rescale)


def _ordered_copy(x: Uint32) -> Uint32:
    return _asm(Uint32, [Uint32(x)], "mov.b32 $0, $1;", "=r,r", ordered=True)


@cute.jit
def words_to_operand_a(words: cute.Tensor, rP: cute.Tensor):
    """``rP`` (an 8-bit register A operand fragment, ((4, 2, 2), 1, K / 32)) <- the operand-order
    words of :func:`silu_to_fp8_words`, one ordered move each (side effects): call this after the
    ``wait_group`` that retires the WGMMA reading ``rP``, so that ``rP`` is only written once the
    tensor cores are done with it (computed straight into ``rP``, the next P makes ptxas serialize
    every WGMMA of the kernel, C7513)."""
    out = cute.recast_tensor(cute.make_tensor(rP.iterator, cute.make_layout(cute.size(rP))), Uint32)
    for w in cutlass.range_constexpr(cute.size(words)):
        out[w] = _ordered_copy(words[w])


@cute.jit
def zero_smem_cols_past(zero_copy, sX: cute.Tensor, tile_shape: cutlass.Constexpr, tid_in_wg: Int32, wg: Int32,
                        col_limit: Int32):
    """Zero the columns at and past ``col_limit`` of a (rows, cols) 8-bit smem tile (one
    warpgroup; the other may write the same zeros), then fence for WGMMA reads and sync the
    warpgroup. ``zero_copy``: :func:`common.sm90.rows_zero_copy` over the tile's columns (16-byte
    chunks along a row, 16 columns each). The V^T tile of the FP8 forward holds keys along its
    columns, each 16-key group in ``KEY_AT_COLUMN`` order: past the sequence TMA reads the next
    sequence's values, and P = 0 there times a NaN would be NaN."""
    thr = zero_copy.get_slice(tid_in_wg)
    tZc = thr.partition_D(cute.make_identity_tensor(tile_shape))
    tZs = thr.partition_D(sX)
    zeros = cute.make_fragment_like(tZs[None, 0, 0], sX.element_type)
    zeros.fill(0.0)
    vec = cute.size(tZs.shape[0])
    assert vec == 16, "one chunk per 16-key group"
    for m in cutlass.range_constexpr(cute.size(tZs.shape[1])):
        for n in cutlass.range_constexpr(cute.size(tZs.shape[2])):
            col0 = tZc[0, m, n][1]
            if col0 >= col_limit:
                cute.autovec_copy(zeros, tZs[None, m, n])
            elif col0 + vec > col_limit:
                for e in cutlass.range_constexpr(vec):
                    if col0 + key_at_column(e) >= col_limit:
                        tZs[e, m, n] = sX.element_type(0.0)
    cute.arch.fence_view_async_shared()
    cute.arch.barrier(barrier_id=NamedBarrier.ZERO_ROWS_WG0 + wg, number_of_threads=128)


# Quant mode 1 (two-direction): per-token descales of the score products and per-(block, dim)
# descales of the token-contiguous copies, which scale an accumulator's columns.
@cute.jit
def row_token_descales(mTable, first: Int32, last: Int32, head: Int32, tAcc_rc) -> cute.Tensor:
    """The (T, H) table's descales of one head for the tokens ``first + r`` of the thread's two
    accumulator rows r (``tAcc_rc``: identity coordinates, rows x columns), clamped to ``last``
    (rows past a sequence are masked or never stored), (2,) fp32."""
    out = cute.make_rmem_tensor(cute.make_layout(2), Float32)
    for i in cutlass.range_constexpr(2):
        out[i] = mTable[cutlass.min(first + tAcc_rc[i, 0][0], last), head]
    return out


@cute.jit
def tile_token_descales(mTable, first: Int32, last: Int32, head: Int32, columns: cutlass.Constexpr[int]
                        ) -> cute.Tensor:
    """What a lane holds of the (T, H) table's descales of one head for the tokens ``first + c``
    of an accumulator tile's columns (``columns`` per thread, 4x that per tile): every 32nd token,
    clamped to ``last``. :func:`column_descale` shuffles a thread's columns out of them; one load
    per thread and column instead cost ~3x more (H100, quant mode 1 backward)."""
    lane = cute.arch.lane_idx()
    held = cute.make_rmem_tensor(cute.make_layout(4 * columns // 32), Float32)
    for r in cutlass.range_constexpr(cute.size(held)):
        held[r] = mTable[cutlass.min(first + lane + 32 * r, last), head]
    return held


def column_descale(held: cute.Tensor, j: int) -> Float32:
    """The descale of the thread's accumulator column ``j`` (in the order of
    :func:`common.sm90.wgmma_acc_rows_cols`: tile column 8 (j // 2) + 2 (lane % 4) + j % 2) from
    :func:`tile_token_descales`: lane (column % 32) holds it, in register column // 32. Plain
    Python (traced inline), so that the shuffle sits beside its use."""
    source = 8 * ((j // 2) % 4) + 2 * (cute.arch.lane_idx() % 4) + j % 2
    return cute.arch.shuffle_sync(held[j // 8], source)


@cute.jit
def dim_descales(scale_row: cute.Tensor, tAcc_rc, inverse_row=None) -> cute.Tensor:
    """Per column of the thread's accumulator columns (``tAcc_rc``: identity coordinates, rows x
    columns) its entry of ``scale_row`` (one (D,) row of a (B, blocks, H, 2, D) table: a block's
    scales) or, with ``inverse_row`` (another block's reciprocals), their product: the factor that
    moves columns accumulated in the first block's units to the second's. A thread's columns come
    in pairs (2q, 2q + 1 of each n8 group): one 8-byte load per pair and table row."""
    ratios = cute.make_rmem_tensor(cute.make_layout(cute.size(tAcc_rc.shape[1])), Float32)
    pair_old = cute.make_rmem_tensor(cute.make_layout(2), Float32)
    pair_new = cute.make_rmem_tensor(cute.make_layout(2), Float32)
    for p in cutlass.range_constexpr(cute.size(ratios) // 2):
        pair = tAcc_rc[0, 2 * p][1] // 2
        cute.autovec_copy(cute.local_tile(scale_row, (2,), (pair,)), pair_old)
        if cutlass.const_expr(inverse_row is None):
            for c in cutlass.range_constexpr(2):
                ratios[2 * p + c] = pair_old[c]
        else:
            cute.autovec_copy(cute.local_tile(inverse_row, (2,), (pair,)), pair_new)
            for c in cutlass.range_constexpr(2):
                ratios[2 * p + c] = pair_old[c] * pair_new[c]
    return ratios


# The fused FP8 backward (hopper.bwd_fp8, ``fuse_dq``): G from a warpgroup's key-major G^T accumulator
# into the K-major A operand of dQ = G K^T8 in shared memory.
#: Layout of the per-warpgroup G scale exchange: (4 warps' maxima + the scale, warpgroup, sG buffer).
G_SCALE_SLOTS = (5, 2, 2)


@cute.jit
def g_to_smem_keys_contiguous(acc_G: cute.Tensor, base: Float32, sG: cute.Tensor, sScales: cute.Tensor, buf: Int32,
                              wg: Int32, tid_in_wg: Int32):
    """Store ``acc_G * base`` (a warpgroup's (64 keys, 64 queries) fp32 WGMMA accumulator, G^T) as
    e4m3 G[query, key] into rows 0-63, key columns ``64 wg``.. of ``sG`` ((64, 128) 8-bit, the
    128-byte swizzle of :func:`common.sm90.sm90_smem_layout`, 1024-byte aligned), the keys of
    every 16-key group in ``KEY_AT_COLUMN`` order, as K^T holds them. One power-of-two scale for
    the warpgroup's tile (``pow2_ceil(max(max |G| base, 2^-100 448) / 448)``: its four warps'
    maxima meet in ``sScales[warp, wg, buf]``, one warpgroup barrier) goes to
    ``sScales[4, wg, buf]``; the values are ``e4m3(G base / scale)``.

    A 32-bit word of a G row takes keys (2m, 2m + 1, 2m + 8, 2m + 9) of a 16-key group: rows g
    and g + 8 of the lanes with g = 2m and 2m + 1 (lanes l and l ^ 4). Each lane packs its two
    rows at its two query columns, swaps the word with its partner (one shuffle) and keeps one
    query's four keys (one byte permute): the even lane the first column, the odd lane the
    second. The stores are one 16-byte chunk per lane pair and row, conflict-free."""
    n = cute.size(acc_G)
    flat = cute.make_tensor(acc_G.iterator, cute.make_layout(n))
    amax = _tree([cute.arch.fmax(flat[k], -flat[k]) for k in range(n)], cute.arch.fmax)
    for offset in (1, 2, 4, 8, 16):
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset))
    warp, lane = tid_in_wg // 32, tid_in_wg % 32
    if lane == 0:
        sScales[warp, wg, buf] = amax
    cute.arch.barrier(barrier_id=NamedBarrier.ZERO_ROWS_WG0 + wg, number_of_threads=128)
    amax = cute.arch.fmax(cute.arch.fmax(sScales[0, wg, buf], sScales[1, wg, buf]),
                          cute.arch.fmax(sScales[2, wg, buf], sScales[3, wg, buf]))
    scale = pow2_ceil(cute.arch.fmax(amax * base * Float32(1.0 / E4M3_MAX), Float32(MIN_ROW_SCALE)))
    if tid_in_wg == 0:
        sScales[4, wg, buf] = scale
    multiplier = base * pow2_reciprocal(scale)
    g = lane // 4
    odd = g % 2
    # (b:a) byte picks: even lane a0 b0 a1 b1 (its column), odd lane b2 a2 b3 a3 (the next one).
    selector = cutlass.select_(odd == 1, Uint32(0x3726), Uint32(0x5140))
    row = 2 * (lane % 4) + odd
    chunk = (wg * 4 + warp) ^ row
    address = sG.iterator.toint() + row * 128 + chunk * 16 + (g // 2) * 4
    for j in cutlass.range_constexpr(n // 4):
        # flat[4j + 2i + c]: row g + 8i, column 8j + 2 (lane % 4) + c.
        own = e4m3x4(flat[4 * j] * multiplier, flat[4 * j + 2] * multiplier, flat[4 * j + 1] * multiplier,
                     flat[4 * j + 3] * multiplier)
        word = prmt(own, cute.arch.shuffle_sync_bfly(own, 4), selector)
        ptr = cute.make_ptr(Uint32, address + j * 1024, cute.AddressSpace.smem, assumed_align=4)
        cute.make_tensor(ptr, cute.make_layout(1))[0] = word


@cute.jit
def cast_tile_e4m3(sSrc: cute.Tensor, sDst: cute.Tensor, inverse: Float32, tidx: Int32,
                   num_threads: cutlass.Constexpr[int]):
    """e4m3(x * ``inverse``) of a 16-bit (rows, cols) smem tile into an e4m3 tile of the same
    logical shape, each in its own (swizzled WGMMA) layout, by ``num_threads`` threads: runs of 8
    elements along cols (16 bytes read, 8 written; both swizzles keep such a run contiguous). The
    arithmetic of the quantizers (hstu_cute.hopper.quantize), so the bytes match theirs. The
    caller fences (``fence_proxy`` async shared) before a WGMMA reads ``sDst``."""
    rows, cols = cute.size(sSrc, mode=[0]), cute.size(sSrc, mode=[1])
    chunks = cols // 8
    assert cols % 8 == 0 and num_threads % chunks == 0
    lanes_per_row = chunks
    rows_per_pass = num_threads // lanes_per_row
    chunk = tidx % lanes_per_row
    row = tidx // lanes_per_row
    values = cute.make_rmem_tensor(cute.make_layout(8), sSrc.element_type)
    out = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float8E4M3FN)
    for r in cutlass.range(row, rows, rows_per_pass, unroll=2):
        cute.autovec_copy(cute.local_tile(sSrc[r, None], (8,), (chunk,)), values)
        out.store((values.load().to(Float32) * inverse).to(cutlass.Float8E4M3FN))
        cute.autovec_copy(out, cute.local_tile(sDst[r, None], (8,), (chunk,)))
