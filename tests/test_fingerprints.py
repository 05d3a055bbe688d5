"""Per-family cache fingerprints (hstu_cute/fingerprints.py, cache.family_fingerprint): which
edits invalidate which kernel families. CPU only, nothing compiled: every edit is made to a
copy of the package in a temporary directory, never to the real files."""

import json
import shutil
from pathlib import Path

import pytest

import hstu_cute.cache as cache_mod
from hstu_cute import fingerprints
from hstu_cute.cache import ModuleCache, clear_fingerprint_caches, family_fingerprint, source_fingerprint
from hstu_cute.variants import shipped_keys

REPO = Path(__file__).resolve().parents[1]

AMPERE_FWD = {"ampere_fwd", "ampere_fwd_paged"}
AMPERE_BWD = {"ampere_bwd_dq", "ampere_bwd_dkdv"}
HOPPER_FWD = {"hopper_fwd", "hopper_fwd_paged", "hopper_fwd_fp8"}
HOPPER_BWD = {"hopper_bwd_dkdv", "hopper_bwd_fused", "hopper_bwd_dq", "hopper_bwd_wide"}
HOPPER_BWD_FP8 = {"hopper_bwd_fp8_dkdv", "hopper_bwd_fp8_dq", "hopper_bwd_fp8_fused"}
VT, QUANT, FUNC_TABLE = {"hopper_fwd_vt"}, {"hopper_fwd_quant_slots"}, {"func_table"}
ALL = AMPERE_FWD | AMPERE_BWD | HOPPER_FWD | HOPPER_BWD | HOPPER_BWD_FP8 | VT | QUANT | FUNC_TABLE
#: Modules no kernel is built from: editing them must invalidate no family.
HOST_ONLY = ("cli.py", "validation.py", "api.py", "nn.py", "call.py", "warmup.py", "cache.py", "bench.py",
             "launch/fwd.py", "launch/prepared.py", "__init__.py", "fingerprints.py", "reference.py")


@pytest.fixture
def pkg(tmp_path):
    """A copy of the package (named hstu_cute, as the import resolution expects)."""
    root = tmp_path / "hstu_cute"
    shutil.copytree(REPO / "hstu_cute", root, ignore=shutil.ignore_patterns("__pycache__"))
    clear_fingerprint_caches()
    yield root
    clear_fingerprint_caches()


def fps(root):
    clear_fingerprint_caches()
    return {name: family_fingerprint(name, "hstu_cute.variants", root) for name in ALL}


def edit(root, rel, text="\n# an edit\n"):
    path = root / rel
    path.write_text(path.read_text() + text)


def changed(before, after):
    return {name for name in before if before[name] != after[name]}


def test_families_are_the_compile_table():
    assert set(fingerprints.compile_families()) == ALL
    assert fingerprints.compile_families()["hopper_fwd"] == {"hopper.fwd"}
    assert fingerprints.compile_families()["ampere_bwd_dq"] == {"ampere.bwd"}
    # Every shipped key belongs to a family with kernel modules, and its class lives in KEY_MODULE.
    for arch in ("sm_80", "sm_90a"):
        for key in shipped_keys(arch):
            assert fingerprints.compile_families()[key.kernel_name], key
            assert type(key).__module__ == f"hstu_cute.{fingerprints.KEY_MODULE}"


def test_sources_of_the_hopper_forward():
    src = set(fingerprints.family_sources("hopper_fwd", "hstu_cute.variants"))
    assert {"hopper/fwd.py", "hopper/base.py", "common/silu.py", "common/sm90.py", "masks.py", "fp8_format.py",
            "kernel_args.py", "compile.py", "variants.py"} <= src
    assert not {"hopper/bwd.py", "ampere/fwd.py", "common/sm80.py"} & src
    assert fingerprints.family_sources("no_such_kernel") is None


def test_no_family_is_built_from_host_only_modules():
    for name in ALL:
        src = fingerprints.family_sources(name, "hstu_cute.variants")
        assert not set(HOST_ONLY) & set(src), (name, set(HOST_ONLY) & set(src))
        assert not [s for s in src if s.startswith(("launch/", "integrations/"))], name


def test_copy_matches_the_package(pkg):
    assert fps(pkg) == fps(None)
    assert len(set(fps(pkg).values())) == 8  # families built from the same files share one


def test_editing_host_modules_changes_no_family(pkg):
    base = fps(pkg)
    for rel in HOST_ONLY:
        edit(pkg, rel)
    assert changed(base, fps(pkg)) == set()
    # ...but the whole-package fingerprint (kernel names compile.py does not know) does change.
    assert family_fingerprint("test_vec_add", None, pkg) != source_fingerprint()


def test_editing_silu_changes_the_families_that_use_it(pkg):
    base = fps(pkg)
    edit(pkg, "common/silu.py")
    assert changed(base, fps(pkg)) == ALL - VT - QUANT - FUNC_TABLE


def test_editing_the_hopper_forward_changes_its_families_only(pkg):
    base = fps(pkg)
    edit(pkg, "hopper/fwd.py")
    assert changed(base, fps(pkg)) == HOPPER_FWD


@pytest.mark.parametrize("rel, families", [
    ("hopper/base.py", HOPPER_FWD | HOPPER_BWD | HOPPER_BWD_FP8),
    ("hopper/bwd_wide.py", HOPPER_BWD),
    ("hopper/bwd.py", HOPPER_BWD | HOPPER_BWD_FP8),
    ("hopper/quantize.py", QUANT),
    ("ampere/func_table.py", FUNC_TABLE),
    ("ampere/base.py", AMPERE_FWD | AMPERE_BWD),
    ("common/sm80.py", AMPERE_FWD | AMPERE_BWD),
    ("common/key_blocks.py", AMPERE_FWD | AMPERE_BWD | HOPPER_FWD),
    ("common/fp8.py", HOPPER_FWD | HOPPER_BWD_FP8 | QUANT),
    ("masks.py", ALL),
    ("fp8_format.py", ALL),
    ("kernel_args.py", ALL),
    ("compile.py", ALL),
    ("variants.py", ALL),
])
def test_each_edit_changes_exactly_its_families(pkg, rel, families):
    base = fps(pkg)
    edit(pkg, rel)
    assert changed(base, fps(pkg)) == families


def test_a_new_import_joins_the_family(pkg):
    """A function-level ``from .. import`` in a kernel module adds the imported module (and its
    imports) to the family's files."""
    base = fps(pkg)
    edit(pkg, "hopper/vt.py", "\n\ndef _probe():\n    from ..common import silu\n    return silu\n")
    assert changed(base, fps(pkg)) == VT
    base = fps(pkg)
    edit(pkg, "common/silu.py")
    assert changed(base, fps(pkg)) == ALL - QUANT - FUNC_TABLE


def test_toolchain_versions_change_every_family(pkg, monkeypatch):
    base = fps(pkg)
    monkeypatch.setattr(cache_mod, "runtime_versions", lambda: {"nvidia-cutlass-dsl": "0.0", "python": "3.0"})
    assert changed(base, fps(pkg)) == ALL
    monkeypatch.setattr(cache_mod, "CACHE_FORMAT", 999)
    assert len(set(fps(pkg).values())) == 8


def test_computed_once_per_process(pkg):
    before = family_fingerprint("hopper_fwd", "hstu_cute.variants", pkg)
    edit(pkg, "hopper/fwd.py")
    assert family_fingerprint("hopper_fwd", "hstu_cute.variants", pkg) == before  # cached...
    clear_fingerprint_caches()
    assert family_fingerprint("hopper_fwd", "hstu_cute.variants", pkg) != before  # ...until cleared


# ---------------------------------------------------------------------------------------------
# The cache's layout, entries(), clear(), prune()
# ---------------------------------------------------------------------------------------------


def _fake_entry(root, fp, kernel_name, digest, key_module="hstu_cute.variants"):
    kdir = root / fp / kernel_name
    kdir.mkdir(parents=True, exist_ok=True)
    (root / fp / ".hstu_cute_fingerprint").write_text("{}")
    (kdir / f"{digest}.o").write_bytes(b"obj")
    (kdir / f"{digest}.json").write_text(json.dumps(
        {"kernel_name": kernel_name, "key_module": key_module, "key": f"K({digest})", "size": 3}))


def test_entries_are_filed_under_their_family(tmp_path):
    c = ModuleCache(tmp_path, arch="sm_80")
    key = next(k for k in shipped_keys("sm_90a") if k.kernel_name == "hopper_fwd")
    fp = family_fingerprint("hopper_fwd", "hstu_cute.variants")
    assert c.fingerprint_for(key) == fp == c.family_fingerprints()["hopper_fwd"]
    assert c.fingerprint_dir(key) == tmp_path / fp
    assert c.entry_paths(key)["obj"].parent == tmp_path / fp / "hopper_fwd"
    bwd = next(k for k in shipped_keys("sm_80") if k.kernel_name == "ampere_bwd_dq")
    assert c.fingerprint_for(bwd) != fp


def test_entries_clear_and_prune_per_family(tmp_path):
    c = ModuleCache(tmp_path, arch="sm_80")
    fwd, vt = c.family_fingerprints()["hopper_fwd"], c.family_fingerprints()["hopper_fwd_vt"]
    _fake_entry(tmp_path, fwd, "hopper_fwd", "a")
    _fake_entry(tmp_path, fwd, "hopper_fwd_paged", "b")
    _fake_entry(tmp_path, vt, "hopper_fwd_vt", "c")
    _fake_entry(tmp_path, "0123456789abcdef", "hopper_fwd", "old")  # an older hopper/fwd.py
    _fake_entry(tmp_path, vt, "hopper_fwd", "misfiled")  # not hopper_fwd's fingerprint
    assert [e["digest"] for e in c.entries()] == ["a", "b", "c"]
    every = c.entries(all_fingerprints=True)
    assert sorted((e["digest"], e["current"]) for e in every) == [
        ("a", True), ("b", True), ("c", True), ("misfiled", False), ("old", False)]
    assert c.prune() == 5  # old: .o, .json, its directory's marker; misfiled: .o, .json
    assert sorted(e["digest"] for e in c.entries(all_fingerprints=True)) == ["a", "b", "c"]
    assert not (tmp_path / "0123456789abcdef").exists()
    _fake_entry(tmp_path, "0123456789abcdef", "hopper_fwd", "old")
    assert c.clear() == 8  # a, b, c and both current markers
    assert [e["digest"] for e in c.entries(all_fingerprints=True)] == ["old"]
    assert c.clear(all_fingerprints=True) == 3
    assert list(tmp_path.iterdir()) == []


def test_fast_import_scan_matches_ast():
    """The line scan finds what a full parse finds, or declines (then the full parse runs)."""
    import ast

    scanned = 0
    for path in sorted((REPO / "hstu_cute").rglob("*.py")):
        fast = fingerprints._fast_import_nodes(path.read_bytes())
        if fast is None:
            continue
        scanned += 1
        full = [n for n in ast.walk(ast.parse(path.read_bytes())) if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert sorted(map(ast.dump, fast)) == sorted(map(ast.dump, full)), path
    assert scanned >= 20
    for text in ("x = 1; import os\n", "if x: from . import masks\n", "from . import \\\n    masks\n",
                 '"""from the package import what"""\n'):
        assert fingerprints._fast_import_nodes(text.encode()) is None, text
    assert len(fingerprints._fast_import_nodes(b"from .a import (b,\n    c)\n\ndef f():\n    import os\n")) == 2
