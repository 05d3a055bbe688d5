"""Block-sparse HSTU on the GPU (hstu_cute.BlockMask; docs/dev/block-sparse.md): the 16-bit
forward on both kernel paths and the fused Hopper backward against the oracle under the ratio rule (2x), over every constructor, block sizes 16 / 32 /
64 / 128 and 64 x 128, densities 0 / one block / ~10% / ~50% / 100%, edge lengths, every HSTU mask,
rab, delta_q and seqused; at 100% the result equals the dense call. Outputs are poisoned; list
entries past each count hold garbage."""

from __future__ import annotations

import zlib

import pytest
import torch

from hstu_cute import BlockMask, hstu_attn_varlen_func, reference
from hstu_cute.block_mask import blocks_for
from hstu_cute.testing import check_against_oracle, gaussian_jagged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _batch(lengths_q, lengths_k, heads, head_dim, dtype, gen, rab_heads=None, seqused=False):
    return gaussian_jagged_batch(lengths_q, lengths_k, heads, head_dim, dtype, gen, rab_heads=rab_heads,
                                 seqused=seqused)


def _dense_blocks(batch, heads_mask, rows, keys, q_block, k_block, density, gen):
    shape = (batch, heads_mask, blocks_for(rows, q_block), blocks_for(keys, k_block))
    if density == "one":
        dense = torch.zeros(shape, dtype=torch.bool)
        dense[..., -1, 0] = True
        return dense
    return torch.rand(shape, generator=gen) < density


def _with_garbage(bm: BlockMask, gen) -> BlockMask:
    """The same mask with every list entry past its count overwritten by garbage."""
    index = bm.kv_index.clone()
    past = torch.arange(index.shape[-1], device=index.device) >= bm.kv_count[..., None].long()
    garbage = torch.randint(-(1 << 20), 1 << 20, index.shape, generator=gen, dtype=torch.int32).to(index.device)
    return BlockMask(bm.kv_count, torch.where(past, garbage, index), bm.q_block, bm.k_block)


def _check(b, bm, seed, **kw):
    out = torch.full(b["q"].shape, float("nan"), dtype=b["q"].dtype, device="cuda")
    del out  # poison the allocator's block that the call's output takes
    with torch.no_grad():
        out = hstu_attn_varlen_func(**b, block_mask=bm, **kw)
    ref32 = reference.hstu_attn_reference(**b, block_mask=bm, **kw)
    ref_same = reference.hstu_attn_reference(**b, block_mask=bm, compute_dtype=None, **kw)
    ok, err, ref_err = reference.ratio_check(out, ref32, ref_same, 2.0)
    assert ok, f"[seed={seed}] out: kernel err {err:.3e} > 2 x {ref_err:.3e}"
    return out


CASES = [
    # (lengths_q, lengths_k, blocks, density, mask kwargs, heads_mask, rab_heads, seqused, dtype, head_dim)
    ([0, 1, 17, 1111], [0, 1, 17, 1111], (128, 128), 0.1, dict(window_size=(-1, 0)), 1, None, False,
     torch.bfloat16, 128),
    ([256, 300, 64], [256, 300, 64], (64, 128), 0.5, dict(), 2, None, False, torch.float16, 64),
    ([513, 200], [513, 200], (16, 16), 0.5, dict(window_size=(-1, 0)), 2, 1, False, torch.bfloat16, 128),
    ([700, 33], [700, 33], (32, 64), 0.1, dict(window_size=(64, 32)), 1, 2, True, torch.bfloat16, 256),
    ([40, 300], [333, 300], (32, 32), 0.5, dict(window_size=(-1, 0)), 1, None, False, torch.bfloat16, 128),
    ([400, 129], [400, 129], (128, 64), "one", dict(window_size=(-1, 0), num_contexts=[3, 0],
                                                    num_targets=[20, 5], target_group_size=4), 1, None, False,
     torch.bfloat16, 32),
    ([300, 17], [300, 17], (64, 64), 0.0, dict(window_size=(-1, 0)), 1, None, False, torch.bfloat16, 128),
    ([0, 17, 600], [0, 17, 600], (64, 128), 0.3, dict(window_size=(-1, 0)), 2, 1, False, torch.bfloat16, 96),
    ([513, 129], [513, 129], (128, 64), 0.5, dict(), 1, None, True, torch.float16, 192),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_block_sparse_forward_matches_oracle(path, case):
    lengths_q, lengths_k, (qb, kb), density, mask_kw, heads_mask, rab_heads, seqused, dtype, head_dim = CASES[case]
    seed = _seed(case)
    gen = torch.Generator().manual_seed(seed)
    heads = 2
    b = _batch(lengths_q, lengths_k, heads, head_dim, dtype, gen, rab_heads, seqused)
    mask_kw = dict(mask_kw)
    for name in ("num_contexts", "num_targets"):
        if name in mask_kw:
            mask_kw[name] = torch.tensor(mask_kw[name], dtype=torch.int32, device="cuda")
    n = max(lengths_k)
    dense = _dense_blocks(len(lengths_k), heads_mask, n, n, qb, kb, density, gen).cuda()
    bm = _with_garbage(BlockMask.from_dense(dense, qb, kb), gen)
    out = _check(b, bm, seed, **mask_kw)
    if density == 0.0:
        assert not out.any()


@pytest.mark.parametrize("q_block,k_block", [(128, 128), (64, 128), (32, 16)])
def test_full_density_equals_the_dense_call(path, q_block, k_block):
    gen = torch.Generator().manual_seed(q_block + k_block)
    b = _batch([1111, 17, 300], [1111, 17, 300], 2, 128, torch.bfloat16, gen)
    n = 1111
    bm = BlockMask.from_dense(torch.ones(3, 1, blocks_for(n, q_block), blocks_for(n, k_block), dtype=torch.bool,
                                         device="cuda"), q_block, k_block)
    with torch.no_grad():
        dense = hstu_attn_varlen_func(**b, window_size=(-1, 0))
        sparse = hstu_attn_varlen_func(**b, window_size=(-1, 0), block_mask=bm)
    ref32 = reference.hstu_attn_reference(**b, window_size=(-1, 0))
    ref_same = reference.hstu_attn_reference(**b, window_size=(-1, 0), compute_dtype=None)
    ok, err, ref_err = reference.ratio_check(sparse, ref32, ref_same, 2.0)
    assert ok, f"kernel err {err:.3e} > 2 x {ref_err:.3e}"
    assert torch.allclose(sparse.float(), dense.float(), atol=2e-2, rtol=2e-2)


def test_every_constructor_on_the_device(path):
    """from_topk, from_jagged_dense, from_lists and from_flex give masks the kernel runs as the
    oracle says (from_dense: the cases above)."""
    gen = torch.Generator().manual_seed(11)
    lengths = [256, 100, 384]
    b = _batch(lengths, lengths, 2, 64, torch.bfloat16, gen)
    qb = kb = 64
    mq = mk = blocks_for(384, 64)
    top = torch.randint(-1, mk, (3, 2, mq, 3), generator=gen).cuda()
    masks_ = [BlockMask.from_topk(top, qb, kb, mk)]
    nq = [blocks_for(n, qb) for n in lengths]
    jagged = (torch.rand(1, sum(nq), sum(nq), generator=gen) < 0.4).cuda()
    masks_.append(BlockMask.from_jagged_dense(jagged, b["seq_offsets_q"], b["seq_offsets_k"], qb, kb, 384))
    dense = (torch.rand(3, 1, mq, mk, generator=gen) < 0.3).cuda()
    ref = BlockMask.from_dense(dense, qb, kb)
    masks_.append(BlockMask.from_lists(ref.kv_count.long(), ref.kv_index.long(), qb, kb))
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        def band(bb, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < 130)

        masks_.append(BlockMask.from_flex(create_block_mask(band, 3, 1, 384, 384, device="cuda", BLOCK_SIZE=64)))
    except ImportError:
        pass
    for i, bm in enumerate(masks_):
        _check(b, bm, i, window_size=(-1, 0))


BWD_CASES = [
    # (lengths, blocks, density, mask kwargs, heads_mask, seqused, head_dim, extra: rab heads / flags)
    ([0, 1, 17, 1111], (128, 128), 0.3, dict(window_size=(-1, 0)), 1, False, 128, {}),
    ([513, 200, 64], (64, 128), 0.5, dict(), 2, False, 128, {}),
    ([700, 333], (16, 32), 0.5, dict(window_size=(-1, 0)), 1, True, 64, {}),
    ([2500, 90], (128, 128), 0.1, dict(window_size=(-1, 0), num_targets=[30, 7]), 2, False, 128,
     dict(deterministic=True)),
    ([300, 17], (64, 64), 0.0, dict(window_size=(-1, 0)), 1, False, 128, {}),
    ([400, 129], (32, 64), 0.5, dict(window_size=(-1, 0)), 1, False, 256, dict(rab_heads=1, has_drab=True)),
    ([333, 64], (64, 32), 0.5, dict(window_size=(40, 8)), 2, False, 32, dict(rab_heads=2, has_drab=True)),
    ([700, 1], (64, 128), 0.3, dict(window_size=(-1, 0)), 2, False, 96, {}),
    ([513, 200], (128, 128), 0.5, dict(window_size=(-1, 0), num_targets=[30, 7]), 1, False, 192,
     dict(rab_heads=1, has_drab=True)),
]


@pytest.mark.parametrize("case", range(len(BWD_CASES)), ids=[f"case{i}" for i in range(len(BWD_CASES))])
def test_block_sparse_backward_matches_oracle(path, case):
    """The backward against the oracle's gradients (ratio rule, 5x): the fused Hopper kernel at D128
    without drab, the sm80 pair elsewhere (deterministic, drab, other head dims, the sm80 path)."""
    lengths, (qb, kb), density, mask_kw, heads_mask, seqused, head_dim, extra = BWD_CASES[case]
    extra = dict(extra)
    rab_heads = extra.pop("rab_heads", None)
    seed = _seed("bwd", case)
    gen = torch.Generator().manual_seed(seed)
    b = _batch(lengths, lengths, 2, head_dim, torch.bfloat16, gen, rab_heads=rab_heads, seqused=seqused)
    mask_kw = {n: (torch.tensor(x, dtype=torch.int32, device="cuda") if n.startswith("num_") else x)
               for n, x in mask_kw.items()}
    n = max(lengths)
    dense = _dense_blocks(len(lengths), heads_mask, n, n, qb, kb, density, gen).cuda()
    bm = _with_garbage(BlockMask.from_dense(dense, qb, kb), gen)
    leaves = check_against_oracle(dict(b, **mask_kw), seed, block_mask=bm, **extra)
    if density == 0.0:
        assert not any(leaves[name].grad.any() for name in ("q", "k", "v"))


def test_per_head_mask_with_drab_summed_over_heads_is_refused():
    gen = torch.Generator().manual_seed(3)
    b = _batch([64], [64], 2, 64, torch.bfloat16, gen, rab_heads=1)
    b["q"].requires_grad_()
    b["rab"].requires_grad_()
    bm = BlockMask.from_dense(torch.ones(1, 2, 1, 1, dtype=torch.bool, device="cuda"), 64, 64)
    out = hstu_attn_varlen_func(**b, block_mask=bm, has_drab=True)
    with pytest.raises(NotImplementedError, match="one mask per head with drab summed over the heads"):
        out.sum().backward()
