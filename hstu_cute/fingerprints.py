"""Which source files a compiled module is built from, and the fingerprint of that set.

The module cache (:mod:`hstu_cute.cache`) files each compiled module under the fingerprint of its
*kernel family* (its ``kernel_name``), so that editing a file no kernel is built from (``cli.py``,
the launchers, the docs) invalidates nothing, and editing one kernel invalidates only the
families built from it. The file set is derived from the code, not listed by hand:

* **the compile step**: ``compile.py`` and what it imports at module level (the argument spec,
  ``kernel_args.py``, and through it ``fp8_format.py``); its function-level imports are the
  per-family dispatch and are not followed, except:
* **the family's kernel modules**: the modules imported by the builder function that
  ``compile.KERNELS`` maps the family's ``kernel_name`` to (``_hopper_fwd`` imports
  ``hopper.fwd``), read from ``compile.py`` with :mod:`ast`;
* **the key class's module** (``type(key).__module__``, :mod:`hstu_cute.variants` for every
  shipped key): its properties (``key.mask``, ``kernel_name``) are read by the compile step;
* the transitive closure of all of those over imports *within the package* (module-level and
  function-level ``from .x import``, ``from ..x import``, ``from hstu_cute.x import``,
  ``import hstu_cute.x``), e.g. ``hopper/base.py``, the ``common/`` modules a kernel uses,
  ``masks.py``, ``fp8_format.py``.

``from PKG import name`` depends on ``PKG/name.py`` when that is a module, else on
``PKG/__init__.py``. The parent packages a submodule import executes implicitly (the package's
``__init__.py``: host glue that imports ``warmup``; the subpackages' docstring-only
``__init__.py``) are not dependencies: no kernel reads from them.

A ``kernel_name`` that ``compile.KERNELS`` does not map (a test's or a user's own key) gets the
fingerprint of the whole package (every ``.py``), the conservative fallback.

Every fingerprint also hashes the cache format and the nvidia-cutlass-dsl, apache-tvm-ffi and
Python versions (passed in by the cache). Results are cached per process; tests that edit a
copy of the package call :func:`clear_caches`.

Imports only the standard library.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import re
import textwrap
from pathlib import Path
from typing import Iterable, Mapping

__all__ = [
    "PACKAGE_ROOT",
    "KEY_MODULE",
    "clear_caches",
    "compile_families",
    "family_sources",
    "fingerprint_of",
    "module_imports",
    "import_closure",
    "package_sources",
]

#: The ``hstu_cute`` package directory (tests point the functions here at a copy of it).
PACKAGE_ROOT = Path(__file__).resolve().parent
#: The module of the package's compile keys, relative to the package: what a family's
#: fingerprint assumes when no key is at hand (a cache entry whose sidecar is unreadable).
KEY_MODULE = "variants"
#: The compile step, relative to the package.
COMPILE_MODULE = "compile"
FINGERPRINT_LEN = 16


def _root(root: Path | None) -> Path:
    return (PACKAGE_ROOT if root is None else Path(root)).resolve()


def _module_file(root: Path, module: str) -> Path | None:
    """The file of package-relative dotted ``module`` ("" is the package): ``a/b.py`` or
    ``a/b/__init__.py``; None if neither exists."""
    parts = [p for p in module.split(".") if p]
    base = root.joinpath(*parts)
    if parts and base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _is_package(root: Path, module: str) -> bool:
    return (root.joinpath(*[p for p in module.split(".") if p]) / "__init__.py").is_file()


def _relative(root: Path, absolute: str) -> str | None:
    """``hstu_cute.a.b`` -> ``a.b`` (``hstu_cute`` -> ""); None outside the package."""
    head, _, tail = absolute.partition(".")
    return tail if head == root.name else None


@functools.lru_cache(maxsize=None)
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_bytes(), filename=str(path))


def _imports_of_nodes(root: Path, module: str, nodes: Iterable[ast.AST]) -> set[str]:
    """Package-relative modules that the import statements among ``nodes`` load."""
    is_pkg = _is_package(root, module)
    own = [p for p in module.split(".") if p]
    found: set[str] = set()

    def add(target: str) -> None:
        if _module_file(root, target) is not None:
            found.add(target)

    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                rel = _relative(root, alias.name)
                if rel is not None:
                    add(rel)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = own if is_pkg else own[:-1]
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)] if node.level - 1 <= len(base) else None
                if base is None:
                    continue  # above the package
                target = ".".join(base + (node.module.split(".") if node.module else []))
            else:
                if node.module is None:
                    continue
                rel = _relative(root, node.module)
                if rel is None:
                    continue
                target = rel
            if _is_package(root, target):
                for alias in node.names:
                    sub = f"{target}.{alias.name}" if target else alias.name
                    if alias.name != "*" and _module_file(root, sub) is not None:
                        found.add(sub)
                    else:  # a name defined in the package's __init__.py
                        add(target)
            else:
                add(target)
    return found


def _top_level_nodes(tree: ast.Module) -> Iterable[ast.AST]:
    """The statements that run at import time: the module body, descending into ``if`` /
    ``try`` / ``with`` blocks but not into functions or classes."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt) or isinstance(child, ast.excepthandler):
                stack.append(child)


# A line that starts an import statement, with its parenthesised or backslash-continued names.
_IMPORT_LINE = re.compile(
    rb"^([ \t]*)((?:from[ \t]+[\w.]+[ \t]+import[ \t]*(?:\([^)]*\)|[^\n]*))|(?:import[ \t]+[^\n]*))", re.M)
_IMPORT_WORD = re.compile(rb"\bimport\b")


def _fast_import_nodes(data: bytes) -> list[ast.AST] | None:
    """The import statements of a file, parsing only the lines that
    start one (a tenth of the time of parsing a kernel file). None when that is not certain to
    find them all: some ``import`` word outside those lines (``x = 1; import y``,
    ``if c: import y``, a docstring), a line that does not parse, a continued line."""
    spans, out = [], []
    for m in _IMPORT_LINE.finditer(data):
        text = m.group(2)
        if text.rstrip().endswith(b"\\"):
            return None
        try:
            tree = ast.parse(textwrap.dedent(text.decode()))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            return None
        out.extend(tree.body)
        spans.append(m.span(2))
    words = [w.start() for w in _IMPORT_WORD.finditer(data)]
    i = 0
    for pos in words:  # both sorted: every `import` word must lie in a parsed statement
        while i < len(spans) and spans[i][1] <= pos:
            i += 1
        if i == len(spans) or not spans[i][0] <= pos:
            return None
    return out


@functools.lru_cache(maxsize=None)
def _import_nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every import statement of a file, at any depth."""
    fast = _fast_import_nodes(path.read_bytes())
    if fast is not None:
        return tuple(fast)
    return tuple(n for n in ast.walk(_parsed(path)) if isinstance(n, (ast.Import, ast.ImportFrom)))


@functools.lru_cache(maxsize=None)
def _module_imports(root: Path, module: str, top_level_only: bool) -> frozenset[str]:
    path = _module_file(root, module)
    if path is None:
        raise FileNotFoundError(f"no module {module!r} in {root}")
    nodes = _top_level_nodes(_parsed(path)) if top_level_only else _import_nodes(path)
    return frozenset(_imports_of_nodes(root, module, nodes) - {module})


def module_imports(module: str, root: Path | None = None, *, top_level_only: bool = False) -> frozenset[str]:
    """The package-relative modules that ``module`` (package-relative, dotted) imports from
    the package, directly."""
    return _module_imports(_root(root), module, top_level_only)


@functools.lru_cache(maxsize=None)
def _closure(root: Path, modules: tuple[str, ...]) -> tuple[str, ...]:
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(_module_imports(root, m, False) - seen)
    return tuple(sorted(seen))


def import_closure(modules: Iterable[str], root: Path | None = None) -> tuple[str, ...]:
    """``modules`` and everything they import from the package, transitively (sorted)."""
    return _closure(_root(root), tuple(sorted(set(modules))))


@functools.lru_cache(maxsize=None)
def _compile_families(root: Path) -> Mapping[str, frozenset[str]]:
    path = _module_file(root, COMPILE_MODULE)
    if path is None:
        return {}
    tree = _parsed(path)
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    table = None
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == "KERNELS" for t in targets) and isinstance(node.value, ast.Dict):
            table = node.value
    if table is None:
        return {}
    out: dict[str, frozenset[str]] = {}
    for k, v in zip(table.keys, table.values):
        if isinstance(k, ast.Constant) and isinstance(k.value, str) and isinstance(v, ast.Name) and v.id in functions:
            out[k.value] = frozenset(_imports_of_nodes(root, COMPILE_MODULE, ast.walk(functions[v.id])))
    return out


def compile_families(root: Path | None = None) -> Mapping[str, frozenset[str]]:
    """``{kernel_name: kernel modules}`` read from ``compile.KERNELS``: each family's builder
    function and the package modules it imports (e.g. ``hopper_fwd`` -> ``{"hopper.fwd"}``)."""
    return _compile_families(_root(root))


def _key_module(root: Path, key_module: str | None) -> str | None:
    if key_module is None:
        return KEY_MODULE if _module_file(root, KEY_MODULE) is not None else None
    rel = _relative(root, key_module)
    return rel if rel is not None and _module_file(root, rel) is not None else None


def family_sources(kernel_name: str, key_module: str | None = None,
                   root: Path | None = None) -> tuple[str, ...] | None:
    """Package-relative paths (``hopper/fwd.py``, ...) of the files a module of ``kernel_name``
    is built from, sorted; None when ``compile.KERNELS`` has no such family.

    ``key_module`` is the absolute module name of the key's class (``type(key).__module__``);
    None means :data:`KEY_MODULE`. A key class outside the package adds nothing."""
    r = _root(root)
    kernels = _compile_families(r).get(kernel_name)
    if not kernels:
        return None
    # compile.py itself, but only its module-level imports: its function-level ones are the
    # other families' kernel modules (and the cache, covered by the cache format).
    seeds = set(kernels) | set(_module_imports(r, COMPILE_MODULE, True))
    km = _key_module(r, key_module)
    if km is not None:
        seeds.add(km)
    return _sources(r, set(import_closure(seeds, r)) | {COMPILE_MODULE})


def _sources(root: Path, modules: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(_module_file(root, m).relative_to(root).as_posix() for m in modules))


def package_sources(root: Path | None = None) -> tuple[str, ...]:
    """Every ``.py`` file of the package (the fallback set for unknown kernel names)."""
    r = _root(root)
    return tuple(sorted(p.relative_to(r).as_posix() for p in r.rglob("*.py") if p.is_file()))


def fingerprint_of(sources: Iterable[str], header: Mapping[str, str], root: Path | None = None) -> str:
    """Hash of ``header`` (cache format, toolchain versions) and of ``sources`` (package-relative
    paths, each with its bytes)."""
    r = _root(root)
    h = hashlib.sha256()
    for name, value in sorted(header.items()):
        h.update(f"{name}={value}\0".encode())
    for rel in sorted(set(sources)):
        data = (r / rel).read_bytes()
        h.update(len(rel).to_bytes(8, "little"))
        h.update(rel.encode())
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:FINGERPRINT_LEN]


def clear_caches() -> None:
    """Forget the parsed files and import graphs (for tests that edit a copy of the package)."""
    for fn in (_parsed, _import_nodes, _module_imports, _closure, _compile_families):
        fn.cache_clear()
