"""The fast tier's gate against the oracle with planted fast tiers, on the CPU.

    python bench/gate_planted.py [--prompts 4] [--tokens 64] [--bits 4] [--kv-bits 4]

The bundled model in bfloat16, its weights quantized (groups of 64), along the oracle's
greedy trajectories of the golden prompts: for each fast tier of
`qfuse.testing.planted_ops` (an honest fast product, and the reference with one fault
injected), the gate's table and verdict (`qfuse.gates.oracle_gate.run_oracle_gate`).
Every Triton kernel is off. tests/test_gate_oracle.py runs the same cases on one prompt, 8 tokens;
this runs them where the test suite cannot afford to (minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from qfuse import choose, levers, testing
from qfuse.convert import quantize_model
from qfuse.gates import golden_io, oracle_gate, quant_cost
from qfuse.loading import DEFAULT_MODEL, load_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--bits", type=int, default=4, choices=[0, 4, 8], help="0: bf16 weights")
    p.add_argument("--kv-bits", type=int, default=4, choices=[0, 4, 8])
    args = p.parse_args(argv)
    for k in levers.KERNELS.values():
        os.environ[k.env_var] = "0"
    model = load_model(DEFAULT_MODEL, dtype=torch.bfloat16)
    if args.bits:
        model = quantize_model(model, args.bits, 64)
    golden = golden_io.load_golden(DEFAULT_MODEL / "golden.json")
    golden = {**golden, "trajectories": [
        {**t, "continuation": t["continuation"][:args.tokens]}
        for t in golden["trajectories"][:args.prompts]]}
    reference_products = testing.as_choices({"linear": testing.cached_reference_linear})
    real = {name: getattr(choose, name) for name in
            ("choose_product", "choose_kv_append", "choose_decode_attention")}
    # compat's values, dequantized once
    choose.choose_product = reference_products["choose_product"]
    refs = oracle_gate.oracle_references(model, golden, args.kv_bits, 64)
    print(f"{quant_cost.weights_label(model)}, {args.kv_bits or 'dense'}-bit KV, "
          f"{args.prompts} prompts × {args.tokens} tokens, bfloat16 on the CPU; "
          f"{oracle_gate.RULE}")
    for name in testing.PLANTED:
        try:
            for attr, fn in testing.as_choices(testing.planted_ops(name)).items():
                setattr(choose, attr, fn)
            levers.reload()  # the model's plans were made with the choices before
            rows = oracle_gate.run_oracle_gate(model, golden, args.kv_bits, 64, references=refs)
        finally:
            for attr, fn in real.items():
                setattr(choose, attr, fn)
            choose.choose_product = reference_products["choose_product"]
        print(f"\n{name}: {oracle_gate.oracle_verdict(rows)}")
        print(oracle_gate.oracle_report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
