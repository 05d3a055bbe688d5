#!/usr/bin/env bash
# One GPU call of session 21: ncu pipe use of the D128 FP8 forward (P cast, scaled P), the quantizer rows timed as CUDA-graph replays. Logs under $OUT.
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export HSTU_CUTE_CACHE_DIR="${HSTU_CUTE_CACHE_DIR:-/tmp/hstu-cute-cache}" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python -m hstu_cute warmup --kernels fwd --head-dim 128 --head-dim 256 --mask causal --dtype bfloat16 --workers "$(nproc)" > "$OUT/warmup.log" 2>&1; echo "warmup rc=$?: $(tail -n 1 "$OUT/warmup.log")"
for v in "128" "128 scaled"; do
  python scripts/ncu_fp8_fwd.py $v > /dev/null 2>&1  # compile/load outside ncu
  timeout 200 ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:ForwardFp8 --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --metrics "regex:^sm__(inst_executed_pipe|pipe)_.*\.avg\.pct_of_peak_sustained_active$" python scripts/ncu_fp8_fwd.py $v > "$OUT/ncu-fwd-${v// /-}.txt" 2>&1
  echo "== ncu fwd $v rc=$?"; grep -E "pct_of_peak|Issue Slots Busy|Executed Ipc|No Eligible|Active Warps Per|Eligible Warps|Warp Cycles Per Issued|Duration" "$OUT/ncu-fwd-${v// /-}.txt" | grep -v " 0$\| 0\.00$" | head -40
done
FP8_ENTRIES=quant0,quant1,quant2,quant5 timeout 150 python scripts/bench_fp8.py 128 256 2>&1 | grep "TF/s"
timeout 150 python -c "
from hstu_cute import bench as B
for d in (128, 256):
    w = B.Workload(f'full B8 N4096 D{d}', 8, 4096, head_dim=d)
    for m in (2, 5, 1, 0):
        r = B.run_workload_bwd_fp8(w, m, 'quant')
        print(r['workload'], r['entry'], round(r['ms'] * 1e3, 1), 'us', round(r['gbps']), 'GB/s', r['timing'])
" 2>&1 | grep -v Warn
