"""The text side of a request: prompts in, stop strings out.

Prompts become token ids as `generate` encodes them (`encode_prompts`: a RequestError for
an empty prompt or text that is not UTF-8), fit the KV cache with max_tokens
(`fit_prompt`: refused, or cut to their last tokens under a max_kv_size), and go to a
prefill as one right-padded batch (`pad_prompts`). Generated text ends at the earliest
stop string (`cut_at_stop`); a stream holds back what could still become one
(`stop_hold`).
"""

from __future__ import annotations

import torch

from ..errors import RequestError, utf8_problem


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


def stop_hold(stop: list[str]) -> int:
    """Characters of a stream's text held back: what could be the start of a stop string
    that spans tokens."""
    return max((len(x) for x in stop), default=1) - 1


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """text up to the earliest stop string, and whether one occurred."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)
