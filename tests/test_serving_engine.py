"""The serving engine in-process on the CPU: a quantized KV cache written slot by slot
gives each request the tokens it gets alone, and a cancelled request frees its slot."""

import threading
import time

import pytest

import qfuse
from qfuse.generation import encode_prompts
from qfuse.serving.engine import Engine, Request

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n", "for i in range(", "x = ["]


@pytest.fixture(scope="module")
def loaded():
    return qfuse.load(progress=False)


def _run(engine, tokenizer, prompts, max_tokens=12):
    out = {p: [] for p in prompts}
    left, done = [len(prompts)], threading.Event()

    def emitter(p):
        def emit(event):
            if event.token is not None:
                out[p].append(event.token)
            if event.finish_reason:
                left[0] -= 1
                if not left[0]:
                    done.set()
        return emit

    for p in prompts:
        engine.submit(Request(encode_prompts(tokenizer, [p])[0], max_tokens, emit=emitter(p)))
    assert done.wait(60)
    return out


def test_kv4_slots_are_batch_invariant(loaded):
    model, tokenizer = loaded
    engine = Engine(model, tokenizer, max_batch=3, kv_bits=4, kv_group_size=32)
    engine.start()
    try:
        alone = {p: _run(engine, tokenizer, [p])[p] for p in PROMPTS}
        together = _run(engine, tokenizer, PROMPTS)  # 5 requests over 3 slots
    finally:
        engine.stop()
    assert together == alone
    assert all(len(t) == 12 for t in alone.values())


def test_cancel_frees_the_slot(loaded):
    model, tokenizer = loaded
    engine = Engine(model, tokenizer, max_batch=2)
    engine.start()
    try:
        started = threading.Event()
        req = Request(encode_prompts(tokenizer, ["def f():\n"])[0], 900,
                      emit=lambda event: started.set())
        engine.submit(req)
        assert started.wait(30) and engine.stats()["active"] == 1
        engine.cancel(req)
        deadline = time.monotonic() + 10
        while engine.stats()["active"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats()["active"] == 0 and req.completion_tokens < 900
        assert engine.cache.host_lengths == [0, 0]
    finally:
        engine.stop()
