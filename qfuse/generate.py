"""Text generation: prefill, then one cached decode step per token, as a generator.

`generate(model, tokenizer, prompts, ...)` yields a `Step` per decode step
(the new token of every sequence, its text, which sequences finished) and
finally a `Summary` with prompt and generation tokens/s, peak memory and each
sequence's finish reason ("stop", "length"). Prompts of different lengths
share one batch: they are right-padded for prefill and decoded at their own
positions. Sampling: greedy (temperature 0), temperature, top-k, top-p,
min-p, repetition penalty, seeded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .cache import KVCache


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must lie in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


@dataclass
class Step:
    tokens: list[int]  # the new token of each sequence (finished ones repeat their last)
    texts: list[str]  # text each sequence added this step
    finished: list[bool]


@dataclass
class Summary:
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory_gb: float
    finish_reasons: list[str]
    outputs: list[str] = field(default_factory=list)


def sample(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor | None,
           generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] (float) → token ids [B]. history: [B, T] ids already seen (or None)."""
    logits = logits.float()
    if params.repetition_penalty != 1.0 and history is not None and history.numel():
        seen = torch.gather(logits, 1, history)
        seen = torch.where(seen > 0, seen / params.repetition_penalty, seen * params.repetition_penalty)
        logits = logits.scatter(1, history, seen)
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
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
        probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0))
    return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator)[:, 0]


class GraphedDecode:
    """`model.decode(tokens, cache)` captured once as a CUDA graph and replayed per token.

    Everything the step reads lives in fixed buffers (the token buffer, the
    cache, its device-side lengths), so one capture serves every position.
    Sampling stays outside the graph."""

    def __init__(self, model, cache: KVCache, batch_size: int):
        device = cache.lengths.device
        self.tokens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        saved = cache.lengths.clone()
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

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits


def generate(model, tokenizer, prompts: list[str], max_tokens: int = 64,
             params: SamplingParams | None = None, stop: list[str] | None = None,
             kv_bits: int = 0, kv_group_size: int = 64,
             cuda_graph: bool = False) -> Iterator[Step | Summary]:
    """Yield a Step per generated token position, then one Summary.

    cuda_graph: replay the decode step from a CUDA graph (CUDA only)."""
    params = params or SamplingParams()
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    ids = [tokenizer.encode(p).ids for p in prompts]
    if any(len(x) == 0 for x in ids):
        raise ValueError("every prompt must encode to at least one token")
    cfg, device = model.config, model.model.norm.weight.device
    longest = max(len(x) for x in ids)
    if longest + max_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
            f"of {cfg.max_position_embeddings} tokens")
    B = len(ids)
    batch = torch.zeros(B, longest, dtype=torch.int64)
    for b, x in enumerate(ids):
        batch[b, : len(x)] = torch.tensor(x)
    batch = batch.to(device)
    lengths = torch.tensor([len(x) for x in ids], device=device)
    cache = KVCache(cfg, B, longest + max_tokens, model.dtype, device, kv_bits, kv_group_size)
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(batch, lengths, cache)
        last = logits[torch.arange(B, device=device), lengths - 1]
        history = batch if params.repetition_penalty != 1.0 else None
        token = sample(last, params, history, generator)
    _sync(device)
    prompt_time = time.perf_counter() - t0

    def decode(tok):
        return model.decode(tok, cache)

    if cuda_graph:
        if device.type != "cuda":
            raise ValueError("cuda_graph needs the model on a CUDA device")
        decode = GraphedDecode(model, cache, B)
    eos = set(cfg.eos_token_ids)
    finished = [False] * B
    reasons = ["length"] * B
    generated: list[list[int]] = [[] for _ in range(B)]
    texts = ["" for _ in range(B)]
    stop = stop or []
    t1 = time.perf_counter()
    steps = 0
    for step in range(max_tokens):
        tok_list = token.tolist()  # the one host sync per step
        new_texts = []
        for b in range(B):
            if finished[b]:
                new_texts.append("")
                continue
            if tok_list[b] in eos:
                finished[b], reasons[b] = True, "stop"
                new_texts.append("")
                continue
            generated[b].append(tok_list[b])
            full = tokenizer.decode(generated[b])
            if full.endswith("\ufffd"):  # a multi-byte character is still incomplete
                new_texts.append("")
                continue
            piece, texts[b] = full[len(texts[b]):], full
            hit = next((s for s in stop if s in texts[b]), None)
            if hit is not None:
                texts[b] = texts[b][: texts[b].index(hit)]
                finished[b], reasons[b] = True, "stop"
            new_texts.append(piece)
        steps += 1
        yield Step(tok_list, new_texts, list(finished))
        if all(finished) or step == max_tokens - 1:
            break
        with torch.no_grad():
            logits = decode(token)
            if params.repetition_penalty != 1.0:
                history = torch.cat([history, token[:, None]], dim=1)
            token = sample(logits, params, history, generator)
    _sync(device)
    gen_time = time.perf_counter() - t1
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else 0.0
    yield Summary(
        prompt_tokens=int(lengths.sum()), generation_tokens=sum(len(g) for g in generated),
        prompt_tps=int(lengths.sum()) / max(prompt_time, 1e-9),
        generation_tps=sum(len(g) for g in generated) / max(gen_time, 1e-9),
        peak_memory_gb=peak, finish_reasons=reasons, outputs=texts)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
