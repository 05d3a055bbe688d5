"""Kernel vs oracle on the GPU (spec section 5 ratio rule). Skips cleanly without a GPU.

Every test runs on both forward kernel paths (the ``path`` fixture of conftest.py): 'ampere'
(mma.sync, any sm80+ GPU) and 'hopper' (TMA + WGMMA, compute capability 9.x only, skipped elsewhere).

Every batch is drawn with an explicit, process-independent seed (no ``hash()``: it is salted per
process), and failures print it: ``random_jagged_batch(..., seed=<seed>)`` redraws the batch."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from hstu_cute import hstu_attn_varlen_func, launch, reference, variants
from hstu_cute.testing import call_record, random_jagged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# FBGEMM's test shapes (spec section 5): (max_seqlen_q, max_seqlen_k); q < k means delta_q.
SHAPES = [(32, 32), (99, 99), (256, 256), (1111, 1111), (27, 32), (8, 99), (51, 256), (160, 2000)]
MASKS = {
    "none": dict(window_size=(-1, -1)),
    "causal": dict(window_size=(-1, 0)),
    "local111,11": dict(window_size=(111, 11)),
    "local111,222": dict(window_size=(111, 222)),
    "ctx+tgt g1": dict(window_size=(-1, 0), num_contexts=333, num_targets=1111, target_group_size=1),
    "tgt g11": dict(window_size=(-1, 0), num_targets=1111, target_group_size=11),
    "ctx+tgt g222": dict(window_size=(-1, 0), num_contexts=333, num_targets=1111, target_group_size=222),
}
DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = list(variants.HEAD_DIMS)
RABS = [None, 1, "H"]


def _grid():
    """A rotating design over the FBGEMM-like grid: every shape x mask pair, with dtype, head dim,
    rab, alpha, lengths and seqused cycling so every option meets every shape and mask family."""
    cases = []
    for i, ((mq, mk), (mask_name, mask)) in enumerate(itertools.product(SHAPES, MASKS.items())):
        delta = mq < mk
        cases.append(pytest.param(
            dict(
                max_seqlen_q=mq, max_seqlen_k=mk, is_delta_q=delta, mask=mask,
                dtype=DTYPES[i % 2], head_dim=HEAD_DIMS[(i // 2) % len(HEAD_DIMS)], rab=RABS[i % 3],
                alpha=(1.0, 0.1)[(i // 3) % 2], lengths=("random", "full")[(i // 5) % 2],
                seqused=(i % 4) == 1,
            ),
            id=f"{mq}x{mk}-{mask_name}-{i}",
        ))
    return cases


def _seed(*parts) -> int:
    """A seed that is the same in every process (unlike ``hash``, which PYTHONHASHSEED salts)."""
    return zlib.crc32(repr(parts).encode())


def _check(b, path, seed):
    """Poisoned output buffer -> kernel of ``path`` -> ratio rule against fp32 and same-dtype oracles.
    ``seed``: the batch's seed, reported in failures."""
    call, rab = call_record(**b)
    out = torch.full_like(b["q"], float("nan"))
    launch.forward(b["q"], b["k"], b["v"], rab, call, out=out, path=path)
    torch.cuda.synchronize()
    ref32 = reference.hstu_attn_reference(**b)
    ref_same = reference.hstu_attn_reference(**b, compute_dtype=None)
    ok, err, ref_err = reference.ratio_check(out, ref32, ref_same, 2.0)
    assert not torch.isnan(out).any(), (
        f"[{path} seed={seed}] unwritten (poisoned) output rows, or NaN read from padding"
    )
    assert ok, f"[{path} seed={seed}] kernel err {err:.3e} > 2 x same-dtype err {ref_err:.3e}"
    return out


def _run(path, batch, dtype, seed, heads=2, **kw):
    """A random jagged batch (drawn with ``seed``) through the kernel of ``path``, checked against the oracle."""
    b = random_jagged_batch(batch, heads, device="cuda", dtype=dtype, seed=seed, **kw)
    return b, _check(b, path, seed)


@pytest.mark.parametrize("case", _grid())
def test_fbgemm_grid(case, path):
    case = dict(case)  # the param dict is shared by both paths' runs
    seed = _seed(case)  # the whole case (mask, rab and dtype included); the same on both paths
    mask = case.pop("mask")
    rab = case.pop("rab")
    rab_heads = 2 if rab == "H" else rab
    _run(path, 32, case.pop("dtype"), seed, rab_heads=rab_heads, **mask, **case)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("mask", ["none", "causal", "ctx+tgt g1", "tgt g11", "local111,11"])
def test_edge_lengths(head_dim, mask, path):
    m = dict(MASKS[mask])
    if "num_contexts" in m or "num_targets" in m:
        m["num_contexts"], m["num_targets"], m["target_group_size"] = 5, 20, 3
    _run(path, 4, torch.bfloat16, _seed("edge", head_dim, mask), head_dim=head_dim, max_seqlen_q=1111,
         lengths=[0, 1, 17, 1111], rab_heads=1, **m)


def test_all_target_sequences(path):
    lens = [64, 300, 1, 129]
    _run(path, 4, torch.bfloat16, 1, head_dim=128, max_seqlen_q=300, lengths=lens, window_size=(-1, 0),
         num_targets=lens, target_group_size=7)


@pytest.mark.parametrize("max_len", [0, 16])
def test_empty_batch(max_len, path):
    b = random_jagged_batch(3, 2, 64, max_len, lengths=[0, 0, 0], device="cuda", seed=0)
    out = hstu_attn_varlen_func(**b)
    assert out.shape == (0, 2, 64)


def test_delta_q_with_seqused_and_scaling(path):
    _run(path, 8, torch.float16, 2, head_dim=64, max_seqlen_q=77, max_seqlen_k=300, is_delta_q=True,
         window_size=(-1, 0), seqused=True, scaling_seqlen=500, rab_heads=2)


def test_large_batch_short_sequences(path):
    _run(path, 3000, torch.bfloat16, 4, heads=1, head_dim=32, max_seqlen_q=9, window_size=(-1, 0))


def test_claimed_tiles_across_launches_and_streams(path):
    """The Hopper forward's CTAs claim tiles from a per-stream counter that each launch must leave
    at zero: many launches in a row, and launches on two streams at once, all give the first
    (oracle-checked) output bitwise, on a jagged batch of thousands of tiles (lengths 0 to 700,
    so most CTAs claim several tiles and some claims land past the sequences' ends)."""
    if path != "hopper":
        pytest.skip("tile claims are a Hopper forward feature")
    b, first = _run(path, 600, torch.bfloat16, 11, heads=4, head_dim=128, max_seqlen_q=700,
                    window_size=(-1, 0), num_targets=16)
    kw = {k: v for k, v in b.items() if k in ("seq_offsets_q", "seq_offsets_k", "max_seqlen_q", "max_seqlen_k",
                                             "num_targets", "window_size", "alpha")}
    outs = [hstu_attn_varlen_func(b["q"], b["k"], b["v"], **kw) for _ in range(8)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(4):
        for s in streams:
            with torch.cuda.stream(s):
                outs.append(hstu_attn_varlen_func(b["q"], b["k"], b["v"], **kw))
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        torch.testing.assert_close(out, first, rtol=0, atol=0, msg=f"launch {i}")
    counters = [c for c in launch._TILE_COUNTERS.values()]
    assert counters and all(int(c.abs().sum()) == 0 for c in counters), counters


def test_public_api_matches_forward(path):
    b = random_jagged_batch(4, 2, 128, 200, device="cuda", window_size=(-1, 0), seed=3)
    out = hstu_attn_varlen_func(**b)
    ref32 = reference.hstu_attn_reference(**b)
    ref_same = reference.hstu_attn_reference(**b, compute_dtype=None)
    ok, err, ref_err = reference.ratio_check(out, ref32, ref_same, 2.0)
    assert ok, f"[{path} seed=3] kernel err {err:.3e} > 2 x same-dtype err {ref_err:.3e}"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", [
    pytest.param(dict(max_seqlen_q=300, window_size=(-1, 0)), id="causal"),
    pytest.param(dict(max_seqlen_q=257, window_size=(-1, -1), rab_heads=2), id="none-rab"),
    pytest.param(dict(max_seqlen_q=77, max_seqlen_k=300, is_delta_q=True, window_size=(64, 0), rab_heads=1),
                 id="delta_q-local-rab"),
])
def test_nan_beyond_seqused(head_dim, case, path):
    """k and v rows past seqused_k (up to the next sequence's offset) are NaN: the kernel must never
    let them into a valid output (masked scores times NaN would still be NaN)."""
    seed = head_dim + len(str(case))  # stable: str() of a dict of ints and tuples
    b = random_jagged_batch(8, 2, head_dim, lengths="full", seqused=True, seed=seed, device="cuda",
                            dtype=torch.bfloat16, **case)
    offsets = b["seq_offsets_k"].tolist()
    used = b["seqused_k"].tolist()
    poisoned = 0
    for start, end, n in zip(offsets, offsets[1:], used):
        if start + n < end:
            b["k"][start + n:end] = float("nan")
            b["v"][start + n:end] = float("nan")
            poisoned += end - start - n
    assert poisoned > 0, f"the draw (seed={seed}) left no padding to poison"
    out = _check(b, path, seed)
    assert not torch.isnan(out).any(), f"[{path} seed={seed}] NaN in the output"
