"""hstu_cute.padded on CPU: the padded entry equals the jagged call (forward and gradients), rows
past each length are zero and padding is never read, the divisor is the padded length, the
conversions round-trip, and the documented views really are views (data_ptr)."""

from __future__ import annotations

import warnings

import pytest
import torch

from hstu_cute import nn as hnn
from hstu_cute.padded import hstu_attn_padded, offsets_from_lengths, to_jagged, to_padded

F64 = torch.float64
LENGTHS = [7, 0, 1, 4, 7]
B, N, H, D = len(LENGTHS), 7, 2, 8


@pytest.fixture(autouse=True)
def _quiet_reference_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hstu_cute: CPU tensors run the PyTorch reference")
        yield


def _padded(seed=0, value_dim=D, poison=True):
    """q, k, v (B, N, H, .) with NaN past each length: a path that reads padding shows it."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, N, H, D, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(B, N, H, value_dim, generator=gen, dtype=F64)
    if poison:
        for t in (q, k, v):
            for b, n in enumerate(LENGTHS):
                t[b, n:] = float("nan")
    return q, k, v


def _int32(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("lengths_as", ["list", "int32", "int64"])
@pytest.mark.parametrize("case", ["causal", "ctx+tgt+rab", "local"])
def test_padded_equals_the_jagged_call(case, lengths_as):
    kw = {"causal": {},
          "ctx+tgt+rab": dict(num_contexts=_int32([2, 0, 0, 1, 3]), num_targets=_int32([1, 0, 1, 2, 2]),
                              rab=torch.randn(B, 1, N, N, dtype=F64, generator=torch.Generator().manual_seed(9))),
          "local": dict(window_size=(2, 1))}[case]
    lengths = {"list": LENGTHS, "int32": _int32(LENGTHS), "int64": torch.tensor(LENGTHS)}[lengths_as]
    q, k, v = _padded()
    out = hstu_attn_padded(q, k, v, lengths, alpha=0.4, **kw)
    assert out.shape == (B, N, H, D) and out.dtype == F64
    (qj, offsets), (kj, _), (vj, _) = (to_jagged(t, LENGTHS) for t in (q, k, v))
    jagged = hnn.hstu_attention(qj, kj, vj, offsets, N, alpha=0.4, **kw)
    expected = to_padded(jagged, offsets, N)
    assert torch.isfinite(out).all(), "padding (NaN) was read"
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for b, n in enumerate(LENGTHS):
        assert (out[b, n:] == 0).all()
    assert out.abs().max() > 0


def test_padded_gradients_equal_the_jagged_ones_and_vanish_past_each_length():
    q, k, v = (t.nan_to_num(0.0).requires_grad_(True) for t in _padded())
    targets = _int32([1, 0, 0, 1, 2])
    out = hstu_attn_padded(q, k, v, LENGTHS, num_targets=targets)
    dout = torch.randn_like(out)
    out.backward(dout)

    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    (qj, offsets), (kj, _), (vj, _) = (to_jagged(t, LENGTHS) for t in leaves)
    jagged = hnn.hstu_attention(qj, kj, vj, offsets, N, num_targets=targets)
    (to_padded(jagged, offsets, N) * dout).sum().backward()
    for mine, theirs in zip((q, k, v), leaves):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-12)
        for b, n in enumerate(LENGTHS):
            assert (mine.grad[b, n:] == 0).all()
        assert mine.grad.abs().max() > 0


def test_value_head_dim_may_differ():
    q, k, v = _padded(value_dim=3)
    out = hstu_attn_padded(q, k, v, LENGTHS)
    assert out.shape == (B, N, H, 3) and torch.isfinite(out).all()


def test_divisor_is_the_padded_length():
    q, k, v = _padded(poison=False)
    wide = [torch.cat([t, torch.zeros_like(t)], dim=1) for t in (q, k, v)]  # padded to 2N
    out = hstu_attn_padded(q, k, v, LENGTHS)
    out_wide = hstu_attn_padded(*wide, LENGTHS)
    torch.testing.assert_close(out_wide[:, :N], out / 2, rtol=1e-12, atol=1e-12)
    pinned = hstu_attn_padded(*wide, LENGTHS, scaling_seqlen=N)
    torch.testing.assert_close(pinned[:, :N], out, rtol=1e-12, atol=1e-12)


def test_padded_meta_tensors_take_the_kernel_path():
    q = torch.empty(3, 16, 2, 64, dtype=torch.bfloat16, device="meta")
    lengths = torch.empty(3, dtype=torch.int32, device="meta")
    out = hstu_attn_padded(q, q, q, lengths, num_targets=lengths)
    assert out.shape == (3, 16, 2, 64) and out.device.type == "meta"
    # Host lengths (a CPU tensor) for a batch on another device: checked on the host, then copied.
    assert hstu_attn_padded(q, q, q, torch.tensor([16, 0, 3])).shape == (3, 16, 2, 64)
    with pytest.raises(ValueError, match=r"lengths: expected values in \[0, 16\] .*, got \[17\]"):
        hstu_attn_padded(q, q, q, torch.tensor([16, 17, 3]))


def test_padded_errors_name_the_argument():
    q, k, v = _padded()
    cases = [
        ((q[0], k, v, LENGTHS), ValueError, r"q: expected a 4-D tensor .*, got shape \(7, 2, 8\)"),
        ((q, k[:, :6], v, LENGTHS), ValueError,
         r"k\.shape\[:3\]: expected \(5, 7\) \+ \(H_kv,\) with H_kv dividing 2 .*, got \(5, 6, 2\)"),
        ((q, k, v[:4], LENGTHS), ValueError, r"v\.shape\[:3\]: expected \(5, 7\) \+ \(H_kv,\)"),
        ((q, k, v, LENGTHS[:4]), ValueError, r"len\(lengths\): expected 5 .*, got 4"),
        ((q, k, v, [7, 0, 1, 4, 8]), ValueError, r"lengths: expected values in \[0, 7\] .*, got \[8\]"),
        ((q, k, v, torch.tensor(LENGTHS, dtype=torch.float32)), TypeError,
         r"lengths\.dtype: expected torch.int32 or torch.int64, got torch.float32"),
        ((q, k, v, torch.tensor(LENGTHS[:2])), ValueError, r"lengths: expected shape \(5,\) .*, got \(2,\)"),
        ((q, k, v, "7"), TypeError, r"lengths: expected a \(B,\) int tensor or a sequence of ints, got str"),
        ((q, k, v, torch.tensor(LENGTHS, device="meta")), ValueError,
         r"lengths\.device: expected cpu \(same as the batch\) or cpu, got meta"),
    ]
    for args, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            hstu_attn_padded(*args)


# --------------------------------------------------------------------------------------------
# Views and copies
# --------------------------------------------------------------------------------------------

def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_flatten_is_a_view_for_contiguous_and_fused_projection_layouts():
    from hstu_cute.padded import _flatten_batch

    x = torch.randn(B, N, H, D)
    flat = _flatten_batch("q", x)
    assert flat.data_ptr() == x.data_ptr() and flat.shape == (B * N, H, D)
    fused = torch.randn(B, N, 3 * H * D).view(B, N, 3, H, D)  # one projection for q, k, v
    q_view = fused.unbind(2)[1]
    assert _flatten_batch("q", q_view).data_ptr() == q_view.data_ptr()
    # (B, H, N, D) transposed to (B, N, H, D): dims 0 and 1 do not merge, reshape copies.
    transposed = torch.randn(B, H, N, D).transpose(1, 2)
    assert not _shares_storage(_flatten_batch("q", transposed), transposed)


def test_to_jagged_and_to_padded_round_trip():
    x = torch.randn(B, N, 3, generator=torch.Generator().manual_seed(1))
    values, offsets = to_jagged(x, LENGTHS)
    assert values.shape == (sum(LENGTHS), 3) and offsets.dtype == torch.int32
    assert offsets.tolist() == [0, 7, 7, 8, 12, 19]
    assert torch.equal(values[7:8], x[2, :1]) and torch.equal(values[8:12], x[3, :4])
    back = to_padded(values, offsets, N, padding_value=-1.0)
    for b, n in enumerate(LENGTHS):
        assert torch.equal(back[b, :n], x[b, :n]) and (back[b, n:] == -1).all()
    again, offsets_again = to_jagged(back, torch.tensor(LENGTHS))
    assert torch.equal(again, values) and torch.equal(offsets_again, offsets)


def test_views_where_claimed():
    x = torch.randn(3, 5, 4)
    full, offsets = to_jagged(x, [5, 5, 5])
    assert full.data_ptr() == x.data_ptr() and offsets.tolist() == [0, 5, 10, 15]
    one, _ = to_jagged(x[:1], [2])
    assert one.data_ptr() == x.data_ptr() and one.shape == (2, 4)
    gathered, _ = to_jagged(x, [5, 1, 5])
    assert not _shares_storage(gathered, x)
    values = torch.randn(15, 4)
    padded = to_padded(values, offsets, 5)
    assert padded.data_ptr() == values.data_ptr() and padded.shape == (3, 5, 4)
    ragged = to_padded(values[:11], torch.tensor([0, 5, 6, 11], dtype=torch.int32), 5)
    assert not _shares_storage(ragged, values) and (ragged[1, 1:] == 0).all()


def test_conversions_edge_cases_and_gradients():
    assert to_padded(torch.zeros(0, 2), torch.zeros(3, dtype=torch.int32), 4).shape == (2, 4, 2)
    values, offsets = to_jagged(torch.randn(2, 3, 2), [0, 0])
    assert values.shape == (0, 2) and offsets.tolist() == [0, 0, 0]
    values = torch.randn(6, 2, requires_grad=True)
    offsets = torch.tensor([0, 2, 6], dtype=torch.int64)
    padded = to_padded(values, offsets, 5)
    padded.sum().backward()
    assert torch.equal(values.grad, torch.ones(6, 2))
    assert torch.equal(offsets_from_lengths(torch.tensor([3, 0, 2], dtype=torch.int32)),
                       torch.tensor([0, 3, 3, 5], dtype=torch.int32))


def test_conversion_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"x: expected a tensor of at least 2 dims"):
        to_jagged(torch.zeros(3), [1, 1, 1])
    with pytest.raises(ValueError, match=r"lengths: expected values in \[0, 4\] .*, got \[5\]"):
        to_jagged(torch.zeros(2, 4), torch.tensor([5, 1]))
    with pytest.raises(TypeError, match=r"offsets: expected an int32/int64 tensor .*, got torch.float32"):
        to_padded(torch.zeros(3, 2), torch.tensor([0.0, 3.0]), 3)
    with pytest.raises(ValueError, match=r"max_len: expected a Python int >= 0, got -1"):
        to_padded(torch.zeros(3, 2), torch.tensor([0, 3]), -1)
