"""A completion stream's server-sent events, each ``data: <chunk>\\n\\n`` with the chunk
object written exactly as ``json.dumps`` writes it (default separators, ASCII escapes).

A stream's chunks differ only in their choices (and the usage of the last): the head (id,
object, created, model) is encoded once a stream, and the chunk nearly every token makes,
one choice without logprobs, is formatted around its text's JSON string. json.dumps of
the whole chunk took ~5 µs a token, about a fifth of the server thread's streaming time at
256 streams (py-spy over `python bench/engine_host.py 256 128 http`, NOTES "Serving");
the formatted one takes under 1 µs. Anything else (logprobs, the role, echo, usage) goes through
json.dumps as before.
"""

from __future__ import annotations

import json

# finish_reason as JSON: json.dumps(None) takes the encoder's slow path, a str its fast one.
_REASONS = {None: "null", "stop": '"stop"', "length": '"length"'}


class StreamChunks:
    """The events of one stream: ``rid`` its id, ``kind`` its object ("text_completion",
    "chat.completion.chunk"), ``created`` its time, ``model`` the served name;
    ``include_usage``: every chunk has a "usage" key (null but in the last)."""

    def __init__(self, rid: str, kind: str, created: int, model: str, include_usage: bool):
        head = json.dumps({"id": rid, "object": kind, "created": created, "model": model})
        self._head = f'data: {head[:-1]}, "choices": '  # the object left open
        self._usage = include_usage
        self._tail = ', "usage": null}\n\n' if include_usage else "}\n\n"

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        """The event of a chunk with these ``choices`` (and ``usage`` where included)."""
        tail = f', "usage": {json.dumps(usage)}}}\n\n' if self._usage else self._tail
        return f"{self._head}{json.dumps(choices)}{tail}"

    def text(self, index: int, text: str, finish_reason: str | None) -> str:
        """A completion's chunk: choice ``index`` adds ``text``, no logprobs."""
        return self._plain(index, finish_reason, f'"text": {json.dumps(text)}')

    def delta(self, index: int, text: str, finish_reason: str | None) -> str:
        """A chat chunk: choice ``index`` adds ``text`` to its message's content (an empty
        delta without text), no logprobs."""
        delta = f'{{"content": {json.dumps(text)}}}' if text else "{}"
        return self._plain(index, finish_reason, f'"delta": {delta}')

    def _plain(self, index: int, finish_reason: str | None, body: str) -> str:
        """The event of one choice without logprobs, ``body`` its text or delta member."""
        return (f'{self._head}[{{"index": {index}, "finish_reason": '
                f'{_reason(finish_reason)}, {body}, "logprobs": null}}]{self._tail}')


def _reason(finish_reason: str | None) -> str:
    known = _REASONS.get(finish_reason)
    return json.dumps(finish_reason) if known is None else known
