"""`qfuse serve` on a paged KV cache (``kv_page_size``), over HTTP on loopback: live servers
in this process (`serve_in_process`, the tiny test model on the CPU), driven by the official
openai client and by plain HTTP.

Every server has pages of 16 tokens, as many as one sequence of its context takes, and
prefills prompts over 16 tokens in chunks. On the main one (4 slots, 256 tokens):
completions and chat, whole and streamed, give the greedy text of `qfuse.generate` (a
long prompt too, in chunks); a client that disconnects mid-prefill (its chunk held
until the server has seen it go) or mid-decode frees its pages. On a smaller one (4
slots, 128 tokens) a flood of more requests than the slots and pages hold queues,
preempts, and every request completes with the text it gets alone. A third (1 slot, a
queue of 1) answers a request past its queue with 503 and Retry-After. After each,
/health shows every page free. Every wait is bounded in time, every loop in count.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

CONTEXT, PAGE, PAGES, CHUNK = 256, 16, 16, 16
LONG = "class Stack:\n    def push(self, x):\n        self.items.append(x)\n" * 4


@pytest.fixture(scope="module")
def loaded(tiny_loaded):
    """The tiny test model: these tests are of the server, not of the bundled model."""
    return tiny_loaded


class Holding:
    """The model, whose prefill chunks after the first wait while ``hold`` is armed (set
    to an Event): so that a test can act while a prompt is between chunks."""

    def __init__(self, model):
        self.inner, self.hold, self.inside = model, None, threading.Event()

    def __getattr__(self, name):  # config, dtype, model (its layers), ...
        return getattr(self.inner, name)

    def __call__(self, ids, lengths=None, cache=None, past=0, **kw):
        hold = self.hold
        if past and hold is not None:
            self.inside.set()
            assert hold.wait(30), "the held chunk was never released"
        return self.inner(ids, lengths, cache, past=past, **kw)

    def decode(self, tokens, cache):
        return self.inner.decode(tokens, cache)


def _start(loaded, model, context=CONTEXT, pages=PAGES, **kw):
    """(engine, server): a live server over a paged engine of ``pages`` pages of PAGE
    tokens, prompts over CHUNK tokens prefilled in chunks."""
    from qfuse.serving.engine import Engine
    from qfuse.serving.in_process import serve_in_process

    _, tokenizer = loaded
    engine = Engine(model, tokenizer, context=context, kv_page_size=PAGE, kv_pages=pages,
                    prefill_chunk=CHUNK, **kw)
    return engine, serve_in_process(engine, tokenizer, loaded[0].config.vocab_size)


@pytest.fixture(scope="module")
def served(loaded):
    """(engine, port, the Holding model) of the main server."""
    holding = Holding(loaded[0])
    engine, server = _start(loaded, holding, max_batch=4, max_queue=8)
    yield engine, server.port, holding
    server.stop()  # its lifespan stops the engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served[1]}/v1", api_key="none",
                         max_retries=0, timeout=60)


def _health(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def _settled(port: int, timeout: float = 300.0) -> dict:
    """/health once no request is in a slot or waiting (AssertionError past ``timeout``, a
    hang guard only: settling takes a fraction of a second)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = _health(port)
        if health["active"] == 0 and health["waiting"] == 0:
            return health
        time.sleep(0.02)
    raise AssertionError(f"requests still in flight after {timeout:g} s: {_health(port)}")


def _all_free(health: dict) -> bool:
    pages = health["kv_pages"]
    return pages["used"] == 0 and pages["free"] == pages["total"] and health["kv_tokens"] == 0


def _stream(port: int, body: dict):
    """A streamed POST /v1/completions: (connection, response), read by r.fp.readline."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions",
                 body=json.dumps({**body, "temperature": 0, "stream": True}).encode(),
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def _first_text_event(r) -> None:
    """Reads up to a text chunk: the request has made a token (bounded by the stream's
    own length and the connection's timeout)."""
    while line := r.fp.readline():
        if line.startswith(b"data: ") and b'"text": ""' not in line:
            return
    raise AssertionError("the stream ended before any text")


def _gone(conn) -> None:
    """The client goes away without a word, as a killed process does."""
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def test_completions_and_chat_on_pages_give_the_greedy_text(loaded, client, served):
    import qfuse

    model, tokenizer = loaded
    _, port, _ = served
    assert len(tokenizer.encode(LONG).ids) > 3 * CHUNK  # prefilled in chunks
    for prompt in ("def fibonacci(n):", LONG):
        expected = qfuse.generate(model, tokenizer, prompt, max_tokens=24)
        whole = client.completions.create(model="default", prompt=prompt, max_tokens=24,
                                          temperature=0)
        assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
        streamed = client.completions.create(model="default", prompt=prompt, max_tokens=24,
                                             temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == expected
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    chat = client.chat.completions.create(model="default", messages=messages, max_tokens=20,
                                          temperature=0)
    chunks = list(client.chat.completions.create(
        model="default", messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and text == chat.choices[0].message.content
    assert chunks[-1].usage == chat.usage
    assert _all_free(_settled(port))


def test_a_flood_over_the_pages_queues_preempts_and_all_complete(loaded):
    # Its own server, smaller: 4 slots, 8 pages of 16 tokens (one 128-token sequence).
    _, server = _start(loaded, loaded[0], max_batch=4, max_queue=8, context=128, pages=8)
    port = server.port
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0, timeout=60)  # makes no connection yet
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n"]

    def ask(prompt):
        return client.completions.create(model="default", prompt=prompt, max_tokens=40,
                                          temperature=0)

    try:
        alone = {p: ask(p).choices[0].text for p in prompts}
        assert _health(port)["kv_pages"]["preemptions"] == 0
        # 6 requests of ~45 tokens (3 pages each) on 4 slots and 8 pages: two wait for a
        # slot, and the 4 in slots outgrow the pages, so the youngest are preempted.
        flood = prompts * 2
        with concurrent.futures.ThreadPoolExecutor(len(flood)) as pool:
            answers = list(pool.map(ask, flood, timeout=120))
        assert [a.choices[0].text for a in answers] == [alone[p] for p in flood]
        assert all(a.choices[0].finish_reason == "length" for a in answers)
        health = _settled(port)
        assert health["kv_pages"]["preemptions"] > 0, "the pages never ran out"
        assert _all_free(health) and health["requests_total"] == len(prompts) + len(flood)
    finally:
        server.stop()


def test_a_client_gone_mid_prefill_frees_its_pages(loaded, served):
    engine, port, holding = served
    tokens = _health(port)["tokens_total"]
    seen_cancel = threading.Event()
    cancel = engine.cancel

    def cancel_seen(req):  # the app's cancel of a request whose client went away
        cancel(req)
        seen_cancel.set()

    holding.hold, holding.inside = threading.Event(), threading.Event()
    engine.cancel = cancel_seen
    try:
        conn, r = _stream(port, {"prompt": LONG, "max_tokens": 20})
        assert r.status == 200
        assert holding.inside.wait(30)  # its second chunk is under way, held
        health = _health(port)
        assert health["prefilling"] == 1 and health["kv_pages"]["used"] > 0
        _gone(conn)
        assert seen_cancel.wait(10), "the server never noticed the client go"
    finally:
        holding.hold.set()
        holding.hold = None
        del engine.cancel
    health = _settled(port)
    assert _all_free(health)
    assert health["tokens_total"] == tokens  # it never reached its first token


def test_a_client_gone_mid_decode_frees_its_pages(served):
    _, port, _ = served
    before = _health(port)["tokens_total"]
    conn, r = _stream(port, {"prompt": "def f():\n", "max_tokens": 200})
    assert r.status == 200
    _first_text_event(r)
    health = _health(port)
    assert health["active"] == 1 and health["kv_pages"]["used"] > 0
    _gone(conn)
    health = _settled(port)
    assert _all_free(health)
    tokens = health["tokens_total"]
    assert tokens - before < 200  # freed before its 200 tokens, not at their end
    time.sleep(0.3)
    assert _health(port)["tokens_total"] == tokens  # its generation has stopped


def test_past_the_queue_a_503_with_retry_after_and_every_page_free_after(loaded):
    _, server = _start(loaded, loaded[0], max_batch=1, max_queue=1)
    port = server.port
    conns = []
    try:
        # One request in the only slot (decoding), one waiting: the queue is full.
        conns.append(_stream(port, {"prompt": "def f():\n", "max_tokens": 200}))
        _first_text_event(conns[0][1])
        conns.append(_stream(port, {"prompt": "import os\n", "max_tokens": 200}))
        deadline = time.monotonic() + 300  # a hang guard only
        while _health(port)["waiting"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _health(port)["waiting"] == 1
        busy = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                             max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as e:
            busy.completions.create(model="default", prompt="x", max_tokens=4)
        assert e.value.status_code == 503
        assert e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "queue_full"
    finally:
        for conn, _ in conns:
            _gone(conn)
    health = _settled(port)
    assert _all_free(health)
    try:  # and it still serves
        r = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                          max_retries=0, timeout=30).completions.create(
            model="default", prompt="x", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens >= 1
        assert _all_free(_settled(port))
    finally:
        server.stop()
