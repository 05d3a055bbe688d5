"""What a ``quant_mode`` means, decoded once: :class:`Fp8Recipe`.

This is the only module that reads the mode's number. Everything else (validation, the launchers,
the quantizer plan, the reference quantizers, the benchmarks) asks the recipe: whether P is
scaled, whether scales run along two directions, which scale groups a quantizer forms, which slot
quantizer launches a purpose takes, which descale tables the kernels read. A call carries its
recipe in its record (:class:`hstu_cute.validation.Problem`). Imports nothing heavy.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass


class QuantMode(enum.IntEnum):
    """The public ``quant_mode`` values with a quantizer (-1: none; pre-quantized e4m3 inputs
    take :data:`PRE_QUANTIZED`)."""

    CAST = 0
    TWO_DIRECTION = 1
    PER_BLOCK = 2
    PER_HEAD = 3
    PER_SEQUENCE = 4
    PER_TENSOR = 5


#: quant_mode of a call the op does not quantize: 16-bit inputs without FP8, or inputs that come
#: quantized already (float8_e4m3fn q, k, v).
PRE_QUANTIZED = -1


def is_quant_mode(value) -> bool:
    """``value`` is a public ``quant_mode``: an int (not a bool) in -1..5."""
    return isinstance(value, int) and not isinstance(value, bool) and PRE_QUANTIZED <= value <= max(QuantMode)


class ScaleGroup(enum.Enum):
    """Which elements of a (T, H, D) tensor share one scale."""

    NONE = "none"  # saturating cast, no scale (mode 0)
    TOKEN = "token"  # per (token, head) over D, plus per (block, head, dim) along tokens (mode 1)
    BLOCK = "block"  # per (block of 128 tokens from the sequence start, head) (mode 2)
    HEAD = "head"  # per (sequence, head)
    SEQUENCE = "sequence"  # per sequence
    TENSOR = "tensor"  # the whole batch


#: What the slot quantizer makes in one call, by purpose: "forward" (q, k, v -> e4m3 q, k and
#: V^T), "training" (q, k, v -> also the backward's Q^T, K^T and e4m3 V, from the same passes),
#: "gradient" (dO -> e4m3 dO and dO^T).
QUANT_PURPOSES = ("forward", "training", "gradient")

_GROUPS = {QuantMode.CAST: ScaleGroup.NONE, QuantMode.TWO_DIRECTION: ScaleGroup.TOKEN,
           QuantMode.PER_BLOCK: ScaleGroup.BLOCK, QuantMode.PER_HEAD: ScaleGroup.HEAD,
           QuantMode.PER_SEQUENCE: ScaleGroup.SEQUENCE, QuantMode.PER_TENSOR: ScaleGroup.TENSOR}


@dataclass(frozen=True)
class Fp8Recipe:
    """An FP8 call's recipe (hashable; part of the call record). ``mode`` is the public
    ``quant_mode`` (:data:`PRE_QUANTIZED` for e4m3 inputs)."""

    mode: int

    @property
    def quantizes(self) -> bool:
        """The op quantizes 16-bit inputs on the device (and can train)."""
        return self.mode != PRE_QUANTIZED

    @functools.cached_property
    def group(self) -> ScaleGroup | None:
        """The quantizers' scale groups (None: the inputs come quantized). Kept on the recipe
        (one per mode): an FP8 step asks 13 times, and the enum lookup cost ~2 us each on the
        host (tools/host.py standin --profile --mode 2, session 31)."""
        return _GROUPS[QuantMode(self.mode)] if self.quantizes else None

    @property
    def scaled_p(self) -> bool:
        """P is re-quantized per row with a running scale (fp8_format): every scaled mode; the
        pre-quantized entry and the plain cast take P cast."""
        return self.quantizes and self.group is not ScaleGroup.NONE

    @property
    def two_direction(self) -> bool:
        """q and k scaled per token, the token-contiguous copies per (block, dim): (T, H) and
        (B, blocks, H, 2, D) descale tables, a second quantizer launch for training."""
        return self.group is ScaleGroup.TOKEN

    @property
    def unit_descales(self) -> bool:
        """The kernels read (1,) descales (ones, or the pre-quantized inputs' own)."""
        return not self.scaled_p

    @property
    def grouped(self) -> bool:
        """Scales over whole sequences or more (modes 3-5): the quantizer is one cooperative
        launch (each group's scale, a grid barrier, the cast) writing into group tables."""
        return self.group in (ScaleGroup.HEAD, ScaleGroup.SEQUENCE, ScaleGroup.TENSOR)

    @property
    def fused_backward_serves(self) -> bool:
        """The fused FP8 backward kernel reads this recipe's tables (not mode 1's)."""
        return self.quantizes and not self.two_direction

    def group_table(self, batch: int, heads: int) -> tuple[int, tuple[int, int, int]]:
        """(words, (B, blocks, H) strides) of one tensor's group scales in a (B, blocks, H) view
        that every block of a group reads (zero strides along the dims a group spans)."""
        assert self.grouped, self
        return {ScaleGroup.HEAD: (batch * heads, (heads, 0, 1)),
                ScaleGroup.SEQUENCE: (batch, (1, 0, 0))}.get(self.group, (1, (0, 0, 0)))

    def table_family(self, role: str) -> str:
        """The scale table a slot of ``role`` writes: its own family for "token" / "column" /
        "unit", "group" for grouped recipes, else "block"."""
        if role in ("token", "column", "unit"):
            return role
        return "group" if self.grouped else "block"


@functools.lru_cache(maxsize=None)
def recipe(quant_mode: int) -> Fp8Recipe:
    """The recipe of a public ``quant_mode`` (-1: pre-quantized inputs), one object per mode."""
    return Fp8Recipe(int(quant_mode))


@functools.lru_cache(maxsize=None)
def quant_launches(mode: int, purpose: str) -> tuple:
    """The slot quantizer's launches of quant mode ``mode`` (0-5) for ``purpose``: each a tuple
    of slots ``(input, role, plain, transposed)``, ``input`` indexing the purpose's tensors (q,
    k, v; or dO). Grouped recipes (modes 3-5) take one cooperative launch of "group" slots (each
    tensor's scales, a grid barrier, its cast while L2 still holds it). Two-direction (mode 1)
    scales its token-contiguous copies along tokens, unlike its (T, H, D) ones, so its training
    call adds a launch for Q^T, K^T and e4m3 V, and its gradient call reads dO twice."""
    assert purpose in QUANT_PURPOSES and 0 <= mode <= 5
    group = _GROUPS[QuantMode(mode)]
    inputs = (0,) if purpose == "gradient" else (0, 1, 2)
    both = purpose != "forward"

    def copies(i):  # (plain, transposed): the forward reads V only as V^T
        return (True, both) if i < 2 or purpose == "gradient" else (both, True)

    if group is ScaleGroup.TOKEN:
        first = tuple((i, "token", True, False) if i < 2 or purpose == "gradient" else (i, "column", False, True)
                      for i in inputs)
        if purpose == "forward":
            return (first,)
        if purpose == "gradient":
            return (first + ((0, "column", False, True),),)
        return (first, ((0, "column", False, True), (1, "column", False, True), (2, "token", True, False)))
    if group in (ScaleGroup.NONE, ScaleGroup.BLOCK):
        return (tuple((i, "unit" if group is ScaleGroup.NONE else "fused", *copies(i)) for i in inputs),)
    return (tuple((i, "group", *copies(i)) for i in inputs),)
