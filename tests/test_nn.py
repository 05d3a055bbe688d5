"""hstu_cute.nn on CPU: HSTUAttention and HSTUBlock against their plain-PyTorch references, the
argument errors, the one-time CPU warning, meta tensors (the kernel path's shapes without a
launch) and the exactness of zero-padding head dims."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from hstu_cute import nn as hnn
from hstu_cute import reference
from hstu_cute.testing import random_jagged_batch

F64 = torch.float64


@pytest.fixture(autouse=True)
def _quiet_reference_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hstu_cute: CPU tensors run the PyTorch reference")
        yield


def _jagged(lengths=(9, 0, 1, 6), heads=2, head_dim=8, dtype=F64, seed=0, **kw):
    return random_jagged_batch(len(lengths), heads, head_dim, max(lengths), lengths=list(lengths), dtype=dtype,
                               seed=seed, **kw)


def _offsets(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


# --------------------------------------------------------------------------------------------
# HSTUAttention
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["causal", "ctx+tgt+rab", "local", "none", "tgt-groups"])
def test_attention_module_matches_the_oracle(case):
    kw = {"causal": dict(window_size=(-1, 0)),
          "ctx+tgt+rab": dict(window_size=(-1, 0), num_contexts=2, num_targets=3, rab_heads=2),
          "local": dict(window_size=(2, 1)),
          "none": dict(window_size=(-1, -1)),
          "tgt-groups": dict(window_size=(-1, 0), num_targets=4, target_group_size=2)}[case]
    b = _jagged(alpha=0.7, **kw)
    module = hnn.HSTUAttention(alpha=0.7, window=b["window_size"], target_group_size=b["target_group_size"],
                               scaling_seqlen=13)
    out = module(b["q"], b["k"], b["v"], b["seq_offsets_q"], b["max_seqlen_q"], b["num_contexts"],
                 b["num_targets"], b["rab"])
    expected = reference.hstu_attn_reference(**dict(b, scaling_seqlen=13), compute_dtype=F64)
    assert out.shape == b["q"].shape and out.dtype == F64
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert out.abs().max() > 0


def test_attention_module_defaults_to_causal_and_max_seqlen_divisor():
    b = _jagged(window_size=(-1, 0))
    out = hnn.HSTUAttention()(b["q"], b["k"], b["v"], b["seq_offsets_q"], b["max_seqlen_q"])
    torch.testing.assert_close(out, reference.hstu_attn_reference(**b, compute_dtype=F64), rtol=0, atol=1e-12)
    # S = max_seqlen: doubling it halves the output (docs/operator.md, "The output is divided by S").
    doubled = hnn.HSTUAttention()(b["q"], b["k"], b["v"], b["seq_offsets_q"], 2 * b["max_seqlen_q"])
    torch.testing.assert_close(doubled, out / 2, rtol=1e-12, atol=1e-12)


def test_bf16_attention_on_cpu_rounds_like_the_kernel():
    b = _jagged(dtype=torch.bfloat16, window_size=(-1, 0), num_targets=2)
    out = hnn.hstu_attention(b["q"], b["k"], b["v"], b["seq_offsets_q"], b["max_seqlen_q"],
                             num_targets=b["num_targets"])
    same = reference.hstu_attn_reference(**b, compute_dtype=None)
    assert out.dtype == torch.bfloat16 and torch.equal(out, same)


def test_cpu_warning_is_issued_once(monkeypatch):
    monkeypatch.setattr(hnn, "_reference_warned", False)
    b = _jagged()
    args = (b["q"], b["k"], b["v"], b["seq_offsets_q"], b["max_seqlen_q"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hnn.hstu_attention(*args)
        hnn.hstu_attention(*args)
        hnn.hstu_attention(*args, backend="reference")  # asked for explicitly: no warning
    messages = [str(w.message) for w in caught if "PyTorch reference" in str(w.message)]
    assert len(messages) == 1 and "CPU tensors" in messages[0]


def test_int64_indices_and_gradients_including_rab():
    b = _jagged(window_size=(-1, 0), num_contexts=2, num_targets=2, rab_heads=1)
    q, k, v, rab = (b[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "rab"))
    out = hnn.hstu_attention(q, k, v, b["seq_offsets_q"].long(), b["max_seqlen_q"],
                             num_contexts=b["num_contexts"].long(), num_targets=b["num_targets"].long(), rab=rab)
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = reference.reference_grads(**b, dout=dout, compute_dtype=F64)
    for name, t in (("dq", q), ("dk", k), ("dv", v), ("drab", rab)):
        torch.testing.assert_close(t.grad, grads[name], rtol=0, atol=1e-12)
    assert rab.grad.abs().max() > 0


def test_rab_gets_no_gradient_without_has_drab():
    b = _jagged(rab_heads=2)
    rab = b["rab"].clone().requires_grad_(True)
    q = b["q"].clone().requires_grad_(True)
    hnn.hstu_attention(q, b["k"], b["v"], b["seq_offsets_q"], b["max_seqlen_q"], rab=rab, has_drab=False).sum().backward()
    assert q.grad is not None and rab.grad is None


def test_quant_mode_on_the_reference_path_is_refused():
    b = _jagged()
    with pytest.raises(NotImplementedError, match=r"quant_mode: .*expected -1, got 1"):
        hnn.HSTUAttention(quant_mode=1)(b["q"], b["k"], b["v"], b["seq_offsets_q"], b["max_seqlen_q"])


def test_kernel_backend_refuses_cpu_tensors_naming_the_device():
    b = _jagged(dtype=torch.bfloat16, head_dim=32)
    with pytest.raises(ValueError, match=r"q\.device: expected a CUDA device"):
        hnn.hstu_attention(b["q"], b["k"], b["v"], b["seq_offsets_q"], b["max_seqlen_q"], backend="kernel")


@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(alpha=float("nan")), ValueError, r"alpha: expected a finite Python float, got nan"),
    (dict(alpha="0.5"), TypeError, r"alpha: expected a finite Python float, got '0.5'"),
    (dict(window=(1, 2, 3)), TypeError, r"window: expected a \(left, right\) pair of ints"),
    (dict(scaling_seqlen=0), ValueError, r"scaling_seqlen: expected -1 .* or an int >= 1, got 0"),
    (dict(deterministic=1), TypeError, r"deterministic: expected a bool, got int"),
    (dict(quant_mode=6), ValueError, r"quant_mode: expected an int in -1..5 .*, got 6"),
    (dict(target_group_size=0), ValueError, r"target_group_size: expected an int >= 1, got 0"),
    (dict(backend="triton"), ValueError, r"backend: expected one of .*'reference'.*, got 'triton'"),
])
def test_attention_module_setting_errors(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        hnn.HSTUAttention(**kwargs)


def test_attention_call_errors_name_the_argument():
    b = _jagged()
    q, k, v, offs = b["q"], b["k"], b["v"], b["seq_offsets_q"]
    attn = hnn.HSTUAttention()
    cases = [
        ((q[0], k, v, offs, 9), ValueError, r"q: expected a 3-D tensor .*, got shape \(2, 8\)"),
        ((q, k[:-1], v, offs, 9), ValueError, r"k\.shape: expected \(16, H_kv, 8\) with H_kv dividing 2 .*, "
         r"got \(15, 2, 8\)"),
        ((q, k, v[:, :1], offs, 9), ValueError, r"v\.shape\[:2\]: expected \(16, 2\) .*, got \(16, 1\)"),
        ((q, k.float(), v, offs, 9), TypeError, r"k/v dtype: expected torch.float64"),
        ((q, k, v, offs.float(), 9), TypeError, r"seq_offsets\.dtype: expected torch.int32 or torch.int64"),
        ((q, k, v, offs[:1], 9), ValueError, r"seq_offsets: expected a 1-D tensor of length B\+1 >= 2, got \(1,\)"),
        ((q, k, v, offs, 9.0), TypeError, r"max_seqlen: expected a Python int >= 0, got 9.0"),
        ((q, k, v, offs, -1), ValueError, r"max_seqlen: expected a Python int >= 0, got -1"),
        ((q, k, v, offs.to("meta"), 9), ValueError, r"seq_offsets\.device: expected cpu"),
    ]
    for args, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            attn(*args)


def test_meta_tensors_take_the_kernel_path_and_give_shapes():
    T, H = 17, 2
    offs = torch.empty(4, dtype=torch.int32, device="meta")

    def meta(d):
        return torch.empty(T, H, d, dtype=torch.bfloat16, device="meta")

    assert hnn.HSTUAttention()(meta(64), meta(64), meta(64), offs, 9).shape == (T, H, 64)
    # A value head dim other than q's, and a head dim between the built ones: padded, then sliced.
    out = hnn.HSTUAttention()(meta(48), meta(48), meta(24), offs, 9)
    assert out.shape == (T, H, 24) and out.device.type == "meta"
    with pytest.raises(ValueError, match=r"head dim\): expected one of \(32, 64, 96, 128, 192, 256\), got 320"):
        hnn.HSTUAttention()(meta(320), meta(320), meta(320), offs, 9)


@pytest.mark.parametrize("head_dim,value_dim", [(8, 24), (40, 40), (64, 16)])
def test_zero_padding_the_head_dims_is_exact(head_dim, value_dim):
    gen = torch.Generator().manual_seed(3)
    lengths = [7, 3]
    T = sum(lengths)
    q, k = (torch.randn(T, 2, head_dim, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(T, 2, value_dim, generator=gen, dtype=F64)
    offs = _offsets(lengths)
    padded_q, padded_k, padded_v, dv = hnn.pad_head_dims(q, k, v)
    width = hnn.kernel_head_dim(head_dim, value_dim)
    assert dv == value_dim and padded_q.shape[2] == padded_k.shape[2] == padded_v.shape[2] == width
    expected = hnn.hstu_attention_reference(q, k, v, offs, 7, num_targets=torch.tensor([2, 1], dtype=torch.int32))
    got = hnn.hstu_attention_reference(padded_q, padded_k, padded_v, offs, 7,
                                       num_targets=torch.tensor([2, 1], dtype=torch.int32))[..., :value_dim]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_pad_head_dims_to_the_kernels_that_run():
    """16-bit kernels take D96 and D192; FP8's only 64, 128 and 256 (hstu_attention passes
    FP8_HEAD_DIMS when quant_mode != -1), so a head dim the 16-bit kernels serve can still need
    padding for FP8."""
    from hstu_cute.variants import FP8_HEAD_DIMS

    def width(d, **kw):
        x = torch.empty(3, 2, d)
        return hnn.pad_head_dims(x, x, x, **kw)[0].shape[2]

    assert [width(d) for d in (32, 80, 96, 100, 192)] == [32, 96, 96, 128, 192]
    assert [width(d, built=FP8_HEAD_DIMS) for d in (32, 80, 96, 100, 192)] == [64, 128, 128, 128, 256]


def test_fp8_through_the_module_pads_to_an_fp8_head_dim(monkeypatch):
    """On meta tensors with the Hopper kernels forced: an 80- or 96-wide head with quant_mode=2
    validates (padded to 128), as before D96 existed; in 16 bits D96 runs as it is."""
    monkeypatch.setenv("HSTU_CUTE_ARCH", "sm_90a")
    offs = torch.empty(4, dtype=torch.int32, device="meta")

    def meta(d):
        return torch.empty(9, 2, d, dtype=torch.bfloat16, device="meta")

    for d in (80, 96):
        assert hnn.hstu_attention(meta(d), meta(d), meta(d), offs, 9, quant_mode=2).shape == (9, 2, d)
    assert hnn.hstu_attention(meta(96), meta(96), meta(96), offs, 9).shape == (9, 2, 96)


def test_pad_head_dims_leaves_built_dims_alone():
    q = torch.empty(3, 2, 64)
    assert all(a is b for a, b in zip(hnn.pad_head_dims(q, q, q)[:3], (q, q, q)))


# --------------------------------------------------------------------------------------------
# HSTUBlock
# --------------------------------------------------------------------------------------------

LENGTHS = (9, 0, 1, 6, 12)


def _block_inputs(d_model=24, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(LENGTHS), d_model, generator=gen).to(dtype)
    targets = torch.tensor([2, 0, 1, 0, 3], dtype=torch.int32)
    contexts = torch.tensor([1, 0, 0, 2, 2], dtype=torch.int32)
    return x, _offsets(LENGTHS), targets, contexts


def _block(**kw):
    torch.manual_seed(0)
    block = hnn.HSTUBlock(24, 3, 8, **kw)
    with torch.no_grad():  # non-trivial norms, so the test sees their parameters
        for p in (block.input_norm.weight, block.output_norm.weight, block.output_norm.bias):
            p.add_(torch.rand_like(p) * 0.5)
    return block


@pytest.mark.parametrize("hidden_dim", [None, 5])
def test_block_matches_its_reference_forward_and_backward(hidden_dim):
    block = _block(hidden_dim=hidden_dim).double()
    x, offs, targets, contexts = _block_inputs()
    x = x.double().requires_grad_(True)
    rab = torch.randn(len(LENGTHS), 1, 12, 12, dtype=F64, generator=torch.Generator().manual_seed(5),
                      requires_grad=True)
    out = block(x, offs, 12, contexts, targets, rab)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, rab, *block.parameters()], dout)
    ref = hnn.hstu_block_reference(block, x, offs, 12, contexts, targets, rab, compute_dtype=None)
    ref_grads = torch.autograd.grad(ref, [x, rab, *block.parameters()], dout)
    assert out.shape == x.shape == (sum(LENGTHS), 24)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for (name, _), g, r in zip([("x", 0), ("rab", 0), *block.named_parameters()], grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12, msg=name)
        assert r.abs().max() > 0, f"gradient of {name} is zero: the comparison would be vacuous"


def test_block_reference_is_the_documented_math():
    """hstu_block_reference written out once more with explicit ops, so a wrong reference
    (wrong SiLU placement, missing residual, norm on the wrong tensor) fails here."""
    block = _block().double()
    x, offs, targets, _ = _block_inputs()
    x = x.double()
    H, d = 3, 8
    h = torch.nn.functional.layer_norm(x, (24,), block.input_norm.weight, block.input_norm.bias, 1e-6)
    proj = h @ block.uvqk.weight.t() + block.uvqk.bias
    u, v, q, k = proj[:, :24], proj[:, 24:48], proj[:, 48:72], proj[:, 72:]
    a = torch.zeros(x.shape[0], H, d, dtype=F64)
    offsets = offs.tolist()
    for b in range(len(LENGTHS)):
        s, e = offsets[b], offsets[b + 1]
        L, t = e - s, int(targets[b])
        for i in range(L):
            for j in range(L):
                history_end = L - t
                allowed = j <= i and not (i >= history_end and j >= history_end and j != i)
                if allowed:
                    qi, kj, vj = (z[s + n].view(H, d) for z, n in ((q, i), (k, j), (v, j)))
                    z = (qi * kj).sum(-1) / math.sqrt(d)
                    a[s + i] += (z * torch.sigmoid(z))[:, None] * vj / 12
    norm = torch.nn.functional.layer_norm(a.reshape(-1, 24), (24,), block.output_norm.weight,
                                          block.output_norm.bias, 1e-6)
    expected = x + (torch.nn.functional.silu(u) * norm) @ block.output.weight.t()
    torch.testing.assert_close(hnn.hstu_block_reference(block, x, offs, 12, num_targets=targets), expected,
                               rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(block(x, offs, 12, num_targets=targets), expected, rtol=1e-10, atol=1e-10)


def test_block_trains_on_cpu():
    block = _block()
    x, offs, targets, _ = _block_inputs()
    goal = torch.randn_like(x, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.Adam(block.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = (block(x, offs, 12, num_targets=targets) - goal).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_block_dropout_only_in_training():
    block = _block(dropout=0.5)
    x, offs, _, _ = _block_inputs()
    block.eval()
    torch.testing.assert_close(block(x, offs, 12), hnn.hstu_block_reference(block, x, offs, 12),
                               rtol=1e-5, atol=1e-5)
    block.train()
    assert not torch.allclose(block(x, offs, 12), block(x, offs, 12))


def test_block_fp32_on_the_kernel_path_casts_to_the_attention_dtype():
    """An fp32 model without autocast: q, k, v reach the kernel in bf16 (meta: shapes, dtypes)."""
    seen = {}
    block = hnn.HSTUBlock(64, 2, 32, device="meta")

    def spy(module, args, kwargs):
        seen["dtype"] = args[0].dtype

    block.attention.register_forward_pre_hook(spy, with_kwargs=True)
    x = torch.empty(17, 64, device="meta")
    out = block(x, torch.empty(4, dtype=torch.int32, device="meta"), 9)
    assert seen["dtype"] == torch.bfloat16 and out.dtype == torch.float32 and out.shape == (17, 64)


def test_block_compiles_fullgraph_on_meta_tensors():
    """The block traces as one graph, forward and backward (the op is a node); meta tensors carry
    it without a GPU."""
    torch._dynamo.reset()
    block = hnn.HSTUBlock(64, 2, 32, device="meta", dtype=torch.bfloat16)
    x = torch.empty(17, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.empty(4, dtype=torch.int32, device="meta")
    targets = torch.empty(3, dtype=torch.int32, device="meta")
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x, offs, 9, num_targets=targets)
    out.sum().backward()
    assert out.shape == (17, 64) and x.grad.shape == (17, 64) and block.uvqk.weight.grad is not None
    torch._dynamo.reset()


@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(d_model=0, num_heads=2, head_dim=8), ValueError, r"d_model: expected an int >= 1, got 0"),
    (dict(d_model=8, num_heads=2.0, head_dim=8), ValueError, r"num_heads: expected an int >= 1, got 2.0"),
    (dict(d_model=8, num_heads=2, head_dim=8, hidden_dim=0), ValueError, r"hidden_dim: expected an int >= 1"),
    (dict(d_model=8, num_heads=2, head_dim=8, dropout=1.0), ValueError, r"dropout: expected a float in \[0, 1\)"),
    (dict(d_model=8, num_heads=2, head_dim=8, attention_dtype=torch.float32), TypeError,
     r"attention_dtype: expected torch.bfloat16 or torch.float16, got torch.float32"),
    (dict(d_model=8, num_heads=2, head_dim=8, window=(0,)), TypeError, r"window: expected a \(left, right\)"),
])
def test_block_constructor_errors(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        hnn.HSTUBlock(**kwargs)


def test_block_input_errors():
    block = _block()
    x, offs, _, _ = _block_inputs()
    with pytest.raises(ValueError, match=r"x\.shape: expected \(T, 24\) .*, got \(28, 23\)"):
        block(x[:, :23], offs, 12)
    with pytest.raises(TypeError, match=r"x: expected a torch.Tensor, got list"):
        block([1.0], offs, 12)


def test_block_deepcopy_keeps_settings():
    block = _block(window=(3, 0), scaling_seqlen=20, deterministic=True)
    clone = copy.deepcopy(block)
    assert clone.attention.window == (3, 0) and clone.attention.scaling_seqlen == 20
    assert clone.attention.deterministic and abs(clone.attention.alpha - 1 / math.sqrt(8)) < 1e-12
