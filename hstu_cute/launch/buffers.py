"""Device buffers and streams the launchers keep between calls: 16-byte alignment of the
operands, rab rows padded for TMA, cached int32 constants (fillers for absent seqused / contexts /
targets, unit descales) outside torch's allocator, the tile counters and split-key arrival counts
(one per device and stream, zero at launch and after), the gradient buffers and the device switch.
"""

from __future__ import annotations

import contextlib
import math

import torch


INT32_MAX = 2**31 - 1


_VEC = {torch.bfloat16: 8, torch.float16: 8, torch.float32: 4, torch.float8_e4m3fn: 16, torch.float8_e5m2: 16}
_CONTIGUOUS = torch.contiguous_format


def aligned_16(t: torch.Tensor) -> torch.Tensor:
    """The kernels load 16-byte vectors along D: token/head strides must be multiples of 16
    bytes and the base pointer 16-byte aligned. Rare layouts that are not get one copy.
    (``t.stride()`` once: ``t.stride(i)`` parses its argument, ~0.4 us a call on the host.)"""
    strides = t.stride()
    vec = _VEC.get(t.dtype) or 16 // t.element_size()
    if strides[0] % vec or strides[1] % vec or t.data_ptr() % 16:
        t = t.contiguous()
        if t.data_ptr() % 16:
            t = t.clone()
    return t


def empty_as(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous tensor of ``t``'s shape and device (and dtype, unless given).
    ``empty_like`` skips the shape and device parsing of ``torch.empty(shape, dtype=, device=)``:
    2-3 us against 6 a call on the CPU stand-in (docs/dev/perf-log.md, session 34)."""
    return torch.empty_like(t, dtype=dtype, memory_format=_CONTIGUOUS)


def zeros_as(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`empty_as`, zero-filled."""
    return torch.zeros_like(t, dtype=dtype, memory_format=_CONTIGUOUS)


def rab_vec(rab: torch.Tensor) -> int:
    """Elements per rab load: 8 (16-byte cp.async) when every row starts 16-byte aligned, else 1
    (scalar loads; e.g. max_seqlen_k not a multiple of 8 -- pad rab's last dim to avoid it)."""
    aligned = rab.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in rab.stride()[:3])
    return 8 if aligned else 1


def pad_rab_rows(rab: torch.Tensor) -> torch.Tensor:
    """rab with 16-byte aligned rows (what TMA and 16-byte loads need): ``rab`` itself when it
    already has them, else a copy into a slab whose last dim is padded to a multiple of 8."""
    if rab_vec(rab) == 8:
        return rab
    cols = rab.shape[3]
    padded = torch.zeros(rab.shape[:3] + ((cols + 7) // 8 * 8,), dtype=rab.dtype, device=rab.device)
    padded[..., :cols].copy_(rab)
    return padded


_FILLERS: dict = {}


def _filler(batch: int, device: torch.device, value: int) -> torch.Tensor:
    """Cached (batch,) int32 constant: stands in for absent seqused (no limit) or absent
    contexts/targets (zero), so these need no kernel variants of their own."""
    key = (batch, device, value)
    t = _FILLERS.get(key)
    if t is None:
        if len(_FILLERS) > 64:
            _FILLERS.clear()
        t = constant_prefix(_FILLER_BASES, (device, value), batch, device,
                            lambda n: torch.full((n,), value, dtype=torch.int32, device=device))
        if not torch.cuda.is_current_stream_capturing():
            _FILLERS[key] = t
    return t


_FILLER_BASES: dict = {}


def constant_prefix(buffers: dict, key, length: int, device, values) -> torch.Tensor:
    """The first ``length`` entries of a cached int32 constant ``values(n)`` (n entries made on
    ``device``, copied device to device: no host sync): a view of one buffer per ``key`` in
    ``buffers``, grown by doubling, outside torch's allocator (:func:`_outside_torch_pool`; the
    buffers are never freed). Inside a CUDA-graph capture, or off CUDA, a fresh tensor (a buffer
    filled there would hold its values only when the graph replays)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return values(length)
    buffer = buffers.get(key)
    if buffer is None or buffer.shape[0] < length:
        size = max(length, 2 * buffer.shape[0] if buffer is not None else 64)
        buffer = buffers[key] = _outside_torch_pool((size,), torch.int32, device).copy_(values(size))
    return buffer[:length]


def _outside_torch_pool(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized tensor in memory of its own (cudaMalloc, never freed), for cached device
    state that outlives the call (tile counters, split-key arrival counts, constants):
    torch.compile's cudagraph trees (mode="reduce-overhead") route the thread's allocations to
    their pool while they warm up and reject a live tensor there that is not an output. A capture
    itself gets fresh tensors instead (callers check)."""
    assert dtype.itemsize == 4, dtype
    if device.type != "cuda":
        return torch.empty(shape, dtype=dtype, device=device)
    from cuda.bindings import runtime as cudart

    words = max(1, math.prod(shape))
    with torch.cuda.device(device):
        err, ptr = cudart.cudaMalloc(words * 4)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaMalloc of {words * 4} bytes of cached device state failed: {err}")
    return torch.as_tensor(_DeviceWords(int(ptr), words), device=device).view(dtype)[: math.prod(shape)].view(shape)


_TILE_COUNTERS: dict = {}


def tile_counter(device) -> torch.Tensor:
    """The (2,) int32 tile counter of a kernel that claims its tiles (common.tile_scheduler.TileClaims):
    zero at launch, and the kernel leaves it zero. One per (device, stream): launches on one
    stream run one after another, so they share it. A CUDA-graph capture gets a fresh zeroed one
    per launch instead (the memset is captured too; the allocator reuses its memory only for
    later work in stream order), so replays never share a counter with other streams."""
    if torch._C._cuda_isCurrentStreamCapturing():
        return torch.zeros(2, dtype=torch.int32, device=device)
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    counter = _TILE_COUNTERS.get(key)
    if counter is None:
        counter = _TILE_COUNTERS[key] = _new_tile_counter(device)
    return counter


_SPLIT_ARRIVALS: dict = {}


def split_arrivals(device, count: int) -> torch.Tensor:
    """At least ``count`` int32 arrival counts of the split-key forward, zero at launch (the
    kernel leaves them zero): like :func:`tile_counter`, one buffer per (device, stream), grown
    when a call needs more; a CUDA-graph capture gets a fresh zeroed one."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(count, dtype=torch.int32, device=device)
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    counts = _SPLIT_ARRIVALS.get(key)
    if counts is None or counts.shape[0] < count:
        # Grown by doubling (the old buffer is never freed); zeroed on this stream, ahead of the
        # kernel that first uses it.
        size = max(count, 2 * counts.shape[0] if counts is not None else 4096)
        counts = _SPLIT_ARRIVALS[key] = _outside_torch_pool((size,), torch.int32, device).zero_()
    return counts


def _new_tile_counter(device) -> torch.Tensor:
    """A zeroed counter in memory of its own (cudaMalloc, never freed), outside torch's caching
    allocator: torch.compile's cudagraph trees route the current thread's allocations to their
    pool while they warm up and reject a live tensor there that is not an output, and this one
    outlives the call. Zeroed on the current stream, ahead of the kernel that first uses it."""
    return _outside_torch_pool((2,), torch.int32, device).zero_()


class _DeviceWords:
    """``count`` int32 at ``ptr`` in device memory, seen by ``torch.as_tensor`` without a copy."""

    def __init__(self, ptr: int, count: int):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": "<i4", "data": (ptr, False), "version": 3,
                                         "strides": None}


_ONES: dict = {}


def unit_descale(device) -> torch.Tensor:
    """A cached (1,) fp32 one on ``device``: the descale of an FP8 operand given none."""
    t = _ONES.get(device)
    if t is None:
        if torch.cuda.is_current_stream_capturing():
            return torch.ones(1, dtype=torch.float32, device=device)
        t = _ONES[device] = _outside_torch_pool((1,), torch.float32, device).fill_(1.0)
    return t


def unit_descale_table(device, batch: int, heads: int) -> torch.Tensor:
    """Quant mode 0's descale table for the backward kernels: a zero-strided (B, 1, H) view of
    :func:`unit_descale`."""
    return unit_descale(device).view(1, 1, 1).expand(batch, 1, heads)


_NO_SWITCH = contextlib.nullcontext()


def _on_device(device):
    """The device's context, or nothing when it is already current (switching costs ~2 us; the
    raw query skips torch.cuda.current_device's lazy-init check, a call that runs every launch)."""
    return _NO_SWITCH if device.index == torch._C._cuda_getDevice() else torch.cuda.device(device)


def _gradient_buffers(q, k, v, seqused_q, seqused_k, kv_group: int = 1) -> tuple:
    """dq, dk, dv shaped like q, k, v: zeros where seqused leaves rows the kernels do not write.
    Three allocations: views of one buffer would alias each other, which the ops' outputs must not
    (compiled graphs assume fresh outputs)."""
    dq = (zeros_as if seqused_q is not None else empty_as)(q)
    if kv_group == 1:
        make_k = zeros_as if seqused_k is not None else empty_as
        return dq, make_k(k), make_k(v)
    # GQA / MQA: dK and dV per query head, summed over each group afterwards (group_sums).
    make = torch.zeros if seqused_k is not None else torch.empty
    shape = (k.shape[0], q.shape[1], k.shape[2])
    return dq, make(shape, dtype=k.dtype, device=k.device), make(shape, dtype=v.dtype, device=v.device)


def group_sums(dk: torch.Tensor, dv: torch.Tensor, kv_group: int) -> tuple:
    """dK and dV of the key heads from those of the query heads (GQA / MQA: query head h reads
    key head h // kv_group), summed in a fixed order."""
    if kv_group == 1:
        return dk, dv
    tokens, heads, dim = dk.shape
    return (dk.view(tokens, heads // kv_group, kv_group, dim).sum(2),
            dv.view(tokens, heads // kv_group, kv_group, dim).sum(2))


def _aligned_rab_and_drab(rab, has_drab: bool) -> tuple:
    """(rab as the kernels read it, the drab they write, the drab to return): rab rows not
    16-byte aligned (e.g. max_seqlen_k % 8 != 0) are read from a padded copy, and drab is then
    returned as a view of a padded gradient. drab is None without ``has_drab``."""
    if rab is None:
        return None, None, None
    cols = None
    if rab_vec(rab) != 8:
        cols = rab.shape[3]
        rab = pad_rab_rows(rab)
    drab = torch.zeros_like(rab) if has_drab else None
    return rab, drab, (drab[..., :cols] if drab is not None and cols is not None else drab)


def _drab_sums_atomically(has_drab: bool, rab_heads: int, heads: int, deterministic: bool) -> bool:
    """drab of one rab head over several heads is added with fp32 atomics unless ``deterministic``
    (the kernel keys that write it take this flag as ``rab_sum_heads``)."""
    return has_drab and rab_heads == 1 and heads > 1 and not deterministic


def _drab_over_heads(rab, drab, heads: int, deterministic: bool) -> tuple:
    """(where a kernel that writes drab per (query, key) tile of one head writes it, whether it
    adds with fp32 atomics): ``drab`` itself, or for one rab head over several heads an fp32
    (B, L_q, L_k) sum added to with atomics, or (``deterministic``) per-head drab (B, H, L_q, L_k)
    summed afterwards in head order (:func:`_sum_drab_heads`)."""
    if drab is None or rab.shape[1] != 1 or heads == 1:
        return drab, False
    B, _, Lq, Lk = rab.shape
    if _drab_sums_atomically(True, 1, heads, deterministic):
        return torch.zeros((B, Lq, Lk), dtype=torch.float32, device=rab.device), True
    return torch.zeros((B, heads, Lq, Lk), dtype=rab.dtype, device=rab.device), False


def _sum_drab_heads(drab, target) -> None:
    """drab from the buffer :func:`_drab_over_heads` gave (nothing to do when it was drab)."""
    if target is not drab:
        drab[:, 0].copy_(target if target.dim() == 3 else target.float().sum(1))
