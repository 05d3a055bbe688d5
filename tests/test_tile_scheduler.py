"""The tile walks visit every tile exactly once, in the promised order, and the launcher's section
sizes follow its rule. The walk's arithmetic runs on Python ints here, the same code the kernels trace."""

import dataclasses
import itertools

import pytest
import torch

from hstu_cute import launch, masks
from hstu_cute.common.tile_scheduler import SectionWalk
from hstu_cute.validation import Problem


@pytest.mark.parametrize("blocks,heads,batch", [(8, 4, 32), (3, 2, 5), (1, 1, 1), (5, 3, 7), (16, 1, 3)])
@pytest.mark.parametrize("section", [1, 2, 3, 4, 7, 1000])
@pytest.mark.parametrize("reverse", [False, True])
def test_section_walk_is_a_bijection(blocks, heads, batch, section, reverse):
    walk = SectionWalk(blocks, heads, batch, section, reverse)
    seen = [walk.coords(t) for t in range(walk.num_tiles)]
    assert sorted(seen) == sorted(itertools.product(range(blocks), range(heads), range(batch)))


def test_section_walk_order():
    # 2 heads x 3 sequences in sections of 4 pairs (the last one has 2): blocks slowest inside a
    # section, heaviest (last) block first when reversed.
    walk = SectionWalk(2, 2, 3, 4, reverse=True)
    pairs = [(h, b) for b in range(3) for h in range(2)]
    expected = [(1, *pairs[i]) for i in range(4)] + [(0, *pairs[i]) for i in range(4)]
    expected += [(1, *pairs[i]) for i in (4, 5)] + [(0, *pairs[i]) for i in (4, 5)]
    assert [walk.coords(t) for t in range(walk.num_tiles)] == expected


def _problem(batch, heads=4, head_dim=128):
    spec = masks.MaskSpec(masks.MaskKind.CAUSAL, False, False)
    return Problem(batch=batch, heads=heads, head_dim=head_dim, dtype=torch.bfloat16, mask=spec, window_left=-1,
                   window_right=0, scale_seqlen=1024, rab_heads=0)


def test_sections_full_batches_take_one_pair_on_persistent_kernels():
    p = _problem(32)
    assert launch.bh_per_section(p, 32 * 1024, 1024, persistent=True) == 1
    # One CTA per tile (the hardware hands out tiles as CTAs finish): sections sized by L2.
    per_pair = 2 * 128 * 2 * 1024  # K and V (or Q and dO) of one sequence, bf16
    assert launch.bh_per_section(p, 32 * 1024, 1024, persistent=False) == launch.L2_SECTION_BYTES // per_pair


def test_sections_jagged_batches_fit_l2():
    p = _problem(128)
    tokens = 128 * 1000  # an average sequence of 1000 tokens under max_seqlen 2048
    per_pair = 2 * 128 * 2 * 1000
    assert launch.bh_per_section(p, tokens, 2048, persistent=True) == launch.L2_SECTION_BYTES // per_pair
    # Never more than every pair, never fewer than one.
    assert launch.bh_per_section(_problem(1, heads=1), 5, 2048, persistent=True) == 1
    assert launch.bh_per_section(p, 128 * 10**7, 10**8, persistent=True) == 1


def test_sections_of_claiming_kernels_stay_within_their_bounds():
    """Kernels that claim their tiles take L2-sized sections on full batches too, never fewer than
    CLAIM_MIN_PAIRS pairs nor more than CLAIM_MAX_PAIRS (nor more than every pair)."""
    p = _problem(8)  # B8 N4096: the L2 rule alone gives 4 pairs
    assert launch.L2_SECTION_BYTES // (2 * 128 * 2 * 4096) < launch.CLAIM_MIN_PAIRS
    assert launch.bh_per_section(p, 8 * 4096, 4096, persistent=True, dynamic=True) == launch.CLAIM_MIN_PAIRS
    p = _problem(1024)  # B1024 N256: 64 pairs fit the L2 budget
    assert launch.bh_per_section(p, 1024 * 256, 256, persistent=True, dynamic=True) == 64
    assert launch.bh_per_section(_problem(2, heads=2), 2 * 4096, 4096, persistent=True, dynamic=True) == 4
    p = _problem(4096)  # short jagged: 128 tokens on average, the L2 rule alone gives 128 pairs
    assert launch.bh_per_section(p, 4096 * 128, 256, persistent=True, dynamic=True) == launch.CLAIM_MAX_PAIRS
    assert launch.bh_per_section(p, 4096 * 128, 256, persistent=True) == 128


def test_claims_are_the_hopper_forward_default():
    """The shipped Hopper forward keys claim their tiles; the launcher hands them a counter."""
    from hstu_cute import kernel_args, variants

    keys = variants.shipped_hopper_fwd_keys("sm_90a")
    assert keys and all(k.dynamic_tiles and k.persistent for k in keys)
    assert all("mTileCounter" in kernel_args.slots(k) for k in keys)


def test_forward_consumers_take_published_sequences():
    """Every claiming Hopper forward but the paged one has its producer publish each tile's
    sequence words (the consumers then skip the offsets' global loads), and the words are the
    ones SequenceInfo writes."""
    from hstu_cute import compile as compile_mod, variants
    from hstu_cute.common.seqinfo import SEQ_WORDS, SequenceInfo

    keys = variants.shipped_hopper_fwd_keys("sm_90a") + variants.shipped_hopper_fp8_fwd_keys("sm_90a")
    kernels = [compile_mod.kernel_for(k) for k in keys if k.kernel_name in ("hopper_fwd", "hopper_fwd_paged",
                                                                            "hopper_fwd_fp8")]
    assert kernels and all(kr.publishes_seq == (not kr.paged) for kr in kernels)
    seq = masks.SeqMask(seqlen_q=5, seqlen_k=7, num_context=2, history_end=6)
    words = SequenceInfo(masks.MaskSpec(masks.MaskKind.CAUSAL), None, None, 64, 64).to_words(11, 13, seq)
    assert words == (11, 13, 5, 7, 2, 6) and len(words) == SEQ_WORDS


def test_forward_output_goes_through_the_staged_epilogue():
    """The Hopper forward stores its output through smem and a TMA store wherever a 64-column
    block layout exists (head dims 64k) and the tile is not a split-key part; the key field turns
    it off and says so in the description."""
    from hstu_cute import compile as compile_mod, variants

    keys = [k for k in variants.shipped_hopper_fwd_keys("sm_90a") + variants.shipped_hopper_fp8_fwd_keys("sm_90a")
            if k.kernel_name in ("hopper_fwd", "hopper_fwd_paged", "hopper_fwd_fp8")]
    for k in keys:
        kr = compile_mod.kernel_for(k)
        assert kr.staged == (k.head_dim % 64 == 0 and not k.split_keys), k.describe()
    on = next(k for k in keys if k.head_dim == 128 and not k.split_keys)
    off = dataclasses.replace(on, staged_epilogue=False)
    tiles_on, tiles_off = on.describe().split()[4], off.describe().split()[4]
    assert not compile_mod.kernel_for(off).staged and tiles_off == tiles_on + "r"


def test_sections_of_block_sparse_walks_fit_l2_without_the_claim_floor():
    """Block-sparse tiles read their kept key blocks out of step with each other, so a claiming
    kernel's section holds only the pairs whose K and V fit the L2 budget (one at B8 N16384)."""
    p = _problem(8, heads=32)
    per_pair = 2 * 128 * 2 * 16384
    assert launch.L2_SECTION_BYTES // per_pair == 1
    assert launch.bh_per_section(p, 8 * 16384, 16384, persistent=True, dynamic=True) == launch.CLAIM_MIN_PAIRS
    assert launch.bh_per_section(p, 8 * 16384, 16384, persistent=True, dynamic=True, block_sparse=True) == 1
    p = _problem(8, heads=32)  # N4096: four pairs fit
    assert launch.bh_per_section(p, 8 * 4096, 4096, persistent=True, dynamic=True, block_sparse=True) == 4
    # A sequence longer than the budget still takes one pair per section.
    assert launch.bh_per_section(_problem(1), 65536, 65536, persistent=True, dynamic=True, block_sparse=True) == 1
