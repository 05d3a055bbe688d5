"""HSTU attention as PyTorch modules: :class:`HSTUAttention` (the operator with its settings held
as attributes) and :class:`HSTUBlock` (one whole HSTU layer), plus plain-PyTorch references of both
(:func:`hstu_attention_reference`, :func:`hstu_block_reference`) that the tests compare against.

The math of the block is written down in docs/modules.md. Where the computation runs:

* CUDA (and meta) tensors take ``hstu_cute.hstu_attn_varlen_func``: the CuTe kernels (meta tensors
  only give shapes).
* CPU tensors take the PyTorch oracle (:mod:`hstu_cute.reference`, the variant that rounds where the
  kernel rounds), so a model built from these modules trains and tests on a machine without a GPU.
  It is slow (a Python loop over the sequences) and says so once per process with a warning.

``backend="reference"`` forces the oracle on any device (the tests use it as the same-dtype
yardstick on the GPU); ``backend="kernel"`` forces the operator (which refuses CPU tensors).
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .fp8_recipe import is_quant_mode
from .validation import fail
from .variants import FP8_HEAD_DIMS, HEAD_DIMS

__all__ = [
    "HSTUAttention",
    "HSTUBlock",
    "hstu_attention",
    "hstu_attention_reference",
    "hstu_block_reference",
    "BACKENDS",
]

BACKENDS = ("auto", "kernel", "reference")
CAUSAL = (-1, 0)

_reference_warned = False


def _warn_reference_once() -> None:
    global _reference_warned
    if not _reference_warned:
        _reference_warned = True
        warnings.warn(
            "hstu_cute: CPU tensors run the PyTorch reference of HSTU attention (hstu_cute.reference), not "
            "the CuTe kernel: correct but slow (one Python loop per batch). Move the model to a CUDA device "
            "for the kernel.", UserWarning, stacklevel=3)


def _check_backend(backend) -> None:
    if backend not in BACKENDS:
        fail(ValueError, "backend", f"one of {BACKENDS}", repr(backend))


def _check_window(name, window) -> tuple[int, int]:
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window)):
        fail(TypeError, name, "a (left, right) pair of ints (negative = unbounded)", repr(window))
    return int(window[0]), int(window[1])


def _is_int(x) -> bool:
    return (isinstance(x, (numbers.Integral, torch.SymInt))) and not isinstance(x, bool)


def _check_settings(alpha, window, scaling_seqlen, deterministic, quant_mode, target_group_size):
    """The settings a module holds, checked once at construction (the operator checks them again
    per call, with the same messages)."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        fail(TypeError, "alpha", "a finite Python float", repr(alpha))
    if not math.isfinite(alpha):
        fail(ValueError, "alpha", "a finite Python float", repr(alpha))
    window = _check_window("window", window)
    if not _is_int(scaling_seqlen) or (scaling_seqlen != -1 and scaling_seqlen < 1):
        fail(ValueError, "scaling_seqlen", "-1 (use max_seqlen) or an int >= 1", repr(scaling_seqlen))
    if not isinstance(deterministic, bool):
        fail(TypeError, "deterministic", "a bool", type(deterministic).__name__)
    if not _is_int(quant_mode) or not is_quant_mode(quant_mode):
        fail(ValueError, "quant_mode", "an int in -1..5 (-1: 16-bit)", repr(quant_mode))
    if not _is_int(target_group_size) or target_group_size < 1:
        fail(ValueError, "target_group_size", "an int >= 1", repr(target_group_size))
    return window


def _check_qkv(q, k, v, seq_offsets, max_seqlen) -> None:
    """Checks every path shares (the kernel path's operator checks the rest: dtypes, head dims,
    strides, devices). Self-attention: k and v have q's rows."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, name, "a torch.Tensor", type(t).__name__)
        if t.dim() != 3:
            fail(ValueError, name, "a 3-D tensor (tokens, heads, head_dim)", f"shape {tuple(t.shape)}")
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]  # q's heads, or a divisor of them (GQA / MQA: docs/operator.md)
    if k.shape[0] != tokens or k.shape[2] != head_dim or kv_heads < 1 or heads % kv_heads:
        fail(ValueError, "k.shape", f"({tokens}, H_kv, {head_dim}) with H_kv dividing {heads} (q's tokens, heads and "
             "head dim: self-attention)", tuple(k.shape))
    if tuple(v.shape[:2]) != (tokens, kv_heads):
        fail(ValueError, "v.shape[:2]", f"{(tokens, kv_heads)} (k's tokens and heads)", tuple(v.shape[:2]))
    if k.dtype != q.dtype or v.dtype != q.dtype:
        fail(TypeError, "k/v dtype", f"{q.dtype} (same as q)", f"k {k.dtype}, v {v.dtype}")
    if not isinstance(seq_offsets, torch.Tensor):
        fail(TypeError, "seq_offsets", "a torch.Tensor of B+1 int32/int64 offsets", type(seq_offsets).__name__)
    if seq_offsets.dtype not in (torch.int32, torch.int64):
        fail(TypeError, "seq_offsets.dtype", "torch.int32 or torch.int64", seq_offsets.dtype)
    if seq_offsets.dim() != 1 or seq_offsets.shape[0] < 2:
        fail(ValueError, "seq_offsets", "a 1-D tensor of length B+1 >= 2", tuple(seq_offsets.shape))
    if seq_offsets.device != q.device:
        fail(ValueError, "seq_offsets.device", f"{q.device} (same as q)", seq_offsets.device)
    if not _is_int(max_seqlen) or max_seqlen < 0:
        fail(TypeError if not _is_int(max_seqlen) else ValueError, "max_seqlen", "a Python int >= 0",
             repr(max_seqlen))


def _int32(t):
    """Index tensors as the operator takes them: int64 ones (common in recommender code) become
    int32 with one small device copy, without a host sync."""
    return t.to(torch.int32) if isinstance(t, torch.Tensor) and t.dtype == torch.int64 else t


def kernel_head_dim(*dims: int, built: tuple = HEAD_DIMS) -> int | None:
    """The smallest head dim of ``built`` (the kernels' head dims) that holds every one of ``dims``."""
    need = max(dims)
    return next((d for d in built if d >= need), None)


def pad_head_dims(q, k, v, built: tuple = HEAD_DIMS):
    """q, k, v zero-padded along the head dim to one dim the kernels support (``built``: the head
    dims of the kernels that will run; the FP8 kernels' are :data:`~hstu_cute.variants.FP8_HEAD_DIMS`).

    Exact: zero columns add nothing to q.k, and zero columns of v give output columns that the
    caller slices off. It lets the value head dim differ from the query/key one (as in STU layers)
    and covers head dims between the built ones, at the price of one copy of each padded tensor.
    Returns ``(q, k, v, value_dim)``; the tensors are returned as they are when nothing is needed.
    """
    head_dim, value_dim = q.shape[2], v.shape[2]
    if head_dim == value_dim and head_dim in built:
        return q, k, v, value_dim
    target = kernel_head_dim(head_dim, value_dim, built=built)
    if target is None:  # too wide for every kernel: let the operator name the problem
        return q, k, v, value_dim
    q, k = (F.pad(t, (0, target - head_dim)) if target != head_dim else t for t in (q, k))
    v = F.pad(v, (0, target - value_dim)) if target != value_dim else v
    return q, k, v, value_dim


def hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seqlen: int,
    *,
    num_contexts: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    target_group_size: int = 1,
    window_size: tuple[int, int] = CAUSAL,
    alpha: float = 1.0,
    rab: torch.Tensor | None = None,
    has_drab: bool | None = None,
    scaling_seqlen: int = -1,
    seqused: torch.Tensor | None = None,
    deterministic: bool = False,
    quant_mode: int = -1,
    backend: str = "auto",
    block_mask=None,
) -> torch.Tensor:
    """HSTU self-attention over one jagged batch: ``hstu_attn_varlen_func`` with one set of
    offsets for queries and keys, on the device's path (kernel on CUDA, PyTorch reference on CPU).

    Differences from calling the operator directly, all of them conveniences that keep the math:

    * ``window_size`` defaults to causal ``(-1, 0)``.
    * ``has_drab=None`` (default) means "``rab.requires_grad``": a learned bias gets its gradient.
    * int64 ``seq_offsets`` / ``num_contexts`` / ``num_targets`` / ``seqused`` are converted to int32.
    * ``v`` may have a head dim other than q's, and head dims between the built ones are accepted:
      on the kernel path q, k, v are zero-padded to the next built head dim (one copy each;
      exact, see :func:`pad_head_dims`).
    * ``seqused`` (B,) valid prefix of each sequence's rows, for queries and keys alike.
    * ``block_mask``: a :class:`hstu_cute.BlockMask`, passed through (docs/operator.md, "Block-sparse
      masks"); the reference path applies it too.

    Returns ``(T, H, Dv)`` in q's dtype. Argument errors name the argument, the expected and the
    actual value, before anything runs.
    """
    _check_backend(backend)
    _check_qkv(q, k, v, seq_offsets, max_seqlen)
    window_size = _check_window("window_size", window_size)
    if has_drab is None:
        has_drab = rab is not None and rab.requires_grad
    seq_offsets, num_contexts, num_targets, seqused = map(_int32, (seq_offsets, num_contexts, num_targets, seqused))
    use_reference = backend == "reference" or (backend == "auto" and q.device.type == "cpu")
    if use_reference:
        if backend == "auto":
            _warn_reference_once()
        if quant_mode != -1:
            raise NotImplementedError(
                f"quant_mode: the PyTorch reference path (CPU tensors or backend='reference') has no FP8; "
                f"expected -1, got {quant_mode}. FP8 runs on Hopper GPUs.")
        if rab is not None and not has_drab:
            rab = rab.detach()  # as the kernel: no gradient for rab unless has_drab
        from .reference import hstu_attn_reference

        return hstu_attn_reference(
            q, k, v, seq_offsets, seq_offsets, max_seqlen, max_seqlen, num_contexts, num_targets, target_group_size,
            window_size, alpha, rab, scaling_seqlen=scaling_seqlen, seqused_q=seqused, seqused_k=seqused,
            compute_dtype=None, block_mask=block_mask)
    from .api import hstu_attn_varlen_func

    # FP8 runs at fewer head dims (64, 128, 256): an 80-wide head pads to 128 there, to 96 in 16 bits.
    q, k, v, value_dim = pad_head_dims(q, k, v, FP8_HEAD_DIMS if quant_mode != -1 else HEAD_DIMS)
    out = hstu_attn_varlen_func(
        q, k, v, seq_offsets, seq_offsets, max_seqlen, max_seqlen, num_contexts, num_targets, target_group_size,
        window_size, alpha, rab, has_drab, quant_mode=quant_mode, scaling_seqlen=scaling_seqlen, seqused_q=seqused,
        seqused_k=seqused, deterministic=deterministic, block_mask=block_mask)
    return out if out.shape[2] == value_dim else out[..., :value_dim]


def hstu_attention_reference(
    q, k, v, seq_offsets, max_seqlen, *, num_contexts=None, num_targets=None, target_group_size=1,
    window_size=CAUSAL, alpha=1.0, rab=None, scaling_seqlen=-1, seqused=None,
    compute_dtype: torch.dtype | None = torch.float32,
) -> torch.Tensor:
    """The oracle of :func:`hstu_attention` (and of :class:`HSTUAttention`): the operator's
    PyTorch reference on the same self-attention call. ``compute_dtype=torch.float32`` (default)
    is the fp32 oracle (wider inputs stay wider), ``None`` rounds where the kernel rounds."""
    from .reference import hstu_attn_reference

    if compute_dtype is not None:
        compute_dtype = torch.promote_types(q.dtype, compute_dtype)

    return hstu_attn_reference(
        q, k, v, seq_offsets, seq_offsets, max_seqlen, max_seqlen, num_contexts, num_targets, target_group_size,
        window_size, alpha, rab, scaling_seqlen=scaling_seqlen, seqused_q=seqused, seqused_k=seqused,
        compute_dtype=compute_dtype)


class HSTUAttention(nn.Module):
    """HSTU attention (SiLU, no softmax) over a jagged batch, as a module.

    The settings of the operator are attributes: ``alpha`` (scales ``q.k + rab``), ``window``
    (``(left, right)``, default causal ``(-1, 0)``), ``scaling_seqlen`` (the divisor ``S``; -1 means
    the call's ``max_seqlen``), ``target_group_size``, ``deterministic`` (bitwise reproducible
    backward), ``quant_mode`` (FP8, Hopper; training with modes 0-5 at head dims 64, 128, 256) and
    ``backend`` (see the module doc).
    The module holds no parameters.

    ``forward(q, k, v, seq_offsets, max_seqlen, num_contexts=None, num_targets=None, rab=None,
    *, has_drab=None, seqused=None, block_mask=None)`` returns ``(T, H, Dv)``; see
    :func:`hstu_attention`.
    """

    def __init__(self, alpha: float = 1.0, window: tuple[int, int] = CAUSAL, scaling_seqlen: int = -1,
                 deterministic: bool = False, quant_mode: int = -1, target_group_size: int = 1,
                 backend: str = "auto"):
        super().__init__()
        self.window = _check_settings(alpha, window, scaling_seqlen, deterministic, quant_mode, target_group_size)
        _check_backend(backend)
        self.alpha = float(alpha)
        self.scaling_seqlen = int(scaling_seqlen)
        self.deterministic = deterministic
        self.quant_mode = int(quant_mode)
        self.target_group_size = int(target_group_size)
        self.backend = backend

    def forward(self, q, k, v, seq_offsets, max_seqlen, num_contexts=None, num_targets=None, rab=None, *,
                has_drab=None, seqused=None, block_mask=None):
        return hstu_attention(
            q, k, v, seq_offsets, max_seqlen, num_contexts=num_contexts, num_targets=num_targets,
            target_group_size=self.target_group_size, window_size=self.window, alpha=self.alpha, rab=rab,
            has_drab=has_drab, scaling_seqlen=self.scaling_seqlen, seqused=seqused,
            deterministic=self.deterministic, quant_mode=self.quant_mode, backend=self.backend,
            block_mask=block_mask)

    def extra_repr(self) -> str:
        return (f"alpha={self.alpha:g}, window={self.window}, scaling_seqlen={self.scaling_seqlen}, "
                f"target_group_size={self.target_group_size}, deterministic={self.deterministic}, "
                f"quant_mode={self.quant_mode}, backend={self.backend!r}")


_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


class HSTUBlock(nn.Module):
    """One HSTU layer over a jagged batch ``x`` of shape ``(T, d_model)`` (docs/modules.md)::

        h          = LayerNorm_in(x)
        u, v, q, k = split(h W_uvqk + b_uvqk)             # fused projection, H heads each
        u          = SiLU(u)
        a          = HSTUAttention(q, k, v)                # (T, H * hidden_dim), divided by S
        y          = u * LayerNorm_out(a)                  # gating by u
        out        = x + Dropout(y) W_out                  # output projection, residual

    ``q``, ``k`` have ``head_dim`` per head, ``u``, ``v`` have ``hidden_dim`` (default
    ``head_dim``). ``num_kv_heads`` (default ``num_heads``, a divisor of it): the heads of k and v,
    shared by groups of query heads (GQA / MQA; docs/operator.md). ``alpha`` defaults to
    ``1/sqrt(head_dim)``. The attention is causal by default
    (``window``), with optional contexts, targets and rab per call.

    On the kernel path (CUDA), q, k, v that are not 16-bit (an fp32 model without autocast) are cast
    to ``attention_dtype`` (bf16 by default) for the kernel and the attention output back to x's
    dtype; under ``torch.autocast`` they already are 16-bit. On CPU the block runs in x's dtype
    through the PyTorch reference.
    """

    def __init__(self, d_model: int, num_heads: int, head_dim: int, hidden_dim: int | None = None, *,
                 alpha: float | None = None, window: tuple[int, int] = CAUSAL, scaling_seqlen: int = -1,
                 target_group_size: int = 1, dropout: float = 0.0, eps: float = 1e-6, deterministic: bool = False,
                 quant_mode: int = -1, attention_dtype: torch.dtype = torch.bfloat16, backend: str = "auto",
                 num_kv_heads: int | None = None, device=None, dtype=None):
        super().__init__()
        for name, value in (("d_model", d_model), ("num_heads", num_heads), ("head_dim", head_dim)):
            if not _is_int(value) or value < 1:
                fail(ValueError, name, "an int >= 1", repr(value))
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if not _is_int(num_kv_heads) or num_kv_heads < 1 or num_heads % num_kv_heads:
            fail(ValueError, "num_kv_heads", f"an int >= 1 dividing num_heads ({num_heads}), or None", repr(num_kv_heads))
        hidden_dim = head_dim if hidden_dim is None else hidden_dim
        if not _is_int(hidden_dim) or hidden_dim < 1:
            fail(ValueError, "hidden_dim", "an int >= 1 or None (= head_dim)", repr(hidden_dim))
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= dropout < 1.0:
            fail(ValueError, "dropout", "a float in [0, 1)", repr(dropout))
        if attention_dtype not in _KERNEL_DTYPES:
            fail(TypeError, "attention_dtype", "torch.bfloat16 or torch.float16", attention_dtype)
        self.d_model, self.num_heads, self.head_dim, self.hidden_dim = d_model, num_heads, head_dim, hidden_dim
        self.num_kv_heads = num_kv_heads
        self.attention_dtype = attention_dtype
        self.dropout = float(dropout)
        factory = dict(device=device, dtype=dtype)
        self.input_norm = nn.LayerNorm(d_model, eps=eps, **factory)
        self.uvqk = nn.Linear(d_model, sum(self.uvqk_sizes()), **factory)
        self.output_norm = nn.LayerNorm(num_heads * hidden_dim, eps=eps, **factory)
        self.output = nn.Linear(num_heads * hidden_dim, d_model, bias=False, **factory)
        self.attention = HSTUAttention(1.0 / math.sqrt(head_dim) if alpha is None else alpha, window, scaling_seqlen,
                                       deterministic, quant_mode, target_group_size, backend)

    def uvqk_sizes(self) -> list[int]:
        """Columns of the fused projection's u, v, q and k: u and q per query head, v and k per key
        head."""
        H, H_kv, dv, da = self.num_heads, self.num_kv_heads, self.hidden_dim, self.head_dim
        return [H * dv, H_kv * dv, H * da, H_kv * da]

    def split_uvqk(self, h: torch.Tensor):
        """The fused projection's four parts: u as (T, H, hidden_dim), v as (T, H_kv, hidden_dim),
        q as (T, H, head_dim), k as (T, H_kv, head_dim): views of one product (no copies)."""
        u, v, q, k = self.uvqk(h).split(self.uvqk_sizes(), dim=-1)
        H, H_kv, dv, da = self.num_heads, self.num_kv_heads, self.hidden_dim, self.head_dim
        return (u.unflatten(-1, (H, dv)), v.unflatten(-1, (H_kv, dv)), q.unflatten(-1, (H, da)),
                k.unflatten(-1, (H_kv, da)))

    def _kernel_path(self, x: torch.Tensor) -> bool:
        backend = self.attention.backend
        return backend == "kernel" or (backend == "auto" and x.device.type != "cpu")

    def forward(self, x: torch.Tensor, seq_offsets: torch.Tensor, max_seqlen: int, num_contexts=None,
                num_targets=None, rab=None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            fail(TypeError, "x", "a torch.Tensor", type(x).__name__)
        if x.dim() != 2 or x.shape[1] != self.d_model:
            fail(ValueError, "x.shape", f"(T, {self.d_model}) (tokens, d_model)", tuple(x.shape))
        u, v, q, k = self.split_uvqk(self.input_norm(x))
        u = F.silu(u)
        if self._kernel_path(x) and q.dtype not in _KERNEL_DTYPES:
            q, k, v = (t.to(self.attention_dtype) for t in (q, k, v))
            if rab is not None and rab.dtype not in _KERNEL_DTYPES:
                rab = rab.to(self.attention_dtype)
        a = self.attention(q, k, v, seq_offsets, max_seqlen, num_contexts, num_targets, rab)
        a = a.reshape(a.shape[0], -1).to(u.dtype)
        y = u.flatten(1) * self.output_norm(a)
        return x + self.output(F.dropout(y, self.dropout, self.training))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, "
                f"hidden_dim={self.hidden_dim}, dropout={self.dropout:g}")


def hstu_block_reference(block: HSTUBlock, x, seq_offsets, max_seqlen, num_contexts=None, num_targets=None,
                         rab=None, *, compute_dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """The math of :class:`HSTUBlock` in plain PyTorch on ``block``'s parameters (no dropout),
    with the attention from the operator's oracle (:func:`hstu_attention_reference`).

    ``compute_dtype=torch.float32``: the block's parameters and ``x`` upcast, everything in fp32
    (the fp32 oracle; returns fp32; wider inputs stay wider). ``None``: in x's dtype, the attention
    rounding where the kernel rounds (the same-dtype yardstick). Differentiable w.r.t. ``x`` and the
    block's parameters.
    """
    dtype = x.dtype if compute_dtype is None else torch.promote_types(x.dtype, compute_dtype)

    def cast(t):
        return None if t is None else t.to(dtype)

    H, dv, da = block.num_heads, block.hidden_dim, block.head_dim
    x = cast(x)
    norm_in, norm_out = block.input_norm, block.output_norm
    h = F.layer_norm(x, (block.d_model,), cast(norm_in.weight), cast(norm_in.bias), norm_in.eps)
    projected = h @ cast(block.uvqk.weight).t() + cast(block.uvqk.bias)
    u, v, q, k = torch.split(projected, block.uvqk_sizes(), dim=1)
    rows = x.shape[0]
    att = block.attention
    H_kv = block.num_kv_heads
    a = hstu_attention_reference(
        q.reshape(rows, H, da), k.reshape(rows, H_kv, da), v.reshape(rows, H_kv, dv), seq_offsets, max_seqlen,
        num_contexts=num_contexts, num_targets=num_targets, target_group_size=att.target_group_size,
        window_size=att.window, alpha=att.alpha, rab=cast(rab), scaling_seqlen=att.scaling_seqlen,
        compute_dtype=None).reshape(rows, H * dv)
    gated = F.silu(u) * F.layer_norm(a, (H * dv,), cast(norm_out.weight), cast(norm_out.bias), norm_out.eps)
    return x + gated @ cast(block.output.weight).t()
