"""Continuous batching: concurrent requests share decode steps over one slotted KV cache.

The engine owns a KVCache of ``max_batch`` slots (one sequence each) and a thread
that loops: admit waiting requests into free slots (each prefilled alone, straight
into its slot), then run one decode step over every slot, then sample each active
slot's next token with its own parameters. A request that finishes, is cancelled
or whose client went away frees its slot before the next step.

Batch invariance: the decode step always runs all ``max_batch`` rows (idle slots
decode a dummy token at length 0) and every prompt is prefilled alone, so a
request's tensors have the same shapes whoever shares its steps; each row of the
products and of attention is computed independently of the others, so greedy
tokens do not depend on the company a request keeps. (A product over 1 row and
over 8 rows may round differently on the CPU, which is why the batch is fixed.)
On CUDA the fixed shape also lets one CUDA graph serve every step
(``cuda_graph=True``; off by default until it has been run on a GPU).

Requests talk to the server through `Request.emit`, called on the engine thread
with one `Event` per generated token (and one on finishing).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache import KVCache
from ..generation import GraphedDecode, SamplingParams, _cut_at_stop, penalize, sample

log = logging.getLogger("qfuse")


class QueueFull(Exception):
    """Every slot is busy and the waiting queue holds ``max_queue`` requests."""


@dataclass
class Event:
    text: str  # new text (held back while it could start a stop string)
    token: int | None = None  # the sampled token; None for EOS and for the error event
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


@dataclass
class _Seq:
    """A request in a slot: what the next step feeds and what it has produced."""
    req: Request
    slot: int
    token: int = 0  # the last sampled token, fed to the next decode step
    generated: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    seen: torch.Tensor | None = None  # bool [V]: for the repetition penalty
    counts: torch.Tensor | None = None  # float32 [V]: for presence/frequency penalties
    generator: torch.Generator | None = None


class Engine:
    """Continuous batching over ``model``; `start()` runs its thread, `stop()` ends it.

    max_batch: slots (sequences decoded together); max_queue: requests that may wait
    for a slot before `submit` raises QueueFull; context: tokens per slot (prompt +
    max_tokens), at most the model's max_position_embeddings; cuda_graph: replay the
    decode step from a CUDA graph (needs the model on CUDA)."""

    def __init__(self, model, tokenizer, *, max_batch: int = 8, max_queue: int = 64,
                 context: int | None = None, kv_bits: int = 0, kv_group_size: int = 64,
                 cuda_graph: bool = False):
        cfg = model.config
        self.model, self.tokenizer = model, tokenizer
        self.device = model.model.norm.weight.device
        self.context = min(context or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.cache = KVCache(cfg, max_batch, self.context, model.dtype, self.device, kv_bits,
                             kv_group_size)
        self.eos = set(cfg.eos_token_ids)
        self.vocab = cfg.vocab_size
        self.slots: list[_Seq | None] = [None] * max_batch
        self.waiting: deque[Request] = deque()
        self.requests_total = 0
        self.tokens_total = 0
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._decode = self._eager_decode
        if cuda_graph:
            # One graph for the fixed batch shape: every step replays it.
            self._decode = GraphedDecode(model, self.cache, max_batch)
        self._tokens = torch.zeros(max_batch, dtype=torch.int64)

    # ---- the server's side (any thread) ----

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="qfuse-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, req: Request) -> None:
        """Queue ``req``; QueueFull when max_queue requests already wait for a slot."""
        with self._cv:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull
            self.waiting.append(req)
            self.requests_total += 1
            self._cv.notify()

    def cancel(self, req: Request) -> None:
        """Stop ``req``: it leaves the queue, or frees its slot before the next step."""
        req.cancelled = True
        with self._cv:
            self._cv.notify()

    def stats(self) -> dict:
        with self._cv:
            active = sum(s is not None for s in self.slots)
            return {"slots": self.max_batch, "active": active, "free_slots": self.max_batch - active,
                    "waiting": len(self.waiting), "max_queue": self.max_queue,
                    "requests_total": self.requests_total, "tokens_total": self.tokens_total}

    # ---- the engine thread ----

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self.waiting and not self._active():
                    self._cv.wait()
                if self._stopping:
                    return
                admitted = []
                for s in range(self.max_batch):
                    while self.slots[s] is None and self.waiting:
                        req = self.waiting.popleft()
                        if not req.cancelled:
                            self.slots[s] = seq = _Seq(req, s)
                            admitted.append(seq)
            try:
                for seq in admitted:
                    self._prefill(seq)
                self._free_cancelled()
                if self._active():
                    self._step()
            except Exception:  # a bug or out of memory: fail the requests, keep serving
                log.exception("qfuse serve: the engine step failed")
                for seq in self._active():
                    seq.req.emit(Event("", finish_reason="error"))
                    self._free(seq)

    def _active(self) -> list[_Seq]:
        return [s for s in self.slots if s is not None]

    def _free(self, seq: _Seq) -> None:
        """Empty ``seq``'s slot, then give it back (an idle slot always has length 0)."""
        self.cache.lengths[seq.slot] = 0
        self.cache.host_lengths[seq.slot] = 0
        with self._cv:
            self.slots[seq.slot] = None

    def _free_cancelled(self) -> None:
        for seq in self._active():
            if seq.req.cancelled:
                self._free(seq)

    def _prefill(self, seq: _Seq) -> None:
        req, V = seq.req, self.vocab
        ids = torch.tensor([req.ids], dtype=torch.int64, device=self.device)
        view = self.cache.slot(seq.slot)  # prefill writes straight into the slot
        with torch.no_grad():
            logits = self.model(ids, None, view)[:, -1]
        self.cache.host_lengths[seq.slot] = view.host_lengths[0]
        if req.params.repetition_penalty != 1.0:
            seq.seen = torch.zeros(V, dtype=torch.bool, device=self.device)
            seq.seen[ids[0]] = True
        if req.presence_penalty or req.frequency_penalty:
            seq.counts = torch.zeros(V, dtype=torch.float32, device=self.device)
        if req.params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(req.params.seed)
        self._advance([seq], [logits])

    def _eager_decode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.decode(tokens, self.cache)

    def _step(self) -> None:
        """One decode step over every slot; idle slots decode token 0 at length 0."""
        active = self._active()
        self._tokens.zero_()
        for seq in active:
            self._tokens[seq.slot] = seq.token
        with torch.no_grad():
            logits = self._decode(self._tokens.to(self.device))
        busy = {seq.slot for seq in active}
        idle = [s for s in range(self.max_batch) if s not in busy]
        if idle:  # the step advanced the idle slots too: keep them empty, never full
            self.cache.lengths[idle] = 0
            for s in idle:
                self.cache.host_lengths[s] = 0
        self._advance(active, [logits[seq.slot: seq.slot + 1] for seq in active])

    def _advance(self, seqs: list[_Seq], logits: list[torch.Tensor]) -> None:
        """Sample each sequence's next token from its logits [1, V], emit it, and free
        the slot of each request that is done. Each sequence samples with its own
        parameters, but their tokens reach the host together: one sync per step."""
        drawn = []
        for seq, row in zip(seqs, logits):
            req = seq.req
            if req.cancelled:
                self._free(seq)
                continue
            seen = None if seq.seen is None else seq.seen[None]
            x = penalize(row, req.params, seen)
            if seq.counts is not None:  # OpenAI's definition, on top of the repetition penalty
                x = x - req.frequency_penalty * seq.counts - req.presence_penalty * (seq.counts > 0)
            drawn.append((seq, x, sample(x, req.params, None, seq.generator)))
        if not drawn:
            return
        tokens = torch.cat([t for _, _, t in drawn]).tolist()
        for (seq, x, _), token in zip(drawn, tokens):
            self._emit(seq, x, token)

    def _emit(self, seq: _Seq, x: torch.Tensor, token: int) -> None:
        """Emit ``seq``'s sampled ``token`` (drawn from penalized logits x [1, V]) and
        free the slot when the request is done."""
        req = seq.req
        event = Event("")
        if req.logprobs is not None:
            lp = torch.log_softmax(x[0], -1)
            event.logprob = float(lp[token])
            if req.logprobs:
                top = torch.topk(lp, min(req.logprobs, self.vocab))
                event.top = list(zip(top.indices.tolist(), top.values.tolist()))
        if token in self.eos:
            event.finish_reason = "stop"
        else:
            event.token = token
            seq.token = token
            seq.generated.append(token)
            req.completion_tokens += 1
            with self._cv:
                self.tokens_total += 1
            if seq.seen is not None:
                seq.seen[token] = True
            if seq.counts is not None:
                seq.counts[token] += 1
            full = self.tokenizer.decode(seq.generated)
            if not full.endswith("\ufffd"):  # else a multi-byte character is incomplete
                seq.text, hit = _cut_at_stop(full, req.stop)
                if hit:
                    event.finish_reason = "stop"
            if event.finish_reason is None and len(seq.generated) >= req.max_tokens:
                event.finish_reason = "length"
        # Hold back text that could be the start of a stop string spanning tokens.
        hold = max((len(s) for s in req.stop), default=1) - 1
        upto = len(seq.text) if event.finish_reason else max(seq.emitted, len(seq.text) - hold)
        event.text = seq.text[seq.emitted: upto]
        seq.emitted = upto
        req.emit(event)
        if event.finish_reason:
            self._free(seq)
