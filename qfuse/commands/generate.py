"""`qfuse generate [MODEL] PROMPT`: stream a continuation of a prompt (tensor parallel
under torchrun or with --tp)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import UserError, utf8_problem
from . import flags


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream a continuation of a prompt")
    p.add_argument("model_or_prompt", nargs="*", metavar="[MODEL] PROMPT",
                   help="checkpoint folder (config.json, *.safetensors, tokenizer.json), "
                        "then the prompt; without a folder, the bundled default model")
    p.add_argument("--prompt", default=None,
                   help="the prompt, instead of the positional; - reads standard input")
    flags.add_generation_args(p)
    flags.add_tp_args(p, "generate")


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
    where = "the prompt"
    if prompt == "-":
        prompt, where = _read_stdin(), "standard input"
        if not prompt:
            raise UserError("standard input is empty: `--prompt -` continues the text read "
                            "from it")
    if not prompt:
        raise UserError("the prompt is empty: give the text to continue (or --prompt - to "
                        "read it from standard input)")
    problem = utf8_problem(prompt)
    if problem is not None:  # argv: Python handed invalid bytes over as lone surrogates
        raise UserError(f"{where} {problem}")
    return model, prompt


def _read_stdin() -> str:
    """Standard input as text; a UserError naming the byte when it is not UTF-8."""
    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:  # a text stream without bytes under it (a caller's StringIO)
        return sys.stdin.read()
    data = raw.read()
    try:
        # Newlines as text-mode reading gives them (universal newlines).
        return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as e:
        raise UserError(f"standard input is not valid UTF-8 (byte 0x{data[e.start]:02x} at "
                        f"offset {e.start})") from None


def _is_path(text: str) -> bool:
    if not text:  # Path("") is ".", which exists: an empty prompt is no folder
        return False
    try:
        return Path(text).exists()
    except (OSError, ValueError):  # a prompt too long for a file name, or holding NUL
        return False
