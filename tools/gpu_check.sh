#!/usr/bin/env bash
# The one GPU call: precompile (parallel) -> GPU tests -> compute-sanitizer -> backward smoke -> benchmark
# -> serving (paged and split-key calls beside their same-run lines) -> sparse (block-sparse and func
# masks: their GPU tests, compute-sanitizer over them, bench --grid blocksparse and --grid func) -> nsa
# (hstu_cute.nsa's GPU tests and bench --grid nsa) -> multi (two GPUs: the training example under
# torchrun, DDP / FSDP2 / --compile / FP8 from a cold shared module cache, one GPU against two for weak
# scaling, tests/test_multi_gpu.py).
# Usage on the GPU machine: [STAGES="warmup tests shards sanitizer smoke perf serving sparse nsa multi"] tools/gpu_check.sh [perf modes]
# (perf modes: tools/gpu_perf.py's, default all). Logs under $OUT (or ./gpu-out). STAGES picks a
# subset, so a long check can be split over two calls within one device command's time limit;
# GPU_TESTS picks test files, WARMUP_ARGS narrows the warmup (its filters). STAGES="shards" runs
# GPU_TESTS (K: a -k filter) in SHARDS concurrent pytest processes: tests that JIT-compile their own
# variants compile on that many cores at once, sharing the module cache (its lock compiles each
# variant once); logs under $OUT/shards.
if [[ ${1:-} == -h || ${1:-} == --help ]]; then  # usage: the comment block above
  sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0
fi
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export HSTU_CUTE_CACHE_DIR="${HSTU_CUTE_CACHE_DIR:-/tmp/hstu-cute-cache}"
STAGES=" ${STAGES:-warmup tests sanitizer smoke perf serving} "
status=()
shards() {  # test files...: in SHARDS concurrent pytest processes; prints one line per shard
  local ids="$OUT/shards/ids.txt" s pids=() rc=0; mkdir -p "$OUT/shards"
  python -m pytest -q --collect-only -m gpu -p no:cacheprovider ${K:+-k "$K"} "$@" 2>/dev/null | grep "::" > "$ids"
  for ((s = 0; s < ${SHARDS:-14}; s++)); do
    mapfile -t mine < <(awk -v n="${SHARDS:-14}" -v s="$s" 'NR % n == s' "$ids")
    (( ${#mine[@]} )) || continue
    timeout "${SHARD_TIMEOUT:-300}" python -m pytest -q -m gpu -p no:cacheprovider "${mine[@]}" \
      > "$OUT/shards/shard$s.log" 2>&1 &
    pids+=($!)
  done
  for s in "${pids[@]}"; do wait "$s" || rc=1; done
  for s in "$OUT"/shards/shard*.log; do echo "$(basename "$s"): $(tail -n 1 "$s")"; done
  grep -h -E "^FAILED|^ERROR" "$OUT"/shards/shard*.log | head -n 40
  return $rc
}
shard_counts() {  # "N passed M failed" over the shards' logs
  grep -hoE '[0-9]+ (passed|failed|error|skipped)' "$OUT"/shards/shard*.log | awk '{n[$2] += $1} END {for (k in n) printf "%d %s ", n[k], k}'
}
if [[ $STAGES == *" warmup "* ]]; then
  t0=$(date +%s)
  timeout "${WARMUP_TIMEOUT:-400}" python -m hstu_cute warmup --workers "$(nproc)" ${WARMUP_ARGS:-} > "$OUT/warmup.log" 2>&1; status+=("warmup rc=$? $(( $(date +%s) - t0 ))s")
fi
if [[ $STAGES == *" tests "* ]]; then
  t0=$(date +%s)
  timeout "${GPU_TESTS_TIMEOUT:-300}" python -m pytest -q -m gpu ${GPU_TESTS:-tests} -p no:cacheprovider > "$OUT/gpu-tests.log" 2>&1; rc=$?
  status+=("gpu tests rc=$rc $(( $(date +%s) - t0 ))s: $(tail -n 1 "$OUT/gpu-tests.log")")
  grep -E "FAILED|Error" "$OUT/gpu-tests.log" | head -n 20
fi
if [[ $STAGES == *" shards "* ]]; then
  t0=$(date +%s)
  shards ${GPU_TESTS:-tests} > "$OUT/shards.log" 2>&1; rc=$?
  status+=("GPU tests in shards rc=$rc $(( $(date +%s) - t0 ))s: $(shard_counts)")
  grep -E "FAILED|ERROR" "$OUT/shards.log" | head -n 20
fi
if [[ $STAGES == *" sanitizer "* ]]; then
  t0=$(date +%s)
  timeout "${SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 python tools/sanitize.py cases > "$OUT/sanitizer.log" 2>&1; rc=$?
  status+=("compute-sanitizer memcheck rc=$rc $(( $(date +%s) - t0 ))s: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -n 1)")
  t0=$(date +%s)
  timeout "${SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 python tools/sanitize.py fp8 > "$OUT/sanitizer-fp8.log" 2>&1; rc=$?
  status+=("compute-sanitizer memcheck (FP8) rc=$rc $(( $(date +%s) - t0 ))s: $(grep -E 'ERROR SUMMARY|skipped' "$OUT/sanitizer-fp8.log" | tail -n 1)")
  t0=$(date +%s)
  timeout "${SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 python tools/sanitize.py fp8-bwd > "$OUT/sanitizer-fp8-bwd.log" 2>&1; rc=$?
  status+=("compute-sanitizer memcheck (FP8 backward) rc=$rc $(( $(date +%s) - t0 ))s: $(grep -E 'ERROR SUMMARY|skipped' "$OUT/sanitizer-fp8-bwd.log" | tail -n 1)")
fi
if [[ $STAGES == *" smoke "* ]]; then
  python tools/gpu_bwd_smoke.py > "$OUT/bwd-smoke.log" 2>&1; status+=("backward smoke rc=$?: $(tail -n 1 "$OUT/bwd-smoke.log")")
fi
if [[ $STAGES == *" perf "* ]]; then
  python tools/gpu_perf.py "${1:-all}" > "$OUT/perf.log" 2>&1; status+=("perf rc=$?")
  sed -n '/=== summary ===/,$p' "$OUT/perf.log"
fi
if [[ $STAGES == *" serving "* ]]; then
  python tools/gpu_serving.py --page-sizes 16 32 --out "$OUT/serving.jsonl" > "$OUT/serving.log" 2>&1
  status+=("serving grid rc=$?: $OUT/serving.jsonl")
  python tools/gpu_split.py --out "$OUT/split.jsonl" > "$OUT/split.log" 2>&1
  status+=("split keys rc=$?: $OUT/split.jsonl")
fi
if [[ $STAGES == *" sparse "* ]]; then
  t0=$(date +%s)
  # In shards: these tests JIT-compile their own variants (~45 s for the block-sparse file on 16
  # cores, H200 session 31); the sanitizer below then loads them from the module cache
  # (compiling in-process under it reports cuGetProcAddress API errors, not memory errors).
  shards tests/test_block_sparse_gpu.py tests/test_func_gpu.py > "$OUT/sparse-tests.log" 2>&1; rc=$?
  status+=("sparse GPU tests rc=$rc $(( $(date +%s) - t0 ))s: $(shard_counts)")
  grep -E "FAILED|ERROR" "$OUT/sparse-tests.log" | head -n 20
  t0=$(date +%s)
  timeout "${SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 python -m pytest -q -m gpu \
    -p no:cacheprovider tests/test_block_sparse_gpu.py -k "case0 or case2 or case4" > "$OUT/sanitizer-sparse.log" 2>&1; rc=$?
  status+=("compute-sanitizer memcheck (block-sparse) rc=$rc $(( $(date +%s) - t0 ))s: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer-sparse.log" | tail -n 1)")
  python -m hstu_cute bench --grid blocksparse --out "$OUT/blocksparse.jsonl" > "$OUT/blocksparse.log" 2>&1
  status+=("bench blocksparse rc=$?: $OUT/blocksparse.jsonl")
  python -m hstu_cute bench --grid func --out "$OUT/func.jsonl" > "$OUT/func.log" 2>&1
  status+=("bench func rc=$?: $OUT/func.jsonl")
fi
if [[ $STAGES == *" nsa "* ]]; then
  t0=$(date +%s)
  shards tests/test_nsa_gpu.py > "$OUT/nsa-tests.log" 2>&1; rc=$?
  status+=("NSA GPU tests rc=$rc $(( $(date +%s) - t0 ))s: $(shard_counts)")
  grep -E "FAILED|ERROR" "$OUT/nsa-tests.log" | head -n 20
  timeout "${NSA_BENCH_TIMEOUT:-300}" python -m hstu_cute bench --grid nsa --out "$OUT/nsa.jsonl" > "$OUT/nsa.log" 2>&1
  status+=("bench nsa rc=$?: $OUT/nsa.jsonl")
fi
if [[ $STAGES == *" multi "* ]]; then
  # MULTI picks parts: cold (DDP / FSDP2 from an empty cache, then --compile and FP8 from it),
  # scale (one GPU against two, the same batch per rank, eager and compiled; "fsdp" adds FSDP2),
  # profile (torch.profiler traces of the eager step on one GPU and two), tests.
  MULTI=" ${MULTI:-cold scale tests} "
  cache=/tmp/hstu-multi-cache
  # The weak-scaling model: the same batch per rank (41k tokens) on one GPU and on two.
  scale=(--batch-size 128 --max-len 512 --d-model 256 --heads 4 --head-dim 64 --layers 4 --vocab 4096)
  example() {  # name nproc fresh-cache(0/1) args...: one torchrun of the example, its per-rank compile counts
    local name=$1 nproc=$2 fresh=$3; shift 3; local t0=$(date +%s)
    (( fresh )) && rm -rf "$cache"
    timeout "${MULTI_RUN_S:-240}" torchrun --standalone --nproc_per_node="$nproc" examples/train_hstu.py \
      --cache-dir "$cache" --log-every 50 --out "$OUT/multi-$name.json" "$@" > "$OUT/multi-$name.log" 2>&1
    status+=("example $name rc=$? $(( $(date +%s) - t0 ))s: $(grep -E '^rank .* compiled' "$OUT/multi-$name.log" | sort | tr '\n' ';') $(grep -E '^loss ' "$OUT/multi-$name.log")")
  }
  if [[ $MULTI == *" cold "* ]]; then
    example ddp 2 1 --steps 100
    example fsdp2 2 1 --fsdp --steps 100
    example ddp-compile 2 0 --compile --steps 100
    example ddp-fp8 2 0 --quant-mode 2 --head-dim 64 --steps 100
  fi
  if [[ $MULTI == *" scale "* ]]; then
    steps=(--steps "${SCALE_STEPS:-150}")
    example scale1 1 0 "${scale[@]}" "${steps[@]}"
    example scale2 2 0 "${scale[@]}" "${steps[@]}"
    example scale1-compile 1 0 --compile "${scale[@]}" "${steps[@]}"
    example scale2-compile 2 0 --compile "${scale[@]}" "${steps[@]}"
    [[ $MULTI == *" fsdp "* ]] && example scale2-fsdp2 2 0 --fsdp "${scale[@]}" "${steps[@]}"
  fi
  if [[ $MULTI == *" profile "* ]]; then  # where an eager DDP step goes: torch.profiler, steps 10-14
    example profile1 1 0 "${scale[@]}" --steps 16 --profile-dir "$OUT/profile1"
    example profile2 2 0 "${scale[@]}" --steps 16 --profile-dir "$OUT/profile2"
  fi
  if [[ $MULTI == *" tests "* ]]; then
    t0=$(date +%s)
    timeout "${MULTI_TESTS_S:-240}" python -m pytest -q -m gpu -p no:cacheprovider tests/test_multi_gpu.py > "$OUT/multi-tests.log" 2>&1
    status+=("tests/test_multi_gpu.py rc=$? $(( $(date +%s) - t0 ))s: $(tail -n 1 "$OUT/multi-tests.log")")
  fi
fi
echo "=== gpu_check ==="
printf '%s\n' "${status[@]}"
