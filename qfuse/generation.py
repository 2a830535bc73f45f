"""`qfuse.generation.generate`, the batched step-by-step generator, by the name the README
gives it: prefill, then one cached decode step per token, yielding a `Step` per token
and a `Summary` at the end. The loop is `runtime/generation.py`; this module hands on
what a caller of it needs (the sampling parameters it takes, the error a request it
cannot serve raises).
"""

from .errors import RequestError
from .runtime.generation import PromptStats, Step, Summary, generate
from .runtime.sampling import SamplingParams

__all__ = ["PromptStats", "RequestError", "SamplingParams", "Step", "Summary", "generate"]
