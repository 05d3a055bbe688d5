"""Every compile key, the default tiles per head dim, and the shipped variant lists, in one place.

A compile key is a frozen dataclass holding everything baked into one cubin; lengths, batch,
heads, strides and scalar values are runtime arguments (:mod:`hstu_cute.kernel_args`). The
shipped lists are what ``warmup`` precompiles and CI compiles:

* every arch: the sm80 (mma.sync) forward and backward kernels; on sm90 they still serve the
  backward with drab below D256, and everything under ``HSTU_CUTE_ARCH=sm80``;
* ``sm_90*``: also the Hopper (TMA + WGMMA) forward kernels and backward kernels (fused D128,
  the deterministic dK/dV + dQ pair, the wide D256 dK/dV/drab kernel), the defaults there.

Imports neither torch nor cutlass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .arch import has_hopper_kernels
from .fp8_format import vt_width
from .fp8_recipe import QUANT_PURPOSES, quant_launches
from .masks import MaskKind, MaskSpec

#: The head dims every kernel family supports (forward and backward, sm80 and sm90).
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
#: The head dims of the shipped (precompiled) lists. D96 and D192 compile on first use
#: (:func:`jit_only_keys`): shipping them would add 336 sm_90a variants, about a third of CI's cold
#: compile on 2 cores.
SHIPPED_HEAD_DIMS = (32, 64, 128, 256)
#: The 16-bit input dtypes, by DSL name.
DTYPES = ("bfloat16", "float16")
# (mask_kind, context+target): none, local, causal, causal with contexts/targets. Context and
# target share one variant (absent ones are passed as zeros): the extra compares only run on
# partial tiles. delta_q and seqused are runtime arguments.
SHIPPED_MASKS = ((MaskKind.NONE, False), (MaskKind.LOCAL, False), (MaskKind.CAUSAL, False), (MaskKind.CAUSAL, True))

__all__ = [
    "HEAD_DIMS", "SHIPPED_HEAD_DIMS", "DTYPES", "SHIPPED_MASKS", "AmpereFwdKey", "AmpereBwdKey", "HopperFwdKey", "HopperBwdKey",
    "KEY_CLASSES", "make_fwd_key", "make_bwd_keys", "make_hopper_fwd_key", "make_hopper_bwd_key",
    "HopperFp8FwdKey", "make_hopper_fp8_fwd_key", "FP8_DTYPE", "FP8_HEAD_DIMS", "HopperFp8BwdKey",
    "make_hopper_fp8_bwd_key", "FP8_BWD_HEAD_DIMS", "FP8_FUSED_HEAD_DIMS", "HopperVtKey",
    "HopperQuantSlotsKey", "make_hopper_quant_slots_key",
    "quant_launches", "QUANT_PURPOSES", "shipped_quant_slots", "HopperPagedFwdKey", "make_hopper_paged_fwd_key",
    "PAGED_MASKS",
    "PAGE_SIZES", "SPLIT_KEY_MASKS", "AmperePagedFwdKey", "make_ampere_paged_fwd_key",
    "make_hopper_vt_key", "vt_width", "FuncTableKey", "make_func_table_key",
    "shipped_keys", "has_hopper_kernels",
]


@dataclass(frozen=True)
class _Variant:
    """The fields every compile key has, in this order (after a backward key's ``role``: see
    :class:`_BwdVariant`), the mask of the variant and a one-line description. A key's repr, which
    lists its fields in order, is its cache key: reordering them invalidates every cached module."""

    arch: str  # "sm_80", "sm_89", "sm_90a", ... (the Hopper keys: "sm_90a")
    dtype: str  # "bfloat16" | "float16"
    head_dim: int
    mask_kind: int = int(MaskKind.NONE)
    has_context: bool = False
    has_target: bool = False
    has_rab: bool = False

    @property
    def mask(self) -> MaskSpec:
        return MaskSpec(MaskKind(self.mask_kind), self.has_context, self.has_target)

    def _describe(self, shape: str, extras: list[str]) -> str:
        return f"{self.kernel_name} {self.arch} {self.dtype} d{self.head_dim} {shape} " + ",".join(
            [self.mask.name] + extras)


def _fast_silu(dtype: str) -> bool:
    # tanh.approx (one MUFU op) is well below bf16's rounding of P; fp16 keeps 3 more mantissa
    # bits, so it takes the exp2 form.
    return dtype == "bfloat16"


def _variant_fields(arch, dtype, head_dim, kind, context_target: bool, has_rab: bool) -> dict:
    """The :class:`_Variant` fields of a key (and its ``fast_silu``) from the key factories' arguments."""
    return dict(arch=arch, dtype=dtype, head_dim=head_dim, mask_kind=int(kind), has_context=context_target,
                has_target=context_target, has_rab=has_rab, fast_silu=_fast_silu(dtype))


@dataclass(frozen=True)
class _Role:
    role: str


@dataclass(frozen=True)
class _BwdVariant(_Variant, _Role):
    """The fields of a backward key: ``role`` first (dataclasses take the fields of the bases in
    reverse MRO order: :class:`_Role`'s, then :class:`_Variant`'s), then these two."""

    kernel_family: ClassVar[str]

    has_drab: bool = False
    rab_sum_heads: bool = False  # drab of one rab head for all heads (summed over the heads)

    @property
    def kernel_name(self) -> str:
        return f"{self.kernel_family}_{self.role}"


# ---------------------------------------------------------------------------------------------
# sm80 (mma.sync): hstu_cute.ampere
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AmpereFwdKey(_Variant):
    """Compile key of :class:`~hstu_cute.ampere.fwd.HstuForwardSm80`."""

    kernel_name: ClassVar[str] = "ampere_fwd"
    paged: ClassVar[bool] = False

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
    # A tile's key blocks split into parts over CTAs, the last CTA to finish adds the fp32 parts
    # (HstuForwardSm80 split_keys; launch.key_splits picks the parts).
    split_keys: bool = False
    # A block mask: every tile walks its list of key tiles (hstu_cute.block_mask.TileLists).
    block_sparse: bool = False

    def describe(self) -> str:
        return self._describe(f"{self.tile_m}x{self.tile_n}w{self.num_warps}s{self.num_stages}"
                              + ("k" if self.split_keys else ""),
                              ([f"rab/{self.rab_vec}"] if self.has_rab else [])
                              + (["block-sparse"] if self.block_sparse else []))


def default_fwd_tiles(head_dim: int) -> dict:
    """(tile_m, tile_n, num_warps, num_stages) per head dim; smem stays <= 99 KB (Ada's limit)
    without rab. Chosen by the benchmark sweep recorded in docs/dev/perf-log.md."""
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


def make_fwd_key(arch, dtype, head_dim, kind, context_target, has_rab, rab_vec, tiles=None,
                 split_keys: bool = False, block_sparse: bool = False) -> AmpereFwdKey:
    return AmpereFwdKey(
        **_variant_fields(arch, dtype, head_dim, kind, context_target, has_rab), rab_vec=rab_vec if has_rab else 8,
        **(tiles or dict(default_fwd_tiles(head_dim), lpt_grid=MaskKind(kind) in (MaskKind.CAUSAL, MaskKind.FUNC))),
        split_keys=split_keys, block_sparse=block_sparse,
    )


@dataclass(frozen=True)
class AmperePagedFwdKey(AmpereFwdKey):
    """Compile key of :class:`~hstu_cute.ampere.fwd.HstuForwardSm80` reading each sequence's
    cached keys and values from a paged KV cache ahead of its new ones (common.key_blocks)."""

    kernel_name: ClassVar[str] = "ampere_fwd_paged"
    paged: ClassVar[bool] = True


def make_ampere_paged_fwd_key(arch, dtype, head_dim, kind, context_target, has_rab, rab_vec,
                              tiles=None, split_keys: bool = False) -> AmperePagedFwdKey:
    return AmperePagedFwdKey(
        **_variant_fields(arch, dtype, head_dim, kind, context_target, has_rab), rab_vec=rab_vec if has_rab else 8,
        **(tiles or dict(default_fwd_tiles(head_dim), lpt_grid=False)), split_keys=split_keys,
    )


@dataclass(frozen=True)
class AmpereBwdKey(_BwdVariant):
    """Compile key shared by the two sm80 backward kernels (:mod:`hstu_cute.ampere.bwd`): role
    "dq" (dQ and drab; with ``rab_sum_heads`` its CTAs loop over the heads) or "dkdv". rab is
    always read with 16-byte loads: the launcher pads its rows when they are not aligned."""

    kernel_family: ClassVar[str] = "ampere_bwd"

    tile_m: int = 64
    tile_n: int = 64
    num_warps: int = 4
    # Warps along the head dim in the GEMMs into dQ (dq) or dK and dV (dkdv). 1 keeps P and G in
    # registers (each warp owns whole rows: 16 x head_dim fp32 per accumulator and warp); > 1
    # splits the accumulators over more warps, G (and P) then pass through smem.
    warps_d: int = 1
    fast_silu: bool = True
    ptxas_opt: int = 2
    # A block mask: dQ walks each tile's list of key tiles, dK/dV skips tiles without a kept block.
    block_sparse: bool = False

    def describe(self) -> str:
        rab = (["rab" + ("+drab" if self.has_drab else "") + ("(sum)" if self.rab_sum_heads else "")]
               if self.has_rab else [])
        split = f"d{self.warps_d}" if self.warps_d > 1 else ""
        return self._describe(f"{self.tile_m}x{self.tile_n}w{self.num_warps}{split}",
                              rab + (["block-sparse"] if self.block_sparse else []))


def default_bwd_tiles(role: str, head_dim: int) -> dict:
    """Tiles of the sm80 backward kernels per head dim: no register spills on sm_80 (ptxas -v)
    and dynamic smem within the A100's 163 KB."""
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


def make_bwd_keys(arch, dtype, head_dim, kind, context_target, has_rab, has_drab, rab_sum_heads,
                  block_sparse: bool = False):
    """(dq key, dkdv key) of one sm80 backward call."""
    common = _variant_fields(arch, dtype, head_dim, kind, context_target, has_rab)
    dq = AmpereBwdKey(role="dq", has_drab=has_drab, rab_sum_heads=has_drab and rab_sum_heads, **common,
                      **default_bwd_tiles("dq", head_dim), block_sparse=block_sparse)
    dkdv = AmpereBwdKey(role="dkdv", **common, **default_bwd_tiles("dkdv", head_dim), block_sparse=block_sparse)
    return dq, dkdv


# ---------------------------------------------------------------------------------------------
# sm90 (TMA + WGMMA): hstu_cute.hopper
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HopperFwdKey(_Variant):
    """Compile key of :class:`~hstu_cute.hopper.fwd.HstuForwardSm90`. rab always has 16-byte
    aligned rows here: TMA needs them, the launcher pads rab when they are not."""

    kernel_name: ClassVar[str] = "hopper_fwd"
    # Keys ahead of the new ones from a paged KV cache (HopperPagedFwdKey).
    paged: ClassVar[bool] = False

    tile_m: int = 128  # 64 rows per consumer warpgroup
    tile_n: int = 128
    num_stages: int = 2
    fast_silu: bool = True
    intra_wg_overlap: bool = True
    pingpong: bool = True
    # Persistent CTAs walk LPT-ordered tiles in a snake order (docs/dev/perf-log.md 2026-11-21: a
    # plain stride lost to one tile per CTA, 465 vs 533 TF; the snake order won, D256 612 vs 544).
    persistent: bool = True
    ptxas_opt: int = 3
    # Q tiles in smem: with 2 the producer loads the next tile's Q while the consumers still
    # read this one's (persistent CTAs on short sequences, where a tile has few n-blocks).
    q_stages: int = 1
    # Persistent CTAs claim tiles from a global counter instead of walking a static snake
    # (common.tile_scheduler.TileClaims): jagged batches balance whatever their lengths.
    dynamic_tiles: bool = False
    # A tile's key blocks split into parts over CTAs, fp32 partial outputs summed by the launcher
    # (HstuForwardSm90 split_keys; launch.key_splits picks the parts).
    split_keys: bool = False
    # The output through smem and a TMA store where the smem fits (hopper.base.StagedEpilogue);
    # False: register stores only ("r" in the description).
    staged_epilogue: bool = True
    # A block mask: every tile walks its list of key tiles (hstu_cute.block_mask.TileLists).
    block_sparse: bool = False

    def describe(self) -> str:
        flags = ("o" if self.intra_wg_overlap else "") + ("p" if self.pingpong else "") + (
            "P" if self.persistent else "") + (f"q{self.q_stages}" if self.q_stages != 1 else "") + (
            "d" if self.dynamic_tiles else "") + ("k" if self.split_keys else "") + (
            "" if self.staged_epilogue else "r")
        return self._describe(f"{self.tile_m}x{self.tile_n}s{self.num_stages}{flags}",
                              (["rab"] if self.has_rab else []) + (["block-sparse"] if self.block_sparse else []))


def default_hopper_fwd_tiles(head_dim: int, has_rab: bool) -> dict:
    """(tile_m, tile_n, num_stages, ptxas_opt) per head dim; smem <= 227 KB with the rab ring.
    H100, B8 N4096 causal (2026-11-21): D128 persistent -O2 565.6 TF vs -O3 462.3; tile_n 176 and
    3 stages were slower; D256 128x64 612 vs 128x80 582."""
    if head_dim <= 128:
        # A second Q stage (smem 192 KB at D128; with the rab ring it would not fit): B32 N1024
        # 400 vs 359 TF, B128 N512 292 vs 279, elsewhere within noise (H100, session 9).
        return dict(tile_m=128, tile_n=128, num_stages=2, ptxas_opt=2, q_stages=1 if has_rab else 2,
                    dynamic_tiles=True)
    return dict(tile_m=128, tile_n=64, num_stages=2, ptxas_opt=3, dynamic_tiles=True)


def block_sparse_hopper_fwd_tiles(head_dim: int, has_rab: bool, q_block: int, k_block: int) -> dict:
    """The Hopper block-sparse forward's tiles for a mask of ``q_block`` x ``k_block`` blocks: the
    default tiles where they divide the blocks; else 64 x 64 where those do, so that no tile mixes
    kept and dropped blocks. H200, D128 causal (docs/dev/perf-log.md session 38): B8 H32 N16384,
    10 % of 64 x 64 blocks kept, 64 x 64 tiles 6.26 ms, 128 x 64 9.03, 128 x 128 15.43, 64 x 128
    22.73; with 32 x 32 blocks (NSA's seed settings at 64K) 64 x 64 tiles were slower (the whole
    forward 7.01 against 6.48 ms), so smaller blocks keep the default."""
    tiles = default_hopper_fwd_tiles(head_dim, has_rab)
    if (q_block % tiles["tile_m"] or k_block % tiles["tile_n"]) and not (q_block % 64 or k_block % 64):
        tiles = dict(tiles, tile_m=64, tile_n=64)
    return tiles


def make_hopper_fwd_key(arch, dtype, head_dim, kind, context_target, has_rab, tiles=None,
                        split_keys: bool = False, block_sparse: bool = False) -> HopperFwdKey:
    return HopperFwdKey(**_variant_fields(arch, dtype, head_dim, kind, context_target, has_rab),
                        **(tiles or default_hopper_fwd_tiles(head_dim, has_rab)), split_keys=split_keys,
                        block_sparse=block_sparse)


@dataclass(frozen=True)
class HopperPagedFwdKey(HopperFwdKey):
    """Compile key of :class:`~hstu_cute.hopper.fwd.HstuForwardSm90` reading each sequence's
    cached keys and values from a paged KV cache ahead of its new ones (common.key_blocks); the
    page size is a runtime argument."""

    kernel_name: ClassVar[str] = "hopper_fwd_paged"
    paged: ClassVar[bool] = True


#: The masks of the paged (serving) variants: the causal family, as HSTU serves.
PAGED_MASKS = ((MaskKind.CAUSAL, False), (MaskKind.CAUSAL, True))
#: The masks with split-key forward variants (HopperFwdKey.split_keys): the serving family.
SPLIT_KEY_MASKS = PAGED_MASKS
#: The page sizes a paged KV cache may have (tokens per page).
PAGE_SIZES = (16, 32, 64, 128)


def default_hopper_paged_fwd_tiles(head_dim: int, has_rab: bool) -> dict:
    """The forward's tiles with a third K/V stage where smem allows it (D <= 128 without rab,
    224 KB with one Q stage): cache blocks arrive in several page-sized boxes, whose latency the
    deeper ring hides. H100, 64 users x (4096 + 256) causal D128, page sizes 16 / 32 / 64 / 128:
    paged 0.290 / 0.255 / 0.259 / 0.257 ms with 3 stages against 0.296 / 0.268 / 0.261 / 0.255
    with the forward's 2 (two Q stages); contiguous keys 0.248 ms on the forward's tiles."""
    tiles = default_hopper_fwd_tiles(head_dim, has_rab)
    if head_dim <= 128 and not has_rab:
        tiles.update(num_stages=3, q_stages=1)
    return tiles


def make_hopper_paged_fwd_key(arch, dtype, head_dim, kind, context_target, has_rab, tiles=None,
                              split_keys: bool = False) -> HopperPagedFwdKey:
    return HopperPagedFwdKey(**_variant_fields(arch, dtype, head_dim, kind, context_target, has_rab),
                             **(tiles or default_hopper_paged_fwd_tiles(head_dim, has_rab)), split_keys=split_keys)


#: The FP8 element type of q, k and v, by DSL name, and the head dims of the FP8 forward
#: (FBGEMM's FP8 set).
FP8_DTYPE = "float8_e4m3fn"
FP8_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class HopperFp8FwdKey(HopperFwdKey):
    """Compile key of :class:`~hstu_cute.hopper.fwd.HstuForwardFp8Sm90`: ``dtype`` is the e4m3
    input type, ``out_dtype`` the output's (and rab's) 16-bit type; ``scaled_p``: quant modes
    >= 1 (P re-quantized with a per-row scale, descales per (sequence, block, head)), else the
    pre-quantized entry and mode 0 (P cast, (1,) descales); ``two_direction`` (quant mode 1, with
    ``scaled_p``): q and k descales per (token, head), V^T's per (block, head, dim)."""

    kernel_name: ClassVar[str] = "hopper_fwd_fp8"

    out_dtype: str = "bfloat16"
    scaled_p: bool = False
    two_direction: bool = False
    # P cast: the SiLU ahead of the mask's branch, which keeps ptxas from hoisting the P.V wait
    # above it (HstuForwardSm90 early_silu). Shipped where it measured faster: D256 without rab
    # (default_hopper_fp8_fwd_tiles).
    early_silu: bool = False

    def __post_init__(self):
        assert self.scaled_p or not self.two_direction, "two_direction needs scaled_p"
        assert not (self.early_silu and self.scaled_p), "early_silu is for P cast"

    def describe(self) -> str:
        return (super().describe() + f" ->{self.out_dtype}" + (" scaled-P" if self.scaled_p else "")
                + (" two-direction" if self.two_direction else "") + (" early-SiLU" if self.early_silu else ""))


@dataclass(frozen=True)
class _Fp8InputKey(_Variant):
    """Fields of the kernels that prepare the FP8 forward's inputs: only the input dtype and the
    head dim matter (no mask, no rab)."""

    ptxas_opt: int = 3

    def describe(self) -> str:
        return f"{self.kernel_name} {self.arch} {self.dtype} d{self.head_dim}"


@dataclass(frozen=True)
class HopperVtKey(_Fp8InputKey):
    """Compile key of :class:`~hstu_cute.hopper.vt.VTransposeSm90` (e4m3 V -> V^T for the
    pre-quantized FP8 forward): ``dtype`` is V's, e4m3."""

    kernel_name: ClassVar[str] = "hopper_fwd_vt"


def make_hopper_vt_key(arch, dtype, head_dim) -> HopperVtKey:
    return HopperVtKey(arch=arch, dtype=dtype, head_dim=head_dim)


@dataclass(frozen=True)
class FuncTableKey(_Variant):
    """Compile key of :class:`~hstu_cute.ampere.func_table.FuncTableSm80` (a ``func`` mask's
    per-block table, :func:`hstu_cute.masks.func_key_ranges`): only the arch and ``n_func`` (1 or
    3) matter; ``dtype`` is the table's, ``head_dim`` unused (0)."""

    kernel_name: ClassVar[str] = "func_table"

    n_func: int = 1
    ptxas_opt: int = 3

    def describe(self) -> str:
        return f"{self.kernel_name} {self.arch} n_func={self.n_func}"


def make_func_table_key(arch, n_func) -> FuncTableKey:
    return FuncTableKey(arch=arch, dtype="int32", head_dim=0, mask_kind=int(MaskKind.FUNC), n_func=n_func)


@dataclass(frozen=True)
class HopperQuantSlotsKey(_Fp8InputKey):
    """Compile key of :class:`~hstu_cute.hopper.quantize_slots.QuantizeSlotsSm90` (quant modes
    0-5, several tensors per launch): the ``slots`` of one launch, each ``(role, plain,
    transposed)``: role "unit" (mode 0's cast), "fused" (mode 2), "group" (modes 3-5: the groups'
    scales, a grid barrier, the cast, in one cooperative launch), "token" or "column" (mode 1);
    ``plain`` writes the (T, H, D) e4m3 copy, ``transposed`` V^T (:func:`quant_launches` lists
    what the launcher asks)."""

    kernel_name: ClassVar[str] = "hopper_fwd_quant_slots"

    slots: tuple = (("fused", True, False),)

    @property
    def cooperative(self) -> bool:
        """Role "group": one cooperative launch with grid barriers (modes 3-5)."""
        return any(role == "group" for role, _, _ in self.slots)

    def describe(self) -> str:
        def slot(role, plain, transposed):
            return role + "+P" * plain + "+T" * transposed

        return super().describe() + " " + ",".join(slot(*s) for s in self.slots)


def make_hopper_quant_slots_key(arch, dtype, head_dim, slots) -> HopperQuantSlotsKey:
    return HopperQuantSlotsKey(arch=arch, dtype=dtype, head_dim=head_dim, slots=tuple(tuple(s) for s in slots))


def shipped_quant_slots() -> tuple:
    """Every distinct slot tuple of :func:`quant_launches` (one compile key each, per dtype and
    head dim), in a fixed order."""
    seen = {}
    for mode in (2, 3, 1, 0):  # modes 4 and 5 launch what mode 3 does (their groups are tables)
        for purpose in QUANT_PURPOSES:
            for launch in quant_launches(mode, purpose):
                seen.setdefault(tuple(slot[1:] for slot in launch), None)
    return tuple(seen)


#: (scaled_p, two_direction) of the shipped FP8 forward variants: P cast (the pre-quantized entry
#: and mode 0), scaled P (modes 2-5), scaled P with per-token and per-dim descales (mode 1).
FP8_P_SCALINGS = ((False, False), (True, False), (True, True))


def default_hopper_fp8_fwd_tiles(head_dim: int, has_rab: bool, scaled_p: bool = False,
                                 two_direction: bool = False) -> dict:
    """FP8 tiles: K and V^T tiles are half the bytes of 16-bit ones, so the smem plan of
    :func:`default_hopper_fwd_tiles` fits with a second Q stage even beside rab. D256 (H100, B8
    N4096, TF/s, same runs, docs/dev/perf-log.md session 17): 128-key tiles (2 stages) beside the
    128-register O accumulator, causal P cast 1095-1108 against 1022-1045 with 64-key tiles (3
    stages), scaled P 1008-1028 against 818-839; contexts + targets 808-818 / 727-731 against
    763-772 / 591-595; local windows even or better. With rab ptxas spills at 128 keys and they
    lose (P cast 738-749 against 790-804, scaled 601-606 against 707-723), as do quant mode 1's
    (``two_direction``: 364-377 against 467-499): 64-key tiles, P cast with 3 stages (176 KB with
    rab; 1038-1048 against 1021-1027 with 2, session 12)."""
    if head_dim <= 128:
        return dict(tile_m=128, tile_n=128, num_stages=2, ptxas_opt=2, q_stages=2, dynamic_tiles=True)
    if not has_rab and not two_direction:
        # P cast with the SiLU ahead of the mask's branch (HopperFp8FwdKey.early_silu): causal,
        # H100, same runs (session 23): 1150-1165 TF/s against 1104-1143. At D128 it measured
        # even (848-862 against 850-858) and at D64 slower (497-506 against 552-554): off there.
        return dict(tile_m=128, tile_n=128, num_stages=2, ptxas_opt=3, dynamic_tiles=True, early_silu=not scaled_p)
    return dict(tile_m=128, tile_n=64, num_stages=2 if scaled_p else 3, ptxas_opt=3, dynamic_tiles=True)


def make_hopper_fp8_fwd_key(arch, out_dtype, head_dim, kind, context_target, has_rab,
                            tiles=None, scaled_p: bool = False, two_direction: bool = False) -> HopperFp8FwdKey:
    fields = _variant_fields(arch, FP8_DTYPE, head_dim, kind, context_target, has_rab)
    fields["fast_silu"] = True  # tanh.approx is far below e4m3's rounding of P
    return HopperFp8FwdKey(**fields, out_dtype=out_dtype, scaled_p=scaled_p, two_direction=two_direction,
                           **(tiles or default_hopper_fp8_fwd_tiles(head_dim, has_rab, scaled_p, two_direction)))


@dataclass(frozen=True)
class HopperBwdKey(_BwdVariant):
    """Compile key of the sm90 backward kernels: role "fused"
    (:class:`~hstu_cute.hopper.bwd.HstuBackwardDkDvSm90` with its dQ reduction: the default at
    D128), or the deterministic pair "dkdv" + "dq" (:class:`~hstu_cute.hopper.bwd.HstuBackwardDqSm90`,
    calls without drab; with drab the sm80 dQ kernel pairs with "dkdv"); at head dim 256 role
    "wide" (:class:`~hstu_cute.hopper.bwd_wide.HstuBackwardWideSm90`: dK, dV and drab) + "dq".
    ``has_drab`` and ``rab_sum_heads`` (drab of one rab head summed over H > 1 heads) are set for
    role "wide" only: the others leave drab to the sm80 dQ kernel."""

    kernel_family: ClassVar[str] = "hopper_bwd"

    tile_m: int = 64  # queries per m-block (dq: per CTA, 64 per consumer warpgroup)
    tile_n: int = 128  # keys per CTA (dkdv: 64 per consumer warpgroup; dq: per n-block)
    num_stages: int = 2
    fast_silu: bool = True
    ptxas_opt: int = 3
    persistent: bool = False  # roles "dkdv" / "fused" / "dq": one CTA per SM walking the tiles
    dynamic_tiles: bool = False  # persistent CTAs claim their tiles (HopperFwdKey.dynamic_tiles)
    # A block mask (roles "dkdv" / "fused"): the m-block walk skips tiles without a kept block.
    block_sparse: bool = False

    @property
    def zeroes_dq_ahead(self) -> bool:
        """The fused kernel zeroes its dQ accumulator a walk section ahead (hopper.dq_ahead): it
        needs one tile per CTA. Not under a block mask: there the compiled-in wait and zeroing cost
        the walk's one-block CTAs even with lead 0 (H200, B8 H32 N16384 causal 10 %, backward call,
        docs/dev/perf-log.md session 41: 11.56-11.63 -> 12.47-12.51 ms)."""
        return self.role == "fused" and not self.persistent and not self.block_sparse

    def describe(self) -> str:
        extras = (["rab"] if self.has_rab else []) + (["drab"] if self.has_drab else []) + (
            ["sum_heads"] if self.rab_sum_heads else []) + (["block-sparse"] if self.block_sparse else [])
        flags = ("P" if self.persistent else "") + ("d" if self.dynamic_tiles else "")
        return self._describe(f"{self.tile_m}x{self.tile_n}s{self.num_stages}{flags}", extras)


HOPPER_BWD_ROLES = ("fused", "dkdv", "dq", "wide")
# Persistent dK/dV and dQ kernels (H100 B8 N4096 causal, docs/dev/perf-log.md session 6): D128 pair
# 437.6 vs 422.4 TF, D64 322-324 vs 304-306; the fused kernel stays one CTA per n-block (a tile
# loop slows its m-block loop: 402-418 vs 443-448).
_BWD_TILES = {"dkdv": dict(tile_m=64, tile_n=128, persistent=True, dynamic_tiles=True),
              "fused": dict(tile_m=64, tile_n=128),
              "dq": dict(tile_m=128, tile_n=64, persistent=True, dynamic_tiles=True), "wide": dict(tile_m=64, tile_n=64)}
# dQ at D256: Q and dO (2 x 64 KB) stay resident, so K/V tiles of 48 keys (32 beside rab's ring)
# keep two stages in smem (H100 B8 N4096 causal, with the wide kernel: 369.4 TF at 128 x 48,
# 359.5-363.5 at 128 x 32, 331.6 at 128 x 64 with one stage).
_BWD_TILES_D256 = {"dq": dict(tile_m=128, tile_n=48, num_stages=2, persistent=True, dynamic_tiles=True)}
_BWD_TILES_D256_RAB = {"dq": dict(tile_m=128, tile_n=32, num_stages=2, persistent=True, dynamic_tiles=True)}
# Head dims of the wide dK/dV/drab kernel; it pairs with the dQ kernel there.
HOPPER_WIDE_HEAD_DIMS = (256,)
# (has_rab, has_drab, rab_sum_heads) of the shipped backward variants: the sm80 kernels and the
# Hopper wide kernel ship all four, the other Hopper roles (no drab) the first two.
_BWD_RAB = ((False, False, False), (True, False, False), (True, True, False), (True, True, True))
# Head dims where the fused kernel is the default (no drab, not deterministic, keys of at least
# FUSED_MIN_SEQLEN_K tokens). H200, B8 N4096 causal bf16, same run (docs/dev/perf-log.md
# 2026-11-21): D128 fused 431 vs pair 404 TF; D64 fused 252 vs pair 280 (at D64 the per-m-block
# barriers and dQ reduce are not hidden by the GEMMs).
HOPPER_FUSED_HEAD_DIMS = (128,)
# At D128 the fused kernel runs for key sequences of at least this many tokens, the pair below.
# H100, D128 bf16 causal backward, same runs (docs/dev/perf-log.md session 7), TF/s pair vs fused:
# B64 N512 177 vs 133, B32 N1024 266 vs 183, B16 N2048 386 vs 318 (uniform lengths 359 vs 308):
# the fused kernel's one CTA per n-block walks few m-blocks there. At N4096 the fused kernel
# is ahead on zipf lengths (352 vs 265), context + targets (390 vs 359) and without a mask (532
# vs 510), and 2% behind on full causal batches (465 vs 473).
FUSED_MIN_SEQLEN_K = 2049


def hopper_bwd_tiles(role: str, head_dim: int, has_rab: bool) -> dict:
    if head_dim in HOPPER_WIDE_HEAD_DIMS:
        return (_BWD_TILES_D256_RAB if has_rab else _BWD_TILES_D256).get(role, _BWD_TILES[role])
    return _BWD_TILES[role]


def make_hopper_bwd_key(role, arch, dtype, head_dim, kind, context_target, has_rab, tiles=None, has_drab=False,
                        rab_sum_heads=False, block_sparse=False) -> HopperBwdKey:
    assert not block_sparse or role in ("dkdv", "fused"), role
    return HopperBwdKey(role=role, **_variant_fields(arch, dtype, head_dim, kind, context_target, has_rab),
                        has_drab=has_drab, rab_sum_heads=rab_sum_heads,
                        **(tiles or hopper_bwd_tiles(role, head_dim, has_rab)), block_sparse=block_sparse)


@dataclass(frozen=True)
class HopperFp8BwdKey(HopperBwdKey):
    """Compile key of the FP8 backward (:mod:`hstu_cute.hopper.bwd_fp8`): role "dkdv" or "dq" (the
    deterministic pair), or "fused" (dK, dV and dQ's reduce-adds in one kernel); ``dtype`` is e4m3
    (q, k, v, dO and their token-contiguous copies), ``out_dtype`` the
    gradients' (and rab's) 16-bit type. Descales are (B, blocks, H) tables (quant modes 0, 2-5);
    ``two_direction`` (quant mode 1): (T, H) per-token tables, and (B, blocks, H, 2, D) tables of
    the token-contiguous copies."""

    kernel_family: ClassVar[str] = "hopper_bwd_fp8"

    out_dtype: str = "bfloat16"
    two_direction: bool = False

    def describe(self) -> str:
        return super().describe() + f" ->{self.out_dtype}" + (" two-direction" if self.two_direction else "")

    @property
    def dim_parts(self) -> int:
        """CTAs per key block of the dK/dV kernel, each with dK and dV of ``D / dim_parts`` dims:
        2 at D256, where 128 keys' dK and dV over all of D would take 256 accumulator registers
        per thread (hopper.bwd_fp8); 1 otherwise (and for the dQ kernel)."""
        return 2 if self.role == "dkdv" and self.head_dim > 128 else 1


#: Head dims of the FP8 backward. Its dK and dV accumulators (2 x 64 x D fp32 per warpgroup) fit the
#: registers up to D128; at D256 two CTAs per key block take half of D each (hopper.bwd_fp8).
FP8_BWD_HEAD_DIMS = (64, 128, 256)
# A dK/dV tile is one quantizer block of keys (128), its m-blocks and the dQ kernel's n-blocks lie
# inside one block: the descales are scalars per GEMM. H100 B8 N4096 D128 causal mode 2, each
# kernel alone (session 16, tools/gpu_fp8_bwd.py sweep): dQ with 128-key blocks 0.261 ms against
# 0.298 with 64; dK/dV with 3 stages 0.411 against 0.416 with 2 (noise: kept 2).
_FP8_BWD_TILES = {"dkdv": dict(tile_m=64, tile_n=128, persistent=True, dynamic_tiles=True),
                  "dq": dict(tile_m=128, tile_n=128, persistent=True, dynamic_tiles=True),
                  "fused": dict(tile_m=64, tile_n=128)}
#: Head dims of the fused FP8 backward (role "fused": quant modes 0, 2-5, no rab, not deterministic;
#: opt-in, see hstu_cute.launch.FP8_FUSED_BY_DEFAULT). Non-persistent like the 16-bit fused kernel:
#: its m-block parity alternates the dQ owner within one key block.
FP8_FUSED_HEAD_DIMS = (128,)
# D256 dQ: 64-key blocks (a 128 x 256 fp32 dQ accumulator takes 128 registers per thread); dQ with 3
# stages 0.425 ms against 0.423 with 2 (kept 2). D256 dK/dV: 2 stages, which leave room for the staged
# epilogue without rab (hopper.bwd_base.StagedEpilogue; 3 stages without it took 208 KB). H100 B8
# N4096 H4 causal mode 2, dK/dV alone, same runs (session 19): 0.850 / 0.919 ms with 2 stages and the
# staged epilogue against 0.900 / 0.957 with 3 stages and register stores (session 18: 3 stages 0.898
# against 2 stages 0.937, both with register stores).
_FP8_BWD_TILES_D256 = dict(_FP8_BWD_TILES, dq=dict(tile_m=128, tile_n=64, persistent=True, dynamic_tiles=True))


def fp8_bwd_tiles(role: str, head_dim: int) -> dict:
    return (_FP8_BWD_TILES if head_dim <= 128 else _FP8_BWD_TILES_D256)[role]


def make_hopper_fp8_bwd_key(role, arch, out_dtype, head_dim, kind, context_target, has_rab,
                            tiles=None, has_drab: bool = False, rab_sum_heads: bool = False,
                            two_direction: bool = False) -> HopperFp8BwdKey:
    """``has_drab`` / ``rab_sum_heads`` (drab of one rab head summed over the heads with fp32
    atomics) concern role "dq" only: the dQ kernel writes drab."""
    fields = _variant_fields(arch, FP8_DTYPE, head_dim, kind, context_target, has_rab)
    fields["fast_silu"] = True
    drab = dict(has_drab=has_drab, rab_sum_heads=has_drab and rab_sum_heads) if role == "dq" else {}
    return HopperFp8BwdKey(role=role, **fields, out_dtype=out_dtype, two_direction=two_direction,
                           **(tiles or fp8_bwd_tiles(role, head_dim)), **drab)


def _hopper_role_serves(role: str, head_dim: int) -> bool:
    if head_dim in HOPPER_WIDE_HEAD_DIMS:
        return role in ("wide", "dq")
    return role != "wide" and (role != "fused" or head_dim in HOPPER_FUSED_HEAD_DIMS)


KEY_CLASSES = {cls.__name__: cls for cls in (AmpereFwdKey, AmpereBwdKey, HopperFwdKey, HopperBwdKey,
                                              HopperFp8FwdKey, HopperFp8BwdKey, HopperVtKey,
                                              HopperQuantSlotsKey, HopperPagedFwdKey, AmperePagedFwdKey,
                                              FuncTableKey)}


# ---------------------------------------------------------------------------------------------
# Shipped lists
# ---------------------------------------------------------------------------------------------
def _shipped_variants(dtypes, head_dims) -> list[tuple]:
    """(dtype, head_dim, mask kind, context_target) of every shipped variant, in the lists' order:
    the leading arguments (after arch) of every key factory."""
    return [(dtype, head_dim, kind, context_target)
            for dtype in dtypes for head_dim in head_dims for kind, context_target in SHIPPED_MASKS]


def shipped_ampere_fwd_keys(arch: str, dtypes=DTYPES, head_dims=SHIPPED_HEAD_DIMS) -> list[AmpereFwdKey]:
    """Every mask's variants, then the split-key ones of the causal family (rab rows 16-byte
    aligned: the launcher pads others when it splits)."""
    return ([make_fwd_key(arch, *variant, has_rab, rab_vec) for variant in _shipped_variants(dtypes, head_dims)
             for has_rab, rab_vec in ((False, 8), (True, 8), (True, 1))]
            + [make_fwd_key(arch, dtype, head_dim, kind, context_target, has_rab, 8, split_keys=True)
               for dtype in dtypes for head_dim in head_dims for kind, context_target in SPLIT_KEY_MASKS
               for has_rab in (False, True)])


def shipped_ampere_paged_fwd_keys(arch: str, dtypes=DTYPES, head_dims=SHIPPED_HEAD_DIMS) -> list:
    # rab rows 16-byte aligned only (the launcher pads others): serving calls are few and long.
    return [make_ampere_paged_fwd_key(arch, dtype, head_dim, kind, context_target, has_rab, 8, split_keys=split_keys)
            for split_keys in (False, True) for dtype in dtypes for head_dim in head_dims
            for kind, context_target in PAGED_MASKS for has_rab in (False, True)]


def shipped_ampere_bwd_keys(arch: str, dtypes=DTYPES, head_dims=SHIPPED_HEAD_DIMS) -> list[AmpereBwdKey]:
    # Each call's (dq, dkdv) pair; the dkdv key does not depend on drab, so it is listed once.
    return list(dict.fromkeys(key for variant in _shipped_variants(dtypes, head_dims) for rab in _BWD_RAB
                              for key in make_bwd_keys(arch, *variant, *rab)))


def shipped_hopper_fwd_keys(arch: str = "sm_90a", dtypes=DTYPES, head_dims=SHIPPED_HEAD_DIMS) -> list[HopperFwdKey]:
    """Every mask's variants, then the split-key ones of the causal family (serving calls and
    other few-tile calls over long keys)."""
    return ([make_hopper_fwd_key(arch, *variant, has_rab) for variant in _shipped_variants(dtypes, head_dims)
             for has_rab in (False, True)]
            + [make_hopper_fwd_key(arch, dtype, head_dim, kind, context_target, has_rab, split_keys=True)
               for dtype in dtypes for head_dim in head_dims for kind, context_target in SPLIT_KEY_MASKS
               for has_rab in (False, True)])


def shipped_hopper_paged_fwd_keys(arch: str = "sm_90a", dtypes=DTYPES, head_dims=SHIPPED_HEAD_DIMS) -> list:
    return [make_hopper_paged_fwd_key(arch, dtype, head_dim, kind, context_target, has_rab, split_keys=split_keys)
            for split_keys in (False, True) for dtype in dtypes for head_dim in head_dims
            for kind, context_target in PAGED_MASKS for has_rab in (False, True)]


#: The 16-bit side (output, rab, quantizer input) of the shipped FP8 variants. fp16's FP8 kernels
#: compile on first use: shipping them took 256 variants, about 12 of the cold CI compile's 50
#: minutes on 2 cores (docs/dev/perf-log.md, session 32).
FP8_SHIPPED_DTYPES = ("bfloat16",)


def shipped_hopper_fp8_fwd_keys(arch: str = "sm_90a", dtypes=DTYPES, head_dims=SHIPPED_HEAD_DIMS,
                                shipped=FP8_SHIPPED_DTYPES) -> list:
    """FP8 forward variants (``dtypes`` are the output and rab types, those among ``shipped``;
    P cast, scaled P, then scaled P with mode 1's descales), then the V^T kernel of the
    pre-quantized entry (e4m3 V) and the slot quantizers of quant modes 0-5."""
    dtypes = [d for d in dtypes if d in shipped]
    fp8_dims = [d for d in head_dims if d in FP8_HEAD_DIMS]
    return ([make_hopper_fp8_fwd_key(arch, *variant, has_rab, scaled_p=scaled_p, two_direction=two_direction)
             for scaled_p, two_direction in FP8_P_SCALINGS for variant in _shipped_variants(dtypes, fp8_dims)
             for has_rab in (False, True)]
            + [make_hopper_vt_key(arch, FP8_DTYPE, d) for d in fp8_dims]
            + [make_hopper_quant_slots_key(arch, dtype, d, slots) for dtype in dtypes for d in fp8_dims
               for slots in shipped_quant_slots()])


def shipped_hopper_bwd_keys(arch: str = "sm_90a", dtypes=DTYPES, head_dims=SHIPPED_HEAD_DIMS) -> list[HopperBwdKey]:
    return [
        make_hopper_bwd_key(role, arch, *variant, has_rab, has_drab=has_drab, rab_sum_heads=sum_heads)
        for role in HOPPER_BWD_ROLES
        for variant in _shipped_variants(dtypes, [d for d in head_dims if _hopper_role_serves(role, d)])
        for has_rab, has_drab, sum_heads in (_BWD_RAB if role == "wide" else _BWD_RAB[:2])
    ]


def shipped_hopper_fp8_bwd_keys(arch: str = "sm_90a", dtypes=DTYPES, head_dims=SHIPPED_HEAD_DIMS,
                                shipped=FP8_SHIPPED_DTYPES) -> list:
    """FP8 backward pairs (``dtypes``: the gradients' and rab's types, those among ``shipped``), then the dQ kernels that write drab (per rab head, or summed over
    heads with atomics); quant modes 0, 2-5, then mode 1 (``two_direction``); then the fused
    kernels (quant modes 0, 2-5, no rab)."""
    dtypes = [d for d in dtypes if d in shipped]
    variants = _shipped_variants(dtypes, [d for d in head_dims if d in FP8_BWD_HEAD_DIMS])
    pairs = [key for two_direction in (False, True) for key in (
        [make_hopper_fp8_bwd_key(role, arch, *variant, has_rab, two_direction=two_direction)
         for role in ("dkdv", "dq") for variant in variants for has_rab in (False, True)]
        + [make_hopper_fp8_bwd_key("dq", arch, *variant, True, has_drab=True, rab_sum_heads=sum_heads,
                                   two_direction=two_direction)
           for variant in variants for sum_heads in (False, True)])]
    return pairs + [make_hopper_fp8_bwd_key("fused", arch, *variant, False) for variant in variants
                    if variant[1] in FP8_FUSED_HEAD_DIMS]


def shipped_keys(arch: str, dtypes=DTYPES, head_dims=SHIPPED_HEAD_DIMS) -> list:
    """Every shipped compile key (forward and backward, every kernel family) for ``arch``; the API
    can also select :func:`jit_only_keys`, compiled on first use. Head dims outside
    :data:`SHIPPED_HEAD_DIMS` are left out."""
    return _family_keys(arch, tuple(dtypes), tuple(d for d in head_dims if d in SHIPPED_HEAD_DIMS))


def _family_keys(arch: str, dtypes: tuple, head_dims: tuple) -> list:
    """Every kernel family's keys at ``head_dims``, shipped or not."""
    keys = (shipped_ampere_fwd_keys(arch, dtypes, head_dims) + shipped_ampere_bwd_keys(arch, dtypes, head_dims)
            + shipped_ampere_paged_fwd_keys(arch, dtypes, head_dims))
    if has_hopper_kernels(arch):
        keys += (shipped_hopper_fwd_keys(arch, dtypes, head_dims) + shipped_hopper_bwd_keys(arch, dtypes, head_dims)
                 + shipped_hopper_fp8_fwd_keys(arch, dtypes, head_dims)
                 + shipped_hopper_fp8_bwd_keys(arch, dtypes, head_dims)
                 + shipped_hopper_paged_fwd_keys(arch, dtypes, head_dims))
    return keys


def jit_only_keys(arch: str, dtypes=DTYPES, head_dims=HEAD_DIMS) -> list:
    """The variants the API selects but the package does not ship (compiled on first use): every
    family at the head dims outside :data:`SHIPPED_HEAD_DIMS`, and the FP8 kernels and quantizers of
    the 16-bit types outside :data:`FP8_SHIPPED_DTYPES`."""
    dtypes, head_dims = tuple(dtypes), tuple(head_dims)
    keys = _family_keys(arch, dtypes, tuple(d for d in head_dims if d not in SHIPPED_HEAD_DIMS))
    if not has_hopper_kernels(arch):
        return keys
    others = tuple(d for d in dtypes if d not in FP8_SHIPPED_DTYPES)
    shipped = set(shipped_keys(arch, dtypes, head_dims))  # the V^T kernels (e4m3 only) are shipped
    shipped_dims = tuple(d for d in head_dims if d in SHIPPED_HEAD_DIMS)
    return keys + [k for k in (shipped_hopper_fp8_fwd_keys(arch, others, shipped_dims, shipped=others)
                               + shipped_hopper_fp8_bwd_keys(arch, others, shipped_dims, shipped=others))
                   if k not in shipped]
