"""Turn a compile key into a compiled module: fake tensors with symbolic sizes, ``cute.compile``
with the TVM-FFI calling convention (torch tensors are passed directly, the stream is the current
torch stream). Needs no GPU: the target arch comes from the key."""

from __future__ import annotations

import os
import threading

_COMPILE_LOCK = threading.Lock()  # cute.compile keeps thread-local MLIR state: one at a time


def _dsl_dtype(name: str):
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[name]


def _int_vec(n):
    import cutlass
    import cutlass.cute as cute

    return cute.runtime.make_fake_compact_tensor(cutlass.Int32, (n,), assumed_align=4)


def _compile(key, kernel, *args):
    """``cute.compile`` with the trailing stream argument (the caller's torch stream at run time),
    the key's arch and ptxas level; one compile at a time. Without a JIT engine when the cache
    exports the module and loads the exported object (:func:`hstu_cute.cache.building_for_export`)."""
    import cutlass.cute as cute

    from .cache import building_for_export

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = f"--enable-tvm-ffi --gpu-arch {key.arch}"
    if key.ptxas_opt != 3:
        options += f" --ptxas-options=-O{key.ptxas_opt}"
    with _COMPILE_LOCK:
        return cute.compile(kernel, *args, stream, options=options, no_jit_engine=building_for_export())


def _fake_tokens_heads_dim(dtype, tokens, heads, head_dim):
    """(T, H, D) view with a 64-bit token stride (global offsets never overflow int32) and a
    16-byte aligned head stride."""
    import cutlass.cute as cute

    stride_t = cute.sym_int64(divisibility=8)
    stride_h = cute.sym_int(divisibility=8)
    return cute.runtime.make_fake_tensor(dtype, (tokens, heads, head_dim), (stride_t, stride_h, 1), assumed_align=16)


def _fake_rab_rows_aligned(dtype):
    """(B, H_rab, L_q, L_k) rab whose rows start 16-byte aligned (what TMA needs; the launchers
    pad rab when they do not)."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(
        dtype, tuple(cute.sym_int() for _ in range(4)),
        (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1),
        assumed_align=16,
    )


def build_ampere_fwd(key):
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from .ampere.fwd import HstuForwardSm80

    dtype = _dsl_dtype(key.dtype)
    kernel = HstuForwardSm80(
        dtype,
        key.head_dim,
        key.mask,
        key.has_rab,
        key.rab_vec,
        key.tile_m,
        key.tile_n,
        key.num_warps,
        key.num_stages,
        key.fast_silu,
        key.lpt_grid,
    )
    t_q, t_k, heads = cute.sym_int(), cute.sym_int(), cute.sym_int()
    batch, batch1 = cute.sym_int(), cute.sym_int()
    q = _fake_tokens_heads_dim(dtype, t_q, heads, key.head_dim)
    k = _fake_tokens_heads_dim(dtype, t_k, heads, key.head_dim)
    v = _fake_tokens_heads_dim(dtype, t_k, heads, key.head_dim)
    o = _fake_tokens_heads_dim(dtype, t_q, heads, key.head_dim)
    offsets_q, offsets_k = _int_vec(batch1), _int_vec(batch1)
    seqused_q, seqused_k = _int_vec(batch), _int_vec(batch)
    num_contexts = _int_vec(batch) if key.has_context else None
    num_targets = _int_vec(batch) if key.has_target else None
    rab = None
    if key.has_rab:
        rab = cute.runtime.make_fake_tensor(
            dtype,
            (cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()),
            (cute.sym_int64(divisibility=key.rab_vec), cute.sym_int64(divisibility=key.rab_vec),
             cute.sym_int(divisibility=key.rab_vec), 1),
            assumed_align=2 * key.rab_vec,
        )
    return _compile(key, kernel, q, k, v, o, offsets_q, offsets_k, seqused_q, seqused_k, num_contexts, num_targets,
                    rab, Float32(1.0), Float32(1.0), Int32(0), Int32(0), Int32(1), Int32(0), Int32(1))


def build_ampere_bwd(key):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from .ampere.bwd import HstuBackwardDkDvSm80, HstuBackwardDqSm80

    dtype = _dsl_dtype(key.dtype)
    cls = HstuBackwardDqSm80 if key.role == "dq" else HstuBackwardDkDvSm80
    kernel = cls(dtype, key.head_dim, key.mask, key.has_rab, key.rab_vec, key.has_drab, key.rab_sum_heads,
                 key.tile_m, key.tile_n, key.num_warps, key.fast_silu, key.warps_d)
    t_q, t_k, heads = cute.sym_int(), cute.sym_int(), cute.sym_int()
    batch, batch1 = cute.sym_int(), cute.sym_int()
    q, do, dq = (_fake_tokens_heads_dim(dtype, t_q, heads, key.head_dim) for _ in range(3))
    k, v, dk, dv = (_fake_tokens_heads_dim(dtype, t_k, heads, key.head_dim) for _ in range(4))

    def slab(elem, vec, rank):
        shape = tuple(cute.sym_int() for _ in range(rank))
        stride = tuple(cute.sym_int64(divisibility=vec) for _ in range(rank - 2)) + (cute.sym_int(divisibility=vec), 1)
        return cute.runtime.make_fake_tensor(elem, shape, stride, assumed_align=max(elem.width // 8 * vec, 4))

    offsets_q, offsets_k, seqused_q, seqused_k = _int_vec(batch1), _int_vec(batch1), _int_vec(batch), _int_vec(batch)
    num_contexts = _int_vec(batch) if key.has_context else None
    num_targets = _int_vec(batch) if key.has_target else None
    rab = slab(dtype, key.rab_vec, 4) if key.has_rab else None
    scalars = (Float32(1.0), Float32(1.0), Int32(0), Int32(0), Int32(1), Int32(0), Int32(1))
    if key.role == "dq":
        drab = slab(dtype, 1, 4) if key.has_drab else None
        drab_accum = slab(cutlass.Float32, 1, 3) if key.rab_sum_heads else None
        args = (q, k, v, do, dq, offsets_q, offsets_k, seqused_q, seqused_k, num_contexts, num_targets, rab, drab,
                drab_accum)
    else:
        args = (q, k, v, do, dk, dv, offsets_q, offsets_k, seqused_q, seqused_k, num_contexts, num_targets, rab)
    return _compile(key, kernel, *args, *scalars)


def build_hopper_fwd(key):
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from .hopper.fwd import HstuForwardSm90

    dtype = _dsl_dtype(key.dtype)
    kernel = HstuForwardSm90(dtype, key.head_dim, key.mask, key.has_rab, key.tile_m, key.tile_n, key.num_stages,
                             key.fast_silu, key.intra_wg_overlap, key.pingpong, key.persistent)
    t_q, t_k, heads = cute.sym_int(), cute.sym_int(), cute.sym_int()
    batch, batch1 = cute.sym_int(), cute.sym_int()
    q, o = (_fake_tokens_heads_dim(dtype, t_q, heads, key.head_dim) for _ in range(2))
    k, v = (_fake_tokens_heads_dim(dtype, t_k, heads, key.head_dim) for _ in range(2))
    rab = _fake_rab_rows_aligned(dtype) if key.has_rab else None
    args = (q, k, v, o, _int_vec(batch1), _int_vec(batch1), _int_vec(batch), _int_vec(batch),
            _int_vec(batch) if key.has_context else None, _int_vec(batch) if key.has_target else None, rab)
    return _compile(key, kernel, *args, Float32(1.0), Float32(1.0), Int32(0), Int32(0), Int32(1), Int32(0), Int32(1),
                    Int32(1), Int32(1))


def build_hopper_bwd(key):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from .hopper.bwd import HstuBackwardDkDvSm90, HstuBackwardDqSm90
    from .hopper.bwd_wide import HstuBackwardWideSm90

    dtype = _dsl_dtype(key.dtype)
    if key.role == "wide":
        kernel = HstuBackwardWideSm90(dtype, key.head_dim, key.mask, key.has_rab, key.has_drab, key.rab_sum_heads,
                                      key.tile_m, key.tile_n, key.num_stages, key.fast_silu)
    elif key.role == "dq":
        kernel = HstuBackwardDqSm90(dtype, key.head_dim, key.mask, key.has_rab, key.tile_m, key.tile_n,
                                    key.num_stages, key.fast_silu, persistent=key.persistent)
    else:
        kernel = HstuBackwardDkDvSm90(dtype, key.head_dim, key.mask, key.has_rab, key.tile_m, key.tile_n,
                                      key.num_stages, key.fast_silu, fuse_dq=key.role == "fused",
                                      persistent=key.persistent)
    t_q, t_k, heads = cute.sym_int(), cute.sym_int(), cute.sym_int()
    batch, batch1 = cute.sym_int(), cute.sym_int()
    q, do, dq = (_fake_tokens_heads_dim(dtype, t_q, heads, key.head_dim) for _ in range(3))
    k, v, dk, dv = (_fake_tokens_heads_dim(dtype, t_k, heads, key.head_dim) for _ in range(4))
    rab = _fake_rab_rows_aligned(dtype) if key.has_rab else None
    # The fused kernel reduces dQ into an fp32 (T_q, H, D) accumulator through TMA (16-byte strides).
    dq_accum = cute.runtime.make_fake_tensor(
        cutlass.Float32, (t_q, heads, key.head_dim), (cute.sym_int64(divisibility=4), cute.sym_int(divisibility=4), 1),
        assumed_align=16,
    )
    outs = {"dkdv": (dk, dv, None), "fused": (dk, dv, dq_accum), "dq": (dq,), "wide": (dk, dv)}[key.role]
    args = (q, k, v, do, *outs, _int_vec(batch1), _int_vec(batch1), _int_vec(batch), _int_vec(batch),
            _int_vec(batch) if key.has_context else None, _int_vec(batch) if key.has_target else None, rab)
    if key.role == "wide":
        # drab: (B, H_rab, L_q, L_k) in the input dtype, or the fp32 (B, L_q, L_k) sum over heads.
        drab = None
        if key.has_drab:
            rank, elem = (3, cutlass.Float32) if key.rab_sum_heads else (4, dtype)
            drab = cute.runtime.make_fake_tensor(
                elem, tuple(cute.sym_int() for _ in range(rank)),
                tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,), assumed_align=4)
        args += (drab,)
    grid_args = (Int32(1),) if key.role == "wide" else (Int32(1), Int32(1))  # blocks[, SMs]
    return _compile(key, kernel, *args, Float32(1.0), Float32(1.0), Int32(0), Int32(0), Int32(1), Int32(0),
                    *grid_args)


BUILDERS = {"hopper_fwd": build_hopper_fwd, "hopper_bwd_dkdv": build_hopper_bwd, "hopper_bwd_dq": build_hopper_bwd,
            "hopper_bwd_fused": build_hopper_bwd, "hopper_bwd_wide": build_hopper_bwd, "ampere_fwd": build_ampere_fwd, "ampere_bwd_dq": build_ampere_bwd, "ampere_bwd_dkdv": build_ampere_bwd}


def build(key):
    """Compile ``key`` now (no caching here; see :mod:`hstu_cute.cache`)."""
    os.environ.setdefault("CUTE_DSL_ARCH", key.arch)
    return BUILDERS[key.kernel_name](key)
