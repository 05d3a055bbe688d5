"""tools/ (the maintained developer tools, issue 42): every tool prints its usage with --help and
exits 0 without doing anything (no GPU, no compile: heavy imports sit inside main), tools/ stays
small, and scripts/ (the drawer it replaced) does not come back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
MAX_TOOLS = 20
# Python tools with subcommands: each subcommand's --help too.
SUBCOMMANDS = {
    "sanitize.py": ("cases", "fp8", "fp8-bwd"),
    "host.py": ("attribution", "primitives", "standin", "dispatch", "profile"),
}


def _tools() -> list[Path]:
    return sorted(p for p in TOOLS.iterdir() if p.is_file() and p.suffix in (".py", ".sh"))


def _help(cmd: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES="")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)


def test_tools_is_small_and_scripts_is_gone():
    assert TOOLS.is_dir()
    files = [p for p in TOOLS.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert 0 < len(files) <= MAX_TOOLS, sorted(p.name for p in files)
    assert all(p in _tools() for p in files), "tools/ holds only .py and .sh tools"
    assert not (ROOT / "scripts").exists(), "scripts/ became tools/"


@pytest.mark.parametrize("tool", [p.name for p in _tools()])
def test_tool_help(tool):
    path = TOOLS / tool
    if path.suffix == ".sh":
        assert path.read_text().startswith("#!/usr/bin/env bash\n")
        cmds = [["bash", str(path), flag] for flag in ("-h", "--help")]
    else:
        text = path.read_text()
        assert text.lstrip().startswith(('"""', "r\"\"\"")), f"{tool}: no module docstring"
        cmds = [[sys.executable, str(path), "--help"]]
        cmds += [[sys.executable, str(path), sub, "--help"] for sub in SUBCOMMANDS.get(tool, ())]
    for cmd in cmds:
        r = _help(cmd)
        assert r.returncode == 0, f"{' '.join(cmd[1:])}: rc {r.returncode}\n{r.stderr[-2000:]}"
        assert r.stdout.strip(), f"{' '.join(cmd[1:])}: no usage printed"
        if path.suffix == ".py":
            assert r.stdout.startswith("usage:"), r.stdout[:200]
        else:
            assert "Usage" in r.stdout or "usage" in r.stdout, r.stdout[:200]


def test_shell_help_runs_nothing(tmp_path):
    """--help of a device script prints its usage and stops: nothing written under $OUT."""
    out = tmp_path / "out"
    for path in (p for p in _tools() if p.suffix == ".sh"):
        r = subprocess.run(["bash", str(path), "--help"], cwd=tmp_path, env=dict(os.environ, OUT=str(out)),
                           capture_output=True, text=True, timeout=10)
        assert r.returncode == 0 and r.stdout.strip(), path.name
        assert not out.exists(), f"{path.name} --help ran its body"


def test_no_reference_to_scripts_dir():
    """Nothing in the tree points at scripts/ any more, except the perf diary's old entries
    (its last section maps the old names to the new)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    hits = []
    for rel in tracked.stdout.split():
        if rel == "docs/dev/perf-log.md" or rel == "tests/test_tools.py":
            continue
        path = ROOT / rel
        if not path.is_file() or path.suffix not in (".py", ".sh", ".md", ".txt", ".ipynb", ".json", ".toml", ""):
            continue
        text = path.read_text(errors="replace")
        hits += [f"{rel}:{i}" for i, line in enumerate(text.splitlines(), 1) if "scripts/" in line]
    assert not hits, hits


def test_tools_name_only_what_the_package_has():
    """Every ``bench.X`` / ``launch.X`` a Python tool reads exists (the modes run only on a GPU, so
    a renamed or removed helper would otherwise fail there first: gpu_perf's modes called a
    ``bench.replace`` that a cleanup had removed)."""
    import ast
    import importlib

    missing = []
    for path in (p for p in _tools() if p.suffix == ".py"):
        tree = ast.parse(path.read_text())
        imported = {alias.asname or alias.name: f"{node.module}.{alias.name}" for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module == "hstu_cute" for alias in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported:
                module = importlib.import_module(imported[node.value.id])
                if not hasattr(module, node.attr):
                    missing.append(f"{path.name}: {imported[node.value.id]}.{node.attr}")
    assert not missing, missing
