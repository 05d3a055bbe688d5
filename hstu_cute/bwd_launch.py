"""Backward launch: allocate gradients, pick the two backward kernels, launch them on the current
stream. Called by :func:`hstu_cute.api.backward` after validation (done in the forward)."""

from __future__ import annotations

import contextlib

import torch

from .ampere import BWD_HEAD_DIMS, make_bwd_keys


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}

# At D128 the fused kernel runs for key sequences of at least this many tokens, the pair below.
# H100, D128 bf16 causal backward, same runs (docs/perf-log.md session 7), TF/s pair vs fused:
# B64 N512 177 vs 133, B32 N1024 266 vs 183, B16 N2048 386 vs 318 (uniform lengths 359 vs 308):
# the fused kernel's one CTA per n-block walks few m-blocks there. At N4096 the fused kernel
# is ahead on zipf lengths (352 vs 265), context + targets (390 vs 359) and without a mask (532
# vs 510), and 2% behind on full causal batches (465 vs 473).
FUSED_MIN_SEQLEN_K = 2049


@contextlib.contextmanager
def _beside(device):
    """Launches in the body go to a side stream forked from, and joined back into, the current
    stream (CUDA-graph capture included): the dK/dV and dQ kernels are independent, so the second
    fills the SMs the first leaves idle in its last wave."""
    main = torch.cuda.current_stream(device)
    side = _SIDE_STREAMS.get(device.index)
    if side is None:
        if torch.cuda.is_current_stream_capturing():
            # No stream creation inside a CUDA-graph capture: this call runs in line.
            yield
            return
        side = _SIDE_STREAMS[device.index] = torch.cuda.Stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        yield
    main.wait_stream(side)


def run_backward(dout, q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, num_contexts,
                 num_targets, target_group_size, alpha, rab, has_drab, seqused_q, seqused_k, p,
                 deterministic=False, tiles_dq: dict | None = None, tiles_dkdv: dict | None = None,
                 path: str | None = None):
    """Returns (dq, dk, dv, drab or None).

    ``path`` 'hopper' (default on sm90): at head dim 128, without drab, unless ``deterministic``
    and for keys of at least ``FUSED_MIN_SEQLEN_K`` tokens, one fused TMA + WGMMA kernel computes
    dK, dV and reduces dQ into an fp32 accumulator (the order of that sum varies run to run);
    otherwise a dK/dV kernel and a dQ kernel (the sm80 one when drab is wanted), each summing in
    a fixed order. At head dim 256 the wide dK/dV/drab kernel and the dQ kernel (deterministic,
    except the sum of drab over heads for one rab head unless ``deterministic``). 'ampere': the
    sm80 dK/dV and dQ kernels at every head dim, deterministic."""
    from . import api
    from .cache import default_cache
    from .compile import build
    from .hopper import HOPPER_FUSED_HEAD_DIMS, HOPPER_WIDE_HEAD_DIMS, make_hopper_bwd_key

    if path is None:
        path = api.kernel_path(q.device)
    wide = path == "hopper" and p.head_dim in HOPPER_WIDE_HEAD_DIMS
    if p.head_dim not in BWD_HEAD_DIMS:
        raise NotImplementedError(f"q.shape[2] (head dim): the backward kernels support {BWD_HEAD_DIMS}, got {p.head_dim}")
    zero_q, zero_k = seqused_q is not None, seqused_k is not None
    dq = (torch.zeros if zero_q else torch.empty)(q.shape, dtype=q.dtype, device=q.device)
    dk = (torch.zeros if zero_k else torch.empty)(k.shape, dtype=k.dtype, device=k.device)
    dv = (torch.zeros if zero_k else torch.empty)(v.shape, dtype=v.dtype, device=v.device)
    drab = torch.zeros_like(rab) if has_drab else None
    if q.shape[0] == 0 or k.shape[0] == 0 or max_seqlen_q == 0 or p.batch == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), drab
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    q, k, v, dout = (api._aligned_16(t) for t in (q, k, v, dout))

    device, batch = q.device, p.batch
    drab_view = None
    if rab is not None and api._rab_vec(rab) != 8:
        # Rows not 16-byte aligned (e.g. max_seqlen_k % 8 != 0): the kernels read a padded copy,
        # and drab is returned as a view of a padded gradient.
        cols = rab.shape[3]
        rab = api.pad_rab_rows(rab)
        if has_drab:
            drab = torch.zeros_like(rab)
            drab_view = drab[..., :cols]
    rab_vec = 8
    sum_heads = has_drab and rab is not None and rab.shape[1] == 1 and p.heads > 1
    if seqused_q is None:
        seqused_q = api._filler(batch, device, api.INT32_MAX)
    if seqused_k is None:
        seqused_k = api._filler(batch, device, api.INT32_MAX)
    context_target = p.mask.has_context or p.mask.has_target
    if context_target:
        num_contexts = num_contexts if num_contexts is not None else api._filler(batch, device, 0)
        num_targets = num_targets if num_targets is not None else api._filler(batch, device, 0)
    scalars = (float(alpha), 1.0 / p.scale_seqlen, p.window_left, p.window_right, int(target_group_size),
               int(p.mask.is_delta_q))
    arch, dtype_name = api.device_arch(device), api._DTYPE_NAMES[p.dtype]
    if wide:
        common = (arch, dtype_name, p.head_dim, p.mask.kind, context_target, rab is not None)
        # drab of one rab head over H heads: atomic fp32 sums, or (deterministic) per-head drab
        # summed afterwards in a fixed order.
        atomic_sum = sum_heads and not deterministic
        key_kv = make_hopper_bwd_key("wide", *common, tiles_dkdv, has_drab=has_drab, rab_sum_heads=atomic_sum)
        key_q = make_hopper_bwd_key("dq", *common, tiles_dq)
        fn_kv = default_cache().get(key_kv, lambda: build(key_kv))
        fn_q = default_cache().get(key_q, lambda: build(key_q))
        drab_out = drab
        if atomic_sum:
            drab_out = torch.zeros((rab.shape[0], rab.shape[2], rab.shape[3]), dtype=torch.float32, device=device)
        elif sum_heads:
            drab_out = torch.zeros((rab.shape[0], p.heads, rab.shape[2], rab.shape[3]), dtype=q.dtype, device=device)
        with torch.cuda.device(device):
            fn_kv(q, k, v, dout, dk, dv, seq_offsets_q, seq_offsets_k, seqused_q, seqused_k, num_contexts, num_targets,
                  rab, drab_out, *scalars, -(-max_seqlen_k // key_kv.tile_n))
            with _beside(device):
                fn_q(q, k, v, dout, dq, seq_offsets_q, seq_offsets_k, seqused_q, seqused_k, num_contexts,
                     num_targets, rab, *scalars, -(-max_seqlen_q // key_q.tile_m), api._num_sms(device))
            if sum_heads:
                drab[:, 0].copy_(drab_out if atomic_sum else drab_out.float().sum(1))
        return dq, dk, dv, (drab_view if drab_view is not None else drab)
    key_dq, key_dkdv = make_bwd_keys(arch, dtype_name, p.head_dim, p.mask.kind, context_target, rab is not None,
                                     rab_vec, has_drab, sum_heads)
    if tiles_dq or tiles_dkdv:  # benchmark sweeps only
        import dataclasses

        # The Hopper keys below take them whole; with drab the sm80 dQ kernel runs on that path too.
        if path != "hopper" or has_drab:
            key_dq = dataclasses.replace(key_dq, **(tiles_dq or {}))
        if path != "hopper":
            key_dkdv = dataclasses.replace(key_dkdv, **(tiles_dkdv or {}))
    fused = (path == "hopper" and not has_drab and not deterministic and p.head_dim in HOPPER_FUSED_HEAD_DIMS
             and max_seqlen_k >= FUSED_MIN_SEQLEN_K)
    if path == "hopper":
        common = (key_dkdv.arch, key_dkdv.dtype, p.head_dim, p.mask.kind, key_dkdv.has_context, rab is not None)
        key_dkdv = make_hopper_bwd_key("fused" if fused else "dkdv", *common, tiles_dkdv)
        if not has_drab and not fused:  # drab (and its sum over heads) comes from the sm80 dQ kernel
            key_dq = make_hopper_bwd_key("dq", *common, tiles_dq)
    cache = default_cache()
    fn_dq = None if fused else cache.get(key_dq, lambda: build(key_dq))
    fn_dkdv = cache.get(key_dkdv, lambda: build(key_dkdv))
    drab_accum = None
    if sum_heads:
        drab_accum = torch.zeros((rab.shape[0], rab.shape[2], rab.shape[3]), dtype=torch.float32, device=device)
    num_m_blocks = -(-max_seqlen_q // key_dq.tile_m)
    num_n_blocks = -(-max_seqlen_k // key_dkdv.tile_n)
    with torch.cuda.device(device):
        if fused:
            dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=device)
            fn_dkdv(q, k, v, dout, dk, dv, dq_accum, seq_offsets_q, seq_offsets_k, seqused_q, seqused_k,
                    num_contexts, num_targets, rab, *scalars, num_n_blocks, api._num_sms(device))
            return dq_accum.to(q.dtype), dk, dv, None
        # The Hopper dK/dV kernel takes no dQ accumulator here, and the SM count (persistent grid).
        hopper = path == "hopper"
        fn_dkdv(q, k, v, dout, dk, dv, *((None,) if hopper else ()), seq_offsets_q, seq_offsets_k, seqused_q,
                seqused_k, num_contexts, num_targets, rab, *scalars, num_n_blocks,
                *((api._num_sms(device),) if hopper else ()))
        with _beside(device):
            if key_dq.kernel_name == "hopper_bwd_dq":
                fn_dq(q, k, v, dout, dq, seq_offsets_q, seq_offsets_k, seqused_q, seqused_k, num_contexts,
                      num_targets, rab, *scalars, num_m_blocks, api._num_sms(device))
            else:
                fn_dq(q, k, v, dout, dq, seq_offsets_q, seq_offsets_k, seqused_q, seqused_k, num_contexts,
                      num_targets, rab, drab, drab_accum, *scalars, num_m_blocks)
    return dq, dk, dv, (drab_view if drab_view is not None else drab)
