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

``--parts chain`` (not in the default run) times instead a decoder layer's chain of
dependent products (O, up, down) three ways side by side, under CUDA graphs: the ring
chain (`ring_chain`, one persistent launch), the same products as separate `qmatmul_ring`
launches (PDL on, the same splits, so the same bits), the `qmatmul_mma` launches the
decode path takes at these rows (other splits, other bits), and a torch copy of the same bytes
(eager: inside a graph a copy becomes a copy-engine node, see `common.copy_bandwidth_gbs`);
then the chain's timed form (`RingChain(..., timed=True)`) the same way, its µs beside the
untimed chain's (what the clocks cost) and, for one launch in the middle of the replay,
where each program's time went (`ring_chain.fold_timing`: shares of each program's span
waiting for ring slots, on the launch before, on counters, on data, computing, storing);
the result is `products_chain.json`.
"""

from __future__ import annotations

import dataclasses
import math
from itertools import pairwise

import torch

from ..errors import UserError
from ..kernels.products import qmatmul_mma as mm
from ..kernels.products import qmatmul_ring as ring
from ..kernels.products import ring_chain as rc
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


# (K_0, N_0, N_1, N_2): a layer's O (K_0 → N_0), up (→ N_1) and down (→ N_2) as one chain.
CHAINS = {"gemma3-12b": (4096, 3840, 15360, 3840), "llama3-8b": (4096, 4096, 14336, 4096)}
PARTS = ("variants", "chain")


def _copy_us(nbytes: int) -> float:
    """µs of an eager device-to-device copy of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return common.time_graph_us(dst.copy_, [(src,)], min_calls=10, graph=False)


def _separate(x, fs):
    """The chain as separate `qmatmul_ring` launches (PDL on where the GPU has it)."""
    for f in fs:
        x = ring.qmatmul_ring(x, f)
    return x


def _fragment(x, fs):
    """The chain as separate `qmatmul_mma` launches: what the decode path runs at 1-8 rows
    for these one-wave products (`qmatmul_ring.preferred`); its own splits, so other bits."""
    for f in fs:
        x = mm.qmatmul_mma(x, f)
    return x


def _chain_weights(dims):
    return [repack(common.random_quantized((n, k), 4, GROUP, 0.01, 0.02))
            for k, n in pairwise(dims)]


def chain_main(out_dir: str, quick: bool) -> int:
    """The chain part (module docstring): µs per chain and share of copy per variant."""
    meta = common.metadata()
    copy_gbs = common.copy_bandwidth_gbs()
    rows = []
    for model, dims in CHAINS.items():
        one = _chain_weights(dims)
        nbytes = sum(f.nbytes for f in one)
        count = max(2, math.ceil(L2_CLEAR_BYTES / nbytes))
        sets = [one] + [_chain_weights(dims) for _ in range(count - 1)]
        chains = [rc.RingChain(fs) for fs in sets]
        timed = [rc.RingChain(fs, timed=True) for fs in sets]
        copy_us = _copy_us(nbytes)
        for M in ((1,) if quick else (1, 4)):
            x = torch.randn(M, dims[0], device="cuda", dtype=torch.bfloat16)
            row = {"model": model, "dims": list(dims), "rows": M, "MB": nbytes / 1e6,
                   "copy_us": copy_us, "programs": chains[0].programs,
                   "bitwise_equal": bool(torch.equal(chains[0](x)[-1], _separate(x, sets[0])))}
            for name, fn, inputs in (("chain", _ChainCall(x), [(c,) for c in chains]),
                                     ("separate", _separate, [(x, fs) for fs in sets]),
                                     ("fragment", _fragment, [(x, fs) for fs in sets])):
                us = common.time_graph_us(fn, inputs, min_calls=2 * len(inputs))
                row[f"{name}_us"] = us
                row[f"{name}_share_of_copy"] = nbytes / (us * 1e-6) / 1e9 / copy_gbs
            row.update(_timed_run(x, chains[0], timed))
            rows.append(row)
            print({k: v for k, v in row.items() if k != "timing_programs"}, flush=True)
        del sets, chains, timed, one
        torch.cuda.empty_cache()
    payload = {"meta": meta, "copy_GBps": copy_gbs, "quick": quick, "rows": rows}
    common.write_results(out_dir, "products_chain", payload)
    common.print_table(rows, ["model", "rows", "MB", "copy_us", "chain_us", "separate_us",
                              "fragment_us", "chain_share_of_copy", "separate_share_of_copy",
                              "fragment_share_of_copy", "bitwise_equal"])
    shares = [f"{role}_{b}" for role, names in (("producer", rc.PRODUCER_BUCKETS),
                                                 ("consumer", rc.CONSUMER_BUCKETS))
              for b in names]
    common.print_table([{"model": r["model"], "rows": r["rows"], "timed_us": r["timed_us"],
                         "launch_us": r["timing"]["launch_ns"] / 1e3,
                         **{k: r["timing"]["shares"][k]["mean"] for k in shares}}
                        for r in rows], ["model", "rows", "timed_us", "launch_us", *shares])
    return 0


def _timed_run(x, untimed, timed) -> dict:
    """The timed chains replayed as the chain variant is, and one launch's breakdown: the
    middle chain's (a launch with another before it in the replay, as in a decode step),
    its summary and per-program shares, and each launch's mean shares."""
    out = {"timed_bitwise_equal": all(torch.equal(a, b)
                                      for a, b in zip(timed[0](x), untimed(x)))}
    out["timed_us"] = common.time_graph_us(_ChainCall(x), [(c,) for c in timed],
                                           min_calls=2 * len(timed))
    folds = [rc.fold_timing(c.timing) for c in timed]
    middle = folds[len(folds) // 2]
    out["timing"] = middle.summary()
    out["timing_programs"] = dataclasses.asdict(middle)
    out["timing_launch_means"] = {
        name: [sum(f.shares[name]) / len(f.shares[name]) for f in folds]
        for name in middle.shares}
    return out


class _ChainCall:
    """``chain(x)`` for a fixed x: the chain variant's timed call."""

    def __init__(self, x):
        self.x = x

    def __call__(self, chain):
        return chain(self.x)


def main(out_dir: str = "bench/results", quick: bool = False,
         parts: tuple[str, ...] | None = None) -> int:
    """``parts``: "variants" (the default: the launch variants per product) and/or
    "chain" (the ring chain against separate launches and copy)."""
    parts = parts or ("variants",)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise UserError(f"unknown part(s) of `qfuse bench products`: {', '.join(unknown)} "
                        f"(known: {', '.join(PARTS)})")
    if "chain" in parts:
        chain_main(out_dir, quick)
    if "variants" in parts:
        return variants_main(out_dir, quick)
    return 0


def variants_main(out_dir: str = "bench/results", quick: bool = False) -> int:
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
