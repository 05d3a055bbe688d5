"""JIT module cache: compiled CuTe DSL executors in memory and on disk.

``cute.compile`` does not memoize (it sets ``no_cache=True``) and one compile of an attention
kernel costs about a second of CPU time, so every kernel module asks this cache for its executor::

    fn = default_cache().get(key, lambda: cute.compile(host_fn, *fake_args,
                                                      options="--enable-tvm-ffi"))

``key`` is a small frozen dataclass owned by the kernel module. It has a ``kernel_name``
(attribute or property, a ``str``) and hashable, picklable, repr-stable fields (ints, bools,
strs, floats, enums, nested frozen dataclasses, tuples of those).

Lookup order
------------
1. **Memory**: one ``dict.get`` keyed by the dataclass itself. No digest, no file I/O, no tracing.
2. **Disk**: ``<cache_dir>/<fingerprint>/<kernel_name>/<digest>.o`` (exported with
   ``export_to_c``) and ``<digest>.json`` (sidecar: key repr and module, sha256 and size of the
   ``.o``, DSL / tvm-ffi / Python versions, arch, fingerprint), where ``<fingerprint>`` is the
   key's kernel family's (below). The ``.o`` is loaded with
   ``cutlass.cute.runtime.load_module(path, enable_tvm_ffi=True)`` and the function exported
   under :data:`EXPORT_FUNCTION_NAME` is taken from it. Entries are verified (sidecar parses,
   versions/fingerprint/arch/key match, sha256 and size match) *before* loading; a corrupt or
   stale entry is deleted and rebuilt, never loaded.
3. **Compile**: ``build()`` runs under an exclusive ``fcntl.flock`` on ``<digest>.lock`` so that
   N processes starting together compile a variant once (the others wait on the lock, then load
   the entry from disk). The ``.o`` is exported to a temp file in the same directory and moved
   into place with ``os.replace``; the sidecar is written the same way, last. The process keeps
   the executor that ``build()`` returned, unless it is export-only (below). When no complete
   entry was written (``build()`` raised, or the export failed) the holder removes the lock
   file before releasing it, so failed runs leave no empty ``.lock`` files; a process that then
   gets the lock on the removed file notices (inode check) and locks the path again.

While the cache builds an entry it will export, :func:`building_for_export` is True: a builder may
then return a module compiled without an in-process JIT engine (``hstu_cute.compile`` does), and
the cache loads the exported object as a disk hit would. The DSL's engine costs two extra host
codegens (MCJIT, then a JITLink object) that the export repeats anyway: about 0.3 s of a 2.7 s
cold compile (Hopper fwd D128 causal, 2 cores).

Disk errors (read-only directory, full disk, permissions) never fail a call: the cache warns
once and carries on in memory (entries that already exist on disk are still loaded).

Fingerprints
------------
Each kernel family (``kernel_name``) has its own fingerprint (:func:`family_fingerprint`): a
hash of exactly the files its modules are built from, of :data:`CACHE_FORMAT` and of the
nvidia-cutlass-dsl, apache-tvm-ffi and Python versions. The files are derived from the code
(:mod:`hstu_cute.fingerprints`): the builder that ``compile.KERNELS`` maps the family to names
its kernel modules (``hopper_fwd`` -> ``hopper/fwd.py``), and the set is those modules,
``compile.py`` and its module-level imports (``kernel_args.py``), the key class's module
(``variants.py``), and everything these import from the package, transitively (``hopper/base.py``,
the ``common/`` modules the kernel uses, ``masks.py``, ``fp8_format.py``, ...). So editing
``cli.py`` or a launcher invalidates nothing, editing ``hopper/fwd.py`` only the Hopper
forward families, editing ``common/silu.py`` the families whose kernels import it. Families
built from the same files share a fingerprint directory (``<fp>/hopper_fwd``,
``<fp>/hopper_fwd_paged``, ...); each directory's marker file lists its files. A
``kernel_name`` that ``compile.KERNELS`` does not know (a test's or a user's own kernel) gets
:func:`source_fingerprint`, the hash of every ``.py`` of the package. Directories of other
fingerprints are left alone (never loaded; :meth:`ModuleCache.prune` deletes them). The digest of a key also covers the GPU arch of the entry (``key.arch`` when
the key has such a str field, else ``CUTE_DSL_ARCH`` / the DSL's detected arch), so machines of
different archs can share one cache directory.

Environment
-----------
``HSTU_CUTE_CACHE_DIR``  cache root (default ``$XDG_CACHE_HOME/hstu_cute`` or
                         ``~/.cache/hstu_cute``).
``HSTU_CUTE_CACHE=0``    disables the disk layer (the memory layer stays).

This module imports neither torch nor cutlass at import time (``import tvm_ffi`` imports torch,
so tvm-ffi's version is read from package metadata); cutlass is imported on the first disk load.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import dataclasses
import enum
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

__all__ = [
    "CACHE_FORMAT",
    "EXPORT_FUNCTION_NAME",
    "CacheStats",
    "EntryTiming",
    "ModuleCache",
    "building_for_export",
    "cache_enabled_from_env",
    "default_cache",
    "default_cache_dir",
    "key_digest",
    "key_payload",
    "reset_default_cache",
    "runtime_versions",
    "family_fingerprint",
    "source_fingerprint",
]

log = logging.getLogger(__name__)

#: Name every cached ``.o`` exports its TVM-FFI function under (symbol ``__tvm_ffi_<name>``).
#: Each ``.o`` is loaded into its own execution engine, so one fixed name is enough.
EXPORT_FUNCTION_NAME = "hstu_cute_entry"

#: Bumped when the layout of the directory or of the sidecar changes (2: one fingerprint per
#: kernel family; the sidecar names the key's module).
CACHE_FORMAT = 2

ENV_DIR = "HSTU_CUTE_CACHE_DIR"
ENV_ENABLE = "HSTU_CUTE_CACHE"

_FALSE_STRINGS = frozenset({"0", "false", "no", "off"})
_FP_MARKER = ".hstu_cute_fingerprint"  # in each fingerprint directory; clear() looks for it
_DIGEST_LEN = 32
_PACKAGE_ROOT = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------
# Fingerprint, versions, arch
# ---------------------------------------------------------------------------------------------


def _dist_version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=1)
def runtime_versions() -> dict[str, str]:
    """Versions that make a cached ``.o`` unusable when they change (read from metadata)."""
    return {
        "nvidia-cutlass-dsl": _dist_version("nvidia-cutlass-dsl"),
        "apache-tvm-ffi": _dist_version("apache-tvm-ffi"),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def _fp():
    """:mod:`hstu_cute.fingerprints`, imported on first use (stdlib only; this module stays
    importable on its own)."""
    from . import fingerprints

    return fingerprints


def _fingerprint_header() -> dict[str, str]:
    return {"hstu_cute-cache-format": str(CACHE_FORMAT), **runtime_versions()}


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """Hash of every ``.py`` file in the package (sorted relative paths + bytes), of the cache
    format and of :func:`runtime_versions`: the fingerprint of keys whose ``kernel_name`` is no
    family of ``compile.KERNELS`` (a user's or a test's own kernel). Computed once per process."""
    return _fp().fingerprint_of(
        _fp().package_sources(_PACKAGE_ROOT), _fingerprint_header(), _PACKAGE_ROOT)


@functools.lru_cache(maxsize=None)
def _family_fingerprint(kernel_name: str, key_module: str | None, root: Path) -> str:
    sources = _fp().family_sources(kernel_name, key_module, root)
    if sources is None:
        return source_fingerprint() if root == _PACKAGE_ROOT else _fp().fingerprint_of(
            _fp().package_sources(root), _fingerprint_header(), root)
    return _fp().fingerprint_of(sources, _fingerprint_header(), root)


def family_fingerprint(kernel_name: str, key_module: str | None = None, root: Path | None = None) -> str:
    """The fingerprint of the modules of ``kernel_name``: the files they are built from
    (:func:`hstu_cute.fingerprints.family_sources`: the kernel modules, what they import from
    the package, the compile step and argument spec, the key's module ``key_module``, default
    :mod:`hstu_cute.variants`), the cache format and :func:`runtime_versions`. A name that
    ``compile.KERNELS`` does not know gets :func:`source_fingerprint`. Cached per process
    (:func:`clear_fingerprint_caches`); ``root`` defaults to this package (tests pass a copy)."""
    return _family_fingerprint(kernel_name, key_module, Path(root).resolve() if root is not None else _PACKAGE_ROOT)


def clear_fingerprint_caches() -> None:
    """Forget every fingerprint computed in this process (tests that edit package files)."""
    source_fingerprint.cache_clear()
    _family_fingerprint.cache_clear()
    _fp().clear_caches()


def _detect_arch() -> str:
    """The GPU arch ``cute.compile`` targets by default (``CUTE_DSL_ARCH`` or the device)."""
    env = os.environ.get("CUTE_DSL_ARCH")
    if env:
        return env
    try:
        from cutlass.cutlass_dsl import CuTeDSL

        return str(CuTeDSL._get_dsl().envar.arch)
    except Exception as exc:  # pragma: no cover - depends on the DSL install
        log.debug("could not detect the GPU arch: %r", exc)
        return "unknown"


# ---------------------------------------------------------------------------------------------
# Key digest
# ---------------------------------------------------------------------------------------------


def _canon(value: Any) -> Any:
    """A JSON-encodable, process-independent form of a key field."""
    if isinstance(value, enum.Enum):  # before int: IntEnum is an int
        return {"enum": type(value).__qualname__, "name": value.name, "value": _canon(value.value)}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"float": repr(value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "dataclass": type(value).__qualname__,
            "fields": [[f.name, _canon(getattr(value, f.name))] for f in dataclasses.fields(value)],
        }
    if isinstance(value, (tuple, list)):
        return {type(value).__name__: [_canon(v) for v in value]}
    if isinstance(value, frozenset):
        items = [json.dumps(_canon(v), sort_keys=True) for v in value]
        return {"frozenset": sorted(items)}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, type):  # e.g. a cutlass dtype class
        return {"type": f"{value.__module__}.{value.__qualname__}"}
    text = repr(value)
    if " at 0x" in text:
        raise TypeError(
            f"compile-key field {value!r} of type {type(value).__qualname__} has no stable repr"
        )
    return {"repr": f"{type(value).__qualname__}:{text}"}


def _kernel_name(key: Any) -> str:
    name = getattr(key, "kernel_name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"compile key {key!r} needs a non-empty str `kernel_name`")
    return name


def key_payload(key: Any, arch: str = "") -> str:
    """Canonical JSON text of a key: its class ``__qualname__``, ``kernel_name``, fields, arch."""
    if not dataclasses.is_dataclass(key) or isinstance(key, type):
        raise TypeError(f"compile keys must be dataclass instances, got {type(key).__qualname__}")
    payload = {
        "type": type(key).__qualname__,
        "kernel_name": _kernel_name(key),
        "fields": [[f.name, _canon(getattr(key, f.name))] for f in dataclasses.fields(key)],
        "arch": arch,
    }
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def key_digest(key: Any, arch: str = "") -> str:
    """Stable hex digest of :func:`key_payload` (not Python's ``hash``)."""
    return hashlib.sha256(key_payload(key, arch).encode()).hexdigest()[:_DIGEST_LEN]


def _safe_component(name: str) -> str:
    out = "".join(c if (c.isascii() and (c.isalnum() or c in "._-")) else "_" for c in name)
    out = out.lstrip(".")
    return out or "_"


# ---------------------------------------------------------------------------------------------
# Locations and environment
# ---------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$HSTU_CUTE_CACHE_DIR``, else ``$XDG_CACHE_HOME/hstu_cute``, else ``~/.cache/hstu_cute``."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "hstu_cute"


def cache_enabled_from_env() -> bool:
    """False when ``HSTU_CUTE_CACHE`` is ``0`` / ``false`` / ``no`` / ``off``."""
    return os.environ.get(ENV_ENABLE, "1").strip().lower() not in _FALSE_STRINGS


# ---------------------------------------------------------------------------------------------
# Export-only builds
# ---------------------------------------------------------------------------------------------

_BUILDING_FOR_EXPORT = contextvars.ContextVar("hstu_cute_building_for_export", default=False)


def building_for_export() -> bool:
    """True inside a ``build()`` whose result the cache exports and then loads from disk: the
    builder may skip the in-process JIT engine (an export-only module has ``engine`` None)."""
    return _BUILDING_FOR_EXPORT.get()


def _export_only(fn: Any) -> bool:
    return getattr(fn, "engine", True) is None


# ---------------------------------------------------------------------------------------------
# Runtime libraries
# ---------------------------------------------------------------------------------------------

_RUNTIME_LOCK = threading.Lock()
_RUNTIME_HANDLES: list[ctypes.CDLL] = []
_RUNTIME_INIT_S: float | None = None


def _ensure_runtime() -> float:
    """Import the DSL runtime once per process; returns the seconds the first call took.

    ``find_runtime_libraries(enable_tvm_ffi=True)`` imports ``tvm_ffi`` (and through it torch):
    over a second in a fresh process, which would otherwise be billed to the first disk load.
    The libraries are also opened ``RTLD_GLOBAL`` (as FA4 does) so that symbols a loaded object
    needs are visible process-wide; with DSL 4.8.1 loading worked without it.
    """
    global _RUNTIME_INIT_S
    if _RUNTIME_INIT_S is not None:
        return 0.0
    with _RUNTIME_LOCK:
        if _RUNTIME_INIT_S is not None:
            return 0.0
        t0 = time.perf_counter()
        from cutlass.cute.runtime import find_runtime_libraries

        for lib in find_runtime_libraries(enable_tvm_ffi=True):
            if Path(lib).exists():
                try:
                    _RUNTIME_HANDLES.append(ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL))
                except OSError as exc:  # pragma: no cover - broken install
                    log.debug("could not preload %s: %r", lib, exc)
        _RUNTIME_INIT_S = time.perf_counter() - t0
        return _RUNTIME_INIT_S


# ---------------------------------------------------------------------------------------------
# Stats and timings
# ---------------------------------------------------------------------------------------------


@dataclass
class CacheStats:
    """Counters of one :class:`ModuleCache` (monotonic; ``reset()`` zeroes them)."""

    memory_hits: int = 0
    disk_hits: int = 0
    compiles: int = 0
    rebuilt_corrupt: int = 0
    rebuilt_stale: int = 0
    disk_writes: int = 0
    disk_errors: int = 0
    lock_wait_s: float = 0.0
    runtime_init_s: float = 0.0

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EntryTiming:
    """How the executor of one key was obtained in this process, most recent first-get.

    ``source`` is ``"disk"`` (``seconds`` = verify + ``load_module`` + lookup) or
    ``"compile"`` (``seconds`` = ``build()``; ``export_s`` = ``export_to_c`` + writes, + the load
    of an export-only build).
    ``lock_wait_s`` is time spent waiting for another process's compile of the same key.
    """

    source: str
    seconds: float
    export_s: float = 0.0
    lock_wait_s: float = 0.0
    path: str | None = None


class _Entry(NamedTuple):
    """Where and what one key's disk entry is."""

    digest: str
    arch: str
    key_repr: str
    payload: str
    dir: Path
    obj: Path
    meta: Path
    lock: Path
    fingerprint: str = ""  # of the key's family; "" (tests building entries by hand): the dir's name
    key_module: str | None = None  # type(key).__module__


class _Corrupt(Exception):
    pass


class _Stale(Exception):
    pass


class _DiskError(Exception):
    """Wraps an OSError of the disk layer (makes the cache degrade to memory-only)."""


# ---------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------


class ModuleCache:
    """Memory + disk cache of compiled executors, keyed by frozen dataclasses.

    Args:
        cache_dir: root directory; default :func:`default_cache_dir` (reads the env).
        enabled: disk layer on/off; default :func:`cache_enabled_from_env`.
        fingerprint_override: use this string as every key's fingerprint instead of
            :meth:`fingerprint_for`'s (tests).
        arch: arch the entries are for (part of the digest); default ``CUTE_DSL_ARCH`` or the
            DSL's detection, resolved on the first disk access.
        lock_timeout: seconds to wait for another process's compile before compiling anyway.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        enabled: bool | None = None,
        fingerprint_override: str | None = None,
        arch: str | None = None,
        lock_timeout: float = 600.0,
    ) -> None:
        self._root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self._disk_enabled = cache_enabled_from_env() if enabled is None else bool(enabled)
        if fingerprint_override is not None and _safe_component(fingerprint_override) != (
            fingerprint_override
        ):
            raise ValueError(f"fingerprint_override {fingerprint_override!r} is not a safe name")
        self._fingerprint = fingerprint_override
        self._override = fingerprint_override
        self._family_fps: dict[tuple[str, str | None], str] = {}
        self._arch = arch
        self.lock_timeout = float(lock_timeout)
        self._mem: dict[Any, Any] = {}
        self._timings: dict[Any, EntryTiming] = {}
        self._lock = threading.RLock()
        self._writable = True
        self._warned: set[str] = set()
        self.stats = CacheStats()

    # -- hot path -------------------------------------------------------------------------------

    def get(self, key: Any, build: Callable[[], Any]) -> Any:
        """The executor for ``key``: from memory, else from disk, else ``build()`` (then saved)."""
        fn = self._mem.get(key)
        if fn is not None:
            self.stats.memory_hits += 1
            return fn
        return self._get_slow(key, build)

    def __contains__(self, key: Any) -> bool:
        return key in self._mem

    def __len__(self) -> int:
        return len(self._mem)

    # -- properties / introspection ---------------------------------------------------------------

    @property
    def disk_enabled(self) -> bool:
        """Whether the disk layer is on (by argument / env)."""
        return self._disk_enabled

    @property
    def writable(self) -> bool:
        """False once a disk error made this cache memory-only for writes."""
        return self._disk_enabled and self._writable

    @property
    def fingerprint(self) -> str:
        """The fingerprint of keys the package does not know (:func:`source_fingerprint`, every
        ``.py`` of the package), or the override. The package's kernel families each have their
        own: :meth:`fingerprint_for`, :meth:`family_fingerprints`."""
        if self._fingerprint is None:
            self._fingerprint = source_fingerprint()
        return self._fingerprint

    def fingerprint_for(self, key: Any) -> str:
        """The fingerprint ``key``'s entry is filed under: :func:`family_fingerprint` of its
        ``kernel_name`` and class module (or the override)."""
        return self._fingerprint_for_name(_kernel_name(key), type(key).__module__)

    def _fingerprint_for_name(self, kernel_name: str, key_module: str | None) -> str:
        if self._override is not None:
            return self._override
        fp = self._family_fps.get((kernel_name, key_module))
        if fp is None:
            fp = self._family_fps[(kernel_name, key_module)] = family_fingerprint(kernel_name, key_module)
        return fp

    def family_fingerprints(self) -> dict[str, str]:
        """``{kernel_name: fingerprint}`` of the package's kernel families (``compile.KERNELS``)."""
        return {name: self._fingerprint_for_name(name, None) for name in _fp().compile_families()}

    @property
    def arch(self) -> str:
        if self._arch is None:
            self._arch = _detect_arch()
        return self._arch

    def cache_dir(self) -> Path:
        """Root directory (the fingerprint directories live under it)."""
        return self._root

    def fingerprint_dir(self, key: Any = None) -> Path:
        """``cache_dir() / fingerprint_for(key)``: where ``key``'s kernel family keeps its
        entries (without a key: the directory of :attr:`fingerprint`)."""
        return self._root / (self.fingerprint if key is None else self.fingerprint_for(key))

    def entry_arch(self, key: Any) -> str:
        """The arch of ``key``'s entry: ``key.arch`` when the key has one (a non-empty str),
        else :attr:`arch`."""
        arch = getattr(key, "arch", None)
        return arch if isinstance(arch, str) and arch else self.arch

    def entry_paths(self, key: Any) -> dict[str, Path]:
        """``{"dir", "obj", "meta", "lock"}`` paths of ``key``'s disk entry (no disk access)."""
        e = self._entry(key)
        return {"dir": e.dir, "obj": e.obj, "meta": e.meta, "lock": e.lock}

    def timing(self, key: Any) -> EntryTiming | None:
        """How ``key``'s executor was obtained in this process (None if never built/loaded)."""
        return self._timings.get(key)

    def timings(self) -> dict[Any, EntryTiming]:
        return dict(self._timings)

    def _kernel_dirs(self) -> Iterator[tuple[Path, Path, bool]]:
        """``(fingerprint_dir, kernel_dir, current)`` for every kernel directory under a
        fingerprint directory (one with the marker file). ``current``: the directory's name is
        the fingerprint this cache files that kernel under now (key module from a sidecar)."""
        try:
            fp_dirs = sorted(p for p in self._root.iterdir() if (p / _FP_MARKER).is_file())
        except OSError:
            return
        for fp_dir in fp_dirs:
            try:
                kernel_dirs = sorted(p for p in fp_dir.iterdir() if p.is_dir())
            except OSError:
                continue
            for kdir in kernel_dirs:
                yield fp_dir, kdir, fp_dir.name == self._dir_fingerprint(kdir)

    def _dir_fingerprint(self, kdir: Path) -> str:
        name, module = kdir.name, None
        try:
            metas = sorted(p for p in kdir.glob("*.json") if not p.name.startswith("."))
        except OSError:
            metas = []
        for meta_path in metas:
            meta = self._read_meta(meta_path)
            if meta and isinstance(meta.get("kernel_name"), str):
                name = meta["kernel_name"]
                module = meta.get("key_module") if isinstance(meta.get("key_module"), str) else None
                break
        return self._fingerprint_for_name(name, module)

    def entries(self, *, all_fingerprints: bool = False) -> list[dict[str, Any]]:
        """Disk entries of the current fingerprints (each kernel family's own: those this cache
        would load), or of every fingerprint directory; sorted by kernel name then key.

        Each is ``dict(kernel_name, key, size, path, mtime, digest, arch, compile_s, valid,
        fingerprint, current)``; ``key`` is the key's repr from the sidecar (None if the sidecar
        is missing/garbled).
        """
        out: list[dict[str, Any]] = []
        for fp_dir, kdir, current in self._kernel_dirs():
            if not (current or all_fingerprints):
                continue
            try:
                objs = sorted(p for p in kdir.glob("*.o") if not p.name.startswith("."))
            except OSError:
                continue
            for obj in objs:
                try:
                    st = obj.stat()
                except OSError:
                    continue
                meta = self._read_meta(obj.with_suffix(".json"))
                valid = bool(meta) and meta.get("size") == st.st_size
                out.append(
                    {
                        "kernel_name": (meta or {}).get("kernel_name", kdir.name),
                        "key": (meta or {}).get("key"),
                        "size": st.st_size,
                        "path": str(obj),
                        "mtime": st.st_mtime,
                        "digest": obj.stem,
                        "arch": (meta or {}).get("arch"),
                        "compile_s": (meta or {}).get("compile_s"),
                        "valid": valid,
                        "fingerprint": fp_dir.name,
                        "current": current,
                    }
                )
        out.sort(key=lambda e: (e["kernel_name"], e["key"] or "", e["digest"], e["fingerprint"]))
        return out

    def clear_memory(self) -> None:
        """Forget the in-memory executors and timings (the disk stays)."""
        with self._lock:
            self._mem.clear()
            self._timings.clear()

    def clear(self, *, all_fingerprints: bool = False) -> int:
        """Clear memory and delete the disk entries of the current fingerprints (the kernel
        directories :meth:`entries` lists), or every fingerprint directory under
        :meth:`cache_dir` (recognised by their marker file). Only files this cache writes
        (``*.o``, ``*.json``, ``*.lock``, temp files, the marker) are deleted, then empty
        directories; returns how many files."""
        self.clear_memory()
        if all_fingerprints:
            try:
                dirs = [p for p in self._root.iterdir() if (p / _FP_MARKER).is_file()]
            except OSError:
                dirs = []
            return sum(_remove_tree_files(d) for d in dirs)
        return self._remove_kernel_dirs(current=True)

    def prune(self) -> int:
        """Delete the entries of fingerprints that are no longer current (left by older sources
        or toolchains); returns how many files. Not safe while a process of *other* sources
        uses the same directory (its current entries are stale to this one)."""
        return self._remove_kernel_dirs(current=False)

    def _remove_kernel_dirs(self, *, current: bool) -> int:
        removed = 0
        fp_dirs = set()
        for fp_dir, kdir, is_current in list(self._kernel_dirs()):
            fp_dirs.add(fp_dir)
            if is_current == current:
                removed += _remove_tree_files(kdir)
        for fp_dir in fp_dirs:  # a fingerprint directory left without kernels goes too
            try:
                if not any(p.is_dir() for p in fp_dir.iterdir()):
                    removed += _remove_tree_files(fp_dir)
            except OSError:
                pass
        return removed

    # -- slow path --------------------------------------------------------------------------------

    def _entry(self, key: Any) -> _Entry:
        arch = self.entry_arch(key)
        payload = key_payload(key, arch)
        digest = hashlib.sha256(payload.encode()).hexdigest()[:_DIGEST_LEN]
        fingerprint = self.fingerprint_for(key)
        kdir = self._root / fingerprint / _safe_component(_kernel_name(key))
        return _Entry(
            digest, arch, repr(key), payload, kdir,
            kdir / f"{digest}.o", kdir / f"{digest}.json", kdir / f"{digest}.lock", fingerprint,
            type(key).__module__,
        )

    def _get_slow(self, key: Any, build: Callable[[], Any]) -> Any:
        with self._lock:
            fn = self._mem.get(key)
            if fn is not None:
                self.stats.memory_hits += 1
                return fn
            if not self._disk_enabled:
                return self._build(key, build, None, lock_wait=0.0)

            entry = self._entry(key)

            # Optimistic lock-free load: a complete, verified entry needs no lock.
            fn = self._try_load(key, entry, lock_wait=0.0, quiet=True)
            if fn is not None:
                return fn

            if not self._writable:
                return self._build(key, build, None, lock_wait=0.0)

            try:
                with self._flock(entry) as (locked, waited):
                    self.stats.lock_wait_s += waited
                    # Under the lock no writer is active: the state on disk is final.
                    fn = self._try_load(key, entry, lock_wait=waited)
                    if fn is not None:
                        return fn
                    return self._build(key, build, entry, lock_wait=waited)
            except _DiskError:
                # Raised while taking the lock (before build): carry on in memory.
                return self._build(key, build, None, lock_wait=0.0)

    def _try_load(
        self,
        key: Any,
        entry: _Entry,
        *,
        lock_wait: float,
        quiet: bool = False,
    ) -> Any | None:
        """Load a verified entry; on a corrupt/stale one delete it (unless ``quiet``: the
        lock-free probe leaves repairs to the locked pass). Returns None on a miss."""
        obj, meta_path = entry.obj, entry.meta
        try:
            meta_exists = meta_path.exists()
            obj_exists = obj.exists()
        except OSError:
            return None
        if not meta_exists and not obj_exists:
            return None
        t0 = time.perf_counter()
        try:
            if not meta_exists:
                raise _Corrupt("sidecar missing")
            if not obj_exists:
                raise _Corrupt("object file missing")
            meta = self._read_meta(meta_path)
            if meta is None:
                raise _Corrupt("sidecar unreadable or garbled")
            self._check_meta(meta, entry)
            data = obj.read_bytes()
            if len(data) != meta["size"]:
                raise _Corrupt(f"size {len(data)} != {meta['size']}")
            if hashlib.sha256(data).hexdigest() != meta["sha256"]:
                raise _Corrupt("sha256 mismatch")
            init_s = _ensure_runtime()  # once per process; not billed to this entry
            self.stats.runtime_init_s += init_s
            t0 += init_s
            fn = _load_function(obj)
        except (_Corrupt, _Stale) as exc:
            if quiet:
                log.debug("lock-free probe of %s: %s", obj, exc)
                return None
            self._discard(entry, exc)
            return None
        except OSError as exc:
            if quiet:
                return None
            self._discard(entry, _Corrupt(f"read failed: {exc!r}"))
            return None
        except Exception as exc:  # load_module / symbol lookup failed
            if quiet:
                log.debug("lock-free load of %s failed: %r", obj, exc)
                return None
            self._discard(entry, _Corrupt(f"load failed: {exc!r}"))
            return None
        seconds = time.perf_counter() - t0
        self._mem[key] = fn
        self._timings[key] = EntryTiming("disk", seconds, lock_wait_s=lock_wait, path=str(obj))
        self.stats.disk_hits += 1
        log.debug("loaded %s from disk in %.1f ms", obj, seconds * 1e3)
        return fn

    def _check_meta(self, meta: dict[str, Any], entry: _Entry) -> None:
        for name, typ in (("sha256", str), ("size", int), ("versions", dict)):
            if not isinstance(meta.get(name), typ):
                raise _Corrupt(f"sidecar field {name!r} missing")
        if meta.get("format") != CACHE_FORMAT:
            raise _Stale(f"format {meta.get('format')!r} != {CACHE_FORMAT}")
        if meta["versions"] != runtime_versions():
            raise _Stale(f"versions {meta['versions']} != {runtime_versions()}")
        fingerprint = entry.fingerprint or entry.dir.parent.name
        if meta.get("fingerprint") != fingerprint:
            raise _Stale(f"fingerprint {meta.get('fingerprint')!r} != {fingerprint!r}")
        if meta.get("arch") != entry.arch:
            raise _Stale(f"arch {meta.get('arch')!r} != {entry.arch!r}")
        if meta.get("function_name") != EXPORT_FUNCTION_NAME:
            raise _Stale(f"function name {meta.get('function_name')!r}")
        if meta.get("digest") != entry.digest or meta.get("key") != entry.key_repr:
            raise _Stale(f"key {meta.get('key')!r} != {entry.key_repr!r}")

    @staticmethod
    def _read_meta(meta_path: Path) -> dict[str, Any] | None:
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        return meta if isinstance(meta, dict) else None

    def _discard(self, entry: _Entry, reason: Exception) -> None:
        if isinstance(reason, _Stale):
            self.stats.rebuilt_stale += 1
            kind = "stale"
        else:
            self.stats.rebuilt_corrupt += 1
            kind = "corrupt"
        log.info("hstu_cute cache: %s entry %s (%s): rebuilding", kind, entry.obj, reason)
        for p in (entry.meta, entry.obj):  # sidecar first: it is what vouches for the .o
            try:
                p.unlink(missing_ok=True)
            except OSError as exc:
                self._disk_error(exc)

    def _build(
        self,
        key: Any,
        build: Callable[[], Any],
        entry: _Entry | None,
        *,
        lock_wait: float,
    ) -> Any:
        exporting = entry is not None and self._writable
        t0 = time.perf_counter()
        token = _BUILDING_FOR_EXPORT.set(exporting)
        try:
            fn = build()
        finally:
            _BUILDING_FOR_EXPORT.reset(token)
        seconds = time.perf_counter() - t0
        if fn is None:
            raise TypeError(f"build() for {key!r} returned None")
        self.stats.compiles += 1
        export_s = 0.0
        path = None
        needs_engine = exporting and _export_only(fn)
        if exporting:
            t1 = time.perf_counter()
            if self._export(key, fn, entry, seconds):
                path = str(entry.obj)
                if needs_engine:
                    loaded = self._load_exported(entry)
                    if loaded is not None:
                        fn, needs_engine = loaded, False
            export_s = time.perf_counter() - t1
        if needs_engine:  # the export failed or did not load: compile again, with an engine
            fn = build()
        self._mem[key] = fn
        self._timings[key] = EntryTiming("compile", seconds, export_s, lock_wait, path)
        return fn

    def _load_exported(self, entry: _Entry) -> Any | None:
        """The executor of an entry this process just exported (None if it does not load)."""
        try:
            self.stats.runtime_init_s += _ensure_runtime()
            return _load_function(entry.obj)
        except Exception as exc:  # load_module / symbol lookup failed
            log.warning("hstu_cute cache: cannot load %s just exported (%r)", entry.obj, exc)
            return None

    def _export(self, key: Any, fn: Any, entry: _Entry, compile_s: float) -> bool:
        kdir, digest = entry.dir, entry.digest
        token = f"{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}"
        tmp_obj = kdir / f".{digest}.{token}.tmp.o"  # export_to_c picks the format from ".o"
        tmp_meta = kdir / f".{digest}.{token}.tmp.json"
        try:
            try:
                fn.export_to_c(str(tmp_obj), function_name=EXPORT_FUNCTION_NAME)
            except OSError:
                raise
            except Exception as exc:
                self._warn_once(
                    f"export:{type(fn).__qualname__}",
                    f"hstu_cute cache: cannot export {type(fn).__qualname__} for "
                    f"{_kernel_name(key)} ({exc!r}); keeping it in memory only. Compile with "
                    f'options="--enable-tvm-ffi" to make it cacheable on disk.',
                )
                return False
            data = tmp_obj.read_bytes()
            _fsync_path(tmp_obj)
            os.replace(tmp_obj, entry.obj)
            meta = {
                "format": CACHE_FORMAT,
                "kernel_name": _kernel_name(key),
                "key_type": type(key).__qualname__,
                "key_module": type(key).__module__,
                "key": entry.key_repr,
                "digest": digest,
                "payload": entry.payload,
                "function_name": EXPORT_FUNCTION_NAME,
                "sha256": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "fingerprint": entry.fingerprint or entry.dir.parent.name,
                "arch": entry.arch,
                "versions": runtime_versions(),
                "compile_s": round(compile_s, 6),
                "created": time.time(),
                "pid": os.getpid(),
            }
            with open(tmp_meta, "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_meta, entry.meta)
            self.stats.disk_writes += 1
            return True
        except OSError as exc:
            self._disk_error(exc)
            # Never leave a .o without the sidecar that vouches for it.
            for p in (entry.meta, entry.obj):
                try:
                    p.unlink(missing_ok=True)
                except OSError:
                    pass
            return False
        finally:
            for p in (tmp_obj, tmp_meta):
                try:
                    p.unlink(missing_ok=True)
                except OSError:
                    pass

    # -- locking and errors ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _flock(self, entry: _Entry) -> Iterator[tuple[bool, float]]:
        """Exclusive flock on ``<digest>.lock``; yields ``(locked, seconds_waited)``.

        Raises _DiskError when the directory or the lock file cannot be created. On timeout
        yields ``locked=False`` (the caller still writes atomically, so that is safe).

        The lock file is removed on release when no complete entry is on disk (the build failed
        or was not exported), so failed runs leave no empty ``.lock`` files; beside a complete
        entry it stays. It is unlinked only by the holder, before unlocking, and a process that
        gets the lock checks that its descriptor is still the file at ``entry.lock`` (else it
        reopens the path and locks again): whoever holds the lock on the file at that path is
        the only holder, as with a lock file that is never removed."""
        fd = self._open_lock(entry)
        t0 = time.perf_counter()
        locked = False
        unsupported = False  # flock does not work here: nobody can lock, nobody waits
        try:
            delay = 0.005
            deadline = time.monotonic() + self.lock_timeout
            while True:
                got = False
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    got = True
                except BlockingIOError:
                    pass
                except OSError as exc:  # e.g. a filesystem without flock support
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        log.debug("flock(%s) failed: %r; continuing unlocked", entry.lock, exc)
                        unsupported = True
                        break
                if got:
                    if _same_file(fd, entry.lock):
                        locked = True
                        break
                    # The holder before us removed the file after we opened it: this lock guards
                    # nothing. Lock the file that is at the path now (created if need be).
                    os.close(fd)  # releases the flock
                    fd = -1
                    fd = self._open_lock(entry)
                    delay = 0.005
                if time.monotonic() >= deadline:
                    self._warn_once(
                        f"lock-timeout:{entry.lock}",
                        f"hstu_cute cache: waited {self.lock_timeout:.0f}s for {entry.lock}; "
                        "compiling without the lock",
                    )
                    break
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
            yield locked, time.perf_counter() - t0
        finally:
            if fd >= 0:
                if (locked or unsupported) and not entry.meta.exists():
                    # Still holding the lock (or nobody can lock here): no process relies on this
                    # file any more; a waiter that opened it notices and reopens the path.
                    try:
                        os.unlink(entry.lock)
                    except OSError:
                        pass
                if locked:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_UN)
                    except OSError:
                        pass
                os.close(fd)

    def _open_lock(self, entry: _Entry) -> int:
        """Create the entry's directory (and the fingerprint marker) and open its lock file."""
        try:
            entry.dir.mkdir(parents=True, exist_ok=True)
            marker = entry.dir.parent / _FP_MARKER
            if not marker.exists():
                marker.write_text(json.dumps({"fingerprint": entry.dir.parent.name, **runtime_versions(),
                                              "sources": self._marker_sources(entry)}))
            return os.open(entry.lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            self._disk_error(exc)
            raise _DiskError(str(exc)) from exc

    def _marker_sources(self, entry: _Entry) -> Any:
        """The files the fingerprint of ``entry``'s directory hashes (for people reading it)."""
        if self._override is not None:
            return None
        try:
            sources = _fp().family_sources(entry.dir.name, entry.key_module, _PACKAGE_ROOT)
        except Exception:  # informative only
            return None
        return list(sources) if sources is not None else "every .py of the package"

    def _disk_error(self, exc: OSError) -> None:
        self.stats.disk_errors += 1
        if self._writable:
            self._writable = False
            self._warn_once(
                "disk",
                f"hstu_cute cache: disk cache at {self._root} is not usable ({exc!r}); "
                "continuing with the in-memory cache only",
            )

    def _warn_once(self, tag: str, message: str) -> None:
        if tag in self._warned:
            return
        self._warned.add(tag)
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def __repr__(self) -> str:
        return (
            f"ModuleCache(dir={str(self._root)!r}, disk={'on' if self._disk_enabled else 'off'}"
            f"{'' if self._writable else ' (read-only)'}, entries_in_memory={len(self._mem)})"
        )


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _load_function(obj: Path) -> Any:
    from cutlass.cute.runtime import load_module

    module = load_module(str(obj), enable_tvm_ffi=True)
    # The returned tvm_ffi.Function keeps the module's execution engine alive.
    return getattr(module, EXPORT_FUNCTION_NAME)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is still the file at ``path`` (not removed or replaced)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:  # removed by the holder before us
        return False
    except OSError:  # cannot tell: as before lock files were removed, trust the descriptor
        return True
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _owned_file(name: str) -> bool:
    return name.endswith((".o", ".json", ".lock")) or name == _FP_MARKER


def _remove_tree_files(root: Path) -> int:
    removed = 0
    if not root.is_dir():
        return 0
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            if _owned_file(name):
                try:
                    os.unlink(os.path.join(dirpath, name))
                    removed += 1
                except OSError:
                    pass
        try:
            os.rmdir(dirpath)
        except OSError:
            pass
    return removed


# ---------------------------------------------------------------------------------------------
# Process-wide instance
# ---------------------------------------------------------------------------------------------

_DEFAULT: ModuleCache | None = None
_DEFAULT_LOCK = threading.Lock()


def default_cache() -> ModuleCache:
    """The process-wide cache (created on first use from ``HSTU_CUTE_CACHE_DIR`` /
    ``HSTU_CUTE_CACHE``)."""
    cache = _DEFAULT
    if cache is None:
        with _DEFAULT_LOCK:
            cache = _DEFAULT
            if cache is None:
                cache = _set_default(ModuleCache())
    return cache


def _set_default(cache: ModuleCache | None) -> ModuleCache | None:
    global _DEFAULT
    _DEFAULT = cache
    return cache


def reset_default_cache() -> None:
    """Drop the process-wide cache; the next :func:`default_cache` re-reads the environment."""
    with _DEFAULT_LOCK:
        _set_default(None)
