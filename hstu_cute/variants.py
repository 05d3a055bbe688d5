"""Every shipped kernel variant per target arch, in one place (what ``warmup`` and
``python -m hstu_cute warmup`` precompile, what CI compiles).

* every arch: the Ampere (mma.sync) forward and backward kernels (:func:`hstu_cute.ampere.shipped_keys`);
  on sm90 they still serve the backward, and the forward under ``HSTU_CUTE_ARCH=sm80``;
* ``sm_90*``: also the Hopper (TMA + WGMMA) forward kernels
  (:func:`hstu_cute.hopper.shipped_hopper_fwd_keys`) and dK/dV kernels
  (:func:`hstu_cute.hopper.shipped_hopper_bwd_keys`), the defaults there.

Imports no torch or cutlass (the key modules are plain dataclasses).
"""

from __future__ import annotations

from .ampere import SHIPPED_DTYPES, SHIPPED_HEAD_DIMS
from .ampere import shipped_keys as _ampere_shipped_keys

__all__ = ["shipped_keys", "has_hopper_kernels"]


def has_hopper_kernels(arch: str) -> bool:
    """Whether the Hopper kernels exist for the cubin arch ``arch`` (``"sm_90a"``, ...)."""
    return arch.startswith("sm_90")


def shipped_keys(arch: str, dtypes=SHIPPED_DTYPES, head_dims=SHIPPED_HEAD_DIMS) -> list:
    """Every compile key (forward and backward, every kernel family) the API can select for ``arch``."""
    dtypes, head_dims = tuple(dtypes), tuple(head_dims)
    keys = _ampere_shipped_keys(arch, dtypes, head_dims)
    if has_hopper_kernels(arch):
        from .hopper import HOPPER_BWD_HEAD_DIMS, HOPPER_HEAD_DIMS, shipped_hopper_bwd_keys, shipped_hopper_fwd_keys

        hopper_dims = tuple(d for d in head_dims if d in HOPPER_HEAD_DIMS)
        if hopper_dims:
            keys += shipped_hopper_fwd_keys(arch, dtypes, hopper_dims)
        bwd_dims = tuple(d for d in head_dims if d in HOPPER_BWD_HEAD_DIMS)
        if bwd_dims:
            keys += shipped_hopper_bwd_keys(arch, dtypes, bwd_dims)
    return keys
