#!/usr/bin/env bash
# Issue 40 in one device call: the host table, the recsys training steps, the headline, then the
# GPU tests of the paths the call record and the prepared launches touched. Logs under $OUT.
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export HSTU_CUTE_CACHE_DIR="${HSTU_CUTE_CACHE_DIR:-/tmp/hstu-cute-cache}"
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null
timeout 150 python -m hstu_cute bench --host --out "$OUT/host.jsonl" > "$OUT/host.log" 2>&1; echo "host rc=$?"; cat "$OUT/host.log"
timeout 200 python -m hstu_cute bench --grid recsys --out "$OUT/recsys.jsonl" > "$OUT/recsys.log" 2>&1; echo "recsys rc=$?"; cat "$OUT/recsys.log"
timeout 60 python -m hstu_cute bench --out "$OUT/headline.jsonl" > "$OUT/headline.log" 2>&1; echo "headline rc=$?"; tail -n 25 "$OUT/headline.log"
timeout "${TESTS_S:-160}" python -m pytest -q -m gpu -x -p no:cacheprovider tests/test_training_step_gpu.py tests/test_torch_integration_gpu.py tests/test_forward_gpu.py tests/test_paged_gpu.py > "$OUT/gpu-tests.log" 2>&1; echo "gpu tests rc=$?"; tail -n 15 "$OUT/gpu-tests.log"
