"""The runtime arguments of every kernel family, in order: one spec that both the fake-tensor
compile (:mod:`hstu_cute.compile`) and the launch (:mod:`hstu_cute.launch`) build from.

A spec is a tuple of :class:`Arg`, named as the kernel's ``__call__`` parameters (CuTe naming:
``mQ`` is global q); ``compile`` checks the names against the kernel's signature, so the three
can not drift apart. An argument absent from a variant (``present(key)`` false) is passed as
``None`` at compile time and at launch. At launch :func:`ordered` picks the values by name from
the mapping the launcher filled, so adding an argument (FP8 descales, a page table) is one
:class:`Arg` here, its value in the launcher's mapping, and its use in the kernel.

Imports neither torch nor cutlass at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .fp8_format import QUANT_MAX_SLOTS
from .masks import MaskKind


def dsl_dtype(name: str):
    """The cutlass type of a compile key's dtype name."""
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float8_e4m3fn": cutlass.Float8E4M3FN,
            "int32": cutlass.Int32}[name]


class FakeShapes:
    """Symbolic sizes shared by the fake tensors of one compile: every (T_q, H, D) tensor shares
    T_q and H, every (T_k, H, D) tensor T_k and H, every per-sequence vector B (or B + 1), so the
    compiler sees the same facts the launch guarantees. ``dtype`` is the key's 16-bit DSL type."""

    def __init__(self, key):
        import cutlass.cute as cute

        self.key = key
        self.dtype = dsl_dtype(key.dtype)
        # The output's (and rab's) type: the inputs' except for FP8 keys.
        self.out_dtype = dsl_dtype(getattr(key, "out_dtype", key.dtype))
        self.tokens_q, self.tokens_k, self.heads = cute.sym_int(), cute.sym_int(), cute.sym_int()
        # The 16-bit forwards' k and v: H_q / group heads (GQA / MQA), their own size.
        self.heads_kv = cute.sym_int()
        self.batch, self.batch1 = cute.sym_int(), cute.sym_int()
        self.pages = cute.sym_int()
        self.arrivals = cute.sym_int()
        # The slot quantizer (hstu_cute.hopper.quantize_slots): each input its own token count.
        for i in range(QUANT_MAX_SLOTS):
            setattr(self, f"tokens_slot{i}", cute.sym_int())


# ---------------------------------------------------------------------------------------------
# Fake values, one builder per kind of argument
# ---------------------------------------------------------------------------------------------
def _tokens(tokens_attr: str, elem=None, divisibility: int = 8, align: int = 16, heads_attr: str = "heads"):
    """(T, H, D) with a 64-bit token stride (global offsets never overflow int32) and a head
    stride that keeps every row 16-byte aligned. ``elem``: a cutlass type name, or "out" for the
    key's output type (default: the input type); ``heads_attr``: which head count H is."""

    def fake(s: FakeShapes):
        import cutlass
        import cutlass.cute as cute

        dtype = s.dtype if elem is None else s.out_dtype if elem == "out" else getattr(cutlass, elem)
        stride_t = cute.sym_int64(divisibility=divisibility)
        stride_h = cute.sym_int(divisibility=divisibility)
        return cute.runtime.make_fake_tensor(dtype, (getattr(s, tokens_attr), getattr(s, heads_attr), s.key.head_dim),
                                             (stride_t, stride_h, 1), assumed_align=align)

    return fake


def _int_vec(length_attr: str):
    def fake(s: FakeShapes):
        import cutlass
        import cutlass.cute as cute

        return cute.runtime.make_fake_compact_tensor(cutlass.Int32, (getattr(s, length_attr),), assumed_align=4)

    return fake


def _slab(rank: int, vec: int, elem=None, last_stride_64: bool = False, align: int | None = None):
    """A rank-``rank`` tensor of free sizes, last dim contiguous, strides multiples of ``vec``:
    rab and drab. ``last_stride_64``: the row stride is 64-bit too (the TMA kernels' view);
    ``align``: the base pointer's alignment (default: one ``vec`` load, at least 4 bytes)."""

    def fake(s: FakeShapes):
        import cutlass
        import cutlass.cute as cute

        dtype = s.out_dtype if elem is None else getattr(cutlass, elem)
        shape = tuple(cute.sym_int() for _ in range(rank))
        row = cute.sym_int64(divisibility=vec) if last_stride_64 else cute.sym_int(divisibility=vec)
        stride = tuple(cute.sym_int64(divisibility=vec) for _ in range(rank - 2)) + (row, 1)
        base_align = align if align is not None else max(dtype.width // 8 * vec, 4)
        return cute.runtime.make_fake_tensor(dtype, shape, stride, assumed_align=base_align)

    return fake


def _tokens_transposed(s: FakeShapes):
    """V^T (H, D, W) e4m3 of the FP8 forward: keys contiguous, rows 16-byte aligned (TMA)."""
    import cutlass
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(cutlass.Float8E4M3FN, (s.heads, s.key.head_dim, cute.sym_int()),
                                         (cute.sym_int64(divisibility=16), cute.sym_int64(divisibility=16), 1),
                                         assumed_align=16)


def _table(s: FakeShapes):
    """A (B, blocks, H) fp32 table; any strides (the quantizers' group tables are zero-strided
    views along the dims a group spans)."""
    import cutlass
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(cutlass.Float32, (s.batch, cute.sym_int(), s.heads),
                                         (cute.sym_int(), cute.sym_int(), cute.sym_int()), assumed_align=4)


def _token_table(s: FakeShapes):
    """A (T, H) fp32 table, a value per token and head (quant mode 1's q and k scales)."""
    import cutlass
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(cutlass.Float32, (cute.sym_int(), s.heads), (cute.sym_int(), cute.sym_int()),
                                         assumed_align=4)


def _dim_table(s: FakeShapes):
    """A (B, blocks, H, 2, D) fp32 table: per (sequence, block, head) the scale of each dim, then
    its reciprocal (quant mode 1's V scales); (H, 2, D) compact, so that pairs of dims load as
    one 8-byte access."""
    import cutlass
    import cutlass.cute as cute

    D = s.key.head_dim
    return cute.runtime.make_fake_tensor(cutlass.Float32, (s.batch, cute.sym_int(), s.heads, 2, D),
                                         (cute.sym_int(divisibility=2 * D), cute.sym_int(divisibility=2 * D), 2 * D,
                                          D, 1), assumed_align=16)


def _descale(s: FakeShapes, token_table=_token_table):
    """(1,) fp32; with ``scaled_p`` a (B, blocks, H) table (quant modes >= 1), with
    ``two_direction`` ``token_table`` (mode 1)."""
    import cutlass
    import cutlass.cute as cute

    if not s.key.scaled_p:
        return cute.runtime.make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),), assumed_align=4)
    return token_table(s) if s.key.two_direction else _table(s)


def _descale_v(s: FakeShapes):
    return _descale(s, _dim_table)


def _role_table(role: str):
    """The fake scale table of a quantizer role: (T, H) per token, (B, blocks, H, 2, D) per block
    and dim, else (B, blocks, H)."""
    return {"token": _token_table, "column": _dim_table}.get(role, _table)


def _quant_slot_args(i: int) -> tuple:
    """Slot ``i`` of a slot-quantizer launch: input, offsets, scale table (by role: (T, H) for
    "token", (B, blocks, H, 2, D) for "column", none for "unit", else (B, blocks, H),
    zero-strided for the groups of modes 3-5), the (T, H, D) e4m3 copy, V^T, the slot's block
    count (0: skip the slot)."""

    def slot(key):
        return key.slots[i] if i < len(key.slots) else None

    def used(key):
        return slot(key) is not None

    def scale(s: FakeShapes):
        return _role_table(slot(s.key)[0])(s)

    tokens = f"tokens_slot{i}"
    return (Arg(f"mX{i}", _tokens(tokens), used), Arg(f"mOffsets{i}", _int_vec("batch1"), used),
            Arg(f"mScale{i}", scale, lambda key: used(key) and slot(key)[0] != "unit"),
            Arg(f"mO{i}", _tokens(tokens, "Float8E4M3FN", 16), lambda key: used(key) and slot(key)[1]),
            Arg(f"mVt{i}", _tokens_transposed, lambda key: used(key) and slot(key)[2]),
            Arg(f"num_blocks{i}", _i32, used))


def _int_words(count: int, align: int):
    """``count`` int32 device words (counters a kernel and its launcher share)."""

    def fake(s: FakeShapes):
        import cutlass
        import cutlass.cute as cute

        return cute.runtime.make_fake_compact_tensor(cutlass.Int32, (count,), assumed_align=align)

    return fake


def _zeroes_ahead(key) -> bool:
    return key.zeroes_dq_ahead


def _int_words_any(s: FakeShapes):
    """A 1-D int32 tensor of any length (per-call counters)."""
    import cutlass
    import cutlass.cute as cute

    return cute.runtime.make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)


def _cooperative(key) -> bool:
    return key.cooperative


def _f32(s: FakeShapes):
    from cutlass import Float32

    return Float32(1.0)


def _i32(s: FakeShapes):
    from cutlass import Int32

    return Int32(1)


def _always(key) -> bool:
    return True


def _has_context(key) -> bool:
    return key.has_context


def _has_target(key) -> bool:
    return key.has_target


def _has_func(key) -> bool:
    return key.mask_kind == int(MaskKind.FUNC)


def _has_rab(key) -> bool:
    return key.has_rab


@dataclass(frozen=True)
class Arg:
    """One runtime argument: its name (the kernel parameter's), how ``compile`` fakes it, and in
    which variants it exists (else ``None`` is passed)."""

    name: str
    fake: Callable[[FakeShapes], Any]
    present: Callable[[Any], bool] = _always


def _ampere_rab(s: FakeShapes):
    # rab_vec 8: 16-byte rows (cp.async of 8 elements); 1: any layout, element loads.
    return _slab(4, s.key.rab_vec, align=s.dtype.width // 8 * s.key.rab_vec)(s)


# The argument runs every family shares, in the order the kernels take them.
_SEQUENCES = (
    Arg("mOffsetsQ", _int_vec("batch1")),  # (B + 1,) int32
    Arg("mOffsetsK", _int_vec("batch1")),
    Arg("mSeqUsedQ", _int_vec("batch")),  # (B,) valid prefix, INT32_MAX when unused
    Arg("mSeqUsedK", _int_vec("batch")),
    Arg("mNumContexts", _int_vec("batch"), _has_context),
    Arg("mNumTargets", _int_vec("batch"), _has_target),
    Arg("mFunc", _slab(3, 1, elem="Int32"), _has_func),  # (1, n_func, T_q + 256) int32
    # (B, blocks, 7) int32 per 64 query rows and per 64 keys: masks.FUNC_TABLE_COLUMNS
    Arg("mFuncBlocks", _slab(3, 1, elem="Int32"), _has_func),
)
_SCALARS = (
    Arg("alpha", _f32),
    Arg("inv_scale", _f32),  # 1 / S
    Arg("window_left", _i32),
    Arg("window_right", _i32),
    Arg("group_size", _i32),
    Arg("is_delta_q", _i32),
)
_Q, _K, _V, _DO = (Arg("mQ", _tokens("tokens_q")), Arg("mK", _tokens("tokens_k")), Arg("mV", _tokens("tokens_k")),
                   Arg("mdO", _tokens("tokens_q")))
# The 16-bit forwards and backwards read k and v natively under GQA / MQA (H_kv heads; the
# kernels map query head h to key head h // (H_q / H_kv)); dK and dV stay per query head.
_K_KV = Arg("mK", _tokens("tokens_k", heads_attr="heads_kv"))
_V_KV = Arg("mV", _tokens("tokens_k", heads_attr="heads_kv"))
_DK, _DV = Arg("mdK", _tokens("tokens_k")), Arg("mdV", _tokens("tokens_k"))
_DQ = Arg("mdQ", _tokens("tokens_q"))
_TMA_RAB = Arg("mRab", _slab(4, 8, last_stride_64=True), _has_rab)  # rows 16-byte aligned (TMA)
_SM80_RAB16 = Arg("mRab", _slab(4, 8), _has_rab)  # the backward pads rab rows to 16 bytes
_NUM_SMS = Arg("num_sms", _i32)
# (batch, head) pairs per section of the tile walk (common.tile_scheduler.SectionWalk)
_BH_PER_SECTION = Arg("bh_per_section", _i32)


# (2,) int32, zero at launch, zero again after it (common.tile_scheduler.TileClaims)
_TILE_COUNTER = Arg("mTileCounter", _int_words(2, 8), lambda key: key.dynamic_tiles)


def _cache_rows(s: FakeShapes):
    """A paged KV cache (pages, 2, page_size, H, D) seen as (R, H, D) rows (page * 2 + kind) *
    page_size + row: a token tensor of its own row count (TMA bounds every page read by it)."""
    import cutlass.cute as cute

    stride_h = cute.sym_int(divisibility=8)
    return cute.runtime.make_fake_tensor(s.dtype, (cute.sym_int(), s.heads, s.key.head_dim),
                                         (cute.sym_int64(divisibility=8), stride_h, 1), assumed_align=16)


def _paged(key) -> bool:
    return key.paged


def _split_keys(key) -> bool:
    return getattr(key, "split_keys", False)


def _partials(s: FakeShapes):
    """Split keys: the fp32 partial outputs of every part, part after part: (parts x T_q, H, D),
    a row count of its own."""
    import cutlass
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(cutlass.Float32, (cute.sym_int(), s.heads, s.key.head_dim),
                                         (cute.sym_int64(divisibility=8), cute.sym_int(divisibility=8), 1),
                                         assumed_align=16)


# A paged KV cache ahead of each sequence's new keys (common.key_blocks.PagedArgs), in this order.
_PAGES = (
    Arg("mCache", _cache_rows, _paged),
    Arg("mPageOffsets", _int_vec("batch1"), _paged),  # (B + 1,) int32
    Arg("mPageIds", _int_vec("pages"), _paged),  # (P,) int32
    Arg("mLastPageLens", _int_vec("batch"), _paged),  # (B,) int32
    Arg("log2_page_size", _i32, _paged),
    # rab among the new tokens, (B, H_rab, L_new, L_new): rab[b, h, C_b + i, C_b + j]: a TMA box
    # or a 16-byte load can not start at the cached length's column of rab itself (unaligned).
    Arg("mRabNew", _slab(4, 8, last_stride_64=True), lambda key: key.paged and key.has_rab),
)


# Split keys: partial outputs, arrival counts per (sequence, head, m-block[, warpgroup]) (zero at
# launch, left zero), parts of each tile's key blocks.
_SPLITS = (Arg("mPartials", _partials, _split_keys), Arg("mArrivals", _int_vec("arrivals"), _split_keys),
           Arg("num_splits", _i32, _split_keys))


def _block_sparse(key) -> bool:
    return getattr(key, "block_sparse", False)


# A block mask (hstu_cute.block_mask.TileLists at the key's tile; common.seqinfo.BlockSparseArgs).
_BLOCKS = (Arg("mBlockCount", _slab(3, 1, elem="Int32"), _block_sparse),  # (B, H_mask, M_t)
           Arg("mBlockIndex", _slab(4, 1, elem="Int32"), _block_sparse),  # (B, H_mask, M_t, N_t)
           Arg("mBlockState", _slab(4, 1, elem="Uint8"), _block_sparse),  # (B, H_mask, M_t, N_t): 0 / 1 / 2
           Arg("mBlockKept", _slab(4, 1, elem="Uint8"), _block_sparse),  # (B, H_mask, M_q, M_k)
           Arg("q_block", _i32, _block_sparse), Arg("k_block", _i32, _block_sparse))


def _wide_drab(s: FakeShapes):
    import cutlass
    import cutlass.cute as cute

    # (B, H_rab, L_q, L_k) in the gradients' type, or the fp32 (B, L_q, L_k) sum over heads.
    rank, elem = (3, cutlass.Float32) if s.key.rab_sum_heads else (4, s.out_dtype)
    return cute.runtime.make_fake_tensor(elem, tuple(cute.sym_int() for _ in range(rank)),
                                         tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,), assumed_align=4)


SPECS: dict[str, tuple[Arg, ...]] = {
    "ampere_fwd": (_Q, _K_KV, _V_KV, Arg("mO", _tokens("tokens_q")), *_SEQUENCES, Arg("mRab", _ampere_rab, _has_rab),
                   *_SCALARS, Arg("num_m_blocks", _i32), *_PAGES, *_SPLITS, *_BLOCKS),
    "ampere_bwd_dq": (_Q, _K_KV, _V_KV, _DO, _DQ, *_SEQUENCES, _SM80_RAB16,
                      Arg("mdRab", _slab(4, 1), lambda key: key.has_drab),
                      Arg("mdRabAccum", _slab(3, 1, "Float32"), lambda key: key.rab_sum_heads),
                      *_SCALARS, Arg("num_m_blocks", _i32), *_BLOCKS),
    "ampere_bwd_dkdv": (_Q, _K_KV, _V_KV, _DO, _DK, _DV, *_SEQUENCES, _SM80_RAB16, *_SCALARS, Arg("num_n_blocks", _i32),
                        *_BLOCKS),
    "hopper_fwd": (_Q, _K_KV, _V_KV, Arg("mO", _tokens("tokens_q")), *_SEQUENCES, _TMA_RAB, *_SCALARS,
                   Arg("num_m_blocks", _i32), _NUM_SMS, _BH_PER_SECTION, _TILE_COUNTER, *_PAGES, *_SPLITS, *_BLOCKS),
    # FP8: mV is V^T (hstu_cute.hopper.vt, made by "hopper_fwd_vt"); the descales are (1,) fp32
    # tensors, or (B, blocks, H) tables with scaled P (read on the device: no host sync).
    "hopper_fwd_fp8": (_Q, _K, Arg("mV", _tokens_transposed), Arg("mO", _tokens("tokens_q", "out")), *_SEQUENCES,
                       _TMA_RAB, *_SCALARS, Arg("num_m_blocks", _i32), _NUM_SMS, _BH_PER_SECTION, _TILE_COUNTER,
                       Arg("mDescaleQ", _descale), Arg("mDescaleK", _descale), Arg("mDescaleV", _descale_v)),
    # (1, n_func, T_q + 256) func, the q offsets -> the (B, blocks, 7) table (hstu_cute.ampere.func_table)
    "func_table": (Arg("mFunc", _slab(3, 1, elem="Int32")), Arg("mOffsetsQ", _int_vec("batch1")),
                   Arg("mTable", _slab(3, 1, elem="Int32"))),
    "hopper_fwd_vt": (Arg("mV", _tokens("tokens_k")), Arg("mVt", _tokens_transposed),
                      Arg("mOffsets", _int_vec("batch1"))),
    # Several tensors per launch (hstu_cute.hopper.quantize_slots): up to QUANT_MAX_SLOTS slots.
    # With "group" slots: the grid barrier's arrival count (zero at launch) and the SM count.
    "hopper_fwd_quant_slots": (*(arg for i in range(QUANT_MAX_SLOTS) for arg in _quant_slot_args(i)),
                               Arg("mBarrier", _int_words(1, 4), _cooperative), Arg("num_sms", _i32, _cooperative)),
    "hopper_bwd_dq": (_Q, _K_KV, _V_KV, _DO, _DQ, *_SEQUENCES, _TMA_RAB, *_SCALARS, Arg("num_m_blocks", _i32), _NUM_SMS,
                      _BH_PER_SECTION, _TILE_COUNTER),
    "hopper_bwd_wide": (_Q, _K_KV, _V_KV, _DO, _DK, _DV, *_SEQUENCES, _TMA_RAB,
                        Arg("mdRab", _wide_drab, lambda key: key.has_drab), *_SCALARS, Arg("num_n_blocks", _i32)),
}
# The dK/dV kernel with and without its fused dQ reduction: an fp32 (T_q, H, D) accumulator that
# TMA reduce-adds into (16-byte strides).
SPECS["hopper_fwd_paged"] = SPECS["hopper_fwd"]
SPECS["ampere_fwd_paged"] = SPECS["ampere_fwd"]
SPECS["hopper_bwd_dkdv"] = SPECS["hopper_bwd_fused"] = (
    _Q, _K_KV, _V_KV, _DO, _DK, _DV, Arg("mdQaccum", _tokens("tokens_q", "Float32", 4), lambda key: key.role == "fused"),
    *_SEQUENCES, _TMA_RAB, *_SCALARS, Arg("num_n_blocks", _i32), _NUM_SMS, _BH_PER_SECTION, _TILE_COUNTER,
    *_BLOCKS,
    # One CTA per tile: the kernel zeroes the accumulator ``zero_lead`` walk sections ahead,
    # counting per section (hstu_cute.hopper.dq_ahead).
    Arg("mZeroDone", _int_words_any, _zeroes_ahead), Arg("zero_lead", _i32, _zeroes_ahead),
)


# The FP8 backward pair (hstu_cute.hopper.bwd_fp8): e4m3 q, k, v, dO, token-contiguous copies (Q^T and
# dO^T for the dK/dV kernel, K^T for the dQ kernel), gradients in the key's output type and (B,
# blocks, H) descale tables of q, k, v and dO; with two_direction (quant mode 1) (T, H) tables, and
# the copies' (B, blocks, H, 2, D) tables.
def _bwd_descale(s: FakeShapes):
    return _token_table(s) if s.key.two_direction else _table(s)


_FP8_BWD_DESCALES = tuple(Arg(name, _bwd_descale) for name in ("mDescaleQ", "mDescaleK", "mDescaleV", "mDescaleDO"))


def _column_descale(name: str) -> Arg:
    return Arg(name, _dim_table, lambda key: key.two_direction)


def _fused(key) -> bool:
    return key.role == "fused"


# The fused FP8 backward (role "fused") also reads K^T and reduce-adds dQ into an fp32 accumulator.
SPECS["hopper_bwd_fp8_dkdv"] = SPECS["hopper_bwd_fp8_fused"] = (
    _Q, _K, _V, _DO, Arg("mQt", _tokens_transposed), Arg("mdOt", _tokens_transposed),
    Arg("mKt", _tokens_transposed, _fused), Arg("mdK", _tokens("tokens_k", "out")),
    Arg("mdV", _tokens("tokens_k", "out")), Arg("mdQaccum", _tokens("tokens_q", "Float32", 4), _fused),
    *_SEQUENCES, _TMA_RAB,
    *_SCALARS, Arg("num_n_blocks", _i32), _NUM_SMS, _BH_PER_SECTION, _TILE_COUNTER, *_FP8_BWD_DESCALES,
    _column_descale("mDescaleQt"), _column_descale("mDescaleDOt"),
)
SPECS["hopper_bwd_fp8_dq"] = (
    _Q, _K, _V, _DO, Arg("mKt", _tokens_transposed), Arg("mdQ", _tokens("tokens_q", "out")), *_SEQUENCES, _TMA_RAB,
    *_SCALARS, Arg("num_m_blocks", _i32), _NUM_SMS, _BH_PER_SECTION, _TILE_COUNTER, *_FP8_BWD_DESCALES,
    _column_descale("mDescaleKt"),
    # drab: (B, H_rab, L_q, L_k) in the gradients' type, or the fp32 (B, L_q, L_k) sum over heads.
    Arg("mdRab", _wide_drab, lambda key: key.has_drab),
)


def spec(key) -> tuple[Arg, ...]:
    return SPECS[key.kernel_name]


def fake_args(key) -> list:
    """The compile-time stand-ins of ``key``'s runtime arguments, in order."""
    shapes = FakeShapes(key)
    return [a.fake(shapes) if a.present(key) else None for a in spec(key)]


_SLOTS: dict = {}


def slots(key) -> tuple:
    """``key``'s argument names in order, None where the argument is absent (memoized: the
    launcher asks on every call)."""
    names = _SLOTS.get(key)
    if names is None:
        names = _SLOTS[key] = tuple(a.name if a.present(key) else None for a in spec(key))
    return names


def ordered(key, values: dict) -> list:
    """``key``'s runtime arguments in order, from the launcher's ``values`` by name (absent
    ones as None, whatever ``values`` holds)."""
    return [values[name] if name is not None else None for name in slots(key)]
