"""Which GPU we run on and which kernel family serves it; the cubin archs we build for.

Imports torch only inside the functions that query a device, so that ``check_arch`` (used by
``warmup`` and the CLI before any compile) stays cheap.
"""

from __future__ import annotations

import functools
import os

#: Cubin targets the kernels are built and tested for. sm80 kernels (mma.sync) serve every one;
#: the Hopper kernels (TMA + WGMMA) need the arch-specific ``sm_90a``.
SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_87", "sm_89", "sm_90a")

_AMPERE_NAMES = ("sm80", "sm86", "sm87", "sm89", "ampere")
_HOPPER_NAMES = ("sm90", "sm90a", "hopper")


def check_arch(arch: object, name: str = "--arch") -> str:
    """``arch`` if it is one of :data:`SUPPORTED_ARCHS`, else a ``ValueError`` naming ``name``,
    the valid archs and, for a near miss such as ``sm_90`` or ``sm90a``, the arch meant."""
    if arch in SUPPORTED_ARCHS:
        return arch
    text = str(arch).strip().lower()
    guess = text if text.startswith("sm_") else "sm_" + text.removeprefix("sm")
    if guess + "a" in SUPPORTED_ARCHS:
        guess += "a"
    hint = f" (did you mean {guess}?)" if guess in SUPPORTED_ARCHS else ""
    raise ValueError(f"{name}: expected one of {', '.join(SUPPORTED_ARCHS)}, got {arch!r}{hint}")


def has_hopper_kernels(arch: str) -> bool:
    """Whether the Hopper kernels exist for the cubin arch ``arch`` (``"sm_90a"``, ...)."""
    return arch.startswith("sm_90")


def _index(device) -> int:
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _arch_of_index(index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}" + ("a" if major == 9 else "")


@functools.lru_cache(maxsize=None)
def _sms_of_index(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def device_arch(device) -> str:
    """The cubin target for a device: 'sm_80', 'sm_86', 'sm_89', 'sm_90a', ..."""
    return _arch_of_index(_index(device))


def num_sms(device) -> int:
    """Streaming multiprocessors of ``device``: the persistent kernels launch one CTA per SM."""
    return _sms_of_index(_index(device))


def forced_path() -> str | None:
    """The kernel family ``HSTU_CUTE_ARCH`` forces: 'ampere' for an sm80-class name, 'hopper' for
    an sm90 one, None when unset. It takes ``--arch``'s names (``sm_80``, ``sm_86``, ``sm_89``,
    ``sm_90a``) and the short aliases (``sm80``, ``sm90``, ``ampere``, ``hopper``); anything else is
    a ``ValueError`` naming the variable (raised by validation at a call's first use, and shown
    by ``info``)."""
    return _forced_path(os.environ.get("HSTU_CUTE_ARCH", ""))


def _forced_path(setting: str) -> str | None:
    # Not cached: validation calls it while torch.compile traces, and Dynamo warns on lru_cache.
    forced = setting.strip().lower().replace("_", "")
    if not forced:
        return None
    if forced in _AMPERE_NAMES:
        return "ampere"
    if forced in _HOPPER_NAMES:
        return "hopper"
    raise ValueError(f"HSTU_CUTE_ARCH: expected one of sm_80, sm_86, sm_89, sm_90a (or the aliases sm80, sm90); "
                     f"got {forced!r}")


def kernel_path(device) -> str:
    """Which kernel family serves this device: 'hopper' (TMA + WGMMA) on sm90, 'ampere'
    (mma.sync) on sm80-sm89.

    ``HSTU_CUTE_ARCH`` forces a path (:func:`forced_path`): an sm80-class arch (the mma.sync
    kernels, on any sm80+ GPU) or sm90 (the Hopper kernels; only on a compute capability 9.x
    device).
    """
    # One lookup per call: the environment may change between calls (tests, notebooks).
    return _kernel_path(os.environ.get("HSTU_CUTE_ARCH", ""), _index(device))


@functools.lru_cache(maxsize=64)
def _kernel_path(setting: str, index: int) -> str:
    import torch

    forced = _forced_path(setting)
    if forced == "ampere":
        return "ampere"
    major, minor = torch.cuda.get_device_capability(index)
    if forced == "hopper":
        if major != 9:
            raise NotImplementedError(
                f"HSTU_CUTE_ARCH=sm90 selects the Hopper (TMA + WGMMA) kernels, which need compute capability "
                f"9.x; device cuda:{index} has {major}.{minor} (unset HSTU_CUTE_ARCH or set it to sm80)"
            )
        return "hopper"
    if major < 8:
        raise NotImplementedError(
            f"hstu_cute needs compute capability >= 8.0 (Ampere); device cuda:{index} has {major}.x"
        )
    return "hopper" if major == 9 else "ampere"
