#!/usr/bin/env bash
# One device call: install qfuse on the GPU machine, then the named steps, each
# with a time limit, logging to $OUT/log.txt; results go to $OUT (the device tool
# brings back at most 8 files).
# Usage: bash bench/device_run.sh STEP...   where STEP is
#   tests            the whole suite (CPU tests then run their kernels on the GPU too)
#   gpu-tests        the tests marked gpu only (pytest -m gpu -v into $OUT/gpu-tests.txt),
#                    every one run (no -x; GPU_TESTS_ARGS adds pytest arguments),
#                    spread over GPU_WORKERS (8) processes when the GPU's compute
#                    mode lets several share it; failures listed, $OUT/gpu-tests.xml
#   pytest PATH...   the named test files (GPU tests among them run there)
#   bench NAME...    `qfuse bench NAME --out $OUT` for each NAME
#   sweep FILE       attention launch variants timed side by side (a JSON file such
#                    as bench/attention_paths.json; qfuse/bench/attention.py says how)
#   keep FILE...     copy repo files (e.g. a golden file a step wrote) to $OUT
#   step_ab DIR      bench/step_ab.py for this tree, then for the older qfuse unpacked in
#                    DIR (`git archive REV qfuse ':!qfuse/assets' | tar -x -C DIR`, DIR
#                    ignored by git and named in the call's carry): $OUT/step_{after,before}.json
#   bench_ab DIR NAME  `qfuse bench NAME` for this tree into $OUT/after, then for the older
#                    qfuse in DIR (as step_ab) into $OUT/before, BENCH_ARGS for both: a
#                    before/after figure from one call
#   wheels           install the serving extra and gguf from wheels in .whl/ (the device
#                    image lacks them; .whl/ is gitignored, so carry it: see NOTES)
#   torchrun ARG... ::  `torchrun --standalone --nproc-per-node $NPROC -m qfuse ARG...`
#                    (NPROC: the GPU count); its arguments end at `::` or the end
set -uo pipefail
export PYTHONUNBUFFERED=1
# NVLink multicast off in every process this call starts (device README: never on).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/qfuse-out}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
rm -f "$OUT/install.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,compute_mode --format=csv \
    | tee -a "$LOG"
status=0
run() {  # run SECONDS CMD...
    local limit=$1; shift
    echo "=== $* (limit ${limit}s) $(date -u +%T)" | tee -a "$LOG"
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG" | grep -v "it/s\|step/s" | tail -60
    local rc=${PIPESTATUS[0]}
    echo "=== exit $rc" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || status=1
}
# Test processes for gpu-tests: Triton's compiles are CPU-bound, so several pytest
# workers sharing the GPU finish the suite in a fraction of one call; only where the
# compute mode is Default (an exclusive GPU takes one process) and xdist is there.
gpu_test_workers() {
    local mode
    mode="$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader | head -1)"
    if [ "$mode" = "Default" ] && python3 -c "import xdist" 2>/dev/null \
            && [ "${GPU_WORKERS:-8}" -gt 1 ]; then
        echo "-n ${GPU_WORKERS:-8}"
    fi
}
pytest_timeout() {  # a hung test costs its own limit, not the whole call's
    python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout ${TEST_TIMEOUT:-300}"
}
is_step() { case "$1" in tests|gpu-tests|pytest|bench|bench_ab|wheels|sweep|keep|step_ab|torchrun) return 0;; *) return 1;; esac; }
while [ $# -gt 0 ]; do
    case "$1" in
        tests) run 400 python3 -m pytest tests -q -x -W ignore::DeprecationWarning; shift ;;
        gpu-tests)
            # shellcheck disable=SC2046  # the helpers print whole flags, or nothing
            # -v into its own file: a run cut by its limit still names every failure so far
            run "${GPU_TESTS_LIMIT:-540}" bash -c "python3 -m pytest tests -m gpu -v -rfE \
                --junitxml $OUT/gpu-tests.xml $(gpu_test_workers) $(pytest_timeout) \
                -W ignore::DeprecationWarning ${GPU_TESTS_ARGS:-} >$OUT/gpu-tests.txt 2>&1; \
                rc=\$?; grep -E 'FAILED|ERROR|passed|failed' $OUT/gpu-tests.txt | tail -40; exit \$rc"
            shift ;;
        pytest)
            shift
            files=()
            while [ $# -gt 0 ] && ! is_step "$1"; do files+=("$1"); shift; done
            run "${PYTEST_LIMIT:-240}" python3 -m pytest "${files[@]}" -q -W ignore::DeprecationWarning ;;
        bench)
            shift
            while [ $# -gt 0 ] && ! is_step "$1"; do
                run "${BENCH_LIMIT:-300}" python3 -m qfuse bench "$1" --out "$OUT" ${BENCH_ARGS:-}
                shift
            done ;;
        sweep) run "${SWEEP_LIMIT:-300}" python3 -c 'import sys; from qfuse.bench import attention
sys.exit(attention.main(sys.argv[1], sweep=sys.argv[2]))' "$OUT" "$2"; shift 2 ;;
        step_ab)
            run "${STEP_AB_LIMIT:-150}" python3 bench/step_ab.py "$OUT/step_after.json"
            run "${STEP_AB_LIMIT:-150}" env PYTHONPATH="$PWD/$2" python3 bench/step_ab.py \
                "$OUT/step_before.json"
            shift 2 ;;
        bench_ab)
            mkdir -p "$OUT/after" "$OUT/before"
            # shellcheck disable=SC2086  # BENCH_ARGS holds several arguments
            run "${BENCH_LIMIT:-300}" python3 -m qfuse bench "$3" --out "$OUT/after" ${BENCH_ARGS:-}
            # from another folder: `python -m` puts the working folder first on the path
            # shellcheck disable=SC2086
            run "${BENCH_LIMIT:-300}" bash -c "cd /tmp && PYTHONPATH='$PWD/$2' python3 -m qfuse \
                bench '$3' --out '$OUT/before' ${BENCH_ARGS:-}"
            shift 3 ;;
        wheels)
            run 120 python3 -m pip install -q --no-index --find-links .whl starlette uvicorn \
                pydantic prometheus-client httpx openai gguf
            shift ;;
        keep)
            shift
            while [ $# -gt 0 ] && ! is_step "$1"; do cp "$1" "$OUT/"; shift; done ;;
        torchrun)
            shift
            targs=()
            while [ $# -gt 0 ] && [ "$1" != "::" ]; do targs+=("$1"); shift; done
            [ $# -gt 0 ] && shift
            run "${TP_LIMIT:-300}" torchrun --standalone \
                --nproc-per-node "${NPROC:-$(nvidia-smi -L | wc -l)}" -m qfuse "${targs[@]}" ;;
        *) echo "unknown step $1"; exit 2 ;;
    esac
done
ls -la "$OUT"
exit $status
