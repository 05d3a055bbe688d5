"""Precompile kernel variants into the module cache, with or without a GPU.

``warmup()`` compiles every kernel variant the API can select for a target arch (or the keys
you pass) through :func:`hstu_cute.cache.default_cache`, so that the first call of
``hstu_attn_varlen_func`` in a later process loads the module from disk instead of compiling it.
The target arch is part of each compile key, so no GPU is needed: a CPU-only build machine can
fill a cache directory that the GPU machines then read (set ``HSTU_CUTE_CACHE_DIR`` on both).

The arch (``arch=`` and every key's ``.arch``) is checked against
:data:`hstu_cute.arch.SUPPORTED_ARCHS` before anything is compiled or locked: an unsupported one
is a ``ValueError`` naming the valid archs (and, for ``sm_90``, the ``sm_90a`` meant).

``cute.compile`` is not thread-safe, so the parallel path uses processes (``spawn`` context):
each worker compiles its key through its own default cache, which writes the entry to disk, and
returns how long it took and whether it was a disk hit.

Result dicts are plain text: error messages and tracebacks have the DSL's ANSI colour codes
removed. :func:`describe_variant` is the one-line description of a key they carry (also used by
``python -m hstu_cute``).

This module imports only the standard library at import time (``import hstu_cute`` stays light).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import traceback
from typing import Any, Callable, Iterable, Sequence

__all__ = ["warmup", "WarmupError", "default_arch", "describe_variant"]

#: ``progress(done, total, key, result)``: called once per key as it finishes.
ProgressFn = Callable[[int, int, Any, dict], None]


class WarmupError(RuntimeError):
    """Some variants failed to compile. ``results`` holds every key's result dict."""

    def __init__(self, message: str, results: list[dict]):
        super().__init__(message)
        self.results = results


def default_arch() -> str:
    """The cubin arch of the current CUDA device when there is one, else ``"sm_80"``."""
    try:
        import torch

        if torch.cuda.is_available():
            from .arch import device_arch

            return device_arch(torch.device("cuda", torch.cuda.current_device()))
    except Exception:  # no driver, broken install: fall back to the portable target
        pass
    return "sm_80"


_FP8_LABELS = ("scaled-P", "two-direction")


def describe_variant(key: Any, rab_heads: int | None = None) -> str:
    """``key.describe()`` (``repr(key)`` for other keys) with the rab details in words.

    The compile keys label rab by how the kernel loads it (``rab/8``, ``rab/1``,
    ``rab+drab(sum)``, ``sum_heads``); here that is ``rab``, ``rab (rows not 16-byte aligned)``,
    ``rab+drab (1 rab head for all heads)``. ``rab_heads`` (a call's rab head count, which the
    kernel takes at run time) adds ``(1 head)`` / ``(H heads)``. Keys without rab are unchanged.
    """
    describe = getattr(key, "describe", None)
    text = describe() if callable(describe) else repr(key)
    if not getattr(key, "has_rab", False):
        return text
    words = text.split(" ")
    # FP8 keys end with their output type and P / descale labels, after the mask.
    mask_at = max((i for i, w in enumerate(words) if not (w.startswith("->") or w in _FP8_LABELS)), default=0)
    if mask_at == 0:
        return text
    base, tail = " ".join(words[:mask_at]), words[mask_at]
    suffix = "".join(" " + w for w in words[mask_at + 1:])
    kept = [t for t in tail.split(",") if not (t.startswith("rab") or t in ("drab", "sum_heads"))]
    notes = []
    if rab_heads:
        notes.append(f"{rab_heads} head{'s' if rab_heads != 1 else ''}")
    elif getattr(key, "rab_sum_heads", False):
        notes.append("1 rab head for all heads")
    if getattr(key, "rab_vec", 8) == 1:
        notes.append("rows not 16-byte aligned")
    label = ("rab+drab" if getattr(key, "has_drab", False) else "rab") + (f" ({', '.join(notes)})" if notes else "")
    return f"{base} {','.join(kept)}, {label}{suffix}"


_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")


def strip_ansi(text: str) -> str:
    """``text`` without ANSI escape sequences (the DSL colours parts of its error messages)."""
    return _ANSI.sub("", text)


def _compile_one(key: Any) -> dict:
    """Get ``key`` from the default cache (memory, disk, or compile); never raises."""
    from .cache import default_cache

    t0 = time.perf_counter()
    result: dict = {
        "key": key,
        "variant": describe_variant(key),
        "arch": getattr(key, "arch", None),
        "pid": os.getpid(),
        "ok": False,
        "source": None,
        "disk_hit": False,
        "seconds": 0.0,
        "export_s": 0.0,
        "wall_s": 0.0,
        "path": None,
        "error": None,
    }
    try:
        cache = default_cache()
        in_memory = key in cache
        from .compile import build

        module = cache.get(key, lambda: build(key))
        if module is None:  # the cache refuses None already; belt and braces
            raise TypeError(f"the cache returned no module for {key!r}")
        timing = cache.timing(key)
        if in_memory:
            result["source"] = "memory"
        elif timing is not None:
            result["source"] = timing.source
            result["seconds"] = timing.seconds
            result["export_s"] = timing.export_s
            result["path"] = timing.path
        else:
            result["source"] = "compile"
        result["disk_hit"] = result["source"] == "disk"
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported per key, the batch carries on
        if isinstance(exc, KeyboardInterrupt):
            raise
        result["error"] = strip_ansi(f"{type(exc).__name__}: {exc}")
        result["traceback"] = strip_ansi(traceback.format_exc())
    result["wall_s"] = time.perf_counter() - t0
    if result["source"] in (None, "compile") and not result["seconds"]:
        result["seconds"] = result["wall_s"]
    return result


def _worker_init(arch: str) -> None:
    # Before cutlass is imported in this process: the DSL reads its target arch from the env.
    os.environ["CUTE_DSL_ARCH"] = arch


def _worker_compile(key: Any) -> dict:
    arch = getattr(key, "arch", None)
    if isinstance(arch, str) and arch:
        os.environ["CUTE_DSL_ARCH"] = arch
    result = _compile_one(key)
    result.pop("key", None)  # the parent has the key; keep the pickle small
    return result


def _cost(key: Any) -> tuple:
    """Rough compile cost, to start the slowest variants first (better packing)."""
    return (-int(getattr(key, "head_dim", 0)), -int(bool(getattr(key, "has_rab", False))),
            -int(bool(getattr(key, "has_context", False))))


def _resolve_keys(arch: str | None, keys: Iterable[Any] | None) -> tuple[str, list]:
    """(arch, unique keys); a ``ValueError`` for an unsupported arch, before anything else."""
    from .arch import check_arch

    if arch is not None:
        check_arch(arch, name="arch")
    if keys is None:
        from .variants import shipped_keys

        if arch is None:
            arch = check_arch(default_arch(), name="arch (the current GPU's; pass arch=... to choose)")
        return arch, shipped_keys(arch)
    keys = list(keys)
    for k in keys:
        key_arch = getattr(k, "arch", None)
        if arch is None and key_arch is not None:
            check_arch(key_arch, name=f"{type(k).__name__}.arch")
    if arch is not None:
        # An explicit arch retargets the given variants.
        keys = [k if getattr(k, "arch", arch) == arch else dataclasses.replace(k, arch=arch) for k in keys]
    else:
        archs = sorted({getattr(k, "arch", "") for k in keys} - {""})
        arch = archs[0] if len(archs) == 1 else (default_arch() if not archs else ",".join(archs))
    # Drop duplicates, keep the order.
    seen, unique = set(), []
    for k in keys:
        if k not in seen:
            seen.add(k)
            unique.append(k)
    return arch, unique


def warmup(
    arch: str | None = None,
    keys: Sequence[Any] | None = None,
    workers: int | None = None,
    progress: ProgressFn | None = None,
    *,
    raise_errors: bool = True,
) -> list[dict]:
    """Compile kernel variants into the module cache (memory and disk). Needs no GPU.

    Args:
        arch: target cubin arch, one of :data:`hstu_cute.arch.SUPPORTED_ARCHS` (``"sm_80"``,
            ``"sm_86"``, ``"sm_87"``, ``"sm_89"``, ``"sm_90a"``). Default: the current GPU's arch
            when there is one, else ``"sm_80"``. With ``keys``, an explicit ``arch`` replaces the
            arch of every key.
        keys: compile keys (default: ``hstu_cute.variants.shipped_keys(arch)``, every forward and
            backward variant the API can select, the Hopper kernels included on sm_90a).
        workers: processes compiling in parallel (default ``os.cpu_count()``). ``1`` compiles in
            this process, without a pool. The parallel path needs the disk cache (workers hand
            their modules over through it); with ``HSTU_CUTE_CACHE=0`` it compiles in-process.
        progress: optional ``callback(done, total, key, result)`` called as each key finishes.
        raise_errors: after every key was tried, raise :class:`WarmupError` if any failed
            (``False``: just report them in the results).

    Returns:
        One dict per key, in the order of ``keys``: ``key``, ``variant`` (a short description,
        :func:`describe_variant`),
        ``arch``, ``ok``, ``source`` (``"compile"``, ``"disk"`` or ``"memory"``), ``disk_hit``,
        ``seconds`` (the compile, or the verified disk load), ``export_s`` (writing the entry),
        ``wall_s`` (everything for this key in its process, first imports included), ``path``
        (the ``.o`` written, when compiled), ``pid`` and ``error`` (None, or ``"Type: message"``;
        a failed in-process compile also has ``traceback``).

    Raises:
        ValueError: ``arch``, or the ``.arch`` of a key, is not a supported arch (checked before
            anything is compiled or locked), or ``workers`` is not an int >= 1.
        WarmupError: with ``raise_errors``, when some variants failed.
    """
    arch, keys = _resolve_keys(arch, keys)
    total = len(keys)
    if workers is None:
        workers = os.cpu_count() or 1
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: expected an int >= 1 (or None for os.cpu_count()), got {workers!r}")
    results: list[dict | None] = [None] * total
    if total == 0:
        return []

    in_process = workers == 1
    if not in_process:
        from .cache import default_cache

        cache = default_cache()
        if not cache.writable:
            import warnings

            warnings.warn(
                "hstu_cute.warmup: the disk cache is off or not writable "
                f"({cache!r}); compiling in this process instead of {workers} workers",
                RuntimeWarning,
                stacklevel=2,
            )
            in_process = True

    done = 0

    def finish(i: int, result: dict) -> None:
        nonlocal done
        result["key"] = keys[i]
        results[i] = result
        done += 1
        if progress is not None:
            progress(done, total, keys[i], result)

    if in_process:
        for i, key in enumerate(keys):
            finish(i, _compile_one(key))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        order = sorted(range(total), key=lambda i: _cost(keys[i]))
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(workers, total), mp_context=ctx,
                                 initializer=_worker_init, initargs=(arch.split(",")[0],)) as pool:
            futures = {pool.submit(_worker_compile, keys[i]): i for i in order}
            for fut in as_completed(futures):
                i = futures[fut]
                try:
                    result = fut.result()
                except Exception as exc:  # a worker died (e.g. killed for memory)
                    result = {
                        "variant": describe_variant(keys[i]), "arch": getattr(keys[i], "arch", None), "pid": None,
                        "ok": False, "source": None, "disk_hit": False, "seconds": 0.0, "export_s": 0.0,
                        "wall_s": 0.0, "path": None, "error": strip_ansi(f"{type(exc).__name__}: {exc}"),
                    }
                finish(i, result)

    out = [r for r in results if r is not None]
    failed = [r for r in out if not r["ok"]]
    if failed and raise_errors:
        first = failed[0]
        raise WarmupError(
            f"hstu_cute.warmup: {len(failed)} of {total} variants failed to compile for {arch}; "
            f"first: {first['variant']}: {first['error']}",
            out,
        )
    return out
