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
from .call import Call
from .kernel_args import ordered, slots
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
    SPLIT_KEY_MASKS,
    vt_width,
)
from .fp8_format import QUANT_MAX_SLOTS, SCALE_FLOOR
from .fp8_recipe import Fp8Recipe, ScaleGroup, quant_launches, recipe
from .quantize import num_blocks

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


def _sequence_args(call: Call, device, context_target: bool) -> dict:
    """The per-sequence runtime arguments every kernel family takes, absent ones filled."""
    batch = call.problem.batch
    num_contexts, num_targets = call.num_contexts, call.num_targets
    if context_target:
        num_contexts = num_contexts if num_contexts is not None else _filler(batch, device, 0)
        num_targets = num_targets if num_targets is not None else _filler(batch, device, 0)
    return dict(
        mOffsetsQ=call.seq_offsets_q, mOffsetsK=call.seq_offsets_k,
        mSeqUsedQ=call.seqused_q if call.seqused_q is not None else _filler(batch, device, INT32_MAX),
        mSeqUsedK=call.seqused_k if call.seqused_k is not None else _filler(batch, device, INT32_MAX),
        mNumContexts=num_contexts, mNumTargets=num_targets,
    )


def _call_tensors(call: Call) -> dict:
    """The call's own per-sequence tensors, by argument name (absent ones left out: a prepared
    launch has their fillers in place)."""
    values = {"mOffsetsQ": call.seq_offsets_q, "mOffsetsK": call.seq_offsets_k}
    for name, t in (("mSeqUsedQ", call.seqused_q), ("mSeqUsedK", call.seqused_k),
                    ("mNumContexts", call.num_contexts), ("mNumTargets", call.num_targets)):
        if t is not None:
            values[name] = t
    return values


def _scalar_args(call: Call) -> dict:
    alpha = float(call.alpha)
    if not math.isfinite(alpha):  # traced calls skip the check in validation (a symbolic alpha)
        fail(ValueError, "alpha", "a finite Python float", repr(alpha))
    p = call.problem
    return dict(alpha=alpha, inv_scale=1.0 / p.scale_seqlen, window_left=p.window_left,
                window_right=p.window_right, group_size=int(call.target_group_size),
                is_delta_q=int(p.mask.is_delta_q))


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


def _launch(key, compiled, values: dict) -> None:
    compiled(*ordered(key, values))


class Prepared:
    """A compiled kernel with its runtime arguments laid out once for every call of one argument
    signature (:attr:`hstu_cute.call.Call.plans`): ``fixed`` (scalars, fillers, block counts,
    the tile walk) sit in place, a call fills in its tensors by name. A repeated call then costs
    a list copy and the TVM-FFI call (the prepared launches of a step: docs/perf-log.md, session
    28)."""

    __slots__ = ("key", "fn", "fixed", "args", "index", "claims_tiles")

    def __init__(self, key, fixed: dict):
        names = slots(key)
        self.key, self.fn, self.fixed = key, _compiled(key), fixed
        self.args = [fixed.get(n) if n is not None else None for n in names]
        self.index = {n: i for i, n in enumerate(names) if n is not None}
        self.claims_tiles = getattr(key, "dynamic_tiles", False)

    def __call__(self, values: dict, device) -> None:
        """Launch on the current stream; a kernel that claims its tiles gets that stream's
        :func:`tile_counter`."""
        if self.claims_tiles:
            values["mTileCounter"] = tile_counter(device)
        _launch_prepared(self, values)


def _launch_prepared(prepared: Prepared, values: dict) -> None:
    """Run ``prepared`` with the call's ``values`` (names its key lacks are ignored)."""
    args = prepared.args.copy()
    index = prepared.index
    for name, value in values.items():
        i = index.get(name)
        if i is not None:
            args[i] = value
    prepared.fn(*args)


def _plan(call: Call, key: tuple, build):
    """``call.plans[key]``, made by ``build()`` the first time (every time for a call without a
    plan cache); plans made inside a CUDA-graph capture are not kept (their filler tensors would
    hold values only when the graph replays)."""
    plans = call.plans
    if plans is None:
        return build()
    plan = plans.get(key)
    if plan is None:
        plan = build()
        if not torch.cuda.is_current_stream_capturing():
            plans[key] = plan
    return plan


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
    """:func:`hstu_cute.fp8_recipe.quant_launches`, each launch with its key's slot tuple."""
    return tuple((launch, tuple(slot[1:] for slot in launch)) for launch in quant_launches(mode, purpose))


def quantize_for(mode, purpose: str, xs: tuple, offsets: tuple, max_seqlens: tuple) -> list[dict]:
    """Quantize the 16-bit (T, H, D) tensors ``xs`` (q, k, v; or dO) with ``mode`` (a quant mode
    0-5 or its :class:`~hstu_cute.fp8_recipe.Fp8Recipe`) for
    ``purpose`` (:func:`hstu_cute.variants.quant_launches`: one launch of the slot quantizer,
    :mod:`hstu_cute.hopper.quantize_slots`, mode 1 two) and return, per tensor, its copies by
    name: ``"plain"`` (T, H, D) e4m3 and/or ``"transposed"`` V^T (H, D, W)
    (:func:`transposed_for_pv`'s layout), each as ``(data, descale table)``. The table is (B,
    blocks, H) for mode 2, a zero-strided (B, 1, H) view of the group's scale for modes 3-5;
    mode 1's plain tables are (T, H) (per token), its transposed ones (B, blocks, H, 2, D): per
    block and dim the scale, then its reciprocal; mode 0's are zero-strided (B, 1, H) views of a
    cached one. Every shape depends only on shapes (no sync)."""
    r = mode if isinstance(mode, Fp8Recipe) else recipe(mode)
    x0 = xs[0]
    device = x0.device
    batch = offsets[0].shape[0] - 1
    heads, head_dim = x0.shape[1], x0.shape[2]
    blocks = [num_blocks(m) for m in max_seqlens]
    empty = [batch == 0 or x.shape[0] == 0 for x in xs]
    copies: list[dict] = [{} for _ in xs]
    tables: dict = {}  # (tensor, role family) -> (the kernel's table, the copies' table)
    cooperative = {}
    if r.group is ScaleGroup.NONE:
        ones = unit_descale_table(device, batch, heads)
        for i in range(len(xs)):
            tables[i, "unit"] = (None, ones)
    if r.grouped:
        # The blocks max each group's scale in here, every block of a group sees it (zero strides
        # along the (B, blocks, H) dims it spans); the word after the tables counts the grid
        # barrier's arrivals: one memset for all.
        size, strides = r.group_table(batch, heads)
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
    for launch_slots, slot_specs in _quant_plan(r.mode, purpose):
        values: dict = dict(cooperative)
        for names, (i, role, plain, transposed) in zip(_SLOT_ARGS, launch_slots):
            x = aligned[i]
            family = r.table_family(role)
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


def forward(q, k, v, rab, call: Call, tiles: dict | None = None, out: torch.Tensor | None = None,
            path: str | None = None, fp8: "Fp8Operands | None" = None, splits: int | None = None) -> torch.Tensor:
    """Launch the forward kernel of ``path`` ('hopper' or 'ampere'; default: :func:`kernel_path`)
    for the validated ``call`` and return ``out`` (T_q, H, D); ``tiles`` overrides the key's
    default tiles (benchmarks). With ``fp8`` q and k are e4m3 and the Hopper FP8 kernel runs
    (``v`` is unused: the kernel reads ``fp8.vt``); ``out`` is in ``fp8.out_dtype``. A call with a
    paged cache (``call.paged``) reads its keys from there first. ``splits``: parts of the key
    blocks on the 16-bit paths (None: :func:`key_splits`; more than 1 takes the split-key variant,
    whose parts add up inside the kernel). The launch is prepared once per argument signature
    (:class:`Prepared`)."""
    p = call.problem
    device = q.device
    if fp8 is not None:
        path = "hopper"
    elif path is None:
        path = kernel_path(device)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype if fp8 is None else fp8.out_dtype, device=device)
    if call.seqused_q is not None:
        out.zero_()  # padding rows (past seqused_q) are never written by the kernel
    if q.shape[0] == 0 or call.max_seqlen_q == 0 or p.batch == 0 or k.shape[0] == 0:
        return out.zero_()
    q, k = aligned_16(q), aligned_16(k)
    v = aligned_16(v) if fp8 is None else fp8.vt
    if rab is not None and (path == "hopper" or p.page_size):
        rab = pad_rab_rows(rab)  # TMA (and the paged sm80 key) need 16-byte aligned rows
    fp8_kind = None if fp8 is None else (fp8.out_dtype, fp8.scaled_p, fp8.two_direction)
    plan_key = ("fwd", path, rab_vec(rab) if rab is not None else 0, k.shape[0], splits, fp8_kind, call.alpha,
                call.target_group_size)

    def build():
        return _forward_plan(call, device, rab, k.shape[0], path, tiles, fp8, splits)

    prepared, splits = _plan(call, plan_key, build) if tiles is None else build()
    if splits > 1 and rab is not None:
        rab = pad_rab_rows(rab)  # the split variants read 16-byte aligned rab rows
    values = dict(mQ=q, mK=k, mV=v, mO=out, mRab=rab, **_call_tensors(call))
    key = prepared.key
    if fp8 is not None:
        values.update(zip(("mDescaleQ", "mDescaleK", "mDescaleV"), fp8.descales))
    if splits > 1:
        values.update(mPartials=torch.empty((splits * q.shape[0],) + tuple(q.shape[1:]), dtype=torch.float32,
                                            device=device),
                      mArrivals=split_arrivals(device, p.batch * p.heads * -(-call.max_seqlen_q // key.tile_m) * 2))
    if p.page_size:
        values.update(_paged_args(p, call.paged))
        if rab is not None:
            values["mRabNew"] = rab_among_new(rab, call.paged.page_offsets, call.paged.last_page_lens, p.page_size,
                                              call.max_seqlen_q)
    # The launch goes to the current device's current stream (TVM-FFI env stream); switching
    # devices costs ~10 us, so only do it when q lives elsewhere.
    with _on_device(device):
        prepared(values, device)
    return out


def _forward_plan(call: Call, device, rab, tokens_k: int, path: str, tiles, fp8, splits) -> tuple:
    """(the prepared forward launch, the key splits it takes) of ``call``'s signature."""
    p = call.problem
    if fp8 is None:
        key = fwd_key(p, device_arch(device), rab, tiles, path)
        if splits is None:
            splits = key_splits(p, key.tile_m, key.tile_n, call.max_seqlen_q, call.max_seqlen_k, num_sms(device))
        fixed = {}
        if splits > 1:
            key = fwd_key(p, device_arch(device), pad_rab_rows(rab) if rab is not None else None, tiles, path,
                          split_keys=True)
            fixed["num_splits"] = splits
    else:
        splits = 1
        key = fp8_fwd_key(p, device_arch(device), rab, fp8.out_dtype, tiles, fp8.scaled_p, fp8.two_direction)
        fixed = {}
    fixed.update(num_m_blocks=-(-call.max_seqlen_q // key.tile_m) * splits,
                 **_sequence_args(call, device, key.has_context), **_scalar_args(call))
    if p.page_size:
        fixed["log2_page_size"] = p.page_size.bit_length() - 1
    shared_tokens = p.batch * call.max_seqlen_k if p.page_size else tokens_k
    if path == "hopper":
        fixed.update(num_sms=num_sms(device), **_walk_fixed(key, p, shared_tokens, call.max_seqlen_k))
    return Prepared(key, fixed), splits


def _paged_args(p: Problem, paged) -> dict:
    """The paged cache's per-call runtime arguments: the cache seen as (pages * 2 * page_size, H,
    D) rows (validation checked that its strides allow that view; no copy), and its tables."""
    kv_cache = paged.kv_cache
    rows = kv_cache.shape[0] * 2 * p.page_size
    cache_rows = kv_cache.as_strided((rows, kv_cache.shape[3], kv_cache.shape[4]), (kv_cache.stride(2),
                                     kv_cache.stride(3), 1))
    return dict(mCache=cache_rows, mPageOffsets=paged.page_offsets, mPageIds=paged.page_ids,
                mLastPageLens=paged.last_page_lens)


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


def prepare_fp8(q, k, v, call: Call, training: bool = False) -> tuple[torch.Tensor, torch.Tensor, Fp8Operands]:
    """(q8, k8, operands) of a validated FP8 call (its recipe: ``call.problem.recipe``):
    pre-quantized e4m3 q, k, v with ``call.descales`` (None: 1), or 16-bit inputs quantized by the
    recipe; plus V^T. What :func:`forward_fp8` does before the kernel (benchmarks time it alone).
    ``training`` (quantizing recipes): ``operands.kept`` holds what the backward may take of q, k
    and v (e4m3 q, k and their tables, e4m3 V, Q^T and K^T: :func:`kept_for_backward`), written by
    the same passes. Raises NotImplementedError where no FP8 kernel runs (not sm90, or the sm80
    path forced)."""
    p = call.problem
    r = p.recipe
    device = q.device
    path = kernel_path(device)
    if path != "hopper":
        arch = device_arch(device)
        what = f"quant_mode={r.mode}" if r.quantizes else "pre-quantized float8_e4m3fn inputs"
        raise NotImplementedError(
            f"{what}: the FP8 kernels are Hopper-only (sm90); this call would run the {path} path on {arch} "
            "(no silent 16-bit fallback: pass 16-bit inputs with quant_mode=-1)")
    if not r.quantizes:
        descales = tuple(d if d is not None else unit_descale(device) for d in call.descales)
        return q, k, Fp8Operands(transposed_for_pv(v, call.seq_offsets_k), descales, p.out_dtype, False)
    copies = quantize_for(r, "training" if training else "forward", (q, k, v),
                          (call.seq_offsets_q, call.seq_offsets_k, call.seq_offsets_k),
                          (call.max_seqlen_q, call.max_seqlen_k, call.max_seqlen_k))
    (q8, dq), (k8, dk), (vt, dv) = copies[0]["plain"], copies[1]["plain"], copies[2]["transposed"]
    kept = kept_for_backward(copies, r.two_direction) if training else None
    if r.unit_descales:  # P cast, (1,) descales
        return q8, k8, Fp8Operands(vt, (unit_descale(device),) * 3, p.out_dtype, False, kept=kept)
    return q8, k8, Fp8Operands(vt, (dq, dk, dv), p.out_dtype, True, r.two_direction, kept)


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


def forward_fp8(q, k, v, rab, call: Call, tiles: dict | None = None, out: torch.Tensor | None = None,
                keep_quantized: bool = False):
    """The FP8 forward of a validated call (``call.problem.fp8``): :func:`prepare_fp8`, then the
    Hopper FP8 kernel. With ``keep_quantized`` (a quantizing training call) returns ``(out,
    kept)``, ``kept`` being what the backward may take of the forward's quantization, by the
    backward's argument names (``operands.kept`` of :func:`prepare_fp8`;
    :func:`fp8_backward_operands` takes it as ``quantized``)."""
    q8, k8, fp8 = prepare_fp8(q, k, v, call, training=keep_quantized)
    out = forward(q8, k8, None, rab, call, tiles=tiles, out=out, fp8=fp8)
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


def _walk_fixed(key, p: Problem, shared_tokens: int, max_seqlen: int) -> dict:
    """The tile-walk argument of a persistent sm90 kernel's launch (:func:`bh_per_section`);
    the sm80 kernels take none. Kernels that claim their tiles also take :func:`tile_counter`,
    per call (one per stream)."""
    if not key.kernel_name.startswith("hopper"):
        return {}
    return dict(bh_per_section=bh_per_section(p, shared_tokens, max_seqlen, key.persistent, key.dynamic_tiles))


def _walk_args(key, p: Problem, shared_tokens: int, max_seqlen: int, device) -> dict:
    """:func:`_walk_fixed` and the tile counter of a kernel that claims its tiles."""
    args = _walk_fixed(key, p, shared_tokens, max_seqlen)
    if getattr(key, "dynamic_tiles", False):
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


_NO_SWITCH = contextlib.nullcontext()


def _on_device(device):
    """The device's context, or nothing when it is already current (switching costs ~2 us; the
    raw query skips torch.cuda.current_device's lazy-init check, a call that runs every launch)."""
    return _NO_SWITCH if device.index == torch._C._cuda_getDevice() else torch.cuda.device(device)


def _gradient_buffers(q, k, v, seqused_q, seqused_k) -> tuple:
    """dq, dk, dv shaped like q, k, v: zeros where seqused leaves rows the kernels do not write.
    Where the three have one shape they are views of one allocation: each torch.empty costs
    ~13 us of host time on the H200 host (scripts/host_attribution.py, session 28)."""
    zero_q, zero_k = seqused_q is not None, seqused_k is not None
    if zero_q == zero_k and q.shape == k.shape:
        return (torch.zeros if zero_q else torch.empty)((3,) + tuple(q.shape), dtype=q.dtype,
                                                        device=q.device).unbind(0)
    return ((torch.zeros if zero_q else torch.empty)(q.shape, dtype=q.dtype, device=q.device),
            (torch.zeros if zero_k else torch.empty)(k.shape, dtype=k.dtype, device=k.device),
            (torch.zeros if zero_k else torch.empty)(v.shape, dtype=v.dtype, device=v.device))


def _nothing_to_do(q, k, max_seqlen_q: int, p: Problem) -> bool:
    """No query or key token: every gradient is zero and no kernel runs."""
    return q.shape[0] == 0 or k.shape[0] == 0 or max_seqlen_q == 0 or p.batch == 0


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
    dq, dk, dv = _gradient_buffers(q, k, v, call.seqused_q, call.seqused_k)
    if _nothing_to_do(q, k, call.max_seqlen_q, p):
        return dq.zero_(), dk.zero_(), dv.zero_(), (torch.zeros_like(rab) if call.has_drab else None)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    q, k, v, dout = aligned_16(q), aligned_16(k), aligned_16(v), aligned_16(dout)
    rab, drab, drab_view = _aligned_rab_and_drab(rab, call.has_drab)
    kind = _backward_kind(call, path)
    plan_key = ("bwd", path, kind, rab is not None, q.shape[0], k.shape[0], call.has_drab, call.deterministic,
                call.alpha, call.target_group_size)

    def build():
        return _backward_plan(call, device, path, kind, rab is not None, q.shape[0], k.shape[0], tiles_dq, tiles_dkdv)

    plan = _plan(call, plan_key, build) if tiles_dq is None and tiles_dkdv is None else build()
    values = dict(mQ=q, mK=k, mV=v, mdO=dout, mdQ=dq, mdK=dk, mdV=dv, mRab=rab, **_call_tensors(call))
    with _on_device(device):
        if plan.kind == "fused":
            dq_accum = values["mdQaccum"] = torch.zeros(q.shape, dtype=torch.float32, device=device)
            plan.first(values, device)
            return dq_accum.to(q.dtype), dk, dv, None
        drab_out = drab
        if plan.kind == "wide":
            drab_out, _ = _drab_over_heads(rab, drab, p.heads, call.deterministic)
        elif plan.sum_heads:
            values["mdRabAccum"] = torch.zeros((rab.shape[0], rab.shape[2], rab.shape[3]), dtype=torch.float32,
                                               device=device)
        values["mdRab"] = drab_out
        # One stream: the dQ kernel beside the dK/dV kernel on a side stream took the same device
        # time (0.99-1.02x, CUDA graphs, tiny to B8 N4096, scripts/side_stream_ab.py) and ~45-60
        # us more host time per step (docs/perf-log.md, session 28).
        plan.first(values, device)
        plan.second(values, device)
        if plan.kind == "wide":
            _sum_drab_heads(drab, drab_out)
    return dq, dk, dv, drab_view


class _BackwardPlan:
    """The prepared launches of a 16-bit backward: ``kind`` "fused" (one kernel), "wide" (the D256
    dK/dV/drab kernel, then the dQ kernel) or "pair" (the dK/dV kernel, then the dQ(+drab)
    kernel); ``sum_heads``: the pair's dQ kernel sums drab over heads into fp32."""

    __slots__ = ("kind", "first", "second", "sum_heads")

    def __init__(self, kind: str, first: Prepared, second: Prepared | None = None, sum_heads: bool = False):
        self.kind, self.first, self.second, self.sum_heads = kind, first, second, sum_heads


def _backward_kind(call: Call, path: str) -> str:
    """Which kernels a 16-bit backward runs (:class:`_BackwardPlan`); decided per call, outside
    the cached plans (tests and sweeps move ``FUSED_MIN_SEQLEN_K``)."""
    p = call.problem
    if path == "hopper" and p.head_dim in HOPPER_WIDE_HEAD_DIMS:
        return "wide"
    if (path == "hopper" and not call.has_drab and not call.deterministic and p.head_dim in HOPPER_FUSED_HEAD_DIMS
            and call.max_seqlen_k >= FUSED_MIN_SEQLEN_K):
        return "fused"
    return "pair"


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
        # drab of one rab head over several heads: fp32 atomics unless deterministic (_drab_over_heads)
        atomic_sum = has_drab and p.rab_heads == 1 and p.heads > 1 and not call.deterministic
        key_kv = _made(make_hopper_bwd_key, "wide", *common, tiles_dkdv, has_drab=has_drab, rab_sum_heads=atomic_sum)
        key_q = _made(make_hopper_bwd_key, "dq", *common, tiles_dq)
        return _BackwardPlan("wide", over_keys(key_kv), over_queries(key_q))
    if kind == "fused":
        return _BackwardPlan("fused", over_keys(_made(make_hopper_bwd_key, "fused", *common, tiles_dkdv)))
    sum_heads = has_drab and p.rab_heads == 1 and p.heads > 1
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


# ---------------------------------------------------------------------------------------------
# FP8 backward
# ---------------------------------------------------------------------------------------------
def check_fp8_backward(p: Problem) -> None:
    """NotImplementedError, naming the argument, for an FP8 training call no backward kernel
    serves: raised before the forward runs, so that a training step fails before any work."""
    if not p.recipe.quantizes:
        raise NotImplementedError(
            "q/k/v.requires_grad: pre-quantized float8_e4m3fn inputs are forward-only (FBGEMM's FP8 entry); "
            "train with 16-bit inputs and quant_mode >= 0")
    if p.head_dim not in FP8_BWD_HEAD_DIMS:
        raise NotImplementedError(f"q.shape[2] (head dim) with quant_mode={p.quant_mode} and inputs that require "
                                  f"grad: the FP8 backward supports {FP8_BWD_HEAD_DIMS}, got {p.head_dim}")


def fp8_backward_operands(dout, q, k, v, call: Call, quantized: dict | None = None) -> dict:
    """What the FP8 backward kernels read, by argument name: e4m3 q, k, v, dO, the
    token-contiguous copies Q^T, K^T, dO^T, and their descale tables, quantized with ``mode`` on
    the device by the call's recipe (:func:`quantize_for`; dO with q's groups). q, k and v come
    from ``quantized`` (the forward's training copies, :func:`kept_for_backward`) when given, else
    are quantized here as a training forward does (which also writes a V^T the backward does not
    read); dO and dO^T take one launch (modes 3-5: two). Mode 1's token-contiguous copies are
    scaled along tokens, with their own (B, blocks, H, 2, D) tables. Benchmarks time this apart
    from the kernels."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    r = call.problem.recipe
    two_direction = r.two_direction
    if quantized is None:
        quantized = kept_for_backward(
            quantize_for(r, "training", (q, k, v), (call.seq_offsets_q, call.seq_offsets_k, call.seq_offsets_k),
                         (call.max_seqlen_q, call.max_seqlen_k, call.max_seqlen_k)), two_direction)
    (copies,) = quantize_for(r, "gradient", (dout,), (call.seq_offsets_q,), (call.max_seqlen_q,))
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


def fp8_fused_serves(head_dim: int, fp8: Fp8Recipe, has_rab: bool, has_drab: bool, deterministic: bool) -> bool:
    """Whether the fused FP8 kernel can serve a backward: recipes it reads the tables of
    (:attr:`Fp8Recipe.fused_backward_serves`) at the head dims of ``FP8_FUSED_HEAD_DIMS``,
    without rab, not ``deterministic`` (its dQ sum order varies)."""
    return (head_dim in FP8_FUSED_HEAD_DIMS and fp8.fused_backward_serves and not has_rab
            and not has_drab and not deterministic)


def fp8_backward_fused(head_dim: int, fp8: Fp8Recipe, max_seqlen_k: int, has_rab: bool, has_drab: bool,
                       deterministic: bool) -> bool:
    """Whether :func:`backward_fp8` runs the fused FP8 kernel by default: with
    ``FP8_FUSED_BY_DEFAULT``, where it serves (:func:`fp8_fused_serves`), for keys of at least
    ``FUSED_MIN_SEQLEN_K`` tokens (as the 16-bit fused kernel)."""
    return (FP8_FUSED_BY_DEFAULT and max_seqlen_k >= FUSED_MIN_SEQLEN_K
            and fp8_fused_serves(head_dim, fp8, has_rab, has_drab, deterministic))


def backward_fp8(dout, q, k, v, rab, call: Call, operands: dict | None = None, tiles: dict | None = None,
                 kernels=("dkdv", "dq"), quantized: dict | None = None, fused: bool | None = None):
    """The FP8 backward of a validated quant-mode call (:func:`check_fp8_backward`):
    :func:`fp8_backward_operands` (or the given ``operands``), then the FP8 dK/dV kernel and the dQ
    kernel beside it, or where :func:`fp8_backward_fused` (or ``fused``) says so the fused kernel
    (:mod:`hstu_cute.hopper.bwd_fp8`). Returns ``(dq, dk, dv, drab)`` in the input dtype
    (``drab`` shaped like rab with ``call.has_drab``, else None; the dQ kernel writes it from G in
    fp32). The pair sums every gradient in a fixed order (bitwise reproducible), except drab of
    one rab head over several heads, added with fp32 atomics unless ``deterministic`` (then
    per-head drab summed afterwards); the fused kernel reduce-adds dQ in an order that varies.
    ``quantized``: the forward's copies of q, k and v (:func:`forward_fp8` with ``keep_quantized``).
    ``tiles`` (role -> the keys' tile fields) and ``kernels`` (the roles to launch) serve
    benchmark sweeps."""
    p = call.problem
    r = p.recipe
    has_drab, deterministic = call.has_drab, call.deterministic
    max_seqlen_q, max_seqlen_k = call.max_seqlen_q, call.max_seqlen_k
    check_fp8_backward(p)
    device = q.device
    if kernel_path(device) != "hopper":
        raise NotImplementedError(f"quant_mode={r.mode} backward: the FP8 kernels are Hopper-only (sm90); "
                                  f"got {device_arch(device)}")
    dq, dk, dv = _gradient_buffers(q, k, v, call.seqused_q, call.seqused_k)
    if _nothing_to_do(q, k, max_seqlen_q, p):
        return dq.zero_(), dk.zero_(), dv.zero_(), (torch.zeros_like(rab) if has_drab else None)
    if operands is None:
        operands = fp8_backward_operands(dout, q, k, v, call, quantized)
    rab, drab, drab_view = _aligned_rab_and_drab(rab, has_drab)
    drab_out, atomic_sum = _drab_over_heads(rab, drab, p.heads, deterministic)
    context_target = p.mask.has_context or p.mask.has_target
    values = dict(operands, mdQ=dq, mdK=dk, mdV=dv, mRab=rab, mdRab=drab_out, num_sms=num_sms(device),
                  **_sequence_args(call, device, context_target), **_scalar_args(call))
    common = (device_arch(device), DTYPE_NAMES[p.dtype], p.head_dim, p.mask.kind, context_target, rab is not None)
    tiles = tiles or {}
    two_direction = r.two_direction
    if fused is None:
        fused = fp8_backward_fused(p.head_dim, r, max_seqlen_k, rab is not None, has_drab, deterministic)
    elif fused and not fp8_fused_serves(p.head_dim, r, rab is not None, has_drab, deterministic):
        raise ValueError(f"fused=True: the fused FP8 backward serves head dims {FP8_FUSED_HEAD_DIMS}, quant modes "
                         f"0, 2-5, no rab or drab, not deterministic; got head dim {p.head_dim}, quant_mode="
                         f"{r.mode}, rab={rab is not None}, has_drab={has_drab}, deterministic={deterministic}")
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
