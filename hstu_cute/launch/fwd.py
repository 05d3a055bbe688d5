"""The forward launch of a validated call (:func:`forward`): 16-bit and FP8 kernels, split keys,
the paged KV cache, on the current torch stream (CUDA-graph capture works).
"""

from __future__ import annotations

import torch

from ..arch import device_arch, kernel_path, num_sms
from ..call import Call
from ..validation import Problem
from ..variants import block_sparse_hopper_fwd_tiles

from .buffers import _on_device, aligned_16, empty_as, pad_rab_rows, rab_vec, split_arrivals
from .heuristics import _walk_fixed, key_splits
from ..kv_cache import cache_rows, rab_among_new, target_key_rows
from .prepared import (Prepared, _call_tensors, _plan, _scalar_args, _sequence_args, block_sparse_args, fp8_fwd_key,
                       fwd_key)


def forward(q, k, v, rab, call: Call, tiles: dict | None = None, out: torch.Tensor | None = None,
            path: str | None = None, fp8=None, splits: int | None = None) -> torch.Tensor:
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
        out = empty_as(q, None if fp8 is None else fp8.out_dtype)
    if call.seqused_q is not None:
        out.zero_()  # padding rows (past seqused_q) are never written by the kernel
    if q.shape[0] == 0 or call.max_seqlen_q == 0 or p.batch == 0 or k.shape[0] == 0:
        return out.zero_()
    q, k = aligned_16(q), aligned_16(k)
    v = aligned_16(v) if fp8 is None else fp8.vt
    if rab is not None and (path == "hopper" or p.page_size):
        rab = pad_rab_rows(rab)  # TMA (and the paged sm80 key) need 16-byte aligned rows
    fp8_kind = None if fp8 is None else (fp8.out_dtype, fp8.scaled_p, fp8.two_direction)
    block_sparse = call.block_mask is not None
    if block_sparse:
        splits = 1
    blocks = (call.block_mask.q_block, call.block_mask.k_block) if block_sparse else None
    plan_key = ("fwd", path, rab_vec(rab) if rab is not None else 0, k.shape[0], splits, fp8_kind, call.alpha,
                call.target_group_size, blocks)

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
    if block_sparse:
        values.update(block_sparse_args(call, key))
    if p.page_size:
        values.update(_paged_args(p, call.paged))
        # Keys past the cache: the targets' rows of k / v (call.seq_offsets_k counts keys, not rows).
        values["mOffsetsK"], values["mSeqUsedK"], history = target_key_rows(call.seq_offsets_q, call.num_targets)
        if rab is not None:
            values["mRabNew"] = rab_among_new(rab, call.paged.page_offsets, call.paged.last_page_lens, p.page_size,
                                              history, call.max_seqlen_q)
    # The launch goes to the current device's current stream (TVM-FFI env stream); switching
    # devices costs ~10 us, so only do it when q lives elsewhere.
    with _on_device(device):
        prepared(values, device)
    return out


def _forward_plan(call: Call, device, rab, tokens_k: int, path: str, tiles, fp8, splits) -> tuple:
    """(the prepared forward launch, the key splits it takes) of ``call``'s signature."""
    p = call.problem
    if fp8 is None:
        block_mask = call.block_mask
        if block_mask is not None and path == "hopper" and tiles is None:
            tiles = block_sparse_hopper_fwd_tiles(p.head_dim, rab is not None, block_mask.q_block, block_mask.k_block)
        key = fwd_key(p, device_arch(device), rab, tiles, path, block_sparse=block_mask is not None)
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
    """The paged cache's per-call runtime arguments: its rows (:func:`hstu_cute.kv_cache.cache_rows`)
    and its tables."""
    return dict(mCache=cache_rows(paged.kv_cache, p.page_size), mPageOffsets=paged.page_offsets,
                mPageIds=paged.page_ids, mLastPageLens=paged.last_page_lens)
