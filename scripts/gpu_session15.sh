#!/usr/bin/env bash
# Session 15 GPU batch: paged / split-key tests at the final part cap, and the split benchmark.
set -uo pipefail
mkdir -p "$OUT"
python -m hstu_cute warmup --arch sm_90a --kernels fwd --mask causal --mask target --workers 16 2>&1 | tail -1
python -m pytest -q -p no:cacheprovider tests/test_paged_gpu.py 2>&1 | tail -2 | tee "$OUT/paged_tests.txt"
python scripts/gpu_split.py --out "$OUT/split.jsonl" 2>&1 | tail -8
