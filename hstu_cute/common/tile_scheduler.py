"""Which tiles a CTA works on, and in which order.

A *walk* maps a linear tile index to ``(block, head, batch)`` (``num_tiles`` of them); the
kernels order tiles heaviest first so that the last wave is short. :class:`TileScheduler` hands a
CTA its tiles: its own index, then (persistent CTAs, one per SM) the next one in a snake order.
With one CTA per tile the first step of the snake leaves the range, so the same loop serves both.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


def _blocks_slowest(tile, num_heads, num_batch):
    """(block, head, batch) with heads fastest, then sequences, blocks slowest."""
    per_block = num_heads * num_batch
    block = tile // per_block
    rest = tile - block * per_block
    batch = rest // num_heads
    return block, rest - batch * num_heads, batch


def _blocks_fastest(tile, num_blocks, num_heads):
    """(block, head, batch) with blocks fastest, then heads, sequences slowest."""
    rest = tile // num_blocks
    block = tile - rest * num_blocks
    batch = rest // num_heads
    return block, rest - batch * num_heads, batch


class _Walk:
    """``num_blocks`` x ``num_heads`` x ``num_batch`` tiles; subclasses order them (``coords``)."""

    def __init__(self, num_blocks, num_heads, num_batch):
        self.num_blocks = num_blocks
        self.num_heads = num_heads
        self.num_batch = num_batch
        self.num_tiles = num_blocks * num_heads * num_batch


class BlockMajorWalk(_Walk):
    """Heads vary fastest, blocks slowest, from 0 up or (``reverse``) down. With causal masks both
    put the heaviest tiles first: key block 0 is seen by the most queries (dK/dV kernels), the
    last query block sees the most keys (dQ kernel)."""

    def __init__(self, num_blocks, num_heads, num_batch, reverse: bool = False):
        super().__init__(num_blocks, num_heads, num_batch)
        self.reverse = reverse

    def coords(self, tile):
        # The block is reversed before the head is formed: this op order is what the shipped PTX
        # of the dQ kernel was measured with.
        per_block = self.num_heads * self.num_batch
        block = tile // per_block
        rest = tile - block * per_block
        batch = rest // self.num_heads
        if cutlass.const_expr(self.reverse):
            block = self.num_blocks - 1 - block
        return block, rest - batch * self.num_heads, batch


class LongestFirstOrLocalWalk(_Walk):
    """The forward's walk over m-blocks, chosen at run time. With ``lpt`` m-blocks vary slowest
    and in reverse (the longest causal rows first across all heads and sequences), else fastest
    and in reverse (the tiles running together share one sequence's K/V in L2: B1024 N256 jagged
    causal on the H100, 144 TF vs 115 with lpt, 2026-11-21)."""

    def __init__(self, lpt, num_m_blocks, num_heads, num_batch):
        super().__init__(num_m_blocks, num_heads, num_batch)
        self.lpt = lpt

    def coords(self, tile):
        lpt_m_rev, lpt_head, lpt_batch = _blocks_slowest(tile, self.num_heads, self.num_batch)
        l2_m_rev, l2_head, l2_batch = _blocks_fastest(tile, self.num_blocks, self.num_heads)
        m_block_rev = cutlass.select_(self.lpt, lpt_m_rev, l2_m_rev)
        head = cutlass.select_(self.lpt, lpt_head, l2_head)
        batch = cutlass.select_(self.lpt, lpt_batch, l2_batch)
        return self.num_blocks - 1 - m_block_rev, head, batch


def snake_next(tile, cta, grid):
    """Persistent CTAs walk rounds of ``grid`` tiles in a snake order (forward, then backward):
    with tiles sorted heaviest first, every CTA's total work evens out (a plain stride hands CTA 0
    the heaviest tile of every round). One tile per CTA: the first step leaves the range."""
    round_next = tile // grid + 1
    return round_next * grid + cutlass.select_(round_next % 2 == 1, grid - 1 - cta, cta)


class TileScheduler:
    """A CTA's tiles of ``walk``: ``first()``, then ``next(tile)`` while ``tile < num_tiles``;
    ``coords(tile)`` is the walk's. Build it where the CTA index is first needed."""

    def __init__(self, walk):
        self.walk = walk
        self.num_tiles = walk.num_tiles
        self.cta, _, _ = cute.arch.block_idx()
        self.grid, _, _ = cute.arch.grid_dim()

    def first(self):
        return self.cta

    def next(self, tile):
        return snake_next(tile, self.cta, self.grid)

    def coords(self, tile):
        return self.walk.coords(tile)
