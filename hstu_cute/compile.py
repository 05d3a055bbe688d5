"""Turn a compile key into a compiled module: the kernel object from the key's static config,
fake tensors with symbolic sizes from the family's argument spec (:mod:`hstu_cute.kernel_args`),
``cute.compile`` with the TVM-FFI calling convention (torch tensors are passed directly, the
stream is the current torch stream). Needs no GPU: the target arch comes from the key."""

from __future__ import annotations

import inspect
import os
import threading

from . import kernel_args
from .kernel_args import dsl_dtype

_COMPILE_LOCK = threading.Lock()  # cute.compile keeps thread-local MLIR state: one at a time


def _hopper_quant_slots(key):
    from .hopper.quantize_slots import QuantizeSlotsSm90

    return QuantizeSlotsSm90(dsl_dtype(key.dtype), key.head_dim, key.slots)


def _hopper_vt(key):
    from .hopper.vt import VTransposeSm90

    return VTransposeSm90(dsl_dtype(key.dtype), key.head_dim)


def _func_table(key):
    from .ampere.func_table import FuncTableSm80

    return FuncTableSm80(key.n_func)


def _ampere_fwd(key):
    from .ampere.fwd import HstuForwardSm80

    return HstuForwardSm80(dsl_dtype(key.dtype), key.head_dim, key.mask, key.has_rab, key.rab_vec, key.tile_m,
                           key.tile_n, key.num_warps, key.num_stages, key.fast_silu, key.lpt_grid, paged=key.paged,
                           split_keys=key.split_keys, block_sparse=getattr(key, "block_sparse", False))


def _ampere_bwd(key):
    from .ampere.bwd import HstuBackwardDkDvSm80, HstuBackwardDqSm80

    cls = HstuBackwardDqSm80 if key.role == "dq" else HstuBackwardDkDvSm80
    return cls(dsl_dtype(key.dtype), key.head_dim, key.mask, key.has_rab, key.has_drab, key.rab_sum_heads,
               key.tile_m, key.tile_n, key.num_warps, key.fast_silu, key.warps_d, block_sparse=key.block_sparse)


def _hopper_fwd(key):
    from .hopper.fwd import HstuForwardSm90

    return HstuForwardSm90(dsl_dtype(key.dtype), key.head_dim, key.mask, key.has_rab, key.tile_m, key.tile_n,
                           key.num_stages, key.fast_silu, key.intra_wg_overlap, key.pingpong, key.persistent,
                           key.q_stages, key.dynamic_tiles, paged=key.paged, split_keys=key.split_keys,
                           staged_epilogue=key.staged_epilogue, block_sparse=key.block_sparse)


def _hopper_fwd_fp8(key):
    from .hopper.fwd import HstuForwardFp8Sm90

    return HstuForwardFp8Sm90(dsl_dtype(key.dtype), key.head_dim, key.mask, key.has_rab, key.tile_m, key.tile_n,
                              key.num_stages, key.fast_silu, key.intra_wg_overlap, key.pingpong, key.persistent,
                              key.q_stages, key.dynamic_tiles, out_dtype=dsl_dtype(key.out_dtype),
                              scaled_p=key.scaled_p, two_direction=key.two_direction, early_silu=key.early_silu,
                              staged_epilogue=key.staged_epilogue)


def _hopper_bwd(key):
    from .hopper.bwd import HstuBackwardDkDvSm90, HstuBackwardDqSm90
    from .hopper.bwd_wide import HstuBackwardWideSm90

    dtype = dsl_dtype(key.dtype)
    if key.role == "wide":
        return HstuBackwardWideSm90(dtype, key.head_dim, key.mask, key.has_rab, key.has_drab, key.rab_sum_heads,
                                    key.tile_m, key.tile_n, key.num_stages, key.fast_silu)
    if key.role == "dq":
        return HstuBackwardDqSm90(dtype, key.head_dim, key.mask, key.has_rab, key.tile_m, key.tile_n,
                                  key.num_stages, key.fast_silu, persistent=key.persistent,
                                  dynamic_tiles=key.dynamic_tiles)
    return HstuBackwardDkDvSm90(dtype, key.head_dim, key.mask, key.has_rab, key.tile_m, key.tile_n, key.num_stages,
                                key.fast_silu, fuse_dq=key.role == "fused", persistent=key.persistent,
                                dynamic_tiles=key.dynamic_tiles, block_sparse=key.block_sparse,
                                zero_ahead=key.zeroes_dq_ahead)


def _hopper_bwd_fp8(key):
    from .hopper.bwd_fp8 import HstuBackwardDkDvFp8Sm90, HstuBackwardDqFp8Sm90

    cls = HstuBackwardDqFp8Sm90 if key.role == "dq" else HstuBackwardDkDvFp8Sm90
    extra = (dict(has_drab=key.has_drab, rab_sum_heads=key.rab_sum_heads) if key.role == "dq"
             else dict(dim_parts=key.dim_parts, fuse_dq=key.role == "fused"))
    return cls(key.head_dim, key.mask, key.has_rab, key.tile_m, key.tile_n, key.num_stages,
               dsl_dtype(key.out_dtype), persistent=key.persistent, dynamic_tiles=key.dynamic_tiles,
               two_direction=key.two_direction, **extra)


KERNELS = {"ampere_fwd": _ampere_fwd, "ampere_fwd_paged": _ampere_fwd, "ampere_bwd_dq": _ampere_bwd, "ampere_bwd_dkdv": _ampere_bwd,
           "hopper_fwd": _hopper_fwd, "hopper_fwd_paged": _hopper_fwd, "hopper_fwd_fp8": _hopper_fwd_fp8, "hopper_fwd_vt": _hopper_vt,
           "hopper_fwd_quant_slots": _hopper_quant_slots, "func_table": _func_table, "hopper_bwd_dkdv": _hopper_bwd,
           "hopper_bwd_fused": _hopper_bwd,
           "hopper_bwd_dq": _hopper_bwd, "hopper_bwd_wide": _hopper_bwd, "hopper_bwd_fp8_dkdv": _hopper_bwd_fp8,
           "hopper_bwd_fp8_dq": _hopper_bwd_fp8, "hopper_bwd_fp8_fused": _hopper_bwd_fp8}


def kernel_for(key):
    """The kernel object of ``key`` (static config only; nothing traced yet)."""
    return KERNELS[key.kernel_name](key)


def check_signature(key, kernel) -> None:
    """The kernel's ``__call__`` takes exactly the spec's arguments, in order, then the stream."""
    params = list(inspect.signature(kernel.__call__).parameters)
    expected = [a.name for a in kernel_args.spec(key)] + ["stream"]
    if params != expected:
        raise TypeError(f"{type(kernel).__name__}.__call__: expected parameters {expected} "
                        f"(hstu_cute.kernel_args.SPECS[{key.kernel_name!r}]), got {params}")


def build(key):
    """Compile ``key`` now (no caching here; see :mod:`hstu_cute.cache`). ``cute.compile`` with
    the trailing stream argument (the caller's torch stream at run time), the key's arch and
    ptxas level; one compile at a time. Without a JIT engine when the cache exports the module
    and loads the exported object (:func:`hstu_cute.cache.building_for_export`)."""
    os.environ.setdefault("CUTE_DSL_ARCH", key.arch)
    import cutlass.cute as cute

    from .cache import building_for_export

    kernel = kernel_for(key)
    check_signature(key, kernel)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = f"--enable-tvm-ffi --gpu-arch {key.arch}"
    if key.ptxas_opt != 3:
        options += f" --ptxas-options=-O{key.ptxas_opt}"
    with _COMPILE_LOCK:
        return cute.compile(kernel, *kernel_args.fake_args(key), stream, options=options,
                            no_jit_engine=building_for_export())
