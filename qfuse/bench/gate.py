"""`qfuse bench gate`: the gates on the bundled default model, on the GPU, as a report.

First what each quantization costs (compat quantized against compat dense, the
figure each configuration's KL limit scales with: `gates.kl_limit`), then the exact
tier (dense weights and KV: logits must be bitwise equal to compat) and the fast
tier with each quantization (dense or 4-bit weights, each with dense, 8-bit and
4-bit KV: at least 63/64 argmax agreement with compat per prompt and mean KL within
the configuration's limit), along the golden trajectories in the model folder
(`qfuse gate --make-golden` writes them; they are never made here). Each
configuration's verdict is NOT TESTED where no fused kernel ran. Writes gate.json
and gate.png.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import gates
from ..convert import quantize_model
from ..errors import UserError
from ..loading import DEFAULT_MODEL, load_model
from . import common


def gate_matrix(model, golden: dict, cost: list[dict]) -> list[dict]:
    """Each configuration's gate, its KL limit scaled by its quantization cost."""
    cost_of = {r["config"]: r["mean_kl"] for r in cost}
    qmodel = quantize_model(model, 4, 64)
    configs = [("exact", "dense weights, dense KV", model, 0),
               ("fast", "dense weights, dense KV", model, 0),
               ("fast", "dense weights, 8-bit KV", model, 8),
               ("fast", "dense weights, 4-bit KV", model, 4),
               ("fast", "4-bit weights, dense KV", qmodel, 0),
               ("fast", "4-bit weights, 8-bit KV", qmodel, 8),
               ("fast", "4-bit weights, 4-bit KV", qmodel, 4)]
    results = []
    for tier_name, quant, m, kv_bits in configs:
        rows = gates.run_gate(m, golden, tier_name, kv_bits, 64)
        limit = gates.kl_limit(cost_of.get(quant))
        verdict = gates.verdict(rows, tier_name, limit)
        results.append({"tier": tier_name, "quantization": quant, "verdict": verdict,
                        "pass": verdict == "PASS", "kl_limit": limit,
                        "quantization_kl": cost_of.get(quant),
                        "kernels_run": gates.kernels_run(rows),
                        "rows": gates.rows_as_dicts(rows)})
        print(f"\n{tier_name} tier, {quant}: {verdict} (mean-KL limit {limit:.2g})")
        print(gates.report(rows))
    return results


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['tier']}\n{r['quantization'].replace(', ', chr(10))}" for r in results]
    mean_kl = [max(max(x["mean_kl"] for x in r["rows"]), 1e-12) for r in results]
    agree = [min(x["agreement"] / x["positions"] for x in r["rows"]) for r in results]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.bar(range(len(results)), mean_kl, color=["g" if r["pass"] else "r" for r in results])
    a1.scatter(range(len(results)), [r.get("kl_limit", gates.KL_FLOOR) for r in results],
               marker="_", s=400, color="k", label="each configuration's limit")
    a1.set_yscale("log")
    a1.set_ylabel("worst prompt's mean KL(compat ‖ tier)")
    a2.bar(range(len(results)), agree, color=["g" if r["pass"] else "r" for r in results])
    a2.axhline(63 / 64, color="k", ls="--", lw=1, label="63/64")
    a2.set_ylim(0.9, 1.0)
    a2.set_ylabel("worst prompt's argmax agreement")
    for ax in (a1, a2):
        ax.set_xticks(range(len(results)), labels, fontsize=7)
        ax.legend(fontsize=8)
    fig.suptitle("qfuse gates on the default model (bars: 1e-12 floor for KL = 0)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(out_dir: str = "bench/results", quick: bool = False,
         model_dir: str | Path | None = None) -> int:
    model_dir = Path(model_dir or DEFAULT_MODEL)
    golden_path = model_dir / "golden.json"
    if not golden_path.exists():
        raise UserError(f"no golden file at {golden_path}; write one first with "
                        f"`qfuse gate {model_dir} --make-golden --dtype bfloat16`")
    model = load_model(model_dir, dtype=torch.bfloat16, device="cuda")
    golden = gates.load_golden(golden_path)
    cost = gates.quantization_cost(model, golden)
    print("quantization cost (compat quantized against compat dense, bf16):")
    print(gates.cost_report(cost))
    results = gate_matrix(model, golden, cost)
    common.write_results(out_dir, "gate", {
        "meta": common.metadata(), "model": str(model_dir.name), "dtype": "bfloat16",
        "golden_tokens_per_prompt": golden["n_tokens"], "gates": results,
        "all_pass": all(r["pass"] for r in results), "quantization_cost": cost})
    plot(results, Path(out_dir) / "gate.png")
    return 0 if all(r["pass"] for r in results) else 1
