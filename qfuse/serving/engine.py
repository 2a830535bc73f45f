"""Continuous batching: concurrent requests share decode steps over one slotted KV cache.

The engine owns a KVCache of ``max_batch`` slots (one sequence each) and a thread
that loops: admit waiting requests (first come, first served) into the lowest free
slots and prefill them, then run one decode step, then sample every active slot's
next token with its own parameters. A request that finishes, is cancelled or whose
client went away frees its slot before the next step.

Prefill: requests admitted together into adjacent slots are prefilled as one
right-padded batch (`generation.pad_prompts`, as `generate` batches prompts), straight
into a view of those slots; a busy slot between free ones splits the batch. Each row
gets the first token and KV entries it gets prefilled alone, up to rounding (a product
over more rows may round differently): greedy tokens agree unless two candidates tie
within rounding. One loop admits at most ``max_prefill_tokens`` padded tokens (rows x
longest prompt, summed over its batches) before its decode step, so that a burst of
prompts cannot stall the streams for long; a longer prompt is still admitted, alone.

Chunked prefill (``prefill_chunk``, `qfuse serve --prefill-chunk`): a prompt longer than
``prefill_chunk`` tokens takes its slot at admission and is prefilled in its own row,
one chunk per loop: tokens [0, C), then [C, 2C), ... (C = prefill_chunk), each chunk attending to
the ones before it through the slot's cache (`Decoder.forward(..., past=)`), while the
loop's decode step goes on for the sequences already generating. Chunk boundaries
depend on the prompt alone, never on the load. The sequence joins the decode steps once
its last chunk has given its first token (TTFT ends there). The loop's budget of
``max_prefill_tokens`` counts chunks too: the chunks of the prompts under way (oldest
first, one each), then the new prompts; the first piece always runs, so the oldest
prompt under way advances every loop (younger ones whenever the budget holds their
chunks too: with a budget under k chunks, the k-th waits for the ones before it) and a
loop stalls the streams for at most max(max_prefill_tokens, prefill_chunk) prompt
tokens. Only a prompt's last chunk computes logits (its last token's). A chunk's greedy tokens are those of the whole prompt up
to rounding (on a CPU, a product over fewer rows may sum in another order); with a
quantized KV cache a chunk attends to the earlier chunks' keys and values as stored,
quantized, as a decode step does, where a whole prompt attends to them exact.
Until its last chunk a sequence is `stats()["prefilling"]`: it holds its slot (the
decode step's row for it is a dummy whose write the next chunk overwrites, and its
length is put back), a cancel frees the slot before its next chunk, and a chunk that
fails ends that request alone. ``prefill_chunk=0`` prefills every prompt whole. Paged,
one loop's chunks that start at the same position (``past``, one per `Decoder.forward`
call: the prompts after the same cached prefix, say) run as one right-padded call over
their rows (`_chunk_groups`), the loop's padded tokens still within max_prefill_tokens;
their boundaries stay the prompts' own, and a call that fails runs each chunk alone.

Sampling: plain greedy rows share one argmax; unseeded, unpenalized rows with the
same parameters share one draw (from torch's global generator); a seeded request
draws alone from its own generator, so its tokens do not depend on its company, and
a penalized one alone with its own penalty state.

Batch invariance (``deterministic=True``, `qfuse serve --deterministic`): the decode step
runs only batch sizes at which each row is computed as at ``max_batch`` rows
(`step_buckets`): on a GPU where every weight product takes the same row-invariant kernel
at those rows as at max_batch (the fragment kernel or the TMA ring over 1-32 rows, the
wgmma kernel over 33-256 on Hopper), those buckets, rounded up to as the default rounds;
elsewhere (a CPU, dense weights, tensor parallelism) all ``max_batch`` rows at every step
(idle slots decode a dummy token at length 0). Every prompt is prefilled alone (in the
same chunks; paged, equal chunks at the same position share a call when its token rows
take the row-invariant kernels one chunk's take: `_prefill_chunks`), so a request's
tensors are computed as they are whoever shares its steps; each row of the products and
of attention is computed independently of the others, so greedy tokens do not depend on
the company a request keeps. (A product over 1 row and over 8 rows may round differently
unless its kernel is row-invariant, which is why the batch is fixed elsewhere and
prompts are not batched.) The price: one stream pays for a step of the smallest such
bucket (of max_batch where only it is; measured in `bench/results/serve.json`), so it is
not the default.

``deterministic=False`` (the default) decodes only the rows up to the highest busy slot, rounded
up to a bucket (1, 2, 4, ... max_batch): fewer rows, faster steps at low load, but
a request's rounding may then depend on how many others share its steps. Slots are
filled lowest first, so the busy rows stay packed at the front (a slot freed below
a busy one stays a hole, decoding a dummy row, until it is refilled).

``cuda_graph=True`` (needs CUDA) replays each bucket's step from its own CUDA graph,
all captured when the engine is made: one graph when deterministic.

Failures: one sequence's failure ends that sequence alone. Its per-sequence work (its
penalty state and seed generator, its draw, the sync of its token, its logprobs,
detokenizing and stop strings, its emit) runs under its own try: an exception there
sends its client an error event and frees its slot, and the other rows of the step go
on. A batched call that fails (the prefill of adjacent prompts, the decode step, a
shared argmax or draw) blames no row: its rows are run again one by one (the decode
step at batch 1, from the lengths it started at), and only a row that fails alone is
ended. `ModelFailed` (a lost tensor-parallel rank) ends everything, as no call can
succeed again; an exception outside these (a bug in the loop itself) fails the
requests in the slots and the engine goes on serving. Every failure's traceback goes
to the log.

Paged KV cache (``kv_page_size``, `qfuse serve --kv-page-size`; off by default): K and V
live in a `PagedKVCache` of ``kv_pages`` pages (default: every slot at ``context``), so
memory follows the tokens in use. Slots still bound the batch; pages bound admission: a
waiting request is admitted, in order, only when its prompt plus one page of decode room
fits the free pages left after the prompts already admitted take the rest of theirs
(`_fits`); else it and all behind it wait (max_queue and QueueFull as ever). Each
prefill runs over just the rows it feeds (`PagedKVCache.select`), and so does each
decode step by default (no dummy rows, which would take pages: every step is the
"bucket" of its rows). With ``cuda_graph`` a decode step runs the decoding rows packed
at the front of a bucket's fixed batch, replayed from that bucket's graph over fixed
inputs prepared before each replay (`paged_graphs`: the pages are taken on the host
first); with ``deterministic`` the same over its buckets (`step_buckets`), replayed or
eagerly without graphs, and where max_batch is its one bucket, every slot at its own
row of that batch. There the idle rows decode on the cache's scratch
page, which no sequence holds, so they take none. Batch invariance then holds as on
slots, as long as no sequence is preempted (which depends on the load: a resumed
sequence's prefill rounds as a prefill, not as its decode steps did). A decode step that
finds too few free pages (`OutOfPages`, before anything changed) preempts the youngest
sequence admitted (its pages go back; it goes to the head of the queue, before new
requests, keeping its sampling state and what it has streamed), then runs again; a
prefill that finds too few does the same to that sequence alone. A preempted sequence is
later prefilled again, alone (in chunks if long), from its prompt and the tokens it
generated but the last, which its next decode step feeds as before: its stream goes on
where it stopped, its greedy tokens those it would have had (up to the rounding of a
prefill against decode steps). ``kv_pages`` must hold one sequence of ``context``
tokens, so the oldest sequence alone always fits and preemption always ends. A finished,
cancelled or failed sequence releases its pages; `stats()["kv_pages"]` reports them.

Prefix caching (``prefix_caching``, `qfuse serve --enable-prefix-caching`, on there by
default with pages): the full pages of every prefilled prompt go to a `PrefixCache` after
each prefill (chunk) and stay cached when their sequence ends (free pages to admission and
to `vllm:kv_cache_usage_perc`, evicted least recently used first when an allocation needs
them). At admission a request takes the longest cached prefix of whole pages of its prompt
(never all of it: its last token is computed for its logits) into its row, counted as
pages it need not take, and is prefilled from there, in chunks at the boundaries its
prompt alone sets (together with the other chunks of its loop at the same position) (multiples of ``prefill_chunk``; the first one shorter), as a chunk after
cached tokens. Its greedy tokens are those of the request alone without the cache when the
cached prefix ends at one of those boundaries (the same chunks, the same K/V); elsewhere up
to the rounding of a chunk against a longer one, and, with a quantized KV cache, of
attending to the prefix's K/V as stored rather than exact. Its later tokens go to pages of
its own (whole pages only are shared), so no shared page is written. A preempted sequence
resumes from the cache too. `stats()["prefix_cache"]` counts the prompt tokens looked up
(``queries``) and found (``hits``) at each new request's admission, as vLLM's
prefix_cache_queries and prefix_cache_hits do. With ``prefill_chunk=0`` the paged cache's
sliding layers are sized for a whole prompt after cached tokens.

Async scheduling (``async_scheduling``, `qfuse serve --async-scheduling`, vLLM's name; off
by default until its GPU test has run): the host's work between two slotted decode steps
(reading the tokens, detokenizing, stop strings, the events to the clients) runs while
the next step computes, instead of leaving the GPU idle. When a request waits for a free
slot, the tokens in flight are read first, so that the slots they free are admitted at
once (a prefill waits for the GPU anyway). A step is launched
before the host reads the last step's tokens: a row whose token is still on the device
is fed from there (`_stage_step`; the host's tokens and the lengths go over in one copy
from pinned memory, which waits behind the stream's work instead of syncing it), the
step's draws are copied back behind it (`_stage_tokens`), and the last step's tokens are
then read and emitted (`_finish_ahead`). A sequence whose in-flight token is its
max_tokens-th takes no further step; one that the emission ends (EOS, a stop string) or
a cancel frees has had one row computed for nothing, which is dropped. Greedy and seeded
tokens are those of reading each step first (unseeded sampled rows share one draw, which
a dropped row still takes part in, so theirs may differ; a dropped row in the highest slot
may keep one step in a larger bucket, whose rounding may differ). Only rows without
per-token host state run ahead: a penalized request (its counts are updated from the
host's token) or one asking for logprobs (read from the step's logits, which the next
replay overwrites) makes its steps read their tokens first; so does the paged cache,
whose steps take their pages on the host.

Requests talk to the server through `Request.emit`, called on the engine thread
with one `Event` per generated token (and one on finishing).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache import KVCache
from ..detokenize import IncrementalText
from ..generation import (
    GraphedDecode,
    SamplingParams,
    cut_at_stop,
    pad_prompts,
    penalize,
    sample,
    stop_hold,
)
from ..host_copies import to_device
from ..paged_cache import OutOfPages, PagedKVCache
from ..paged_graphs import GraphedPagedDecode, PagedStepInputs
from ..prefix_cache import Hit, PrefixCache

log = logging.getLogger("qfuse")


def bucket_sizes(max_batch: int) -> list[int]:
    """The batch sizes a non-deterministic engine decodes at: the powers of two below
    max_batch, then max_batch itself."""
    sizes = [1]
    while sizes[-1] * 2 < max_batch:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def step_buckets(model, max_batch: int, deterministic: bool) -> list[int]:
    """The batch sizes an engine decodes at. Bucketed (the default): `bucket_sizes`.
    Deterministic: those of them at which every weight product takes the row-invariant
    kernel it takes at max_batch rows (`Decoder.product_kernels`: on Hopper, say, the
    fragment kernel or the TMA ring over 1-32 rows, the wgmma kernel over 33-256), so a
    row's bits do not depend on which of them a step runs; max_batch alone where the
    kernels are not row-invariant (on a CPU, dense weights, tensor parallelism: the model
    cannot tell)."""
    if not deterministic:
        return bucket_sizes(max_batch)
    kernels = product_kernels(model, max_batch)
    if kernels is None:
        return [max_batch]
    return [b for b in bucket_sizes(max_batch) if product_kernels(model, b) == kernels]


def product_kernels(model, rows: int) -> tuple[str, ...] | None:
    """`Decoder.product_kernels` of ``model`` (None for a model without it: a tensor-
    parallel leader, a stand-in)."""
    kernels_of = getattr(model, "product_kernels", None)
    return kernels_of(rows) if kernels_of is not None else None


def paged_cache_options(context: int, prefill_chunk: int, prefix_caching: bool,
                        fixed_batch: bool) -> dict:
    """The `PagedKVCache` keywords the engine makes its cache with (and `sizing` counts):
    a fixed-batch step (a graph's bucket, the deterministic batch) decodes its idle rows
    on a scratch page, which no sequence holds; a prompt after a cached prefix is
    prefilled as a chunk, without chunks a whole prompt's."""
    return {"chunk_tokens": prefill_chunk or (context if prefix_caching else 1),
            "scratch_page": fixed_batch, "prefix_pages": prefix_caching}


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
class _Seq:
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
    # Overlap: its last token is still on the device, at this index of a step's tokens
    # (`_Ahead`) the host has not read yet; the next step feeds it from there.
    ahead: tuple[_Ahead, int] | None = None


@dataclass
class _Draw:
    """Tokens drawn together for some sequences, still on the device."""
    seqs: list[_Seq]
    at: list[int]  # the index of each sequence's token in ``tokens``
    tokens: torch.Tensor  # int64 [k]
    x: torch.Tensor | None  # float32 [len(seqs), V] drawn from (for logprobs); None: argmax


@dataclass
class _Ahead:
    """A decode step's draws whose tokens the host has not read yet (async scheduling): all of
    them in one device tensor, copied to ``host`` (pinned) behind the step, ``event``
    recorded after the copy; `Engine._finish_ahead` waits for it and emits them."""
    draws: list[_Draw]
    tokens: torch.Tensor  # the draws' tokens, concatenated, on the device
    host: torch.Tensor
    event: torch.cuda.Event | None  # None on a CPU, where the copy has already happened


def _deferrable(seq: _Seq) -> bool:
    """Whether ``seq``'s next draw can run before the host reads its last token: no
    per-token state of its own feeds it (penalty counts are updated from the host's
    token) and no logprobs are read from its logits (a replay overwrites them)."""
    return seq.seen is None and seq.counts is None and seq.req.logprobs is None


def _plain_greedy(seq: _Seq) -> bool:
    """Whether ``seq`` takes the argmax of its raw logits (no penalty, no logprobs)."""
    return seq.req.params.temperature == 0 and _deferrable(seq)


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
    a paged KV cache of pages of this many tokens, kv_pages of them (the module's
    docstring: admission by free pages, preemption); prefix_caching: share the pages of
    cached prompt prefixes (needs kv_page_size; the module's docstring); async_scheduling:
    launch a slotted decode step before the host has read the last step's tokens (the
    module's docstring; off: each step's tokens are read before the next); on_graph: called
    as on_graph(bucket, seconds) after each bucket's CUDA graph is captured, so that a
    caller can say where a long start is, or end it by raising (the start stops there,
    between two captures, and the exception propagates)."""

    def __init__(self, model, tokenizer, *, max_batch: int = 8, max_queue: int = 64,
                 context: int | None = None, kv_bits: int = 0, kv_group_size: int = 64,
                 cuda_graph: bool = False, deterministic: bool = False,
                 max_prefill_tokens: int = 2048, prefill_chunk: int = 512,
                 kv_page_size: int | None = None, kv_pages: int | None = None,
                 prefix_caching: bool = False, async_scheduling: bool = False,
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
        self._admissions = 0  # requests admitted so far: each _Seq's `admitted`
        self.paged = kv_page_size is not None
        if kv_pages is not None and not self.paged:
            raise ValueError("kv_pages sizes a paged KV cache: give kv_page_size too")
        if async_scheduling and self.paged:
            raise ValueError("async_scheduling runs the slotted cache's steps (a paged step "
                             "takes its pages on the host first): leave out kv_page_size")
        if prefix_caching and not self.paged:
            raise ValueError("prefix_caching shares the pages of a paged KV cache: give "
                             "kv_page_size too")
        if self.paged:
            self.cache = PagedKVCache(
                cfg, max_batch, self.context, model.dtype, self.device, kv_bits,
                kv_group_size, kv_page_size, kv_pages, **paged_cache_options(
                    self.context, prefill_chunk, prefix_caching, cuda_graph or deterministic))
            per_seq = -(-self.context // kv_page_size)
            if kv_pages is not None and kv_pages < per_seq:
                raise ValueError(f"kv_pages={kv_pages} pages of {kv_page_size} tokens hold "
                                 f"less than one sequence of context={self.context} tokens "
                                 f"({per_seq} pages)")
        else:
            self.cache = KVCache(cfg, max_batch, self.context, model.dtype, self.device,
                                 kv_bits, kv_group_size)
        self.prefix = PrefixCache(self.cache) if prefix_caching else None
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up, and found
        self.preempted: deque[_Seq] = deque()  # oldest admission first; before `waiting`
        self.preemptions = 0
        self.eos = set(cfg.eos_token_ids)
        self.vocab = cfg.vocab_size
        self.slots: list[_Seq | None] = [None] * max_batch
        self.waiting: deque[Request] = deque()
        self.requests_total = 0
        self.tokens_total = 0
        self.deterministic = deterministic
        self.buckets = step_buckets(model, max_batch, deterministic)
        self._kernels_by_rows: dict[int, tuple[str, ...] | None] = {}  # `_same_invariant_kernel`
        self.steps_by_batch = dict.fromkeys(self.buckets, 0)  # decode steps run per size
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        if cuda_graph and self.device.type != "cuda":
            raise ValueError("cuda_graph needs the model on a CUDA device")
        # Per bucket: the cache's first rows as a view, and the step over them (a paged
        # cache selects the rows of each step instead).
        self._views = {} if self.paged else {
            b: self.cache if b == max_batch else self.cache.rows(0, b) for b in self.buckets}
        self._decoders = {}
        for b, view in self._views.items():
            # Captured now, while every slot is idle: a graph made mid-serving would stall
            # the streams for its warm-up and capture.
            if cuda_graph:
                began = time.perf_counter()
                self._decoders[b] = GraphedDecode(model, view, b)
                if on_graph is not None:
                    on_graph(b, time.perf_counter() - began)
            else:
                self._decoders[b] = lambda tokens, view=view: model.decode(tokens, view)
        # Paged, per bucket: ``step(tokens, rows)`` over fixed inputs (`paged_graphs`),
        # replayed from a graph or run eagerly (deterministic); none: each step selects
        # its rows (`_paged_step`).
        self._paged_decoders = {}
        if self.paged and (cuda_graph or deterministic):
            for b in self.buckets:
                if cuda_graph:  # captured now, while idle, as the slotted graphs are
                    began = time.perf_counter()
                    self._paged_decoders[b] = GraphedPagedDecode(model, self.cache, b)
                    if on_graph is not None:
                        on_graph(b, time.perf_counter() - began)
                else:
                    inputs = PagedStepInputs(self.cache, b)
                    self._paged_decoders[b] = (
                        lambda tokens, rows, inputs=inputs: inputs.step(model, tokens, rows))
        self.async_scheduling = async_scheduling
        self._ahead: _Ahead | None = None  # the step whose tokens the host has yet to read
        # Where the engine thread's time goes (`qfuse bench serve` reads the differences):
        # all of it but the waits for work, and of that the waits for sampled tokens (the
        # GPU's step still running); the rest is the host's own work.
        self.busy_s = self.token_wait_s = 0.0

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

    def in_flight(self) -> int:
        """Requests in a slot or waiting for one: a snapshot read without the lock, as a
        signal handler calls it (`qfuse serve`'s first Ctrl-C)."""
        return sum(s is not None for s in self.slots) + len(self.waiting) + len(self.preempted)

    def stats(self) -> dict:
        with self._cv:
            active = sum(s is not None for s in self.slots)
            return {"slots": self.max_batch, "active": active, "free_slots": self.max_batch - active,
                    # of the active: prompts between chunks, not decoding yet
                    "prefilling": len(self._prefilling()),
                    # preempted sequences wait too, ahead of the queue
                    "waiting": len(self.waiting) + len(self.preempted),
                    "max_queue": self.max_queue,
                    "requests_total": self.requests_total, "tokens_total": self.tokens_total,
                    # The engine thread writes the lengths without the lock: a snapshot.
                    "kv_tokens": sum(self.cache.host_lengths),
                    "deterministic": self.deterministic, "prefill_chunk": self.prefill_chunk,
                    "async_scheduling": self.async_scheduling,
                    "buckets": list(self.buckets),  # the batch sizes steps decode at
                    "steps_by_batch": {str(b): n for b, n in self.steps_by_batch.items()},
                    **({"kv_pages": self.page_stats()} if self.paged else {}),
                    **({"prefix_cache": {"queries": self.prefix_queries,
                                         "hits": self.prefix_hits}}
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
                "preemptions": self.preemptions}

    # ---- the engine thread ----

    def _loop(self) -> None:
        while True:
            try:
                if not self._turn():
                    return
            except ModelFailed:  # no step can run again: fail everything and stop
                self._ahead = None
                with self._cv:
                    self._stopping = True
                    waiting, self.waiting = list(self.waiting), deque()
                    preempted, self.preempted = list(self.preempted), deque()
                for seq in self._active() + preempted:
                    self._end(seq, Event("", finish_reason="error"))
                for req in waiting:
                    _tell(req, Event("", finish_reason="error"))
                return
            except Exception:  # a bug in the loop itself: fail the requests, keep serving
                log.exception("qfuse serve: the engine step failed")
                self._ahead = None
                for seq in self._active():
                    self._end(seq, Event("", finish_reason="error"))

    def _turn(self) -> bool:
        """One pass of the loop: wait for work, admit and prefill, then one decode step
        (or, with nothing to decode, the tokens of a step run ahead); False once the
        engine stops. Its time but the wait for work counts in ``busy_s``."""
        began, idle = time.perf_counter(), 0.0
        try:
            if self._ahead is not None and (self.waiting or self.preempted) \
                    and None in self.slots:
                # The tokens in flight first: the slots they free take the waiting at once.
                self._finish_ahead()
            with self._cv:
                waited = time.perf_counter()
                while (not self._stopping and not self.waiting and not self.preempted
                       and not self._active() and self._ahead is None):
                    self._cv.wait()
                idle = time.perf_counter() - waited
                if self._stopping:
                    return False
                chunks, batches = self._admit()
            for group in self._chunk_groups(chunks):
                self._prefill_chunks(group)
            for batch in batches:
                self._prefill(batch)
            self._free_cancelled()
            if self._decoding():
                self._step()
            else:
                self._finish_ahead()
            return True
        finally:
            self.busy_s += time.perf_counter() - began - idle

    def _active(self) -> list[_Seq]:
        """The sequences in slots: prefilling or decoding."""
        return [s for s in self.slots if s is not None]

    def _decoding(self) -> list[_Seq]:
        """The sequences whose whole prompt is in the cache: the decode step's."""
        return [s for s in self.slots if s is not None and s.prefilled == len(s.feed)]

    def _prefilling(self) -> list[_Seq]:
        """The sequences whose prompt is between chunks, oldest admission first."""
        under_way = [s for s in self.slots if s is not None and s.prefilled < len(s.feed)]
        return sorted(under_way, key=lambda seq: seq.admitted)

    def _chunked(self, req: Request) -> bool:
        """Whether ``req``'s prompt is prefilled in chunks (by its length alone)."""
        return 0 < self.prefill_chunk < len(req.ids)

    def _next_chunk(self, seq: _Seq) -> tuple[int, int]:
        """The prompt positions [start, stop) of ``seq``'s next chunk: up to the next
        multiple of prefill_chunk, so that a cached prefix moves no boundary."""
        return seq.prefilled, self._chunk_stop(seq.prefilled, len(seq.feed))

    def _chunk_stop(self, start: int, n: int) -> int:
        chunk = self.prefill_chunk or n
        return min((start // chunk + 1) * chunk, n)

    def _free(self, seq: _Seq) -> None:
        """Empty ``seq``'s slot (a paged cache: give its pages back), then give it back
        (an idle slot always has length 0)."""
        if self.slots[seq.slot] is not seq:
            return  # waiting to resume (preempted): it holds neither slot nor pages
        if self.paged:
            self.cache.release(seq.slot)
        else:
            self.cache.lengths[seq.slot] = 0
            self.cache.host_lengths[seq.slot] = 0
        with self._cv:
            self.slots[seq.slot] = None

    def _preempt(self, seq: _Seq) -> None:
        """Out of pages: ``seq`` gives its slot and pages back and waits at the head of
        the queue (oldest admission first) to be prefilled again from what its cache
        held, keeping its sampling state and what it has streamed."""
        log.info("qfuse serve: out of KV pages; a sequence of %d tokens waits to resume",
                 self.cache.host_lengths[seq.slot])
        self._free(seq)
        if seq.generated:  # its cache held the prompt and all its tokens but the last
            seq.feed, seq.resumed = seq.req.ids + seq.generated[:-1], True
        seq.prefilled = 0
        with self._cv:
            self.preemptions += 1
            self.preempted.append(seq)
            self.preempted = deque(sorted(self.preempted, key=lambda q: q.admitted))

    def _youngest(self) -> _Seq:
        return max(self._active(), key=lambda seq: seq.admitted)

    def _fits(self, seq_or_req, hit: Hit | None = None) -> bool:
        """Paged: whether a new row for this request (its feed) plus a page of decode room
        fits the free pages left once the prompts in slots take the rest of theirs; a
        prefix cache's ``hit`` brings pages it need not take (and takes cached ones out
        of the free count)."""
        ids = seq_or_req.feed if isinstance(seq_or_req, _Seq) else seq_or_req.ids
        n = min(len(ids) + self.cache.page_size, self.context)
        need = self.cache.pages_needed(n)
        taken = dict.fromkeys(need, 0)
        for w, pages in (hit.pages if hit is not None else {}).items():
            need[w] = max(0, need[w] - len(pages))
            allocator = self.cache.groups[w].allocator
            taken[w] = sum(allocator.is_cached(p) for p in pages.values())
        owed = dict.fromkeys(need, 0)
        for seq in self._active():
            if seq.prefilled < len(seq.feed):
                full = self.cache.pages_needed(len(seq.feed))
                for w, g in self.cache.groups.items():
                    held = sum(p >= 0 for p in g.rows[seq.slot])
                    owed[w] += max(0, full[w] - held)
        return all(need[w] + owed[w] <= g.allocator.free_pages - taken[w]
                   for w, g in self.cache.groups.items())

    def _end(self, seq: _Seq, event: Event) -> None:
        """Free ``seq``'s slot and send its last ``event``, unless it had one already."""
        if seq.done:
            return
        seq.done = True
        self._free(seq)
        _tell(seq.req, event)

    def _fail(self, seq: _Seq, what: str) -> None:
        """End ``seq`` alone after ``what`` failed for it (called in the except block:
        the log gets the traceback); its client gets an error event."""
        log.exception("qfuse serve: %s failed for one request; it ends, the others go on",
                      what)
        self._end(seq, Event("", finish_reason="error"))

    def _free_cancelled(self) -> None:
        for seq in self._active():
            if seq.req.cancelled:
                self._free(seq)

    def _admit(self) -> tuple[list[_Seq], list[list[_Seq]]]:
        """Plan this loop's prefill (under the lock): the next chunk of each prompt under
        way (oldest first), then waiting requests moved into the lowest free slots, a
        long prompt to prefill in chunks (its first one now) and the others as batches:
        runs of adjacent slots, or one request each when deterministic. Stops before the
        piece that would take the padded tokens past max_prefill_tokens, unless it is
        the first. Returns (the sequences whose next chunk runs, the batches)."""
        chunks: list[_Seq] = []
        batches: list[list[_Seq]] = []
        spent = 0
        for seq in self._prefilling():
            if seq.req.cancelled:  # freed after this loop's prefill, unprefilled
                continue
            start, stop = self._next_chunk(seq)
            if chunks and spent + stop - start > self.max_prefill_tokens:
                return chunks, batches  # the new prompts wait for those under way
            chunks.append(seq)
            spent += stop - start
        for s in range(self.max_batch):
            if self.slots[s] is not None:
                continue
            while self.preempted and self.preempted[0].req.cancelled:
                self.preempted.popleft()  # it holds no pages; its client is gone
            while self.waiting and self.waiting[0].cancelled:
                self.waiting.popleft()
            back = self.preempted[0] if self.preempted else None
            if back is None and not self.waiting:
                break
            req = back.req if back is not None else self.waiting[0]
            feed = back.feed if back is not None else req.ids
            hit = self.prefix.lookup(feed) if self.prefix is not None else Hit()
            if self.paged and not self._fits(back or req, hit):
                break  # it and everything behind it wait for pages, in order
            # A preempted sequence is prefilled alone, as a long prompt is (no first token),
            # and so is one after a cached prefix (a chunk after cached tokens).
            chunked = back is not None or self._chunked(req) or hit.tokens > 0
            last = batches[-1] if batches else None
            joins = (not chunked and last is not None and last[-1].slot == s - 1
                     and not self.deterministic)
            cost = self._chunk_stop(hit.tokens, len(feed)) - hit.tokens if chunked \
                else len(feed)
            if joins:  # the batch's padded tokens (rows x longest prompt) grow by cost
                longest = max(len(seq.req.ids) for seq in last)
                cost = (len(last) + 1) * max(longest, cost) - len(last) * longest
            if (batches or chunks) and spent + cost > self.max_prefill_tokens:
                break
            if back is not None:
                self.preempted.popleft()
                self.slots[s] = seq = back
                seq.slot = s
            else:
                self.waiting.popleft()
                self.slots[s] = seq = _Seq(req, s, admitted=self._admissions, feed=req.ids,
                                           detokenized=IncrementalText(self.tokenizer),
                                           hold=stop_hold(req.stop))
                self._admissions += 1
                if self.prefix is not None:  # as vLLM counts: new requests, in tokens
                    self.prefix_queries += len(feed)
                    self.prefix_hits += hit.tokens
            if hit.tokens:  # the row starts with the cached prefix's pages, shared
                try:
                    self.cache.attach(s, hit.tokens, hit.pages)
                    seq.prefilled = hit.tokens
                except ValueError:  # refused before anything changed: prefill it all
                    # (a raise here would fail every request in the slots: `_loop`)
                    log.exception("qfuse serve: a cached prefix could not be attached; "
                                  "the prompt is prefilled whole")
            if chunked:
                chunks.append(seq)
            elif joins:
                last.append(seq)
            else:
                batches.append([seq])
            spent += cost
        return chunks, batches

    def _prefill(self, seqs: list[_Seq]) -> None:
        """Prefill ``seqs`` (in adjacent slots) as one right-padded batch, straight into a
        view of their slots, and sample each one's first token. If the batch fails,
        each is prefilled alone (a failure cannot be blamed on one row of a batch)."""
        first, n = seqs[0].slot, len(seqs)
        try:
            ids, lengths = pad_prompts([seq.req.ids for seq in seqs], self.device)
            view = self.cache.select([seq.slot for seq in seqs]) if self.paged \
                else self.cache.rows(first, first + n)
            with torch.no_grad():
                logits = self.model(ids, lengths, view, logits="last")
        except ModelFailed:
            raise
        except OutOfPages:  # taken before anything ran: each tries alone, or waits
            if n == 1:
                self._preempt(seqs[0])
                return
            for seq in seqs:
                self._prefill([seq])
            return
        except Exception:
            if n == 1:
                self._fail(seqs[0], "the prefill")
                return
            log.exception("qfuse serve: a prefill of %d prompts failed; prefilling each alone", n)
            for seq in seqs:
                self._prefill([seq])
            return
        for seq in seqs:
            seq.prefilled = len(seq.req.ids)
            if self.prefix is not None:
                self.prefix.register(seq.slot, seq.feed, seq.prefilled)
        self._first_tokens(seqs, logits, [seq.slot - first for seq in seqs])

    def _chunk_groups(self, chunks: list[_Seq]) -> list[list[_Seq]]:
        """This loop's chunks (oldest first) as the groups prefilled in one call each:
        paged, the chunks that start at the same position (``past``: one scalar per
        `Decoder.forward` call), padded to the longest, as long as the loop's padded
        tokens stay within max_prefill_tokens (a chunk that would take them past it runs
        alone, at the cost `_admit` counted). Deterministic: only chunks of equal length
        share a call, so that no row's attention is padded (see `_prefill_chunks`). The
        slotted cache prefills each chunk alone (its view of one row)."""
        if not self.paged:
            return [[seq] for seq in chunks]
        groups: list[list[_Seq]] = []
        by_key: dict[tuple[int, int], list[_Seq]] = {}
        longest: dict[int, int] = {}  # by group (its id): its longest chunk
        spent = 0  # the loop's padded tokens so far
        for seq in chunks:
            start, stop = self._next_chunk(seq)
            key = (start, stop - start if self.deterministic else 0)
            group = by_key.get(key)
            if group is not None:
                n, old = len(group), longest[id(group)]
                grown = spent - n * old + (n + 1) * max(old, stop - start)
                # Deterministic: the call's token rows take the row-invariant kernel one
                # chunk's would, else the order of its sums may change.
                same = not self.deterministic or self._same_invariant_kernel(
                    (n + 1) * (stop - start), stop - start)
                if grown <= self.max_prefill_tokens and same:
                    group.append(seq)
                    longest[id(group)] = max(old, stop - start)
                    spent = grown
                    continue
            group = [seq]
            groups.append(group)
            by_key[key] = group  # a later chunk of this key joins the newest group
            longest[id(group)] = stop - start
            spent += stop - start
        return groups

    def _same_invariant_kernel(self, rows: int, alone: int) -> bool:
        """Whether every product over ``rows`` token rows takes the row-invariant kernel
        it takes over ``alone`` rows (`Decoder.product_kernels`; never where there is
        none). Each row count is asked once: the routes are fixed once the engine is
        made, and asking builds a probe tensor a weight shape."""
        known = self._kernels_by_rows
        for n in (alone, rows):
            if n not in known:
                known[n] = product_kernels(self.model, n)
        return known[alone] is not None and known[rows] == known[alone]

    def _prefill_chunks(self, seqs: list[_Seq]) -> None:
        """Prefill the next chunk of each of ``seqs`` (paged, all starting at the same
        position) in one right-padded call over their rows (`PagedKVCache.select`); each
        last chunk samples its first token. If the call fails, each chunk runs alone
        (`_prefill_chunk`: a failure cannot be blamed on one row of a batch).

        Each row's queries attend to its own cached keys and chunk alone (the prompt
        mask), so a row gets the tensors it gets alone up to the rounding of products over
        more rows. Deterministic, the rows also have the shapes they have alone (equal
        chunks, no padding) and the call's token rows take the GPU's product kernel that
        one chunk's take, row-invariant ones (`Decoder.product_kernels`;
        `_chunk_groups`): an output row summed in an order that does not depend on the
        number of rows. Where the model names none (a CPU, cuBLAS's prefill rows past
        256, dense weights), each chunk runs alone."""
        live = [seq for seq in seqs if not (seq.req.cancelled or seq.done)]
        if len(live) <= 1:
            for seq in live:
                self._prefill_chunk(seq)
            return
        start = live[0].prefilled
        stops = [self._next_chunk(seq)[1] for seq in live]
        # Only last chunks sample (a resumed sequence's never): "last" if any row does.
        lasts = [stop == len(seq.feed) and not seq.resumed for seq, stop in zip(live, stops)]
        try:
            ids, lengths = pad_prompts([seq.feed[start:stop] for seq, stop in zip(live, stops)],
                                       self.device)
            view = self.cache.select([seq.slot for seq in live])
            with torch.no_grad():
                logits = self.model(ids, lengths, view, past=start,
                                    logits="last" if any(lasts) else "none")
        except ModelFailed:
            raise
        except Exception as e:  # each alone: it preempts, fails or runs on its own
            if not isinstance(e, OutOfPages):  # pages run out before anything ran: no bug
                log.exception("qfuse serve: a prefill of %d chunks failed; prefilling each "
                              "alone", len(live))
            for seq in live:
                self._prefill_chunk(seq)
            return
        for seq, stop in zip(live, stops):
            seq.prefilled = stop
            if self.prefix is not None:  # before the next growth, as `_prefill_chunk`'s
                self.prefix.register(seq.slot, seq.feed, stop, since=start)
        rows = [i for i, last in enumerate(lasts) if last]
        if rows:
            self._first_tokens([live[i] for i in rows], logits, rows)

    def _prefill_chunk(self, seq: _Seq) -> None:
        """Prefill ``seq``'s next chunk into its slot, after the ones its cache holds; the
        last chunk samples its first token. A chunk that fails ends ``seq`` alone."""
        if seq.req.cancelled or seq.done:
            return  # its slot is freed after this loop's prefill
        start, stop = self._next_chunk(seq)
        # Only the last chunk samples (no logits before it); a resumed sequence's never.
        last = stop == len(seq.feed) and not seq.resumed
        try:
            ids = torch.tensor([seq.feed[start:stop]], device=self.device)
            view = self.cache.select([seq.slot]) if self.paged \
                else self.cache.rows(seq.slot, seq.slot + 1)
            with torch.no_grad():
                logits = self.model(ids, None, view, past=start,
                                    logits="last" if last else "none")
        except ModelFailed:
            raise
        except OutOfPages:  # nothing was taken: it waits for pages at the queue's head
            self._preempt(seq)
            return
        except Exception:  # noqa: BLE001 -- this request's chunk alone: it ends (logged)
            self._fail(seq, "a prefill chunk")
            return
        seq.prefilled = stop
        if self.prefix is not None:  # now: the next growth may drop a sliding layer's pages
            self.prefix.register(seq.slot, seq.feed, stop, since=start)
        if last:
            self._first_tokens([seq], logits, [0])

    def _first_tokens(self, seqs: list[_Seq], logits: torch.Tensor, rows: list[int]) -> None:
        """Make each prefilled sequence's sampling state and sample its first token from
        its row of ``logits``; a sequence whose state cannot be made ends alone."""
        ready, at = [], []
        for seq, row in zip(seqs, rows):
            try:
                self._start(seq)
                ready.append(seq)
                at.append(row)
            except Exception:  # noqa: BLE001 -- e.g. a seed torch cannot take: it ends (logged)
                self._fail(seq, "making its sampling state")
        self._advance(ready, logits, at)

    def _start(self, seq: _Seq) -> None:
        """Make ``seq``'s own sampling state: penalty counts and its seeded generator."""
        req, V = seq.req, self.vocab
        if req.params.repetition_penalty != 1.0:
            seq.seen = torch.zeros(V, dtype=torch.bool, device=self.device)
            seq.seen[torch.tensor(req.ids, device=self.device)] = True
        if req.presence_penalty or req.frequency_penalty:
            seq.counts = torch.zeros(V, dtype=torch.float32, device=self.device)
        if req.params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(req.params.seed)

    def batch_for(self, top: int) -> int:
        """The rows a step decodes when the highest busy slot is ``top - 1``."""
        return next(b for b in self.buckets if b >= top)

    def _step(self) -> None:
        """One decode step over the bucket's rows; idle rows decode token 0 at length 0,
        a prefilling one token 0 after its chunks so far (a write at its next position,
        which its next chunk overwrites); both get their lengths back.

        Async scheduling (slotted): when every row of a step is `_deferrable`, its tokens
        stay on the device while the next step is launched (fed from there), and are
        read and emitted while that one runs; otherwise they are read at once, after the
        step run ahead before it. A row whose sequence that emission ends (EOS, a stop
        string, a cancel) was computed for nothing; one that ends by max_tokens is known
        beforehand and left out."""
        if self.paged:  # never run ahead (its pages need the host): nothing in flight
            self._paged_step()
            return
        active = [seq for seq in self._decoding() if not self._last_in_flight(seq)]
        if not active:
            self._finish_ahead()
            return
        B = self.batch_for(max(seq.slot for seq in active) + 1)
        before = self.cache.host_lengths[:B]  # a copy of the host's list: no device sync
        busy = {seq.slot for seq in active}
        # The step advances every row: only the busy ones keep their new entry (idle rows
        # stay empty, never full; a prefilling one keeps its chunks so far).
        after = [n + 1 if s in busy else n for s, n in enumerate(before)]
        tokens, lengths = self._stage_step(active, B, after)
        try:
            with torch.no_grad():
                logits = self._decoders[B](tokens)
        except ModelFailed:
            raise
        except Exception:
            log.exception("qfuse serve: a decode step of %d rows failed; decoding each "
                          "sequence alone", B)
            self._finish_ahead()  # each row's last token on the host; some may end there
            live = [seq for seq in active if self.slots[seq.slot] is seq and not seq.done]
            kept = {seq.slot for seq in self._active()}
            self._decode_alone(live, [n if s in kept else 0 for s, n in enumerate(before)])
            return
        self.steps_by_batch[B] += 1
        if len(active) < B:  # a row not busy: the step advanced it too; put it back
            self.cache.lengths[:B].copy_(lengths)
        self.cache.host_lengths[:B] = after
        rows = [seq.slot for seq in active]
        draws = self._sample(active, logits, rows)
        if self.async_scheduling and all(_deferrable(seq) for seq in active):
            last, self._ahead = self._ahead, self._stage_tokens(draws)
            if last is not None:
                self._finish_ahead(last)
        else:
            self._finish_ahead()
            self._finish(draws, self._to_host(draws))

    def _last_in_flight(self, seq: _Seq) -> bool:
        """Whether ``seq``'s token still on the device is its last (by max_tokens)."""
        return seq.ahead is not None and len(seq.generated) + 1 >= seq.req.max_tokens

    def _stage_step(self, active: list[_Seq], B: int,
                    after: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's B tokens and the rows' lengths after it, on the device, with one
        copy from pinned memory that waits behind the stream's work instead of syncing
        it: the host's tokens, then each row run ahead fed its token from the device."""
        ahead = [seq for seq in active if seq.ahead is not None]
        fed = [0] * B
        for seq in active:
            if seq.ahead is None:
                fed[seq.slot] = seq.token
        k = len(ahead)
        dev = to_device(fed + after + [seq.slot for seq in ahead]
                        + [seq.ahead[1] for seq in ahead], self.device)
        tokens, lengths = dev[:B], dev[B: 2 * B]
        if k:  # only one step runs ahead at a time: every such token is in its tensor
            tokens = tokens.index_put((dev[2 * B: 2 * B + k],),
                                      self._ahead.tokens[dev[2 * B + k: 2 * B + 2 * k]])
        return tokens, lengths

    def _stage_tokens(self, draws: list[_Draw]) -> _Ahead | None:
        """Start the copy of a step's drawn tokens to the host behind the step, and mark
        each sequence's token as still on the device."""
        if not draws:
            return None
        tokens = torch.cat([d.tokens for d in draws]) if len(draws) > 1 else draws[0].tokens
        host = torch.empty(tokens.numel(), dtype=tokens.dtype, pin_memory=tokens.is_cuda)
        host.copy_(tokens, non_blocking=True)
        event = None
        if tokens.is_cuda:
            event = torch.cuda.Event()
            event.record()
        ahead = _Ahead(draws, tokens, host, event)
        start = 0
        for d in draws:
            for seq, at in zip(d.seqs, d.at):
                seq.ahead = (ahead, start + at)
            start += d.tokens.numel()
        return ahead

    def _finish_ahead(self, ahead: _Ahead | None = None) -> None:
        """Read the tokens of a step run ahead (default: the one in flight, which is then
        none) and emit them; if the read fails, each draw is read alone (`_to_host`)."""
        if ahead is None:
            ahead, self._ahead = self._ahead, None
            if ahead is None:
                return
        for d in ahead.draws:
            for seq in d.seqs:
                if seq.ahead is not None and seq.ahead[0] is ahead:
                    seq.ahead = None

        def read():  # the copy staged behind the step, once it has run
            if ahead.event is not None:
                ahead.event.synchronize()
            return ahead.host.tolist()

        self._finish(ahead.draws, self._to_host(ahead.draws, read))

    def _paged_step(self) -> None:
        """One decode step over just the decoding rows of the paged cache; too few free
        pages (raised before anything changed) preempts the youngest sequence and tries
        again, until the rest fit (the oldest alone always does)."""
        while True:
            active = self._decoding()
            if not active:
                return
            rows = [seq.slot for seq in active]
            host = self.cache.host_lengths  # a copy per read: read once
            before = [host[s] for s in rows]
            ids = [seq.token for seq in active]
            if self.buckets == [self.max_batch] and self.deterministic:
                # one fixed batch: every slot at its own row; idle ones on scratch
                B = self.max_batch
                fed: list[int | None] = [None] * B
                fed_ids = [0] * B
                for seq in active:
                    fed[seq.slot], fed_ids[seq.slot] = seq.slot, seq.token
                at = rows
            else:  # packed at the front, rounded up to a bucket
                B = self.batch_for(len(rows)) if self._paged_decoders else len(rows)
                fed, at, fed_ids = rows, list(range(len(active))), ids
            fed_tokens = torch.tensor(fed_ids, device=self.device)  # the step's one copy
            try:
                with torch.no_grad():
                    if self._paged_decoders:
                        logits = self._paged_decoders[B](fed_tokens, fed)
                    else:
                        logits = self.model.decode(fed_tokens, self.cache.select(rows))
            except ModelFailed:
                raise
            except OutOfPages:
                self._preempt(self._youngest())
                continue
            except Exception:
                log.exception("qfuse serve: a decode step of %d rows failed; decoding each "
                              "sequence alone", len(rows))
                for s, n in zip(rows, before):  # the step may have taken their pages
                    self.cache.shrink(s, n)
                self._decode_alone_paged(active, torch.tensor(ids, device=self.device))
                return
            self.steps_by_batch[B] = self.steps_by_batch.get(B, 0) + 1
            self._advance(active, logits, at)
            return

    def _decode_alone_paged(self, active: list[_Seq], tokens: torch.Tensor) -> None:
        """After a failed paged step (rows put back): each sequence at batch 1."""
        self._each_alone(active, lambda i, seq: self.model.decode(
            tokens[i: i + 1], self.cache.select([seq.slot])))

    def _decode_alone(self, active: list[_Seq], before: list[int]) -> None:
        """After a failed step over rows 0..len(before)-1: put their lengths back to
        ``before`` (the step may have advanced some of them, in some layers), then
        decode each sequence at batch 1 and sample from the rows that succeeded."""
        B = len(before)
        view = self.cache.rows(0, B)
        view.host_lengths = before
        view.lengths.copy_(torch.tensor(before, dtype=view.lengths.dtype))
        self._each_alone(active, lambda i, seq: self.model.decode(
            torch.tensor([seq.token], device=self.device),
            self.cache.rows(seq.slot, seq.slot + 1)))

    def _each_alone(self, active: list[_Seq], decode_one) -> None:
        """``decode_one(i, seq)`` (its logits [1, V]) for each sequence of a failed step;
        a sequence that fails alone ends, the others sample from their rows."""
        done, rows = [], []
        for i, seq in enumerate(active):
            try:
                with torch.no_grad():
                    rows.append(decode_one(i, seq))
                done.append(seq)
            except ModelFailed:
                raise
            except Exception:  # noqa: BLE001 -- this row fails alone: it ends (logged)
                self._fail(seq, "its decode step")
        if done:
            self._advance(done, torch.cat(rows), list(range(len(done))))

    def _advance(self, seqs: list[_Seq], logits: torch.Tensor, rows: list[int]) -> None:
        """Sample each sequence's next token from its row of logits [B, V], emit it, and
        free the slot of each request that is done (`_sample`, then `_finish` with the
        tokens read at once)."""
        draws = self._sample(seqs, logits, rows)
        self._finish(draws, self._to_host(draws))

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor, rows: list[int]) -> list[_Draw]:
        """Draw each sequence's next token from its row of logits [B, V], on the device,
        without a sync (a cancelled request's slot is freed instead); `_finish` emits
        them once read, all a step's draws with one read. Each sequence samples with its
        own parameters. Plain
        greedy rows (no penalty, no logprobs) share one argmax, which picks the first
        maximum of each row whatever the batch, as the per-row path does. Rows without
        a seed or a penalty that share their parameters share one draw: every step of
        it is row by row, and they have no generator of their own to keep apart."""
        live = []
        for seq, row in zip(seqs, rows):
            if seq.req.cancelled:
                self._free(seq)
            else:
                live.append((seq, row))
        if not live:
            return []

        def argmax(group):
            if len(group) == 1:  # alone, after the shared argmax failed
                (seq, row), = group
                return _Draw([seq], [0], logits[row: row + 1].argmax(dim=-1), None)
            # One argmax over every row serves all plain greedy rows (idle rows cost
            # nothing worth a gather).
            return _Draw([seq for seq, _ in group], [row for _, row in group],
                         logits.argmax(dim=-1), None)

        def shared_draw(group):
            params = group[0][0].req.params
            rows = to_device([row for _, row in group], self.device)  # a list index syncs
            x = penalize(logits.index_select(0, rows), params, None)
            return _Draw([seq for seq, _ in group], list(range(len(group))),
                         sample(x, params, None, None), x)

        def own_draw(group):
            (seq, row), = group
            req = seq.req
            seen = None if seq.seen is None else seq.seen[None]
            x = penalize(logits[row: row + 1], req.params, seen)
            if seq.counts is not None:  # OpenAI's definition, on top of the repetition penalty
                x = x - req.frequency_penalty * seq.counts - req.presence_penalty * (seq.counts > 0)
            return _Draw([seq], [0], sample(x, req.params, None, seq.generator), x)

        greedy = [(seq, row) for seq, row in live if _plain_greedy(seq)]
        draws = self._draw(argmax, greedy) if greedy else []
        # A seeded or penalized row samples alone with its own state.
        shared: dict[SamplingParams, list[tuple[_Seq, int]]] = {}
        for seq, row in live:
            if _plain_greedy(seq):
                continue
            if seq.generator is None and seq.seen is None and seq.counts is None:
                shared.setdefault(seq.req.params, []).append((seq, row))
            else:
                draws += self._draw(own_draw, [(seq, row)])
        for group in shared.values():
            draws += self._draw(shared_draw, group)
        return draws

    def _finish(self, draws: list[_Draw], tokens: list[list[int] | None]) -> None:
        """Emit each draw's ``tokens`` (host ints; None: they could not be read, and its
        sequences end) to its sequences, but to none that ended or was cancelled since
        the draw (a step run ahead: `_step`)."""
        added = 0
        for draw, values in zip(draws, tokens):
            for i, seq in enumerate(draw.seqs):
                if seq.done:
                    continue
                if seq.req.cancelled:
                    self._free(seq)
                    continue
                if values is None:
                    self._end(seq, Event("", finish_reason="error"))
                    continue
                had = len(seq.generated)
                try:
                    self._emit(seq, None if draw.x is None else draw.x[i: i + 1],
                               values[draw.at[i]])
                except Exception:  # noqa: BLE001 -- logprobs, detokenizing, stop strings, emit
                    self._fail(seq, "emitting its token")
                added += len(seq.generated) - had
        # Counted once a step, not under the lock once a token (stats() reads it there).
        with self._cv:
            self.tokens_total += added

    def _draw(self, how, group: list[tuple[_Seq, int]]) -> list[_Draw]:
        """``how(group)`` as one draw; if it fails, each (seq, row) of the group draws
        alone, and a sequence whose own draw fails ends."""
        try:
            return [how(group)]
        except Exception:  # whatever the draw raised, one request's fault at most
            if len(group) == 1:
                self._fail(group[0][0], "sampling")
                return []
            log.exception("qfuse serve: a draw for %d rows failed; drawing each alone",
                          len(group))
        return [d for one in group for d in self._draw(how, [one])]

    def _to_host(self, draws: list[_Draw], read=None) -> list[list[int] | None]:
        """Each draw's tokens on the host: one read for all (``read()``: the draws'
        tokens concatenated, as host ints; default: concatenate them and read, one sync);
        if that fails, one read per draw, and a draw that still fails is None (its
        sequences end, `_finish`)."""
        if not draws:
            return []
        try:
            began = time.perf_counter()
            tokens = read() if read is not None else \
                torch.cat([d.tokens for d in draws]).tolist()  # the step's one host sync
            self.token_wait_s += time.perf_counter() - began
        except Exception:  # find the draw at fault
            log.exception("qfuse serve: reading a step's tokens failed; reading each draw alone")
            out = []
            for d in draws:
                try:
                    out.append(d.tokens.tolist())
                except Exception:
                    log.exception("qfuse serve: the tokens of %d requests could not be read; "
                                  "they end", len(d.seqs))
                    out.append(None)
            return out
        out, start = [], 0
        for d in draws:
            out.append(tokens[start: start + d.tokens.numel()])
            start += d.tokens.numel()
        return out

    def _emit(self, seq: _Seq, x: torch.Tensor | None, token: int) -> None:
        """Emit ``seq``'s sampled ``token`` (drawn from penalized logits x [1, V]; None
        for a plain greedy pick, which has no logprobs to report) and free the slot
        when the request is done."""
        req = seq.req
        event = Event("")
        if req.logprobs is not None:
            lp = torch.log_softmax(x[0], -1)
            if req.logprobs:
                k = min(req.logprobs, self.vocab)
                top = torch.topk(lp, k)
                # One host read for the token's logprob and the top k, not three (float64
                # holds each float32 value and each token id exactly).
                got = torch.cat([lp[token: token + 1].double(), top.values.double(),
                                 top.indices.double()]).tolist()
                event.top = list(zip(map(int, got[1 + k:]), got[1: 1 + k]))
                event.logprob = got[0]
            else:
                event.logprob = float(lp[token])
        if token in self.eos or token in req.stop_token_ids:
            event.finish_reason = "stop"
        else:
            event.token = token
            seq.token = token
            seq.generated.append(token)
            req.completion_tokens += 1
            if seq.seen is not None:
                seq.seen[token] = True
            if seq.counts is not None:
                seq.counts[token] += 1
            if seq.detokenized.add(token):  # else a multi-byte character is incomplete
                seq.text, hit = cut_at_stop(seq.detokenized.text, req.stop)
                if hit:
                    event.finish_reason = "stop"
            if event.finish_reason is None and len(seq.generated) >= req.max_tokens:
                event.finish_reason = "length"
        upto = len(seq.text) if event.finish_reason \
            else max(seq.emitted, len(seq.text) - seq.hold)
        event.text = seq.text[seq.emitted: upto]
        seq.emitted = upto
        if event.finish_reason:
            self._end(seq, event)
        else:
            req.emit(event)


def _tell(req: Request, event: Event) -> None:
    """``req.emit(event)`` for a last event, which nothing may stop: an emit that fails
    is logged (its client, if still there, is beyond reach)."""
    try:
        req.emit(event)
    except Exception:
        log.exception("qfuse serve: a request's last event could not be sent")
