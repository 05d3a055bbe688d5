"""Training step of a small HSTU layer under torch.compile (inductor, fullgraph) against the fp32
oracle: every gradient (input, projections, rab) within the spec's 5x ratio rule, on both kernel
paths. Without rab at D128 the Hopper path runs the pair for these short sequences, or (forced)
the fused dK/dV/dQ backward (dQ by TMA reduce-add); with a learned rab (has_drab) the pair."""

from __future__ import annotations

import copy

import pytest
import torch

from hstu_cute import hstu_attn_varlen_func, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

H, D, L = 2, 128, 160
LENGTHS = (160, 3, 0, 97, 1)


class HstuLayer(torch.nn.Module):
    """qkv projection -> SiLU attention (causal, targets) -> output projection. ``attention``
    is ours, or the oracle (with ``compute_dtype``)."""

    def __init__(self, dtype, with_rab: bool, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.qkv = torch.nn.Parameter((torch.rand(3 * H * D, H * D, generator=gen) * 2 - 1).mul(0.05).to(dtype))
        self.out = torch.nn.Parameter((torch.rand(H * D, H * D, generator=gen) * 2 - 1).mul(0.05).to(dtype))
        self.rab = None
        if with_rab:
            self.rab = torch.nn.Parameter((torch.rand(1, 1, L, L, generator=gen) * 2 - 1).to(dtype))

    def forward(self, x, offsets, targets, oracle_dtype=None, use_oracle=False):
        q, k, v = (x @ self.qkv.t()).view(-1, 3, H, D).unbind(1)
        rab = None if self.rab is None else self.rab.expand(offsets.shape[0] - 1, -1, -1, -1)
        kw = dict(num_targets=targets, window_size=(-1, 0), alpha=0.7, rab=rab)
        if use_oracle:
            o = reference.hstu_attn_reference(q, k, v, offsets, offsets, L, L, compute_dtype=oracle_dtype,
                                              has_drab=rab is not None, **kw)
        else:
            o = hstu_attn_varlen_func(q, k, v, offsets, offsets, L, L, has_drab=rab is not None, **kw)
        return o.reshape(-1, H * D) @ self.out.t()


def _grads(layer, x0, offsets, targets, fn, **kw):
    layer.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    y = fn(x, offsets, targets, **kw)
    y.float().square().sum().backward()
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    return dict(zip(names, [x.grad] + [p.grad for _, p in layer.named_parameters()]))


@pytest.mark.parametrize("with_rab,fused", [(False, False), (False, True), (True, False)],
                         ids=["no-rab", "no-rab-fused", "rab-drab"])
def test_compiled_training_step_matches_oracle(path, with_rab, fused, monkeypatch):
    from hstu_cute import launch

    if fused:
        monkeypatch.setattr(launch.heuristics, "FUSED_MIN_SEQLEN_K", 0)
    torch._dynamo.reset()
    dev = "cuda"
    lengths = list(LENGTHS)
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    targets = torch.tensor([7, 1, 0, 97, 0], dtype=torch.int32, device=dev)
    gen = torch.Generator().manual_seed(1)
    x0 = (torch.rand(sum(lengths), H * D, generator=gen) * 2 - 1).to(dev)

    layer = HstuLayer(torch.bfloat16, with_rab).to(dev)
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")
    ours = _grads(layer, x0.bfloat16(), offsets, targets, compiled)
    same = _grads(layer, x0.bfloat16(), offsets, targets, layer, use_oracle=True, oracle_dtype=None)
    layer32 = copy.deepcopy(layer).float()  # the same (bf16-representable) weights and input, in fp32
    oracle = _grads(layer32, x0.bfloat16().float(), offsets, targets, layer32, use_oracle=True,
                    oracle_dtype=torch.float32)

    assert set(ours) == set(oracle) == {"x", "qkv", "out"} | ({"rab"} if with_rab else set())
    for name, g32 in oracle.items():
        assert ours[name] is not None and torch.isfinite(ours[name]).all(), name
        ok, err, ref_err = reference.ratio_check(ours[name], g32, same[name], 5.0)
        assert ok, f"d{name}: compiled kernel error {err:.3e} > 5 x same-dtype oracle error {ref_err:.3e}"
        assert g32.abs().max() > 0, f"d{name} is all zero: the check would be vacuous"
    torch._dynamo.reset()
