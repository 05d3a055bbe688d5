"""Which tiles a CTA works on, and in which order.

A *walk* maps a linear tile index to ``(block, head, batch)`` (``num_tiles`` of them); the
kernels order tiles heaviest first within sections that fit in L2. :class:`TileScheduler` hands a
CTA its tiles: its own index, then (persistent CTAs, one per SM) the next one in a snake order.
With one CTA per tile the first step of the snake leaves the range, so the same loop serves both.
:class:`TileClaims` (the sm90 default for persistent kernels) lets each CTA claim the walk's next
tile from a global counter whenever it is free, and hands it to the consumer warps through smem.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from .sm90 import advanced


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

    # The consumer side of a tile loop, shaped like :class:`TileClaims`' (the token is unused).
    def consumer_first(self):
        return self.first(), cutlass.Int32(0)

    def consumer_next(self, tile, token):
        return self.next(tile), token


# Tiles a producer may publish ahead of the consumers (smem ring of tile indices).
TILE_RING_STAGES = 4


class TileClaims:
    """Persistent CTAs that claim their tiles from a global counter instead of a static snake:
    a CTA starts at its own index and then takes whichever tile of ``walk`` comes next when it is
    free, so jagged batches balance whatever their lengths (host simulation of the jagged recsys
    rows, 132 CTAs: the heaviest CTA at 1.26-1.31x the mean with the static snake, within 3% with
    claims).

    ``mCounter``: (2,) int32 in global memory, zero at launch: tiles claimed past the grid, then
    CTAs done. The last CTA to finish sets both back to zero, so the next launch on the same
    stream finds them zeroed (the launcher keeps one pair per stream; CUDA-graph captures take a
    fresh zeroed pair per launch).

    The producer warp claims (:meth:`claim`, :meth:`claimed`) and publishes each tile the
    consumers must visit into a small smem ring (:meth:`publish`), then ``num_tiles`` to stop
    them; the consumers read it back (:meth:`consumer_next`)."""

    def __init__(self, walk, mCounter, ring, sRing, sWords=None):
        self.walk = walk
        self.num_tiles = walk.num_tiles
        self.counter = mCounter
        self.ring = ring
        self.sRing = sRing
        # (TILE_RING_STAGES, words) published beside each tile (publish's ``words``), or None.
        self.sWords = sWords
        self.cta, _, _ = cute.arch.block_idx()
        self.grid, _, _ = cute.arch.grid_dim()

    def coords(self, tile):
        return self.walk.coords(tile)

    def first(self):
        return self.cta

    @cute.jit
    def claim(self):
        """Lane 0 of the calling warp claims the next tile; :meth:`claimed` reads it out (the
        atomic's latency hides behind whatever the warp issues in between)."""
        ticket, counter = cutlass.Int32(0), self.counter
        if cute.arch.lane_idx() == 0:
            ticket = cute.arch.atomic_add(counter.iterator, cutlass.Int32(1), sem="relaxed", scope="gpu")
        return ticket

    def claimed(self, ticket):
        return self.grid + cute.arch.shuffle_sync(ticket, 0)

    @cute.jit
    def finish(self):
        """After the warp's last claim: the last CTA of the launch zeroes the counters."""
        counter, last = self.counter, self.grid - 1
        if cute.arch.lane_idx() == 0:
            done = cute.arch.atomic_add(counter.iterator + 1, cutlass.Int32(1), sem="acq_rel", scope="gpu")
            if done == last:
                counter[0] = cutlass.Int32(0)
                counter[1] = cutlass.Int32(0)

    @cute.jit
    def publish(self, state, tile, words=()):
        """The whole producer warp: tile (and ``words``, Int32 values the consumers would
        otherwise load themselves) -> ring slot (``state``), returns the advanced state."""
        self.ring.producer_acquire(state)
        slots, extra = self.sRing, self.sWords
        if cute.arch.lane_idx() == 0:
            slots[state.index] = tile
            for i in cutlass.range_constexpr(len(words)):
                extra[state.index, i] = words[i]
        self.ring.producer_commit(state)
        return advanced(state)

    def consumer_first(self):
        """Every consumer thread: (first tile, ring state)."""
        return self.consumer_next(None, pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                                     TILE_RING_STAGES))

    def consumer_next(self, tile, state):
        """Every consumer thread: (the next tile the producer published, advanced ring state)."""
        self.ring.consumer_wait(state)
        nxt = self.sRing[state.index]
        self.ring.consumer_release(state)
        return nxt, advanced(state)

    def consumer_first_words(self):
        """Every consumer thread: (first tile, its words, ring state)."""
        return self.consumer_next_words(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                                     TILE_RING_STAGES))

    def consumer_next_words(self, state):
        """Every consumer thread: (the next tile the producer published, the words published with
        it, advanced ring state)."""
        self.ring.consumer_wait(state)
        nxt = self.sRing[state.index]
        words = tuple(self.sWords[state.index, i] for i in range(cute.size(self.sWords, mode=[1])))
        self.ring.consumer_release(state)
        return nxt, words, advanced(state)
