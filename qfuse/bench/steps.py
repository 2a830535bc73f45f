"""`qfuse bench steps`: the decode step as fused steps against the layer-by-layer paths,
side by side in one run (same GPU, same process), on the e2e bench's headline shapes.

Four ways to run one decode step, each on a model built under its levers:
  fragments        weights held in mma fragment order, products by the fragment and ring
                   kernels, layer by layer (~17 launches a layer): today's default;
  fragments fused  the same held weights as fused steps (`kernels.steps.fragment_steps`);
  gemv             the weights kept in the MLX layout (QFUSE_QMATMUL_MMA=0), the CUDA-core
                   GEMV's products, layer by layer;
  gemv fused       the same MLX-layout weights as the portable fused steps.
Each fused variant against its layer-by-layer one is what fusing the steps buys for the
same product arithmetic; `fragments fused` against `fragments`, whether they become the
default. Each row: ms per
token (CUDA graphs), share of the copy roofline, launches per step (profiler, eager) and
resident memory against the model and cache. Results: bench/results/steps.json|png.
"""

from __future__ import annotations

import os

import torch

from .. import levers
from ..errors import UserError
from . import common, e2e

VARIANTS = {
    "fragments": {"QFUSE_FUSED_STEPS": "0"},
    "fragments fused": {"QFUSE_FUSED_STEPS": "1"},
    "gemv": {"QFUSE_QMATMUL_MMA": "0", "QFUSE_FUSED_STEPS": "0"},
    "gemv fused": {"QFUSE_QMATMUL_MMA": "0", "QFUSE_FUSED_STEPS": "1"},
}
# (model, weight bits, kv bits, context, batch): the e2e headline shapes the steps serve
CONFIGS = [("gemma3-12b", 4, 4, 8192, 1), ("gemma3-12b", 4, 4, 8192, 4),
           ("llama3-8b", 4, 0, 8192, 1)]
# --quick: the held weights' two variants at one and four rows, the default's choice
QUICK = [("gemma3-12b", 4, 4, 8192, 1), ("gemma3-12b", 4, 4, 8192, 4),
         ("llama3-8b", 4, 0, 8192, 1)]
QUICK_VARIANTS = ("fragments", "fragments fused")


def _with_levers(env: dict, run):
    """run() with each variable of ``env`` set through `levers.setting` (plans anew)."""
    if not env:
        return run()
    (var, value), rest = next(iter(env.items())), dict(list(env.items())[1:])
    with levers.setting(var, value):
        return _with_levers(rest, run)


def _launches(model, kv_bits: int, context: int, B: int) -> float:
    """Kernels a decode step launches (eager, one step profiled after a warm-up)."""
    with levers.use_tier("fast"), torch.no_grad():
        cache = e2e.filled_cache(model, B, kv_bits, context, 4)
        tokens = torch.zeros(B, dtype=torch.int64, device="cuda")
        model.decode(tokens, cache)
        plan_kernel = model.plans.get("decode", B, cache).model["layers"].choice
        launches = common.gpu_profile(lambda: model.decode(tokens, cache), 1)["launches_per_step"]
    return launches, f"{plan_kernel.kernel}: {plan_kernel.reason}"


def main(out_dir: str = "bench/results", quick: bool = False,
         parts: tuple[str, ...] | None = None) -> int:
    """``parts``: the variants to run (default: all, or QUICK_VARIANTS with ``quick``)."""
    unknown = sorted(set(parts or ()) - set(VARIANTS))
    if unknown:
        raise UserError(f"unknown steps variant(s) {', '.join(unknown)}; the variants: "
                        f"{', '.join(VARIANTS)}")
    meta = common.metadata()
    copy_gbs = common.copy_bandwidth_gbs()
    rows = []
    configs = QUICK if quick else CONFIGS
    chosen = parts or (QUICK_VARIANTS if quick else tuple(VARIANTS))
    variants = {k: v for k, v in VARIANTS.items() if k in chosen}
    for variant, env in variants.items():
        built, model = None, None
        for name, wb, kb, context, B in configs:
            def one(name=name, wb=wb, kb=kb, context=context, B=B):
                nonlocal built, model
                if built != (name, wb):
                    model = None
                    torch.cuda.empty_cache()
                    model, built = e2e.random_model(e2e.MODELS[name], wb, "cuda"), (name, wb)
                row = e2e.run_config(model, name, wb, kb, context, B, "fast", copy_gbs, 20)
                row["launches_per_step"], row["layers"] = _launches(model, kb, context, B)
                return row
            row = {"variant": variant, **_with_levers(env, one)}
            rows.append(row)
            print(row, flush=True)
        model = None
        torch.cuda.empty_cache()
    payload = {"meta": meta, "copy_GBps": copy_gbs, "quick": quick, "variants": VARIANTS,
               "rows": rows}
    common.write_results(out_dir, "steps", payload)
    plot(rows, os.path.join(out_dir, "steps.png"))
    common.print_table(rows, ["variant", "model", "kv", "batch", "ms_per_token",
                              "roofline_share", "launches_per_step",
                              "resident_vs_model_and_cache", "not_run"])
    return 0


def plot(rows: list[dict], path: str) -> None:
    """Share of the copy roofline per configuration, one bar per variant."""
    plt = common.pyplot(path)
    if plt is None:
        return
    configs = list(dict.fromkeys(f"{r['model']} kv {r['kv']} B={r['batch']}" for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(VARIANTS)
    for j, variant in enumerate(VARIANTS):
        shares = {f"{r['model']} kv {r['kv']} B={r['batch']}": r.get("roofline_share", 0)
                  for r in rows if r["variant"] == variant}
        ax.bar([i + j * width for i in range(len(configs))],
               [shares.get(c, 0) for c in configs], width, label=variant)
    ax.set_xticks([i + width * (len(VARIANTS) - 1) / 2 for i in range(len(configs))], configs)
    ax.set_ylabel("share of the copy roofline")
    ax.set_title("decode step: fused steps against layer by layer (4-bit weights, 8k)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
