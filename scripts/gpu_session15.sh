#!/usr/bin/env bash
# Session 15 GPU batch: host time of the split path.
set -uo pipefail
mkdir -p "$OUT"
python scripts/host_split.py 2>&1 | tail -80
