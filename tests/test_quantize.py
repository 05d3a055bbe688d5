"""FP8 quantizers (hstu_cute.quantize), on CPU: every mode's groups and scales, blocks that restart
at sequence starts, edge lengths, padding tokens, mode 1's 16-byte aligned token-contiguous copy
for any token count, and torch.export with a dynamic token count (no data-dependent shapes)."""

from __future__ import annotations

import pytest
import torch

from hstu_cute import quantize as qz
from hstu_cute.quantize import QuantMode

MODES = list(QuantMode)


def _batch(lengths, heads=2, dim=32, seed=0, pad=0):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths) + pad
    x = (torch.randn(tokens, heads, dim, generator=g) * torch.logspace(-2, 2, dim)).to(torch.bfloat16)
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return x, offsets, max(lengths)


def _expected_scale_shape(mode, tokens, heads, batch, blocks):
    return {QuantMode.CAST: (1,), QuantMode.TWO_DIRECTION: (tokens, heads), QuantMode.PER_BLOCK: (batch, blocks, heads),
            QuantMode.PER_HEAD: (batch, heads), QuantMode.PER_SEQUENCE: (batch,), QuantMode.PER_TENSOR: (1,)}[mode]


def _group_of(mode, t, h, d, seq, pos, block=qz.BLOCK_TOKENS, token_contiguous=False):
    """The group a scalar belongs to, written from the docstring's table (the test's own model)."""
    if mode == QuantMode.CAST:
        return None
    if mode == QuantMode.PER_TENSOR:
        return ()
    if mode == QuantMode.TWO_DIRECTION:
        return (seq, pos // block, h, d) if token_contiguous else (t, h)
    if mode == QuantMode.PER_BLOCK:
        return (seq, pos // block, h)
    if mode == QuantMode.PER_HEAD:
        return (seq, h)
    return (seq,)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lengths", [[1, 17, 300], [128, 129, 0, 5], [1111]])
def test_scales_are_group_amax_over_448(mode, lengths):
    x, offsets, max_len = _batch(lengths, seed=len(lengths) + int(mode))
    q = qz.quantize(x, mode, offsets, max_len)
    tokens, heads, dim = x.shape
    blocks = qz.num_blocks(max_len)
    assert q.data.dtype == qz.E4M3 and q.data.shape == x.shape
    assert tuple(q.scale.shape) == _expected_scale_shape(mode, tokens, heads, len(lengths), blocks)
    # The amax of every group from a plain loop over the scalars.
    views = [False, True] if mode == QuantMode.TWO_DIRECTION else [False]
    for token_contiguous in views:
        amax: dict = {}
        starts = offsets.tolist()
        for seq, n in enumerate(lengths):
            for pos in range(n):
                t = starts[seq] + pos
                for h in range(heads):
                    for d in range(dim):
                        key = _group_of(mode, t, h, d, seq, pos, token_contiguous=token_contiguous)
                        if key is not None:
                            amax[key] = max(amax.get(key, 0.0), abs(float(x[t, h, d])))
        scales = q.scale_t if token_contiguous else q.scale
        for key, value in amax.items():
            want = max(value / qz.E4M3_MAX, qz.SCALE_FLOOR)
            assert float(scales[key] if key != () else scales[0]) == pytest.approx(want, rel=1e-6), key


@pytest.mark.parametrize("mode", MODES)
def test_round_trip_error_is_e4m3_rounding(mode):
    x, offsets, max_len = _batch([5, 300, 17, 128], dim=64, seed=3)
    q = qz.quantize(x, mode, offsets, max_len)
    for token_contiguous in ([False, True] if mode == QuantMode.TWO_DIRECTION else [False]):
        back = qz.dequantize(q, mode, offsets, max_len, token_contiguous=token_contiguous)
        scale = qz.dequantize(qz.Quantized(torch.ones_like(q.data, dtype=torch.float32).to(qz.E4M3), q.scale,
                                           torch.ones_like(q.data_t, dtype=torch.float32).to(qz.E4M3)
                                           if q.data_t is not None else None, q.scale_t),
                              mode, offsets, max_len, token_contiguous=token_contiguous)
        xf = x.float()
        if mode == QuantMode.CAST:
            xf = xf.clamp(-qz.E4M3_MAX, qz.E4M3_MAX)
        # e4m3: 3 mantissa bits (half-ulp 2^-4 relative), subnormal step 2^-9 of the scale.
        bound = xf.abs() * 2.0**-4 + scale * 2.0**-10
        assert torch.all((back - xf).abs() <= bound * (1 + 1e-6)), (back - xf).abs().max()


def test_blocks_restart_at_sequence_starts():
    """Mode 2: a large value in sequence 0's second block scales only that block; the next
    sequence's first block (which shares no 128-token global block boundary) keeps its own."""
    lengths = [130, 5, 128]
    x, offsets, max_len = _batch(lengths, heads=1, dim=16, seed=4)
    x[129, 0, 3] = 1000.0
    q = qz.quantize(x, QuantMode.PER_BLOCK, offsets, max_len)
    assert float(q.scale[0, 1, 0]) == pytest.approx(1000.0 / 448, rel=1e-6)
    assert float(q.scale[0, 0, 0]) < 1.0 and float(q.scale[1, 0, 0]) < 1.0
    assert float(q.scale[1, 1, 0]) == pytest.approx(qz.SCALE_FLOOR)  # a block no token of sequence 1 reaches


def test_padding_tokens_and_saturation_stay_finite():
    x, offsets, max_len = _batch([3, 4], seed=5, pad=9)  # 9 tokens past the last sequence
    x[-1] = 1e4  # padding far beyond the groups' amax
    x[0, 0, 0] = 1e4  # and mode 0's range
    for mode in MODES:
        q = qz.quantize(x, mode, offsets, max_len)
        assert torch.isfinite(q.data.float()).all(), mode
        if q.data_t is not None:
            assert torch.isfinite(q.data_t.float()).all(), mode
    assert float(qz.quantize(x, QuantMode.CAST, offsets, max_len).data[0, 0, 0].float()) == qz.E4M3_MAX


@pytest.mark.parametrize("tokens", [1, 15, 17, 1111])
def test_token_contiguous_copy_is_16_byte_aligned(tokens):
    x, offsets, max_len = _batch([tokens], seed=tokens)
    q = qz.quantize(x, QuantMode.TWO_DIRECTION, offsets, max_len)
    heads, dim = x.shape[1:]
    assert q.data_t.shape == (heads, dim, -(-tokens // 16) * 16) and q.data_t.is_contiguous()
    assert q.data_t.stride(1) % 16 == 0  # bytes per row of e4m3
    assert torch.all(q.data_t[:, :, tokens:].float() == 0)


def test_empty_sequences_and_tensor():
    x, offsets, max_len = _batch([0, 0, 3], seed=6)
    for mode in MODES:
        q = qz.quantize(x, mode, offsets, max_len)
        assert torch.isfinite(qz.dequantize(q, mode, offsets, max_len)).all()
    empty = torch.zeros(0, 2, 32, dtype=torch.bfloat16)
    zero = torch.tensor([0, 0], dtype=torch.int32)
    for mode in MODES:
        q = qz.quantize(empty, mode, zero, 1)
        assert q.data.shape == (0, 2, 32)


class _Quantizer(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    def forward(self, x, offsets):
        q = qz.quantize(x, self.mode, offsets, 300)
        return tuple(t for t in q if t is not None)


@pytest.mark.parametrize("mode", MODES)
def test_export_with_dynamic_token_count(mode):
    """No data-dependent shapes: one exported program serves any token count and any offsets."""
    from torch.export import Dim

    x, offsets, _ = _batch([17, 300, 5], seed=7)
    ep = torch.export.export(_Quantizer(mode), (x, offsets), dynamic_shapes=({0: Dim("tokens", min=2)}, {0: None}))
    for lengths in ([17, 300, 5], [1, 1, 250]):
        x2, off2, _ = _batch(lengths, seed=8)
        got = ep.module()(x2, off2)
        want = _Quantizer(mode)(x2, off2)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# The FP8 emulation oracle (reference.hstu_attn_fp8_emulation)
# ---------------------------------------------------------------------------------------------
def _attn_batch(seed=9):
    from hstu_cute.testing import random_jagged_batch

    return random_jagged_batch(4, 2, 64, 200, lengths=[1, 17, 200, 130], window_size=(-1, 0), seed=seed,
                               dtype=torch.bfloat16)


@pytest.mark.parametrize("mode", MODES)
def test_emulation_error_is_fp8_sized(mode):
    """Quantized inputs and P move the output by an FP8-sized amount: more than bf16 rounding,
    well under the output's scale."""
    from hstu_cute import reference

    b = _attn_batch()
    exact = reference.hstu_attn_reference(**b)
    emulated = reference.hstu_attn_fp8_emulation(**b, quant_mode=int(mode))
    scale = exact.abs().max()
    err = (emulated - exact).abs().max() / scale
    same_dtype = (reference.hstu_attn_reference(**b, compute_dtype=None).float() - exact).abs().max() / scale
    assert torch.isfinite(emulated).all()
    assert same_dtype < err < 0.15, (float(err), float(same_dtype))


def test_emulation_without_p_rounding_is_the_oracle_on_dequantized_inputs():
    from hstu_cute import reference

    b = _attn_batch(seed=10)
    mode = QuantMode.PER_HEAD
    deq = {n: qz.dequantize(qz.quantize(b[n], mode, b[o], b[m]), mode, b[o], b[m])
           for n, o, m in (("q", "seq_offsets_q", "max_seqlen_q"), ("k", "seq_offsets_k", "max_seqlen_k"),
                           ("v", "seq_offsets_k", "max_seqlen_k"))}
    want = reference.hstu_attn_reference(**dict(b, **deq))
    got = reference.hstu_attn_fp8_emulation(**b, quant_mode=int(mode), round_p=False)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_scaled_p_rule():
    """The scaled-P rule (hstu_cute.fp8_format): each row has its own running power-of-two scale
    over key blocks visited last to first, so a large P in a row's first block (visited last)
    leaves its later blocks' rounding alone, one in its last block coarsens the earlier ones, and
    other rows never notice; the plain cast saturates at 448."""
    from hstu_cute import reference

    g = torch.Generator().manual_seed(11)
    p = torch.rand(2, 40, 300, generator=g) + 0.5
    dv = torch.full((2, 300), 0.01)
    p[0, 0, 0] = 1e4  # first block of row 0: visited last
    p[0, 1, 299] = 1e5  # last block of row 1: visited first
    r = reference.scaled_p_e4m3(p, dv, 128)
    assert r.shape == p.shape
    rel = ((r - p).abs() / p)
    assert float(r[0, 0, 0]) == pytest.approx(1e4, rel=2**-4)
    assert (rel[0, 0, 128:] <= 2**-4).all()  # blocks visited before the large value
    assert (rel[:, 2:] <= 2**-4).all() and (rel[1] <= 2**-4).all()
    # Row 1's scale grew with its last block: its first blocks keep fewer bits (values ~1 next
    # to 1e5 at (224, 448] land in e4m3's subnormals).
    coarse = rel[0, 1, :256]
    assert coarse.max() > 2**-4
    # Powers of two: with dv = 1 and P exactly 448 * 2**k the rounding is exact.
    exact = torch.full((1, 1, 64), 448.0 * 8)
    assert torch.equal(reference.scaled_p_e4m3(exact, torch.ones(1, 64), 64), exact)
    assert float(reference.cast_p_e4m3(p)[0, 0, 0]) == qz.E4M3_MAX


def test_vt_key_order_matches_the_operand_packing():
    """Recipe B: the forward packs operand register (row g, 16-key half) from accumulator slots
    ROW_G_SLOTS of the half (accumulator register 4j + 2i + c holds column 8j + 2q + c), and an
    8-bit A operand's byte e of lane q sits at k position 4q + e (PTX wgmma fragments): V^T column
    4q + e must then hold exactly that accumulator column, for every lane."""
    pytest.importorskip("cutlass")
    from hstu_cute.common.fp8 import ROW_G8_SLOTS, ROW_G_SLOTS
    from hstu_cute.fp8_format import COLUMN_OF_KEY, KEY_AT_COLUMN, column_of_key, key_at_column, vt_key_column

    for q in range(4):
        for e, (slot, slot8) in enumerate(zip(ROW_G_SLOTS, ROW_G8_SLOTS)):
            assert slot8 == slot + 2  # the same columns, row g + 8 (i = 1)
            assert KEY_AT_COLUMN[4 * q + e] == 8 * (slot // 4) + 2 * q + slot % 2
    assert sorted(KEY_AT_COLUMN) == list(range(16))
    assert [column_of_key(k) for k in range(16)] == list(COLUMN_OF_KEY)
    assert [key_at_column(p) for p in range(16)] == list(KEY_AT_COLUMN)
    assert sorted(vt_key_column(k) for k in range(48)) == list(range(48))


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4, 5])
def test_quantizer_launches_are_shipped_and_complete(mode):
    """Every slot set the launcher can ask for (variants.quant_launches) is a shipped compile key;
    each purpose writes exactly the copies its readers take (forward: e4m3 q, k and V^T;
    training: also Q^T, K^T and e4m3 V; gradient: e4m3 dO and dO^T), each copy once; modes 3-5
    in one cooperative launch."""
    from hstu_cute import variants
    from hstu_cute.fp8_format import QUANT_MAX_SLOTS

    shipped = set(variants.shipped_quant_slots())
    wanted = {"forward": {(0, "P"), (1, "P"), (2, "T")},
              "training": {(i, c) for i in range(3) for c in "PT"},
              "gradient": {(0, "P"), (0, "T")}}
    for purpose in variants.QUANT_PURPOSES:
        launches = variants.quant_launches(mode, purpose)
        written = []
        for launch in launches:
            assert 1 <= len(launch) <= QUANT_MAX_SLOTS
            assert tuple(slot[1:] for slot in launch) in shipped, (mode, purpose, launch)
            for i, role, plain, transposed in launch:
                written += [(i, "P")] * plain + [(i, "T")] * transposed
        assert sorted(written) == sorted(wanted[purpose]), (mode, purpose)
        if mode >= 3:
            # One cooperative launch: each tensor's scales, a grid barrier, then its cast.
            (launch,) = launches
            assert all(role == "group" for _, role, _, _ in launch)
            assert variants.make_hopper_quant_slots_key("sm_90a", "bfloat16", 128, [s[1:] for s in launch]).cooperative
