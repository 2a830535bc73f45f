"""Launch shapes of the batched-rows wgmma product (`qmatmul_wgmma`) timed side by side
with bf16 `F.linear` on the Gemma 3 12B MLP projections, 64/128/256 rows (H200 only):
what chose the launcher's defaults (bench/NOTES.md, "Quantized products" → "Batched
rows"). Each variant is also checked against the default's output (same split: bitwise).

    python bench/wgmma_sweep.py [OUT.json]
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from qfuse.bench import common
from qfuse.kernels.products import qmatmul_wgmma as wg
from qfuse.kernels.products.qmatmul_mma import fragments_of

SHAPES = {"up": (15360, 3840), "down": (3840, 15360)}
VARIANTS = [  # (wg, cb, stages, per_sm, inflight, ws), None: the default (stages: as fit)
    None, (2, 4, None, 1, 1, False), (1, 4, 2, 2, 1, False), (2, 2, None, 1, 1, True),
    (2, 4, None, 1, 1, True), (1, 4, 2, 2, 1, True), (1, 4, None, 1, 1, True),
    (2, 1, None, 1, 1, True)]


def main(out: str | None = None) -> None:
    rows = []
    for name, (N, K) in SHAPES.items():
        n_sets = common.n_rotations(N * K // 2, cap=8)
        qs = [fragments_of(common.random_quantized((N, K), 4, 64, 0.005, 0.015))
              for _ in range(n_sets)]
        ds = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
              for _ in range(n_sets)]
        nbytes = qs[0].nbytes
        for M in (64, 128, 256):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            bf16 = common.time_graph_us(lambda x, w: F.linear(x, w), [(x, w) for w in ds])
            ref = wg.qmatmul_wgmma(x, qs[0])
            # the one copy of x the kernel's k order needs, alone: its share of the time
            permute = common.time_graph_us(wg.permuted_rows, [(x,)])
            for v in VARIANTS:
                shape = {} if v is None else {k: a for k, a in zip(
                    ("wg", "cb", "stages", "per_sm", "inflight", "ws"), v) if a is not None}
                row = {"proj": name, "N": N, "K": K, "M": M, "variant": str(v or "default"),
                       "bf16_us": bf16, "permute_us": permute}
                try:
                    y = wg.qmatmul_wgmma(x, qs[0], **shape)
                    row["max_abs_vs_default"] = (y.float() - ref.float()).abs().max().item()
                    us = common.time_graph_us(
                        lambda x, f, shape=shape: wg.qmatmul_wgmma(x, f, **shape),
                        [(x, f) for f in qs])
                    row.update(us=us, vs_bf16=bf16 / us, GBps=nbytes / us / 1e3,
                               TFLOPs=2 * M * N * K / us / 1e6)
                except Exception as exc:  # noqa: BLE001 -- reported, not hidden
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
    if out:
        with open(out, "w") as fh:
            json.dump({"meta": common.metadata(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
