"""hstu_cute.integrations.generative_recommenders on CPU.

* The oracle's mask (written from that library's semantics) is checked against hand-drawn grids,
  so the oracle itself can be wrong and fail.
* The argument mapping is checked pair by pair: for every small length, context and target count,
  window and causality that hstu_mha accepts, the oracle's mask equals our mask engine's on the
  mapped arguments.
* hstu_mha (CPU: our PyTorch reference path) equals the oracle in fp64 and passes the ratio rule
  in bf16 against the oracle's own bf16 rounding, over the mask grid.
* Refusals name the argument; meta tensors give shapes.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from hstu_cute import masks, reference
from hstu_cute.integrations.generative_recommenders import (
    attention_mask,
    hstu_mha,
    hstu_mha_arguments,
    reference_hstu_mha,
)

F64 = torch.float64


@pytest.fixture(autouse=True)
def _quiet_reference_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hstu_cute: CPU tensors run the PyTorch reference")
        yield


def _grid(rows: str) -> torch.Tensor:
    return torch.tensor([[c == "x" for c in row.split()] for row in rows.strip().splitlines()])


def test_oracle_mask_against_hand_drawn_grids():
    # L = 7, 2 contexts, 2 targets: context rows see every key before the targets, history rows are
    # causal, a target sees contexts, history and itself.
    got = attention_mask(torch.tensor([7]), 8, num_targets=torch.tensor([2]), contextual_seq_len=2)[0, :7, :7]
    assert torch.equal(got, _grid("""
        x x x x x . .
        x x x x x . .
        x x x . . . .
        x x x x . . .
        x x x x x . .
        x x x x x x .
        x x x x x . x"""))
    # Causal window max_attn_len = 2 over L = 5.
    got = attention_mask(torch.tensor([5]), 5, max_attn_len=2)[0]
    assert torch.equal(got, _grid("""
        x . . . .
        x x . . .
        x x x . .
        . x x x .
        . . x x x"""))
    # Not causal, targets: history rows see the targets, targets do not see each other.
    got = attention_mask(torch.tensor([4]), 4, causal=False, num_targets=torch.tensor([2]))[0]
    assert torch.equal(got, _grid("""
        x x x x
        x x x x
        x x x .
        x x . x"""))
    # A window with full-attention tail rows (min_full_attn_seq_len = 1: the last id before the
    # targets and the targets).
    got = attention_mask(torch.tensor([6]), 6, max_attn_len=1, num_targets=torch.tensor([1]),
                         min_full_attn_seq_len=1)[0]
    assert torch.equal(got, _grid("""
        x . . . . .
        x x . . . .
        . x x . . .
        . . x x . .
        x x x x x .
        x x x x x x"""))


def _our_mask(L, N, call) -> torch.Tensor:
    kind, wl, wr = masks.normalize_window(call["window_size"], N)
    c = 0 if call["num_contexts"] is None else int(call["num_contexts"][0])
    t = None if call["num_targets"] is None else int(call["num_targets"][0])
    spec = masks.MaskSpec(kind, has_context=call["num_contexts"] is not None, has_target=t is not None)
    seq = masks.seq_mask_from_lengths(spec, L, L, wl, wr, c, t or 0, 1)
    return masks.dense_mask(spec, seq).expand(L, L)


def test_mapping_reproduces_the_library_mask_pair_by_pair():
    N = 9
    checked = refused = 0
    for L, c, t, m, causal in itertools.product(range(1, N + 1), range(0, 4), [None, 0, 1, 2, 4], [0, 1, 3, 7, 8, 12],
                                                (True, False)):
        if c + (t or 0) > L:
            continue  # outside the contract: sequences hold their contexts and targets
        targets = None if t is None else torch.tensor([t])
        q = torch.empty(L, 1, 8)
        try:
            call = hstu_mha_arguments(N, 1.0, q, torch.tensor([0, L]), causal, targets, m, c)
        except NotImplementedError:
            refused += 1
            continue
        expected = attention_mask(torch.tensor([L]), N, causal, targets, m, c)[0, :L, :L]
        assert torch.equal(_our_mask(L, N, call), expected), (L, c, t, m, causal, call["window_size"])
        assert call["scaling_seqlen"] == N and call["max_seqlen"] == N
        checked += 1
    # Both outcomes covered; a changed mapping moves these (session 32: the causal windows with
    # contexts and targets, 393 configurations, became expressible).
    assert (checked, refused) == (966, 714)


def _batch(dtype, lengths=(12, 0, 1, 5, 9, 12), heads=2, head_dim=8, value_dim=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k = ((torch.rand(T, heads, head_dim, generator=gen) * 2 - 1).to(dtype) for _ in range(2))
    v = (torch.rand(T, heads, value_dim or head_dim, generator=gen) * 2 - 1).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])  # int64, as that library makes them
    return q, k, v, offsets, torch.tensor(lengths)


CASES = [  # (causal, contextual_seq_len, targets?, max_attn_len)
    (True, 0, False, 0), (True, 0, True, 0), (True, 1, False, 0), (True, 1, True, 0), (True, 2, True, 0),
    (True, 0, False, 3), (True, 0, False, 11), (False, 0, False, 0), (False, 0, False, 4), (False, 2, False, 0),
    # A causal window with contexts and targets: the band counts attention ids.
    (True, 0, True, 2), (True, 2, False, 3), (True, 2, True, 4), (True, 1, True, 1),
]


def _case_args(case, lengths):
    causal, contexts, with_targets, window = case
    targets = None
    if with_targets:
        targets = torch.clamp(lengths - max(contexts, 0), min=0).clamp(max=3)
    contexts = min(contexts, int(lengths[lengths > 0].min()))  # every non-empty sequence holds its contexts
    return dict(causal=causal, num_targets=targets, max_attn_len=window, contextual_seq_len=contexts)


@pytest.mark.parametrize("case", CASES, ids=[f"causal{c}-ctx{x}-tgt{t}-win{w}" for c, x, t, w in CASES])
def test_hstu_mha_equals_the_oracle_fp64(case):
    q, k, v, offsets, lengths = _batch(F64, lengths=(12, 1, 5, 9, 12))
    kw = _case_args(case, lengths)
    out = hstu_mha(12, 0.3, q, k, v, offsets, **kw)
    expected = reference_hstu_mha(12, 0.3, q, k, v, offsets, **kw, compute_dtype=F64)
    assert out.shape == q.shape and out.dtype == F64
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert expected.abs().max() > 0


@pytest.mark.parametrize("case", CASES[:5], ids=[f"causal{c}-ctx{x}-tgt{t}-win{w}" for c, x, t, w in CASES[:5]])
def test_hstu_mha_bf16_ratio_rule_against_the_library_rounding(case):
    q, k, v, offsets, lengths = _batch(torch.bfloat16, lengths=(12, 1, 5, 9, 12))
    kw = _case_args(case, lengths)
    out = hstu_mha(12, 0.3, q, k, v, offsets, **kw)
    fp32 = reference_hstu_mha(12, 0.3, q, k, v, offsets, **kw)
    theirs = reference_hstu_mha(12, 0.3, q, k, v, offsets, **kw, compute_dtype=None)
    ok, err, ref_err = reference.ratio_check(out, fp32, theirs, 2.0)
    assert out.dtype == torch.bfloat16 and ok, (err, ref_err)


def test_divisor_is_max_seq_len_and_value_dim_may_differ():
    q, k, v, offsets, _ = _batch(F64, lengths=(5, 3), value_dim=3)
    out = hstu_mha(5, 1.0, q, k, v, offsets)
    assert out.shape == (8, 2, 3)
    torch.testing.assert_close(hstu_mha(10, 1.0, q, k, v, offsets), out / 2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, reference_hstu_mha(5, 1.0, q, k, v, offsets, compute_dtype=F64),
                               rtol=0, atol=1e-12)


def test_gradients_match_the_oracle():
    q, k, v, offsets, lengths = _batch(F64, lengths=(6, 4))
    targets = torch.tensor([2, 1])
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    oracle_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    dout = torch.randn_like(q)
    hstu_mha(6, 0.5, *leaves, offsets, num_targets=targets, contextual_seq_len=1).backward(dout)
    reference_hstu_mha(6, 0.5, *oracle_leaves, offsets, num_targets=targets, contextual_seq_len=1,
                       compute_dtype=F64).backward(dout)
    for mine, theirs in zip(leaves, oracle_leaves):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-12)


def test_dropout_outside_training_is_a_no_op():
    q, k, v, offsets, _ = _batch(F64, lengths=(4, 4))
    torch.testing.assert_close(hstu_mha(4, 1.0, q, k, v, offsets, dropout_pr=0.3, training=False),
                               hstu_mha(4, 1.0, q, k, v, offsets), rtol=0, atol=0)


@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(dropout_pr=0.1), NotImplementedError, r"dropout_pr: attention dropout is not implemented.*got 0.1"),
    (dict(dropout_pr=1.5, training=False), ValueError, r"dropout_pr: expected a float in \[0, 1\], got 1.5"),
    (dict(max_attn_len=2, num_targets=torch.tensor([1, 1]), causal=False), NotImplementedError,
     r"max_attn_len: expected 0 \(or >= max_seq_len - 1 = 5\) together with num_targets and causal=False, got 2"),
    (dict(max_attn_len=2, contextual_seq_len=1, causal=False), NotImplementedError,
     r"max_attn_len: expected 0 .* together with contextual_seq_len=1 and causal=False, got 2"),
    (dict(max_attn_len=2, min_full_attn_seq_len=1), NotImplementedError,
     r"min_full_attn_seq_len: expected 0 with max_attn_len=2, got 1"),
    (dict(causal=False, num_targets=torch.tensor([1, 1])), NotImplementedError,
     r"num_targets: expected None with causal=False"),
    (dict(max_attn_len=-1), ValueError, r"max_attn_len: expected an int >= 0, got -1"),
    (dict(contextual_seq_len=1.0), TypeError, r"contextual_seq_len: expected a Python int, got float 1.0"),
    (dict(causal=1), TypeError, r"causal: expected a bool, got int"),
])
def test_refusals_name_the_argument(kwargs, exc, pattern):
    q, k, v, offsets, _ = _batch(F64, lengths=(6, 4))
    with pytest.raises(exc, match=pattern):
        hstu_mha(6, 1.0, q, k, v, offsets, **kwargs)


def test_wide_windows_and_ignored_hints_are_accepted():
    q, k, v, offsets, _ = _batch(F64, lengths=(6, 4))
    base = hstu_mha(6, 1.0, q, k, v, offsets, num_targets=torch.tensor([1, 1]))
    # max_attn_len >= max_seq_len - 1 masks nothing: accepted with targets.
    wide = hstu_mha(6, 1.0, q, k, v, offsets, num_targets=torch.tensor([1, 1]), max_attn_len=5,
                    min_full_attn_seq_len=2, sort_by_length=True, kernel="TRITON", enable_tma=True)
    torch.testing.assert_close(wide, base, rtol=0, atol=0)


def test_shape_errors_and_meta_tensors():
    q, k, v, offsets, _ = _batch(F64, lengths=(6, 4))
    with pytest.raises(ValueError, match=r"max_seq_len: expected an int >= 1, got 0"):
        hstu_mha(0, 1.0, q, k, v, offsets)
    with pytest.raises(ValueError, match=r"k\.shape: expected \(10, 2, 8\) .*, got \(9, 2, 8\)"):
        hstu_mha(6, 1.0, q, k[:9], v, offsets)
    meta_q = torch.empty(10, 2, 64, dtype=torch.bfloat16, device="meta")
    meta_v = torch.empty(10, 2, 32, dtype=torch.bfloat16, device="meta")
    offs = torch.empty(3, dtype=torch.int64, device="meta")
    out = hstu_mha(6, 1.0, meta_q, meta_q, meta_v, offs, num_targets=torch.empty(2, dtype=torch.int64, device="meta"),
                   contextual_seq_len=2)
    assert out.shape == (10, 2, 32) and out.dtype == torch.bfloat16 and out.device.type == "meta"
