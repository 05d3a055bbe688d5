"""The Hopper FP8 forward against the FP8 emulation oracle (docs/operator.md, FP8): the kernel's
error against the fp32 oracle on the unquantized inputs must stay within 2x of the emulation's
(quantize and dequantize in PyTorch, P through e4m3, fp32 math). Skips without an sm90 GPU.

Entry points: pre-quantized e4m3 inputs with (1,) descales (here quantized per tensor by
``hstu_cute.quantize``, mode 5's groups) and ``quant_mode`` 0 (P cast) and 1-5 (scaled P) with
16-bit inputs."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from hstu_cute import hstu_attn_varlen_func, launch, reference, variants
from hstu_cute.fp8_format import vt_key_column
from hstu_cute.quantize import QuantMode, quantize_batch
from hstu_cute.testing import call_record, random_jagged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="the FP8 kernels need a compute capability 9.x GPU"),
]

SHAPES = [(32, 32), (99, 99), (256, 256), (1111, 1111), (51, 256), (160, 2000)]
MASKS = {
    "none": dict(window_size=(-1, -1)),
    "causal": dict(window_size=(-1, 0)),
    "local111,11": dict(window_size=(111, 11)),
    "ctx+tgt g1": dict(window_size=(-1, 0), num_contexts=333, num_targets=1111, target_group_size=1),
    "tgt g11": dict(window_size=(-1, 0), num_targets=1111, target_group_size=11),
}
HEAD_DIMS = [64, 128, 256]
RABS = [None, 1, "H"]
# (entry, output dtype): pre-quantized inputs give bf16; quant_mode N keeps the inputs' dtype.
ENTRIES = [("prequantized", torch.bfloat16), ("mode0", torch.bfloat16), ("mode0", torch.float16),
           ("mode1", torch.bfloat16), ("mode2", torch.bfloat16), ("mode3", torch.float16), ("mode4", torch.bfloat16),
           ("mode5", torch.bfloat16), ("mode1", torch.float16)]
SCALED_MODES = [1, 2, 3, 4, 5]


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _grid():
    cases = []
    for i, ((mq, mk), (mask_name, mask)) in enumerate(itertools.product(SHAPES, MASKS.items())):
        delta = mq < mk
        if delta and ("num_contexts" in mask or "num_targets" in mask):
            continue
        entry, dtype = ENTRIES[i % len(ENTRIES)]
        cases.append(pytest.param(
            dict(max_seqlen_q=mq, max_seqlen_k=mk, is_delta_q=delta, mask=mask, entry=entry, dtype=dtype,
                 head_dim=HEAD_DIMS[(i // 3) % 3], rab=RABS[(i // 2) % 3], alpha=(1.0, 0.3)[(i // 5) % 2],
                 lengths=("random", "full")[(i // 4) % 2], seqused=(i % 5) == 2),
            id=f"{mq}x{mk}-{mask_name}-{entry}-{i}"))
    return cases


def _prequantized(b):
    """e4m3 q, k, v (per-tensor scales) and their (1,) descales, from a 16-bit batch."""
    return {n: (x.data, x.scale) for n, x in zip("qkv", quantize_batch(b, QuantMode.PER_TENSOR))}


def _key_columns(first_column: int, length: int) -> torch.Tensor:
    """V^T columns of a sequence's keys 0..length-1, in key order (fp8_format.vt_key_column)."""
    return torch.tensor([first_column + vt_key_column(k) for k in range(length)], dtype=torch.long, device="cuda")


def _ref_args(b):
    return {k: v for k, v in b.items() if k not in ("q", "k", "v")}


def run_fp8(b, entry, out_dtype):
    """(kernel output, emulation, fp32 oracle on the unquantized inputs) of one batch."""
    rest = _ref_args(b)
    if entry == "prequantized":
        pq = _prequantized(b)
        q8, k8, v8 = (pq[n][0] for n in "qkv")
        descales = [pq[n][1] for n in "qkv"]
        args = (q8, k8, v8)
        quant_mode = -1
        emul = reference.hstu_attn_reference(
            *(x.float() * d for x, d in zip(args, descales)), **rest, compute_dtype=torch.float32,
            p_round=lambda p, b: reference.cast_p_e4m3(p))
    else:
        args = (b["q"], b["k"], b["v"])
        descales = [None, None, None]
        quant_mode = int(entry.removeprefix("mode"))
        emul = reference.hstu_attn_fp8_emulation(*args, **rest, quant_mode=quant_mode)
    call, rab = call_record(**dict(b, q=args[0], k=args[1], v=args[2], quant_mode=quant_mode,
                                   **dict(zip(("descale_q", "descale_k", "descale_v"), descales))))
    assert call.problem.out_dtype == out_dtype
    out = launch.forward_fp8(*args, rab, call,
                             out=torch.full(b["q"].shape, float("nan"), dtype=out_dtype, device="cuda"))
    torch.cuda.synchronize()
    ref32 = reference.hstu_attn_reference(b["q"], b["k"], b["v"], **rest)
    return out, emul, ref32


def _check(b, entry, out_dtype, seed):
    out, emul, ref32 = run_fp8(b, entry, out_dtype)
    assert out.dtype == out_dtype
    assert not torch.isnan(out).any(), f"[seed={seed}] unwritten (poisoned) output rows or NaN read from padding"
    ok, err, emul_err = reference.ratio_check(out, ref32, emul, 2.0)
    assert ok, f"[{entry} seed={seed}] kernel err {err:.3e} > 2 x emulation err {emul_err:.3e}"
    return out


@pytest.mark.parametrize("case", _grid())
def test_fp8_grid(case):
    case = dict(case)
    seed = _seed(case)
    mask, rab, entry, dtype = case.pop("mask"), case.pop("rab"), case.pop("entry"), case.pop("dtype")
    b = random_jagged_batch(16, 2, device="cuda", dtype=dtype, seed=seed, rab_heads=2 if rab == "H" else rab,
                            **mask, **case)
    _check(b, entry, dtype, seed)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("entry", ["prequantized", "mode0", "mode1", "mode2"])
def test_fp8_edge_lengths(head_dim, entry):
    """Lengths 0, 1, 17, 1111: token counts that are not multiples of 16 (V^T's padded rows)."""
    b = random_jagged_batch(4, 2, head_dim, 1111, device="cuda", seed=_seed("edge", head_dim, entry),
                            lengths=[0, 1, 17, 1111], window_size=(-1, 0), num_targets=[0, 1, 5, 20],
                            target_group_size=3, rab_heads=1)
    _check(b, entry, torch.bfloat16, 0)


@pytest.mark.parametrize("mode", SCALED_MODES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fp8_scaled_modes(mode, head_dim):
    """Every scaled-P mode and head dim, on a jagged batch whose sequences and blocks have very
    different magnitudes (so that per-sequence, per-head and per-block scales differ), with
    targets, rab and a second, delta_q batch through a local window."""
    seed = _seed("scaled", mode, head_dim)
    b = random_jagged_batch(5, 3, head_dim, 700, device="cuda", seed=seed, window_size=(-1, 0), num_targets=7,
                            target_group_size=2, rab_heads=1, lengths=[700, 0, 129, 300, 64])
    g = torch.Generator(device="cuda").manual_seed(seed)
    for name in "qkv":
        # Magnitudes from 1/8 to 8 by token block, and by head.
        gain = torch.exp2(torch.randint(-3, 4, (b[name].shape[0] // 64 + 1, 3), generator=g, device="cuda").float())
        b[name] = (b[name].float() * gain.repeat_interleave(64, 0)[: b[name].shape[0], :, None]).to(b[name].dtype)
    _check(b, f"mode{mode}", torch.bfloat16, seed)
    b = random_jagged_batch(4, 2, head_dim, 300, 500, device="cuda", seed=seed + 1, window_size=(200, 30),
                            is_delta_q=True, dtype=torch.float16, alpha=0.5)
    _check(b, f"mode{mode}", torch.float16, seed + 1)


def _check_copies(copies: dict, x, offsets, max_seqlen: int, mode: int, lengths: list) -> None:
    """One tensor's copies from launch.quantize_for against hstu_cute.quantize, bit for bit: the
    e4m3 data of every sequence token and its table; V^T's columns of each sequence (mode 1: the
    (T, H) table of the sequences' tokens, and V^T against the token-contiguous copy with its
    (B, blocks, H, D) table and reciprocals)."""
    from hstu_cute import quantize

    want = quantize.quantize(x, mode, offsets, max_seqlen)
    two_direction = mode == QuantMode.TWO_DIRECTION
    batch, heads = len(lengths), x.shape[1]
    start, end = int(offsets[0]), int(offsets[-1])
    assert copies, "no copy written"
    if mode == QuantMode.CAST:  # no scale: tables of ones
        for _, table in copies.values():
            assert table.shape == (batch, 1, heads) and bool((table == 1).all())
    if "plain" in copies:
        data, table = copies["plain"]
        assert torch.equal(data[start:end].view(torch.uint8), want.data[start:end].view(torch.uint8))
        if two_direction:
            assert torch.equal(table[start:end], want.scale[start:end])
        elif mode != QuantMode.CAST:
            assert torch.equal(table, quantize.descale_table(want.scale, mode, batch, heads))
    if "transposed" in copies:
        vt, table = copies["transposed"]
        if two_direction:  # the scales, then their reciprocals
            assert torch.equal(table[:, :, :, 1], 1.0 / want.scale_t)
            table, want_table, by_token = table[:, :, :, 0], want.scale_t, want.data_t.permute(2, 0, 1)[: x.shape[0]]
        elif mode == QuantMode.CAST:
            want_table, by_token = table, want.data
        else:
            want_table, by_token = quantize.descale_table(want.scale, mode, batch, heads), want.data
        assert torch.equal(table, want_table)
        for seq, (first, length) in enumerate(zip(offsets.tolist(), lengths)):
            column = -(-first // 16) * 16 + 16 * seq
            got = vt[:, :, _key_columns(column, length)]
            assert torch.equal(got.view(torch.uint8), by_token[first:first + length].permute(1, 2, 0)
                               .view(torch.uint8)), seq


@pytest.mark.parametrize("mode", [0] + SCALED_MODES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_quantizer_launches_match_torch(mode, head_dim):
    """Every purpose's slot-quantizer launches (launch.quantize_for: q, k and v in one launch,
    modes 3-5 cooperative, with grid barriers) against hstu_cute.quantize: q on one set of offsets (300 tokens at most), k and v
    on another (200 at most: fewer blocks than q's in the same launch), magnitudes that differ by
    up to 256x between tokens and heads, empty and one-token sequences."""
    lengths_q, lengths_k = [300, 0, 1, 17, 129, 256], [200, 5, 0, 128, 129, 1]
    b = random_jagged_batch(6, 3, head_dim, 300, device="cuda", seed=_seed("quant", mode, head_dim), lengths=lengths_q)
    bk = random_jagged_batch(6, 3, head_dim, 200, device="cuda", seed=_seed("quant-k", mode, head_dim),
                             lengths=lengths_k)
    g = torch.Generator(device="cuda").manual_seed(mode)

    def skewed(x):
        gain = torch.exp2(torch.randint(-4, 5, (x.shape[0], 3, 1), generator=g, device="cuda").float())
        return (x.float() * gain).to(x.dtype)

    q, k, v, dout = skewed(b["q"]), skewed(bk["k"]), skewed(bk["v"]), skewed(b["v"])
    offsets = (b["seq_offsets_q"], bk["seq_offsets_k"], bk["seq_offsets_k"])
    for purpose in ("forward", "training"):
        copies = launch.quantize_for(mode, purpose, (q, k, v), offsets, (300, 200, 200))
        for x, offs, max_seqlen, lengths, got in zip((q, k, v), offsets, (300, 200, 200),
                                                     (lengths_q, lengths_k, lengths_k), copies):
            assert set(got) == ({"plain", "transposed"} if purpose == "training"
                                else {"transposed"} if x is v else {"plain"})
            _check_copies(got, x, offs, max_seqlen, mode, lengths)
    (got,) = launch.quantize_for(mode, "gradient", (dout,), offsets[:1], (300,))
    assert set(got) == {"plain", "transposed"}
    _check_copies(got, dout, offsets[0], 300, mode, lengths_q)


@pytest.mark.parametrize("mode", [3, 4, 5])
@pytest.mark.parametrize("head_dim, dtype", [(64, torch.bfloat16), (256, torch.float16)])
def test_group_quantizer_with_many_blocks_per_cta(mode, head_dim, dtype):
    """Modes 3-5's cooperative launch when every persistent CTA strides over several blocks of
    each tensor (more blocks than CTAs; at D256 one CTA per SM) and the groups' scales differ by
    up to 2^8: bit for bit against hstu_cute.quantize, in the forward's and the gradient's
    launches."""
    lengths = [4096, 1111, 3000, 17, 0, 2900, 4000, 129]
    b = random_jagged_batch(8, 4, head_dim, 4096, device="cuda", seed=_seed("group", mode, head_dim), lengths=lengths,
                            dtype=dtype)
    gain = torch.exp2(torch.arange(-4, 4, device="cuda").float())
    seq = torch.searchsorted(b["seq_offsets_q"].long(), torch.arange(b["q"].shape[0], device="cuda"), right=True) - 1
    q = (b["q"].float() * gain[seq.clamp(0, 7)][:, None, None]).to(dtype)
    offsets = (b["seq_offsets_q"],) * 3
    copies = launch.quantize_for(mode, "training", (q, b["k"], b["v"]), offsets, (4096,) * 3)
    for x, got in zip((q, b["k"], b["v"]), copies):
        _check_copies(got, x, b["seq_offsets_q"], 4096, mode, lengths)
    (got,) = launch.quantize_for(mode, "gradient", (q,), offsets[:1], (4096,))
    _check_copies(got, q, b["seq_offsets_q"], 4096, mode, lengths)


def test_group_quantizer_launch_that_cannot_fit_raises(monkeypatch):
    """A cooperative launch larger than the GPU holds (here: asked for 4x its SMs) must raise, not
    skip the quantizer and leave its outputs unwritten; the GPU stays usable."""
    b = random_jagged_batch(2, 2, 128, 300, device="cuda", seed=5)
    sms = launch.fp8.num_sms(torch.device("cuda"))
    monkeypatch.setattr(launch.fp8, "num_sms", lambda device: 4 * sms)
    with pytest.raises(Exception):
        launch.quantize_for(5, "forward", (b["q"], b["k"], b["v"]), (b["seq_offsets_q"],) * 3, (300,) * 3)
        torch.cuda.synchronize()
    monkeypatch.undo()
    torch.cuda.synchronize()
    copies = launch.quantize_for(5, "forward", (b["q"], b["k"], b["v"]), (b["seq_offsets_q"],) * 3, (300,) * 3)
    _check_copies(copies[0], b["q"], b["seq_offsets_q"], 300, 5, b["seq_offsets_q"].diff().tolist())


def test_fp8_all_target_and_many_sequences():
    lens = [64, 300, 1, 129]
    b = random_jagged_batch(4, 2, 128, 300, device="cuda", seed=3, lengths=lens, window_size=(-1, 0),
                            num_targets=lens, target_group_size=7)
    _check(b, "prequantized", torch.bfloat16, 3)
    b = random_jagged_batch(3000, 2, 64, 40, device="cuda", seed=4, window_size=(-1, 0))
    _check(b, "mode0", torch.bfloat16, 4)


def test_fp8_nan_in_one_sequence_stays_there():
    """V of sequence 0 is NaN (e4m3 0x7F): TMA reads it past the end of no other sequence's keys
    into a P.V (the kernel zeroes V^T key columns past seqlen_k), so the others stay exact."""
    b = random_jagged_batch(3, 2, 128, 200, device="cuda", seed=5, lengths=[7, 130, 200], window_size=(-1, 0))
    clean, _, _ = run_fp8(b, "prequantized", torch.bfloat16)
    pq = _prequantized(b)
    v8 = pq["v"][0].clone()
    v8.view(torch.uint8)[:7] = 0x7F
    call, _ = call_record(q=pq["q"][0], k=pq["k"][0], v=v8, seq_offsets_q=b["seq_offsets_q"],
                          seq_offsets_k=b["seq_offsets_k"], max_seqlen_q=200, max_seqlen_k=200, window_size=(-1, 0),
                          descale_q=pq["q"][1], descale_k=pq["k"][1], descale_v=pq["v"][1])
    out = launch.forward_fp8(pq["q"][0], pq["k"][0], v8, None, call)
    torch.cuda.synchronize()
    assert torch.isnan(out[:7]).all()
    assert torch.equal(out[7:], clean[7:])


def test_fp8_public_call_and_errors():
    b = random_jagged_batch(4, 2, 128, 200, device="cuda", seed=6, window_size=(-1, 0))
    rest = {k: v for k, v in b.items() if k not in ("q", "k", "v")}
    out = hstu_attn_varlen_func(b["q"], b["k"], b["v"], **rest, quant_mode=0)
    emul = reference.hstu_attn_fp8_emulation(b["q"], b["k"], b["v"], **rest, quant_mode=0)
    ref32 = reference.hstu_attn_reference(b["q"], b["k"], b["v"], **rest)
    ok, err, emul_err = reference.ratio_check(out, ref32, emul, 2.0)
    assert ok, (err, emul_err)
    pq = _prequantized(b)
    out8 = hstu_attn_varlen_func(pq["q"][0], pq["k"][0], pq["v"][0], **rest, descale_q=pq["q"][1],
                                 descale_k=pq["k"][1], descale_v=pq["v"][1])
    assert out8.dtype == torch.bfloat16
    # The pre-quantized entry is forward-only; quant modes train (tests/test_fp8_backward_gpu.py).
    with pytest.raises(NotImplementedError, match="forward-only"):
        hstu_attn_varlen_func(pq["q"][0].clone().requires_grad_(), pq["k"][0], pq["v"][0], **rest,
                              descale_q=pq["q"][1], descale_k=pq["k"][1], descale_v=pq["v"][1])
    trained = hstu_attn_varlen_func(b["q"].clone().requires_grad_(), b["k"], b["v"], **rest, quant_mode=0)
    assert trained.grad_fn is not None and torch.equal(trained.detach(), out)
    with pytest.raises(NotImplementedError, match="descale_do"):
        hstu_attn_varlen_func(pq["q"][0], pq["k"][0], pq["v"][0], **rest, descale_do=pq["q"][1])


def test_fp8_raises_on_the_sm80_path(monkeypatch):
    from hstu_cute import arch

    monkeypatch.setenv("HSTU_CUTE_ARCH", "sm80")
    arch._kernel_path.cache_clear()
    try:
        b = random_jagged_batch(2, 2, 128, 64, device="cuda", seed=7)
        rest = {k: v for k, v in b.items() if k not in ("q", "k", "v")}
        with pytest.raises(NotImplementedError, match="Hopper-only"):
            hstu_attn_varlen_func(b["q"], b["k"], b["v"], **rest, quant_mode=0)
    finally:
        arch._kernel_path.cache_clear()


def test_vt_layout():
    """V^T of e4m3 V (hopper.vt, the pre-quantized entry): sequence b's keys at columns
    roundup16(off_b) + 16 b onward, in KEY_AT_COLUMN order within each 16-key group; empty
    sequences and tokens past the last offset are harmless."""
    lengths = [0, 1, 17, 300, 0, 64, 5]
    offsets = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    tokens = int(offsets[-1]) + 3  # 3 tokens past the last sequence
    v = (torch.randn(tokens, 2, 64, device="cuda") * 200).clamp(-448, 448).to(torch.float8_e4m3fn)
    vt = launch.transposed_for_pv(v, offsets)
    assert vt.dtype == torch.float8_e4m3fn and vt.shape == (2, 64, variants.vt_width(tokens, len(lengths)))
    for b, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        col = (start + 15) // 16 * 16 + 16 * b
        assert torch.equal(vt[:, :, _key_columns(col, end - start)].view(torch.uint8),
                           v[start:end].permute(1, 2, 0).view(torch.uint8)), b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_mode0_cast_saturates_strided_input(dtype, head_dim):
    """quant_mode 0's slot role "unit": torch's clamp-and-cast bit for bit, for values beyond
    +-448 and a strided input (every other head of a wider tensor), in both copies."""
    x = (torch.randn(37, 6, head_dim, device="cuda") * 300).to(dtype)[:, ::2]
    offsets = torch.tensor([0, 20, 37], dtype=torch.int32, device="cuda")
    (copies,) = launch.quantize_for(0, "gradient", (x,), (offsets,), (20,))
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    data, _ = copies["plain"]
    assert data.is_contiguous() and torch.equal(data.view(torch.uint8), want)
    vt, _ = copies["transposed"]
    for b, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        col = (start + 15) // 16 * 16 + 16 * b
        assert torch.equal(vt[:, :, _key_columns(col, end - start)].view(torch.uint8),
                           want[start:end].permute(1, 2, 0)), b
