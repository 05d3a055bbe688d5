"""FP8: the quantizer launches of a call's recipe (:func:`quantize_for`, the slot quantizer),
the FP8 forward's operands (:func:`prepare_fp8`, :func:`forward_fp8`) and the FP8 backward
(:func:`backward_fp8`: dO's quantization, then the dK/dV kernel and the dQ kernel beside it, or the
fused kernel).
"""

from __future__ import annotations

import functools
import math

import torch

from ..arch import device_arch, kernel_path, num_sms
from ..call import Call
from ..validation import DTYPE_NAMES, Problem
from ..variants import (
    FP8_BWD_HEAD_DIMS,
    FP8_DTYPE,
    FP8_FUSED_HEAD_DIMS,
    make_hopper_fp8_bwd_key,
    make_hopper_quant_slots_key,
    make_hopper_vt_key,
    vt_width,
)
from ..fp8_format import QUANT_MAX_SLOTS, SCALE_FLOOR
from ..fp8_recipe import Fp8Recipe, ScaleGroup, quant_launches, recipe
from ..quantize import num_blocks

from .buffers import (
    _aligned_rab_and_drab,
    _drab_over_heads,
    _gradient_buffers,
    _on_device,
    _sum_drab_heads,
    aligned_16,
    unit_descale,
    unit_descale_table,
    zeros_as,
)
from .fwd import forward
from .heuristics import _walk_fixed, fp8_backward_fused, fp8_fused_serves
from .prepared import (Prepared, _cached, _call_tensors, _compiled, _launch, _made, _nothing_to_do, _plan, _scalar_args,
                       _sequence_args)


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


# Every piece of a quantizer call's arena starts at a multiple of this many bytes (TMA and the
# 16-byte vector stores need 16; 256 keeps pieces off each other's cache lines).
_PIECE_ALIGN = 256


class _QuantPlan:
    """:func:`quantize_for` for one signature, laid out once: the slot quantizer's launches
    (:class:`Prepared`, their block counts in place) and where each e4m3 copy and scale table lives.
    A call then makes one allocation (an arena the copies and tables are views of; a training
    call's V^T, which only the forward reads, in a second one, so that the backward's saved copies
    do not hold it), plus the zeroed group words of modes 3-5: a mode-2 training step made 12
    allocations in these launches before (tools/host.py standin, session 37).

    ``views``: per view ``(arena, shape, strides, element offset)``, arena 0/1 (e4m3 or fp32 of
    the first arena), 2 (e4m3 of the second), 3 (the group words), or a constant tensor;
    ``fills``: ``(view, value, column)`` floor scales where an input has no tokens (``column``:
    also the reciprocal half of a (B, blocks, H, 2, D) table); ``slots``: per launch, per slot
    ``(argument names, input, table view or None, plain view or None, transposed view or None)``;
    ``copies``: ``(input, "plain" / "transposed", data view, table view)``."""

    __slots__ = ("nbytes", "vt_nbytes", "words", "views", "fills", "launches", "copies")

    def __init__(self, r: Fp8Recipe, purpose: str, xs: tuple, batch: int, max_seqlens: tuple, device):
        x0 = xs[0]
        heads, head_dim = x0.shape[1], x0.shape[2]
        arch = device_arch(device)
        blocks = [num_blocks(m) for m in max_seqlens]
        empty = [batch == 0 or x.shape[0] == 0 for x in xs]
        self.nbytes = self.vt_nbytes = self.words = 0
        self.views, self.fills, self.launches, self.copies = [], [], [], []
        separate_vt = purpose == "training"

        def view(arena, shape, itemsize: int) -> int:
            strides = tuple(int(math.prod(shape[d + 1:])) for d in range(len(shape)))
            size = -(-math.prod(shape) * itemsize // _PIECE_ALIGN) * _PIECE_ALIGN
            if arena == 2:
                offset, self.vt_nbytes = self.vt_nbytes, self.vt_nbytes + size
            else:
                offset, self.nbytes = self.nbytes, self.nbytes + size
            self.views.append((arena, shape, strides, offset // itemsize))
            return len(self.views) - 1

        tables: dict = {}  # (input, table family) -> (the kernel's table, the copies' table), as views
        if r.group is ScaleGroup.NONE:
            self.views.append(unit_descale_table(device, batch, heads))
            for i in range(len(xs)):
                tables[i, "unit"] = (None, len(self.views) - 1)
        if r.grouped:
            # The blocks max each group's scale in here, every block of a group sees it (zero
            # strides along the (B, blocks, H) dims it spans); the word after the tables counts the
            # grid barrier's arrivals: one memset for all.
            size, strides = r.group_table(batch, heads)
            self.words = len(xs) * size + 1
            for i in range(len(xs)):
                self.views += [(3, (batch, blocks[i], heads), strides, i * size), (3, (batch, 1, heads), strides, i * size)]
                tables[i, "group"] = (len(self.views) - 2, len(self.views) - 1)
                if empty[i]:  # every word of the group's scales, whatever the view's zero strides reach
                    self.views.append((3, (size,), (1,), i * size))
                    self.fills.append((len(self.views) - 1, SCALE_FLOOR, False))
        for launch_slots, slot_specs in _quant_plan(r.mode, purpose):
            key = _made(make_hopper_quant_slots_key, arch, DTYPE_NAMES[x0.dtype], head_dim, slot_specs)
            fixed, slots = {}, []
            if r.grouped:
                fixed["num_sms"] = num_sms(device)
            for names, (i, role, plain, transposed) in zip(_SLOT_ARGS, launch_slots):
                family = r.table_family(role)
                table = tables.get((i, family))
                if table is None:
                    shape = {"token": (xs[i].shape[0], heads),
                             "column": (batch, blocks[i], heads, 2, head_dim)}.get(family, (batch, blocks[i], heads))
                    table = tables[i, family] = (view(1, shape, 4),) * 2
                    if empty[i]:
                        self.fills.append((table[0], SCALE_FLOOR, family == "column"))
                out = view(0, tuple(xs[i].shape), 1) if plain else None
                vt = view(2 if separate_vt and i == 2 else 0,
                          (heads, head_dim, vt_width(xs[i].shape[0], batch)), 1) if transposed else None
                fixed[names[5]] = 0 if empty[i] else blocks[i]
                slots.append((names, i, table[0], out, vt))  # the unit family's kernel takes no table
                if plain:
                    self.copies.append((i, "plain", out, table[1]))
                if transposed:
                    self.copies.append((i, "transposed", vt, table[1]))
            runs = not all(empty[i] for i, *_ in launch_slots)
            self.launches.append((Prepared(key, fixed), tuple(slots), runs))

    def __call__(self, xs: tuple, offsets: tuple, device) -> list[dict]:
        arenas = [None] * 4
        if self.nbytes:
            arena = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            arenas[0], arenas[1] = arena.view(torch.float8_e4m3fn), arena.view(torch.float32)
        if self.vt_nbytes:
            arenas[2] = torch.empty(self.vt_nbytes, dtype=torch.float8_e4m3fn, device=device)
        if self.words:
            arenas[3] = torch.zeros(self.words, dtype=torch.float32, device=device)
        views = [v if type(v) is torch.Tensor else arenas[v[0]].as_strided(v[1], v[2], v[3]) for v in self.views]
        for fill, value, column in self.fills:
            views[fill].fill_(value)
            if column:
                views[fill][:, :, :, 1] = 1.0 / SCALE_FLOOR
        aligned = [aligned_16(x) for x in xs]
        with _on_device(device):
            for prepared, slots, runs in self.launches:
                # The last group word counts the cooperative launch's grid-barrier arrivals.
                values = {"mBarrier": arenas[3][-1:].view(torch.int32)} if self.words else {}
                for names, i, table, out, vt in slots:
                    values[names[0]] = aligned[i]
                    values[names[1]] = offsets[i]
                    if table is not None:
                        values[names[2]] = views[table]
                    if out is not None:
                        values[names[3]] = views[out]
                    if vt is not None:
                        values[names[4]] = views[vt]
                if runs:
                    prepared(values, device)
        copies: list[dict] = [{} for _ in xs]
        for i, name, data, table in self.copies:
            copies[i][name] = (views[data], views[table])
        return copies


def quantize_for(mode, purpose: str, xs: tuple, offsets: tuple, max_seqlens: tuple,
                 plans: dict | None = None) -> list[dict]:
    """Quantize the 16-bit (T, H, D) tensors ``xs`` (q, k, v; or dO) with ``mode`` (a quant mode
    0-5 or its :class:`~hstu_cute.fp8_recipe.Fp8Recipe`) for
    ``purpose`` (:func:`hstu_cute.variants.quant_launches`: one launch of the slot quantizer,
    :mod:`hstu_cute.hopper.quantize_slots`, mode 1 two) and return, per tensor, its copies by
    name: ``"plain"`` (T, H, D) e4m3 and/or ``"transposed"`` V^T (H, D, W)
    (:func:`transposed_for_pv`'s layout), each as ``(data, descale table)``. The table is (B,
    blocks, H) for mode 2, a zero-strided (B, 1, H) view of the group's scale for modes 3-5;
    mode 1's plain tables are (T, H) (per token), its transposed ones (B, blocks, H, 2, D): per
    block and dim the scale, then its reciprocal; mode 0's are zero-strided (B, 1, H) views of a
    cached one. Every shape depends only on shapes (no sync). ``plans``: a call's cache of
    prepared launches (:attr:`hstu_cute.call.Call.plans`), where the layout is kept
    (:class:`_QuantPlan`)."""
    r = mode if isinstance(mode, Fp8Recipe) else recipe(mode)
    device = xs[0].device
    batch = offsets[0].shape[0] - 1
    plan_key = ("quant", r.mode, purpose, xs[0].dtype, tuple(x.shape[0] for x in xs), tuple(max_seqlens))

    def build():
        return _QuantPlan(r, purpose, xs, batch, max_seqlens, device)

    return _cached(plans, plan_key, build)(xs, offsets, device)


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
                          (call.max_seqlen_q, call.max_seqlen_k, call.max_seqlen_k), call.plans)
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
    if dout.stride()[-1] != 1:
        dout = dout.contiguous()
    r = call.problem.recipe
    two_direction = r.two_direction
    if quantized is None:
        quantized = kept_for_backward(
            quantize_for(r, "training", (q, k, v), (call.seq_offsets_q, call.seq_offsets_k, call.seq_offsets_k),
                         (call.max_seqlen_q, call.max_seqlen_k, call.max_seqlen_k), call.plans), two_direction)
    (copies,) = quantize_for(r, "gradient", (dout,), (call.seq_offsets_q,), (call.max_seqlen_q,), call.plans)
    (do8, table_do), (dot, table_dot) = copies["plain"], copies["transposed"]
    operands = dict(quantized, mdO=do8, mdOt=dot, mDescaleDO=table_do)
    if two_direction:
        operands["mDescaleDOt"] = table_dot
    return operands


def _fp8_backward_plan(call: Call, device, fused: bool, has_rab: bool, has_drab: bool, atomic_sum: bool,
                       tokens_q: int, tokens_k: int, tiles: dict) -> tuple:
    """The FP8 backward's prepared launches (:class:`Prepared`) for one argument signature: the
    fused kernel alone, or the dK/dV kernel then the dQ kernel. The launches' fixed arguments
    (scalars, fillers, block counts, the tile walk) are laid out once, as the 16-bit backward's."""
    p = call.problem
    max_q, max_k = call.max_seqlen_q, call.max_seqlen_k
    context_target = p.mask.has_context or p.mask.has_target
    common = (device_arch(device), DTYPE_NAMES[p.dtype], p.head_dim, p.mask.kind, context_target, has_rab)
    base = dict(**_sequence_args(call, device, context_target), **_scalar_args(call), num_sms=num_sms(device))
    if fused:
        key = _made(make_hopper_fp8_bwd_key, "fused", *common, tiles.get("fused"))
        return (Prepared(key, dict(base, num_n_blocks=-(-max_k // key.tile_n), **_walk_fixed(key, p, tokens_q, max_q))),)
    two_direction = p.recipe.two_direction
    key_kv = _made(make_hopper_fp8_bwd_key, "dkdv", *common, tiles.get("dkdv"), two_direction=two_direction)
    key_q = _made(make_hopper_fp8_bwd_key, "dq", *common, tiles.get("dq"), has_drab, atomic_sum,
                  two_direction=two_direction)
    # The dK/dV walk counts dim_parts n-blocks per key block (D256: two CTAs, each with half of D).
    return (Prepared(key_kv, dict(base, num_n_blocks=key_kv.dim_parts * -(-max_k // key_kv.tile_n),
                                  **_walk_fixed(key_kv, p, tokens_q, max_q))),
            Prepared(key_q, dict(base, num_m_blocks=-(-max_q // key_q.tile_m), **_walk_fixed(key_q, p, tokens_k, max_k))))


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
    tiles = tiles or {}
    if fused is None:
        fused = fp8_backward_fused(p.head_dim, r, max_seqlen_k, rab is not None, has_drab, deterministic)
    elif fused and not fp8_fused_serves(p.head_dim, r, rab is not None, has_drab, deterministic):
        raise ValueError(f"fused=True: the fused FP8 backward serves head dims {FP8_FUSED_HEAD_DIMS}, quant modes "
                         f"0, 2-5, no rab or drab, not deterministic; got head dim {p.head_dim}, quant_mode="
                         f"{r.mode}, rab={rab is not None}, has_drab={has_drab}, deterministic={deterministic}")
    plan_key = ("bwd_fp8", fused, rab is not None, q.shape[0], k.shape[0], has_drab, atomic_sum, call.alpha,
                call.target_group_size)

    def build():
        return _fp8_backward_plan(call, device, fused, rab is not None, has_drab, atomic_sum, q.shape[0], k.shape[0],
                                  tiles)

    plan = _plan(call, plan_key, build) if not tiles else build()
    values = dict(operands, mdQ=dq, mdK=dk, mdV=dv, mRab=rab, mdRab=drab_out, **_call_tensors(call))
    with _on_device(device):
        if fused:
            dq_accum = values["mdQaccum"] = zeros_as(q, torch.float32)
            plan[0](values, device)
            return dq_accum.to(q.dtype), dk, dv, None
        if "dkdv" in kernels:
            plan[0](values, device)
        # One stream, as the 16-bit backward: dQ beside dK/dV on a side stream took the same
        # device time (mode 2, B32 N1024: 0.251 ms both ways, CUDA graphs) and ~75 us more host
        # time per FP8 step (docs/dev/perf-log.md, session 37).
        if "dq" in kernels:
            plan[1](values, device)
    _sum_drab_heads(drab, drab_out)
    return dq, dk, dv, drab_view
