"""The call record: one immutable description of a validated call, built once by
:func:`hstu_cute.api.hstu_attn_varlen_func` (through :mod:`hstu_cute.validation`), carried to the
launchers and saved for the backward.

A :class:`Call` holds everything but the autograd inputs (q, k, v, rab): the static description
the kernels are selected from (:class:`~hstu_cute.validation.Problem`, FP8 recipe included), the
per-sequence tensors, the score scalars, the paged cache's tables. Adding an argument is one field
here plus its use.

The ``torch.library`` ops take the call flat (their schemas); :data:`OP_FIELDS` is the one list of
those arguments, the schemas are written from it, and :func:`op_arguments` /
:func:`call_of_op_arguments` convert at that boundary only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .block_mask import BlockMask
from .validation import Problem, problem_of_op_args


class PagedTables(NamedTuple):
    """A paged KV cache ahead of each sequence's new keys (docs/operator.md, "Paged KV cache")."""

    kv_cache: torch.Tensor
    page_offsets: torch.Tensor
    page_ids: torch.Tensor
    last_page_lens: torch.Tensor


class Call(NamedTuple):
    """A validated call, without its autograd inputs (q, k, v, rab). Immutable; fields are read
    by name. ``plans`` is the launchers' cache of prepared launches for every call of this
    argument signature (one dict shared by the calls of a signature; None: prepare per call).
    A named tuple: built on every call, where a frozen dataclass's field-by-field ``__init__``
    costs several microseconds more on the host (docs/dev/perf-log.md, session 28)."""

    problem: Problem
    seq_offsets_q: torch.Tensor
    seq_offsets_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    num_contexts: torch.Tensor | None = None
    num_targets: torch.Tensor | None = None
    seqused_q: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    target_group_size: int = 1
    alpha: float = 1.0
    has_drab: bool = False
    deterministic: bool = False
    # Pre-quantized e4m3 inputs: the (1,) fp32 descales of q, k, v (None: 1).
    descales: tuple = (None, None, None)
    paged: PagedTables | None = None
    plans: dict | None = None
    # FBGEMM's arbitrary mask (1, n_func, T_q + 256) int32 (problem.mask.kind is FUNC), or None.
    func: torch.Tensor | None = None
    # A block-sparse mask (hstu_cute.BlockMask), or None.
    block_mask: BlockMask | None = None

    @property
    def block_count(self) -> torch.Tensor | None:
        return self.block_mask.kv_count if self.block_mask is not None else None

    @property
    def block_index(self) -> torch.Tensor | None:
        return self.block_mask.kv_index if self.block_mask is not None else None


# ---------------------------------------------------------------------------------------------
# The op boundary: the flat arguments of hstu_cute::fwd / bwd / fwd_fp8 / bwd_fp8 / fwd_paged
# ---------------------------------------------------------------------------------------------
#: (name, schema type) of the call's arguments in the ops' schemas, after q, k, v (and dout).
OP_FIELDS = (
    ("seq_offsets_q", "Tensor"), ("seq_offsets_k", "Tensor"), ("max_seqlen_q", "SymInt"),
    ("max_seqlen_k", "SymInt"), ("num_contexts", "Tensor?"), ("num_targets", "Tensor?"),
    ("target_group_size", "SymInt"), ("window_left", "SymInt"), ("window_right", "SymInt"), ("alpha", "float"),
    ("rab", "Tensor?"), ("is_delta_q", "bool"), ("scaling_seqlen", "SymInt"), ("seqused_q", "Tensor?"),
    ("seqused_k", "Tensor?"), ("func", "Tensor?"), ("block_count", "Tensor?"), ("block_index", "Tensor?"),
    ("q_block", "int"), ("k_block", "int"),
)
OP_NAMES = tuple(name for name, _ in OP_FIELDS)
#: The per-sequence tensors among them (the traced autograd function's extra inputs).
SEQUENCE_NAMES = ("seq_offsets_q", "seq_offsets_k", "num_contexts", "num_targets", "seqused_q", "seqused_k", "func",
                  "block_count", "block_index")
_RAB_AT = OP_NAMES.index("rab")


def op_schema_args() -> str:
    """The call's part of an op schema."""
    return ", ".join(f"{kind} {name}" for name, kind in OP_FIELDS)


def op_arguments(call: Call, rab: torch.Tensor | None) -> tuple:
    """``call`` and ``rab`` as the ops' flat arguments (:data:`OP_FIELDS` order). The window
    goes normalized, the divisor as ``scaling_seqlen``: the op rebuilds the same problem."""
    p, bm = call.problem, call.block_mask
    values = dict(seq_offsets_q=call.seq_offsets_q, seq_offsets_k=call.seq_offsets_k,
                  max_seqlen_q=call.max_seqlen_q, max_seqlen_k=call.max_seqlen_k, num_contexts=call.num_contexts,
                  num_targets=call.num_targets, target_group_size=call.target_group_size,
                  window_left=p.window_left, window_right=p.window_right, alpha=call.alpha, rab=rab,
                  is_delta_q=p.mask.is_delta_q, scaling_seqlen=p.scale_seqlen, seqused_q=call.seqused_q,
                  seqused_k=call.seqused_k, func=call.func, block_count=call.block_count,
                  block_index=call.block_index, q_block=bm.q_block if bm is not None else 0,
                  k_block=bm.k_block if bm is not None else 0)
    return tuple(values[name] for name in OP_NAMES)


def op_values(args: tuple) -> dict:
    """The ops' flat arguments (:data:`OP_FIELDS` order) by name."""
    return dict(zip(OP_NAMES, args))


def call_of_op_arguments(q: torch.Tensor, args: tuple, quant_mode: int = -1, has_drab: bool = False,
                         deterministic: bool = False, descales: tuple = (None, None, None),
                         paged: PagedTables | None = None) -> tuple[Call, torch.Tensor | None]:
    """(the call, rab) of an op's flat arguments (already validated by the public call that
    traced them)."""
    a = op_values(args)
    page_size = paged.kv_cache.shape[2] if paged is not None else 0
    problem, plans = problem_of_op_args(q, a["seq_offsets_q"], a["max_seqlen_q"], a["max_seqlen_k"],
                                        a["num_contexts"], a["num_targets"], a["window_left"], a["window_right"],
                                        a["rab"], a["is_delta_q"], a["scaling_seqlen"], quant_mode, page_size,
                                        a["func"] is not None)
    block_mask = None
    if a["block_count"] is not None:
        block_mask = BlockMask(a["block_count"], a["block_index"], a["q_block"], a["k_block"])
    call = Call(problem, a["seq_offsets_q"], a["seq_offsets_k"], a["max_seqlen_q"], a["max_seqlen_k"],
                a["num_contexts"], a["num_targets"], a["seqused_q"], a["seqused_k"], a["target_group_size"],
                a["alpha"], has_drab, deterministic, descales, paged, plans, a["func"], block_mask)
    return call, args[_RAB_AT]


class OpScalars(NamedTuple):
    """The ops' non-tensor arguments of a call, plus the backward's flags: what the traced
    autograd function carries beside its tensor inputs (Dynamo traces a named tuple of constants
    where it would not trace a record holding tensors)."""

    max_seqlen_q: int
    max_seqlen_k: int
    target_group_size: int
    window_left: int
    window_right: int
    alpha: float
    is_delta_q: bool
    scaling_seqlen: int
    q_block: int
    k_block: int
    has_drab: bool
    deterministic: bool


def op_scalars(call: Call) -> OpScalars:
    values = op_values(op_arguments(call, None))
    return OpScalars(**{name: values[name] for name in OpScalars._fields if name in values},
                     has_drab=call.has_drab, deterministic=call.deterministic)


def op_arguments_of(tensors: dict, scalars: OpScalars) -> tuple:
    """The ops' flat arguments from ``tensors`` (rab and :data:`SEQUENCE_NAMES`, by name) and
    ``scalars``."""
    return tuple(tensors[name] if name in tensors else getattr(scalars, name) for name in OP_NAMES)


def sequence_tensors(call: Call) -> tuple:
    """The call's per-sequence tensors, :data:`SEQUENCE_NAMES` order."""
    return tuple(getattr(call, name) for name in SEQUENCE_NAMES)
