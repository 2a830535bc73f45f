"""`qfuse bench gate`: the gates of every configuration of the default model, as a report.

Configurations: the model's own bf16 weights, and those weights quantized to 8 and to 4
bits (groups of 64), each with a dense, an 8-bit and a 4-bit KV cache (groups of 64).
For each, along the golden prompts of the model folder (`qfuse gate --make-golden`
writes them; they are never made here):

- the fast tier against the oracle (`oracle_gate.run_oracle_gate`): agreement with the
  oracle's argmax at least compat's minus one per 64, mean KL(oracle ‖ fast) at most
  2 × compat's + 1e-4, per prompt; compat's and fast's figures side by side, fast
  against compat as information; NOT TESTED where no fused kernel ran;
- the exact tier: logits bitwise equal to compat's, teacher-forced along the same
  oracle trajectories (compat's logits are the ones the fast tier's rule already has);
- what the quantization itself costs: the configuration's oracle against the dense
  oracle (dense weights and KV) along the dense oracle's trajectories (`quant_cost.cost_row`).

Writes gate.json and gate.png; exit 0 when every configuration passes both tiers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import levers
from ..convert import quantize_model
from ..errors import UserError
from ..gates import golden_io, measures, oracle_gate, quant_cost
from ..loading import DEFAULT_MODEL, load_model
from ..oracle import oracle_model
from . import common

WEIGHT_BITS = (0, 8, 4)  # 0: the model's own weights
KV_BITS = (0, 8, 4)  # 0: a dense cache
GROUP_SIZE = 64  # weights and KV


def exact_rows(model, refs: list[oracle_gate.OracleReference], kv_bits: int,
               kv_group_size: int) -> list[dict]:
    """The exact tier teacher-forced along each reference's tokens: whether its logits are
    compat's bit for bit, and the fused kernels it ran."""
    rows = []
    for ref in refs:
        before = levers.counters()
        with levers.use_tier("exact"):
            logits, _ = measures.teacher_forced(model, ref.prompt_ids, ref.tokens, kv_bits,
                                                kv_group_size)
        rows.append({"prompt": ref.prompt,
                     "bitwise_equal": bool(torch.equal(logits, ref.compat_logits)),
                     "max_abs_diff": float((logits - ref.compat_logits).abs().max()),
                     "kernels": measures.kernel_dispatches(before, levers.counters())})
    return rows


def _exact_verdict(rows: list[dict]) -> str:
    if not any(r["kernels"] for r in rows):
        return "NOT TESTED"
    return "PASS" if all(r["bitwise_equal"] for r in rows) else "FAIL"


def gate_matrix(model, golden: dict, progress: bool = True) -> list[dict]:
    """Every configuration's gates and quantization cost (module docstring)."""
    kv_group_size = min(GROUP_SIZE, model.config.head_dim)  # small test models
    dense_oracle = oracle_model(model)
    cost_refs = quant_cost.cost_references(dense_oracle, golden, progress)
    results = []
    for bits in WEIGHT_BITS:
        m = quantize_model(model, bits, GROUP_SIZE) if bits else model
        orc = oracle_model(m) if bits else dense_oracle
        for kv_bits in KV_BITS:
            quant = f"{quant_cost.weights_label(m)}, {f'{kv_bits}-bit' if kv_bits else 'dense'} KV"
            refs = oracle_gate.oracle_references(m, golden, kv_bits, kv_group_size, orc, progress)
            rows = oracle_gate.run_oracle_gate(m, golden, kv_bits, kv_group_size, refs,
                                               progress=progress)
            exact = exact_rows(m, refs, kv_bits, kv_group_size)
            cost = (quant_cost.cost_row(quant, orc, kv_bits, kv_group_size, cost_refs)
                    if bits or kv_bits else None)
            verdict, exact_verdict = oracle_gate.oracle_verdict(rows), _exact_verdict(exact)
            results.append({
                "quantization": quant, "weight_bits": bits, "kv_bits": kv_bits,
                "verdict": verdict, "pass": verdict == "PASS", "rule": oracle_gate.RULE,
                "kernels_run": measures.kernels_run(rows),
                "rows": oracle_gate.oracle_rows_as_dicts(rows),
                "exact": {"verdict": exact_verdict, "pass": exact_verdict == "PASS",
                          "rows": exact},
                "quantization_cost": cost})
            print(f"\n{quant}: fast tier {verdict}, exact tier {exact_verdict}")
            print(oracle_gate.oracle_report(rows))
        del orc, m
    return results


def plot(results: list[dict], path: Path) -> None:
    plt = common.pyplot(path)
    if plt is None:
        return

    labels = [f"W {r['weight_bits'] or 16}-bit\nKV {r['kv_bits'] or 'dense'}"
              for r in results]
    # Each configuration's prompt nearest its KL limit, and nearest its agreement floor.
    kl_worst = [max(r["rows"], key=lambda x: x["fast_mean_kl"] / x["kl_limit"]) for r in results]
    ag_worst = [min(r["rows"], key=lambda x: x["fast_agreement"] - x["agreement_floor"])
                for r in results]
    x = range(len(results))
    colors = ["g" if r["pass"] else "r" for r in results]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, 5))
    a1.bar([i - 0.2 for i in x], [max(w["fast_mean_kl"], 1e-12) for w in kl_worst], 0.4,
           color=colors, label="fast")
    a1.bar([i + 0.2 for i in x], [max(w["compat_mean_kl"], 1e-12) for w in kl_worst], 0.4,
           color="0.6", label="compat")
    a1.scatter(list(x), [w["kl_limit"] for w in kl_worst], marker="_", s=400, color="k",
               label="fast's limit (2 × compat + 1e-4)")
    a1.set_yscale("log")
    a1.set_ylabel("mean KL(oracle ‖ tier)")
    a2.bar([i - 0.2 for i in x], [w["fast_agreement"] / w["positions"] for w in ag_worst], 0.4,
           color=colors, label="fast")
    a2.bar([i + 0.2 for i in x], [w["compat_agreement"] / w["positions"] for w in ag_worst],
           0.4, color="0.6", label="compat")
    a2.scatter(list(x), [w["agreement_floor"] / w["positions"] for w in ag_worst], marker="_",
               s=400, color="k", label="fast's floor (compat − 1 per 64)")
    a2.set_ylim(0.8, 1.0)
    a2.set_ylabel("argmax agreement with the oracle")
    for ax in (a1, a2):
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
    fig.suptitle("qfuse gates against the float32 oracle, default model: per configuration "
                 "the prompt nearest its KL limit (left) and its agreement floor (right); green: "
                 "fast passes; KL bars floored at 1e-12", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(out_dir: str = "bench/results", quick: bool = False,
         model_dir: str | Path | None = None, device: str = "cuda") -> int:
    """``quick``: the first golden prompt only (a smoke test)."""
    model_dir = Path(model_dir or DEFAULT_MODEL)
    golden_path = model_dir / "golden.json"
    if not golden_path.exists():
        raise UserError(f"no golden file at {golden_path}; write one first with "
                        f"`qfuse gate {model_dir} --make-golden --dtype bfloat16`")
    model = load_model(model_dir, dtype=torch.bfloat16, device=device)
    golden = golden_io.load_golden(golden_path)
    if quick:
        golden = {**golden, "trajectories": golden["trajectories"][:1]}
    results = gate_matrix(model, golden)
    print("\nquantization cost (the oracle, quantized against dense):")
    print(quant_cost.cost_report([r["quantization_cost"] for r in results
                                  if r["quantization_cost"]]))
    all_pass = all(r["pass"] and r["exact"]["pass"] for r in results)
    common.write_results(out_dir, "gate", {
        "meta": common.metadata(), "model": str(model_dir.name), "dtype": "bfloat16",
        "oracle": "float32", "rule": oracle_gate.RULE, "quick": quick,
        "golden_tokens_per_prompt": golden["n_tokens"], "prompts": len(golden["trajectories"]),
        "gates": results, "all_pass": all_pass})
    plot(results, Path(out_dir) / "gate.png")
    return 0 if all_pass else 1
