"""sm80+ kernels (mma.sync). They run on Ampere, Ada and Hopper; the cubin is built for the
target arch named in the compile key (SASS is not forward compatible across major archs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..masks import MaskKind, MaskSpec


@dataclass(frozen=True)
class AmpereFwdKey:
    """Compile key of :class:`~hstu_cute.ampere.fwd.HstuForwardSm80`: everything baked into a
    cubin. Lengths, batch, heads, strides and scalar values are runtime arguments."""

    kernel_name: ClassVar[str] = "ampere_fwd"

    arch: str  # "sm_80", "sm_89", "sm_90a", ...
    dtype: str  # "bfloat16" | "float16"
    head_dim: int
    mask_kind: int = int(MaskKind.NONE)
    # Context and target share one variant (absent ones are passed as zeros): the extra compares
    # only run on partial tiles. delta_q and seqused are runtime arguments.
    has_context: bool = False
    has_target: bool = False
    has_rab: bool = False
    rab_vec: int = 8  # elements per rab load: 8 (16-byte aligned rows) or 1 (any layout)
    tile_m: int = 128
    tile_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    fast_silu: bool = True
    # Measured 2026-11-20 on the H100, B=8 N=4096 D=128 causal: 323 TF with m-blocks slowest
    # (heaviest first across all heads/batches) vs 270 TF with m-blocks fastest.
    lpt_grid: bool = True
    # ptxas optimization level: -O2 assembles ~0.4 s faster than -O3 on 2 cores (2026-11-20).
    ptxas_opt: int = 3

    @property
    def mask(self) -> MaskSpec:
        return MaskSpec(MaskKind(self.mask_kind), self.has_context, self.has_target)

    def describe(self) -> str:
        extras = [self.mask.name]
        if self.has_rab:
            extras.append(f"rab/{self.rab_vec}")
        return (
            f"{self.kernel_name} {self.arch} {self.dtype} d{self.head_dim} {self.tile_m}x{self.tile_n}"
            f"w{self.num_warps}s{self.num_stages} " + ",".join(extras)
        )


def default_fwd_tiles(head_dim: int) -> dict:
    """(tile_m, tile_n, num_warps, num_stages) per head dim; smem stays <= 99 KB (Ada's limit)
    without rab. Chosen by the benchmark sweep recorded in docs/perf-log.md."""
    if head_dim <= 64:
        # B8 N4096 causal on the H100: 246.9 TF at 128x128 vs 237.3 at 128x64; ptxas -O2 287/272
        # vs -O3 250/257 (interleaved pairs).
        return dict(tile_m=128, tile_n=128, num_warps=4, num_stages=2, ptxas_opt=2)
    if head_dim <= 128:
        # ptxas -O2 337/311 vs -O3 308/305 TF (interleaved pairs, B8 N4096 causal).
        return dict(tile_m=128, tile_n=64, num_warps=4, num_stages=2, ptxas_opt=2)
    # B8 N4096 D256 causal on the H100: 323 TF at 64x64 s1 vs 273 at s2 and 292 at 128x64 w8;
    # ptxas -O3 309/320 vs -O2 294/306.
    return dict(tile_m=64, tile_n=64, num_warps=4, num_stages=1, ptxas_opt=3)


SHIPPED_DTYPES = ("bfloat16", "float16")
SHIPPED_HEAD_DIMS = (32, 64, 128, 256)
# (mask_kind, context+target): none, local, causal, causal with contexts/targets.
SHIPPED_MASKS = ((MaskKind.NONE, False), (MaskKind.LOCAL, False), (MaskKind.CAUSAL, False), (MaskKind.CAUSAL, True))
SHIPPED_RAB = ((False, 8), (True, 8), (True, 1))


def shipped_fwd_keys(arch: str, dtypes=SHIPPED_DTYPES, head_dims=SHIPPED_HEAD_DIMS) -> list[AmpereFwdKey]:
    """Every forward variant the API can select for ``arch`` (what CI compiles, what warmup builds)."""
    keys = []
    for dtype in dtypes:
        for head_dim in head_dims:
            for kind, context_target in SHIPPED_MASKS:
                for has_rab, rab_vec in SHIPPED_RAB:
                    keys.append(make_fwd_key(arch, dtype, head_dim, kind, context_target, has_rab, rab_vec))
    return keys


def make_fwd_key(arch, dtype, head_dim, kind, context_target, has_rab, rab_vec, tiles=None) -> AmpereFwdKey:
    return AmpereFwdKey(
        arch=arch, dtype=dtype, head_dim=head_dim, mask_kind=int(kind),
        has_context=context_target, has_target=context_target, has_rab=has_rab, rab_vec=rab_vec if has_rab else 8,
        # tanh.approx (one MUFU op) is well below bf16's rounding of P; fp16 keeps 3 more mantissa
        # bits, so it takes the exp2 form.
        fast_silu=dtype == "bfloat16",
        **(tiles or dict(default_fwd_tiles(head_dim), lpt_grid=MaskKind(kind) == MaskKind.CAUSAL)),
    )


@dataclass(frozen=True)
class AmpereBwdKey:
    """Compile key shared by the two backward kernels (:mod:`hstu_cute.ampere.bwd`)."""

    role: str  # "dq" (dQ and drab) or "dkdv"
    arch: str
    dtype: str
    head_dim: int
    mask_kind: int = int(MaskKind.NONE)
    has_context: bool = False
    has_target: bool = False
    has_rab: bool = False
    rab_vec: int = 8
    has_drab: bool = False
    rab_sum_heads: bool = False  # one rab head for all heads: dq CTAs loop over heads
    tile_m: int = 64
    tile_n: int = 64
    num_warps: int = 4
    # Warps along the head dim in the GEMMs into dQ (dq) or dK and dV (dkdv). 1 keeps P and G in
    # registers (each warp owns whole rows: 16 x head_dim fp32 per accumulator and warp); > 1
    # splits the accumulators over more warps, G (and P) then pass through smem.
    warps_d: int = 1
    fast_silu: bool = True
    ptxas_opt: int = 2

    @property
    def kernel_name(self) -> str:
        return f"ampere_bwd_{self.role}"

    @property
    def mask(self) -> MaskSpec:
        return MaskSpec(MaskKind(self.mask_kind), self.has_context, self.has_target)

    def describe(self) -> str:
        extras = [self.mask.name]
        if self.has_rab:
            extras.append(f"rab/{self.rab_vec}" + ("+drab" if self.has_drab else "") + ("(sum)" if self.rab_sum_heads else ""))
        split = f"d{self.warps_d}" if self.warps_d > 1 else ""
        return (f"{self.kernel_name} {self.arch} {self.dtype} d{self.head_dim} {self.tile_m}x{self.tile_n}"
                f"w{self.num_warps}{split} " + ",".join(extras))


BWD_HEAD_DIMS = (32, 64, 128, 256)


def default_bwd_tiles(role: str, head_dim: int) -> dict:
    """Tiles of the backward kernels per head dim: no register spills on sm_80 (ptxas -v) and
    dynamic smem within the A100's 163 KB."""
    if head_dim <= 128:
        return dict(tile_m=64, tile_n=64, num_warps=4)
    # ptxas -O3: at -O2 two dQ variants (bf16, rab, no drab) capped themselves at 128 registers
    # and spilled 4 bytes.
    if role == "dq":
        # dQ (64 x 256 fp32) over 8 warps, 4 of them along the head dim: 64 accumulator registers
        # per thread (in 4 warps, 128: fp16 with drab summed over heads spilled). K/V stay
        # double-buffered in 32-key tiles: 140 KB with rab (64-key tiles would need 212 KB).
        return dict(tile_m=64, tile_n=32, num_warps=8, warps_d=4, ptxas_opt=3)
    # dK + dV (2 x 64 x 256 fp32) over 8 warps, 4 of them along the head dim: 128 accumulator
    # registers per thread. 32-query tiles keep Q/dO double-buffered: 144 KB with rab.
    return dict(tile_m=32, tile_n=64, num_warps=8, warps_d=4, ptxas_opt=3)


def make_bwd_keys(arch, dtype, head_dim, kind, context_target, has_rab, rab_vec, has_drab, rab_sum_heads):
    """(dq key, dkdv key) of one backward call."""
    common = dict(arch=arch, dtype=dtype, head_dim=head_dim, mask_kind=int(kind), has_context=context_target,
                  has_target=context_target, has_rab=has_rab, rab_vec=rab_vec if has_rab else 8,
                  fast_silu=dtype == "bfloat16")
    dq = AmpereBwdKey(role="dq", has_drab=has_drab, rab_sum_heads=has_drab and rab_sum_heads, **common,
                      **default_bwd_tiles("dq", head_dim))
    dkdv = AmpereBwdKey(role="dkdv", **common, **default_bwd_tiles("dkdv", head_dim))
    return dq, dkdv


def shipped_bwd_keys(arch: str, dtypes=SHIPPED_DTYPES, head_dims=BWD_HEAD_DIMS) -> list[AmpereBwdKey]:
    keys = []
    for dtype in dtypes:
        for head_dim in head_dims:
            for kind, context_target in SHIPPED_MASKS:
                # The backward always reads rab with 16-byte loads: the launcher pads rab's rows
                # to a multiple of 8 elements when they are not (one copy, rare layouts only).
                for has_rab, has_drab, sum_heads in ((False, False, False), (True, False, False),
                                                     (True, True, False), (True, True, True)):
                    dq, dkdv = make_bwd_keys(arch, dtype, head_dim, kind, context_target, has_rab, 8,
                                             has_drab, sum_heads)
                    keys.append(dq)
                    if dkdv not in keys:
                        keys.append(dkdv)
    return keys


def shipped_keys(arch: str, dtypes=SHIPPED_DTYPES, head_dims=SHIPPED_HEAD_DIMS) -> list:
    """Every variant (forward and backward) the API can select for ``arch``."""
    bwd_dims = tuple(d for d in head_dims if d in BWD_HEAD_DIMS)
    return shipped_fwd_keys(arch, dtypes, head_dims) + (shipped_bwd_keys(arch, dtypes, bwd_dims) if bwd_dims else [])
