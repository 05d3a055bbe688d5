"""sm90a kernels: TMA loads, WGMMA, a producer warp feeding consumer warpgroups through mbarrier
pipelines. The forward is :class:`~hstu_cute.hopper.fwd.HstuForwardSm90`; the backward is
:mod:`hstu_cute.hopper.bwd` (head dims 32-128) and :mod:`hstu_cute.hopper.bwd_wide` (256). FP8
raises ``NotImplementedError``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..ampere import SHIPPED_DTYPES, SHIPPED_MASKS
from ..masks import MaskKind, MaskSpec


@dataclass(frozen=True)
class HopperFwdKey:
    """Compile key of :class:`~hstu_cute.hopper.fwd.HstuForwardSm90` (everything baked into the
    cubin; lengths, batch, heads, strides and scalars are runtime arguments). rab always has
    16-byte aligned rows here: TMA needs them, the launcher pads rab when they are not."""

    kernel_name: ClassVar[str] = "hopper_fwd"

    arch: str  # "sm_90a"
    dtype: str
    head_dim: int
    mask_kind: int = int(MaskKind.NONE)
    has_context: bool = False
    has_target: bool = False
    has_rab: bool = False
    tile_m: int = 128  # 64 rows per consumer warpgroup
    tile_n: int = 128
    num_stages: int = 2
    fast_silu: bool = True
    intra_wg_overlap: bool = True
    pingpong: bool = True
    # Persistent CTAs walk LPT-ordered tiles in a snake order (docs/perf-log.md 2026-11-21: a
    # plain stride lost to one tile per CTA, 465 vs 533 TF; the snake order won, D256 612 vs 544).
    persistent: bool = True
    ptxas_opt: int = 3

    @property
    def mask(self) -> MaskSpec:
        return MaskSpec(MaskKind(self.mask_kind), self.has_context, self.has_target)

    def describe(self) -> str:
        extras = [self.mask.name] + (["rab"] if self.has_rab else [])
        flags = ("o" if self.intra_wg_overlap else "") + ("p" if self.pingpong else "") + (
            "P" if self.persistent else "")
        return (f"{self.kernel_name} {self.arch} {self.dtype} d{self.head_dim} {self.tile_m}x{self.tile_n}"
                f"s{self.num_stages}{flags} " + ",".join(extras))


@dataclass(frozen=True)
class HopperBwdKey:
    """Compile key of the sm90 backward kernels (:mod:`hstu_cute.hopper.bwd`): role "fused"
    (:class:`~hstu_cute.hopper.bwd.HstuBackwardDkDvSm90` with its dQ reduction: the default),
    or the deterministic pair "dkdv" + "dq" (:class:`~hstu_cute.hopper.bwd.HstuBackwardDqSm90`,
    calls without drab; with drab the sm80 dQ kernel pairs with "dkdv"); at head dim 256 role
    "wide" (:class:`~hstu_cute.hopper.bwd_wide.HstuBackwardWideSm90`: dK, dV and drab) + "dq"."""

    role: str
    arch: str
    dtype: str
    head_dim: int
    mask_kind: int = int(MaskKind.NONE)
    has_context: bool = False
    has_target: bool = False
    has_rab: bool = False
    has_drab: bool = False  # role "wide" only (the others leave drab to the sm80 dQ kernel)
    rab_sum_heads: bool = False  # role "wide": drab of one rab head summed over H > 1 heads
    tile_m: int = 64  # queries per m-block (dq: per CTA, 64 per consumer warpgroup)
    tile_n: int = 128  # keys per CTA (dkdv: 64 per consumer warpgroup; dq: per n-block)
    num_stages: int = 2
    fast_silu: bool = True
    ptxas_opt: int = 3
    persistent: bool = False  # roles "dkdv" / "fused" / "dq": one CTA per SM walking the tiles

    @property
    def kernel_name(self) -> str:
        return f"hopper_bwd_{self.role}"

    @property
    def mask(self) -> MaskSpec:
        return MaskSpec(MaskKind(self.mask_kind), self.has_context, self.has_target)

    def describe(self) -> str:
        extras = ([self.mask.name] + (["rab"] if self.has_rab else []) + (["drab"] if self.has_drab else [])
                  + (["sum_heads"] if self.rab_sum_heads else []))
        return (f"{self.kernel_name} {self.arch} {self.dtype} d{self.head_dim} {self.tile_m}x{self.tile_n}"
                f"s{self.num_stages}{'P' if self.persistent else ''} " + ",".join(extras))


HOPPER_BWD_HEAD_DIMS = (32, 64, 128, 256)
# Persistent dK/dV and dQ kernels (H100 B8 N4096 causal, docs/perf-log.md session 6): D128 pair
# 437.6 vs 422.4 TF, D64 322-324 vs 304-306; the fused kernel stays one CTA per n-block (a tile
# loop slows its m-block loop: 402-418 vs 443-448).
_BWD_TILES = {"dkdv": dict(tile_m=64, tile_n=128, persistent=True),
              "fused": dict(tile_m=64, tile_n=128),
              "dq": dict(tile_m=128, tile_n=64, persistent=True), "wide": dict(tile_m=64, tile_n=64)}
# dQ at D256: Q and dO (2 x 64 KB) stay resident, so K/V tiles of 48 keys (32 beside rab's ring)
# keep two stages in smem (H100 B8 N4096 causal, with the wide kernel: 369.4 TF at 128 x 48,
# 359.5-363.5 at 128 x 32, 331.6 at 128 x 64 with one stage).
_BWD_TILES_D256 = {"dq": dict(tile_m=128, tile_n=48, num_stages=2, persistent=True)}
_BWD_TILES_D256_RAB = {"dq": dict(tile_m=128, tile_n=32, num_stages=2, persistent=True)}
HOPPER_BWD_ROLES = ("fused", "dkdv", "dq", "wide")
# Head dims of the wide dK/dV/drab kernel; it pairs with the dQ kernel there.
HOPPER_WIDE_HEAD_DIMS = (256,)
# (has_rab, has_drab, rab_sum_heads) of the wide kernel's variants.
_WIDE_RAB = ((False, False, False), (True, False, False), (True, True, False), (True, True, True))
# Head dims where the fused kernel is the default (no drab, not deterministic, keys of at least
# bwd_launch.FUSED_MIN_SEQLEN_K tokens). H200, B8 N4096 causal bf16, same run (docs/perf-log.md
# 2026-11-21): D128 fused 431 vs pair 404 TF; D64 fused 252 vs pair 280 (at D64 the per-m-block
# barriers and dQ reduce are not hidden by the GEMMs).
HOPPER_FUSED_HEAD_DIMS = (128,)


def make_hopper_bwd_key(role, arch, dtype, head_dim, kind, context_target, has_rab, tiles=None, has_drab=False,
                        rab_sum_heads=False) -> HopperBwdKey:
    return HopperBwdKey(role=role, arch=arch, dtype=dtype, head_dim=head_dim, mask_kind=int(kind),
                        has_context=context_target, has_target=context_target, has_rab=has_rab, has_drab=has_drab,
                        rab_sum_heads=rab_sum_heads, fast_silu=dtype == "bfloat16",
                        **(tiles or hopper_bwd_tiles(role, head_dim, has_rab)))


def hopper_bwd_tiles(role: str, head_dim: int, has_rab: bool) -> dict:
    if head_dim in HOPPER_WIDE_HEAD_DIMS:
        return (_BWD_TILES_D256_RAB if has_rab else _BWD_TILES_D256).get(role, _BWD_TILES[role])
    return _BWD_TILES[role]


def _role_serves(role: str, head_dim: int) -> bool:
    if head_dim in HOPPER_WIDE_HEAD_DIMS:
        return role in ("wide", "dq")
    return role != "wide" and (role != "fused" or head_dim in HOPPER_FUSED_HEAD_DIMS)


def shipped_hopper_bwd_keys(arch: str = "sm_90a", dtypes=SHIPPED_DTYPES, head_dims=HOPPER_BWD_HEAD_DIMS) -> list:
    return [
        make_hopper_bwd_key(role, arch, dtype, head_dim, kind, context_target, has_rab, has_drab=has_drab,
                            rab_sum_heads=sum_heads)
        for role in HOPPER_BWD_ROLES
        for dtype in dtypes
        for head_dim in head_dims
        if _role_serves(role, head_dim)
        for kind, context_target in SHIPPED_MASKS
        for has_rab, has_drab, sum_heads in (_WIDE_RAB if role == "wide" else ((False, False, False),
                                                                               (True, False, False)))
    ]


def default_hopper_fwd_tiles(head_dim: int, has_rab: bool) -> dict:
    """(tile_m, tile_n, num_stages, ptxas_opt) per head dim; smem <= 227 KB with the rab ring.
    H100, B8 N4096 causal (2026-11-21): D128 persistent -O2 565.6 TF vs -O3 462.3; tile_n 176 and
    3 stages were slower; D256 128x64 612 vs 128x80 582."""
    if head_dim <= 128:
        return dict(tile_m=128, tile_n=128, num_stages=2, ptxas_opt=2)
    return dict(tile_m=128, tile_n=64, num_stages=2, ptxas_opt=3)


HOPPER_HEAD_DIMS = (32, 64, 128, 256)


def make_hopper_fwd_key(arch, dtype, head_dim, kind, context_target, has_rab, tiles=None) -> HopperFwdKey:
    return HopperFwdKey(
        arch=arch, dtype=dtype, head_dim=head_dim, mask_kind=int(kind), has_context=context_target,
        has_target=context_target, has_rab=has_rab, fast_silu=dtype == "bfloat16",
        **(tiles or default_hopper_fwd_tiles(head_dim, has_rab)),
    )


def shipped_hopper_fwd_keys(arch: str = "sm_90a", dtypes=SHIPPED_DTYPES, head_dims=HOPPER_HEAD_DIMS) -> list:
    return [
        make_hopper_fwd_key(arch, dtype, head_dim, kind, context_target, has_rab)
        for dtype in dtypes
        for head_dim in head_dims
        for kind, context_target in SHIPPED_MASKS
        for has_rab in (False, True)
    ]
