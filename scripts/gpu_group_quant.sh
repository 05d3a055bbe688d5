#!/usr/bin/env bash
# Modes 3-5's cooperative quantizer on the GPU in one call: precompile the slot quantizers and the
# D128 causal kernels, run the quantizer tests, ncu the mode-5 forward quantizer (DRAM bytes, L2
# hits: the second read of each tensor should come from L2), time kernel5 / quant5 / mode5 beside
# bf16, then the host time per FP8 call. Logs under $OUT. Usage: bash scripts/gpu_group_quant.sh [D ...]
# (session 25 measured it against the former two-launch quantizer: docs/dev/perf-log.md).
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export HSTU_CUTE_CACHE_DIR="${HSTU_CUTE_CACHE_DIR:-/tmp/hstu-cute-cache}" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python scripts/warm_keys.py '^hopper_fwd_quant_slots |^hopper_fwd_fp8 sm_90a float8_e4m3fn d(128|256) \S+ causal ->bfloat16 scaled-P$|^hopper_fwd sm_90a bfloat16 d(128|256) \S+ causal$' 2>&1 | grep -v cuGetProcAddress | tail -n 3
python -m pytest -q -p no:cacheprovider tests/test_fp8_forward_gpu.py -k "quantizer" 2>&1 | tail -n 8 | tee "$OUT/group-quant-tests.txt"
M=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum
ncu --metrics $M -k regex:Quantize python scripts/ncu_quant.py 5 128 2>&1 | grep -E "dram__|lts__|gpu__time" | tail -n 8 | tee "$OUT/group-quant-ncu.txt"
for round in 1 2; do
  echo "== round $round"
  FP8_ENTRIES=kernel5,quant5,mode5 python scripts/bench_fp8.py "${@:-128}" 2>&1 | grep "TF/s"
done 2>&1 | tee "$OUT/group-quant-bench.txt"
python scripts/profile_host_fp8.py --modes 2,5 --calls 1000 2>&1 | tee "$OUT/host-fp8.txt" | grep -A22 "per call"
