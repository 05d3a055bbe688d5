#!/usr/bin/env bash
# GPU tests in N concurrent pytest processes: tests that JIT-compile their own variants (block-sparse,
# func) spend most of their time compiling on one core; shards compile on N cores at once and share
# the module cache (its file lock compiles each variant once).
# Usage on the GPU machine: [SHARDS=8] [K=expr] tools/gpu_shards.sh TEST_FILE... ; logs under
# $OUT/shards (or ./gpu-out/shards), one line per shard and a total at the end.
if [[ ${1:-} == -h || ${1:-} == --help || $# -eq 0 ]]; then
  sed -n '2,/^if /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0
fi
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT/shards"
SHARDS="${SHARDS:-8}"
ids="$OUT/shards/ids.txt"
python -m pytest -q --collect-only -m gpu -p no:cacheprovider ${K:+-k "$K"} "$@" 2>/dev/null | grep "::" > "$ids"
echo "$(wc -l < "$ids") tests in $SHARDS shards"
pids=()
for ((s = 0; s < SHARDS; s++)); do
  mapfile -t mine < <(awk -v n="$SHARDS" -v s="$s" 'NR % n == s' "$ids")
  (( ${#mine[@]} )) || continue
  timeout "${SHARD_TIMEOUT:-500}" python -m pytest -q -m gpu -p no:cacheprovider "${mine[@]}" \
    > "$OUT/shards/shard$s.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for f in "$OUT"/shards/shard*.log; do echo "$(basename "$f"): $(tail -n 1 "$f")"; done
grep -h -E "^FAILED|^ERROR" "$OUT"/shards/shard*.log | head -n 40
echo "shards rc=$rc"
exit $rc
