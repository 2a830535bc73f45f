"""The Python API at the top of the package: `load`, `generate`, `stream_generate`,
`use_tier`.

    model, tokenizer = qfuse.load()                 # the bundled default model
    text = qfuse.generate(model, tokenizer, "def fibonacci(n):", max_tokens=64)
    for r in qfuse.stream_generate(model, tokenizer, "import os\\n", max_tokens=32):
        print(r.text, end="", flush=True)          # r.token, r.generation_tps, ...

A thin layer over `qfuse.loading` and the generation engine `qfuse.runtime.generation`,
whose batched generator (`qfuse.generation.generate`) stays available for callers that
want every sequence's step. Nothing heavy (torch, tokenizers) is imported until a
function is called, so `import qfuse` stays cheap.
"""

from __future__ import annotations

import numbers
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UserError


@dataclass(frozen=True)
class GenerationResponse:
    """One step of `stream_generate`: the new text and token, and the stats so far.

    text: the text this step added (may be empty while a multi-byte character or a
    possible stop string is incomplete; the final response flushes it).
    token: the token the model produced this step (the end-of-sequence token too).
    prompt_tokens, prompt_tps: the prompt's length and its prefill speed (tokens/s,
    the first token's sampling included, the model's one-time warm-up excluded).
    prompt_compiled: whether prompt_tps includes compiling for the prompt's shape, which
    a later call with a prompt of that shape does not pay (Triton compiled a kernel, or
    on CUDA the shape is new: cuDNN attention plans each shape).
    generation_tokens, generation_tps: tokens produced so far and their rate since
    the first one (0.0 for the first: one token gives no interval to time).
    peak_memory: GB at most so far: CUDA memory allocated since the call on a GPU, the
    process's resident memory on a CPU (as the engine's Summary reports it).
    finish_reason: None until the last response, then "stop" (end-of-sequence token
    or a stop string) or "length" (max_tokens reached).
    logprobs: float32 tensor [vocabulary] on the model's device, the log-probabilities
    this step's token was drawn from, as mlx-lm gives them: log-softmax of the logits
    after the repetition penalty, before temperature and top-k/top-p/min-p.
    logprob (a property): the sampled token's entry, as a float.
    """

    text: str
    token: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    logprobs: Any = None  # a torch.Tensor; `Any` keeps `import qfuse` free of torch
    prompt_compiled: bool = False

    @property
    def logprob(self) -> float:
        """log P(token) under `logprobs` (a host sync on a GPU: read it only if needed)."""
        return float(self.logprobs[self.token])


def load(path: str | Path | None = None, *, device=None, dtype=None, progress: bool = True,
         check_weights: bool = True):
    """(model, tokenizer) from a checkpoint folder, or the bundled default model.

    path: a folder with config.json, *.safetensors and tokenizer.json (Hugging Face or
    MLX-quantized layout); None loads the model shipped in the package.
    device: default "cuda" when a GPU is visible, else "cpu".
    dtype: a torch dtype or its name; default bfloat16 on CUDA, float32 on CPU.
    progress: a bar on stderr (bytes read) once loading takes more than a second.
    check_weights: refuse a weight holding NaN or inf (one min/max pass over each
    floating tensor as it is read, on the CPU: about a second per 4 GB of weights
    per core); False skips it (a very large model, weights known to be sound).
    Raises UserError when a QFUSE_* variable is wrong (`levers.check_environment`),
    the folder does not exist (or is a symbolic link loop), the dtype is unknown, or
    the checkpoint cannot be right (a bad config, a tensor of the wrong shape or dtype,
    with check_weights a NaN/inf)."""
    from . import levers

    levers.check_environment()
    _check_type("path", path, (str, os.PathLike), "a folder path (str or Path) or None",
                none=True)
    _check_type("progress", progress, bool, "True or False")
    _check_type("check_weights", check_weights, bool, "True or False")
    import torch

    from .loading import DEFAULT_MODEL, check_checkpoint, load_model, load_tokenizer

    path = Path(path) if path is not None else DEFAULT_MODEL
    if not path.is_dir():
        check_checkpoint(path)  # says what is there instead: nothing, a link loop, a file
        if path.suffix.lower() != ".gguf":  # a .gguf file loads as a folder does
            raise UserError(f"no model folder at {path}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise UserError(f"unknown dtype {dtype!r} (float32, bfloat16 or float16)")
        dtype = getattr(torch, dtype)
    return (load_model(path, dtype=dtype, device=device, progress=progress,
                       check_weights=check_weights), load_tokenizer(path))


def use_tier(name: str):
    """A context manager: the model's ops called inside the block run in tier ``name``.

        with qfuse.use_tier("compat"):              # the PyTorch reference, every op
            text = qfuse.generate(model, tokenizer, "def fibonacci(n):")

    name: compat (every op the spelled-out PyTorch reference), exact (only kernels
    bit-identical to it) or fast (every kernel); what QFUSE_TIER says, which the
    block overrides (default: fast on CUDA, compat on CPU). Blocks nest, and each
    holds for its own thread or asyncio task only. A generator from
    `stream_generate` reads the tier as each token is computed: iterate it inside the
    block. Raises UserError for another name."""
    from . import levers

    try:
        return levers.use_tier(name)
    except ValueError as e:
        raise UserError(str(e)) from None


def stream_generate(model, tokenizer, prompt: str, max_tokens: int = 256, *,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0, repetition_penalty: float = 1.0,
                    seed: int | None = None, stop: list[str] | None = None,
                    kv_bits: int = 0, kv_group_size: int = 64,
                    cuda_graph: bool | None = None, add_special_tokens: bool = True,
                    max_kv_size: int | None = None,
                    logprobs: bool = True) -> Iterator[GenerationResponse]:
    """Yield a GenerationResponse per generated token of one prompt.

    Sampling: temperature 0 (default) is greedy; top_k/top_p/min_p filter,
    repetition_penalty divides the logits of tokens already seen, seed makes
    sampling repeatable. stop: a string, or a list of strings, that ends generation
    (the text stops before it). kv_bits 4 or 8 quantizes the KV cache (groups of
    kv_group_size).
    cuda_graph: replay the decode step from a CUDA graph (default: on CUDA).
    add_special_tokens: False for prompts that already hold them (a chat template).
    max_kv_size: cap the KV cache at this many tokens; a longer prompt keeps its end.
    logprobs: False leaves each response's `logprobs` None and skips the log-softmax
    over the vocabulary at every token (what `generate` does: it returns text only).
    For several prompts at once use `generate` with a list, or the batched engine
    `qfuse.generation.generate`.

    An argument of the wrong type (max_tokens=1.5, stop=5, prompt=None) is a UserError
    naming the argument and what it takes, as a value out of range is."""
    from .runtime.generation import Summary, peak_memory_gb

    if not isinstance(prompt, str):
        raise UserError(f"stream_generate takes one prompt, a string (generate also takes a "
                        f"list of them); got {_shown(prompt)}")
    stop = _check_arguments(max_tokens, stop=stop, kv_bits=kv_bits,
                            kv_group_size=kv_group_size, cuda_graph=cuda_graph,
                            add_special_tokens=add_special_tokens, max_kv_size=max_kv_size,
                            logprobs=logprobs)
    events = _events(model, tokenizer, [prompt], max_tokens, temperature=temperature,
                     top_k=top_k, top_p=top_p, min_p=min_p,
                     repetition_penalty=repetition_penalty, seed=seed, stop=stop,
                     kv_bits=kv_bits, kv_group_size=kv_group_size, cuda_graph=cuda_graph,
                     add_special_tokens=add_special_tokens, max_kv_size=max_kv_size,
                     logprobs=logprobs)
    device = model.model.norm.weight.device
    first = None  # when the first token was ready: prefill ends there
    stats, count = None, 0
    for event in events:
        if isinstance(event, Summary):
            continue  # its figures were already given by the last response
        now = time.perf_counter()
        count += 1
        if first is None:
            # The prompt as the engine saw it (cut to max_kv_size when asked) and timed it.
            first, stats = now, event.prompt
        reason = None
        if event.finished[0]:
            reason = "stop"
        elif count == max_tokens:
            reason = "length"
        # The first token came out of prefill, so the rate counts the ones after it.
        tps = (count - 1) / (now - first) if count > 1 and now > first else 0.0
        yield GenerationResponse(
            text=event.texts[0], token=event.tokens[0], prompt_tokens=stats.tokens,
            prompt_tps=stats.tps, generation_tokens=count, generation_tps=tps,
            peak_memory=peak_memory_gb(device),
            finish_reason=reason,
            logprobs=event.logprobs[0] if event.logprobs is not None else None,
            prompt_compiled=stats.compiled)


def generate(model, tokenizer, prompt: str | list[str], max_tokens: int = 256, *,
             verbose: bool = False, **options) -> str | list[str]:
    """The generated text for a prompt (a str), or for each of a list of prompts (a list,
    decoded together as one batch).

    Options are those of `stream_generate` (sampling, stop, kv_bits, ...). verbose:
    print the text as it comes, then the prompt and generation speeds and the peak
    memory (one prompt only). An unknown option, or an argument of the wrong type, is
    a UserError naming it."""
    _check_type("verbose", verbose, bool, "True or False")
    unknown = sorted(set(options) - _OPTIONS)
    if "logprobs" in unknown:
        raise UserError("generate returns text only: stream_generate gives logprobs")
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], _OPTIONS, n=1)
        raise UserError(f"generate has no option {unknown[0]!r}"
                        + (f" (did you mean {close[0]!r}?)" if close else
                           f"; its options: {', '.join(sorted(_OPTIONS))}"))
    if not isinstance(prompt, (str, list, tuple)):
        raise UserError(f"prompt must be a string or a list of strings, got {_shown(prompt)}")
    if isinstance(prompt, str):
        pieces = []
        last = None
        for last in stream_generate(model, tokenizer, prompt, max_tokens, logprobs=False,
                                    **options):
            pieces.append(last.text)
            if verbose:
                print(last.text, end="", flush=True)
        if verbose and last is not None:
            print()
            compiled = " (compiling for its shape included)" if last.prompt_compiled else ""
            rate = (f", {last.generation_tps:.1f} tokens/s" if last.generation_tokens > 1
                    else "")  # one token: no interval to time
            def tokens(n: int) -> str:
                return f"{n} token" if n == 1 else f"{n} tokens"

            print(f"prompt: {tokens(last.prompt_tokens)}, {last.prompt_tps:.1f} tokens/s"
                  f"{compiled}\n"
                  f"generation: {tokens(last.generation_tokens)}{rate}\n"
                  f"peak memory: {last.peak_memory:.3f} GB\n"
                  f"finish: {last.finish_reason}", file=sys.stderr)
        return "".join(pieces)
    if verbose:
        raise UserError("verbose=True streams one prompt; pass a string, not a list")
    return _generate_batch(model, tokenizer, list(prompt), max_tokens, **options)


def _generate_batch(model, tokenizer, prompts: list[str], max_tokens: int, **options) -> list[str]:
    from .runtime.generation import Summary

    if not prompts:
        raise UserError("generate takes a prompt string or a non-empty list of them")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise UserError(f"prompt must be a string or a list of strings, got a list whose "
                            f"item {i} is {_shown(p)}")
    options["stop"] = _check_arguments(max_tokens, **options)
    for event in _events(model, tokenizer, prompts, max_tokens, **options):
        if isinstance(event, Summary):
            return event.outputs
    raise AssertionError("the generation engine ended without a Summary")


def _events(model, tokenizer, prompts: list[str], max_tokens: int, *,
            temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
            min_p: float = 0.0, repetition_penalty: float = 1.0,
            seed: int | None = None, stop: list[str] | None = None,
            kv_bits: int = 0, kv_group_size: int = 64,
            cuda_graph: bool | None = None, add_special_tokens: bool = True,
            max_kv_size: int | None = None, logprobs: bool = False):
    """The engine's Steps and Summary for ``prompts`` with `stream_generate`'s options,
    for both entry points. A request the engine cannot serve is a UserError
    (RequestError) before any compute; any other error is the engine's own."""
    from .runtime.generation import generate as engine
    from .runtime.sampling import SamplingParams

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=repetition_penalty, seed=seed)
    yield from engine(model, tokenizer, prompts, max_tokens, params, stop, kv_bits,
                      kv_group_size, cuda_graph=cuda_graph,
                      add_special_tokens=add_special_tokens, max_kv_size=max_kv_size,
                      logprobs=logprobs)


# The options `generate` passes on to `stream_generate` (and to the batch engine).
_OPTIONS = frozenset({"temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed",
                      "stop", "kv_bits", "kv_group_size", "cuda_graph", "add_special_tokens",
                      "max_kv_size"})


def _shown(value) -> str:
    """A value as an error message shows it: its repr, cut short, and its type."""
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{text} ({type(value).__name__})"


def _check_type(name: str, value, types, what: str, none: bool = False) -> None:
    """UserError "``name`` must be ``what``, got ..." unless ``value`` is one of ``types``
    (or None where ``none`` allows it); a bool is no integer here."""
    if value is None and none:
        return
    if isinstance(value, types) and not (isinstance(value, bool) and bool not in (
            types if isinstance(types, tuple) else (types,))):
        return
    raise UserError(f"{name} must be {what}, got {_shown(value)}")


def _check_arguments(max_tokens, stop=None, kv_bits: int = 0, kv_group_size: int = 64,
                     cuda_graph=None, add_special_tokens: bool = True, max_kv_size=None,
                     logprobs: bool = False, **sampling) -> list[str] | None:
    """UserError naming the first argument of the wrong type; returns ``stop`` as a list
    (a lone string is one stop string, not its characters). Sampling values are
    SamplingParams' to check (types and ranges alike); ranges are the engine's."""
    _check_type("max_tokens", max_tokens, numbers.Integral, "an integer")
    _check_type("kv_bits", kv_bits, numbers.Integral, "an integer (0, 4 or 8)")
    _check_type("kv_group_size", kv_group_size, numbers.Integral, "an integer (32, 64 or 128)")
    _check_type("max_kv_size", max_kv_size, numbers.Integral, "an integer or None", none=True)
    _check_type("cuda_graph", cuda_graph, bool, "True, False or None", none=True)
    _check_type("add_special_tokens", add_special_tokens, bool, "True or False")
    _check_type("logprobs", logprobs, bool, "True or False")
    if stop is None or isinstance(stop, str):
        return None if stop is None else [stop]
    if not isinstance(stop, (list, tuple)):
        raise UserError(f"stop must be a string or a list of strings, got {_shown(stop)}")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise UserError(f"stop must be a string or a list of strings, got a list whose "
                            f"item {i} is {_shown(s)}")
    return list(stop)
