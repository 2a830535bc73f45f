"""Text generation: prefill, then one cached decode step per token, as a generator.

`generate(model, tokenizer, prompts, ...)` yields a `Step` per decode step
(the new token of every sequence, its text, which sequences finished, and on
request the log-probabilities it was drawn from) and finally a `Summary` with
prompt and generation tokens/s, peak memory (the GPU's on CUDA, the process's
resident memory on the host) and each sequence's finish reason ("stop",
"length", or "interrupted" when ``should_stop`` asked).
Prompts of different lengths share one batch: they are right-padded for
prefill and decoded at their own positions. Sampling: greedy (temperature 0),
temperature, top-k, top-p, min-p, repetition penalty, seeded. A request that
cannot be served (a bad sampling value, a prompt that does not fit the
context) is a `RequestError` before any compute. The KV cache is slotted (`KVCache`)
or, with ``kv_page_size``, paged (`PagedKVCache`): the same keys, attended the same way.

The loop is this module; what it draws on has a file each: `sampling` (the parameters,
the penalty, the draw), `prompts` (prompts to token ids, stop strings), `slotted_graphs`
and `paged_graphs` (the decode step replayed from a CUDA graph).
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..errors import RequestError
from .cache import KVCache, cache_problem
from .detokenize import IncrementalText
from .paged_cache import PagedKVCache
from .paged_graphs import GraphedPagedDecode
from .prompts import cut_at_stop, encode_prompts, fit_prompt, pad_prompts, stop_hold
from .sampling import SamplingParams, draw, penalize
from .slotted_graphs import GraphedDecode


@dataclass
class Step:
    tokens: list[int]  # the new token of each sequence (finished ones repeat their last)
    texts: list[str]  # text each sequence added this step
    finished: list[bool]
    # float32 [B, V] on the model's device, with generate(logprobs=True): log-softmax of
    # the logits after the repetition penalty, before temperature and top-k/p/min-p
    # (as mlx-lm reports them). Left on the device: reading it is the caller's sync.
    logprobs: torch.Tensor | None = None
    # The first Step only: the prompt's figures, as the Summary gives them at the end.
    prompt: PromptStats | None = None


@dataclass(frozen=True)
class PromptStats:
    """The prefill's figures: ``tokens`` prefilled (all sequences), at ``tps`` tokens/s
    (the first token's sampling included; the model's one-time warm-up excluded), and
    ``compiled``: whether its time (and ``tps``) includes compiling for its shape, which
    a later prompt of that shape does not pay: Triton compiled a kernel, or on CUDA the
    shape is new to the model (cuDNN attention plans each shape)."""

    tokens: int
    tps: float
    compiled: bool = False


@dataclass
class Summary:
    """What a generation did. prompt_tps excludes the model's one-time warm-up; with
    prompt_compiled it includes compiling for the prompt's shape (`PromptStats`). generation_tps: the tokens
    after each sequence's first (which prefill produced) over the decode steps' time;
    None when no decode step produced one (a 1-token generation: nothing to time)."""

    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float | None
    peak_memory_gb: float
    finish_reasons: list[str]
    outputs: list[str] = field(default_factory=list)
    peak_memory_kind: str = "gpu"  # "gpu": allocated on the CUDA device; "host": peak RSS
    prompt_compiled: bool = False


def generate(model, tokenizer, prompts: list[str], max_tokens: int = 64,
             params: SamplingParams | None = None, stop: list[str] | None = None,
             kv_bits: int = 0, kv_group_size: int = 64,
             cuda_graph: bool | None = None,
             add_special_tokens: bool = True, max_kv_size: int | None = None,
             should_stop: Callable[[], bool] | None = None,
             logprobs: bool = False, kv_page_size: int | None = None,
             kv_pages: int | None = None) -> Iterator[Step | Summary]:
    """Yield a Step per generated token position, then one Summary.

    cuda_graph: replay the decode step from a CUDA graph (over a paged cache:
    `paged_graphs.GraphedPagedDecode`); None (default) means yes on CUDA, no on a CPU.
    add_special_tokens: False for prompts that already carry them (a rendered
    chat template starts with its own BOS).
    max_kv_size: cap the KV cache at this many tokens; a prompt that does not fit
    with max_tokens keeps only its last tokens (`fit_prompt`) instead of the
    RequestError.
    should_stop: polled once per step (a Ctrl-C flag, say); when it says True the
    text decoded so far is flushed, unfinished sequences end as "interrupted", and
    the Summary follows.
    logprobs: give each Step its ``logprobs`` (one log-softmax over the vocabulary
    per step, no host sync); off by default, so the step costs nothing extra.
    kv_page_size: keep K and V in a `PagedKVCache` of pages of this many tokens (a
    power of two) instead of the slotted `KVCache` (None, the default); the decode
    step reads and writes through block tables. kv_pages: its pages per
    full-attention layer (default: every sequence at prompt + max_tokens); fewer
    than the prompts and max_tokens could take is a RequestError before any compute
    (generate does not queue: every sequence runs to the end)."""
    params = params or SamplingParams()
    cfg, device = model.config, model.model.norm.weight.device
    problem = cache_problem(cfg, kv_bits, kv_group_size)
    if problem is not None:
        raise RequestError(problem)
    if kv_pages is not None and kv_page_size is None:
        raise RequestError("kv_pages sizes a paged KV cache: give kv_page_size too")
    if cuda_graph is None:
        cuda_graph = default_cuda_graph(device)
    if cuda_graph and device.type != "cuda":
        raise RequestError("cuda_graph needs the model on a CUDA device")
    ids = [fit_prompt(x, max_tokens, cfg.max_position_embeddings, max_kv_size,
                      cfg.bos_token_id)
           for x in encode_prompts(tokenizer, prompts, add_special_tokens)]
    batch, lengths = pad_prompts(ids, device)
    B = batch.shape[0]
    rows = torch.arange(B, device=device)  # made once: the decode loop indexes with it
    cache = make_cache(cfg, [len(x) for x in ids], max_tokens, model.dtype, device, kv_bits,
                       kv_group_size, kv_page_size, kv_pages, scratch_page=cuda_graph)
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    _warm_up(model, device, kv_bits, kv_group_size)
    new_shape = new_prefill_shape(model, device, tuple(batch.shape))
    compiles = _triton_compiles()
    t0 = time.perf_counter()
    seen = None
    if params.repetition_penalty != 1.0:  # each prompt's own tokens, never its padding
        seen = torch.zeros(B, cfg.vocab_size, dtype=torch.bool, device=device)
        for b, x in enumerate(ids):
            seen[b, torch.tensor(x, device=device)] = True

    def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # log_softmax makes a new tensor: it never aliases the CUDA graph's logits buffer,
        # which the next replay overwrites.
        x = penalize(logits, params, seen)
        return draw(x, params, generator), torch.log_softmax(x, -1) if logprobs else None

    with torch.no_grad():
        last = model(batch, lengths, cache, logits="last")
        token, token_logprobs = pick(last)
    _sync(device)
    prompt_time = time.perf_counter() - t0
    after = _triton_compiles()
    compiled = new_shape or (after is not None and (compiles is None or after > compiles))
    n_prompt = sum(len(x) for x in ids)  # the host's count: no read of ``lengths``
    prompt = PromptStats(n_prompt, n_prompt / max(prompt_time, 1e-9), compiled=compiled)

    def decode(tok):
        return model.decode(tok, cache)

    if cuda_graph:
        decode = GraphedPagedDecode(model, cache, B) if kv_page_size is not None \
            else GraphedDecode(model, cache, B)
    eos = set(cfg.eos_token_ids)
    finished = [False] * B
    reasons = ["length"] * B
    generated: list[list[int]] = [[] for _ in range(B)]
    detokenized = [IncrementalText(tokenizer) for _ in range(B)]
    texts = ["" for _ in range(B)]  # decoded so far, cut at a stop string
    emitted = [0] * B  # characters of texts already streamed
    stop = [x for x in (stop or []) if x]
    # Hold back text that could be the start of a stop string spanning tokens.
    hold = stop_hold(stop)
    t1 = time.perf_counter()
    for step in range(max_tokens):
        tok_list = token.tolist()  # the one host sync per step
        interrupted = should_stop is not None and should_stop()
        last_step = step == max_tokens - 1 or interrupted
        for b in range(B):
            if finished[b]:
                continue
            if tok_list[b] in eos:
                finished[b], reasons[b] = True, "stop"
                continue
            generated[b].append(tok_list[b])
            if not detokenized[b].add(tok_list[b]):  # a multi-byte character is incomplete
                continue
            texts[b], hit = cut_at_stop(detokenized[b].text, stop)
            if hit:
                finished[b], reasons[b] = True, "stop"
        new_texts = []
        for b in range(B):
            done = finished[b] or last_step or all(finished)
            upto = len(texts[b]) if done else max(emitted[b], len(texts[b]) - hold)
            new_texts.append(texts[b][emitted[b]:upto])
            emitted[b] = upto
        yield Step(tok_list, new_texts, list(finished), token_logprobs,
                   prompt if step == 0 else None)
        if interrupted:
            reasons = [r if f else "interrupted" for r, f in zip(reasons, finished)]
        if all(finished) or last_step:
            break
        with torch.no_grad():
            logits = decode(token)
            if seen is not None:
                seen[rows, token] = True
            token, token_logprobs = pick(logits)
    _sync(device)
    gen_time = time.perf_counter() - t1
    # Each sequence's first token came out of prefill (timed there): the rate counts
    # the ones the decode steps made, so one token gives no rate, not a huge one.
    decoded = sum(max(len(g) - 1, 0) for g in generated)
    yield Summary(
        prompt_tokens=prompt.tokens, generation_tokens=sum(len(g) for g in generated),
        prompt_tps=prompt.tps,
        generation_tps=decoded / max(gen_time, 1e-9) if decoded else None,
        peak_memory_gb=peak_memory_gb(device), finish_reasons=reasons, outputs=texts,
        peak_memory_kind="gpu" if device.type == "cuda" else "host",
        prompt_compiled=prompt.compiled)


def default_cuda_graph(device: torch.device) -> bool:
    """Whether decode steps replay CUDA graphs when nobody said (`generate`, `qfuse
    serve`): on CUDA, over a slotted or a paged cache (the paged graph, `paged_graphs`,
    passed its GPU tests and served the bench's paged loads in stop 38: bench/NOTES.md,
    "Serving")."""
    return device.type == "cuda"


def make_cache(cfg, prompt_lengths: list[int], max_tokens: int, dtype: torch.dtype, device,
               kv_bits: int = 0, kv_group_size: int = 64, page_size: int | None = None,
               num_pages: int | None = None, scratch_page: bool = False
               ) -> KVCache | PagedKVCache:
    """The KV cache `generate` decodes on: a row per prompt, each holding the longest
    prompt + max_tokens tokens; slotted, or paged with ``page_size`` (``num_pages`` per
    full-attention layer; ``scratch_page``: a page past them for a CUDA graph's capture,
    `paged_graphs`). RequestError for a page size the cache refuses, or pages too
    few for every prompt to reach its prompt + max_tokens - 1 tokens at once (generate
    decodes every row to the end; it has no queue to wait in)."""
    B, longest = len(prompt_lengths), max(prompt_lengths)
    if page_size is None:
        return KVCache(cfg, B, longest + max_tokens, dtype, device, kv_bits, kv_group_size)
    try:
        cache = PagedKVCache(cfg, B, longest + max_tokens, dtype, device, kv_bits,
                             kv_group_size, page_size, num_pages, scratch_page=scratch_page)
    except ValueError as e:  # the page size or count: the request's mistake
        raise RequestError(f"kv_page_size={page_size!r}, kv_pages={num_pages!r}: {e}") from None
    # After the last decode step a row holds prompt + max_tokens - 1 tokens (the first
    # token came from the prefill). Only the full-attention pool can fall short: a
    # sliding layer's budget holds its window in every row.
    full = cache.groups.get(None)
    if full is not None:
        need = sum(-(-(n + max_tokens - 1) // page_size) for n in prompt_lengths)
        if need > full.allocator.num_pages:
            raise RequestError(f"kv_pages={full.allocator.num_pages} pages of {page_size} "
                               f"tokens hold fewer than the {need} these prompts and "
                               f"max_tokens={max_tokens} take")
    return cache


# Models (or tensor-parallel leaders) that already ran their warm-up in this process.
_warmed: weakref.WeakSet = weakref.WeakSet()


def _warm_up(model, device: torch.device, kv_bits: int, kv_group_size: int) -> None:
    """The first time ``model`` generates in this process, one untimed forward of one
    token: what the process pays once (on the CPU the thread pool, many times a short
    prompt's prefill: bench/NOTES.md, "The stats line"; on CUDA the context, cuBLAS,
    compiling the kernels of the decode shapes) then stays out of the prompt's tokens/s."""
    if model in _warmed:
        return
    cache = KVCache(model.config, 1, 2, model.dtype, device, kv_bits, kv_group_size)
    with torch.no_grad():
        model(torch.zeros(1, 1, dtype=torch.int64, device=device),
              torch.ones(1, dtype=torch.int64, device=device), cache)
    _sync(device)
    _warmed.add(model)


# The prefill shapes (rows, length) each model has run on CUDA in this process.
_shapes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def new_prefill_shape(model, device: torch.device, shape: tuple[int, int]) -> bool:
    """Whether a CUDA prefill of ``shape`` is the model's first in this process: cuDNN
    attention builds an execution plan per new shape inside the prefill (many times a
    warm prefill: bench/NOTES.md, "The stats line"), a compilation no hook reports. False on the CPU, where a new shape costs nothing."""
    if device.type != "cuda":
        return False
    seen = _shapes.setdefault(model, set())
    new = shape not in seen
    seen.add(shape)
    return new


_compiled = [0]  # Triton kernels compiled since qfuse's hook was installed


def _triton_compiles() -> int | None:
    """Triton kernels this process compiled (or loaded from Triton's disk cache) since
    qfuse began counting; None while Triton is not imported (then none can have been:
    qfuse imports it where a kernel launches). The count is a hook on Triton's JIT,
    installed the first time Triton is seen here, calling any hook set before it."""
    runtime = getattr(getattr(sys.modules.get("triton"), "knobs", None), "runtime", None)
    if runtime is None:
        return None
    previous = getattr(runtime, "jit_post_compile_hook", None)
    if not getattr(previous, "qfuse_counts", False):
        def counting(*args, **kwargs):
            _compiled[0] += 1
            return previous(*args, **kwargs) if previous is not None else None

        counting.qfuse_counts = True
        runtime.jit_post_compile_hook = counting
    return _compiled[0]


def peak_memory_gb(device: torch.device) -> float:
    """GB at most so far: allocated on the GPU since the last peak reset on CUDA, else the
    process's peak resident memory (0.0 where unknown: Windows)."""
    if device.type == "cuda":
        # max_memory_allocated's figure, read from the allocator's nested stats: it
        # flattens and sorts all of them first, and stream_generate asks at every token.
        stats = torch.cuda.memory.memory_stats_as_nested_dict()
        return stats.get("allocated_bytes", {}).get("all", {}).get("peak", 0) / 1e9
    try:
        import resource
    except ImportError:
        return 0.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e9 if sys.platform == "darwin" else rss * 1024 / 1e9  # bytes vs KiB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
