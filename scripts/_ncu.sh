source .cutedsl/activate.sh && export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 HSTU_CUTE_CACHE_DIR=/tmp/c19n
python scripts/gpu_fp8_fused.py --stages warmup > /dev/null 2>&1
ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:DkDvFp8 --section SourceCounters --section WarpStateStats -o /tmp/dkdv -f python scripts/ncu_fp8_bwd.py 2 > /dev/null 2>&1
ncu --import /tmp/dkdv.ncu-rep --page source --csv --print-source sass > $OUT/dkdv_src.csv 2>&1
ls -la $OUT; head -3 $OUT/dkdv_src.csv | cut -c1-600
