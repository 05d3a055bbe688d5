"""A causal band with contexts and targets (docs/operator.md, "Local window with contexts and
targets") on the GPU: forward and backward on both kernel paths against the oracle (ratio rule: 2x
for the output, 5x for gradients), with edge lengths (0, 1, 17, 1111), bands of 0, 1, 17, 300
and wider than some sequences, contexts alone, targets alone, both, target groups, rab with drab,
delta_q and seqused; the paged KV cache (FBGEMM's meaning) against the oracle on the whole
sequences; the generative-recommenders drop-in with max_attn_len, contexts and targets against its
oracle. Outputs are poisoned by check_against_oracle."""

from __future__ import annotations

import zlib

import pytest
import torch

from hstu_cute import hstu_attn_varlen_func, reference
from hstu_cute.testing import check_against_oracle, random_jagged_batch, random_paged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = [
    # (lengths, window left, contexts, targets, group, head dim, dtype, rab heads, delta_q, seqused)
    ([0, 1, 17, 1111], 17, [0, 0, 5, 33], [0, 1, 7, 64], 1, 128, torch.bfloat16, None, False, False),
    ([300, 129, 700], 300, [3, 0, 20], None, 1, 64, torch.float16, 1, False, True),
    ([256, 2000, 40], 1, None, [60, 100, 40], 11, 128, torch.bfloat16, 2, False, False),
    ([1111, 64, 513], 0, [100, 0, 7], [11, 64, 0], 3, 256, torch.bfloat16, None, False, False),
    ([900, 33], 64, [16, 2], [32, 8], 1, 32, torch.float16, None, True, False),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_causal_band_with_contexts_and_targets(path, case):
    lengths, window, contexts, targets, group, head_dim, dtype, rab_heads, delta_q, seqused = CASES[case]
    seed = zlib.crc32(repr(("semi-local", case)).encode())
    max_k = max(lengths)
    lengths_q = [max(n // 3, min(n, 1)) for n in lengths] if delta_q else None
    b = random_jagged_batch(len(lengths), 2, head_dim, max(lengths_q) if delta_q else max_k, max_k, device="cuda",
                            dtype=dtype, seed=seed, lengths=lengths, lengths_q=lengths_q, is_delta_q=delta_q,
                            window_size=(window, 0), num_contexts=contexts, num_targets=targets,
                            target_group_size=group, rab_heads=rab_heads, alpha=0.5, seqused=seqused)
    check_against_oracle(b, seed, has_drab=rab_heads is not None)


def test_generative_recommenders_window_with_contexts_and_targets(path):
    """That library's max_attn_len with contextual_seq_len and num_targets through the drop-in, on
    the kernels, against its oracle (bf16: the ratio rule against that library's own rounding)."""
    from hstu_cute import reference
    from hstu_cute.integrations.generative_recommenders import hstu_mha, reference_hstu_mha

    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([300, 17, 129, 256])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).cuda()
    q, k, v = ((torch.rand(int(lengths.sum()), 2, 64, generator=gen) * 2 - 1).to(torch.bfloat16).cuda()
               for _ in range(3))
    kw = dict(num_targets=torch.tensor([20, 3, 0, 64]).cuda(), max_attn_len=40, contextual_seq_len=5)
    out = hstu_mha(300, 0.3, q, k, v, offsets, **kw)
    fp32 = reference_hstu_mha(300, 0.3, q, k, v, offsets, **kw)
    theirs = reference_hstu_mha(300, 0.3, q, k, v, offsets, **kw, compute_dtype=None)
    ok, err, ref_err = reference.ratio_check(out, fp32, theirs, 2.0)
    assert ok, (err, ref_err)


@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_cache_with_a_causal_band(path, page_size):
    """Serving with a causal band over contexts and targets: the new history and the targets attend
    the cached keys inside their bands (the band reaching the contexts, a target's band ending at
    the history's end), against the oracle on the whole sequences; NaN in every unused cache row."""
    cached, new = [0, 17, 1111, 300, 64], [5, 40, 256, 1, 64]
    whole = [c + n for c, n in zip(cached, new)]
    targets = [min(n, t) for n, t in zip(new, [2, 8, 64, 1, 16])]
    contexts = [min(w - t, 9) for w, t in zip(whole, targets)]
    paged, dense = random_paged_batch(cached, new, 2, 128, page_size, dtype=torch.bfloat16, device="cuda", alpha=0.5,
                                      num_contexts=contexts, num_targets=targets, window_size=(100, 0),
                                      rab_heads=1, seed=page_size)
    with torch.no_grad():
        out = hstu_attn_varlen_func(**paged)
    ref32 = reference.hstu_attn_reference(**dense, compute_dtype=torch.float32)
    ref_same = reference.hstu_attn_reference(**dense, compute_dtype=None)
    ok, err, ref_err = reference.ratio_check(out, ref32, ref_same, 2.0)
    assert ok, f"kernel err {err:.3e} vs same-dtype oracle err {ref_err:.3e}"


@pytest.mark.parametrize("mode", [2, 1])
def test_fp8_with_a_causal_band(mode):
    """The FP8 kernels (Hopper) with a causal band over contexts and targets: the forward within 2x
    and the gradients within 5x of the FP8 emulation's error."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FP8 kernels need a compute capability 9.x GPU")
    seed = zlib.crc32(repr(("semi-local fp8", mode)).encode())
    b = random_jagged_batch(4, 2, 128, 700, device="cuda", seed=seed, lengths=[0, 17, 700, 300], alpha=0.5,
                            window_size=(64, 0), num_contexts=[0, 3, 20, 7], num_targets=[0, 5, 40, 9])
    rest = {n: x for n, x in b.items() if n not in ("q", "k", "v") and not n.startswith("_")}
    q, k, v = (b[n].detach().clone().requires_grad_() for n in "qkv")
    out = hstu_attn_varlen_func(q, k, v, **rest, quant_mode=mode)
    dout = (torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)) * 1e-2).to(out.dtype).cuda()
    out.backward(dout)
    args = {n: b[n] for n in ("seq_offsets_q", "seq_offsets_k", "max_seqlen_q", "max_seqlen_k", "num_contexts",
                              "num_targets", "target_group_size", "window_size", "alpha")}
    exact = reference.hstu_attn_reference(b["q"], b["k"], b["v"], **args, compute_dtype=torch.float32)
    emul = reference.hstu_attn_fp8_emulation(b["q"], b["k"], b["v"], **args, quant_mode=mode)
    ok, err, ref_err = reference.ratio_check(out.detach(), exact, emul, 2.0)
    assert ok, f"out: {err:.3e} > 2 x {ref_err:.3e}"
    grads = reference.hstu_attn_fp8_grad_emulation(b["q"], b["k"], b["v"], dout, **args, quant_mode=mode)
    exact_grads = reference.hstu_attn_fp8_grad_emulation(b["q"], b["k"], b["v"], dout, **args, quant_mode=mode,
                                                         quantize_inputs=False, round_products=False)
    for name, got in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        ok, err, ref_err = reference.ratio_check(got, exact_grads[name], grads[name], 5.0)
        assert ok, f"{name}: {err:.3e} > 5 x {ref_err:.3e}"
