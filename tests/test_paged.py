"""The paged KV-cache call on CPU: argument checks (clear errors before any launch), the device-data
checks of HSTU_CUTE_CHECK=1, meta tensors, and the key-block segmentation against the mask engine."""

from __future__ import annotations

import pytest
import torch

from hstu_cute import hstu_attn_varlen_func, masks, validation
from hstu_cute.testing import random_paged_batch


def _meta(d):
    return {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


@pytest.fixture
def batch():
    paged, dense = random_paged_batch([0, 17, 40, 64], [3, 5, 16, 1], 2, 32, 16, num_targets=[1, 0, 2, 1], seed=3)
    return paged, dense


def test_meta_call_has_the_output_shape(batch):
    paged, _ = batch
    out = hstu_attn_varlen_func(**_meta(paged))
    assert out.shape == paged["q"].shape and out.device.type == "meta" and out.dtype == paged["q"].dtype


@pytest.mark.parametrize("change, exc, match", [
    (dict(page_ids=None), ValueError, "page_ids: expected a tensor when any of kv_cache"),
    (dict(kv_cache="x"), TypeError, "kv_cache: expected a torch.Tensor"),
    (dict(page_offsets=torch.zeros(4, dtype=torch.int32)), ValueError, "page_offsets: expected a 1-D tensor of length 5"),
    (dict(last_page_lens=torch.zeros(4, dtype=torch.int64)), TypeError, "last_page_lens.dtype: expected torch.int32"),
    (dict(window_size=(-1, -1), num_targets=None), NotImplementedError, "causal family"),
    (dict(window_size=(8, 0), num_targets=None), NotImplementedError, "causal family"),
    (dict(has_drab=True, rab="rab"), NotImplementedError, "inference-only"),
    (dict(seqused_q=torch.ones(4, dtype=torch.int32)), NotImplementedError, "seqused_q: not with a paged KV cache"),
    (dict(k="short", v="short"), ValueError, r"k.shape\[0\]: expected 25 \(q's rows: with a paged KV cache"),
])
def test_bad_arguments_name_themselves(batch, change, exc, match):
    paged, _ = batch
    args = _meta(paged)
    for k, v in change.items():
        if isinstance(v, torch.Tensor):
            v = v.to("meta")
        if isinstance(v, str) and v == "short":
            args[k] = args[k][:-1]
            continue
        if isinstance(v, str) and v == "rab":
            v = torch.zeros(4, 2, paged["max_seqlen_k"], paged["max_seqlen_k"], dtype=paged["q"].dtype, device="meta")
            args["rab"] = v
            continue
        args[k] = v
    with pytest.raises(exc, match=match):
        hstu_attn_varlen_func(**args)


def test_cache_shape_dtype_page_size_and_strides(batch):
    paged, _ = batch
    cache = paged["kv_cache"].to("meta")
    for bad, exc, match in (
        (cache.to(torch.float16), TypeError, "kv_cache.dtype"),
        (cache[:, :1], ValueError, r"kv_cache: expected shape \(num_pages, 2, page_size, 2, 32\)"),
        (torch.zeros(9, 2, 24, 2, 32, dtype=cache.dtype, device="meta"), ValueError, "page_size"),
        (torch.zeros(0, 2, 16, 2, 32, dtype=cache.dtype, device="meta"), ValueError, "num_pages"),
        (torch.zeros(9, 16, 2, 2, 32, dtype=cache.dtype, device="meta").transpose(1, 2), ValueError,
         r"kv_cache.stride\(\)"),
    ):
        with pytest.raises(exc, match=match):
            hstu_attn_varlen_func(**dict(_meta(paged), kv_cache=bad))


def test_requires_grad_and_fp8_are_refused(batch):
    paged, _ = batch
    args = _meta(paged)
    args["q"] = args["q"].requires_grad_(True)
    with pytest.raises(NotImplementedError, match="inference-only"):
        hstu_attn_varlen_func(**args)
    paged64, _ = random_paged_batch([3], [2], 2, 64, 16, seed=1)
    with pytest.raises(NotImplementedError, match="kv_cache: the paged KV cache serves bf16/fp16"):
        hstu_attn_varlen_func(**dict(_meta(paged64), quant_mode=0))


def test_device_data_checks(batch):
    paged, _ = batch
    tables = (paged["kv_cache"], paged["page_offsets"], paged["page_ids"], paged["last_page_lens"])
    # The cache holds the old history and the new one: cached + new - targets.
    assert validation.checked_cached_lengths(*tables).tolist() == [2, 22, 54, 64]
    bad_ids = paged["page_ids"].clone()
    bad_ids[1] = paged["kv_cache"].shape[0]
    with pytest.raises(ValueError, match=r"page_ids: expected page ids in \[0, "):
        validation.checked_cached_lengths(tables[0], tables[1], bad_ids, tables[3])
    for lens_value in (0, 17):
        lens = paged["last_page_lens"].clone()
        lens[1] = lens_value
        with pytest.raises(ValueError, match="last_page_lens"):
            validation.checked_cached_lengths(tables[0], tables[1], tables[2], lens)
    offsets = paged["page_offsets"].clone()
    offsets[2] = offsets[1] - 1
    with pytest.raises(ValueError, match="page_offsets: expected non-decreasing"):
        validation.checked_cached_lengths(tables[0], offsets, tables[2], tables[3])
    offsets = paged["page_offsets"].clone()
    offsets[-1] = paged["page_ids"].shape[0] + 1
    with pytest.raises(ValueError, match=r"page_offsets\[-1\]"):
        validation.checked_cached_lengths(tables[0], offsets, tables[2], tables[3])


def test_paged_data_checks_name_the_argument(batch):
    """HSTU_CUTE_CHECK=1's checks of a paged call's data (validation._check_paged_data): the batch
    passes; targets past the query rows, history missing from the cache and key offsets that do not
    count cached + target keys are refused by name."""
    import types

    paged, _ = batch

    def call(**change):
        fields = dict(seq_offsets_q=paged["seq_offsets_q"], seq_offsets_k=paged["seq_offsets_k"],
                      max_seqlen_q=paged["max_seqlen_q"], max_seqlen_k=paged["max_seqlen_k"],
                      num_contexts=None, num_targets=paged["num_targets"], seqused_q=None, seqused_k=None,
                      paged=(paged["kv_cache"], paged["page_offsets"], paged["page_ids"], paged["last_page_lens"]))
        return types.SimpleNamespace(**dict(fields, **change))

    validation.check_device_data(call(), paged["q"], paged["k"])
    too_many = paged["num_targets"].clone()
    too_many[0] = 4  # 3 query rows
    with pytest.raises(ValueError, match="num_targets: expected 0 <= num_targets <= the sequence's query rows"):
        validation.check_device_data(call(num_targets=too_many), paged["q"], paged["k"])
    with pytest.raises(ValueError, match="new history .* already in the cache"):
        # Sequence 0: 10 query rows, no targets, 2 cached tokens.
        validation.check_device_data(call(num_targets=None, seq_offsets_q=torch.tensor([0, 10, 15, 31, 32],
                                                                                       dtype=torch.int32)),
                                     torch.empty(32, 2, 32), paged["k"])
    with pytest.raises(ValueError, match="seq_offsets_k: expected each sequence's keys: cached tokens \\+ targets"):
        validation.check_device_data(call(seq_offsets_k=paged["seq_offsets_q"]), paged["q"], paged["k"])


def _segments_allowed(spec, seq, cached):
    """M(r, j) rebuilt from the two key segments of common.key_blocks (cache: whole coordinates
    cut at the cached length; new: everything shifted by it), for every query and key."""
    from hstu_cute.common.key_blocks import cache_segment, new_segment

    cache, new = cache_segment(seq, cached), new_segment(seq, cached)
    rows = torch.arange(seq.seqlen_q)[:, None]
    keys = torch.arange(seq.seqlen_k)[None, :]
    in_cache = masks.allowed(spec, cache, rows + cache.row_offset, keys)
    in_new = masks.allowed(spec, new, rows + new.row_offset, keys - cached)
    return torch.where(keys < cached, in_cache, in_new & (keys >= cached))


@pytest.mark.parametrize("cached,new,ctx,tgt,group", [(0, 5, 0, 5, 1), (37, 9, 4, 3, 1), (40, 12, 45, 6, 2),
                                                       (128, 64, 0, 64, 11), (5, 1, 3, 1, 1), (20, 8, 0, 0, 1),
                                                       (70, 70, 10, 0, 1), (64, 100, 0, 40, 3)])
def test_key_segments_partition_the_mask(cached, new, ctx, tgt, group):
    """The shift invariance the paged kernels rely on: the cache segment (``cached`` tokens, the
    new history included) and the shifted target segment together give exactly the whole
    sequence's delta_q mask, also for the history queries that sit inside the cache (negative
    rows in the target segment)."""
    pytest.importorskip("cutlass")
    spec = masks.MaskSpec(masks.MaskKind.CAUSAL, True, True, True)
    whole = cached + tgt
    seq = masks.seq_mask_from_lengths(spec, new, whole, num_context=ctx, num_target=tgt, group_size=group)
    expected = masks.dense_mask(spec, seq)
    assert torch.equal(_segments_allowed(spec, seq, cached), expected)


@pytest.mark.parametrize("count,parts", [(0, 4), (1, 16), (5, 3), (34, 16), (17, 17), (2, 5)])
def test_key_block_parts_cover_each_block_once(count, parts):
    """Split keys: the parts of a tile's key blocks (common.key_blocks.KeyBlocks.part) are
    consecutive, in order, and cover every block exactly once (some may be empty)."""
    pytest.importorskip("cutlass")
    from hstu_cute.common.key_blocks import KeyBlocks

    blocks = KeyBlocks(None, (0, 0, 0, count))
    covered = []
    for index in range(parts):
        part = blocks.part(index, parts)
        assert part.part_index == index and part.count >= 0
        covered += [part.first + i for i in range(part.count)]
    assert covered == list(range(count))


def test_cached_lengths_target_rows_and_rab_among_new():
    """The launcher's C_b (validation.cached_lengths), the target key rows (kv_cache.target_key_rows)
    and the rab of the queries against the targets (kv_cache.rab_among_new: rab[b, h, S_b + i,
    C_b + j], S_b = C_b + t_b - n_b inside each sequence), against a direct loop, for a strided rab,
    a sequence without pages and one without targets."""
    from hstu_cute import kv_cache

    page_size = 16
    page_offsets = torch.tensor([0, 3, 3, 4, 6], dtype=torch.int32)
    last_page_lens = torch.tensor([5, 1, 16, 9], dtype=torch.int32)
    cached = validation.cached_lengths(page_offsets, last_page_lens, page_size)
    assert cached.tolist() == [37, 0, 16, 25]
    new, tgt = [6, 11, 3, 8], [2, 11, 0, 8]
    seq_offsets_q = torch.tensor([0, 6, 17, 20, 28], dtype=torch.int32)
    offsets, targets, history = kv_cache.target_key_rows(seq_offsets_q, torch.tensor(tgt, dtype=torch.int32))
    assert offsets.tolist() == [4, 6, 20, 20, 28] and targets.tolist() == tgt and history.tolist() == [4, 0, 3, 0]
    assert [t.tolist() for t in kv_cache.target_key_rows(seq_offsets_q, None)[1:]] == [[0, 0, 0, 0], new]
    max_k = max(c + t for c, t in zip(cached.tolist(), tgt))
    base = torch.randn(4, 3, max_k + 2, max_k + 5)
    rab = base[:, ::2, :max_k, 1:max_k + 1]  # strided: every other head, an offset column
    for _ in range(2):  # the second call takes the cached geometry
        got = kv_cache.rab_among_new(rab, page_offsets, last_page_lens, page_size, history, max(new))
    assert got.shape == (4, 2, 16, 16)
    for b, (c, n, t) in enumerate(zip(cached.tolist(), new, tgt)):
        s = c + t - n
        assert torch.equal(got[b, :, :n, :t], rab[b, :, s:s + n, c:c + t])


def test_key_offsets_and_append_without_targets():
    """kv_cache.key_offsets counts cached + target keys; PagedKVCache.append with num_targets
    caches only each sequence's rows before its targets."""
    from hstu_cute import kv_cache

    cached = torch.tensor([5, 0, 7], dtype=torch.int32)
    assert kv_cache.key_offsets(cached, torch.tensor([1, 2, 0], dtype=torch.int32)).tolist() == [0, 6, 8, 15]
    assert kv_cache.key_offsets(cached).tolist() == [0, 5, 5, 12]
    cache = kv_cache.PagedKVCache(1, 8, 16, 1, 16, dtype=torch.float32, device="cpu", max_sequences=2)
    rows = torch.arange(10, dtype=torch.float32)[:, None, None].expand(10, 1, 16).contiguous()
    ids = torch.tensor([0, 1])
    cache.append(ids, torch.tensor([0, 4, 10], dtype=torch.int32), rows, -rows,
                 num_targets=torch.tensor([1, 3], dtype=torch.int32))
    keys, values, offsets = kv_cache.gather_history(cache.layer(0), *cache.lookup(ids)[:3])
    assert offsets.tolist() == [0, 3, 6]
    assert keys[:, 0, 0].tolist() == [0, 1, 2, 4, 5, 6] and values[:, 0, 0].tolist() == [0, -1, -2, -4, -5, -6]
