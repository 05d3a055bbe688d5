"""torch integration and autograd on the GPU: eager fast path, opcheck with real tensors,
torch.compile(fullgraph=True) and torch.export against eager, CUDA graph capture/replay, and the
backward (dq, dk, dv, drab) against the oracle with the spec's 5x rule. Skips without a GPU.

The forward runs on the device's default kernel path (hopper on sm90, ampere on sm80-sm89); the
tests that take the ``path`` fixture (conftest.py) run on both paths (hopper only on sm90). The
backward runs the mma.sync kernels on every path.

Every random tensor comes from an explicit seed (batches: ``random_jagged_batch(seed=...)``;
upstream gradients: a CPU generator, see ``_dout``), and the backward checks print the seed.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from hstu_cute import api, arch, hstu_attn_varlen_func, reference, validation, variants
from hstu_cute.call import op_arguments
from hstu_cute.testing import call_record, random_jagged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16 = torch.bfloat16
H, D = 2, 64
ARG_NAMES = ("q", "k", "v", "seq_offsets_q", "seq_offsets_k", "max_seqlen_q", "max_seqlen_k", "num_contexts",
             "num_targets", "target_group_size", "window_size", "alpha", "rab", "is_delta_q", "scaling_seqlen",
             "seqused_q", "seqused_k")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _batch(seed=0, lengths=(100, 1, 0, 77), **kw):
    kw.setdefault("window_size", (-1, 0))
    return random_jagged_batch(len(lengths), H, D, max(lengths), lengths=list(lengths), device="cuda", seed=seed,
                               **kw)


def _dout(like, seed):
    """Upstream gradient uniform in (-1, 1) from its own CPU generator: the same on every run and
    device, whatever else drew from torch's global RNG before. ``seed`` is the batch's seed; the
    generator takes ``seed + 1`` so dout is not the batch's own stream (whose first draw is q)."""
    g = torch.Generator().manual_seed(seed + 1)
    return (torch.rand(like.shape, generator=g) * 2 - 1).to(device=like.device, dtype=like.dtype)


def _public(b, **extra):
    return hstu_attn_varlen_func(**{n: b[n] for n in ARG_NAMES if n in b}, **extra)


# ---------------------------------------------------------------------------------------------
# Eager fast path and the ops on real tensors
# ---------------------------------------------------------------------------------------------
def test_eager_calls_skip_the_dispatcher(monkeypatch, path):
    """Eager CUDA calls run forward() directly: the op bodies (which rebuild the Problem) never run."""

    def op_body(*a):
        raise AssertionError("eager call went through the torch dispatcher")

    b = _batch(num_targets=5, rab_heads=1)
    expected = _public(b)
    monkeypatch.setattr(api, "call_of_op_arguments", op_body)
    assert api._eager(b["q"])
    torch.testing.assert_close(_public(b), expected, rtol=0, atol=0)
    q = b["q"].detach().clone().requires_grad_(True)  # through the autograd.Function
    torch.testing.assert_close(_public(dict(b, q=q)).detach(), expected, rtol=0, atol=0)


def test_dispatcher_path_matches_eager(monkeypatch):
    b = _batch(num_contexts=3, num_targets=5, target_group_size=2, rab_heads=H)
    expected = _public(b)
    monkeypatch.setattr(api, "_eager", lambda t: False)
    torch.testing.assert_close(_public(b), expected, rtol=0, atol=0)


def _fwd_op_args(b):
    """The 16-bit ops' arguments for batch ``b``, as the public API builds them (its call record)."""
    call, rab = call_record(**b)
    return (b["q"], b["k"], b["v"]) + op_arguments(call, rab)


def test_opcheck_fwd_cuda(path):
    args = _fwd_op_args(_batch(num_targets=5, rab_heads=1, seqused=True))
    result = torch.library.opcheck(torch.ops.hstu_cute.fwd.default, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_opcheck_bwd_cuda():
    args = _fwd_op_args(_batch(num_targets=5, rab_heads=H))
    dout = _dout(args[0], seed=0)
    result = torch.library.opcheck(torch.ops.hstu_cute.bwd.default, (dout,) + args + (True, False))
    assert all(v == "SUCCESS" for v in result.values()), result


# ---------------------------------------------------------------------------------------------
# torch.compile, torch.export, CUDA graphs: forward
# ---------------------------------------------------------------------------------------------
class Attn(torch.nn.Module):
    def forward(self, q, k, v, offsets, targets):
        return hstu_attn_varlen_func(q, k, v, offsets, offsets, 128, 128, num_targets=targets,
                                     window_size=(-1, 0), alpha=0.25)


def _attn_inputs(seed, lengths=(128, 3, 60)):
    b = _batch(seed, lengths=lengths, num_targets=4)
    return b["q"], b["k"], b["v"], b["seq_offsets_q"], b["num_targets"]


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_fullgraph_forward_matches_eager(backend):
    attn = Attn()
    compiled = torch.compile(attn, fullgraph=True, backend=backend)
    for seed in range(2):
        x = _attn_inputs(seed)
        torch.testing.assert_close(compiled(*x), attn(*x), rtol=0, atol=0)


def test_compile_reduce_overhead_forward_matches_eager():
    """Inductor's CUDA graphs (mode="reduce-overhead") around the op."""
    attn = Attn()
    compiled = torch.compile(attn, fullgraph=True, mode="reduce-overhead")
    for seed in range(3):
        x = _attn_inputs(seed)
        torch.testing.assert_close(compiled(*x).clone(), attn(*x), rtol=0, atol=0)


def test_compile_reduce_overhead_first_call_trains(monkeypatch):
    """The launcher's cached constants (absent seqused / contexts / targets, FP8 unit descales)
    first made inside torch.compile(mode="reduce-overhead")'s warm-up: they must live outside the
    cudagraph pool (which rejects a live tensor that is not an output), so a compiled training
    step works from the very first call of a process."""
    from hstu_cute import launch

    for name in ("_FILLERS", "_FILLER_BASES", "_ONES"):
        monkeypatch.setattr(launch.buffers, name, {})
    attn = Attn()
    step = torch.compile(lambda *x: attn(*x).float().square().sum(), mode="reduce-overhead")
    for seed in range(3):
        x = [t.requires_grad_() if t.is_floating_point() else t for t in _attn_inputs(seed)]
        step(*x).backward()
        eager = [t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in x]
        attn(*eager).float().square().sum().backward()
        for got, want in zip(x, eager):
            if got.is_floating_point():
                torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_and_run(strict):
    from torch.export import Dim

    tokens, batch1 = Dim("tokens", min=2), Dim("batch1", min=3, max=validation.MAX_GRID_BATCH + 1)
    ep = torch.export.export(Attn(), _attn_inputs(0), strict=strict,
                             dynamic_shapes=({0: tokens}, {0: tokens}, {0: tokens}, {0: batch1}, {0: batch1 - 1}))
    assert "hstu_cute.fwd" in str(ep.graph_module.code) or any(
        "hstu_cute.fwd" in str(m.code) for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule))
    for seed, lengths in ((1, (128, 3, 60)), (2, (5, 128, 128, 17))):
        x = _attn_inputs(seed, lengths)
        torch.testing.assert_close(ep.module()(*x), Attn()(*x), rtol=0, atol=0)


def _graph_replays_like_eager(fn, inputs):
    """Warm ``fn`` up off the capture (compile/load, cached fillers and prepared launches),
    capture it on ``inputs(0)``, then copy fresh inputs in and replay: bitwise equal to eager."""
    static = inputs(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(*static)
    for seed in (1, 2):
        fresh = inputs(seed)
        with torch.no_grad():
            for s, f in zip(static, fresh):
                s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, fn(*fresh), rtol=0, atol=0)


def test_cuda_graph_capture_replay_forward(path):
    """Kernels launch on the current stream: a captured forward replays to the eager result."""
    _graph_replays_like_eager(Attn(), _attn_inputs)


def test_cuda_graph_capture_replay_backward(path):
    """The backward's two kernels (dK/dV, then dQ) replay to the eager gradients, bitwise
    (deterministic=True)."""

    def grads(q, k, v, offsets, targets, dout):
        out = hstu_attn_varlen_func(q, k, v, offsets, offsets, 128, 128, num_targets=targets, window_size=(-1, 0),
                                    alpha=0.25, deterministic=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    def inputs(seed):
        q, k, v, offsets, targets = _attn_inputs(seed)
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        g = torch.Generator(device="cuda").manual_seed(seed)
        dout = torch.rand(q.shape, device="cuda", generator=g).to(q.dtype) - 0.5
        return q, k, v, offsets, targets, dout

    _graph_replays_like_eager(grads, inputs)

# ---------------------------------------------------------------------------------------------
# Backward against the oracle (spec section 5: 5x rule for dq, dk, dv, drab)
# ---------------------------------------------------------------------------------------------
MASKS = {
    "causal": dict(window_size=(-1, 0)),
    "ctx+tgt g3": dict(window_size=(-1, 0), num_contexts=5, num_targets=20, target_group_size=3),
    "local(13,5)": dict(window_size=(13, 5)),
    "delta_q causal": dict(window_size=(-1, 0), is_delta_q=True),
    "delta_q local(7,3)": dict(window_size=(7, 3), is_delta_q=True),
    "none": dict(window_size=(-1, -1)),
}


@pytest.fixture
def fused_any_length(monkeypatch):
    """The fused D128 kernel for every key length (by default short sequences take the pair)."""
    from hstu_cute import launch

    monkeypatch.setattr(launch.heuristics, "FUSED_MIN_SEQLEN_K", 0)


def _check_backward(b, has_drab, seed, deterministic=False, dtype=BF16):
    """Backward of batch ``b`` (drawn with ``seed``) against the oracle. dout is drawn from
    ``seed`` too (its own generator), so repeated calls on one batch use the same dout."""
    leaves = {n: b[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v")}
    if b["rab"] is not None:
        leaves["rab"] = b["rab"].detach().clone().requires_grad_(has_drab)
    out = _public(dict(b, **leaves), has_drab=has_drab, deterministic=deterministic)
    dout = _dout(out, seed)
    out.backward(dout)
    kw = {n: b[n] for n in ARG_NAMES}
    ref32 = reference.reference_grads(**kw, dout=dout)
    ref_same = reference.reference_grads(**kw, dout=dout, compute_dtype=None)
    ok, err, ref_err = reference.ratio_check(out, ref32["out"], ref_same["out"], 2.0)
    assert ok, f"[seed={seed}] out: kernel err {err:.3e} > 2 x {ref_err:.3e}"
    names = ("q", "k", "v") + (("rab",) if has_drab else ())
    for n in names:
        grad = leaves[n].grad
        assert grad is not None and grad.shape == b[n].shape and grad.dtype == dtype, (n, seed)
        assert not torch.isnan(grad).any(), f"[seed={seed}] d{n} has NaN"
        ok, err, ref_err = reference.ratio_check(grad, ref32["d" + n], ref_same["d" + n], 5.0)
        assert ok, f"[seed={seed}] d{n}: kernel err {err:.3e} > 5 x same-dtype err {ref_err:.3e}"
    if b["rab"] is not None and not has_drab:
        assert leaves["rab"].grad is None
    return {n: leaves[n].grad for n in names}


@pytest.mark.parametrize("rab", [None, "1", "H"], ids=["no-rab", "H_rab=1", "H_rab=H"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_backward_matches_oracle(mask, rab, path):
    m = dict(MASKS[mask])
    lengths = [0, 1, 17, 200, 129]
    max_q = 200
    if m.get("is_delta_q"):
        max_q = 50
        m["lengths_q"] = "random"
    rab_heads = {None: None, "1": 1, "H": H}[rab]
    seed = zlib.crc32(f"{mask}/{rab}".encode())
    b = random_jagged_batch(len(lengths), H, D, max_q, 200, lengths=lengths, device="cuda", dtype=BF16,
                            rab_heads=rab_heads, alpha=0.5, seed=seed, **m)
    _check_backward(b, has_drab=rab_heads is not None, seed=seed)


@pytest.mark.parametrize("kernels", ["fused", "pair"])
@pytest.mark.parametrize("rab", [None, "1", "H"], ids=["no-rab", "H_rab=1", "H_rab=H"])
@pytest.mark.parametrize("mask", list(MASKS) + ["all-target g5"])
def test_backward_d128_without_drab_matches_oracle(mask, rab, kernels, path, monkeypatch):
    """At D128 without drab the Hopper path runs the fused dK/dV/dQ kernel (dQ by TMA reduce-add;
    with rab its split-column mode) for long keys and the pair for short ones (``kernels``
    forces either): edge lengths, all-target sequences, delta_q, rab."""
    from hstu_cute import launch

    monkeypatch.setattr(launch.heuristics, "FUSED_MIN_SEQLEN_K", 0 if kernels == "fused" else 1 << 30)
    m = dict(MASKS.get(mask, dict(window_size=(-1, 0), target_group_size=5)))
    lengths = [0, 1, 17, 300, 129, 64]
    if mask == "all-target g5":
        m["num_targets"] = list(lengths)
    max_q = 300
    if m.get("is_delta_q"):
        max_q = 70
        m["lengths_q"] = "random"
    rab_heads = {None: None, "1": 1, "H": H}[rab]
    seed = zlib.crc32(f"d128/{mask}/{rab}".encode())
    b = random_jagged_batch(len(lengths), H, 128, max_q, 300, lengths=lengths, device="cuda", dtype=BF16,
                            rab_heads=rab_heads, alpha=0.5, seed=seed, **m)
    _check_backward(b, has_drab=False, seed=seed)


def test_backward_d128_deterministic_is_bitwise_and_close_to_default(path, fused_any_length):
    b = random_jagged_batch(4, H, 128, 400, device="cuda", dtype=BF16, lengths=[400, 17, 1, 250],
                            window_size=(-1, 0), seed=9)
    runs = []
    for deterministic in (True, True, True, False):
        runs.append(_check_backward(b, has_drab=False, seed=9, deterministic=deterministic))  # same dout every run
    for other in runs[1:3]:
        for n in runs[0]:
            assert torch.equal(runs[0][n], other[n]), f"d{n} differs between deterministic runs"
    for n in runs[0]:  # the default (fused on Hopper) sums dQ in another order: close, not bitwise
        torch.testing.assert_close(runs[3][n], runs[0][n], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case", ["bf16 ctx+tgt", "fp16 seqused"])
def test_backward_d128_long_jagged_many_contributors(case, path):
    """Long sequences: up to 32 n-block CTAs reduce-add into one dQ tile (the fused kernel), context
    + targets, seqused shorter than the storage."""
    lengths = [4096, 1111, 2500, 1, 700]
    if case == "bf16 ctx+tgt":
        dtype, m = BF16, dict(num_contexts=[3, 0, 40, 0, 7], num_targets=[100, 5, 0, 1, 33], target_group_size=4)
    else:
        dtype, m = torch.float16, dict(seqused=True)
    b = random_jagged_batch(len(lengths), H, 128, 4096, device="cuda", dtype=dtype, lengths=lengths,
                            window_size=(-1, 0), seed=41, **m)
    _check_backward(b, has_drab=False, seed=41, dtype=dtype)


@pytest.mark.parametrize("case", ["ctx+tgt", "ctx+tgt lead 2", "seqused fp16", "delta_q", "rows past the last offset"])
def test_fused_backward_zeroes_its_dq_accumulator_ahead(case, path, fused_any_length, monkeypatch):
    """The fused kernel zeroes its fp32 dQ accumulator one walk section ahead of its reduce-adds
    (hopper.dq_ahead). Here every section is one (batch, head) pair, and the accumulator is
    filled with NaN before the launcher zeroes the first section: a row the kernel leaves, or
    zeroes after a reduce-add into it, gives NaN or a wrong dq. Edge lengths, seqused, delta_q,
    rows past the last offset (zero gradients, written by the last section), and two sections
    between the zeroing CTAs and their rows (``launch.bwd.DQ_ZERO_LEAD``)."""
    if path != "hopper":
        pytest.skip("the fused kernel runs on the hopper path")
    from hstu_cute import launch

    monkeypatch.setattr(launch.heuristics, "L2_SECTION_BYTES", 1)
    monkeypatch.setattr(launch.bwd, "_POISON_DQ_ACCUMULATOR", True)
    monkeypatch.setattr(launch.bwd, "DQ_ZERO_LEAD", 2 if case.endswith("lead 2") else 1)
    lengths = [300, 0, 1, 17, 1111, 129]
    dtype, max_q, m = BF16, 1111, dict(window_size=(-1, 0))
    if case.startswith("ctx+tgt"):
        m.update(num_contexts=[3, 0, 1, 2, 40, 0], num_targets=[20, 0, 0, 5, 100, 129], target_group_size=3)
    elif case == "seqused fp16":
        dtype, m["seqused"] = torch.float16, True
    elif case == "delta_q":
        max_q = 300
        m.update(is_delta_q=True, lengths_q="random")
    seed = zlib.crc32(f"zero-ahead/{case}".encode())
    b = random_jagged_batch(len(lengths), H, 128, max_q, 1111, lengths=lengths, device="cuda", dtype=dtype,
                            alpha=0.5, seed=seed, **m)
    if case != "rows past the last offset":
        _check_backward(b, has_drab=False, seed=seed, dtype=dtype)
        return
    # 37 query rows past the last offset: their dq must be exact zeros (nobody but the last
    # section's CTA writes them); the rows of the sequences against the oracle on the batch
    # without them. (The forward does not promise those rows of out: docs/operator.md.)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    extra = (torch.rand((37, H, 128), generator=gen, device="cuda") * 2 - 1).to(dtype)
    leaves = {n: b[n].detach().clone().requires_grad_(True) for n in ("k", "v")}
    leaves["q"] = torch.cat([b["q"], extra]).requires_grad_(True)
    out = _public(dict(b, **leaves))
    dout = _dout(out, seed)
    out.backward(dout)
    assert not leaves["q"].grad[-37:].any(), "dq rows past the last offset are not zero"
    kw = {n: b[n] for n in ARG_NAMES}
    ref32 = reference.reference_grads(**kw, dout=dout[:-37])
    ref_same = reference.reference_grads(**kw, dout=dout[:-37], compute_dtype=None)
    for n in ("q", "k", "v"):
        grad = leaves[n].grad[:-37] if n == "q" else leaves[n].grad
        ok, err, ref_err = reference.ratio_check(grad, ref32["d" + n], ref_same["d" + n], 5.0)
        assert ok, f"[seed={seed}] d{n}: kernel err {err:.3e} > 5 x same-dtype err {ref_err:.3e}"


def test_backward_d128_default_repeats_agree(path, fused_any_length):
    """Five runs of the default backward (the fused kernel on Hopper sums dQ in a varying order)
    agree with the deterministic pair to bf16 rounding: a race between the CTAs adding into one
    dQ tile would show up as a wrong tile in some run."""
    b = random_jagged_batch(6, H, 128, 2048, device="cuda", dtype=BF16, lengths=[2048, 1500, 64, 2048, 5, 999],
                            window_size=(-1, 0), seed=12)
    want = _check_backward(b, has_drab=False, seed=12, deterministic=True)
    for _ in range(5):
        got = _check_backward(b, has_drab=False, seed=12)  # the same dout
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("head_dim", variants.HEAD_DIMS)
def test_backward_head_dims_fp16(head_dim, path):
    b = random_jagged_batch(3, H, head_dim, 130, device="cuda", dtype=torch.float16, lengths=[130, 17, 1],
                            window_size=(-1, 0), num_targets=9, target_group_size=2, rab_heads=1, seed=7)
    _check_backward(b, has_drab=True, seed=7, dtype=torch.float16)


@pytest.mark.parametrize("rab", [None, "1", "H", "1 no-drab"], ids=["no-rab", "H_rab=1", "H_rab=H", "H_rab=1-no-drab"])
@pytest.mark.parametrize("mask", list(MASKS) + ["all-target g5"])
def test_backward_d256_matches_oracle(mask, rab, path):
    """Head dim 256 (hopper: the wide dK/dV/drab kernel and the dQ kernel; ampere: the sm80 dQ
    kernel with drab and the dK/dV kernel with its GEMMs split along the head dim): edge
    lengths, all-target sequences, delta_q, rab with 1 and H heads."""
    m = dict(MASKS.get(mask, dict(window_size=(-1, 0), target_group_size=5)))
    lengths = [0, 1, 17, 200, 129, 64]
    if mask == "all-target g5":
        m["num_targets"] = list(lengths)
    max_q = 200
    if m.get("is_delta_q"):
        max_q = 70
        m["lengths_q"] = "random"
    rab_heads = {None: None, "1": 1, "H": H, "1 no-drab": 1}[rab]
    seed = zlib.crc32(f"d256/{mask}/{rab}".encode())
    b = random_jagged_batch(len(lengths), H, 256, max_q, 200, lengths=lengths, device="cuda", dtype=BF16,
                            rab_heads=rab_heads, alpha=0.5, seed=seed, **m)
    _check_backward(b, has_drab=rab in ("1", "H"), seed=seed)


def test_backward_d256_fp16_seqused_long(path):
    b = random_jagged_batch(3, H, 256, 1111, device="cuda", dtype=torch.float16, lengths=[1111, 17, 300],
                            window_size=(-1, 0), seqused=True, num_targets=9, target_group_size=2, rab_heads=1, seed=8)
    _check_backward(b, has_drab=True, seed=8, dtype=torch.float16)


def test_backward_d256_deterministic_is_bitwise(path):
    """deterministic=True at D256: dQ, dK, dV and drab summed over heads (one rab head, 3 heads)
    are bitwise equal across runs; the default (on hopper an atomic drab sum) is close to them."""
    b = random_jagged_batch(3, 3, 256, 300, device="cuda", dtype=BF16, lengths=[300, 17, 129],
                            window_size=(-1, 0), num_targets=9, rab_heads=1, seed=21)
    runs = []
    for deterministic in (True, True, False):
        runs.append(_check_backward(b, has_drab=True, seed=21, deterministic=deterministic))  # same dout every run
    for n in runs[0]:
        assert torch.equal(runs[0][n], runs[1][n]), f"d{n} differs between deterministic runs"
        torch.testing.assert_close(runs[2][n], runs[0][n], rtol=2e-2, atol=2e-2)


def test_backward_d256_sm80_kernels_run(monkeypatch):
    """HSTU_CUTE_ARCH=sm80 at head dim 256: the backward launches the sm80 dQ and dK/dV kernels
    (on every GPU, Hopper included), and their gradients pass the 5x rule."""
    from hstu_cute import launch

    keys = []
    real_make = launch.bwd.make_bwd_keys

    def recording_make(*args):
        pair = real_make(*args)
        keys.extend(pair)
        return pair

    monkeypatch.setattr(launch.bwd, "make_bwd_keys", recording_make)
    monkeypatch.setenv("HSTU_CUTE_ARCH", "sm80")
    arch._kernel_path.cache_clear()
    try:
        b = random_jagged_batch(3, H, 256, 1111, device="cuda", dtype=BF16, lengths=[1111, 17, 1],
                                window_size=(-1, 0), num_targets=9, rab_heads=H, seed=31)
        _check_backward(b, has_drab=True, seed=31)
    finally:
        arch._kernel_path.cache_clear()
    assert [(k.kernel_name, k.head_dim) for k in keys] == [("ampere_bwd_dq", 256), ("ampere_bwd_dkdv", 256)], keys


def test_backward_rab_without_drab(path):
    b = _batch(0, rab_heads=H, num_targets=5)
    _check_backward(b, has_drab=False, seed=0)


def test_backward_seqused_and_scaling(path):
    b = random_jagged_batch(6, H, D, 90, device="cuda", dtype=BF16, window_size=(-1, 0), seqused=True,
                            scaling_seqlen=300, rab_heads=H, seed=11)
    _check_backward(b, has_drab=True, seed=11)


def test_backward_deterministic_is_bitwise_reproducible(path):
    b = random_jagged_batch(4, H, D, 300, device="cuda", dtype=BF16, lengths=[300, 17, 1, 250],
                            window_size=(-1, 0), num_contexts=4, num_targets=30, rab_heads=1, seed=3)
    runs = []
    for _ in range(3):
        runs.append(_check_backward(b, has_drab=True, seed=3, deterministic=True))  # same dout every run
    for n in runs[0]:
        for other in runs[1:]:
            assert torch.equal(runs[0][n], other[n]), f"d{n} differs between deterministic runs"


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(H * D, 3 * H * D, dtype=BF16, device="cuda")
        self.out = torch.nn.Linear(H * D, H * D, dtype=BF16, device="cuda")
        self.rab = torch.nn.Parameter(torch.rand(1, 1, 128, 128, dtype=BF16, device="cuda") * 2 - 1)

    def forward(self, x, offsets, targets):
        q, k, v = self.qkv(x).view(-1, 3, H, D).unbind(1)
        rab = self.rab.expand(offsets.shape[0] - 1, -1, -1, -1)
        o = hstu_attn_varlen_func(q, k, v, offsets, offsets, 128, 128, num_targets=targets, window_size=(-1, 0),
                                  alpha=0.5, rab=rab, has_drab=True, deterministic=True)
        return self.out(o.reshape(-1, H * D))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_forward_backward_matches_eager(backend):
    torch.manual_seed(0)
    layer = Layer()
    b = _batch(0, lengths=(128, 3, 60), num_targets=4)
    x0 = torch.randn(b["q"].shape[0], H * D, dtype=BF16, device="cuda")

    def run(fn):
        layer.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        y = fn(x, b["seq_offsets_q"], b["num_targets"])
        y.float().square().sum().backward()
        return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]

    eager = run(layer)
    compiled = run(torch.compile(layer, fullgraph=True, backend=backend))
    assert all(t is not None for t in eager + compiled)
    # Same HSTU kernels (deterministic backward); the projections' kernels may differ under
    # inductor or AOT decompositions: bf16-level tolerance.
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=2e-2, atol=2e-2)
