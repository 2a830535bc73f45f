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
"""

from __future__ import annotations

import math
import numbers
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .cache import KVCache, cache_problem
from .detokenize import IncrementalText
from .errors import UserError, utf8_problem
from .paged_cache import PagedKVCache
from .paged_graphs import GraphedPagedDecode


class RequestError(UserError, ValueError):
    """A generation request that cannot be served. A ValueError too, for callers
    that caught ValueError before it existed."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        # NaN passes every comparison below and inf poisons the softmax: both are refused
        # here, where every caller (CLI, Python API, server) builds its parameters.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not math.isfinite(value):
                raise RequestError(f"{name} must be a finite number, got {value!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise RequestError(f"top_k must be an integer, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(
                self.seed, numbers.Integral) or not -2**63 <= self.seed < 2**63):
            raise RequestError(f"seed must be an integer in [-2**63, 2**63) (int64), got "
                               f"{self.seed!r}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must lie in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise RequestError(f"min_p must lie in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


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


def encode_prompts(tokenizer, prompts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each prompt, as generate() encodes them (RequestError if one is empty,
    or not valid UTF-8 text: a lone surrogate, which the tokenizer cannot take)."""
    for i, p in enumerate(prompts):
        problem = utf8_problem(p) if isinstance(p, str) else "is not a string"
        if problem is not None:
            which = "the prompt" if len(prompts) == 1 else f"prompt {i}"
            raise RequestError(f"{which} {problem}")
    if add_special_tokens:
        ids = [tokenizer.encode(p).ids for p in prompts]
    else:
        ids = [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    if any(len(x) == 0 for x in ids):
        raise RequestError("every prompt must encode to at least one token")
    return ids


def pad_prompts(ids: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one prefill batch (`Decoder.forward`): their ids
    right-padded with 0 to the longest, int64 [B, T], and their lengths, int64 [B]."""
    batch = torch.zeros(len(ids), max(len(x) for x in ids), dtype=torch.int64)
    for b, x in enumerate(ids):
        batch[b, : len(x)] = torch.tensor(x)
    return batch.to(device), torch.tensor([len(x) for x in ids], device=device)


def fit_prompt(ids: list[int], max_tokens: int, context: int, max_kv_size: int | None = None,
               bos_token_id: int | None = None) -> list[int]:
    """The prompt ids to prefill, so that prompt + max_tokens fit the KV cache.

    The cache holds ``context`` tokens (the model's max_position_embeddings), or
    ``max_kv_size`` when given. A prompt that does not fit is a RequestError;
    with ``max_kv_size`` it keeps only its last tokens instead (and its leading
    BOS, which models such as Gemma need), dropping its start."""
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}")
    limit = context
    if max_kv_size is not None:
        if not 0 < max_kv_size <= context:
            raise RequestError(f"max_kv_size must lie in [1, {context}] (the model's context), "
                               f"got {max_kv_size}")
        if max_tokens >= max_kv_size:
            raise RequestError(f"max_tokens ({max_tokens}) leaves no room for the prompt in a "
                               f"KV cache of max_kv_size={max_kv_size} tokens")
        limit = max_kv_size
    if len(ids) + max_tokens <= limit:
        return ids
    if max_kv_size is None:
        prompt = f"prompt ({len(ids)} tokens)"
        if len(ids) < context:
            prompt += f" + max_tokens ({max_tokens})"
        raise RequestError(f"{prompt} exceeds the model's context of {context} tokens")
    keep = limit - max_tokens
    if bos_token_id is not None and ids[0] == bos_token_id and keep > 1:
        return [ids[0], *ids[len(ids) - keep + 1:]]
    return ids[len(ids) - keep:]


def penalize(logits: torch.Tensor, params: SamplingParams,
             seen: torch.Tensor | None) -> torch.Tensor:
    """logits [B, V] in float32 after the repetition penalty (a new tensor whenever
    it differs from ``logits``). seen: bool [B, V], tokens each sequence has already
    contained, or None."""
    logits = logits.float()
    if params.repetition_penalty != 1.0 and seen is not None:
        penalized = torch.where(logits > 0, logits / params.repetition_penalty,
                                logits * params.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None,
           generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] → token ids [B]. seen: bool [B, V], tokens each sequence has
    already contained (for the repetition penalty), or None."""
    return _draw(penalize(logits, params, seen), params, generator)


def _draw(logits: torch.Tensor, params: SamplingParams,
          generator: torch.Generator | None) -> torch.Tensor:
    """Token ids [B] from float32 logits [B, V] that are already penalized."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    # Shifted so the likeliest token is 0 first: a tiny temperature then sends the others
    # to -inf (greedy in the limit) instead of every logit to ±inf and the softmax to NaN.
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), 0)
    if params.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p
        drop[:, 0] = False  # also when top_p is below float32's smallest value
        probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0))
    return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator)[:, 0]


def stop_hold(stop: list[str]) -> int:
    """Characters of a stream's text held back: what could be the start of a stop string
    that spans tokens."""
    return max((len(x) for x in stop), default=1) - 1


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """text up to the earliest stop string, and whether one occurred."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class GraphedDecode:
    """`model.decode(tokens, cache)` captured once as a CUDA graph and replayed per token.

    Everything the step reads lives in fixed buffers (the token buffer, the
    cache, its device-side lengths), so one capture serves every position.
    Sampling stays outside the graph."""

    def __init__(self, model, cache: KVCache, batch_size: int):
        if isinstance(cache, PagedKVCache):
            # Its step finds pages on the host, which a replay cannot do: the paged graph
            # reads fixed inputs that are prepared before each replay instead.
            raise TypeError("GraphedDecode takes a slotted KVCache; a PagedKVCache's graph "
                            "is paged_graphs.GraphedPagedDecode")
        device = cache.lengths.device
        self.cache = cache
        self.tokens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        saved, saved_host = cache.lengths.clone(), list(cache.host_lengths)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            model.decode(self.tokens, cache)  # warm-up: compiles kernels, caches RoPE tables
        torch.cuda.current_stream().wait_stream(stream)
        # The warm-up appended at each sequence's position; the real step will
        # overwrite those slots, so only the lengths need restoring.
        cache.lengths.copy_(saved)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.logits = model.decode(self.tokens, cache)
        cache.host_lengths = saved_host  # capture ran the Python side once, not the step

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.cache.reserve_step()
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits


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
        return _draw(x, params, generator), torch.log_softmax(x, -1) if logprobs else None

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
