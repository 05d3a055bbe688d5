"""``hstu_mha`` with the calling convention and semantics of Meta's generative-recommenders
(``generative_recommenders.ops.hstu_attention.hstu_mha``), running on hstu-cute.

Swap it in where a model calls that function (docs/integrations.md). The semantics are those of
that library's PyTorch reference (``pytorch_hstu_mha``), restated here in our own words and
implemented independently in :func:`reference_hstu_mha` (the oracle the tests hold ``hstu_mha``
to):

* Sequences are padded to ``N = max_seq_len``; ``P = silu(alpha * q.k) / N`` on allowed pairs, zero
  elsewhere; ``out = P @ v``. The divisor is ``max_seq_len``, always.
* The mask works on *attention ids*: with ``c = contextual_seq_len > 0`` the first ``c``
  positions share id 0 (position ``p >= c`` has id ``p - c + 1``); with targets, every target
  shares the id of the first target. A pair ``(r, j)`` attends when ``r == j`` or
  ``id(r) - id(j) > 0`` (causal; ``|id(r) - id(j)| > 0`` when not), and, with ``max_attn_len = m > 0``,
  ``id(r) - id(j) <= m`` (rows with ``id(r) >= last_id - min_full_attn_seq_len`` exempt when
  ``min_full_attn_seq_len > 0``). Context rows (id 0) also see every key before the targets.

What that means in our operator's terms (every case below was checked pair by pair against the
oracle, tests/test_integrations.py):

* causal: ``window_size=(-1, 0)``, ``num_targets`` as given (group size 1: a target sees the
  history and itself), ``num_contexts = contextual_seq_len`` for every sequence;
* ``max_attn_len = m``: ``window_size=(m, 0)`` (with contexts and targets too: hstu-cute's causal
  band with contexts and targets counts that library's attention ids, docs/operator.md), or
  ``(m, m)`` when not causal; ``m >= max_seq_len - 1`` is no window at all;
* not causal, without targets: no mask (contexts then change nothing);
* ``scaling_seqlen = max_seq_len``.

Not expressible, so refused with ``NotImplementedError`` naming the argument: ``max_attn_len``
together with targets or contexts when not causal, ``min_full_attn_seq_len`` with a window,
``causal=False`` with ``num_targets`` (history rows would see the targets), and attention dropout
(``dropout_pr > 0`` with ``training=True``).

Preconditions, as in the operator: every sequence holds at most ``max_seq_len`` tokens and at
least ``contextual_seq_len + num_targets[b]`` (checked on the device data with
``HSTU_CUTE_CHECK=1``; on CPU by the reference). That library's reference degenerates to a
diagonal mask on shorter sequences; we do not reproduce that.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from ..nn import _is_int, hstu_attention
from ..padded import to_jagged, to_padded
from ..validation import fail

__all__ = ["hstu_mha", "hstu_mha_arguments", "reference_hstu_mha", "attention_mask"]


def _check_int(name, value, minimum):
    if not _is_int(value):
        fail(TypeError, name, "a Python int", f"{type(value).__name__} {value!r}")
    if value < minimum:
        fail(ValueError, name, f"an int >= {minimum}", value)


def _window_active(max_attn_len: int, max_seq_len: int) -> bool:
    # Ids differ by at most max_seq_len - 1, so a wider window masks nothing.
    return 0 < max_attn_len < max_seq_len - 1


def hstu_mha_arguments(
    max_seq_len: int,
    alpha: float,
    q: torch.Tensor,
    seq_offsets: torch.Tensor,
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
) -> dict:
    """The keyword arguments of :func:`hstu_cute.nn.hstu_attention` that compute that library's
    ``hstu_mha`` (besides q, k, v): the mapping described in the module doc. Raises
    ``NotImplementedError`` naming the argument where the operator cannot express the mask."""
    _check_int("max_seq_len", max_seq_len, 1)
    _check_int("max_attn_len", max_attn_len, 0)
    _check_int("contextual_seq_len", contextual_seq_len, 0)
    _check_int("min_full_attn_seq_len", min_full_attn_seq_len, 0)
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        fail(TypeError, "alpha", "a Python float", repr(alpha))
    if not isinstance(causal, bool):
        fail(TypeError, "causal", "a bool", type(causal).__name__)
    window = _window_active(max_attn_len, max_seq_len)
    if window and not causal and (num_targets is not None or contextual_seq_len > 0):
        which = "num_targets" if num_targets is not None else f"contextual_seq_len={contextual_seq_len}"
        raise NotImplementedError(
            f"max_attn_len: expected 0 (or >= max_seq_len - 1 = {max_seq_len - 1}) together with {which} and "
            f"causal=False, got {max_attn_len}: hstu-cute's window with contexts/targets is a causal band")
    if window and min_full_attn_seq_len > 0:
        raise NotImplementedError(
            f"min_full_attn_seq_len: expected 0 with max_attn_len={max_attn_len}, got {min_full_attn_seq_len}: rows "
            f"with full attention inside a local window are not expressible in hstu-cute's masks")
    if not causal and num_targets is not None:
        raise NotImplementedError(
            "num_targets: expected None with causal=False, got a tensor: that library's non-causal mask lets history "
            "rows see the targets, which hstu-cute's masks cannot express (targets need the causal window)")
    if not isinstance(seq_offsets, torch.Tensor):
        fail(TypeError, "seq_offsets", "a torch.Tensor of B+1 offsets", type(seq_offsets).__name__)
    batch = seq_offsets.shape[0] - 1 if seq_offsets.dim() == 1 else 0
    if causal:
        window_size = (max_attn_len, 0) if window else (-1, 0)
        num_contexts = None
        if contextual_seq_len > 0:
            num_contexts = torch.full((batch,), contextual_seq_len, dtype=torch.int32, device=q.device)
    else:
        # Not causal and without targets every pair attends, contexts or not: their shared id hides
        # context-context pairs, and the context rows' own rule shows them again.
        window_size = (max_attn_len, max_attn_len) if window else (-1, -1)
        num_contexts = None
    return dict(seq_offsets=seq_offsets, max_seqlen=max_seq_len, num_contexts=num_contexts, num_targets=num_targets,
                window_size=window_size, alpha=float(alpha), scaling_seqlen=max_seq_len)


def hstu_mha(
    max_seq_len: int,
    alpha: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    causal: bool = True,
    dropout_pr: float = 0.0,
    training: bool = True,
    num_targets: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    sort_by_length: bool = False,
    kernel=None,
    enable_tma: bool = False,
    *,
    deterministic: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """generative-recommenders' ``hstu_mha`` on hstu-cute: same arguments, same result.

    ``q``, ``k``: ``(L, H, D)``; ``v``: ``(L, H, Dv)`` (``Dv`` may differ from ``D``); ``seq_offsets``
    ``(B+1,)`` int32 or int64; ``num_targets`` ``(B,)`` int or None. Returns ``(L, H, Dv)`` in q's
    dtype. CUDA tensors run the kernel (bf16/fp16), CPU tensors our PyTorch reference.

    ``sort_by_length``, ``kernel`` and ``enable_tma`` select that library's implementations and
    are accepted and ignored. ``deterministic`` (keyword) asks our backward for bitwise
    reproducible gradients. Refusals (``NotImplementedError``, naming the argument): see the
    module doc.
    """
    del sort_by_length, kernel, enable_tma
    if isinstance(dropout_pr, bool) or not isinstance(dropout_pr, numbers.Real) or not 0.0 <= dropout_pr <= 1.0:
        fail(ValueError, "dropout_pr", "a float in [0, 1]", repr(dropout_pr))
    if dropout_pr > 0.0 and training:
        raise NotImplementedError(
            f"dropout_pr: attention dropout is not implemented in hstu-cute; expected 0.0 (or training=False), got "
            f"{dropout_pr}")
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, name, "a torch.Tensor", type(t).__name__)
    if tuple(k.shape) != tuple(q.shape):
        fail(ValueError, "k.shape", f"{tuple(q.shape)} (q's shape)", tuple(k.shape))
    call = hstu_mha_arguments(max_seq_len, alpha, q, seq_offsets, causal, num_targets, max_attn_len,
                              contextual_seq_len, min_full_attn_seq_len)
    return hstu_attention(q, k, v, deterministic=deterministic, backend=backend, **call)


def attention_mask(lengths: torch.Tensor, max_seq_len: int, causal: bool = True,
                   num_targets: torch.Tensor | None = None, max_attn_len: int = 0, contextual_seq_len: int = 0,
                   min_full_attn_seq_len: int = 0) -> torch.Tensor:
    """``(B, N, N)`` bool: which (query row, key column) pairs attend in that library's mask, for
    sequences of ``lengths`` padded to ``N = max_seq_len`` (the semantics of the module doc)."""
    N, c = max_seq_len, contextual_seq_len
    lengths = lengths.long()
    positions = torch.arange(N, device=lengths.device)
    ids = (positions - (c - 1)).clamp(min=0) if c > 0 else positions
    ids = ids.expand(lengths.shape[0], N)
    # The id every position past the history maps to (that of the first target) bounds the ids.
    last_id = lengths - (c - 1 if c > 0 else 0)
    if num_targets is not None:
        last_id = last_id - num_targets.long()
        ids = torch.minimum(ids, last_id[:, None])
    row, col = ids[:, :, None], ids[:, None, :]
    gap = row - col if causal else (row - col).abs()
    allowed = (gap > 0) | torch.eye(N, dtype=torch.bool, device=lengths.device)
    if max_attn_len > 0:
        in_window = gap <= max_attn_len
        if min_full_attn_seq_len > 0:
            in_window = in_window | (row >= (last_id - min_full_attn_seq_len)[:, None, None])
        allowed = allowed & in_window
    if c > 0:
        allowed = allowed | ((row == 0) & (col < last_id[:, None, None]))
    return allowed


def reference_hstu_mha(
    max_seq_len: int,
    alpha: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    *,
    compute_dtype: torch.dtype | None = torch.float32,
) -> torch.Tensor:
    """The oracle of :func:`hstu_mha`, written from that library's semantics (module doc): dense
    over sequences padded to ``max_seq_len``, mask from :func:`attention_mask`. Every argument that
    library's reference takes is honoured, including those :func:`hstu_mha` refuses.

    ``compute_dtype=torch.float32``: inputs upcast, fp32 throughout (returns fp32). ``None``: in the
    inputs' dtype with that library's rounding points (``silu(alpha q.k) / N`` rounded before the
    product with v): the yardstick of the ratio rule for 16-bit inputs."""
    dtype = q.dtype if compute_dtype is None else compute_dtype
    N, rows, heads = max_seq_len, q.shape[0], q.shape[1]
    offsets = seq_offsets.long()
    lengths = offsets[1:] - offsets[:-1]
    qp, kp, vp = (to_padded(t.to(dtype), offsets, N).transpose(1, 2) for t in (q, k, v))  # (B, H, N, d)
    scores = torch.einsum("bhid,bhjd->bhij", qp, kp) * alpha
    weights = F.silu(scores) / N
    mask = attention_mask(lengths, N, causal, num_targets, max_attn_len, contextual_seq_len, min_full_attn_seq_len)
    weights = weights * mask[:, None].to(dtype)
    out = torch.einsum("bhij,bhjd->bhid", weights, vp).transpose(1, 2)  # (B, N, H, Dv)
    values, _ = to_jagged(out, lengths)
    if values.shape[0] != rows:  # rows past the last offset belong to no sequence
        values = torch.cat([values, values.new_zeros((rows - values.shape[0], heads, values.shape[2]))])
    return values
