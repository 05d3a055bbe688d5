"""Argument checks of the public call (spec: docs/operator.md, "Errors"): every argument is
checked before anything is compiled or launched, without a GPU sync, and a failure names the
argument, the expected and the actual value. Checks that need the device's data (and a sync) run
only with ``HSTU_CUTE_CHECK=1``.

The result of a successful check is a :class:`Problem`: the normalized, hashable description of
the call that the launcher selects kernels from.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

import torch

from . import masks
from .block_mask import BlockMask, blocks_for
from .arch import forced_path
from .fp8_recipe import PRE_QUANTIZED, Fp8Recipe, is_quant_mode, recipe
from .variants import FP8_HEAD_DIMS, HEAD_DIMS, PAGE_SIZES

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
FP8_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2") if hasattr(torch, n)
)
MAX_GRID_BATCH = 65535  # grid.z limit of a launch
#: The FP8 element type the FP8 kernels read (pre-quantized inputs, and what quant_mode makes).
FP8_INPUT_DTYPE = getattr(torch, "float8_e4m3fn", None)


def is_fp8_call(dtype: torch.dtype, quant_mode: int) -> bool:
    """A call takes the FP8 path: pre-quantized e4m3 inputs, or a quant_mode."""
    return quant_mode != PRE_QUANTIZED or dtype == FP8_INPUT_DTYPE


def output_dtype(dtype: torch.dtype) -> torch.dtype:
    """The output's (and rab's) dtype for inputs of ``dtype``: bf16 for pre-quantized e4m3
    inputs, else the inputs' own."""
    return torch.bfloat16 if dtype == FP8_INPUT_DTYPE else dtype


def kv_group(q, k, v, paged: bool = False) -> int:
    """GQA / MQA (docs/operator.md, "Grouped query heads"): ``H_q // H_kv`` when k and v hold
    ``H_kv`` heads, a proper divisor of q's ``H_q``, shared by groups of consecutive query heads
    (query head ``h`` reads key head ``h // group``); 1 otherwise (validation then names what does
    not match). 16-bit k and v only, and not with a paged cache, whose pages hold ``H_q`` heads."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v)) or paged:
        return 1
    h_q, h_kv = q.shape[1], k.shape[1]
    if (h_kv == h_q or h_kv < 1 or h_q % h_kv or v.shape[1] != h_kv
            or k.dtype not in (torch.bfloat16, torch.float16) or v.dtype != k.dtype):
        return 1
    return h_q // h_kv


def expand_kv_heads(q, k, v, paged: bool = False):
    """``(k, v)`` with each key head repeated for its group of query heads (:func:`kv_group`; a
    copy, differentiable: the backward sums each group's gradients), or unchanged."""
    group = kv_group(q, k, v, paged)
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def kv_heads_for_kernels(q, k, v, quant_mode, paged: bool = False):
    """``(k, v)`` as the kernels take them under GQA / MQA: as given (H_kv heads) for 16-bit
    calls, whose forward and backward kernels read key head ``h // group`` in place (the backward
    sums each group's dK / dV); :func:`expand_kv_heads` for FP8 calls (the FP8 kernels take H_q
    heads; autograd sums the copies' gradients back)."""
    if quant_mode == -1:
        return k, v
    return expand_kv_heads(q, k, v, paged)


def fp32_as_bf16(q, k, v, rab, paged: bool = False):
    """fp32 inputs (docs/operator.md, "fp32 inputs"): ``(q, k, v, rab, widened)`` with q, k, v (and
    an fp32 rab) cast to bf16 when q, k and v are all fp32 (not with a paged cache, whose pages hold
    16-bit keys), ``widened`` saying so; the caller casts the output back. The casts are
    differentiable: the gradients come back in fp32. bf16, not fp16: the same exponent range as
    fp32, so no input overflows and no gradient underflows (an fp16 cast was 1.5x TF32's error and
    bf16 10x at unit scale, both within that library's fp32 tolerances on its own grid;
    docs/dev/perf-log.md, session 32)."""
    if paged or getattr(q, "dtype", None) != torch.float32 or not all(
            isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in (q, k, v)):
        return q, k, v, rab, False
    if isinstance(rab, torch.Tensor) and rab.dtype == torch.float32:
        rab = rab.to(torch.bfloat16)
    return q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), rab, True


def fail(exc, name, expected, actual):
    raise exc(f"{name}: expected {expected}, got {actual}")


def _check_int_vector(name, t, batch, device):
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        fail(TypeError, name, "a torch.Tensor or None", type(t).__name__)
    if t.dtype != torch.int32:
        fail(TypeError, name, "dtype torch.int32", t.dtype)
    if t.dim() != 1 or t.shape[0] != batch:
        fail(ValueError, name, f"shape ({batch},) (one entry per sequence)", tuple(t.shape))
    if t.device != device:
        fail(ValueError, name, f"device {device} (same as q)", t.device)


def _check_python_int(name, x, minimum=None):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        fail(TypeError, name, "a Python int", f"{type(x).__name__} {x!r}")
    if minimum is not None and x < minimum:
        fail(ValueError, name, f"an int >= {minimum}", x)


@dataclass(frozen=True)
class Problem:
    """Validated, normalized arguments of one call."""

    batch: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    mask: masks.MaskSpec
    window_left: int
    window_right: int
    scale_seqlen: int
    rab_heads: int
    # FP8: -1 none or pre-quantized e4m3 inputs (``dtype`` says which), 0..5 the op quantizes.
    quant_mode: int = -1
    # Tokens per page of a paged KV cache ahead of the new keys (kv_cache); 0 without one.
    page_size: int = 0

    @property
    def fp8(self) -> bool:
        return is_fp8_call(self.dtype, self.quant_mode)

    @property
    def recipe(self) -> Fp8Recipe | None:
        """The FP8 recipe (:mod:`hstu_cute.fp8_recipe`), None for a 16-bit call."""
        return recipe(self.quant_mode) if self.fp8 else None

    @property
    def out_dtype(self) -> torch.dtype:
        return output_dtype(self.dtype)


def _check_descale(name, t, device):
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        fail(TypeError, name, "a torch.Tensor or None", type(t).__name__)
    if t.dtype != torch.float32:
        fail(TypeError, f"{name}.dtype", "torch.float32", t.dtype)
    if tuple(t.shape) != (1,):
        fail(ValueError, f"{name}.shape", "(1,) (one descale for the whole tensor)", tuple(t.shape))
    if t.device != device:
        fail(ValueError, f"{name}.device", f"{device} (same as q)", t.device)


def _check_fp8(q, k, v, descale_q, descale_k, descale_v, descale_do, quant_mode):
    """The FP8 arguments: pre-quantized e4m3 inputs (with optional (1,) descales) or a built
    ``quant_mode`` with 16-bit inputs; never both, and no descale without e4m3 inputs."""
    fp8_inputs = [n for n, t in (("q", q), ("k", k), ("v", v)) if t.dtype in FP8_DTYPES]
    descales = (("descale_q", descale_q), ("descale_k", descale_k), ("descale_v", descale_v))
    if fp8_inputs:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype != FP8_INPUT_DTYPE:
                fail(TypeError, f"{name}.dtype", "torch.float8_e4m3fn for all of q, k, v (pre-quantized inputs)",
                     t.dtype)
        if quant_mode != PRE_QUANTIZED:
            fail(ValueError, "quant_mode", "-1 with pre-quantized float8_e4m3fn inputs (they are quantized already)",
                 quant_mode)
        if descale_do is not None:
            raise NotImplementedError(
                "descale_do: the pre-quantized FP8 entry is forward-only (there is no dO to descale); pass None")
        for name, t in descales:
            _check_descale(name, t, q.device)
        return
    for name, t in descales + (("descale_do", descale_do),):
        if t is not None:
            fail(ValueError, name, "None unless q, k, v are pre-quantized torch.float8_e4m3fn", "a tensor")


_PAGED_NAMES = ("kv_cache", "page_offsets", "page_ids", "last_page_lens")


def _check_paged(kv_cache, page_offsets, page_ids, last_page_lens, q, batch) -> int:
    """The paged KV cache's arguments (all four or none); returns its page size (0: none)."""
    given = dict(zip(_PAGED_NAMES, (kv_cache, page_offsets, page_ids, last_page_lens)))
    if all(t is None for t in given.values()):
        return 0
    for name, t in given.items():
        if t is None:
            fail(ValueError, name, "a tensor when any of kv_cache, page_offsets, page_ids, last_page_lens is given "
                 "(the paged KV cache takes all four)", None)
        if not isinstance(t, torch.Tensor):
            fail(TypeError, name, "a torch.Tensor or None", type(t).__name__)
        if t.device != q.device:
            fail(ValueError, f"{name}.device", f"{q.device} (same as q)", t.device)
    heads, head_dim = q.shape[1], q.shape[2]
    if kv_cache.dtype != q.dtype:
        fail(TypeError, "kv_cache.dtype", f"{q.dtype} (same as q)", kv_cache.dtype)
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or tuple(kv_cache.shape[3:]) != (heads, head_dim):
        fail(ValueError, "kv_cache", f"shape (num_pages, 2, page_size, {heads}, {head_dim})", tuple(kv_cache.shape))
    if kv_cache.shape[0] < 1:
        fail(ValueError, "kv_cache.shape[0] (num_pages)", "at least 1", kv_cache.shape[0])
    page_size = kv_cache.shape[2]
    if page_size not in PAGE_SIZES:
        fail(ValueError, "kv_cache.shape[2] (page_size)", f"one of {PAGE_SIZES}", page_size)
    s_page, s_kind, s_row, s_head, s_dim = kv_cache.stride()
    vec = 16 // kv_cache.element_size()
    # The kernels read the cache as rows (page * 2 + kind) * page_size + row of one row stride.
    if (s_dim != 1 or s_row % vec or s_head % vec or s_kind != page_size * s_row or s_page != 2 * s_kind
            or kv_cache.data_ptr() % 16):
        fail(ValueError, "kv_cache.stride()", "(2 * page_size * R, page_size * R, R, H_stride, 1) with R and "
             "H_stride multiples of 16 bytes and a 16-byte aligned base (e.g. a contiguous cache)",
             tuple(kv_cache.stride()))
    for name, t, length in (("page_offsets", page_offsets, batch + 1), ("page_ids", page_ids, None),
                            ("last_page_lens", last_page_lens, batch)):
        if t.dtype != torch.int32:
            fail(TypeError, f"{name}.dtype", "torch.int32", t.dtype)
        if t.dim() != 1 or (length is not None and t.shape[0] != length):
            fail(ValueError, name, f"a 1-D tensor of length {length if length is not None else 'page_offsets[-1]'}",
                 tuple(t.shape))
    return page_size


def validate(
    q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
    target_group_size, window_size, alpha, rab, has_drab, is_delta_q, descale_q, descale_k, descale_v,
    descale_do, quant_mode, scaling_seqlen, seqused_q, seqused_k, kv_cache=None, page_offsets=None,
    page_ids=None, last_page_lens=None, func=None, block_mask=None,
) -> Problem:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, name, "a torch.Tensor", type(t).__name__)
    _check_python_int("quant_mode", quant_mode)
    if not is_quant_mode(quant_mode):
        fail(ValueError, "quant_mode", "an int in -1..5", quant_mode)
    _check_fp8(q, k, v, descale_q, descale_k, descale_v, descale_do, quant_mode)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in DTYPE_NAMES and t.dtype != FP8_INPUT_DTYPE:
            fail(TypeError, name, "dtype torch.bfloat16, torch.float16 or torch.float8_e4m3fn", t.dtype)
        if t.dim() != 3:
            fail(ValueError, name, "a 3-D tensor (tokens, heads, head_dim)", f"{t.dim()}-D shape {tuple(t.shape)}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            fail(ValueError, f"{name}.stride(-1)", "1 (last dim contiguous)", t.stride(-1))
    if k.dtype != q.dtype or v.dtype != q.dtype:
        fail(TypeError, "k/v dtype", f"{q.dtype} (same as q)", f"k {k.dtype}, v {v.dtype}")
    heads, head_dim = q.shape[1], q.shape[2]
    if head_dim not in HEAD_DIMS:
        fail(ValueError, "q.shape[2] (head dim)", f"one of {HEAD_DIMS}", head_dim)
    fp8 = is_fp8_call(q.dtype, quant_mode)
    if forced_path() == "ampere" and fp8:  # also a ValueError for an invalid HSTU_CUTE_ARCH
        what = f"quant_mode={quant_mode}" if quant_mode != PRE_QUANTIZED else "float8_e4m3fn inputs"
        raise NotImplementedError(f"{what}: HSTU_CUTE_ARCH={os.environ.get('HSTU_CUTE_ARCH')} forces the sm80 "
                                  "(mma.sync) kernels, which have no FP8; the FP8 kernels are Hopper-only (sm90)")
    if fp8 and head_dim not in FP8_HEAD_DIMS:
        raise NotImplementedError(f"q.shape[2] (head dim): the FP8 forward supports {FP8_HEAD_DIMS}, got {head_dim}")
    # GQA / MQA reach validation with H_kv heads only where the 16-bit kernels read them natively
    # (hstu_attn_varlen_func); FP8 calls come expanded.
    kv_heads = k.shape[1] if not fp8 and kv_group(q, k, v, kv_cache is not None) > 1 else heads
    if k.shape[1] != kv_heads:
        fail(ValueError, "k.shape[1] (heads)", f"{heads} (q's heads), or a divisor of them for GQA / MQA with "
             "16-bit k and v, without a paged cache", k.shape[1])
    if k.shape[2] != head_dim:
        fail(ValueError, "k.shape[2] (head dim)", f"{head_dim} (q's head dim)", k.shape[2])
    if v.shape[1] != kv_heads or v.shape[2] != head_dim:
        fail(ValueError, "v.shape[1:]", f"({kv_heads}, {head_dim})", tuple(v.shape[1:]))
    if v.shape[0] != k.shape[0]:
        fail(ValueError, "v.shape[0]", f"{k.shape[0]} (k's tokens)", v.shape[0])
    device = q.device
    for name, t in (("k", k), ("v", v)):
        if t.device != device:
            fail(ValueError, f"{name}.device", f"{device} (same as q)", t.device)

    for name, t in (("seq_offsets_q", seq_offsets_q), ("seq_offsets_k", seq_offsets_k)):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, name, "a torch.Tensor", type(t).__name__)
        if t.dtype != torch.int32:
            fail(TypeError, name, "dtype torch.int32", t.dtype)
        if t.dim() != 1 or t.shape[0] < 2:
            fail(ValueError, name, "a 1-D tensor of length B+1 >= 2", tuple(t.shape))
        if t.device != device:
            fail(ValueError, f"{name}.device", f"{device} (same as q)", t.device)
    if seq_offsets_k.shape[0] != seq_offsets_q.shape[0]:
        fail(ValueError, "seq_offsets_k.shape[0]", f"{seq_offsets_q.shape[0]} (same B+1 as seq_offsets_q)",
              seq_offsets_k.shape[0])
    batch = seq_offsets_q.shape[0] - 1
    if batch > MAX_GRID_BATCH:
        raise NotImplementedError(
            f"seq_offsets_q: expected at most {MAX_GRID_BATCH} sequences per call (launch grid limit), got {batch}")

    if isinstance(max_seqlen_q, torch.Tensor) or max_seqlen_q is None:
        # FBGEMM's current order puts seqused_q (a tensor or None) in this place.
        fail(TypeError, "max_seqlen_q", "a Python int (a positional call in FBGEMM's current order, with seqused_q "
             "here, goes to hstu_cute.integrations.fbgemm.hstu_attn_varlen_func)", type(max_seqlen_q).__name__)
    _check_python_int("max_seqlen_q", max_seqlen_q, 0)
    _check_python_int("max_seqlen_k", max_seqlen_k, 0)
    if max_seqlen_q > max_seqlen_k:
        fail(ValueError, "max_seqlen_q", f"<= max_seqlen_k ({max_seqlen_k})", max_seqlen_q)
    if not isinstance(is_delta_q, bool):
        fail(TypeError, "is_delta_q", "a bool", type(is_delta_q).__name__)
    page_size = _check_paged(kv_cache, page_offsets, page_ids, last_page_lens, q, batch)
    if page_size and fp8:
        raise NotImplementedError("kv_cache: the paged KV cache serves bf16/fp16 calls; FP8 inputs or a quant_mode "
                                  "with a cache are not built")
    if page_size:
        if k.shape[0] != q.shape[0]:
            fail(ValueError, "k.shape[0]", f"{q.shape[0]} (q's rows: with a paged KV cache, k and v share q's "
                 "layout and only each sequence's target rows are read)", k.shape[0])
        for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
            if t is not None:
                raise NotImplementedError(f"{name}: not with a paged KV cache (the page tables give the lengths); "
                                          "pass None")
    # A cache puts the queries at the end of their keys (delta_q alignment) whatever is_delta_q says.
    is_delta_q = is_delta_q or bool(page_size)
    if max_seqlen_q < max_seqlen_k and not is_delta_q:
        fail(ValueError, "max_seqlen_q", f"== max_seqlen_k ({max_seqlen_k}) unless is_delta_q=True", max_seqlen_q)

    _check_int_vector("num_contexts", num_contexts, batch, device)
    _check_int_vector("num_targets", num_targets, batch, device)
    _check_int_vector("seqused_q", seqused_q, batch, device)
    _check_int_vector("seqused_k", seqused_k, batch, device)
    _check_python_int("target_group_size", target_group_size, 1)

    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)):
        fail(TypeError, "window_size", "a (left, right) pair of ints", repr(window_size))
    kind, wl, wr = masks.normalize_window(tuple(window_size), max_seqlen_k)
    has_context, has_target = num_contexts is not None, num_targets is not None
    # A local window with contexts / targets is a causal band (WL, 0) (docs/operator.md, "Local
    # window with contexts and targets"): the HSTU rules already end every row at itself.
    causal_family = kind == masks.MaskKind.CAUSAL or (kind == masks.MaskKind.LOCAL and wr == 0)
    if (has_context or has_target) and not causal_family:
        name = "num_contexts" if has_context else "num_targets"
        fail(ValueError, "window_size", f"the causal window (-1, 0) or a causal band (WL >= 0, 0) when {name} is "
             "given", tuple(window_size))
    if page_size and kind != masks.MaskKind.CAUSAL and not (causal_family and (has_context or has_target)):
        raise NotImplementedError(f"window_size: a paged KV cache serves the causal family (window (-1, 0), with "
                                  f"contexts and targets, or a causal band (WL, 0) with them); got "
                                  f"{tuple(window_size)}")

    if isinstance(alpha, bool) or not (isinstance(alpha, (numbers.Real, torch.SymFloat, torch.SymInt))):
        fail(TypeError, "alpha", "a finite Python float", repr(alpha))
    # torch.compile makes alpha a symbolic float once it recompiles for a second value, and
    # math.isfinite can not be traced: traced calls check it when the op runs (launch._scalar_args).
    if not torch.compiler.is_compiling() and not math.isfinite(alpha):
        fail(ValueError, "alpha", "a finite Python float", repr(alpha))
    _check_python_int("scaling_seqlen", scaling_seqlen)
    if scaling_seqlen != -1 and scaling_seqlen < 1:
        fail(ValueError, "scaling_seqlen", "-1 (use max_seqlen_q) or an int >= 1", scaling_seqlen)
    scale_seqlen = scaling_seqlen if scaling_seqlen != -1 else max_seqlen_q

    if not isinstance(has_drab, bool):
        fail(TypeError, "has_drab", "a bool", type(has_drab).__name__)
    if fp8 and has_drab and not recipe(quant_mode).quantizes:
        raise NotImplementedError("has_drab: pre-quantized float8_e4m3fn inputs are forward-only (no backward); "
                                  "train with 16-bit inputs and quant_mode >= 0, or pass False")
    if page_size and has_drab:
        raise NotImplementedError("has_drab: the paged KV cache path is inference-only (no backward); pass False")
    rab_heads = 0
    if rab is None:
        if has_drab:
            fail(ValueError, "has_drab", "False when rab is None", True)
    else:
        if not isinstance(rab, torch.Tensor):
            fail(TypeError, "rab", "a torch.Tensor or None", type(rab).__name__)
        out_dtype = output_dtype(q.dtype)
        if rab.dtype != out_dtype:
            why = "the output's dtype: bf16 for float8_e4m3fn inputs" if out_dtype != q.dtype else "same as q"
            fail(TypeError, "rab.dtype", f"{out_dtype} ({why})", rab.dtype)
        if rab.dim() != 4:
            fail(ValueError, "rab", "a 4-D tensor (B, H_rab, max_seqlen_k, max_seqlen_k)", tuple(rab.shape))
        if rab.shape[0] != batch:
            fail(ValueError, "rab.shape[0]", f"{batch} (the batch size)", rab.shape[0])
        if rab.shape[1] not in (1, heads):
            fail(ValueError, "rab.shape[1] (H_rab)", f"1 or {heads}", rab.shape[1])
        if rab.shape[2] < max_seqlen_k or rab.shape[3] < max_seqlen_k:
            fail(ValueError, "rab.shape[2:]", f"at least ({max_seqlen_k}, {max_seqlen_k})", tuple(rab.shape[2:]))
        if rab.stride(-1) != 1 and rab.shape[-1] > 1:
            fail(ValueError, "rab.stride(-1)", "1 (last dim contiguous)", rab.stride(-1))
        if rab.device != device:
            fail(ValueError, "rab.device", f"{device} (same as q)", rab.device)
        rab_heads = rab.shape[1]

    if func is not None:
        _check_func(func, q, window_size, num_contexts, num_targets, page_size)
        kind = masks.MaskKind.FUNC
    if block_mask is not None:
        _check_block_mask(block_mask, batch, heads, max_seqlen_k, device, page_size, fp8, func)

    # Last, so that every other check can be exercised on CPU tensors. Meta tensors (shapes only:
    # the ops' fake implementations run, nothing is launched) serve tracing on machines without CUDA.
    if device.type != "cuda" and device.type != "meta":
        fail(ValueError, "q.device", "a CUDA device (or meta for shapes only; use hstu_cute.reference on CPU)",
              device)
    mask = masks.MaskSpec(kind, has_context, has_target, is_delta_q)
    return Problem(batch, heads, head_dim, q.dtype, mask, wl, wr, scale_seqlen, rab_heads, quant_mode, page_size)


def _check_block_mask(block_mask, batch, heads, max_seqlen_k, device, page_size, fp8, func) -> None:
    """A :class:`hstu_cute.BlockMask` (its own fields are checked when it is built): lists for
    this batch and 1 or H heads on q's device, covering ``max_seqlen_k`` rows and keys (query
    blocks count in key coordinates); 16-bit, without a paged cache or ``func``."""
    if not isinstance(block_mask, BlockMask):
        fail(TypeError, "block_mask", "a hstu_cute.BlockMask or None", type(block_mask).__name__)
    if block_mask.batch != batch:
        fail(ValueError, "block_mask.kv_count.shape[0]", f"{batch} (the batch)", block_mask.batch)
    if block_mask.heads not in (1, heads):
        fail(ValueError, "block_mask.kv_count.shape[1]", f"1 or {heads} (q's heads)", block_mask.heads)
    rows, keys = blocks_for(max_seqlen_k, block_mask.q_block), blocks_for(max_seqlen_k, block_mask.k_block)
    if block_mask.q_blocks < rows:
        fail(ValueError, "block_mask.kv_count.shape[2]", f">= {rows} (max_seqlen_k={max_seqlen_k} rows in blocks "
             f"of {block_mask.q_block}; query blocks count in key coordinates)", block_mask.q_blocks)
    if block_mask.k_blocks < keys:
        fail(ValueError, "block_mask.kv_index.shape[3]", f">= {keys} (max_seqlen_k={max_seqlen_k} keys in blocks "
             f"of {block_mask.k_block})", block_mask.k_blocks)
    if block_mask.device != device:
        fail(ValueError, "block_mask.device", f"{device} (same as q)", block_mask.device)
    if page_size or fp8 or func is not None:
        raise NotImplementedError("block_mask: the block-sparse kernels take 16-bit inputs without a paged cache "
                                  "or func")


def _check_func(func, q, window_size, num_contexts, num_targets, page_size) -> None:
    """An arbitrary ``func`` mask (docs/operator.md, "Arbitrary masks"): ``(1, n_func, T_q + 256)``
    int32 on q's device, ``n_func`` odd (1 or 3: the kernels' two intervals per row), last dim
    contiguous, with no other mask; 16-bit or FP8, without a paged cache."""
    if not isinstance(func, torch.Tensor):
        fail(TypeError, "func", "a torch.Tensor or None", type(func).__name__)
    if func.dtype != torch.int32:
        fail(TypeError, "func.dtype", "torch.int32", func.dtype)
    rows = q.shape[0] + masks.FUNC_ROW_PADDING
    if func.dim() != 3 or func.shape[0] != 1 or func.shape[1] % 2 != 1 or func.shape[2] < rows:
        fail(ValueError, "func", f"shape (1, n_func, >= {rows}) with n_func odd (q's rows + "
             f"{masks.FUNC_ROW_PADDING} of padding)", tuple(func.shape))
    if func.stride(-1) != 1 and func.shape[-1] > 1:
        fail(ValueError, "func.stride(-1)", "1 (last dim contiguous)", func.stride(-1))
    if func.device != q.device:
        fail(ValueError, "func.device", f"{q.device} (same as q)", func.device)
    if tuple(window_size) != (-1, -1) or num_contexts is not None or num_targets is not None:
        fail(ValueError, "func", "no other mask: window_size=(-1, -1), num_contexts=None, num_targets=None (func "
             "replaces them)", f"window_size={tuple(window_size)}, num_contexts "
             f"{'given' if num_contexts is not None else 'None'}, num_targets "
             f"{'given' if num_targets is not None else 'None'}")
    if func.shape[1] > 3:
        raise NotImplementedError(f"func.shape[1] (n_func): the kernels take 1 or 3 bounds per row (two "
                                  f"intervals), got {func.shape[1]}")
    if page_size:
        raise NotImplementedError("func: not with a paged KV cache")


def cached_lengths(page_offsets: torch.Tensor, last_page_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """(B,) int64 cached tokens per sequence, ``(pages - 1) * page_size + last_page_lens[b]`` (0
    without pages; the last page's length clamped into [1, page_size] as the kernels read it), on
    the tables' device with no sync."""
    # Without pages (pages - 1) * page_size + last <= 0: the final clamp makes it 0. Few ops: the
    # paged call runs this on every launch with rab (each op costs host time).
    pages = torch.diff(page_offsets).long()
    return (pages * page_size + last_page_lens.clamp(1, page_size) - page_size).clamp_(min=0)


def checked_cached_lengths(kv_cache, page_offsets, page_ids, last_page_lens) -> torch.Tensor:
    """(B,) int64 cached tokens per sequence, on the host, after checking the page tables: offsets
    from 0, non-decreasing, within page_ids; page ids within the cache; last page lengths in
    [1, page_size] where a sequence has pages (a GPU sync: HSTU_CUTE_CHECK=1 only)."""
    num_pages, page_size = kv_cache.shape[0], kv_cache.shape[2]
    offsets = page_offsets.to("cpu", torch.int64)
    if int(offsets[0]) != 0:
        fail(ValueError, "page_offsets[0]", 0, int(offsets[0]))
    pages = offsets[1:] - offsets[:-1]
    if bool((pages < 0).any()):
        fail(ValueError, "page_offsets", "non-decreasing offsets", offsets.tolist()[:16])
    if int(offsets[-1]) > page_ids.shape[0]:
        fail(ValueError, "page_offsets[-1]", f"<= {page_ids.shape[0]} (entries of page_ids)", int(offsets[-1]))
    ids = page_ids[: int(offsets[-1])].to("cpu", torch.int64)
    if ids.numel() and bool(((ids < 0) | (ids >= num_pages)).any()):
        bad = ids[(ids < 0) | (ids >= num_pages)]
        fail(ValueError, "page_ids", f"page ids in [0, {num_pages}) (kv_cache.shape[0])", bad.tolist()[:16])
    last = last_page_lens.to("cpu", torch.int64)
    bad = (pages > 0) & ((last < 1) | (last > page_size))
    if bool(bad.any()):
        fail(ValueError, "last_page_lens", f"1 <= last_page_lens <= {page_size} (page_size) for sequences with pages",
             last[bad].tolist()[:16])
    return cached_lengths(offsets, last, page_size)


def check_device_data(call, q, k):
    """Checks that need the device's data (and a GPU sync): only with HSTU_CUTE_CHECK=1. ``call``:
    the call record (:class:`hstu_cute.call.Call`). With a paged cache, ``seq_offsets_k`` counts
    each sequence's keys (cached + targets, FBGEMM's ``cu_seqlens_k``), which must agree with the
    page tables (:func:`_check_paged_data`)."""
    seq_offsets_q, seq_offsets_k, seqused_q, seqused_k = (call.seq_offsets_q, call.seq_offsets_k, call.seqused_q,
                                                          call.seqused_k)
    max_seqlen_q, max_seqlen_k, num_contexts, num_targets, paged = (call.max_seqlen_q, call.max_seqlen_k,
                                                                    call.num_contexts, call.num_targets, call.paged)
    if paged is not None:
        _check_paged_data(call, q)
        return
    lens_q = _offsets_on_host("seq_offsets_q", seq_offsets_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
    lens_k = _offsets_on_host("seq_offsets_k", seq_offsets_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
    for name, t, ref in (("seqused_q", seqused_q, lens_q), ("seqused_k", seqused_k, lens_k)):
        if t is not None and bool(((t.cpu() < 0) | (t.cpu() > ref)).any()):
            fail(ValueError, name, "0 <= seqused <= offset difference per sequence", t.cpu().tolist()[:16])
    if call.func is not None:
        _check_func_data(call.func, seq_offsets_q, lens_q, lens_k)
    if call.block_mask is not None:
        _check_block_lists(call.block_mask)
    if num_contexts is not None or num_targets is not None:
        valid_k = seqused_k.cpu() if seqused_k is not None else lens_k
        c = num_contexts.cpu() if num_contexts is not None else torch.zeros_like(valid_k)
        t = num_targets.cpu() if num_targets is not None else torch.zeros_like(valid_k)
        if bool(((c < 0) | (t < 0) | (c + t > valid_k)).any()):
            fail(ValueError, "num_contexts/num_targets", "0 <= c, 0 <= t, c + t <= length per sequence",
                  f"c={c.tolist()[:16]} t={t.tolist()[:16]}")


def _check_func_data(func, seq_offsets_q, lens_q, lens_k) -> None:
    """Every bound of a sequence's query rows within ``[0, L_k]`` (its keys): the kernels and the
    oracle clamp others, but FBGEMM's reference slices with them, where a negative bound counts from
    the end; such a mask means different things in the two libraries."""
    rows = torch.repeat_interleave(torch.arange(lens_q.numel()), lens_q)
    bounds = func[0, :, :rows.numel()].to("cpu", torch.int64) if rows.numel() else None
    if bounds is None:
        return
    bad = (bounds < 0) | (bounds > lens_k[rows])
    if bool(bad.any()):
        i, r = (int(x) for x in bad.nonzero()[0])
        b = int(rows[r])
        fail(ValueError, f"func[0, {i}, {r}]", f"a key position in [0, {int(lens_k[b])}] (sequence {b}'s keys; "
             "HSTU_CUTE_CHECK=1)", int(bounds[i, r]))


def _check_block_lists(block_mask) -> None:
    """Each list's count in ``[0, M_k]`` and its first ``count`` indices in ``[0, M_k)``, strictly
    ascending (no duplicates). The library never reads past a count, and it clamps what it reads."""
    count = block_mask.kv_count.to("cpu", torch.int64)
    index = block_mask.kv_index.to("cpu", torch.int64)
    k_blocks = block_mask.k_blocks
    if bool(((count < 0) | (count > k_blocks)).any()):
        where = tuple(int(x) for x in ((count < 0) | (count > k_blocks)).nonzero()[0])
        fail(ValueError, f"block_mask.kv_count[{', '.join(map(str, where))}]", f"in [0, {k_blocks}] (M_k)",
             int(count[where]))
    used = torch.arange(k_blocks) < count[..., None]
    out_of_range = used & ((index < 0) | (index >= k_blocks))
    if bool(out_of_range.any()):
        where = tuple(int(x) for x in out_of_range.nonzero()[0])
        fail(ValueError, f"block_mask.kv_index[{', '.join(map(str, where))}]", f"in [0, {k_blocks}) (M_k)",
             int(index[where]))
    not_ascending = used[..., 1:] & (index[..., 1:] <= index[..., :-1])
    if bool(not_ascending.any()):
        *row, i = (int(x) for x in not_ascending.nonzero()[0])
        fail(ValueError, f"block_mask.kv_index[{', '.join(map(str, row))}]", "strictly ascending indices in each "
             "list's first kv_count entries (no duplicates)", index[tuple(row)][:int(count[tuple(row)])].tolist())


def _offsets_on_host(name: str, offsets: torch.Tensor, total: int | None, max_len: int, max_name: str):
    """(B,) int64 lengths of checked offsets: from 0, non-decreasing, within ``total`` rows (None:
    unbounded), none longer than ``max_len``."""
    o = offsets.to("cpu", torch.int64)
    if int(o[0]) != 0:
        fail(ValueError, f"{name}[0]", 0, int(o[0]))
    lens = o[1:] - o[:-1]
    if bool((lens < 0).any()):
        fail(ValueError, name, "non-decreasing offsets", o.tolist()[:16])
    if total is not None and int(o[-1]) > total:
        fail(ValueError, f"{name}[-1]", f"<= {total} (tokens in the tensor)", int(o[-1]))
    if lens.numel() and int(lens.max()) > max_len:
        fail(ValueError, max_name, f">= the longest sequence ({int(lens.max())})", max_len)
    return lens


def _check_paged_data(call, q) -> None:
    """The paged call's data (docs/operator.md, "Paged KV cache"): the page tables
    (:func:`checked_cached_lengths`); n_b query rows per sequence, t_b <= n_b of them targets, the
    n_b - t_b new-history ones already in the cache (n_b - t_b <= C_b); ``seq_offsets_k`` counting
    C_b + t_b keys per sequence; contexts within the keys."""
    cached = checked_cached_lengths(*call.paged)
    new = _offsets_on_host("seq_offsets_q", call.seq_offsets_q, q.shape[0], call.max_seqlen_q, "max_seqlen_q")
    t = call.num_targets.cpu().long() if call.num_targets is not None else torch.zeros_like(new)
    if bool(((t < 0) | (t > new)).any()):
        fail(ValueError, "num_targets", "0 <= num_targets <= the sequence's query rows (targets are new rows)",
             t.tolist()[:16])
    if bool((new - t > cached).any()):
        fail(ValueError, "kv_cache / page tables", "each sequence's new history (its query rows that are not "
             "targets) already in the cache: query rows - targets <= cached tokens (append the history first)",
             f"history {(new - t).tolist()[:16]}, cached {cached.tolist()[:16]}")
    keys = _offsets_on_host("seq_offsets_k", call.seq_offsets_k, None, call.max_seqlen_k, "max_seqlen_k")
    if not torch.equal(keys, cached + t):
        fail(ValueError, "seq_offsets_k", "each sequence's keys: cached tokens + targets (FBGEMM's cu_seqlens_k)",
             f"lengths {keys.tolist()[:16]} for cached + targets {(cached + t).tolist()[:16]}")
    if call.num_contexts is not None:
        c = call.num_contexts.cpu().long()
        if bool(((c < 0) | (c + t > keys)).any()):
            fail(ValueError, "num_contexts/num_targets", "0 <= c, c + t <= keys per sequence",
                 f"c={c.tolist()[:16]} t={t.tolist()[:16]}")


_VALIDATED: dict = {}


def _signature(x):
    """What :func:`validate` reads of one argument: a tensor's type, dtype, shape, strides and
    device; a sequence's items; any other value with its type (``True`` and ``1`` differ). The
    device as ``get_device()`` (no device object per call): -1 for CPU and meta alike, which
    never share a memoized signature with CUDA tensors (validation requires one device)."""
    kind = type(x)
    if x is None:
        return None
    if kind is torch.Tensor or isinstance(x, torch.Tensor):
        return (kind, x.dtype, x.shape, x.stride(), x.get_device())
    if kind is BlockMask:
        return (kind, x.q_block, x.k_block, _signature(x.kv_count), _signature(x.kv_index))
    if kind is tuple or isinstance(x, (tuple, list)):
        return (kind, tuple(map(_signature, x)))
    return (kind, x)


def _signature_of(args: tuple) -> tuple:
    """:func:`_signature` of every argument, the common kinds inline (one function call per
    argument cost ~0.5 us each on the H200 host; 27 arguments per call). A plain tensor's entry
    leaves out its type, a subclass's keeps it: the two never compare equal."""
    signature = []
    for x in args:
        kind = type(x)
        if x is None:
            signature.append(None)
        elif kind is torch.Tensor:
            signature.append((x.dtype, x.shape, x.stride(), x.get_device()))
        elif kind is int or kind is float or kind is bool:
            signature.append((kind, x))
        else:
            signature.append(_signature(x))
    return tuple(signature)


def validate_memoized(*args) -> tuple[Problem, dict]:
    """:func:`validate`, run once per argument signature (eager calls: plain tensors with concrete
    shapes), with the signature's cache of prepared launches (:attr:`hstu_cute.call.Call.plans`).
    A repeated signature skips the ~15 us of checks (H100 host, the host_breakdown.py probe, last
    at 22440db); failures are never memoized, so a bad call raises every time."""
    try:
        signature = _signature_of(args)
        entry = _VALIDATED.get(signature)
    except TypeError:  # an unhashable argument: check it the long way (it will likely fail)
        return validate(*args), {}
    if entry is None:
        entry = (validate(*args), {})
        if len(_VALIDATED) >= 1024:
            _VALIDATED.clear()
        _VALIDATED[signature] = entry
    return entry


_PROBLEMS: dict = {}


def problem_of_op_args(q, seq_offsets_q, max_seqlen_q, max_seqlen_k, num_contexts, num_targets, window_left,
                       window_right, rab, is_delta_q, scaling_seqlen, quant_mode: int = -1, page_size: int = 0,
                       has_func: bool = False) -> tuple[Problem, dict]:
    """The :class:`Problem` of already validated op arguments (what :func:`validate` returned for
    the public call; the window comes normalized), with its cache of prepared launches.
    Memoized: the ops run it on every call."""
    memo = (seq_offsets_q.shape[0], q.shape[1], q.shape[2], q.dtype, max_seqlen_q, max_seqlen_k,
            num_contexts is not None, num_targets is not None, window_left, window_right, is_delta_q,
            scaling_seqlen, rab.shape[1] if rab is not None else 0, quant_mode, page_size, has_func)
    entry = _PROBLEMS.get(memo)
    if entry is None:
        if len(_PROBLEMS) > 256:
            _PROBLEMS.clear()
        kind, wl, wr = masks.normalize_window((window_left, window_right), max_seqlen_k)
        kind = masks.MaskKind.FUNC if has_func else kind
        mask = masks.MaskSpec(kind, num_contexts is not None, num_targets is not None, is_delta_q)
        problem = Problem(seq_offsets_q.shape[0] - 1, q.shape[1], q.shape[2], q.dtype, mask, wl, wr,
                          scaling_seqlen if scaling_seqlen != -1 else max_seqlen_q,
                          rab.shape[1] if rab is not None else 0, quant_mode, page_size)
        entry = _PROBLEMS[memo] = (problem, {})
    return entry


def device_checks_enabled() -> bool:
    """``HSTU_CUTE_CHECK=1``: also check offsets, lengths, contexts and targets on the device data."""
    return os.environ.get("HSTU_CUTE_CHECK", "0") == "1"
