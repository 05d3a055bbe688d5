"""SiLU and its gradient in fp32 registers (spec: docs/operator.md, "Math"), in the two forms the
kernels use: one MUFU ``tanh.approx`` per element (bf16: well below its rounding of P), or an
``exp2`` and an ``rcp.approx`` (fp16, which keeps three more mantissa bits)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass._mlir.dialects import llvm

from .sm90 import wgmma_acc_rows_cols


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
def silu_and_grad_inplace(acc_s: cute.Tensor, acc_dp: cute.Tensor, alpha: Float32, inv_scale: Float32,
                          fast: cutlass.Constexpr[bool]):
    """acc_s <- P = silu(alpha s) / S_len;  acc_dp <- G = alpha silu'(alpha s) dP / S_len."""
    alpha_scaled = alpha * inv_scale
    for i in cutlass.range(cute.size(acc_s), unroll_full=True):
        z = acc_s[i] * alpha
        if const_expr(fast):
            sig = Float32(0.5) + Float32(0.5) * tanh_approx(z * Float32(0.5))
        else:
            sig = rcp_approx(Float32(1.0) + cute.math.exp2(z * Float32(-1.4426950408889634), fastmath=True))
        acc_s[i] = z * sig * inv_scale
        acc_dp[i] = acc_dp[i] * alpha_scaled * (sig * (Float32(1.0) + z * (Float32(1.0) - sig)))


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


def silu_and_grad_token_scaled(acc_s: cute.Tensor, acc_dp: cute.Tensor, half_alpha: Float32, s_rows, s_cols,
                               dp_rows: cute.Tensor, dp_cols):
    """:func:`silu_and_grad_unscaled` of scores ``acc_s[r, c] * s_rows[r] * s_cols(c)`` and of
    ``acc_dp[r, c] * dp_rows[r] * dp_cols(c)``: per-token descales of both GEMMs' operands
    (quant mode 1), two or three FP32 ops per element more; ``s_rows`` None: the scores are
    scaled already (:func:`scale_scores_by_tokens`). Rows and columns as in
    :func:`common.sm90.wgmma_acc_rows_cols`; ``s_cols`` / ``dp_cols`` give a column's descale
    (called once per column, beside its use). Plain Python, traced inline."""
    rc_s = cute.make_tensor(acc_s.iterator, wgmma_acc_rows_cols(acc_s.layout))
    rc_dp = cute.make_tensor(acc_dp.iterator, wgmma_acc_rows_cols(acc_dp.layout))
    row_factors = None if s_rows is None else [s_rows[i] * half_alpha for i in range(2)]
    for j in range(cute.size(rc_s.shape[1])):
        s_col = None if s_rows is None else s_cols(j)
        dp_col = dp_cols(j)
        for i in range(2):
            h = rc_s[i, j] * (half_alpha if s_rows is None else row_factors[i] * s_col)
            t = tanh_approx(h)
            rc_s[i, j] = h + h * t
            w = rc_dp[i, j] * (dp_rows[i] * dp_col) * ((h + Float32(1.0)) - h * t)
            rc_dp[i, j] = w + w * t


def scale_scores_by_tokens(acc_s: cute.Tensor, s_rows: cute.Tensor, s_cols, rab: cute.Tensor):
    """``acc_s[r, c] <- acc_s[r, c] * s_rows[r] * s_cols(c) + rab[r, c]`` (``rab``: 16-bit, in the
    accumulator's layout): with rab, the scores are final before the SiLU, and rab's registers
    are free before dP is waited for. Plain Python, traced inline."""
    rc_s = cute.make_tensor(acc_s.iterator, wgmma_acc_rows_cols(acc_s.layout))
    rc_rab = cute.make_tensor(rab.iterator, wgmma_acc_rows_cols(rab.layout))
    for j in range(cute.size(rc_s.shape[1])):
        s_col = s_cols(j)
        for i in range(2):
            rc_s[i, j] = rc_s[i, j] * (s_rows[i] * s_col) + rc_rab[i, j].to(Float32)


@cute.jit
def silu_and_grad(acc_S, acc_dP, alpha: Float32, inv_scale: Float32, fast: cutlass.Constexpr[bool],
                  unscaled: cutlass.Constexpr[bool]):
    """P and G (spec section 2) from S and dP, in place; ``unscaled`` (the tanh SiLU only):
    S_len P and 2 S_len G / alpha, four to five fewer FP32 ops per element, and the caller scales
    dV by 1 / S_len, dK, dQ (and drab) by alpha / (2 S_len). H100 B8 N4096 causal bf16: D128
    pair 470 vs 440 TF, fused 462 vs 446, D64 361 vs 322, D32 220 vs 185."""
    if const_expr(unscaled):
        silu_and_grad_unscaled(acc_S, acc_dP, alpha * Float32(0.5))
    else:
        silu_and_grad_inplace(acc_S, acc_dP, alpha, inv_scale, fast)
