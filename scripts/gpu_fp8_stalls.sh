#!/usr/bin/env bash
# Where the D128 FP8 forward's warps wait, per SASS instruction: ncu source counters over the third
# launch of scripts/ncu_fp8_fwd.py (P cast, then scaled P), summarized by scripts/stall_top.py.
# Reports and CSVs under $OUT (docs/design/fp8-forward.md section 9 asks for this profile).
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export HSTU_CUTE_CACHE_DIR="${HSTU_CUTE_CACHE_DIR:-/tmp/hstu-cute-cache}" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python scripts/warm_keys.py '^hopper_fwd_(fp8 .*d128 \S+ causal ->bfloat16|quant_slots sm_90a bfloat16 d128|vt .*d128)' 2>&1 | grep warm_keys
for v in "128" "128 scaled"; do
  tag="${v// /-}"
  python scripts/ncu_fp8_fwd.py $v > /dev/null 2>&1  # compile and load outside ncu
  timeout 240 ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:ForwardFp8 --section SourceCounters \
    --section WarpStateStats -f -o "$OUT/stalls-$tag" python scripts/ncu_fp8_fwd.py $v > "$OUT/ncu-$tag.log" 2>&1
  echo "== $tag ncu rc=$?"
  ncu -i "$OUT/stalls-$tag.ncu-rep" --page details --print-details all 2>&1 | grep -iE "stall|warp cycles per|eligible" | head -30
  ncu -i "$OUT/stalls-$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/stalls-$tag.csv" 2> "$OUT/stalls-$tag.err"
  python scripts/stall_top.py "$OUT/stalls-$tag.csv" --top 40
done
