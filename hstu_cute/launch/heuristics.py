"""Launch heuristics, from host values only (no sync): how many parts a tile's key blocks split
into, how many (batch, head) pairs a section of the tile walk holds, which kernels a backward
runs. Each constant names the measurement that set it.
"""

from __future__ import annotations

from ..call import Call
from ..validation import Problem
from ..variants import (
    FUSED_MIN_SEQLEN_K,
    HOPPER_FUSED_HEAD_DIMS,
    HOPPER_WIDE_HEAD_DIMS,
    FP8_FUSED_HEAD_DIMS,
    SPLIT_KEY_MASKS,
)
from ..fp8_recipe import Fp8Recipe


#: Split keys: at least this many key blocks per part (each part pays a pipeline fill and an fp32
#: partial output), between these many parts. H100, device time (CUDA graph), 16-bit D128 (the
#: sweep_splits.py probe, last at b196058; docs/dev/perf-log.md session 15): one user x (4096 + 256)
#: 59.7 us with one part, 37.1 / 36.6 / 37.8 with 4 / 8 / 12, but 16 parts ran 33-187 us across runs
#: (erratic, not understood); x (16384 + 256) 199.7 -> 56.6 with 8; 2 parts over 16 users lost
#: (0.8x); more CTAs than SMs lost badly (8 users x 8 parts 118 us against 52 with 4). At least 4
#: blocks per part (session 16, the gpu_split_training.py probe, last at 59f9d9b: causal training
#: forwards, H100 graph time, 4 parts against one): B1 N1024 H4 (8 key blocks) 25.5 vs 22.1 us lost,
#: N2048 H2 28.7 vs 30.8 and N4096 H1 34.7 vs 48.3 won.
MIN_BLOCKS_PER_SPLIT = 4
MIN_SPLITS = 4
MAX_SPLITS = 8


def key_splits(p: Problem, tile_m: int, tile_n: int, max_seqlen_q: int, max_seqlen_k: int, sms: int) -> int:
    """Parts to split every tile's key blocks into (1: no split), from host values only (no
    sync): when at most a quarter of the SMs would get a query tile, as many parts as fill the
    SMs, keeping :data:`MIN_BLOCKS_PER_SPLIT` blocks of the longest keys in each. One user's serving
    call (256 new tokens, 4 heads) has 8 query tiles for 132 SMs."""
    if (p.mask.kind, p.mask.has_context or p.mask.has_target) not in SPLIT_KEY_MASKS:
        return 1
    tiles = p.batch * p.heads * -(-max_seqlen_q // tile_m)
    if MIN_SPLITS * tiles > sms:
        return 1
    blocks = -(-max_seqlen_k // tile_n)
    splits = min(sms // max(tiles, 1), blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS)
    return splits if splits >= MIN_SPLITS else 1


# The part of the H100's 50 MB L2 that one section of a kernel's tile walk may fill with the
# operands its tiles share (common.tile_scheduler.SectionWalk). H100 sweep, session 9 (docs/dev/perf-log.md):
# 8 MB is best or near it on jagged batches (B128 N2048 forward 355 TF against 281 with one
# section, Zipf B512 N1024 84 against 54 with one pair per section).
L2_SECTION_BYTES = 8 * 2**20
# Sections of kernels that claim their tiles hold at least this many pairs. H100 forward, full
# batches, three interleaved repeats (docs/dev/perf-log.md session 10): 16 pairs match the static
# snake with one pair (B16 N2048 547-551 vs 547-555 TF, B8 N4096 649-664 vs 642-667) where the
# 8 MB rule's 4-8 pairs lose (518-521, 586-602).
CLAIM_MIN_PAIRS = 16
# ... and at most this many: on jagged rows of short average length the 8 MB rule gives hundreds.
# H100, forward / backward TF/s, rule vs 64 pairs (session 10): Zipf B512 N1024 105.7 / 103.4 vs
# 117.5 / 107.2; short jagged u[1,256] B4096 92.1 / 79.7 vs 94.4 / 81.0; one section over all
# pairs is worst everywhere (102.5 / 99.3, 87.9 / 76.5).
CLAIM_MAX_PAIRS = 64


def bh_per_section(p: Problem, shared_tokens: int, max_seqlen: int, persistent: bool, dynamic: bool = False,
                   block_sparse: bool = False) -> int:
    """(batch, head) pairs per section of the tile walk. Persistent kernels on a batch of full
    sequences (``shared_tokens`` == batch x ``max_seqlen``: known without reading the offsets)
    take one pair per section: their static snake order stays balanced (the heaviest CTA within
    3% of the mean), where other sections can leave one CTA 1.5-1.7x the mean (B8 N4096 forward
    434 TF with 4 pairs per section, 667 with one). Otherwise as many pairs as fit their two
    shared operands of an average sequence (K and V for the forward and dQ kernels, Q and dO
    for the dK/dV kernels) in :data:`L2_SECTION_BYTES`. Kernels that claim their tiles
    (``dynamic``) balance any section, so they always take the L2-sized ones, between
    :data:`CLAIM_MIN_PAIRS` and :data:`CLAIM_MAX_PAIRS` pairs, except ``block_sparse`` walks:
    their tiles read kept blocks out of order, not in step along the sequence as dense tiles do,
    so only the L2-sized sections share K and V there (H200, B8 H32 N16384 causal 10 %, 16 pairs
    against 1: forward 3.45 -> 3.06 ms with 128-blocks, 6.39 -> 5.24 with 64-blocks; ncu's L2
    hit rate 31 % at 16 pairs; docs/dev/perf-log.md session 39)."""
    pairs = p.batch * p.heads
    if persistent and not dynamic and shared_tokens == p.batch * max_seqlen:
        return 1
    per_pair = 2 * p.head_dim * p.dtype.itemsize * max(shared_tokens // max(p.batch, 1), 1)
    fit = L2_SECTION_BYTES // per_pair
    if dynamic and not block_sparse:
        fit = min(max(fit, CLAIM_MIN_PAIRS), CLAIM_MAX_PAIRS)
    return max(1, min(fit, pairs))


def _walk_fixed(key, p: Problem, shared_tokens: int, max_seqlen: int) -> dict:
    """The tile-walk argument of a persistent sm90 kernel's launch (:func:`bh_per_section`);
    the sm80 kernels take none. Kernels that claim their tiles also take :func:`tile_counter`,
    per call (one per stream)."""
    if not key.kernel_name.startswith("hopper"):
        return {}
    return dict(bh_per_section=bh_per_section(p, shared_tokens, max_seqlen, key.persistent, key.dynamic_tiles,
                                              key.block_sparse))


def block_sparse_fused(call: Call, path: str) -> bool:
    """Whether the fused Hopper kernel serves a block-sparse backward (D128, no drab, not
    ``deterministic``, at any key length: skipped tiles cost little there); the sm80 pair serves
    the others, on either path."""
    return (path == "hopper" and call.problem.head_dim in HOPPER_FUSED_HEAD_DIMS and not call.has_drab
            and not call.deterministic)


def _backward_kind(call: Call, path: str) -> str:
    """Which kernels a 16-bit backward runs (:class:`_BackwardPlan`); decided per call, outside
    the cached plans (tests and sweeps move ``FUSED_MIN_SEQLEN_K``)."""
    p = call.problem
    if call.block_mask is not None:
        return "fused" if block_sparse_fused(call, path) else "sm80 pair"
    if path == "hopper" and p.head_dim in HOPPER_WIDE_HEAD_DIMS:
        return "wide"
    if (path == "hopper" and not call.has_drab and not call.deterministic and p.head_dim in HOPPER_FUSED_HEAD_DIMS
            and call.max_seqlen_k >= FUSED_MIN_SEQLEN_K):
        return "fused"
    return "pair"


# The fused FP8 backward (dK, dV and dQ's reduce-adds in one kernel) runs only when asked for
# (``backward_fp8(fused=True)``, or this flag): slower than the pair where it exists. H100, B8
# N4096 H4 D128 causal, quant mode 2, kernels alone, same runs (docs/dev/perf-log.md, session 19):
# 0.753-0.763 ms against the pair's 0.664-0.666 (bf16 backward 0.705-0.718).
FP8_FUSED_BY_DEFAULT = False


def fp8_fused_serves(head_dim: int, fp8: Fp8Recipe, has_rab: bool, has_drab: bool, deterministic: bool) -> bool:
    """Whether the fused FP8 kernel can serve a backward: recipes it reads the tables of
    (:attr:`Fp8Recipe.fused_backward_serves`) at the head dims of ``FP8_FUSED_HEAD_DIMS``,
    without rab, not ``deterministic`` (its dQ sum order varies)."""
    return (head_dim in FP8_FUSED_HEAD_DIMS and fp8.fused_backward_serves and not has_rab
            and not has_drab and not deterministic)


def fp8_backward_fused(head_dim: int, fp8: Fp8Recipe, max_seqlen_k: int, has_rab: bool, has_drab: bool,
                       deterministic: bool) -> bool:
    """Whether :func:`backward_fp8` runs the fused FP8 kernel by default: with
    ``FP8_FUSED_BY_DEFAULT``, where it serves (:func:`fp8_fused_serves`), for keys of at least
    ``FUSED_MIN_SEQLEN_K`` tokens (as the 16-bit fused kernel)."""
    return (FP8_FUSED_BY_DEFAULT and max_seqlen_k >= FUSED_MIN_SEQLEN_K
            and fp8_fused_serves(head_dim, fp8, has_rab, has_drab, deterministic))
