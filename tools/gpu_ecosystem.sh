#!/usr/bin/env bash
# Issue 19's GPU call: precompile the variants used below (parallel) -> tests/test_ecosystem_gpu.py ->
# the training example (eager, compiled, two FP8 steps) -> tools/notebook_results.py (the notebook's
# stored results). Logs and JSON under $OUT (default ./gpu-out). STAGES picks a subset.
# Usage on the GPU machine: GIT_COMMIT=<sha> [STAGES="warmup tests example results"] tools/gpu_ecosystem.sh
if [[ ${1:-} == -h || ${1:-} == --help ]]; then  # usage: the comment block above
  sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0
fi
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export HSTU_CUTE_CACHE_DIR="${HSTU_CUTE_CACHE_DIR:-/tmp/hstu-cute-cache}"
STAGES=" ${STAGES:-warmup tests example results} "
EXAMPLE_ARGS=(--head-dim 64 --d-model 128 --heads 2 --layers 2 --batch-size 32 --max-len 256 --vocab 512
              --steps "${EXAMPLE_STEPS:-150}" --log-every 25)
status=()
stamp() { echo "$(( $(date +%s) - $1 ))s"; }

if [[ $STAGES == *" warmup "* ]]; then
  t0=$(date +%s)
  # Head dim 64, bf16: the Hopper forward and backward variants, the sm80 backward ones with rab (drab
  # at D64 comes from the sm80 dQ kernel); causal forwards at D128/D256 for the performance rows.
  # (python -c: the warmup's worker processes re-import the main module, which a script on stdin is not.)
  python -c "$(cat <<'PY'
import os
from hstu_cute import variants, warmup
bf16 = ("bfloat16",)
keys = (variants.shipped_hopper_fwd_keys("sm_90a", bf16, (64,)) + variants.shipped_hopper_bwd_keys("sm_90a", bf16, (64,))
        + [k for k in variants.shipped_ampere_bwd_keys("sm_90a", bf16, (64,)) if k.has_rab]
        + [k for k in variants.shipped_hopper_fwd_keys("sm_90a", bf16, (128, 256))
           if k.mask_kind == 2 and not k.has_context and not k.has_rab])
results = warmup(arch="sm_90a", keys=keys, workers=os.cpu_count(), raise_errors=False)
bad = [r for r in results if not r["ok"]]
print(f"{len(results)} variants, {len(bad)} failed", *(r["error"] for r in bad[:5]), sep="\n")
PY
)" > "$OUT/warmup.log" 2>&1
  status+=("warmup rc=$? $(stamp $t0): $(head -n 1 "$OUT/warmup.log")")
fi
if [[ $STAGES == *" tests "* ]]; then
  t0=$(date +%s)
  timeout "${TESTS_TIMEOUT:-240}" python -m pytest -q -p no:cacheprovider tests/test_ecosystem_gpu.py -rfE \
    > "$OUT/eco-tests.log" 2>&1; rc=$?
  status+=("tests/test_ecosystem_gpu.py rc=$rc $(stamp $t0): $(tail -n 1 "$OUT/eco-tests.log")")
  grep -E "FAILED|Error" "$OUT/eco-tests.log" | head -n 20
fi
if [[ $STAGES == *" example "* ]]; then
  t0=$(date +%s)
  timeout 150 python examples/train_hstu.py "${EXAMPLE_ARGS[@]}" --out "$OUT/example-eager.json" \
    > "$OUT/example-eager.log" 2>&1
  status+=("example eager rc=$? $(stamp $t0): $(tail -n 1 "$OUT/example-eager.log")")
  t0=$(date +%s)
  timeout 240 python examples/train_hstu.py "${EXAMPLE_ARGS[@]}" --compile --out "$OUT/example-compiled.json" \
    > "$OUT/example-compiled.log" 2>&1
  status+=("example --compile rc=$? $(stamp $t0): $(tail -n 1 "$OUT/example-compiled.log")")
  timeout 120 python examples/train_hstu.py "${EXAMPLE_ARGS[@]}" --steps 2 --quant-mode 0 \
    > "$OUT/example-fp8.log" 2>&1
  status+=("example --quant-mode 0 (FP8 training, 2 steps) rc=$?: $(tail -n 1 "$OUT/example-fp8.log" | cut -c1-160)")
fi
if [[ $STAGES == *" results "* ]]; then
  t0=$(date +%s)
  timeout "${RESULTS_TIMEOUT:-240}" python tools/notebook_results.py --commit "${GIT_COMMIT:-unknown}" \
    --example-eager "$OUT/example-eager.json" --example-compiled "$OUT/example-compiled.json" \
    --out "$OUT/gpu_results.json" > "$OUT/results.log" 2>&1
  status+=("notebook results rc=$? $(stamp $t0): $(tail -n 1 "$OUT/results.log")")
fi
echo "=== gpu_ecosystem ==="
printf '%s\n' "${status[@]}"
