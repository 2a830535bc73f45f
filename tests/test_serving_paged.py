"""The serving engine on a paged KV cache (``kv_page_size``), in-process on the CPU with
the tiny test model: the greedy tokens of the slotted engine; more requests than pages
queue and all complete (QueueFull past max_queue), with every page free afterwards; a
sequence preempted mid-decode resumes with the tokens it gets alone; a cancel mid-prefill
and mid-decode gives its pages back; bad values are one-line errors, in the engine and in
`qfuse serve`'s flags."""

import threading

import pytest

from qfuse.serving.engine import Engine, QueueFull
from qfuse.serving.in_process import Followed, until_idle

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n" * 10, "x = [", "hello world"]
CONTEXT = 256  # one sequence: 16 pages of 16 tokens


@pytest.fixture(scope="module")
def loaded(tiny_loaded):
    """The tiny test model: these tests are of the engine, not of the bundled model."""
    return tiny_loaded


def _run(loaded, prompts, max_tokens, **kw):
    """Each prompt's greedy tokens, all submitted at once, and the engine (stopped)."""
    model, tokenizer = loaded
    engine = Engine(model, tokenizer, max_batch=4, context=CONTEXT, **kw)
    engine.start()
    try:
        jobs = [Followed(engine, tokenizer, p, max_tokens) for p in prompts]
        tokens = [job.wait() for job in jobs]
        assert all(job.reason in ("length", "stop") for job in jobs)
    finally:
        engine.stop()
    return tokens, engine


def _all_free(engine) -> bool:
    """Every page of every pool is free, and stats() says so for the full one."""
    pages = engine.stats()["kv_pages"]
    return pages["used"] == 0 and pages["free"] == pages["total"] and all(
        g.allocator.free_pages == g.allocator.num_pages for g in engine.cache.groups.values())



def test_greedy_tokens_on_pages_are_the_slotted_engines(loaded):
    slotted, _ = _run(loaded, PROMPTS, 24)
    paged, engine = _run(loaded, PROMPTS, 24, kv_page_size=16)
    # a prompt past the chunk goes in chunks, each taking its pages
    chunked, _ = _run(loaded, PROMPTS, 24, kv_page_size=8, prefill_chunk=32)
    assert paged == slotted and chunked == slotted
    assert _all_free(engine) and engine.stats()["kv_pages"]["preemptions"] == 0


def test_more_requests_than_pages_queue_and_all_complete_with_every_page_free(loaded):
    model, tokenizer = loaded
    # 16 pages hold one sequence of the context: five requests of up to ~190 tokens
    # each cannot all be in the cache at once.
    engine = Engine(model, tokenizer, max_batch=4, context=CONTEXT, max_queue=5,
                    kv_page_size=16, kv_pages=16)
    jobs = [Followed(engine, tokenizer, p, 150) for p in PROMPTS]  # queued before the start
    with pytest.raises(QueueFull):
        Followed(engine, tokenizer, "one too many", 4)
    engine.start()
    try:
        tokens = [job.wait() for job in jobs]
        assert [job.reason for job in jobs] == ["length"] * 5 and all(
            len(t) == 150 for t in tokens)
        assert until_idle(engine) and _all_free(engine)
    finally:
        engine.stop()


def test_a_sequence_preempted_mid_decode_keeps_its_greedy_tokens(loaded):
    alone = [_run(loaded, [p], 150)[0][0] for p in PROMPTS]
    tight, engine = _run(loaded, PROMPTS, 150, kv_page_size=16, kv_pages=16)
    stats = engine.stats()["kv_pages"]
    assert stats["preemptions"] > 0, "the pages never ran out: the test tests nothing"
    assert tight == alone
    assert _all_free(engine)


def test_cancel_mid_prefill_and_mid_decode_frees_the_pages(loaded):
    model, tokenizer = loaded
    gate, inside = threading.Event(), threading.Event()

    class Blocking:  # the model, holding its second prefill chunk until `gate` is set
        def __init__(self):
            self.chunks = 0

        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, ids, lengths=None, cache=None, past=0, **kw):
            if past:
                inside.set()
                assert gate.wait(30)
            return model(ids, lengths, cache, past=past, **kw)

        def decode(self, tokens, cache):
            return model.decode(tokens, cache)

    engine = Engine(Blocking(), tokenizer, max_batch=2, context=CONTEXT, kv_page_size=16,
                    prefill_chunk=16)
    engine.start()
    try:
        long = Followed(engine, tokenizer, "class Stack:\n" * 20, 8)  # 80 tokens: 5 chunks
        assert inside.wait(30)
        assert engine.stats()["kv_pages"]["used"] > 0  # its first chunk's pages
        engine.cancel(long.req)
        gate.set()
        assert until_idle(engine) and _all_free(engine)
        assert long.tokens == []

        def cancel_at_three(job):
            if len(job.tokens) == 3:
                engine.cancel(job.req)

        decoding = Followed(engine, tokenizer, "def fibonacci(n):", 100, on_token=cancel_at_three)
        assert until_idle(engine) and _all_free(engine)
        assert 3 <= len(decoding.tokens) < 100
    finally:
        gate.set()
        engine.stop()


def test_bad_page_values_are_one_line_errors(loaded):
    model, tokenizer = loaded
    for kw, message in (
            ({"kv_pages": 8}, "kv_pages sizes a paged KV cache: give kv_page_size too"),
            ({"kv_page_size": 12}, "page_size must be a power of two, got 12"),
            ({"kv_page_size": 16, "kv_pages": 4},
             "kv_pages=4 pages of 16 tokens hold less than one sequence of context=256"),
            ({"kv_page_size": 16, "async_scheduling": True},
             "async_scheduling runs the slotted cache's steps")):
        with pytest.raises(ValueError) as e:
            Engine(model, tokenizer, max_batch=2, context=CONTEXT, **kw)
        assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_bad_page_flags_are_one_line_errors_before_loading(qfuse_here, monkeypatch):
    import qfuse.from_flags

    def load_model_from_flags(args):
        raise AssertionError("the model loaded before the mistake was reported")

    monkeypatch.setattr(qfuse.from_flags, "load_model_from_flags", load_model_from_flags)
    for flags, message in (
            (["--kv-pages", "8"], "--kv-pages sizes a paged KV cache: give --kv-page-size"),
            (["--kv-page-size", "12"], "--kv-page-size must be a power of two"),
            (["--kv-page-size", "0"], "--kv-page-size must be a power of two"),
            (["--kv-page-size", "16", "--kv-pages", "0"], "--kv-pages must be at least 1"),
            (["--kv-page-size", "16", "--async-scheduling"],
             "--async-scheduling runs the slotted KV cache's steps"),
            (["--kv-page-size", "16", "--kv-pages", "3", "--max-kv-size", "256"],
             "--kv-pages 3 pages of 16 tokens hold less than one sequence of 256 tokens")):
        r = qfuse_here("serve", "--port", "0", *flags)
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith(f"qfuse: error: {message}") and r.stderr.count("\n") == 1
