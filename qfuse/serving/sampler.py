"""The serving engine's sampler: each sequence's next token from its row of a step's logits.

`Sampler.sample(seqs, logits, rows)` draws on the device without a sync and returns
`Draw`s; `Sampler.read(draws)` brings all of a step's tokens to the host in one read.
Each sequence samples with its own parameters: plain greedy rows (no penalty, no
logprobs) share one argmax, which picks the first maximum of each row whatever the batch;
unseeded, unpenalized rows with the same parameters share one draw (from torch's global
generator); a seeded request draws alone from its own generator, so its tokens do not
depend on its company, and a penalized one alone with its own penalty state.

Failures blame no row of a shared draw: it is drawn again row by row, and a sequence whose
own draw fails ends alone (``fail``). A read that fails is retried draw by draw; a draw
that cannot be read gives None, and its sequences end (`Emission.finish`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..runtime.host_copies import to_device
from ..runtime.sampling import SamplingParams, penalize, sample
from .requests import Seq

log = logging.getLogger("qfuse")


@dataclass
class Draw:
    """Tokens drawn together for some sequences, still on the device."""
    seqs: list[Seq]
    at: list[int]  # the index of each sequence's token in ``tokens``
    tokens: torch.Tensor  # int64 [k]
    x: torch.Tensor | None  # float32 [len(seqs), V] drawn from (for logprobs); None: argmax


def deferrable(seq: Seq) -> bool:
    """Whether ``seq``'s next draw can run before the host reads its last token: no
    per-token state of its own feeds it (penalty counts are updated from the host's
    token) and no logprobs are read from its logits (a replay overwrites them)."""
    return seq.seen is None and seq.counts is None and seq.req.logprobs is None


def plain_greedy(seq: Seq) -> bool:
    """Whether ``seq`` takes the argmax of its raw logits (no penalty, no logprobs)."""
    return seq.req.params.temperature == 0 and deferrable(seq)


class Sampler:
    """Draws for the sequences of one engine. free(seq): a cancelled request's slot is
    freed instead of drawn for; fail(seq, what): ``seq`` ends alone after ``what``
    failed for it. ``token_wait_s``: seconds spent waiting for drawn tokens to reach
    the host (the GPU's step still running)."""

    def __init__(self, device: torch.device, vocab: int, free: Callable[[Seq], None],
                 fail: Callable[[Seq, str], None]):
        self.device, self.vocab = device, vocab
        self.free, self.fail = free, fail
        self.token_wait_s = 0.0

    def start(self, seq: Seq) -> None:
        """Make ``seq``'s own sampling state: penalty counts and its seeded generator."""
        req, V = seq.req, self.vocab
        if req.params.repetition_penalty != 1.0:
            seq.seen = torch.zeros(V, dtype=torch.bool, device=self.device)
            seq.seen[torch.tensor(req.ids, device=self.device)] = True
        if req.presence_penalty or req.frequency_penalty:
            seq.counts = torch.zeros(V, dtype=torch.float32, device=self.device)
        if req.params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(req.params.seed)

    def sample(self, seqs: list[Seq], logits: torch.Tensor, rows: list[int]) -> list[Draw]:
        """Draw each sequence's next token from its row of logits [B, V], on the device,
        without a sync (a cancelled request's slot is freed instead); `Emission.finish`
        emits them once read, all a step's draws with one read."""
        greedy, rest = [], []  # the plain greedy rows, the others in order
        for seq, row in zip(seqs, rows):
            if seq.req.cancelled:
                self.free(seq)
            else:
                (greedy if plain_greedy(seq) else rest).append((seq, row))
        if not greedy and not rest:
            return []

        def argmax(group):
            if len(group) == 1:  # alone, after the shared argmax failed
                (seq, row), = group
                return Draw([seq], [0], logits[row: row + 1].argmax(dim=-1), None)
            # One argmax over every row serves all plain greedy rows (idle rows cost
            # nothing worth a gather).
            return Draw([seq for seq, _ in group], [row for _, row in group],
                        logits.argmax(dim=-1), None)

        def shared_draw(group):
            params = group[0][0].req.params
            rows = to_device([row for _, row in group], self.device)  # a list index syncs
            x = penalize(logits.index_select(0, rows), params, None)
            return Draw([seq for seq, _ in group], list(range(len(group))),
                        sample(x, params, None, None), x)

        def own_draw(group):
            (seq, row), = group
            req = seq.req
            seen = None if seq.seen is None else seq.seen[None]
            x = penalize(logits[row: row + 1], req.params, seen)
            if seq.counts is not None:  # OpenAI's definition, on top of the repetition penalty
                x = x - req.frequency_penalty * seq.counts - req.presence_penalty * (seq.counts > 0)
            return Draw([seq], [0], sample(x, req.params, None, seq.generator), x)

        draws = self.draw(argmax, greedy) if greedy else []
        # A seeded or penalized row samples alone with its own state.
        shared: dict[SamplingParams, list[tuple[Seq, int]]] = {}
        for seq, row in rest:
            if seq.generator is None and seq.seen is None and seq.counts is None:
                shared.setdefault(seq.req.params, []).append((seq, row))
            else:
                draws += self.draw(own_draw, [(seq, row)])
        for group in shared.values():
            draws += self.draw(shared_draw, group)
        return draws

    def draw(self, how, group: list[tuple[Seq, int]]) -> list[Draw]:
        """``how(group)`` as one draw; if it fails, each (seq, row) of the group draws
        alone, and a sequence whose own draw fails ends."""
        try:
            return [how(group)]
        except Exception:  # whatever the draw raised, one request's fault at most
            if len(group) == 1:
                self.fail(group[0][0], "sampling")
                return []
            log.exception("qfuse serve: a draw for %d rows failed; drawing each alone",
                          len(group))
        return [d for one in group for d in self.draw(how, [one])]

    def read(self, draws: list[Draw], read=None) -> list[list[int] | None]:
        """Each draw's tokens on the host: one read for all (``read()``: the draws'
        tokens concatenated, as host ints; default: concatenate them and read, one sync);
        if that fails, one read per draw, and a draw that still fails is None (its
        sequences end, `Emission.finish`)."""
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
