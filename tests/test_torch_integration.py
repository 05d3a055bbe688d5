"""torch.library ops, autograd, torch.compile and torch.export on CPU (no GPU needed).

What runs where:

* Fake CUDA tensors (``FakeTensorMode`` with ``device="cuda"``) work on the CPU build for the
  forward: the public function is validated and traced as ``hstu_cute::fwd`` by torch.export.
  Autograd on fake CUDA tensors does not: the CPU build has no CUDA device guard and the process
  aborts (C++ ``terminate``), so no test here sets requires_grad on a fake CUDA tensor.
* Meta tensors (accepted by validation: shapes only, nothing launched) carry the forward AND
  backward tracing: torch.compile(fullgraph=True) of a small HSTU layer, export with parameters.
* CPU numerics of the autograd wiring: the kernel launches (``api.forward`` / ``api.backward``)
  are replaced by the PyTorch oracle and validation is run on meta copies of the arguments, so
  the real op bodies, the autograd.Function and compiled graphs run end to end on CPU tensors.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from hstu_cute import api, fp8_format, hstu_attn_varlen_func, reference, validation
from hstu_cute.testing import random_jagged_batch

BF16 = torch.bfloat16
H, D = 2, 32


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if any kernel is compiled or launched (the fake paths must not)."""
    import hstu_cute.compile

    def boom(*a, **k):
        raise AssertionError("nothing may be compiled or launched on this path")

    monkeypatch.setattr(api, "forward", boom)
    monkeypatch.setattr(api, "forward_fp8", boom)
    monkeypatch.setattr(api, "backward", boom)
    monkeypatch.setattr(hstu_cute.compile, "build", boom)


def _graph_targets(gm: torch.fx.GraphModule) -> list[str]:
    """call_function targets of a graph module and of every nested submodule (strict export and
    autograd.Function tracing put the op in subgraphs)."""
    return [str(n.target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function"]


def _op_nodes(gm: torch.fx.GraphModule, name: str) -> list[torch.fx.Node]:
    return [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function" and str(n.target).startswith(name)]


def _batch(device, lengths=(8, 6), heads=H, head_dim=D, rab_heads=None, requires_grad=False, seed=0):
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    T, L = offsets[-1], max(lengths)
    gen = torch.Generator().manual_seed(seed)

    def t(*shape, dtype=BF16):
        if device == "cpu":
            x = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        else:
            x = torch.empty(shape, dtype=dtype)
        return x.to(device).requires_grad_(requires_grad and dtype.is_floating_point)

    b = dict(q=t(T, heads, head_dim), k=t(T, heads, head_dim), v=t(T, heads, head_dim),
             seq_offsets_q=torch.tensor(offsets, dtype=torch.int32, device=device), max_seqlen_q=L, max_seqlen_k=L)
    b["seq_offsets_k"] = b["seq_offsets_q"]
    if rab_heads:
        b["rab"] = t(len(lengths), rab_heads, L, L)
    return b


# ---------------------------------------------------------------------------------------------
# The ops and their fake implementations
# ---------------------------------------------------------------------------------------------
def test_ops_registered():
    fwd = str(torch.ops.hstu_cute.fwd.default._schema)
    bwd = str(torch.ops.hstu_cute.bwd.default._schema)
    assert fwd.startswith("hstu_cute::fwd(Tensor q, Tensor k, Tensor v, Tensor seq_offsets_q") and fwd.endswith("-> Tensor")
    assert "bool has_drab, bool deterministic" in bwd and bwd.endswith("-> (Tensor, Tensor, Tensor, Tensor)")
    # Functional ops: nothing is mutated or aliased, so tracing needs no functionalization tricks.
    assert not any(a.alias_info for a in torch.ops.hstu_cute.fwd.default._schema.arguments)
    assert not any(a.alias_info for a in torch.ops.hstu_cute.bwd.default._schema.arguments)


def _op_args(device, rab_heads=1, contexts=True, seqused=True, delta_q=False):
    T_k, L_k = 14, 8
    L_q, T_q = (5, 9) if delta_q else (L_k, T_k)
    q = torch.empty(T_q, H, D, dtype=BF16, device=device)
    k, v = (torch.empty(T_k, H, D, dtype=BF16, device=device) for _ in range(2))
    off_q = torch.empty(3, dtype=torch.int32, device=device)
    off_k = torch.empty(3, dtype=torch.int32, device=device)
    vec = lambda: torch.empty(2, dtype=torch.int32, device=device)  # noqa: E731
    rab = torch.empty(2, rab_heads, L_k, L_k, dtype=BF16, device=device) if rab_heads else None
    return (q, k, v, off_q, off_k, L_q, L_k, vec() if contexts else None, vec() if contexts else None, 2,
            L_k, 0, 0.5, rab, delta_q, -1, vec() if seqused else None, vec() if seqused else None, None,
            None, None, 0, 0)


OP_CASES = [
    dict(rab_heads=None, contexts=False, seqused=False),
    dict(rab_heads=1, contexts=True, seqused=True),
    dict(rab_heads=H, contexts=False, seqused=True),
    dict(rab_heads=1, contexts=False, seqused=False, delta_q=True),
]


@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_opcheck_fwd(case):
    """torch.library.opcheck: schema, fake vs real (meta) outputs, aot dispatch with dynamic shapes."""
    result = torch.library.opcheck(torch.ops.hstu_cute.fwd.default, _op_args("meta", **case))
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("case,has_drab", [(c, d) for c in OP_CASES for d in (False, True) if c["rab_heads"] or not d],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) if isinstance(c, dict) else f"drab={c}")
def test_opcheck_bwd(case, has_drab):
    args = _op_args("meta", **case)
    result = torch.library.opcheck(torch.ops.hstu_cute.bwd.default, (torch.empty_like(args[0]),) + args + (has_drab, True))
    assert all(v == "SUCCESS" for v in result.values()), result


def test_fake_cuda_forward_through_public_function(no_launch):
    """Under FakeTensorMode with CUDA fake tensors the public call validates, skips the eager
    fast path and runs the fake implementation: a contiguous (T, H, D) output, nothing launched."""
    with FakeTensorMode():
        qkv = torch.empty(14, 3, H, D, dtype=BF16, device="cuda")
        q, k, v = qkv.unbind(1)  # non-contiguous views, as a fused projection gives them
        off = torch.tensor([0, 8, 14], dtype=torch.int32, device="cuda")
        targets = torch.tensor([2, 1], dtype=torch.int32, device="cuda")
        assert not api._eager(q)
        out = hstu_attn_varlen_func(q, k, v, off, off, 8, 8, num_targets=targets, window_size=(-1, 0),
                                    target_group_size=2, alpha=0.5)
    assert isinstance(out, FakeTensor) and out.device.type == "cuda"
    assert out.shape == (14, H, D) and out.dtype == BF16 and out.is_contiguous()


def test_fake_cuda_bwd_op_shapes(no_launch):
    with FakeTensorMode():
        args = _op_args("cuda", rab_heads=H)
        dout = torch.empty_like(args[0])
        dq, dk, dv, drab = torch.ops.hstu_cute.bwd(dout, *args, True, False)
        assert (dq.shape, dk.shape, dv.shape, drab.shape) == (args[0].shape, args[1].shape, args[2].shape,
                                                              args[13].shape)
        assert {t.dtype for t in (dq, dk, dv, drab)} == {BF16} and all(t.device.type == "cuda" for t in (dq, drab))
        drab0 = torch.ops.hstu_cute.bwd(dout, *args, False, False)[3]
        assert drab0.numel() == 0


def test_eager_gate():
    """The dispatcher is skipped only for plain CUDA tensors outside tracing and dispatch modes."""
    assert not api._eager(torch.zeros(1))  # CPU
    assert not api._eager(torch.zeros(1, device="meta"))
    with FakeTensorMode():
        assert not api._eager(torch.zeros(1, device="cuda"))


def test_meta_tensors_trace_forward_and_backward(no_launch):
    """Eager autograd on meta tensors: fwd and bwd ops give gradients of the right shapes;
    rab gets one only with has_drab."""
    for has_drab in (False, True):
        b = _batch("meta", rab_heads=1, requires_grad=True)
        out = hstu_attn_varlen_func(**b, window_size=(-1, 0), has_drab=has_drab)
        assert out.device.type == "meta" and out.shape == b["q"].shape and out.requires_grad
        out.sum().backward()
        for name in ("q", "k", "v"):
            assert b[name].grad is not None and b[name].grad.shape == b[name].shape
        assert (b["rab"].grad is not None) == has_drab
        if has_drab:
            assert b["rab"].grad.shape == b["rab"].shape


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_deterministic_must_be_bool(bad, no_launch):
    b = _batch("cpu")
    with pytest.raises(TypeError, match=r"^deterministic: expected a bool, got "):
        hstu_attn_varlen_func(**b, deterministic=bad)


# ---------------------------------------------------------------------------------------------
# torch.export
# ---------------------------------------------------------------------------------------------
class Attn(torch.nn.Module):
    def forward(self, q, k, v, offsets, targets):
        return hstu_attn_varlen_func(q, k, v, offsets, offsets, 8, 8, num_targets=targets, window_size=(-1, 0),
                                     alpha=0.25)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_fake_cuda(strict, no_launch):
    with FakeTensorMode():
        q, k, v = (torch.empty(14, H, D, dtype=BF16, device="cuda") for _ in range(3))
        off = torch.empty(3, dtype=torch.int32, device="cuda")
        targets = torch.empty(2, dtype=torch.int32, device="cuda")
    ep = torch.export.export(Attn(), (q, k, v, off, targets), strict=strict)
    nodes = _op_nodes(ep.graph_module, "hstu_cute.fwd")
    assert len(nodes) == 1, _graph_targets(ep.graph_module)
    # Scalars are baked in normalized: window (-1, 0) -> (max_seqlen_k, 0), alpha as given.
    args = nodes[0].args
    assert args[5:8] == (8, 8, None) and args[9:13] == (1, 8, 0, 0.25)
    out = nodes[0].meta["val"]
    assert out.shape == (14, H, D) and out.device.type == "cuda"


def test_export_fake_cuda_dynamic_tokens(no_launch):
    from torch.export import Dim

    tokens, batch1 = Dim("tokens", min=2), Dim("batch1", min=3, max=validation.MAX_GRID_BATCH + 1)
    with FakeTensorMode():
        q, k, v = (torch.empty(14, H, D, dtype=BF16, device="cuda") for _ in range(3))
        off = torch.empty(3, dtype=torch.int32, device="cuda")
        targets = torch.empty(2, dtype=torch.int32, device="cuda")
    ep = torch.export.export(Attn(), (q, k, v, off, targets),
                             dynamic_shapes=({0: tokens}, {0: tokens}, {0: tokens}, {0: batch1}, {0: batch1 - 1}))
    assert len(_op_nodes(ep.graph_module, "hstu_cute.fwd")) == 1
    out_shape = _op_nodes(ep.graph_module, "hstu_cute.fwd")[0].meta["val"].shape
    assert str(out_shape[0]) != "14" and tuple(out_shape[1:]) == (H, D)  # symbolic token count


class HstuLayer(torch.nn.Module):
    """Linear q/k/v projection -> HSTU attention -> linear output, with an optional rab parameter."""

    def __init__(self, device, max_len=8, rab_heads=None, has_drab=False, deterministic=False):
        super().__init__()
        self.qkv = torch.nn.Linear(H * D, 3 * H * D, dtype=BF16, device=device)
        self.out = torch.nn.Linear(H * D, H * D, dtype=BF16, device=device)
        self.max_len, self.has_drab, self.deterministic = max_len, has_drab, deterministic
        self.rab = None
        if rab_heads:
            self.rab = torch.nn.Parameter(torch.zeros(1, rab_heads, max_len, max_len, dtype=BF16, device=device))

    def forward(self, x, offsets, targets):
        q, k, v = self.qkv(x).view(-1, 3, H, D).unbind(1)
        rab = self.rab.expand(offsets.shape[0] - 1, -1, -1, -1) if self.rab is not None else None
        o = hstu_attn_varlen_func(q, k, v, offsets, offsets, self.max_len, self.max_len, num_targets=targets,
                                  window_size=(-1, 0), alpha=0.5, rab=rab, has_drab=self.has_drab,
                                  deterministic=self.deterministic)
        return self.out(o.reshape(-1, H * D))


def _layer_inputs(device, tokens=14, batch=2):
    x = torch.empty(tokens, H * D, dtype=BF16, device=device)
    offsets = torch.empty(batch + 1, dtype=torch.int32, device=device)
    targets = torch.empty(batch, dtype=torch.int32, device=device)
    return x, offsets, targets


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_layer_with_parameters_meta(strict, no_launch):
    """A layer with parameters (the op is reached through the autograd.Function), dynamic
    token count and batch, exported on meta and re-run at other sizes."""
    from torch.export import Dim

    layer = HstuLayer("meta", rab_heads=1)
    tokens, batch1 = Dim("tokens", min=2), Dim("batch1", min=3, max=validation.MAX_GRID_BATCH + 1)
    ep = torch.export.export(layer, _layer_inputs("meta"), strict=strict,
                             dynamic_shapes=({0: tokens}, {0: batch1}, {0: batch1 - 1}))
    assert len(_op_nodes(ep.graph_module, "hstu_cute.fwd")) == 1, _graph_targets(ep.graph_module)
    y = ep.module()(*_layer_inputs("meta", tokens=23, batch=5))
    assert y.shape == (23, H * D) and y.device.type == "meta"


# ---------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True): forward and backward
# ---------------------------------------------------------------------------------------------
def _capturing_backend(graphs: dict):
    from torch._dynamo.backends.common import aot_autograd
    from functorch.compile import make_boxed_func

    def compiler(kind):
        def compile_fn(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)

        return compile_fn

    return aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))


@pytest.mark.parametrize("rab", ["none", "rab-H_rab=1-drab", "rab-H_rab=H-no-drab"])
def test_compile_fullgraph_forward_backward_meta(rab, no_launch):
    rab_heads, has_drab = {"none": (None, False), "rab-H_rab=1-drab": (1, True), "rab-H_rab=H-no-drab": (H, False)}[rab]
    layer = HstuLayer("meta", rab_heads=rab_heads, has_drab=has_drab, deterministic=True)
    x, offsets, targets = _layer_inputs("meta")
    x.requires_grad_(True)
    graphs = {}
    compiled = torch.compile(layer, fullgraph=True, backend=_capturing_backend(graphs))
    y = compiled(x, offsets, targets)
    assert y.shape == (14, H * D)
    y.sum().backward()
    assert x.grad.shape == x.shape and layer.qkv.weight.grad.shape == layer.qkv.weight.shape
    if rab_heads:
        assert (layer.rab.grad is not None) == has_drab
    fw_nodes = _op_nodes(graphs["fw"], "hstu_cute.fwd")
    bw_nodes = _op_nodes(graphs["bw"], "hstu_cute.bwd")
    assert len(fw_nodes) == 1 and len(bw_nodes) == 1, (_graph_targets(graphs["fw"]), _graph_targets(graphs["bw"]))
    assert not _op_nodes(graphs["fw"], "hstu_cute.bwd") and not _op_nodes(graphs["bw"], "hstu_cute.fwd")
    assert bw_nodes[0].args[-2:] == (has_drab, True)  # has_drab, deterministic reach the backward op


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_named_backends_meta(backend, no_launch):
    layer = HstuLayer("meta")
    x, offsets, targets = _layer_inputs("meta")
    x.requires_grad_(True)
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    compiled(x, offsets, targets).sum().backward()
    assert x.grad.shape == x.shape


def test_compile_with_changing_lengths_meta(no_launch):
    """max_seqlen and the token count change between calls: dynamo makes them symbolic after the
    first recompile (validation traces with SymInts) and does not recompile again."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def call(q, offsets, max_len: int):
        return hstu_attn_varlen_func(q, q, q, offsets, offsets, max_len, max_len, window_size=(-1, 0), alpha=0.3)

    compiled = torch.compile(call, fullgraph=True, backend=backend)
    offsets = torch.empty(3, dtype=torch.int32, device="meta")
    for max_len, tokens in ((8, 14), (12, 20), (16, 30), (40, 61)):
        q = torch.empty(tokens, H, D, dtype=BF16, device="meta", requires_grad=True)
        y = compiled(q, offsets, max_len)
        y.sum().backward()
        assert y.shape == q.shape and q.grad.shape == q.shape
    assert len(graphs) == 2, f"{len(graphs)} graphs: expected one static and one dynamic"


def test_compile_with_changing_alpha_meta(no_launch):
    """alpha changes between calls: after the first recompile dynamo passes it as a symbolic
    float, which validation must trace without math.isfinite (a graph break under fullgraph);
    a non-finite alpha is still refused when the op runs."""

    def call(q, offsets, alpha: float):
        return hstu_attn_varlen_func(q, q, q, offsets, offsets, 8, 8, window_size=(-1, 0), alpha=alpha)

    compiled = torch.compile(call, fullgraph=True, backend="eager")
    offsets = torch.empty(3, dtype=torch.int32, device="meta")
    q = torch.empty(14, H, D, dtype=BF16, device="meta", requires_grad=True)
    for alpha in (0.1, 0.2, 0.3):
        y = compiled(q, offsets, alpha)
        y.sum().backward()
        assert y.shape == q.shape
    from hstu_cute import launch
    from hstu_cute.call import Call

    problem, _ = validation.problem_of_op_args(q, offsets, 8, 8, None, None, -1, 0, None, False, -1)
    with pytest.raises(ValueError, match="alpha: expected a finite Python float, got nan"):
        launch._scalar_args(Call(problem, offsets, offsets, 8, 8, alpha=float("nan")))


# ---------------------------------------------------------------------------------------------
# CPU numerics of the wiring, with the oracle standing in for the kernels
# ---------------------------------------------------------------------------------------------
def _oracle_args(call):
    """The oracle's arguments of a call record (hstu_cute.call.Call)."""
    p = call.problem
    return ((call.seq_offsets_q, call.seq_offsets_k, call.max_seqlen_q, call.max_seqlen_k, call.num_contexts,
             call.num_targets, call.target_group_size, (p.window_left, p.window_right), call.alpha),
            dict(scaling_seqlen=p.scale_seqlen, seqused_q=call.seqused_q, seqused_k=call.seqused_k))


def _oracle_forward(q, k, v, rab, call, tiles=None, out=None):
    args, kwargs = _oracle_args(call)
    return reference.hstu_attn_reference(q, k, v, *args, rab, call.problem.mask.is_delta_q, **kwargs).to(q.dtype)


CALLS = []


def _oracle_backward(dout, q, k, v, rab, call):
    has_drab = call.has_drab
    CALLS.append(dict(has_drab=has_drab, deterministic=call.deterministic))
    args, kwargs = _oracle_args(call)

    def grads():
        return reference.reference_grads(q, k, v, *args, rab, call.problem.mask.is_delta_q, dout=dout, **kwargs)

    # Inside an op body autograd's dispatch keys are excluded (thread-local): run the oracle's
    # autograd on a fresh thread.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        g = pool.submit(grads).result()
    return (g["dq"].to(q.dtype), g["dk"].to(k.dtype), g["dv"].to(v.dtype),
            g["drab"].to(rab.dtype) if has_drab else None)


@pytest.fixture
def oracle_kernels(monkeypatch):
    """CPU stand-ins: validation runs on meta copies (all checks but the device one), the
    launches run the oracle. Calls take the dispatcher path (CPU tensors are never 'eager')."""
    validate = api.validate

    def validate_on_meta(*args):
        return validate(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])

    monkeypatch.setattr(api, "validate", validate_on_meta)
    # the eager path's entry: the problem and its (here empty) cache of prepared launches
    monkeypatch.setattr(api, "validate_memoized", lambda *args: (validate_on_meta(*args), {}))
    monkeypatch.setattr(api, "forward", _oracle_forward)
    monkeypatch.setattr(api, "backward", _oracle_backward)
    CALLS.clear()


def _cpu_layer_inputs():
    torch.manual_seed(0)
    lengths = [8, 1, 0, 5]
    offsets = torch.tensor([0, 8, 9, 9, 14], dtype=torch.int32)
    targets = torch.tensor([2, 0, 0, 1], dtype=torch.int32)
    x = torch.randn(sum(lengths), H * D).to(BF16)
    return x, offsets, targets


def _grads_of(layer, fn, x, offsets, targets):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = fn(x, offsets, targets)
    y.float().square().sum().backward()
    named = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    return y.detach(), named


@pytest.mark.parametrize("has_drab", [False, True])
def test_compiled_layer_matches_eager_cpu(has_drab, oracle_kernels):
    """torch.compile(fullgraph=True, backend="aot_eager") of the layer runs the op bodies at run
    time: outputs and every gradient equal the eager call's."""
    torch.manual_seed(1)
    layer = HstuLayer("cpu", rab_heads=1, has_drab=has_drab, deterministic=True)
    with torch.no_grad():
        layer.rab.uniform_(-1, 1)
    x, offsets, targets = _cpu_layer_inputs()
    y_eager, g_eager = _grads_of(layer, layer, x, offsets, targets)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    y_comp, g_comp = _grads_of(layer, compiled, x, offsets, targets)
    assert CALLS and all(c == dict(has_drab=has_drab, deterministic=True) for c in CALLS)
    torch.testing.assert_close(y_comp, y_eager, rtol=0, atol=0)
    assert set(g_comp) == set(g_eager)
    for name in g_eager:
        if name == "rab" and not has_drab:
            assert g_eager[name] is None and g_comp[name] is None
            continue
        torch.testing.assert_close(g_comp[name], g_eager[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("fast_path", [False, True], ids=["dispatcher", "eager-fast-path"])
def test_gradients_route_to_the_right_inputs_cpu(fast_path, oracle_kernels, monkeypatch):
    """Eager wiring on CPU: dq/dk/dv/drab land on q/k/v/rab (compared with the oracle's own
    autograd), and a tensor passed as q, k and v at once gets the sum of the three gradients
    (the compiled path deduplicates the inputs of the autograd.Function). ``eager-fast-path``
    lets CPU tensors take the fast path that CUDA tensors take (no dispatcher: the op bodies,
    which rebuild the Problem, must not run)."""
    problem = api.call_of_op_arguments
    if fast_path:
        eager = api._eager

        def no_op_body(*a):
            raise AssertionError("the eager fast path must not go through the op bodies")

        monkeypatch.setattr(api, "_eager", lambda t: eager(t) or (type(t) is torch.Tensor and t.device.type == "cpu"
                                                                   and not torch.compiler.is_compiling()))
        monkeypatch.setattr(api, "call_of_op_arguments", no_op_body)
    b = random_jagged_batch(3, H, D, 12, dtype=BF16, window_size=(-1, 0), rab_heads=H, num_targets=3, seed=5)
    kw = {n: b[n] for n in ("seq_offsets_q", "seq_offsets_k", "max_seqlen_q", "max_seqlen_k", "num_targets",
                            "window_size", "alpha")}
    leaves = {n: b[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "rab")}
    out = hstu_attn_varlen_func(leaves["q"], leaves["k"], leaves["v"], rab=leaves["rab"], has_drab=True, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=out.dtype)
    out.backward(dout)
    ref = reference.reference_grads(b["q"], b["k"], b["v"], rab=b["rab"], dout=dout, **kw)
    for n in ("q", "k", "v", "rab"):
        torch.testing.assert_close(leaves[n].grad.float(), ref["d" + n].to(BF16).float(), msg=n)

    def shared(fn):
        x = b["q"].detach().clone().requires_grad_(True)
        fn(x).backward(dout)
        return x.grad

    call = lambda x: hstu_attn_varlen_func(x, x, x, **kw)  # noqa: E731
    g_eager = shared(call)
    monkeypatch.setattr(api, "call_of_op_arguments", problem)  # the compiled graph runs the op bodies
    g_comp = shared(torch.compile(call, fullgraph=True, backend="aot_eager"))
    ref = reference.reference_grads(b["q"], b["q"], b["q"], dout=dout, **kw)
    expected = (ref["dq"].to(BF16) + ref["dk"].to(BF16) + ref["dv"].to(BF16)).float()
    torch.testing.assert_close(g_eager.float(), expected)
    torch.testing.assert_close(g_comp.float(), expected)


def test_validation_errors_under_compile(no_launch):
    """Validation is traced too: without fullgraph the original exception comes out; with
    fullgraph=True dynamo reports it as an unsupported raise that carries the message."""
    q = torch.empty(14, H, 48, dtype=BF16, device="meta")  # head dim 48: not supported
    off = torch.empty(3, dtype=torch.int32, device="meta")

    def call(q, off):
        return hstu_attn_varlen_func(q, q, q, off, off, 8, 8)

    with pytest.raises(ValueError, match=r"^q\.shape\[2\] \(head dim\): expected one of"):
        torch.compile(call, backend="eager")(q, off)
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(call, fullgraph=True, backend="eager")(q, off)
    assert "q.shape[2] (head dim): expected one of" in str(info.value)


# ---------------------------------------------------------------------------------------------
# FP8: one opaque op (quantization + kernel), traced by torch.compile and torch.export
# ---------------------------------------------------------------------------------------------
E4M3 = torch.float8_e4m3fn


class Fp8Attn(torch.nn.Module):
    """Pre-quantized e4m3 inputs with descales, or 16-bit inputs with ``quant_mode``."""

    def __init__(self, quant_mode):
        super().__init__()
        self.quant_mode = quant_mode

    def forward(self, q, k, v, offsets, targets, dq, dk, dv):
        if self.quant_mode == -1:
            return hstu_attn_varlen_func(q, k, v, offsets, offsets, 8, 8, num_targets=targets, window_size=(-1, 0),
                                         alpha=0.25, descale_q=dq, descale_k=dk, descale_v=dv)
        return hstu_attn_varlen_func(q, k, v, offsets, offsets, 8, 8, num_targets=targets, window_size=(-1, 0),
                                     alpha=0.25, quant_mode=self.quant_mode)


# Every FP8 entry the operator serves: pre-quantized inputs (-1) and the built quant modes.
FP8_ENTRY_MODES = list(fp8_format.BUILT_QUANT_MODES)
FP8_ENTRY_IDS = ["prequantized"] + [f"mode{m}" for m in FP8_ENTRY_MODES[1:]]


def _fp8_inputs(quant_mode, device="cuda"):
    dtype = E4M3 if quant_mode == -1 else BF16
    q, k, v = (torch.empty(14, H, 64, dtype=dtype, device=device) for _ in range(3))
    off = torch.empty(3, dtype=torch.int32, device=device)
    targets = torch.empty(2, dtype=torch.int32, device=device)
    scales = tuple(torch.empty(1, dtype=torch.float32, device=device) for _ in range(3))
    return (q, k, v, off, targets, *scales)


@pytest.mark.parametrize("quant_mode", FP8_ENTRY_MODES, ids=FP8_ENTRY_IDS)
@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_fp8_fake_cuda(quant_mode, strict, no_launch):
    with FakeTensorMode():
        inputs = _fp8_inputs(quant_mode)
    ep = torch.export.export(Fp8Attn(quant_mode), inputs, strict=strict)
    nodes = _op_nodes(ep.graph_module, "hstu_cute.fwd_fp8")
    assert len(nodes) == 1, _graph_targets(ep.graph_module)
    names = [a.name for a in torch.ops.hstu_cute.fwd_fp8.default._schema.arguments]
    assert nodes[0].args[names.index("quant_mode")] == max(quant_mode, -1)
    out = nodes[0].meta["val"]
    assert out.shape == (14, H, 64) and out.dtype == BF16 and out.device.type == "cuda"


@pytest.mark.parametrize("quant_mode", FP8_ENTRY_MODES, ids=FP8_ENTRY_IDS)
def test_compile_fullgraph_fp8_meta(quant_mode, no_launch):
    graphs = {}
    compiled = torch.compile(Fp8Attn(quant_mode), fullgraph=True, backend=_capturing_backend(graphs))
    with torch.no_grad():
        out = compiled(*_fp8_inputs(quant_mode, "meta"))
    assert out.shape == (14, H, 64) and out.dtype == BF16
    assert len(_op_nodes(graphs["fw"], "hstu_cute.fwd_fp8")) == 1


def _fp8_op_call(quant_mode, device):
    """(q, k, v, descales, the call's op arguments) of a small FP8 call on ``device``: the record
    validated on meta tensors, then its tensors moved (the ops' implementations run on CPU tensors)."""
    from hstu_cute.call import Call, op_arguments

    meta = _fp8_inputs(quant_mode, "meta")
    q, k, v, off, targets, dq, dk, dv = _fp8_inputs(quant_mode, device)
    if device != "meta":
        off.copy_(torch.tensor([0, 6, 14], dtype=torch.int32))
        targets.copy_(torch.tensor([2, 3], dtype=torch.int32))
    descale = dict(descale_q=meta[5], descale_k=meta[6], descale_v=meta[7]) if quant_mode == -1 else {}
    p = validation.validate(*meta[:3], meta[3], meta[3], 8, 8, None, meta[4], 1, (-1, 0), 0.25, None, False, False,
                            *(descale.get(n) for n in ("descale_q", "descale_k", "descale_v")), None, quant_mode, -1,
                            None, None)
    call = Call(p, off, off, 8, 8, None, targets, alpha=0.25)
    descales = (dq, dk, dv) if quant_mode == -1 else (None, None, None)
    return q, k, v, descales, op_arguments(call, None)


@pytest.mark.parametrize("quant_mode", FP8_ENTRY_MODES, ids=FP8_ENTRY_IDS)
@pytest.mark.parametrize("has_drab, deterministic", [(False, False), (True, True), (False, True)])
def test_fp8_ops_carry_quant_mode_and_flags(quant_mode, has_drab, deterministic, monkeypatch):
    """What reaches the launchers through hstu_cute::fwd_fp8 / bwd_fp8 (the path of torch.compile,
    torch.export and dispatch modes) is the caller's quant_mode, has_drab and deterministic, and the
    call's own arguments; flags equal to a default among them included."""
    seen = []

    def forward_fp8(q, k, v, rab, call):
        seen.append(call)
        return torch.zeros(q.shape, dtype=BF16)

    def backward_fp8(dout, q, k, v, rab, call):
        seen.append(call)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None

    monkeypatch.setattr(api, "forward_fp8", forward_fp8)
    monkeypatch.setattr(api, "backward_fp8", backward_fp8)
    q, k, v, descales, op_args = _fp8_op_call(quant_mode, "cpu")
    torch.ops.hstu_cute.fwd_fp8(q, k, v, *descales, *op_args, quant_mode, has_drab, deterministic)
    if quant_mode >= 0:
        torch.ops.hstu_cute.bwd_fp8(torch.zeros_like(q), q, k, v, *op_args, quant_mode, has_drab, deterministic)
    for call in seen:
        assert call.problem.quant_mode == quant_mode
        assert (call.has_drab, call.deterministic) == (has_drab, deterministic)
        assert (call.max_seqlen_q, call.max_seqlen_k, call.alpha, call.problem.window_right) == (8, 8, 0.25, 0)
        assert call.block_mask is None and call.func is None and call.num_targets is op_args[5]
    assert len(seen) == (2 if quant_mode >= 0 else 1)


@pytest.mark.parametrize("quant_mode", FP8_ENTRY_MODES, ids=FP8_ENTRY_IDS)
def test_opcheck_fwd_fp8(quant_mode):
    q, k, v, descales, op_args = _fp8_op_call(quant_mode, "meta")
    args = (q, k, v, *descales, *op_args, quant_mode, False, False)
    result = torch.library.opcheck(torch.ops.hstu_cute.fwd_fp8.default, args,
                                   test_utils=("test_schema", "test_faketensor"))
    assert all(v == "SUCCESS" for v in result.values()), result
