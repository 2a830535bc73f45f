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

Parts (`--parts`, default both): "matrix", the configurations above; "formats", the model
written as a checkpoint of each other tool qfuse reads (`formats.writers.KINDS`: AWQ, GPTQ
with and without act-order, compressed-tensors asymmetric and symmetric, 4-bit, groups of
64, round to nearest; GGUF as llama.cpp's converter writes it, Q8_0 throughout and Q4_0
projections with a Q8_0 embedding, from the `gguf` package's quantizers, which the part
then needs), each loaded as a user loads it and gated as a configuration with a dense KV
cache against its own oracle, with its cost against the dense model's oracle, and a
PASS/FAIL line per format.

Writes gate.json (the matrix under "gates", the formats under "formats") and gate.png (the
matrix); exit 0 when every configuration run passes both tiers.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from .. import levers
from ..convert import quantize_model
from ..errors import UserError
from ..formats import gguf_writer, writers
from ..gates import golden_io, measures, oracle_gate, quant_cost
from ..loading import DEFAULT_MODEL, load_model
from ..oracle import oracle_model
from . import common

WEIGHT_BITS = (0, 8, 4)  # 0: the model's own weights
KV_BITS = (0, 8, 4)  # 0: a dense cache
GROUP_SIZE = 64  # weights and KV
PARTS = ("matrix", "formats")


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


def gate_configuration(model, oracle, golden: dict, quant: str, kv_bits: int,
                       kv_group_size: int, cost_refs, progress: bool = True) -> dict:
    """One configuration's gates (module docstring) as a result row named ``quant``:
    ``model`` (bfloat16) and ``oracle`` (its `oracle.oracle_model`); its quantization cost
    along ``cost_refs`` (`quant_cost.cost_references` of the dense model), None when
    ``cost_refs`` is None (the dense configuration)."""
    refs = oracle_gate.oracle_references(model, golden, kv_bits, kv_group_size, oracle,
                                         progress)
    rows = oracle_gate.run_oracle_gate(model, golden, kv_bits, kv_group_size, refs,
                                       progress=progress)
    exact = exact_rows(model, refs, kv_bits, kv_group_size)
    cost = (quant_cost.cost_row(quant, oracle, kv_bits, kv_group_size, cost_refs)
            if cost_refs is not None else None)
    verdict, exact_verdict = oracle_gate.oracle_verdict(rows), _exact_verdict(exact)
    print(f"\n{quant}: fast tier {verdict}, exact tier {exact_verdict}")
    print(oracle_gate.oracle_report(rows))
    return {"quantization": quant, "kv_bits": kv_bits,
            "verdict": verdict, "pass": verdict == "PASS", "rule": oracle_gate.RULE,
            "kernels_run": measures.kernels_run(rows),
            "rows": oracle_gate.oracle_rows_as_dicts(rows),
            "exact": {"verdict": exact_verdict, "pass": exact_verdict == "PASS",
                      "rows": exact},
            "quantization_cost": cost}


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
            row = gate_configuration(m, orc, golden, quant, kv_bits, kv_group_size,
                                     cost_refs if bits or kv_bits else None, progress)
            results.append({"weight_bits": bits, **row})
        del orc, m
    return results


def format_gates(model, model_dir: Path, golden: dict, device: str,
                 progress: bool = True) -> list[dict]:
    """Each checkpoint format of `writers.KINDS` written from the dense model folder
    ``model_dir`` (``model``, loaded from it) into a temporary folder (4-bit, groups of
    `GROUP_SIZE`; the GGUF kinds their own types), loaded as a user loads it (bfloat16,
    on ``device``) and gated as a configuration of the matrix with a dense KV cache: the
    fast tier against the converted model's own oracle, the exact tier against its
    compat, and what its quantization costs against the dense model's oracle. One row per
    format, named by `"format"`; the run then ends with a PASS/FAIL line per format."""
    gguf_writer.require_gguf()  # before the first format's minutes, not after them
    kv_group_size = min(GROUP_SIZE, model.config.head_dim)
    cost_refs = quant_cost.cost_references(oracle_model(model), golden, progress)
    results = []
    with tempfile.TemporaryDirectory(prefix="qfuse-formats-") as tmp:
        for kind in writers.KINDS:
            written = writers.write_checkpoint(model_dir, Path(tmp) / kind, kind,
                                               group=GROUP_SIZE)
            m = load_model(written, dtype=torch.bfloat16, device=device, progress=False)
            row = gate_configuration(m, oracle_model(m), golden,
                                     f"{kind} {quant_cost.weights_label(m)}, dense KV", 0,
                                     kv_group_size, cost_refs, progress)
            results.append({"format": kind, "weight_bits": writers.weight_bits(kind), **row})
            results[-1]["format_verdict"] = format_verdict(row)
            del m
    return results


def _passed(row: dict) -> bool:
    return row["pass"] and row["exact"]["pass"]


def format_verdict(row: dict) -> str:
    """One format's verdict over both tiers: PASS when both pass, FAIL when either fails,
    NOT TESTED otherwise (no fused kernel ran)."""
    verdicts = (row["verdict"], row["exact"]["verdict"])
    return "PASS" if _passed(row) else "FAIL" if "FAIL" in verdicts else "NOT TESTED"


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
         model_dir: str | Path | None = None, device: str = "cuda",
         parts: tuple[str, ...] | None = None) -> int:
    """``quick``: the first golden prompt only (a smoke test). ``parts``: of `PARTS`
    (default all): "matrix", the configurations of the model's own weights quantized
    and its KV cache; "formats", checkpoints of other tools written from the model
    (`format_gates`)."""
    parts = tuple(parts or PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise UserError(f"unknown part {unknown[0]!r} of `qfuse bench gate` (parts: "
                        f"{', '.join(PARTS)})")
    model_dir = Path(model_dir or DEFAULT_MODEL)
    golden_path = model_dir / "golden.json"
    if not golden_path.exists():
        raise UserError(f"no golden file at {golden_path}; write one first with "
                        f"`qfuse gate {model_dir} --make-golden --dtype bfloat16`")
    model = load_model(model_dir, dtype=torch.bfloat16, device=device)
    golden = golden_io.load_golden(golden_path)
    if quick:
        golden = {**golden, "trajectories": golden["trajectories"][:1]}
    results = gate_matrix(model, golden) if "matrix" in parts else []
    formats = format_gates(model, model_dir, golden, device) if "formats" in parts else []
    costs = [r["quantization_cost"] for r in results + formats if r["quantization_cost"]]
    print("\nquantization cost (the oracle, quantized against dense):")
    print(quant_cost.cost_report(costs))
    for r in formats:
        print(f"{r['format']}: {format_verdict(r)} (fast tier {r['verdict']}, exact tier "
              f"{r['exact']['verdict']})")
    all_pass = all(_passed(r) for r in results + formats)
    common.write_results(out_dir, "gate", {
        "meta": common.metadata(), "model": str(model_dir.name), "dtype": "bfloat16",
        "oracle": "float32", "rule": oracle_gate.RULE, "quick": quick, "parts": list(parts),
        "golden_tokens_per_prompt": golden["n_tokens"], "prompts": len(golden["trajectories"]),
        "gates": results, "formats": formats, "all_pass": all_pass})
    if results:
        plot(results, Path(out_dir) / "gate.png")
    return 0 if all_pass else 1
