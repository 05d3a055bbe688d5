"""Block-sparse masks (docs/operator.md, "Block-sparse masks"): which (query block, key block)
pairs of each sequence and head are attended, on top of the HSTU mask.

One representation, :class:`BlockMask`: per (sequence, head or 1, query block) the ascending list of
kept key blocks, as a count and an index tensor (FlexAttention's and FlashAttention-4's layout). Blocks
count from each sequence's start, in key coordinates on both sides: query ``i`` of a sequence with
``L_q`` queries and ``L_k`` keys sits at row ``r = L_k - L_q + i`` (``r = i`` without delta_q) and
belongs to query block ``r // q_block``. So a mask made for a whole sequence serves a delta_q call on
its last rows unchanged.

Every constructor runs on the mask's device with tensor ops only: no host sync, and it traces.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

#: Block sizes must be multiples of this (the kernels' MMA granularity).
BLOCK_MULTIPLE = 16

__all__ = ["BlockMask", "BLOCK_MULTIPLE", "blocks_for", "KernelTables", "TileLists"]


def blocks_for(length: int, block: int) -> int:
    """Blocks of ``block`` rows that cover ``length`` rows (the last one may be partial)."""
    return -(-max(int(length), 0) // int(block))


def _check_block(name: str, block) -> int:
    if isinstance(block, bool) or not isinstance(block, int):
        raise TypeError(f"{name}: expected a Python int, got {type(block).__name__}")
    if block <= 0 or block % BLOCK_MULTIPLE:
        raise ValueError(f"{name}: expected a positive multiple of {BLOCK_MULTIPLE}, got {block}")
    return block


@dataclasses.dataclass(frozen=True)
class BlockMask:
    """Kept (query block, key block) pairs per sequence and head.

    * ``kv_count``: ``(B, H_mask, M_q)`` int32, the number of kept key blocks of each query block;
    * ``kv_index``: ``(B, H_mask, M_q, M_k)`` int32, their indices in ascending order in the first
      ``kv_count`` entries (the rest is never read: it may hold anything);
    * ``q_block`` / ``k_block``: block sizes in rows and keys, multiples of 16.

    ``H_mask`` is 1 (every head) or the call's H. ``M_q`` covers at least ``max_seqlen_k`` rows in
    ``q_block`` blocks (query blocks are numbered in key coordinates: module doc) and ``M_k`` at
    least ``max_seqlen_k`` keys in ``k_block`` blocks. Build one with a constructor
    (:meth:`from_dense`, :meth:`from_jagged_dense`, :meth:`from_lists`, :meth:`from_topk`,
    :meth:`from_flex`)."""

    kv_count: torch.Tensor
    kv_index: torch.Tensor
    q_block: int
    k_block: int

    def __post_init__(self):
        _check_block("q_block", self.q_block)
        _check_block("k_block", self.k_block)
        for name, t, dim in (("kv_count", self.kv_count, 3), ("kv_index", self.kv_index, 4)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"BlockMask.{name}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.int32:
                raise TypeError(f"BlockMask.{name}.dtype: expected torch.int32, got {t.dtype}")
            if t.dim() != dim:
                raise ValueError(f"BlockMask.{name}: expected {dim} dims, got shape {tuple(t.shape)}")
        if self.kv_index.shape[:3] != self.kv_count.shape:
            raise ValueError(f"BlockMask.kv_index: expected shape {tuple(self.kv_count.shape)} + (M_k,), got "
                             f"{tuple(self.kv_index.shape)}")
        if self.kv_index.device != self.kv_count.device:
            raise ValueError(f"BlockMask.kv_index.device: expected {self.kv_count.device} (kv_count's), got "
                             f"{self.kv_index.device}")

    # -- shape: B, H_mask, M_q, M_k and the device ---------------------------------------------
    batch = property(lambda self: self.kv_count.shape[0])
    heads = property(lambda self: self.kv_count.shape[1])
    q_blocks = property(lambda self: self.kv_count.shape[2])
    k_blocks = property(lambda self: self.kv_index.shape[3])
    device = property(lambda self: self.kv_count.device)

    # -- constructors --------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, blocks: torch.Tensor, q_block: int, k_block: int) -> "BlockMask":
        """From a per-sequence dense bool ``(B, H_mask, M_q, M_k)``: ``blocks[b, h, i, j]`` keeps
        key block ``j`` for query block ``i``."""
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.bool or blocks.dim() != 4:
            raise TypeError(f"blocks: expected a 4-D torch.bool tensor (B, H_mask, M_q, M_k), got "
                            f"{getattr(blocks, 'dtype', type(blocks).__name__)} {tuple(getattr(blocks, 'shape', ()))}")
        count, index = _ascending_lists(blocks)
        mask = cls(count, index, q_block, k_block)
        if not _untracked(count, index):
            # to_dense would rebuild it from the lists: a scatter per kernel_tables build (0.1 ms
            # at 4 x 1024 x 1024 blocks, H200, session 38), twice per training step.
            object.__setattr__(mask, "_dense", (blocks.clone(), count._version, index._version))
        return mask

    @classmethod
    def from_lists(cls, kv_count: torch.Tensor, kv_index: torch.Tensor, q_block: int, k_block: int) -> "BlockMask":
        """From FlexAttention's / FlashAttention-4's lists: ``kv_count (B, H_mask, M_q)`` and
        ``kv_index (B, H_mask, M_q, M_k)``, ascending in each row's first ``kv_count`` entries
        (``HSTU_CUTE_CHECK=1`` checks it). Integer tensors of any width are converted to int32."""
        return cls(kv_count.to(torch.int32), kv_index.to(torch.int32).contiguous(), q_block, k_block)

    @classmethod
    def from_topk(cls, indices: torch.Tensor, q_block: int, k_block: int, k_blocks: int) -> "BlockMask":
        """From the key blocks a selection step picked per query block: ``indices (B, H_mask, M_q,
        top_k)``, any order, duplicates allowed; negative entries are unused slots. ``k_blocks``
        is ``M_k``; an entry at or past it is refused by ``HSTU_CUTE_CHECK=1`` and dropped."""
        if not isinstance(indices, torch.Tensor) or indices.dim() != 4 or indices.is_floating_point():
            raise TypeError(f"indices: expected a 4-D integer tensor (B, H_mask, M_q, top_k), got "
                            f"{getattr(indices, 'dtype', type(indices).__name__)}")
        b, h, m, _ = indices.shape
        idx = indices.to(torch.int64)
        valid = (idx >= 0) & (idx < k_blocks)
        # Scatter into one extra column for the unused and out-of-range slots, then drop it.
        target = torch.where(valid, idx, torch.full_like(idx, k_blocks))
        dense = torch.zeros((b, h, m, k_blocks + 1), dtype=torch.bool, device=indices.device)
        dense.scatter_(3, target, True)
        return cls.from_dense(dense[..., :k_blocks], q_block, k_block)

    @classmethod
    def from_jagged_dense(cls, blocks: torch.Tensor, seq_offsets_q: torch.Tensor, seq_offsets_k: torch.Tensor,
                          q_block: int, k_block: int, max_seqlen_k: int) -> "BlockMask":
        """From HBSA's layout: ``blocks (H_mask, total_q_blocks, total_k_blocks)`` bool with blocks
        numbered over the whole jagged batch. Sequence ``b`` owns ``ceil(L_k / q_block)`` query
        blocks (key coordinates: module doc; HBSA's count when ``L_q == L_k``) and ``ceil(L_k /
        k_block)`` key blocks, after those of the sequences before it."""
        _check_block("q_block", q_block)
        _check_block("k_block", k_block)
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.bool or blocks.dim() != 3:
            raise TypeError("blocks: expected a 3-D torch.bool tensor (H_mask, total_q_blocks, total_k_blocks)")
        del seq_offsets_q  # query blocks are numbered in key coordinates
        lens = (seq_offsets_k[1:] - seq_offsets_k[:-1]).to(torch.int64)
        nq = (lens + q_block - 1) // q_block
        nk = (lens + k_block - 1) // k_block
        first_q = torch.cumsum(nq, 0) - nq
        first_k = torch.cumsum(nk, 0) - nk
        mq, mk = blocks_for(max_seqlen_k, q_block), blocks_for(max_seqlen_k, k_block)
        i = torch.arange(mq, device=blocks.device)
        j = torch.arange(mk, device=blocks.device)
        inside = (i[None, :, None] < nq[:, None, None]) & (j[None, None, :] < nk[:, None, None])  # (B, mq, mk)
        rows = (first_q[:, None] + i[None, :]).clamp(max=max(blocks.shape[1] - 1, 0))
        cols = (first_k[:, None] + j[None, :]).clamp(max=max(blocks.shape[2] - 1, 0))
        if blocks.shape[1] == 0 or blocks.shape[2] == 0:
            picked = torch.zeros((blocks.shape[0], lens.numel(), mq, mk), dtype=torch.bool, device=blocks.device)
        else:
            picked = blocks[:, rows[:, :, None], cols[:, None, :]].transpose(0, 1)  # (B, H_mask, mq, mk)
        return cls.from_dense(picked & inside[:, None], q_block, k_block)

    @classmethod
    def from_flex(cls, flex_mask) -> "BlockMask":
        """From a ``torch.nn.attention.flex_attention.BlockMask`` (uniform lengths): its partial
        and full blocks are both kept; element masking inside kept blocks is the HSTU mask's."""
        q_block, k_block = (int(s) for s in flex_mask.BLOCK_SIZE)
        count = flex_mask.kv_num_blocks
        index = flex_mask.kv_indices
        dense = _dense_of_lists(count, index, index.shape[-1])
        if getattr(flex_mask, "full_kv_num_blocks", None) is not None:
            dense = dense | _dense_of_lists(flex_mask.full_kv_num_blocks, flex_mask.full_kv_indices, index.shape[-1])
        return cls.from_dense(dense, q_block, k_block)

    # -- views ---------------------------------------------------------------------------------
    def to_dense(self) -> torch.Tensor:
        """``(B, H_mask, M_q, M_k)`` bool of the kept blocks (entries past each count ignored).
        A mask made from a dense grid keeps a copy of it, until its lists change in place."""
        kept = self.__dict__.get("_dense")
        if kept is not None and kept[1:] == (self.kv_count._version, self.kv_index._version):
            return kept[0]
        return _dense_of_lists(self.kv_count, self.kv_index, self.k_blocks)

    def element_mask(self, b: int, h: int, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Bool ``(len(rows), len(keys))``: whether sequence ``b``'s key-coordinate ``rows`` and
        ``keys`` fall in kept blocks of head ``h`` (the oracle's expansion; ``h`` is taken modulo
        ``H_mask``)."""
        dense = self.to_dense()[b, h % self.heads]
        qi = (rows // self.q_block).clamp(max=self.q_blocks - 1)
        kj = (keys // self.k_block).clamp(max=self.k_blocks - 1)
        inside = (rows // self.q_block < self.q_blocks)[:, None] & (keys // self.k_block < self.k_blocks)[None, :]
        return dense.to(rows.device)[qi[:, None], kj[None, :]] & inside

    def tile_lists(self, seq_offsets_q: torch.Tensor, seq_offsets_k: torch.Tensor, seqused_q, seqused_k,
                   tile_m: int, tile_n: int, max_seqlen_q: int, max_seqlen_k: int,
                   is_delta_q: bool = False, dense: torch.Tensor | None = None) -> TileLists:
        """The mask at a kernel's ``tile_m x tile_n`` tiles (:class:`TileLists`), on the device
        without a sync: a 2-D prefix sum of the kept blocks, read at each tile's rectangle of
        blocks (clipped to the sequence's valid rows and keys). Query 0 sits at key-coordinate
        row ``L_k - L_q`` with ``is_delta_q`` and at row 0 without, as in the kernels' masks.
        ``dense``: :meth:`to_dense`, when the caller has it already."""
        device = self.device
        dense = self.to_dense() if dense is None else dense
        batch, heads, mq, mk = dense.shape
        lens_q = (seq_offsets_q[1:] - seq_offsets_q[:-1]).to(torch.int64)
        lens_k = (seq_offsets_k[1:] - seq_offsets_k[:-1]).to(torch.int64)
        if seqused_q is not None:
            lens_q = torch.minimum(lens_q, seqused_q.to(torch.int64))
        if seqused_k is not None:
            lens_k = torch.minimum(lens_k, seqused_k.to(torch.int64))
        lens_q, lens_k = lens_q.clamp(min=0), lens_k.clamp(min=0)
        offset = (lens_k - lens_q).clamp(min=0) if is_delta_q else torch.zeros_like(lens_q)
        m_tiles, n_tiles = blocks_for(max_seqlen_q, tile_m), blocks_for(max_seqlen_k, tile_n)
        if not is_delta_q and _nested(tile_m, self.q_block) and _nested(tile_n, self.k_block):
            return self._aligned_tile_lists(dense, lens_q, lens_k, tile_m, tile_n, m_tiles, n_tiles)
        prefix = torch.zeros((batch, heads, mq + 1, mk + 1), dtype=torch.int32, device=device)
        # int32 scans along the last dimension: the scan along dim 2 in place, int64, took 0.38 ms
        # at 4 x 1024 x 1024 blocks on the H200 (docs/dev/perf-log.md session 38).
        rows_summed = dense.transpose(2, 3).contiguous().cumsum(3, dtype=torch.int32).transpose(2, 3)
        prefix[:, :, 1:, 1:] = rows_summed.contiguous().cumsum(3, dtype=torch.int32)
        m = torch.arange(m_tiles, device=device)
        n = torch.arange(n_tiles, device=device)
        # Rows [r0, r1) and keys [j0, j1) of each tile, clipped to the sequence (empty: r0 >= r1).
        r0 = offset[:, None] + m[None, :] * tile_m
        r1 = offset[:, None] + torch.minimum((m[None, :] + 1) * tile_m, lens_q[:, None])
        j0 = (n[None, :] * tile_n).expand(lens_k.numel(), -1)
        j1 = torch.minimum((n[None, :] + 1) * tile_n, lens_k[:, None])
        rows_live, keys_live = r1 > r0, j1 > j0
        # Block ranges [qa, qb) x [ka, kb), clamped into the mask's blocks.
        qa = (r0 // self.q_block).clamp(max=mq)
        qb = ((r1 - 1).clamp(min=0) // self.q_block + 1).clamp(max=mq)
        ka = (j0 // self.k_block).clamp(max=mk)
        kb = ((j1 - 1).clamp(min=0) // self.k_block + 1).clamp(max=mk)

        def corner(rows, cols):  # prefix[b, h, rows[b, m], cols[b, n]] -> (B, H, M_t, N_t)
            b_idx = torch.arange(batch, device=device)[:, None, None, None]
            h_idx = torch.arange(heads, device=device)[None, :, None, None]
            return prefix[b_idx, h_idx, rows[:, None, :, None], cols[:, None, None, :]]

        kept = corner(qb, kb) - corner(qa, kb) - corner(qb, ka) + corner(qa, ka)
        area = ((qb - qa)[:, None, :, None] * (kb - ka)[:, None, None, :])
        live = (rows_live[:, None, :, None] & keys_live[:, None, None, :])
        return _tile_lists((kept > 0) & live, kept, area)

    def _aligned_tile_lists(self, dense, lens_q, lens_k, tile_m: int, tile_n: int, m_tiles: int,
                            n_tiles: int) -> TileLists:
        """:meth:`tile_lists` where each tile size divides its block size or is a multiple of it
        and rows start at key-coordinate row 0 (no delta_q): the kept blocks of a tile are then a
        fixed group of whole blocks (or one block), summed by a reshape, with the blocks past each
        sequence's valid rows and keys dropped first. At 64 x 64 tiles of 64-blocks, B1 H4 and
        1024 x 1024 blocks, the prefix-sum path's corner gathers took 0.48 ms (H200, session 38)."""
        mq, mk = dense.shape[2:]
        rows_live = torch.arange(mq, device=dense.device)[None, :] * self.q_block < lens_q[:, None]  # (B, M_q)
        keys_live = torch.arange(mk, device=dense.device)[None, :] * self.k_block < lens_k[:, None]  # (B, M_k)
        valid = dense & rows_live[:, None, :, None] & keys_live[:, None, None, :]
        kept = _blocks_to_tiles(_blocks_to_tiles(valid.to(torch.int32), 2, self.q_block, tile_m, m_tiles),
                                3, self.k_block, tile_n, n_tiles)
        row_area = _blocks_to_tiles(rows_live.to(torch.int32), 1, self.q_block, tile_m, m_tiles)
        key_area = _blocks_to_tiles(keys_live.to(torch.int32), 1, self.k_block, tile_n, n_tiles)
        area = row_area[:, None, :, None] * key_area[:, None, None, :]
        tiles_live = ((torch.arange(m_tiles, device=dense.device)[None, :] * tile_m < lens_q[:, None])[:, None, :, None]
                      & (torch.arange(n_tiles, device=dense.device)[None, :] * tile_n < lens_k[:, None])[:, None, None, :])
        return _tile_lists((kept > 0) & tiles_live, kept, area)

    def kernel_tables(self, seq_offsets_q: torch.Tensor, seq_offsets_k: torch.Tensor, seqused_q, seqused_k,
                      tile_m: int, tile_n: int, max_seqlen_q: int, max_seqlen_k: int,
                      is_delta_q: bool = False) -> "KernelTables":
        """What the kernels read (:class:`KernelTables`), built by :meth:`tile_lists` once per
        tile size and batch layout and kept on the mask: a mask reused by every layer and by the
        backward costs its ~40 small tensor ops (~0.3 ms of device time and more of host at
        B8 N16384) once (docs/dev/perf-log.md, session 31). The batch layout is recognised by the
        very tensor objects (held by the entry, so their memory is not reused) and their version
        counters: an in-place change rebuilds the tables."""
        layout = (seq_offsets_q, seq_offsets_k, seqused_q, seqused_k)
        static = (tile_m, tile_n, int(max_seqlen_q), int(max_seqlen_k), bool(is_delta_q))
        # Traced calls and CUDA-graph captures build them afresh and keep nothing: a capture
        # records the building kernels without running them, so its tables hold their values
        # only when the graph replays.
        tracing = _untracked(self.kv_count, *layout)
        versions = tuple(None if t is None else t._version for t in layout) if not tracing else None
        cache = self.__dict__.get("_kernel_tables")
        if cache is None and not tracing:
            cache = []
            object.__setattr__(self, "_kernel_tables", cache)
        if not tracing:
            for entry_static, entry_layout, entry_versions, tables in cache:
                if (entry_static == static and entry_versions == versions
                        and all(a is b for a, b in zip(entry_layout, layout))):
                    return tables
        dense = self.to_dense()
        lists = self.tile_lists(*layout, tile_m, tile_n, max_seqlen_q, max_seqlen_k, is_delta_q, dense)
        tables = KernelTables(lists.count, lists.index, lists.t_count, lists.t_index, lists.state(),
                              dense.to(torch.uint8))
        if not tracing:
            cache.append((static, layout, versions, tables))
            del cache[:-KERNEL_TABLES_KEPT]
        return tables

    def density(self) -> torch.Tensor:
        """Kept blocks over all blocks (a 0-d tensor on the mask's device; no sync)."""
        return self.kv_count.sum(dtype=torch.float32) / max(self.kv_count.numel() * self.k_blocks, 1)


class TileLists(NamedTuple):
    """A block mask at a kernel's tile size (:meth:`BlockMask.tile_lists`). Query tiles count from
    each sequence's first query, as the kernels' m-blocks do; key tiles from its first key.

    * ``count (B, H_mask, M_t)`` / ``index (B, H_mask, M_t, N_t)``: per query tile, the key tiles
      holding any kept element of a valid row and key, ascending (the forward walks them);
    * ``kept (B, H_mask, M_t, N_t)`` bool: the same tiles as a grid;
    * ``partial (B, H_mask, M_t, N_t)`` bool: the tile mixes kept and dropped blocks (the kernels
      mask it by block, on top of the HSTU mask);
    * ``t_count (B, H_mask, N_t)`` / ``t_index (B, H_mask, N_t, M_t)``: per key tile, its query
      tiles (the dK/dV kernels walk them)."""

    count: torch.Tensor
    index: torch.Tensor
    kept: torch.Tensor
    partial: torch.Tensor
    t_count: torch.Tensor
    t_index: torch.Tensor

    def state(self) -> torch.Tensor:
        """(B, H_mask, M_t, N_t) uint8 per tile: 0 no kept element, 1 all kept, 2 mixed (the
        kernels' ``mBlockState``)."""
        return self.kept.to(torch.uint8) + self.partial.to(torch.uint8)


#: Batch layouts whose kernel tables a mask keeps (the newest ones).
KERNEL_TABLES_KEPT = 4


class KernelTables(NamedTuple):
    """A block mask as the kernels read it (:meth:`BlockMask.kernel_tables`): the lists per query
    tile (``count``, ``index``) and per key tile (``t_count``, ``t_index``) of :class:`TileLists`,
    each tile's ``state`` (:meth:`TileLists.state`) and the kept blocks as uint8 ``kept_blocks``
    (B, H_mask, M_q, M_k), read inside the mixed tiles."""

    count: torch.Tensor
    index: torch.Tensor
    t_count: torch.Tensor
    t_index: torch.Tensor
    state: torch.Tensor
    kept_blocks: torch.Tensor


def _tile_lists(any_kept: torch.Tensor, kept: torch.Tensor, area: torch.Tensor) -> TileLists:
    """:class:`TileLists` from each live tile's kept flag ``any_kept`` and its kept and total
    element counts (``kept < area``: the tile mixes kept and dropped blocks)."""
    count, index = _ascending_lists(any_kept)
    t_count, t_index = _ascending_lists(any_kept.transpose(2, 3))
    return TileLists(count, index, any_kept, any_kept & (kept < area), t_count, t_index)


def _untracked(*tensors) -> bool:
    """Whether tensors made now must not be kept on a mask: traced calls (compile, export, fake
    tensors) and CUDA-graph captures, which record the kernels that fill them without running
    them (the values exist only when the graph replays)."""
    return torch.compiler.is_compiling() or any(
        isinstance(t, torch.Tensor) and type(t) is not torch.Tensor for t in tensors) or (
        tensors[0].is_cuda and torch.cuda.is_current_stream_capturing())


def _ascending_lists(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, index) of each row of ``kept (..., N)`` bool: the kept positions ascending, then
    the dropped ones ascending (what a stable sort of the dropped flags gives), by a prefix sum
    and one scatter: the sort took 0.37 ms for two 4 x 1024 x 1024 grids on the H200
    (docs/dev/perf-log.md session 38). ``index`` is contiguous int32."""
    flags = kept.contiguous().to(torch.int32)
    count = flags.sum(dim=-1, dtype=torch.int32)
    kept_through = flags.cumsum(-1, dtype=torch.int32)  # kept positions <= j
    position = torch.arange(flags.shape[-1], dtype=torch.int32, device=flags.device)
    # kept j goes to (kept before j); dropped j to count + (dropped before j) = count + j - kept_through[j].
    target = torch.where(flags.bool(), kept_through - 1, count[..., None] + position - kept_through)
    index = torch.empty_like(flags).scatter_(-1, target.to(torch.int64), position.expand_as(flags))
    return count, index


def _nested(tile: int, block: int) -> bool:
    """Whether tiles of ``tile`` rows hold whole blocks of ``block`` rows or lie inside one."""
    return tile % block == 0 or block % tile == 0


def _blocks_to_tiles(x: torch.Tensor, dim: int, block: int, tile: int, tiles: int) -> torch.Tensor:
    """``x`` per block along ``dim`` -> per tile (``tiles`` of them), for :func:`_nested` sizes:
    the sum over the tile's ``tile // block`` blocks, or its one block's value where the tile lies
    inside a block. Blocks past the last tile are dropped, missing ones count 0."""
    if tile % block == 0:
        group = tile // block
        per_block = _resized(x, dim, tiles * group)
        return per_block.unflatten(dim, (tiles, group)).sum(dim + 1, dtype=x.dtype)
    return _resized(x.repeat_interleave(block // tile, dim=dim), dim, tiles)


def _resized(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` cut or zero-padded to ``size`` entries along ``dim``."""
    have = x.shape[dim]
    if have >= size:
        return x.narrow(dim, 0, size)
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, size - have]
    return torch.nn.functional.pad(x, pad)


def _dense_of_lists(count: torch.Tensor, index: torch.Tensor, k_blocks: int) -> torch.Tensor:
    """(…, M_q, k_blocks) bool from count / index lists; entries past each count and indices out of
    [0, k_blocks) are dropped (one extra scatter column)."""
    idx = index.to(torch.int64)
    used = torch.arange(idx.shape[-1], device=idx.device) < count.to(torch.int64)[..., None]
    valid = used & (idx >= 0) & (idx < k_blocks)
    target = torch.where(valid, idx, torch.full_like(idx, k_blocks))
    dense = torch.zeros(idx.shape[:-1] + (k_blocks + 1,), dtype=torch.bool, device=idx.device)
    dense.scatter_(-1, target, True)
    return dense[..., :k_blocks]
