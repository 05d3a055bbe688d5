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

``max P`` instead of ``max |P|``: silu is never below -0.279, so with the floor of 0.5 the
negative values can not saturate, and a row whose P stays below 0.5 still keeps every value above
~1e-5 of it in e4m3's normal range. Powers of two make every rescale exact.
"""

E4M3_MAX = 448.0
# The smallest scale a quantizer group gets (an all-zero group keeps finite values).
SCALE_FLOOR = 1e-6
# Tokens per block of quant modes 1 and 2, counted from each sequence's start: the Hopper
# forward's query tile (its key tiles divide it).
BLOCK_TOKENS = 128
# The floor of a row's P maximum in the scaled-P rule above.
P_AMAX_FLOOR = 0.5
