"""The serving engine's prefill: prompts into their slots' cache, and each one's first token.

`Prefill.batch(seqs)`: prompts admitted together into adjacent slots, as one right-padded
batch straight into a view of those slots; a prompt alone that fits one of the ``fixed``
prefills (slotted; `runtime.prefill_graphs`, a CUDA graph per length) goes through the
shortest that holds it, right-padded to its length. `Prefill.chunks(seqs)`: the next
chunk of each prompt under way (paged: several chunks starting at the same position share
one call), attending to the chunks before it through the cache (`Decoder.forward(...,
past=)`); only a prompt's last chunk computes logits. Each last piece samples the
sequence's first token (`Emission.advance`) once its sampling state is made
(`Sampler.start`).

Failures: a batched call that fails blames no row, and each prompt (chunk) runs again
alone; one that fails alone ends that request (`Scheduler.fail`). Too few free pages
(`OutOfPages`, raised before anything changed) preempts the sequence. `ModelFailed`
propagates to the engine's loop. A chunk of a cancelled or ended sequence is skipped.
"""

from __future__ import annotations

import logging

import torch

from ..runtime.paged_cache import OutOfPages
from ..runtime.prefill_graphs import PaddedPrefill, fitting
from ..runtime.prefix_cache import PrefixCache
from ..runtime.prompts import pad_prompts
from .emission import Emission
from .requests import ModelFailed, Seq
from .sampler import Sampler
from .scheduler import Scheduler

log = logging.getLogger("qfuse")


class Prefill:
    """Prefills ``model``'s prompts into ``cache`` (slotted, or ``paged``); a ``prefix``
    cache registers each prefilled prompt's full pages. ``fixed``: fixed-length prefills
    of a slotted cache by length (`PaddedPrefill` or `GraphedPrefill`), for prompts
    prefilled alone."""

    def __init__(self, model, cache, *, device: torch.device, paged: bool,
                 prefix: PrefixCache | None, scheduler: Scheduler, sampler: Sampler,
                 emission: Emission, fixed: dict[int, PaddedPrefill] | None = None):
        self.model, self.cache, self.device, self.paged = model, cache, device, paged
        self.prefix, self.fixed = prefix, fixed or {}
        self.fixed_runs = 0  # prompts prefilled through a fixed-length prefill
        self.scheduler, self.sampler, self.emission = scheduler, sampler, emission

    def batch(self, seqs: list[Seq]) -> None:
        """Prefill ``seqs`` (in adjacent slots) as one right-padded batch, straight into a
        view of their slots, and sample each one's first token. If the batch fails,
        each is prefilled alone (a failure cannot be blamed on one row of a batch)."""
        first, n = seqs[0].slot, len(seqs)
        fixed = fitting(self.fixed, len(seqs[0].req.ids)) if n == 1 else None
        try:
            if fixed is not None:
                logits = fixed(seqs[0].req.ids, first)
                self.fixed_runs += 1
            else:
                ids, lengths = pad_prompts([seq.req.ids for seq in seqs], self.device)
                view = self.cache.select([seq.slot for seq in seqs]) if self.paged \
                    else self.cache.rows(first, first + n)
                with torch.no_grad():
                    logits = self.model(ids, lengths, view, logits="last")
        except ModelFailed:
            raise
        except OutOfPages:  # taken before anything ran: each tries alone, or waits
            if n == 1:
                self.scheduler.preempt(seqs[0])
                return
            for seq in seqs:
                self.batch([seq])
            return
        except Exception:
            if n == 1:
                self.scheduler.fail(seqs[0], "the prefill")
                return
            log.exception("qfuse serve: a prefill of %d prompts failed; prefilling each alone", n)
            for seq in seqs:
                self.batch([seq])
            return
        for seq in seqs:
            seq.prefilled = len(seq.req.ids)
            if self.prefix is not None:
                self.prefix.register(seq.slot, seq.feed, seq.prefilled)
        self.first_tokens(seqs, logits, [seq.slot - first for seq in seqs])

    def chunks(self, seqs: list[Seq]) -> None:
        """Prefill the next chunk of each of ``seqs`` (paged, all starting at the same
        position) in one right-padded call over their rows (`PagedKVCache.select`); each
        last chunk samples its first token. If the call fails, each chunk runs alone
        (`chunk`: a failure cannot be blamed on one row of a batch).

        Each row's queries attend to its own cached keys and chunk alone (the prompt
        mask), so a row gets the tensors it gets alone up to the rounding of products over
        more rows. Deterministic, the rows also have the shapes they have alone (equal
        chunks, no padding) and the call's token rows take the GPU's product kernel that
        one chunk's take, row-invariant ones (`Decoder.product_kernels`;
        `Scheduler.chunk_groups`): an output row summed in an order that does not depend
        on the number of rows. Where the model names none (a CPU, cuBLAS's prefill rows
        past 256, dense weights), each chunk runs alone."""
        live = [seq for seq in seqs if not (seq.req.cancelled or seq.done)]
        if len(live) <= 1:
            for seq in live:
                self.chunk(seq)
            return
        start = live[0].prefilled
        stops = [self.scheduler.next_chunk(seq)[1] for seq in live]
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
                self.chunk(seq)
            return
        for seq, stop in zip(live, stops):
            seq.prefilled = stop
            if self.prefix is not None:  # before the next growth, as `chunk`'s
                self.prefix.register(seq.slot, seq.feed, stop, since=start)
        rows = [i for i, last in enumerate(lasts) if last]
        if rows:
            self.first_tokens([live[i] for i in rows], logits, rows)

    def chunk(self, seq: Seq, stop: int | None = None) -> None:
        """Prefill ``seq``'s next chunk (up to prompt position ``stop``, default its chunk
        boundary) into its slot, after the ones its cache holds; the last chunk samples
        its first token. A chunk that fails ends ``seq`` alone."""
        if seq.req.cancelled or seq.done:
            return  # its slot is freed after this loop's prefill
        start, boundary = self.scheduler.next_chunk(seq)
        stop = boundary if stop is None else stop
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
            self.scheduler.preempt(seq)
            return
        except Exception:  # noqa: BLE001 -- this request's chunk alone: it ends (logged)
            self.scheduler.fail(seq, "a prefill chunk")
            return
        seq.prefilled = stop
        if self.prefix is not None:  # now: the next growth may drop a sliding layer's pages
            self.prefix.register(seq.slot, seq.feed, stop, since=start)
        if last:
            self.first_tokens([seq], logits, [0])

    def first_tokens(self, seqs: list[Seq], logits: torch.Tensor, rows: list[int]) -> None:
        """Make each prefilled sequence's sampling state and sample its first token from
        its row of ``logits``; a sequence whose state cannot be made ends alone."""
        started = self.started(seqs)
        self.emission.advance([seqs[i] for i in started], logits, [rows[i] for i in started])

    def started(self, seqs: list[Seq]) -> list[int]:
        """Make each prefilled sequence's sampling state; the indices of those made (a
        sequence whose state cannot be made ends alone)."""
        made = []
        for i, seq in enumerate(seqs):
            try:
                self.sampler.start(seq)
                made.append(i)
            except Exception:  # noqa: BLE001 -- e.g. a seed torch cannot take: it ends (logged)
                self.scheduler.fail(seq, "making its sampling state")
        return made
