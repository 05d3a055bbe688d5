"""Zeroing the masked elements of a score accumulator (spec: docs/operator.md, "Masks"), with the
mask semantics of :mod:`hstu_cute.masks` bound to DSL scalar ops. Query-major (rows are queries,
the forward and dQ kernels) for mma.sync fragments and WGMMA (rows, cols) views; key-major (rows
are keys, the dK/dV kernels) for any accumulator with an identity-tensor partition."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .. import masks
from .seqinfo import block_index, block_kept, floor_div

# The mask engine's helpers, bound to DSL scalar ops for use while tracing a kernel.
KERNEL_OPS = masks.Ops(min=cutlass.min, max=cutlass.max, select=cutlass.select_)


@cute.jit
def apply_mask_inplace(acc: cute.Tensor, tScS: cute.Tensor, spec: cutlass.Constexpr, seq, row0: Int32, col0: Int32):
    """Zero every accumulator element whose (row0 + row, col0 + col) is masked (spec section 4).

    An m16n8 accumulator fragment holds, per thread, values v = col_pair + 2 * row_half: two rows
    (r, r + 8) per m-atom. Each row's allowed intervals are computed once (masks.row_intervals)
    and shifted to tile columns, so an element costs three compares and a select.
    """
    assert cute.size(acc.shape[0]) == 4
    for m in cutlass.range_constexpr(cute.size(acc.shape[1])):
        for half in cutlass.range_constexpr(2):
            r = row0 + tScS[2 * half, m, 0][0]
            bounds = masks.shifted(masks.row_intervals(spec, seq, r, KERNEL_OPS), col0)
            col_limit = seq.seqlen_k - col0
            for n in cutlass.range_constexpr(cute.size(acc.shape[2])):
                for col_pair in cutlass.range_constexpr(2):
                    v = col_pair + 2 * half
                    keep = masks.in_row_intervals(spec, tScS[v, m, n][1], bounds, col_limit)
                    acc[v, m, n] = cutlass.select_(keep, acc[v, m, n], Float32(0.0))

@cute.jit
def apply_mask_rows_cols(acc_rc: cute.Tensor, coord_rc: cute.Tensor, spec: cutlass.Constexpr, seq, row0: Int32,
                         col0: Int32):
    """Zero every masked element of an accumulator seen as (rows, cols) (``coord_rc``: its tile
    coordinates in the same view); one interval computation per row, a select per element."""
    col_limit = seq.seqlen_k - col0
    # A column's coordinate is the same in every row: read each once (fewer traced ops).
    cols = [coord_rc[0, j][1] for j in range(cute.size(acc_rc.shape[1]))]
    for i in cutlass.range_constexpr(cute.size(acc_rc.shape[0])):
        bounds = masks.shifted(masks.row_intervals(spec, seq, row0 + coord_rc[i, 0][0], KERNEL_OPS), col0)
        for j in cutlass.range_constexpr(cute.size(acc_rc.shape[1])):
            keep = masks.in_row_intervals(spec, cols[j], bounds, col_limit)
            acc_rc[i, j] = cutlass.select_(keep, acc_rc[i, j], Float32(0.0))


@cute.jit
def apply_mask_key_major(acc_S: cute.Tensor, acc_dP: cute.Tensor, tScS: cute.Tensor, spec: cutlass.Constexpr, seq,
                         row_first: Int32, col0: Int32, q_rows: Int32):
    """Zero the masked elements of a key-major pair of accumulators (S^T and dP^T; ``tScS``
    gives each element's (key, query) tile coordinate) and the queries at and past ``q_rows``."""
    for i in cutlass.range(cute.size(acc_S), unroll_full=True):
        key, query = tScS[i]
        keep = masks.allowed(spec, seq, row_first + query, col0 + key, KERNEL_OPS) & (query < q_rows)
        acc_S[i] = cutlass.select_(keep, acc_S[i], Float32(0.0))
        acc_dP[i] = cutlass.select_(keep, acc_dP[i], Float32(0.0))


@cute.jit
def apply_mask_key_major_by_query(S_rc: cute.Tensor, dP_rc: cute.Tensor, coord_rc: cute.Tensor, spec: cutlass.Constexpr,
                                  seq, row_first: Int32, col0: Int32, q_rows: Int32):
    """:func:`apply_mask_key_major` on (keys, queries) views of the pair, one interval computation
    per query: a func mask reads its intervals from memory, and per element the causal-as-func
    D128 backward took 1.17x the causal one (docs/dev/perf-log.md, session 30)."""
    col_limit = seq.seqlen_k - col0
    keys = [coord_rc[i, 0][0] for i in range(cute.size(S_rc.shape[0]))]
    for j in cutlass.range_constexpr(cute.size(S_rc.shape[1])):
        query = coord_rc[0, j][1]
        bounds = masks.shifted(masks.row_intervals(spec, seq, row_first + query, KERNEL_OPS), col0)
        query_in = query < q_rows
        for i in cutlass.range_constexpr(cute.size(S_rc.shape[0])):
            keep = masks.in_row_intervals(spec, keys[i], bounds, col_limit) & query_in
            S_rc[i, j] = cutlass.select_(keep, S_rc[i, j], Float32(0.0))
            dP_rc[i, j] = cutlass.select_(keep, dP_rc[i, j], Float32(0.0))


@cute.jit
def mask_dropped_blocks(accs, coords: cute.Tensor, seq, m_block: Int32, n_block: Int32, row0: Int32, col0: Int32,
                        key_major: cutlass.Constexpr[bool] = False, mixed=None,
                        rows_cols: cutlass.Constexpr[int] = 0, query_rows: cutlass.Constexpr[int] = 0):
    """Block-sparse calls: zero the elements of each accumulator of ``accs`` that lie in a dropped
    block, in the tiles that mix kept and dropped blocks (``coords``: each element's tile
    coordinate, (row, key), or (key, row) when ``key_major``; the same layout as the
    accumulators). Other tiles skip it: the per-element block lookups (two divisions and a load)
    on every tile the HSTU mask cuts cost the 10%-density causal forward about half its speed
    (docs/dev/perf-log.md, session 31). A no-op without a block mask. ``mixed``: the tile's
    :meth:`~hstu_cute.common.seqinfo.BlockTiles.tile_mixed`, when the caller loaded it ahead.
    ``rows_cols``: nonzero when ``accs`` and ``coords`` are (rows, cols) views (WGMMA
    accumulators, :func:`common.sm90.wgmma_acc_rows_cols`), the tile's extent along their columns:
    the blocks are looked up per row and per column, not per element (blocks smaller than the tile,
    as NSA's selection makes, mix nearly every tile). ``query_rows``: nonzero with ``key_major``
    (rows, cols) views, the tile's query rows: where they all lie in one query block, each key
    row's flag is read once (:func:`_mask_blocks_key_rows`)."""
    if const_expr(seq.sparse is not None):
        probe = seq.sparse.kept_probe()
        if const_expr(mixed is None):
            mixed = seq.sparse.tile_mixed(m_block, n_block)
        if mixed:
            if const_expr(rows_cols):
                _mask_blocks_rows_cols(accs, coords, probe, row0, col0, key_major, rows_cols)
            elif const_expr(query_rows):
                _mask_blocks_key_rows(accs, coords, probe, row0, col0, query_rows)
            else:
                for i in cutlass.range(cute.size(coords), unroll_full=True):
                    a, b = coords[i]
                    row, key = (b, a) if const_expr(key_major) else (a, b)
                    keep = block_kept(probe, row0 + row, col0 + key)
                    for acc in accs:
                        acc[i] = cutlass.select_(keep, acc[i], Float32(0.0))


def _mask_blocks_rows_cols(accs, coords, probe, row0, col0, key_major: bool, span: int):
    """:func:`mask_dropped_blocks` on (rows, cols) views (the rows queries and the columns keys, or
    keys and queries when ``key_major``; ``span``: the tile's extent along the columns). Per row,
    the kept flags of the blocks the tile's columns cross are read once into the bits of a word
    (blocks are at least 16 wide: at most ``span // 16 + 1`` of them); per column, its block's
    place among them. An element then costs a shift and a select, not two divisions and a load.
    Plain Python, traced inline."""
    mKept, q_block, k_block, q_blocks, k_blocks = probe
    inv_q, inv_k = Float32(1.0) / Float32(q_block), Float32(1.0) / Float32(k_block)
    rows, cols = range(cute.size(coords.shape[0])), range(cute.size(coords.shape[1]))
    if key_major:
        r_origin, r_block, r_inv, r_blocks = col0, k_block, inv_k, k_blocks
        c_origin, c_block, c_inv, c_blocks = row0, q_block, inv_q, q_blocks
    else:
        r_origin, r_block, r_inv, r_blocks = row0, q_block, inv_q, q_blocks
        c_origin, c_block, c_inv, c_blocks = col0, k_block, inv_k, k_blocks
    first = floor_div(c_origin, c_block, c_inv)  # the tile's first column block (the origin is >= 0)
    place = [floor_div(c_origin + coords[0, j][1], c_block, c_inv) - first for j in cols]
    words = []
    for i in rows:
        rb, r_inside = block_index(floor_div(r_origin + coords[i, 0][0], r_block, r_inv), r_blocks)
        word = Int32(0)
        for t in range(span // 16 + 1):
            cb = cutlass.min(first + t, c_blocks - 1)
            kept = (mKept[cb, rb] if key_major else mKept[rb, cb]) != 0
            word = word | cutlass.select_(r_inside & (first + t < c_blocks) & kept, Int32(1 << t), Int32(0))
        words.append(word)
    for i in rows:
        for j in cols:
            keep = ((words[i] >> place[j]) & Int32(1)) != 0
            for acc in accs:
                acc[i, j] = cutlass.select_(keep, acc[i, j], Float32(0.0))


def _mask_blocks_key_rows(accs, coords, probe, row0, col0, query_rows: int):
    """:func:`mask_dropped_blocks` on key-major (rows, cols) views (rows keys, columns queries) of
    a tile of ``query_rows`` queries from key-coordinate row ``row0``. Where those rows lie in one
    query block, as in the backward's 64-row tiles under blocks of 64 or more, a key row's kept
    flag holds for all its elements: one division and one load per row instead of per element
    (blocks smaller than the tile's keys mix nearly every tile: NSA's selection). Otherwise per
    element, as the general path. The per-row words of :func:`_mask_blocks_rows_cols` are not
    used here: in the fused backward they spilled onto its main path (SASS, session 37). Plain
    Python, traced inline."""
    mKept, q_block, k_block, q_blocks, k_blocks = probe
    inv_q, inv_k = Float32(1.0) / Float32(q_block), Float32(1.0) / Float32(k_block)
    rows, cols = range(cute.size(coords.shape[0])), range(cute.size(coords.shape[1]))
    first_block = floor_div(row0, q_block, inv_q)
    if first_block == floor_div(row0 + (query_rows - 1), q_block, inv_q):
        qb, q_inside = block_index(first_block, q_blocks)
        for i in rows:
            kb, k_inside = block_index(floor_div(col0 + coords[i, 0][0], k_block, inv_k), k_blocks)
            keep = q_inside & k_inside & (mKept[qb, kb] != 0)
            for j in cols:
                for acc in accs:
                    acc[i, j] = cutlass.select_(keep, acc[i, j], Float32(0.0))
    else:
        for i in rows:
            for j in cols:
                key, row = coords[i, j]
                keep = block_kept(probe, row0 + row, col0 + key)
                for acc in accs:
                    acc[i, j] = cutlass.select_(keep, acc[i, j], Float32(0.0))
