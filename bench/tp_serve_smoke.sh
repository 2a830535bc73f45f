#!/usr/bin/env bash
# A live `qfuse serve` under torchrun on every GPU of the machine: start it, ask one
# completion and the health endpoint, stop it. Needs starlette and uvicorn (wheels in
# .whl/ on the device machine: install them to /tmp/site first). Log: $OUT/serve_tp.log.
set -uo pipefail
OUT="${OUT:-/tmp/qfuse-out}"
PORT="${PORT:-8013}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 170 torchrun --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" -m qfuse serve \
    --port "$PORT" --max-batch 8 "$@" >"$OUT/serve_tp.log" 2>&1 &
server=$!
for _ in $(seq 120); do
    curl -sf "localhost:$PORT/health" >/dev/null 2>&1 && break
    sleep 1
done
curl -s "localhost:$PORT/health"; echo
curl -s "localhost:$PORT/v1/completions" -H 'content-type: application/json' \
    -d '{"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}'; echo
pkill -INT -f "torchrun.*qfuse serve" 2>/dev/null
wait "$server"
echo "server exit $?"
tail -5 "$OUT/serve_tp.log"
