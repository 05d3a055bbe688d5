"""fp32 inputs (docs/operator.md, "fp32 inputs") on meta tensors, nothing launched: the kernels see
bf16 q, k, v (and rab), the output and every gradient come back fp32 with the inputs' shapes,
eagerly and under torch.compile(fullgraph=True); what stays refused names the argument."""

from __future__ import annotations

import pytest
import torch

import hstu_cute.api as api
from hstu_cute import hstu_attn_varlen_func, validation

F32, BF16 = torch.float32, torch.bfloat16


def _batch(dtype=F32, lengths=(9, 17, 1), heads=2, head_dim=32, rab=False):
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="meta")
    t, n = sum(lengths), max(lengths)
    b = dict(q=torch.empty(t, heads, head_dim, dtype=dtype, device="meta"),
             k=torch.empty(t, heads, head_dim, dtype=dtype, device="meta"),
             v=torch.empty(t, heads, head_dim, dtype=dtype, device="meta"),
             seq_offsets_q=offsets, seq_offsets_k=offsets, max_seqlen_q=n, max_seqlen_k=n, window_size=(-1, 0))
    if rab:
        b["rab"] = torch.empty(len(lengths), 1, n, n, dtype=dtype, device="meta")
    return b


@pytest.fixture
def attended(monkeypatch):
    """The dtypes the validated call reaches the launchers with (api._attend's q, k, v, rab)."""
    import hstu_cute.compile

    monkeypatch.setattr(hstu_cute.compile, "build", lambda *a, **k: pytest.fail("compiled a kernel"))
    seen = []
    real = api._attend

    def spy(call, q, k, v, rab, eager):
        seen.append((q.dtype, k.dtype, v.dtype, None if rab is None else rab.dtype, call.problem.dtype))
        return real(call, q, k, v, rab, eager)

    monkeypatch.setattr(api, "_attend", spy)
    return seen


@pytest.mark.parametrize("rab", [False, True])
def test_fp32_inputs_run_in_bf16_and_return_fp32(attended, rab):
    b = _batch(rab=rab)
    leaves = ("q", "k", "v", "rab") if rab else ("q", "k", "v")
    for n in leaves:
        b[n].requires_grad_()
    out = hstu_attn_varlen_func(**b, has_drab=rab)
    assert out.dtype == F32 and out.shape == b["q"].shape
    assert attended == [(BF16, BF16, BF16, BF16 if rab else None, BF16)]
    out.sum().backward()
    for n in leaves:
        assert b[n].grad.dtype == F32 and b[n].grad.shape == b[n].shape, n


def test_fp32_inputs_under_torch_compile(attended):
    b = _batch()
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: hstu_attn_varlen_func(q, k, v, b["seq_offsets_q"], b["seq_offsets_k"],
                                                                   17, 17, window_size=(-1, 0)),
                             fullgraph=True, backend="eager")
    out = compiled(b["q"], b["k"], b["v"])
    assert out.dtype == F32 and out.shape == b["q"].shape
    assert attended and all(seen[:3] == (BF16, BF16, BF16) for seen in attended)


def test_16bit_inputs_are_untouched():
    b = _batch(BF16)
    assert validation.fp32_as_bf16(b["q"], b["k"], b["v"], None)[4] is False
    q, k, v, rab, widened = validation.fp32_as_bf16(*(_batch()[n] for n in "qkv"), None, paged=True)
    assert not widened and q.dtype == F32  # a paged cache holds 16-bit keys: validation names q's dtype


def test_mixed_fp32_is_refused_by_name():
    b = _batch()
    b["k"] = b["k"].to(BF16)
    with pytest.raises(TypeError, match="q: expected dtype torch.bfloat16, torch.float16 or torch.float8_e4m3fn, "
                                        "got torch.float32"):
        hstu_attn_varlen_func(**b)
