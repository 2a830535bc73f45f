"""A token from a step's logits: the request's sampling parameters (`SamplingParams`,
checked where they are built, so the CLI, the Python API and the server refuse the same
values), the repetition penalty (`penalize`), and the draw (`draw`: greedy at
temperature 0, else temperature, top-k, min-p and top-p, seeded through a generator).
`generate` and the serving engine's sampler both draw through here.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..errors import RequestError


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
    return draw(penalize(logits, params, seen), params, generator)


def draw(logits: torch.Tensor, params: SamplingParams,
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
