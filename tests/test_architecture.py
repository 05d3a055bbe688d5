"""The package's shape: imports flow one way, and every kernel takes exactly the runtime
arguments its family's spec lists (hstu_cute.kernel_args), in order. CPU only, nothing compiled."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hstu_cute"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, at module level or inside functions."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                # ``from . import masks`` depends on the submodule, ``from .x import f`` on x.
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    # Importing a submodule runs its package's __init__ first: only the leaf edge matters here,
    # since our package __init__ files import nothing eagerly but warmup.
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_import_graph_has_no_cycle():
    graph = _import_graph()
    assert "hstu_cute.api" in graph and "hstu_cute.launch" in graph["hstu_cute.api"]
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_kernels_do_not_import_the_host_layers():
    """Kernel modules depend on masks and the kernel-common layer only, never on the API,
    launch, validation, compile keys or the cache."""
    graph = _import_graph()
    host = {"hstu_cute.api", "hstu_cute.launch", "hstu_cute.validation", "hstu_cute.variants", "hstu_cute.cache",
            "hstu_cute.compile", "hstu_cute.kernel_args", "hstu_cute.cli", "hstu_cute.bench"}
    for module, deps in graph.items():
        if module.startswith(("hstu_cute.ampere", "hstu_cute.hopper", "hstu_cute.common")):
            assert not deps & host, (module, deps & host)
        if module.startswith("hstu_cute.hopper"):
            assert not any(d.startswith("hstu_cute.ampere") for d in deps), (module, deps)


def test_api_holds_only_the_public_surface():
    tree = ast.parse((PACKAGE / "api.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert defined == {"hstu_attn_varlen_func", "_HstuAttnFunction", "_HstuAttnEager", "_bwd_through_op",
                       "_fwd_impl", "_fwd_fake", "_bwd_impl", "_bwd_fake", "_empty_drab", "_eager", "_dedupe",
                       "_check_data", "_fwd_fp8_impl", "_fwd_fp8_fake", "_fwd_paged_impl", "_bwd_fp8_impl",
                       "_bwd_fp8_fake", "_fwd_fp8_setup_context", "_fwd_fp8_backward", "_HstuAttnFp8Eager",
                       "_bwd_fp8_through_op", "_fwd_fp8_call", "_traced_op_arguments", "_attend"}, defined


def _one_key_per_family():
    from hstu_cute.masks import MaskKind
    from hstu_cute import variants

    keys = {}
    for key in (variants.shipped_ampere_fwd_keys("sm_80", ("bfloat16",), (64,))
                + variants.shipped_ampere_bwd_keys("sm_80", ("bfloat16",), (64,))
                + variants.shipped_hopper_fwd_keys("sm_90a", ("bfloat16",), (128, 256))
                + variants.shipped_hopper_bwd_keys("sm_90a", ("bfloat16",), (128, 256))
                + variants.shipped_hopper_fp8_fwd_keys("sm_90a", ("bfloat16",), (128,))
                + variants.shipped_hopper_paged_fwd_keys("sm_90a", ("bfloat16",), (128,))
                + variants.shipped_ampere_paged_fwd_keys("sm_80", ("bfloat16",), (64,))
                + variants.shipped_hopper_fp8_bwd_keys("sm_90a", ("bfloat16",), (128,))):
        # Causal with context and rab, or without rab where a family has none (the fused FP8 backward).
        if key.mask_kind == int(MaskKind.CAUSAL) and key.has_context and (key.has_rab or getattr(key, "role", "") == "fused"):
            keys.setdefault(key.kernel_name, key)
    keys["hopper_fwd_vt"] = variants.make_hopper_vt_key("sm_90a", variants.FP8_DTYPE, 128)
    keys["hopper_fwd_quant_slots"] = variants.make_hopper_quant_slots_key("sm_90a", "bfloat16", 128,
                                                                          variants.shipped_quant_slots()[-1])
    keys["func_table"] = variants.make_func_table_key("sm_90a", 3)
    return keys


def test_every_family_has_a_spec_matching_its_kernel():
    """compile.build refuses a kernel whose __call__ drifts from kernel_args.SPECS; here for every
    family, without compiling (the kernel objects only hold static config)."""
    pytest.importorskip("cutlass")
    from hstu_cute import compile as compile_mod
    from hstu_cute import kernel_args

    keys = _one_key_per_family()
    assert set(keys) == set(kernel_args.SPECS) == set(compile_mod.KERNELS)
    for key in keys.values():
        compile_mod.check_signature(key, compile_mod.kernel_for(key))


def test_signature_drift_is_refused():
    pytest.importorskip("cutlass")
    from hstu_cute import compile as compile_mod

    key = _one_key_per_family()["hopper_fwd"]

    class Drifted:
        def __call__(self, mQ, mK, stream):
            pass

    with pytest.raises(TypeError, match=r"Drifted.__call__: expected parameters \['mQ', 'mK', 'mV'"):
        compile_mod.check_signature(key, Drifted())


def test_ordered_takes_values_by_name_and_drops_absent_ones():
    from hstu_cute import kernel_args

    from hstu_cute.masks import MaskKind
    from hstu_cute.variants import make_bwd_keys

    key, _ = make_bwd_keys("sm_80", "bfloat16", 64, MaskKind.CAUSAL, True, True, True, True)
    names = [a.name for a in kernel_args.spec(key)]
    values = {n: n for n in names}
    args = kernel_args.ordered(key, values)
    # has_context, has_rab, has_drab: every argument present but the func mask's (MaskKind.FUNC keys
    # only) and the block mask's (block-sparse keys only)
    blocks = {"mBlockCount", "mBlockIndex", "mBlockState", "mBlockKept", "q_block", "k_block"}
    assert args == [None if n in {"mFunc", "mFuncBlocks"} | blocks else n for n in names]
    no_ctx = type(key)(**{**key.__dict__, "has_context": False, "has_target": False, "has_drab": False,
                          "rab_sum_heads": False})
    args = kernel_args.ordered(no_ctx, values)
    absent = {"mNumContexts", "mNumTargets", "mFunc", "mFuncBlocks", "mdRab", "mdRabAccum"} | blocks
    assert [a for a, n in zip(args, names) if a is None] == [None] * len(absent)
    assert {n for a, n in zip(args, names) if a is None} == absent
