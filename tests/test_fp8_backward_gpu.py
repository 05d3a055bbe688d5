"""The Hopper FP8 backward (quant modes 0-5) against the FP8 gradient emulation
(:func:`hstu_cute.reference.hstu_attn_fp8_grad_emulation`): each gradient's error against the fp32
backward on the unquantized inputs must stay within 5x of the emulation's error (spec, ratio rule
for gradients). Gradients come from autograd through the public call (torch.ops.hstu_cute::fwd_fp8
and its registered backward, hstu_cute::bwd_fp8). Skips without an sm90 GPU."""

from __future__ import annotations

import zlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hstu_cute import hstu_attn_varlen_func, launch, reference
from hstu_cute.fp8_recipe import recipe
from hstu_cute.launch import fp8_backward_fused
from hstu_cute.quantize import QuantMode, quantize_batch
from hstu_cute.testing import gaussian_jagged_batch, random_func, random_jagged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="the FP8 kernels need a compute capability 9.x GPU"),
]

MASKS = {
    "none": dict(window_size=(-1, -1)),
    "causal": dict(window_size=(-1, 0)),
    "local": dict(window_size=(111, 11)),
    "ctx+tgt": dict(window_size=(-1, 0), num_contexts=200, num_targets=300, target_group_size=3),
}
_EMULATION_ARGS = ("seq_offsets_q", "seq_offsets_k", "max_seqlen_q", "max_seqlen_k", "num_contexts", "num_targets",
                   "target_group_size", "window_size", "alpha", "rab", "is_delta_q", "scaling_seqlen", "seqused_q",
                   "seqused_k")


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def fp8_grads(b, mode, dout):
    """(kernel grads, emulated grads, fp32 grads) of one batch, dicts of dq, dk, dv."""
    q, k, v = (b[n].detach().clone().requires_grad_() for n in "qkv")
    rest = {n: x for n, x in b.items() if n not in ("q", "k", "v")}
    out = hstu_attn_varlen_func(q, k, v, **rest, quant_mode=mode)
    out.backward(dout)
    torch.cuda.synchronize()
    kernel = dict(dq=q.grad, dk=k.grad, dv=v.grad)
    args = {n: b[n] for n in _EMULATION_ARGS}
    fused = fp8_backward_fused(q.shape[2], recipe(mode), b["max_seqlen_k"], b["rab"] is not None, False, False)
    emul = reference.hstu_attn_fp8_grad_emulation(b["q"], b["k"], b["v"], dout, **args, quant_mode=mode,
                                                  fused_dq=fused)
    exact = reference.hstu_attn_fp8_grad_emulation(b["q"], b["k"], b["v"], dout, **args, quant_mode=mode,
                                                   quantize_inputs=False, round_products=False)
    return kernel, emul, exact


def check(b, mode, seed, dout_scale=1e-2):
    gen = torch.Generator().manual_seed(seed)
    dout = (torch.randn(b["q"].shape, generator=gen) * dout_scale).to(b["q"].dtype).cuda()
    kernel, emul, exact = fp8_grads(b, mode, dout)
    for name in ("dq", "dk", "dv"):
        assert kernel[name].dtype == b["q"].dtype
        ok, err, emul_err = reference.ratio_check(kernel[name], exact[name], emul[name], 5.0)
        assert ok, f"[mode {mode} seed={seed}] {name}: kernel err {err:.3e} > 5 x emulation err {emul_err:.3e}"
    return kernel


# (mode, mask, head dim, dtype, rab heads, max lengths q/k, lengths)
GRID = [
    (0, "causal", 128, torch.bfloat16, None, (512, 512), "random"),
    (2, "causal", 128, torch.bfloat16, None, (1024, 1024), "random"),
    (2, "none", 64, torch.float16, 1, (300, 300), "random"),
    (3, "local", 128, torch.bfloat16, 2, (700, 700), "full"),
    (4, "ctx+tgt", 128, torch.bfloat16, None, (1111, 1111), "random"),
    (5, "ctx+tgt", 64, torch.bfloat16, 2, (600, 600), "random"),
    (2, "causal", 64, torch.bfloat16, None, (200, 900), "random"),  # delta_q
    (0, "none", 128, torch.float16, None, (257, 257), "full"),
    (5, "causal", 128, torch.float16, 1, (999, 999), "random"),
    (3, "ctx+tgt", 64, torch.float16, None, (400, 400), "random"),
    # Mode 1: per-token descales, and the copies' per-(block, dim) descales moving with the walk.
    (1, "causal", 128, torch.bfloat16, None, (1024, 1024), "random"),
    (1, "none", 64, torch.float16, 1, (300, 300), "random"),
    (1, "local", 128, torch.float16, 2, (700, 700), "full"),
    (1, "ctx+tgt", 128, torch.bfloat16, None, (1111, 1111), "random"),
    (1, "causal", 64, torch.bfloat16, 2, (200, 900), "random"),  # delta_q
    # D256: two CTAs per key block, each with half of D (dK, dV; Q^T / dO^T tiles and column descales).
    (2, "causal", 256, torch.bfloat16, None, (1024, 1024), "random"),
    (0, "ctx+tgt", 256, torch.float16, 1, (600, 600), "random"),
    (1, "local", 256, torch.bfloat16, 2, (700, 700), "full"),
    (5, "none", 256, torch.bfloat16, None, (300, 300), "random"),
    (1, "causal", 256, torch.float16, None, (200, 900), "random"),  # delta_q
]


@pytest.mark.parametrize("case", GRID, ids=lambda c: f"mode{c[0]}-{c[1]}-d{c[2]}-{str(c[3])[6:]}-rab{c[4]}-{c[5]}")
def test_fp8_backward_grid(case):
    mode, mask, head_dim, dtype, rab_heads, (mq, mk), lengths = case
    seed = _seed(case)
    b = random_jagged_batch(8, 2, head_dim, mq, mk, device="cuda", dtype=dtype, seed=seed, rab_heads=rab_heads,
                            is_delta_q=mq < mk, lengths=lengths, alpha=0.5, **MASKS[mask])
    check(b, mode, seed)


# seqused: valid prefixes shorter than the storage (the quantizers' groups still span it, padding
# included, as the emulation's do): (mode, mask, head dim, dtype, max lengths q/k)
SEQUSED_GRID = [
    (2, "causal", 128, torch.bfloat16, (1024, 1024)),
    (5, "ctx+tgt", 128, torch.float16, (700, 700)),
    (1, "local", 64, torch.bfloat16, (600, 600)),
    (0, "none", 256, torch.bfloat16, (400, 400)),
    (2, "causal", 64, torch.float16, (300, 900)),  # delta_q
]


@pytest.mark.parametrize("case", SEQUSED_GRID, ids=lambda c: f"mode{c[0]}-{c[1]}-d{c[2]}-{str(c[3])[6:]}-{c[4][0]}x{c[4][1]}")
def test_fp8_backward_seqused(case):
    mode, mask, head_dim, dtype, (mq, mk) = case
    seed = _seed("seqused", case)
    b = random_jagged_batch(6, 2, head_dim, mq, mk, device="cuda", dtype=dtype, seed=seed, is_delta_q=mq < mk,
                            lengths="random", alpha=0.5, seqused=True, **MASKS[mask])
    used_q, used_k = b["seqused_q"].tolist(), b["seqused_k"].tolist()
    offs_q, offs_k = b["seq_offsets_q"].tolist(), b["seq_offsets_k"].tolist()
    pad_q = [t for i in range(6) for t in range(offs_q[i] + used_q[i], offs_q[i + 1])]
    pad_k = [t for i in range(6) for t in range(offs_k[i] + used_k[i], offs_k[i + 1])]
    assert pad_q and pad_k, "the batch must have padding rows"
    kernel = check(b, mode, seed)
    assert kernel["dq"][pad_q].abs().max().item() == 0.0
    assert kernel["dk"][pad_k].abs().max().item() == 0.0 and kernel["dv"][pad_k].abs().max().item() == 0.0


# The fused kernel (opt-in: D128, modes 0 and 2-5, no rab, keys of at least FUSED_MIN_SEQLEN_K
# tokens), through the public call: (mode, mask, dtype, max lengths q/k, lengths)
FUSED_GRID = [
    (2, "causal", torch.bfloat16, (2304, 2304), "random"),
    (0, "none", torch.float16, (2100, 2100), "random"),
    (3, "local", torch.bfloat16, (2200, 2200), "full"),
    (4, "ctx+tgt", torch.bfloat16, (2500, 2500), "random"),
    (5, "causal", torch.float16, (2049, 2049), "full"),
    (2, "causal", torch.bfloat16, (900, 2300), "random"),  # delta_q
]


@pytest.mark.parametrize("case", FUSED_GRID, ids=lambda c: f"mode{c[0]}-{c[1]}-{str(c[2])[6:]}-{c[3]}-{c[4]}")
def test_fp8_backward_fused(case, monkeypatch):
    mode, mask, dtype, (mq, mk), lengths = case
    monkeypatch.setattr(launch.heuristics, "FP8_FUSED_BY_DEFAULT", True)
    assert fp8_backward_fused(128, recipe(mode), mk, False, False, False)
    seed = _seed("fused", case)
    b = random_jagged_batch(4, 2, 128, mq, mk, device="cuda", dtype=dtype, seed=seed, is_delta_q=mq < mk,
                            lengths=lengths, alpha=0.5, **MASKS[mask])
    check(b, mode, seed)


def test_fp8_backward_fused_edge_lengths(monkeypatch):
    """The fused kernel with lengths 0, 1, 17, 2100 (key blocks cut short: K^T's padding and the
    next sequence behind them), all-target sequences and an empty one."""
    monkeypatch.setattr(launch.heuristics, "FP8_FUSED_BY_DEFAULT", True)
    b = random_jagged_batch(5, 2, 128, 2100, device="cuda", seed=_seed("fused-edge"), lengths=[0, 1, 17, 2100, 40],
                            window_size=(-1, 0), num_targets=[0, 1, 17, 20, 40], target_group_size=2)
    check(b, 2, 0)


# (mode, mask, head dim, rab heads, max lengths q/k, deterministic)
DRAB_GRID = [
    (2, "causal", 128, 2, (700, 700), False),  # drab per head
    (0, "ctx+tgt", 64, 1, (600, 600), False),  # one rab head over 2 heads: fp32 atomics
    (5, "local", 128, 1, (500, 500), True),  # one rab head, deterministic: per-head drab summed after
    (2, "causal", 64, 2, (200, 900), False),  # delta_q: drab rows in whole-sequence coordinates
    (1, "causal", 128, 2, (700, 700), False),
    (1, "ctx+tgt", 64, 1, (600, 600), True),
    (2, "causal", 256, 2, (500, 500), False),
    (1, "causal", 256, 1, (500, 500), False),
]


@pytest.mark.parametrize("case", DRAB_GRID, ids=lambda c: f"mode{c[0]}-{c[1]}-d{c[2]}-rab{c[3]}-{c[4]}-det{c[5]}")
def test_fp8_backward_drab(case):
    """has_drab: drab (written by the FP8 dQ kernel from G in fp32) and dq, dk, dv within 5x of the
    emulation's error; rab with as many heads as q or one (summed over the heads)."""
    mode, mask, head_dim, rab_heads, (mq, mk), deterministic = case
    seed = _seed("drab", case)
    b = random_jagged_batch(6, 2, head_dim, mq, mk, device="cuda", dtype=torch.bfloat16, seed=seed,
                            rab_heads=rab_heads, is_delta_q=mq < mk, alpha=0.5, **MASKS[mask])
    gen = torch.Generator().manual_seed(seed)
    dout = (torch.randn(b["q"].shape, generator=gen) * 1e-2).to(b["q"].dtype).cuda()
    q, k, v, rab = (b[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "rab"))
    rest = {n: x for n, x in b.items() if n not in ("q", "k", "v", "rab")}
    out = hstu_attn_varlen_func(q, k, v, **rest, rab=rab, has_drab=True, deterministic=deterministic, quant_mode=mode)
    out.backward(dout)
    torch.cuda.synchronize()
    kernel = dict(dq=q.grad, dk=k.grad, dv=v.grad, drab=rab.grad)
    args = {n: b[n] for n in _EMULATION_ARGS}
    emul = reference.hstu_attn_fp8_grad_emulation(b["q"], b["k"], b["v"], dout, **args, quant_mode=mode)
    exact = reference.hstu_attn_fp8_grad_emulation(b["q"], b["k"], b["v"], dout, **args, quant_mode=mode,
                                                   quantize_inputs=False, round_products=False)
    assert kernel["drab"].shape == rab.shape and kernel["drab"].dtype == rab.dtype
    for name in ("dq", "dk", "dv", "drab"):
        ok, err, emul_err = reference.ratio_check(kernel[name], exact[name], emul[name], 5.0)
        assert ok, f"[{case}] {name}: kernel err {err:.3e} > 5 x emulation err {emul_err:.3e}"
    if deterministic:
        again = torch.autograd.grad(hstu_attn_varlen_func(q, k, v, **rest, rab=rab, has_drab=True,
                                                          deterministic=True, quant_mode=mode), rab, dout)[0]
        assert torch.equal(again, kernel["drab"])


@pytest.mark.parametrize("mode", [0, 1, 2, 5])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_backward_edge_lengths(mode, head_dim):
    """Lengths 0, 1, 17, 1111 (token counts that are not multiples of 16: the copies' padding),
    all-target sequences and an empty one."""
    b = random_jagged_batch(5, 2, head_dim, 1111, device="cuda", seed=_seed("edge", mode, head_dim),
                            lengths=[0, 1, 17, 1111, 40], window_size=(-1, 0), num_targets=[0, 1, 17, 20, 40],
                            target_group_size=2)
    check(b, mode, 0)


@pytest.mark.parametrize("mode", [1, 2])
def test_fp8_backward_is_deterministic(mode):
    b = random_jagged_batch(4, 2, 128, 1024, device="cuda", seed=3, window_size=(-1, 0))
    dout = torch.randn_like(b["q"]) * 1e-2
    first = fp8_grads(b, mode, dout)[0]
    second = fp8_grads(b, mode, dout)[0]
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_fp8_backward_small_dout_mode2_beats_mode0():
    """Mode 0 casts dO as it is: a 1e-5 dO is mostly below e4m3's smallest subnormal, while mode 2
    scales it per block. Both meet the rule against their own emulation."""
    b = random_jagged_batch(4, 2, 128, 512, device="cuda", seed=4, window_size=(-1, 0))
    g0 = check(b, 0, 5, dout_scale=1e-5)
    g2 = check(b, 2, 5, dout_scale=1e-5)
    assert g2["dv"].abs().sum() > 0 and g0["dv"].float().abs().sum() < g2["dv"].float().abs().sum()


@pytest.mark.parametrize("mode", [1, 2])
def test_fp8_compiled_training_step(mode):
    """torch.compile(fullgraph=True) of a step through the FP8 op and its registered backward: the
    gradients equal the eager ones bitwise (the same kernels, summed in a fixed order)."""
    b = random_jagged_batch(4, 2, 128, 512, device="cuda", seed=8, window_size=(-1, 0), num_targets=50)
    rest = {n: x for n, x in b.items() if n not in ("q", "k", "v")}
    dout = torch.randn_like(b["q"]) * 1e-2

    def step(q, k, v):
        return (hstu_attn_varlen_func(q, k, v, **rest, quant_mode=mode).float() * dout.float()).sum()

    grads = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        q, k, v = (b[n].detach().clone().requires_grad_() for n in "qkv")
        fn(q, k, v).backward()
        grads.append((q.grad, k.grad, v.grad))
    for eager, compiled in zip(*grads):
        assert torch.equal(eager, compiled)


class _Watching(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_training_through_op_equals_eager(mode, head_dim):
    """The backward's copies of q, k and v kept from the forward's quantizer pass (eager) and made
    again by the backward (through the op, which saves only 16-bit inputs) are the same bits, so
    the training step's output and gradients are bitwise equal both ways; jagged, with an empty
    sequence, q and k of different lengths (delta_q)."""
    b = random_jagged_batch(5, 2, head_dim, 300, 700, device="cuda", seed=_seed("slots", mode, head_dim),
                            lengths=[700, 0, 1, 129, 257], is_delta_q=True, window_size=(-1, 0), alpha=0.5)
    rest = {n: x for n, x in b.items() if n not in ("q", "k", "v")}
    dout = torch.randn_like(b["q"]) * 1e-2

    def step(fn):
        q, k, v = (b[n].detach().clone().requires_grad_() for n in "qkv")
        out = fn(q, k, v)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    def eager(q, k, v):
        return hstu_attn_varlen_func(q, k, v, **rest, quant_mode=mode)

    def through_op(q, k, v):
        with _Watching():  # a dispatch mode watching: the call goes through the ops
            return hstu_attn_varlen_func(q, k, v, **rest, quant_mode=mode)

    for want, got in zip(step(eager), step(through_op)):
        assert torch.equal(want, got)


# FBGEMM's func masks with FP8 (its HSTU8Test draws them): (entry, n_func, head dim, dtype, lengths q, lengths k,
# fused). The forward within 2x of the FP8 emulation's error, the gradients within 5x.
FUNC_GRID = [
    (2, 3, 128, torch.bfloat16, [0, 1, 17, 1111], [0, 1, 17, 1111], False),
    (0, 1, 128, torch.float16, [300, 64, 129], [300, 64, 129], False),
    (1, 3, 128, torch.bfloat16, [256, 17, 200], [256, 17, 200], False),
    (5, 3, 64, torch.bfloat16, [8, 51, 400], [99, 256, 400], False),  # delta_q
    (2, 3, 128, torch.bfloat16, [2100, 40], [2100, 40], True),
    (-1, 3, 128, torch.bfloat16, [0, 1, 17, 1111], [0, 1, 17, 1111], False),  # pre-quantized, forward only
]


@pytest.mark.parametrize("case", FUNC_GRID, ids=lambda c: f"mode{c[0]}-n{c[1]}-d{c[2]}-{str(c[3])[6:]}-{c[4][-1]}x{c[5][-1]}"
                         + ("-fused" if c[6] else ""))
def test_fp8_func_matches_emulation(case, monkeypatch):
    mode, n_func, head_dim, dtype, lengths_q, lengths_k, fused = case
    seed = _seed("func", case)
    gen = torch.Generator().manual_seed(seed)
    b = gaussian_jagged_batch(lengths_q, lengths_k, 2, head_dim, dtype, gen)
    func = random_func(lengths_q, lengths_k, n_func, gen)
    args = {n: b[n] for n in ("seq_offsets_q", "seq_offsets_k", "max_seqlen_q", "max_seqlen_k", "alpha", "is_delta_q")}
    exact = reference.hstu_attn_reference(b["q"], b["k"], b["v"], **args, func=func, compute_dtype=torch.float32)
    if mode == -1:
        pq = {n: x for n, x in zip("qkv", quantize_batch(b, QuantMode.PER_TENSOR))}
        out = hstu_attn_varlen_func(*(pq[n].data for n in "qkv"), **args, func=func, descale_q=pq["q"].scale,
                                    descale_k=pq["k"].scale, descale_v=pq["v"].scale)
        emul = reference.hstu_attn_reference(*(pq[n].data.float() * pq[n].scale for n in "qkv"), **args, func=func,
                                             compute_dtype=torch.float32, p_round=lambda p, _: reference.cast_p_e4m3(p))
        ok, err, emul_err = reference.ratio_check(out, exact, emul, 2.0)
        assert ok, f"[{case}] out: kernel err {err:.3e} > 2 x emulation err {emul_err:.3e}"
        return
    if fused:
        monkeypatch.setattr(launch.heuristics, "FP8_FUSED_BY_DEFAULT", True)
        assert fp8_backward_fused(head_dim, recipe(mode), max(lengths_k), False, False, False)
    dout = (torch.randn(b["q"].shape, generator=gen) * 1e-2).to(dtype).cuda()
    q, k, v = (b[n].detach().clone().requires_grad_() for n in "qkv")
    out = hstu_attn_varlen_func(q, k, v, **args, func=func, quant_mode=mode)
    out.backward(dout)
    emul_out = reference.hstu_attn_fp8_emulation(b["q"], b["k"], b["v"], **args, func=func, quant_mode=mode)
    ok, err, emul_err = reference.ratio_check(out.detach(), exact, emul_out, 2.0)
    assert ok, f"[{case}] out: kernel err {err:.3e} > 2 x emulation err {emul_err:.3e}"
    grad_args = dict(args, func=func, quant_mode=mode, fused_dq=fused)
    emul = reference.hstu_attn_fp8_grad_emulation(b["q"], b["k"], b["v"], dout, **grad_args)
    exact_grads = reference.hstu_attn_fp8_grad_emulation(b["q"], b["k"], b["v"], dout, **grad_args,
                                                         quantize_inputs=False, round_products=False)
    for name, got in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        ok, err, emul_err = reference.ratio_check(got, exact_grads[name], emul[name], 5.0)
        assert ok, f"[{case}] {name}: kernel err {err:.3e} > 5 x emulation err {emul_err:.3e}"
