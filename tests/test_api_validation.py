"""Argument checks of ``hstu_attn_varlen_func`` (spec section 1), on CPU.

Every check of ``hstu_cute.validation.validate`` gets a case: the exception type, and a message that
names the argument and contains both the expected and the actual value. The "must be a CUDA
device" check is the last one, so every other check is reachable with CPU tensors; device
mismatches use ``device="meta"`` tensors for the odd one out. Each case goes through the public
function with the compile and launch paths replaced by stubs that fail the test, so the error is
proven to come before anything is compiled or launched.
"""

from __future__ import annotations

import pytest
import torch

import hstu_cute
from hstu_cute import api, arch, masks, validation, variants
from hstu_cute.call import Call

B, H, D, L = 2, 2, 64, 8  # two sequences of length <= 8
BF16, FP16 = torch.bfloat16, torch.float16


def _t(*shape, dtype=BF16, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


def _i32(vals, device="cpu", dtype=torch.int32):
    return torch.tensor(vals, dtype=dtype, device=device)


def _noncontig_last(*shape, dtype=BF16):
    """A tensor of ``shape`` whose last dim has stride 2."""
    return torch.zeros(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]


def base_args(**overrides):
    """A fully valid call on CPU tensors (only the final device check fails)."""
    args = dict(
        q=_t(16, H, D), k=_t(16, H, D), v=_t(16, H, D),
        seq_offsets_q=_i32([0, 8, 14]), seq_offsets_k=_i32([0, 8, 14]),
        max_seqlen_q=L, max_seqlen_k=L,
        num_contexts=None, num_targets=None, target_group_size=1, window_size=(-1, -1), alpha=1.0,
        rab=None, has_drab=False, is_delta_q=False,
        descale_q=None, descale_k=None, descale_v=None, descale_do=None,
        quant_mode=-1, scaling_seqlen=-1, seqused_q=None, seqused_k=None,
    )  # fmt: skip
    args.update(overrides)
    return args


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything gets compiled or launched."""
    import hstu_cute.compile

    def boom(*a, **k):
        raise AssertionError("validation must fail before anything is compiled or launched")

    monkeypatch.setattr(api, "forward", boom)
    monkeypatch.setattr(hstu_cute.compile, "build", boom)
    monkeypatch.delenv("HSTU_CUTE_CHECK", raising=False)


def _check_message(exc: BaseException, name: str, expected: str, actual: str) -> None:
    msg = str(exc)
    assert msg.startswith(f"{name}:"), f"message should start with the argument {name!r}: {msg!r}"
    assert "expected" in msg and expected in msg, f"expected value {expected!r} missing from {msg!r}"
    assert "got" in msg and actual in msg.split("got", 1)[1], f"actual value {actual!r} missing from {msg!r}"


# (id, overrides(base) -> dict, exception, argument name, expected text, actual text)
CASES = [
    # q, k, v: tensors of a 16-bit dtype, 3-D, last dim contiguous
    ("q-not-tensor", lambda a: dict(q=[[0.0]]), TypeError, "q", "a torch.Tensor", "list"),
    ("k-not-tensor", lambda a: dict(k=None), TypeError, "k", "a torch.Tensor", "NoneType"),
    ("v-not-tensor", lambda a: dict(v="v"), TypeError, "v", "a torch.Tensor", "str"),
    ("q-dtype-fp64", lambda a: dict(q=a["q"].double(), k=a["k"].double(), v=a["v"].double()), TypeError, "q",
     "dtype torch.bfloat16, torch.float16 or torch.float8_e4m3fn", "torch.float64"),
    ("q-fp32-with-bf16-keys", lambda a: dict(q=a["q"].float()), TypeError, "q",
     "dtype torch.bfloat16, torch.float16 or torch.float8_e4m3fn", "torch.float32"),
    ("k-dtype-int8", lambda a: dict(k=a["k"].to(torch.int8)), TypeError, "k",
     "dtype torch.bfloat16, torch.float16 or torch.float8_e4m3fn", "torch.int8"),
    ("v-dtype-fp64", lambda a: dict(v=a["v"].double()), TypeError, "v",
     "dtype torch.bfloat16, torch.float16 or torch.float8_e4m3fn", "torch.float64"),
    ("q-2d", lambda a: dict(q=_t(16, D)), ValueError, "q", "a 3-D tensor", "2-D shape (16, 64)"),
    ("k-4d", lambda a: dict(k=_t(16, H, D, 1)), ValueError, "k", "a 3-D tensor", "4-D shape (16, 2, 64, 1)"),
    ("q-stride", lambda a: dict(q=_noncontig_last(16, H, D)), ValueError, "q.stride(-1)", "1 (last dim contiguous)",
     "2"),
    ("v-stride", lambda a: dict(v=_noncontig_last(16, H, D)), ValueError, "v.stride(-1)", "1 (last dim contiguous)",
     "2"),
    ("kv-dtype-mismatch", lambda a: dict(k=a["k"].half()), TypeError, "k/v dtype", "torch.bfloat16 (same as q)",
     "k torch.float16"),
    ("v-dtype-mismatch", lambda a: dict(v=a["v"].half()), TypeError, "k/v dtype", "torch.bfloat16 (same as q)",
     "v torch.float16"),
    ("head-dim-48", lambda a: dict(q=_t(16, H, 48), k=_t(16, H, 48), v=_t(16, H, 48)), ValueError,
     "q.shape[2] (head dim)", "one of (32, 64, 96, 128, 192, 256)", "48"),
    ("head-dim-512", lambda a: dict(q=_t(16, H, 512), k=_t(16, H, 512), v=_t(16, H, 512)), ValueError,
     "q.shape[2] (head dim)", "one of (32, 64, 96, 128, 192, 256)", "512"),
    ("k-heads", lambda a: dict(k=_t(16, 3, D)), ValueError, "k.shape[1] (heads)",
     "2 (q's heads), or a divisor of them for GQA / MQA with 16-bit k and v, without a paged cache", "3"),
    ("v-heads-gqa", lambda a: dict(k=_t(16, 1, D)), ValueError, "k.shape[1] (heads)",
     "2 (q's heads), or a divisor of them for GQA / MQA with 16-bit k and v, without a paged cache", "1"),
    ("k-head-dim", lambda a: dict(k=_t(16, H, 32)), ValueError, "k.shape[2] (head dim)", "64 (q's head dim)", "32"),
    ("v-head-dim", lambda a: dict(v=_t(16, H, 32)), ValueError, "v.shape[1:]", "(2, 64)", "(2, 32)"),
    ("v-heads", lambda a: dict(v=_t(16, 1, D)), ValueError, "v.shape[1:]", "(2, 64)", "(1, 64)"),
    ("v-tokens", lambda a: dict(v=_t(15, H, D)), ValueError, "v.shape[0]", "16 (k's tokens)", "15"),
    # one device
    ("k-device", lambda a: dict(k=_t(16, H, D, device="meta")), ValueError, "k.device", "cpu (same as q)", "meta"),
    ("v-device", lambda a: dict(v=_t(16, H, D, device="meta")), ValueError, "v.device", "cpu (same as q)", "meta"),
    # offsets: int32, 1-D, B+1 >= 2, same device, same length
    ("offq-not-tensor", lambda a: dict(seq_offsets_q=[0, 8, 14]), TypeError, "seq_offsets_q", "a torch.Tensor",
     "list"),
    ("offk-not-tensor", lambda a: dict(seq_offsets_k=(0, 8, 14)), TypeError, "seq_offsets_k", "a torch.Tensor",
     "tuple"),
    ("offq-int64", lambda a: dict(seq_offsets_q=_i32([0, 8, 14], dtype=torch.int64)), TypeError, "seq_offsets_q",
     "dtype torch.int32", "torch.int64"),
    ("offk-float", lambda a: dict(seq_offsets_k=_i32([0, 8, 14], dtype=torch.float32)), TypeError, "seq_offsets_k",
     "dtype torch.int32", "torch.float32"),
    ("offq-len1", lambda a: dict(seq_offsets_q=_i32([0])), ValueError, "seq_offsets_q",
     "a 1-D tensor of length B+1 >= 2", "(1,)"),
    ("offk-2d", lambda a: dict(seq_offsets_k=_i32([[0, 8, 14]])), ValueError, "seq_offsets_k",
     "a 1-D tensor of length B+1 >= 2", "(1, 3)"),
    ("offq-device", lambda a: dict(seq_offsets_q=_i32([0, 8, 14], device="meta")), ValueError,
     "seq_offsets_q.device", "cpu (same as q)", "meta"),
    ("offk-device", lambda a: dict(seq_offsets_k=_i32([0, 8, 14], device="meta")), ValueError,
     "seq_offsets_k.device", "cpu (same as q)", "meta"),
    ("offk-batch", lambda a: dict(seq_offsets_k=_i32([0, 4, 8, 14])), ValueError, "seq_offsets_k.shape[0]",
     "3 (same B+1 as seq_offsets_q)", "4"),
    # max_seqlen: Python ints, q <= k, q < k only with delta_q
    ("maxq-float", lambda a: dict(max_seqlen_q=8.0), TypeError, "max_seqlen_q", "a Python int", "float 8.0"),
    ("maxk-tensor", lambda a: dict(max_seqlen_k=torch.tensor(8)), TypeError, "max_seqlen_k", "a Python int",
     "Tensor"),
    ("maxq-bool", lambda a: dict(max_seqlen_q=True), TypeError, "max_seqlen_q", "a Python int", "bool True"),
    ("maxq-negative", lambda a: dict(max_seqlen_q=-1), ValueError, "max_seqlen_q", "an int >= 0", "-1"),
    ("maxk-negative", lambda a: dict(max_seqlen_q=0, max_seqlen_k=-3), ValueError, "max_seqlen_k", "an int >= 0",
     "-3"),
    ("maxq-gt-maxk", lambda a: dict(max_seqlen_q=9), ValueError, "max_seqlen_q", "<= max_seqlen_k (8)", "9"),
    ("deltaq-not-bool", lambda a: dict(is_delta_q=1), TypeError, "is_delta_q", "a bool", "int"),
    ("maxq-lt-maxk-without-deltaq", lambda a: dict(max_seqlen_q=4), ValueError, "max_seqlen_q",
     "== max_seqlen_k (8) unless is_delta_q=True", "4"),
    # (B,) int32 vectors
    *[
        case
        for name in ("num_contexts", "num_targets", "seqused_q", "seqused_k")
        for case in (
            (f"{name}-not-tensor", lambda a, n=name: {n: [1, 2]}, TypeError, name, "a torch.Tensor or None", "list"),
            (f"{name}-int64", lambda a, n=name: {n: _i32([1, 2], dtype=torch.int64)}, TypeError, name,
             "dtype torch.int32", "torch.int64"),
            (f"{name}-shape", lambda a, n=name: {n: _i32([1, 2, 3])}, ValueError, name,
             "shape (2,) (one entry per sequence)", "(3,)"),
            (f"{name}-2d", lambda a, n=name: {n: _i32([[1, 2]])}, ValueError, name,
             "shape (2,) (one entry per sequence)", "(1, 2)"),
            (f"{name}-device", lambda a, n=name: {n: _i32([1, 2], device="meta")}, ValueError, name,
             "device cpu (same as q)", "meta"),
        )
    ],
    # target_group_size, window_size, masks
    ("group-zero", lambda a: dict(target_group_size=0), ValueError, "target_group_size", "an int >= 1", "0"),
    ("group-float", lambda a: dict(target_group_size=1.5), TypeError, "target_group_size", "a Python int",
     "float 1.5"),
    ("window-len1", lambda a: dict(window_size=(-1,)), TypeError, "window_size", "a (left, right) pair of ints",
     "(-1,)"),
    ("window-float", lambda a: dict(window_size=(4.0, 0)), TypeError, "window_size", "a (left, right) pair of ints",
     "(4.0, 0)"),
    ("window-str", lambda a: dict(window_size="causal"), TypeError, "window_size", "a (left, right) pair of ints",
     "'causal'"),
    ("context-needs-causal", lambda a: dict(num_contexts=_i32([1, 1])), ValueError, "window_size",
     "the causal window (-1, 0) or a causal band (WL >= 0, 0) when num_contexts is given", "(-1, -1)"),
    ("target-needs-causal-band", lambda a: dict(num_targets=_i32([1, 1]), window_size=(2, 3)), ValueError,
     "window_size", "the causal window (-1, 0) or a causal band (WL >= 0, 0) when num_targets is given", "(2, 3)"),
    # alpha, scaling_seqlen
    ("alpha-str", lambda a: dict(alpha="1"), TypeError, "alpha", "a finite Python float", "'1'"),
    ("alpha-bool", lambda a: dict(alpha=True), TypeError, "alpha", "a finite Python float", "True"),
    ("alpha-nan", lambda a: dict(alpha=float("nan")), ValueError, "alpha", "a finite Python float", "nan"),
    ("alpha-inf", lambda a: dict(alpha=float("inf")), ValueError, "alpha", "a finite Python float", "inf"),
    ("scaling-float", lambda a: dict(scaling_seqlen=8.0), TypeError, "scaling_seqlen", "a Python int", "float 8.0"),
    ("scaling-zero", lambda a: dict(scaling_seqlen=0), ValueError, "scaling_seqlen",
     "-1 (use max_seqlen_q) or an int >= 1", "0"),
    ("scaling-negative", lambda a: dict(scaling_seqlen=-2), ValueError, "scaling_seqlen",
     "-1 (use max_seqlen_q) or an int >= 1", "-2"),
    # rab / has_drab
    ("has_drab-not-bool", lambda a: dict(has_drab=1), TypeError, "has_drab", "a bool", "int"),
    ("has_drab-without-rab", lambda a: dict(has_drab=True), ValueError, "has_drab", "False when rab is None", "True"),
    ("rab-not-tensor", lambda a: dict(rab=[[0.0]]), TypeError, "rab", "a torch.Tensor or None", "list"),
    ("rab-dtype", lambda a: dict(rab=_t(B, 1, L, L, dtype=FP16)), TypeError, "rab.dtype",
     "torch.bfloat16 (same as q)", "torch.float16"),
    ("rab-3d", lambda a: dict(rab=_t(B, L, L)), ValueError, "rab",
     "a 4-D tensor (B, H_rab, max_seqlen_k, max_seqlen_k)", "(2, 8, 8)"),
    ("rab-batch", lambda a: dict(rab=_t(3, 1, L, L)), ValueError, "rab.shape[0]", "2 (the batch size)", "3"),
    ("rab-heads", lambda a: dict(rab=_t(B, 3, L, L)), ValueError, "rab.shape[1] (H_rab)", "1 or 2", "3"),
    ("rab-too-small", lambda a: dict(rab=_t(B, 1, L - 1, L)), ValueError, "rab.shape[2:]", "at least (8, 8)",
     "(7, 8)"),
    ("rab-too-narrow", lambda a: dict(rab=_t(B, H, L, L - 2)), ValueError, "rab.shape[2:]", "at least (8, 8)",
     "(8, 6)"),
    ("rab-stride", lambda a: dict(rab=_noncontig_last(B, 1, L, L)), ValueError, "rab.stride(-1)",
     "1 (last dim contiguous)", "2"),
    ("rab-device", lambda a: dict(rab=_t(B, 1, L, L, device="meta")), ValueError, "rab.device", "cpu (same as q)",
     "meta"),
    # quant_mode (range; 0..5 are FP8, tested below)
    ("quant-mode-str", lambda a: dict(quant_mode="0"), TypeError, "quant_mode", "a Python int", "str '0'"),
    ("quant-mode-bool", lambda a: dict(quant_mode=False), TypeError, "quant_mode", "a Python int", "bool False"),
    ("quant-mode-6", lambda a: dict(quant_mode=6), ValueError, "quant_mode", "an int in -1..5", "6"),
    ("quant-mode--2", lambda a: dict(quant_mode=-2), ValueError, "quant_mode", "an int in -1..5", "-2"),
    # last: CUDA device
    ("q-on-cpu", lambda a: {}, ValueError, "q.device", "a CUDA device", "cpu"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_validation_message(case, no_launch):
    _, make, exc_type, name, expected, actual = case
    args = base_args()
    args.update(make(args))
    with pytest.raises(exc_type) as info:
        hstu_cute.hstu_attn_varlen_func(**args)
    assert type(info.value) is exc_type, f"{type(info.value).__name__}: {info.value}"
    _check_message(info.value, name, expected, actual)
    # validate() itself raises the same error (what the public function runs first).
    with pytest.raises(exc_type) as info2:
        validation.validate(**args)
    assert str(info2.value) == str(info.value)


def test_every_argument_combination_valid_except_device(no_launch):
    """Everything optional given and valid: only the (last) device check fails on CPU."""
    args = base_args(
        num_contexts=_i32([1, 0]), num_targets=_i32([2, 3]), target_group_size=2, window_size=(-1, 0),
        alpha=0.5, rab=_t(B, H, L, L), has_drab=True, scaling_seqlen=16,
        seqused_q=_i32([8, 5]), seqused_k=_i32([8, 5]),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"^q\.device: expected a CUDA device .*got cpu$"):
        hstu_cute.hstu_attn_varlen_func(**args)
    # delta_q (Lq < Lk) with a local window and H_rab = 1, fp16
    args = base_args(
        q=_t(6, H, D, dtype=FP16), k=_t(16, H, D, dtype=FP16), v=_t(16, H, D, dtype=FP16),
        seq_offsets_q=_i32([0, 3, 6]), max_seqlen_q=3, is_delta_q=True, window_size=(4, 1),
        rab=_t(B, 1, L, L, dtype=FP16),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"^q\.device: expected a CUDA device"):
        hstu_cute.hstu_attn_varlen_func(**args)
    # delta_q with contexts and targets on contiguous keys (the queries are the last rows, as with
    # a paged cache)
    args = base_args(
        q=_t(6, H, D), seq_offsets_q=_i32([0, 3, 6]), max_seqlen_q=3, is_delta_q=True, window_size=(-1, 0),
        num_contexts=_i32([2, 1]), num_targets=_i32([2, 3]), target_group_size=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"^q\.device: expected a CUDA device"):
        hstu_cute.hstu_attn_varlen_func(**args)


@pytest.mark.parametrize("head_dim", variants.HEAD_DIMS)
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_supported_dtypes_and_head_dims_pass(dtype, head_dim, no_launch):
    args = base_args(q=_t(16, H, head_dim, dtype=dtype), k=_t(16, H, head_dim, dtype=dtype),
                     v=_t(16, H, head_dim, dtype=dtype))
    with pytest.raises(ValueError, match=r"^q\.device:"):
        hstu_cute.hstu_attn_varlen_func(**args)


def test_too_many_sequences_is_not_implemented(no_launch):
    offsets = torch.zeros(validation.MAX_GRID_BATCH + 2, dtype=torch.int32)
    with pytest.raises(NotImplementedError) as info:
        hstu_cute.hstu_attn_varlen_func(**base_args(seq_offsets_q=offsets, seq_offsets_k=offsets))
    msg = str(info.value)
    assert msg.startswith("seq_offsets_q:") and str(validation.MAX_GRID_BATCH) in msg and str(validation.MAX_GRID_BATCH + 1) in msg


# ---------------------------------------------------------------------------------------------
# FP8: pre-quantized e4m3 inputs and quant_mode 0-5 (Hopper forward)
# ---------------------------------------------------------------------------------------------
FP8 = getattr(torch, "float8_e4m3fn", None)
needs_fp8 = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")


def fp8_args(**overrides):
    args = base_args()
    for n in "qkv":
        args[n] = args[n].to(FP8)
    args.update(overrides)
    return args


@needs_fp8
def test_fp8_inputs_pass_validation(no_launch):
    with pytest.raises(ValueError, match=r"^q\.device:"):
        hstu_cute.hstu_attn_varlen_func(**fp8_args(descale_q=torch.ones(1), descale_v=torch.ones(1)))


@needs_fp8
def test_fp8_inputs_must_all_be_e4m3(no_launch):
    args = base_args()
    args["q"] = args["q"].to(FP8)
    with pytest.raises(TypeError) as info:
        hstu_cute.hstu_attn_varlen_func(**args)
    _check_message(info.value, "k.dtype", "torch.float8_e4m3fn for all of q, k, v", "torch.bfloat16")
    with pytest.raises(TypeError) as info:
        hstu_cute.hstu_attn_varlen_func(**fp8_args(q=args["q"].to(torch.float8_e5m2)))
    _check_message(info.value, "q.dtype", "torch.float8_e4m3fn", "torch.float8_e5m2")


@needs_fp8
@pytest.mark.parametrize("case", [
    ("quant-mode-with-fp8", dict(quant_mode=0), ValueError, "quant_mode", "-1 with pre-quantized", "0"),
    ("descale-shape", dict(descale_q=torch.ones(2)), ValueError, "descale_q.shape", "(1,)", "(2,)"),
    ("descale-dtype", dict(descale_k=torch.ones(1, dtype=torch.float16)), TypeError, "descale_k.dtype",
     "torch.float32", "torch.float16"),
    ("descale-type", dict(descale_v=1.0), TypeError, "descale_v", "a torch.Tensor or None", "float"),
    ("rab-dtype", dict(rab=_t(2, 1, L, L, dtype=FP16)), TypeError, "rab.dtype", "torch.bfloat16", "torch.float16"),
], ids=lambda c: c[0])
def test_fp8_argument_errors(case, no_launch):
    _, overrides, exc, name, expected, actual = case
    with pytest.raises(exc) as info:
        hstu_cute.hstu_attn_varlen_func(**fp8_args(**overrides))
    _check_message(info.value, name, expected, actual)


@needs_fp8
def test_fp8_not_built_cases_say_so(no_launch):
    with pytest.raises(NotImplementedError, match="descale_do.*forward-only"):
        hstu_cute.hstu_attn_varlen_func(**fp8_args(descale_do=torch.ones(1)))
    small = {n: _t(16, H, 32, dtype=FP8) for n in "qkv"}
    with pytest.raises(NotImplementedError, match=r"head dim.*\(64, 128, 256\).*32"):
        hstu_cute.hstu_attn_varlen_func(**fp8_args(**small))
    with pytest.raises(NotImplementedError, match="has_drab: pre-quantized.*forward-only"):
        hstu_cute.hstu_attn_varlen_func(**fp8_args(rab=_t(2, 1, L, L, dtype=torch.bfloat16), has_drab=True))


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4, 5])
def test_built_quant_modes_pass_validation(mode, no_launch):
    with pytest.raises(ValueError, match=r"^q\.device:"):
        hstu_cute.hstu_attn_varlen_func(**base_args(quant_mode=mode))


@pytest.mark.parametrize("name", ["descale_q", "descale_k", "descale_v", "descale_do"])
def test_descale_needs_fp8_inputs(name, no_launch):
    with pytest.raises(ValueError) as info:
        hstu_cute.hstu_attn_varlen_func(**base_args(**{name: torch.ones(1)}))
    _check_message(info.value, name, "None unless q, k, v are pre-quantized torch.float8_e4m3fn", "a tensor")


@needs_fp8
@pytest.mark.parametrize("entry", ["prequantized", "mode0", "mode1", "mode2"])
def test_fp8_on_meta_is_shapes_only(entry, no_launch):
    """Meta tensors trace the FP8 op's fake implementation (bf16 out for e4m3 inputs, the inputs'
    dtype for quant_mode). With inputs that require grad, quant modes trace the registered FP8
    backward (hstu_cute::bwd_fp8's fake: gradients shaped and typed like q, k, v); pre-quantized
    inputs raise before any work (forward-only)."""
    args = fp8_args() if entry == "prequantized" else base_args(quant_mode=0, q=_t(16, H, D, dtype=FP16),
                                                                  k=_t(16, H, D, dtype=FP16),
                                                                  v=_t(16, H, D, dtype=FP16))
    args = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    out = hstu_cute.hstu_attn_varlen_func(**args)
    assert out.device.type == "meta" and out.shape == args["q"].shape
    assert out.dtype == (torch.bfloat16 if entry == "prequantized" else FP16)
    if entry == "prequantized":
        with pytest.raises(NotImplementedError, match="pre-quantized.*forward-only"):
            hstu_cute.hstu_attn_varlen_func(**dict(args, q=args["q"].requires_grad_()))
        return
    mode = int(entry[-1])
    args = dict(args, quant_mode=mode)
    q, k, v = (args[n].requires_grad_() for n in "qkv")
    out = hstu_cute.hstu_attn_varlen_func(**args)
    assert out.requires_grad
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert all(g.device.type == "meta" and g.shape == x.shape and g.dtype == x.dtype
               for g, x in ((dq, q), (dk, k), (dv, v)))
    # D256 trains too (two CTAs per key block take half of D each).
    wide = {n: _t(16, H, 256, dtype=FP16).to("meta").requires_grad_() for n in "qkv"}
    dq, dk, dv = torch.autograd.grad(hstu_cute.hstu_attn_varlen_func(**dict(args, **wide)),
                                     tuple(wide.values()), torch.ones(16, H, 256, dtype=FP16, device="meta"))
    assert dq.shape == dk.shape == dv.shape == (16, H, 256)
    # has_drab: the rab gradient comes back shaped and typed like rab (one rab head over H heads too).
    for rab_heads in (H, 1):
        rab = _t(2, rab_heads, L, L, dtype=FP16).to("meta").requires_grad_()
        out = hstu_cute.hstu_attn_varlen_func(**dict(args, rab=rab, has_drab=True))
        dq, drab = torch.autograd.grad(out, (q, rab), torch.ones_like(out))
        assert drab.device.type == "meta" and drab.shape == rab.shape and drab.dtype == rab.dtype


def test_all_on_meta_is_shapes_only(no_launch):
    """Meta tensors pass validation (the device check accepts them) and give a meta output of
    the right shape from the op's fake implementation; nothing is compiled or launched."""
    args = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in base_args().items()}
    out = hstu_cute.hstu_attn_varlen_func(**args)
    assert out.device.type == "meta" and out.shape == args["q"].shape and out.dtype == args["q"].dtype


# ---------------------------------------------------------------------------------------------
# Kernel path selection (HSTU_CUTE_ARCH) and the cubin arch
# ---------------------------------------------------------------------------------------------
def _clear_device_memos():
    # arch memoizes the capability query and the path per device index; mocks must not leak.
    for fn in (arch._kernel_path, arch._arch_of_index):
        fn.cache_clear()


@pytest.fixture
def capability(monkeypatch):
    """``capability(cap)`` mocks torch.cuda.get_device_capability (``None``: must not be called)."""

    def set_cap(cap):
        def fake(device=None):
            if cap is None:
                raise AssertionError("the device capability must not be queried here")
            return cap

        monkeypatch.setattr(torch.cuda, "get_device_capability", fake)
        _clear_device_memos()

    _clear_device_memos()
    yield set_cap
    _clear_device_memos()


CUDA0 = torch.device("cuda", 0)  # never touched: the capability query is mocked


HOPPER_VALUES = ["sm90", "sm_90", "SM90A", "sm_90a", "hopper"]


@pytest.mark.parametrize("value", HOPPER_VALUES)
def test_forced_hopper_path_on_sm90(value, monkeypatch, capability):
    monkeypatch.setenv("HSTU_CUTE_ARCH", value)
    capability((9, 0))
    assert arch.kernel_path(CUDA0) == "hopper"


@pytest.mark.parametrize("value", HOPPER_VALUES)
def test_forced_hopper_path_on_sm80_not_implemented(value, monkeypatch, capability):
    monkeypatch.setenv("HSTU_CUTE_ARCH", value)
    capability((8, 0))
    with pytest.raises(NotImplementedError) as info:
        arch.kernel_path(CUDA0)
    msg = str(info.value)
    assert "HSTU_CUTE_ARCH=sm90" in msg and "9.x" in msg and "8.0" in msg


@pytest.mark.parametrize("cap", [None, (8, 0), (8, 6), (8, 9), (9, 0)])
@pytest.mark.parametrize("value", ["sm80", "sm_80", "sm86", "sm89", "ampere", " SM80 "])
def test_forced_ampere_path(value, cap, monkeypatch, capability):
    """Forcing sm80 works on any device (the capability is not even queried)."""
    monkeypatch.setenv("HSTU_CUTE_ARCH", value)
    capability(cap)
    assert arch.kernel_path(CUDA0) == "ampere"


@pytest.mark.parametrize("value", ["sm70", "blackwell", "90"])
def test_forced_unknown_path_is_value_error(value, monkeypatch, capability):
    monkeypatch.setenv("HSTU_CUTE_ARCH", value)
    capability(None)
    with pytest.raises(ValueError) as info:
        arch.kernel_path(CUDA0)
    msg = str(info.value)
    assert msg.startswith("HSTU_CUTE_ARCH:") and "sm80" in msg and "sm90" in msg
    assert repr(value.strip().lower().replace("_", "")) in msg


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 9)])
def test_default_path_is_ampere_on_sm8x(cap, monkeypatch, capability):
    monkeypatch.delenv("HSTU_CUTE_ARCH", raising=False)
    capability(cap)
    assert arch.kernel_path(CUDA0) == "ampere"


def test_default_path_is_hopper_on_sm90(monkeypatch, capability):
    monkeypatch.delenv("HSTU_CUTE_ARCH", raising=False)
    capability((9, 0))
    assert arch.kernel_path(CUDA0) == "hopper"


def test_pre_ampere_device_not_implemented(monkeypatch, capability):
    monkeypatch.delenv("HSTU_CUTE_ARCH", raising=False)
    capability((7, 5))
    with pytest.raises(NotImplementedError, match=r"compute capability >= 8\.0.*7\.x"):
        arch.kernel_path(CUDA0)


@pytest.mark.parametrize("cap, expected", [((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 9), "sm_89"), ((9, 0), "sm_90a")])
def test_device_arch(cap, expected, capability):
    capability(cap)
    assert arch.device_arch(CUDA0) == expected


# ---------------------------------------------------------------------------------------------
# HSTU_CUTE_CHECK=1: checks on the device data (run here on CPU tensors directly)
# ---------------------------------------------------------------------------------------------
def _problem():
    return validation.Problem(B, H, D, BF16, masks.MaskSpec(masks.MaskKind.CAUSAL, True, True), L, 0, L, 0)


def _device_check(**over):
    a = dict(seq_offsets_q=_i32([0, 8, 14]), seq_offsets_k=_i32([0, 8, 14]), max_seqlen_q=L, max_seqlen_k=L,
             q=_t(16, H, D), k=_t(16, H, D), num_contexts=None, num_targets=None, seqused_q=None, seqused_k=None)
    a.update(over)
    q, k = a.pop("q"), a.pop("k")
    return validation.check_device_data(Call(_problem(), **a), q, k)


def _func(**at):
    """(1, 3, 14 + 256) bounds inside each sequence's keys (8, then 6), the padding garbage;
    ``at``: {(bound, row): value} overrides."""
    func = torch.full((1, 3, 14 + masks.FUNC_ROW_PADDING), -7, dtype=torch.int32)
    func[0, :, :8], func[0, :, 8:14] = 8, 6
    for (i, r), value in at.values():
        func[0, i, r] = value
    return func


def _block_lists(count, index):
    """A BlockMask of B = 1 from raw lists (counts (1, 2) per query block, indices (1, 2, 4))."""
    from hstu_cute import BlockMask

    return BlockMask(torch.tensor([count], dtype=torch.int32), torch.tensor([index], dtype=torch.int32), 16, 16)


def test_device_data_valid_passes():
    _device_check()
    _device_check(func=_func(a=((1, 3), 0), b=((2, 13), 0)))
    _device_check(block_mask=_block_lists([[2, 0]], [[[1, 3, -7, 99], [99, 99, 99, 99]]]))  # garbage past counts
    _device_check(num_contexts=_i32([2, 0]), num_targets=_i32([6, 6]), seqused_q=_i32([8, 0]),
                  seqused_k=_i32([8, 6]))


DEVICE_CASES = [
    ("first-offset", dict(seq_offsets_q=_i32([1, 8, 14])), "seq_offsets_q[0]", "0", "1"),
    ("non-monotone-q", dict(seq_offsets_q=_i32([0, 9, 5]), seq_offsets_k=_i32([0, 9, 5]), max_seqlen_q=9,
                            max_seqlen_k=9), "seq_offsets_q", "non-decreasing offsets", "[0, 9, 5]"),
    ("non-monotone-k", dict(seq_offsets_k=_i32([0, 8, 6])), "seq_offsets_k", "non-decreasing offsets", "[0, 8, 6]"),
    ("past-the-tensor", dict(seq_offsets_k=_i32([0, 8, 16]), k=_t(15, H, D)), "seq_offsets_k[-1]",
     "<= 15 (tokens in the tensor)", "16"),
    ("longer-than-max-q", dict(max_seqlen_q=6, max_seqlen_k=6), "max_seqlen_q", ">= the longest sequence (8)", "6"),
    ("longer-than-max-k", dict(seq_offsets_k=_i32([0, 4, 14])), "max_seqlen_k", ">= the longest sequence (10)",
     "8"),
    ("seqused-too-long", dict(seqused_k=_i32([9, 1])), "seqused_k",
     "0 <= seqused <= offset difference per sequence", "[9, 1]"),
    ("seqused-negative", dict(seqused_q=_i32([1, -1])), "seqused_q",
     "0 <= seqused <= offset difference per sequence", "[1, -1]"),
    ("context-plus-target-too-long", dict(num_contexts=_i32([5, 0]), num_targets=_i32([4, 0])),
     "num_contexts/num_targets", "c + t <= length per sequence", "c=[5, 0] t=[4, 0]"),
    ("targets-past-seqused", dict(num_targets=_i32([3, 3]), seqused_k=_i32([8, 2])),
     "num_contexts/num_targets", "c + t <= length per sequence", "t=[3, 3]"),
    ("targets-alone-too-long", dict(num_targets=_i32([9, 0])), "num_contexts/num_targets",
     "c + t <= length per sequence", "t=[9, 0]"),
    ("negative-context", dict(num_contexts=_i32([-1, 0])), "num_contexts/num_targets", "0 <= c", "c=[-1, 0]"),
    ("func-negative-bound", dict(func=_func(a=((1, 5), -1))), "func[0, 1, 5]", "in [0, 8]", "-1"),
    ("func-past-the-keys", dict(func=_func(a=((0, 9), 7))), "func[0, 0, 9]", "in [0, 6]", "7"),
    ("block-count-too-big", dict(block_mask=_block_lists([[3, 5]], [[[0, 1, 2, 3], [0, 1, 2, 3]]])),
     "block_mask.kv_count[0, 0, 1]", "in [0, 4] (M_k)", "5"),
    ("block-index-out-of-range", dict(block_mask=_block_lists([[2, 1]], [[[0, 4, 1, 1], [3, 9, 9, 9]]])),
     "block_mask.kv_index[0, 0, 0, 1]", "in [0, 4) (M_k)", "4"),
    ("block-index-duplicate", dict(block_mask=_block_lists([[3, 1]], [[[0, 2, 2, 1], [3, 9, 9, 9]]])),
     "block_mask.kv_index[0, 0, 0]", "strictly ascending", "[0, 2, 2]"),
]


@pytest.mark.parametrize("case", DEVICE_CASES, ids=[c[0] for c in DEVICE_CASES])
def test_device_data_checks(case):
    _, over, name, expected, actual = case
    with pytest.raises(ValueError) as info:
        _device_check(**over)
    _check_message(info.value, name, expected, actual)


# ---------------------------------------------------------------------------------------------
# validate_memoized: the eager path checks each argument signature once
# ---------------------------------------------------------------------------------------------
def _meta_args(**override):
    T, H, D = 10, 2, 64
    q, k, v = (torch.empty(T, H, D, dtype=BF16, device="meta") for _ in range(3))
    off = torch.empty(3, dtype=torch.int32, device="meta")
    args = dict(q=q, k=k, v=v, seq_offsets_q=off, seq_offsets_k=off, max_seqlen_q=8, max_seqlen_k=8, num_contexts=None,
                num_targets=None, target_group_size=1, window_size=(-1, 0), alpha=0.5, rab=None, has_drab=False,
                is_delta_q=False, descale_q=None, descale_k=None, descale_v=None, descale_do=None, quant_mode=-1,
                scaling_seqlen=-1, seqused_q=None, seqused_k=None)
    args.update(override)
    return tuple(args.values())


def test_validate_memoized_checks_a_signature_once(monkeypatch):
    calls = []
    real = validation.validate
    monkeypatch.setattr(validation, "validate", lambda *a: calls.append(1) or real(*a))
    validation._VALIDATED.clear()
    p1 = validation.validate_memoized(*_meta_args())
    p2 = validation.validate_memoized(*_meta_args())  # new tensors, same signature
    assert p1 is p2 and len(calls) == 1
    validation.validate_memoized(*_meta_args(alpha=0.25))  # another scalar: checked again
    wide = torch.empty(10, 2, 128, dtype=BF16, device="meta")[..., :64]  # other strides, same shape
    validation.validate_memoized(*_meta_args(q=wide))
    assert len(calls) == 3


def test_validate_memoized_never_caches_a_failure():
    validation._VALIDATED.clear()
    validation.validate_memoized(*_meta_args())
    for _ in range(2):  # True == 1 and hash(True) == hash(1): the type is part of the signature
        with pytest.raises(TypeError, match="target_group_size"):
            validation.validate_memoized(*_meta_args(target_group_size=True))
    bad_dtype = torch.empty(10, 2, 64, dtype=torch.float32, device="meta")
    for _ in range(2):
        with pytest.raises(TypeError, match="q: expected dtype"):
            validation.validate_memoized(*_meta_args(q=bad_dtype))


# ---------------------------------------------------------------------------------------------
# HSTU_CUTE_ARCH at validation: one vocabulary with --arch, checked at a call's first use
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["sm_80", "sm80", "ampere", "sm_86"])
@pytest.mark.parametrize("fp8", ["quant_mode", "e4m3 inputs"])
def test_fp8_with_forced_sm80_path_is_not_implemented_on_meta(value, fp8, monkeypatch):
    monkeypatch.setenv("HSTU_CUTE_ARCH", value)
    if fp8 == "quant_mode":
        args = _meta_args(quant_mode=2)
    else:
        e4m3 = torch.empty(10, 2, 64, dtype=torch.float8_e4m3fn, device="meta")
        args = _meta_args(q=e4m3, k=e4m3, v=e4m3)
    with pytest.raises(NotImplementedError, match=f"HSTU_CUTE_ARCH={value} forces the sm80"):
        validation.validate(*args)
    monkeypatch.setenv("HSTU_CUTE_ARCH", "sm_90a")
    validation.validate(*args)  # the Hopper path (or none forced) takes the call


@pytest.mark.parametrize("value", ["sm75", "blackwell", "sm_100"])
def test_invalid_forced_path_raises_at_validation(value, monkeypatch):
    monkeypatch.setenv("HSTU_CUTE_ARCH", value)
    with pytest.raises(ValueError, match="HSTU_CUTE_ARCH: expected one of sm_80, sm_86, sm_89, sm_90a"):
        validation.validate(*_meta_args())


@pytest.mark.parametrize("window", [(0, 0), (3, 0), (100, 0)])
def test_causal_band_with_contexts_and_targets_validates(window):
    """A causal band with contexts and targets (docs/operator.md, "Local window with contexts and
    targets"): the semi-local mask spec (the causal one for a band as wide as the keys); a meta
    call returns the output's shape."""
    ctx = torch.empty(2, dtype=torch.int32, device="meta")
    p = validation.validate(*_meta_args(window_size=window, num_contexts=ctx, num_targets=ctx))
    if window[0] < 8:
        assert p.mask.semi_local and p.mask.kind == masks.MaskKind.LOCAL and p.window_left == window[0]
    else:  # a band as wide as the keys is the causal mask
        assert p.mask.kind == masks.MaskKind.CAUSAL and not p.mask.semi_local
    args = dict(zip(("q", "k", "v", "seq_offsets_q", "seq_offsets_k", "max_seqlen_q", "max_seqlen_k"),
                    _meta_args()[:7]))
    out = hstu_cute.hstu_attn_varlen_func(**args, window_size=window, num_contexts=ctx, num_targets=ctx)
    assert out.shape == args["q"].shape
