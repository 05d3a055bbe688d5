"""GQA / MQA (docs/operator.md, "Grouped query heads") on CPU: the oracle's rule (query head h
reads key head h // (H_q / H_kv)) against a direct per-head computation, gradients of the shared
key heads summed over their groups, the public call on meta tensors (eager autograd, torch.compile)
and what stays refused."""

from __future__ import annotations

import pytest
import torch

from hstu_cute import hstu_attn_varlen_func, reference, validation

BF16 = torch.bfloat16


def _batch(h_q, h_kv, lengths=(9, 17, 1), head_dim=32, device="cpu", dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    t = sum(lengths)
    q = torch.randn(t, h_q, head_dim, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(t, h_kv, head_dim, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    return dict(q=q.to(device), k=k.to(device), v=v.to(device), seq_offsets_q=offsets.to(device),
                seq_offsets_k=offsets.to(device), max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))


@pytest.mark.parametrize("h_q,h_kv", [(4, 1), (4, 2), (6, 3)])
def test_oracle_reads_key_head_h_over_group(h_q, h_kv):
    b = _batch(h_q, h_kv)
    out = reference.hstu_attn_reference(**b, window_size=(-1, 0), alpha=0.5, compute_dtype=torch.float64)
    group = h_q // h_kv
    for h in range(h_q):
        one = dict(b, q=b["q"][:, h:h + 1], k=b["k"][:, h // group:h // group + 1], v=b["v"][:, h // group:h // group + 1])
        want = reference.hstu_attn_reference(**one, window_size=(-1, 0), alpha=0.5, compute_dtype=torch.float64)
        assert torch.allclose(out[:, h:h + 1], want, rtol=1e-12, atol=1e-12), h


def test_shared_key_heads_get_their_groups_gradients():
    b = _batch(4, 2)
    leaves = {n: b[n].clone().requires_grad_() for n in ("q", "k", "v")}
    out = reference.hstu_attn_reference(**dict(b, **leaves), window_size=(-1, 0))
    dout = torch.randn_like(out)
    out.backward(dout)
    # The same call with each key head copied for its group: its gradients summed per group.
    expanded = {"q": b["q"].clone().requires_grad_(),
                "k": b["k"].repeat_interleave(2, dim=1).requires_grad_(),
                "v": b["v"].repeat_interleave(2, dim=1).requires_grad_()}
    reference.hstu_attn_reference(**dict(b, **expanded), window_size=(-1, 0)).backward(dout)
    for n in ("k", "v"):
        summed = expanded[n].grad.unflatten(1, (2, 2)).sum(dim=2)
        assert torch.allclose(leaves[n].grad, summed, rtol=1e-12, atol=1e-12), n
    assert torch.allclose(leaves["q"].grad, expanded["q"].grad)


def test_the_public_call_takes_grouped_heads_on_meta_tensors(monkeypatch):
    """Eager autograd and torch.compile(fullgraph=True) on meta tensors (nothing launched): the
    output has q's heads, k's and v's gradients k's and v's shapes."""
    import hstu_cute.compile

    monkeypatch.setattr(hstu_cute.compile, "build", lambda *a, **k: pytest.fail("compiled a kernel"))
    b = _batch(8, 2, device="meta", dtype=BF16)
    for n in ("q", "k", "v"):
        b[n].requires_grad_()
    out = hstu_attn_varlen_func(**b, window_size=(-1, 0))
    assert out.shape == b["q"].shape
    out.sum().backward()
    assert b["k"].grad.shape == b["k"].shape and b["v"].grad.shape == b["v"].shape
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: hstu_attn_varlen_func(q, k, v, b["seq_offsets_q"], b["seq_offsets_k"],
                                                                   17, 17, window_size=(-1, 0)),
                             fullgraph=True, backend="eager")
    assert compiled(b["q"].detach(), b["k"].detach(), b["v"].detach()).shape == b["q"].shape


def test_what_stays_refused():
    assert validation.kv_group(*(_batch(4, 2, dtype=BF16)[n] for n in ("q", "k", "v"))) == 2
    b = _batch(4, 3, dtype=BF16, device="meta")  # not a divisor
    with pytest.raises(ValueError, match=r"k\.shape\[1\] \(heads\): expected 4 \(q's heads\), or a divisor"):
        hstu_attn_varlen_func(**b)
    b = _batch(4, 2, dtype=torch.float32, device="meta")  # 16-bit k and v only
    assert validation.kv_group(b["q"], b["k"], b["v"]) == 1
    assert validation.kv_group(*(_batch(4, 2, dtype=BF16)[n] for n in ("q", "k", "v")), paged=True) == 1


def test_modules_and_the_padded_entry_take_fewer_key_heads():
    """HSTUBlock(num_kv_heads=...) projects k and v per key head; on CPU (the reference path) it
    matches hstu_block_reference with every gradient; hstu_attention and hstu_attn_padded take k, v
    with H_kv heads as the operator does."""
    import warnings

    from hstu_cute import HSTUBlock, hstu_attn_padded
    from hstu_cute.nn import hstu_attention, hstu_block_reference

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    block = HSTUBlock(32, 4, 16, num_kv_heads=2, dtype=torch.float64)
    assert block.uvqk.out_features == 4 * 16 + 2 * 16 + 4 * 16 + 2 * 16
    offsets = torch.tensor([0, 10, 27, 28], dtype=torch.int32)
    x = torch.randn(28, 32, dtype=torch.float64, requires_grad=True)
    out = block(x, offsets, 17)
    ref = hstu_block_reference(block, x, offsets, 17, compute_dtype=torch.float64)
    assert torch.allclose(out, ref, rtol=1e-10, atol=1e-12)
    leaves = [x, *block.parameters()]
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(ref, leaves, dout)):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-11)
    with pytest.raises(ValueError, match="num_kv_heads"):
        HSTUBlock(32, 4, 16, num_kv_heads=3)

    b = _batch(4, 2, lengths=(7, 7))
    want = reference.hstu_attn_reference(**b, window_size=(-1, 0), compute_dtype=torch.float64)
    got = hstu_attention(b["q"], b["k"], b["v"], b["seq_offsets_q"], 7)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    padded = hstu_attn_padded(*(b[n].view(2, 7, *b[n].shape[1:]) for n in ("q", "k", "v")), [7, 7])
    assert torch.allclose(padded.reshape(14, 4, -1), want, rtol=1e-10, atol=1e-12)


def test_16bit_calls_take_the_key_heads_natively(monkeypatch):
    """A 16-bit call reaches the launchers with k and v of H_kv heads, with autograd or without
    (the forward and backward kernels map query head h to key head h // group; the backward sums
    each group's dK / dV), and its gradients have k's and v's shapes. fp32 inputs are cast first,
    then take the same road. Meta tensors: nothing launched."""
    import hstu_cute.api as api
    import hstu_cute.compile

    monkeypatch.setattr(hstu_cute.compile, "build", lambda *a, **k: pytest.fail("compiled a kernel"))
    seen = []
    real = api._attend

    def spy(call, q, k, v, rab, eager):
        seen.append((q.shape[1], k.shape[1], v.shape[1]))
        return real(call, q, k, v, rab, eager)

    monkeypatch.setattr(api, "_attend", spy)
    b = _batch(8, 2, device="meta", dtype=BF16)
    assert hstu_attn_varlen_func(**b, window_size=(-1, 0)).shape == b["q"].shape
    leaves = {n: b[n].clone().requires_grad_() for n in ("q", "k", "v")}
    with torch.no_grad():
        hstu_attn_varlen_func(**dict(b, **leaves), window_size=(-1, 0))
    out = hstu_attn_varlen_func(**dict(b, **leaves), window_size=(-1, 0))
    dq, dk, dv = torch.autograd.grad(out, tuple(leaves.values()), torch.ones_like(out))
    assert (dq.shape, dk.shape, dv.shape) == (b["q"].shape, b["k"].shape, b["v"].shape)
    hstu_attn_varlen_func(**dict(b, k=leaves["k"]), window_size=(-1, 0))  # only k requires grad
    b32 = _batch(8, 2, device="meta", dtype=torch.float32)
    assert hstu_attn_varlen_func(**b32, window_size=(-1, 0)).dtype == torch.float32
    assert seen == [(8, 2, 2), (8, 2, 2), (8, 2, 2), (8, 2, 2), (8, 2, 2)]
