set -uo pipefail
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
M=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum
for c in 2 3 4; do for probe in full amax_only; do
  ( export HSTU_CUTE_CACHE_DIR=/tmp/hc_${probe}_$c HSTU_CUTE_GROUP_PROBE=$probe HSTU_CUTE_CTAS=$c; python scripts/warm_keys.py '^hopper_fwd_quant_slots sm_90a bfloat16 d128 group\+P,group\+P,group\+T$' >/dev/null 2>&1 ) &
done; done
wait
for c in 2 3 4; do for probe in full amax_only; do
  echo "== ctas $c $probe"
  HSTU_CUTE_CACHE_DIR=/tmp/hc_${probe}_$c HSTU_CUTE_GROUP_PROBE=$probe HSTU_CUTE_CTAS=$c ncu --metrics $M -k regex:Quantize python scripts/ncu_quant.py 5 128 2>&1 | grep -E "dram__bytes_read|lts__|gpu__time" | tail -n 3
done; done
