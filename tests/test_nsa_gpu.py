"""Sparse HSTU, NSA-style (hstu_cute.nsa), on the GPU: the kernels' operator against the oracle
under the ratio rule (2x for the output, 5x for every gradient: q, k, v and the gates), both
kernel paths, edge lengths (0, 1, 17, 1111, not multiples of any block), top_n past the
available blocks. The oracle takes the kernel run's selected blocks (a near tie in the
importance may pick others in another precision); the selection itself is checked on CPU
(tests/test_nsa.py)."""

from __future__ import annotations

import pytest
import torch

from hstu_cute import nsa, reference
from hstu_cute.nsa import NSAConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = [
    # (lengths, config, head dim)
    ([0, 1, 17, 1111, 700], NSAConfig(cmp_block=32, cmp_stride=16, sel_block=64, top_n=6, window=128), 128),
    ([300, 129, 64], NSAConfig(cmp_block=16, cmp_stride=16, sel_block=32, top_n=40, window=0, num_initial=1,
                               num_local=1), 64),
]


@pytest.mark.parametrize("rows_per_entry", [None, 256], ids=["entries-default", "entries-256"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_nsa_matches_the_oracle(path, case, rows_per_entry, monkeypatch):
    """``rows_per_entry``: the compressed branch's and the initial blocks' calls in entries of that
    many query rows (several per sequence here; the default takes whole sequences this short)."""
    if rows_per_entry is not None:
        monkeypatch.setattr(nsa, "_CMP_ROWS_PER_ENTRY", rows_per_entry)
        monkeypatch.setattr(nsa, "_INITIAL_ROWS_PER_ENTRY", rows_per_entry)
    lengths, cfg, dim = CASES[case]
    gen = torch.Generator().manual_seed(40 + case)
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    t, heads = sum(lengths), 2
    q, k, v = ((torch.randn(t, heads, dim, generator=gen) * 0.5).to(torch.bfloat16).cuda().requires_grad_()
               for _ in range(3))
    gates = torch.rand(t, heads, 3, generator=gen).to(torch.bfloat16).cuda().requires_grad_()
    max_seqlen = max(lengths)
    out, bm = nsa.hstu_nsa_attn(q, k, v, offsets, max_seqlen, gates, alpha=0.5, cfg=cfg, return_block_mask=True)
    kw = dict(alpha=0.5, cfg=cfg, block_mask=bm)
    ref32, _ = nsa.hstu_nsa_reference(q, k, v, offsets, max_seqlen, gates, compute_dtype=torch.float32, **kw)
    ref_same, _ = nsa.hstu_nsa_reference(q, k, v, offsets, max_seqlen, gates, compute_dtype=torch.bfloat16, **kw)
    ok, err, ref_err = reference.ratio_check(out, ref32, ref_same, 2.0)
    assert ok, f"out: kernel err {err:.3e} > 2 x {ref_err:.3e}"
    dout = torch.randn(out.shape, generator=gen).to(out.dtype).cuda()
    leaves = (q, k, v, gates)
    got = torch.autograd.grad(out, leaves, dout)
    want32 = torch.autograd.grad(ref32, leaves, dout.float())
    want_same = torch.autograd.grad(ref_same, leaves, dout)
    for name, g, w32, ws in zip(("q", "k", "v", "gates"), got, want32, want_same):
        ok, err, ref_err = reference.ratio_check(g, w32, ws, 5.0)
        assert ok, f"d{name}: kernel err {err:.3e} > 5 x {ref_err:.3e}"


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_importance_on_the_kernels(path, case):
    """The importance the CUDA path computes on the attention kernels (tokens as rows, indicator
    values over chunks of D query blocks) against the PyTorch path's (fp32 scores, TF32-exact products: backend
    "reference"). P reaches the GEMM in bf16 and the output is stored in bf16, two roundings of
    relative 2^-9 at most per entry, so 1e-2 relative (plus 1e-3 of the largest entry, for sums
    that cancel) bounds it with room; a wrong token range or indicator column is off by whole
    scores."""
    lengths, cfg, dim = CASES[case]
    gen = torch.Generator().manual_seed(60 + case)
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    t, heads, max_seqlen = sum(lengths), 2, max(lengths)
    q, k, v = ((torch.randn(t, heads, dim, generator=gen) * 0.5).to(torch.bfloat16).cuda() for _ in range(3))
    k_cmp, v_cmp, counts = nsa.compress_kv(k, v, offsets, max_seqlen, cfg)
    kw = dict(alpha=0.5, scaling_seqlen=max_seqlen, cfg=cfg)
    _, got = nsa.compressed_attention(q, k_cmp, v_cmp, counts, offsets, max_seqlen, **kw)
    _, want = nsa.compressed_attention(q, k_cmp, v_cmp, counts, offsets, max_seqlen, backend="reference", **kw)
    assert want.abs().max() > 0
    err = (got - want).abs()
    bound = 1e-2 * want.abs() + 1e-3 * want.abs().max()
    assert bool((err <= bound).all()), f"importance: max error {err.max():.3e}, worst ratio {(err / bound).max():.2f}"
