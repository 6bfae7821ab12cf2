#!/usr/bin/env bash
# One GPU session: benchmarks/gpu_suite.py with unbuffered output, the repository on PYTHONPATH and a log in $OUT.
# Usage (from anywhere): bash benchmarks/gpu_suite.sh [--budget-s 480] [other gpu_suite.py options]
set -o pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
export OUT="${OUT:-$repo/gpu-out}" PYTHONUNBUFFERED=1 PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >"$OUT/nvidia-smi.txt" 2>&1 || true
cd "$repo" && python3 benchmarks/gpu_suite.py "$@" 2>&1 | tee "$OUT/gpu_suite.log"
