"""The serving engine's decode steps over the slotted KV cache.

A step decodes the cache's first B rows, B the bucket of the highest busy slot (`buckets`;
deterministic: its own buckets), eagerly or replayed from the bucket's CUDA graph, all
captured when the runner is made (``on_graph(bucket, seconds)`` after each). Idle rows
decode token 0 at length 0, a prefilling one token 0 after its chunks so far (a write at
its next position, which its next chunk overwrites); both get their lengths back.

Async scheduling (``async_scheduling``): when every row of a step is `deferrable`, its
tokens stay on the device while the next step is launched (fed from there), and are read
and emitted while that one runs (`Ahead`, `finish_ahead`); otherwise they are read at once.
A row whose sequence that emission ends was computed for nothing and is dropped; a
sequence whose token in flight is its max_tokens-th takes no further step.

A step that fails blames no row: lengths are put back and each sequence decodes alone at
batch 1 (`Emission.advance_each`); `ModelFailed` propagates. docs/serving.md has the why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..runtime.cache import KVCache
from ..runtime.host_copies import to_device
from ..runtime.slotted_graphs import GraphedDecode
from .buckets import batch_for
from .emission import Emission
from .requests import ModelFailed, Seq
from .sampler import Draw, Sampler, deferrable
from .scheduler import Scheduler

log = logging.getLogger("qfuse")


@dataclass
class Ahead:
    """A decode step's draws whose tokens the host has not read yet (async scheduling): all of
    them in one device tensor, copied to ``host`` (pinned) behind the step, ``event``
    recorded after the copy; `SlottedSteps.finish_ahead` waits for it and emits them."""
    draws: list[Draw]
    tokens: torch.Tensor  # the draws' tokens, concatenated, on the device
    host: torch.Tensor
    event: torch.cuda.Event | None  # None on a CPU, where the copy has already happened


class SlottedSteps:
    """Decode steps over ``cache``'s first rows, one callable per bucket in ``decoders``
    (``decoders[B](tokens [B]) -> logits [B, V]``); ``steps_by_batch`` counts the steps
    run per bucket; ``ahead``: the step whose tokens the host has yet to read."""

    def __init__(self, model, cache: KVCache, *, buckets: list[int], max_batch: int,
                 cuda_graph: bool, on_graph: Callable[[int, float], None] | None,
                 async_scheduling: bool, steps_by_batch: dict[int, int],
                 scheduler: Scheduler, sampler: Sampler, emission: Emission):
        self.model, self.cache, self.buckets = model, cache, buckets
        self.device = model.model.norm.weight.device
        self.async_scheduling, self.steps_by_batch = async_scheduling, steps_by_batch
        self.scheduler, self.sampler, self.emission = scheduler, sampler, emission
        self.ahead: Ahead | None = None
        self.decoders: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}
        for b in buckets:
            view = cache if b == max_batch else cache.rows(0, b)
            # Captured now, while every slot is idle: a graph made mid-serving would stall
            # the streams for its warm-up and capture.
            if cuda_graph:
                began = time.perf_counter()
                self.decoders[b] = GraphedDecode(model, view, b)
                if on_graph is not None:
                    on_graph(b, time.perf_counter() - began)
            else:
                self.decoders[b] = lambda tokens, view=view: model.decode(tokens, view)

    def step(self) -> None:
        """One decode step over the bucket of the decoding sequences' rows (those whose
        token in flight is their last take none); with async scheduling its tokens may
        stay in flight, else they are read and emitted, after the step run ahead."""
        active = [seq for seq in self.scheduler.decoding()
                  if seq.ahead is None or not self._last_in_flight(seq)]
        if not active:
            self.finish_ahead()
            return
        rows = [seq.slot for seq in active]
        B = batch_for(self.buckets, max(rows) + 1)
        before = self.cache.host_lengths[:B]  # a copy of the host's list: no device sync
        # The step advances every row: only the busy ones keep their new entry (idle rows
        # stay empty, never full; a prefilling one keeps its chunks so far).
        after = before.copy()
        for s in rows:
            after[s] += 1
        tokens, lengths = self.stage_step(active, B, after)
        try:
            with torch.no_grad():
                logits = self.decoders[B](tokens)
        except ModelFailed:
            raise
        except Exception:
            log.exception("qfuse serve: a decode step of %d rows failed; decoding each "
                          "sequence alone", B)
            self.finish_ahead()  # each row's last token on the host; some may end there
            live = [seq for seq in active
                    if self.scheduler.slots[seq.slot] is seq and not seq.done]
            kept = {seq.slot for seq in self.scheduler.active()}
            self._decode_alone(live, [n if s in kept else 0 for s, n in enumerate(before)])
            return
        self.steps_by_batch[B] += 1
        if len(active) < B:  # a row not busy: the step advanced it too; put it back
            self.cache.lengths[:B].copy_(lengths)
        self.cache.host_lengths[:B] = after
        draws = self.sampler.sample(active, logits, rows)
        if self.async_scheduling and all(deferrable(seq) for seq in active):
            last, self.ahead = self.ahead, self.stage_tokens(draws)
            if last is not None:
                self.finish_ahead(last)
        else:
            self.finish_ahead()
            self.emission.finish(draws, self.sampler.read(draws))

    def _last_in_flight(self, seq: Seq) -> bool:
        """Whether ``seq``'s token still on the device is its last (by max_tokens)."""
        return seq.ahead is not None and len(seq.generated) + 1 >= seq.req.max_tokens

    def stage_step(self, active: list[Seq], B: int,
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
                                      self.ahead.tokens[dev[2 * B + k: 2 * B + 2 * k]])
        return tokens, lengths

    def stage_tokens(self, draws: list[Draw]) -> Ahead | None:
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
        ahead = Ahead(draws, tokens, host, event)
        start = 0
        for d in draws:
            for seq, at in zip(d.seqs, d.at):
                seq.ahead = (ahead, start + at)
            start += d.tokens.numel()
        return ahead

    def finish_ahead(self, ahead: Ahead | None = None) -> None:
        """Read the tokens of a step run ahead (default: the one in flight, which is then
        none) and emit them; if the read fails, each draw is read alone (`Sampler.read`)."""
        if ahead is None:
            ahead, self.ahead = self.ahead, None
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

        self.emission.finish(ahead.draws, self.sampler.read(ahead.draws, read))

    def drop_ahead(self) -> None:
        """Forget the step in flight (the loop failed: its sequences are ended)."""
        self.ahead = None

    def _decode_alone(self, active: list[Seq], before: list[int]) -> None:
        """After a failed step over rows 0..len(before)-1: put their lengths back to
        ``before`` (the step may have advanced some of them, in some layers), then
        decode each sequence at batch 1 and sample from the rows that succeeded."""
        B = len(before)
        view = self.cache.rows(0, B)
        view.host_lengths = before
        view.lengths.copy_(torch.tensor(before, dtype=view.lengths.dtype))
        self.emission.advance_each(active, lambda i, seq: self.model.decode(
            torch.tensor([seq.token], device=self.device),
            self.cache.rows(seq.slot, seq.slot + 1)))
