"""The serving engine's scheduler: who holds a slot, who waits, and what each loop prefills.

It owns the slots (a `Seq` each, or None), the queue of waiting requests and the queue of
preempted sequences (oldest admission first, ahead of the waiting). Each loop `admit`
plans the prefill: the next chunk of each prompt under way (oldest first), then waiting
requests moved into the lowest free slots (first come, first served) as batches of
adjacent slots or as chunked prompts, within ``max_prefill_tokens`` padded tokens (the
first piece always runs). Paged, a request is admitted only while its prompt plus a page
of decode room fits the free pages (`fits`); `preempt` sends a sequence back to the head
of the queue when pages run out. `chunk_groups` plans which chunks share one prefill call.
Chunk boundaries depend on the prompt alone, never on the load.

A sequence ends through `end` (its slot freed, its last event sent) or `fail` (the same
with an error event, its traceback logged). The engine's lock guards the slots and the
queues where another thread reads them; docs/serving.md explains the policies.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from ..runtime.detokenize import IncrementalText
from ..runtime.prefix_cache import Hit, PrefixCache
from ..runtime.prompts import stop_hold
from .buckets import product_kernels
from .requests import Event, Request, Seq, tell

log = logging.getLogger("qfuse")

# Mixed steps: the prompt tokens a step runs at least while prompts are under way, however
# many decode rows take its budget (a full batch would starve them), as a piece's floor.
MIN_PIECE = 16


class Scheduler:
    """The slots and queues of one engine over ``cache`` (slotted or paged: ``paged``),
    guarded by ``lock`` (the engine's condition) where other threads read them."""

    def __init__(self, model, tokenizer, cache, *, lock: threading.Condition, paged: bool,
                 prefix: PrefixCache | None, max_batch: int, context: int,
                 max_prefill_tokens: int, prefill_chunk: int, deterministic: bool,
                 mixed: bool = False):
        self.model, self.tokenizer, self.cache, self.lock = model, tokenizer, cache, lock
        self.paged, self.prefix = paged, prefix
        self.max_batch, self.context = max_batch, context
        self.max_prefill_tokens, self.prefill_chunk = max_prefill_tokens, prefill_chunk
        self.deterministic = deterministic
        # Mixed steps: `admit` only fills slots; each step's `pieces` say what it prefills.
        self.mixed = mixed
        self.slots: list[Seq | None] = [None] * max_batch
        self.waiting: deque[Request] = deque()
        self.preempted: deque[Seq] = deque()  # oldest admission first; before `waiting`
        self.preemptions = 0
        self.admissions = 0  # requests admitted so far: each Seq's `admitted`
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up, and found
        self._kernels_by_rows: dict[int, tuple[str, ...] | None] = {}  # `_same_invariant_kernel`
        self._singles: dict[int, str] = {}  # one token's text, for every `IncrementalText`

    # ---- who is where ----

    def active(self) -> list[Seq]:
        """The sequences in slots: prefilling or decoding."""
        return [s for s in self.slots if s is not None]

    def decoding(self) -> list[Seq]:
        """The sequences whose whole prompt is in the cache: the decode step's."""
        return [s for s in self.slots if s is not None and s.prefilled == len(s.feed)]

    def prefilling(self) -> list[Seq]:
        """The sequences whose prompt is between chunks, oldest admission first."""
        under_way = [s for s in self.slots if s is not None and s.prefilled < len(s.feed)]
        return sorted(under_way, key=lambda seq: seq.admitted)

    def youngest(self) -> Seq:
        return max(self.active(), key=lambda seq: seq.admitted)

    def take_all(self) -> tuple[list[Request], list[Seq]]:
        """Empty both queues (under the lock): the requests waiting, the sequences
        preempted."""
        with self.lock:
            waiting, preempted = list(self.waiting), list(self.preempted)
            self.waiting.clear()
            self.preempted.clear()
        return waiting, preempted

    # ---- chunks ----

    def chunked(self, req: Request) -> bool:
        """Whether ``req``'s prompt is prefilled in chunks (by its length alone)."""
        return 0 < self.prefill_chunk < len(req.ids)

    def next_chunk(self, seq: Seq) -> tuple[int, int]:
        """The prompt positions [start, stop) of ``seq``'s next chunk: up to the next
        multiple of prefill_chunk, so that a cached prefix moves no boundary."""
        return seq.prefilled, self.chunk_stop(seq.prefilled, len(seq.feed))

    def chunk_stop(self, start: int, n: int) -> int:
        chunk = self.prefill_chunk or n
        return min((start // chunk + 1) * chunk, n)

    # ---- leaving a slot ----

    def free(self, seq: Seq) -> None:
        """Empty ``seq``'s slot (a paged cache: give its pages back), then give it back
        (an idle slot always has length 0)."""
        if self.slots[seq.slot] is not seq:
            return  # waiting to resume (preempted): it holds neither slot nor pages
        if self.paged:
            self.cache.release(seq.slot)
        else:
            self.cache.lengths[seq.slot] = 0
            self.cache.host_lengths[seq.slot] = 0
        with self.lock:
            self.slots[seq.slot] = None

    def end(self, seq: Seq, event: Event) -> None:
        """Free ``seq``'s slot and send its last ``event``, unless it had one already."""
        if seq.done:
            return
        seq.done = True
        self.free(seq)
        tell(seq.req, event)

    def fail(self, seq: Seq, what: str) -> None:
        """End ``seq`` alone after ``what`` failed for it (called in the except block:
        the log gets the traceback); its client gets an error event."""
        log.exception("qfuse serve: %s failed for one request; it ends, the others go on",
                      what)
        self.end(seq, Event("", finish_reason="error"))

    def free_cancelled(self) -> None:
        for seq in self.active():
            if seq.req.cancelled:
                self.free(seq)

    def preempt(self, seq: Seq) -> None:
        """Out of pages: ``seq`` gives its slot and pages back and waits at the head of
        the queue (oldest admission first) to be prefilled again from what its cache
        held, keeping its sampling state and what it has streamed."""
        log.info("qfuse serve: out of KV pages; a sequence of %d tokens waits to resume",
                 self.cache.host_lengths[seq.slot])
        self.free(seq)
        if seq.generated:  # its cache held the prompt and all its tokens but the last
            seq.feed, seq.resumed = seq.req.ids + seq.generated[:-1], True
        seq.prefilled = 0
        with self.lock:
            self.preemptions += 1
            self.preempted.append(seq)
            self.preempted = deque(sorted(self.preempted, key=lambda q: q.admitted))

    # ---- admission ----

    def fits(self, seq_or_req, hit: Hit | None = None) -> bool:
        """Paged: whether a new row for this request (its feed) plus a page of decode room
        fits the free pages left once the prompts in slots take the rest of theirs; a
        prefix cache's ``hit`` brings pages it need not take (and takes cached ones out
        of the free count)."""
        ids = seq_or_req.feed if isinstance(seq_or_req, Seq) else seq_or_req.ids
        n = min(len(ids) + self.cache.page_size, self.context)
        need = self.cache.pages_needed(n)
        taken = dict.fromkeys(need, 0)
        for w, pages in (hit.pages if hit is not None else {}).items():
            need[w] = max(0, need[w] - len(pages))
            allocator = self.cache.groups[w].allocator
            taken[w] = sum(allocator.is_cached(p) for p in pages.values())
        owed = dict.fromkeys(need, 0)
        for seq in self.active():
            if seq.prefilled < len(seq.feed):
                full = self.cache.pages_needed(len(seq.feed))
                for w, g in self.cache.groups.items():
                    held = sum(p >= 0 for p in g.rows[seq.slot])
                    owed[w] += max(0, full[w] - held)
        return all(need[w] + owed[w] <= g.allocator.free_pages - taken[w]
                   for w, g in self.cache.groups.items())

    def admit(self) -> tuple[list[Seq], list[list[Seq]]]:
        """Plan this loop's prefill (under the lock): the next chunk of each prompt under
        way (oldest first), then waiting requests moved into the lowest free slots, a
        long prompt to prefill in chunks (its first one now) and the others as batches:
        runs of adjacent slots, or one request each when deterministic. Stops before the
        piece that would take the padded tokens past max_prefill_tokens, unless it is
        the first. Returns (the sequences whose next chunk runs, the batches).

        Mixed steps: every request that fits a free slot and the pages moves in, as a
        prompt to prefill in pieces (`pieces`); nothing runs here: returns ([], [])."""
        chunks: list[Seq] = []
        batches: list[list[Seq]] = []
        spent = 0
        for seq in [] if self.mixed else self.prefilling():
            if seq.req.cancelled:  # freed after this loop's prefill, unprefilled
                continue
            start, stop = self.next_chunk(seq)
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
            if self.paged and not self.fits(back or req, hit):
                break  # it and everything behind it wait for pages, in order
            # A preempted sequence is prefilled alone, as a long prompt is (no first token),
            # and so is one after a cached prefix (a chunk after cached tokens).
            chunked = self.mixed or back is not None or self.chunked(req) or hit.tokens > 0
            last = batches[-1] if batches else None
            joins = (not chunked and last is not None and last[-1].slot == s - 1
                     and not self.deterministic)
            cost = self.chunk_stop(hit.tokens, len(feed)) - hit.tokens if chunked \
                else len(feed)
            if joins:  # the batch's padded tokens (rows x longest prompt) grow by cost
                longest = max(len(seq.req.ids) for seq in last)
                cost = (len(last) + 1) * max(longest, cost) - len(last) * longest
            if (batches or chunks) and spent + cost > self.max_prefill_tokens \
                    and not self.mixed:
                break
            if back is not None:
                self.preempted.popleft()
                self.slots[s] = seq = back
                seq.slot = s
            else:
                self.waiting.popleft()
                self.slots[s] = seq = Seq(req, s, admitted=self.admissions, feed=req.ids,
                                          detokenized=IncrementalText(self.tokenizer,
                                                                      self._singles),
                                          hold=stop_hold(req.stop))
                self.admissions += 1
                if self.prefix is not None:  # as vLLM counts: new requests, in tokens
                    self.prefix_queries += len(feed)
                    self.prefix_hits += hit.tokens
            if hit.tokens:  # the row starts with the cached prefix's pages, shared
                try:
                    self.cache.attach(s, hit.tokens, hit.pages)
                    seq.prefilled = hit.tokens
                except ValueError:  # refused before anything changed: prefill it all
                    # (a raise here would fail every request in the slots: the engine's loop)
                    log.exception("qfuse serve: a cached prefix could not be attached; "
                                  "the prompt is prefilled whole")
            if chunked:
                if not self.mixed:  # mixed: its pieces run in the steps (`pieces`)
                    chunks.append(seq)
            elif joins:
                last.append(seq)
            else:
                batches.append([seq])
            spent += cost
        return chunks, batches

    def pieces(self, budget: int) -> list[tuple[Seq, int]]:
        """Mixed steps: what this step prefills beside the decode rows, (sequence, stop)
        each, from its `prefilled` on: the prompts under way oldest first, each up to its
        next chunk boundary (`next_chunk`), within ``budget`` tokens less one per decoding
        sequence, but MIN_PIECE at least (the last piece cut to fit; a cut chunk's rest
        comes next step, up to the same boundary). A step thus runs at most max(budget,
        decoding + MIN_PIECE) tokens."""
        left = max(budget - len(self.decoding()), MIN_PIECE)
        out = []
        for seq in self.prefilling():
            if left <= 0:
                break
            if seq.req.cancelled:  # freed after this loop's step, unprefilled
                continue
            start, stop = self.next_chunk(seq)
            stop = min(stop, start + left)
            out.append((seq, stop))
            left -= stop - start
        return out

    def chunk_groups(self, chunks: list[Seq]) -> list[list[Seq]]:
        """This loop's chunks (oldest first) as the groups prefilled in one call each:
        paged, the chunks that start at the same position (``past``: one scalar per
        `Decoder.forward` call), padded to the longest, as long as the loop's padded
        tokens stay within max_prefill_tokens (a chunk that would take them past it runs
        alone, at the cost `admit` counted). Deterministic: only chunks of equal length
        share a call, so that no row's attention is padded (see `Prefill.chunks`). The
        slotted cache prefills each chunk alone (its view of one row)."""
        if not self.paged:
            return [[seq] for seq in chunks]
        groups: list[list[Seq]] = []
        by_key: dict[tuple[int, int], list[Seq]] = {}
        longest: dict[int, int] = {}  # by group (its id): its longest chunk
        spent = 0  # the loop's padded tokens so far
        for seq in chunks:
            start, stop = self.next_chunk(seq)
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
