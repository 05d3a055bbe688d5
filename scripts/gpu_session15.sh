#!/usr/bin/env bash
# Session 15 GPU batch: the launcher's constants outside the cudagraph pool, torch integration,
# the ecosystem tests (issue 19) and the compiled example from a cold process.
set -uo pipefail
mkdir -p "$OUT"
python -m pytest -q -p no:cacheprovider tests/test_torch_integration_gpu.py -k "reduce_overhead_first" 2>&1 | tail -3
python -m pytest -q -p no:cacheprovider tests/test_torch_integration_gpu.py tests/test_ecosystem_gpu.py tests/test_training_step_gpu.py 2>&1 | tail -3
