"""Sparse HSTU, NSA-style (hstu_cute.nsa) on CPU: the composed operator (the selected and window
branches through hstu_cute.nn's reference path) against the oracle written from the definitions,
output and every gradient (q, k, v, the gates) in float64; the importance; the selection rule
against a brute force; configurations and bad input."""

from __future__ import annotations

import pytest
import torch

from hstu_cute import nsa
from hstu_cute.nsa import NSAConfig


def _batch(lengths, heads=2, dim=16, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    t = sum(lengths)
    q, k, v = (torch.randn(t, heads, dim, generator=gen, dtype=dtype).requires_grad_() for _ in range(3))
    gates = torch.rand(t, heads, 3, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v, offsets, gates


@pytest.fixture
def fp64_kernels(monkeypatch):
    """The attention kernels replaced by the fp64 oracle, which reads the same arguments (func
    masks included): what the CUDA path hands the kernels, checked on CPU."""
    import hstu_cute.api
    from hstu_cute import reference

    def oracle(q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, **kw):
        return reference.hstu_attn_reference(q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, **kw,
                                             compute_dtype=torch.float64)

    monkeypatch.setattr(hstu_cute.api, "hstu_attn_varlen_func", oracle)


CONFIGS = {
    "small": NSAConfig(cmp_block=32, cmp_stride=16, sel_block=32, top_n=4, window=48, num_initial=1, num_local=1),
    "seed-like": NSAConfig(cmp_block=16, cmp_stride=16, sel_block=16, top_n=3, window=0, num_initial=1,
                           num_local=1),
    "top_n past the blocks": NSAConfig(cmp_block=16, cmp_stride=8, sel_block=64, top_n=40, window=100,
                                       num_initial=2, num_local=2),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_output_and_gradients_match_the_oracle(name):
    cfg = CONFIGS[name]
    lengths = [0, 1, 17, 300, 129] if name != "seed-like" else [1111, 5, 0]
    max_seqlen = max(lengths)
    q, k, v, offsets, gates = _batch(lengths, seed=len(name))
    out, bm = nsa.hstu_nsa_attn(q, k, v, offsets, max_seqlen, gates, alpha=0.3, cfg=cfg, return_block_mask=True)
    ref, _ = nsa.hstu_nsa_reference(q, k, v, offsets, max_seqlen, gates, alpha=0.3, cfg=cfg, block_mask=bm,
                                    compute_dtype=torch.float64)
    assert torch.allclose(out, ref, rtol=1e-9, atol=1e-11), (out - ref).abs().max()
    dout = torch.randn_like(out)
    leaves = (q, k, v, gates)
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ref, leaves, dout)
    for n, a, b in zip(("q", "k", "v", "gates"), got, want):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-11), (n, (a - b).abs().max())
    # The oracle's own selection (sorting) picks the same blocks where importance has no ties.
    ref_own, _ = nsa.hstu_nsa_reference(q, k, v, offsets, max_seqlen, gates, alpha=0.3, cfg=cfg,
                                        compute_dtype=torch.float64)
    assert torch.allclose(out, ref_own, rtol=1e-9, atol=1e-11)


def test_importance_matches_the_oracle_and_chunks_do_not_matter():
    cfg = CONFIGS["small"]
    lengths = [300, 17, 129]
    q, k, v, offsets, gates = _batch(lengths, seed=3)
    k_cmp, v_cmp, counts = nsa.compress_kv(k, v, offsets, 300, cfg)
    assert counts.tolist() == [(300 - 32) // 16 + 1, 0, (129 - 32) // 16 + 1]
    assert torch.allclose(k_cmp[0, 2], k[32:64].mean(0).detach().to(k_cmp.dtype))
    _, want = nsa.hstu_nsa_reference(q, k, v, offsets, 300, gates, alpha=0.3, cfg=cfg, compute_dtype=torch.float64)
    outs = []
    for chunk in (7, 64, 4096):
        o, imp = nsa.compressed_attention(q, k_cmp, v_cmp, counts, offsets, 300, alpha=0.3, scaling_seqlen=300,
                                          cfg=cfg, rows_per_chunk=chunk)
        assert torch.allclose(imp, want, rtol=1e-5, atol=1e-7)
        outs.append(o)
    assert torch.allclose(outs[0], outs[2]) and torch.allclose(outs[1], outs[2])


@pytest.mark.parametrize("rows_per_entry", [nsa._CMP_ROWS_PER_ENTRY, 64, 100])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compressed_output_through_a_func_mask_equals_the_chunked_one(name, rows_per_entry, fp64_kernels):
    """What the CUDA path hands the kernels (each sequence's rows in entries of ``rows_per_entry``,
    each entry with a copy of the sequence's compressed tokens as keys, a func bound per query row)
    computes the chunked branch: here with the kernels replaced by the fp64 oracle, which reads the
    same func mask; gradients reach q, k_cmp and v_cmp alike (the copies' gradients add up)."""
    cfg = CONFIGS[name]
    lengths = [300, 17, 0, 129, 31, 32]
    q, k, v, offsets, _ = _batch(lengths, seed=5)
    k_cmp, v_cmp, counts = nsa.compress_kv(k, v, offsets, 300, cfg)
    want, _ = nsa.compressed_attention(q, k_cmp, v_cmp, counts, offsets, 300, alpha=0.3, scaling_seqlen=300, cfg=cfg)
    batch, pos = nsa._token_positions(offsets, q.shape[0])
    got = nsa._compressed_output_on_kernels(q, k_cmp, v_cmp, counts, offsets, 300, batch, pos, 0.3, 300, cfg,
                                            rows_per_entry)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(6), dtype=want.dtype)
    got_grads = torch.autograd.grad(got, (q, k, v), dout, retain_graph=True)
    for g, w in zip(got_grads, torch.autograd.grad(want, (q, k, v), dout)):
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rows_per_entry", [nsa._INITIAL_ROWS_PER_ENTRY, 64, 100])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_initial_blocks_apart_add_up_to_the_selected_branch(name, rows_per_entry, fp64_kernels):
    """Where the CUDA path runs the selected branch's forced initial blocks as their own call
    (entries of query rows, each with a copy of its sequence's first keys, a func prefix per row)
    and the other selected blocks block-sparse, the two add up to the branch over the whole
    selection: output and gradients of q, k and v, with the kernels replaced by the fp64 oracle."""
    from hstu_cute.block_mask import BlockMask
    from hstu_cute.nn import CAUSAL, hstu_attention

    cfg = CONFIGS[name]
    lengths = [300, 17, 0, 129, 31, 32, 1]
    q, k, v, offsets, _ = _batch(lengths, seed=7)
    m = -(-300 // cfg.sel_block)
    importance = torch.rand((len(lengths), q.shape[1], m, m), generator=torch.Generator().manual_seed(8),
                            dtype=torch.float64)
    indices = nsa._selected_indices(importance, offsets, cfg)
    kw = dict(window_size=CAUSAL, alpha=0.3, scaling_seqlen=300, backend="reference")
    want = hstu_attention(q, k, v, offsets, 300, block_mask=BlockMask.from_topk(indices, cfg.sel_block, cfg.sel_block,
                                                                               m), **kw)
    assert cfg.top_n >= cfg.num_initial + cfg.num_local  # the configurations where the CUDA path splits
    rest = BlockMask.from_topk(torch.where(indices < cfg.num_initial, -1, indices), cfg.sel_block, cfg.sel_block, m)
    got = (hstu_attention(q, k, v, offsets, 300, block_mask=rest, **kw)
           + nsa._initial_blocks_on_kernels(q, k, v, offsets, 300, 0.3, 300, cfg, rows_per_entry))
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    assert float((want - hstu_attention(q, k, v, offsets, 300, block_mask=rest, **kw)).detach().abs().max()) > 1e-3
    dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(9), dtype=want.dtype)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), dout, retain_graph=True),
                    torch.autograd.grad(want, (q, k, v), dout)):
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_importance_through_indicator_values_equals_the_chunked_one(name, fp64_kernels):
    """What the CUDA path hands the kernels for the importance (the tokens as rows, q's rows as
    keys in chunks of ``D`` query blocks, a func interval per token, indicator values) computes
    the chunked branch's importance: here with the kernels replaced by the fp64 oracle, which
    reads the same func mask. Several chunks of query blocks (head dim 16, up to 70 blocks)."""
    cfg = CONFIGS[name]
    lengths = [1111, 17, 0, 129, 31, 32, 300]
    q, k, v, offsets, _ = _batch(lengths, seed=7)
    k_cmp, v_cmp, counts = nsa.compress_kv(k, v, offsets, 1111, cfg)
    _, want = nsa.compressed_attention(q, k_cmp, v_cmp, counts, offsets, 1111, alpha=0.3, scaling_seqlen=900, cfg=cfg)
    batch, pos = nsa._token_positions(offsets, q.shape[0])
    got = nsa._importance_on_kernels(q, k_cmp, counts, offsets, 1111, batch, pos, 0.3, 900, cfg)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert want.abs().max() > 0
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (got - want).abs().max()


@pytest.mark.parametrize("cmp_block,cmp_stride", [(32, 16), (16, 16), (48, 16), (24, 16), (40, 32)])
def test_compressed_tokens_are_the_windows_means(cmp_block, cmp_stride):
    """compress_kv against each window's mean, read directly, with gradients: windows of whole
    runs of the stride (summed run by run) and the others (unfold), in bf16 (the means rounded
    once) and fp64; sequences of 0, 1, one window, and lengths no window count divides."""
    cfg = NSAConfig(cmp_block=cmp_block, cmp_stride=cmp_stride, sel_block=64, top_n=4, window=0, num_initial=1,
                    num_local=1)
    lengths = [0, 1, cmp_block, 131, 300]
    for dtype in (torch.float64, torch.bfloat16):
        q, k, v, offsets, _ = _batch(lengths, seed=3, dtype=dtype)
        k_cmp, v_cmp, counts = nsa.compress_kv(k, v, offsets, 300, cfg)
        assert k_cmp.dtype == dtype and k_cmp.shape[1] == (300 - cmp_block) // cmp_stride + 1
        for b, n in enumerate(lengths):
            lo = int(offsets[b])
            want = [(c * cmp_stride, c * cmp_stride + cmp_block) for c in range(int(counts[b]))]
            assert int(counts[b]) == (max(n - cmp_block, -cmp_stride) // cmp_stride + 1 if n >= cmp_block else 0)
            for c, (a, e) in enumerate(want):
                for got, x in ((k_cmp, k), (v_cmp, v)):
                    ref = x[lo + a:lo + e].double().mean(0)
                    tol = 1e-12 if dtype == torch.float64 else 2 ** -8 * ref.abs().max().item()
                    assert (got[b, c].double() - ref).abs().max() <= tol, (b, c)
            assert not k_cmp[b, int(counts[b]):].any() and not v_cmp[b, int(counts[b]):].any()
        # The gradient of a sum over the tokens: each key row gets 1 / cmp_block per window holding it.
        (k_cmp.double().sum() + 2 * v_cmp.double().sum()).backward()
        for b, n in enumerate(lengths):
            lo = int(offsets[b])
            for r in range(n):
                hits = sum(1 for c in range(int(counts[b])) if c * cmp_stride <= r < c * cmp_stride + cmp_block)
                want_grad = hits / cmp_block
                assert abs(float(k.grad[lo + r, 0, 0]) - want_grad) <= 1e-3 * max(want_grad, 1), (b, r)
                assert abs(float(v.grad[lo + r, 1, 3]) - 2 * want_grad) <= 2e-3 * max(want_grad, 1), (b, r)


def test_selection_rule_against_a_brute_force():
    cfg = NSAConfig(cmp_block=16, cmp_stride=16, sel_block=16, top_n=5, window=0, num_initial=1, num_local=2)
    lengths = [160, 33, 0, 16]
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    m = 10
    importance = torch.rand(4, 3, m, m, generator=torch.Generator().manual_seed(5))
    dense = nsa.select_blocks(importance, offsets, cfg).to_dense()
    for b, length in enumerate(lengths):
        nblocks = -(-length // 16)
        for h in range(3):
            for qb in range(m):
                want = set()
                if qb < nblocks:
                    forced = [kb for kb in range(qb + 1) if kb < cfg.num_initial or kb > qb - cfg.num_local]
                    rest = sorted((kb for kb in range(qb + 1) if kb not in forced),
                                  key=lambda kb: -float(importance[b, h, qb, kb]))
                    want = set((forced + rest)[:cfg.top_n])
                got = set(torch.nonzero(dense[b, h, qb]).flatten().tolist())
                assert got == want, (b, h, qb, got, want)


def test_bad_input_and_configs_name_the_field():
    q, k, v, offsets, gates = _batch([40])
    with pytest.raises(ValueError, match="gates"):
        nsa.hstu_nsa_attn(q, k, v, offsets, 40, gates[..., :2])
    with pytest.raises(ValueError, match="max_seqlen"):
        nsa.hstu_nsa_attn(q, k, v, offsets, 0, gates)
    with pytest.raises(ValueError, match="sel_block"):
        NSAConfig(sel_block=24)
    with pytest.raises(ValueError, match="cmp_stride"):
        NSAConfig(cmp_block=16, cmp_stride=32)
    with pytest.raises(ValueError, match="top_n"):
        NSAConfig(top_n=2, num_initial=2, num_local=2)
    with pytest.raises(ValueError, match="window"):
        NSAConfig(window=-1)


def test_the_named_configurations_hold():
    assert (nsa.PAPER.cmp_block, nsa.PAPER.cmp_stride, nsa.PAPER.sel_block, nsa.PAPER.top_n, nsa.PAPER.window) == (
        32, 16, 64, 16, 512)
    assert (nsa.SEED.cmp_block, nsa.SEED.sel_block, nsa.SEED.top_n) == (32, 32, 4)


def test_sparse_block_matches_its_reference_with_gradients():
    """HSTUSparseBlock (CPU: the reference path) against hstu_nsa_block_reference in float64, the
    output and the gradients of x and of every parameter (the gate model's included)."""
    cfg = NSAConfig(cmp_block=16, cmp_stride=8, sel_block=16, top_n=4, window=32, num_initial=1, num_local=1)
    torch.manual_seed(0)
    block = nsa.HSTUSparseBlock(32, 2, 16, cfg=cfg, dtype=torch.float64)
    offsets = torch.tensor([0, 100, 117, 117, 300], dtype=torch.int32)
    x = torch.randn(300, 32, dtype=torch.float64, requires_grad=True)
    out = block(x, offsets, 183)
    ref = nsa.hstu_nsa_block_reference(block, x, offsets, 183)
    assert torch.allclose(out, ref, rtol=1e-9, atol=1e-11)
    leaves = [x, *block.parameters()]
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(ref, leaves, dout)):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-10)
    with pytest.raises(NotImplementedError, match="num_targets"):
        block(x, offsets, 183, num_targets=torch.zeros(4, dtype=torch.int32))


def test_exports_on_fake_tensors():
    """torch.export of the operator on meta tensors (the kernel path traced, nothing launched): the
    selected and the window branches are hstu_cute's forward op; the rest are torch ops."""
    cfg = NSAConfig(cmp_block=32, cmp_stride=16, sel_block=64, top_n=4, window=128)
    q, k, v = (torch.empty(1024, 2, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))
    gates = torch.empty(1024, 2, 3, dtype=torch.bfloat16, device="meta")
    offsets = torch.tensor([0, 512, 1024], dtype=torch.int32, device="meta")

    class Sparse(torch.nn.Module):
        def forward(self, q, k, v, offsets, gates):
            return nsa.hstu_nsa_attn(q, k, v, offsets, 512, gates, alpha=0.5, cfg=cfg, backend="kernel")

    program = torch.export.export(Sparse(), (q, k, v, offsets, gates))
    ops = [str(n.target) for n in program.graph.nodes if "hstu_cute" in str(n.target)]
    assert ops == ["hstu_cute.fwd.default"] * 2, ops
    assert program.module()(q, k, v, offsets, gates).shape == q.shape
