#!/usr/bin/env bash
# Modes 3-5's cooperative quantizer (session 25) on the GPU in one call: precompile the FP8
# forward and slot-quantizer variants, run the quantizer and scaled-mode tests, then time quant5 /
# mode5 / kernel5 with the cooperative launch against the two-launch arm
# (HSTU_CUTE_TWO_PASS_GROUPS=1), alternating rounds. Logs under $OUT. Usage: bash
# scripts/gpu_group_quant.sh [D ...]
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export HSTU_CUTE_CACHE_DIR="${HSTU_CUTE_CACHE_DIR:-/tmp/hstu-cute-cache}" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python scripts/warm_keys.py '^hopper_fwd_(fp8|quant_slots|vt) |^hopper_fwd sm_90a bfloat16 d(128|256) \S+ causal$' 2>&1 | grep -v cuGetProcAddress | tail -n 3
python -m pytest -q -p no:cacheprovider tests/test_fp8_forward_gpu.py -k "quantizer or scaled_modes or mode3 or mode4 or mode5" 2>&1 | tail -n 8 | tee "$OUT/group-quant-tests.txt"
for round in 1 2; do
  for arm in group two_pass; do
    echo "== round $round arm $arm"
    HSTU_CUTE_TWO_PASS_GROUPS=$([ $arm = two_pass ] && echo 1 || echo 0) FP8_ENTRIES=kernel5,quant5,mode5 \
      python scripts/bench_fp8.py "${@:-128}" 2>&1 | grep "TF/s"
  done
done 2>&1 | tee "$OUT/group-quant-bench.txt"
