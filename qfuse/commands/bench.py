"""`qfuse bench NAME`: run one GPU benchmark of `qfuse/bench/` (JSON + PNG results)."""

from __future__ import annotations

import importlib

import torch

from ..errors import UserError

NAMES = ["act", "attention", "mlp", "products", "train", "e2e", "steps", "gate", "serve",
         "e2e_tp"]


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="GPU benchmarks (JSON + PNG in bench/results/)")
    p.add_argument("name", choices=NAMES,
                   help="which benchmark (e2e_tp: under torchrun, tensor parallel)")
    p.add_argument("--out", default="bench/results", help="folder for <name>.json/.png")
    p.add_argument("--quick", action="store_true", help="fewer shapes (smoke test)")
    p.add_argument("--sweep", metavar="FILE", default=None,
                   help="attention only: time the launch variants of a JSON sweep file "
                        "side by side (format: qfuse/bench/attention.py)")
    p.add_argument("--parts", default=None, metavar="LIST",
                   help="serve, gate, steps and products: the comma-separated parts to run, "
                        "of slotted, async, prefix, deterministic, paged, mixed (serve); "
                        "matrix, formats (gate; formats: the model written as AWQ, GPTQ, "
                        "compressed-tensors and GGUF checkpoints); the variants of "
                        "qfuse/bench/steps.py (steps); variants, chain (products; default: "
                        "variants) (default: all)")
    p.add_argument("--budget-s", type=float, default=None, metavar="SECONDS",
                   help="serve only: the whole run's time budget (default 400 on a GPU)")


def run(args) -> int:
    if args.sweep is not None and args.name != "attention":
        raise UserError(f"--sweep is an option of `qfuse bench attention`, not of {args.name}")
    if args.parts is not None and args.name not in ("serve", "gate", "steps", "products"):
        raise UserError(f"--parts is an option of `qfuse bench serve`, `gate`, `steps` and "
                        f"`products`, not of {args.name}")
    if args.budget_s is not None and args.name != "serve":
        raise UserError(f"--budget-s is an option of `qfuse bench serve`, not of {args.name}")
    parts = tuple(p.strip() for p in args.parts.split(",")) if args.parts else None
    if args.name == "e2e_tp":  # --quick also runs on CPU (gloo), on the bundled model
        from ..parallel import bench as tp_bench

        return tp_bench.main(out_dir=args.out, quick=args.quick)
    if not torch.cuda.is_available() and args.name != "serve":  # serve --quick: CPU too
        raise UserError("qfuse bench needs a CUDA GPU; none is visible")
    module = importlib.import_module(f"qfuse.bench.{args.name}")
    if args.name == "attention":
        return module.main(out_dir=args.out, quick=args.quick, sweep=args.sweep)
    if args.name == "serve":
        return module.main(out_dir=args.out, quick=args.quick, parts=parts,
                           budget_s=args.budget_s)
    if args.name in ("gate", "steps", "products"):
        return module.main(out_dir=args.out, quick=args.quick, parts=parts)
    return module.main(out_dir=args.out, quick=args.quick)
