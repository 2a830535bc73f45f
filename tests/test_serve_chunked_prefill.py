"""`qfuse serve`'s chunked prefill on loopback: a live server in this process
(`serving.server.Background`, the tiny test model, 2 batch-invariant slots, chunks of 4
tokens). A long prompt's greedy completion is the one an engine that prefills it whole
gives; its TTFT and prompt tokens are counted once, at the last chunk's token; while a
long prompt is between chunks, /health and /metrics say it is prefilling, and a client
that disconnects then frees its slot before any token is made."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families

from qfuse.serving.in_process import get_text

CHUNK, SLOTS = 4, 2
TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 30


@pytest.fixture(scope="module")
def loaded(tiny_loaded):
    """The tiny test model: these tests are of the server, not of the bundled model."""
    return tiny_loaded


@pytest.fixture(scope="module")
def port(loaded):
    from qfuse.serving.engine import Engine
    from qfuse.serving.in_process import serve_in_process

    model, tokenizer = loaded
    engine = Engine(model, tokenizer, max_batch=SLOTS, deterministic=True,
                    prefill_chunk=CHUNK)
    server = serve_in_process(engine, tokenizer, model.config.vocab_size)
    yield server.port
    server.stop()  # its lifespan stops the engine


def _prompt(loaded, n: int) -> list[int]:
    from qfuse.runtime.prompts import encode_prompts

    ids = encode_prompts(loaded[1], [TEXT])[0]
    assert len(ids) >= n
    return ids[:n]


def _health(port: int) -> dict:
    return json.loads(get_text(port, "/health"))


def _metrics(port: int) -> dict[str, float]:
    """/metrics' unlabelled samples (model_name aside) by name."""
    families = text_string_to_metric_families(get_text(port, "/metrics"))
    return {s.name: s.value for family in families for s in family.samples
            if set(s.labels) == {"model_name"}}


def _whole_prompt_text(loaded, ids: list[int], max_tokens: int) -> str:
    """The greedy text of an engine like the server's that prefills ``ids`` whole."""
    from qfuse.serving.engine import Engine, Request

    model, tokenizer = loaded
    engine = Engine(model, tokenizer, max_batch=SLOTS, deterministic=True, prefill_chunk=0)
    texts, done = [], threading.Event()

    def emit(event):
        texts.append(event.text)
        if event.finish_reason:
            done.set()

    engine.submit(Request(ids, max_tokens, emit=emit))
    engine.start()
    try:
        assert done.wait(60)
    finally:
        engine.stop()
    return "".join(texts)


def _post(port: int, body: dict) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    return conn


def test_a_long_prompt_in_chunks_answers_as_prefilled_whole(loaded, port):
    ids = _prompt(loaded, 301)  # 76 chunks, the last of one token
    before = _metrics(port)
    conn = _post(port, {"prompt": ids, "max_tokens": 8, "temperature": 0})
    try:
        r = conn.getresponse()
        answer = json.loads(r.read())
    finally:
        conn.close()
    assert r.status == 200, answer
    assert answer["choices"][0]["text"] == _whole_prompt_text(loaded, ids, 8)
    assert answer["usage"]["prompt_tokens"] == 301
    after = _metrics(port)
    assert after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0) == 301
    assert after["vllm:time_to_first_token_seconds_count"] \
        - before.get("vllm:time_to_first_token_seconds_count", 0) == 1
    assert after["qfuse:num_requests_prefilling"] == 0


def test_a_client_gone_mid_prefill_frees_its_slot_before_any_token(loaded, port):
    ids = _prompt(loaded, 1000)  # 250 chunks: seconds of prefill on a CPU
    tokens = _health(port)["tokens_total"]
    conn = _post(port, {"prompt": ids, "max_tokens": 20, "temperature": 0, "stream": True})
    try:
        assert conn.getresponse().status == 200
        deadline = time.monotonic() + 300  # hang guards only, here and below: the prefill
        while not _health(port)["prefilling"] and time.monotonic() < deadline:  # takes seconds
            time.sleep(0.005)
        health = _health(port)
        assert health["prefilling"] == 1 and health["active"] == 1
        assert _metrics(port)["qfuse:num_requests_prefilling"] == 1
        conn.sock.shutdown(socket.SHUT_RDWR)
    finally:
        conn.close()
    deadline = time.monotonic() + 300
    while _health(port)["active"] and time.monotonic() < deadline:
        time.sleep(0.01)
    health = _health(port)
    assert health["active"] == 0 and health["prefilling"] == 0 and health["kv_tokens"] == 0
    assert health["tokens_total"] == tokens  # it never reached its first token
