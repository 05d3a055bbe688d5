"""Shared fixtures."""

from __future__ import annotations

import os

import pytest
import torch

# The DSL settles its target arch when cutlass is first imported, and a machine without a GPU has
# none to detect. tests/test_cache.py compiles for sm_80 and sets this before its own imports,
# which held only while no earlier test module imported cutlass (test_tile_scheduler.py run
# before it broke ten of its tests): set it once for the whole CPU session instead.
if "CUTE_DSL_ARCH" not in os.environ and not torch.cuda.is_available():
    os.environ["CUTE_DSL_ARCH"] = "sm_80"


class CompileTally:
    """How the compile tests got their variants' modules: compiled, or reused from a lasting
    cache (``HSTU_CUTE_TEST_CACHE_DIR``: a verified entry of the same key and fingerprint)."""

    def __init__(self):
        self.compiled = self.reused = self.failed = 0
        self.compile_s = 0.0
        self.dirs: set[str] = set()

    def add(self, results) -> None:
        for r in results:
            if not r["ok"]:
                self.failed += 1
            elif r["source"] == "compile":
                self.compiled += 1
                self.compile_s += r["seconds"]
            else:
                self.reused += 1


_TALLY = pytest.StashKey[CompileTally]()


@pytest.fixture
def compile_tally(request) -> CompileTally:
    stash = request.config.stash
    if _TALLY not in stash:
        stash[_TALLY] = CompileTally()
    return stash[_TALLY]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tally = config.stash.get(_TALLY, None)
    if tally is None or not (tally.compiled or tally.reused or tally.failed):
        return
    terminalreporter.write_line(
        f"hstu_cute compile tests: {tally.compiled} variants compiled ({tally.compile_s:.0f} s of compiles), "
        f"{tally.reused} reused from the module cache (verified entries of the same key and fingerprint), "
        f"{tally.failed} failed; cache: {', '.join(sorted(tally.dirs)) or '?'}"
    )


@pytest.fixture(params=["ampere", "hopper"])
def path(request, monkeypatch):
    """The forward kernel path under test ('ampere': mma.sync, any sm80+ GPU; 'hopper': TMA + WGMMA,
    compute capability 9.x only, skipped elsewhere). Also forced through HSTU_CUTE_ARCH, so calls of
    ``hstu_attn_varlen_func`` take it too. For GPU tests only (queries the device)."""
    from hstu_cute import arch

    name = request.param
    if name == "hopper" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper kernels need a compute capability 9.x GPU")
    monkeypatch.setenv("HSTU_CUTE_ARCH", {"ampere": "sm80", "hopper": "sm90"}[name])
    arch._kernel_path.cache_clear()
    assert arch.kernel_path(torch.device("cuda", torch.cuda.current_device())) == name
    yield name
    arch._kernel_path.cache_clear()
