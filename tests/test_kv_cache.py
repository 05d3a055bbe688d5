"""PagedKVCache and the oracle's gather helpers (hstu_cute/kv_cache.py).

The CPU tests check the allocator against a plain model of what each slot should hold: after every
append, ``lookup`` + ``gather_history`` on each layer must give back exactly the rows appended to
each slot, in order. The GPU tests (skipped without one) capture an append + lookup in a CUDA graph
and run the capturable methods under ``torch.cuda.set_sync_debug_mode("error")``."""

from __future__ import annotations

import pytest
import torch

from hstu_cute.kv_cache import PAGE_SIZES, PagedKVCache, concat_history, gather_history

HEADS, HEAD_DIM = 2, 4


class Model:
    """What each slot of a cache should hold: its rows per layer, (num_layers, n, H, D)."""

    def __init__(self, cache):
        self.cache = cache
        self.rows = {}

    def empty(self):
        c = self.cache
        return torch.zeros((c.num_layers, 0, c.heads, c.head_dim), dtype=c.dtype, device=c.device)

    def append(self, slots, lengths, generator, ids_dtype=torch.int64, padding=0):
        """Append ``lengths[i]`` random rows to ``slots[i]`` through the cache, and to the model."""
        c = self.cache
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        total = int(offsets[-1]) + padding
        keys = torch.randn((c.num_layers, total, c.heads, c.head_dim), generator=generator).to(c.dtype)
        values = torch.randn((c.num_layers, total, c.heads, c.head_dim), generator=generator).to(c.dtype)
        start = c.append(torch.tensor(slots, dtype=ids_dtype), offsets, keys, values)
        assert start.dtype == torch.int32 and start.tolist() == [self.length(s) for s in slots]
        self.add(slots, offsets, keys, values)

    def add(self, slots, offsets, keys, values):
        for i, s in enumerate(slots):
            new = torch.stack([keys[:, offsets[i]:offsets[i + 1]], values[:, offsets[i]:offsets[i + 1]]])
            self.rows[s] = torch.cat([self.slot(s), new.to(self.empty().device)], 2)

    def slot(self, s):
        """(2, num_layers, n, H, D): keys and values of slot s."""
        return self.rows.get(s, torch.stack([self.empty()] * 2))

    def length(self, s):
        return self.slot(s).shape[2]

    def free(self, slots):
        for s in slots:
            self.rows.pop(int(s), None)

    def check(self, slots):
        """lookup(slots) + gather_history on every layer equals the model, slot by slot."""
        c = self.cache
        page_offsets, page_ids, last_page_lens, cached_lens = c.lookup(torch.tensor(slots, device=c.device))
        expected_lens = [self.length(s) for s in slots]
        assert cached_lens.tolist() == expected_lens
        assert page_ids.shape == (len(slots) * c.max_pages_per_sequence,)
        for t in (page_offsets, page_ids, last_page_lens, cached_lens):
            assert t.dtype == torch.int32
        counts = (page_offsets[1:] - page_offsets[:-1]).tolist()
        assert page_offsets[0] == 0
        assert counts == [-(-n // c.page_size) for n in expected_lens]
        assert ((last_page_lens >= 1) & (last_page_lens <= c.page_size)).all()
        assert (page_ids[page_offsets[-1]:] == 0).all()
        used = page_ids[:page_offsets[-1]]
        assert used.unique().numel() == used.numel()  # no page shared between slots
        assert ((used >= 0) & (used < c.num_pages)).all()
        for layer in range(c.num_layers):
            keys, values, offsets = gather_history(c.layer(layer), page_offsets, page_ids, last_page_lens)
            assert offsets.tolist() == [0, *torch.tensor(expected_lens).cumsum(0).tolist()]
            for i, s in enumerate(slots):
                want = self.slot(s)[:, layer]
                assert torch.equal(keys[offsets[i]:offsets[i + 1]], want[0]), (s, layer)
                assert torch.equal(values[offsets[i]:offsets[i + 1]], want[1]), (s, layer)
        return page_offsets, page_ids, last_page_lens, cached_lens


def _cache(page_size=16, num_layers=2, num_pages=64, max_sequences=8, **kwargs):
    return PagedKVCache(num_layers, num_pages, page_size, HEADS, HEAD_DIM, device="cpu",
                        max_sequences=max_sequences, **kwargs)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_appends_match_history(page_size):
    P = page_size
    cache = _cache(P, num_layers=3, num_pages=40, max_sequences=6)
    model, gen = Model(cache), torch.Generator().manual_seed(P)
    # Per round, (slot, new rows): pages fill partially, then exactly, then spill over; some slots
    # get no rows in a round, one gets none ever, and the batch order changes between rounds.
    rounds = [
        [(0, 3), (1, P), (2, 0), (3, P - 1)],
        [(3, 1), (0, P - 3), (1, P + 1), (2, 0)],
        [(2, 1), (0, 1), (1, 2 * P + 5), (3, 0)],
        [(1, 0), (0, 2 * P), (3, P + 2)],
    ]
    for i, batch in enumerate(rounds):
        slots, lengths = zip(*batch)
        model.append(list(slots), list(lengths), gen, ids_dtype=(torch.int64, torch.int32)[i % 2])
        model.check([0, 1, 2, 3, 4])
        model.check([3, 5, 1])  # any subset, any order, slots never used included
    assert cache.num_free_pages() == 40 - sum(-(-model.length(s) // P) for s in range(6))
    assert not cache.overflowed()


def test_empty_slots_and_zero_rows():
    cache = _cache(32)
    model, gen = Model(cache), torch.Generator().manual_seed(0)
    model.append([1, 2], [0, 0], gen)  # no rows at all: no pages taken
    assert cache.num_free_pages() == 64
    page_offsets, _, last_page_lens, cached_lens = model.check([0, 1, 2])
    assert page_offsets.tolist() == [0, 0, 0, 0] and cached_lens.tolist() == [0, 0, 0]
    assert last_page_lens.tolist() == [32, 32, 32]  # page_size for slots without pages
    model.append([2, 1, 0], [0, 5, 0], gen)
    page_offsets, _, last_page_lens, cached_lens = model.check([0, 1, 2])
    assert page_offsets.tolist() == [0, 0, 1, 1] and cached_lens.tolist() == [0, 5, 0]
    assert last_page_lens.tolist() == [32, 5, 32]
    # An empty batch is a no-op.
    empty = torch.zeros((2, 0, HEADS, HEAD_DIM), dtype=cache.dtype)
    cache.append(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int32), empty, empty)
    model.check([0, 1, 2])


def test_padding_rows_are_dropped():
    """keys/values may be longer than seq_offsets[-1] (fixed shapes): the tail lands nowhere."""
    cache = _cache(16)
    model, gen = Model(cache), torch.Generator().manual_seed(1)
    model.append([0, 1], [20, 3], gen, padding=13)
    model.append([1], [14], gen, padding=40)
    model.check([0, 1])
    assert cache.num_free_pages() == 64 - 2 - 2


def test_write_one_layer_and_single_layer_append():
    cache = _cache(16, num_layers=1)
    gen = torch.Generator().manual_seed(2)
    k = torch.randn((7, HEADS, HEAD_DIM), generator=gen).to(cache.dtype)
    v = torch.randn((7, HEADS, HEAD_DIM), generator=gen).to(cache.dtype)
    ids, offsets = torch.tensor([4, 2]), torch.tensor([0, 4, 7], dtype=torch.int32)
    assert cache.append(ids, offsets, k, v).tolist() == [0, 0]  # (T, H, D) when num_layers == 1
    start = cache.reserve(ids, torch.tensor([2, 0], dtype=torch.int32))
    assert start.tolist() == [4, 3]
    cache.write(0, ids, torch.tensor([0, 2, 2], dtype=torch.int32), k[:2] * 2, v[:2] * 2, start)
    keys, values, offsets_out = gather_history(cache.layer(0), *cache.lookup(ids)[:3])
    assert offsets_out.tolist() == [0, 6, 9]
    assert torch.equal(keys, torch.cat([k[:4], k[:2] * 2, k[4:]]))
    assert torch.equal(values, torch.cat([v[:4], v[:2] * 2, v[4:]]))


def test_free_returns_pages_and_slots_are_reused():
    cache = _cache(16, num_pages=20)
    model, gen = Model(cache), torch.Generator().manual_seed(3)
    model.append([0, 1, 2], [40, 17, 16], gen)  # 3 + 2 + 1 pages
    assert cache.num_free_pages() == 14
    cache.free(torch.tensor([1]))
    model.free([1])
    assert cache.num_free_pages() == 16
    model.check([0, 1, 2])
    model.append([1, 3], [50, 5], gen)  # reuses the freed pages, and more
    assert cache.num_free_pages() == 16 - 4 - 1
    model.check([0, 1, 2, 3])
    cache.free(torch.tensor([3, 0, 2, 1], dtype=torch.int32))
    cache.free(torch.tensor([5]))  # a slot without pages: nothing to give back
    model.free([0, 1, 2, 3])
    assert cache.num_free_pages() == 20
    assert sorted(cache.free_stack.tolist()) == list(range(20))
    model.check([0, 1, 2, 3])
    model.append([2, 0], [16 * 19, 16], gen)  # every page in use, after all that churn
    assert cache.num_free_pages() == 0 and not cache.overflowed()
    model.check([0, 2])


def test_overflow_sets_flag_and_changes_nothing():
    cache = _cache(16, num_pages=6, max_pages_per_sequence=4)
    model, gen = Model(cache), torch.Generator().manual_seed(4)
    model.append([0, 1], [20, 10], gen)  # 2 + 1 pages, 3 left
    before = cache.storage.clone()
    ids = torch.tensor([1, 2])
    keys = torch.ones((2, 60, HEADS, HEAD_DIM), dtype=cache.dtype)
    # Slot 1 needs 1 more page, slot 2 needs 3: 4 > 3 free, so neither gets any.
    start = cache.append(ids, torch.tensor([0, 10, 60], dtype=torch.int32), keys, keys)
    assert start.tolist() == [10, 0]
    assert cache.overflowed() and cache.num_free_pages() == 3
    assert torch.equal(cache.storage, before)  # the rows were dropped
    model.check([0, 1, 2])
    cache.clear_overflow()
    assert not cache.overflowed()
    # More pages than max_pages_per_sequence for one slot is an overflow too, with pages free.
    cache.free(torch.tensor([0, 1]))
    model.free([0, 1])
    cache.reserve(torch.tensor([3]), torch.tensor([16 * 4 + 1], dtype=torch.int32))
    assert cache.overflowed() and cache.num_free_pages() == 6
    model.check([0, 1, 3])
    cache.clear_overflow()
    model.append([3], [16 * 4], gen)  # exactly the limit fits
    assert not cache.overflowed()
    model.check([3])


def test_lru_slots_and_evict_lru():
    cache = _cache(16, max_sequences=8)
    model, gen = Model(cache), torch.Generator().manual_seed(5)
    model.append([0, 1, 2, 3, 4], [5, 6, 7, 8, 9], gen)
    for s in (3, 1, 0, 4, 2):  # use order: 3 is the least recently used
        cache.lookup(torch.tensor([s]))
    assert cache.lru_slots(3).tolist() == [3, 1, 0]
    cache.lookup(torch.tensor([1, 3]))
    assert cache.lru_slots(2).tolist() == [0, 4]
    free_before = cache.num_free_pages()
    evicted = cache.evict_lru(2)
    model.free(evicted.tolist())
    assert evicted.tolist() == [0, 4] and cache.num_free_pages() == free_before + 2
    model.check([0, 1, 2, 3, 4])
    # Slots without pages sort after every slot with pages.
    assert set(cache.lru_slots(3).tolist()) == {1, 2, 3}
    assert set(cache.lru_slots(5).tolist()[:3]) == {1, 2, 3}
    assert cache.lru_slots(0).numel() == 0


def test_concat_history():
    cache = _cache(16, num_layers=1)
    model, gen = Model(cache), torch.Generator().manual_seed(6)
    model.append([0, 2], [18, 3], gen)
    page_offsets, page_ids, last_page_lens, _ = cache.lookup(torch.tensor([0, 1, 2]))
    k = torch.randn((6, HEADS, HEAD_DIM), generator=gen).to(cache.dtype)
    v = torch.randn((6, HEADS, HEAD_DIM), generator=gen).to(cache.dtype)
    new_offsets = torch.tensor([0, 2, 6, 6], dtype=torch.int32)  # slot 2 gets no new rows
    # Slot 0's last row and slot 1's last three are targets; the other new rows are history.
    k_full, v_full, offsets = concat_history(cache.layer(0), page_offsets, page_ids, last_page_lens,
                                             k, v, new_offsets, torch.tensor([1, 3, 0], dtype=torch.int32))
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 19, 22, 25]
    old_k, old_v = model.rows[0][:, 0], model.rows[2][:, 0]
    assert torch.equal(k_full, torch.cat([old_k[0], k[1:2], k[3:6], old_v[0]]))
    assert torch.equal(v_full, torch.cat([old_k[1], v[1:2], v[3:6], old_v[1]]))
    _, _, cache_only = concat_history(cache.layer(0), page_offsets, page_ids, last_page_lens, k, v, new_offsets)
    assert cache_only.tolist() == [0, 18, 18, 21]


def test_gather_history_ignores_trailing_page_ids():
    kv = torch.arange(4 * 2 * 16 * 1 * 1, dtype=torch.float32).view(4, 2, 16, 1, 1)
    keys, values, offsets = gather_history(
        kv, torch.tensor([0, 2, 2], dtype=torch.int32), torch.tensor([3, 1, 7, 7], dtype=torch.int32),
        torch.tensor([5, 9], dtype=torch.int32))
    assert offsets.tolist() == [0, 21, 21]
    assert torch.equal(keys, torch.cat([kv[3, 0], kv[1, 0, :5]]))
    assert torch.equal(values, torch.cat([kv[3, 1], kv[1, 1, :5]]))


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(page_size=48), ValueError, "page_size"),
    (dict(page_size=16.0), ValueError, "page_size"),
    (dict(num_layers=0), ValueError, "num_layers"),
    (dict(num_pages=2.5), TypeError, "num_pages"),
    (dict(heads=-1), ValueError, "heads"),
    (dict(head_dim=True), TypeError, "head_dim"),
    (dict(max_sequences=0), ValueError, "max_sequences"),
    (dict(max_pages_per_sequence=65), ValueError, "max_pages_per_sequence"),
    (dict(max_pages_per_sequence="4"), TypeError, "max_pages_per_sequence"),
    (dict(dtype="bf16"), TypeError, "dtype"),
])
def test_constructor_errors_name_the_argument(kwargs, exc, name):
    args = dict(num_layers=1, num_pages=64, page_size=16, heads=2, head_dim=4, device="cpu")
    with pytest.raises(exc, match=rf"^{name}: expected .*, got "):
        PagedKVCache(**{**args, **kwargs})


def test_call_errors_name_the_argument():
    cache = _cache(16)
    ids, offsets = torch.tensor([0, 1]), torch.tensor([0, 1, 3], dtype=torch.int32)
    rows = torch.zeros((2, 3, HEADS, HEAD_DIM), dtype=cache.dtype)
    with pytest.raises(TypeError, match="^seq_ids: expected dtype int32 or int64"):
        cache.lookup(torch.tensor([0.0]))
    with pytest.raises(ValueError, match="^seq_ids: expected a 1-D tensor"):
        cache.free(torch.tensor([[0]]))
    with pytest.raises(ValueError, match=r"^seq_offsets: expected shape \(3,\)"):
        cache.append(ids, offsets[:2], rows, rows)
    with pytest.raises(ValueError, match=r"^keys: expected shape \(2, T, 2, 4\)"):
        cache.append(ids, offsets, rows[0], rows)
    with pytest.raises(ValueError, match=r"^values: expected shape \(2, 3, 2, 4\)"):
        cache.append(ids, offsets, rows, rows[:, :2])
    with pytest.raises(TypeError, match="^keys: expected dtype torch.bfloat16"):
        cache.append(ids, offsets, rows.float(), rows)
    with pytest.raises(ValueError, match=r"^new_lens: expected shape \(2,\)"):
        cache.reserve(ids, torch.tensor([1]))
    with pytest.raises(IndexError, match=r"^layer: expected"):
        cache.write(2, ids, offsets, rows[0], rows[0], torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="^count: expected"):
        cache.lru_slots(9)


# -- GPU only --

def _random_batch(cache, slots, lengths, total, generator):
    """Fixed-shape inputs for a captured append: rows past the real ones are padding."""
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    shape = (cache.num_layers, total, cache.heads, cache.head_dim)
    keys = torch.randn(shape, generator=generator).to(cache.dtype)
    values = torch.randn(shape, generator=generator).to(cache.dtype)
    return torch.tensor(slots), offsets, keys, values


@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_append_lookup(page_size):
    P, total = page_size, 4 * page_size  # rows per replay: the largest batch, the rest padding
    cache = PagedKVCache(2, 32, P, HEADS, HEAD_DIM, device="cuda", max_sequences=8,
                         max_pages_per_sequence=8)
    model, gen = Model(cache), torch.Generator().manual_seed(7)
    # Static inputs: the graph reads these buffers; each replay refills them first.
    static = [t.cuda() for t in _random_batch(cache, [0, 1, 2], [1, 1, 1], total, gen)]

    def step():
        cache.append(*static)
        return cache.lookup(static[0])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a throwaway cache of the same shapes
        scratch = PagedKVCache(2, 32, P, HEADS, HEAD_DIM, device="cuda", max_sequences=8,
                               max_pages_per_sequence=8)
        scratch.append(*static)
        scratch.lookup(static[0])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    assert cache.num_free_pages() == 32 and int(cache.lengths.sum()) == 0  # capture ran nothing

    for slots, lengths in [([0, 1, 2], [3, P, 0]), ([2, 0, 1], [P + 1, P - 3, 2 * P]),
                           ([1, 2, 3], [0, P - 1, 5])]:
        ids, offsets, keys, values = _random_batch(cache, slots, lengths, total, gen)
        for buffer, new in zip(static, (ids, offsets, keys, values)):
            buffer.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        model.add(slots, offsets.tolist(), keys, values)
        page_offsets, page_ids, last_page_lens, cached_lens = outputs
        assert cached_lens.tolist() == [model.length(s) for s in slots]
        for layer in range(cache.num_layers):
            k, v, out_offsets = gather_history(cache.layer(layer), page_offsets, page_ids, last_page_lens)
            for i, s in enumerate(slots):
                assert torch.equal(k[out_offsets[i]:out_offsets[i + 1]], model.slot(s)[0, layer])
                assert torch.equal(v[out_offsets[i]:out_offsets[i + 1]], model.slot(s)[1, layer])
    assert not cache.overflowed()

    # free is capturable too: free slots 0..2 by replay; slot 3 keeps its pages.
    static[0].copy_(torch.tensor([0, 1, 2]))
    free_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(free_graph):
        cache.free(static[0])
    free_graph.replay()
    model.free([0, 1, 2])
    assert cache.num_free_pages() == 32 - -(-model.length(3) // P)
    model.check([0, 1, 2, 3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_no_host_sync_on_gpu():
    cache = PagedKVCache(2, 4, 16, HEADS, HEAD_DIM, device="cuda", max_sequences=4)
    ids, offsets, keys, values = (t.cuda() for t in _random_batch(
        cache, [0, 1], [20, 3], 30, torch.Generator().manual_seed(8)))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        start = cache.reserve(ids, offsets[1:] - offsets[:-1])
        cache.write(1, ids, offsets, keys[1], values[1], start)
        cache.append(ids, offsets, keys, values)
        cache.append(ids, offsets, keys * 0, values)  # needs a 5th page of 4: overflow, no sync
        tables = cache.lookup(ids)
        cache.lru_slots(2)
        cache.evict_lru(1)
        cache.free(ids)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert cache.overflowed() and cache.num_free_pages() == 4
    assert tables[3].tolist() == [40, 6]
