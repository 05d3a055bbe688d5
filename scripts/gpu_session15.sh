#!/usr/bin/env bash
# Session 15 GPU batch: the paged tests and the paged call's host time after the leaner rab gather.
set -uo pipefail
mkdir -p "$OUT"
python -m hstu_cute warmup --arch sm_90a --kernels fwd --mask causal --mask target --workers 16 2>&1 | tail -1
python -m pytest -q -p no:cacheprovider tests/test_paged_gpu.py tests/test_kv_cache.py 2>&1 | tail -2
python scripts/host_paged.py --profile 2>&1 | tail -25
