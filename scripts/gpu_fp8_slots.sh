#!/usr/bin/env bash
# The slot quantizer's first GPU run (estimated, never run yet: ~6-7 min on a cold H100 without
# the sanitizer, up to ~14 with it): precompile its variants and the FP8 kernels its tests run,
# the quantizer and training-equality GPU tests, the A/B rows (per-tensor against slot quantizers,
# same lease) of scripts/ab_quantizers.py, then compute-sanitizer over the FP8 backward cases with
# the slot quantizer on. A device command may run 10 minutes: SANITIZER=0 for the first call, then
# STAGE=sanitizer alone in a second one on the warm machine. Logs and JSON lines under $OUT.
# The bundle must carry tvm-ffi (the kernels' calling convention; a bundle without it fails at
# import): pack it with the device tool's bundler given apache-tvm-ffi==0.1.15.post2, carry .cutedsl.
# Usage on the GPU machine: source .cutedsl/activate.sh && bash scripts/gpu_fp8_slots.sh
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export HSTU_CUTE_CACHE_DIR="${HSTU_CUTE_CACHE_DIR:-/tmp/hstu-cute-cache}" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
if [[ "${STAGE:-all}" == all ]]; then
t0=$(date +%s)
python scripts/ab_quantizers.py warm --warmup-only > "$OUT/warmup.log" 2>&1
echo "warmup rc=$? $(( $(date +%s) - t0 ))s: $(tail -n 1 "$OUT/warmup.log")"
t0=$(date +%s)
timeout 240 python -m pytest -q -p no:cacheprovider tests/test_fp8_forward_gpu.py tests/test_fp8_backward_gpu.py \
  -k "quantizer" > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t0 ))s: $(tail -n 1 "$OUT/gpu-tests.log")"
grep -E "FAILED|Error" "$OUT/gpu-tests.log" | head -n 10
for label in per-tensor slots; do
  flag=$([[ $label == slots ]] && echo 1 || echo 0)
  HSTU_CUTE_FP8_QUANT_SLOTS=$flag timeout 150 python scripts/ab_quantizers.py "$label" > "$OUT/ab-$label.log" 2>&1
  echo "== $label (rc=$?)"; grep -v Warning "$OUT/ab-$label.log" | tail -n 24
done
fi
if [[ "${SANITIZER:-1}" == 1 ]]; then
  t0=$(date +%s)
  HSTU_CUTE_FP8_QUANT_SLOTS=1 timeout "${SANITIZER_TIMEOUT:-200}" compute-sanitizer --tool memcheck --error-exitcode 9 \
    python scripts/sanitize_fp8_bwd.py > "$OUT/sanitizer-slots.log" 2>&1
  echo "compute-sanitizer (slot quantizer) rc=$? $(( $(date +%s) - t0 ))s: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer-slots.log" | tail -n 1)"
fi
