#!/usr/bin/env bash
# The FP8 forward on the GPU in one call: precompile its variants (FP8 forward, slot quantizers,
# V^T) in parallel, run tests/test_fp8_forward_gpu.py, then scripts/bench_fp8.py (bf16 line in the
# same run). Logs and JSON lines under $OUT. Usage: bash scripts/gpu_fp8_fwd.sh [D ...]
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export HSTU_CUTE_CACHE_DIR="${HSTU_CUTE_CACHE_DIR:-/tmp/hstu-cute-cache}" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python scripts/warm_keys.py '^hopper_fwd_(fp8|quant_slots|vt) ' 2>&1 | grep -v cuGetProcAddress | tail -n 3
python -m pytest -q -p no:cacheprovider tests/test_fp8_forward_gpu.py 2>&1 | tail -n 5 | tee "$OUT/fp8-forward-tests.txt"
python scripts/bench_fp8.py "$@" 2>&1 | grep "TF/s" | tee "$OUT/bench-fp8.txt"
