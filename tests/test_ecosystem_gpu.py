"""The ecosystem layer on the GPU kernel (the default kernel path of the device), each against an
fp32 oracle with the spec's ratio rule (docs/operator.md, section 13: error <= 2x the same-dtype
reference's for outputs, 5x for gradients):

* HSTUBlock forward and backward (input, every parameter, a learned rab) against
  ``hstu_block_reference`` in fp32, the same-dtype yardstick being the block in bf16 on the
  PyTorch reference; also a head dim the kernels are not built for (zero-padded);
* generative-recommenders ``hstu_mha`` against the oracle of that library's semantics, over its
  mask grid, the same-dtype yardstick being that library's own bf16 rounding;
* the padded entry against the jagged call, forward and gradients.

Head dim 64, bf16 throughout, so the run compiles few variants.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hstu_cute import nn as hnn
from hstu_cute import reference
from hstu_cute.integrations.generative_recommenders import hstu_mha, reference_hstu_mha
from hstu_cute.padded import hstu_attn_padded, to_jagged, to_padded

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16 = torch.bfloat16
LENGTHS = (160, 3, 0, 97, 1, 128)


def _offsets(lengths, device="cuda"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _grads(fn, leaves: dict, dout):
    out = fn()
    names = list(leaves)
    grads = torch.autograd.grad(out, [leaves[n] for n in names], dout.to(out.dtype))
    return out.detach(), dict(zip(names, grads))


def _block_leaves(block, x, rab):
    leaves = {"x": x}
    if rab is not None:
        leaves["rab"] = rab
    leaves.update(dict(block.named_parameters()))
    return leaves


@pytest.mark.parametrize("head_dim,hidden_dim,with_rab", [(64, 64, False), (64, 64, True), (48, 64, False)],
                         ids=["d64", "d64-rab", "d48-padded"])
def test_block_forward_backward_matches_the_fp32_reference(head_dim, hidden_dim, with_rab):
    torch.manual_seed(0)
    H, d_model, L = 2, 96, max(LENGTHS)
    block = hnn.HSTUBlock(d_model, H, head_dim, hidden_dim, device="cuda", dtype=BF16)
    with torch.no_grad():
        for p in (block.output_norm.weight, block.input_norm.weight):
            p.add_(torch.rand_like(p) * 0.5)
    offsets = _offsets(LENGTHS)
    targets = torch.tensor([7, 1, 0, 20, 0, 5], dtype=torch.int32, device="cuda")
    contexts = torch.tensor([3, 0, 0, 2, 0, 4], dtype=torch.int32, device="cuda")
    gen = torch.Generator().manual_seed(1)
    x0 = (torch.rand(sum(LENGTHS), d_model, generator=gen) * 2 - 1).cuda()
    rab0 = (torch.rand(1, 1, L, L, generator=gen) * 2 - 1).cuda() if with_rab else None
    dout = (torch.rand(sum(LENGTHS), d_model, generator=gen) * 2 - 1).cuda()

    def leaves_for(model, dtype):
        x = x0.to(dtype).requires_grad_(True)
        rab = None if rab0 is None else rab0.to(dtype).requires_grad_(True)
        return x, rab, _block_leaves(model, x, rab)

    def expand(rab):
        return None if rab is None else rab.expand(len(LENGTHS), -1, -1, -1)

    x, rab, leaves = leaves_for(block, BF16)
    ours_out, ours = _grads(lambda: block(x, offsets, L, contexts, targets, expand(rab)), leaves, dout)
    x, rab, leaves = leaves_for(block, BF16)
    same_out, same = _grads(lambda: hnn.hstu_block_reference(block, x, offsets, L, contexts, targets, expand(rab),
                                                             compute_dtype=None), leaves, dout)
    block32 = copy.deepcopy(block).float()  # the same (bf16-representable) weights in fp32
    x, rab, leaves = leaves_for(block32, torch.float32)
    ref_out, ref = _grads(lambda: hnn.hstu_block_reference(block32, x, offsets, L, contexts, targets, expand(rab)),
                          leaves, dout)

    ok, err, ref_err = reference.ratio_check(ours_out, ref_out, same_out, 2.0)
    assert ok, f"block output: kernel error {err:.3e} > 2 x same-dtype error {ref_err:.3e}"
    assert set(ours) == set(ref)
    for name, g32 in ref.items():
        assert torch.isfinite(ours[name]).all(), name
        ok, err, ref_err = reference.ratio_check(ours[name], g32, same[name], 5.0)
        assert ok, f"d{name}: kernel error {err:.3e} > 5 x same-dtype error {ref_err:.3e}"
        assert g32.abs().max() > 0, f"d{name} is zero: the check would be vacuous"


def test_block_fp32_model_runs_the_kernel_in_bf16():
    torch.manual_seed(0)
    block = hnn.HSTUBlock(64, 2, 64, device="cuda")
    x = torch.randn(sum(LENGTHS), 64, device="cuda", requires_grad=True)
    out = block(x, _offsets(LENGTHS), max(LENGTHS))
    out.square().sum().backward()
    ref = hnn.hstu_block_reference(block, x.detach(), _offsets(LENGTHS), max(LENGTHS))
    assert out.dtype == torch.float32 and x.grad is not None and torch.isfinite(x.grad).all()
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()  # bf16 attention inside an fp32 block


GR_CASES = [  # (causal, contextual_seq_len, targets?, max_attn_len)
    (True, 0, False, 0), (True, 0, True, 0), (True, 4, True, 0), (True, 0, False, 50), (False, 0, False, 0),
    (False, 0, False, 33),
]


@pytest.mark.parametrize("case", GR_CASES, ids=[f"causal{c}-ctx{x}-tgt{t}-win{w}" for c, x, t, w in GR_CASES])
def test_hstu_mha_matches_the_library_oracle(case):
    causal, contexts, with_targets, window = case
    lengths = torch.tensor([200, 4, 77, 200, 150, 5])
    gen = torch.Generator().manual_seed(7)
    T, H, D = int(lengths.sum()), 2, 64
    q, k, v = ((torch.rand(T, H, D, generator=gen) * 2 - 1).to(BF16).cuda() for _ in range(3))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).cuda()  # int64, as that library
    targets = (lengths - contexts).clamp(max=9).cuda() if with_targets else None
    kw = dict(causal=causal, num_targets=targets, max_attn_len=window, contextual_seq_len=contexts)
    out = hstu_mha(200, 0.2, q, k, v, offsets, **kw)
    fp32 = reference_hstu_mha(200, 0.2, q, k, v, offsets, **kw)
    theirs = reference_hstu_mha(200, 0.2, q, k, v, offsets, **kw, compute_dtype=None)
    ok, err, ref_err = reference.ratio_check(out, fp32, theirs, 2.0)
    assert ok, f"hstu_mha error {err:.3e} > 2 x that library's bf16 error {ref_err:.3e}"
    assert fp32.abs().max() > 0


def test_hstu_mha_gradients_match_the_library_oracle():
    lengths = torch.tensor([120, 7, 64])
    gen = torch.Generator().manual_seed(8)
    T, H, D = int(lengths.sum()), 2, 64
    base = [(torch.rand(T, H, D, generator=gen) * 2 - 1).to(BF16).cuda() for _ in range(3)]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).cuda()
    targets = torch.tensor([5, 2, 9], device="cuda")
    dout = (torch.rand(T, H, D, generator=gen) * 2 - 1).to(BF16).cuda()
    kw = dict(num_targets=targets, contextual_seq_len=2)

    def grads(fn, dtype):
        leaves = [t.to(dtype).requires_grad_(True) for t in base]
        return torch.autograd.grad(fn(*leaves), leaves, dout.to(dtype))

    ours = grads(lambda q, k, v: hstu_mha(120, 0.3, q, k, v, offsets, **kw), BF16)
    same = grads(lambda q, k, v: reference_hstu_mha(120, 0.3, q, k, v, offsets, **kw, compute_dtype=None), BF16)
    fp32 = grads(lambda q, k, v: reference_hstu_mha(120, 0.3, q, k, v, offsets, **kw), torch.float32)
    for name, o, s, r in zip("qkv", ours, same, fp32):
        ok, err, ref_err = reference.ratio_check(o, r, s, 5.0)
        assert ok, f"d{name}: error {err:.3e} > 5 x that library's bf16 error {ref_err:.3e}"


def test_padded_matches_the_jagged_call_forward_and_backward():
    lengths = [130, 0, 1, 64, 130]
    B, N, H, D = len(lengths), 130, 2, 64
    gen = torch.Generator().manual_seed(9)
    q, k, v = ((torch.rand(B, N, H, D, generator=gen) * 2 - 1).to(BF16).cuda() for _ in range(3))
    for t in (k, v):
        for b, n in enumerate(lengths):
            t[b, n:] = float("nan")  # padding: never read
    targets = torch.tensor([4, 0, 1, 3, 0], dtype=torch.int32, device="cuda")
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = hstu_attn_padded(*leaves, torch.tensor(lengths, device="cuda"), num_targets=targets, alpha=0.5)
    dout = (torch.rand(B, N, H, D, generator=gen) * 2 - 1).to(BF16).cuda()
    out.backward(dout)

    jagged_leaves = [to_jagged(t, lengths)[0].detach().clone().requires_grad_(True) for t in (q, k, v)]
    offsets = to_jagged(q, lengths)[1]
    jagged = hnn.hstu_attention(*jagged_leaves, offsets, N, num_targets=targets, alpha=0.5)
    jagged.backward(to_jagged(dout, lengths)[0])
    fp32 = hnn.hstu_attention_reference(*(t.detach() for t in jagged_leaves), offsets, N, num_targets=targets,
                                        alpha=0.5)
    same = hnn.hstu_attention_reference(*(t.detach() for t in jagged_leaves), offsets, N, num_targets=targets,
                                        alpha=0.5, compute_dtype=None)
    ok, err, ref_err = reference.ratio_check(to_jagged(out, lengths)[0], fp32, same, 2.0)
    assert ok, f"padded output error {err:.3e} > 2 x same-dtype error {ref_err:.3e}"
    assert torch.isfinite(out).all() and all((out[b, n:] == 0).all() for b, n in enumerate(lengths))
    tol = 2 * (same - fp32).abs().max().item() + 1e-6
    assert (to_padded(jagged.detach(), offsets, N) - out.detach()).abs().max().item() <= tol
    for name, padded_leaf, jagged_leaf in zip("qkv", leaves, jagged_leaves):
        g = padded_leaf.grad
        assert torch.isfinite(g).all() and all((g[b, n:] == 0).all() for b, n in enumerate(lengths)), name
        diff = (to_jagged(g, lengths)[0].float() - jagged_leaf.grad.float()).abs().max().item()
        scale = jagged_leaf.grad.float().abs().max().item()
        assert diff <= 1e-2 * scale, f"d{name}: padded vs jagged {diff:.3e} (max |grad| {scale:.3e})"
