"""Mask engine tests (CPU): spec section 4 worked grids, window normalization, and the tile
classification against the dense predicate."""

from __future__ import annotations

import random

import pytest
import torch

from hstu_cute import masks
from hstu_cute.masks import (
    MaskKind,
    MaskSpec,
    SeqMask,
    TileClass,
    allowed,
    classify_tiles,
    dense_mask,
    in_intervals,
    in_row_intervals,
    m_block_range,
    n_block_at,
    n_block_schedule,
    normalize_window,
    row_intervals,
    seq_mask_from_lengths,
    tile_nonempty,
)


def _dense(spec, seq) -> torch.Tensor:
    """dense_mask broadcast to (Lq, Lk): for MaskKind.NONE masks.py returns (1, Lk) (see
    test_dense_mask_shape_none below)."""
    return dense_mask(spec, seq).expand(int(seq.seqlen_q), int(seq.seqlen_k))


def _grid(text: str) -> list[list[int]]:
    return [[int(x) for x in line.split()] for line in text.strip().splitlines()]


def _mask(window, max_k, Lq, Lk, c=None, t=None, g=1, delta=False) -> list[list[int]]:
    kind, wl, wr = normalize_window(window, max_k)
    spec = MaskSpec(kind, has_context=c is not None, has_target=t is not None, is_delta_q=delta)
    seq = seq_mask_from_lengths(spec, Lq, Lk, wl, wr, c or 0, t or 0, g)
    return _dense(spec, seq).int().tolist()


# ------------------------------------------------------------------------------------------------
# Spec section 4 worked grids A-F, verbatim.
# ------------------------------------------------------------------------------------------------

GRID_A = """
1 1 1 1 0 0
1 1 0 0 0 0
1 1 1 0 0 0
1 1 1 1 0 0
1 1 1 1 1 0
1 1 1 1 0 1
"""
GRID_B = """
1 1 1 1 0 0
1 1 0 0 0 0
1 1 1 0 0 0
1 1 1 1 0 0
1 1 1 1 1 0
1 1 1 1 1 1
"""
GRID_C = """
1 1 1 1 0 0 0 0
1 1 1 1 0 0 0 0
1 1 1 0 0 0 0 0
1 1 1 1 0 0 0 0
1 1 1 1 1 0 0 0
1 1 1 1 1 1 0 0
1 1 1 1 0 0 1 0
1 1 1 1 0 0 1 1
"""
GRID_D = """
1 1 1 1 0 0
1 1 1 1 1 0
1 1 1 1 1 1
"""
GRID_E = """
0 1 1 1 1 0
0 0 1 1 1 1
0 0 0 1 1 1
"""


def test_grid_a_context_target_g1():
    assert _mask((-1, 0), 6, 6, 6, c=1, t=2, g=1) == _grid(GRID_A)


def test_grid_b_context_target_g2():
    assert _mask((-1, 0), 6, 6, 6, c=1, t=2, g=2) == _grid(GRID_B)


def test_grid_c_context_target_l8():
    assert _mask((-1, 0), 8, 8, 8, c=2, t=4, g=2) == _grid(GRID_C)


def test_grid_d_delta_q_causal():
    assert _mask((-1, 0), 6, 3, 6, delta=True) == _grid(GRID_D)


def test_grid_e_delta_q_local():
    assert _mask((2, 1), 6, 3, 6, delta=True) == _grid(GRID_E)


def test_grid_f_local_band():
    expected = [[int(abs(r - j) <= 1) for j in range(6)] for r in range(6)]
    assert _mask((1, 1), 6, 6, 6) == expected


def test_grid_padding_columns_and_rows_shapes():
    # dense_mask is (Lq, Lk); zero-length cases give empty tensors.
    kind, wl, wr = normalize_window((-1, 0), 5)
    spec = MaskSpec(kind)
    assert dense_mask(spec, seq_mask_from_lengths(spec, 0, 5, wl, wr)).shape == (0, 5)
    assert dense_mask(spec, seq_mask_from_lengths(spec, 3, 0, wl, wr)).shape == (3, 0)


def test_dense_mask_shape_none():
    kind, wl, wr = normalize_window((-1, -1), 5)
    spec = MaskSpec(kind)
    assert dense_mask(spec, seq_mask_from_lengths(spec, 4, 5, wl, wr)).shape == (4, 5)


def test_grid_none_all_allowed():
    assert _mask((-1, -1), 5, 4, 5) == [[1] * 5] * 4
    assert _mask((-1, -1), 6, 3, 6, delta=True) == [[1] * 6] * 3


# ------------------------------------------------------------------------------------------------
# Window normalization.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "window, max_k, expected",
    [
        ((-1, -1), 10, (MaskKind.NONE, 10, 10)),
        ((-1, 0), 10, (MaskKind.CAUSAL, 10, 0)),
        ((10, 0), 10, (MaskKind.CAUSAL, 10, 0)),  # left == max_k is unbounded
        ((11, 0), 10, (MaskKind.CAUSAL, 10, 0)),  # left > max_k is unbounded
        ((1000, -1), 10, (MaskKind.NONE, 10, 10)),
        ((11, 11), 10, (MaskKind.NONE, 10, 10)),
        ((10, 10), 10, (MaskKind.NONE, 10, 10)),
        ((-1, 1000), 10, (MaskKind.NONE, 10, 10)),
        ((9, 0), 10, (MaskKind.CAUSAL, 10, 0)),  # left == max_k - 1 already reaches every key
        ((8, 0), 10, (MaskKind.LOCAL, 8, 0)),
        ((0, 0), 1, (MaskKind.CAUSAL, 1, 0)),
        ((-1, 0), 1, (MaskKind.CAUSAL, 1, 0)),
        ((0, 9), 10, (MaskKind.LOCAL, 0, 9)),
        ((0, 0), 10, (MaskKind.LOCAL, 0, 0)),
        ((2, 1), 6, (MaskKind.LOCAL, 2, 1)),
        ((3, -1), 10, (MaskKind.LOCAL, 3, 10)),
        ((-1, 3), 10, (MaskKind.LOCAL, 10, 3)),
        ((5, 20), 10, (MaskKind.LOCAL, 5, 10)),
        ((20, 5), 10, (MaskKind.LOCAL, 10, 5)),
        ((111, 11), 99, (MaskKind.LOCAL, 99, 11)),
        ((111, 222), 99, (MaskKind.NONE, 99, 99)),
        ((111, 222), 2000, (MaskKind.LOCAL, 111, 222)),
    ],
)
def test_normalize_window(window, max_k, expected):
    kind, wl, wr = normalize_window(window, max_k)
    assert (kind, wl, wr) == expected
    assert isinstance(kind, MaskKind)


@pytest.mark.parametrize("contexts,targets", [(0, 0), (3, 0), (0, 4), (2, 5)])
def test_a_side_of_max_k_minus_one_is_unbounded(contexts, targets):
    """Why normalize_window treats ``left >= max_k - 1`` as unbounded: the band (max_k - 1, 0),
    with contexts and targets (semi-local) or without, allows exactly the causal family's keys for
    every sequence length up to max_k, delta_q rows included; without contexts and targets
    (max_k - 2, 0) does not."""
    max_k = 13
    for seqlen in range(max(contexts + targets, 1), max_k + 1):
        for seqlen_q in (seqlen, max(seqlen - 4, 1)):
            r = torch.arange(seqlen - seqlen_q, seqlen).view(-1, 1)
            j = torch.arange(seqlen).view(1, -1)

            def keys(kind, left):
                spec = MaskSpec(kind, has_context=contexts > 0, has_target=targets > 0)
                seq = SeqMask(seqlen_q, seqlen, window_left=left, window_right=0, num_context=contexts,
                              history_end=seqlen - targets, group_size=2, row_offset=seqlen - seqlen_q)
                return allowed(spec, seq, r, j)

            causal = keys(MaskKind.CAUSAL, max_k)
            assert torch.equal(keys(MaskKind.LOCAL, max_k - 1), causal), (seqlen, seqlen_q)
    if contexts == targets == 0:  # with contexts or targets shorter bands can be causal too
        assert not torch.equal(keys(MaskKind.LOCAL, max_k - 2), causal)


def test_mask_spec_rejects_context_target_without_causal():
    with pytest.raises(ValueError):
        MaskSpec(MaskKind.NONE, has_target=True)
    with pytest.raises(ValueError):
        MaskSpec(MaskKind.FUNC, has_context=True)
    assert MaskSpec(MaskKind.LOCAL, has_context=True).semi_local
    assert not MaskSpec(MaskKind.LOCAL).semi_local and not MaskSpec(MaskKind.CAUSAL, has_target=True).semi_local


# ------------------------------------------------------------------------------------------------
# Dense mask vs a literal transcription of the spec predicate, on random configurations.
# ------------------------------------------------------------------------------------------------


def _spec_allowed(kind, wl, wr, r, j, c, h_end, g, has_ctx, has_tgt) -> bool:
    if kind == "none":
        return True
    if kind == "local" and (has_ctx or has_tgt):
        # A causal band with contexts / targets: the HSTU rules AND the band, counted in positions
        # where the contexts are one (c - 1) and the targets sit at the history's end (h_end), as
        # generative-recommenders' attention ids are; the context rows keep their rule.
        if not _spec_allowed("causal", wl, wr, r, j, c, h_end, g, has_ctx, has_tgt):
            return False
        if has_ctx and r < c:
            return True
        row = min(r, h_end) if has_tgt else r
        key = max(j, c - 1) if has_ctx else j
        return row - key <= wl
    if kind == "local":
        return r - wl <= j <= r + wr
    if has_ctx and r < c and j < h_end:
        return True
    if j > r:
        return False
    if has_tgt and r >= h_end and h_end <= j < h_end + g * ((r - h_end) // g):
        return False
    return True


FAMILIES = ["none", "causal", "local", "context", "target", "context+target", "local+context", "local+target",
            "local+context+target"]


def _draw_config(rng: random.Random, max_len: int):
    fam = rng.choice(FAMILIES)
    delta = rng.random() < 0.35 and fam in ("none", "causal", "local", "local+target")
    Lk = rng.choice([0, 1, rng.randint(0, max_len), rng.randint(max_len // 2, max_len)])
    if delta:
        Lq = rng.randint(0, Lk)
    else:
        Lq = Lk
    max_k = Lk + rng.choice([0, 0, rng.randint(0, 50)])
    if fam == "none":
        window = rng.choice([(-1, -1), (max_k, max_k + 3)])
    elif fam == "local":
        window = (rng.choice([-1, rng.randint(0, 40), rng.randint(0, max_k + 5)]),
                  rng.choice([-1, 0, rng.randint(0, 40), rng.randint(0, max_k + 5)]))  # fmt: skip
    elif fam.startswith("local+"):
        window = (rng.choice([0, 1, rng.randint(0, 40), rng.randint(0, max_k + 5)]), 0)
    else:
        window = (-1, 0)
    kind, wl, wr = normalize_window(window, max_k)
    has_ctx = "context" in fam
    has_tgt = "target" in fam
    c = rng.randint(0, Lk) if has_ctx else 0
    t = rng.randint(0, Lk - c) if has_tgt else 0
    if has_tgt and rng.random() < 0.15:
        c, t = 0, Lk  # all targets
    g = rng.choice([1, 2, 3, 7, 11, 64, 222])
    spec = MaskSpec(kind, has_context=has_ctx, has_target=has_tgt, is_delta_q=delta)
    seq = seq_mask_from_lengths(spec, Lq, Lk, wl, wr, c, t, g)
    return spec, seq, dict(kind=kind, wl=wl, wr=wr, c=c, t=t, g=g, Lq=Lq, Lk=Lk, delta=delta, fam=fam)


def test_dense_mask_matches_literal_spec_predicate():
    rng = random.Random(1234)
    for _ in range(150):
        spec, seq, cfg = _draw_config(rng, 24)
        got = _dense(spec, seq).tolist()
        off = cfg["Lk"] - cfg["Lq"] if cfg["delta"] else 0
        kind = {MaskKind.NONE: "none", MaskKind.LOCAL: "local", MaskKind.CAUSAL: "causal"}[cfg["kind"]]
        h_end = cfg["Lk"] - cfg["t"]
        for i in range(cfg["Lq"]):
            for j in range(cfg["Lk"]):
                want = _spec_allowed(kind, cfg["wl"], cfg["wr"], i + off, j, cfg["c"], h_end, cfg["g"],
                                     spec.has_context, spec.has_target)  # fmt: skip
                assert got[i][j] == want, (cfg, i, j)


# ------------------------------------------------------------------------------------------------
# Tile classification vs the dense predicate.
# ------------------------------------------------------------------------------------------------

TILES = [(16, 16), (64, 32), (128, 64), (64, 128), (128, 128), (16, 48)]


def _tile_stats(spec, seq, tm, tn, dense=None):
    """Per tile: (any allowed entry, every valid-row entry allowed with all columns < Lk)."""
    Lq, Lk = int(seq.seqlen_q), int(seq.seqlen_k)
    n_m, n_n = -(-Lq // tm), -(-Lk // tn)
    if dense is None:
        dense = _dense(spec, seq)
    padded_any = torch.zeros(n_m * tm, n_n * tn, dtype=torch.bool)
    padded_all = torch.zeros(n_m * tm, n_n * tn, dtype=torch.bool)
    padded_any[:Lq, :Lk] = dense
    padded_all[:Lq, :Lk] = dense
    padded_all[Lq:, :Lk] = True  # rows past Lq are not valid queries: they do not count
    any_t = padded_any.view(n_m, tm, n_n, tn).any(dim=3).any(dim=1)
    all_t = padded_all.view(n_m, tm, n_n, tn).all(dim=3).all(dim=1)
    return any_t, all_t


@pytest.fixture
def one_torch_thread():
    # Thousands of tiny tensor ops: intra-op threads only add contention (3-10x slower on a
    # loaded machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_classify_tiles_agrees_with_dense_predicate(one_torch_thread):
    rng = random.Random(20240611)
    counts = {fam: {c: 0 for c in TileClass} for fam in FAMILIES}
    non_tight = {fam: 0 for fam in FAMILIES}
    n_configs = 0
    for _ in range(400):
        spec, seq, cfg = _draw_config(rng, 320)
        dense = _dense(spec, seq)
        for tm, tn in rng.sample(TILES, 2):
            n_configs += 1
            grid = classify_tiles(spec, seq, tm, tn)
            n_m, n_n = -(-cfg["Lq"] // tm), -(-cfg["Lk"] // tn)
            assert len(grid) == n_m and all(len(row) == n_n for row in grid)
            if n_m == 0 or n_n == 0:
                continue
            any_t, all_t = _tile_stats(spec, seq, tm, tn, dense)
            cls = torch.tensor([[int(c) for c in row] for row in grid])
            empty, full = cls == TileClass.EMPTY, cls == TileClass.FULL
            info = (cfg, tm, tn)
            for m in range(n_m):
                # The schedule lists exactly the non-empty n-blocks, ascending, each once.
                n_lo, hole_lo, hole_size, count = n_block_schedule(spec, seq, m, tm, tn)
                blocks = [n_block_at(i, n_lo, hole_lo, hole_size) for i in range(count)]
                assert blocks == sorted(set(blocks)), (info, m, blocks)
                assert blocks == (~empty[m]).nonzero().flatten().tolist(), (info, m, blocks)
            # EMPTY tiles are fully masked; FULL tiles are fully allowed with every column < Lk.
            assert not (empty & any_t).any(), (info, (empty & any_t).nonzero().tolist())
            assert not (full & ~all_t).any(), (info, (full & ~all_t).nonzero().tolist())
            if full.any():
                last_full_col = int(full.nonzero()[:, 1].max())
                assert (last_full_col + 1) * tn <= cfg["Lk"], info
            tight = (full == all_t) & (empty == ~any_t)
            if not spec.has_context and not spec.has_target:
                # none / causal / local (incl. delta_q): the classification is exact.
                assert tight.all(), (info, (~tight).nonzero().tolist())
            else:
                non_tight[cfg["fam"]] += int((~tight).sum())
            for c in TileClass:
                counts[cfg["fam"]][c] += int((cls == c).sum())
    assert n_configs > 400
    total = {c: sum(counts[f][c] for f in FAMILIES) for c in TileClass}
    assert all(total[c] > 0 for c in TileClass), total
    for fam in ("causal", "local", "context", "target", "context+target", "local+context", "local+target",
                "local+context+target"):
        assert all(counts[fam][c] > 0 for c in TileClass), (fam, counts[fam])
    assert counts["none"][TileClass.FULL] > 0 and counts["none"][TileClass.PARTIAL] > 0
    assert counts["none"][TileClass.EMPTY] == 0


def test_backward_m_block_walk_visits_each_scheduled_tile_once():
    # The backward walks each n-block's m-blocks (m_block_range, filtered by tile_nonempty) while
    # the forward and the dQ kernels walk each m-block's n-block schedule: both must cover exactly
    # the same tiles, once each (a tile missed by one side drops its share of dK/dV or of dQ).
    rng = random.Random(77)
    checked = 0
    for _ in range(600):
        spec, seq, cfg = _draw_config(rng, 700)
        for tm, tn in ((64, 128), (64, 64), (128, 48), (128, 32), (16, 48)):
            n_m, n_n = -(-cfg["Lq"] // tm), -(-cfg["Lk"] // tn)
            visits = [0] * n_m
            for n in range(n_n):
                m_lo, m_hi = m_block_range(spec, seq, n, tm, tn)
                assert 0 <= m_lo <= m_hi <= max(n_m, 0), (cfg, tm, tn, n, m_lo, m_hi)
                for m in range(m_lo, m_hi):
                    visits[m] += bool(tile_nonempty(spec, seq, m, n, tm, tn))
            for m in range(n_m):
                count = n_block_schedule(spec, seq, m, tm, tn)[3]
                assert visits[m] == count, (cfg, tm, tn, m, visits[m], count)
                checked += 1
    assert checked > 10000

def test_classify_tiles_fully_allowed_interior_causal_is_full():
    # A hand-picked case: causal, L=256, 64x64 tiles -> strictly-below-diagonal tiles FULL,
    # diagonal tiles PARTIAL, above EMPTY.
    kind, wl, wr = normalize_window((-1, 0), 256)
    spec = MaskSpec(kind)
    seq = seq_mask_from_lengths(spec, 256, 256, wl, wr)
    grid = classify_tiles(spec, seq, 64, 64)
    for m in range(4):
        for n in range(4):
            want = TileClass.FULL if n < m else (TileClass.PARTIAL if n == m else TileClass.EMPTY)
            assert grid[m][n] == want, (m, n)


def test_classify_tiles_target_hole_is_skipped():
    # L=512, no context, 256 targets in groups of 64 with 64x64 tiles: the last m-block's rows
    # r in [448, 512) hide target groups [256, 448), i.e. n-blocks 4..6 are EMPTY.
    kind, wl, wr = normalize_window((-1, 0), 512)
    spec = MaskSpec(kind, has_target=True)
    seq = seq_mask_from_lengths(spec, 512, 512, wl, wr, 0, 256, 64)
    grid = classify_tiles(spec, seq, 64, 64)
    assert grid[7][:4] == [TileClass.FULL] * 4
    assert grid[7][4:7] == [TileClass.EMPTY] * 3
    assert grid[7][7] == TileClass.PARTIAL


def test_in_row_intervals_matches_in_intervals_in_tile_coordinates():
    # Kernels shift a row's intervals and seqlen_k by the tile's first column col0 and compare
    # tile columns j in [0, tile_n); in_row_intervals drops the compares the spec makes constant.
    rng = random.Random(7)
    for _ in range(300):
        spec, seq, cfg = _draw_config(rng, 40)
        off = cfg["Lk"] - cfg["Lq"] if cfg["delta"] else 0
        for i in range(cfg["Lq"]):
            bounds = row_intervals(spec, seq, i + off)
            assert len(bounds) == (5 if spec.semi_local and spec.has_target else 3)
            for col0 in (0, 8, 16, 32):
                tile_bounds, limit = masks.shifted(bounds, col0), seq.seqlen_k - col0
                for j in range(16):
                    want = in_intervals(j, tile_bounds, limit)
                    assert want == bool(masks.allowed(spec, seq, i + off, col0 + j)), (cfg, i, col0, j)
                    assert in_row_intervals(spec, j, tile_bounds, limit) == want, (cfg, i, col0, j)


# ---------------------------------------------------------------------------------------------
# Arbitrary (func) masks: FBGEMM's per-row key intervals
# ---------------------------------------------------------------------------------------------
def _func_allowed_loop(f, row, j):
    """FBGEMM's definition, element by element: [0, f0) or any [f(2m-1), f(2m))."""
    if j < f[0][row]:
        return True
    return any(f[2 * m - 1][row] <= j < f[2 * m][row] for m in range(1, (len(f) - 1) // 2 + 1))


@pytest.mark.parametrize("n_func", [1, 3, 5])
def test_func_dense_mask_matches_a_direct_loop(n_func):
    gen = torch.Generator().manual_seed(n_func)
    lengths = [0, 1, 17, 40]
    starts = [0, 0, 1, 18]
    total = sum(lengths)
    func = torch.randint(-3, 45, (1, n_func, total + masks.FUNC_ROW_PADDING), generator=gen, dtype=torch.int32)
    for start, length in zip(starts, lengths):
        for seqlen_k in (length, length + 5):
            got = masks.func_dense_mask(func, start, length, seqlen_k)
            f = func[0].tolist()
            want = torch.tensor([[_func_allowed_loop(f, start + i, j) for j in range(seqlen_k)] for i in range(length)],
                                dtype=torch.bool).reshape(length, seqlen_k)
            assert torch.equal(got, want)


def test_func_encoding_causal_gives_the_causal_oracle():
    """A func mask that spells causal ([0, i + 1) per row, the other intervals empty) gives the
    causal oracle exactly; one that differs in one row does not."""
    from hstu_cute.reference import hstu_attn_reference

    gen = torch.Generator().manual_seed(0)
    lengths = [5, 17, 1, 30]
    offsets = torch.tensor([0, 5, 22, 23, 53], dtype=torch.int32)
    q, k, v = (torch.randn(53, 2, 16, generator=gen) for _ in range(3))
    rows = torch.cat([torch.arange(n) + 1 for n in lengths] + [torch.zeros(masks.FUNC_ROW_PADDING, dtype=torch.int64)])
    func = torch.stack([rows, torch.zeros_like(rows), torch.zeros_like(rows)])[None].to(torch.int32)
    causal = hstu_attn_reference(q, k, v, offsets, offsets, 30, 30, window_size=(-1, 0))
    encoded = hstu_attn_reference(q, k, v, offsets, offsets, 30, 30, func=func)
    assert torch.equal(causal, encoded)
    func[0, 1, 7], func[0, 2, 7] = 10, 12  # row 7 (sequence 1, query 2) also sees keys 10, 11
    assert not torch.equal(causal, hstu_attn_reference(q, k, v, offsets, offsets, 30, 30, func=func))
    with pytest.raises(ValueError, match="func replaces the other masks"):
        hstu_attn_reference(q, k, v, offsets, offsets, 30, 30, window_size=(-1, 0), func=func)


@pytest.mark.parametrize("n_func,low", [(1, 0), (3, 0), (3, -5)])
def test_func_key_ranges_bound_every_row(n_func, low):
    """masks.func_key_ranges: per sequence and 64 query rows, [first allowed key, last + 1), exact
    for non-negative bounds and never narrower than the rows' allowed keys (the kernels skip the
    key blocks outside it); the common intervals allowed by every row of the block (the kernels
    leave tiles inside them unmasked), exact for the first."""
    gen = torch.Generator().manual_seed(n_func * 10 - low)
    lengths = [0, 1, 70, 200, 64]
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    total = sum(lengths)
    func = torch.randint(low, 300, (1, n_func, total + masks.FUNC_ROW_PADDING), generator=gen, dtype=torch.int32)
    table = masks.func_key_ranges(func, offsets, max(lengths), 300)
    assert table.shape == (len(lengths), 8, len(masks.FUNC_TABLE_COLUMNS)) and table.dtype == torch.int32
    keys = torch.arange(0, 400)
    big = torch.iinfo(torch.int32).max // 2
    for b, (start, n) in enumerate(zip(offsets.tolist(), lengths)):
        for block in range(table.shape[1]):
            rows = range(start + block * 64, start + min((block + 1) * 64, n))
            allowed = torch.zeros(keys.shape, dtype=torch.bool)
            allowed_by_all = torch.ones(keys.shape, dtype=torch.bool)
            for r in rows:
                row_allows = masks.func_row_allows(func[0, :, r].long()[:, None], keys)
                allowed |= row_allows
                allowed_by_all &= row_allows
            lo, hi, common_end, common2_lo, common2_hi = table[b, block, :5].tolist()
            common = (keys < common_end) | ((keys >= common2_lo) & (keys < common2_hi))
            assert not (common & ~allowed_by_all).any(), (b, block, common_end, common2_lo, common2_hi)
            if rows:
                assert common_end == int(func[0, 0, rows.start:rows.stop].min()), (b, block, common_end)
            if n_func == 1:
                assert common2_lo >= common2_hi
        # Per 64 keys: the query blocks whose key ranges meet them, exactly (what the dK/dV kernels walk).
        for key_block in range(table.shape[1]):
            meets = [m for m in range(table.shape[1])
                     if table[b, m, 0] < (key_block + 1) * 64 and table[b, m, 1] > key_block * 64]
            first_from_big, past = table[b, key_block, 5:].tolist()
            assert (big - first_from_big, past) == ((meets[0], meets[-1] + 1) if meets else (big, 0)), (b, key_block)
            if not allowed.any():
                assert low < 0 or (lo, hi) == (big, 0), (b, block, lo, hi)
                continue
            first, last = int(allowed.nonzero()[0]), int(allowed.nonzero()[-1]) + 1
            assert lo <= first and hi >= last, (b, block, lo, hi, first, last)
            if low >= 0:
                assert (lo, hi) == (first, last), (b, block, lo, hi, first, last)
