"""`qfuse generate` and `qfuse chat`: load a checkpoint, stream tokens, report stats."""

from __future__ import annotations

import sys

import torch

from .generation import SamplingParams, Summary, generate
from .loading import load_chat_template, load_model, load_tokenizer, render_chat


def _load(args):
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    return load_model(args.model, dtype=dtype, device=device), load_tokenizer(args.model)


def _params(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed)


def _stream(model, tokenizer, prompt: str, args, add_special_tokens: bool = True) -> Summary:
    summary = None
    for event in generate(model, tokenizer, [prompt], args.max_tokens, _params(args),
                          args.stop, args.kv_bits, args.kv_group_size,
                          cuda_graph=args.cuda_graph, add_special_tokens=add_special_tokens):
        if isinstance(event, Summary):
            summary = event
        else:
            sys.stdout.write(event.texts[0])
            sys.stdout.flush()
    print()
    return summary


def _report(s: Summary) -> None:
    print(f"[prompt {s.prompt_tokens} tok, {s.prompt_tps:.1f} tok/s | generated "
          f"{s.generation_tokens} tok, {s.generation_tps:.1f} tok/s | peak "
          f"{s.peak_memory_gb:.2f} GB | finish: {s.finish_reasons[0]}]", file=sys.stderr)


def run_generate(args) -> int:
    model, tokenizer = _load(args)
    sys.stdout.write(args.prompt)
    _report(_stream(model, tokenizer, args.prompt, args))
    return 0


def run_chat(args) -> int:
    """The checkpoint's chat template when it has one, else plain User:/Assistant: turns."""
    model, tokenizer = _load(args)
    template = load_chat_template(args.model)
    special = _special_tokens(args.model)
    messages: list[dict] = []
    print("qfuse chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        if template:
            prompt = render_chat(template, messages, special)
        else:
            prompt = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
            prompt += "Assistant:"
            args.stop = list(dict.fromkeys([*args.stop, "\nUser:"]))
        # A rendered template carries its own BOS: don't let the tokenizer add another.
        summary = _stream(model, tokenizer, prompt, args, add_special_tokens=not template)
        messages.append({"role": "assistant", "content": summary.outputs[0].strip()})
        _report(summary)
    return 0


def _special_tokens(path) -> dict:
    import json
    from pathlib import Path

    cfg = Path(path) / "tokenizer_config.json"
    if not cfg.exists():
        return {}
    raw = json.loads(cfg.read_text())
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = raw.get(key)
        out[key] = value.get("content") if isinstance(value, dict) else value
    return out
