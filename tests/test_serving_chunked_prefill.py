"""The serving engine's chunked prefill in-process on the CPU: a long prompt prefilled in
chunks beside decoding streams gets the greedy tokens of the whole prompt and of the
request alone, at chunk boundaries set by the prompt alone, while the others' decode
steps go on between its chunks; the loop's budget takes the prompts under way oldest
first; a cancel between chunks frees the slot, and a failing chunk ends its request
alone."""

import threading
import time

import pytest

from qfuse.runtime.prompts import encode_prompts
from qfuse.serving.engine import Engine
from qfuse.serving.in_process import Followed

SHORT = ["def fibonacci(n):", "import os\n"]
# 200 and 150 tokens: past the test model's sliding window (128), so its ring layers
# wrap between chunks.
LONG = "class Stack:\n" * 40
OTHER_LONG = "x = [" * 50


@pytest.fixture(scope="module")
def loaded(tiny_loaded):
    """The tiny test model: these tests are of the engine, not of the bundled model."""
    return tiny_loaded


class _Recording:
    """The model, recording its calls: ("prefill", prompt ids, past) and ("decode", rows);
    ``before_prefill(ids, past)`` runs before each prefill (to block or fail one)."""

    def __init__(self, model, before_prefill=None):
        self._model, self.calls, self.before_prefill = model, [], before_prefill

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, ids, lengths=None, cache=None, past=0, **kw):
        self.calls.append(("prefill", tuple(ids[0].tolist()), past))
        if self.before_prefill is not None:
            self.before_prefill(ids[0].tolist(), past)
        return self._model(ids, lengths, cache, past=past, **kw)

    def decode(self, tokens, cache):
        self.calls.append(("decode", tokens.shape[0]))
        return self._model.decode(tokens, cache)

    def prefills(self) -> list[tuple[tuple[int, ...], int]]:
        """(prompt ids, past) of each prefill call, in order."""
        return [(call[1], call[2]) for call in self.calls if call[0] == "prefill"]

    def chunks_of(self, ids: list[int]) -> list[tuple[int, int]]:
        """(past, tokens) of each prefill call that carried a piece of prompt ``ids``."""
        return [(past, len(got)) for got, past in self.prefills()
                if list(got) == ids[past: past + len(got)]]


def _alone(model, tokenizer, prompt, max_tokens, **kw):
    engine = Engine(model, tokenizer, max_batch=4, **kw)
    engine.start()
    try:
        return Followed(engine, tokenizer, prompt, max_tokens).wait()
    finally:
        engine.stop()


def _until(condition, timeout=300.0):  # a hang guard only
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_a_chunked_prompt_gets_its_whole_prompts_tokens_beside_decoding_streams(loaded):
    model, tokenizer = loaded
    whole = _alone(model, tokenizer, LONG, 12, prefill_chunk=0)
    assert _alone(model, tokenizer, LONG, 12, prefill_chunk=16) == whole
    short_alone = [_alone(model, tokenizer, p, 40) for p in SHORT]

    recording = _Recording(model)
    engine = Engine(recording, tokenizer, max_batch=4, prefill_chunk=16)
    engine.start()
    try:
        streams = [Followed(engine, tokenizer, SHORT[0], 40)]
        assert streams[0].started.wait(30)  # decoding in slot 0
        # Slot 1, below a stream in slot 2: the decode steps run its row as a dummy.
        long = Followed(engine, tokenizer, LONG, 12)
        streams.append(Followed(engine, tokenizer, SHORT[1], 40))
        assert long.wait() == whole and len(whole) == 12
        assert [s.wait() for s in streams] == short_alone
    finally:
        engine.stop()
    # 13 chunks at fixed boundaries, the last one short; one decode step between each two.
    chunks = recording.chunks_of(long.ids)
    assert chunks == [(s, 16) for s in range(0, 192, 16)] + [(192, 8)]
    calls = recording.calls
    first = calls.index(("prefill", tuple(long.ids[:16]), 0))
    last = calls.index(("prefill", tuple(long.ids[192:]), 192))
    assert sum(call[0] == "decode" for call in calls[first:last]) == 12
    assert engine.cache.host_lengths == [0] * 4 and not engine.cache.lengths.any()


def test_chunks_depend_on_the_prompt_alone_under_load(loaded):
    """Batch invariant with a quantized KV cache: the long prompt's tokens and chunks are
    those it gets alone, though a budget of one chunk per loop makes it wait its turn."""
    model, tokenizer = loaded
    kw = {"deterministic": True, "kv_bits": 4, "kv_group_size": 32, "prefill_chunk": 16}
    recording = _Recording(model)
    engine = Engine(recording, tokenizer, max_batch=4, **kw)
    engine.start()
    try:
        alone = Followed(engine, tokenizer, LONG, 10).wait()
        alone_chunks = recording.chunks_of(encode_prompts(tokenizer, [LONG])[0])
    finally:
        engine.stop()

    recording = _Recording(model)
    engine = Engine(recording, tokenizer, max_batch=4, max_prefill_tokens=16, **kw)
    jobs = [Followed(engine, tokenizer, p, 10) for p in (OTHER_LONG, SHORT[0], LONG, SHORT[1])]
    engine.start()
    try:
        assert jobs[2].wait() == alone and len(alone) == 10
        for job in jobs:
            job.wait()
    finally:
        engine.stop()
    assert recording.chunks_of(jobs[2].ids) == alone_chunks
    # One piece per loop: the first long prompt's 10 chunks, then the short one admitted
    # behind it, then the second long prompt's 13.
    prefills = [(len(ids), past) for ids, past in recording.prefills()]
    assert prefills == ([(16, s) for s in range(0, 144, 16)] + [(6, 144)]
                        + [(len(jobs[1].ids), 0)] + [(n, s) for s, n in alone_chunks]
                        + [(len(jobs[3].ids), 0)])


def test_the_budget_takes_the_prompts_under_way_oldest_first(loaded):
    model, tokenizer = loaded
    recording = _Recording(model)
    # Room for two chunks a loop: the two long prompts advance side by side.
    engine = Engine(recording, tokenizer, max_batch=4, prefill_chunk=64,
                    max_prefill_tokens=128)
    jobs = [Followed(engine, tokenizer, p, 4) for p in (LONG, OTHER_LONG)]
    engine.start()
    try:
        for job in jobs:
            job.wait()
    finally:
        engine.stop()
    a, b = (job.ids for job in jobs)
    pieces = [(ids[:1], past) for ids, past in recording.prefills()]
    assert pieces == [((a[0],), 0), ((b[0],), 0), ((a[64],), 64), ((b[64],), 64),
                      ((a[128],), 128), ((b[128],), 128), ((a[192],), 192)]
    assert engine.stats()["prefill_chunk"] == 64


def test_a_cancel_between_chunks_frees_the_slot(loaded):
    model, tokenizer = loaded
    reached, go, seen = threading.Event(), threading.Event(), {}

    def before_prefill(ids, past):
        if past == 64:  # the long prompt's 5th chunk: hold the engine inside it
            reached.set()
            assert go.wait(30)

    engine = Engine(_Recording(model, before_prefill), tokenizer, max_batch=2,
                    prefill_chunk=16)
    engine.start()
    try:
        # Slot 0, below the stream in slot 1: the decode steps run its row as a dummy.
        long = Followed(engine, tokenizer, LONG, 8)
        stream = Followed(engine, tokenizer, SHORT[0], 400)
        assert reached.wait(30) and stream.started.is_set()
        seen.update(engine.stats(), long_lengths=(engine.cache.host_lengths[0],
                                                  int(engine.cache.lengths[0])))
        engine.cancel(long.req)
        go.set()
        assert _until(lambda: engine.stats()["active"] == 1)  # the stream goes on
        assert engine.stats()["prefilling"] == 0
        engine.cancel(stream.req)
        assert _until(lambda: engine.stats()["active"] == 0)
        assert not long.tokens and long.req.completion_tokens == 0
        assert engine.cache.host_lengths == [0, 0] and not engine.cache.lengths.any()
        # Still serving, with the freed slots.
        assert len(Followed(engine, tokenizer, LONG, 3).wait()) == 3
    finally:
        go.set()
        engine.stop()
    assert seen["active"] == 2 and seen["prefilling"] == 1 and seen["free_slots"] == 0
    # Its 4 chunks so far, kept through the decode steps between them (their dummy row).
    assert seen["long_lengths"] == (64, 64)


def test_a_failing_chunk_ends_its_request_alone(loaded):
    model, tokenizer = loaded
    failing_ids = encode_prompts(tokenizer, [OTHER_LONG])[0]

    def before_prefill(ids, past):
        if past == 32 and ids == failing_ids[32:48]:
            raise RuntimeError("no memory for this chunk")

    expected = [_alone(model, tokenizer, p, 10, prefill_chunk=16) for p in (LONG, SHORT[0])]
    engine = Engine(_Recording(model, before_prefill), tokenizer, max_batch=4,
                    prefill_chunk=16)
    jobs = [Followed(engine, tokenizer, p, 10) for p in (LONG, OTHER_LONG, SHORT[0])]
    engine.start()
    try:
        for job in jobs:
            job.wait()
        assert [jobs[0].tokens, jobs[2].tokens] == expected
        assert jobs[1].reason == "error" and not jobs[1].tokens
        assert engine.stats()["active"] == 0 and engine.cache.host_lengths == [0] * 4
        assert Followed(engine, tokenizer, SHORT[0], 10).wait() == expected[1]  # still serving
    finally:
        engine.stop()


def test_prefill_chunk_zero_prefills_whole_and_a_negative_one_is_refused(loaded):
    model, tokenizer = loaded
    recording = _Recording(model)
    engine = Engine(recording, tokenizer, max_batch=2, prefill_chunk=0)
    engine.start()
    try:
        job = Followed(engine, tokenizer, LONG, 2)
        job.wait()
    finally:
        engine.stop()
    assert recording.chunks_of(job.ids) == [(0, 200)]
    with pytest.raises(ValueError, match="prefill_chunk must be at least 0"):
        Engine(model, tokenizer, prefill_chunk=-1)
    assert not engine.cache.lengths.any() and engine.cache.host_lengths == [0, 0]
