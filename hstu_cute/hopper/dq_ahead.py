"""The fused backward's fp32 dQ accumulator, zeroed inside the kernel one section ahead.

The fused dK/dV/dQ kernel reduce-adds dQ into an fp32 (T_q, H, D) accumulator that must start at
zero. A separate zero-fill runs at HBM speed but alone on the GPU (0.46 ms of a 15.4 ms block-sparse
step at B8 H32 N16384, docs/dev/perf-log.md session 40), while the kernel itself uses a fifth of
the memory bandwidth. So the kernel zeroes it: the CTAs of walk section ``s`` (one CTA per key block
and (batch, head) pair, :class:`~hstu_cute.common.tile_scheduler.SectionWalk`) zero the rows of
section ``s + lead``'s pairs and count themselves in ``mZeroDone[s + lead]``; a CTA of that section
waits for the count before its first reduce-add. The launcher zeroes the first ``lead`` sections'
rows (and the counts) with one small fill; ``lead`` is a runtime argument, 0 for a launcher that
zeroed everything (:func:`hstu_cute.launch.bwd._dq_accumulator`).

Ordering. CTAs start in increasing index order, and section ``s``'s CTAs all come before section
``s + lead``'s; each zeroes first and waits for nothing, so a waiting CTA only waits for CTAs that are
already running or done. Rows shared across sections through a tile that crosses a sequence's end
(the kernel adds exact zeros there) come out zero whatever the order of the zero-store and the add.

Who zeroes: warps 1-3 of the producer warpgroup, idle otherwise: each row of the accumulator is
``D * 4`` = 512 bytes, one 16-byte store per lane. Section ``s + lead``'s pairs times the key-block
count make as many (pair, chunk of rows) items as section ``s`` has CTAs (sections are full but
the last), one item per CTA; the last section's CTA 0 zeroes the rows past the last sequence.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..common.barriers import NamedBarrier

# Warps 1-3 of warpgroup 0.
ZERO_WARPS = 3


@cute.jit
def section_of(tile: Int32, bh_per_section: Int32, num_n_blocks: Int32):
    """(section, rank in it) of a CTA's linear tile: sections are ``bh_per_section`` pairs times
    ``num_n_blocks`` key blocks."""
    per_section = bh_per_section * num_n_blocks
    section = tile // per_section
    return section, tile - section * per_section


@cute.jit
def zero_ahead(mdQaccum, mZeroDone, mOffsetsQ, tile: Int32, bh_per_section: Int32, num_n_blocks: Int32,
               num_pairs: Int32, heads: Int32, warp_idx: Int32, lead: Int32):
    """Warps 1-3: this CTA's rows of the accumulator of the section ``lead`` ahead (the last
    section's CTA 0: the rows past the last sequence) to zero, then one count in ``mZeroDone``.
    ``lead`` 0: the launcher zeroed everything."""
    if lead > 0:
        section, rank = section_of(tile, bh_per_section, num_n_blocks)
        num_sections = mZeroDone.shape[0]
        target = section + lead
        head_dim = cute.size(mdQaccum, mode=[2])
        lane = cute.arch.lane_idx()
        first_unit, units, stride = Int64(0), Int32(0), Int64(1)
        if target < num_sections:
            width = cutlass.min(bh_per_section, num_pairs - target * bh_per_section)
            if rank < width * num_n_blocks:
                chunk = rank // width
                pair = target * bh_per_section + rank - chunk * width
                batch = pair // heads
                head = pair - batch * heads
                row0 = mOffsetsQ[batch]
                rows = mOffsetsQ[batch + 1] - row0
                per_chunk = (rows + num_n_blocks - 1) // num_n_blocks
                lo = cutlass.min(rows, chunk * per_chunk)
                units = cutlass.min(rows, lo + per_chunk) - lo
                first_unit = (Int64(row0) + Int64(lo)) * Int64(heads) + Int64(head)
                stride = Int64(heads)
        else:
            if section == num_sections - 1:
                if rank == 0:
                    # Rows past the last offset belong to no sequence; nobody else writes them.
                    last = mOffsetsQ[mOffsetsQ.shape[0] - 1]
                    first_unit = Int64(last) * Int64(heads)
                    units = (mdQaccum.shape[0] - last) * heads
        zeros = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        zeros.fill(0.0)
        for u in cutlass.range(warp_idx - 1, units, ZERO_WARPS, unroll=1):
            offset = (first_unit + Int64(u) * stride) * Int64(head_dim) + Int64(lane * 4)
            dst = cute.make_tensor(cute.make_ptr(Float32, (mdQaccum.iterator + offset).toint(),
                                                 cute.AddressSpace.gmem, assumed_align=16), cute.make_layout(4))
            cute.autovec_copy(zeros, dst)
        if target < num_sections:
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(barrier_id=NamedBarrier.DQ_ZERO_AHEAD, number_of_threads=32 * ZERO_WARPS)
            if warp_idx == 1:
                if lane == 0:
                    cute.arch.atomic_add(mZeroDone.iterator + target, Int32(1), sem="release", scope="gpu")


@cute.jit
def wait_zeroed(mZeroDone, tile: Int32, bh_per_section: Int32, num_n_blocks: Int32, lead: Int32):
    """The warp that issues a CTA's first dQ reduce-add: wait until the CTAs ``lead`` sections
    back have zeroed this section's rows (the launcher zeroed the first ``lead`` sections), then
    order their stores before the TMA's (async proxy)."""
    if lead > 0:
        section, _ = section_of(tile, bh_per_section, num_n_blocks)
        if section >= lead:
            expected = bh_per_section * num_n_blocks
            done = cute.arch.load(mZeroDone.iterator + section, Int32, sem="acquire", scope="gpu")
            while done < expected:
                done = cute.arch.load(mZeroDone.iterator + section, Int32, sem="acquire", scope="gpu")
            cute.arch.fence_proxy("async.global")
