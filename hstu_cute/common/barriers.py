"""Named barrier ids (``bar.sync`` / ``bar.arrive``), one enum for every kernel. Id 0 is
``__syncthreads``; a hardware CTA has 16. Kernels that never run together may reuse an id."""

from __future__ import annotations

import enum


class NamedBarrier(enum.IntEnum):
    SYNC_THREADS = 0
    # Forward (sm90): the two consumer warpgroups take turns issuing their GEMMs (2 + warpgroup).
    SCHED_WG0 = 2
    # sm90: a consumer warpgroup's own barrier (4 + warpgroup): after it zeroes smem rows, and in
    # the FP8 backward (quant mode 1) after its cp.async rows of column descales have landed.
    ZERO_ROWS_WG0 = 4
    # Fused dK/dV/dQ backward (sm90): alternating dQ owner, 6 + (m-block parity) = sdS buffer
    # written by both warpgroups; split dQ columns, 6 = sdS free and 7 = sdS written.
    DS = 6
    # Wide D256 backward (sm90): sP/sdS written by both warpgroups, and (one buffer only) no
    # longer read by the previous m-block's GEMMs.
    PDS_WRITTEN = 6
    PDS_FREE = 7
    # Fused backward: a warpgroup's sdQ buffer free, then written and fenced (8 + warpgroup).
    DQ_WG0 = 8
    # Split-key forward (sm90): a consumer warpgroup's partial output stored and fenced, then its
    # arrival count read out (10 + warpgroup).
    SPLIT_WG0 = 10
    # 16-bit dK/dV backward (sm90) staging its dK / dV tiles in sK / sV: both warpgroups' last
    # GEMMs reading those tiles have retired.
    EPILOGUE_KV = 12
    # Fused backward (sm90): warps 1-3 of the producer warpgroup zeroed the next section's dQ
    # accumulator rows (hopper.dq_ahead).
    DQ_ZERO_AHEAD = 13
