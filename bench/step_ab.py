"""The decode step of `qfuse bench e2e`'s fast-tier headline shapes, timed by whichever
qfuse is first on sys.path: run once from the checkout and once with PYTHONPATH pointing
at an older tree (`git archive REV qfuse`), in one device call, to compare a change's
step time side by side with its parent's (same GPU, same process conditions).

Usage: python bench/step_ab.py OUT.json [ROUNDS]
Each configuration is timed ROUNDS times (default 2); the JSON holds every row.
"""

from __future__ import annotations

import json
import sys

import torch

import qfuse
from qfuse.bench import common, e2e

CONFIGS = [("gemma3-12b", 4, 4, 8192, 1), ("gemma3-12b", 4, 4, 8192, 8),
           ("llama3-8b", 4, 0, 8192, 1), ("llama3-8b", 4, 4, 8192, 1)]


def main(out: str, rounds: int = 2) -> int:
    copy_gbs = common.copy_bandwidth_gbs()
    rows, model, built = [], None, None
    for name, wb, kb, context, B in CONFIGS:
        if built != (name, wb):
            del model
            torch.cuda.empty_cache()
            model, built = e2e.random_model(e2e.MODELS[name], wb, "cuda"), (name, wb)
        for r in range(rounds):
            row = e2e.run_config(model, name, wb, kb, context, B, "fast", copy_gbs, 20)
            rows.append({**row, "round": r})
            print(row, flush=True)
    with open(out, "w") as f:
        json.dump({"meta": common.metadata(), "qfuse_path": qfuse.__file__,
                   "copy_GBps": copy_gbs, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2))
