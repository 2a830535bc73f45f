"""What a caller hands the serving engine and gets back, and the state of a request in a slot.

`Request`: a prompt's token ids (already fitted to the context), max_tokens, its sampling
parameters, stop strings and stop ids, penalties, logprobs, and ``emit``, which the engine
calls on its own thread with one `Event` per generated token and one on finishing (its
``finish_reason`` set: "stop", "length" or "error"). `QueueFull`: `Engine.submit` found the
queue full. `ModelFailed`: a model call that cannot succeed again (a lost tensor-parallel
rank); the engine then fails every request it holds and stops.

`Seq` is the engine's own record of a request in a slot, shared by its parts (scheduler,
prefill, step runners, sampler, emission) and by no caller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..runtime.detokenize import IncrementalText
from ..runtime.sampling import SamplingParams

log = logging.getLogger("qfuse")


class QueueFull(Exception):
    """Every slot is busy and the waiting queue holds ``max_queue`` requests."""


class ModelFailed(Exception):
    """Raised by a model call that cannot succeed again (a tensor-parallel rank is gone,
    `qfuse.parallel.serve`): the engine fails every request it holds and its thread
    ends, without the traceback of an ordinary failed step; the server reports it."""


@dataclass
class Event:
    text: str  # new text (held back while it could start a stop string)
    token: int | None = None  # the sampled token; None for EOS (or a stop id) and the error event
    logprob: float | None = None  # with Request.logprobs: the token's log-probability
    top: list[tuple[int, float]] | None = None  # the top_logprobs likeliest (id, logprob)
    finish_reason: str | None = None  # "stop", "length", "error" on the last event


@dataclass
class Request:
    ids: list[int]  # the prompt's token ids (already fitted to the context)
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: off; k: the token's logprob and the top k
    emit: Callable[[Event], None] = lambda event: None
    cancelled: bool = False
    completion_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()  # each ends the request as EOS does


@dataclass
class Seq:
    """A request in a slot: what the next step feeds and what it has produced."""
    req: Request
    slot: int
    admitted: int = 0  # the order of admission: the oldest prompt's chunk comes first
    prefilled: int = 0  # prompt tokens in its cache; it decodes once all are
    token: int = 0  # the last sampled token, fed to the next decode step
    generated: list[int] = field(default_factory=list)
    text: str = ""
    detokenized: IncrementalText | None = None  # the text of `generated`, a few tokens a step
    hold: int = 0  # text held back: what could be the start of a stop string spanning tokens
    emitted: int = 0
    seen: torch.Tensor | None = None  # bool [V]: for the repetition penalty
    counts: torch.Tensor | None = None  # float32 [V]: for presence/frequency penalties
    generator: torch.Generator | None = None
    done: bool = False  # its last event (finished or error) was emitted
    # The tokens its cache holds before it decodes: the prompt, or after a preemption
    # the prompt and the tokens generated but the last (`token`, fed next).
    feed: list[int] = field(default_factory=list)
    resumed: bool = False  # preempted: its prefill samples nothing (it has its token)
    # Async scheduling: its last token is still on the device, at this index of a step's
    # tokens (`slotted_steps.Ahead`) the host has not read yet; the next step feeds it
    # from there.
    ahead: tuple[object, int] | None = None


def tell(req: Request, event: Event) -> None:
    """``req.emit(event)`` for a last event, which nothing may stop: an emit that fails
    is logged (its client, if still there, is beyond reach)."""
    try:
        req.emit(event)
    except Exception:
        log.exception("qfuse serve: a request's last event could not be sent")
