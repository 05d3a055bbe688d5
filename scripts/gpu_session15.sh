#!/usr/bin/env bash
# Session 15 GPU batch: split-key tests, compute-sanitizer over them, the split benchmark, the
# serving grid.
set -uo pipefail
mkdir -p "$OUT"
python -m hstu_cute warmup --arch sm_90a --kernels fwd --mask causal --mask target --workers 16 2>&1 | tail -2
python -m pytest -q -p no:cacheprovider tests/test_paged_gpu.py 2>&1 | tail -4 | tee "$OUT/paged_tests.txt"
timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 python -m pytest -q -p no:cacheprovider \
  tests/test_paged_gpu.py -k "split and hopper" > "$OUT/sanitizer-split.log" 2>&1
echo "sanitizer rc=$? $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitizer-split.log" | tail -n 2 | tr '\n' ' ')"
python scripts/gpu_split.py --out "$OUT/split.jsonl" 2>&1 | tail -8
python scripts/gpu_serving.py --page-sizes 32 --out "$OUT/serving.jsonl" 2>&1 | tail -3
