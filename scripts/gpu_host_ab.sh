#!/usr/bin/env bash
# Same-run host table of two trees: ./.baseline (a `git archive` of an earlier commit's hstu_cute,
# with this tree's bench.py and cli.py for `bench --host`; not committed) and this tree,
# interleaved twice; then scripts/host_primitives.py. Logs under $OUT.
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export HSTU_CUTE_CACHE_DIR="${HSTU_CUTE_CACHE_DIR:-/tmp/hstu-cute-cache}"
for round in 1 2; do
  for tree in baseline head; do
    root=$PWD; [[ $tree == baseline ]] && root=$PWD/.baseline
    PYTHONPATH=$root:$PYTHONPATH timeout 120 python -m hstu_cute bench --host --out "$OUT/host-$tree.jsonl" > "$OUT/host-$tree-$round.log" 2>&1
    echo "$tree round $round rc=$?"; grep -E "│ (null|SDPA|hstu)" "$OUT/host-$tree-$round.log"
  done
done
timeout 150 python scripts/host_primitives.py > "$OUT/primitives.log" 2>&1; echo "primitives rc=$?"; cat "$OUT/primitives.log"
