#!/usr/bin/env bash
# Session 15 GPU batch: split-key tests, the split benchmark, the serving grid.
set -uo pipefail
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
python -m pytest -q -p no:cacheprovider tests/test_paged_gpu.py -x 2>&1 | tail -15 | tee "$OUT/paged_tests.txt"
python scripts/gpu_split.py --out "$OUT/split.jsonl" 2>&1 | tail -8
python scripts/gpu_serving.py --page-sizes 16 32 --out "$OUT/serving.jsonl" 2>&1 | tail -8
