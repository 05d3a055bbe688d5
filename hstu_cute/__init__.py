"""hstu-cute: HSTU (SiLU, jagged) attention for NVIDIA GPUs in the CUTLASS CuTe DSL.

``hstu_attn_varlen_func`` is the FBGEMM-compatible entry point (the contract:
docs/operator.md); ``warmup`` precompiles kernel variants into the module cache
(works without a GPU). ``python -m hstu_cute --help`` lists the command-line tools.

Importing this package is cheap: torch and the CuTe DSL (cutlass) are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# warmup.py imports only the standard library. Importing the function here (rather than
# lazily) also makes it win over the submodule of the same name as the package attribute.
from .warmup import warmup

try:
    from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        __version__ = _version("hstu-cute")
    except _PackageNotFoundError:
        __version__ = "0.1.0"
except ImportError:  # pragma: no cover
    __version__ = "0.1.0"

__all__ = ["hstu_attn_varlen_func", "warmup", "__version__", "HSTUAttention", "HSTUBlock", "hstu_attn_padded",
           "to_jagged", "to_padded", "BlockMask", "HSTUSparseBlock"]

# Names loaded on first use: public name -> the submodule that defines it.
_LAZY = {"HSTUAttention": "nn", "HSTUBlock": "nn", "hstu_attn_padded": "padded", "to_jagged": "padded",
         "to_padded": "padded", "BlockMask": "block_mask", "HSTUSparseBlock": "nsa"}

if TYPE_CHECKING:  # pragma: no cover
    from .api import hstu_attn_varlen_func
    from .block_mask import BlockMask
    from .nn import HSTUAttention, HSTUBlock
    from .nsa import HSTUSparseBlock
    from .padded import hstu_attn_padded, to_jagged, to_padded


def __getattr__(name: str) -> Any:
    if name == "hstu_attn_varlen_func":
        from .api import hstu_attn_varlen_func

        globals()[name] = hstu_attn_varlen_func
        return hstu_attn_varlen_func
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
