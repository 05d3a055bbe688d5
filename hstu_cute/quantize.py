"""FP8 (e4m3) quantizers of the ``quant_mode`` path (docs/operator.md, FP8 section) in PyTorch: the
description that the device quantizers (:mod:`hstu_cute.hopper.quantize`, run by
:func:`hstu_cute.launch.quantize_for`) match bit for bit, and the FP8 oracle's inputs.

Every mode is a handful of tensor ops whose output shapes depend only on the input shapes,
``batch`` and ``max_seqlen`` (never on the offsets' values): no host loop over sequences, no
``.item()``, so the quantizers run inside CUDA graphs and trace under ``torch.compile`` and
``torch.export`` (the peer's per-sequence host loops broke both).

A group's scale is ``max(amax * (1 / 448), 1e-6)`` over the group (fp32), ``x8 = e4m3(x * (1 / scale))`` (in
fp32; within an ulp of ``x / scale`` before the e4m3 rounding), and the
scale is what dequantizes: ``x ~ x8 * scale``. The cast saturates at +-448 (torch's e4m3 cast
would give NaN past it): mode 0 has no scale, so values beyond 448 clamp rather than poison the
output, and tokens past the last sequence (padding) stay finite.

Groups (``QuantMode``), for a (T, H, D) tensor of a jagged batch of B sequences:

* 0 ``CAST``: no scaling; ``scale`` is ones (1,).
* 1 ``TWO_DIRECTION``: per (token, head) over D, ``scale`` (T, H); plus a token-contiguous copy
  (H, D, T16) for the K-major operand of P.V, scaled per (block of ``block`` tokens, head, dim)
  (``scale_t`` (B, blocks, H, D)); T16 is T rounded up to 16 so that every row of the copy is
  16-byte aligned for TMA, whatever the token count (the tail is zeros).
* 2 ``PER_BLOCK``: per (block of ``block`` tokens, head), blocks restarting at every sequence
  start; ``scale`` (B, blocks, H).
* 3 ``PER_HEAD``: per (sequence, head); ``scale`` (B, H).
* 4 ``PER_SEQUENCE``: per sequence; ``scale`` (B,).
* 5 ``PER_TENSOR``: every token of the batch; ``scale`` (1,).

``blocks`` is ``ceil(max_seqlen / block)``; groups no token falls in keep the floor scale.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .fp8_format import BLOCK_TOKENS, E4M3_MAX, SCALE_FLOOR
from .fp8_recipe import QuantMode, ScaleGroup, recipe

E4M3 = torch.float8_e4m3fn
# Rows of mode 1's token-contiguous copy are padded to this many tokens (16 bytes of e4m3).
ROW_ALIGN_TOKENS = 16


__all__ = ["QuantMode", "Quantized", "quantize", "dequantize", "descale_table", "token_scales", "quantize_qkv",
           "quantize_batch", "num_blocks"]


class Quantized(NamedTuple):
    """One quantized (T, H, D) tensor: ``data`` e4m3 (T, H, D) and its ``scale``; mode 1 adds
    the token-contiguous copy ``data_t`` (H, D, T16) and its ``scale_t`` (B, blocks, H, D)."""

    data: torch.Tensor
    scale: torch.Tensor
    data_t: torch.Tensor | None = None
    scale_t: torch.Tensor | None = None


class _Tokens(NamedTuple):
    """Where each token sits: its sequence (clamped to B - 1), its block inside that sequence
    (clamped to blocks - 1) and whether it belongs to any sequence at all."""

    seq: torch.Tensor  # (T,) int64
    block: torch.Tensor  # (T,) int64
    valid: torch.Tensor  # (T,) bool


def _tokens(seq_offsets: torch.Tensor, tokens: int, blocks: int, block: int) -> _Tokens:
    offsets = seq_offsets.to(torch.int64)
    batch = offsets.shape[0] - 1
    pos = torch.arange(tokens, device=offsets.device, dtype=torch.int64)
    seq = (torch.searchsorted(offsets, pos, right=True) - 1).clamp(0, max(batch - 1, 0))
    valid = (pos >= offsets[0]) & (pos < offsets[-1])
    blk = ((pos - offsets[seq]) // block).clamp(0, blocks - 1)
    return _Tokens(seq, blk, valid)


def _group_amax(values: torch.Tensor, index: torch.Tensor, groups: int) -> torch.Tensor:
    """amax of ``values`` (N,) into ``groups`` bins by ``index`` (N,); empty bins read 0."""
    out = torch.zeros(groups, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, index, values, reduce="amax", include_self=True)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    # amax * fp32(1 / 448): what torch's division by a scalar computes on the GPU, and what the
    # device quantizers compute.
    return torch.clamp(amax * (1.0 / E4M3_MAX), min=SCALE_FLOOR)


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x * (1 / scale) in fp32, as the device quantizers compute it (within an ulp of x / scale).
    return torch.clamp(x * (1.0 / scale), -E4M3_MAX, E4M3_MAX).to(E4M3)


def num_blocks(max_seqlen: int, block: int = BLOCK_TOKENS) -> int:
    return max(-(-max_seqlen // block), 1)


def quantize(x: torch.Tensor, mode: int, seq_offsets: torch.Tensor, max_seqlen: int,
             block: int = BLOCK_TOKENS) -> Quantized:
    """Quantize a jagged (T, H, D) 16-bit (or fp32) tensor to e4m3 with ``mode``'s groups."""
    group = recipe(QuantMode(mode)).group
    tokens, heads, dim = x.shape
    batch = seq_offsets.shape[0] - 1
    blocks = num_blocks(max_seqlen, block)
    if group is ScaleGroup.NONE:
        # No scale: clamp in the input dtype (+-448 is exact in bf16 and fp16) and cast, two
        # passes instead of an fp32 copy first.
        scale = torch.ones(1, dtype=torch.float32, device=x.device)
        return Quantized(torch.clamp(x, -E4M3_MAX, E4M3_MAX).to(E4M3), scale)
    xf = x.float()
    if group is ScaleGroup.TENSOR:
        # Over the sequences' tokens (not the padding past them); the appended zero keeps an
        # empty tensor (no tokens) legal without a shape branch.
        valid = _tokens(seq_offsets, tokens, blocks, block).valid
        scale = _scale(torch.cat([(xf.abs() * valid[:, None, None]).reshape(-1), xf.new_zeros(1)]).amax().reshape(1))
        return Quantized(_cast(xf, scale), scale)
    if group is ScaleGroup.TOKEN:
        scale = _scale(xf.abs().amax(dim=2))  # (T, H)
        data = _cast(xf, scale[:, :, None])
        data_t, scale_t = _token_contiguous_copy(xf, seq_offsets, batch, blocks, block)
        return Quantized(data, scale, data_t, scale_t)

    where = _tokens(seq_offsets, tokens, blocks, block)
    per_head = xf.abs().amax(dim=2) * where.valid[:, None]  # (T, H), padding tokens excluded
    head_ids = torch.arange(heads, device=x.device, dtype=torch.int64)
    if group is ScaleGroup.BLOCK:
        index = (where.seq * blocks + where.block)[:, None] * heads + head_ids  # (T, H)
        scale = _scale(_group_amax(per_head.reshape(-1), index.reshape(-1), batch * blocks * heads))
        scale = scale.reshape(batch, blocks, heads)
        token_scale = scale[where.seq, where.block]  # (T, H)
    elif group is ScaleGroup.HEAD:
        index = where.seq[:, None] * heads + head_ids
        scale = _scale(_group_amax(per_head.reshape(-1), index.reshape(-1), batch * heads)).reshape(batch, heads)
        token_scale = scale[where.seq]  # (T, H)
    else:  # PER_SEQUENCE
        scale = _scale(_group_amax(per_head.amax(dim=1), where.seq, batch))
        token_scale = scale[where.seq][:, None].expand(tokens, heads)
    return Quantized(_cast(xf, token_scale[:, :, None]), scale)


def _token_contiguous_copy(xf: torch.Tensor, seq_offsets: torch.Tensor, batch: int, blocks: int, block: int):
    """Mode 1's second copy: (H, D, T16) e4m3, scaled per (block, head, dim)."""
    tokens, heads, dim = xf.shape
    where = _tokens(seq_offsets, tokens, blocks, block)
    group = where.seq * blocks + where.block  # (T,)
    values = (xf.abs() * where.valid[:, None, None]).reshape(tokens, heads * dim)
    index = group[:, None].expand(tokens, heads * dim)
    amax = torch.zeros(batch * blocks, heads * dim, dtype=torch.float32, device=xf.device)
    amax = amax.scatter_reduce(0, index, values, reduce="amax", include_self=True)
    scale_t = _scale(amax).reshape(batch, blocks, heads, dim)
    data = _cast(xf, scale_t[where.seq, where.block])  # (T, H, D)
    tail = -tokens % ROW_ALIGN_TOKENS
    # Padded as bytes (no pad kernel for e4m3); zero bytes are e4m3 zeros.
    data_t = torch.nn.functional.pad(data.permute(1, 2, 0).view(torch.uint8), (0, tail)).view(E4M3)
    return data_t, scale_t


def descale_table(scale: torch.Tensor, mode: int, batch: int, heads: int) -> torch.Tensor:
    """A quantizer's ``scale`` (modes 2-5) as the (B, blocks, H) fp32 table the FP8 forward
    reads per (sequence, block, head): one block for modes 3-5."""
    group = recipe(QuantMode(mode)).group
    if group is ScaleGroup.BLOCK:
        table = scale
    elif group is ScaleGroup.HEAD:
        table = scale[:, None, :]
    elif group is ScaleGroup.SEQUENCE:
        table = scale[:, None, None].expand(batch, 1, heads)
    elif group is ScaleGroup.TENSOR:
        table = scale.reshape(1, 1, 1).expand(batch, 1, heads)
    else:
        raise ValueError(f"quant_mode {int(mode)} has no per-(sequence, block, head) descale table")
    return table.contiguous()


def token_scales(qx: Quantized, mode: int, seq_offsets: torch.Tensor, max_seqlen: int,
                 block: int = BLOCK_TOKENS) -> torch.Tensor:
    """The (T, H) fp32 scale of every token and head of a :class:`Quantized` (its first copy)."""
    group = recipe(QuantMode(mode)).group
    tokens, heads = qx.data.shape[:2]
    if group in (ScaleGroup.NONE, ScaleGroup.TENSOR):
        return qx.scale.reshape(1, 1).expand(tokens, heads)
    if group is ScaleGroup.TOKEN:
        return qx.scale
    where = _tokens(seq_offsets, tokens, num_blocks(max_seqlen, block), block)
    if group is ScaleGroup.BLOCK:
        return qx.scale[where.seq, where.block]
    if group is ScaleGroup.HEAD:
        return qx.scale[where.seq]
    return qx.scale[where.seq][:, None].expand(tokens, heads)


def dequantize(qx: Quantized, mode: int, seq_offsets: torch.Tensor, max_seqlen: int,
               block: int = BLOCK_TOKENS, token_contiguous: bool = False) -> torch.Tensor:
    """fp32 (T, H, D) from a :class:`Quantized` (the emulation oracle's inputs); with
    ``token_contiguous`` mode 1's second copy (what the P.V GEMM reads) instead of the first."""
    if recipe(QuantMode(mode)).two_direction and token_contiguous:
        tokens = qx.data.shape[0]
        where = _tokens(seq_offsets, tokens, num_blocks(max_seqlen, block), block)
        return qx.data_t[:, :, :tokens].float().permute(2, 0, 1) * qx.scale_t[where.seq, where.block]
    return qx.data.float() * token_scales(qx, mode, seq_offsets, max_seqlen, block)[:, :, None]


def quantize_qkv(q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q: int, max_seqlen_k: int,
                 mode: int) -> tuple[Quantized, Quantized, Quantized]:
    """q, k and v of one call quantized with ``mode`` (q along the query offsets, k and v along
    the key offsets)."""
    return (quantize(q, mode, seq_offsets_q, max_seqlen_q), quantize(k, mode, seq_offsets_k, max_seqlen_k),
            quantize(v, mode, seq_offsets_k, max_seqlen_k))


def quantize_batch(batch: dict, mode: int) -> tuple[Quantized, Quantized, Quantized]:
    """:func:`quantize_qkv` of a keyword dict of the public call (``q``, ``k``, ``v``, offsets and
    max lengths), e.g. one from ``hstu_cute.testing.random_jagged_batch``."""
    return quantize_qkv(batch["q"], batch["k"], batch["v"], batch["seq_offsets_q"], batch["seq_offsets_k"],
                        batch["max_seqlen_q"], batch["max_seqlen_k"], mode)
