"""FBGEMM's current HSTU entry points on hstu-cute's kernels.

FBGEMM's ``fbgemm_gpu.experimental.hstu`` moved on from the signature that
:func:`hstu_cute.hstu_attn_varlen_func` keeps (the founding document's, with ``descale_*`` and
``is_delta_q``). This module takes the current one, same parameters, same order, same meaning:

* :func:`hstu_attn_varlen_func` -- ``(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
  max_seqlen_q, max_seqlen_k, scaling_seqlen, num_contexts, num_targets, target_group_size=1,
  window_size=(-1, -1), alpha=1.0, rab=None, has_drab=False, kv_cache=None, page_offsets=None,
  page_ids=None, last_page_lens=None, func=None, quant_mode=-1)``;
* :func:`hstu_attn_qkvpacked_func` -- one ``(L, 3, H, D)`` tensor for q, k and v.

Which to use: code written against FBGEMM's current package imports from here; new code may use
either (the top-level function has keyword-only ``seqused_*`` / ``scaling_seqlen`` and takes
pre-quantized FP8 inputs with their descales). docs/integrations.md, "FBGEMM".

Differences from the founding signature, all decided here once:

* queries sit at the end of their keys whenever ``max_seqlen_q != max_seqlen_k`` (FBGEMM has no
  ``is_delta_q``; with equal bounds each sequence's query and key lengths must be equal);
* a paged cache (``kv_cache`` ...) has the same meaning in both (docs/operator.md, "Paged KV
  cache"): the pages hold the new history, k / v give the targets, ``cu_seqlens_k`` counts
  cached + target keys;
* ``quant_mode=None`` is -1.

A positional call in the other order fails naming the argument (a tensor where an int belongs,
or the other way round), never runs with the arguments reinterpreted.
"""

from __future__ import annotations

import torch

from .. import api
from ..validation import fail

__all__ = ["hstu_attn_varlen_func", "hstu_attn_qkvpacked_func"]

_ORDER_HINT = ("FBGEMM's current order is (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, "
               "max_seqlen_k, scaling_seqlen, ...); hstu_cute.hstu_attn_varlen_func takes (q, k, v, seq_offsets_q, "
               "seq_offsets_k, max_seqlen_q, max_seqlen_k, ...)")


def _check_order(seqused_q, seqused_k) -> None:
    """Our order into this entry puts max_seqlen_q / max_seqlen_k (ints) on seqused_q / seqused_k:
    refused here with the hint. The other arguments' types are validation's (which hints for the
    opposite mix-up at max_seqlen_q)."""
    for name, value in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if value is not None and not isinstance(value, torch.Tensor):
            fail(TypeError, name, f"a (B,) int32 tensor or None ({_ORDER_HINT})", type(value).__name__)


def hstu_attn_varlen_func(
    q, k, v,
    cu_seqlens_q, cu_seqlens_k,
    seqused_q, seqused_k,
    max_seqlen_q, max_seqlen_k,
    scaling_seqlen,
    num_contexts, num_targets,
    target_group_size=1,
    window_size=(-1, -1),
    alpha=1.0,
    rab=None,
    has_drab=False,
    kv_cache=None, page_offsets=None, page_ids=None, last_page_lens=None,
    func=None,
    quant_mode=-1,
):
    """FBGEMM's current ``hstu_attn_varlen_func`` (module docstring): ``cu_seqlens_*`` are
    :func:`hstu_cute.hstu_attn_varlen_func`'s ``seq_offsets_*``, ``scaling_seqlen`` its divisor
    (-1: ``max_seqlen_q``), ``seqused_*`` its valid prefixes. Returns ``out`` (T_q, H, D); with
    ``has_drab`` the backward gives rab's gradient. ``func`` (arbitrary per-row key intervals) is
    validated, then raises ``NotImplementedError``: its kernels are not built yet."""
    _check_order(seqused_q, seqused_k)
    return api.hstu_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
        target_group_size, window_size, alpha, rab, has_drab,
        is_delta_q=kv_cache is None and max_seqlen_q != max_seqlen_k,
        quant_mode=-1 if quant_mode is None else quant_mode, scaling_seqlen=scaling_seqlen, seqused_q=seqused_q,
        seqused_k=seqused_k, kv_cache=kv_cache, page_offsets=page_offsets, page_ids=page_ids,
        last_page_lens=last_page_lens, func=func)


def hstu_attn_qkvpacked_func(
    qkv,
    cu_seqlens_q, cu_seqlens_k,
    seqused_q, seqused_k,
    max_seqlen_q, max_seqlen_k,
    scaling_seqlen=-1,
    num_contexts=None, num_targets=None,
    target_group_size=1,
    window_size=(-1, -1),
    alpha=1.0,
    rab=None,
    has_drab=False,
    func=None,
):
    """FBGEMM's ``hstu_attn_qkvpacked_func``: ``qkv`` is ``(L, 3, H, D)`` (q, k, v along dim 1,
    read in place: no copies); the rest as :func:`hstu_attn_varlen_func`. Under autograd the
    gradient arrives as one ``(L, 3, H, D)`` tensor."""
    if not isinstance(qkv, torch.Tensor):
        fail(TypeError, "qkv", "a torch.Tensor", type(qkv).__name__)
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        fail(ValueError, "qkv", "a 4-D tensor (L, 3, H, D)", tuple(qkv.shape))
    q, k, v = qkv.unbind(1)
    return hstu_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                 max_seqlen_k, scaling_seqlen, num_contexts, num_targets, target_group_size,
                                 window_size, alpha, rab, has_drab, func=func)
