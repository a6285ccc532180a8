#!/usr/bin/env bash
# Everything GPU-only in one bounded command (stages, limits and the report: the docstring of
# benchmark/gpu_check.py). On a lent GPU host, with the wheels of tools/gpu_wheels.sh carried:
#   bash benchmark/gpu_check.sh                # report.json and log.txt in $OUT, else runs/
#   bash benchmark/gpu_check.sh --cpu          # the same stages on the CPU (tiny shapes)
# PYTHON picks the interpreter (default: python3, the one that holds torch on those hosts).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" benchmark/gpu_check.py "$@"
