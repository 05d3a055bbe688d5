"""Padded batches: HSTU attention on ``(B, N, H, D)`` tensors, and conversions between padded and
jagged layouts.

:func:`hstu_attn_padded` needs no copy and no host sync: a padded batch *is* a jagged batch whose
sequences all own ``N`` rows (offsets ``0, N, 2N, ...``), with each sequence's valid length as the
operator's ``seqused``. The rows past a length are never read as keys and come out zero.

Copies, stated once:

* :func:`hstu_attn_padded`: q, k, v are viewed as ``(B * N, H, D)``. That is a view whenever
  dims 0 and 1 merge (``stride(0) == N * stride(1)``: contiguous tensors, or q/k/v split from one
  fused projection); otherwise ``reshape`` copies. The output is a fresh tensor viewed as
  ``(B, N, H, D)``.
* :func:`to_jagged`: a view when every length equals ``N`` (or ``B == 1``); otherwise one gather
  copy. It reads the lengths on the host (one device sync for a CUDA ``lengths`` tensor; none for
  a list or a CPU tensor): the jagged tensor's size depends on them.
* :func:`to_padded`: a view when ``values`` holds exactly ``B * max_len`` rows (then every
  sequence is full); otherwise one gather, without a host sync.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from .nn import CAUSAL, _check_backend, _is_int, hstu_attention
from .validation import fail

__all__ = ["hstu_attn_padded", "to_jagged", "to_padded", "offsets_from_lengths"]


def _lengths_tensor(lengths, batch: int, max_len: int, device) -> torch.Tensor:
    """(B,) int32 lengths on ``device`` from a tensor or a sequence of ints. Host values (a
    sequence, or a CPU tensor for a batch on another device) are range-checked here and copied to
    the device; a device tensor is checked only with HSTU_CUTE_CHECK=1, by the operator."""
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype not in (torch.int32, torch.int64):
            fail(TypeError, "lengths.dtype", "torch.int32 or torch.int64", lengths.dtype)
        if lengths.dim() != 1 or lengths.shape[0] != batch:
            fail(ValueError, "lengths", f"shape ({batch},) (one length per sequence)", tuple(lengths.shape))
        if lengths.device == torch.device(device):
            return lengths.to(torch.int32)
        if lengths.device.type != "cpu":
            fail(ValueError, "lengths.device", f"{device} (same as the batch) or cpu", lengths.device)
        lengths = lengths.tolist()
    if not isinstance(lengths, Sequence) or not all(_is_int(n) for n in lengths):
        fail(TypeError, "lengths", "a (B,) int tensor or a sequence of ints", type(lengths).__name__)
    if len(lengths) != batch:
        fail(ValueError, "len(lengths)", f"{batch} (one length per sequence)", len(lengths))
    bad = [int(n) for n in lengths if not 0 <= n <= max_len]
    if bad:
        fail(ValueError, "lengths", f"values in [0, {max_len}] (the padded length)", bad)
    return torch.tensor([int(n) for n in lengths], dtype=torch.int32, device=device)


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """(B+1,) int32 cumulative offsets of (B,) lengths, on their device, without a host sync."""
    offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


_UNIFORM_OFFSETS: dict = {}


def _uniform_offsets(batch: int, max_len: int, device) -> torch.Tensor:
    """(B+1,) int32 offsets 0, N, 2N, ..., cached per (N, device) (two torch ops per call cost the
    padded entry ~20-40 us of host time on the H100 host): :func:`hstu_cute.launch.constant_prefix`."""
    from .launch import constant_prefix

    device = torch.device(device)
    return constant_prefix(_UNIFORM_OFFSETS, (max_len, device), batch + 1, device,
                           lambda n: torch.arange(n, dtype=torch.int32, device=device) * max_len)


def _flatten_batch(name: str, t: torch.Tensor) -> torch.Tensor:
    """(B, N, H, D) -> (B * N, H, D): a view when dims 0 and 1 merge, a copy otherwise."""
    if not isinstance(t, torch.Tensor):
        fail(TypeError, name, "a torch.Tensor", type(t).__name__)
    if t.dim() != 4:
        fail(ValueError, name, "a 4-D tensor (batch, max_len, heads, head_dim)", f"shape {tuple(t.shape)}")
    return t.flatten(0, 1)


def hstu_attn_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor | Sequence[int],
    *,
    num_contexts: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    target_group_size: int = 1,
    window_size: tuple[int, int] = CAUSAL,
    alpha: float = 1.0,
    rab: torch.Tensor | None = None,
    has_drab: bool | None = None,
    scaling_seqlen: int = -1,
    deterministic: bool = False,
    quant_mode: int = -1,
    backend: str = "auto",
    block_mask=None,
) -> torch.Tensor:
    """HSTU self-attention on a padded batch.

    ``q``, ``k``: ``(B, N, H, D)``; ``v``: ``(B, N, H, Dv)``; ``lengths``: ``(B,)`` valid tokens per
    sequence (an int32/int64 tensor on q's device, or a sequence of ints), each in ``[0, N]``.
    Sequence ``b`` is rows ``[0, lengths[b])`` of ``q[b]``, ``k[b]``, ``v[b]``; what lies past them is
    never read (it may hold anything). Returns ``(B, N, H, Dv)`` in q's dtype, zero past each length.

    The divisor ``S`` is ``N`` (the padded length) unless ``scaling_seqlen`` is given: the same
    batch padded to another ``N`` gives another output. ``rab`` is ``(B, H_rab, N, N)``. Contexts,
    targets, the window (default causal) and the rest mean what they mean for
    ``hstu_attn_varlen_func`` (docs/operator.md), counted within each valid length. Runs the kernel
    on CUDA tensors and the PyTorch reference on CPU tensors, as :func:`hstu_cute.nn.hstu_attention`.
    ``block_mask`` (a :class:`hstu_cute.BlockMask`, blocks counted from each sequence's start) is
    passed through.
    """
    _check_backend(backend)
    flat = [_flatten_batch(name, t) for name, t in (("q", q), ("k", k), ("v", v))]
    batch, max_len = q.shape[:2]
    for name, t in (("k", k), ("v", v)):  # heads: q's, or a divisor of them (GQA / MQA)
        if tuple(t.shape[:2]) != tuple(q.shape[:2]) or t.shape[2] < 1 or q.shape[2] % t.shape[2] or t.shape[2] != k.shape[2]:
            fail(ValueError, f"{name}.shape[:3]", f"{tuple(q.shape[:2])} + (H_kv,) with H_kv dividing {q.shape[2]} "
                 "(q's batch, max_len; k's and v's heads alike)", tuple(t.shape[:3]))
    seqused = _lengths_tensor(lengths, batch, max_len, q.device)
    offsets = _uniform_offsets(batch, max_len, q.device)
    out = hstu_attention(
        *flat, offsets, max_len, num_contexts=num_contexts, num_targets=num_targets,
        target_group_size=target_group_size, window_size=window_size, alpha=alpha, rab=rab, has_drab=has_drab,
        scaling_seqlen=scaling_seqlen, seqused=seqused, deterministic=deterministic, quant_mode=quant_mode,
        backend=backend, block_mask=block_mask)
    return out.unflatten(0, (batch, max_len))


def to_jagged(x: torch.Tensor, lengths: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded ``(B, N, ...)`` to jagged: returns ``(values, offsets)``, ``values`` of shape
    ``(sum(lengths), ...)`` holding rows ``[0, lengths[b])`` of each ``x[b]`` in order and ``offsets``
    ``(B+1,)`` int32 on x's device. A view of ``x`` when every length is ``N`` or ``B == 1`` (see the
    module doc); otherwise one gather copy. Reads the lengths on the host (a sync for a CUDA
    tensor). Differentiable."""
    if not isinstance(x, torch.Tensor):
        fail(TypeError, "x", "a torch.Tensor", type(x).__name__)
    if x.dim() < 2:
        fail(ValueError, "x", "a tensor of at least 2 dims (batch, max_len, ...)", f"shape {tuple(x.shape)}")
    batch, max_len = x.shape[:2]
    lengths_dev = _lengths_tensor(lengths, batch, max_len, x.device)
    host = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    bad = [n for n in host if not 0 <= n <= max_len]
    if bad:
        fail(ValueError, "lengths", f"values in [0, {max_len}] (the padded length)", bad)
    offsets = offsets_from_lengths(lengths_dev)
    if all(n == max_len for n in host):
        return x.flatten(0, 1), offsets
    if batch == 1:
        return x[0, : host[0]], offsets
    valid = torch.arange(max_len, device=x.device) < lengths_dev[:, None]
    return x[valid], offsets


def to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value: float = 0.0) -> torch.Tensor:
    """Jagged ``(T, ...)`` with ``(B+1,)`` offsets to padded ``(B, max_len, ...)``, rows past each
    length set to ``padding_value``. ``values`` must hold exactly the batch's rows (``offsets[-1] ==
    T``, every length ``<= max_len``), as for the operator. A view when ``T == B * max_len`` (every
    sequence then has ``max_len`` rows); otherwise one gather, without a host sync. Differentiable."""
    if not isinstance(values, torch.Tensor):
        fail(TypeError, "values", "a torch.Tensor", type(values).__name__)
    if values.dim() < 1:
        fail(ValueError, "values", "a tensor of at least 1 dim (tokens, ...)", "a 0-D tensor")
    if not isinstance(offsets, torch.Tensor) or offsets.dtype not in (torch.int32, torch.int64):
        fail(TypeError, "offsets", "an int32/int64 tensor of B+1 offsets",
             offsets.dtype if isinstance(offsets, torch.Tensor) else type(offsets).__name__)
    if offsets.dim() != 1 or offsets.shape[0] < 2:
        fail(ValueError, "offsets", "a 1-D tensor of length B+1 >= 2", tuple(offsets.shape))
    if offsets.device != values.device:
        fail(ValueError, "offsets.device", f"{values.device} (same as values)", offsets.device)
    if not _is_int(max_len) or max_len < 0:
        fail(ValueError, "max_len", "a Python int >= 0", repr(max_len))
    if not isinstance(padding_value, numbers.Real):
        fail(TypeError, "padding_value", "a Python number", type(padding_value).__name__)
    batch, tokens, rest = offsets.shape[0] - 1, values.shape[0], tuple(values.shape[1:])
    if tokens == batch * max_len:
        return values.unflatten(0, (batch, max_len))
    if tokens == 0:
        return values.new_full((batch, max_len, *rest), padding_value)
    positions = torch.arange(max_len, device=values.device)
    starts = offsets[:-1].long()[:, None]
    valid = positions < (offsets[1:].long()[:, None] - starts)
    rows = torch.where(valid, starts + positions, 0)
    gathered = values[rows]
    valid = valid.reshape(batch, max_len, *([1] * len(rest)))
    return torch.where(valid, gathered, torch.full((), padding_value, dtype=values.dtype, device=values.device))
