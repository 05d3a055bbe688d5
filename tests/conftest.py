"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["ampere", "hopper"])
def path(request, monkeypatch):
    """The forward kernel path under test ('ampere': mma.sync, any sm80+ GPU; 'hopper': TMA + WGMMA,
    compute capability 9.x only, skipped elsewhere). Also forced through HSTU_CUTE_ARCH, so calls of
    ``hstu_attn_varlen_func`` take it too. For GPU tests only (queries the device)."""
    import torch

    from hstu_cute import arch

    name = request.param
    if name == "hopper" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper kernels need a compute capability 9.x GPU")
    monkeypatch.setenv("HSTU_CUTE_ARCH", {"ampere": "sm80", "hopper": "sm90"}[name])
    arch._kernel_path.cache_clear()
    assert arch.kernel_path(torch.device("cuda", torch.cuda.current_device())) == name
    yield name
    arch._kernel_path.cache_clear()
