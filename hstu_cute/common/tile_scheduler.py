"""Which tiles a CTA works on, and in which order.

A *walk* maps a linear tile index to ``(block, head, batch)`` (``num_tiles`` of them); the
kernels order tiles heaviest first within sections that fit in L2. :class:`TileScheduler` hands a
CTA its tiles: its own index, then (persistent CTAs, one per SM) the next one in a snake order.
With one CTA per tile the first step of the snake leaves the range, so the same loop serves both.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


class SectionWalk:
    """``num_blocks`` x ``num_heads`` x ``num_batch`` tiles in sections of ``section`` (batch,
    head) pairs (a runtime value): inside a section blocks vary slowest, heads then sequences
    fastest; ``reverse`` walks blocks from the last one down. With causal masks that puts the
    heaviest tiles of a section first (the last query block for the forward and dQ kernels, key
    block 0 for the dK/dV kernels), and the CTAs running together share the K/V (or Q/dO) of the
    section's pairs in L2. The launcher sizes ``section`` so that a section's operands fit in L2:
    one section over all pairs re-read every sequence from HBM on each block level (B32 N1024
    causal forward 255 TF on the H100), one pair per section loses the longest-first order."""

    def __init__(self, num_blocks, num_heads, num_batch, section, reverse: bool):
        self.num_blocks = num_blocks
        self.num_heads = num_heads
        self.num_batch = num_batch
        self.num_tiles = num_blocks * num_heads * num_batch
        self.section = section
        self.reverse = reverse

    def coords(self, tile):
        per_section = self.section * self.num_blocks
        index = tile // per_section
        rest = tile - index * per_section
        pair_first = index * self.section
        width = cutlass.min(self.section, self.num_heads * self.num_batch - pair_first)
        block = rest // width
        pair = pair_first + rest - block * width
        if cutlass.const_expr(self.reverse):
            block = self.num_blocks - 1 - block
        batch = pair // self.num_heads
        return block, pair - batch * self.num_heads, batch


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
