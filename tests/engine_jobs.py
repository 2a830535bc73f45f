"""Jobs for the serving engine in tests: each a (prompt, max_tokens, Request keywords)
submitted with its own emit callback, whose events `Streams` collects (tokens, text, the
finish reason) until every job has finished."""

from __future__ import annotations

import threading

from qfuse.runtime.prompts import encode_prompts
from qfuse.serving.engine import Request


class Streams:
    """Each job's tokens, text and finish reason, through the emit callbacks; `done` is
    set once every job has finished. ``log``, if given, gets "token" per token emitted
    (tests that interleave it with other events)."""

    def __init__(self, n: int, log: list | None = None):
        self.tokens = [[] for _ in range(n)]
        self.text = [[] for _ in range(n)]
        self.reasons: list[str | None] = [None] * n
        self.left, self.done, self.log = n, threading.Event(), log

    def emitter(self, i: int):
        def emit(event):
            if event.token is not None:
                self.tokens[i].append(event.token)
                if self.log is not None:
                    self.log.append("token")
            self.text[i].append(event.text)
            if event.finish_reason:
                self.reasons[i] = event.finish_reason
                self.left -= 1
                if not self.left:
                    self.done.set()
        return emit


def submit(engine, tokenizer, jobs, log: list | None = None) -> Streams:
    """Submit the (prompt, max_tokens, kwargs) jobs to ``engine``; their `Streams`."""
    streams = Streams(len(jobs), log)
    for i, (prompt, max_tokens, kw) in enumerate(jobs):
        engine.submit(Request(encode_prompts(tokenizer, [prompt])[0], max_tokens,
                              emit=streams.emitter(i), **kw))
    return streams


def run_to_end(engine, tokenizer, jobs, timeout: float = 60, log: list | None = None
               ) -> Streams:
    """Submit the jobs before the engine starts, so that its first loop admits them all
    at once; run it until every job has finished (within ``timeout`` seconds), stop it."""
    streams = submit(engine, tokenizer, jobs, log)
    engine.start()
    try:
        assert streams.done.wait(timeout)
    finally:
        engine.stop()
    return streams
