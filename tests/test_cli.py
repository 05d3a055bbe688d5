"""``python -m hstu_cute`` on a machine without a GPU (run with the GPU hidden, so these test the
no-GPU paths everywhere), plus the package's import weight and the README / CI contract.

Also the user-facing behaviour of the CLI: ``--arch`` checked before any compile or lock (one
line, exit 2), no ``.lock`` files left by failed compiles, no ANSI codes when the output is not a
terminal, defaults in every ``--help``, argparse errors that name the flag once, and rab
described by heads rather than by load width."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli_proc(*args, cache_dir: Path, timeout: float = 300,
                 extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m hstu_cute ARGS`` with stdout and stderr as pipes (not terminals)."""
    env = dict(os.environ)
    env.update(
        HSTU_CUTE_CACHE_DIR=str(cache_dir),
        CUDA_VISIBLE_DEVICES="",  # the no-GPU paths, also on a GPU machine
        COLUMNS="200",  # rich: no wrapping of the lines the tests look for
        PYTHONUNBUFFERED="1",
    )
    env.pop("HSTU_CUTE_CACHE", None)
    env.pop("HSTU_CUTE_ARCH", None)
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-m", "hstu_cute", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def run_cli(*args, cache_dir: Path, timeout: float = 300, extra_env: dict | None = None):
    proc = run_cli_proc(*args, cache_dir=cache_dir, timeout=timeout, extra_env=extra_env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out}"
    return out


def test_import_is_light():
    code = (
        "import sys, hstu_cute; "
        "assert callable(hstu_cute.warmup), hstu_cute.warmup; "
        "heavy = [m for m in ('cutlass', 'torch', 'tvm_ffi') if m in sys.modules]; "
        "assert not heavy, heavy; "
        "print(hstu_cute.__version__); "
        "f = hstu_cute.hstu_attn_varlen_func; "
        "assert f.__name__ == 'hstu_attn_varlen_func' and f.__module__ == 'hstu_cute.api'; "
        "assert 'cutlass' not in sys.modules; "
        "import hstu_cute.warmup as w; assert callable(w)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*\n", proc.stdout)


def test_info(tmp_path):
    out = run_cli("info", cache_dir=tmp_path)
    for text in ("nvidia-cutlass-dsl", "apache-tvm-ffi", "torch", "no GPU", str(tmp_path), "disk caching",
                 "enabled", "cached entries"):
        assert text in out, f"{text!r} missing from:\n{out}"


def test_info_lists_family_fingerprints_and_other_entries(tmp_path):
    """info names each kernel family's fingerprint, and counts the entries of other fingerprints
    (older sources) apart from the current ones."""
    import json

    from hstu_cute.cache import family_fingerprint

    current = family_fingerprint("hopper_fwd", "hstu_cute.variants")
    for fp, digest in ((current, "a"), ("0123456789abcdef", "old")):
        kdir = tmp_path / fp / "hopper_fwd"
        kdir.mkdir(parents=True)
        (tmp_path / fp / ".hstu_cute_fingerprint").write_text("{}")
        (kdir / f"{digest}.o").write_bytes(b"obj")
        (kdir / f"{digest}.json").write_text(json.dumps({"kernel_name": "hopper_fwd", "size": 3,
                                                          "key_module": "hstu_cute.variants"}))
    out = run_cli("info", cache_dir=tmp_path)
    assert re.search(rf"{current}\s+hopper_fwd, hopper_fwd_paged, hopper_fwd_fp8", out), out
    assert re.search(r"cached entries\s*│?\s*1 ", out), out
    assert re.search(r"other fingerprints\s*│?\s*1 entries", out), out


def test_info_names_an_invalid_forced_path(tmp_path):
    out = run_cli("info", cache_dir=tmp_path, extra_env={"HSTU_CUTE_ARCH": "sm75"})
    assert "ValueError" in out and "HSTU_CUTE_ARCH: expected one of sm_80" in out, out


def test_help_lists_commands(tmp_path):
    out = run_cli("--help", cache_dir=tmp_path)
    for cmd in ("info", "warmup", "demo", "bench"):
        assert cmd in out


def test_demo_without_gpu(tmp_path):
    out = run_cli("demo", "--batch", "2", "--max-len", "32", "--heads", "2", "--head-dim", "64", "--rab-heads", "1",
                  cache_dir=tmp_path)
    assert "No CUDA GPU found" in out
    assert re.search(r"compiled in [\d.]+ (s|ms)", out), out  # the demo's variant was compiled for sm_80
    assert "ampere_fwd sm_80 bfloat16 d64" in out
    # rab is described by its heads, not by the kernel's load width ("rab/8")
    assert "causal, rab (1 head)" in out and "rab/" not in out and "H_rab" not in out, out
    assert "q.device: expected a CUDA device" in out  # the checks ran and only the device one failed
    assert "Oracle" in out and "all finite: True" in out
    assert "Skipped (needs a CUDA GPU)" in out
    for skipped in ("running the compiled kernel", "checking its output against the oracle", "CUDA events"):
        assert skipped in out
    assert list(tmp_path.rglob("*.o")), "the demo's variant should be in the disk cache"


@pytest.mark.parametrize("fp8", [("--quant-mode", "0"), ("--quant-mode", "2"), ("--dtype", "float8_e4m3fn")],
                         ids=["mode0", "mode2", "prequantized"])
def test_demo_fp8_without_gpu(fp8, tmp_path):
    """The FP8 demo compiles the Hopper FP8 variant (sm_90a, no GPU needed), runs the checks, and
    compares the fp32 oracle with the FP8 emulation."""
    out = run_cli("demo", "--batch", "2", "--max-len", "40", "--heads", "2", "--head-dim", "64", *fp8,
                  cache_dir=tmp_path)
    assert "No CUDA GPU found" in out
    assert "hopper_fwd_fp8 sm_90a float8_e4m3fn d64" in out and re.search(r"compiled in [\d.]+ (s|ms)", out), out
    assert ("scaled-P" in out) == (fp8[1] == "2"), out
    assert "q.device: expected a CUDA device" in out
    assert "fp8 emulation" in out and "all finite: True" in out


def test_demo_fp8_bad_head_dim(tmp_path):
    proc = run_cli_proc("demo", "--quant-mode", "0", "--head-dim", "32", cache_dir=tmp_path)
    assert proc.returncode == 2
    assert "--head-dim: the FP8 forward supports (64, 128, 256), got 32" in proc.stdout + proc.stderr


def test_bench_without_gpu_exits_cleanly(tmp_path):
    out = run_cli("bench", cache_dir=tmp_path, timeout=120)
    assert "bench needs a CUDA GPU" in out and "Nothing was timed" in out and "Skipped" in out


WARMUP_ARGS = ("warmup", "--arch", "sm_80", "--head-dim", "64", "--dtype", "bfloat16", "--mask", "causal",
               "--mask", "target", "--no-rab", "--kernels", "fwd", "--workers", "2")


def test_warmup_compiles_then_hits_disk(tmp_path):
    out = run_cli(*WARMUP_ARGS, cache_dir=tmp_path)
    # The forward and the paged (KV-cache) forward of each mask, each also with split keys.
    assert "8 variants for sm_80: 8 compiled, 0 disk hits" in out, out
    assert "ampere_fwd sm_80 bfloat16 d64 128x128w4s2 causal+context+target" in out
    assert "ampere_fwd sm_80 bfloat16 d64 128x128w4s2k causal+context+target" in out
    objs = sorted(tmp_path.rglob("*.o"))
    assert len(objs) == 8
    out = run_cli(*WARMUP_ARGS, cache_dir=tmp_path)
    assert "8 variants for sm_80: 0 compiled, 8 disk hits" in out, out
    assert sorted(tmp_path.rglob("*.o")) == objs
    out = run_cli("info", cache_dir=tmp_path)
    assert "cached entries" in out and re.search(r"cached entries\s*│?\s*8 ", out), out
    assert "causal+context+target" in out


def test_warmup_select_keys_filters():
    from hstu_cute.cli import select_keys

    # Backward: 2 dtypes x 4 head dims x 4 masks x (4 dQ + 2 dK/dV variants).
    # sm80: the forward (96), the backward (192), the paged KV-cache forward (2 dtypes x 4 head
    # dims x 2 causal masks x rab or not: 32) and the split-key forward, contiguous and paged (32 each).
    assert len(select_keys("sm_80")) == 96 + 192 + 32 + 64
    assert len(select_keys("sm_80", kernels="fwd")) == 96 + 32 + 64
    assert len(select_keys("sm_80", kernels="bwd")) == 192
    assert len(select_keys("sm_80", head_dims=[256], kernels="bwd")) == 2 * 4 * 6
    keys = select_keys("sm_80", ["bfloat16"], [64], ["causal", "target"], "none", kernels="fwd")
    assert [k.describe().split()[-1] for k in keys] == ["causal", "causal+context+target"] * 4
    assert [k.kernel_name for k in keys] == ["ampere_fwd"] * 4 + ["ampere_fwd_paged"] * 4
    assert [k.split_keys for k in keys] == [False, False, True, True] * 2
    assert all(k.arch == "sm_80" and k.head_dim == 64 and not k.has_rab for k in keys)
    assert len(select_keys("sm_86", head_dims=[32], rab="only", kernels="fwd")) == 2 * 4 * 2 + 2 * 2 + 2 * 2 * 2
    assert len(select_keys("sm_86", head_dims=[32], rab="only", kernels="bwd")) == 2 * 4 * 4
    assert len(select_keys("sm_80", limit=5)) == 5
    # sm_90a: the Hopper forward and backward kernels too (hstu_cute.variants.shipped_keys): the
    # fused D128 kernel (16), the deterministic pair (96) and at D256 the wide dK/dV/drab kernel
    # (2 dtypes x 4 masks x 4 rab/drab modes) with its dQ kernel (16); the FP8 forward (bf16
    # output only, variants.FP8_SHIPPED_DTYPES, x 3 head dims x 4 masks x rab or not x P cast,
    # scaled or scaled with mode 1's descales: 72), its V^T kernel for e4m3 V (3 head dims), the
    # quantizers of quant modes 0-5 (3 x 12 slot sets); the paged forward, sm80 and Hopper (32 each);
    # the split-key Hopper forward, contiguous and paged (2 dtypes x 4 head dims x 2 masks x rab or not);
    # the FP8 backward pair and its drab dQ kernels (32 + 16 at D64/128, 24 at D256), for quant modes 0,
    # 2-5 and for mode 1, and the fused FP8 backward (4 masks at D128).
    assert len(select_keys("sm_90a")) == (96 + 192 + 64 + 96 + 16 + 32 + 16 + 72 + 3 + 36 + 32 + 32 + 32
                                          + 32 + 64 + 2 * (32 + 16 + 24) + 4)
    assert len(select_keys("sm_90a", kernels="fwd")) == 96 + 64 + 72 + 3 + 36 + 32 + 32 + 32 + 32 + 64
    # + the FP8 pair and drab dQ kernels, for quant modes 0, 2-5 and for mode 1, and the fused FP8 kernel
    assert len(select_keys("sm_90a", kernels="bwd")) == 192 + 96 + 16 + 32 + 16 + 2 * (32 + 16 + 24) + 4
    # --dtype bfloat16 selects the 16-bit kernels only; the FP8 ones come with float8_e4m3fn (their
    # 16-bit side narrowed by the 16-bit dtypes named beside it)
    keys = select_keys("sm_90a", ["bfloat16"], [128], ["causal"], "none", kernels="fwd")
    assert [k.kernel_name for k in keys] == (["ampere_fwd"] * 2 + ["ampere_fwd_paged"] * 2 + ["hopper_fwd"] * 2
                                             + ["hopper_fwd_paged"] * 2)
    assert [k.split_keys for k in keys] == [False, True] * 4
    fp8 = select_keys("sm_90a", ["bfloat16", "float8_e4m3fn"], [128], ["causal"], "none", kernels="fwd")
    # (the quantizers and V^T have no mask or rab: mask and rab filters keep them)
    assert [k.kernel_name for k in fp8 if k not in keys] == (["hopper_fwd_fp8"] * 3 + ["hopper_fwd_vt"]
                                                             + ["hopper_fwd_quant_slots"] * 12)
    assert [(k.scaled_p, k.two_direction) for k in fp8 if k.kernel_name == "hopper_fwd_fp8"] == [
        (False, False), (True, False), (True, True)]
    assert all(k.out_dtype == "bfloat16" for k in fp8 if k.kernel_name == "hopper_fwd_fp8")
    assert len(select_keys("sm_90a", ["float8_e4m3fn"])) == 72 + 3 + 36 + 2 * (32 + 16 + 24) + 4
    assert select_keys("sm_80", ["float8_e4m3fn"]) == []
    # --family narrows to one kernel family; families partition the shipped set
    from hstu_cute.cli import FAMILIES

    assert sum(len(select_keys("sm_90a", families=[f])) for f in FAMILIES) == len(select_keys("sm_90a"))
    assert {k.kernel_name for k in select_keys("sm_90a", families=["quantizers"])} == {"hopper_fwd_quant_slots"}
    assert {k.kernel_name for k in select_keys("sm_90a", families=["paged"])} == {"ampere_fwd_paged",
                                                                                 "hopper_fwd_paged"}
    assert not any(k.kernel_name == "hopper_fwd" for k in select_keys("sm_89"))


def test_warmup_dry_run_lists_without_compiling(tmp_path):
    out = run_cli("warmup", "--arch", "sm_90a", "--head-dim", "128", "--mask", "causal", "--dtype", "bfloat16",
                  "--family", "dense", "--direction", "fwd", "--no-rab", "--dry-run", cache_dir=tmp_path)
    assert "hopper_fwd" in out and "fp8" not in out and "paged" not in out, out
    assert "4 variants for sm_90a would compile (--dry-run: nothing compiled)" in out, out
    assert not list(tmp_path.rglob("*.o"))
    none = run_cli("warmup", "--arch", "sm_80", "--dtype", "float8_e4m3fn", "--dry-run", cache_dir=tmp_path)
    assert "No variant matches these options" in none


def test_warmup_unshipped_adds_the_fp16_fp8_and_unshipped_head_dim_variants():
    """HSTU8Test draws fp16 FP8 calls, and head dims 96 / 192 are served too; their kernels are
    compiled on first use, not shipped: ``--unshipped`` lets a warmup compile them ahead (and only
    them beside the shipped ones)."""
    from hstu_cute.cli import select_keys
    from hstu_cute.variants import HEAD_DIMS, SHIPPED_HEAD_DIMS, jit_only_keys, shipped_keys

    extra = jit_only_keys("sm_90a")
    assert extra and not set(extra) & set(shipped_keys("sm_90a"))
    unshipped_dims = set(HEAD_DIMS) - set(SHIPPED_HEAD_DIMS)
    assert unshipped_dims == {96, 192} and {k.head_dim for k in shipped_keys("sm_90a")} == set(SHIPPED_HEAD_DIMS)
    fp8 = [k for k in extra if k.head_dim in SHIPPED_HEAD_DIMS]
    assert {getattr(k, "out_dtype", k.dtype) for k in fp8 if k.kernel_name != "hopper_fwd_quant_slots"} == {"float16"}
    assert {k.dtype for k in fp8 if k.kernel_name == "hopper_fwd_quant_slots"} == {"float16"}
    odd = [k for k in extra if k.head_dim in unshipped_dims]
    # Every 16-bit family at D96 / D192, both dtypes; no FP8 kernel there (FP8_HEAD_DIMS).
    assert {k.kernel_name for k in odd} == {"ampere_fwd", "ampere_fwd_paged", "ampere_bwd_dq", "ampere_bwd_dkdv",
                                            "hopper_fwd", "hopper_fwd_paged", "hopper_bwd_dkdv", "hopper_bwd_dq"}
    assert {k.dtype for k in odd} == {"bfloat16", "float16"}
    assert {k.head_dim for k in jit_only_keys("sm_80")} == unshipped_dims
    assert not set(jit_only_keys("sm_80")) & set(shipped_keys("sm_80"))
    fp16_fp8 = select_keys("sm_90a", ["float8_e4m3fn", "float16"], families=["fp8", "quantizers"], unshipped=True)
    assert set(fp8) <= set(fp16_fp8)
    assert select_keys("sm_90a", unshipped=True) == select_keys("sm_90a") + extra


def test_warmup_of_an_unshipped_head_dim_says_how_to_compile_it(tmp_path):
    """Head dims 96 / 192 are not shipped: a warmup that asks for them alone matches nothing and
    says they compile on first use or with ``--unshipped``, which lists them."""
    none = run_cli("warmup", "--arch", "sm_90a", "--head-dim", "96", "--dry-run", cache_dir=tmp_path)
    assert "No variant matches these options" in none and "96 compiles on first use" in none
    assert "--unshipped compiles it ahead" in none
    listed = run_cli("warmup", "--arch", "sm_90a", "--head-dim", "96", "--head-dim", "192", "--unshipped",
                     "--dry-run", cache_dir=tmp_path)
    assert "336 variants for sm_90a would compile" in listed and " d96 " in listed and " d192 " in listed
    assert not list(tmp_path.rglob("*.o"))


def test_key_variant_parses_every_key_class():
    from hstu_cute.cli import _key_variant
    from hstu_cute.variants import shipped_keys
    from hstu_cute.warmup import describe_variant

    keys = shipped_keys("sm_90a", ("bfloat16",), (64,))
    assert {k.kernel_name for k in keys} == {"ampere_fwd", "ampere_bwd_dq", "ampere_bwd_dkdv", "hopper_fwd",
                                             "hopper_bwd_dkdv", "hopper_bwd_dq", "hopper_fwd_fp8", "hopper_fwd_vt",
                                             "hopper_fwd_quant_slots",
                                             "ampere_fwd_paged",
                                             "hopper_fwd_paged", "hopper_bwd_fp8_dkdv", "hopper_bwd_fp8_dq"}
    for k in keys:
        assert _key_variant(repr(k)) == describe_variant(k)
    # Never evaluated: anything but a known key class comes back verbatim.
    for raw in ("__import__('os').getcwd()", "Unknown(arch='sm_80')", "AmpereFwdKey(1, 2)", "not python ("):
        assert _key_variant(raw) == raw
    assert _key_variant(None) == "?"


def test_warmup_in_process_and_progress(tmp_path, monkeypatch):
    """The in-process path (workers=1) and the progress callback; a second call is a memory hit."""
    from hstu_cute import warmup
    from hstu_cute.cache import reset_default_cache
    from hstu_cute.cli import select_keys

    monkeypatch.setenv("HSTU_CUTE_CACHE_DIR", str(tmp_path))
    reset_default_cache()
    try:
        keys = select_keys("sm_80", ["float16"], [32], ["none"], "none", kernels="fwd")
        seen = []
        results = warmup(keys=keys, workers=1, progress=lambda *a: seen.append(a))
        assert [(d, t) for d, t, _, _ in seen] == [(1, 1)]
        assert results[0]["ok"] and results[0]["source"] == "compile" and results[0]["seconds"] > 0
        assert warmup(keys=keys, workers=1)[0]["source"] == "memory"
    finally:
        reset_default_cache()


def test_warmup_rejects_bad_workers():
    from hstu_cute import warmup

    with pytest.raises(ValueError, match="workers"):
        warmup(keys=[], workers=0)


# ---------------------------------------------------------------------------------------------
# User-facing behaviour: arch checks, lock files, colour codes, help, argparse messages, labels
# ---------------------------------------------------------------------------------------------
ANSI = "\x1b["


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("cmd", [("warmup",), ("warmup", "--kernels", "fwd", "--workers", "1"), ("demo",)])
@pytest.mark.parametrize("arch", ["sm_75", "sm_100"])
def test_bad_arch_is_one_line_exit_2_and_touches_nothing(tmp_path, cmd, arch):
    cache = tmp_path / "cache"
    proc = run_cli_proc(*cmd, "--arch", arch, cache_dir=cache, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0] == (f"python -m hstu_cute {cmd[0]}: error: --arch: expected one of sm_80, sm_86, sm_87, "
                        f"sm_89, sm_90a, got '{arch}'")
    assert "KeyError" not in proc.stderr and "Traceback" not in proc.stderr
    assert not cache.exists() or _files(cache) == [], _files(cache)  # no lock files, no directories


@pytest.mark.parametrize("arch", ["sm_90", "sm90a", "sm90"])
def test_sm90_suggests_sm90a(tmp_path, arch):
    for cmd in ("warmup", "demo"):
        proc = run_cli_proc(cmd, "--arch", arch, cache_dir=tmp_path / "cache", timeout=120)
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
        assert proc.stderr.splitlines() == [
            f"python -m hstu_cute {cmd}: error: --arch: expected one of sm_80, sm_86, sm_87, sm_89, sm_90a, "
            f"got '{arch}' (did you mean sm_90a?)"
        ]
        assert "CUTE_DSL_ARCH" not in proc.stderr
    assert not (tmp_path / "cache").exists()


def _no_compile(monkeypatch):
    """Make any compile fail loudly: the arch checks must come first."""
    import types

    def build(key):
        raise AssertionError(f"compiled {key!r}")

    monkeypatch.setitem(sys.modules, "hstu_cute.compile", types.SimpleNamespace(build=build))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    from hstu_cute.cache import reset_default_cache

    root = tmp_path / "cache"
    monkeypatch.setenv("HSTU_CUTE_CACHE_DIR", str(root))
    monkeypatch.delenv("HSTU_CUTE_CACHE", raising=False)
    reset_default_cache()
    yield root
    reset_default_cache()


def test_warmup_function_checks_arch_first(cache_dir, monkeypatch):
    from hstu_cute import warmup
    from hstu_cute.cli import select_keys
    from hstu_cute.masks import MaskKind
    from hstu_cute.variants import make_fwd_key

    _no_compile(monkeypatch)
    with pytest.raises(ValueError, match=r"^arch: expected one of sm_80, .*, got 'sm_75'$"):
        warmup(arch="sm_75", workers=1)
    with pytest.raises(ValueError, match=r"got 'sm_90' \(did you mean sm_90a\?\)"):
        warmup(arch="sm_90", workers=1)
    good = make_fwd_key("sm_80", "bfloat16", 64, MaskKind.CAUSAL, False, False, 8)
    bad = make_fwd_key("sm_75", "bfloat16", 64, MaskKind.CAUSAL, False, False, 8)
    with pytest.raises(ValueError, match=r"^AmpereFwdKey\.arch: expected one of .*, got 'sm_75'$"):
        warmup(keys=[good, bad], workers=1, raise_errors=False)
    with pytest.raises(ValueError, match=r"^arch: .*got 'sm_86a'"):  # retargeting to a bad arch
        warmup(arch="sm_86a", keys=[good], workers=1)
    with pytest.raises(ValueError, match="arch"):
        select_keys("sm_75")
    assert not cache_dir.exists(), _files(cache_dir)


def _ansi_build(key):
    # What the DSL's errors look like: parts of the message in ANSI colours, [brackets] too.
    raise RuntimeError(f"\x1b[91mDSL failure\x1b[0m for [{key.arch}] \x1b[1mstop\x1b[0m")


def test_failed_compile_leaves_no_lock_files_and_no_ansi(cache_dir, monkeypatch, capsys):
    import types

    from hstu_cute import cli, warmup

    monkeypatch.setitem(sys.modules, "hstu_cute.compile", types.SimpleNamespace(build=_ansi_build))
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich would colour a pipe with this; the CLI must not
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("COLUMNS", "200")  # no wrapping of the lines looked for
    rc = cli.main(["warmup", "--arch", "sm_80", "--head-dim", "32", "--dtype", "float16", "--mask", "none",
                   "--mask", "causal", "--kernels", "fwd", "--no-rab", "--workers", "1", "-v"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 1, text
    assert "5 variants for sm_80: 0 compiled, 0 disk hits, 0 already in memory, 5 failed" in text, text
    assert "FAILED ampere_fwd sm_80 float16 d32" in text and "RuntimeError: DSL failure for [sm_80] stop" in text
    assert "Traceback" in text  # -v
    assert ANSI not in text, repr(text)
    # The entries' directory may stay; the failed compiles' lock files do not.
    assert [f for f in _files(cache_dir) if f.endswith((".lock", ".o", ".json"))] == [], _files(cache_dir)
    # The function's results are plain text too.
    results = warmup(arch="sm_80", keys=cli.select_keys("sm_80", ["float16"], [32], ["none"], "none",
                                                         kernels="fwd"), workers=1, raise_errors=False)
    assert not results[0]["ok"] and ANSI not in results[0]["error"] + results[0]["traceback"]
    assert not list(cache_dir.rglob("*.lock"))


_LOCK_WORKER = r"""
import os, random, sys, time
from pathlib import Path
from hstu_cute import cache as C

root, n = Path(sys.argv[1]), int(sys.argv[2])
c = C.ModuleCache(root, fingerprint_override="fp", arch="sm_80")
kdir = root / "fp" / "k"
entry = C._Entry("d", "sm_80", "K()", "p", kdir, kdir / "d.o", kdir / "d.json", kdir / "d.lock")
inside, overlaps, held = root / "inside", 0, 0
for _ in range(n):
    with c._flock(entry) as (locked, waited):  # no entry is written: every release removes the file
        held += locked
        try:
            os.close(os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            overlaps += 1
            continue
        time.sleep(random.random() * 2e-4)
        os.unlink(inside)
print(held, overlaps)
"""


def test_removed_lock_files_keep_mutual_exclusion(tmp_path):
    """Lock files are removed on release when no entry was written (a failed compile); processes
    racing on the same entry still never hold the lock together (cache._flock's inode check)."""
    root, n, procs = tmp_path / "cache", 300, 4
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ps = [subprocess.Popen([sys.executable, "-c", _LOCK_WORKER, str(root), str(n)], env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(procs)]
    outs = [p.communicate(timeout=120) for p in ps]
    assert all(p.returncode == 0 for p in ps), [err[-2000:] for _, err in outs]
    assert [tuple(map(int, out.split())) for out, _ in outs] == [(n, 0)] * procs
    assert not list(root.rglob("*.lock")) and not (root / "inside").exists()


def test_unexpected_error_traceback_has_no_ansi(monkeypatch, capsys):
    from hstu_cute import cli

    def boom(args, console):
        raise RuntimeError("\x1b[93mcoloured\x1b[0m failure")

    monkeypatch.setattr(cli, "cmd_bench", boom)
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert cli.main(["bench"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: coloured failure" in err
    assert ANSI not in err, repr(err)


def test_gpu_commands_stop_where_no_kernel_path_serves_the_gpu(monkeypatch):
    """demo and bench share the GPU prologue: a GPU no kernel path serves is one red line and
    exit status 1, before anything runs on it (the GPU is never touched, so this runs on CPU)."""
    import io

    from rich.console import Console

    from hstu_cute import arch, cli

    def refuse(dev):
        raise NotImplementedError(f"no kernels for {dev} [sm_75]")

    monkeypatch.setattr(arch, "kernel_path", refuse)
    for body, argv in ((cli._demo_gpu, ["demo"]), (cli._bench_gpu, ["bench"])):
        stream = io.StringIO()
        console = Console(file=stream, width=200, color_system=None)
        assert body(cli.build_parser().parse_args(argv), console, "cuda:0", "Old GPU") == 1
        assert stream.getvalue() == "NotImplementedError: no kernels for cuda:0 [sm_75]\n", stream.getvalue()
    monkeypatch.setattr(arch, "kernel_path", lambda dev: "hopper")
    monkeypatch.setattr(arch, "device_arch", lambda dev: "sm_90a")
    assert cli._gpu_kernel_path(Console(file=io.StringIO()), "cuda:0") == ("hopper", "sm_90a")


def test_piped_output_has_no_ansi_codes(tmp_path):
    # FORCE_COLOR / TTY_COMPATIBLE make rich colour a pipe; NO_COLOR unset: the pipe alone decides.
    env = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "NO_COLOR": ""}
    for args in (("info",), ("bench",), ("warmup", "--arch", "sm_75"), ("demo", "--window", "x")):
        proc = run_cli_proc(*args, cache_dir=tmp_path, timeout=120, extra_env=env)
        out = proc.stdout + proc.stderr
        assert proc.returncode == (0 if args[0] in ("info", "bench") else 2), out
        assert ANSI not in out, repr(out)
    assert "bench needs a CUDA GPU" in run_cli("bench", cache_dir=tmp_path, extra_env=env)


def test_console_colours_only_on_a_terminal(monkeypatch):
    import io

    from hstu_cute import cli

    class Tty(io.StringIO):
        def isatty(self):
            return True

    for tty, no_color, expect in ((False, "", False), (True, "", True), (True, "1", False)):
        stream = Tty() if tty else io.StringIO()
        monkeypatch.setattr(sys, "stdout", stream)
        monkeypatch.setenv("NO_COLOR", no_color)
        monkeypatch.setenv("FORCE_COLOR", "1")
        cli._console().print("[red]FAILED[/] 1.5 (x)")
        assert (ANSI in stream.getvalue()) is expect, (tty, no_color, stream.getvalue())


@pytest.mark.parametrize("cmd", ["info", "warmup", "demo", "bench"])
def test_every_help_shows_defaults(tmp_path, cmd):
    import argparse

    from hstu_cute.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices[cmd]
    fmt = sub._get_formatter()
    options = [a for a in sub._actions if a.help != argparse.SUPPRESS and a.nargs != 0]  # not -h, not flags
    assert len(options) == {"info": 0, "warmup": 9, "demo": 14, "bench": 3}[cmd]
    for action in options:  # every option that takes a value says its default
        assert "(default: " in fmt._expand_help(action), (action.option_strings, fmt._expand_help(action))
    out = run_cli(cmd, "--help", cache_dir=tmp_path, timeout=120)  # the real command line too
    assert "default" in out and ANSI not in out
    if cmd == "demo":
        flat = " ".join(out.split())
        assert "(default: 128,0)" in flat and "(default: causal)" in flat and "(default: sm_80)" in flat


def test_window_error_names_the_flag_once(tmp_path):
    proc = run_cli_proc("demo", "--window", "3", cache_dir=tmp_path, timeout=120)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "python -m hstu_cute demo: error: argument --window: expected LEFT,RIGHT (two ints, e.g. 128,0), " \
                   "got '3'", proc.stderr
    assert last.count("--window") == 1


def test_other_argparse_errors_name_the_flag_once(capsys):
    from hstu_cute.cli import main

    for argv, flag in ((["demo", "--batch", "0"], "--batch"), (["warmup", "--workers", "x"], "--workers"),
                       (["demo", "--window", "1,2,3"], "--window"), (["warmup", "--dtype", "fp8"], "--dtype")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.count(flag) == 1, last


def test_rab_is_described_by_heads():
    from hstu_cute.cli import _demo_describe, _demo_key, build_parser
    from hstu_cute.variants import shipped_keys
    from hstu_cute.warmup import describe_variant

    def demo(*argv):
        return build_parser().parse_args(["demo", *argv])

    args = demo("--rab-heads", "1", "--max-len", "64")
    key = _demo_key(args, "sm_80")
    assert key.has_rab and key.describe().endswith("causal,rab/8")  # the key's own label
    assert describe_variant(key, args.rab_heads).endswith(" causal, rab (1 head)")
    assert _demo_describe(args, [40, 64]).endswith("mask causal, rab (1 head)")
    args = demo("--rab-heads", "4", "--heads", "4", "--max-len", "63")
    key = _demo_key(args, "sm_86")
    assert describe_variant(key, 4).endswith(" causal, rab (4 heads, rows not 16-byte aligned)")
    assert _demo_describe(args, [40, 63]).endswith(", rab (4 heads)")
    assert describe_variant(_demo_key(args, "sm_90a"), 4).startswith("hopper_fwd sm_90a")
    assert "rab" not in _demo_describe(demo(), [512, 1024])
    # Every shipped variant: no load-width labels, and the rab variants stay distinct.
    keys = shipped_keys("sm_90a", ("bfloat16",), (128, 256))
    texts = [describe_variant(k) for k in keys]
    assert len(set(texts)) == len(set(keys))
    assert not [t for t in texts if re.search(r"rab/\d|\(sum\)|sum_heads", t)]
    assert any(t.endswith("rab+drab (1 rab head for all heads)") for t in texts)
    assert all(describe_variant(k) == k.describe() for k in keys if not k.has_rab)


def test_cli_points_at_docs_not_shared():
    for name in ("cli.py", "warmup.py"):
        text = (REPO / "hstu_cute" / name).read_text(encoding="utf-8")
        assert "shared/" not in text, name
    assert "docs/operator.md" in (REPO / "hstu_cute" / "cli.py").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# README / CI contract
# ---------------------------------------------------------------------------------------------
def _readme_block(marker: str) -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    m = re.search(rf"<!-- {marker} -->\s*```(?:bash|sh)?\n(.*?)```", text, re.S)
    assert m, f"README.md has no ```bash block after <!-- {marker} -->"
    return m.group(1).strip()


def test_readme_has_the_two_fresh_machine_commands():
    main_job = _readme_block("fresh-machine: main job")
    tests = _readme_block("fresh-machine: tests")
    for block in (main_job, tests):
        assert len(block.splitlines()) == 1, block
        assert "pip install torch==2.13.0" in block
    assert main_job.endswith("python -m hstu_cute demo")
    assert tests.endswith("pytest -q")


def test_ci_runs_the_readme_test_command():
    script = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert os.access(REPO / ".ci" / "run", os.X_OK)
    assert "set -euo pipefail" in script
    assert _readme_block("fresh-machine: tests") in script
