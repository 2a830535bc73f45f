"""Command-line flags to checked objects: the device, the model, the sampling
parameters. Shared by `generate`, `chat`, `gate` and `serve` (tensor parallel too), so
each flag is read and refused in one way: a mistake is a UserError naming the flag,
raised before anything heavy loads.
"""

from __future__ import annotations

import sys

import torch

from .errors import RequestError, UserError
from .loading import check_checkpoint, load_model, load_tokenizer
from .runtime.prompts import fit_prompt
from .runtime.sampling import SamplingParams

# Which flag sets each SamplingParams field, so a bad value is named as the user typed it.
_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
          "min_p": "--min-p", "repetition_penalty": "--repetition-penalty", "seed": "--seed"}


def check_args(args) -> None:
    """UserError for a flag value generation would refuse, before anything loads."""
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.max_kv_size is not None and args.max_kv_size < 1:
        raise UserError(f"--max-kv-size must be at least 1, got {args.max_kv_size}")
    if args.max_kv_size is not None and args.max_tokens >= args.max_kv_size:
        raise UserError(f"--max-tokens {args.max_tokens} leaves no room for the prompt in "
                        f"--max-kv-size {args.max_kv_size}")
    try:
        sampling_params(args)
    except RequestError as e:
        field = str(e).split()[0]
        raise UserError(str(e).replace(field, _FLAGS.get(field, field), 1)) from e
    device_from_flags(args)


def check_room(config, ids: list[int], args, what: str) -> None:
    """UserError before the model loads when --max-tokens leaves no room in the context
    for ``ids`` (the shortest prompt the command will send, e.g. chat's first message),
    without --max-kv-size (with it the prompt keeps its end, and check_args has made
    room for one token)."""
    if args.max_kv_size is not None:
        return
    context = config.max_position_embeddings
    if len(ids) + args.max_tokens > context:
        most = context - len(ids)
        raise UserError(f"--max-tokens {args.max_tokens} leaves no room for {what} in the "
                        f"model's context of {context} tokens ({len(ids)} of them needed): "
                        + (f"--max-tokens {most} at most" if most > 0 else
                           "pass --max-kv-size N to keep only the prompt's last tokens"))


def prompt_kept(config, ids: list[int], args) -> int:
    """How many of the prompt's tokens the model will see (fewer than len(ids) when
    --max-kv-size drops the start, and a note on stderr says so); a UserError naming
    the flags when the prompt does not fit."""
    try:
        kept = len(fit_prompt(ids, args.max_tokens, config.max_position_embeddings,
                              args.max_kv_size, config.bos_token_id))
    except RequestError as e:
        raise UserError(f"{str(e).replace('max_tokens', '--max-tokens')}; shorten the prompt, "
                        "lower --max-tokens, or pass --max-kv-size N to keep only the "
                        "prompt's last tokens") from e
    if kept < len(ids):
        print(f"qfuse: note: the prompt has {len(ids)} tokens; the model sees its last {kept} "
              f"(--max-kv-size {args.max_kv_size} with --max-tokens {args.max_tokens})",
              file=sys.stderr)
    return kept


def device_from_flags(args) -> torch.device:
    """--device as a torch.device, checked (default: cuda when a GPU is visible)."""
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        raise UserError(f"--device {args.device!r} is not a device (cpu, cuda, cuda:1, ...)") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {args.device}: no CUDA GPU is visible")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"--device {args.device}: only {torch.cuda.device_count()} CUDA "
                            "GPU(s) are visible")
    elif device.type != "cpu":
        raise UserError(f"--device {args.device}: qfuse runs on cpu or cuda")
    return device


def load_for_gate(args):
    """(model, tokenizer) for `qfuse gate`: the folder checked, then loaded."""
    check_checkpoint(args.model)
    tokenizer = load_tokenizer(args.model)
    return load_model_from_flags(args), tokenizer


def load_dense_for_gate(args):
    """The --dense checkpoint of `qfuse gate` on --device, in float32 whatever --dtype
    says: it only feeds the float32 oracle, and float32 holds any checkpoint's weights
    exactly."""
    return load_model(args.dense, dtype=torch.float32, device=device_from_flags(args),
                      progress=True)


def load_model_from_flags(args):
    """The model of --model on --device in --dtype (bfloat16 on CUDA, else float32),
    its weights checked for NaN/inf unless --no-check-weights."""
    device = device_from_flags(args)
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    return load_model(args.model, dtype=dtype, device=device, progress=True,
                      check_weights=getattr(args, "check_weights", True))


def sampling_params(args) -> SamplingParams:
    """The sampling flags of `generate`/`chat` as SamplingParams."""
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed)
