"""What the quantization itself costs, reported and never a limit: the oracle of the
quantized model (and of the dense one with a quantized KV cache) teacher-forced along
the dense oracle's greedy trajectories, mean and max KL(dense ‖ it) and top-1 agreement
per configuration (`quantization_cost`, `cost_row`, `cost_report`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..oracle import oracle_forced, oracle_model, oracle_trajectory
from .measures import kl_divergence, progress_bar


def weights_label(model) -> str:
    """How ``model`` stores its weights, as the cost and bench tables name it: "dense
    weights", "4-bit weights", or "quantized weights (4/8-bit)" for mixed widths."""
    from ..models.decoder import Linear

    bits = sorted({m.bits for m in model.modules() if isinstance(m, Linear) and m.bits})
    if not bits:
        return "dense weights"
    if len(bits) == 1:
        return f"{bits[0]}-bit weights"
    return f"quantized weights ({'/'.join(map(str, bits))}-bit)"


@dataclass
class CostReference:
    """One prompt's dense reference for the quantization cost: the dense model's oracle,
    its greedy ``tokens`` with a dense cache and its logits along them."""
    prompt_ids: list[int]
    tokens: list[int]
    logits: torch.Tensor


def cost_references(dense_oracle, golden: dict, progress: bool = True) -> list[CostReference]:
    """Per golden prompt, the dense oracle's greedy trajectory (as many tokens as the
    golden continuation) and its logits."""
    refs = []
    for t in progress_bar(golden["trajectories"], "dense oracle", progress):
        tokens, logits, _ = oracle_trajectory(dense_oracle, t["prompt_ids"],
                                              len(t["continuation"]))
        refs.append(CostReference(t["prompt_ids"], tokens, logits))
    return refs


def cost_row(config: str, oracle, kv_bits: int, kv_group_size: int,
             refs: list[CostReference]) -> dict:
    """One configuration's cost: ``oracle`` (of the quantized model, or the dense one with
    a quantized cache) teacher-forced along the dense references; mean and max
    KL(dense ‖ it) over all positions, and its top-1 agreement with the dense oracle."""
    kls, agree, total = [], 0, 0
    for ref in refs:
        logits, _ = oracle_forced(oracle, ref.prompt_ids, ref.tokens, kv_bits, kv_group_size)
        kls.append(kl_divergence(ref.logits, logits))
        agree += int((logits.argmax(-1) == ref.logits.argmax(-1)).sum())
        total += len(ref.tokens)
    kl = torch.cat(kls)
    return {"config": config, "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "top1_agreement": agree / total}


@torch.no_grad()
def quantization_cost(dense, golden: dict, quantized=None, bits: int = 4, group_size: int = 64,
                      kv_bits=(8, 4), kv_group_size: int = 64,
                      progress: bool = True) -> list[dict]:
    """What the quantization itself costs, both sides in the oracle (`oracle.oracle_model`:
    float32, no bf16 rounding, so the figure is the quantization's and not the bf16
    arithmetic's): for the quantized weights with a dense cache and with each of
    ``kv_bits``, and for the dense weights with each quantized cache, `cost_row` along
    the dense oracle's greedy trajectories (`cost_references`). ``dense``: a Decoder with
    dense weights; ``quantized``: the same model with quantized weights (default:
    ``dense`` quantized here to ``bits`` in groups of ``group_size``)."""
    from ..convert import quantize_model

    if weights_label(dense) != "dense weights":
        raise ValueError(f"the dense source holds {weights_label(dense)}")
    kv_group_size = min(kv_group_size, dense.config.head_dim)  # small test models
    dense_oracle = oracle_model(dense)
    if quantized is None:
        quantized = quantize_model(dense, bits, group_size)
    label = weights_label(quantized)
    if label == "dense weights":
        raise ValueError("the quantized model holds dense weights")
    q_oracle = oracle_model(quantized)
    variants = [(f"{label}, dense KV", q_oracle, 0)]
    variants += [(f"dense weights, {b}-bit KV", dense_oracle, b) for b in kv_bits]
    variants += [(f"{label}, {b}-bit KV", q_oracle, b) for b in kv_bits]
    refs = cost_references(dense_oracle, golden, progress)
    return [cost_row(name, orc, kb, kv_group_size, refs)
            for name, orc, kb in progress_bar(variants, "quantization cost", progress, "config")]


def cost_report(cost: list[dict]) -> str:
    """`quantization_cost`'s rows, one line per configuration."""
    return "\n".join(f"  {r['config']:<28} mean KL {r['mean_kl']:.2e}  max KL "
                     f"{r['max_kl']:.2e}  top-1 {r['top1_agreement']:.3f}" for r in cost)
