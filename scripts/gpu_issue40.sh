#!/usr/bin/env bash
# Issue 40 in one device call: the host table, where the host time goes, the recsys training
# steps and the headline (STAGES picks: host attribution primitives recsys headline tests). Logs under $OUT.
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export HSTU_CUTE_CACHE_DIR="${HSTU_CUTE_CACHE_DIR:-/tmp/hstu-cute-cache}"
STAGES=" ${STAGES:-host attribution recsys headline} "
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null
if [[ $STAGES == *" host "* ]]; then
  timeout 150 python -m hstu_cute bench --host --out "$OUT/host.jsonl" > "$OUT/host.log" 2>&1; echo "host rc=$?"; cat "$OUT/host.log"
fi
if [[ $STAGES == *" attribution "* ]]; then
  timeout 100 python scripts/host_attribution.py > "$OUT/attribution.log" 2>&1; echo "attribution rc=$?"; cat "$OUT/attribution.log"
fi
if [[ $STAGES == *" primitives "* ]]; then
  timeout 150 python scripts/host_primitives.py > "$OUT/primitives.log" 2>&1; echo "primitives rc=$?"; cat "$OUT/primitives.log"
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
