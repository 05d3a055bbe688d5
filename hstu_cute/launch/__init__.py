"""Kernel selection and launch for validated calls (:class:`hstu_cute.call.Call`), one job per
module: device buffers, counters and streams (:mod:`.buffers`), heuristics (:mod:`.heuristics`),
prepared launches and compile keys (:mod:`.prepared`), the forward (:mod:`.fwd`), the 16-bit
backward (:mod:`.bwd`) and FP8 quantization with the FP8 forward and backward (:mod:`.fp8`). The
paged cache's page-table arithmetic lives beside the cache (:mod:`hstu_cute.kv_cache`).
"""

from .buffers import (
    INT32_MAX,
    _FILLERS,
    _SPLIT_ARRIVALS,
    _TILE_COUNTERS,
    aligned_16,
    constant_prefix,
    pad_rab_rows,
    rab_vec,
    split_arrivals,
    tile_counter,
    unit_descale,
    unit_descale_table,
)
from .bwd import backward
from .fp8 import (
    Fp8Operands,
    backward_fp8,
    check_fp8_backward,
    fp8_backward_operands,
    forward_fp8,
    kept_for_backward,
    prepare_fp8,
    quantize_for,
    transposed_for_pv,
)
from .fwd import forward
from .heuristics import (
    CLAIM_MAX_PAIRS,
    CLAIM_MIN_PAIRS,
    FP8_FUSED_BY_DEFAULT,
    L2_SECTION_BYTES,
    MAX_SPLITS,
    MIN_BLOCKS_PER_SPLIT,
    MIN_SPLITS,
    bh_per_section,
    fp8_backward_fused,
    fp8_fused_serves,
    key_splits,
)
from .prepared import Prepared, _scalar_args, fp8_fwd_key, fwd_key

__all__ = [
    "INT32_MAX", "_FILLERS", "_SPLIT_ARRIVALS", "_TILE_COUNTERS", "aligned_16", "constant_prefix", "pad_rab_rows",
    "rab_vec", "split_arrivals", "tile_counter", "unit_descale", "unit_descale_table", "backward", "Fp8Operands",
    "backward_fp8", "check_fp8_backward", "fp8_backward_operands", "forward_fp8", "kept_for_backward", "prepare_fp8",
    "quantize_for", "transposed_for_pv", "forward", "CLAIM_MAX_PAIRS", "CLAIM_MIN_PAIRS", "FP8_FUSED_BY_DEFAULT",
    "L2_SECTION_BYTES", "MAX_SPLITS", "MIN_BLOCKS_PER_SPLIT", "MIN_SPLITS", "bh_per_section", "fp8_backward_fused",
    "fp8_fused_serves", "key_splits", "Prepared", "_scalar_args", "fp8_fwd_key", "fwd_key",
]
