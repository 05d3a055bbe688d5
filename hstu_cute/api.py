"""Public API: validation (spec section 1), dispatch by device capability, kernel launch."""

from __future__ import annotations

import functools
import math
import numbers
import os
from dataclasses import dataclass

import torch
import tvm_ffi  # noqa: F401  (the kernels' calling convention; importing it here keeps its ~50 ms
#                  one-time cost out of the first call, e.g. out of a disk-cache load)

from . import masks
from .ampere import make_fwd_key
from .hopper import make_hopper_fwd_key

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_FP8_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2") if hasattr(torch, n)
)
MAX_GRID_BATCH = 65535  # grid.z limit of a launch


# ---------------------------------------------------------------------------------------------
# Arch selection
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _arch_of_index(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}" + ("a" if major == 9 else "")


@functools.lru_cache(maxsize=None)
def _sms_of_index(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``: the persistent kernels launch one CTA per SM."""
    return _sms_of_index(device.index if device.index is not None else torch.cuda.current_device())


def device_arch(device: torch.device) -> str:
    """The cubin target for a device: 'sm_80', 'sm_86', 'sm_89', 'sm_90a', ..."""
    return _arch_of_index(device.index if device.index is not None else torch.cuda.current_device())


def kernel_path(device: torch.device) -> str:
    """Which forward kernel family serves this device: 'hopper' (TMA + WGMMA) on sm90, 'ampere'
    (mma.sync) on sm80-sm89. The backward runs the mma.sync kernels on every arch for now.

    ``HSTU_CUTE_ARCH`` forces a path: 'sm80' (the mma.sync kernels, on any sm80+ GPU) or 'sm90'
    (the Hopper kernels; only on a compute capability 9.x device).
    """
    forced = os.environ.get("HSTU_CUTE_ARCH", "").strip().lower().replace("_", "")
    return _kernel_path(forced, device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=64)
def _kernel_path(forced: str, index: int) -> str:
    if forced and forced not in _AMPERE_NAMES + _HOPPER_NAMES:
        raise ValueError(f"HSTU_CUTE_ARCH: expected one of sm80, sm90; got {forced!r}")
    if forced in _AMPERE_NAMES:
        return "ampere"
    major, minor = torch.cuda.get_device_capability(index)
    if forced in _HOPPER_NAMES:
        if major != 9:
            raise NotImplementedError(
                f"HSTU_CUTE_ARCH=sm90 selects the Hopper (TMA + WGMMA) kernels, which need compute capability "
                f"9.x; device cuda:{index} has {major}.{minor} (unset HSTU_CUTE_ARCH or set it to sm80)"
            )
        return "hopper"
    if major < 8:
        raise NotImplementedError(
            f"hstu_cute needs compute capability >= 8.0 (Ampere); device cuda:{index} has {major}.x"
        )
    return "hopper" if major == 9 else "ampere"


_AMPERE_NAMES = ("sm80", "sm86", "sm89", "ampere")
_HOPPER_NAMES = ("sm90", "sm90a", "hopper")


# ---------------------------------------------------------------------------------------------
# Validation (no GPU sync, nothing launched)
# ---------------------------------------------------------------------------------------------
def _fail(exc, name, expected, actual):
    raise exc(f"{name}: expected {expected}, got {actual}")


def _check_int_vector(name, t, batch, device):
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor or None", type(t).__name__)
    if t.dtype != torch.int32:
        _fail(TypeError, name, "dtype torch.int32", t.dtype)
    if t.dim() != 1 or t.shape[0] != batch:
        _fail(ValueError, name, f"shape ({batch},) (one entry per sequence)", tuple(t.shape))
    if t.device != device:
        _fail(ValueError, name, f"device {device} (same as q)", t.device)


def _check_python_int(name, x, minimum=None):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        _fail(TypeError, name, "a Python int", f"{type(x).__name__} {x!r}")
    if minimum is not None and x < minimum:
        _fail(ValueError, name, f"an int >= {minimum}", x)


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


def validate(
    q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
    target_group_size, window_size, alpha, rab, has_drab, is_delta_q, descale_q, descale_k, descale_v,
    descale_do, quant_mode, scaling_seqlen, seqused_q, seqused_k,
) -> Problem:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, name, "a torch.Tensor", type(t).__name__)
    _check_python_int("quant_mode", quant_mode)
    if not -1 <= quant_mode <= 5:
        _fail(ValueError, "quant_mode", "an int in -1..5", quant_mode)
    fp8_inputs = [n for n, t in (("q", q), ("k", k), ("v", v)) if t.dtype in _FP8_DTYPES]
    if fp8_inputs or quant_mode != -1 or any(d is not None for d in (descale_q, descale_k, descale_v, descale_do)):
        what = f"FP8 inputs ({', '.join(fp8_inputs)})" if fp8_inputs else (
            f"quant_mode={quant_mode}" if quant_mode != -1 else "descale_* arguments")
        raise NotImplementedError(
            f"{what}: the FP8 path needs the Hopper (sm90) FP8 kernels, which are not built yet; "
            "pass bf16/fp16 q, k, v with quant_mode=-1 and no descale tensors"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _DTYPE_NAMES:
            _fail(TypeError, name, "dtype torch.bfloat16 or torch.float16", t.dtype)
        if t.dim() != 3:
            _fail(ValueError, name, "a 3-D tensor (tokens, heads, head_dim)", f"{t.dim()}-D shape {tuple(t.shape)}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            _fail(ValueError, f"{name}.stride(-1)", "1 (last dim contiguous)", t.stride(-1))
    if k.dtype != q.dtype or v.dtype != q.dtype:
        _fail(TypeError, "k/v dtype", f"{q.dtype} (same as q)", f"k {k.dtype}, v {v.dtype}")
    heads, head_dim = q.shape[1], q.shape[2]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        _fail(ValueError, "q.shape[2] (head dim)", f"one of {SUPPORTED_HEAD_DIMS}", head_dim)
    if k.shape[1] != heads:
        _fail(ValueError, "k.shape[1] (heads)", f"{heads} (q's heads; no GQA)", k.shape[1])
    if k.shape[2] != head_dim:
        _fail(ValueError, "k.shape[2] (head dim)", f"{head_dim} (q's head dim)", k.shape[2])
    if v.shape[1] != heads or v.shape[2] != head_dim:
        _fail(ValueError, "v.shape[1:]", f"({heads}, {head_dim})", tuple(v.shape[1:]))
    if v.shape[0] != k.shape[0]:
        _fail(ValueError, "v.shape[0]", f"{k.shape[0]} (k's tokens)", v.shape[0])
    device = q.device
    for name, t in (("k", k), ("v", v)):
        if t.device != device:
            _fail(ValueError, f"{name}.device", f"{device} (same as q)", t.device)

    for name, t in (("seq_offsets_q", seq_offsets_q), ("seq_offsets_k", seq_offsets_k)):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, name, "a torch.Tensor", type(t).__name__)
        if t.dtype != torch.int32:
            _fail(TypeError, name, "dtype torch.int32", t.dtype)
        if t.dim() != 1 or t.shape[0] < 2:
            _fail(ValueError, name, "a 1-D tensor of length B+1 >= 2", tuple(t.shape))
        if t.device != device:
            _fail(ValueError, f"{name}.device", f"{device} (same as q)", t.device)
    if seq_offsets_k.shape[0] != seq_offsets_q.shape[0]:
        _fail(ValueError, "seq_offsets_k.shape[0]", f"{seq_offsets_q.shape[0]} (same B+1 as seq_offsets_q)",
              seq_offsets_k.shape[0])
    batch = seq_offsets_q.shape[0] - 1
    if batch > MAX_GRID_BATCH:
        raise NotImplementedError(
            f"seq_offsets_q: expected at most {MAX_GRID_BATCH} sequences per call (launch grid limit), got {batch}")

    _check_python_int("max_seqlen_q", max_seqlen_q, 0)
    _check_python_int("max_seqlen_k", max_seqlen_k, 0)
    if max_seqlen_q > max_seqlen_k:
        _fail(ValueError, "max_seqlen_q", f"<= max_seqlen_k ({max_seqlen_k})", max_seqlen_q)
    if not isinstance(is_delta_q, bool):
        _fail(TypeError, "is_delta_q", "a bool", type(is_delta_q).__name__)
    if max_seqlen_q < max_seqlen_k and not is_delta_q:
        _fail(ValueError, "max_seqlen_q", f"== max_seqlen_k ({max_seqlen_k}) unless is_delta_q=True", max_seqlen_q)

    _check_int_vector("num_contexts", num_contexts, batch, device)
    _check_int_vector("num_targets", num_targets, batch, device)
    _check_int_vector("seqused_q", seqused_q, batch, device)
    _check_int_vector("seqused_k", seqused_k, batch, device)
    _check_python_int("target_group_size", target_group_size, 1)

    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)):
        _fail(TypeError, "window_size", "a (left, right) pair of ints", repr(window_size))
    kind, wl, wr = masks.normalize_window(tuple(window_size), max_seqlen_k)
    has_context, has_target = num_contexts is not None, num_targets is not None
    if (has_context or has_target) and kind != masks.MaskKind.CAUSAL:
        name = "num_contexts" if has_context else "num_targets"
        _fail(ValueError, "window_size", f"the causal window (-1, 0) when {name} is given", tuple(window_size))
    if is_delta_q and (has_context or has_target):
        _fail(ValueError, "is_delta_q", "False when num_contexts/num_targets are given (FBGEMM V1 rule)", True)

    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        _fail(TypeError, "alpha", "a finite Python float", repr(alpha))
    if not math.isfinite(alpha):
        _fail(ValueError, "alpha", "a finite Python float", repr(alpha))
    _check_python_int("scaling_seqlen", scaling_seqlen)
    if scaling_seqlen != -1 and scaling_seqlen < 1:
        _fail(ValueError, "scaling_seqlen", "-1 (use max_seqlen_q) or an int >= 1", scaling_seqlen)
    scale_seqlen = scaling_seqlen if scaling_seqlen != -1 else max_seqlen_q

    if not isinstance(has_drab, bool):
        _fail(TypeError, "has_drab", "a bool", type(has_drab).__name__)
    rab_heads = 0
    if rab is None:
        if has_drab:
            _fail(ValueError, "has_drab", "False when rab is None", True)
    else:
        if not isinstance(rab, torch.Tensor):
            _fail(TypeError, "rab", "a torch.Tensor or None", type(rab).__name__)
        if rab.dtype != q.dtype:
            _fail(TypeError, "rab.dtype", f"{q.dtype} (same as q)", rab.dtype)
        if rab.dim() != 4:
            _fail(ValueError, "rab", "a 4-D tensor (B, H_rab, max_seqlen_k, max_seqlen_k)", tuple(rab.shape))
        if rab.shape[0] != batch:
            _fail(ValueError, "rab.shape[0]", f"{batch} (the batch size)", rab.shape[0])
        if rab.shape[1] not in (1, heads):
            _fail(ValueError, "rab.shape[1] (H_rab)", f"1 or {heads}", rab.shape[1])
        if rab.shape[2] < max_seqlen_k or rab.shape[3] < max_seqlen_k:
            _fail(ValueError, "rab.shape[2:]", f"at least ({max_seqlen_k}, {max_seqlen_k})", tuple(rab.shape[2:]))
        if rab.stride(-1) != 1 and rab.shape[-1] > 1:
            _fail(ValueError, "rab.stride(-1)", "1 (last dim contiguous)", rab.stride(-1))
        if rab.device != device:
            _fail(ValueError, "rab.device", f"{device} (same as q)", rab.device)
        rab_heads = rab.shape[1]

    # Last, so that every other check can be exercised on CPU tensors. Meta tensors (shapes only:
    # the ops' fake implementations run, nothing is launched) serve tracing on machines without CUDA.
    if device.type != "cuda" and device.type != "meta":
        _fail(ValueError, "q.device", "a CUDA device (or meta for shapes only; use hstu_cute.reference on CPU)",
              device)
    mask = masks.MaskSpec(kind, has_context, has_target, is_delta_q)
    return Problem(batch, heads, head_dim, q.dtype, mask, wl, wr, scale_seqlen, rab_heads)


def debug_check_device_data(p: Problem, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, q, k,
                            num_contexts, num_targets, seqused_q, seqused_k):
    """Checks that need the device's data (and a GPU sync): only with HSTU_CUTE_CHECK=1."""
    for name, off, total, max_len in (("seq_offsets_q", seq_offsets_q, q.shape[0], max_seqlen_q),
                                      ("seq_offsets_k", seq_offsets_k, k.shape[0], max_seqlen_k)):
        o = off.to("cpu", torch.int64)
        if int(o[0]) != 0:
            _fail(ValueError, f"{name}[0]", 0, int(o[0]))
        lens = o[1:] - o[:-1]
        if bool((lens < 0).any()):
            _fail(ValueError, name, "non-decreasing offsets", o.tolist()[:16])
        if int(o[-1]) > total:
            _fail(ValueError, f"{name}[-1]", f"<= {total} (tokens in the tensor)", int(o[-1]))
        if lens.numel() and int(lens.max()) > max_len:
            _fail(ValueError, name.replace("seq_offsets", "max_seqlen"),
                  f">= the longest sequence ({int(lens.max())})", max_len)
    lens_k = (seq_offsets_k[1:] - seq_offsets_k[:-1]).cpu()
    for name, t, ref in (("seqused_q", seqused_q, (seq_offsets_q[1:] - seq_offsets_q[:-1]).cpu()),
                         ("seqused_k", seqused_k, lens_k)):
        if t is not None and bool(((t.cpu() < 0) | (t.cpu() > ref)).any()):
            _fail(ValueError, name, "0 <= seqused <= offset difference per sequence", t.cpu().tolist()[:16])
    if num_contexts is not None or num_targets is not None:
        valid_k = seqused_k.cpu() if seqused_k is not None else lens_k
        c = num_contexts.cpu() if num_contexts is not None else torch.zeros_like(valid_k)
        t = num_targets.cpu() if num_targets is not None else torch.zeros_like(valid_k)
        if bool(((c < 0) | (t < 0) | (c + t > valid_k)).any()):
            _fail(ValueError, "num_contexts/num_targets", "0 <= c, 0 <= t, c + t <= length per sequence",
                  f"c={c.tolist()[:16]} t={t.tolist()[:16]}")


# ---------------------------------------------------------------------------------------------
# Forward launch
# ---------------------------------------------------------------------------------------------
def _aligned_16(t: torch.Tensor) -> torch.Tensor:
    """The kernels load 16-byte vectors along D: token/head strides must be multiples of 8
    elements and the base pointer 16-byte aligned. Rare layouts that are not get one copy."""
    if t.stride(0) % 8 or t.stride(1) % 8 or t.data_ptr() % 16:
        t = t.contiguous()
        if t.data_ptr() % 16:
            t = t.clone()
    return t


def _rab_vec(rab: torch.Tensor) -> int:
    """Elements per rab load: 8 (16-byte cp.async) when every row starts 16-byte aligned, else 1
    (scalar loads; e.g. max_seqlen_k not a multiple of 8 -- pad rab's last dim to avoid it)."""
    aligned = rab.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in (rab.stride(0), rab.stride(1), rab.stride(2)))
    return 8 if aligned else 1


_FILLERS: dict = {}


def _filler(batch: int, device: torch.device, value: int) -> torch.Tensor:
    """Cached (batch,) int32 constant: stands in for absent seqused (no limit) or absent
    contexts/targets (zero), so these need no kernel variants of their own."""
    key = (batch, device, value)
    t = _FILLERS.get(key)
    if t is None:
        if len(_FILLERS) > 64:
            _FILLERS.clear()
        t = _FILLERS[key] = torch.full((batch,), value, dtype=torch.int32, device=device)
    return t


INT32_MAX = 2**31 - 1


_KEYS: dict = {}


def fwd_key(p: Problem, arch: str, rab, tiles: dict | None = None, path: str = "ampere"):
    """The compile key of this call (memoized: building the dataclass costs more than the lookup)."""
    rab_vec = _rab_vec(rab) if rab is not None else 0
    memo = (path, arch, p.dtype, p.head_dim, p.mask.kind, p.mask.has_context or p.mask.has_target, rab_vec,
            tuple(sorted(tiles.items())) if tiles else None)
    key = _KEYS.get(memo)
    if key is None:
        if path == "hopper":
            key = make_hopper_fwd_key(arch, _DTYPE_NAMES[p.dtype], p.head_dim, p.mask.kind, memo[5],
                                      rab is not None, tiles)
        else:
            key = make_fwd_key(arch, _DTYPE_NAMES[p.dtype], p.head_dim, p.mask.kind, memo[5], rab is not None,
                               rab_vec or 8, tiles)
        key = _KEYS[memo] = key
    return key


def pad_rab_rows(rab: torch.Tensor) -> torch.Tensor:
    """rab with 16-byte aligned rows (what TMA and 16-byte loads need): ``rab`` itself when it
    already has them, else a copy into a slab whose last dim is padded to a multiple of 8."""
    if _rab_vec(rab) == 8:
        return rab
    cols = rab.shape[3]
    padded = torch.zeros(rab.shape[:3] + ((cols + 7) // 8 * 8,), dtype=rab.dtype, device=rab.device)
    padded[..., :cols].copy_(rab)
    return padded


def forward(q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
            target_group_size, alpha, rab, seqused_q, seqused_k, p: Problem, tiles: dict | None = None,
            out: torch.Tensor | None = None, path: str | None = None) -> torch.Tensor:
    """Launch the forward kernel of ``path`` ('hopper' or 'ampere'; default: :func:`kernel_path`)."""
    from .cache import default_cache
    from .compile import build

    if path is None:
        path = kernel_path(q.device)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if seqused_q is not None:
        out.zero_()  # padding rows (past seqused_q) are never written by the kernel
    if q.shape[0] == 0 or max_seqlen_q == 0 or p.batch == 0:
        return out.zero_()
    q, k, v = _aligned_16(q), _aligned_16(k), _aligned_16(v)
    if k.shape[0] == 0:
        return out.zero_()
    if rab is not None and path == "hopper":
        rab = pad_rab_rows(rab)  # TMA needs 16-byte aligned rows
    key = fwd_key(p, device_arch(q.device), rab, tiles, path)
    compiled = default_cache().get(key, lambda: build(key))
    num_m_blocks = -(-max_seqlen_q // key.tile_m)
    device, batch = q.device, p.batch
    if seqused_q is None:
        seqused_q = _filler(batch, device, INT32_MAX)
    if seqused_k is None:
        seqused_k = _filler(batch, device, INT32_MAX)
    if key.has_context:
        num_contexts = num_contexts if num_contexts is not None else _filler(batch, device, 0)
        num_targets = num_targets if num_targets is not None else _filler(batch, device, 0)
    args = (q, k, v, out, seq_offsets_q, seq_offsets_k, seqused_q, seqused_k, num_contexts, num_targets, rab,
            float(alpha), 1.0 / p.scale_seqlen, p.window_left, p.window_right, int(target_group_size),
            int(p.mask.is_delta_q), num_m_blocks)
    if path == "hopper":
        # Longest-first tile order pays for long causal rows; for short sequences (a few m-blocks
        # each) keeping a sequence's m-blocks together wins through L2 (B1024 N256: 144 vs 115 TF).
        lpt = p.mask.kind == masks.MaskKind.CAUSAL and max_seqlen_q > 4 * key.tile_m
        args += (_num_sms(device), int(lpt))
    # The launch goes to the current device's current stream (TVM-FFI env stream); switching
    # devices costs ~10 us, so only do it when q lives elsewhere.
    if device.index == torch.cuda.current_device():
        compiled(*args)
    else:
        with torch.cuda.device(device):
            compiled(*args)
    return out


# ---------------------------------------------------------------------------------------------
# Backward launch (the kernels are being written: hstu_cute/ampere/bwd.py)
# ---------------------------------------------------------------------------------------------
def backward(dout, q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
             target_group_size, alpha, rab, has_drab, seqused_q, seqused_k, p: Problem, deterministic: bool):
    """Launch the backward kernels: returns ``(dq, dk, dv, drab)``, fresh tensors shaped like
    q, k, v (and like rab when ``has_drab``, else ``drab`` is None), in the input dtype. The sm80
    kernels and the sm90 dK/dV + dQ pair sum in a fixed order (bitwise identical runs); the sm90
    fused D128 kernel reduces dQ with TMA reduce-adds (order varies: ``deterministic=True``
    takes the pair instead, :func:`hstu_cute.bwd_launch.run_backward`).
    """
    from .bwd_launch import run_backward

    return run_backward(dout, q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts,
                        num_targets, target_group_size, alpha, rab, has_drab, seqused_q, seqused_k, p, deterministic)


# ---------------------------------------------------------------------------------------------
# torch.library registration: hstu_cute::fwd and hstu_cute::bwd
#
# torch.compile and torch.export trace these ops (their fake implementations give the output
# shapes without compiling or launching anything). Eager calls skip the dispatcher and call the
# same Python bodies directly (see _eager), as quack does: going through torch.ops costs ~50-70 us
# per call on the 2-core CPU machine vs ~5 us for the direct call (scripts/measure_dispatch.py,
# docs/perf-log.md "custom op dispatch").
# ---------------------------------------------------------------------------------------------
_OP_ARGS = (
    "Tensor seq_offsets_q, Tensor seq_offsets_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
    "Tensor? num_contexts, Tensor? num_targets, SymInt target_group_size, SymInt window_left, "
    "SymInt window_right, float alpha, Tensor? rab, bool is_delta_q, SymInt scaling_seqlen, "
    "Tensor? seqused_q, Tensor? seqused_k"
)
_FWD_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {_OP_ARGS}) -> Tensor"
_BWD_SCHEMA = (f"(Tensor dout, Tensor q, Tensor k, Tensor v, {_OP_ARGS}, bool has_drab, bool deterministic)"
               " -> (Tensor, Tensor, Tensor, Tensor)")

_PROBLEMS: dict = {}


def _problem(q, seq_offsets_q, max_seqlen_q, max_seqlen_k, num_contexts, num_targets, window_left, window_right,
             rab, is_delta_q, scaling_seqlen) -> Problem:
    """The :class:`Problem` of already validated op arguments (what validate() returned for the
    public call; the window comes normalized). Memoized: the ops run it on every call."""
    memo = (seq_offsets_q.shape[0], q.shape[1], q.shape[2], q.dtype, max_seqlen_q, max_seqlen_k,
            num_contexts is not None, num_targets is not None, window_left, window_right, is_delta_q,
            scaling_seqlen, rab.shape[1] if rab is not None else 0)
    p = _PROBLEMS.get(memo)
    if p is None:
        if len(_PROBLEMS) > 256:
            _PROBLEMS.clear()
        kind, wl, wr = masks.normalize_window((window_left, window_right), max_seqlen_k)
        mask = masks.MaskSpec(kind, memo[6], memo[7], is_delta_q)
        p = _PROBLEMS[memo] = Problem(memo[0] - 1, memo[1], memo[2], q.dtype, mask, wl, wr,
                                      scaling_seqlen if scaling_seqlen != -1 else max_seqlen_q, memo[12])
    return p


def _check_data(p, q, k, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
                seqused_q, seqused_k):
    if os.environ.get("HSTU_CUTE_CHECK", "0") == "1":
        debug_check_device_data(p, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, q, k,
                                num_contexts, num_targets, seqused_q, seqused_k)


def _fwd_impl(q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
              target_group_size, window_left, window_right, alpha, rab, is_delta_q, scaling_seqlen, seqused_q,
              seqused_k):
    p = _problem(q, seq_offsets_q, max_seqlen_q, max_seqlen_k, num_contexts, num_targets, window_left,
                 window_right, rab, is_delta_q, scaling_seqlen)
    # Compiled graphs reach the device-data checks here (eager calls run them before the op).
    _check_data(p, q, k, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
                seqused_q, seqused_k)
    return forward(q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
                   target_group_size, alpha, rab, seqused_q, seqused_k, p)


def _fwd_fake(q, k, v, *rest):
    # forward() allocates a contiguous out of q's shape, whatever q's strides.
    return q.new_empty(q.shape)


def _empty_drab(q):
    return q.new_empty((0,))


def _bwd_impl(dout, q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
              target_group_size, window_left, window_right, alpha, rab, is_delta_q, scaling_seqlen, seqused_q,
              seqused_k, has_drab, deterministic):
    p = _problem(q, seq_offsets_q, max_seqlen_q, max_seqlen_k, num_contexts, num_targets, window_left,
                 window_right, rab, is_delta_q, scaling_seqlen)
    grads = backward(dout, q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts,
                     num_targets, target_group_size, alpha, rab, has_drab, seqused_q, seqused_k, p, deterministic)
    # The fake implementation promises contiguous gradients (compiled graphs rely on its strides);
    # a launcher may hand back a strided view (e.g. drab of a padded slab): copy it then.
    dq, dk, dv, drab = (g if g is None or g.is_contiguous() else g.contiguous() for g in grads)
    return dq, dk, dv, (drab if drab is not None else _empty_drab(q))


def _bwd_fake(dout, q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
              target_group_size, window_left, window_right, alpha, rab, is_delta_q, scaling_seqlen, seqused_q,
              seqused_k, has_drab, deterministic):
    # Contiguous gradients in the input dtype; drab shaped like rab (0 elements without has_drab).
    drab = rab.new_empty(rab.shape) if has_drab and rab is not None else _empty_drab(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), drab


fwd_op = torch.library.custom_op("hstu_cute::fwd", _fwd_impl, mutates_args=(), schema=_FWD_SCHEMA)
fwd_op.register_fake(_fwd_fake)
bwd_op = torch.library.custom_op("hstu_cute::bwd", _bwd_impl, mutates_args=(), schema=_BWD_SCHEMA)
bwd_op.register_fake(_bwd_fake)


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


class _HstuAttnFunction(torch.autograd.Function):
    """Autograd over hstu_cute::fwd / hstu_cute::bwd.

    ``scalars`` are the op's non-tensor arguments; ``p`` (the validated Problem) is given on the
    eager fast path and None when the call goes through the dispatcher (tracing); ``alias`` is
    _dedupe's map (tracing only). The tensors are q, k, v, rab, seq_offsets_q, seq_offsets_k,
    num_contexts, num_targets, seqused_q, seqused_k.
    """

    @staticmethod
    def forward(ctx, scalars, p, alias, *tensors):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors)
        ctx.scalars, ctx.problem, ctx.alias = scalars, p, alias
        if alias is not None:
            tensors = tuple(t if a < 0 else tensors[a] for t, a in zip(tensors, alias))
        q, k, v, rab, seq_offsets_q, seq_offsets_k, num_contexts, num_targets, seqused_q, seqused_k = tensors
        (max_seqlen_q, max_seqlen_k, target_group_size, window_left, window_right, alpha, is_delta_q, scaling_seqlen,
         _, _) = scalars
        if p is not None:
            return forward(q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts,
                           num_targets, target_group_size, alpha, rab, seqused_q, seqused_k, p)
        return torch.ops.hstu_cute.fwd(q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k,
                                       num_contexts, num_targets, target_group_size, window_left, window_right,
                                       alpha, rab, is_delta_q, scaling_seqlen, seqused_q, seqused_k)

    @staticmethod
    def backward(ctx, dout):
        if dout is None:
            return (None,) * 13
        tensors, alias = ctx.saved_tensors, ctx.alias
        if alias is not None:
            tensors = tuple(t if a < 0 else tensors[a] for t, a in zip(tensors, alias))
        q, k, v, rab, seq_offsets_q, seq_offsets_k, num_contexts, num_targets, seqused_q, seqused_k = tensors
        (max_seqlen_q, max_seqlen_k, target_group_size, window_left, window_right, alpha, is_delta_q, scaling_seqlen,
         has_drab, deterministic) = ctx.scalars
        if ctx.problem is not None and _eager(dout):
            dq, dk, dv, drab = backward(dout, q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k,
                                        num_contexts, num_targets, target_group_size, alpha, rab, has_drab,
                                        seqused_q, seqused_k, ctx.problem, deterministic)
        else:
            dq, dk, dv, drab = torch.ops.hstu_cute.bwd(
                dout, q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
                target_group_size, window_left, window_right, alpha, rab, is_delta_q, scaling_seqlen, seqused_q,
                seqused_k, has_drab, deterministic)
        grads = [dq, dk, dv, drab if has_drab else None]
        if alias is not None:  # a tensor given as several of q, k, v gets the sum of their gradients
            for i in (1, 2):
                if alias[i] >= 0:
                    grads[alias[i]] = grads[alias[i]] + grads[i]
                    grads[i] = None
        return (None, None, None, *grads) + (None,) * 6


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
):
    """HSTU attention over a jagged batch (spec: shared/spec/hstu-attention.md, FBGEMM-compatible).

    Returns ``out`` (T_q, H, D) in q's dtype. Every argument is checked before anything is
    compiled or launched; set ``HSTU_CUTE_CHECK=1`` to also check offsets and lengths on the device
    data (costs a GPU sync).

    Differentiable w.r.t. q, k, v (and rab when ``has_drab=True``). ``deterministic=True`` asks
    the backward for a bitwise reproducible accumulation of dq and drab. Under torch.compile and
    torch.export the call is traced as the custom ops ``hstu_cute::fwd`` / ``hstu_cute::bwd``.
    """
    if not isinstance(deterministic, bool):
        _fail(TypeError, "deterministic", "a bool", type(deterministic).__name__)
    p = validate(q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
                 target_group_size, window_size, alpha, rab, has_drab, is_delta_q, descale_q, descale_k,
                 descale_v, descale_do, quant_mode, scaling_seqlen, seqused_q, seqused_k)
    eager = _eager(q)
    if eager:
        _check_data(p, q, k, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
                    seqused_q, seqused_k)
    needs_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (has_drab and rab.requires_grad))
    if needs_grad:
        scalars = (max_seqlen_q, max_seqlen_k, target_group_size, p.window_left, p.window_right, alpha, is_delta_q,
                   scaling_seqlen, has_drab, deterministic)
        tensors = (q, k, v, rab, seq_offsets_q, seq_offsets_k, num_contexts, num_targets, seqused_q, seqused_k)
        if eager:
            return _HstuAttnFunction.apply(scalars, p, None, *tensors)
        tensors, alias = _dedupe(tensors)
        return _HstuAttnFunction.apply(scalars, None, alias, *tensors)
    if eager:
        return forward(q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts,
                       num_targets, target_group_size, alpha, rab, seqused_q, seqused_k, p)
    return torch.ops.hstu_cute.fwd(q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts,
                                   num_targets, target_group_size, p.window_left, p.window_right, alpha, rab,
                                   is_delta_q, scaling_seqlen, seqused_q, seqused_k)
