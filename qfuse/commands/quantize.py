"""`qfuse quantize SRC DST`: write an MLX-layout quantized copy of a dense checkpoint, or
of an AWQ/GPTQ/compressed-tensors one (its own codes and groups kept)."""

from __future__ import annotations


def add_parser(sub) -> None:
    from ..quant import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

    p = sub.add_parser("quantize", help="write an MLX-layout quantized checkpoint")
    p.add_argument("src", help="dense HF checkpoint folder, or an AWQ, GPTQ or "
                               "compressed-tensors one, rewritten as it is (only read)")
    p.add_argument("dst", help="new folder to write; refused if it is SRC, inside SRC, or "
                               "not empty (unless --force)")
    p.add_argument("--bits", type=int, default=4, choices=SUPPORTED_BITS,
                   help="bits per weight")
    p.add_argument("--group-size", type=int, default=64, choices=SUPPORTED_GROUP_SIZES,
                   help="weights sharing one scale and bias")
    p.add_argument("--force", action="store_true",
                   help="replace the model in a non-empty DST: the new model is written "
                        "beside it first, then only the model files qfuse writes are "
                        "replaced; every other file in DST is kept; never when DST is or "
                        "holds SRC")
    p.add_argument("--override", action="append", default=[],
                   metavar="MODULE=BITS[:GROUP]|dense",
                   help="per-module setting, e.g. model.layers.0.mlp.down_proj=8:64")


def run(args) -> int:
    from ..convert import parse_overrides, quantize_checkpoint
    from ..saving import foreign_files

    out = quantize_checkpoint(args.src, args.dst, args.bits, args.group_size,
                              parse_overrides(args.override), force=args.force)
    print(f"wrote {out}")
    kept = foreign_files(out)
    if kept:
        print(f"kept {', '.join(kept)} in {out}: not model files, left as they were")
    return 0
