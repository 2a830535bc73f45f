"""`qfuse bench products`: the decode step's 4-bit weight products, one launch variant
beside another, at the shapes the step runs (Gemma 3 12B and Llama 3 8B).

Each product is timed as the step runs it: back-to-back launches replayed from a CUDA
graph (PDL on), over enough distinct weights that none is still in L2 when it comes
round again. Reported per shape, rows and variant: µs per product, and the weights'
bytes over that time against device-to-device copy (read + written), measured in the
same run. The variants are launch overrides of `qmatmul_mma.mma_shape` (``chunk``:
64-column blocks a step; ``per_sm``: programs per SM, which moves the split of K and
so the order of the sums: such a variant is timed but not bitwise the default), or the
TMA-ring kernel (`qmatmul_ring`) with its launcher's overrides, so the fastest can
become the default with evidence.
"""

from __future__ import annotations

import math

import torch

from ..kernels.products import qmatmul_mma as mm
from ..kernels.products import qmatmul_ring as ring
from ..kernels.products.fragments import repack
from . import common

GROUP = 64
# (name, N, K): the products of one decoder layer (Q/K/V and gate/up stacked) and the head.
SHAPES = {
    "gemma3-12b": [("qkv", 8192, 3840), ("o", 3840, 4096), ("gate_up", 30720, 3840),
                   ("down", 3840, 15360), ("head", 262144, 3840)],
    "llama3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                  ("down", 4096, 14336)],
}
VARIANTS = {
    "default": {},
    # The TMA-ring kernel (`qmatmul_ring`, Hopper) at its defaults, and with two consumer
    # warps a row tile (bench/NOTES.md, "End to end" → "Stop 34", has the other stage
    # sizes and splits swept, at 98bc8dd and cadd4a7: none faster).
    "ring": {"kernel": "ring"},
    "ring_kw2": {"kernel": "ring", "kw": 2},
}


def product(x, w, variant: dict):
    """One product of the variant: ``kernel`` picks the ring kernel, the rest are its
    launcher's (or `qmatmul_mma.mma_shape`'s) overrides."""
    options = dict(variant)
    if options.pop("kernel", None) == "ring":
        return ring.qmatmul_ring(x, w, **options)
    return mm.qmatmul_mma(x, w, **options)
L2_CLEAR_BYTES = 256 << 20  # distinct weights per shape: more than the H200's L2


def time_variant(weights, x, variant: dict) -> float:
    """µs per product of ``x`` with each of ``weights`` in turn, replayed from a graph."""
    def run(w):
        product(x, w, variant)
    return common.time_graph_us(run, [(w,) for w in weights], min_calls=2 * len(weights))


def main(out_dir: str = "bench/results", quick: bool = False) -> int:
    meta = common.metadata()
    copy_gbs = common.copy_bandwidth_gbs()
    rows = []
    for model, shapes in SHAPES.items():
        for name, N, K in shapes:
            one = common.random_quantized((N, K), 4, GROUP, 0.01, 0.02)
            nbytes = one.nbytes
            count = max(2, math.ceil(L2_CLEAR_BYTES / nbytes))
            weights = [repack(one)] + [repack(common.random_quantized((N, K), 4, GROUP, 0.01, 0.02))
                                       for _ in range(count - 1)]
            del one
            for M in ((1, 32) if quick else (1, 8, 32)):  # 1 and 8 share a compile
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                ref = mm.qmatmul_mma(x, weights[0])
                for vname, variant in VARIANTS.items():
                    row = {"model": model, "product": name, "N": N, "K": K, "rows": M,
                           "variant": vname}
                    try:
                        # Whether the variant gives the default's bits (the same sums in
                        # the same order: not so where the split of K moves).
                        row["bitwise_equal"] = bool(torch.equal(
                            product(x, weights[0], variant), ref))
                        us = time_variant(weights, x, variant)
                        row.update(us=us, share_of_copy=nbytes / (us * 1e-6) / 1e9 / copy_gbs)
                    except Exception as exc:  # noqa: BLE001 -- a variant that fails is reported
                        row["not_run"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                    rows.append(row)
                    print(row, flush=True)
            del weights
            torch.cuda.empty_cache()
    best = {}
    for r in rows:
        if "us" in r:
            key = (r["model"], r["product"], r["rows"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    payload = {"meta": meta, "copy_GBps": copy_gbs, "quick": quick, "rows": rows,
               "fastest": [{"model": k[0], "product": k[1], "rows": k[2],
                            "variant": v["variant"], "us": v["us"],
                            "share_of_copy": v["share_of_copy"]} for k, v in best.items()]}
    common.write_results(out_dir, "products", payload)
    common.print_table(payload["fastest"], ["model", "product", "rows", "variant", "us",
                                            "share_of_copy"])
    return 0
