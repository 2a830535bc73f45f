"""Continuous batching: concurrent requests share decode steps over one KV cache.

`Engine` is what callers use: `submit(Request)` (QueueFull past ``max_queue`` waiting),
`cancel`, `start`/`stop` of its thread, `stats()`, `page_stats()`, `in_flight()`. Each
request gets its events through `Request.emit`, called on the engine's thread. The thread
loops: wait for work, admit waiting requests and prefill them, then one decode step, then
sample and emit every decoding sequence's next token (mixed steps: admit, then one step
that decodes and prefills prompt pieces together). A request that finishes, is
cancelled or whose client went away frees its slot before the next step.

The engine's collaborators, one a file: `scheduler` (slots, queues, admission,
preemption, chunk planning), `prefill` (prompts into the cache, first tokens),
`slotted_steps` / `paged_steps` (the decode step over either cache, with CUDA graphs,
async scheduling, preemption), `sampler` (tokens from logits), `emission` (tokens to
events, stop strings, the end of a request); `buckets` (the batch sizes steps run at) and
`requests` (what callers hand it and get back). docs/serving.md explains the policies:
batching, chunked prefill, batch invariance, paged KV and preemption, prefix caching,
async scheduling, failures.

Failures: one sequence's failure ends that sequence alone; a batched call that fails is
run again row by row. `ModelFailed` (a lost tensor-parallel rank) fails every request and
ends the thread; an exception outside these (a bug in the loop itself) fails the requests
in the slots and the engine goes on serving. Every failure's traceback goes to the log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..runtime.cache import KVCache
from ..runtime.paged_cache import PagedKVCache
from ..runtime.prefill_graphs import GraphedPrefill, PaddedPrefill
from ..runtime.prefix_cache import PrefixCache
from .buckets import batch_for, bucket_sizes, paged_cache_options, step_buckets
from .emission import Emission
from .paged_steps import PagedSteps
from .prefill import Prefill
from .requests import Event, ModelFailed, QueueFull, Request, tell
from .sampler import Sampler
from .scheduler import Scheduler
from .slotted_steps import SlottedSteps

# What callers import from here (app, server, bench, tests); each lives in its part's file.
__all__ = ["Engine", "Event", "ModelFailed", "QueueFull", "Request", "bucket_sizes",
           "paged_cache_options", "step_buckets"]

log = logging.getLogger("qfuse")


# Whether a paged engine runs mixed steps unless told (`Engine(mixed_steps=)`).
MIXED_BY_DEFAULT = False


# The prompt lengths of `Engine(prefill_buckets=...)` that `qfuse bench serve` measures:
# off by default until a GPU has timed them (bench/NOTES.md, "Prefill graphs").
PREFILL_BUCKETS = (64, 128, 256, 512)


# A mixed step's tokens unless told, decode rows included: where the committed H200
# figures put a one-stream step at about 1.5x a decode step (bench/NOTES.md, "Mixed steps").
DEFAULT_STEP_TOKENS = 64


class Engine:
    """Continuous batching over ``model``; `start()` runs its thread, `stop()` ends it.

    max_batch: slots (sequences decoded together); max_queue: requests that may wait
    for a slot before `submit` raises QueueFull; context: tokens per slot (prompt +
    max_tokens), at most the model's max_position_embeddings; deterministic: decode
    every slot at every step (batch invariance), else only the busy rows rounded up to
    a bucket, and prefill every prompt alone; cuda_graph: replay the decode step from a
    CUDA graph per bucket (needs the model on CUDA); max_prefill_tokens: the padded
    prompt tokens one loop may prefill before its decode step (one prompt or chunk at
    least); prefill_chunk: a longer prompt is prefilled in chunks of this many tokens, one
    per loop, beside the decode steps of the others (0: every prompt whole); kv_page_size:
    a paged KV cache of pages of this many tokens, kv_pages of them (docs/serving.md:
    admission by free pages, preemption); prefix_caching: share the pages of cached
    prompt prefixes (needs kv_page_size); async_scheduling: launch a slotted decode step
    before the host has read the last step's tokens (off: each step's tokens are read
    before the next); mixed_steps: paged, while prompts go in, each step is one forward
    over every decoding sequence's token and prompt pieces within step_tokens tokens
    (`PagedSteps.mixed_step`; None: `MIXED_BY_DEFAULT` on a paged, non-deterministic
    engine); step_tokens: that budget, decode rows included (default DEFAULT_STEP_TOKENS;
    the oldest prompt under way gets `scheduler.MIN_PIECE` tokens a step at least, so a
    full batch of decode rows never starves it); prefill_buckets: slotted, a prompt
    prefilled alone that fits one of these lengths is right-padded to the shortest that
    holds it and prefilled by one pass of that fixed shape into its slot, replayed from a
    CUDA graph per length with cuda_graph (`runtime.prefill_graphs`; lengths past the
    context or the prefill chunk are dropped; empty: off, the default); on_graph: called
    as on_graph(bucket, seconds) after each bucket's
    CUDA graph is captured, so that a caller can say where a long start is, or end it by
    raising (the start stops there, between two captures, and the exception propagates).

    Its parts: ``scheduler``, ``prefill``, ``steps`` (a `SlottedSteps` or `PagedSteps`),
    ``sampler``, ``emission``; ``busy_s``: the thread's seconds but its waits for work."""

    def __init__(self, model, tokenizer, *, max_batch: int = 8, max_queue: int = 64,
                 context: int | None = None, kv_bits: int = 0, kv_group_size: int = 64,
                 cuda_graph: bool = False, deterministic: bool = False,
                 max_prefill_tokens: int = 2048, prefill_chunk: int = 512,
                 kv_page_size: int | None = None, kv_pages: int | None = None,
                 prefix_caching: bool = False, async_scheduling: bool = False,
                 mixed_steps: bool | None = None, step_tokens: int | None = None,
                 prefill_buckets: tuple[int, ...] = (),
                 on_graph: Callable[[int, float], None] | None = None):
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be at least 1, got {max_prefill_tokens}")
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be at least 0 (0: off), got {prefill_chunk}")
        cfg = model.config
        self.model, self.tokenizer = model, tokenizer
        self.device = model.model.norm.weight.device
        self.context = min(context or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_chunk = prefill_chunk
        self.paged = kv_page_size is not None
        if kv_pages is not None and not self.paged:
            raise ValueError("kv_pages sizes a paged KV cache: give kv_page_size too")
        if async_scheduling and self.paged:
            raise ValueError("async_scheduling runs the slotted cache's steps (a paged step "
                             "takes its pages on the host first): leave out kv_page_size")
        if prefix_caching and not self.paged:
            raise ValueError("prefix_caching shares the pages of a paged KV cache: give "
                             "kv_page_size too")
        if mixed_steps is None:  # the default
            mixed_steps = MIXED_BY_DEFAULT and self.paged and not deterministic and \
                hasattr(model, "mixed")
        if mixed_steps and not self.paged:
            raise ValueError("mixed_steps runs prefill pieces beside the decode rows of a "
                             "paged KV cache: give kv_page_size too")
        if mixed_steps and deterministic:
            raise ValueError("mixed_steps cuts prompts by the load, which deterministic "
                             "serving may not: leave one of them out")
        if mixed_steps and not hasattr(model, "mixed"):
            raise ValueError("mixed_steps needs a model with a mixed step (Decoder.mixed)")
        if prefill_buckets and self.paged:
            raise ValueError("prefill_buckets prefill into a slotted KV cache: leave out "
                             "kv_page_size")
        if any(not isinstance(L, int) or L < 1 for L in prefill_buckets):
            raise ValueError(f"prefill_buckets must be positive lengths, got {prefill_buckets}")
        self.mixed_steps = mixed_steps
        self.step_tokens = DEFAULT_STEP_TOKENS if step_tokens is None else step_tokens
        if self.step_tokens < 1:
            raise ValueError(f"step_tokens must be at least 1, got {self.step_tokens}")
        if self.paged:
            self.cache = PagedKVCache(
                cfg, max_batch, self.context, model.dtype, self.device, kv_bits,
                kv_group_size, kv_page_size, kv_pages, **paged_cache_options(
                    self.context, prefill_chunk, prefix_caching, cuda_graph or deterministic,
                    mixed_steps))
            per_seq = -(-self.context // kv_page_size)
            if kv_pages is not None and kv_pages < per_seq:
                raise ValueError(f"kv_pages={kv_pages} pages of {kv_page_size} tokens hold "
                                 f"less than one sequence of context={self.context} tokens "
                                 f"({per_seq} pages)")
        else:
            self.cache = KVCache(cfg, max_batch, self.context, model.dtype, self.device,
                                 kv_bits, kv_group_size)
        self.prefix = PrefixCache(self.cache) if prefix_caching else None
        self.requests_total = 0
        self.deterministic = deterministic
        self.buckets = step_buckets(model, max_batch, deterministic)
        self.steps_by_batch = dict.fromkeys(self.buckets, 0)  # decode steps run per size
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        if cuda_graph and self.device.type != "cuda":
            raise ValueError("cuda_graph needs the model on a CUDA device")
        self.scheduler = Scheduler(
            model, tokenizer, self.cache, lock=self._cv, paged=self.paged, prefix=self.prefix,
            max_batch=max_batch, context=self.context, max_prefill_tokens=max_prefill_tokens,
            prefill_chunk=prefill_chunk, deterministic=deterministic, mixed=mixed_steps)
        self.sampler = Sampler(self.device, cfg.vocab_size, free=self.scheduler.free,
                               fail=self.scheduler.fail)
        self.emission = Emission(self.scheduler, self.sampler, lock=self._cv,
                                 eos=set(cfg.eos_token_ids), vocab=cfg.vocab_size)
        longest = min(self.context, prefill_chunk or self.context)
        self.prefill_buckets = tuple(sorted({L for L in prefill_buckets if L <= longest}))
        # Made now, while every slot is idle (as the decode graphs are, below).
        fixed = {L: (GraphedPrefill if cuda_graph else PaddedPrefill)(model, self.cache, L)
                 for L in self.prefill_buckets}
        self.prefill = Prefill(model, self.cache, device=self.device, paged=self.paged,
                               prefix=self.prefix, scheduler=self.scheduler,
                               sampler=self.sampler, emission=self.emission, fixed=fixed)
        parts = {"buckets": self.buckets, "max_batch": max_batch, "cuda_graph": cuda_graph,
                 "on_graph": on_graph, "steps_by_batch": self.steps_by_batch,
                 "scheduler": self.scheduler, "emission": self.emission}
        if self.paged:
            self.steps: SlottedSteps | PagedSteps = PagedSteps(
                model, self.cache, deterministic=deterministic,
                fixed=cuda_graph or deterministic, prefill=self.prefill, **parts)
        else:
            self.steps = SlottedSteps(model, self.cache, async_scheduling=async_scheduling,
                                      sampler=self.sampler, **parts)
        self.async_scheduling = async_scheduling
        # Where the engine thread's time goes (`qfuse bench serve` reads the differences):
        # all of it but the waits for work, and of that the waits for sampled tokens (the
        # GPU's step still running: `token_wait_s`); the rest is the host's own work.
        self.busy_s = 0.0

    @property
    def token_wait_s(self) -> float:
        """Of ``busy_s``, the seconds spent waiting for sampled tokens to reach the host."""
        return self.sampler.token_wait_s

    @property
    def tokens_total(self) -> int:
        """Tokens emitted so far, over every request."""
        return self.emission.tokens_total

    @property
    def slots(self) -> list:
        """Each slot's sequence, or None (a snapshot)."""
        return self.scheduler.slots

    @property
    def preemptions(self) -> int:
        """Sequences preempted so far (paged: out of pages)."""
        return self.scheduler.preemptions

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
            if len(self.scheduler.waiting) >= self.max_queue:
                raise QueueFull
            self.scheduler.waiting.append(req)
            self.requests_total += 1
            self._cv.notify()

    def cancel(self, req: Request) -> None:
        """Stop ``req``: it leaves the queue, or frees its slot before the next step."""
        req.cancelled = True
        with self._cv:
            self._cv.notify()

    def in_flight(self) -> int:
        """Requests in a slot or waiting for one: a snapshot read without the lock, as a
        signal handler calls it (`qfuse serve`'s first Ctrl-C)."""
        s = self.scheduler
        return sum(q is not None for q in s.slots) + len(s.waiting) + len(s.preempted)

    def batch_for(self, top: int) -> int:
        """The rows a step decodes when the highest busy slot is ``top - 1``."""
        return batch_for(self.buckets, top)

    def stats(self) -> dict:
        s = self.scheduler
        with self._cv:
            active = sum(q is not None for q in s.slots)
            return {"slots": self.max_batch, "active": active,
                    "free_slots": self.max_batch - active,
                    # of the active: prompts between chunks, not decoding yet
                    "prefilling": len(s.prefilling()),
                    # preempted sequences wait too, ahead of the queue
                    "waiting": len(s.waiting) + len(s.preempted),
                    "max_queue": self.max_queue,
                    "requests_total": self.requests_total,
                    "tokens_total": self.emission.tokens_total,
                    # The engine thread writes the lengths without the lock: a snapshot.
                    "kv_tokens": sum(self.cache.host_lengths),
                    "deterministic": self.deterministic, "prefill_chunk": self.prefill_chunk,
                    "async_scheduling": self.async_scheduling,
                    **({"mixed_steps": self.steps.mixed_runs, "step_tokens": self.step_tokens}
                       if self.mixed_steps else {}),
                    "buckets": list(self.buckets),  # the batch sizes steps decode at
                    **({"prefill_buckets": list(self.prefill_buckets),
                        "fixed_prefills": self.prefill.fixed_runs}
                       if self.prefill_buckets else {}),
                    "steps_by_batch": {str(b): n for b, n in self.steps_by_batch.items()},
                    **({"kv_pages": self.page_stats()} if self.paged else {}),
                    **({"prefix_cache": {"queries": s.prefix_queries, "hits": s.prefix_hits}}
                       if self.prefix is not None else {})}

    def page_stats(self) -> dict:
        """The paged cache's full-attention pool (of the sliding one without): pages of
        page_size tokens, total, used (held by sequences) and free, of which cached (a
        prefix cache keeps them until an allocation needs them), and sequences preempted
        so far. A snapshot, as the lengths are."""
        group = self.cache.groups.get(None) or next(iter(self.cache.groups.values()))
        total = group.allocator.num_pages
        free = group.allocator.free_pages
        return {"page_size": self.cache.page_size, "total": total, "used": total - free,
                "free": free, "cached": group.allocator.cached_pages,
                "preemptions": self.scheduler.preemptions}

    # ---- the engine thread ----

    def _loop(self) -> None:
        while True:
            try:
                if not self._turn():
                    return
            except ModelFailed:  # no step can run again: fail everything and stop
                self.steps.drop_ahead()
                with self._cv:
                    self._stopping = True
                    waiting, preempted = self.scheduler.take_all()
                for seq in self.scheduler.active() + preempted:
                    self.scheduler.end(seq, Event("", finish_reason="error"))
                for req in waiting:
                    tell(req, Event("", finish_reason="error"))
                return
            except Exception:  # a bug in the loop itself: fail the requests, keep serving
                log.exception("qfuse serve: the engine step failed")
                self.steps.drop_ahead()
                for seq in self.scheduler.active():
                    self.scheduler.end(seq, Event("", finish_reason="error"))

    def _turn(self) -> bool:
        """One pass of the loop: wait for work, admit and prefill, then one decode step
        (or, with nothing to decode, the tokens of a step run ahead); False once the
        engine stops. Its time but the wait for work counts in ``busy_s``."""
        s = self.scheduler
        began, idle = time.perf_counter(), 0.0
        try:
            if self.steps.ahead is not None and (s.waiting or s.preempted) \
                    and None in s.slots:
                # The tokens in flight first: the slots they free take the waiting at once.
                self.steps.finish_ahead()
            with self._cv:
                waited = time.perf_counter()
                while (not self._stopping and not s.waiting and not s.preempted
                       and not s.active() and self.steps.ahead is None):
                    self._cv.wait()
                idle = time.perf_counter() - waited
                if self._stopping:
                    return False
                chunks, batches = s.admit()
            for group in s.chunk_groups(chunks):
                self.prefill.chunks(group)
            for batch in batches:
                self.prefill.batch(batch)
            s.free_cancelled()
            if self.mixed_steps:
                # Nothing decoding: no step to hold up, the prefill budget holds.
                self.steps.mixed_step(self.step_tokens if s.decoding() else
                                      max(self.step_tokens, self.max_prefill_tokens))
            elif s.decoding():
                self.steps.step()
            else:
                self.steps.finish_ahead()
            return True
        finally:
            self.busy_s += time.perf_counter() - began - idle
