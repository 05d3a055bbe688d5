"""Compile-only CI test: every shipped variant (forward and backward) compiles for sm_80, and every
Hopper forward variant for sm_90a, on a machine without a GPU.

``hstu_cute.warmup`` compiles each key of ``shipped_keys("sm_80")`` with
``hstu_cute.compile.build`` in worker processes (one per CI core) into a module cache; each
variant must produce a module, exported to disk. Runs by default (CI must run it) and takes
20-55 minutes on 2 cores when nothing is cached; ``pytest -m "not slow"`` skips it for a quick
local run.

The cache is a fresh temporary directory, unless ``HSTU_CUTE_TEST_CACHE_DIR`` names a lasting one
(``.ci/run`` does): then a variant whose entry is there under its current fingerprint (same key,
same kernel sources, same DSL / tvm-ffi / Python) is loaded instead of compiled. That entry was
exported by a compile of exactly that key and fingerprint, and loading it checks its sidecar
(key, fingerprint, versions, arch, sha256, size) and that the object loads, so every shipped
variant is still known to compile. The terminal summary says how many were compiled and reused.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from hstu_cute import warmup
from hstu_cute.cache import ModuleCache, reset_default_cache
from hstu_cute.masks import MaskKind
from hstu_cute.variants import (
    DTYPES,
    SHIPPED_MASKS,
    make_bwd_keys,
    shipped_ampere_bwd_keys,
    shipped_ampere_fwd_keys,
    shipped_ampere_paged_fwd_keys,
    shipped_hopper_bwd_keys,
    shipped_hopper_fp8_bwd_keys,
    shipped_hopper_fp8_fwd_keys,
    shipped_hopper_fwd_keys,
    shipped_hopper_paged_fwd_keys,
)


#: A lasting cache directory for these tests (CI), else each test gets a fresh temporary one.
SHARED_DIR_ENV = "HSTU_CUTE_TEST_CACHE_DIR"


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch, compile_tally):
    """The default cache (worker processes inherit the env) in ``$HSTU_CUTE_TEST_CACHE_DIR`` or a
    fresh temporary directory."""
    shared = os.environ.get(SHARED_DIR_ENV)
    root = Path(shared).expanduser() if shared else tmp_path / "cache"
    monkeypatch.setenv("HSTU_CUTE_CACHE_DIR", str(root))
    monkeypatch.delenv("HSTU_CUTE_CACHE", raising=False)
    reset_default_cache()
    compile_tally.dirs.add(str(root))
    yield root
    reset_default_cache()


def _sources_allowed():
    """Where a variant's module may come from: a compile, or (lasting cache) a verified entry."""
    return ("compile", "disk") if os.environ.get(SHARED_DIR_ENV) else ("compile",)


def _assert_all_built(results, keys, cache_dir, arch, tally):
    assert [r["key"] for r in results] == keys
    tally.add(results)
    failed = [f"{r['variant']}: {r['error']}" for r in results if not r["ok"]]
    assert not failed, "variants that failed to compile:\n" + "\n".join(failed)
    for r in results:
        assert r["source"] in _sources_allowed(), r
    wanted = {repr(k) for k in keys}
    entries = [e for e in ModuleCache(cache_dir).entries() if e["key"] in wanted]
    assert len(entries) == len(keys)
    assert all(e["valid"] and e["arch"] == arch and e["size"] > 0 for e in entries), entries
    assert {e["key"] for e in entries} == wanted


@pytest.mark.slow
def test_every_shipped_sm80_variant_compiles(tmp_cache, compile_tally):
    keys = shipped_ampere_fwd_keys("sm_80") + shipped_ampere_bwd_keys("sm_80") + shipped_ampere_paged_fwd_keys("sm_80")
    # The forward (96 + 32 split-key), the backward (192), the paged forward (32 + 32 split-key).
    assert len(keys) == len(set(keys)) == 96 + 32 + 192 + 32 + 32
    results = warmup(arch="sm_80", workers=2, raise_errors=False)
    _assert_all_built(results, keys, tmp_cache, "sm_80", compile_tally)
    # Each exported object holds an sm_80 cubin.
    for r in results:
        if r["path"]:
            assert b"sm_80" in Path(r["path"]).read_bytes()


@pytest.mark.slow
def test_every_hopper_variant_compiles(tmp_cache, compile_tally):
    """Every Hopper (TMA + WGMMA) variant the API can select on sm90 (forward; fused dK/dV/dQ at
    D128; the deterministic dK/dV + dQ pair; at D256 the wide dK/dV/drab kernel and its dQ
    kernel; the FP8 kernels, the opt-in fused FP8 backward included) builds for sm_90a."""
    keys = (shipped_hopper_fwd_keys("sm_90a") + shipped_hopper_bwd_keys("sm_90a") + shipped_hopper_fp8_fwd_keys()
            + shipped_hopper_paged_fwd_keys() + shipped_hopper_fp8_bwd_keys())
    # FP8 (bf16 side only, variants.FP8_SHIPPED_DTYPES): the forward with P cast, scaled P and
    # scaled P with mode 1's descales (72), V^T of e4m3 V (3), the slot quantizers of quant modes
    # 0-5 (36); the paged KV-cache forward (32); the split-key forward, contiguous and paged (32
    # each); the FP8 backward pair (32) and its dQ kernels that write drab (16), at D64/128 and D256
    # (24 more), each for quant modes 0, 2-5 and for mode 1; the fused FP8 backward at D128 (4, opt-in).
    assert len(keys) == len(set(keys)) == (64 + 96 + 16 + 32 + 16 + 72 + 3 + 36 + 32 + 32 + 32
                                           + 2 * (32 + 16 + 24) + 4)
    assert sum(getattr(k, "two_direction", False) for k in keys if k.kernel_name.startswith("hopper_bwd_fp8")) == 72
    assert all(k.out_dtype == "bfloat16" for k in keys if "fp8" in k.kernel_name)
    assert all(k.dtype == "bfloat16" for k in keys if k.kernel_name == "hopper_fwd_quant_slots")
    assert sum(k.kernel_name.startswith("hopper_fwd") and getattr(k, "split_keys", False) for k in keys) == 64
    assert {k.kernel_name for k in keys} == {"hopper_fwd", "hopper_bwd_fused", "hopper_bwd_dkdv", "hopper_bwd_dq",
                                             "hopper_bwd_wide", "hopper_fwd_fp8", "hopper_fwd_vt",
                                             "hopper_fwd_quant_slots", "hopper_fwd_paged",
                                             "hopper_bwd_fp8_dkdv",
                                             "hopper_bwd_fp8_dq", "hopper_bwd_fp8_fused"}
    results = warmup(arch="sm_90a", keys=keys, workers=2, raise_errors=False)
    _assert_all_built(results, keys, tmp_cache, "sm_90a", compile_tally)
    for r in results:
        if r["path"]:
            archs = set(re.findall(rb"sm_[0-9]+a?", Path(r["path"]).read_bytes()))
            assert archs == {b"sm_90a"}, (r["variant"], archs)


def test_one_sm90a_variant_compiles(tmp_cache, compile_tally):
    """The Ampere (mma.sync) kernel is also what runs on H100: it must build for sm_90a."""
    key = dataclasses.replace(shipped_ampere_fwd_keys("sm_80", ("bfloat16",), (128,))[6], arch="sm_90a")
    assert key.has_rab is False and key.describe().endswith("causal")
    results = warmup(arch="sm_90a", keys=[key], workers=1)
    _assert_all_built(results, [key], tmp_cache, "sm_90a", compile_tally)
    r = results[0]
    assert r["source"] in _sources_allowed() and r["path"]
    archs = set(re.findall(rb"sm_[0-9]+a?", Path(r["path"]).read_bytes()))
    assert archs == {b"sm_90a"}, archs


@pytest.mark.slow
def test_fp8_early_silu_variants_compile(tmp_cache, compile_tally):
    """The P-cast FP8 forward with its SiLU ahead of the mask (``early_silu``) ships at D256 without
    rab only (it measured even at D128 and slower at D64: docs/dev/perf-log.md session 23); the other
    head dims, with and without rab, stay buildable for the tile sweep (``:es``), and the flag is
    refused for scaled P."""
    base = [k for k in shipped_hopper_fp8_fwd_keys() if k.kernel_name == "hopper_fwd_fp8" and not k.scaled_p
            and k.out_dtype == "bfloat16" and k.mask_kind == int(MaskKind.CAUSAL) and not k.has_target]
    shipped = [k for k in base if k.early_silu]
    assert [(k.head_dim, k.has_rab) for k in shipped] == [(256, False)]
    keys = [dataclasses.replace(k, early_silu=True) for k in base if not k.early_silu]
    assert len(keys) == 5 and all(k.describe().endswith(" early-SiLU") for k in keys)
    results = warmup(arch="sm_90a", keys=keys, workers=2, raise_errors=False)
    _assert_all_built(results, keys, tmp_cache, "sm_90a", compile_tally)
    scaled = next(k for k in shipped_hopper_fp8_fwd_keys() if k.kernel_name == "hopper_fwd_fp8" and k.scaled_p)
    with pytest.raises(AssertionError, match="early_silu is for P cast"):
        dataclasses.replace(scaled, early_silu=True)


def test_sm80_d256_backward_keys_shipped():
    """The sm80 backward at head dim 256: the dQ (+drab) and dK/dV keys that the launcher picks,
    for both dtypes and every shipped mask and rab/drab mode, are in the shipped list (what
    warmup and CI compile)."""
    shipped = [k for k in shipped_ampere_bwd_keys("sm_80") if k.head_dim == 256]
    assert len(shipped) == len(set(shipped)) == 2 * 4 * 6
    for dtype in DTYPES:
        for kind, context_target in SHIPPED_MASKS:
            for has_rab, has_drab, sum_heads in ((False, False, False), (True, False, False), (True, True, False),
                                                 (True, True, True)):
                dq, dkdv = make_bwd_keys("sm_80", dtype, 256, kind, context_target, has_rab, has_drab, sum_heads)
                assert dq in shipped and dkdv in shipped, (dq, dkdv)
                # Split along the head dim: no warp holds 16 x 256 fp32 accumulators.
                assert dq.warps_d > 1 and dkdv.warps_d > 1


def test_sm80_d256_backward_compiles(tmp_cache, compile_tally):
    """Both D256 backward kernels build for sm_80 without a GPU: the largest variants (fp16,
    contexts and targets, rab; the dQ kernel with drab summed over heads)."""
    from hstu_cute.masks import MaskKind

    keys = list(make_bwd_keys("sm_80", "float16", 256, MaskKind.CAUSAL, True, True, True, True))
    results = warmup(arch="sm_80", keys=keys, workers=1)
    _assert_all_built(results, keys, tmp_cache, "sm_80", compile_tally)


@pytest.mark.slow
def test_func_variants_compile(tmp_cache, compile_tally):
    """FBGEMM's ``func`` masks are compiled on first use (not shipped); their code must still build
    without a GPU: the per-block table for n_func 1 and 3, every kernel family a 16-bit D128
    func call can take (sm80 forward, dQ, dK/dV; Hopper forward, fused backward, the deterministic
    dQ + dK/dV pair), and the FP8 scaled-P forward with its backward pair."""
    from hstu_cute.variants import (make_func_table_key, make_fwd_key, make_hopper_bwd_key, make_hopper_fp8_bwd_key,
                                    make_hopper_fp8_fwd_key, make_hopper_fwd_key)

    func = int(MaskKind.FUNC)
    sm80 = [make_func_table_key("sm_80", 1), make_func_table_key("sm_80", 3),
            make_fwd_key("sm_80", "bfloat16", 128, func, False, False, 8),
            *make_bwd_keys("sm_80", "bfloat16", 128, func, False, False, False, False)]
    sm90 = [make_func_table_key("sm_90a", 3), make_hopper_fwd_key("sm_90a", "bfloat16", 128, func, False, False),
            *(make_hopper_bwd_key(role, "sm_90a", "bfloat16", 128, func, False, False) for role in ("fused", "dq", "dkdv")),
            # FP8 (FBGEMM's HSTU8Test draws func masks): the scaled-P forward and the backward pair.
            make_hopper_fp8_fwd_key("sm_90a", "bfloat16", 128, func, False, False, scaled_p=True),
            *(make_hopper_fp8_bwd_key(role, "sm_90a", "bfloat16", 128, func, False, False) for role in ("dq", "dkdv"))]
    for arch, keys in (("sm_80", sm80), ("sm_90a", sm90)):
        assert all(k.mask_kind == func for k in keys)
        results = warmup(arch=arch, keys=keys, workers=2, raise_errors=False)
        _assert_all_built(results, keys, tmp_cache, arch, compile_tally)


@pytest.mark.slow
def test_semi_local_variants_compile(tmp_cache, compile_tally):
    """A causal band with contexts and targets (mask kind LOCAL with contexts/targets, compiled on
    first use, not shipped) builds without a GPU: the Hopper forward, its paged forward, its fused
    backward and deterministic pair at D128, and the sm80 forward, paged forward and backward pair."""
    from hstu_cute.variants import (make_ampere_paged_fwd_key, make_fwd_key, make_hopper_bwd_key, make_hopper_fwd_key,
                                    make_hopper_paged_fwd_key)

    local = int(MaskKind.LOCAL)
    sm90 = [make_hopper_fwd_key("sm_90a", "bfloat16", 128, local, True, False),
            make_hopper_paged_fwd_key("sm_90a", "bfloat16", 128, local, True, True),
            *(make_hopper_bwd_key(role, "sm_90a", "bfloat16", 128, local, True, False)
              for role in ("fused", "dq", "dkdv"))]
    sm80 = [make_fwd_key("sm_80", "bfloat16", 128, local, True, False, 8),
            make_ampere_paged_fwd_key("sm_80", "bfloat16", 128, local, True, True, 8),
            *make_bwd_keys("sm_80", "bfloat16", 128, local, True, False, False, False)]
    for arch, keys in (("sm_90a", sm90), ("sm_80", sm80)):
        assert all(k.mask.semi_local for k in keys if hasattr(k, "mask")), keys
        results = warmup(arch=arch, keys=keys, workers=2, raise_errors=False)
        _assert_all_built(results, keys, tmp_cache, arch, compile_tally)


@pytest.mark.slow
def test_block_sparse_variants_compile(tmp_cache, compile_tally):
    """The block-sparse Hopper kernels (compiled on first use, not shipped) build without a GPU:
    the forward causal with contexts and targets (the list walk inside the mask's range and the
    target hole), with no mask and on 64 x 64 tiles (64-row blocks), and the fused backward, D128 bf16; the sm80 forward and its
    dQ (+ drab summed over heads) / dK/dV pair."""
    from hstu_cute.variants import (block_sparse_hopper_fwd_tiles, make_fwd_key, make_hopper_bwd_key,
                                    make_hopper_fwd_key)

    keys = [make_hopper_fwd_key("sm_90a", "bfloat16", 128, int(kind), ct, False, block_sparse=True)
            for kind, ct in ((MaskKind.CAUSAL, True), (MaskKind.NONE, False))]
    # 64-row blocks (NSA's selection): 64 x 64 tiles (variants.block_sparse_hopper_fwd_tiles).
    keys.append(make_hopper_fwd_key("sm_90a", "bfloat16", 128, int(MaskKind.CAUSAL), False, False,
                                    block_sparse_hopper_fwd_tiles(128, False, 64, 64), block_sparse=True))
    keys.append(make_hopper_bwd_key("fused", "sm_90a", "bfloat16", 128, int(MaskKind.CAUSAL), True, False,
                                    block_sparse=True))
    assert all(k.describe().endswith("block-sparse") for k in keys)
    results = warmup(arch="sm_90a", keys=keys, workers=2, raise_errors=False)
    _assert_all_built(results, keys, tmp_cache, "sm_90a", compile_tally)
    sm80 = [make_fwd_key("sm_80", "bfloat16", 128, int(MaskKind.CAUSAL), True, False, 8, block_sparse=True),
            *make_bwd_keys("sm_80", "bfloat16", 128, int(MaskKind.CAUSAL), True, True, True, True, block_sparse=True)]
    results = warmup(arch="sm_80", keys=sm80, workers=1, raise_errors=False)
    _assert_all_built(results, sm80, tmp_cache, "sm_80", compile_tally)


@pytest.mark.slow
def test_jit_head_dims_compile(tmp_cache, compile_tally):
    """Head dims 96 and 192 (compiled on first use, not shipped; ``warmup --unshipped`` lists them)
    build without a GPU: the Hopper forward with and without rab, its paged forward, the dK/dV + dQ
    pair; the sm80 forward and its pair with drab."""
    from hstu_cute.variants import (jit_only_keys, make_fwd_key, make_hopper_bwd_key, make_hopper_fwd_key,
                                    make_hopper_paged_fwd_key)

    causal, target = int(MaskKind.CAUSAL), True
    sm90 = [make_hopper_fwd_key("sm_90a", "bfloat16", 96, causal, False, False),
            make_hopper_fwd_key("sm_90a", "bfloat16", 96, causal, target, True),
            make_hopper_fwd_key("sm_90a", "float16", 192, causal, target, False),
            make_hopper_fwd_key("sm_90a", "bfloat16", 192, int(MaskKind.LOCAL), False, True),
            make_hopper_paged_fwd_key("sm_90a", "bfloat16", 96, causal, target, False),
            make_hopper_paged_fwd_key("sm_90a", "bfloat16", 192, causal, False, False),
            *(make_hopper_bwd_key(role, "sm_90a", "bfloat16", d, causal, target, False)
              for d in (96, 192) for role in ("dkdv", "dq"))]
    sm80 = [make_fwd_key("sm_80", "bfloat16", 96, causal, target, True, 8),
            make_fwd_key("sm_80", "float16", 192, causal, False, False, 8),
            *make_bwd_keys("sm_80", "bfloat16", 192, causal, target, True, True, False)]
    for arch, keys in (("sm_90a", sm90), ("sm_80", sm80)):
        assert set(keys) <= set(jit_only_keys(arch)), [k for k in keys if k not in set(jit_only_keys(arch))]
        results = warmup(arch=arch, keys=keys, workers=2, raise_errors=False)
        _assert_all_built(results, keys, tmp_cache, arch, compile_tally)
