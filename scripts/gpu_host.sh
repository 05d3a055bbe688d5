#!/usr/bin/env bash
# Issue 40's host measurements in one device call: `bench --host` (every line of the host table in
# one run), then cProfiles of the bf16 and FP8 (mode 2) training steps. Logs under $OUT.
# Usage on the GPU machine: scripts/gpu_host.sh [extra stages: recsys headline]
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export HSTU_CUTE_CACHE_DIR="${HSTU_CUTE_CACHE_DIR:-/tmp/hstu-cute-cache}"
git rev-parse --short HEAD 2>/dev/null > "$OUT/commit.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
timeout 400 python -m hstu_cute bench --host --out "$OUT/host.jsonl" > "$OUT/host.log" 2>&1; echo "bench --host rc=$?"
cat "$OUT/host.log"
timeout 200 python scripts/profile_host.py --calls 1000 --top 40 > "$OUT/profile-bf16.log" 2>&1; echo "profile bf16 rc=$?"
head -n 3 "$OUT/profile-bf16.log"
timeout 200 python scripts/profile_host_fp8.py --step > "$OUT/profile-fp8.log" 2>&1; echo "profile fp8 rc=$?"
for stage in "$@"; do
  case $stage in
    recsys) timeout 500 python -m hstu_cute bench --grid recsys --out "$OUT/recsys.jsonl" > "$OUT/recsys.log" 2>&1
            echo "recsys rc=$?"; cat "$OUT/recsys.log";;
    headline) timeout 300 python -m hstu_cute bench --out "$OUT/headline.jsonl" > "$OUT/headline.log" 2>&1
            echo "headline rc=$?"; cat "$OUT/headline.log";;
  esac
done
