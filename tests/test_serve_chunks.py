"""A stream's server-sent events (`serving.chunks.StreamChunks`) are, byte for byte, what
json.dumps writes for the chunk object the OpenAI API defines: the formatted token chunks
(completion text, chat delta) for texts that need escapes, non-ASCII and lone surrogates,
every finish reason, with and without the usage key; the general chunk with usage. A
stream behind the engine takes all its waiting events in one batch (one write), and an
error event raises only after the events before it have been handed on."""

import asyncio
import json

import pytest

from qfuse.serving.chunks import StreamChunks

TEXTS = ["", "a", " the", '"quoted" \\ back', "\n\t\r\x00\x1f\x7f", "naïve 日本語 🙂",
         "\ud800", "</script>"]
REASONS = [None, "stop", "length", "error"]


def reference(choices, usage_key: bool, usage=None) -> str:
    body = {"id": 'cmpl-"x"', "object": "kind", "created": 1700000000, "model": "org/mødel",
            "choices": choices}
    if usage_key:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


@pytest.mark.parametrize("usage_key", [False, True])
def test_token_chunks_are_what_json_dumps_writes(usage_key):
    chunks = StreamChunks('cmpl-"x"', "kind", 1700000000, "org/mødel", usage_key)
    for text in TEXTS:
        for reason in REASONS:
            for index in (0, 7):
                assert chunks.text(index, text, reason) == reference(
                    [{"index": index, "finish_reason": reason, "text": text,
                      "logprobs": None}], usage_key)
                delta = {"content": text} if text else {}
                assert chunks.delta(index, text, reason) == reference(
                    [{"index": index, "finish_reason": reason, "delta": delta,
                      "logprobs": None}], usage_key)


@pytest.mark.parametrize("usage_key", [False, True])
def test_other_chunks_are_what_json_dumps_writes(usage_key):
    chunks = StreamChunks('cmpl-"x"', "kind", 1700000000, "org/mødel", usage_key)
    role = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}]
    assert chunks.chunk(role) == reference(role, usage_key)
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert chunks.chunk([], usage if usage_key else None) == reference([], usage_key, usage)


def _handle_with(events):
    """An app's handle of one request of two choices, ``events`` already waiting."""
    pytest.importorskip("starlette")
    from qfuse.runtime.sampling import SamplingParams
    from qfuse.serving.app import Handle
    from qfuse.serving.metrics import Clock, NoMetrics
    from qfuse.serving.protocol import Job

    job = Job(prompts=[[1, 2]], max_tokens=4, params=SamplingParams(), n=2, stream=True)
    handle = Handle(None, job, NoMetrics("none"), Clock(job.choices))
    for item in events:
        handle.queue.put_nowait(item)
    return handle


def test_a_stream_behind_takes_every_waiting_event_at_once():
    from qfuse.serving.requests import Event

    async def run():
        waiting = [(0, Event("a", token=1)), (1, Event("b", token=2)),
                   (0, Event("c", token=3, finish_reason="length")),
                   (1, Event("", finish_reason="stop"))]
        handle = _handle_with(waiting[:3])
        got = []
        async for batch in handle.batches():
            got.append(batch)
            if len(got) == 1:  # the last one comes while the stream writes the first three
                handle.queue.put_nowait(waiting[3])
        return got, waiting

    got, waiting = asyncio.run(run())
    assert got == [waiting[:3], waiting[3:]]


def test_an_error_event_raises_after_the_events_before_it():
    from qfuse.serving.protocol import ApiError
    from qfuse.serving.requests import Event

    async def run():
        before = [(0, Event("a", token=1)), (1, Event("b", token=2))]
        handle = _handle_with(before + [(0, Event("", finish_reason="error")),
                                        (1, Event("c", token=3))])
        got = []
        with pytest.raises(ApiError) as e:
            async for batch in handle.batches():
                got.append(batch)
        return got, before, e.value

    got, before, error = asyncio.run(run())
    assert got == [before] and error.status == 500
