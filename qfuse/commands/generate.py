"""`qfuse generate [MODEL] PROMPT`: stream a continuation of a prompt (tensor parallel
under torchrun or with --tp)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import UserError
from . import flags


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream a continuation of a prompt")
    p.add_argument("model_or_prompt", nargs="*", metavar="[MODEL] PROMPT",
                   help="checkpoint folder (config.json, *.safetensors, tokenizer.json), "
                        "then the prompt; without a folder, the bundled default model")
    p.add_argument("--prompt", default=None,
                   help="the prompt, instead of the positional; - reads standard input")
    flags.add_tp_args(p, "generate")
    flags.add_generation_args(p)


def run(args) -> int:
    model, args.prompt = model_and_prompt(args)
    args.model = str(flags.model_dir(model))
    with flags.chosen_tier(args):
        if args.tp is not None or flags.world_size() > 1:
            from ..parallel.runtime import run_generate_tp

            return run_generate_tp(args)
        from ..chat import run_generate

        return run_generate(args)


def model_and_prompt(args) -> tuple[str | None, str]:
    """(model folder or None, prompt) of `qfuse generate`, from the positionals
    [MODEL] PROMPT or --model/--prompt (`--prompt -` reads standard input)."""
    pos, model, prompt = list(args.model_or_prompt), args.model_option, args.prompt
    if prompt is not None and len(pos) > 1 or prompt is None and len(pos) > 2:
        raise UserError("generate takes [MODEL] PROMPT, or --model/--prompt (quote a prompt "
                        "with spaces)")
    if prompt is None and len(pos) == 1 and model is None and _is_path(pos[0]):
        # `qfuse generate some/folder` would otherwise prompt the bundled model with a path.
        raise UserError(f"no prompt: {pos[0]} is a path, taken as the model; give the prompt "
                        "after it (or --prompt TEXT, --prompt - for standard input)")
    if prompt is None and pos:
        prompt = pos.pop()
    if pos:
        if model is not None:
            raise UserError(f"two models: {pos[0]} and --model {model}")
        model = pos[0]
    if prompt is None:
        raise UserError("no prompt: give it after the model (or --prompt TEXT, --prompt - for "
                        "standard input)")
    if prompt == "-":
        prompt = sys.stdin.read()
    return model, prompt


def _is_path(text: str) -> bool:
    try:
        return Path(text).exists()
    except (OSError, ValueError):  # a prompt too long for a file name, or holding NUL
        return False
