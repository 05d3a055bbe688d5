#!/usr/bin/env bash
# Session 15 GPU batch: the padded entry's host time with cached offsets, and its GPU tests.
set -uo pipefail
python scripts/host_padded.py 2>&1 | head -3
python -m pytest -q -p no:cacheprovider tests/test_ecosystem_gpu.py -k padded 2>&1 | tail -1
