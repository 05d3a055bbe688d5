"""The numbers that define FP8 (e4m3) quantization in hstu-cute, in one place for the quantizers
(:mod:`hstu_cute.quantize`), the FP8 oracle (:func:`hstu_cute.reference.hstu_attn_fp8_emulation`)
and the kernels (:mod:`hstu_cute.hopper.fwd`). Imports nothing.

Quantizer groups (``quant_mode`` 1-5; the groups are in :mod:`hstu_cute.quantize`): a group's scale
is ``max(amax * fp32(1 / E4M3_MAX), SCALE_FLOOR)`` and ``x8 = e4m3(x * (1 / scale))`` in fp32,
saturating at +-448 (within an ulp of ``x / scale`` before the e4m3 rounding; multiplications are
what the device computes cheaply and what PyTorch computes for a division by a scalar).

Scaled P (``quant_mode`` 1-5). The forward re-quantizes P = silu(scores) per query row with a
running power-of-two scale ``s``, visiting a tile's key blocks (``tile_n`` keys from the sequence
start) from the last to the first, as the kernel does. At each block j, with ``dv_j`` the V
descale of that block's keys:

* ``need = pow2_ceil(dv_j * max(max_k P[row, k], P_AMAX_FLOOR) / E4M3_MAX)``;
* ``s = max(s, need)`` (``s`` starts at 0 for every row);
* ``P8 = e4m3(P * (dv_j / s))``, and the accumulated output is rescaled by ``s_old / s`` when
  ``s`` grows; the epilogue multiplies by the final ``s``.

Mode 1 takes ``dv_j = 1`` here: its V descales are per (block, head, dim), so they scale the
output's columns instead (:class:`hstu_cute.hopper.fwd.HstuForwardSm90`, ``two_direction``).

``max P`` instead of ``max |P|``: silu is never below -0.279, so with the floor of 0.5 the
negative values can not saturate, and a row whose P stays below 0.5 still keeps every value above
~1e-5 of it in e4m3's normal range. Powers of two make every rescale exact.
"""

#: quant_mode values with a kernel behind them (-1: no FP8, or pre-quantized inputs).
BUILT_QUANT_MODES = (-1, 0, 1, 2, 3, 4, 5)
E4M3_MAX = 448.0
# The smallest scale a quantizer group gets (an all-zero group keeps finite values).
SCALE_FLOOR = 1e-6
# Tokens per block of quant modes 1 and 2, counted from each sequence's start: the Hopper
# forward's query tile (its key tiles divide it).
BLOCK_TOKENS = 128
# Tensors (slots) one quantizer launch takes at most (hstu_cute.hopper.quantize).
QUANT_MAX_SLOTS = 4
# The floor of a row's P maximum in the scaled-P rule above.
P_AMAX_FLOOR = 0.5

# V^T (H, D, W), the FP8 forward's token-contiguous copy of V: where each sequence starts, how wide
# it is, and the key order inside every 16-key group (recipe B of docs/design/fp8-forward.md). Within each group of 16 keys counted
# from the sequence start, V^T column p holds key KEY_AT_COLUMN[p]: the order in which the forward
# packs a thread's accumulator columns into the 8-bit register A operand of a k32 WGMMA when each
# 32-bit register takes the thread's two column pairs of one row (n8 groups 2h and 2h + 1), so P
# goes from the accumulator to the operand without shuffles or byte permutes.
KEY_AT_COLUMN = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)
COLUMN_OF_KEY = tuple(KEY_AT_COLUMN.index(k) for k in range(16))


def column_of_key(k):
    """COLUMN_OF_KEY[k] for k in [0, 16) by bit arithmetic (works on ints and DSL integers)."""
    return ((k & 7) >> 1) * 4 + (k & 1) + ((k >> 3) << 1)


def key_at_column(p):
    """KEY_AT_COLUMN[p] for p in [0, 16) by bit arithmetic."""
    return ((p >> 2) << 1) + (p & 1) + (((p >> 1) & 1) << 3)


def vt_column_start(k_start, batch):
    """Column of V^T where sequence ``batch`` (first key token ``k_start``) starts: every
    sequence 16-token aligned (a TMA box must start 16-byte aligned along the contiguous
    dimension), a closed form the forward recomputes (works on ints and DSL integers)."""
    return (k_start + 15) // 16 * 16 + 16 * batch


def vt_width(tokens: int, batch: int) -> int:
    """Columns of V^T for ``tokens`` keys in ``batch`` sequences (:func:`vt_column_start`): every
    sequence fits before the next one's start, whatever the lengths."""
    return -(-tokens // 16) * 16 + 16 * batch + 16


def vt_key_column(position):
    """Column of key ``position`` (counted from its sequence's start) in V^T, relative to the
    sequence's first column (works on ints and DSL integers)."""
    return position - (position & 15) + column_of_key(position & 15)
