"""The serving engine's emission: sampled tokens become events to their requests.

`Emission.advance(seqs, logits, rows)` samples each sequence's next token from its row of
logits (`Sampler`), reads them (one host sync) and emits them; `finish(draws, tokens)`
emits tokens already read (a step run ahead reads its own). Emitting a token: its
logprobs if asked, EOS or a stop id ends the request ("stop"), else the token is kept,
its penalty state updated, its text detokenized a few tokens at a time and cut at a stop
string ("stop"), and max_tokens ends it ("length"); text that could start a stop string
spanning tokens is held back until it cannot. The last event frees the slot
(`Scheduler.end`). A sequence whose emission raises (logprobs, detokenizing, stop
strings, its emit) ends alone with an error event; a cancelled one is freed unemitted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..runtime.prompts import cut_at_stop
from .requests import Event, ModelFailed, Seq
from .sampler import Draw, Sampler
from .scheduler import Scheduler


class Emission:
    """Emits the tokens of one engine's sequences. ``eos``: the token ids that end a
    request as "stop"; ``tokens_total``: tokens emitted so far (updated under ``lock``,
    once a step)."""

    def __init__(self, scheduler: Scheduler, sampler: Sampler, *, lock: threading.Condition,
                 eos: set[int], vocab: int):
        self.scheduler, self.sampler, self.lock = scheduler, sampler, lock
        self.eos, self.vocab = eos, vocab
        self.tokens_total = 0

    def advance(self, seqs: list[Seq], logits: torch.Tensor, rows: list[int]) -> None:
        """Sample each sequence's next token from its row of logits [B, V], emit it, and
        free the slot of each request that is done (`Sampler.sample`, then `finish` with
        the tokens read at once)."""
        draws = self.sampler.sample(seqs, logits, rows)
        self.finish(draws, self.sampler.read(draws))

    def advance_each(self, seqs: list[Seq],
                     decode_one: Callable[[int, Seq], torch.Tensor]) -> None:
        """``decode_one(i, seq)`` (its logits [1, V]) for each sequence of a failed step;
        a sequence that fails alone ends, the others sample from their rows."""
        done, rows = [], []
        for i, seq in enumerate(seqs):
            try:
                with torch.no_grad():
                    rows.append(decode_one(i, seq))
                done.append(seq)
            except ModelFailed:
                raise
            except Exception:  # noqa: BLE001 -- this row fails alone: it ends (logged)
                self.scheduler.fail(seq, "its decode step")
        if done:
            self.advance(done, torch.cat(rows), list(range(len(done))))

    def finish(self, draws: list[Draw], tokens: list[list[int] | None]) -> None:
        """Emit each draw's ``tokens`` (host ints; None: they could not be read, and its
        sequences end) to its sequences, but to none that ended or was cancelled since
        the draw (a step run ahead: `SlottedSteps.step`)."""
        added = 0
        emit = self.emit
        for draw, values in zip(draws, tokens):
            x, at = draw.x, draw.at
            for i, seq in enumerate(draw.seqs):
                if seq.done:
                    continue
                if seq.req.cancelled:
                    self.scheduler.free(seq)
                    continue
                if values is None:
                    self.scheduler.end(seq, Event("", finish_reason="error"))
                    continue
                had = len(seq.generated)
                try:
                    emit(seq, None if x is None else x[i: i + 1], values[at[i]])
                except Exception:  # noqa: BLE001 -- logprobs, detokenizing, stop strings, emit
                    self.scheduler.fail(seq, "emitting its token")
                added += len(seq.generated) - had
        # Counted once a step, not under the lock once a token (stats() reads it there).
        with self.lock:
            self.tokens_total += added

    def emit(self, seq: Seq, x: torch.Tensor | None, token: int) -> None:
        """Emit ``seq``'s sampled ``token`` (drawn from penalized logits x [1, V]; None
        for a plain greedy pick, which has no logprobs to report) and free the slot
        when the request is done."""
        req = seq.req
        logprob = top = None
        if req.logprobs is not None:
            lp = torch.log_softmax(x[0], -1)
            if req.logprobs:
                k = min(req.logprobs, self.vocab)
                best = torch.topk(lp, k)
                # One host read for the token's logprob and the top k, not three (float64
                # holds each float32 value and each token id exactly).
                got = torch.cat([lp[token: token + 1].double(), best.values.double(),
                                 best.indices.double()]).tolist()
                top = list(zip(map(int, got[1 + k:]), got[1: 1 + k]))
                logprob = got[0]
            else:
                logprob = float(lp[token])
        reason = None
        if token in self.eos or token in req.stop_token_ids:
            reason, token = "stop", None  # the event carries no token
        else:
            seq.token = token
            seq.generated.append(token)
            req.completion_tokens += 1
            if seq.seen is not None:
                seq.seen[token] = True
            if seq.counts is not None:
                seq.counts[token] += 1
            if seq.detokenized.add(token):  # else a multi-byte character is incomplete
                if req.stop:
                    seq.text, hit = cut_at_stop(seq.detokenized.text, req.stop)
                    if hit:
                        reason = "stop"
                else:  # nothing to cut at
                    seq.text = seq.detokenized.text
            if reason is None and len(seq.generated) >= req.max_tokens:
                reason = "length"
        text, emitted = seq.text, seq.emitted
        upto = len(text) if reason else max(emitted, len(text) - seq.hold)
        seq.emitted = upto
        event = Event(text[emitted: upto], token, logprob, top, reason)
        if reason:
            self.scheduler.end(seq, event)
        else:
            req.emit(event)
