"""The FP8 training path's plumbing on CPU, kernels stubbed (no GPU): every launch of a quant-mode
forward and backward gets each argument its kernel's spec names, with the shapes and dtypes the
compile-time fakes promise; and the slot quantizer makes 2 quantizer launches per mode-2 training
step (the per-tensor quantizers it replaced made 8). What the kernels compute is checked on the GPU
(tests/test_fp8_forward_gpu.py, tests/test_fp8_backward_gpu.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hstu_cute import kernel_args, launch, validation, variants
from hstu_cute.call import Call

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

B, H, D = 3, 2, 64
LENGTHS_Q = [130, 0, 7]


@pytest.fixture
def recorded(monkeypatch):
    """Launches recorded as (key, values) instead of run; device queries answered as on an H100."""
    calls = []
    stubs = dict(
        kernel_path=lambda device: "hopper", device_arch=lambda device: "sm_90a", num_sms=lambda device: 132,
        _compiled=lambda key: None, _launch=lambda key, compiled, values: calls.append((key, dict(values))),
        _launch_prepared=lambda prepared, values: calls.append((prepared.key, {**prepared.fixed, **values})),
        _on_device=lambda device: contextlib.nullcontext(),
        tile_counter=lambda device: torch.zeros(2, dtype=torch.int32))
    # Each launch module holds its own reference to what it imports: stub it where it is used.
    for module in (launch.buffers, launch.prepared, launch.fwd, launch.bwd, launch.fp8):
        for name, stub in stubs.items():
            if hasattr(module, name):
                monkeypatch.setattr(module, name, stub)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return calls


def _batch(mode: int):
    offsets = torch.tensor([0, 130, 130, 137], dtype=torch.int32)
    q, k, v, dout = (torch.randn(137, H, D, dtype=torch.bfloat16) for _ in range(4))
    meta = [x.to("meta") for x in (q, k, v, offsets, offsets)]
    p = validation.validate(*meta, 130, 130, None, None, 1, (-1, 0), 1.0, None, False, False, None, None, None,
                            None, mode, -1, None, None)
    return q, k, v, dout, offsets, Call(p, offsets, offsets, 130, 130)


_DTYPES = {"Float8E4M3FN": torch.float8_e4m3fn, "BFloat16": torch.bfloat16, "Float16": torch.float16,
           "Float32": torch.float32, "Int32": torch.int32}


def _check_arguments(key, values) -> None:
    """Every argument the spec has for ``key`` is given (not None where present), with the fake's
    rank, element type and static extents (the head dim)."""
    kernel_args.ordered(key, values)  # KeyError on a missing name
    for name, fake in zip(kernel_args.slots(key), kernel_args.fake_args(key)):
        if name is None or not hasattr(fake, "shape"):
            continue
        value = values[name]
        assert value is not None, (key.describe(), name)
        assert value.dim() == len(fake.shape), (key.describe(), name, tuple(value.shape))
        assert value.dtype == _DTYPES[fake.element_type.__name__], (key.describe(), name, value.dtype)
        for dim, extent in enumerate(fake.shape):
            if isinstance(extent, int):
                assert value.shape[dim] == extent, (key.describe(), name, tuple(value.shape))


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4, 5])
def test_fp8_training_step_launches(recorded, mode):
    q, k, v, dout, offsets, call = _batch(mode)
    out, kept = launch.forward_fp8(q, k, v, None, call, keep_quantized=True)
    assert out.shape == q.shape
    forward_launches = len(recorded)
    launch.backward_fp8(dout, q, k, v, None, call, quantized=kept)
    names = [key.kernel_name for key, _ in recorded]
    for key, values in recorded:
        _check_arguments(key, values)
    assert names[forward_launches - 1] == "hopper_fwd_fp8"
    assert names[-2:] == ["hopper_bwd_fp8_dkdv", "hopper_bwd_fp8_dq"]
    quantizers = [n for n in names if n.startswith(("hopper_fwd_quant", "hopper_fwd_vt"))]
    assert set(quantizers) == {"hopper_fwd_quant_slots"}
    # forward: one launch (two for mode 1); backward: dO's (modes 3-5: cooperative, grid barriers)
    assert len(quantizers) == (3 if mode == 1 else 2)
    assert forward_launches == (3 if mode == 1 else 2)


@pytest.mark.parametrize("mode", [0, 1, 2, 5])
def test_fp8_backward_without_forward_copies(recorded, mode):
    """The backward called without the forward's copies (the custom op's path) quantizes q, k
    and v itself: every argument is still there."""
    q, k, v, dout, offsets, call = _batch(mode)
    launch.backward_fp8(dout, q, k, v, None, call)
    for key, values in recorded:
        _check_arguments(key, values)
    assert [key.kernel_name for key, _ in recorded][-2:] == ["hopper_bwd_fp8_dkdv", "hopper_bwd_fp8_dq"]


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("purpose", variants.QUANT_PURPOSES)
def test_quantize_for_copies_and_tables(recorded, mode, purpose):
    """quantize_for's copies: e4m3 (T, H, D) and V^T (H, D, W) of the right sizes, tables of the
    mode's shape ((B, blocks, H); a zero-strided (B, 1, H) view of the group scales for modes
    3-5; mode 1 (T, H) and (B, blocks, H, 2, D)), and the tensors handed to the kernel are the
    ones returned; an empty sequence and q and k of different block counts included."""
    q, k, v, dout, offsets, _ = _batch(mode)
    k_offsets = torch.tensor([0, 40, 41, 137], dtype=torch.int32)
    xs, offs, maxes = ((dout,), (offsets,), (130,)) if purpose == "gradient" else (
        (q, k, v), (offsets, k_offsets, k_offsets), (130, 96, 96))
    copies = launch.quantize_for(mode, purpose, xs, offs, maxes)
    given = [values for _, values in recorded]
    handed = {id(t) for values in given for name, t in values.items() if name.startswith(("mO", "mVt"))}
    for x, max_seqlen, got in zip(xs, maxes, copies):
        blocks = -(-max_seqlen // 128)
        for kind, (data, table) in got.items():
            assert id(data) in handed
            if kind == "plain":
                assert data.shape == x.shape and data.dtype == torch.float8_e4m3fn
            else:
                assert data.shape == (H, D, variants.vt_width(x.shape[0], B))
            if mode == 1:
                assert table.shape == ((x.shape[0], H) if kind == "plain" else (B, blocks, H, 2, D))
            elif mode == 2:
                assert table.shape == (B, blocks, H)
            elif mode == 0:
                assert table.shape == (B, 1, H) and table.stride(0) == table.stride(2) == 0 and bool((table == 1).all())
            else:
                assert table.shape == (B, 1, H)
    assert len(recorded) == len(variants.quant_launches(mode, purpose))
    for key, values in recorded:
        _check_arguments(key, values)
