"""``python -m hstu_cute`` on a machine without a GPU (run with the GPU hidden, so these test the
no-GPU paths everywhere), plus the package's import weight and the README / CI contract."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args, cache_dir: Path, timeout: float = 300, extra_env: dict | None = None):
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
    proc = subprocess.run([sys.executable, "-m", "hstu_cute", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
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


def test_help_lists_commands(tmp_path):
    out = run_cli("--help", cache_dir=tmp_path)
    for cmd in ("info", "warmup", "demo", "bench"):
        assert cmd in out


def test_demo_without_gpu(tmp_path):
    out = run_cli("demo", "--batch", "2", "--max-len", "32", "--heads", "2", "--head-dim", "64",
                  cache_dir=tmp_path)
    assert "No CUDA GPU found" in out
    assert re.search(r"compiled in [\d.]+ (s|ms)", out), out  # the demo's variant was compiled for sm_80
    assert "ampere_fwd sm_80 bfloat16 d64" in out
    assert "q.device: expected a CUDA device" in out  # the checks ran and only the device one failed
    assert "Oracle" in out and "all finite: True" in out
    assert "Skipped (needs a CUDA GPU)" in out
    for skipped in ("running the compiled kernel", "checking its output against the oracle", "CUDA events"):
        assert skipped in out
    assert list(tmp_path.rglob("*.o")), "the demo's variant should be in the disk cache"


def test_bench_without_gpu_exits_cleanly(tmp_path):
    out = run_cli("bench", cache_dir=tmp_path, timeout=120)
    assert "bench needs a CUDA GPU" in out and "Nothing was timed" in out and "Skipped" in out


WARMUP_ARGS = ("warmup", "--arch", "sm_80", "--head-dim", "64", "--dtype", "bfloat16", "--mask", "causal",
               "--mask", "target", "--no-rab", "--kernels", "fwd", "--workers", "2")


def test_warmup_compiles_then_hits_disk(tmp_path):
    out = run_cli(*WARMUP_ARGS, cache_dir=tmp_path)
    assert "2 variants for sm_80: 2 compiled, 0 disk hits" in out, out
    assert "ampere_fwd sm_80 bfloat16 d64 128x128w4s2 causal+context+target" in out
    objs = sorted(tmp_path.rglob("*.o"))
    assert len(objs) == 2
    out = run_cli(*WARMUP_ARGS, cache_dir=tmp_path)
    assert "2 variants for sm_80: 0 compiled, 2 disk hits" in out, out
    assert sorted(tmp_path.rglob("*.o")) == objs
    out = run_cli("info", cache_dir=tmp_path)
    assert "cached entries" in out and re.search(r"cached entries\s*│?\s*2 ", out), out
    assert "causal+context+target" in out


def test_warmup_select_keys_filters():
    from hstu_cute.cli import select_keys

    # Backward: 2 dtypes x 4 head dims x 4 masks x (4 dQ + 2 dK/dV variants).
    assert len(select_keys("sm_80")) == 96 + 192
    assert len(select_keys("sm_80", kernels="fwd")) == 96
    assert len(select_keys("sm_80", kernels="bwd")) == 192
    assert len(select_keys("sm_80", head_dims=[256], kernels="bwd")) == 2 * 4 * 6
    keys = select_keys("sm_80", ["bfloat16"], [64], ["causal", "target"], "none", kernels="fwd")
    assert [k.describe().split()[-1] for k in keys] == ["causal", "causal+context+target"]
    assert all(k.arch == "sm_80" and k.head_dim == 64 and not k.has_rab for k in keys)
    assert len(select_keys("sm_86", head_dims=[32], rab="only", kernels="fwd")) == 2 * 4 * 2
    assert len(select_keys("sm_86", head_dims=[32], rab="only", kernels="bwd")) == 2 * 4 * 4
    assert len(select_keys("sm_80", limit=5)) == 5
    # sm_90a: the Hopper forward and backward kernels too (hstu_cute.variants.shipped_keys): the
    # fused D128 kernel (16), the deterministic pair (96) and at D256 the wide dK/dV/drab kernel
    # (2 dtypes x 4 masks x 4 rab/drab modes) with its dQ kernel (16).
    assert len(select_keys("sm_90a")) == 96 + 192 + 64 + 96 + 16 + 32 + 16
    assert len(select_keys("sm_90a", kernels="fwd")) == 96 + 64
    assert len(select_keys("sm_90a", kernels="bwd")) == 192 + 96 + 16 + 32 + 16
    keys = select_keys("sm_90a", ["bfloat16"], [128], ["causal"], "none", kernels="fwd")
    assert [k.kernel_name for k in keys] == ["ampere_fwd", "hopper_fwd"]
    assert not any(k.kernel_name == "hopper_fwd" for k in select_keys("sm_89"))


def test_key_variant_parses_every_key_class():
    from hstu_cute.cli import _key_variant
    from hstu_cute.variants import shipped_keys

    keys = shipped_keys("sm_90a", ("float16",), (64,))
    assert {k.kernel_name for k in keys} == {"ampere_fwd", "ampere_bwd_dq", "ampere_bwd_dkdv", "hopper_fwd",
                                             "hopper_bwd_dkdv", "hopper_bwd_dq"}
    for k in keys:
        assert _key_variant(repr(k)) == k.describe()
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
