#!/usr/bin/env bash
# One device call for issue 7 (and the GPU half of issue 6): train the default
# model into qfuse/assets/default, freeze its golden trajectories and run the
# gates (bench gate), time a training step fused vs spelled-out (bench train),
# print a sample, run the GPU tests, then `bench mlp`. What must come back goes
# to $OUT: the weight shards as they are (each < 16 MiB) and everything else in
# one tarball (the device tool returns at most 8 files).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/qfuse-out}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv | tee -a "$LOG"
step() {  # step SECONDS CMD...: run with a time limit, log everything
    local limit=$1; shift
    echo "=== $* (limit ${limit}s) $(date -u +%T)" | tee -a "$LOG"
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG" | grep -v "it/s\|step/s" | tail -40
    echo "=== exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}
step 300 python3 -m qfuse train --out qfuse/assets/default --record bench/results/train_record.json
step 120 python3 -m qfuse bench gate
step 90 python3 -m qfuse bench train
step 60 python3 -m qfuse generate "def fibonacci(n):" --max-tokens 64
step 200 python3 -m pytest tests/gpu -q -x -W ignore::DeprecationWarning
tar czf "$OUT/small.tgz" --exclude='*.safetensors' qfuse/assets/default bench/results/train* \
    bench/results/gate*
cp qfuse/assets/default/*.safetensors "$OUT/" 2>/dev/null
step 150 python3 -m qfuse bench mlp --out "$OUT"
ls -la "$OUT"
