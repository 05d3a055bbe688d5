#!/usr/bin/env bash
# The host time in one device call (issue 40): the host table (`bench --host`), where the host time
# goes (tools/host.py attribution, primitives), cProfiles of the bf16 and FP8 (mode 2) training
# steps (tools/host.py profile), the recsys training steps, the headline, the GPU tests.
# STAGES picks: host attribution primitives profile recsys headline tests (default: host attribution
# recsys headline). Logs under $OUT (default ./gpu-out).
# Usage on the GPU machine: [STAGES="host profile"] tools/gpu_host.sh
if [[ ${1:-} == -h || ${1:-} == --help ]]; then  # usage: the comment block above
  sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0
fi
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export HSTU_CUTE_CACHE_DIR="${HSTU_CUTE_CACHE_DIR:-/tmp/hstu-cute-cache}"
STAGES=" ${STAGES:-host attribution recsys headline} "
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null
if [[ $STAGES == *" host "* ]]; then
  timeout 150 python -m hstu_cute bench --host --out "$OUT/host.jsonl" > "$OUT/host.log" 2>&1; echo "host rc=$?"; cat "$OUT/host.log"
fi
if [[ $STAGES == *" attribution "* ]]; then
  timeout 100 python tools/host.py attribution > "$OUT/attribution.log" 2>&1; echo "attribution rc=$?"; cat "$OUT/attribution.log"
fi
if [[ $STAGES == *" primitives "* ]]; then
  timeout 150 python tools/host.py primitives > "$OUT/primitives.log" 2>&1; echo "primitives rc=$?"; cat "$OUT/primitives.log"
fi
if [[ $STAGES == *" profile "* ]]; then
  timeout 200 python tools/host.py profile --modes -1,2 --step --top 30 > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
  grep -E "^quant_mode" "$OUT/profile.log"
fi
if [[ $STAGES == *" recsys "* ]]; then
  timeout 200 python -m hstu_cute bench --grid recsys --out "$OUT/recsys.jsonl" > "$OUT/recsys.log" 2>&1; echo "recsys rc=$?"
  grep -E "step|Host overhead" "$OUT/recsys.log"
fi
if [[ $STAGES == *" headline "* ]]; then
  timeout 60 python -m hstu_cute bench --out "$OUT/headline.jsonl" > "$OUT/headline.log" 2>&1; echo "headline rc=$?"; grep -E "N4096" "$OUT/headline.log"
fi
if [[ $STAGES == *" tests "* ]]; then
  t0=$(date +%s)
  timeout 150 python -m hstu_cute warmup --workers "$(nproc)" > "$OUT/warmup.log" 2>&1; echo "warmup rc=$? $(( $(date +%s) - t0 ))s"
  timeout "${TESTS_S:-330}" python -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/gpu-tests.log" 2>&1; echo "gpu tests rc=$?"
  grep -E "FAILED|Error" "$OUT/gpu-tests.log" | head -n 20; tail -n 3 "$OUT/gpu-tests.log"
fi
