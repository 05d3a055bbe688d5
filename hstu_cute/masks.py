"""The one description of HSTU mask semantics (spec section 4).

Everything that needs to know which (query, key) pairs attend -- the PyTorch oracle, the host-side
tile classification, the tests and the CuTe kernels -- calls the functions in this module, so the
rules cannot drift apart.

The functions are plain Python written only with ``+ - * //``, comparisons, ``&``, ``|`` and the
three helpers of an :class:`Ops` bundle (min, max, select). That lets one body run on

* Python ints (host tile classification, tests),
* torch tensors (the oracle builds dense masks by broadcasting row and column index tensors),
* CuTe DSL ``Int32`` values while a kernel is traced (the kernel passes ``KERNEL_OPS``).

Static choices (mask family, context/target presence, delta_q) live in :class:`MaskSpec`, a frozen
dataclass that is part of a kernel's compile key; Python ``if`` on its fields is resolved while
tracing. Per-sequence values (lengths, window sizes, context length, target group size) live in
:class:`SeqMask` and are runtime values in kernels.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple


class MaskKind(enum.IntEnum):
    NONE = 0
    LOCAL = 1
    CAUSAL = 2
    # FBGEMM's arbitrary mask: per-row key intervals read from a ``func`` tensor (SeqMask.func).
    FUNC = 3


class TileClass(enum.IntEnum):
    EMPTY = 0  # never loaded, never computed
    FULL = 1  # computed with no mask code
    PARTIAL = 2  # computed, then the predicate is applied per element


@dataclass(frozen=True)
class MaskSpec:
    """Static (compile-time) description of the mask family."""

    kind: MaskKind = MaskKind.NONE
    has_context: bool = False
    has_target: bool = False
    is_delta_q: bool = False

    def __post_init__(self):
        if (self.has_context or self.has_target) and self.kind not in (MaskKind.CAUSAL, MaskKind.LOCAL):
            raise ValueError("context/target masks take the causal window (-1, 0) or a causal band (WL, 0)")

    @property
    def semi_local(self) -> bool:
        """A causal band ``(WL, 0)`` with contexts and/or targets (docs/operator.md, "Local window
        with contexts and targets"): the HSTU rules AND the band, counted in HSTU's positions."""
        return self.kind == MaskKind.LOCAL and (self.has_context or self.has_target)

    @property
    def name(self) -> str:
        parts = [self.kind.name.lower()]
        if self.has_context:
            parts.append("context")
        if self.has_target:
            parts.append("target")
        if self.is_delta_q:
            parts.append("deltaq")
        return "+".join(parts)


def normalize_window(window_size: tuple[int, int], max_seqlen_k: int) -> tuple[MaskKind, int, int]:
    """Spec section 4 window normalization: returns (kind, WL, WR) against max_seqlen_k. A left
    side of at least ``max_seqlen_k - 1`` reaches every earlier key from every row (both lie in
    ``[0, max_seqlen_k)``), so it is unbounded: a whole-sequence band with contexts / targets is
    the causal family's mask exactly, and runs its kernels (the semi-local ones cost the recsys
    shape 9-13% more on the same mask, docs/dev/perf-log.md session 36). The right side keeps
    the spec's rule: ``(left, 0)`` must stay causal at ``max_seqlen_k = 1``."""
    left, right = int(window_size[0]), int(window_size[1])
    wl = max_seqlen_k if left < 0 or left >= max_seqlen_k - 1 else left
    wr = max_seqlen_k if right < 0 or right > max_seqlen_k else right
    causal = wl == max_seqlen_k and wr == 0
    local = (wl < max_seqlen_k or wr < max_seqlen_k) and not causal
    if local:
        return MaskKind.LOCAL, wl, wr
    return (MaskKind.CAUSAL if causal else MaskKind.NONE), wl, wr


class Ops(NamedTuple):
    min: Callable[[Any, Any], Any]
    max: Callable[[Any, Any], Any]
    select: Callable[[Any, Any, Any], Any]


PY_OPS = Ops(min=min, max=max, select=lambda c, a, b: a if c else b)


@dataclass
class SeqMask:
    """Per-sequence runtime mask values (Python ints, tensors or DSL scalars).

    ``seqlen_q``/``seqlen_k`` are the valid lengths; ``history_end`` is ``seqlen_k - num_targets``
    (``seqlen_k`` when there are no targets); ``num_context`` is 0 without contexts.
    """

    seqlen_q: Any
    seqlen_k: Any
    window_left: Any = 0
    window_right: Any = 0
    num_context: Any = 0
    history_end: Any = 0
    group_size: Any = 1
    # Key-coordinate position of query 0: seqlen_k - seqlen_q for delta_q (bottom-right
    # alignment), else 0. A runtime value in kernels, so delta_q needs no kernel variant.
    row_offset: Any = 0
    # MaskKind.FUNC: the sequence's interval bounds, ``func.bound(i, r)`` for key-coordinate row
    # ``r`` and bound ``i`` in 0..2 (:func:`row_intervals`); None for the other kinds.
    func: Any = None
    # A block-sparse call's tables for this sequence and head (kernels: common.seqinfo.BlockTiles),
    # else None. The tile tests here stay the HSTU mask's: the kernels walk lists of kept tiles and
    # mask the mixed ones by block after the HSTU mask (common.mask_apply.mask_dropped_blocks).
    sparse: Any = None


def _is_tensor(x) -> bool:
    return type(x).__module__.startswith("torch")


def _tensors(*xs):
    """``xs`` as tensors on the device of the first tensor among them. A Python int left as a CPU
    scalar lets ``torch.where`` launch on the current device rather than the operands' (measured on
    torch 2.13: an illegal address with the operands on cuda:1 and cuda:0 current)."""
    import torch

    device = next((x.device for x in xs if isinstance(x, torch.Tensor)), None)
    return [torch.as_tensor(x, device=device) for x in xs]


def _gmin(a, b):
    if _is_tensor(a) or _is_tensor(b):
        import torch

        return torch.minimum(*_tensors(a, b))
    return min(a, b)


def _gmax(a, b):
    if _is_tensor(a) or _is_tensor(b):
        import torch

        return torch.maximum(*_tensors(a, b))
    return max(a, b)


def _gselect(c, a, b):
    if _is_tensor(c):
        import torch

        return torch.where(*_tensors(c, a, b))
    return a if c else b


# Python ints and torch tensors alike (the oracle and the host side); kernels pass KERNEL_OPS.
GENERIC_OPS = Ops(min=_gmin, max=_gmax, select=_gselect)


def row_intervals(spec: MaskSpec, seq: SeqMask, r, ops: Ops = GENERIC_OPS):
    """Row ``r`` (key coordinates) allows the keys ``j < lo_end`` and ``hi_start <= j <= hi_end``
    (intersected with ``j < seqlen_k``). This is the definition of M(r, j): :func:`allowed` is
    built from it, and kernels evaluate it once per row, then compare columns only.

    * none: ``[0, Lk)``; local: ``[r - WL, r + WR]``;
    * causal: ``[0, r]``; a target row (``r >= h_end``) instead allows every key before the
      targets and its own group up to itself: ``[0, h_end)`` and ``[h_end + g*floor((r - h_end)/g), r]``;
      a context row (``r < c``) also allows every key before the targets: ``[0, h_end)``.
    """
    if spec.kind == MaskKind.NONE:
        return seq.seqlen_k, 1, 0
    if spec.semi_local:
        return _semi_local_intervals(spec, seq, r, ops)
    if spec.kind == MaskKind.LOCAL:
        return 0, r - seq.window_left, r + seq.window_right
    if spec.kind == MaskKind.FUNC:
        # [0, f0) and [f1, f2): the kernels' two intervals hold n_func <= 3 (n_func 1 reads f0 as
        # f1 and f2, an empty second interval).
        f = seq.func
        return f.bound(0, r), f.bound(1, r), f.bound(2, r) - 1
    lo_end, hi_start, hi_end = r + 1, 1, 0
    if spec.has_target:
        h_end = seq.history_end
        is_target = r >= h_end
        # For r < h_end the quotient may be negative (truncated in kernels); it is not selected.
        group_start = h_end + seq.group_size * ((r - h_end) // seq.group_size)
        lo_end = ops.select(is_target, h_end, lo_end)
        hi_start = ops.select(is_target, group_start, hi_start)
        hi_end = ops.select(is_target, r, hi_end)
    if spec.has_context:
        lo_end = ops.select(r < seq.num_context, ops.max(lo_end, seq.history_end), lo_end)
    return lo_end, hi_start, hi_end


def _first_key_seen(x, seq: SeqMask, ops: Ops):
    """The first key the band ``(WL, 0)`` reaches from (anchored) position ``x``: the context keys
    count as one position just before the history, so they come into the band together, and then
    every key before ``x`` is in it."""
    start = x - seq.window_left
    return ops.select(start < seq.num_context, 0, start)


def _semi_local_intervals(spec: MaskSpec, seq: SeqMask, r, ops: Ops):
    """:func:`row_intervals` of a causal band ``(WL, 0)`` with contexts (``c``) and/or targets
    (history end ``h``, group size ``g``): the HSTU rules AND the band, the band counted in HSTU's
    positions, where the ``c`` contexts are one position (just before the history) and every target
    sits at the history's end (generative-recommenders' attention ids; a target's band does not
    depend on its order among the targets). Context rows see ``[0, h)``, as in the causal family.

    * context row ``r < c``: ``[0, h)``;
    * history row ``c <= r < h``: ``[F(r), r]``;
    * target row ``r >= h``: ``[F(h), h - 1]`` and its group up to itself ``[G, r]``,
      ``G = h + g * floor((r - h) / g)``;

    with ``F(x) = x - WL``, or 0 once the band reaches the contexts (``x - WL < c``). Three values
    ``(lo_end, hi_start, hi_end)`` without targets, five ``(lo_end, mid_start, mid_end, hi_start,
    hi_end)`` with them (a target row's two intervals)."""
    h_end = seq.history_end
    lo_end, hi_start, hi_end = 0, _first_key_seen(r, seq, ops), r
    if spec.has_context:
        is_context = r < seq.num_context
        lo_end = ops.select(is_context, h_end, lo_end)
        hi_start = ops.select(is_context, 1, hi_start)
        hi_end = ops.select(is_context, 0, hi_end)
    if not spec.has_target:
        return lo_end, hi_start, hi_end
    is_target = r >= h_end
    # For r < h_end the quotient may be negative (truncated in kernels); it is not selected.
    group_start = h_end + seq.group_size * ((r - h_end) // seq.group_size)
    mid_start = ops.select(is_target, _first_key_seen(h_end, seq, ops), 1)
    mid_end = ops.select(is_target, h_end - 1, 0)
    hi_start = ops.select(is_target, group_start, hi_start)
    return lo_end, mid_start, mid_end, hi_start, hi_end


def shifted(bounds: tuple, col0) -> tuple:
    """A row's :func:`row_intervals` in the columns of a tile starting at key ``col0``."""
    return tuple(b - col0 for b in bounds)


def in_intervals(j, bounds: tuple, seqlen_k):
    """Key ``j`` in a row's :func:`row_intervals` ``bounds`` (three or five values) and ``j < seqlen_k``."""
    if len(bounds) == 5:
        lo_end, mid_start, mid_end, hi_start, hi_end = bounds
        return ((j < lo_end) | ((j >= mid_start) & (j <= mid_end)) | ((j >= hi_start) & (j <= hi_end))) & (
            j < seqlen_k)
    lo_end, hi_start, hi_end = bounds
    return ((j < lo_end) | ((j >= hi_start) & (j <= hi_end))) & (j < seqlen_k)


def in_row_intervals(spec: MaskSpec, j, bounds: tuple, seqlen_k):
    """:func:`in_intervals` without the compares of an interval that ``spec`` makes empty for
    every row and every column ``j >= 0`` (also after shifting the row's values and ``seqlen_k``
    by the same tile offset ``col0 >= 0``): ``[0, lo_end)`` is ``[0, seqlen_k)`` without a mask
    and ``[0, 0)`` for local; ``[hi_start, hi_end]`` is ``[1, 0]`` unless local or causal with
    targets. Kernels evaluate it per accumulator element: the causal D128 forward lost 4
    instructions per element (LLVM cannot prove ``1 - col0 > -col0`` empty)."""
    keep_lo = spec.kind in (MaskKind.CAUSAL, MaskKind.FUNC) or spec.semi_local
    keep_hi = spec.kind in (MaskKind.LOCAL, MaskKind.FUNC) or spec.has_target
    if len(bounds) == 5 or (keep_lo and keep_hi):
        return in_intervals(j, bounds, seqlen_k)
    lo_end, hi_start, hi_end = bounds
    in_col_range = j < seqlen_k
    if keep_lo:
        return (j < lo_end) & in_col_range
    if keep_hi:
        return (j >= hi_start) & (j <= hi_end) & in_col_range
    return in_col_range


def allowed(spec: MaskSpec, seq: SeqMask, r, j, ops: Ops = GENERIC_OPS):
    """M(r, j) for key-coordinate row ``r`` and key column ``j``; elementwise on broadcasting
    tensors. Padded columns (``j >= seqlen_k``) are masked."""
    return in_intervals(j, row_intervals(spec, seq, r, ops), seq.seqlen_k)


# ---------------------------------------------------------------------------------------------
# Tile classification: for an m-block (tile_m query rows) and n-blocks (tile_n keys).
# Conservative where it must be: a tile reported FULL is fully allowed, a tile reported EMPTY is
# fully masked; anything else is PARTIAL.
# ---------------------------------------------------------------------------------------------


def _ceil_div(a, b):
    return (a + b - 1) // b


def m_block_rows(seq: SeqMask, m_block, tile_m, ops: Ops = PY_OPS):
    """First and last key-coordinate rows of the valid queries of this m-block."""
    off = seq.row_offset
    first = off + m_block * tile_m
    last = off + ops.min((m_block + 1) * tile_m, seq.seqlen_q) - 1
    return first, last


def n_block_range(spec: MaskSpec, seq: SeqMask, m_block, tile_m, tile_n, ops: Ops = PY_OPS):
    """[n_lo, n_hi): the n-blocks that may hold an allowed key for this m-block."""
    r_first, r_last = m_block_rows(seq, m_block, tile_m, ops)
    n_total = _ceil_div(seq.seqlen_k, tile_n)
    n_lo = 0
    n_hi = n_total
    if spec.semi_local:
        # Up to the row (context rows: up to the targets); from the first key the band reaches from
        # the first row (target rows: from the history's end).
        n_hi = ops.min(n_total, r_last // tile_n + 1)
        first_key = _first_key_seen(r_first, seq, ops)
        if spec.has_target:
            first_key = ops.select(r_last >= seq.history_end,
                                   ops.min(first_key, _first_key_seen(seq.history_end, seq, ops)), first_key)
        n_lo = ops.max(first_key, 0) // tile_n
        if spec.has_context:
            context_hi = ops.select(r_first < seq.num_context, _ceil_div(seq.history_end, tile_n), 0)
            n_hi = ops.min(n_total, ops.max(n_hi, context_hi))
    elif spec.kind == MaskKind.LOCAL:
        n_lo = ops.max(r_first - seq.window_left, 0) // tile_n
        n_hi = ops.min(n_total, (r_last + seq.window_right) // tile_n + 1)
    elif spec.kind == MaskKind.FUNC:
        lo, hi = seq.func.key_range(m_block, tile_m)
        n_lo = ops.max(lo, 0) // tile_n
        n_hi = ops.min(n_total, (hi + tile_n - 1) // tile_n)
    elif spec.kind == MaskKind.CAUSAL:
        n_hi = ops.min(n_total, r_last // tile_n + 1)
        if spec.has_context:
            # Context rows see every key before the targets.
            context_hi = ops.select(r_first < seq.num_context, _ceil_div(seq.history_end, tile_n), 0)
            n_hi = ops.min(n_total, ops.max(n_hi, context_hi))
    n_hi = ops.max(n_hi, n_lo)
    return n_lo, n_hi


def target_hole(spec: MaskSpec, seq: SeqMask, m_block, tile_m, tile_n, n_lo, n_hi, ops: Ops = PY_OPS):
    """[hole_lo, hole_hi) within [n_lo, n_hi): n-blocks masked for every row of the m-block
    because they lie in the earlier target groups (empty, never loaded). Empty range if none."""
    if not spec.has_target:
        return n_lo, n_lo
    r_first, _ = m_block_rows(seq, m_block, tile_m, ops)
    h_end = seq.history_end
    g = seq.group_size
    # Rows before h_end mask every key >= h_end, so the common hole is set by the first row at or
    # after h_end.
    first_target_row = ops.max(r_first, h_end)
    hole_end = h_end + g * ((first_target_row - h_end) // g)
    hole_lo = ops.min(ops.max(_ceil_div(h_end, tile_n), n_lo), n_hi)
    hole_hi = ops.max(ops.min(hole_end // tile_n, n_hi), hole_lo)
    return hole_lo, hole_hi


def tile_is_full(spec: MaskSpec, seq: SeqMask, m_block, n_block, tile_m, tile_n, ops: Ops = PY_OPS):
    """True only if every (valid row, column) of the tile is allowed and every column < seqlen_k."""
    r_first, r_last = m_block_rows(seq, m_block, tile_m, ops)
    j_first = n_block * tile_n
    j_last = j_first + tile_n - 1
    full = j_last < seq.seqlen_k
    if spec.kind == MaskKind.FUNC:
        common_end, common2_lo, common2_hi = seq.func.common_keys(m_block, tile_m)
        return full & ((j_last < common_end) | ((j_first >= common2_lo) & (j_last < common2_hi)))
    if spec.semi_local:
        # Conservative over every kind of row the tile holds, mixed tiles included (a sequence's
        # last m-block holds history and target rows: as partial tiles they cost the recsys shape
        # 15% of its forward): every row needs j_last < h_end (context rows see the keys before
        # the targets, target rows the history's band); history rows also j_last <= their first
        # row; and the band's start, non-decreasing in the row (target rows anchored at the
        # history's end), must not pass j_first.
        c, h_end = seq.num_context, seq.history_end
        no_history_rows = (r_last < c) | (r_first >= h_end)
        band_start = _first_key_seen(ops.min(r_last, h_end), seq, ops)
        full = full & (j_last < h_end) & (j_first >= band_start) & ((j_last <= ops.max(r_first, c)) | no_history_rows)
    elif spec.kind == MaskKind.LOCAL:
        full = full & (j_first >= r_last - seq.window_left) & (j_last <= r_first + seq.window_right)
    elif spec.kind == MaskKind.CAUSAL:
        if spec.has_context:
            # History rows (r >= c) need j_last <= r; context rows (r < c) need j_last < h_end.
            c = seq.num_context
            below = ((j_last <= ops.max(r_first, c)) | (r_last < c)) & ((j_last < seq.history_end) | (r_first >= c))
        else:
            below = j_last <= r_first
        if spec.has_target:
            h_end = seq.history_end
            g = seq.group_size
            last_hole_end = h_end + g * ((r_last - h_end) // g)
            below = below & (
                (r_last < h_end) | (j_last < h_end) | (j_first >= last_hole_end) | (last_hole_end == h_end)
            )
        full = full & below
    return full


def n_block_schedule(spec: MaskSpec, seq: SeqMask, m_block, tile_m, tile_n, ops: Ops = PY_OPS):
    """(n_lo, hole_lo, hole_size, count): the non-empty n-blocks of an m-block are
    ``n_block_at(i)`` for i in [0, count)."""
    n_lo, n_hi = n_block_range(spec, seq, m_block, tile_m, tile_n, ops)
    hole_lo, hole_hi = target_hole(spec, seq, m_block, tile_m, tile_n, n_lo, n_hi, ops)
    hole_size = hole_hi - hole_lo
    return n_lo, hole_lo, hole_size, (n_hi - n_lo) - hole_size


def n_block_at(i, n_lo, hole_lo, hole_size, ops: Ops = PY_OPS):
    """The i-th non-empty n-block (ascending), skipping the target hole."""
    n = n_lo + i
    return ops.select(n >= hole_lo, n + hole_size, n)


def tile_nonempty(spec: MaskSpec, seq: SeqMask, m_block, n_block, tile_m, tile_n, ops: Ops = PY_OPS):
    """Whether (m_block, n_block) is in the m-block's schedule (the same test the forward uses)."""
    n_lo, hole_lo, hole_size, count = n_block_schedule(spec, seq, m_block, tile_m, tile_n, ops)
    in_range = (n_block >= n_lo) & (n_block < n_lo + count + hole_size)
    nonempty = in_range & ((n_block < hole_lo) | (n_block >= hole_lo + hole_size))
    return nonempty


def m_block_range(spec: MaskSpec, seq: SeqMask, n_block, tile_m, tile_n, ops: Ops = PY_OPS):
    """[m_lo, m_hi): the m-blocks that may attend to this n-block (a superset: callers skip the
    tiles :func:`tile_nonempty` rejects, e.g. the target hole)."""
    m_total = _ceil_div(seq.seqlen_q, tile_m)
    j_first = n_block * tile_n
    j_last = j_first + tile_n - 1
    off = seq.row_offset
    m_lo = 0
    m_hi = m_total
    if spec.semi_local:
        # Rows from the key (every row, with contexts: context rows see every key before the
        # targets) to the last whose band reaches it; a context key sits at the contexts' one
        # position (c - 1); the target rows see a key inside the history's band, and their own.
        last_key = ops.select(j_first < seq.num_context, ops.max(j_last, seq.num_context - 1), j_last)
        m_hi = ops.min(m_total, ops.max(last_key + seq.window_left - off, -1) // tile_m + 1)
        if spec.has_target:
            m_hi = ops.select(j_last >= _first_key_seen(seq.history_end, seq, ops), m_total, m_hi)
        if not spec.has_context:
            m_lo = ops.max(j_first - off, 0) // tile_m
    elif spec.kind == MaskKind.LOCAL:
        m_lo = ops.max(j_first - seq.window_right - off, 0) // tile_m
        m_hi = ops.min(m_total, ops.max(j_last + seq.window_left - off, -1) // tile_m + 1)
    elif spec.kind == MaskKind.CAUSAL and not spec.has_context:
        m_lo = ops.max(j_first - off, 0) // tile_m
    elif spec.kind == MaskKind.FUNC:
        rows_lo, rows_hi = seq.func.query_rows(n_block, tile_n)
        m_lo = rows_lo // tile_m
        m_hi = ops.min(m_total, _ceil_div(rows_hi, tile_m))
    m_lo = ops.min(m_lo, m_hi)
    return m_lo, m_hi


def classify_tiles(spec: MaskSpec, seq: SeqMask, tile_m: int, tile_n: int) -> list[list[TileClass]]:
    """Host-side classification grid [m_block][n_block] for one sequence (Python ints)."""
    n_m = _ceil_div(seq.seqlen_q, tile_m)
    n_n = _ceil_div(seq.seqlen_k, tile_n)
    grid = []
    for m in range(n_m):
        row = [TileClass.EMPTY] * n_n
        n_lo, hole_lo, hole_size, count = n_block_schedule(spec, seq, m, tile_m, tile_n)
        for i in range(count):
            n = n_block_at(i, n_lo, hole_lo, hole_size)
            full = tile_is_full(spec, seq, m, n, tile_m, tile_n)
            row[n] = TileClass.FULL if full else TileClass.PARTIAL
        grid.append(row)
    return grid


def seq_mask_from_lengths(
    spec: MaskSpec,
    seqlen_q: int,
    seqlen_k: int,
    window_left: int = 0,
    window_right: int = 0,
    num_context: int = 0,
    num_target: int = 0,
    group_size: int = 1,
) -> SeqMask:
    return SeqMask(
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        window_left=window_left,
        window_right=window_right,
        num_context=num_context if spec.has_context else 0,
        history_end=seqlen_k - (num_target if spec.has_target else 0),
        group_size=group_size,
        row_offset=seqlen_k - seqlen_q if spec.is_delta_q else 0,
    )


def dense_mask(spec: MaskSpec, seq: SeqMask, device=None):
    """(seqlen_q, seqlen_k) bool tensor of M(i, j) for one sequence (query index i)."""
    import torch

    i = torch.arange(int(seq.seqlen_q), device=device).unsqueeze(1)
    j = torch.arange(int(seq.seqlen_k), device=device).unsqueeze(0)
    return torch.broadcast_to(allowed(spec, seq, i + seq.row_offset, j), (int(seq.seqlen_q), int(seq.seqlen_k)))


# ---------------------------------------------------------------------------------------------
# Arbitrary masks (FBGEMM's ``func``): per-row key intervals, replacing the mask families above.
# ---------------------------------------------------------------------------------------------
#: Rows of padding a ``func`` tensor carries past the last query row (FBGEMM's layout): kernels
#: read the intervals of a whole query tile without bounds checks.
FUNC_ROW_PADDING = 256
#: Query rows (and keys) per entry of a func call's table (``func_key_ranges``): every kernel's
#: tile is a multiple or a divisor of it.
FUNC_BLOCK_ROWS = 64


def func_row_allows(func_rows, j):
    """Whether key ``j`` is allowed for each query row of ``func_rows``, an ``(n_func, rows, ...)``
    stack of one sequence's interval bounds (``n_func`` odd; per-sequence key positions): row i
    allows ``[0, f[0, i])`` and ``[f[2m-1, i], f[2m, i])`` for ``m = 1 .. (n_func-1)/2``. Broadcasts
    over ``j`` (torch tensors or Python ints)."""
    keep = j < func_rows[0]
    for m in range(1, (len(func_rows) - 1) // 2 + 1):
        keep = keep | ((j >= func_rows[2 * m - 1]) & (j < func_rows[2 * m]))
    return keep


def func_dense_mask(func, row_start: int, seqlen_q: int, seqlen_k: int, device=None):
    """(seqlen_q, seqlen_k) bool of a sequence under a ``func`` mask ``(1, n_func, rows)`` whose
    query rows start at global row ``row_start`` (rows index the jagged q, not delta_q positions);
    keys past ``seqlen_k`` are masked by construction."""
    import torch

    rows = func[0, :, row_start:row_start + seqlen_q].to(device=device, dtype=torch.int64)[:, :, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return func_row_allows(rows, j).expand(seqlen_q, seqlen_k)


#: Columns of a func call's per-block table (``func_key_ranges``): five per block of query rows,
#: two per block of keys.
FUNC_TABLE_COLUMNS = ("key_lo", "key_hi", "common_end", "common2_lo", "common2_hi", "rows_first_from_big",
                      "rows_past")
#: Where a func table says "none" (int32 max // 2: sums of two bounds never overflow).
FUNC_TABLE_BIG = (1 << 31) // 2 - 1


def func_table_blocks(max_seqlen_q: int, max_seqlen_k: int) -> int:
    """Entries per sequence of a func table: the longer of ``max_seqlen_q`` and ``max_seqlen_k``
    rounded up to 256 (the tallest tile) in :data:`FUNC_BLOCK_ROWS`."""
    return -(-max(max_seqlen_q, max_seqlen_k, 1) // 256) * (256 // FUNC_BLOCK_ROWS)


def func_key_ranges(func, seq_offsets_q, max_seqlen_q: int, max_seqlen_k: int):
    """(B, blocks, 7) int32 on ``func``'s device: for each sequence and each
    :data:`FUNC_BLOCK_ROWS` of its query rows, resp. of its keys (:data:`FUNC_TABLE_COLUMNS`):

    * ``[key_lo, key_hi)``: the first key any of those rows allows and one past the last (``[big,
      0)`` where none does), over ``func``'s intervals (:func:`func_row_allows`);
    * ``[0, common_end)`` and ``[common2_lo, common2_hi)``: keys every one of those rows allows
      through its first, resp. second interval (empty for n_func 1);
    * ``[big - rows_first_from_big, rows_past)``: of the blocks of keys, the first and one past the
      last block of query rows whose ``[key_lo, key_hi)`` meets them (``(0, 0)`` where none does:
      the kernel builds these two columns with atomic max into a zeroed table).

    ``blocks`` (:func:`func_table_blocks`) covers the tallest tile, so a tile never reads past the
    table. The kernels skip the key blocks outside ``[key_lo, key_hi)`` (the dK/dV kernels the
    query blocks outside the key block's range) and apply no mask to a tile inside a common
    interval: causal spelled as func then masks only the diagonal tiles, as the causal kernels do.
    :class:`hstu_cute.ampere.func_table.FuncTableSm80` builds it in one launch; this is its
    definition (plain torch)."""
    import torch

    device = func.device
    batch = seq_offsets_q.shape[0] - 1
    blocks = func_table_blocks(max_seqlen_q, max_seqlen_k)
    big = FUNC_TABLE_BIG
    n_func = func.shape[1]
    total = func.shape[2] - FUNC_ROW_PADDING
    f = func[0, :, :total].to(torch.int64)
    start = torch.where(f[0] > 0, 0, big)
    end = f[0].clamp(min=0)
    for m in range(1, (n_func - 1) // 2 + 1):
        live = f[2 * m] > f[2 * m - 1]
        start = torch.minimum(start, torch.where(live, f[2 * m - 1].clamp(min=0), big))
        end = torch.maximum(end, torch.where(live, f[2 * m], 0))
    rows = torch.arange(total, device=device)
    seq = (torch.searchsorted(seq_offsets_q[1:].to(torch.int64), rows, right=True)).clamp(max=max(batch - 1, 0))
    local = rows - seq_offsets_q.to(torch.int64)[seq]
    index = seq * blocks + (local // FUNC_BLOCK_ROWS).clamp(max=blocks - 1)
    size = max(batch, 1) * blocks
    columns = []
    for values, reduce, empty in ((start, "amin", big), (end, "amax", 0), (f[0], "amin", big),
                                  (f[1] if n_func >= 3 else None, "amax", -big),
                                  (f[2] if n_func >= 3 else None, "amin", big)):
        column = torch.full((size,), empty, dtype=torch.int64, device=device)
        if values is None:  # n_func 1: no second interval, the common one empty
            column.fill_(big if reduce == "amax" else -big)
        else:
            column.scatter_reduce_(0, index, values.clamp(-big, big), reduce)
        columns.append(column)
    key_lo, key_hi = columns[0].view(-1, blocks), columns[1].view(-1, blocks)
    # meets[b, m, n]: row block m's key range meets key block n.
    key_first = torch.arange(blocks, device=device) * FUNC_BLOCK_ROWS
    meets = (key_lo[:, :, None] < key_first + FUNC_BLOCK_ROWS) & (key_hi[:, :, None] > key_first)
    row_block = torch.arange(blocks, device=device)[None, :, None]
    first = torch.where(meets, row_block, big).amin(dim=1)
    past = torch.where(meets, row_block + 1, 0).amax(dim=1)
    columns += [torch.where(past > 0, big - first, 0).view(-1), past.view(-1)]
    return torch.stack(columns, dim=1).view(max(batch, 1), blocks, len(columns))[:batch].to(torch.int32)
