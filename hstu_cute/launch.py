"""Kernel selection and launch for validated calls: :func:`forward` and :func:`backward`.

Both prepare the tensors the kernels need (16-byte aligned strides, rab rows padded for TMA,
constant stand-ins for absent seqused / contexts / targets), pick the compile keys
(:mod:`hstu_cute.variants`), get the compiled modules from the cache and launch them on the
current torch stream (CUDA-graph capture works). The runtime arguments are filled by name and
ordered by the family's spec (:mod:`hstu_cute.kernel_args`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch

from .arch import device_arch, kernel_path, num_sms
from .cache import default_cache
from .compile import build
from .kernel_args import ordered
from .validation import DTYPE_NAMES, Problem, cached_lengths, fail
from .variants import (
    FUSED_MIN_SEQLEN_K,
    HEAD_DIMS,
    HOPPER_FUSED_HEAD_DIMS,
    HOPPER_WIDE_HEAD_DIMS,
    make_bwd_keys,
    make_fwd_key,
    FP8_BWD_HEAD_DIMS,
    FP8_DTYPE,
    FP8_FUSED_HEAD_DIMS,
    make_hopper_bwd_key,
    make_hopper_fp8_bwd_key,
    make_ampere_paged_fwd_key,
    make_hopper_fp8_fwd_key,
    make_hopper_fwd_key,
    make_hopper_paged_fwd_key,
    make_hopper_quant_slots_key,
    make_hopper_vt_key,
    quant_launches,
    SPLIT_KEY_MASKS,
    vt_width,
)
from .fp8_format import QUANT_MAX_SLOTS, SCALE_FLOOR
from .quantize import QuantMode, num_blocks

INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------------------------------
# Tensor preparation
# ---------------------------------------------------------------------------------------------
def aligned_16(t: torch.Tensor) -> torch.Tensor:
    """The kernels load 16-byte vectors along D: token/head strides must be multiples of 16
    bytes and the base pointer 16-byte aligned. Rare layouts that are not get one copy."""
    vec = 16 // t.element_size()
    if t.stride(0) % vec or t.stride(1) % vec or t.data_ptr() % 16:
        t = t.contiguous()
        if t.data_ptr() % 16:
            t = t.clone()
    return t


def rab_vec(rab: torch.Tensor) -> int:
    """Elements per rab load: 8 (16-byte cp.async) when every row starts 16-byte aligned, else 1
    (scalar loads; e.g. max_seqlen_k not a multiple of 8 -- pad rab's last dim to avoid it)."""
    aligned = rab.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in (rab.stride(0), rab.stride(1), rab.stride(2)))
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


def _sequence_args(p: Problem, device, seq_offsets_q, seq_offsets_k, seqused_q, seqused_k, num_contexts,
                   num_targets, context_target: bool) -> dict:
    """The per-sequence runtime arguments every kernel family takes, absent ones filled."""
    batch = p.batch
    if context_target:
        num_contexts = num_contexts if num_contexts is not None else _filler(batch, device, 0)
        num_targets = num_targets if num_targets is not None else _filler(batch, device, 0)
    return dict(
        mOffsetsQ=seq_offsets_q, mOffsetsK=seq_offsets_k,
        mSeqUsedQ=seqused_q if seqused_q is not None else _filler(batch, device, INT32_MAX),
        mSeqUsedK=seqused_k if seqused_k is not None else _filler(batch, device, INT32_MAX),
        mNumContexts=num_contexts, mNumTargets=num_targets,
    )


def _scalar_args(p: Problem, alpha, target_group_size) -> dict:
    alpha = float(alpha)
    if not math.isfinite(alpha):  # traced calls skip the check in validation (a symbolic alpha)
        fail(ValueError, "alpha", "a finite Python float", repr(alpha))
    return dict(alpha=alpha, inv_scale=1.0 / p.scale_seqlen, window_left=p.window_left,
                window_right=p.window_right, group_size=int(target_group_size), is_delta_q=int(p.mask.is_delta_q))


def _compiled(key):
    return default_cache().get(key, lambda: build(key))


_MADE_KEYS: dict = {}


def _made(factory, *args, **kwargs):
    """``factory(*args, **kwargs)`` for a key factory of :mod:`hstu_cute.variants`, memoized:
    building a key dataclass costs ~3 us of CPU, the lookup a fraction. Tile overrides (dicts,
    benchmark sweeps only) are built afresh."""
    memo = (factory, args, tuple(kwargs.items()))
    try:
        key = _MADE_KEYS.get(memo)
    except TypeError:  # a dict of tiles among the arguments
        return factory(*args, **kwargs)
    if key is None:
        key = _MADE_KEYS[memo] = factory(*args, **kwargs)
    return key


_TILE_COUNTERS: dict = {}


def tile_counter(device) -> torch.Tensor:
    """The (2,) int32 tile counter of a kernel that claims its tiles (common.tile_scheduler.TileClaims):
    zero at launch, and the kernel leaves it zero. One per (device, stream): launches on one
    stream run one after another, so they share it. A CUDA-graph capture gets a fresh zeroed one
    per launch instead (the memset is captured too; the allocator reuses its memory only for
    later work in stream order), so replays never share a counter with other streams."""
    if torch.cuda.is_current_stream_capturing():
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


def _launch(key, compiled, values: dict) -> None:
    compiled(*ordered(key, values))


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------
def fwd_key(p: Problem, arch: str, rab, tiles: dict | None = None, path: str = "ampere", split_keys: bool = False):
    """The forward compile key of this call (memoized by :func:`_made`); ``split_keys``: the
    variant whose tiles take parts of the key blocks (:func:`key_splits`; sm80: rab rows come
    padded to 16 bytes)."""
    context_target = p.mask.has_context or p.mask.has_target
    dtype = DTYPE_NAMES[p.dtype]
    if path == "hopper":
        factory = make_hopper_paged_fwd_key if p.page_size else make_hopper_fwd_key
        return _made(factory, arch, dtype, p.head_dim, p.mask.kind, context_target, rab is not None, tiles,
                     split_keys)
    if p.page_size:  # rab rows come padded to 16 bytes (forward)
        return _made(make_ampere_paged_fwd_key, arch, dtype, p.head_dim, p.mask.kind, context_target,
                     rab is not None, 8, tiles, split_keys)
    vec = rab_vec(rab) if rab is not None else 8
    return _made(make_fwd_key, arch, dtype, p.head_dim, p.mask.kind, context_target, rab is not None, vec, tiles,
                 split_keys)


#: Split keys: at least this many key blocks per part (each part pays a pipeline fill and an fp32
#: partial output), between these many parts. H100, device time (CUDA graph), 16-bit D128
#: (scripts/sweep_splits.py, docs/perf-log.md session 15): one user x (4096 + 256) 59.7 us with one
#: part, 37.1 / 36.6 / 37.8 with 4 / 8 / 12, but 16 parts ran 33-187 us across runs (erratic, not
#: understood); x (16384 + 256) 199.7 -> 56.6 with 8; 2 parts over 16 users lost (0.8x); more
#: CTAs than SMs lost badly (8 users x 8 parts 118 us against 52 with 4). At least 4 blocks per part
#: (session 16, scripts/gpu_split_training.py, causal training forwards, H100 graph time, 4 parts
#: against one): B1 N1024 H4 (8 key blocks) 25.5 vs 22.1 us lost, N2048 H2 28.7 vs 30.8 and N4096
#: H1 34.7 vs 48.3 won.
MIN_BLOCKS_PER_SPLIT = 4
MIN_SPLITS = 4
MAX_SPLITS = 8


def key_splits(p: Problem, tile_m: int, tile_n: int, max_seqlen_q: int, max_seqlen_k: int, sms: int) -> int:
    """Parts to split every tile's key blocks into (1: no split), from host values only (no
    sync): when at most a quarter of the SMs would get a query tile, as many parts as fill the
    SMs, keeping :data:`MIN_BLOCKS_PER_SPLIT` blocks of the longest keys in each. One user's serving
    call (256 new tokens, 4 heads) has 8 query tiles for 132 SMs."""
    if (p.mask.kind, p.mask.has_context or p.mask.has_target) not in SPLIT_KEY_MASKS:
        return 1
    tiles = p.batch * p.heads * -(-max_seqlen_q // tile_m)
    if MIN_SPLITS * tiles > sms:
        return 1
    blocks = -(-max_seqlen_k // tile_n)
    splits = min(sms // max(tiles, 1), blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS)
    return splits if splits >= MIN_SPLITS else 1


class Fp8Operands:
    """What the FP8 forward reads besides e4m3 q and k: V^T (H, D, W) e4m3
    (:func:`transposed_for_pv`), the (q, k, v) descales as (1,) fp32 device tensors (or, with
    ``scaled_p``, (B, blocks, H) tables: quant modes 2-5; with ``two_direction`` too, mode 1's
    (T, H), (T, H) and (B, blocks, H, 2, D) tables: :func:`quantize_for`),
    and the output's dtype. ``kept``: for a training call, what the backward reads of q, k and v,
    by its argument names (:func:`prepare_fp8`), else None."""

    __slots__ = ("vt", "descales", "out_dtype", "scaled_p", "two_direction", "kept")

    def __init__(self, vt: torch.Tensor, descales: tuple, out_dtype: torch.dtype, scaled_p: bool = False,
                 two_direction: bool = False, kept: dict | None = None):
        self.vt, self.descales, self.out_dtype = vt, descales, out_dtype
        self.scaled_p, self.two_direction, self.kept = scaled_p, two_direction, kept


def transposed_for_pv(v: torch.Tensor, seq_offsets: torch.Tensor) -> torch.Tensor:
    """V^T (H, D, W) of e4m3 V (T, H, D) in one launch (:class:`hstu_cute.hopper.vt.VTransposeSm90`;
    the pre-quantized entry: quant modes get V^T from their quantizer, :func:`quantize_for`): keys
    contiguous, each sequence starting 16 tokens aligned, W = :func:`hstu_cute.fp8_format.vt_width`
    (a shape that depends only on shapes: no sync, and it traces)."""
    tokens, heads, head_dim = v.shape
    vt = torch.empty((heads, head_dim, vt_width(tokens, seq_offsets.shape[0] - 1)), dtype=torch.float8_e4m3fn,
                     device=v.device)
    if tokens:
        key = _made(make_hopper_vt_key, device_arch(v.device), FP8_DTYPE, head_dim)
        with _on_device(v.device):
            _launch(key, _compiled(key), dict(mV=v, mVt=vt, mOffsets=seq_offsets))
    return vt


# The slot quantizer's argument names, per slot (hstu_cute.kernel_args: its spec's order).
_SLOT_ARGS = tuple(tuple(f"{name}{j}" for name in ("mX", "mOffsets", "mScale", "mO", "mVt", "num_blocks"))
                   for j in range(QUANT_MAX_SLOTS))


@functools.lru_cache(maxsize=None)
def _quant_plan(mode: int, purpose: str) -> tuple:
    """:func:`hstu_cute.variants.quant_launches`, each launch with its key's slot tuple."""
    return tuple((launch, tuple(slot[1:] for slot in launch)) for launch in quant_launches(mode, purpose))


def quantize_for(mode: int, purpose: str, xs: tuple, offsets: tuple, max_seqlens: tuple) -> list[dict]:
    """Quantize the 16-bit (T, H, D) tensors ``xs`` (q, k, v; or dO) with ``mode`` (0-5) for
    ``purpose`` (:func:`hstu_cute.variants.quant_launches`: one launch of the slot quantizer,
    :mod:`hstu_cute.hopper.quantize_slots`, mode 1 two) and return, per tensor, its copies by
    name: ``"plain"`` (T, H, D) e4m3 and/or ``"transposed"`` V^T (H, D, W)
    (:func:`transposed_for_pv`'s layout), each as ``(data, descale table)``. The table is (B,
    blocks, H) for mode 2, a zero-strided (B, 1, H) view of the group's scale for modes 3-5;
    mode 1's plain tables are (T, H) (per token), its transposed ones (B, blocks, H, 2, D): per
    block and dim the scale, then its reciprocal; mode 0's are zero-strided (B, 1, H) views of a
    cached one. Every shape depends only on shapes (no sync)."""
    x0 = xs[0]
    device = x0.device
    batch = offsets[0].shape[0] - 1
    heads, head_dim = x0.shape[1], x0.shape[2]
    blocks = [num_blocks(m) for m in max_seqlens]
    empty = [batch == 0 or x.shape[0] == 0 for x in xs]
    copies: list[dict] = [{} for _ in xs]
    tables: dict = {}  # (tensor, role family) -> (the kernel's table, the copies' table)
    if mode == QuantMode.CAST:
        ones = unit_descale_table(device, batch, heads)
        for i in range(len(xs)):
            tables[i, "unit"] = (None, ones)
    if mode >= QuantMode.PER_HEAD:
        # The blocks max each group's scale in here, every block of a group sees it (zero strides
        # along the (B, blocks, H) dims it spans); the word after the tables counts the grid
        # barrier's arrivals: one memset for all.
        size, strides = {QuantMode.PER_HEAD: (batch * heads, (heads, 0, 1)),
                         QuantMode.PER_SEQUENCE: (batch, (1, 0, 0))}.get(mode, (1, (0, 0, 0)))
        words = torch.zeros(len(xs) * size + 1, dtype=torch.float32, device=device)
        cooperative = dict(mBarrier=words[-1:].view(torch.int32), num_sms=num_sms(device))
        for i in range(len(xs)):
            if empty[i]:
                words[i * size:(i + 1) * size].fill_(SCALE_FLOOR)
            tables[i, "group"] = (words.as_strided((batch, blocks[i], heads), strides, i * size),
                                  words.as_strided((batch, 1, heads), strides, i * size))
    arch = device_arch(device)
    dtype = DTYPE_NAMES[x0.dtype]
    aligned = [aligned_16(x) for x in xs]
    for launch_slots, slot_specs in _quant_plan(mode, purpose):
        values: dict = dict(cooperative) if mode >= QuantMode.PER_HEAD else {}
        for names, (i, role, plain, transposed) in zip(_SLOT_ARGS, launch_slots):
            x = aligned[i]
            family = role if role in ("token", "column", "unit") else "group" if mode >= QuantMode.PER_HEAD else "block"
            table, copies_table = tables.get((i, family)) or tables.setdefault(
                (i, family), (_new_quant_table(family, x.shape[0], batch, blocks[i], heads, head_dim, empty[i],
                                               device),) * 2)
            out = vt = None
            if plain:
                out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device)
                copies[i]["plain"] = (out, copies_table)
            if transposed:
                vt = torch.empty((heads, head_dim, vt_width(x.shape[0], batch)), dtype=torch.float8_e4m3fn,
                                 device=device)
                copies[i]["transposed"] = (vt, copies_table)
            values.update(zip(names, (x, offsets[i], table, out, vt, 0 if empty[i] else blocks[i])))
        if not all(empty[i] for i, *_ in launch_slots):
            key = _made(make_hopper_quant_slots_key, arch, dtype, head_dim, slot_specs)
            with _on_device(device):
                _launch(key, _compiled(key), values)
    return copies


def _new_quant_table(family: str, tokens: int, batch: int, blocks: int, heads: int, head_dim: int, empty: bool,
                     device) -> torch.Tensor:
    """A slot quantizer's scale table: (T, H) per token, (B, blocks, H, 2, D) per block and dim
    (scale, then reciprocal), (B, blocks, H) per block; the floor scale where no block runs."""
    shape = {"token": (tokens, heads), "column": (batch, blocks, heads, 2, head_dim)}.get(family, (batch, blocks, heads))
    table = torch.empty(shape, dtype=torch.float32, device=device)
    if empty:
        table.fill_(SCALE_FLOOR)
        if family == "column":
            table[:, :, :, 1] = 1.0 / SCALE_FLOOR
    return table


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


def fp8_fwd_key(p: Problem, arch: str, rab, out_dtype: torch.dtype, tiles: dict | None = None,
                scaled_p: bool = False, two_direction: bool = False):
    context_target = p.mask.has_context or p.mask.has_target
    return _made(make_hopper_fp8_fwd_key, arch, DTYPE_NAMES[out_dtype], p.head_dim, p.mask.kind, context_target,
                 rab is not None, tiles, scaled_p, two_direction)


def forward(q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
            target_group_size, alpha, rab, seqused_q, seqused_k, p: Problem, tiles: dict | None = None,
            out: torch.Tensor | None = None, path: str | None = None, fp8: "Fp8Operands | None" = None,
            paged: tuple | None = None, splits: int | None = None) -> torch.Tensor:
    """Launch the forward kernel of ``path`` ('hopper' or 'ampere'; default: :func:`kernel_path`)
    and return ``out`` (T_q, H, D); ``tiles`` overrides the key's default tiles (benchmarks).
    With ``fp8`` q and k are e4m3 and the Hopper FP8 kernel runs (``v`` is unused: the kernel
    reads ``fp8.vt``); ``out`` is in ``fp8.out_dtype``. ``paged``: (kv_cache, page_offsets,
    page_ids, last_page_lens) of a call with ``p.page_size`` (validated). ``splits``: parts of the
    key blocks on the 16-bit paths (None: :func:`key_splits`; more than 1 takes the split-key
    variant, whose parts add up inside the kernel)."""
    if fp8 is not None:
        path = "hopper"
    elif path is None:
        path = kernel_path(q.device)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype if fp8 is None else fp8.out_dtype, device=q.device)
    if seqused_q is not None:
        out.zero_()  # padding rows (past seqused_q) are never written by the kernel
    if q.shape[0] == 0 or max_seqlen_q == 0 or p.batch == 0:
        return out.zero_()
    q, k = aligned_16(q), aligned_16(k)
    v = aligned_16(v) if fp8 is None else fp8.vt
    if k.shape[0] == 0:
        return out.zero_()
    if rab is not None and (path == "hopper" or p.page_size):
        rab = pad_rab_rows(rab)  # TMA (and the paged sm80 key) need 16-byte aligned rows
    device = q.device
    if fp8 is None:
        key = fwd_key(p, device_arch(device), rab, tiles, path)
        extra = {}
        if splits is None:
            splits = key_splits(p, key.tile_m, key.tile_n, max_seqlen_q, max_seqlen_k, num_sms(device))
        if splits > 1:
            if rab is not None:
                rab = pad_rab_rows(rab)  # the split variants read 16-byte aligned rab rows
            key = fwd_key(p, device_arch(device), rab, tiles, path, split_keys=True)
            parts = torch.empty((splits * q.shape[0],) + tuple(q.shape[1:]), dtype=torch.float32, device=device)
            arrivals = split_arrivals(device, p.batch * p.heads * -(-max_seqlen_q // key.tile_m) * 2)
            extra = dict(mPartials=parts, mArrivals=arrivals, num_splits=splits)
    else:
        key = fp8_fwd_key(p, device_arch(device), rab, fp8.out_dtype, tiles, fp8.scaled_p, fp8.two_direction)
        extra = dict(zip(("mDescaleQ", "mDescaleK", "mDescaleV"), fp8.descales))
    compiled = _compiled(key)
    num_m_blocks = -(-max_seqlen_q // key.tile_m) * extra.get("num_splits", 1)
    values = dict(mQ=q, mK=k, mV=v, mO=out, mRab=rab, num_m_blocks=num_m_blocks, **extra,
                  **_sequence_args(p, device, seq_offsets_q, seq_offsets_k, seqused_q, seqused_k, num_contexts,
                                   num_targets, key.has_context),
                  **_scalar_args(p, alpha, target_group_size))
    shared_tokens = k.shape[0]
    if p.page_size:
        values.update(_paged_args(p, paged))
        if rab is not None:
            values["mRabNew"] = rab_among_new(rab, paged[1], paged[3], p.page_size, max_seqlen_q)
        shared_tokens = p.batch * max_seqlen_k
    if path == "hopper":
        values.update(num_sms=num_sms(device), **_walk_args(key, p, shared_tokens, max_seqlen_k, device))
    # The launch goes to the current device's current stream (TVM-FFI env stream); switching
    # devices costs ~10 us, so only do it when q lives elsewhere.
    with _on_device(device):
        _launch(key, compiled, values)
    return out


def _paged_args(p: Problem, paged: tuple) -> dict:
    """The paged cache's runtime arguments: the cache seen as (pages * 2 * page_size, H, D) rows
    (validation checked that its strides allow that view; no copy)."""
    kv_cache, page_offsets, page_ids, last_page_lens = paged
    rows = kv_cache.shape[0] * 2 * p.page_size
    cache_rows = kv_cache.as_strided((rows, kv_cache.shape[3], kv_cache.shape[4]), (kv_cache.stride(2),
                                     kv_cache.stride(3), 1))
    return dict(mCache=cache_rows, mPageOffsets=page_offsets, mPageIds=page_ids, mLastPageLens=last_page_lens,
                log2_page_size=p.page_size.bit_length() - 1)


def rab_among_new(rab: torch.Tensor, page_offsets, last_page_lens, page_size: int, new_len: int) -> torch.Tensor:
    """(B, H_rab, W, W) rab among each sequence's new tokens, rab[b, h, C_b + i, C_b + j] for i, j
    < W = roundup8(new_len) (C_b cached tokens, from the page tables on the device: no sync),
    16-byte aligned rows: a TMA box or a 16-byte load can not start at column C_b of rab itself
    (unaligned). One gather from rab's storage by element offset (any strides); the offsets of
    positions past a sequence's new tokens are clamped into the storage, so they read some element
    of rab (their keys are masked and their queries never stored)."""
    cached = cached_lengths(page_offsets, last_page_lens, page_size)
    width = -(-max(new_len, 1) // 8) * 8
    s_b, s_h, s_r, s_c = rab.stride()
    base, grid, extent = _rab_gather_geometry(rab, width)
    # Offsets: the (b, h) slab's, the cached length's shift along the diagonal, the (i, j) grid's.
    offsets = ((base + (cached * (s_r + s_c))[:, None, None, None]) + grid).clamp_(max=extent - 1)
    return rab.as_strided((extent,), (1,)).take(offsets)


_RAB_GATHER: dict = {}


def _rab_gather_geometry(rab: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """((B, H_rab, 1, 1) slab offsets, (width, width) offsets of i, j, elements of rab's storage
    span) for :func:`rab_among_new`, cached by rab's shape, strides, device and ``width``."""
    key = (tuple(rab.shape), rab.stride(), rab.device, width)
    geometry = _RAB_GATHER.get(key)
    if geometry is None:
        # Made inside a CUDA-graph capture its values exist only when the graph replays: not kept.
        capturing = rab.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if len(_RAB_GATHER) > 64:
            _RAB_GATHER.clear()
        s_b, s_h, s_r, s_c = rab.stride()
        extent = sum((n - 1) * st for n, st in zip(rab.shape, rab.stride())) + 1
        base = (torch.arange(rab.shape[0], device=rab.device) * s_b)[:, None, None, None] + (
            torch.arange(rab.shape[1], device=rab.device) * s_h)[None, :, None, None]
        steps = torch.arange(width, device=rab.device)
        grid = steps[:, None] * s_r + steps[None, :] * s_c
        geometry = (base, grid, extent)
        if not capturing:
            _RAB_GATHER[key] = geometry
    return geometry


def prepare_fp8(q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, p: Problem, descale_q=None,
                descale_k=None, descale_v=None, training: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, Fp8Operands]:
    """(q8, k8, operands) of a validated FP8 call (``p.fp8``): pre-quantized e4m3 q, k, v with
    their descales (None: 1), or 16-bit inputs quantized with ``p.quant_mode``; plus V^T. What
    :func:`forward_fp8` does before the kernel (benchmarks time it alone). ``training`` (quant
    modes): ``operands.kept`` holds what the backward may take of q, k and v (e4m3 q, k and their
    tables, e4m3 V, Q^T and K^T: :func:`kept_for_backward`), written by the same passes.
    Raises NotImplementedError where no FP8 kernel runs (not sm90, or the sm80 path forced)."""
    device = q.device
    path = kernel_path(device)
    if path != "hopper":
        arch = device_arch(device)
        what = "pre-quantized float8_e4m3fn inputs" if p.quant_mode == -1 else f"quant_mode={p.quant_mode}"
        raise NotImplementedError(
            f"{what}: the FP8 kernels are Hopper-only (sm90); this call would run the {path} path on {arch} "
            "(no silent 16-bit fallback: pass 16-bit inputs with quant_mode=-1)")
    if p.quant_mode == -1:
        descales = tuple(d if d is not None else unit_descale(device) for d in (descale_q, descale_k, descale_v))
        return q, k, Fp8Operands(transposed_for_pv(v, seq_offsets_k), descales, p.out_dtype, False)
    two_direction = p.quant_mode == QuantMode.TWO_DIRECTION
    copies = quantize_for(p.quant_mode, "training" if training else "forward", (q, k, v),
                          (seq_offsets_q, seq_offsets_k, seq_offsets_k), (max_seqlen_q, max_seqlen_k, max_seqlen_k))
    (q8, dq), (k8, dk), (vt, dv) = copies[0]["plain"], copies[1]["plain"], copies[2]["transposed"]
    kept = kept_for_backward(copies, two_direction) if training else None
    if p.quant_mode == QuantMode.CAST:  # P cast, (1,) descales
        return q8, k8, Fp8Operands(vt, (unit_descale(device),) * 3, p.out_dtype, False, kept=kept)
    return q8, k8, Fp8Operands(vt, (dq, dk, dv), p.out_dtype, True, two_direction, kept)


def kept_for_backward(copies: list[dict], two_direction: bool) -> dict:
    """The backward kernels' arguments made of q, k and v (:func:`quantize_for`'s "training"
    copies): e4m3 q, k, v, the token-contiguous Q^T and K^T, their descale tables (mode 1: the
    copies' own per-(block, dim) tables)."""
    (q8, dq), (qt, dqt) = copies[0]["plain"], copies[0]["transposed"]
    (k8, dk), (kt, dkt) = copies[1]["plain"], copies[1]["transposed"]
    v8, dv = copies[2]["plain"]
    kept = dict(mQ=q8, mK=k8, mV=v8, mQt=qt, mKt=kt, mDescaleQ=dq, mDescaleK=dk, mDescaleV=dv)
    if two_direction:
        kept.update(mDescaleQt=dqt, mDescaleKt=dkt)
    return kept


def forward_fp8(q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
                target_group_size, alpha, rab, seqused_q, seqused_k, p: Problem, descale_q=None, descale_k=None,
                descale_v=None, tiles: dict | None = None, out: torch.Tensor | None = None,
                keep_quantized: bool = False):
    """The FP8 forward of a validated call (``p.fp8``): :func:`prepare_fp8`, then the Hopper FP8
    kernel. With ``keep_quantized`` (a quant-mode training call) returns ``(out, kept)``, ``kept``
    being what the backward may take of the forward's quantization, by the backward's argument
    names (``operands.kept`` of :func:`prepare_fp8`; :func:`fp8_backward_operands` takes it as
    ``quantized``)."""
    q8, k8, fp8 = prepare_fp8(q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, p, descale_q,
                              descale_k, descale_v, training=keep_quantized)
    out = forward(q8, k8, None, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
                  target_group_size, alpha, rab, seqused_q, seqused_k, p, tiles=tiles, out=out, fp8=fp8)
    return (out, fp8.kept) if keep_quantized else out


# The part of the H100's 50 MB L2 that one section of a kernel's tile walk may fill with the
# operands its tiles share (common.tile_scheduler.SectionWalk). H100 sweep, session 9 (docs/perf-log.md):
# 8 MB is best or near it on jagged batches (B128 N2048 forward 355 TF against 281 with one
# section, Zipf B512 N1024 84 against 54 with one pair per section).
L2_SECTION_BYTES = 8 * 2**20
# Sections of kernels that claim their tiles hold at least this many pairs. H100 forward, full
# batches, three interleaved repeats (docs/perf-log.md session 10): 16 pairs match the static
# snake with one pair (B16 N2048 547-551 vs 547-555 TF, B8 N4096 649-664 vs 642-667) where the
# 8 MB rule's 4-8 pairs lose (518-521, 586-602).
CLAIM_MIN_PAIRS = 16
# ... and at most this many: on jagged rows of short average length the 8 MB rule gives hundreds.
# H100, forward / backward TF/s, rule vs 64 pairs (session 10): Zipf B512 N1024 105.7 / 103.4 vs
# 117.5 / 107.2; short jagged u[1,256] B4096 92.1 / 79.7 vs 94.4 / 81.0; one section over all
# pairs is worst everywhere (102.5 / 99.3, 87.9 / 76.5).
CLAIM_MAX_PAIRS = 64


def bh_per_section(p: Problem, shared_tokens: int, max_seqlen: int, persistent: bool, dynamic: bool = False) -> int:
    """(batch, head) pairs per section of the tile walk. Persistent kernels on a batch of full
    sequences (``shared_tokens`` == batch x ``max_seqlen``: known without reading the offsets)
    take one pair per section: their static snake order stays balanced (the heaviest CTA within
    3% of the mean), where other sections can leave one CTA 1.5-1.7x the mean (B8 N4096 forward
    434 TF with 4 pairs per section, 667 with one). Otherwise as many pairs as fit their two
    shared operands of an average sequence (K and V for the forward and dQ kernels, Q and dO
    for the dK/dV kernels) in :data:`L2_SECTION_BYTES`. Kernels that claim their tiles
    (``dynamic``) balance any section, so they always take the L2-sized ones, between
    :data:`CLAIM_MIN_PAIRS` and :data:`CLAIM_MAX_PAIRS` pairs."""
    pairs = p.batch * p.heads
    if persistent and not dynamic and shared_tokens == p.batch * max_seqlen:
        return 1
    per_pair = 2 * p.head_dim * p.dtype.itemsize * max(shared_tokens // max(p.batch, 1), 1)
    fit = L2_SECTION_BYTES // per_pair
    if dynamic:
        fit = min(max(fit, CLAIM_MIN_PAIRS), CLAIM_MAX_PAIRS)
    return max(1, min(fit, pairs))


def _walk_args(key, p: Problem, shared_tokens: int, max_seqlen: int, device) -> dict:
    """The tile-walk argument of a persistent sm90 kernel's launch (:func:`bh_per_section`);
    the sm80 kernels take none."""
    if not key.kernel_name.startswith("hopper"):
        return {}
    dynamic = key.dynamic_tiles
    args = dict(bh_per_section=bh_per_section(p, shared_tokens, max_seqlen, key.persistent, dynamic))
    if dynamic:
        args["mTileCounter"] = tile_counter(device)
    return args


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------
class _SideStream:
    """A device's side stream and the two events that fork it from, and join it back into, the
    current stream. Reused across calls: a wait captures the event's state when it is issued, so
    recording the event again later is safe (CUDA-graph capture included)."""

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device)
        self.fork = torch.cuda.Event()
        self.join = torch.cuda.Event()


_SIDE_STREAMS: dict[int, _SideStream] = {}


@contextlib.contextmanager
def _beside(device):
    """Launches in the body go to a side stream forked from, and joined back into, the current
    stream (CUDA-graph capture included): the dK/dV and dQ kernels are independent, so the second
    fills the SMs the first leaves idle in its last wave. Events and stream are reused and the
    stream is switched with ``torch.cuda.set_stream``: the ``wait_stream`` / ``torch.cuda.stream``
    pair cost 23 us of CPU per call on the H100 host (scripts/host_breakdown.py)."""
    side = _SIDE_STREAMS.get(device.index)
    if side is None:
        if torch.cuda.is_current_stream_capturing():
            # No stream creation inside a CUDA-graph capture: this call runs in line.
            yield
            return
        side = _SIDE_STREAMS[device.index] = _SideStream(device)
    main = torch.cuda.current_stream(device)
    side.fork.record(main)
    side.stream.wait_event(side.fork)
    torch.cuda.set_stream(side.stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(main)
        side.join.record(side.stream)
        main.wait_event(side.join)


def _on_device(device):
    """The device's context, or nothing when it is already current (switching costs ~2 us)."""
    return contextlib.nullcontext() if device.index == torch.cuda.current_device() else torch.cuda.device(device)


def _gradient_buffers(q, k, v, seqused_q, seqused_k) -> tuple:
    """dq, dk, dv shaped like q, k, v: zeros where seqused leaves rows the kernels do not write."""
    zero_q, zero_k = seqused_q is not None, seqused_k is not None
    return ((torch.zeros if zero_q else torch.empty)(q.shape, dtype=q.dtype, device=q.device),
            (torch.zeros if zero_k else torch.empty)(k.shape, dtype=k.dtype, device=k.device),
            (torch.zeros if zero_k else torch.empty)(v.shape, dtype=v.dtype, device=v.device))


def _nothing_to_do(q, k, max_seqlen_q: int, p: Problem) -> bool:
    """No query or key token: every gradient is zero and no kernel runs."""
    return q.shape[0] == 0 or k.shape[0] == 0 or max_seqlen_q == 0 or p.batch == 0


def backward(dout, q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts, num_targets,
             target_group_size, alpha, rab, has_drab, seqused_q, seqused_k, p: Problem, deterministic: bool = False,
             tiles_dq: dict | None = None, tiles_dkdv: dict | None = None, path: str | None = None):
    """Launch the backward kernels; returns ``(dq, dk, dv, drab)``, fresh tensors shaped like q,
    k, v (and like rab when ``has_drab``, else ``drab`` is None), in the input dtype.

    ``path`` 'hopper' (default on sm90): at head dim 128, without drab, unless ``deterministic``
    and for keys of at least ``FUSED_MIN_SEQLEN_K`` tokens, one fused TMA + WGMMA kernel computes
    dK, dV and reduces dQ into an fp32 accumulator (the order of that sum varies run to run);
    otherwise a dK/dV kernel and a dQ kernel (the sm80 one when drab is wanted), each summing in
    a fixed order. At head dim 256 the wide dK/dV/drab kernel and the dQ kernel (deterministic,
    except the sum of drab over heads for one rab head unless ``deterministic``). 'ampere': the
    sm80 dK/dV and dQ kernels at every head dim, deterministic. ``tiles_*`` override the keys'
    default tiles (benchmark sweeps)."""
    if path is None:
        path = kernel_path(q.device)
    if p.head_dim not in HEAD_DIMS:
        raise NotImplementedError(f"q.shape[2] (head dim): the backward kernels support {HEAD_DIMS}, got {p.head_dim}")
    dq, dk, dv = _gradient_buffers(q, k, v, seqused_q, seqused_k)
    if _nothing_to_do(q, k, max_seqlen_q, p):
        return dq.zero_(), dk.zero_(), dv.zero_(), (torch.zeros_like(rab) if has_drab else None)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    q, k, v, dout = (aligned_16(t) for t in (q, k, v, dout))

    device = q.device
    rab, drab, drab_view = _aligned_rab_and_drab(rab, has_drab)
    sum_heads = has_drab and rab.shape[1] == 1 and p.heads > 1
    context_target = p.mask.has_context or p.mask.has_target
    values = dict(mQ=q, mK=k, mV=v, mdO=dout, mdQ=dq, mdK=dk, mdV=dv, mRab=rab,
                  **_sequence_args(p, device, seq_offsets_q, seq_offsets_k, seqused_q, seqused_k, num_contexts,
                                   num_targets, context_target),
                  **_scalar_args(p, alpha, target_group_size))
    if path == "hopper":
        values.update(num_sms=num_sms(device))
    common = (device_arch(device), DTYPE_NAMES[p.dtype], p.head_dim, p.mask.kind, context_target, rab is not None)
    with _on_device(device):
        if path == "hopper" and p.head_dim in HOPPER_WIDE_HEAD_DIMS:
            _backward_wide(values, common, device, rab, drab, has_drab, deterministic, p, max_seqlen_q,
                           max_seqlen_k, tiles_dq, tiles_dkdv)
        else:
            fused = (path == "hopper" and not has_drab and not deterministic
                     and p.head_dim in HOPPER_FUSED_HEAD_DIMS and max_seqlen_k >= FUSED_MIN_SEQLEN_K)
            if fused:
                dq = _backward_fused(values, common, device, q, p, max_seqlen_q, max_seqlen_k, tiles_dkdv)
                return dq, dk, dv, None
            _backward_pair(values, common, device, path, rab, drab, sum_heads, has_drab, p, max_seqlen_q,
                           max_seqlen_k, tiles_dq, tiles_dkdv)
    return dq, dk, dv, drab_view


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


def _drab_over_heads(rab, drab, heads: int, deterministic: bool) -> tuple:
    """(where a kernel that writes drab per (query, key) tile of one head writes it, whether it
    adds with fp32 atomics): ``drab`` itself, or for one rab head over several heads an fp32
    (B, L_q, L_k) sum added to with atomics, or (``deterministic``) per-head drab (B, H, L_q, L_k)
    summed afterwards in head order (:func:`_sum_drab_heads`)."""
    if drab is None or rab.shape[1] != 1 or heads == 1:
        return drab, False
    B, _, Lq, Lk = rab.shape
    if not deterministic:
        return torch.zeros((B, Lq, Lk), dtype=torch.float32, device=rab.device), True
    return torch.zeros((B, heads, Lq, Lk), dtype=rab.dtype, device=rab.device), False


def _sum_drab_heads(drab, target) -> None:
    """drab from the buffer :func:`_drab_over_heads` gave (nothing to do when it was drab)."""
    if target is not drab:
        drab[:, 0].copy_(target if target.dim() == 3 else target.float().sum(1))


def _backward_wide(values, common, device, rab, drab, has_drab, deterministic, p, max_seqlen_q, max_seqlen_k,
                   tiles_dq, tiles_dkdv) -> None:
    """D256 on sm90: the wide dK/dV/drab kernel, the dQ kernel beside it."""
    drab_out, atomic_sum = _drab_over_heads(rab, drab, p.heads, deterministic)
    key_kv = _made(make_hopper_bwd_key, "wide", *common, tiles_dkdv, has_drab=has_drab, rab_sum_heads=atomic_sum)
    key_q = _made(make_hopper_bwd_key, "dq", *common, tiles_dq)
    fn_kv, fn_q = _compiled(key_kv), _compiled(key_q)
    _launch(key_kv, fn_kv, dict(values, mdRab=drab_out, num_n_blocks=-(-max_seqlen_k // key_kv.tile_n)))
    with _beside(device):
        _launch(key_q, fn_q, dict(values, num_m_blocks=-(-max_seqlen_q // key_q.tile_m),
                                  **_walk_args(key_q, p, values["mK"].shape[0], max_seqlen_k, device)))
    _sum_drab_heads(drab, drab_out)


def _backward_fused(values, common, device, q, p, max_seqlen_q, max_seqlen_k, tiles_dkdv) -> torch.Tensor:
    """D128 on sm90: one kernel for dK, dV and dQ (reduce-added into fp32); returns dq."""
    key = _made(make_hopper_bwd_key, "fused", *common, tiles_dkdv)
    fn = _compiled(key)
    dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=device)
    _launch(key, fn, dict(values, mdQaccum=dq_accum, num_n_blocks=-(-max_seqlen_k // key.tile_n),
                          **_walk_args(key, p, q.shape[0], max_seqlen_q, device)))
    return dq_accum.to(q.dtype)


def _backward_pair(values, common, device, path, rab, drab, sum_heads, has_drab, p, max_seqlen_q, max_seqlen_k,
                   tiles_dq, tiles_dkdv) -> None:
    """The deterministic pair: a dK/dV kernel and a dQ(+drab) kernel beside it."""
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
    fn_dq, fn_dkdv = _compiled(key_dq), _compiled(key_dkdv)
    drab_accum = None
    if sum_heads:
        drab_accum = torch.zeros((rab.shape[0], rab.shape[2], rab.shape[3]), dtype=torch.float32, device=device)
    _launch(key_dkdv, fn_dkdv, dict(values, num_n_blocks=-(-max_seqlen_k // key_dkdv.tile_n),
                                    **_walk_args(key_dkdv, p, values["mQ"].shape[0], max_seqlen_q, device)))
    with _beside(device):
        _launch(key_dq, fn_dq, dict(values, mdRab=drab, mdRabAccum=drab_accum,
                                    num_m_blocks=-(-max_seqlen_q // key_dq.tile_m),
                                    **_walk_args(key_dq, p, values["mK"].shape[0], max_seqlen_k, device)))


# ---------------------------------------------------------------------------------------------
# FP8 backward
# ---------------------------------------------------------------------------------------------
def check_fp8_backward(p: Problem) -> None:
    """NotImplementedError, naming the argument, for an FP8 training call no backward kernel
    serves: raised before the forward runs, so that a training step fails before any work."""
    if p.quant_mode == -1:
        raise NotImplementedError(
            "q/k/v.requires_grad: pre-quantized float8_e4m3fn inputs are forward-only (FBGEMM's FP8 entry); "
            "train with 16-bit inputs and quant_mode >= 0")
    if p.head_dim not in FP8_BWD_HEAD_DIMS:
        raise NotImplementedError(f"q.shape[2] (head dim) with quant_mode={p.quant_mode} and inputs that require "
                                  f"grad: the FP8 backward supports {FP8_BWD_HEAD_DIMS}, got {p.head_dim}")


def fp8_backward_operands(dout, q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, mode: int,
                          quantized: dict | None = None) -> dict:
    """What the FP8 backward kernels read, by argument name: e4m3 q, k, v, dO, the
    token-contiguous copies Q^T, K^T, dO^T, and their descale tables, quantized with ``mode`` on
    the device by the slot quantizer (:func:`quantize_for`; dO with q's groups). q, k and v come
    from ``quantized`` (the forward's training copies, :func:`kept_for_backward`) when given, else
    are quantized here as a training forward does (which also writes a V^T the backward does not
    read); dO and dO^T take one launch (modes 3-5: two). Mode 1's token-contiguous copies are
    scaled along tokens, with their own (B, blocks, H, 2, D) tables. Benchmarks time this apart
    from the kernels."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    two_direction = mode == QuantMode.TWO_DIRECTION
    if quantized is None:
        quantized = kept_for_backward(
            quantize_for(mode, "training", (q, k, v), (seq_offsets_q, seq_offsets_k, seq_offsets_k),
                         (max_seqlen_q, max_seqlen_k, max_seqlen_k)), two_direction)
    (copies,) = quantize_for(mode, "gradient", (dout,), (seq_offsets_q,), (max_seqlen_q,))
    (do8, table_do), (dot, table_dot) = copies["plain"], copies["transposed"]
    operands = dict(quantized, mdO=do8, mdOt=dot, mDescaleDO=table_do)
    if two_direction:
        operands["mDescaleDOt"] = table_dot
    return operands


# The fused FP8 backward (dK, dV and dQ's reduce-adds in one kernel) runs only when asked for
# (``backward_fp8(fused=True)``, or this flag): slower than the pair where it exists. H100, B8
# N4096 H4 D128 causal, quant mode 2, kernels alone, same runs (docs/perf-log.md, session 19):
# 0.753-0.763 ms against the pair's 0.664-0.666 (bf16 backward 0.705-0.718).
FP8_FUSED_BY_DEFAULT = False


def fp8_fused_serves(head_dim: int, quant_mode: int, has_rab: bool, has_drab: bool, deterministic: bool) -> bool:
    """Whether the fused FP8 kernel can serve a backward: quant modes 0, 2-5 at the head dims of
    ``FP8_FUSED_HEAD_DIMS``, without rab, not ``deterministic`` (its dQ sum order varies)."""
    return (head_dim in FP8_FUSED_HEAD_DIMS and quant_mode != QuantMode.TWO_DIRECTION and not has_rab
            and not has_drab and not deterministic)


def fp8_backward_fused(head_dim: int, quant_mode: int, max_seqlen_k: int, has_rab: bool, has_drab: bool,
                       deterministic: bool) -> bool:
    """Whether :func:`backward_fp8` runs the fused FP8 kernel by default: with
    ``FP8_FUSED_BY_DEFAULT``, where it serves (:func:`fp8_fused_serves`), for keys of at least
    ``FUSED_MIN_SEQLEN_K`` tokens (as the 16-bit fused kernel)."""
    return (FP8_FUSED_BY_DEFAULT and max_seqlen_k >= FUSED_MIN_SEQLEN_K
            and fp8_fused_serves(head_dim, quant_mode, has_rab, has_drab, deterministic))


def backward_fp8(dout, q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts,
                 num_targets, target_group_size, alpha, rab, seqused_q, seqused_k, p: Problem,
                 operands: dict | None = None, tiles: dict | None = None, kernels=("dkdv", "dq"),
                 has_drab: bool = False, deterministic: bool = False, quantized: dict | None = None,
                 fused: bool | None = None):
    """The FP8 backward of a validated quant-mode call (:func:`check_fp8_backward`):
    :func:`fp8_backward_operands` (or the given ``operands``), then the FP8 dK/dV kernel and the dQ
    kernel beside it, or where :func:`fp8_backward_fused` (or ``fused``) says so the fused kernel
    (:mod:`hstu_cute.hopper.bwd_fp8`). Returns ``(dq, dk, dv, drab)`` in the input dtype
    (``drab`` shaped like rab with ``has_drab``, else None; the dQ kernel writes it from G in
    fp32). The pair sums every gradient in a fixed order (bitwise reproducible), except drab of
    one rab head over several heads, added with fp32 atomics unless ``deterministic`` (then
    per-head drab summed afterwards); the fused kernel reduce-adds dQ in an order that varies.
    ``quantized``: the forward's copies of q, k and v (:func:`forward_fp8` with ``keep_quantized``).
    ``tiles`` (role -> the keys' tile fields) and ``kernels`` (the roles to launch) serve
    benchmark sweeps."""
    check_fp8_backward(p)
    device = q.device
    if kernel_path(device) != "hopper":
        raise NotImplementedError(f"quant_mode={p.quant_mode} backward: the FP8 kernels are Hopper-only (sm90); "
                                  f"got {device_arch(device)}")
    dq, dk, dv = _gradient_buffers(q, k, v, seqused_q, seqused_k)
    if _nothing_to_do(q, k, max_seqlen_q, p):
        return dq.zero_(), dk.zero_(), dv.zero_(), (torch.zeros_like(rab) if has_drab else None)
    if operands is None:
        operands = fp8_backward_operands(dout, q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k,
                                         p.quant_mode, quantized)
    rab, drab, drab_view = _aligned_rab_and_drab(rab, has_drab)
    drab_out, atomic_sum = _drab_over_heads(rab, drab, p.heads, deterministic)
    context_target = p.mask.has_context or p.mask.has_target
    values = dict(operands, mdQ=dq, mdK=dk, mdV=dv, mRab=rab, mdRab=drab_out, num_sms=num_sms(device),
                  **_sequence_args(p, device, seq_offsets_q, seq_offsets_k, seqused_q, seqused_k, num_contexts,
                                   num_targets, context_target),
                  **_scalar_args(p, alpha, target_group_size))
    common = (device_arch(device), DTYPE_NAMES[p.dtype], p.head_dim, p.mask.kind, context_target, rab is not None)
    tiles = tiles or {}
    two_direction = p.quant_mode == QuantMode.TWO_DIRECTION
    if fused is None:
        fused = fp8_backward_fused(p.head_dim, p.quant_mode, max_seqlen_k, rab is not None, has_drab, deterministic)
    elif fused and not fp8_fused_serves(p.head_dim, p.quant_mode, rab is not None, has_drab, deterministic):
        raise ValueError(f"fused=True: the fused FP8 backward serves head dims {FP8_FUSED_HEAD_DIMS}, quant modes "
                         f"0, 2-5, no rab or drab, not deterministic; got head dim {p.head_dim}, quant_mode="
                         f"{p.quant_mode}, rab={rab is not None}, has_drab={has_drab}, deterministic={deterministic}")
    if fused:
        key = _made(make_hopper_fp8_bwd_key, "fused", *common, tiles.get("fused"))
        dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=device)
        with _on_device(device):
            _launch(key, _compiled(key), dict(values, mdQaccum=dq_accum, num_n_blocks=-(-max_seqlen_k // key.tile_n),
                                              **_walk_args(key, p, q.shape[0], max_seqlen_q, device)))
        return dq_accum.to(q.dtype), dk, dv, None
    key_kv = _made(make_hopper_fp8_bwd_key, "dkdv", *common, tiles.get("dkdv"), two_direction=two_direction)
    key_q = _made(make_hopper_fp8_bwd_key, "dq", *common, tiles.get("dq"), has_drab, atomic_sum,
                  two_direction=two_direction)
    with _on_device(device):
        if "dkdv" in kernels:
            # The walk counts dim_parts n-blocks per key block (D256: two CTAs, each with half of D).
            n_blocks = key_kv.dim_parts * -(-max_seqlen_k // key_kv.tile_n)
            _launch(key_kv, _compiled(key_kv), dict(values, num_n_blocks=n_blocks,
                                                    **_walk_args(key_kv, p, q.shape[0], max_seqlen_q, device)))
        if "dq" in kernels:
            with _beside(device):
                _launch(key_q, _compiled(key_q), dict(values, num_m_blocks=-(-max_seqlen_q // key_q.tile_m),
                                                      **_walk_args(key_q, p, k.shape[0], max_seqlen_k, device)))
    _sum_drab_heads(drab, drab_out)
    return dq, dk, dv, drab_view
