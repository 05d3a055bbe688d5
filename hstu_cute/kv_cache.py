"""Paged KV cache for ``hstu_attn_varlen_func``: the oracle's gather helpers and a device-side
page allocator (plain torch, no CuTe).

Layout (the op's ``kv_cache`` / ``page_offsets`` / ``page_ids`` / ``last_page_lens`` arguments,
FBGEMM's names):

* ``kv_cache``: (num_pages, 2, page_size, H, D) in q's dtype; ``[:, 0]`` holds keys and ``[:, 1]``
  values. page_size is one of 16, 32, 64, 128.
* ``page_offsets``: (B+1,) int32, non-decreasing, starting at 0. Sequence b owns the pages
  ``page_ids[page_offsets[b]:page_offsets[b+1]]`` in order: its position p lives in page
  ``page_ids[page_offsets[b] + p // page_size]`` at row ``p % page_size``.
* ``page_ids``: 1-D int32, possibly longer than ``page_offsets[-1]``; the trailing entries are
  ignored, so the tables can keep one shape from call to call (CUDA graphs).
* ``last_page_lens``: (B,) int32, the rows used in each sequence's last page, in [1, page_size]
  for a sequence with pages. Its cached length is ``(pages - 1) * page_size + last_page_lens[b]``,
  or 0 when it has no pages (``last_page_lens[b]`` is then ignored).

``PagedKVCache`` keeps the pages of every layer of a model in one tensor and one page table shared
by all layers (every layer caches the same positions). Its methods ``reserve``, ``write``,
``append``, ``lookup`` and ``free`` never synchronise with the host and can be captured in a CUDA
graph, under these rules:

* no ``.item()``, ``.tolist()``, ``.cpu()`` or Python branch on tensor values; every decision that
  depends on data is a ``torch.where`` on the device;
* every output and temporary has a shape fixed by the arguments' shapes (B, T) and the cache's
  sizes, never by their values: writes that must not happen are sent to a scratch element kept
  past the end of each table (and a scratch page past the last page), instead of being filtered out;
* the caller passes tensors already on the cache's device and keeps their shapes fixed between
  replays (pad the jagged rows ``keys``/``values`` to a fixed T: rows past ``seq_offsets[-1]`` are
  dropped), and the ids in one call are distinct slots (not checked: checking would sync).

``reserve`` and ``lookup`` stamp the slots they name with a global tick; ``lru_slots`` and
``evict_lru`` (sync-free too) pick the slots with pages whose stamp is oldest, for a serving
loop's eviction policy. ``num_free_pages`` and ``overflowed`` read device state on the host and do
synchronise.
"""

from __future__ import annotations

import torch

from .validation import cached_lengths
from .validation import fail as _fail
from .variants import PAGE_SIZES


def gather_history(kv_cache, page_offsets, page_ids, last_page_lens):
    """The cached tokens of every sequence, dense: ``(keys, values, offsets)`` with keys and values
    (sum C_b, H, D) in the cache's dtype and offsets (B+1,) int32, the running sum of C_b.

    For tests and the oracle: plain host loops, synchronising freely."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        _fail(ValueError, "kv_cache", "shape (num_pages, 2, page_size, H, D)", tuple(kv_cache.shape))
    page_size = kv_cache.shape[2]
    starts = page_offsets.tolist()
    ids = page_ids.tolist()
    keys, values, offsets = [], [], [0]
    for b, length in enumerate(cached_lengths(page_offsets, last_page_lens, page_size).tolist()):
        pages = ids[starts[b]:starts[b + 1]]
        rows = kv_cache[pages].transpose(0, 1).reshape(2, len(pages) * page_size, *kv_cache.shape[3:])
        keys.append(rows[0, :length])
        values.append(rows[1, :length])
        offsets.append(offsets[-1] + length)
    empty = kv_cache.new_empty((0, *kv_cache.shape[3:]))
    return (torch.cat([empty, *keys]), torch.cat([empty, *values]),
            torch.tensor(offsets, dtype=torch.int32, device=kv_cache.device))


def concat_history(kv_cache, page_offsets, page_ids, last_page_lens, k, v, seq_offsets, num_targets=None):
    """The keys and values of a paged call, dense (docs/operator.md, "Paged KV cache"): per
    sequence its cached tokens followed by its targets, the last ``num_targets[b]`` of its rows
    ``k[seq_offsets[b]:seq_offsets[b+1]]`` (and ``v``; None: no targets, the cache alone).
    Returns ``(k_full, v_full, offsets_full)``; ``offsets_full`` is the call's ``seq_offsets_k``.
    For tests and the oracle (host loops)."""
    old_k, old_v, old_offsets = gather_history(kv_cache, page_offsets, page_ids, last_page_lens)
    old, rows = old_offsets.tolist(), seq_offsets.tolist()
    targets = num_targets.tolist() if num_targets is not None else [0] * (len(rows) - 1)
    ks, vs, offsets = [], [], [0]
    for b in range(len(rows) - 1):
        first = rows[b + 1] - min(max(targets[b], 0), rows[b + 1] - rows[b])
        ks += [old_k[old[b]:old[b + 1]], k[first:rows[b + 1]].to(old_k.dtype)]
        vs += [old_v[old[b]:old[b + 1]], v[first:rows[b + 1]].to(old_v.dtype)]
        offsets.append(offsets[-1] + old[b + 1] - old[b] + rows[b + 1] - first)
    return (torch.cat([old_k[:0], *ks]), torch.cat([old_v[:0], *vs]),
            torch.tensor(offsets, dtype=torch.int32, device=kv_cache.device))


class PagedKVCache:
    """Pages of keys and values for all layers of a model, allocated on the device.

    Sequences live in slots 0..max_sequences-1 (mapping users to slots is the caller's business).
    A slot's pages are listed, in order, in its row of ``page_table``; all layers share the table,
    so ``reserve`` allocates for every layer at once and ``write`` fills one layer. Free pages sit
    on a stack, ``free_stack[:free_count]``; allocation pops from its top.

    Each table that takes masked scatters has one scratch element past its end (the storage one
    scratch page past the last): the public attributes are views that leave it out."""

    def __init__(self, num_layers, num_pages, page_size, heads, head_dim, dtype=torch.bfloat16,
                 device="cuda", max_sequences=1024, max_pages_per_sequence=None):
        for name, value in (("num_layers", num_layers), ("num_pages", num_pages), ("heads", heads),
                            ("head_dim", head_dim), ("max_sequences", max_sequences)):
            if not isinstance(value, int) or isinstance(value, bool):
                _fail(TypeError, name, "an int", type(value).__name__)
            if value < 1:
                _fail(ValueError, name, "a positive int", value)
        if type(page_size) is not int or page_size not in PAGE_SIZES:
            _fail(ValueError, "page_size", f"one of {PAGE_SIZES}", repr(page_size))
        if max_pages_per_sequence is None:
            max_pages_per_sequence = num_pages
        if not isinstance(max_pages_per_sequence, int) or isinstance(max_pages_per_sequence, bool):
            _fail(TypeError, "max_pages_per_sequence", "an int or None", type(max_pages_per_sequence).__name__)
        if not 1 <= max_pages_per_sequence <= num_pages:
            _fail(ValueError, "max_pages_per_sequence", f"an int in [1, num_pages={num_pages}]",
                  max_pages_per_sequence)
        if not isinstance(dtype, torch.dtype):
            _fail(TypeError, "dtype", "a torch.dtype", type(dtype).__name__)

        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.heads, self.head_dim, self.dtype = heads, head_dim, dtype
        self.max_sequences, self.max_pages_per_sequence = max_sequences, max_pages_per_sequence

        # Page num_pages of every layer is the scratch page that dropped rows are written to.
        self._storage = torch.zeros((num_layers, num_pages + 1, 2, page_size, heads, head_dim),
                                    dtype=dtype, device=device)
        self.device = device = self._storage.device  # "cuda" resolved to "cuda:<current>"

        def ints(n, dtype=torch.int32):
            return torch.zeros(n, dtype=dtype, device=device)

        self.storage = self._storage[:, :num_pages]
        self._page_table = ints(max_sequences * max_pages_per_sequence + 1)
        self.page_table = self._page_table[:-1].view(max_sequences, max_pages_per_sequence)
        self.lengths = ints(max_sequences)
        self.pages = ints(max_sequences)
        self._free_stack = torch.arange(num_pages + 1, dtype=torch.int32, device=device)
        self.free_stack = self._free_stack[:-1]
        self.free_count = torch.full((1,), num_pages, dtype=torch.int32, device=device)
        self.last_use = ints(max_sequences, torch.int64)
        self.tick = ints(1, torch.int64)
        self.overflow = ints(1)
        self._columns = torch.arange(max_pages_per_sequence, dtype=torch.int32, device=device)

    def layer(self, i):
        """Layer i's pages, (num_pages, 2, page_size, H, D) and contiguous: the op's kv_cache."""
        if not -self.num_layers <= i < self.num_layers:
            _fail(IndexError, "layer", f"an index in [0, {self.num_layers})", i)
        return self._storage[i, :self.num_pages]

    # -- checks on shapes, dtypes and devices only (never on values: that would sync) --

    def _check_ids(self, seq_ids):
        if not isinstance(seq_ids, torch.Tensor) or seq_ids.dim() != 1:
            _fail(ValueError, "seq_ids", "a 1-D tensor of slot ids", _describe(seq_ids))
        if seq_ids.dtype not in (torch.int32, torch.int64):
            _fail(TypeError, "seq_ids", "dtype int32 or int64", seq_ids.dtype)
        self._check_device("seq_ids", seq_ids)
        return seq_ids.long()

    def _check_device(self, name, t):
        if t.device != self.device:
            _fail(ValueError, name, f"a tensor on {self.device}", t.device)

    def _check_vector(self, name, t, length):
        if not isinstance(t, torch.Tensor) or t.shape != (length,):
            _fail(ValueError, name, f"shape ({length},)", _describe(t))
        if t.dtype not in (torch.int32, torch.int64):
            _fail(TypeError, name, "dtype int32 or int64", t.dtype)
        self._check_device(name, t)

    def _check_rows(self, name, t, leading):
        """t must be (*leading, H, D) in the cache's dtype; None in leading means any size (T)."""
        expected = (*leading, self.heads, self.head_dim)
        if not isinstance(t, torch.Tensor) or t.dim() != len(expected) or any(
                want is not None and have != want for have, want in zip(t.shape, expected)):
            shape = ", ".join("T" if x is None else str(x) for x in expected)
            _fail(ValueError, name, f"shape ({shape})", _describe(t))
        if t.dtype != self.dtype:
            _fail(TypeError, name, f"dtype {self.dtype}", t.dtype)
        self._check_device(name, t)

    def _touch(self, ids):
        self.tick.add_(1)
        self.last_use.index_put_((ids,), self.tick.expand(ids.shape[0]))

    # -- the sync-free, capturable operations --

    def reserve(self, seq_ids, new_lens):
        """Make room for ``new_lens[b]`` more tokens in slot ``seq_ids[b]`` (all layers): allocate
        the pages that takes and advance the lengths. Returns the slots' previous lengths (B,)
        int32, the ``start_lens`` of ``write``.

        All or nothing: when the free pages do not cover the whole call, or a slot would need more
        than max_pages_per_sequence pages, ``overflow`` is set to 1 and no slot gets pages or
        length (``write`` then drops the rows). The returned lengths are the previous ones either
        way. new_lens must be >= 0 (not checked)."""
        ids = self._check_ids(seq_ids)
        self._check_vector("new_lens", new_lens, ids.shape[0])
        old_lens, old_pages = self.lengths[ids], self.pages[ids]
        new_total = old_lens + new_lens.to(torch.int32)
        needed = (new_total + self.page_size - 1) // self.page_size
        extra = needed - old_pages
        total_extra = extra.sum(dtype=torch.int32)
        ok = (total_extra <= self.free_count[0]) & (needed <= self.max_pages_per_sequence).all()
        extra = torch.where(ok, extra, 0)
        total_extra = torch.where(ok, total_extra, 0)

        # Slot b pops free_stack[free_count - total_extra + before_b + j] for j < extra[b] into
        # its page-table column old_pages[b] + j. The (B, M) cells that take nothing read and
        # write the scratch entries past the ends of the stack and the table.
        before = torch.cumsum(extra, 0, dtype=torch.int32) - extra
        taken = self._columns < extra[:, None]
        source = self.free_count - total_extra + before[:, None] + self._columns
        source = torch.where(taken, source, self.num_pages).long()
        target = ids[:, None] * self.max_pages_per_sequence + old_pages[:, None] + self._columns
        target = torch.where(taken, target, self.max_sequences * self.max_pages_per_sequence)
        self._page_table.index_put_((target.reshape(-1),), self._free_stack[source].reshape(-1))

        self.free_count.sub_(total_extra)
        self.lengths.index_put_((ids,), torch.where(ok, new_total, old_lens))
        self.pages.index_put_((ids,), old_pages + extra)
        self.overflow.copy_(torch.where(ok, self.overflow, 1))
        self._touch(ids)
        return old_lens

    def write(self, layer, seq_ids, seq_offsets, keys, values, start_lens):
        """Scatter one layer's jagged new rows into its pages: row t of sequence b (t in
        [seq_offsets[b], seq_offsets[b+1])) goes to position ``start_lens[b] + t - seq_offsets[b]``
        of slot ``seq_ids[b]``. keys/values are (T, H, D); rows past ``seq_offsets[-1]`` (padding)
        and rows outside the slot's reserved length (after an overflow) are dropped."""
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            _fail(IndexError, "layer", f"an int in [0, {self.num_layers})", layer)
        ids = self._check_ids(seq_ids)
        batch = ids.shape[0]
        self._check_vector("seq_offsets", seq_offsets, batch + 1)
        self._check_vector("start_lens", start_lens, batch)
        self._check_rows("keys", keys, (None,))
        self._check_rows("values", values, tuple(keys.shape[:1]))
        rows = keys.shape[0]
        if batch == 0 or rows == 0:
            return

        offsets = seq_offsets.long()
        token = torch.arange(rows, device=keys.device)
        seq = (torch.searchsorted(offsets, token, right=True) - 1).clamp(0, batch - 1)
        slot = ids[seq]
        position = start_lens.long()[seq] + token - offsets[seq]
        column = position // self.page_size
        kept = (token < offsets[-1]) & (position < self.lengths[slot])
        column = torch.where(kept, column, 0)
        page = torch.where(kept, self.page_table[slot, column].long(), self.num_pages)  # scratch
        row = torch.where(kept, position % self.page_size, 0)
        pages = self._storage[layer]
        pages.index_put_((page, torch.zeros_like(page), row), keys)
        pages.index_put_((page, torch.ones_like(page), row), values)

    def append(self, seq_ids, seq_offsets, keys, values, num_targets=None):
        """``reserve`` then ``write`` for every layer: keys/values are (num_layers, T, H, D), or
        (T, H, D) when num_layers == 1. Returns the slots' previous lengths (B,) int32.

        ``num_targets`` ((B,) int32, or None): the last ``num_targets[b]`` rows of each sequence
        are targets, scored but never cached; only the rows before them (the new history) are
        appended. A serving step appends its batch this way, then attends the same q / k / v to
        the cache (FBGEMM's meaning: the pages hold the new history, k / v give the targets)."""
        ids = self._check_ids(seq_ids)
        self._check_vector("seq_offsets", seq_offsets, ids.shape[0] + 1)
        if self.num_layers == 1 and isinstance(keys, torch.Tensor) and keys.dim() == 3:
            keys = keys[None]
        if self.num_layers == 1 and isinstance(values, torch.Tensor) and values.dim() == 3:
            values = values[None]
        self._check_rows("keys", keys, (self.num_layers, None))
        self._check_rows("values", values, tuple(keys.shape[:2]))
        new_lens = seq_offsets[1:] - seq_offsets[:-1]
        if num_targets is not None:
            self._check_vector("num_targets", num_targets, ids.shape[0])
            # write() drops the rows past the reserved length: the targets.
            new_lens = (new_lens - num_targets).clamp(min=0)
        start_lens = self.reserve(seq_ids, new_lens)
        for i in range(self.num_layers):
            self.write(i, seq_ids, seq_offsets, keys[i], values[i], start_lens)
        return start_lens

    def lookup(self, seq_ids):
        """The op's tables for these slots, in this order: ``(page_offsets (B+1,), page_ids
        (B * max_pages_per_sequence,), last_page_lens (B,), cached_lens (B,))``, all int32.
        page_ids holds each slot's pages at page_offsets[b]..; its tail is 0. last_page_lens is
        page_size for a slot with no pages (any value in range would do: the kernel ignores it).
        Marks the slots as used now (for ``lru_slots``)."""
        ids = self._check_ids(seq_ids)
        batch, width = ids.shape[0], self.max_pages_per_sequence
        pages, lengths = self.pages[ids], self.lengths[ids]
        page_offsets = torch.zeros(batch + 1, dtype=torch.int32, device=self.device)
        page_offsets[1:] = torch.cumsum(pages, 0, dtype=torch.int32)
        # Compact each slot's first pages[b] table entries to page_offsets[b]..; the rest of the
        # (B, M) cells go to a scratch entry past the end.
        used = self._columns < pages[:, None]
        target = torch.where(used, page_offsets[:-1, None] + self._columns, batch * width).long()
        page_ids = torch.zeros(batch * width + 1, dtype=torch.int32, device=self.device)
        page_ids.index_put_((target.reshape(-1),), self.page_table[ids].reshape(-1))
        last_page_lens = torch.where(pages > 0, lengths - (pages - 1) * self.page_size, self.page_size)
        self._touch(ids)
        return page_offsets, page_ids[:-1], last_page_lens.to(torch.int32), lengths

    def free(self, seq_ids):
        """Give the slots' pages back to the free stack and set their lengths to 0. Slots without
        pages are left as they are."""
        ids = self._check_ids(seq_ids)
        pages = self.pages[ids]
        before = torch.cumsum(pages, 0, dtype=torch.int32) - pages
        returned = self._columns < pages[:, None]
        # Push onto free_stack[free_count + before_b + j]; the cells that return nothing go to
        # the scratch entry past the stack's end.
        target = torch.where(returned, self.free_count + before[:, None] + self._columns, self.num_pages)
        self._free_stack.index_put_((target.long().reshape(-1),), self.page_table[ids].reshape(-1))
        self.free_count.add_(pages.sum(dtype=torch.int32))
        self.pages.index_put_((ids,), torch.zeros_like(pages))
        self.lengths.index_put_((ids,), torch.zeros_like(pages))
        self.page_table.index_put_((ids,), torch.zeros_like(self._columns))

    def lru_slots(self, count):
        """The ``count`` least recently used slots holding pages (by the last ``reserve``/``lookup``
        that named them), oldest first, as an int64 device tensor. Slots without pages sort last,
        so if fewer than count hold pages the tail is empty slots (freeing them is a no-op)."""
        if not isinstance(count, int) or not 0 <= count <= self.max_sequences:
            _fail(ValueError, "count", f"an int in [0, max_sequences={self.max_sequences}]", count)
        age = torch.where(self.pages > 0, self.last_use, torch.iinfo(torch.int64).max)
        return torch.topk(age, count, largest=False, sorted=True).indices

    def evict_lru(self, count):
        """Free the ``count`` least recently used slots (``lru_slots``) and return their ids."""
        ids = self.lru_slots(count)
        self.free(ids)
        return ids

    # -- host reads (these synchronise) --

    def num_free_pages(self):
        """The number of free pages, read on the host (synchronises with the device)."""
        return int(self.free_count.item())

    def overflowed(self):
        """Whether a ``reserve`` ran out of pages since the last ``clear_overflow`` (synchronises)."""
        return bool(self.overflow.item())

    def clear_overflow(self):
        """Reset the ``overflow`` flag (on the device; no sync)."""
        self.overflow.zero_()


def _describe(x):
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return type(x).__name__


# ---------------------------------------------------------------------------------------------
# Page-table arithmetic of the paged launch (hstu_cute.launch.fwd)
# ---------------------------------------------------------------------------------------------
def key_offsets(cached_lens: torch.Tensor, num_targets: torch.Tensor | None = None) -> torch.Tensor:
    """(B+1,) int32 ``seq_offsets_k`` of a paged call (FBGEMM's ``cu_seqlens_k``): the running sum
    of each sequence's keys, its cached tokens plus its targets, on the device (no sync; it
    captures in a CUDA graph). ``cached_lens``: :meth:`PagedKVCache.lookup`'s last value, after
    the new history was appended."""
    keys = cached_lens if num_targets is None else cached_lens + num_targets
    offsets = torch.zeros(keys.shape[0] + 1, dtype=torch.int32, device=keys.device)
    torch.cumsum(keys, 0, dtype=torch.int32, out=offsets[1:])
    return offsets


def cache_rows(kv_cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """The cache (pages, 2, page_size, H, D) seen as (pages * 2 * page_size, H, D) rows, row
    (page * 2 + kind) * page_size + r, as the kernels read it (validation checked that its strides
    allow that view; no copy)."""
    rows = kv_cache.shape[0] * 2 * page_size
    return kv_cache.as_strided((rows, kv_cache.shape[3], kv_cache.shape[4]), (kv_cache.stride(2),
                               kv_cache.stride(3), 1))


def target_key_rows(seq_offsets_q: torch.Tensor, num_targets: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where a paged call's kernels read keys from k / v: ``(offsets, targets, history)``, ``(B+1,)``,
    ``(B,)`` and ``(B,)`` int32 on the device (no sync). Sequence b's keys past its cache are its
    ``t_b`` targets, the last ``t_b`` of its query rows (k and v share q's layout), so its key rows
    start at ``offsets[b] = seq_offsets_q[b+1] - t_b`` and ``targets`` (the kernels' seqused_k)
    stops them after ``t_b``; ``offsets`` is non-decreasing because ``t_b`` is clamped into
    ``[0, n_b]``. ``history``: the ``n_b - t_b`` query rows before the targets (already cached)."""
    new = torch.diff(seq_offsets_q)
    if num_targets is None:
        return seq_offsets_q, torch.zeros_like(new), new
    targets = torch.minimum(num_targets.clamp(min=0), new)
    return torch.cat((seq_offsets_q[1:] - targets, seq_offsets_q[-1:])), targets, new - targets


def rab_among_new(rab: torch.Tensor, page_offsets, last_page_lens, page_size: int, history, width: int
                  ) -> torch.Tensor:
    """(B, H_rab, W, W) rab of each sequence's queries against its target keys, ``rab[b, h, S_b + i,
    C_b + j]`` for i, j < W = roundup8(width): ``C_b`` cached tokens (from the page tables on the
    device: no sync), ``S_b = C_b - history[b]`` the whole-sequence row of its query 0
    (``history``: :func:`target_key_rows`'), 16-byte aligned rows: a TMA box or a 16-byte load can
    not start at column C_b of rab itself (unaligned). One gather from rab's storage by element
    offset (any strides); offsets past a sequence's rows are clamped into the storage, so they read
    some element of rab (their keys are masked and their queries never stored)."""
    cached = cached_lengths(page_offsets, last_page_lens, page_size)
    width = -(-max(width, 1) // 8) * 8
    s_b, s_h, s_r, s_c = rab.stride()
    base, grid, extent = _rab_gather_geometry(rab, width)
    # Offsets: the (b, h) slab's, query 0's row and the first target column, the (i, j) grid's.
    offsets = ((base + ((cached - history) * s_r + cached * s_c)[:, None, None, None]) + grid).clamp_(
        min=0, max=extent - 1)
    return rab.as_strided((extent,), (1,)).take(offsets)


_RAB_GATHER: dict = {}


def _rab_gather_geometry(rab: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """((B, H_rab, 1, 1) slab offsets, (width, width) offsets of i, j, elements of rab's storage
    span) for :func:`rab_among_new`, cached by rab's shape, strides, device and ``width``."""
    key = (tuple(rab.shape), rab.stride(), rab.device, width)
    geometry = _RAB_GATHER.get(key)
    if geometry is None:
        # Made inside a CUDA-graph capture its values exist only when the graph replays: not kept.
        capturing = rab.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if len(_RAB_GATHER) > 64:
            _RAB_GATHER.clear()
        s_b, s_h, s_r, s_c = rab.stride()
        extent = sum((n - 1) * st for n, st in zip(rab.shape, rab.stride())) + 1
        base = (torch.arange(rab.shape[0], device=rab.device) * s_b)[:, None, None, None] + (
            torch.arange(rab.shape[1], device=rab.device) * s_h)[None, :, None, None]
        steps = torch.arange(width, device=rab.device)
        grid = steps[:, None] * s_r + steps[None, :] * s_c
        geometry = (base, grid, extent)
        if not capturing:
            _RAB_GATHER[key] = geometry
    return geometry
