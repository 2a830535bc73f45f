"""`qfuse gate [MODEL]`: compare a tier with compat on frozen golden trajectories
(tensor parallel under torchrun)."""

from __future__ import annotations

from ..errors import UserError
from . import flags


def add_parser(sub) -> None:
    p = sub.add_parser("gate", help="compare a tier with compat on frozen trajectories")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint folder (default: the bundled model)")
    flags.add_model_option(p)
    p.add_argument("--golden", default=None, help="golden file (default: MODEL/golden.json)")
    p.add_argument("--make-golden", action="store_true",
                   help="write the golden file from compat on this device (never implicit)")
    p.add_argument("--tier", default="fast", choices=["exact", "fast"],
                   help="the tier compared with compat")
    p.add_argument("--tokens", type=int, default=64,
                   help="continuation tokens per prompt when writing a golden file")
    flags.add_kv_cache_args(p)
    flags.add_device_args(p)
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    p.add_argument("--quantization-cost", action="store_true",
                   help="also report what the quantization costs (KL, top-1; both sides "
                        "in the float32 oracle): the model's weights and 4/8-bit KV against "
                        "the dense model (a dense MODEL: its 4-bit quantization)")
    p.add_argument("--dense", metavar="DIR", default=None,
                   help="the unquantized checkpoint a quantized MODEL was made from: the "
                        "dense side of --quantization-cost (implies it)")


def run(args) -> int:
    if args.tokens < 1:
        raise UserError(f"--tokens must be at least 1, got {args.tokens}")
    flags.chosen_model(args)
    if flags.world_size() > 1:
        from ..parallel.gate import run_gate_tp

        return run_gate_tp(args)
    from ..from_flags import load_dense_for_gate, load_for_gate
    from ..gates import command

    return command.gate_command(
        lambda: load_for_gate(args), args.model, golden=args.golden,
        write_golden=args.make_golden, tier_name=args.tier, n_tokens=args.tokens,
        kv_bits=args.kv_bits, kv_group_size=args.kv_group_size, json_path=args.json,
        with_quantization_cost=args.quantization_cost or args.dense is not None,
        dense=args.dense, load_dense=lambda: load_dense_for_gate(args))
