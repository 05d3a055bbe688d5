"""The FP8 backward's oracle (reference.hstu_attn_fp8_grad_emulation, docs/design/fp8-backward.md):
written out, its fp32 backward equals autograd of the forward oracle; quantization and the
per-row re-quantization of P^T / G^T / G change the gradients by an e4m3-sized amount, less with
finer quantizer groups; and the running scale matches a direct per-row computation."""

from __future__ import annotations

import pytest
import torch

from hstu_cute import masks, reference
from hstu_cute.testing import random_jagged_batch

CASES = {
    "causal": dict(window_size=(-1, 0)),
    "ctx+tgt g3 rab1": dict(window_size=(-1, 0), num_contexts=5, num_targets=9, target_group_size=3, rab_heads=1),
    "local rabH": dict(window_size=(20, 7), rab_heads=2),
    "delta_q": dict(window_size=(-1, 0), is_delta_q=True, max_seqlen_k=190),
    "none": dict(window_size=(-1, -1)),
}
ORACLE_KEYS = ("q", "k", "v", "seq_offsets_q", "seq_offsets_k", "max_seqlen_q", "max_seqlen_k", "num_contexts",
               "num_targets", "target_group_size", "window_size", "alpha", "rab", "is_delta_q")


def _batch(case, seed, lengths=(150, 1, 17, 0, 97)):
    kw = dict(CASES[case])
    max_k = kw.pop("max_seqlen_k", None)
    batch = random_jagged_batch(len(lengths), 2, 32, max(lengths), max_k, lengths=list(lengths), alpha=0.4,
                                dtype=torch.float32, seed=seed, **kw)
    dout = torch.randn(batch["q"].shape, generator=torch.Generator().manual_seed(seed + 1)) * 1e-2
    return {k: batch[k] for k in ORACLE_KEYS}, dout


@pytest.mark.parametrize("case", list(CASES))
def test_written_out_backward_equals_autograd(case):
    args, dout = _batch(case, 3)
    want = reference.reference_grads(**args, dout=dout, compute_dtype=torch.float64)
    got = reference.hstu_attn_fp8_grad_emulation(**{k: (v.double() if isinstance(v, torch.Tensor) and
                                                        v.is_floating_point() else v) for k, v in args.items()},
                                                 dout=dout.double(), quant_mode=5, quantize_inputs=False,
                                                 round_products=False)
    for name in ("dq", "dk", "dv") + (("drab",) if args["rab"] is not None else ()):
        scale = want[name].abs().max().item() or 1.0
        assert (got[name] - want[name]).abs().max().item() <= 1e-9 * scale, name


@pytest.mark.parametrize("n_func", [1, 3])
def test_written_out_backward_with_func_equals_autograd(n_func):
    """FBGEMM's func mask in place of the others: the written-out backward reads the same per-row
    intervals as the forward oracle (rab per head, out-of-range bounds clamped by both)."""
    lengths = [150, 1, 17, 0, 97]
    args, dout = _batch("none", 11, tuple(lengths))
    args = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in args.items()}
    args["rab"] = torch.randn(len(lengths), 2, 150, 150, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    gen = torch.Generator().manual_seed(13)
    func = torch.randint(-2, 160, (1, n_func, sum(lengths) + masks.FUNC_ROW_PADDING), generator=gen, dtype=torch.int32)
    want = reference.reference_grads(**args, dout=dout.double(), compute_dtype=torch.float64, func=func)
    got = reference.hstu_attn_fp8_grad_emulation(**args, dout=dout.double(), quant_mode=5, quantize_inputs=False,
                                                 round_products=False, func=func)
    for name in ("dq", "dk", "dv", "drab"):
        scale = want[name].abs().max().item() or 1.0
        assert scale > 0 and (got[name] - want[name]).abs().max().item() <= 1e-9 * scale, name
    # The mask matters: without func the gradients differ.
    plain = reference.hstu_attn_fp8_grad_emulation(**args, dout=dout.double(), quant_mode=5, quantize_inputs=False,
                                                   round_products=False)
    assert not torch.allclose(plain["dq"], got["dq"])


@pytest.mark.parametrize("delta_q", [False, True])
def test_written_out_backward_with_seqused_equals_autograd(delta_q):
    """seqused shortens each sequence to a prefix of its storage: the written-out backward attends
    over the prefixes only, as the oracle does (padding rows get zero gradients)."""
    kw = dict(window_size=(-1, 0), is_delta_q=True) if delta_q else dict(window_size=(20, 7), rab_heads=1)
    batch = random_jagged_batch(5, 2, 32, 150, 190 if delta_q else None, lengths=[150, 1, 17, 0, 97], alpha=0.4,
                                dtype=torch.float64, seed=23, seqused=True, **kw)
    args = {k: batch[k] for k in ORACLE_KEYS + ("seqused_q", "seqused_k")}
    assert args["seqused_k"] is not None
    dout = torch.randn(batch["q"].shape, generator=torch.Generator().manual_seed(24), dtype=torch.float64) * 1e-2
    want = reference.reference_grads(**args, dout=dout, compute_dtype=torch.float64)
    got = reference.hstu_attn_fp8_grad_emulation(**args, dout=dout, quant_mode=5, quantize_inputs=False,
                                                 round_products=False)
    for name in ("dq", "dk", "dv") + (("drab",) if args["rab"] is not None else ()):
        scale = want[name].abs().max().item() or 1.0
        assert (got[name] - want[name]).abs().max().item() <= 1e-9 * scale, name
    offs_k, used_k = args["seq_offsets_k"].tolist(), args["seqused_k"].tolist()
    padding = [t for b in range(5) for t in range(offs_k[b] + used_k[b], offs_k[b + 1])]
    assert padding, "the batch must have key padding for this test to mean anything"
    assert got["dk"][padding].abs().max().item() == 0.0 and got["dv"][padding].abs().max().item() == 0.0


def _errors(args, dout, mode, **flags):
    exact = reference.reference_grads(**args, dout=dout, compute_dtype=torch.float32)
    got = reference.hstu_attn_fp8_grad_emulation(**args, dout=dout, quant_mode=mode, **flags)
    return {n: ((got[n] - exact[n]).norm() / exact[n].norm()).item() for n in ("dq", "dk", "dv")}


@pytest.mark.parametrize("case", ["causal", "ctx+tgt g3 rab1"])
def test_quantization_error_is_e4m3_sized_and_finer_groups_help(case):
    args, dout = _batch(case, 11)
    per_block = _errors(args, dout, 2)
    per_tensor = _errors(args, dout, 5)
    products_only = _errors(args, dout, 2, quantize_inputs=False)
    for name in ("dq", "dk", "dv"):
        # e4m3 keeps 3 mantissa bits: relative errors of a few percent, never zero.
        assert 1e-3 < products_only[name] < 0.1, (name, products_only)
        assert 1e-3 < per_block[name] < 0.15, (name, per_block)
        assert per_block[name] <= per_tensor[name] * 1.05, (name, per_block, per_tensor)


def test_mode_zero_casts_a_small_do_away():
    """Mode 0 casts dO as it is: a typical upstream gradient (1e-4) is below e4m3's subnormals,
    so dV vanishes, where per-block scales (mode 2) keep it."""
    args, dout = _batch("causal", 5)
    dout = dout * 1e-2
    exact = reference.reference_grads(**args, dout=dout, compute_dtype=torch.float32)
    cast = reference.hstu_attn_fp8_grad_emulation(**args, dout=dout, quant_mode=0)
    scaled = reference.hstu_attn_fp8_grad_emulation(**args, dout=dout, quant_mode=2)
    assert cast["dv"].abs().max() == 0
    assert ((scaled["dv"] - exact["dv"]).norm() / exact["dv"].norm()) < 0.15


def test_running_scale_against_per_row_rule():
    """Ascending blocks, the scale only grows, skipped blocks untouched; every value is e4m3 times
    its block's running scale."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 40, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 0.0])[None, :, None]
    visited = torch.tensor([True, False, True])
    out = reference.running_scale_e4m3(x, 16, True, visited, 1e-30)
    assert torch.all(out[:, :, 16:32] == 0)
    scale = torch.zeros(2, 5)
    for j in (0, 32):
        tile = x[:, :, j:j + 16]
        need = 2.0 ** torch.ceil(torch.log2(tile.abs().amax(dim=2).clamp(min=1e-30) / 448))
        scale = torch.maximum(scale, need)
        expect = (tile / scale[:, :, None]).to(torch.float8_e4m3fn).float() * scale[:, :, None]
        assert torch.equal(out[:, :, j:j + 16], expect)


def test_tile_scale_against_per_tile_rule():
    """The fused kernel's G for dQ: one power-of-two scale per (head, rows x cols tile), ragged
    edge tiles included; an all-zero tile keeps zeros."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 70, 90, generator=gen) * torch.logspace(-4, 3, 90)[None, None, :]
    x[:, 64:, :32] = 0.0
    out = reference.tile_scale_e4m3(x, 32, 32, 1e-30)
    assert out.shape == x.shape and torch.all(out[:, 64:, :32] == 0)
    for r in range(0, 70, 32):
        for c in range(0, 90, 32):
            tile = x[:, r:r + 32, c:c + 32]
            s = 2.0 ** torch.ceil(torch.log2(tile.abs().amax(dim=(1, 2)).clamp(min=1e-30) / 448))[:, None, None]
            assert torch.equal(out[:, r:r + 32, c:c + 32], (tile / s).to(torch.float8_e4m3fn).float() * s)
    # One tile's largest value is what the scale is cut for: it comes back within e4m3's half ulp.
    assert torch.allclose(out.abs().amax(), x.abs().amax(), rtol=2 ** -4)
