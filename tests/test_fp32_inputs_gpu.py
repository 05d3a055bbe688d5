"""fp32 inputs on the GPU (docs/operator.md, "fp32 inputs": computed in bf16), both kernel paths:
the output and every gradient against the fp32 oracle within the ratio rule, with the bf16 oracle
on the cast inputs as the same-dtype yardstick (2x for the output, 5x for gradients); fp32 out and
fp32 gradients; edge lengths and contexts / targets with rab and drab."""

from __future__ import annotations

import pytest
import torch

from hstu_cute import hstu_attn_varlen_func
from hstu_cute.reference import ratio_check, reference_grads
from hstu_cute.testing import random_jagged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("case", [dict(window_size=(-1, 0)),
                                  dict(window_size=(-1, 0), num_contexts=[0, 3, 9], num_targets=[0, 5, 40],
                                       target_group_size=2, rab_heads=1)], ids=["causal", "ctx+tgt+rab"])
def test_fp32_inputs_match_the_oracle(path, case):
    drab = "rab_heads" in case
    b = random_jagged_batch(3, 2, 64, 300, device="cuda", dtype=torch.float32, seed=32, lengths=[1, 17, 300],
                            alpha=0.5, **case)
    names = ("q", "k", "v") + (("rab",) if drab else ())
    leaves = {n: b[n].detach().clone().requires_grad_() for n in names}
    out = hstu_attn_varlen_func(**dict(b, **leaves), has_drab=drab)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(33)).cuda()
    out.backward(dout)
    assert out.dtype == torch.float32 and all(leaves[n].grad.dtype == torch.float32 for n in names)
    exact = reference_grads(**b, dout=dout)
    cast = dict(b, **{n: b[n].to(torch.bfloat16) for n in names})
    bf16 = reference_grads(**cast, dout=dout.to(torch.bfloat16), compute_dtype=None)
    ok, err, ref_err = ratio_check(out, exact["out"], bf16["out"].float(), 2.0)
    assert ok, f"out: {err:.3e} > 2 x {ref_err:.3e}"
    for n in names:
        ok, err, ref_err = ratio_check(leaves[n].grad, exact["d" + n], bf16["d" + n].float(), 5.0)
        assert ok, f"d{n}: {err:.3e} > 5 x {ref_err:.3e}"
