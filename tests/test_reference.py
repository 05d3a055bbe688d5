"""The PyTorch oracle (hstu_cute.reference) against an independent brute force (CPU, fast).

The brute force below is written straight from spec sections 2-4 with scalar Python loops and its
own literal mask predicate; it does not use hstu_cute.masks.
"""

from __future__ import annotations

import math

import pytest
import torch

from hstu_cute.reference import (
    hstu_attn_reference,
    ratio_check,
    reference_grads,
)
from hstu_cute.testing import random_jagged_batch

# ------------------------------------------------------------------------------------------------
# Brute force, from the spec text.
# ------------------------------------------------------------------------------------------------


def spec_window(window, max_k):
    left, right = window
    wl = max_k if left < 0 or left > max_k else left
    wr = max_k if right < 0 or right > max_k else right
    causal = wl == max_k and wr == 0
    local = (wl < max_k or wr < max_k) and not causal
    mode = "local" if local else ("none" if not causal else "causal")
    return mode, wl, wr


def spec_M(mode, wl, wr, r, j, c, h_end, g, has_ctx, has_tgt):
    if mode == "none":
        return True
    if mode == "local":
        return r - wl <= j <= r + wr
    if has_ctx and r < c and j < h_end:
        return True
    elif j > r:
        return False
    elif has_tgt and r >= h_end and h_end <= j < h_end + g * math.floor((r - h_end) / g):
        return False
    else:
        return True


def silu(z):
    return z / (1.0 + math.exp(-z))


def dsilu(z):
    s = 1.0 / (1.0 + math.exp(-z))
    return s * (1.0 + z * (1.0 - s))


def _lst(t):
    return None if t is None else [int(x) for x in t.tolist()]


def _rounder(dtype):
    if dtype is None:
        return lambda x: x
    return lambda x: torch.tensor(x, dtype=torch.float64).to(dtype).item()


def brute_force(kw, dout=None, round_to=None):
    """Returns out (and with dout: dq, dk, dv, drab) as float64 tensors.

    ``round_to`` (forward only): round ``silu(Z)`` to that dtype before the P.V sum and the final
    ``sum / S`` to it, the kernel's rounding points of spec section 2 (the sums stay float64)."""
    rnd = _rounder(round_to)
    q, k, v, rab = (kw[n].detach().double().tolist() if kw[n] is not None else None for n in ("q", "k", "v", "rab"))
    T_q, H, D = kw["q"].shape
    T_k = kw["k"].shape[0]
    offq, offk = _lst(kw["seq_offsets_q"]), _lst(kw["seq_offsets_k"])
    B = len(offq) - 1
    usedq, usedk = _lst(kw["seqused_q"]), _lst(kw["seqused_k"])
    ctx, tgt = _lst(kw["num_contexts"]), _lst(kw["num_targets"])
    mode, wl, wr = spec_window(kw["window_size"], kw["max_seqlen_k"])
    S = kw["scaling_seqlen"] if kw["scaling_seqlen"] != -1 else kw["max_seqlen_q"]
    alpha, g = kw["alpha"], kw["target_group_size"]
    h_rab = None if rab is None else len(rab[0])

    out = [[[0.0] * D for _ in range(H)] for _ in range(T_q)]
    do = None if dout is None else dout.double().tolist()
    dq = [[[0.0] * D for _ in range(H)] for _ in range(T_q)]
    dk = [[[0.0] * D for _ in range(H)] for _ in range(T_k)]
    dv = [[[0.0] * D for _ in range(H)] for _ in range(T_k)]
    drab = None
    if rab is not None:
        n = len(rab[0][0])
        drab = [[[[0.0] * n for _ in range(n)] for _ in range(h_rab)] for _ in range(B)]

    for b in range(B):
        Lq = usedq[b] if usedq is not None else offq[b + 1] - offq[b]
        Lk = usedk[b] if usedk is not None else offk[b + 1] - offk[b]
        off = Lk - Lq if kw["is_delta_q"] else 0
        c = ctx[b] if ctx is not None else 0
        t = tgt[b] if tgt is not None else 0
        h_end = Lk - t
        for h in range(H):
            hr = h if h_rab == H else 0
            for i in range(Lq):
                qi = q[offq[b] + i][h]
                for j in range(Lk):
                    if not spec_M(mode, wl, wr, i + off, j, c, h_end, g, ctx is not None, tgt is not None):
                        continue
                    kj = k[offk[b] + j][h]
                    vj = v[offk[b] + j][h]
                    bias = rab[b][hr][off + i][j] if rab is not None else 0.0
                    z = alpha * (sum(qi[d] * kj[d] for d in range(D)) + bias)
                    p = silu(z) / S
                    p_acc = rnd(silu(z)) if round_to is not None else p
                    for d in range(D):
                        out[offq[b] + i][h][d] += p_acc * vj[d]
                    if do is None:
                        continue
                    doi = do[offq[b] + i][h]
                    dp = sum(doi[d] * vj[d] for d in range(D))
                    G = alpha * dsilu(z) * dp / S
                    for d in range(D):
                        dv[offk[b] + j][h][d] += p * doi[d]
                        dq[offq[b] + i][h][d] += G * kj[d]
                        dk[offk[b] + j][h][d] += G * qi[d]
                    if drab is not None:
                        drab[b][hr][off + i][j] += G
    if round_to is not None:
        out = [[[rnd(x / S) for x in row] for row in rows] for rows in out]
    res = {"out": torch.tensor(out, dtype=torch.float64).view(T_q, H, D)}
    if do is not None:
        res["dq"] = torch.tensor(dq, dtype=torch.float64).view(T_q, H, D)
        res["dk"] = torch.tensor(dk, dtype=torch.float64).view(T_k, H, D)
        res["dv"] = torch.tensor(dv, dtype=torch.float64).view(T_k, H, D)
        res["drab"] = None if drab is None else torch.tensor(drab, dtype=torch.float64)
    return res


def poison_padding(kw):
    """NaN into every storage element the spec says is never read: q/k/v rows past the valid
    lengths, and rab outside rows [off, off + Lq) x cols [0, Lk) of each sequence."""
    offq, offk = _lst(kw["seq_offsets_q"]), _lst(kw["seq_offsets_k"])
    B = len(offq) - 1
    kw = dict(kw)
    q, k, v = kw["q"].clone(), kw["k"].clone(), kw["v"].clone()
    rab = kw["rab"].clone() if kw["rab"] is not None else None
    rab_used = torch.zeros_like(rab, dtype=torch.bool) if rab is not None else None
    for b in range(B):
        Lq = int(kw["seqused_q"][b]) if kw["seqused_q"] is not None else offq[b + 1] - offq[b]
        Lk = int(kw["seqused_k"][b]) if kw["seqused_k"] is not None else offk[b + 1] - offk[b]
        q[offq[b] + Lq : offq[b + 1]] = float("nan")
        k[offk[b] + Lk : offk[b + 1]] = float("nan")
        v[offk[b] + Lk : offk[b + 1]] = float("nan")
        if rab is not None:
            off = Lk - Lq if kw["is_delta_q"] else 0
            rab_used[b, :, off : off + Lq, :Lk] = True
    if rab is not None:
        rab[~rab_used] = float("nan")
    kw.update(q=q, k=k, v=v, rab=rab)
    return kw


def padding_rows(kw):
    """Boolean (T_q,) of output rows that must be zero because they are not valid queries."""
    offq = _lst(kw["seq_offsets_q"])
    T_q = kw["q"].shape[0]
    valid = torch.zeros(T_q, dtype=torch.bool)
    for b in range(len(offq) - 1):
        Lq = int(kw["seqused_q"][b]) if kw["seqused_q"] is not None else offq[b + 1] - offq[b]
        valid[offq[b] : offq[b] + Lq] = True
    return ~valid


# ------------------------------------------------------------------------------------------------
# Cases: keyword arguments of random_jagged_batch (small: H=2, D=4, lengths <= 9).
# ------------------------------------------------------------------------------------------------

CAUSAL = (-1, 0)
BASE = dict(batch_size=4, num_heads=2, head_dim=4, max_seqlen_q=7, dtype=torch.float32)
DELTA = dict(BASE, max_seqlen_q=4, max_seqlen_k=7, lengths=[7, 4, 0, 5], lengths_q=[3, 4, 0, 1], is_delta_q=True)

CASES = {
    "none_full": dict(BASE, lengths="full"),
    "none_ragged": dict(BASE, lengths=[5, 0, 1, 7]),
    "causal": dict(BASE, lengths=[6, 1, 0, 7], window_size=CAUSAL),
    "causal_left_gt_max": dict(BASE, lengths=[6, 3, 2, 7], window_size=(100, 0)),
    "local_2_1": dict(BASE, lengths=[6, 3, 1, 7], window_size=(2, 1)),
    "local_0_0": dict(BASE, lengths=[6, 3, 1, 7], window_size=(0, 0)),
    "local_left_only": dict(BASE, lengths=[6, 3, 1, 7], window_size=(3, -1)),
    "local_right_only": dict(BASE, lengths=[6, 3, 1, 7], window_size=(-1, 2)),
    "window_both_huge_is_none": dict(BASE, lengths=[6, 3, 1, 7], window_size=(50, 50)),
    "context": dict(BASE, lengths=[6, 3, 1, 7], window_size=CAUSAL, num_contexts=[1, 3, 0, 2]),
    "target_g1": dict(BASE, lengths=[6, 3, 1, 7], window_size=CAUSAL, num_targets=[2, 1, 1, 4]),
    "target_g2": dict(BASE, lengths=[6, 3, 1, 7], window_size=CAUSAL, num_targets=[2, 3, 0, 5], target_group_size=2),
    "target_g3": dict(BASE, lengths=[6, 3, 1, 7], window_size=CAUSAL, num_targets=[5, 2, 1, 7], target_group_size=3),
    "context_target_g2": dict(
        BASE, lengths=[6, 8, 1, 7], max_seqlen_q=8, window_size=CAUSAL,
        num_contexts=[1, 2, 0, 2], num_targets=[2, 4, 1, 3], target_group_size=2,
    ),
    "all_targets": dict(BASE, lengths=[6, 3, 0, 1], window_size=CAUSAL, num_targets=[6, 3, 0, 1], target_group_size=2),
    "all_targets_with_zero_context": dict(
        BASE, lengths=[5, 4, 2, 1], window_size=CAUSAL, num_contexts=[0, 0, 0, 0], num_targets=[5, 4, 2, 1]
    ),
    "all_context": dict(BASE, lengths=[5, 4, 2, 1], window_size=CAUSAL, num_contexts=[5, 4, 2, 1]),
    "delta_causal": dict(DELTA, window_size=CAUSAL),
    "delta_local": dict(DELTA, window_size=(2, 1)),
    "delta_none": dict(DELTA),
    "delta_causal_rab_H": dict(DELTA, window_size=CAUSAL, rab_heads=2),
    "rab_h1": dict(BASE, lengths=[6, 3, 1, 7], window_size=CAUSAL, rab_heads=1),
    "rab_hH": dict(BASE, lengths=[6, 3, 1, 7], rab_heads=2),
    "rab_local_alpha": dict(BASE, lengths=[6, 3, 1, 7], window_size=(1, 2), rab_heads=1, alpha=0.37),
    "alpha_large": dict(BASE, lengths=[6, 3, 1, 7], window_size=CAUSAL, alpha=2.5),
    "scaling_seqlen": dict(BASE, lengths=[6, 3, 1, 7], window_size=CAUSAL, scaling_seqlen=5),
    "looser_max_seqlen": dict(BASE, lengths=[3, 2, 1, 3], max_seqlen_q=9, window_size=CAUSAL),
    "seqused": dict(BASE, lengths=[6, 3, 1, 7], window_size=CAUSAL, seqused=True, seed=3),
    "seqused_context_target": dict(
        BASE, lengths=[7, 6, 5, 7], window_size=CAUSAL, seqused=True, num_contexts=2, num_targets=3,
        target_group_size=2, rab_heads=1, seed=5,
    ),
    "seqused_delta_local_rab": dict(DELTA, window_size=(1, 1), seqused=True, rab_heads=2, seed=11),
    "random_lengths_ctx_tgt": dict(
        BASE, batch_size=5, lengths="random", window_size=CAUSAL, num_contexts=3, num_targets=4, target_group_size=3,
        seed=13,
    ),
    "length_one_all": dict(BASE, lengths=[1, 1, 1, 1], window_size=CAUSAL, num_contexts=[0, 1, 0, 0], num_targets=[1, 0, 0, 1]),
    "zero_length_sequences": dict(BASE, lengths=[0, 0, 4, 0], window_size=CAUSAL),
    "empty_batch": dict(BASE, lengths=[0, 0, 0, 0]),
    "empty_batch_max0": dict(BASE, batch_size=2, max_seqlen_q=0, lengths=[0, 0], window_size=CAUSAL),
    "single_sequence": dict(BASE, batch_size=1, lengths=[7], window_size=(2, 0), rab_heads=1),
    "delta_context_target_extension": dict(
        DELTA, window_size=CAUSAL, num_contexts=[2, 1, 0, 1], num_targets=[2, 1, 0, 2], target_group_size=2
    ),
}  # fmt: skip


def make_case(name):
    args = dict(CASES[name])
    args.setdefault("seed", sum(map(ord, name)))
    kw = random_jagged_batch(**args)
    return kw


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_brute_force(name):
    kw = make_case(name)
    want = brute_force(kw)["out"]
    pkw = poison_padding(kw)
    # fp64 upcast: agreement to rounding noise.
    got64 = hstu_attn_reference(**pkw, compute_dtype=torch.float64)
    assert got64.dtype == torch.float64 and got64.shape == want.shape
    torch.testing.assert_close(got64, want, rtol=1e-10, atol=1e-12)
    # Default fp32 oracle.
    got32 = hstu_attn_reference(**pkw)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, rtol=1e-5, atol=1e-6)
    # Padding rows are exactly zero (even with NaN in the padding storage).
    pad = padding_rows(kw)
    assert torch.all(got32[pad] == 0)
    assert torch.isfinite(got32).all()
    # Same-dtype variant in fp32 inputs equals the fp32 oracle up to summation order.
    same = hstu_attn_reference(**pkw, compute_dtype=None)
    assert same.dtype == torch.float32
    torch.testing.assert_close(same, got32, rtol=1e-6, atol=1e-7)
    assert torch.all(same[pad] == 0)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_brute_force_bf16_inputs(name):
    """bf16 inputs, fp32 oracle: the upcast is exact, so it must equal the fp64 brute force on the
    same (rounded) values up to fp32 noise."""
    kw = random_jagged_batch(**dict(CASES[name], dtype=torch.bfloat16, seed=7))
    want = brute_force(kw)["out"]
    got = hstu_attn_reference(**poison_padding(kw))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


GRAD_CASES = [
    "rab_h1",
    "rab_hH",
    "context_target_g2",
    "delta_causal_rab_H",
    "seqused_delta_local_rab",
    "seqused_context_target",
    "zero_length_sequences",
    "all_targets",
]


@pytest.mark.parametrize("name", GRAD_CASES)
def test_reference_grads_match_brute_force(name):
    kw = make_case(name)
    dout = torch.rand(kw["q"].shape, generator=torch.Generator().manual_seed(99), dtype=torch.float64) * 2 - 1
    want = brute_force(kw, dout)
    pkw = poison_padding(kw)
    got = reference_grads(**pkw, dout=dout, compute_dtype=torch.float64)
    for n in ("out", "dq", "dk", "dv"):
        assert got[n].dtype == torch.float64
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-12, msg=lambda m, n=n: f"{n}: {m}")
    if kw["rab"] is None:
        assert got["drab"] is None
    else:
        assert got["drab"].shape == kw["rab"].shape
        torch.testing.assert_close(got["drab"], want["drab"], rtol=1e-9, atol=1e-12)
    # Default fp32 oracle gradients are fp32 (leaves in the compute dtype).
    g32 = reference_grads(**pkw, dout=dout)
    for n in ("dq", "dk", "dv"):
        assert g32[n].dtype == torch.float32
        torch.testing.assert_close(g32[n].double(), want[n], rtol=1e-5, atol=1e-6)
        assert torch.isfinite(g32[n]).all()
    # Padded rows of dq are zero.
    assert torch.all(g32["dq"][padding_rows(kw)] == 0)


def test_reference_grads_same_dtype_bf16():
    kw = random_jagged_batch(
        3, 2, 16, 24, dtype=torch.bfloat16, lengths=[24, 17, 9], window_size=CAUSAL, rab_heads=1,
        num_targets=[4, 3, 0], seed=21,
    )  # fmt: skip
    dout = torch.rand(kw["q"].shape, generator=torch.Generator().manual_seed(1)) * 2 - 1
    g32 = reference_grads(**kw, dout=dout)
    gsame = reference_grads(**kw, dout=dout, compute_dtype=None)
    for n in ("out", "dq", "dk", "dv", "drab"):
        assert gsame[n].dtype == torch.bfloat16
        assert g32[n].dtype == torch.float32
        diff = (gsame[n].float() - g32[n]).abs().max().item()
        scale = g32[n].abs().max().item()
        assert 0 < diff <= 0.02 * scale, (n, diff, scale)


def test_reference_empty_batch_grads_are_zero():
    kw = random_jagged_batch(**dict(CASES["empty_batch"], rab_heads=1, seed=0))
    assert kw["q"].shape[0] == 0
    out = hstu_attn_reference(**kw)
    assert out.shape == (0, 2, 4)
    g = reference_grads(**kw, dout=torch.zeros(0, 2, 4))
    assert g["dq"].shape == (0, 2, 4) and g["drab"].shape == kw["rab"].shape
    assert torch.all(g["drab"] == 0)


def test_reference_grads_takes_the_oracles_arguments():
    """reference_grads shares the oracle's parameter list: positional and keyword calls agree,
    its signature is the oracle's plus the keyword-only dout, and unknown or missing arguments
    are refused like a plain function's."""
    import inspect

    kw = make_case("delta_causal_rab_H")
    dout = torch.rand(kw["q"].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    names = list(inspect.signature(hstu_attn_reference).parameters)
    positional = [kw.pop(n) for n in names[:14]]  # q .. is_delta_q, the oracle's positional parameters
    by_position = reference_grads(*positional, dout=dout, compute_dtype=torch.float64, **kw)
    by_name = reference_grads(**dict(zip(names, positional)), **kw, dout=dout, compute_dtype=torch.float64,
                              has_drab=True)
    for n in ("out", "dq", "dk", "dv", "drab"):
        assert torch.equal(by_position[n], by_name[n]), n
    assert by_position["drab"] is not None and positional[0].grad is None  # the caller's tensors untouched
    params = dict(inspect.signature(reference_grads).parameters)
    assert params.pop("dout").kind is inspect.Parameter.KEYWORD_ONLY
    assert list(params.values()) == list(inspect.signature(hstu_attn_reference).parameters.values())
    with pytest.raises(TypeError, match="dout"):
        reference_grads(*positional, **kw)
    with pytest.raises(TypeError, match="bogus"):
        reference_grads(*positional, dout=dout, bogus=1, **kw)
    with pytest.raises(TypeError):
        reference_grads(*positional, dout, **kw)  # dout is keyword-only


def test_has_drab_kwarg_is_accepted():
    kw = make_case("rab_h1")
    a = hstu_attn_reference(**kw, has_drab=True)
    b = hstu_attn_reference(**kw)
    assert torch.equal(a, b)


def test_autograd_on_user_leaves():
    kw = random_jagged_batch(2, 2, 8, 6, dtype=torch.bfloat16, rab_heads=1, requires_grad=True, seed=4,
                             window_size=CAUSAL, lengths=[6, 5])  # fmt: skip
    out = hstu_attn_reference(**kw)
    out.sum().backward()
    for n in ("q", "k", "v", "rab"):
        assert kw[n].grad is not None and kw[n].grad.dtype == torch.bfloat16
        assert kw[n].grad.abs().sum() > 0
    # drab is zero outside the used rows/cols and the causal region.
    assert torch.all(kw["rab"].grad[0, 0].triu(1) == 0)


# ------------------------------------------------------------------------------------------------
# Same-dtype variant, ratio rule.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [(-1, -1), CAUSAL, (5, 3)])
def test_same_dtype_differs_slightly(dtype, window):
    kw = random_jagged_batch(3, 2, 32, 48, dtype=dtype, window_size=window, rab_heads=2, seed=17,
                             lengths=[48, 30, 11])  # fmt: skip
    ref32 = hstu_attn_reference(**kw)
    same = hstu_attn_reference(**kw, compute_dtype=None)
    also_same = hstu_attn_reference(**kw, compute_dtype=dtype)
    assert same.dtype == dtype and ref32.dtype == torch.float32
    assert torch.equal(same, also_same)
    err = (same.float() - ref32).abs().max().item()
    scale = ref32.abs().max().item()
    assert 0 < err < 0.01 * scale, (err, scale)
    # Rounding ref32 to the dtype is within the same-dtype error budget's order of magnitude.
    ok, kerr, rerr = ratio_check(ref32.to(dtype), ref32, same, 2)
    assert ok, (kerr, rerr)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_same_dtype_follows_kernel_rounding_points(dtype):
    """ref_same_dtype rounds P (before the P.V sum) and the output, nothing else: compare with the
    brute force rounding at the same points. Summation order (fp32 vs float64) may flip a final
    rounding now and then, so allow one ulp and require almost all entries to agree exactly."""
    kw = random_jagged_batch(
        3, 2, 8, 24, dtype=dtype, lengths=[24, 13, 20], window_size=CAUSAL, rab_heads=1, alpha=1.7,
        num_targets=[5, 2, 0], seed=8,
    )  # fmt: skip
    want = brute_force(kw, round_to=dtype)["out"]
    got = hstu_attn_reference(**kw, compute_dtype=None).double()
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    assert ((got - want).abs() <= ulp * want.abs()).all()
    exact = (got == want).double().mean().item()
    assert exact > 0.97, exact
    # Without rounding P the agreement would be far worse (guards the test's own power).
    no_p_rounding = brute_force(kw)["out"].to(dtype).double()
    assert (no_p_rounding == want).double().mean().item() < exact - 0.1


def test_ratio_check_rule():
    ref = torch.linspace(-1, 1, 100, dtype=torch.float64)
    same = ref + 1e-3
    ok, kerr, rerr = ratio_check(ref + 1.5e-3, ref, same, 2)
    assert ok and abs(kerr - 1.5e-3) < 1e-9 and abs(rerr - 1e-3) < 1e-9
    ok, _, _ = ratio_check(ref + 2.5e-3, ref, same, 2)
    assert not ok
    ok, _, _ = ratio_check(ref + 4.9e-3, ref, same, 5)
    assert ok
    bad = ref.clone()
    bad[3] = float("nan")
    assert not ratio_check(bad, ref, same, 2)[0]
    bad[3] = float("inf")
    assert not ratio_check(bad, ref, same, 2)[0]
    # Zero reference error: only eps of slack.
    assert ratio_check(ref + 5e-7, ref, ref, 2)[0]
    assert not ratio_check(ref + 1e-5, ref, ref, 2)[0]
    # Empty tensors pass; shape mismatch raises.
    assert ratio_check(torch.zeros(0), torch.zeros(0), torch.zeros(0), 2) == (True, 0.0, 0.0)
    with pytest.raises(ValueError):
        ratio_check(torch.zeros(3), torch.zeros(4), torch.zeros(4), 2)
    # Mixed dtypes are fine.
    assert ratio_check(ref.bfloat16(), ref, ref.bfloat16(), 2)[0]


# ------------------------------------------------------------------------------------------------
# random_jagged_batch (hstu_cute.testing).
# ------------------------------------------------------------------------------------------------


def test_random_jagged_batch_invariants():
    for seed in range(40):
        delta = seed % 2 == 1
        max_k = 3 + seed
        max_q = max_k - (seed % 3) if delta else max_k
        kw = random_jagged_batch(
            5, 2, 8, max_q, max_k, is_delta_q=delta, seqused=seed % 4 < 2, num_contexts=4 if seed % 3 else None,
            window_size=CAUSAL,
            num_targets=5, rab_heads=1 if seed % 2 else 2, lengths="full" if seed % 5 == 0 else "random", seed=seed,
        )  # fmt: skip
        oq, ok_ = kw["seq_offsets_q"], kw["seq_offsets_k"]
        assert oq.dtype == torch.int32 and ok_.dtype == torch.int32 and oq[0] == 0 and ok_[0] == 0
        sq, sk = (oq[1:] - oq[:-1]).tolist(), (ok_[1:] - ok_[:-1]).tolist()
        assert kw["q"].shape == (int(oq[-1]), 2, 8) and kw["k"].shape == kw["v"].shape == (int(ok_[-1]), 2, 8)
        assert kw["q"].dtype == torch.bfloat16 and kw["q"].abs().max() <= 1
        assert kw["rab"].shape == (5, 1 if seed % 2 else 2, max_k, max_k)
        Lq = kw["seqused_q"].tolist() if kw["seqused_q"] is not None else sq
        Lk = kw["seqused_k"].tolist() if kw["seqused_k"] is not None else sk
        for b in range(5):
            assert 0 <= Lq[b] <= sq[b] <= max_q and 0 <= Lk[b] <= sk[b] <= max_k
            if delta:
                assert Lq[b] <= Lk[b] and sq[b] <= sk[b]
            else:
                assert Lq[b] == Lk[b] and sq[b] == sk[b]
            c = int(kw["num_contexts"][b]) if kw["num_contexts"] is not None else 0
            t = int(kw["num_targets"][b])
            assert c >= 0 and t >= 0 and c + t <= Lk[b]
        for key in ("num_targets", "seqused_q", "seqused_k"):
            assert kw[key] is None or kw[key].dtype == torch.int32
        if seed % 5 == 0 and seed % 4 >= 2:
            assert sk == [max_k] * 5
        # The oracle accepts the dict as-is.
        hstu_attn_reference(**kw)


def test_random_jagged_batch_reproducible_and_validates():
    a = random_jagged_batch(3, 2, 8, 20, seed=5, rab_heads=2, num_targets=4)
    b = random_jagged_batch(3, 2, 8, 20, seed=5, rab_heads=2, num_targets=4)
    for n in ("q", "k", "v", "rab", "seq_offsets_q", "num_targets"):
        assert torch.equal(a[n], b[n])
    assert set(a) == {
        "q", "k", "v", "seq_offsets_q", "seq_offsets_k", "max_seqlen_q", "max_seqlen_k", "num_contexts",
        "num_targets", "target_group_size", "window_size", "alpha", "rab", "is_delta_q", "scaling_seqlen",
        "seqused_q", "seqused_k",
    }  # fmt: skip
    with pytest.raises(ValueError):
        random_jagged_batch(2, 2, 8, 10, 12)  # max_q < max_k without delta_q
    with pytest.raises(ValueError):
        random_jagged_batch(2, 2, 8, 10, rab_heads=3)
    with pytest.raises(ValueError):
        random_jagged_batch(2, 2, 8, 10, lengths=[3, 11])


def test_reference_rejects_bad_inputs():
    kw = make_case("rab_h1")
    with pytest.raises(ValueError):
        hstu_attn_reference(**dict(kw, window_size=(-1, -1), num_targets=torch.zeros(4, dtype=torch.int32)))
    with pytest.raises(ValueError):
        hstu_attn_reference(**dict(kw, rab=kw["rab"][:, :, :3]))
    with pytest.raises(ValueError):
        hstu_attn_reference(**dict(kw, max_seqlen_q=3, max_seqlen_k=3))  # lengths exceed max_seqlen
    with pytest.raises(ValueError):
        hstu_attn_reference(**dict(kw, window_size=CAUSAL, num_targets=torch.full((4,), 9, dtype=torch.int32)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reference_cuda_matches_cpu():
    kw = make_case("seqused_context_target")
    cpu = hstu_attn_reference(**kw)
    kw_cuda = {n: (x.cuda() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    cuda = hstu_attn_reference(**kw_cuda)
    assert cuda.is_cuda
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-5, atol=1e-6)
