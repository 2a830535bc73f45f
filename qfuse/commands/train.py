"""`qfuse train --out DIR`: train a small Gemma 3 text model on the standard library."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError
from . import flags

# Help for the TrainSettings flags; the others are config.json fields.
_HELP = {
    "seq_len": "tokens per training sequence",
    "batch_size": "sequences per step",
    "steps": "optimizer steps",
    "lr": "peak learning rate (AdamW, warmup then cosine decay)",
    "warmup": "linear warmup steps",
    "weight_decay": "AdamW weight decay of the matrices",
    "eval_every": "steps between validation losses",
    "eval_batches": "batches per validation loss",
    "max_chars": "cap the corpus at this many characters (tests)",
    "seed": "initialization and batch order",
    "sliding_window_pattern": "every Nth layer attends to the full context, the others to "
                              "the sliding window (Gemma 3: 6)",
    "tokenizer": "train with this tokenizer.json (its vocabulary must be --vocab-size "
                 "entries) instead of training a new one",
}
# Flags whose default (None) does not say their type.
_TYPES = {"max_chars": int, "tokenizer": str}


def add_parser(sub) -> None:
    from ..train import TrainSettings

    p = sub.add_parser("train", help="train a small Gemma 3 text model on the stdlib corpus")
    p.add_argument("--out", required=True,
                   help="new checkpoint folder; checked before training starts: refused if "
                        "not empty (unless --force) or without room for the model")
    p.add_argument("--force", action="store_true",
                   help="replace the model in a non-empty --out: the new model is written "
                        "beside it first, then only the model files qfuse writes are "
                        "replaced; every other file there is kept")
    p.add_argument("--record", default=None, help="write losses and timings (JSON) here")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    for field, default in TrainSettings().__dict__.items():
        kind = _TYPES.get(field) or (float if isinstance(default, float) else int)
        p.add_argument(f"--{field.replace('_', '-')}", type=kind, default=default,
                       help=_HELP.get(field, f"the model's {field} (config.json)"))


def run(args) -> int:
    from ..saving import check_destination, foreign_files
    from ..train import ModelKept, TrainSettings, checkpoint_bytes, train

    settings = TrainSettings(**{k: getattr(args, k) for k in TrainSettings().__dict__})
    settings.check()  # these two before the progress line starts
    out = check_destination(args.out, force=args.force, need=checkpoint_bytes(settings))
    record_path = Path(args.record) if args.record else None
    # Like --out, a record that cannot be written must fail before training, not after.
    if record_path and (record_path.is_dir() or not record_path.parent.is_dir()):
        raise UserError(f"--record {record_path}: not a file in an existing folder")
    # train() logs its first line once the corpus is read and the tokenizer trained.
    setup = flags.Elapsed("reading the corpus, training the tokenizer")

    def log(line: str) -> None:
        setup.close()
        print(line)

    try:
        with setup:
            record = train(out, settings, args.device, log=log, force=args.force)
    except ModelKept as e:  # the model was saved elsewhere: keep the run's record too
        if record_path:
            _write_record(record_path, e.record)
        raise
    if record_path:
        _write_record(record_path, record)
    print(f"wrote {out}; validation loss {record['best_val_loss']:.3f} "
          f"(best, at step {record['best_step'] + 1} of {settings.steps})")
    kept = foreign_files(out)
    if kept:
        print(f"kept {', '.join(kept)} in {out}: not model files, left as they were")
    return 0


def _write_record(path: Path, record: dict) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
