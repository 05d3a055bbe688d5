"""``python -m hstu_cute``: info, warmup, demo and bench.

* ``info``    versions, GPU and selected kernel path, module cache directory and its entries.
* ``warmup``  precompile kernel variants into the module cache (no GPU needed).
* ``demo``    a random jagged batch through the kernel, checked against the oracle and timed. Without
              a GPU it says so, precompiles the demo's variant, runs the oracle on CPU and lists
              what it skipped.
* ``bench``   the benchmark workloads with the GEMM peak and torch SDPA (flash, cuDNN) timed in the
              same run as reference lines, FLOPs by the convention of docs/operator.md (needs a GPU).

``--arch`` (warmup, demo) is checked with :func:`hstu_cute.arch.check_arch` before anything is
compiled or locked: an unsupported arch is one line on stderr and exit status 2, like the
argparse errors. Every ``--help`` shows the defaults. Output that is not a terminal (a pipe, a
file, CI logs) or runs under ``NO_COLOR`` has no colour codes, and an unexpected error's
traceback is printed without the DSL's ANSI codes there too.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import platform
import sys
import time
from typing import Any

from .arch import SUPPORTED_ARCHS, check_arch, forced_path
from .fp8_format import BUILT_QUANT_MODES
from .variants import DTYPES, FP8_DTYPE, HEAD_DIMS, SHIPPED_HEAD_DIMS
from .warmup import describe_variant, strip_ansi

#: Mask families of the ``--mask`` options ('target': causal with contexts and targets).
MASKS = ("none", "local", "causal", "target")


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------
def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _no_color() -> bool:
    return os.environ.get("NO_COLOR", "") != ""  # https://no-color.org


def _console():
    """stdout console: colours only on a terminal without ``NO_COLOR``; plain text otherwise,
    also when FORCE_COLOR / TTY_COMPATIBLE are set (rich would honour those in a pipe)."""
    from rich.console import Console

    tty = _isatty(sys.stdout)
    color = tty and not _no_color()
    kw: dict = dict(force_terminal=None if tty else False, color_system="auto" if color else None,
                    no_color=not color)
    if not tty and "COLUMNS" not in os.environ:
        kw["width"] = 120  # pipes and CI logs: do not squeeze tables into 80 columns
    return Console(**kw)


def _esc(text: object) -> str:
    """``text`` for a rich markup string (error messages may hold ``[...]``)."""
    from rich.markup import escape

    return escape(str(text))


def _dist_version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _gpu_status() -> tuple[Any, str]:
    """(torch.device or None, a sentence saying which GPU or why there is none)."""
    import torch

    if torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
        return dev, torch.cuda.get_device_name(dev)
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU-only build"
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
        if visible is not None:
            why += f" (CUDA_VISIBLE_DEVICES={visible!r})"
    return None, why


def _gpu_kernel_path(console, dev) -> tuple[str, str] | None:
    """(kernel path, cubin arch) of the GPU ``dev`` for the demo and bench, or None after printing
    why no kernel path serves it."""
    from .arch import device_arch, kernel_path

    try:
        path = kernel_path(dev)
    except (NotImplementedError, ValueError) as exc:
        console.print(f"[red]{type(exc).__name__}[/]: {_esc(exc)}")
        return None
    return path, device_arch(dev)


def _mask_window(mask: str, window: tuple[int, int]) -> tuple[int, int]:
    return {"none": (-1, -1), "causal": (-1, 0), "target": (-1, 0)}.get(mask, window)


def _parse_window(text: str) -> tuple[int, int]:
    # argparse prefixes "argument --window: ": the message does not name the flag again.
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (two ints, e.g. 128,0), got {text!r}") from None
    return left, right


def _key_variant(key_repr: str | None) -> str:
    """A compact description of a cached entry from its sidecar's key repr (parsed with ast,
    never evaluated; only the classes of :data:`hstu_cute.variants.KEY_CLASSES` are built): the
    :func:`hstu_cute.warmup.describe_variant` text, or the raw repr when it is not a known key."""
    from .variants import KEY_CLASSES

    if not key_repr:
        return "?"
    try:
        node = ast.parse(key_repr, mode="eval").body
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args:
            cls = KEY_CLASSES.get(node.func.id)
            if cls is not None:
                fields = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
                return describe_variant(cls(**fields))
    except Exception:
        pass
    return key_repr


def _fmt_s(seconds: float | None) -> str:
    return "-" if seconds is None else (f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s")


def _fmt_tf(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


# ---------------------------------------------------------------------------------------------
# info
# ---------------------------------------------------------------------------------------------
def cmd_info(args, console) -> int:
    from rich.table import Table

    from . import __version__
    from .cache import default_cache

    t = Table(title=f"hstu-cute {__version__}", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    import torch

    t.add_row("python", f"{platform.python_version()} ({sys.executable})")
    t.add_row("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none: CPU build'})")
    for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi", "cuda-python", "rich"):
        t.add_row(dist, _dist_version(dist))

    dev, what = _gpu_status()
    if dev is None:
        t.add_row("GPU", f"[yellow]no GPU[/]: {what}")
    else:
        from .arch import device_arch, kernel_path

        major, minor = torch.cuda.get_device_capability(dev)
        props = torch.cuda.get_device_properties(dev)
        t.add_row("GPU", f"{what} ({props.total_memory / 2**30:.0f} GiB), {torch.cuda.device_count()} visible")
        t.add_row("compute capability", f"{major}.{minor}")
        try:
            path = kernel_path(dev)
            t.add_row("kernel path", {"hopper": "hopper (TMA + WGMMA kernels; mma.sync dQ for drab below D256)",
                                      "ampere": "ampere (mma.sync kernels)"}.get(path, path))
        except (NotImplementedError, ValueError) as exc:
            t.add_row("kernel path", f"[red]{type(exc).__name__}[/]: {_esc(exc)}")
        t.add_row("cubin arch", device_arch(dev))
    for env in ("HSTU_CUTE_ARCH", "HSTU_CUTE_CHECK", "CUTE_DSL_ARCH"):
        t.add_row(env, os.environ.get(env, "(unset)"))
    try:
        forced_path()
    except ValueError as exc:
        t.add_row("HSTU_CUTE_ARCH", f"[red]ValueError[/]: {_esc(exc)}")

    cache = default_cache()
    every = cache.entries(all_fingerprints=True)
    entries = [e for e in every if e["current"]]
    stale = [e for e in every if not e["current"]]
    t.add_row("cache dir", str(cache.cache_dir()))
    t.add_row("disk caching", ("enabled" if cache.disk_enabled else "[yellow]disabled[/] (HSTU_CUTE_CACHE=0)")
              + f", HSTU_CUTE_CACHE={os.environ.get('HSTU_CUTE_CACHE', '(unset)')}")
    families: dict[str, list[str]] = {}
    for name, fp in cache.family_fingerprints().items():
        families.setdefault(fp, []).append(name)
    t.add_row("cache fingerprints", f"{len(families)} for the {sum(map(len, families.values()))} kernel families "
              "(each: the files its kernels are built from + DSL/tvm-ffi/Python versions)\n"
              + "\n".join(f"{fp}  {', '.join(names)}" for fp, names in families.items()))
    t.add_row("cached entries", f"{len(entries)} ({sum(e['size'] for e in entries) / 2**20:.1f} MiB) "
                                f"in {cache.cache_dir()}/<fingerprint>/<kernel>")
    if stale:
        t.add_row("other fingerprints", f"{len(stale)} entries ({sum(e['size'] for e in stale) / 2**20:.1f} MiB) "
                                        "of other sources or toolchains (never loaded; "
                                        "hstu_cute.cache.default_cache().prune() deletes them)")
    console.print(t)

    if entries:
        et = Table(title=f"Cached modules ({len(entries)})", title_justify="left")
        for col, kw in (("variant", {}), ("arch", {}), ("size", {"justify": "right"}),
                        ("compile", {"justify": "right"}), ("valid", {})):
            et.add_column(col, **kw)
        for e in entries:
            et.add_row(_esc(_key_variant(e["key"]) if e["key"] else f"{e['kernel_name']} {e['digest']}"),
                       _esc(e["arch"]),
                       f"{e['size'] / 1024:.0f} KiB",
                       _fmt_s(e["compile_s"]), "yes" if e["valid"] else "[red]no[/]")
        console.print(et)
    else:
        console.print("No cached modules for the current fingerprints yet: [bold]python -m hstu_cute warmup[/] "
                      "precompiles them (no GPU needed).")
    return 0


# ---------------------------------------------------------------------------------------------
# warmup
# ---------------------------------------------------------------------------------------------
#: Kernel families of ``warmup --family``: the 16-bit kernels on contiguous keys, the paged-cache
#: forwards, the FP8 kernels (forward, backward, V^T) and the FP8 quantizers.
FAMILIES = ("dense", "paged", "fp8", "quantizers")
#: ``warmup --dtype``: the 16-bit dtypes select the 16-bit kernels, float8_e4m3fn the FP8 ones.
WARMUP_DTYPES = DTYPES + (FP8_DTYPE,)


#: Kernels without a mask or rab (the FP8 quantizers, V^T): every mask and rab filter keeps them.
_MASKLESS = ("hopper_fwd_quant_slots", "hopper_fwd_vt")


def key_family(key) -> str:
    """The :data:`FAMILIES` entry of a compile key."""
    name = key.kernel_name
    if name.endswith("_paged"):
        return "paged"
    if name == "hopper_fwd_quant_slots":
        return "quantizers"
    if "_fp8" in name or name == "hopper_fwd_vt":
        return "fp8"
    return "dense"


def _dtype_matches(key, dtypes: tuple) -> bool:
    """``key`` is one of the dtypes' kernels: 16-bit kernels by their dtype; FP8 kernels and
    quantizers with float8_e4m3fn, and by their 16-bit side (output or input) when 16-bit dtypes
    are named too."""
    if key_family(key) in ("dense", "paged"):
        return key.dtype in dtypes
    if FP8_DTYPE not in dtypes:
        return False
    sixteen = [d for d in dtypes if d != FP8_DTYPE]
    side = getattr(key, "out_dtype", key.dtype) if key.dtype == FP8_DTYPE else key.dtype
    return not sixteen or side == FP8_DTYPE or side in sixteen


def select_keys(arch: str, dtypes=None, head_dims=None, masks_=None, rab: str = "all", limit=None,
                kernels: str = "all", families=None, unshipped: bool = False) -> list:
    """The shipped forward and backward variants for ``arch`` (:func:`hstu_cute.variants.shipped_keys`:
    the Hopper kernels too on sm_90a), with ``unshipped`` also those compiled on first use
    (:func:`hstu_cute.variants.jit_only_keys`), filtered like the ``warmup`` options. ``arch`` must
    be a supported arch (:func:`hstu_cute.arch.check_arch`, ``ValueError`` otherwise)."""
    from .masks import MaskKind
    from .variants import jit_only_keys, shipped_keys

    check_arch(arch, name="arch")
    keys = shipped_keys(arch, DTYPES, tuple(head_dims or HEAD_DIMS))
    if unshipped:
        keys += jit_only_keys(arch, DTYPES, tuple(head_dims or HEAD_DIMS))
    if dtypes:
        keys = [k for k in keys if _dtype_matches(k, tuple(dtypes))]
    if families:
        keys = [k for k in keys if key_family(k) in families]
    if masks_:
        wanted = {
            {"none": (MaskKind.NONE, False), "local": (MaskKind.LOCAL, False), "causal": (MaskKind.CAUSAL, False),
             "target": (MaskKind.CAUSAL, True)}[m]
            for m in masks_
        }
        keys = [k for k in keys if k.kernel_name in _MASKLESS or (MaskKind(k.mask_kind), k.has_context) in wanted]
    if rab == "none":
        keys = [k for k in keys if k.kernel_name in _MASKLESS or not k.has_rab]
    elif rab == "only":
        keys = [k for k in keys if k.kernel_name in _MASKLESS or k.has_rab]
    if kernels != "all":
        # kernel_name: "ampere_fwd", "hopper_fwd", "ampere_bwd_dq", "ampere_bwd_dkdv"
        keys = [k for k in keys if k.kernel_name.split("_")[1] == kernels]
    if limit is not None:
        keys = keys[:limit]
    return keys


def _run_warmup(console, arch: str, keys: list, workers: int | None, title: str) -> list[dict]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from .warmup import warmup

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task(title, total=len(keys))

        def progress(done, total, key, result):
            mark = "[green]ok[/]" if result["ok"] else "[red]FAILED[/]"
            bar.update(task, completed=done, description=f"{title}: {mark} {_esc(result['variant'])}")

        results = warmup(arch=arch, keys=keys, workers=workers, progress=progress, raise_errors=False)
        bar.update(task, description=title)
    return results


def _source_text(r: dict) -> str:
    if not r["ok"]:
        return "[red]FAILED[/]"
    return {"compile": "compiled", "disk": "disk hit", "memory": "in memory"}.get(r["source"], str(r["source"]))


def summarize_warmup(results: list[dict]) -> dict:
    counts = {"compiled": 0, "disk hits": 0, "in memory": 0, "failed": 0}
    for r in results:
        if not r["ok"]:
            counts["failed"] += 1
        else:
            counts[{"compile": "compiled", "disk": "disk hits", "memory": "in memory"}.get(r["source"], "compiled")] += 1
    return counts


def cmd_warmup(args, console) -> int:
    from rich.table import Table

    from .cache import default_cache
    from .warmup import default_arch

    arch = args.arch  # checked in main()
    if arch is None:
        try:
            arch = check_arch(default_arch(), name="this GPU's arch (no --arch given)")
        except ValueError as exc:
            return _error(args, str(exc))
    keys = select_keys(arch, args.dtype, args.head_dim, args.mask, "none" if args.no_rab else args.rab, args.limit,
                       args.kernels, args.family, args.unshipped)
    if not keys:
        jit_dims = sorted(set(args.head_dim or ()) - set(SHIPPED_HEAD_DIMS))
        plural = len(jit_dims) > 1
        hint = (f" Head dim{'s' if plural else ''} {', '.join(map(str, jit_dims))} compile{'' if plural else 's'} on "
                f"first use; --unshipped compiles {'them' if plural else 'it'} ahead."
                if jit_dims and not args.unshipped else "")
        console.print(f"[yellow]No variant matches these options[/]; nothing to compile.{hint}")
        return 0
    if args.dry_run:
        from .warmup import describe_variant

        for key in keys:
            console.print(_esc(describe_variant(key)), highlight=False)
        console.print(f"{len(keys)} variants for {arch} would compile (--dry-run: nothing compiled).")
        return 0
    workers = args.workers if args.workers is not None else (os.cpu_count() or 1)
    workers = min(workers, len(keys))
    cache = default_cache()
    console.print(f"Precompiling [bold]{len(keys)}[/] kernel variants for [bold]{arch}[/] with {workers} "
                  f"worker process{'es' if workers != 1 else ''} into {cache.cache_dir()} "
                  f"(disk caching {'on' if cache.disk_enabled else 'OFF: kept in memory of this process only'}; "
                  "no GPU needed)")
    t0 = time.perf_counter()
    results = _run_warmup(console, arch, keys, workers, f"warmup {arch}")
    wall = time.perf_counter() - t0

    table = Table(title=f"Variants for {arch}", title_justify="left")
    table.add_column("variant")
    table.add_column("result")
    table.add_column("time", justify="right")
    for r in results:
        table.add_row(_esc(r["variant"]), _source_text(r), _fmt_s(r["seconds"]))
    console.print(table)
    counts = summarize_warmup(results)
    compile_s = sum(r["seconds"] for r in results if r["ok"] and r["source"] == "compile")
    console.print(
        f"{len(results)} variants for {arch}: {counts['compiled']} compiled, {counts['disk hits']} disk hits, "
        f"{counts['in memory']} already in memory, {counts['failed']} failed; {wall:.1f} s wall, "
        f"{compile_s:.1f} s of compiles, {workers} worker{'s' if workers != 1 else ''}."
    )
    for r in results:
        if not r["ok"]:
            console.print(f"[red]FAILED[/] {_esc(r['variant'])}: {_esc(r['error'])}")
            if args.verbose and r.get("traceback"):
                console.print(r["traceback"], markup=False, highlight=False)
    return 1 if counts["failed"] else 0


# ---------------------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------------------
def _demo_inputs(args, device):
    import torch

    from .testing import random_jagged_batch

    window = _mask_window(args.mask, args.window)
    extra = {}
    if args.mask == "target":
        extra = dict(num_contexts=max(1, args.max_len // 64), num_targets=max(1, args.max_len // 16),
                     target_group_size=args.group)
    dtype = torch.bfloat16 if args.dtype == FP8_DEMO_DTYPE else getattr(torch, args.dtype)
    return random_jagged_batch(
        args.batch, args.heads, args.head_dim, args.max_len, lengths="random", min_seqlen=max(1, args.max_len // 2),
        dtype=dtype, device=device, window_size=window,
        rab_heads=args.rab_heads or None, seed=args.seed, **extra,
    )


# --dtype for pre-quantized e4m3 q, k, v (the demo quantizes its bf16 batch per tensor).
FP8_DEMO_DTYPE = "float8_e4m3fn"


def _demo_fp8(args) -> bool:
    return args.dtype == FP8_DEMO_DTYPE or args.quant_mode >= 0


def _demo_call(args, kw):
    """(call, emulation) of the demo: ``call()`` runs hstu_attn_varlen_func on the batch (FP8: with
    --quant-mode, or on its per-tensor e4m3 quantization with descales); ``emulation()`` is the
    reference the output is checked against (FP8: the emulation oracle; else the same-dtype oracle)."""
    from .api import hstu_attn_varlen_func
    from .reference import hstu_attn_fp8_emulation, hstu_attn_reference, cast_p_e4m3

    if not _demo_fp8(args):
        return (lambda: hstu_attn_varlen_func(**kw)), (lambda: hstu_attn_reference(**kw, compute_dtype=None))
    rest = {k: v for k, v in kw.items() if k not in ("q", "k", "v")}
    if args.quant_mode >= 0:
        qkv = (kw["q"], kw["k"], kw["v"])
        return ((lambda: hstu_attn_varlen_func(*qkv, **rest, quant_mode=args.quant_mode)),
                (lambda: hstu_attn_fp8_emulation(*qkv, **rest, quant_mode=args.quant_mode)))
    import torch

    from .quantize import QuantMode, quantize_batch

    quantized = quantize_batch(kw, QuantMode.PER_TENSOR)
    data, scales = [x.data for x in quantized], [x.scale for x in quantized]
    return ((lambda: hstu_attn_varlen_func(*data, **rest, descale_q=scales[0], descale_k=scales[1],
                                           descale_v=scales[2])),
            (lambda: hstu_attn_reference(*(x.float() * s for x, s in zip(data, scales)), **rest,
                                         compute_dtype=torch.float32,
                                         p_round=lambda p, b: cast_p_e4m3(p))))


def _lengths(kw) -> tuple[list[int], list[int]]:
    oq, ok = kw["seq_offsets_q"].cpu().tolist(), kw["seq_offsets_k"].cpu().tolist()
    return [b - a for a, b in zip(oq, oq[1:])], [b - a for a, b in zip(ok, ok[1:])]


def _demo_workload(args, lens_k):
    from .bench import Workload

    return Workload(
        "demo", args.batch, args.max_len, heads=args.heads, head_dim=args.head_dim,
        window=_mask_window(args.mask, args.window), dtype=args.dtype,
        contexts=max(1, args.max_len // 64) if args.mask == "target" else None,
        targets=max(1, args.max_len // 16) if args.mask == "target" else None,
        rab_heads=args.rab_heads or None,
    )


def _demo_key(args, arch: str):
    from .arch import has_hopper_kernels
    from .masks import normalize_window
    from .variants import make_fwd_key, make_hopper_fp8_fwd_key, make_hopper_fwd_key

    kind, _, _ = normalize_window(_mask_window(args.mask, args.window), args.max_len)
    if _demo_fp8(args):
        from .fp8_recipe import recipe

        fp8 = recipe(args.quant_mode)
        out_dtype = "bfloat16" if args.dtype == FP8_DEMO_DTYPE else args.dtype
        return make_hopper_fp8_fwd_key(arch, out_dtype, args.head_dim, kind, args.mask == "target",
                                       bool(args.rab_heads), scaled_p=fp8.scaled_p,
                                       two_direction=fp8.two_direction)
    if has_hopper_kernels(arch):  # what the API runs by default there
        return make_hopper_fwd_key(arch, args.dtype, args.head_dim, kind, args.mask == "target", bool(args.rab_heads))
    # Same choice as the API: 16-byte rab loads when every rab row is 16-byte aligned.
    rab_vec = 8 if args.max_len % 8 == 0 else 1
    return make_fwd_key(arch, args.dtype, args.head_dim, kind, args.mask == "target", bool(args.rab_heads), rab_vec)


def _demo_describe(args, lens_k) -> str:
    mask = args.mask if args.mask != "local" else f"local{tuple(args.window)}"
    rab = f", {_rab_text(args.rab_heads)}" if args.rab_heads else ""
    fp8 = f", quant_mode {args.quant_mode}" if args.quant_mode >= 0 else (
        " (pre-quantized per tensor, descales)" if args.dtype == FP8_DEMO_DTYPE else "")
    return (f"B={args.batch}, lengths {min(lens_k)}..{max(lens_k)} (max_seqlen {args.max_len}), H={args.heads}, "
            f"D={args.head_dim}, {args.dtype}{fp8}, mask {mask}{rab}")


def _rab_text(rab_heads: int) -> str:
    """The demo's rab in words: rab is one bias per (query, key) pair, shared by all heads
    (``--rab-heads 1``) or one per head (``--rab-heads H``)."""
    return f"rab ({rab_heads} head{'s' if rab_heads != 1 else ''})"


def cmd_demo(args, console) -> int:
    if args.mask != "local" and args.window != (128, 0):
        console.print("[yellow]note[/]: --window only applies to --mask local; ignored")
    if args.rab_heads not in (0, 1, args.heads):
        console.print(f"[red]--rab-heads[/]: expected 0 (no rab), 1 or {args.heads} (--heads), got {args.rab_heads}")
        return 2
    if _demo_fp8(args):
        from .variants import FP8_HEAD_DIMS

        if args.dtype == FP8_DEMO_DTYPE and args.quant_mode >= 0:
            console.print("[red]--quant-mode[/]: expected -1 with --dtype float8_e4m3fn (already quantized)")
            return 2
        if args.head_dim not in FP8_HEAD_DIMS:
            console.print(f"[red]--head-dim[/]: the FP8 forward supports {FP8_HEAD_DIMS}, got {args.head_dim}")
            return 2
    dev, what = _gpu_status()
    if args.cpu:
        dev, what = None, "--cpu given"
    if dev is None:
        return _demo_cpu(args, console, what)
    return _demo_gpu(args, console, dev, what)


def _demo_cpu(args, console, why: str) -> int:
    import torch
    from rich.table import Table

    from .arch import has_hopper_kernels
    from .bench import flops
    from .reference import hstu_attn_reference

    arch = args.arch or ("sm_90a" if _demo_fp8(args) else "sm_80")
    if _demo_fp8(args) and not has_hopper_kernels(arch):
        console.print(f"[red]--arch[/]: the FP8 kernels are Hopper-only (sm_90a), got {arch}")
        return 2
    console.print(f"[bold yellow]No CUDA GPU found[/] ({why}): the kernel cannot run here. "
                  "Doing the parts that need no GPU instead.")

    # 1. Compile the variant the demo would launch (exercises the whole compiler, no GPU needed).
    key = _demo_key(args, arch)
    console.print(f"\n[bold]1. Precompile[/] the demo's kernel variant for {arch}: "
                  f"{_esc(describe_variant(key, args.rab_heads or None))}")
    results = _run_warmup(console, arch, [key], 1, f"compile {arch}")
    r = results[0]
    if not r["ok"]:
        console.print(f"[red]compile FAILED[/]: {_esc(r['error'])}")
        return 1
    console.print(f"   {_source_text(r)} in {_fmt_s(r['seconds'])}" + (f" -> {r['path']}" if r.get("path") else ""))

    # 2. The argument checks of docs/operator.md, "Errors and checks" (all but the device check
    # pass on CPU tensors).
    kw = _demo_inputs(args, "cpu")
    lens_q, lens_k = _lengths(kw)
    console.print(f"\n[bold]2. Argument checks[/] on a random jagged batch: {_demo_describe(args, lens_k)}")
    call, emulation = _demo_call(args, kw)
    try:
        call()
    except ValueError as exc:
        if not str(exc).startswith("q.device"):
            console.print(f"[red]unexpected validation error[/]: {_esc(exc)}")
            return 1
        console.print(f"   every check passed up to the last one, which rejects CPU tensors as it should:\n"
                      f"   {_esc(exc)}")

    # 3. The oracle on CPU.
    console.print("\n[bold]3. Oracle[/] (hstu_cute.reference, PyTorch on CPU)")
    t0 = time.perf_counter()
    ref32 = hstu_attn_reference(**kw)
    t1 = time.perf_counter()
    ref_same = emulation()
    t2 = time.perf_counter()
    f, convention = flops(_demo_workload(args, lens_k), lens_q, lens_k)
    tokens = int(kw["seq_offsets_q"][-1])
    table = Table(show_header=True, title_justify="left")
    for col in ("oracle", "out", "time", "GFLOP/s", "max |out|", "mean |out|", "max |ref_same - ref_fp32|"):
        table.add_column(col, justify="right" if col not in ("oracle", "out") else "left")
    second = "fp8 emulation" if _demo_fp8(args) else args.dtype
    for name, out, sec in (("fp32", ref32, t1 - t0), (second, ref_same, t2 - t1)):
        o = out.float()[:tokens]
        table.add_row(name, f"{tuple(out.shape)} {str(out.dtype).replace('torch.', '')}", _fmt_s(sec),
                      f"{f / sec / 1e9:.1f}", f"{o.abs().max().item():.4g}", f"{o.abs().mean().item():.4g}",
                      f"{(ref_same.float() - ref32.float()).abs().max().item():.3g}" if name != "fp32" else "-")
    console.print(table)
    console.print(f"   {tokens} tokens, {f / 1e9:.2f} GFLOP by the '{convention}' convention, "
                  f"all finite: {bool(torch.isfinite(ref32).all() and torch.isfinite(ref_same.float()).all())}")

    console.print("\n[bold yellow]Skipped (needs a CUDA GPU)[/]:")
    for item in (
        "running the compiled kernel (hstu_attn_varlen_func) on this batch",
        "checking its output against the oracle (ratio_check, factor 2)",
        "timing it with CUDA events (median) and reporting TFLOP/s",
    ):
        console.print(f"   - {item}")
    console.print("Run [bold]python -m hstu_cute demo[/] on a machine with an sm80+ NVIDIA GPU (and a CUDA build "
                  "of torch) for those.")
    return 0


def _demo_gpu(args, console, dev, name: str) -> int:
    import torch
    from rich.table import Table

    from .bench import flops, time_cuda
    from .cache import default_cache
    from .reference import hstu_attn_reference, ratio_check

    served = _gpu_kernel_path(console, dev)
    if served is None:
        return 1
    path, arch = served
    console.print(f"GPU: [bold]{name}[/] ({arch}, kernel path {path})")
    with torch.cuda.device(dev):
        kw = _demo_inputs(args, dev)
        lens_q, lens_k = _lengths(kw)
        console.print(f"Batch: {_demo_describe(args, lens_k)}")
        cache = default_cache()
        before = (cache.stats.compiles, cache.stats.disk_hits)
        call, emulation = _demo_call(args, kw)
        with torch.no_grad():
            t0 = time.perf_counter()
            out = call()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            after = (cache.stats.compiles, cache.stats.disk_hits)
            how = "compiled" if after[0] > before[0] else ("loaded from disk" if after[1] > before[1] else "in memory")
            ref32 = hstu_attn_reference(**kw)
            ref_same = emulation()
            ok, err, ref_err = ratio_check(out, ref32, ref_same, 2)
            ms, iqr = time_cuda([call], warmup=args.warmup_iters, reps=args.reps)
    f, convention = flops(_demo_workload(args, lens_k), lens_q, lens_k)
    table = Table(title="hstu_attn_varlen_func", title_justify="left")
    for col in ("first call", "median", "IQR", "TFLOP/s", "FLOPs", "max |out - ref_fp32|",
                "max |ref_same - ref_fp32|", "check"):
        table.add_column(col, justify="right")
    table.add_row(f"{first * 1e3:.0f} ms ({how}; imports included)", f"{ms:.3f} ms", f"{iqr:.3f} ms", f"{f / ms / 1e9:.1f}",
                  f"{f / 1e9:.2f} G ({convention})", f"{err:.3g}", f"{ref_err:.3g}",
                  "[green]PASS[/]" if ok else "[red]FAIL[/]")
    console.print(table)
    console.print(f"Check: max|out - ref_fp32| <= 2 * max|ref_same - ref_fp32| + 1e-6 (docs/operator.md, "
                  f"Tolerances): "
                  f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------
def cmd_bench(args, console) -> int:
    dev, what = _gpu_status()
    if dev is None:
        console.print(f"[bold yellow]bench needs a CUDA GPU[/]: none found ({what}). Nothing was timed.")
        console.print("Skipped: the benchmark workloads (see docs/operator.md), the bf16 GEMM 8192^3 peak and "
                      "the torch SDPA flash/cuDNN reference lines. [bold]python -m hstu_cute warmup[/] and "
                      "[bold]python -m hstu_cute demo[/] do useful work without a GPU.")
        return 0
    return _bench_gpu(args, console, dev, what)


def _bench_gpu(args, console, dev, name: str) -> int:
    import torch
    from rich.progress import Progress

    from . import __version__, bench

    served = _gpu_kernel_path(console, dev)
    if served is None:
        return 1
    path, arch = served
    if args.grid == "serving":
        return _bench_serving(args, console, dev, name)
    if args.grid == "blocksparse":
        return _bench_sparse(args, console, dev, name)
    if args.grid == "nsa":
        return _bench_nsa(args, console, dev, name)
    if args.host:
        return _bench_host(args, console, dev, name)
    workloads = {"headline": lambda: [bench.headline()], "full": bench.default_grid,
                 "recsys": bench.recsys_grid, "func": bench.func_grid}[args.grid]()
    if args.limit is not None:
        workloads = workloads[: args.limit]
    meta = dict(gpu=name, arch=arch, kernel_path=path, torch=torch.__version__,
                dsl=_dist_version("nvidia-cutlass-dsl"), hstu_cute=__version__, grid=args.grid,
                time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    console.print(f"GPU: [bold]{name}[/] ({arch}, kernel path {path}); {len(workloads)} workloads, "
                  f"{args.direction.replace('both', 'forward and backward')}, bf16 unless named; FLOP convention "
                  "of docs/operator.md")

    # The sm80 kernels on the same inputs, side by side (not on the recsys grid: its point is the
    # training step, which gets its own rows there).
    both = path == "hopper" and args.grid != "recsys"
    directions = ("fwd", "bwd") if args.direction == "both" else (args.direction,)
    if args.grid == "recsys" and args.direction == "both":
        directions += ("step",)
    rows: dict[str, list[dict]] = {"fwd": [], "bwd": [], "step": [], "fp8": []}
    fp8 = args.fp8 and path == "hopper"
    with torch.cuda.device(dev):
        gemm = bench.gemm_tflops()
        with Progress(console=console, transient=True) as bar:
            for direction in directions:
                todo = workloads
                run = {"fwd": bench.run_workload, "bwd": bench.run_workload_bwd,
                       "step": bench.run_training_step}[direction]
                task = bar.add_task(direction, total=len(todo))
                for w in todo:
                    bar.update(task, description=f"{direction} {w.name}")
                    try:
                        row = run(w)
                        if both:
                            row["sm80_tflops"] = run(dataclasses.replace(w, sdpa=False), path="ampere")["tflops"]
                    except Exception as exc:  # one bad workload (e.g. out of memory) must not end the run
                        row = dict(workload=w.name, error=f"{type(exc).__name__}: {exc}")
                        torch.cuda.empty_cache()
                    row["spec"] = dataclasses.asdict(w)
                    row["direction"] = direction
                    rows[direction].append(row)
                    if direction == "step":  # the same step replayed from CUDA graphs: Python's host cost removed
                        try:
                            graph_row = bench.run_training_step(w, graphed=True)
                        except Exception as exc:
                            graph_row = dict(workload=w.name + " step, CUDA graph",
                                             error=f"{type(exc).__name__}: {exc}")
                        rows[direction].append(dict(graph_row, spec=dataclasses.asdict(w), direction=direction))
                    if fp8:
                        rows["fp8"] += _bench_fp8_rows(bench, w, row, direction)
                    bar.advance(task)
        try:
            overhead = bench.host_overhead_us()
        except Exception as exc:
            overhead = {"error": f"{type(exc).__name__}: {exc}"}

    for direction in directions:
        title = {"fwd": "forward", "bwd": "backward (dq, dk, dv)",
                 "step": "training step (autograd forward + backward, L2 flushed before each sample; 'CUDA graph' "
                         "rows: the step replayed from graphs, cuDNN's too)"}[direction]
        console.print(_bench_table(f"hstu_cute {title} on {name} ({arch}, {path} kernels)", rows[direction], gemm,
                                   both))
    if fp8:
        for direction in directions:
            title = {"fwd": "forward", "bwd": "backward", "step": "training step"}[direction]
            console.print(_bench_fp8_table(f"hstu_cute FP8 {title} on {name} ({arch})",
                                           [r for r in rows["fp8"] if r["direction"] == f"fp8 {direction}"]))
    elif args.fp8:
        console.print(f"[yellow]--fp8[/]: skipped (the FP8 kernels need the Hopper kernel path; this run: {path} "
                      "kernels)")
    if "api_us" in overhead:
        parts = ", ".join(f"{k[:-3]} {v:.1f} us" for k, v in overhead.items() if k != "api_us" and k.endswith("_us"))
        console.print(f"Host overhead of one hstu_attn_varlen_func call (tiny problem): {overhead['api_us']:.1f} us"
                      + (f" ({parts})" if parts else ""))
    else:
        console.print(f"Host overhead: not measured ({overhead.get('error')})")
    console.print("SDPA lines: torch scaled_dot_product_attention (softmax) on the same dense shapes, timed in this "
                  "run (backward: the gradient pass alone, FLOPs 2.5x the forward's); '-' where a workload has no "
                  "dense equivalent or the backend is unavailable.")
    if any(r.get("sdpa_padded") for direction in directions for r in rows[direction]):
        console.print("Jagged rows: the SDPA lines run the padded dense batch (B, H, N, D), shown as effective "
                      "TFLOP/s on the jagged FLOPs: what a user pays by padding.")
    all_rows = rows["fwd"] + rows["bwd"] + rows["step"] + rows["fp8"]
    if args.out:
        with open(args.out, "a", encoding="utf-8") as fh:
            for row in all_rows:
                fh.write(json.dumps({**meta, "gemm_tflops": gemm, **row}, default=str) + "\n")
            fh.write(json.dumps({**meta, "gemm_tflops": gemm, "workload": "host_overhead", **overhead}) + "\n")
        console.print(f"Appended {len(all_rows) + 1} JSON lines to {args.out}")
    return 1 if any("error" in r for r in all_rows) else 0


def _bench_host(args, console, dev, name: str) -> int:
    """``bench --host``: CPU time per call on a tiny problem beside PyTorch's floor and SDPA cuDNN,
    all lines in one run (bench.host_table)."""
    import torch
    from rich.table import Table

    from . import bench

    with torch.cuda.device(dev):
        rows = bench.host_table(calls=args.host_calls)
    table = Table(title=f"Host time per call on {name}: {rows[0]['shape']}, {args.host_calls} calls queued, no sync "
                        "(min-max of 5 interleaved repeats)")
    table.add_column("line")
    table.add_column("forward, no grad (us)", justify="right")
    table.add_column("forward + backward step (us)", justify="right")
    for row in rows:
        table.add_row(row["line"], "%.0f-%.0f" % row["fwd_us"], "%.0f-%.0f" % row["step_us"])
    console.print(table)
    _append_json_lines(args.out, rows, gpu=name, workload="host")
    return 0


def _append_json_lines(path, rows: list[dict], **meta) -> None:
    """One JSON line per row, ``meta`` first, appended to ``path`` (nothing without a path)."""
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps({**meta, **row}, default=str) + "\n")


def _bench_serving(args, console, dev, name: str) -> int:
    """``bench --grid serving``: the paged call beside contiguous keys and recomputing the history
    (hstu_cute.bench_serving), eager and from a CUDA graph."""
    import torch
    from rich.table import Table

    from .bench_serving import run_serving, serving_grid

    rows = []
    with torch.cuda.device(dev):
        for w in serving_grid()[: args.limit]:
            rows.append(run_serving(w))
    table = Table(title=f"hstu_cute serving on {name}: paged KV cache (page size {rows[0]['page_size']}), D128 bf16 "
                        "H4, L2 flushed, us (graph: replayed CUDA graph)")
    for col in ("workload", "paged", "graph", "contiguous", "graph", "recompute", "graph", "paged / contiguous",
                "recompute / paged", "paged TF/s"):
        table.add_column(col, justify="left" if col == "workload" else "right")
    for r in rows:
        table.add_row(r["workload"], *(f"{r[k] * 1e3:.1f}" for k in ("paged_ms", "paged_graph_ms", "contiguous_ms",
                                                                     "contiguous_graph_ms", "recompute_ms",
                                                                     "recompute_graph_ms")),
                      f"{r['paged_over_contiguous']:.2f}", f"{r['recompute_over_paged']:.1f}",
                      f"{r['paged_tflops']:.0f}")
    console.print(table)
    _append_json_lines(args.out, rows, gpu=name, grid="serving")
    return 0


def _grid_rows(args, console, dev, workloads: list, run) -> list[dict]:
    """``run(w, direction)`` over the first ``--limit`` of ``workloads`` for each ``--direction``
    (``bwd`` meaning forward + backward), each time printed as it lands."""
    import torch

    rows = []
    directions = {"fwd": ("fwd",), "bwd": ("fwd+bwd",), "both": ("fwd", "fwd+bwd")}[args.direction]
    with torch.cuda.device(dev):
        for direction in directions:
            for w in workloads[: args.limit]:
                rows.append(run(w, direction))
                console.print(f"{w.name} {direction}: {rows[-1]['ms']:.3f} ms")
    return rows


def _bench_sparse(args, console, dev, name: str) -> int:
    """``bench --grid blocksparse``: the block-sparse forward, and forward + backward, beside our
    dense call and FlexAttention with the same kept blocks (hstu_cute.bench_sparse)."""
    from rich.table import Table

    from .bench_sparse import run_sparse, sparse_grid

    rows = _grid_rows(args, console, dev, sparse_grid(), run_sparse)
    table = Table(title=f"hstu_cute block-sparse on {name}: H32 D128 bf16, block 128; TF/s on the allowed pairs of "
                        "the kept blocks (fwd+bwd: 3.5x the forward's FLOPs); FlexAttention is softmax")
    for col in ("workload", "direction", "kept", "sparse ms", "kernels ms", "TF/s", "dense ms", "dense TF/s", "x dense",
                "Flex ms", "Flex TF/s", "x Flex"):
        table.add_column(col, justify="left" if col == "workload" else "right")

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    for r in rows:
        table.add_row(r["workload"], r["direction"], f"{100 * r['density']:.1f}%", fmt(r["ms"], ".3f"),
                      fmt(r["kernel_ms"], ".3f"), fmt(r["tflops"], ".0f"),
                      fmt(r["dense_ms"], ".3f"), fmt(r["dense_tflops"], ".0f"), fmt(r["x_dense"], ".2f"),
                      fmt(r["flex_ms"], ".3f"), fmt(r["flex_tflops"], ".0f"), fmt(r["x_flex"], ".2f"))
    console.print(table)
    _append_json_lines(args.out, rows, gpu=name, grid="blocksparse")
    return 0


def _bench_nsa(args, console, dev, name: str) -> int:
    """``bench --grid nsa``: sparse HSTU (hstu_cute.nsa) beside our dense causal call, forward
    and forward + backward (hstu_cute.bench_nsa)."""
    from rich.table import Table

    from .bench_nsa import nsa_grid, run_nsa

    rows = _grid_rows(args, console, dev, nsa_grid(), run_nsa)
    table = Table(title=f"hstu_cute sparse HSTU (NSA-style) on {name}: H4 D128 bf16, 64K tokens per batch; times "
                        "beside our dense causal call on the same inputs")
    for col in ("workload", "direction", "B x N", "sparse ms", "dense ms", "x dense"):
        table.add_column(col, justify="left" if col == "workload" else "right")
    for r in rows:
        table.add_row(r["workload"], r["direction"], f"{r['batch']} x {r['seqlen']}", f"{r['ms']:.3f}",
                      f"{r['dense_ms']:.3f}", f"{r['x_dense']:.2f}")
    console.print(table)
    _append_json_lines(args.out, rows, gpu=name, grid="nsa")
    return 0


def _bench_fp8_rows(bench, w, bf16_row: dict, direction: str) -> list[dict]:
    """The FP8 rows of one workload and direction, with the ratio to its bf16 row: the forward's
    entries (bench.FP8_ENTRIES), the backward's (bench.FP8_BWD_ENTRIES; head dims with an FP8
    backward only) or FP8 training steps (bench.FP8_STEP_MODES)."""
    import torch

    from .variants import FP8_BWD_HEAD_DIMS

    w = dataclasses.replace(w, sdpa=False)
    if direction == "fwd":
        runs = [(f"fp8 {entry}", lambda e=entry: bench.run_workload_fp8(w, e)) for entry in bench.FP8_ENTRIES]
    elif w.head_dim not in FP8_BWD_HEAD_DIMS:
        runs = []
    elif direction == "bwd":
        runs = [(f"fp8 bwd mode{m} {e}", lambda m=m, e=e: bench.run_workload_bwd_fp8(w, m, e))
                for m, e in bench.FP8_BWD_ENTRIES]
    else:
        runs = [(f"step fp8 mode{m}", lambda m=m: bench.run_training_step(w, quant_mode=m))
                for m in bench.FP8_STEP_MODES]
    out = []
    for entry, run in runs:
        try:
            row = run()
            row.setdefault("entry", entry)
            row["x_bf16"] = row["tflops"] / bf16_row["tflops"] if row["tflops"] and bf16_row.get("tflops") else None
        except Exception as exc:  # e.g. a head dim without an FP8 kernel: the row says why
            row = dict(workload=w.name, entry=entry, error=f"{type(exc).__name__}: {exc}")
            torch.cuda.empty_cache()
        row["direction"] = f"fp8 {direction}"
        out.append(row)
    return out


def _bench_fp8_table(title: str, rows: list[dict]):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in ("workload", "FP8 entry", "ms", "IQR", "TFLOP/s", "x bf16 (same run)"):
        table.add_column(col, justify="left" if col in ("workload", "FP8 entry") else "right")
    for row in rows:
        if "error" in row:
            table.add_row(_esc(row["workload"]), row["entry"], f"[red]{_esc(strip_ansi(row['error'])[:60])}[/]", "-",
                          "-", "-")
            continue
        ratio = row.get("x_bf16")
        # The quantizer rows move bytes: GB/s in place of TFLOP/s.
        rate = f"{row['gbps']:.0f} GB/s" if "gbps" in row else f"{row['tflops']:.1f}"
        table.add_row(_esc(row["workload"]), row["entry"], f"{row['ms']:.3f}", f"{row['iqr_ms']:.3f}", rate,
                      f"{ratio:.2f}" if ratio else "-")
    return table


def _bench_table(title: str, rows: list[dict], gemm: float, both: bool):
    """One rich table: our TFLOP/s, the GEMM peak, the sm80 kernels (on sm90) and SDPA lines."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    cols = ["workload", "ms", "IQR", "TFLOP/s", "FLOPs", "% GEMM"] + (["sm80 kernel"] if both else []) + [
        "SDPA flash", "SDPA cuDNN", "x flash", "x cuDNN"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("workload", "FLOPs") else "right")
    table.add_row("[dim]bf16 GEMM 8192^3 (peak, same run)[/]", "-", "-", f"{gemm:.1f}", "2MNK", "100%",
                  *["-"] * (len(cols) - 6))
    for row in rows:
        if "error" in row:
            table.add_row(_esc(row["workload"]), f"[red]{_esc(strip_ansi(row['error'])[:60])}[/]",
                          *["-"] * (len(cols) - 2))
            continue
        tf, fl, cu = row["tflops"], row.get("sdpa_flash"), row.get("sdpa_cudnn")
        table.add_row(
            _esc(row["workload"]), f"{row['ms']:.3f}", f"{row['iqr_ms']:.3f}", f"{tf:.1f}", row["flops"],
            f"{100 * tf / gemm:.0f}%", *([_fmt_tf(row.get("sm80_tflops"))] if both else []), _fmt_tf(fl),
            _fmt_tf(cu), f"{tf / fl:.2f}" if fl else "-", f"{tf / cu:.2f}" if cu else "-",
        )
    return table


# ---------------------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------------------
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: ...)`` to an option's help unless the help already says its default,
    or the default is None / False (an unset option or an off flag)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default == argparse.SUPPRESS \
                or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def _archs() -> str:
    return ", ".join(SUPPORTED_ARCHS)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="python -m hstu_cute",
        description="HSTU attention kernels in the CUTLASS CuTe DSL: tools. Output that is not a terminal, "
                    "or under NO_COLOR, has no colour codes.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hstu-cute {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,warmup,demo,bench}")

    def add(name: str, help: str, description: str):
        return sub.add_parser(name, help=help, description=description, formatter_class=_HelpFormatter)

    p = add("info", "versions, GPU, kernel path, module cache",
            "Versions, GPU and selected kernel path, and the module cache with its entries. The cache "
            "directory is $HSTU_CUTE_CACHE_DIR (default: $XDG_CACHE_HOME/hstu_cute, else ~/.cache/hstu_cute); "
            "HSTU_CUTE_CACHE=0 keeps compiled modules in memory only (default: disk cache on).")
    p.set_defaults(func=cmd_info)

    cpus = os.cpu_count() or 1
    p = add("warmup", "precompile kernel variants into the module cache (no GPU needed)",
            "Precompile the shipped kernel variants for one arch into the module cache, so that later "
            "processes load them from disk. Needs no GPU. The filters below narrow the set; without them "
            "every variant the API can select is compiled (hundreds: minutes on a few cores).")
    p.add_argument("--arch", default=None, metavar="ARCH",
                   help=f"target cubin arch, one of {_archs()} (default: this GPU's arch, else sm_80)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help=f"compile processes; 1 compiles in this process (default: the CPU count, {cpus} here)")
    p.add_argument("--dtype", action="append", choices=WARMUP_DTYPES,
                   help="only this dtype's kernels; repeatable; float8_e4m3fn = the FP8 kernels and quantizers "
                        f"(default: all of {', '.join(WARMUP_DTYPES)})")
    p.add_argument("--family", action="append", choices=FAMILIES,
                   help="only this kernel family; repeatable: dense (16-bit, contiguous keys), paged (the paged KV "
                        f"cache forward), fp8 (FP8 forward, backward, V^T), quantizers (default: all of "
                        f"{', '.join(FAMILIES)})")
    p.add_argument("--head-dim", action="append", type=int, choices=HEAD_DIMS,
                   help=f"only this head dim; repeatable (default: all of {', '.join(map(str, HEAD_DIMS))})")
    p.add_argument("--mask", action="append", choices=MASKS,
                   help="only this mask family; repeatable; 'target' = causal with contexts/targets "
                        f"(default: all of {', '.join(MASKS)})")
    p.add_argument("--rab", choices=("all", "none", "only"), default="all",
                   help="variants with and without a relative attention bias (all), without (none) or with it "
                        "(only)")
    p.add_argument("--no-rab", action="store_true", help="same as --rab none")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="at most this many variants, after the filters (default: no limit)")
    p.add_argument("--direction", "--kernels", dest="kernels", choices=("all", "fwd", "bwd"), default="all",
                   help="forward (fwd), backward (bwd) or both (all); on sm_90a the Hopper kernels as well as "
                        "the sm80 ones")
    p.add_argument("--unshipped", action="store_true",
                   help="also the variants the API compiles on first use rather than ships (head dims "
                        f"{', '.join(str(d) for d in HEAD_DIMS if d not in SHIPPED_HEAD_DIMS)}; the FP8 kernels "
                        "with float16 outputs)")
    p.add_argument("--dry-run", action="store_true", help="list the variants that would compile, compile nothing")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failed compiles")
    p.set_defaults(func=cmd_warmup)

    p = add("demo", "a random jagged batch through the kernel vs the oracle (CPU: oracle only)",
            "A random jagged batch through hstu_attn_varlen_func, checked against the oracle and timed. "
            "Without a GPU: precompiles the demo's kernel variant, runs the argument checks and the oracle on "
            "CPU, and lists what it skipped.")
    p.add_argument("--batch", type=int, default=8, help="sequences in the batch")
    p.add_argument("--max-len", type=int, default=1024,
                   help="max_seqlen; lengths are drawn between max-len/2 and max-len")
    p.add_argument("--heads", type=int, default=4, help="attention heads (H)")
    p.add_argument("--head-dim", type=int, default=128, choices=HEAD_DIMS, help="head dim (D)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES + (FP8_DEMO_DTYPE,),
                   help="dtype of q, k, v (and rab); float8_e4m3fn: pre-quantized e4m3 inputs with descales "
                        "(Hopper FP8 forward, bf16 out and rab)")
    p.add_argument("--quant-mode", type=int, default=-1, choices=BUILT_QUANT_MODES,
                   help="FP8 quantization inside the operator (Hopper FP8 forward): -1 off, 0 cast, 1 two-direction "
                        "(per-token and per-(block, dim) scales), 2 per block, 3 per (sequence, head), "
                        "4 per sequence, 5 per tensor")
    p.add_argument("--mask", default="causal", choices=MASKS,
                   help="none, local (see --window), causal, or target (causal with contexts and targets)")
    p.add_argument("--window", type=_parse_window, default=(128, 0), metavar="LEFT,RIGHT",
                   help="window of --mask local (default: 128,0)")
    p.add_argument("--group", type=int, default=1, help="target group size of --mask target")
    p.add_argument("--rab-heads", type=int, default=0,
                   help="relative attention bias: 0 (none), 1 (one bias shared by all heads) or H (one per head, "
                        "= --heads)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random batch")
    p.add_argument("--arch", default=None, metavar="ARCH",
                   help=f"without a GPU: the arch to precompile the demo's variant for, one of {_archs()} "
                        "(default: sm_80)")
    p.add_argument("--reps", type=int, default=50, help="timed repetitions (GPU)")
    p.add_argument("--warmup-iters", type=int, default=10, help="untimed warm-up calls (GPU)")
    p.add_argument("--cpu", action="store_true", help="take the no-GPU path even if a GPU is present")
    p.set_defaults(func=cmd_demo)

    p = add("bench", "benchmark workloads with GEMM peak and SDPA reference lines (GPU)",
            "Time the kernels on the benchmark workloads, with the bf16 GEMM peak and torch SDPA (flash, "
            "cuDNN) timed in the same run as reference lines; FLOPs by the convention of docs/operator.md. "
            "Needs a GPU (without one it says so and exits 0).")
    p.add_argument("--grid", choices=("headline", "full", "recsys", "func", "blocksparse", "nsa", "serving"),
                   default="headline",
                   help="headline: B8 N4096 D128 causal; full: the whole workload grid (docs/operator.md); recsys: "
                        "short and jagged recommender shapes with a training-step row each; func: FBGEMM's func "
                        "masks beside our causal mask; blocksparse: block masks (forward; fwd+bwd with --direction both or bwd) beside our dense call and "
                        "FlexAttention; nsa: sparse HSTU (hstu_cute.nsa) beside our dense call; serving: new tokens against a paged KV cache beside contiguous keys and recomputing the history")
    p.add_argument("--direction", choices=("fwd", "bwd", "both"), default="both",
                   help="time the forward, the backward or both")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="append one JSON line per workload to this file (default: none)")
    p.add_argument("--fp8", action="store_true",
                   help="also time the Hopper FP8 kernels beside each bf16 row: forward (the kernels alone, the "
                        "pre-quantized entry, quant_mode 0, 1, 2 and 5 end to end and their quantizers), backward "
                        "(modes 2 and 1, the kernels alone and end to end) and, on the recsys "
                        "grid, the training step (mode 2)")
    p.add_argument("--host", action="store_true",
                   help="instead of the workloads: host (CPU) time per call on a tiny problem, forward and "
                        "training step, beside a null autograd.Function, SDPA cuDNN and FlashAttention-4 when it "
                        "imports")
    p.add_argument("--host-calls", type=int, default=1000, help=argparse.SUPPRESS)
    p.add_argument("--limit", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_bench)
    return parser


def _positive(parser, args) -> None:
    for name in ("batch", "max_len", "heads", "workers", "limit", "group", "reps", "host_calls"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}: expected an int >= 1, got {value}")


def _error(args, message: str) -> int:
    """One line on stderr, argparse's format, and exit status 2 (a usage error)."""
    prog = "python -m hstu_cute" + (f" {args.command}" if getattr(args, "command", None) else "")
    sys.stdout.flush()
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return 2


def _print_exception(exc: BaseException) -> None:
    """The traceback of an unexpected error on stderr; without ANSI codes (the DSL colours parts
    of its messages) unless stderr is a terminal and NO_COLOR is unset."""
    import traceback

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if not _isatty(sys.stderr) or _no_color():
        text = strip_ansi(text)
    sys.stdout.flush()
    sys.stderr.write(text)
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _positive(parser, args)
    if getattr(args, "arch", None) is not None:  # before anything is compiled or locked
        try:
            check_arch(args.arch)
        except ValueError as exc:
            return _error(args, str(exc))
    console = _console()
    try:
        return int(args.func(args, console) or 0)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    except Exception as exc:  # noqa: BLE001 - printed plain (see _print_exception), exit status 1
        _print_exception(exc)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
