"""hstu_cute.BlockMask on CPU: every constructor against the dense bool it describes, garbage past
the counts, the oracle's expansion against a direct loop over elements (HSTU mask AND kept block,
key coordinates on both sides, delta_q), and bad input."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from hstu_cute import BlockMask, masks
from hstu_cute.block_mask import blocks_for
from hstu_cute.reference import hstu_attn_reference


def _random_dense(shape, density, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen) < density


@pytest.mark.parametrize("density", [0.0, 0.1, 0.5, 1.0])
def test_from_dense_lists_are_ascending_and_round_trip(density):
    dense = _random_dense((3, 2, 5, 7), density, 1)
    bm = BlockMask.from_dense(dense, 32, 64)
    assert bm.kv_count.dtype == bm.kv_index.dtype == torch.int32
    assert torch.equal(bm.kv_count, dense.sum(-1).to(torch.int32))
    for b, h, i in ((b, h, i) for b in range(3) for h in range(2) for i in range(5)):
        n = int(bm.kv_count[b, h, i])
        assert bm.kv_index[b, h, i, :n].tolist() == dense[b, h, i].nonzero().flatten().tolist()
    assert torch.equal(bm.to_dense(), dense)
    assert math.isclose(float(bm.density()), float(dense.float().mean()), abs_tol=1e-6)


def test_lists_ignore_entries_past_each_count():
    dense = _random_dense((2, 1, 4, 6), 0.4, 2)
    bm = BlockMask.from_dense(dense, 16, 16)
    garbage = bm.kv_index.clone()
    for b, h, i in ((b, h, i) for b in range(2) for h in range(1) for i in range(4)):
        garbage[b, h, i, int(bm.kv_count[b, h, i]):] = torch.randint(-5, 50, (6 - int(bm.kv_count[b, h, i]),),
                                                                     dtype=torch.int32)
    assert torch.equal(BlockMask.from_lists(bm.kv_count, garbage, 16, 16).to_dense(), dense)


def test_from_topk_drops_unused_slots_and_duplicates():
    indices = torch.tensor([[[[3, 1, 1, -1], [0, 5, 2, 9]]]])  # (1, 1, 2, 4); 9 is past M_k = 6
    bm = BlockMask.from_topk(indices, 64, 64, 6)
    expected = torch.zeros(1, 1, 2, 6, dtype=torch.bool)
    expected[0, 0, 0, [1, 3]] = True
    expected[0, 0, 1, [0, 2, 5]] = True
    assert torch.equal(bm.to_dense(), expected)
    assert bm.kv_index[0, 0, 1, :3].tolist() == [0, 2, 5]


def test_from_jagged_dense_matches_per_sequence_blocks():
    """HBSA's layout: blocks numbered over the jagged batch, each sequence's after the previous."""
    lengths = [0, 40, 17, 100]
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    qb, kb = 16, 32
    per_seq = _random_dense((4, 2, blocks_for(100, qb), blocks_for(100, kb)), 0.5, 3)
    nq = [blocks_for(n, qb) for n in lengths]
    nk = [blocks_for(n, kb) for n in lengths]
    total = torch.zeros(2, sum(nq), sum(nk), dtype=torch.bool)
    for b in range(4):
        r, c = sum(nq[:b]), sum(nk[:b])
        total[:, r:r + nq[b], c:c + nk[b]] = per_seq[b, :, :nq[b], :nk[b]]
        per_seq[b, :, nq[b]:, :] = False  # blocks past a sequence do not exist in HBSA's layout
        per_seq[b, :, :, nk[b]:] = False
    bm = BlockMask.from_jagged_dense(total, offsets, offsets, qb, kb, max(lengths))
    assert torch.equal(bm.to_dense(), per_seq)


def test_from_flex_keeps_partial_and_full_blocks():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    def band(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 48)

    fm = flex.create_block_mask(band, B=2, H=1, Q_LEN=256, KV_LEN=256, device="cpu", BLOCK_SIZE=32)
    bm = BlockMask.from_flex(fm)
    assert (bm.q_block, bm.k_block) == (32, 32)
    i = torch.arange(8)
    expected = ((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= 2)).expand(2, 1, 8, 8)
    assert torch.equal(bm.to_dense(), expected)


@pytest.mark.parametrize("bad,match", [
    (dict(q_block=24), "q_block: expected a positive multiple of 16, got 24"),
    (dict(k_block=0), "k_block: expected a positive multiple of 16, got 0"),
    (dict(kv_count=torch.zeros(1, 1, 2, dtype=torch.int64)), "kv_count.dtype: expected torch.int32"),
    (dict(kv_index=torch.zeros(1, 1, 3, 4, dtype=torch.int32)), r"kv_index: expected shape \(1, 1, 2\) \+ \(M_k,\)"),
])
def test_bad_masks_are_refused_naming_the_field(bad, match):
    args = dict(kv_count=torch.zeros(1, 1, 2, dtype=torch.int32), kv_index=torch.zeros(1, 1, 2, 4, dtype=torch.int32),
                q_block=16, k_block=32)
    args.update(bad)
    with pytest.raises((TypeError, ValueError), match=match):
        BlockMask(**args)


def _loop_oracle(q, k, v, lengths_q, lengths_k, spec_kwargs, dense, qb, kb, alpha):
    """out by a direct loop over (sequence, head, query, key): masks.allowed on ints, then the kept
    block of (key-coordinate row, key)."""
    window = spec_kwargs.get("window_size", (-1, -1))
    kind, wl, wr = masks.normalize_window(window, max(lengths_k))
    targets = spec_kwargs.get("num_targets")
    spec = masks.MaskSpec(kind, has_target=targets is not None, is_delta_q=lengths_q != lengths_k)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    sq = sk = 0
    S = max(lengths_q)
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        t = int(targets[b]) if targets is not None else 0
        seq = masks.seq_mask_from_lengths(spec, lq, lk, wl, wr, 0, t, 1)
        for h in range(q.shape[1]):
            for i in range(lq):
                r = seq.row_offset + i
                for j in range(lk):
                    if not masks.allowed(spec, seq, r, j) or not dense[b, h % dense.shape[1], r // qb, j // kb]:
                        continue
                    z = alpha * float(q[sq + i, h].double() @ k[sk + j, h].double())
                    out[sq + i, h] += z / (1 + math.exp(-z)) * v[sk + j, h].double() / S
        sq, sk = sq + lq, sk + lk
    return out


@pytest.mark.parametrize("case", ["causal-16x32", "none-32x16-per-head", "delta_q-causal", "targets-16x16"])
def test_oracle_expands_blocks_like_a_direct_loop(case):
    lengths_q = lengths_k = [17, 0, 40, 1]
    kw, heads_mask, qb, kb = {}, 1, 16, 32
    if case == "causal-16x32":
        kw = dict(window_size=(-1, 0))
    elif case == "none-32x16-per-head":
        heads_mask, qb, kb = 2, 32, 16
    elif case == "delta_q-causal":
        lengths_q, kw = [5, 0, 20, 1], dict(window_size=(-1, 0))
    else:
        kw, qb, kb = dict(window_size=(-1, 0), num_targets=torch.tensor([4, 0, 6, 1], dtype=torch.int32)), 16, 16
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    q = torch.randn(sum(lengths_q), 2, 8, generator=gen)
    k = torch.randn(sum(lengths_k), 2, 8, generator=gen)
    v = torch.randn(sum(lengths_k), 2, 8, generator=gen)
    dense = _random_dense((4, heads_mask, blocks_for(40, qb), blocks_for(40, kb)), 0.5, 4)
    bm = BlockMask.from_dense(dense, qb, kb)
    offsets_q = torch.tensor([0] + torch.tensor(lengths_q).cumsum(0).tolist(), dtype=torch.int32)
    offsets_k = torch.tensor([0] + torch.tensor(lengths_k).cumsum(0).tolist(), dtype=torch.int32)
    out = hstu_attn_reference(q, k, v, offsets_q, offsets_k, max(lengths_q), max(lengths_k), alpha=0.5,
                              is_delta_q=lengths_q != lengths_k, block_mask=bm, compute_dtype=torch.float64, **kw)
    expected = _loop_oracle(q, k, v, lengths_q, lengths_k, kw, dense, qb, kb, 0.5)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
    # The mask matters here: without it the output differs.
    unmasked = hstu_attn_reference(q, k, v, offsets_q, offsets_k, max(lengths_q), max(lengths_k), alpha=0.5,
                                   is_delta_q=lengths_q != lengths_k, compute_dtype=torch.float64, **kw)
    assert not torch.allclose(out, unmasked)


def test_full_and_empty_masks():
    lengths = [17, 33]
    offsets = torch.tensor([0, 17, 50], dtype=torch.int32)
    q, k, v = (torch.randn(50, 2, 8) for _ in range(3))
    full = BlockMask.from_dense(torch.ones(2, 1, 3, 3, dtype=torch.bool), 16, 16)
    empty = BlockMask.from_dense(torch.zeros(2, 2, 3, 3, dtype=torch.bool), 16, 16)
    dense_out = hstu_attn_reference(q, k, v, offsets, offsets, 33, 33, window_size=(-1, 0))
    assert torch.equal(hstu_attn_reference(q, k, v, offsets, offsets, 33, 33, window_size=(-1, 0), block_mask=full),
                       dense_out)
    assert not hstu_attn_reference(q, k, v, offsets, offsets, 33, 33, block_mask=empty).any()
    with pytest.raises(ValueError, match="block_mask: expected"):
        hstu_attn_reference(q, k, v, offsets, offsets, 33, 33, block_mask=BlockMask.from_dense(
            torch.ones(3, 1, 3, 3, dtype=torch.bool), 16, 16))
    del lengths


@pytest.mark.parametrize("tiles,blocks,delta_q,seqused", [
    ((128, 128), (128, 128), False, False),
    ((128, 176), (16, 32), False, True),
    ((64, 128), (48, 64), True, False),
    ((192, 128), (256, 16), True, True),
    # Nested sizes without delta_q: BlockMask._aligned_tile_lists.
    ((64, 64), (64, 64), False, True),
    ((128, 64), (64, 128), False, False),
    ((64, 128), (128, 32), False, True),
    ((128, 128), (256, 64), False, False),
])
def test_tile_lists_match_the_elements(tiles, blocks, delta_q, seqused):
    """BlockMask.tile_lists against a brute-force scan of each tile's valid elements: a tile is
    listed iff one of them is kept, partial iff some are kept and some not; the transposed lists
    hold the same tiles."""
    tile_m, tile_n = tiles
    qb, kb = blocks
    lengths_k = [0, 1, 17, 300, 513]
    lengths_q = [min(n, 40) for n in lengths_k] if delta_q else lengths_k
    offsets_q = torch.tensor([0] + torch.tensor(lengths_q).cumsum(0).tolist(), dtype=torch.int32)
    offsets_k = torch.tensor([0] + torch.tensor(lengths_k).cumsum(0).tolist(), dtype=torch.int32)
    used_q = torch.tensor([max(n - 3, 0) for n in lengths_q], dtype=torch.int32) if seqused else None
    used_k = torch.tensor([max(n - 2, 0) for n in lengths_k], dtype=torch.int32) if seqused else None
    dense = _random_dense((5, 2, blocks_for(513, qb), blocks_for(513, kb)), 0.3, sum(tiles) + sum(blocks))
    bm = BlockMask.from_dense(dense, qb, kb)
    lists = bm.tile_lists(offsets_q, offsets_k, used_q, used_k, tile_m, tile_n, max(lengths_q), max(lengths_k),
                          delta_q)
    m_tiles, n_tiles = blocks_for(max(lengths_q), tile_m), blocks_for(max(lengths_k), tile_n)
    assert lists.count.shape == (5, 2, m_tiles) and lists.t_count.shape == (5, 2, n_tiles)
    for b in range(5):
        lq = int(used_q[b]) if seqused else lengths_q[b]
        lk = int(used_k[b]) if seqused else lengths_k[b]
        off = lk - lq if delta_q else 0  # the kernels' row_offset: seqused alone does not shift rows
        for h in range(2):
            kept = torch.zeros(m_tiles, n_tiles, dtype=torch.bool)
            partial = torch.zeros(m_tiles, n_tiles, dtype=torch.bool)
            for m in range(m_tiles):
                rows = off + torch.arange(m * tile_m, max(min((m + 1) * tile_m, lq), m * tile_m))
                for n in range(n_tiles):
                    keys = torch.arange(n * tile_n, max(min((n + 1) * tile_n, lk), n * tile_n))
                    e = bm.element_mask(b, h, rows, keys)
                    kept[m, n] = e.any()
                    partial[m, n] = e.any() and not e.all()
            for m in range(m_tiles):
                c = int(lists.count[b, h, m])
                assert lists.index[b, h, m, :c].tolist() == kept[m].nonzero().flatten().tolist(), (b, h, m)
            for n in range(n_tiles):
                c = int(lists.t_count[b, h, n])
                assert lists.t_index[b, h, n, :c].tolist() == kept[:, n].nonzero().flatten().tolist(), (b, h, n)
            assert torch.equal(lists.partial[b, h], partial), (b, h)
            assert torch.equal(lists.kept[b, h], kept), (b, h)
            assert torch.equal(lists.state()[b, h], kept.to(torch.uint8) + partial.to(torch.uint8)), (b, h)


def _meta_call(**over):
    from hstu_cute import hstu_attn_varlen_func

    q, k, v = (torch.empty(50, 2, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))
    offsets = torch.empty(3, dtype=torch.int32, device="meta")
    bm = BlockMask.from_dense(torch.ones(2, 1, 3, 3, dtype=torch.bool, device="meta"), 16, 16)
    args = dict(q=q, k=k, v=v, seq_offsets_q=offsets, seq_offsets_k=offsets, max_seqlen_q=33, max_seqlen_k=33,
                window_size=(-1, 0), block_mask=bm)
    args.update(over)
    return hstu_attn_varlen_func(**args)


def _mask_of(shape, q_block=16, k_block=16, device="meta"):
    return BlockMask.from_dense(torch.ones(shape, dtype=torch.bool, device=device), q_block, k_block)


@pytest.mark.parametrize("over,error,match", [
    (dict(block_mask="dense"), TypeError, "block_mask: expected a hstu_cute.BlockMask or None, got str"),
    (dict(block_mask=_mask_of((3, 1, 3, 3))), ValueError, r"block_mask.kv_count.shape\[0\]: expected 2"),
    (dict(block_mask=_mask_of((2, 3, 3, 3))), ValueError, r"block_mask.kv_count.shape\[1\]: expected 1 or 2"),
    (dict(block_mask=_mask_of((2, 1, 2, 3))), ValueError, r"block_mask.kv_count.shape\[2\]: expected >= 3"),
    (dict(block_mask=_mask_of((2, 1, 3, 1), k_block=32)), ValueError, r"block_mask.kv_index.shape\[3\]: expected >= 2"),
    (dict(block_mask=_mask_of((2, 1, 3, 3), device="cpu")), ValueError, "block_mask.device: expected meta"),
])
def test_api_refuses_a_mismatched_block_mask(over, error, match):
    with pytest.raises(error, match=match):
        _meta_call(**over)


def test_api_runs_a_block_mask_on_meta_forward_and_backward():
    out = _meta_call()
    assert out.shape == (50, 2, 64) and out.device.type == "meta"
    for head_dim, deterministic in ((64, False), (128, False), (128, True)):
        q, k, v = (torch.empty(50, 2, head_dim, dtype=torch.bfloat16, device="meta", requires_grad=True)
                   for _ in range(3))
        out = _meta_call(q=q, k=k, v=v, deterministic=deterministic)
        out.sum().backward()
        assert q.grad.shape == q.shape and v.grad.shape == v.shape
    func = torch.zeros(1, 1, 50 + 256, dtype=torch.int32, device="meta")
    with pytest.raises(NotImplementedError, match="block_mask: the block-sparse kernels take 16-bit inputs"):
        _meta_call(func=func, window_size=(-1, -1))


def test_compiled_call_traces_the_block_mask():
    """torch.compile(fullgraph=True) over a call with a block mask on meta tensors: the op takes
    the mask's tensors and block sizes."""
    from hstu_cute import hstu_attn_varlen_func

    q, k, v = (torch.empty(50, 2, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))
    offsets = torch.empty(3, dtype=torch.int32, device="meta")
    bm = _mask_of((2, 2, 3, 3))

    def step(q, k, v, count, index):
        return hstu_attn_varlen_func(q, k, v, offsets, offsets, 33, 33, window_size=(-1, 0),
                                     block_mask=BlockMask(count, index, 16, 16))

    out = torch.compile(step, fullgraph=True, backend="eager")(q, k, v, bm.kv_count, bm.kv_index)
    assert out.shape == q.shape


@pytest.mark.parametrize("causal", [True, False])
def test_bench_counts_the_allowed_pairs_of_kept_blocks(causal):
    from hstu_cute.bench_sparse import SparseWorkload, allowed_pairs

    w = SparseWorkload("tiny", 2, 64, 0.5, causal=causal, block=16)
    kept = _random_dense((2, 1, 4, 4), 0.5, 9)
    bm = BlockMask.from_dense(kept, 16, 16)
    rows = torch.arange(64)
    brute = 0
    for b in range(2):
        e = bm.element_mask(b, 0, rows, rows)
        if causal:
            e = e & (rows[None, :] <= rows[:, None])
        brute += int(e.sum())
    assert allowed_pairs(w, kept) == brute


def test_modules_and_the_padded_entry_take_a_block_mask():
    """HSTUAttention and hstu_attn_padded pass the mask through (CPU: the reference path), with the
    same result as the oracle called directly."""
    import warnings

    from hstu_cute import HSTUAttention, hstu_attn_padded

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 40, 2, 16, generator=gen) for _ in range(3))
    bm = BlockMask.from_dense(_random_dense((2, 1, 3, 3), 0.5, 6), 16, 16)
    offsets = torch.tensor([0, 40, 80], dtype=torch.int32)
    expected = hstu_attn_reference(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), offsets, offsets, 40, 40,
                                   window_size=(-1, 0), block_mask=bm, compute_dtype=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = HSTUAttention()(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), offsets, 40, block_mask=bm)
        padded = hstu_attn_padded(q, k, v, [40, 40], block_mask=bm)
    assert torch.equal(out, expected) and torch.equal(padded.flatten(0, 1), expected)
    unmasked = HSTUAttention()(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), offsets, 40)
    assert not torch.equal(out, unmasked)


def test_kernel_tables_are_built_once_per_batch_layout():
    """BlockMask.kernel_tables: the same tables for the same offset tensors (the forward and the
    backward of a step, every layer), rebuilt for other tensors, after an in-place change, and for
    another tile; the contents are tile_lists'."""
    bm = BlockMask.from_dense(_random_dense((2, 1, 8, 8), 0.4, 5), 32, 32)
    offsets = torch.tensor([0, 200, 256], dtype=torch.int32)
    args = (offsets, offsets, None, None, 64, 64, 200, 200)
    first = bm.kernel_tables(*args)
    assert bm.kernel_tables(*args) is first
    lists = bm.tile_lists(*args)
    for got, want in ((first.count, lists.count), (first.index, lists.index), (first.t_count, lists.t_count),
                      (first.t_index, lists.t_index), (first.state, lists.state())):
        assert torch.equal(got, want)
    assert torch.equal(first.kept_blocks, bm.to_dense().to(torch.uint8))
    assert bm.kernel_tables(offsets, offsets, None, None, 128, 64, 200, 200) is not first
    same_values = offsets.clone()
    assert bm.kernel_tables(same_values, same_values, None, None, 64, 64, 200, 200) is not first
    offsets[2] = 230  # in place: the version counter moves
    rebuilt = bm.kernel_tables(*args)
    assert rebuilt is not first
    assert torch.equal(rebuilt.count, bm.tile_lists(*args).count)
    for i in range(8):  # other layouts push the oldest out: the cache stays small
        other = torch.tensor([0, 100 + i, 150 + i], dtype=torch.int32)
        bm.kernel_tables(other, other, None, None, 64, 64, 200, 200)
    assert len(bm.__dict__["_kernel_tables"]) <= 4


def test_kernel_tables_made_during_a_graph_capture_are_not_kept(monkeypatch):
    """A CUDA-graph capture records the tables' kernels without running them: what it builds must
    not serve a later eager call (CPU stand-in: the capture flag forced on a CUDA-looking mask)."""
    bm = BlockMask.from_dense(_random_dense((1, 1, 4, 4), 0.5, 2), 32, 32)
    offsets = torch.tensor([0, 100], dtype=torch.int32)
    args = (offsets, offsets, None, None, 64, 64, 100, 100)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    captured = bm.kernel_tables(*args)
    assert not bm.__dict__.get("_kernel_tables")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert bm.kernel_tables(*args) is not captured
    assert bm.kernel_tables(*args) is bm.kernel_tables(*args)


def test_floor_div_by_reciprocal_is_exact():
    """The kernels' block index (common.seqinfo.floor_div): the fp32 product with the block size's
    reciprocal, truncated, then one correction each way, equals ``x // d`` for every block size the
    API takes (multiples of 16) and coordinates up to 2^24, also when the reciprocal is off by two
    ulps (an approximate division). Modelled here with the same fp32 operations on CPU tensors."""

    def model(x, d, inv_d):
        q = (x.to(torch.float32) * inv_d).to(torch.int64)  # the product rounds to fp32, then truncates
        q = torch.where(q * d > x, q - 1, q)
        return torch.where((q + 1) * d <= x, q + 1, q)

    gen = torch.Generator().manual_seed(0)
    small = torch.arange(1 << 16)
    for d in range(16, 4097, 16):
        inv = torch.tensor(1.0, dtype=torch.float32) / d
        top = (1 << 24) // d
        x = torch.cat([small, torch.randint(0, 1 << 24, (4096,), generator=gen), torch.arange(1, top) * d - 1,
                       torch.arange(0, top) * d])
        for ulps in (-2, 0, 2):
            approx = inv
            for _ in range(abs(ulps)):
                approx = torch.nextafter(approx, torch.tensor(float("inf") if ulps > 0 else 0.0))
            assert torch.equal(model(x, d, approx), x // d), (d, ulps)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_block_sparse_forward_tiles_divide_the_blocks(head_dim):
    """The Hopper block-sparse forward's tiles (variants.block_sparse_hopper_fwd_tiles): where the
    blocks are multiples of 64, every tile lies inside one block (no tile mixes kept and dropped
    blocks), on the default tiles where those fit; smaller blocks keep the default tiles."""
    from hstu_cute.variants import block_sparse_hopper_fwd_tiles, default_hopper_fwd_tiles

    default = default_hopper_fwd_tiles(head_dim, False)
    for q_block in range(16, 513, 16):
        for k_block in range(16, 513, 16):
            tiles = block_sparse_hopper_fwd_tiles(head_dim, False, q_block, k_block)
            fits = q_block % default["tile_m"] == 0 and k_block % default["tile_n"] == 0
            if fits or q_block % 64 or k_block % 64:
                assert tiles == default, (q_block, k_block, tiles)
            else:
                assert q_block % tiles["tile_m"] == 0 and k_block % tiles["tile_n"] == 0, (q_block, k_block, tiles)
                assert dict(tiles, tile_m=default["tile_m"], tile_n=default["tile_n"]) == default


def test_to_dense_of_a_dense_mask_follows_its_lists():
    """A mask made from a dense grid returns (a copy of) that grid from to_dense, not the caller's
    tensor, and rebuilds it from the lists once they change in place."""
    dense = _random_dense((2, 3, 5, 7), 0.4, 11)
    bm = BlockMask.from_dense(dense, 32, 16)
    got = bm.to_dense()
    assert torch.equal(got, dense)
    dense.fill_(True)  # the caller's grid is theirs
    assert torch.equal(bm.to_dense(), got)
    bm.kv_count.zero_()
    assert not bm.to_dense().any()
