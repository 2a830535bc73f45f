#!/usr/bin/env bash
# One device call: install qfuse on the GPU machine, run the whole test suite
# (GPU tests included; CPU tests then run their kernels on the GPU too), then the
# named benchmarks. Logs and results go to $OUT (the device tool brings them back).
# Usage: bash bench/device_run.sh [tests] [bench NAME...]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/qfuse-out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
status=0
while [ $# -gt 0 ]; do
    case "$1" in
        tests)
            python3 -m pytest tests -q -x -W ignore::DeprecationWarning 2>&1 | tee "$OUT/tests.log" | tail -25
            [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
            shift ;;
        bench)
            shift
            while [ $# -gt 0 ] && [ "$1" != tests ]; do
                python3 -m qfuse bench "$1" --out "$OUT" 2>&1 | tee "$OUT/bench_$1.log" | tail -60
                [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
                shift
            done ;;
        *) echo "unknown step $1"; exit 2 ;;
    esac
done
exit $status
