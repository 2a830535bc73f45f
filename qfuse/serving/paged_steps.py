"""The serving engine's decode steps over the paged KV cache.

By default a step runs over just the decoding rows (`PagedKVCache.select`): no dummy rows,
which would take pages. With CUDA graphs, or deterministic, a step runs those rows packed
at the front of a bucket's fixed batch over fixed inputs prepared before each replay
(`paged_graphs`, the pages taken on the host first), replayed from the bucket's graph
(captured when the runner is made) or run eagerly; where max_batch is the deterministic
engine's one bucket, every slot at its own row of it. Idle rows decode on the cache's
scratch page, which no sequence holds.

A step that finds too few free pages (`OutOfPages`, raised before anything changed)
preempts the youngest sequence (`Scheduler.preempt`) and runs again, until the rest fit:
the oldest alone always does. A step that fails otherwise gives the pages it took back and
each sequence decodes alone (`Emission.advance_each`). Nothing runs ahead of the host:
a paged step takes its pages there.

Mixed steps (`mixed_step`, `Engine(mixed_steps=True)`): while prompts are under way, one
forward (`Decoder.mixed`) runs every decoding sequence's next token and the step's
prefill pieces (`Scheduler.pieces`: within a token budget, oldest prompt first) as one
flat token batch, so a long prompt never holds up the decodes in flight; a step with no
piece is the decode step above (CUDA graphs and all). Too few free pages preempts the
youngest sequence and plans again; a mixed step that fails otherwise gives the pages back
and runs each piece alone (`Prefill.chunk`), then each decode row alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ..runtime.paged_cache import OutOfPages, PagedKVCache
from ..runtime.paged_graphs import GraphedPagedDecode, PagedStepInputs
from .buckets import batch_for
from .emission import Emission
from .prefill import Prefill
from .requests import ModelFailed, Seq
from .scheduler import Scheduler

log = logging.getLogger("qfuse")


class PagedSteps:
    """Decode steps over ``cache``; with ``fixed`` (CUDA graphs or deterministic), one
    ``decoders[B](tokens, rows)`` per bucket over fixed inputs, else none (each step
    selects its rows); ``steps_by_batch`` counts the steps run per batch size."""

    ahead = None  # never a step in flight

    def __init__(self, model, cache: PagedKVCache, *, buckets: list[int], max_batch: int,
                 deterministic: bool, fixed: bool, cuda_graph: bool,
                 on_graph: Callable[[int, float], None] | None,
                 steps_by_batch: dict[int, int], scheduler: Scheduler, emission: Emission,
                 prefill: Prefill | None = None):
        self.model, self.cache, self.buckets = model, cache, buckets
        self.prefill = prefill  # mixed steps: first tokens, and pieces run alone
        self.mixed_runs = 0  # mixed steps run (the decode steps: steps_by_batch)
        self.max_batch, self.deterministic = max_batch, deterministic
        self.device = model.model.norm.weight.device
        self.steps_by_batch, self.scheduler, self.emission = steps_by_batch, scheduler, emission
        self.decoders: dict[int, Callable] = {}
        if fixed:
            for b in buckets:
                if cuda_graph:  # captured now, while idle, as the slotted graphs are
                    began = time.perf_counter()
                    self.decoders[b] = GraphedPagedDecode(model, cache, b)
                    if on_graph is not None:
                        on_graph(b, time.perf_counter() - began)
                else:
                    inputs = PagedStepInputs(cache, b)
                    self.decoders[b] = (
                        lambda tokens, rows, inputs=inputs: inputs.step(model, tokens, rows))

    def step(self) -> None:
        """One decode step over just the decoding rows; too few free pages (raised before
        anything changed) preempts the youngest sequence and tries again, until the rest
        fit (the oldest alone always does)."""
        while True:
            active = self.scheduler.decoding()
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
                B = batch_for(self.buckets, len(rows)) if self.decoders else len(rows)
                fed, at, fed_ids = rows, list(range(len(active))), ids
            fed_tokens = torch.tensor(fed_ids, device=self.device)  # the step's one copy
            try:
                with torch.no_grad():
                    if self.decoders:
                        logits = self.decoders[B](fed_tokens, fed)
                    else:
                        logits = self.model.decode(fed_tokens, self.cache.select(rows))
            except ModelFailed:
                raise
            except OutOfPages:
                self.scheduler.preempt(self.scheduler.youngest())
                continue
            except Exception:
                log.exception("qfuse serve: a decode step of %d rows failed; decoding each "
                              "sequence alone", len(rows))
                for s, n in zip(rows, before):  # the step may have taken their pages
                    self.cache.shrink(s, n)
                self._decode_alone(active, torch.tensor(ids, device=self.device))
                return
            self.steps_by_batch[B] = self.steps_by_batch.get(B, 0) + 1
            self.emission.advance(active, logits, at)
            return

    def mixed_step(self, budget: int) -> None:
        """One step of at most ``budget`` tokens: every decoding sequence's next token and
        the prefill pieces the rest of the budget holds (`Scheduler.pieces`), in one
        forward; with no piece, the decode step (`step`). Each piece that ends its prompt
        samples the first token (a resumed sequence's never)."""
        while True:
            active = self.scheduler.decoding()
            pieces = self.scheduler.pieces(budget)
            if not pieces:
                if active:
                    self.step()
                return
            D = len(active)
            rows = [seq.slot for seq in active] + [seq.slot for seq, _ in pieces]
            host = self.cache.host_lengths  # a copy per read: read once
            before = [host[s] for s in rows]
            ids = [seq.token for seq in active]
            chunks, logits_at, lasts = [], list(range(D)), []
            for seq, stop in pieces:
                ids += seq.feed[seq.prefilled:stop]
                chunks.append(stop - seq.prefilled)
                lasts.append(stop == len(seq.feed) and not seq.resumed)
                if lasts[-1]:
                    logits_at.append(len(ids) - 1)
            try:
                with torch.no_grad():
                    logits = self.model.mixed(torch.tensor(ids, device=self.device),
                                              self.cache.select(rows), D, chunks, logits_at)
            except ModelFailed:
                raise
            except OutOfPages:  # taken before anything ran
                self.scheduler.preempt(self.scheduler.youngest())
                continue
            except Exception:
                log.exception("qfuse serve: a mixed step of %d decode rows and %d prefill "
                              "pieces failed; running each alone", D, len(pieces))
                for s, n in zip(rows, before):  # the step took every row's pages
                    self.cache.shrink(s, n)
                for seq, stop in pieces:
                    self.prefill.chunk(seq, stop)
                live = [seq for seq in active if self.scheduler.slots[seq.slot] is seq]
                if live:
                    self._decode_alone(live, torch.tensor([seq.token for seq in live],
                                                          device=self.device))
                return
            self.mixed_runs += 1
            firsts = []
            for (seq, stop), last in zip(pieces, lasts):
                start, seq.prefilled = seq.prefilled, stop
                if self.scheduler.prefix is not None:  # before the next growth
                    self.scheduler.prefix.register(seq.slot, seq.feed, stop, since=start)
                if last:
                    firsts.append(seq)
            started = self.prefill.started(firsts)
            if active or started:  # logits' rows: the decode rows', then each first token's
                self.emission.advance(active + [firsts[i] for i in started], logits,
                                      list(range(D)) + [D + i for i in started])
            return

    def finish_ahead(self) -> None:
        """Nothing to read: no paged step runs ahead of the host."""

    def drop_ahead(self) -> None:
        """Nothing to forget: no paged step runs ahead of the host."""

    def _decode_alone(self, active: list[Seq], tokens: torch.Tensor) -> None:
        """After a failed step (rows put back): each sequence at batch 1."""
        self.emission.advance_each(active, lambda i, seq: self.model.decode(
            tokens[i: i + 1], self.cache.select([seq.slot])))
