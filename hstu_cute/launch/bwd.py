"""The 16-bit backward launch of a validated call (:func:`backward`): the fused D128 kernel, the
D256 wide kernel with its dQ kernel, or the deterministic dK/dV + dQ pair, on one stream.
"""

from __future__ import annotations

import dataclasses

import torch

from ..arch import device_arch, kernel_path, num_sms
from ..call import Call
from ..validation import DTYPE_NAMES
from ..variants import HEAD_DIMS, make_bwd_keys, make_hopper_bwd_key

from .buffers import (
    _aligned_rab_and_drab,
    _drab_over_heads,
    _drab_sums_atomically,
    _gradient_buffers,
    _on_device,
    _sum_drab_heads,
    aligned_16,
    group_sums,
    zeros_as,
)
from .heuristics import _backward_kind, _walk_fixed
from .prepared import (Prepared, _call_tensors, _made, _nothing_to_do, _plan, _scalar_args, _sequence_args,
                       block_sparse_args)


def backward(dout, q, k, v, rab, call: Call, tiles_dq: dict | None = None, tiles_dkdv: dict | None = None,
             path: str | None = None):
    """Launch the backward kernels of the validated ``call``; returns ``(dq, dk, dv, drab)``,
    fresh tensors shaped like q, k, v (and like rab with ``call.has_drab``, else ``drab`` is
    None), in the input dtype.

    ``path`` 'hopper' (default on sm90): at head dim 128, without drab, unless ``deterministic``
    and for keys of at least ``FUSED_MIN_SEQLEN_K`` tokens, one fused TMA + WGMMA kernel computes
    dK, dV and reduces dQ into an fp32 accumulator (the order of that sum varies run to run);
    otherwise a dK/dV kernel and a dQ kernel (the sm80 one when drab is wanted), each summing in
    a fixed order. At head dim 256 the wide dK/dV/drab kernel and the dQ kernel (deterministic,
    except the sum of drab over heads for one rab head unless ``deterministic``). 'ampere': the
    sm80 dK/dV and dQ kernels at every head dim, deterministic. ``tiles_*`` override the keys'
    default tiles (benchmark sweeps). The launches are prepared once per argument signature
    (:class:`Prepared`)."""
    p = call.problem
    device = q.device
    if path is None:
        path = kernel_path(device)
    if p.head_dim not in HEAD_DIMS:
        raise NotImplementedError(f"q.shape[2] (head dim): the backward kernels support {HEAD_DIMS}, got {p.head_dim}")
    kv_group = q.shape[1] // k.shape[1]
    dq, dk, dv = _gradient_buffers(q, k, v, call.seqused_q, call.seqused_k, kv_group)
    if _nothing_to_do(q, k, call.max_seqlen_q, p):
        return (dq.zero_(), *group_sums(dk.zero_(), dv.zero_(), kv_group),
                (torch.zeros_like(rab) if call.has_drab else None))
    if dout.stride()[-1] != 1:
        dout = dout.contiguous()
    q, k, v, dout = aligned_16(q), aligned_16(k), aligned_16(v), aligned_16(dout)
    rab, drab, drab_view = _aligned_rab_and_drab(rab, call.has_drab)
    kind = _backward_kind(call, path)
    block_sparse = call.block_mask is not None
    plan_key = ("bwd", path, kind, rab is not None, q.shape[0], k.shape[0], call.has_drab, call.deterministic,
                call.alpha, call.target_group_size, block_sparse)

    def build():
        return _backward_plan(call, device, path, kind, rab is not None, q.shape[0], k.shape[0], tiles_dq, tiles_dkdv)

    plan = _plan(call, plan_key, build) if tiles_dq is None and tiles_dkdv is None else build()
    values = dict(mQ=q, mK=k, mV=v, mdO=dout, mdQ=dq, mdK=dk, mdV=dv, mRab=rab, **_call_tensors(call))
    with _on_device(device):
        if plan.kind == "fused":
            if block_sparse:
                values.update(block_sparse_args(call, plan.first.key, per_key_block=True))
            dq_accum = values["mdQaccum"] = _dq_accumulator(q, plan.first, p.batch, call.max_seqlen_q, values)
            plan.first(values, device)
            return (dq_accum.to(q.dtype), *group_sums(dk, dv, kv_group), None)
        drab_out = drab
        if plan.kind == "wide":
            drab_out, _ = _drab_over_heads(rab, drab, p.heads, call.deterministic)
        elif plan.sum_heads:
            values["mdRabAccum"] = torch.zeros((rab.shape[0], rab.shape[2], rab.shape[3]), dtype=torch.float32,
                                               device=device)
        values["mdRab"] = drab_out
        # One stream: the dQ kernel beside the dK/dV kernel on a side stream took the same device
        # time (0.99-1.02x, CUDA graphs, tiny to B8 N4096, the side_stream_ab.py probe at e7fc17c) and
        # ~45-60 us more host time per step (docs/dev/perf-log.md, session 28).
        if block_sparse:  # each kernel's lists at its own tiles; the dK/dV kernel walks them per key tile
            values.update(block_sparse_args(call, plan.first.key, per_key_block=True))
        plan.first(values, device)
        if block_sparse:
            values.update(block_sparse_args(call, plan.second.key))
        plan.second(values, device)
        if plan.kind == "wide":
            _sum_drab_heads(drab, drab_out)
    return (dq, *group_sums(dk, dv, kv_group), drab_view)


# Tests set it: the accumulator is filled with NaN before the launcher zeroes its first sections,
# so that a row the kernel fails to zero shows up (tests/test_torch_integration_gpu.py).
_POISON_DQ_ACCUMULATOR = False

# Walk sections between the fused kernel's CTAs and the dQ rows they zero (hopper.dq_ahead); 0: the
# launcher zeroes the whole accumulator. H200, backward call alone (docs/dev/perf-log.md session 40):
# B8 H4 N4096 causal 0.669 -> 0.654 ms with 1; the block-sparse B8 H32 N16384 10 % walk 11.91 ->
# 12.28 ms with 1 (its short CTAs are bound by their start); block masks compile without it
# (HopperBwdKey.zeroes_dq_ahead).
DQ_ZERO_LEAD = 1


def _zero_counts_words(num_sections: int) -> int:
    """int32 words in front of the dQ accumulator for ``num_sections`` counts: a multiple of 4,
    so that the accumulator behind them keeps a 16-byte aligned base (TMA)."""
    return (num_sections + 3) // 4 * 4


def _prefix_rows(total_rows: int, pairs: int, heads: int, max_seqlen_q: int) -> int:
    """Rows of the accumulator that hold the first ``pairs`` (batch, head) pairs, at most: they lie
    in the first ``ceil(pairs / heads)`` sequences, each at most ``max_seqlen_q`` rows of storage."""
    return min(total_rows, -(-pairs // heads) * max_seqlen_q)


def _dq_accumulator(q, fused: Prepared, batch: int, max_seqlen_q: int, values: dict) -> torch.Tensor:
    """The fused kernel's fp32 (T_q, H, D) dQ accumulator, zero where the kernel reduces into it.
    A kernel that does not zero ahead (persistent, block mask) gets it zeroed here. With one tile
    per CTA the kernel zeroes the rows of each walk section ``lead`` sections ahead (:mod:`hstu_cute.hopper.dq_ahead`): here only the
    first ``lead`` sections' rows (all of them with ``lead`` 0) and the sections' counts
    (``values["mZeroDone"]``, in front of the accumulator in one buffer: one fill)."""
    if not fused.key.zeroes_dq_ahead:
        return zeros_as(q, torch.float32)
    lead = DQ_ZERO_LEAD
    tokens, heads, dim = q.shape
    pairs_per_section = fused.fixed["bh_per_section"]
    sections = -(-(batch * heads) // pairs_per_section)
    words = _zero_counts_words(sections)
    rows = tokens if lead == 0 else _prefix_rows(tokens, lead * pairs_per_section, heads, max_seqlen_q)
    buf = torch.empty(words + tokens * heads * dim, dtype=torch.float32, device=q.device)
    if _POISON_DQ_ACCUMULATOR:
        buf.fill_(float("nan"))
    buf[: words + rows * heads * dim].zero_()
    values["mZeroDone"] = buf[:words].view(torch.int32)[:sections]
    values["zero_lead"] = lead
    return buf[words:].view(tokens, heads, dim)


class _BackwardPlan:
    """The prepared launches of a 16-bit backward: ``kind`` "fused" (one kernel), "wide" (the D256
    dK/dV/drab kernel, then the dQ kernel) or "pair" (the dK/dV kernel, then the dQ(+drab)
    kernel); ``sum_heads``: the pair's dQ kernel sums drab over heads into fp32."""

    __slots__ = ("kind", "first", "second", "sum_heads")

    def __init__(self, kind: str, first: Prepared, second: Prepared | None = None, sum_heads: bool = False):
        self.kind, self.first, self.second, self.sum_heads = kind, first, second, sum_heads


def _backward_plan(call: Call, device, path: str, kind: str, has_rab: bool, tokens_q: int, tokens_k: int, tiles_dq,
                   tiles_dkdv) -> _BackwardPlan:
    p = call.problem
    has_drab = call.has_drab
    max_q, max_k = call.max_seqlen_q, call.max_seqlen_k
    context_target = p.mask.has_context or p.mask.has_target
    common = (device_arch(device), DTYPE_NAMES[p.dtype], p.head_dim, p.mask.kind, context_target, has_rab)
    base = dict(**_sequence_args(call, device, context_target), **_scalar_args(call))
    if path == "hopper":
        base["num_sms"] = num_sms(device)

    def over_keys(key):  # the dK/dV kernels walk key blocks, their tiles share Q and dO
        return Prepared(key, dict(base, num_n_blocks=-(-max_k // key.tile_n), **_walk_fixed(key, p, tokens_q, max_q)))

    def over_queries(key):  # the dQ kernels walk query blocks, their tiles share K and V
        return Prepared(key, dict(base, num_m_blocks=-(-max_q // key.tile_m), **_walk_fixed(key, p, tokens_k, max_k)))

    if kind == "wide":
        atomic_sum = _drab_sums_atomically(has_drab, p.rab_heads, p.heads, call.deterministic)
        key_kv = _made(make_hopper_bwd_key, "wide", *common, tiles_dkdv, has_drab=has_drab, rab_sum_heads=atomic_sum)
        key_q = _made(make_hopper_bwd_key, "dq", *common, tiles_dq)
        return _BackwardPlan("wide", over_keys(key_kv), over_queries(key_q))
    block_sparse = call.block_mask is not None
    if kind == "fused":
        return _BackwardPlan("fused", over_keys(_made(make_hopper_bwd_key, "fused", *common, tiles_dkdv,
                                                      block_sparse=block_sparse)))
    sum_heads = has_drab and p.rab_heads == 1 and p.heads > 1
    if kind == "sm80 pair":  # a block-sparse backward the fused kernel does not serve, on either path
        if sum_heads and call.block_mask.heads > 1:
            raise NotImplementedError("block_mask: one mask per head with drab summed over the heads (rab of one "
                                      "head) is not built; pass a mask shared by the heads (H_mask = 1)")
        key_dq, key_dkdv = _made(make_bwd_keys, *common, has_drab, sum_heads, True)
        return _BackwardPlan("pair", over_keys(key_dkdv), over_queries(key_dq), sum_heads)
    key_dq, key_dkdv = _made(make_bwd_keys, *common, has_drab, sum_heads)
    if tiles_dq or tiles_dkdv:  # benchmark sweeps only
        # The Hopper keys below take them whole; with drab the sm80 dQ kernel runs on that path too.
        if path != "hopper" or has_drab:
            key_dq = dataclasses.replace(key_dq, **(tiles_dq or {}))
        if path != "hopper":
            key_dkdv = dataclasses.replace(key_dkdv, **(tiles_dkdv or {}))
    if path == "hopper":
        key_dkdv = _made(make_hopper_bwd_key, "dkdv", *common, tiles_dkdv)
        if not has_drab:  # drab (and its sum over heads) comes from the sm80 dQ kernel
            key_dq = _made(make_hopper_bwd_key, "dq", *common, tiles_dq)
    return _BackwardPlan("pair", over_keys(key_dkdv), over_queries(key_dq), sum_heads)
