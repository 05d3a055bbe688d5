"""Prepared launches: a compile key's compiled kernel with its runtime arguments laid out once per
argument signature (:class:`Prepared`, cached in :attr:`hstu_cute.call.Call.plans`), the
arguments every family takes (the call's sequences and score scalars), and the compile keys of the
forward. A call fills in its tensors by name (:mod:`hstu_cute.kernel_args` orders them).
"""

from __future__ import annotations

import math

import torch

from ..cache import default_cache
from ..compile import build
from ..call import Call
from ..kernel_args import ordered, slots
from ..arch import device_arch
from ..masks import FUNC_TABLE_COLUMNS, func_table_blocks
from ..validation import DTYPE_NAMES, Problem, fail
from ..variants import (
    make_fwd_key,
    make_ampere_paged_fwd_key,
    make_hopper_fp8_fwd_key,
    make_hopper_fwd_key,
    make_hopper_paged_fwd_key,
    make_func_table_key,
)

from .buffers import INT32_MAX, _filler, _on_device, rab_vec, tile_counter


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
        mNumContexts=num_contexts, mNumTargets=num_targets, mFunc=call.func,
    )


def _call_tensors(call: Call) -> dict:
    """The call's own per-sequence tensors, by argument name (absent ones left out: a prepared
    launch has their fillers in place)."""
    values = {"mOffsetsQ": call.seq_offsets_q, "mOffsetsK": call.seq_offsets_k}
    for name, t in (("mSeqUsedQ", call.seqused_q), ("mSeqUsedK", call.seqused_k),
                    ("mNumContexts", call.num_contexts), ("mNumTargets", call.num_targets), ("mFunc", call.func)):
        if t is not None:
            values[name] = t
    if call.func is not None:
        values["mFuncBlocks"] = func_table(call.func, call.seq_offsets_q, call.max_seqlen_q, call.max_seqlen_k)
    return values


def func_table(func: torch.Tensor, seq_offsets_q: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
    """:func:`hstu_cute.masks.func_key_ranges` in one launch after a fill, no sync
    (:class:`hstu_cute.ampere.func_table.FuncTableSm80`)."""
    batch = seq_offsets_q.shape[0] - 1
    table = torch.zeros((batch, func_table_blocks(max_seqlen_q, max_seqlen_k), len(FUNC_TABLE_COLUMNS)), dtype=torch.int32, device=func.device)
    if batch:
        key = _made(make_func_table_key, device_arch(func.device), func.shape[1])
        with _on_device(func.device):
            _launch(key, _compiled(key), dict(mFunc=func, mOffsetsQ=seq_offsets_q, mTable=table))
    return table


def block_sparse_args(call: Call, key, per_key_block: bool = False) -> dict:
    """The block mask at the key's tiles (:meth:`hstu_cute.BlockMask.tile_lists`; on the device,
    no sync) and its kept blocks, for masking inside the tiles that mix kept and dropped blocks.
    The lists a kernel walks: per query block (forward, dQ), or ``per_key_block`` the transposed
    ones (the Hopper dK/dV kernels)."""
    bm = call.block_mask
    tables = bm.kernel_tables(call.seq_offsets_q, call.seq_offsets_k, call.seqused_q, call.seqused_k, key.tile_m,
                              key.tile_n, call.max_seqlen_q, call.max_seqlen_k, call.problem.mask.is_delta_q)
    count, index = (tables.t_count, tables.t_index) if per_key_block else (tables.count, tables.index)
    return dict(mBlockCount=count, mBlockIndex=index, mBlockState=tables.state, mBlockKept=tables.kept_blocks,
                q_block=bm.q_block, k_block=bm.k_block)


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


def _launch(key, compiled, values: dict) -> None:
    compiled(*ordered(key, values))


class Prepared:
    """A compiled kernel with its runtime arguments laid out once for every call of one argument
    signature (:attr:`hstu_cute.call.Call.plans`): ``fixed`` (scalars, fillers, block counts,
    the tile walk) sit in place, a call fills in its tensors by name. A repeated call then costs
    a list copy and the TVM-FFI call (the prepared launches of a step: docs/dev/perf-log.md, session
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
    """``call.plans[key]``, made by ``build()`` the first time (:func:`_cached`)."""
    return _cached(call.plans, key, build)


def _cached(plans: dict | None, key: tuple, build):
    """``plans[key]``, made by ``build()`` the first time (every time without a plan cache: a
    traced call); plans made inside a CUDA-graph capture are not kept (their filler tensors would
    hold values only when the graph replays)."""
    if plans is None:
        return build()
    plan = plans.get(key)
    if plan is None:
        plan = build()
        if not torch.cuda.is_current_stream_capturing():
            plans[key] = plan
    return plan


def fwd_key(p: Problem, arch: str, rab, tiles: dict | None = None, path: str = "ampere", split_keys: bool = False,
            block_sparse: bool = False):
    """The forward compile key of this call (memoized by :func:`_made`); ``split_keys``: the
    variant whose tiles take parts of the key blocks (:func:`key_splits`; sm80: rab rows come
    padded to 16 bytes)."""
    context_target = p.mask.has_context or p.mask.has_target
    dtype = DTYPE_NAMES[p.dtype]
    if path == "hopper":
        if block_sparse:
            return _made(make_hopper_fwd_key, arch, dtype, p.head_dim, p.mask.kind, context_target, rab is not None,
                         tiles, False, True)
        factory = make_hopper_paged_fwd_key if p.page_size else make_hopper_fwd_key
        return _made(factory, arch, dtype, p.head_dim, p.mask.kind, context_target, rab is not None, tiles,
                     split_keys)
    if p.page_size:  # rab rows come padded to 16 bytes (forward)
        return _made(make_ampere_paged_fwd_key, arch, dtype, p.head_dim, p.mask.kind, context_target,
                     rab is not None, 8, tiles, split_keys)
    vec = rab_vec(rab) if rab is not None else 8
    return _made(make_fwd_key, arch, dtype, p.head_dim, p.mask.kind, context_target, rab is not None, vec, tiles,
                 split_keys, block_sparse)


def fp8_fwd_key(p: Problem, arch: str, rab, out_dtype: torch.dtype, tiles: dict | None = None,
                scaled_p: bool = False, two_direction: bool = False):
    context_target = p.mask.has_context or p.mask.has_target
    return _made(make_hopper_fp8_fwd_key, arch, DTYPE_NAMES[out_dtype], p.head_dim, p.mask.kind, context_target,
                 rab is not None, tiles, scaled_p, two_direction)


def _nothing_to_do(q, k, max_seqlen_q: int, p: Problem) -> bool:
    """No query or key token: every gradient is zero and no kernel runs."""
    return q.shape[0] == 0 or k.shape[0] == 0 or max_seqlen_q == 0 or p.batch == 0
