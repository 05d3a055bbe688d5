"""The public surface: :func:`hstu_attn_varlen_func`, its autograd function, and the
``torch.library`` custom ops ``hstu_cute::fwd`` / ``hstu_cute::bwd`` that torch.compile and
torch.export trace. Argument checks live in :mod:`hstu_cute.validation`, kernel selection and
launch in :mod:`hstu_cute.launch`.
"""

from __future__ import annotations

import torch
import tvm_ffi  # noqa: F401  (the kernels' calling convention; importing it here keeps its ~50 ms
#                  one-time cost out of the first call, e.g. out of a disk-cache load)

from .call import (
    OP_NAMES,
    SEQUENCE_NAMES,
    Call,
    PagedTables,
    call_of_op_arguments,
    op_arguments,
    op_arguments_of,
    op_scalars,
    op_schema_args,
    op_values,
    sequence_tensors,
)
from .launch import backward, backward_fp8, check_fp8_backward, forward, forward_fp8
from .validation import (
    check_device_data,
    device_checks_enabled,
    fail,
    fp32_as_bf16,
    kv_heads_for_kernels,
    output_dtype,
    validate,
    validate_memoized,
)

__all__ = ["hstu_attn_varlen_func", "fwd_op", "bwd_op", "fwd_fp8_op", "bwd_fp8_op", "fwd_paged_op"]


# ---------------------------------------------------------------------------------------------
# torch.library registration: hstu_cute::fwd and hstu_cute::bwd
#
# torch.compile and torch.export trace these ops (their fake implementations give the output
# shapes without compiling or launching anything). Eager calls skip the dispatcher and call the
# same launchers directly (see _eager), as quack does: going through torch.ops costs ~50-70 us
# per call on the 2-core CPU machine vs ~5 us for the direct call (tools/host.py dispatch,
# docs/dev/perf-log.md "custom op dispatch"). The ops take the call flat (hstu_cute.call.OP_FIELDS);
# their bodies turn it back into the call record.
# ---------------------------------------------------------------------------------------------
_OP_ARGS = op_schema_args()
_FWD_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {_OP_ARGS}) -> Tensor"
_BWD_SCHEMA = (f"(Tensor dout, Tensor q, Tensor k, Tensor v, {_OP_ARGS}, bool has_drab, bool deterministic)"
               " -> (Tensor, Tensor, Tensor, Tensor)")


def _check_data(call: Call, q, k):
    if device_checks_enabled():
        check_device_data(call, q, k)


def _fwd_impl(q, k, v, *op_args):
    call, rab = call_of_op_arguments(q, op_args)
    # Compiled graphs reach the device-data checks here (eager calls run them before the op).
    _check_data(call, q, k)
    return forward(q, k, v, rab, call)


def _fwd_fake(q, k, v, *rest):
    # forward() allocates a contiguous out of q's shape, whatever q's strides.
    return q.new_empty(q.shape)


def _empty_drab(q):
    return q.new_empty((0,))


def _bwd_impl(dout, q, k, v, *args):
    *op_args, has_drab, deterministic = args
    call, rab = call_of_op_arguments(q, tuple(op_args), has_drab=has_drab, deterministic=deterministic)
    grads = backward(dout, q, k, v, rab, call)
    # The fake implementation promises contiguous gradients (compiled graphs rely on its strides);
    # a launcher may hand back a strided view (e.g. drab of a padded slab): copy it then.
    dq, dk, dv, drab = (g if g is None or g.is_contiguous() else g.contiguous() for g in grads)
    return dq, dk, dv, (drab if drab is not None else _empty_drab(q))


def _bwd_fake(dout, q, k, v, *args):
    # Contiguous gradients in the input dtype; drab shaped like rab (0 elements without has_drab).
    *op_args, has_drab, _ = args
    rab = op_values(op_args)["rab"]
    drab = rab.new_empty(rab.shape) if has_drab and rab is not None else _empty_drab(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), drab


# FP8: quantization (quant_mode 0..5) and the kernel in one opaque op, so that torch.compile and
# torch.export never trace the quantizers' data-dependent work (a peer's host loops broke export).
# No defaults in the schema: torch leaves trailing arguments equal to their defaults out of the
# implementation's arguments, and an unpacking from the end then read q_block as quant_mode
# (every FP8 forward through the op ran quant_mode 0 until session 32).
_FWD_FP8_SCHEMA = (f"(Tensor q, Tensor k, Tensor v, Tensor? descale_q, Tensor? descale_k, Tensor? descale_v, "
                   f"{_OP_ARGS}, int quant_mode, bool has_drab, bool deterministic) -> Tensor")


def _fwd_fp8_call(q, args) -> tuple[Call, object]:
    """(call, rab) of hstu_cute::fwd_fp8's arguments after q, k, v."""
    descales, (*op_args, quant_mode, has_drab, deterministic) = tuple(args[:3]), args[3:]
    return call_of_op_arguments(q, tuple(op_args), quant_mode, has_drab, deterministic, descales)


def _fwd_fp8_impl(q, k, v, *args):
    # has_drab and deterministic concern the backward (the registered autograd reads them).
    call, rab = _fwd_fp8_call(q, args)
    _check_data(call, q, k)
    return forward_fp8(q, k, v, rab, call)


def _fwd_fp8_fake(q, *rest):
    return q.new_empty(q.shape, dtype=output_dtype(q.dtype))


# The FP8 backward (quant modes 0-5): quantization of q, k, v, dO, the token-contiguous copies and
# both kernels in one opaque op, registered as fwd_fp8's autograd formula.
_BWD_FP8_SCHEMA = (f"(Tensor dout, Tensor q, Tensor k, Tensor v, {_OP_ARGS}, int quant_mode, bool has_drab, "
                   f"bool deterministic) -> (Tensor, Tensor, Tensor, Tensor)")


def _bwd_fp8_impl(dout, q, k, v, *args):
    *op_args, quant_mode, has_drab, deterministic = args
    call, rab = call_of_op_arguments(q, tuple(op_args), quant_mode, has_drab, deterministic)
    dq, dk, dv, drab = backward_fp8(dout, q, k, v, rab, call)
    return dq, dk, dv, (drab.contiguous() if drab is not None else _empty_drab(q))


def _bwd_fp8_fake(dout, q, k, v, *args):
    *op_args, _, has_drab, _ = args
    rab = op_values(op_args)["rab"]
    drab = rab.new_empty(rab.shape) if has_drab and rab is not None else _empty_drab(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), drab


_CALL_TENSORS = ("rab",) + SEQUENCE_NAMES  # the ops' tensor arguments besides q, k, v (and dout)


def _fwd_fp8_setup_context(ctx, inputs, output):
    # Runs while tracing too: it keeps the flat arguments (tensors saved, the rest by name) and
    # builds no record (the op bodies do, on real tensors).
    q, k, v, *args = inputs
    *op_args, ctx.quant_mode, ctx.has_drab, ctx.deterministic = args[3:]
    values = op_values(op_args)
    ctx.save_for_backward(q, k, v, *(values[name] for name in _CALL_TENSORS))
    ctx.op_scalars = {name: values[name] for name in OP_NAMES if name not in _CALL_TENSORS}


def _bwd_fp8_through_op(dout, q, k, v, rab, call: Call):
    """hstu_cute::bwd_fp8 on a saved call."""
    return torch.ops.hstu_cute.bwd_fp8(dout, q, k, v, *op_arguments(call, rab), call.problem.quant_mode,
                                       call.has_drab, call.deterministic)


def _fwd_fp8_backward(ctx, dout):
    q, k, v, *saved = ctx.saved_tensors
    values = dict(ctx.op_scalars, **dict(zip(_CALL_TENSORS, saved)))
    dq, dk, dv, drab = torch.ops.hstu_cute.bwd_fp8(dout, q, k, v, *(values[name] for name in OP_NAMES),
                                                   ctx.quant_mode, ctx.has_drab, ctx.deterministic)
    # One gradient per input of fwd_fp8: q, k, v, then none but drab for rab with has_drab.
    grads = dict(zip(("q", "k", "v"), (dq, dk, dv)), rab=drab if ctx.has_drab else None)
    names = ("q", "k", "v", "descale_q", "descale_k", "descale_v", *OP_NAMES, "quant_mode", "has_drab",
             "deterministic")
    return tuple(grads.get(name) for name in names)


# Serving from a paged KV cache: inference only (no autograd), one op with the cache's tables.
_FWD_PAGED_SCHEMA = (f"(Tensor q, Tensor k, Tensor v, {_OP_ARGS}, Tensor kv_cache, Tensor page_offsets, "
                     f"Tensor page_ids, Tensor last_page_lens) -> Tensor")


def _fwd_paged_impl(q, k, v, *args):
    op_args, paged = args[:-4], PagedTables(*args[-4:])
    call, rab = call_of_op_arguments(q, tuple(op_args), paged=paged)
    _check_data(call, q, k)
    return forward(q, k, v, rab, call)


fwd_op = torch.library.custom_op("hstu_cute::fwd", _fwd_impl, mutates_args=(), schema=_FWD_SCHEMA)
fwd_op.register_fake(_fwd_fake)
bwd_op = torch.library.custom_op("hstu_cute::bwd", _bwd_impl, mutates_args=(), schema=_BWD_SCHEMA)
bwd_op.register_fake(_bwd_fake)
fwd_fp8_op = torch.library.custom_op("hstu_cute::fwd_fp8", _fwd_fp8_impl, mutates_args=(), schema=_FWD_FP8_SCHEMA)
fwd_fp8_op.register_fake(_fwd_fp8_fake)
bwd_fp8_op = torch.library.custom_op("hstu_cute::bwd_fp8", _bwd_fp8_impl, mutates_args=(), schema=_BWD_FP8_SCHEMA)
bwd_fp8_op.register_fake(_bwd_fp8_fake)
fwd_fp8_op.register_autograd(_fwd_fp8_backward, setup_context=_fwd_fp8_setup_context)
fwd_paged_op = torch.library.custom_op("hstu_cute::fwd_paged", _fwd_paged_impl, mutates_args=(),
                                       schema=_FWD_PAGED_SCHEMA)
fwd_paged_op.register_fake(_fwd_fake)


def _eager(t) -> bool:
    """True when a call may skip the dispatcher and run the Python body directly: not traced by
    torch.compile / torch.export, a plain CUDA tensor (not meta, not a FakeTensor or another
    subclass) and no torch dispatch mode active (FakeTensorMode, FlopCounterMode, ... must see
    the op)."""
    return (not torch.compiler.is_compiling() and type(t) is torch.Tensor and t.is_cuda
            and not torch._C._len_torch_dispatch_stack())


def _dedupe(tensors: tuple) -> tuple[tuple, tuple | None]:
    """Dynamo cannot trace an autograd.Function given one tensor in two inputs (seq_offsets_k is
    often seq_offsets_q): keep the first occurrence, pass None for the repeats, and return the
    slot each repeat aliases (None when there are no repeats)."""
    alias = [-1] * len(tensors)
    for i in range(1, len(tensors)):
        if tensors[i] is not None:
            for j in range(i):
                if tensors[j] is tensors[i]:
                    alias[i] = j
                    break
    if all(a < 0 for a in alias):
        return tensors, None
    return tuple(None if a >= 0 else t for t, a in zip(tensors, alias)), tuple(alias)


def _bwd_through_op(dout, q, k, v, rab, call: Call):
    """hstu_cute::bwd on a saved call (traced calls, or a dispatch mode watching an eager
    backward)."""
    return torch.ops.hstu_cute.bwd(dout, q, k, v, *op_arguments(call, rab), call.has_drab, call.deterministic)


class _HstuAttnFunction(torch.autograd.Function):
    """Autograd over hstu_cute::fwd / hstu_cute::bwd for traced calls (torch.compile,
    torch.export, dispatch modes); eager calls take :class:`_HstuAttnEager`.

    The tensors are q, k, v, rab, then the call's per-sequence tensors
    (:data:`hstu_cute.call.SEQUENCE_NAMES`); ``scalars`` the rest of the call
    (:class:`hstu_cute.call.OpScalars`); ``alias`` is _dedupe's map.
    """

    @staticmethod
    def forward(ctx, scalars, alias, *tensors):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors)
        ctx.scalars, ctx.alias = scalars, alias
        if alias is not None:
            tensors = tuple(t if a < 0 else tensors[a] for t, a in zip(tensors, alias))
        q, k, v, *rest = tensors
        return torch.ops.hstu_cute.fwd(q, k, v, *_traced_op_arguments(rest, scalars))

    @staticmethod
    def backward(ctx, dout):
        if dout is None:
            return (None, None) + (None,) * (4 + len(SEQUENCE_NAMES))
        tensors, alias, scalars = ctx.saved_tensors, ctx.alias, ctx.scalars
        if alias is not None:
            tensors = tuple(t if a < 0 else tensors[a] for t, a in zip(tensors, alias))
        q, k, v, *rest = tensors
        dq, dk, dv, drab = torch.ops.hstu_cute.bwd(dout, q, k, v, *_traced_op_arguments(rest, scalars),
                                                   scalars.has_drab, scalars.deterministic)
        grads = [dq, dk, dv, drab if scalars.has_drab else None]
        if alias is not None:  # a tensor given as several of q, k, v gets the sum of their gradients
            for i in (1, 2):
                if alias[i] >= 0:
                    grads[alias[i]] = grads[alias[i]] + grads[i]
                    grads[i] = None
        return (None, None, *grads) + (None,) * len(SEQUENCE_NAMES)


def _traced_op_arguments(tensors, scalars) -> tuple:
    """The ops' flat arguments of the traced function's rab and per-sequence tensors."""
    return op_arguments_of(dict(zip(_CALL_TENSORS, tensors)), scalars)


class _HstuAttnEager(torch.autograd.Function):
    """Autograd of eager calls: the launchers called directly (no dispatcher). Only q, k, v and
    rab are inputs of the node; the rest of the call rides in its record (fewer slots for
    autograd to walk per call)."""

    @staticmethod
    def forward(ctx, call, q, k, v, rab):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, rab)
        ctx.call = call
        return forward(q, k, v, rab, call)

    @staticmethod
    def backward(ctx, dout):
        if dout is None:
            return None, None, None, None, None
        q, k, v, rab = ctx.saved_tensors
        call = ctx.call
        if _eager(dout):
            dq, dk, dv, drab = backward(dout, q, k, v, rab, call)
        else:  # a dispatch mode or tensor subclass is watching the backward: it must see the op
            dq, dk, dv, drab = _bwd_through_op(dout, q, k, v, rab, call)
        return None, dq, dk, dv, (drab if call.has_drab else None)


class _HstuAttnFp8Eager(torch.autograd.Function):
    """Autograd of eager FP8 training calls (quant modes 0-5): the launchers called directly, as
    :class:`_HstuAttnEager` does for 16-bit. Through the dispatcher (fwd_fp8's registered
    autograd) a tiny training step cost 1749 us of host time against 599 for bf16 (H100 host,
    tools/host.py profile --step): each custom-op call spent ~0.7 ms in torch's op machinery."""

    @staticmethod
    def forward(ctx, call, q, k, v, rab):
        ctx.set_materialize_grads(False)
        ctx.call = call
        out, quantized = forward_fp8(q, k, v, rab, call, keep_quantized=True)
        # What the backward reads of q, k and v (e4m3 copies, half the bytes of the 16-bit
        # tensors), written by the forward's quantizer passes: the backward quantizes only dO.
        ctx.kept_names = tuple(quantized)
        ctx.save_for_backward(q, k, v, rab, *quantized.values())
        return out

    @staticmethod
    def backward(ctx, dout):
        if dout is None:
            return None, None, None, None, None
        q, k, v, rab, *kept = ctx.saved_tensors
        call = ctx.call
        if _eager(dout):
            dq, dk, dv, drab = backward_fp8(dout, q, k, v, rab, call, quantized=dict(zip(ctx.kept_names, kept)))
        else:  # a dispatch mode or tensor subclass is watching the backward: it must see the op
            dq, dk, dv, drab = _bwd_fp8_through_op(dout, q, k, v, rab, call)
        return None, dq, dk, dv, (drab if call.has_drab else None)


def hstu_attn_varlen_func(
    q, k, v,
    seq_offsets_q, seq_offsets_k,
    max_seqlen_q, max_seqlen_k,
    num_contexts=None,
    num_targets=None,
    target_group_size=1,
    window_size=(-1, -1),
    alpha=1.0,
    rab=None,
    has_drab=False,
    is_delta_q=False,
    descale_q=None, descale_k=None, descale_v=None, descale_do=None,
    *,
    quant_mode=-1,
    scaling_seqlen=-1,
    seqused_q=None, seqused_k=None,
    deterministic=False,
    kv_cache=None, page_offsets=None, page_ids=None, last_page_lens=None,
    func=None,
    block_mask=None,
):
    """HSTU attention over a jagged batch (FBGEMM-compatible arguments).

    For each sequence and head, ``out_i = sum_j silu(alpha * (q_i . k_j + rab[r, j])) * v_j / S``
    over the keys ``j`` that the mask allows. There is no softmax. **The output is divided by
    ``S = max_seqlen_q``** (batch-global) unless ``scaling_seqlen`` is given: a looser
    ``max_seqlen_q`` gives a smaller output. Full contract: docs/operator.md.

    Args:
        q: ``(T_q, H, D)`` bf16/fp16 CUDA tensor (or float8_e4m3fn, pre-quantized, on sm90:
            forward only); queries of all sequences packed along dim 0. ``D`` in {32, 64, 128,
            256} (FP8: 64, 128, 256); last dim stride 1.
        k: ``(T_k, H, D)`` keys; same dtype, device and ``D`` as q; ``H`` heads, or (16-bit k and
            v, no paged cache) ``H_kv`` heads dividing ``H``: query head ``h`` reads key head
            ``h // (H / H_kv)`` (GQA / MQA; docs/operator.md, "Grouped query heads").
        v: ``(T_k, H, D)`` values; same shape, dtype and device as k.
        seq_offsets_q: ``(B+1,)`` int32 cumulative row offsets of each sequence's queries
            (``[0] == 0``, non-decreasing, ``1 <= B <= 65535``).
        seq_offsets_k: ``(B+1,)`` int32 offsets of each sequence's keys/values; may be the same
            tensor as ``seq_offsets_q``.
        max_seqlen_q: Python int, upper bound on every sequence's query rows. Also the default
            divisor ``S``.
        max_seqlen_k: Python int ``>= max_seqlen_q``; bound on key rows; windows are normalized
            against it. Must equal ``max_seqlen_q`` unless ``is_delta_q``.
        num_contexts: ``(B,)`` int32 context-prefix lengths, or None. Causal window only.
        num_targets: ``(B,)`` int32 target-suffix lengths, or None (``c + t <= L``). Causal
            window only; not with ``is_delta_q``.
        target_group_size: int ``>= 1``. Targets attend within groups of this many consecutive
            targets (plus all context/history keys), never to earlier groups.
        window_size: ``(left, right)`` ints, negative = unbounded. ``(-1, -1)`` no mask,
            ``(-1, 0)`` causal, anything else a local band ``r - left <= j <= r + right``.
        alpha: finite float multiplying ``q.k + rab`` (the bias is scaled too) before the SiLU.
        rab: ``(B, H_rab, max_seqlen_k, max_seqlen_k)`` relative attention bias in q's dtype,
            ``H_rab`` in {1, H} (1 broadcasts over heads), or None. Query ``i`` reads row
            ``off + i``.
        has_drab: bool; also compute the gradient of ``rab`` (requires ``rab``; with
            ``H_rab == 1`` it is summed over heads).
        is_delta_q: bool; each sequence's ``Lq`` queries are the last ``Lq`` of its ``Lk`` key
            positions (masks and rab rows are evaluated at ``i + Lk - Lq``).
        descale_q, descale_k, descale_v: ``(1,)`` fp32 descale factors of pre-quantized
            float8_e4m3fn q, k, v (None: 1.0); only with such inputs. descale_do: accepted for
            FBGEMM's signature; anything but None raises ``NotImplementedError`` (that entry is
            forward-only).
        quant_mode: keyword-only int in -1..5: -1 no FP8; 0..5 quantize 16-bit q, k, v (and dO
            in the backward) to e4m3 on the device and run the Hopper FP8 kernels (sm90 only;
            0 cast, 1 two-direction, 2 per block, 3 per head, 4 per sequence, 5 per tensor:
            docs/operator.md, FP8). Trains (forward and backward) at head dims 64, 128, 256.
        scaling_seqlen: keyword-only int; the divisor ``S``. -1 (default) means
            ``max_seqlen_q``; otherwise ``>= 1``. Pin it to the training value when serving.
        seqused_q: keyword-only ``(B,)`` int32 valid query prefix per sequence, or None. Rows
            past it are padding and come out zero.
        seqused_k: keyword-only ``(B,)`` int32 valid key/value prefix per sequence, or None.
            Padded keys and values are never read.
        deterministic: keyword-only bool; bitwise reproducible backward (selects the dK/dV + dQ
            kernel pair over the fused Hopper kernel, and sums drab over heads in a fixed order).
        kv_cache: keyword-only ``(num_pages, 2, page_size, H, D)`` paged KV cache in q's dtype
            (``[:, 0]`` keys, ``[:, 1]`` values; page_size in {16, 32, 64, 128}), or None. With it
            (FBGEMM's meaning), sequence ``b``'s keys are its ``C_b`` cached tokens, the new
            history already appended, followed by its ``num_targets[b]`` targets; q, k and v share
            one layout at ``seq_offsets_q`` (new history, then targets) and only the targets' rows
            of k/v are read; ``seq_offsets_k`` counts each sequence's keys, ``C_b + t_b``
            (FBGEMM's ``cu_seqlens_k``). The queries are aligned to the end. Inference only; the
            causal family of masks. See docs/operator.md, "Paged KV cache", and
            :class:`hstu_cute.kv_cache.PagedKVCache`.
        page_offsets: keyword-only ``(B+1,)`` int32: sequence ``b`` owns the pages
            ``page_ids[page_offsets[b]:page_offsets[b+1]]``, in order.
        page_ids: keyword-only 1-D int32 page ids (entries past ``page_offsets[B]`` are ignored).
        last_page_lens: keyword-only ``(B,)`` int32 tokens in each sequence's last page, in
            ``[1, page_size]`` (ignored for a sequence without pages):
            ``C_b = (pages - 1) * page_size + last_page_lens[b]``.
        func: keyword-only arbitrary mask, ``(1, n_func, T_q + 256)`` int32 per-row key intervals
            (FBGEMM's layout; docs/operator.md, "Arbitrary masks"), or None; replaces the other
            masks (n_func 1 or 3; 16-bit on Hopper and sm80, FP8 on Hopper; forward and backward).
        block_mask: keyword-only :class:`hstu_cute.BlockMask`, or None: an element is attended
            only if the mask allows it and its (query block, key block) is kept for its sequence
            and head (docs/operator.md, "Block-sparse masks"): 16-bit, forward and backward on
            Hopper and sm80 (no FP8, paged cache or ``func``).

    Returns:
        ``out``: a new ``(T_q, H, D)`` tensor in q's dtype. Under autograd the backward returns
        ``dq``, ``dk``, ``dv`` (and ``drab`` with ``has_drab=True``) in the input dtype.

    Raises:
        TypeError, ValueError: a bad argument, before anything is compiled or launched. The
            message names the argument, the expected and the actual value. With
            ``HSTU_CUTE_CHECK=1`` the offsets, lengths and ``seqused`` / context / target
            values are also checked on the device data (costs a GPU sync).
        NotImplementedError: FP8 where no FP8 kernel runs (not sm90; training pre-quantized
            inputs), more than 65535 sequences, or an unsupported GPU.

    Under ``torch.compile`` / ``torch.export`` the call is traced as the custom ops
    ``hstu_cute::fwd`` / ``hstu_cute::bwd`` (FP8: ``hstu_cute::fwd_fp8`` / ``hstu_cute::bwd_fp8``).
    """
    if not isinstance(deterministic, bool):
        fail(TypeError, "deterministic", "a bool", type(deterministic).__name__)
    q, k, v, rab, widened = fp32_as_bf16(q, k, v, rab, kv_cache is not None)
    k, v = kv_heads_for_kernels(q, k, v, quant_mode, kv_cache is not None)
    eager = _eager(q)
    args = (q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
            target_group_size, window_size, alpha, rab, has_drab, is_delta_q, descale_q, descale_k, descale_v,
            descale_do, quant_mode, scaling_seqlen, seqused_q, seqused_k, kv_cache, page_offsets, page_ids,
            last_page_lens, func, block_mask)
    p, plans = validate_memoized(*args) if eager else (validate(*args), None)
    paged = PagedTables(kv_cache, page_offsets, page_ids, last_page_lens) if p.page_size else None
    call = Call(p, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets, seqused_q,
                seqused_k, target_group_size, alpha, has_drab, deterministic, (descale_q, descale_k, descale_v), paged,
                plans, func, block_mask)
    if eager:
        _check_data(call, q, k)
    out = _attend(call, q, k, v, rab, eager)
    # fp32 inputs ran in bf16 (validation.fp32_as_bf16): the output, and through the cast the
    # gradients, come back in fp32.
    return out.float() if widened else out


def _attend(call: Call, q, k, v, rab, eager: bool):
    """The validated call's forward, with its autograd: the launchers directly (eager) or the
    custom ops (traced, or under a dispatch mode)."""
    p, paged = call.problem, call.paged
    needs_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (call.has_drab and rab.requires_grad))
    if paged is not None:
        if needs_grad or (rab is not None and rab.requires_grad and torch.is_grad_enabled()):
            raise NotImplementedError(
                "q/k/v.requires_grad: the paged KV cache path is inference-only (no backward); run it under "
                "torch.no_grad() or pass detached tensors")
        if eager:
            return forward(q, k, v, rab, call)
        return torch.ops.hstu_cute.fwd_paged(q, k, v, *op_arguments(call, rab), *paged)
    if p.fp8:
        if needs_grad:
            # Before any work: a call no FP8 backward serves fails here, never with a 16-bit backward.
            check_fp8_backward(p)
            if eager:
                return _HstuAttnFp8Eager.apply(call, q, k, v, rab)
        if eager:
            return forward_fp8(q, k, v, rab, call)
        return torch.ops.hstu_cute.fwd_fp8(q, k, v, *call.descales, *op_arguments(call, rab), p.quant_mode,
                                           call.has_drab, call.deterministic)
    if needs_grad:
        if eager:
            return _HstuAttnEager.apply(call, q, k, v, rab)
        tensors, alias = _dedupe((q, k, v, rab) + sequence_tensors(call))
        return _HstuAttnFunction.apply(op_scalars(call), alias, *tensors)
    if eager:
        return forward(q, k, v, rab, call)
    return torch.ops.hstu_cute.fwd(q, k, v, *op_arguments(call, rab))
