"""Tests of hstu_cute/cache.py (CPU only: real sm_80 compiles of a tiny kernel, fake tensors).

Loading an exported ``.o`` with ``load_module(..., enable_tvm_ffi=True)`` needs no GPU (the CUDA
driver is only touched when the function is called), so every test here loads for real; calling
the loaded function is left to GPU tests.
"""

import dataclasses
import enum
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_80")

import _cache_worker as worker  # noqa: E402  (tests/ is on sys.path under pytest)
from _cache_worker import VecAddKey, build_vec_add  # noqa: E402

import hstu_cute.cache as cache_mod  # noqa: E402
from hstu_cute.cache import (  # noqa: E402
    EXPORT_FUNCTION_NAME,
    ModuleCache,
    building_for_export,
    default_cache,
    key_digest,
    key_payload,
    reset_default_cache,
    runtime_versions,
    source_fingerprint,
)

REPO = Path(__file__).resolve().parents[1]
FP = "fp0000000000test"


class Builder:
    """A ``build`` callable that counts its calls. By default it returns one executor compiled
    for real once per test session (exporting it again is real too), so tests stay fast;
    ``fresh=True`` compiles anew on every call."""

    _compiled: dict = {}

    def __init__(self, key, fresh=False):
        self.key, self.fresh, self.calls = key, fresh, 0

    def __call__(self):
        self.calls += 1
        if self.fresh:
            return build_vec_add(self.key)
        if self.key not in Builder._compiled:
            Builder._compiled[self.key] = build_vec_add(self.key)
        return Builder._compiled[self.key]


def _subprocess_env():
    paths = [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))


def new_cache(root, **kw):
    kw.setdefault("fingerprint_override", FP)
    return ModuleCache(root, **kw)


def entry_files(root):
    return sorted(p.relative_to(root).as_posix() for p in Path(root).rglob("*") if p.is_file())


@pytest.fixture(autouse=True)
def _isolate_env(monkeypatch, tmp_path):
    monkeypatch.delenv("HSTU_CUTE_CACHE", raising=False)
    monkeypatch.delenv("HSTU_CUTE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    reset_default_cache()
    yield
    reset_default_cache()


@pytest.fixture(scope="session")
def populated(tmp_path_factory):
    """A cache directory holding one valid entry (scale=2), built by a real compile."""
    root = tmp_path_factory.mktemp("populated")
    key = VecAddKey(scale=2)
    c = new_cache(root)
    b = Builder(key)
    c.get(key, b)
    assert b.calls == 1 and c.stats.disk_writes == 1
    return root, key


def copy_of(populated, tmp_path):
    root, key = populated
    dst = tmp_path / "cache"
    shutil.copytree(root, dst)
    return dst, key


# ---------------------------------------------------------------------------------------------
# Keys and fingerprint
# ---------------------------------------------------------------------------------------------


class Color(enum.IntEnum):
    RED = 1
    BLUE = 2


@dataclasses.dataclass(frozen=True)
class Inner:
    kind: Color = Color.RED
    flag: bool = False


@dataclasses.dataclass(frozen=True)
class FancyKey:
    inner: Inner = Inner()
    tile: tuple = (128, 64)
    ratio: float = 1.0
    name: str = "x"
    kernel_name = "fancy"


def test_key_digest_is_canonical_and_discriminating():
    k = FancyKey()
    assert key_digest(k) == key_digest(FancyKey())
    payload = json.loads(key_payload(k, "sm_90a"))
    assert payload["type"] == "FancyKey" and payload["kernel_name"] == "fancy"
    assert payload["arch"] == "sm_90a"
    variants = [
        FancyKey(inner=Inner(kind=Color.BLUE)),
        FancyKey(inner=Inner(flag=True)),
        FancyKey(tile=(64, 128)),
        FancyKey(ratio=1.5),
        FancyKey(name="y"),
    ]
    digests = {key_digest(k)} | {key_digest(v) for v in variants}
    assert len(digests) == 1 + len(variants)
    assert key_digest(k, "sm_80") != key_digest(k, "sm_90a")
    # bool vs int and int vs float stay distinct
    assert key_digest(VecAddKey(scale=1)) != key_digest(VecAddKey(scale=True))
    assert key_payload(FancyKey(ratio=1.0)) != key_payload(FancyKey(ratio=1))


def test_key_digest_stable_across_processes():
    code = (
        "import sys; sys.path[:0] = [%r, %r]\n"
        "from _cache_worker import VecAddKey\n"
        "from hstu_cute.cache import key_digest\n"
        "print(key_digest(VecAddKey(scale=7), 'sm_80'))\n" % (str(REPO), str(REPO / "tests"))
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == key_digest(VecAddKey(scale=7), "sm_80")


def test_bad_keys_are_rejected():
    class NoRepr:
        pass

    @dataclasses.dataclass(frozen=True)
    class Unstable:
        obj: object
        kernel_name = "bad"

    @dataclasses.dataclass(frozen=True)
    class NoName:
        x: int = 1

    with pytest.raises(TypeError):
        key_digest(Unstable(NoRepr()))
    with pytest.raises(TypeError):
        key_digest(NoName())
    with pytest.raises(TypeError):
        key_digest(("not", "a", "dataclass"))


def test_source_fingerprint_tracks_sources(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    shutil.copytree(REPO / "hstu_cute", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(cache_mod, "_PACKAGE_ROOT", pkg)

    def fp():
        source_fingerprint.cache_clear()
        return source_fingerprint()

    try:
        base = fp()
        assert fp() == base and len(base) == 16
        (pkg / "cache.py").write_text((pkg / "cache.py").read_text() + "\n# edit\n")
        edited = fp()
        assert edited != base
        (pkg / "new_module.py").write_text("x = 1\n")
        assert fp() not in (base, edited)
        (pkg / "notes.txt").write_text("not python\n")  # only .py files count
        with_txt = fp()
        (pkg / "notes.txt").unlink()
        assert fp() == with_txt
    finally:
        source_fingerprint.cache_clear()


def test_import_does_not_pull_torch_or_cutlass():
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('probe_cache', %r)\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['probe_cache'] = m\n"
        "spec.loader.exec_module(m)\n"
        "m.ModuleCache('/nonexistent/x'); m.default_cache()\n"
        "bad = [n for n in ('torch', 'cutlass', 'tvm_ffi') if n in sys.modules]\n"
        "print(','.join(bad))\n" % str(REPO / "hstu_cute" / "cache.py")
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


# ---------------------------------------------------------------------------------------------
# Memory and disk layers
# ---------------------------------------------------------------------------------------------


def test_memory_hit_returns_same_object_without_build(tmp_path, monkeypatch):
    c = new_cache(tmp_path)
    key = VecAddKey(scale=2)
    b = Builder(key, fresh=True)  # a real compile
    fn = c.get(key, b)
    assert b.calls == 1 and c.stats.compiles == 1 and c.stats.disk_writes == 1
    t = c.timing(key)
    assert t.source == "compile" and t.seconds > 0 and t.export_s > 0

    # The hot path does no digest and no file I/O: break both, then ask again.
    def boom(*a, **k):
        raise AssertionError("hot path touched the slow path")

    monkeypatch.setattr(cache_mod, "key_payload", boom)
    monkeypatch.setattr(cache_mod.ModuleCache, "_get_slow", boom)
    shutil.rmtree(tmp_path / FP)
    for _ in range(3):
        assert c.get(key, b) is fn
    assert b.calls == 1 and c.stats.memory_hits == 3
    assert key in c and len(c) == 1
    # an equal key (a new instance) hits too
    assert c.get(VecAddKey(scale=2), b) is fn


def test_disk_round_trip(tmp_path):
    keys = [VecAddKey(scale=2), VecAddKey(scale=3)]
    c1 = new_cache(tmp_path)
    for k in keys:
        c1.get(k, Builder(k))
    assert c1.stats.compiles == 2 and c1.stats.disk_writes == 2

    files = entry_files(tmp_path)
    for k in keys:
        d = key_digest(k, "sm_80")
        for ext in ("o", "json", "lock"):
            assert f"{FP}/test_vec_add/{d}.{ext}" in files
    assert not [f for f in files if "tmp" in f]

    meta = json.loads(c1.entry_paths(keys[0])["meta"].read_text())
    obj = c1.entry_paths(keys[0])["obj"].read_bytes()
    assert meta["sha256"] == hashlib.sha256(obj).hexdigest() and meta["size"] == len(obj)
    assert meta["key"] == repr(keys[0]) and meta["arch"] == "sm_80"
    assert meta["versions"] == runtime_versions() and meta["fingerprint"] == FP
    assert meta["function_name"] == EXPORT_FUNCTION_NAME and meta["compile_s"] > 0

    c2 = new_cache(tmp_path)  # a "new process": empty memory, same directory
    fns = []
    for k in keys:
        b = Builder(k)
        fn = c2.get(k, b)
        assert b.calls == 0 and callable(fn)
        fns.append(fn)
        t = c2.timing(k)
        assert t.source == "disk" and 0 < t.seconds < 5
        assert t.path == str(c2.entry_paths(k)["obj"])
    assert type(fns[0]).__name__ == "Function"  # a tvm_ffi.Function
    assert fns[0] is not fns[1]  # two modules exporting the same symbol name coexist
    assert c2.stats.disk_hits == 2 and c2.stats.compiles == 0
    assert c2.get(keys[0], Builder(keys[0])) is fns[0] and c2.stats.memory_hits == 1

    ents = c2.entries()
    assert [e["key"] for e in ents] == sorted(repr(k) for k in keys)
    assert all(e["kernel_name"] == "test_vec_add" and e["valid"] and e["size"] > 0 for e in ents)
    assert all(Path(e["path"]).exists() and e["mtime"] > 0 for e in ents)

    assert c2.clear() >= 6
    assert c2.entries() == [] and len(c2) == 0
    assert not (tmp_path / FP).exists()


def _corrupt_truncate(paths):
    data = paths["obj"].read_bytes()
    paths["obj"].write_bytes(data[: len(data) // 2])


def _corrupt_flip(paths):
    data = bytearray(paths["obj"].read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0xFF
    paths["obj"].write_bytes(bytes(data))


def _corrupt_garble_sidecar(paths):
    paths["meta"].write_text('{"sha256": "abc", "size": ')


def _corrupt_sidecar_not_dict(paths):
    paths["meta"].write_text("[1, 2, 3]")


def _corrupt_drop_sidecar(paths):
    paths["meta"].unlink()


def _corrupt_drop_obj(paths):
    paths["obj"].unlink()


def _corrupt_unloadable_but_sha_ok(paths):
    """A .o whose sidecar vouches for it but which load_module rejects."""
    junk = b"\x7fELF" + b"\0" * 60 + b"junk" * 100
    paths["obj"].write_bytes(junk)
    meta = json.loads(paths["meta"].read_text())
    meta.update(sha256=hashlib.sha256(junk).hexdigest(), size=len(junk))
    paths["meta"].write_text(json.dumps(meta))


CORRUPTIONS = {
    "truncate": _corrupt_truncate,
    "flip-bytes": _corrupt_flip,
    "garbled-sidecar": _corrupt_garble_sidecar,
    "sidecar-not-dict": _corrupt_sidecar_not_dict,
    "missing-sidecar": _corrupt_drop_sidecar,
    "missing-obj": _corrupt_drop_obj,
    "unloadable": _corrupt_unloadable_but_sha_ok,
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_corrupt_entry_is_rebuilt(populated, tmp_path, how, monkeypatch):
    root, key = copy_of(populated, tmp_path)
    c = new_cache(root)
    paths = c.entry_paths(key)
    good = paths["obj"].read_bytes()
    CORRUPTIONS[how](paths)
    corrupt = paths["obj"].read_bytes() if paths["obj"].exists() else None
    if corrupt == good:
        corrupt = None  # the sidecar was corrupted, the object is intact

    # What load_module is handed, by content: whether the rebuilt entry is then loaded from disk
    # or kept from the build depends on the process's DSL state (with hstu_cute.launch imported
    # first it is loaded), corrupt object bytes never are.
    loaded = []
    real_load = cache_mod._load_function
    monkeypatch.setattr(cache_mod, "_load_function", lambda p: loaded.append(Path(p).read_bytes()) or real_load(p))
    b = Builder(key)
    fn = c.get(key, b)
    assert callable(fn) and b.calls == 1
    assert c.stats.rebuilt_corrupt == 1 and c.stats.disk_hits == 0 and c.stats.disk_writes == 1
    if how != "unloadable" and corrupt is not None:
        assert corrupt not in loaded  # a corrupt entry is never handed to load_module
    new = paths["obj"].read_bytes()
    meta = json.loads(paths["meta"].read_text())
    assert hashlib.sha256(new).hexdigest() == meta["sha256"]
    assert len(new) == len(good)

    c2 = new_cache(root)  # the repaired entry loads
    b2 = Builder(key)
    assert callable(c2.get(key, b2)) and b2.calls == 0 and c2.stats.disk_hits == 1


@pytest.mark.parametrize(
    "field,value",
    [
        ("versions", {"nvidia-cutlass-dsl": "0.0.1", "apache-tvm-ffi": "0", "python": "2.7"}),
        ("fingerprint", "someotherfp00000"),
        ("arch", "sm_90a"),
        ("format", 0),
        ("key", "VecAddKey(scale=99)"),
    ],
)
def test_stale_entry_is_rebuilt(populated, tmp_path, field, value):
    root, key = copy_of(populated, tmp_path)
    c = new_cache(root)
    meta_path = c.entry_paths(key)["meta"]
    meta = json.loads(meta_path.read_text())
    meta[field] = value
    meta_path.write_text(json.dumps(meta))
    b = Builder(key)
    assert callable(c.get(key, b)) and b.calls == 1
    assert c.stats.rebuilt_stale == 1 and c.stats.rebuilt_corrupt == 0
    assert json.loads(meta_path.read_text())[field] != value


def test_changed_fingerprint_uses_new_directory(populated, tmp_path):
    root, key = copy_of(populated, tmp_path)
    c = new_cache(root, fingerprint_override="fp1111111111test")
    b = Builder(key)
    c.get(key, b)
    assert b.calls == 1 and c.stats.disk_hits == 0 and c.stats.compiles == 1
    assert c.fingerprint_dir() == root / "fp1111111111test"
    assert c.entry_paths(key)["obj"].exists()
    assert (root / FP).is_dir()  # the old fingerprint's entries are left alone...
    assert len(c.entries()) == 1
    # ...until clear(all_fingerprints=True) (fingerprint-named dirs only)
    (root / "unrelated").mkdir()
    (root / "unrelated" / "keep.o").write_bytes(b"x")
    c.clear(all_fingerprints=True)
    assert sorted(p.name for p in root.iterdir()) == ["unrelated"]


def test_real_fingerprint_layout(tmp_path):
    c = ModuleCache(tmp_path)
    assert c.fingerprint == source_fingerprint()
    key = VecAddKey(scale=2)
    c.get(key, Builder(key))
    assert c.entry_paths(key)["obj"] == (
        tmp_path / source_fingerprint() / "test_vec_add" / f"{key_digest(key, 'sm_80')}.o"
    )


def test_arch_from_key_or_cache():
    @dataclasses.dataclass(frozen=True)
    class NoArchKey:
        x: int = 1
        kernel_name = "k"

    c = ModuleCache("/nonexistent", arch="sm_86", fingerprint_override=FP)
    assert c.entry_arch(VecAddKey()) == "sm_80"  # the key's own arch wins
    assert c.entry_arch(NoArchKey()) == "sm_86"
    other = ModuleCache("/nonexistent", arch="sm_89", fingerprint_override=FP)
    assert c.entry_paths(NoArchKey())["obj"] != other.entry_paths(NoArchKey())["obj"]
    assert c.entry_paths(VecAddKey())["obj"] == other.entry_paths(VecAddKey())["obj"]


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------


def test_env_disable_keeps_memory_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HSTU_CUTE_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("HSTU_CUTE_CACHE", "0")
    reset_default_cache()
    c = default_cache()
    assert c is default_cache() and not c.disk_enabled
    key = VecAddKey(scale=2)
    b = Builder(key)
    fn = c.get(key, b)
    assert c.get(key, b) is fn and b.calls == 1 and c.stats.memory_hits == 1
    assert not (tmp_path / "c").exists()
    assert c.stats.disk_writes == 0 and c.timing(key).source == "compile"


def test_env_dir_is_honoured(tmp_path, monkeypatch):
    monkeypatch.setenv("HSTU_CUTE_CACHE_DIR", str(tmp_path / "envdir"))
    reset_default_cache()
    c = default_cache()
    assert c.cache_dir() == tmp_path / "envdir" and c.disk_enabled
    key = VecAddKey(scale=2)
    c.get(key, Builder(key))
    assert str(c.entry_paths(key)["obj"]).startswith(str(tmp_path / "envdir" / c.fingerprint))
    assert c.entry_paths(key)["obj"].exists()

    # reset re-reads the environment
    monkeypatch.delenv("HSTU_CUTE_CACHE_DIR")
    reset_default_cache()
    assert default_cache() is not c
    assert default_cache().cache_dir() == tmp_path / "xdg" / "hstu_cute"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    reset_default_cache()
    assert default_cache().cache_dir() == tmp_path / "home" / ".cache" / "hstu_cute"


# ---------------------------------------------------------------------------------------------
# Disk errors degrade to memory-only
# ---------------------------------------------------------------------------------------------


def _get_twice_two_keys(c):
    fns = {}
    for scale in (2, 3):
        key = VecAddKey(scale=scale)
        b = Builder(key)
        fns[scale] = c.get(key, b)
        assert c.get(key, b) is fns[scale] and b.calls == 1
    return fns


def test_unwritable_dir_degrades_with_one_warning(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache dir should be")
    c = new_cache(blocker / "cache")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fns = _get_twice_two_keys(c)
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "in-memory" in msgs[0], msgs
    assert all(callable(f) for f in fns.values())
    assert not c.writable and c.stats.compiles == 2 and c.stats.disk_errors >= 1
    assert c.entries() == []


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody (root included) can write: mode 0555, or ``chattr +i`` for root."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        yield ro
        ro.chmod(0o755)
        return
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(ro)], capture_output=True).returncode:
        pytest.skip("running as root and cannot make a directory immutable")
    try:
        yield ro
    finally:
        subprocess.run([chattr, "-i", str(ro)], check=True)


def test_read_only_dir_degrades(read_only_dir):
    try:
        (read_only_dir / "probe").write_text("x")
        pytest.skip("the directory is still writable")
    except OSError:
        pass
    c = new_cache(read_only_dir)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fns = _get_twice_two_keys(c)
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == 1
    assert all(callable(f) for f in fns.values())
    assert not c.writable and c.stats.compiles == 2
    assert list(read_only_dir.iterdir()) == []


class _OsProxy:
    """``os`` for hstu_cute.cache only, with some calls failing (the DSL's own os untouched)."""

    def __init__(self, **failing):
        self._failing = failing

    def __getattr__(self, name):
        if name in self._failing:
            code = self._failing[name]

            def fail(*a, **k):
                raise OSError(code, os.strerror(code))

            return fail
        return getattr(os, name)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_write_errors_degrade_with_one_warning(tmp_path, monkeypatch, code):
    monkeypatch.setattr(cache_mod, "os", _OsProxy(replace=code))
    c = new_cache(tmp_path)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fns = _get_twice_two_keys(c)
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == 1
    assert all(callable(f) for f in fns.values()) and c.stats.compiles == 2
    # nothing half-written is left behind (lock files are fine)
    assert [f for f in entry_files(tmp_path) if f.endswith((".o", ".json")) or "tmp" in f] == []


def test_read_only_populated_dir_still_loads(populated, tmp_path, monkeypatch):
    root, key = copy_of(populated, tmp_path)

    # no lock files, no replacing, no deleting
    monkeypatch.setattr(cache_mod, "os", _OsProxy(replace=errno.EROFS, open=errno.EROFS))
    c = new_cache(root)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        b = Builder(key)
        fn = c.get(key, b)  # a verified entry loads without a lock
        assert callable(fn) and b.calls == 0 and c.stats.disk_hits == 1
        assert rec == []
        other = VecAddKey(scale=3)  # a miss: can't lock, can't write -> memory only
        b3 = Builder(other)
        assert callable(c.get(other, b3)) and b3.calls == 1
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == 1


def test_unexportable_executor_stays_in_memory(tmp_path):
    class NotExportable:
        def __call__(self):
            pass

        def export_to_c(self, file_path, file_name, function_prefix=""):  # non-TVM signature
            raise NotImplementedError

    @dataclasses.dataclass(frozen=True)
    class K:
        kernel_name = "plain"

    c = new_cache(tmp_path)
    obj = NotExportable()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert c.get(K(), lambda: obj) is obj
    assert len(rec) == 1 and "--enable-tvm-ffi" in str(rec[0].message)
    assert c.writable and c.entries() == []


class ExportOnlyBuilder:
    """Builds like hstu_cute.compile: without a JIT engine while the cache builds for export."""

    def __init__(self, key):
        self.key, self.seen = key, []

    def __call__(self):
        self.seen.append(building_for_export())
        return build_vec_add(self.key, jit_engine=not building_for_export())


def test_export_only_build_is_loaded_from_its_export(tmp_path):
    key = VecAddKey(scale=6)
    c = new_cache(tmp_path)
    b = ExportOnlyBuilder(key)
    fn = c.get(key, b)
    assert b.seen == [True] and not building_for_export()
    assert type(fn).__name__ == "Function" and callable(fn)  # loaded from the exported object
    assert c.stats.compiles == 1 and c.stats.disk_writes == 1 and c.stats.disk_hits == 0
    t = c.timing(key)
    assert t.source == "compile" and t.path == str(c.entry_paths(key)["obj"])
    assert [e["valid"] for e in c.entries()] == [True]
    assert c.get(key, b) is fn and b.seen == [True]
    c2 = new_cache(tmp_path)
    assert callable(c2.get(key, Builder(key))) and c2.stats.disk_hits == 1


def test_export_only_build_without_disk_gets_an_engine(tmp_path):
    key = VecAddKey(scale=7)
    c = new_cache(tmp_path, enabled=False)
    b = ExportOnlyBuilder(key)
    fn = c.get(key, b)
    assert b.seen == [False] and fn.engine is not None and c.entries() == []


def test_export_only_build_that_does_not_load_is_rebuilt_with_an_engine(tmp_path, monkeypatch):
    def broken_load(obj):
        raise RuntimeError("load_module failed")

    monkeypatch.setattr(cache_mod, "_load_function", broken_load)
    key = VecAddKey(scale=8)
    c = new_cache(tmp_path)
    b = ExportOnlyBuilder(key)
    fn = c.get(key, b)
    assert b.seen == [True, False] and fn.engine is not None
    assert c.get(key, b) is fn and c.stats.compiles == 1


def test_build_errors_propagate_and_leave_no_entry(tmp_path):
    c = new_cache(tmp_path)
    key = VecAddKey(scale=5)

    def bad_build():
        raise ValueError("compile failed")

    with pytest.raises(ValueError):
        c.get(key, bad_build)
    assert key not in c and c.entries() == []
    b = Builder(key)
    assert callable(c.get(key, b)) and b.calls == 1  # the lock was released


# ---------------------------------------------------------------------------------------------
# Several processes
# ---------------------------------------------------------------------------------------------


def test_processes_racing_compile_once(tmp_path):
    n = 3
    cache_dir, barrier, counter = tmp_path / "cache", tmp_path / "barrier", tmp_path / "count"
    barrier.mkdir()
    env = _subprocess_env()
    cmd = [
        sys.executable, worker.__file__, "--cache-dir", str(cache_dir), "--fingerprint", FP,
        "--scale", "4", "--barrier-dir", str(barrier), "--workers", str(n),
        "--counter-file", str(counter),
    ]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(n)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))

    assert len(counter.read_text().split()) == 1  # exactly one build() across the processes
    assert sum(r["stats"]["compiles"] for r in results) == 1
    assert sum(r["stats"]["disk_hits"] for r in results) == n - 1
    assert all(r["callable"] for r in results)
    assert sorted(r["source"] for r in results) == ["compile"] + ["disk"] * (n - 1)
    # the loaders waited on the compiler's lock rather than compiling themselves
    assert all(r["lock_wait_s"] > 0 for r in results if r["source"] == "disk")
    c = new_cache(cache_dir)
    assert len(c.entries()) == 1 and c.entries()[0]["valid"]


def _cuda_arch():
    if not any(Path("/dev").glob("nvidia[0-9]*")):
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


@pytest.mark.gpu
def test_gpu_compiled_and_disk_loaded_executors_run(tmp_path):
    arch = _cuda_arch()
    if arch is None:
        pytest.skip("needs a CUDA GPU")
    env = _subprocess_env()
    env["CUTE_DSL_ARCH"] = arch
    cmd = [
        sys.executable, worker.__file__, "--cache-dir", str(tmp_path), "--fingerprint", FP,
        "--scale", "3", "--arch", arch, "--call",
    ]
    results = []
    for _ in range(2):  # a process that compiles, then one that loads from disk
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert [r["source"] for r in results] == ["compile", "disk"]
    assert results[1]["type"] == "Function"
    assert [r["max_err"] for r in results] == [0.0, 0.0]
