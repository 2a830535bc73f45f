"""`qfuse serve` on loopback with the tiny test model (served as "default", the bundled
model's name), driven by the official openai client; the two stopped by signals serve
the bundled model.

Live servers, each started by conftest's `start_server` on a free port and stopped
after the module: one with an API key and 4 slots (answers, errors, fields that
would break the engine's step, concurrency, a client that disconnects), and the same
with `--async-scheduling`; one with 1
slot and a queue of 2 that allows two origins (a burst gets 503s; CORS), one whose
sampling fails for one request (the others' streams go on). Two more are started to
be stopped: with Ctrl-C twice, and with SIGTERM (the drain keeps /health up). Every
request is bounded in time. The chat page in a browser: test_chat_page.py; fuzzing:
test_serve_fuzz.py.
"""

from __future__ import annotations

import concurrent.futures
import functools
import http.client
import json
import os
import re
import signal
import socket
import sys
import threading
import time

import pytest

from .conftest import TINY_MODEL

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

KEY = "test-key"
# These servers are tests of the server, not of the model: the tiny one decodes ~4x faster.
TINY = (str(TINY_MODEL), "--served-model-name", "default")
# How long a wait for the server to settle may take before the test fails: a hang guard
# only, far above the fraction of a second it takes; what the test proves is said by
# counts (tokens generated, requests cut off), never by how soon.
SETTLE_S = 300


def _raw(port: int, method: str, path: str, body: bytes | None = None,
         headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), json.loads(r.read() or b"null")
    finally:
        conn.close()


def _http(port: int, method: str, path: str, body: bytes | None = None,
          headers: dict | None = None) -> tuple[int, dict, str]:
    """(status, headers by lower-case name, body text) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    finally:
        conn.close()


@pytest.fixture(scope="module", params=[(), ("--async-scheduling",)],
                ids=["sync", "async-scheduling"])
def port(start_server, request) -> int:
    # Batch invariant, so that a request's greedy text is the same alone and in company;
    # every test on it runs again with each step launched before the last one's tokens
    # are read (the engine's async scheduling).
    return start_server(*TINY, "--api-key", KEY, "--max-batch", "4", "--deterministic",
                        *request.param)


@pytest.fixture(scope="module")
def client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0,
                         timeout=60)


def _health(port: int) -> dict:
    return _raw(port, "GET", "/health")[2]


@pytest.fixture(scope="module")
def python_api_completion(tiny_loaded) -> tuple[str, str, int]:
    """(prompt, its 24 greedy tokens' text from the Python API, the prompt's tokens): the
    same for both servers, so generated once."""
    import qfuse

    model, tokenizer = tiny_loaded
    prompt = "def fibonacci(n):"
    return (prompt, qfuse.generate(model, tokenizer, prompt, max_tokens=24),
            len(tokenizer.encode(prompt).ids))


@pytest.fixture(scope="module")
def small_port(start_server) -> int:
    """A server with 1 slot and a queue of 2 that allows two origins: the burst test's
    small queue and the CORS test's origins, one start for both (a burst's requests
    carry no origin; the CORS test's come one at a time)."""
    return start_server(*TINY, "--max-batch", "1", "--max-queue", "2",
                        "--allowed-origins", f"{ORIGIN}, https://app.example.com")


def test_models_and_health(client, port):
    assert [m.id for m in client.models.list().data] == ["default"]
    health = _health(port)
    assert health["status"] == "ok" and health["slots"] == 4
    # What it started with and why, as its start-up line said (no GPU here: no graphs).
    startup = health["startup"]
    assert (startup["slots"], startup["slots_reason"], startup["cuda_graph"]) == \
        (4, "--max-batch", False)
    assert startup["kv_cache_bytes"] > 0 and startup["context"] == health["context_length"]
    assert startup["summary"].startswith("qfuse serve: slots 4 (--max-batch; KV cache ")


def test_models_retrieve_gives_the_entry_or_an_openai_404(client, port):
    entry = client.models.retrieve("default")
    assert entry == client.models.list().data[0]
    assert (entry.id, entry.object, entry.owned_by) == ("default", "model", "qfuse")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    error = e.value.body
    assert (error["type"], error["param"], error["code"]) == \
        ("invalid_request_error", "model", "model_not_found")
    assert "'gpt-9'" in error["message"] and "'default'" in error["message"]
    status, _, body = _raw(port, "GET", "/v1/models/default")  # a key, as for the list
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_completion_matches_the_python_api(client, python_api_completion):
    prompt, expected, n_prompt = python_api_completion
    r = client.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (n_prompt, 24, n_prompt + 24)


def test_streamed_equals_whole_with_usage(client):
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    whole = client.chat.completions.create(model="default", messages=messages, max_tokens=20,
                                           temperature=0)
    stream = client.chat.completions.create(model="default", messages=messages, max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert whole.usage.completion_tokens == 20 or whole.choices[0].finish_reason == "stop"

    stream = client.completions.create(model="default", prompt="import os\n", max_tokens=12,
                                       temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in stream)
    assert text == client.completions.create(model="default", prompt="import os\n",
                                             max_tokens=12, temperature=0).choices[0].text


def test_completion_prompt_lists_give_a_choice_each(client):
    from qfuse.loading import DEFAULT_MODEL, load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n"]

    def ask(prompt, **kw):
        return client.completions.create(model="default", prompt=prompt, max_tokens=10,
                                         temperature=0, **kw)

    solo = [ask(p) for p in prompts]
    alone = [r.choices[0].text for r in solo]
    ids = [tokenizer.encode(p).ids for p in prompts]
    # The string is encoded with the tokenizer's special tokens; ids go in as they are.
    assert ask(ids[0]).choices[0].text == alone[0]
    for prompt in (prompts, ids):
        r = ask(prompt)
        assert [(c.index, c.text) for c in r.choices] == list(enumerate(alone))
        assert r.usage.prompt_tokens == sum(map(len, ids))
        assert r.usage.completion_tokens == sum(x.usage.completion_tokens for x in solo)
    # n choices for each prompt, prompt p's at p*n ..; streamed, each index gets its text.
    chunks = list(ask(prompts[:2], n=2, stream=True))
    texts = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: alone[0], 1: alone[0], 2: alone[1], 3: alone[1]}
    echoed = ask(ids[1:], echo=True).choices[0].text
    assert echoed == tokenizer.decode(ids[1]) + alone[1]

    for bad in ([], [[]], [1, "x"], [[1], "x"], [True], [[10 ** 9]], [-1], 5):
        with pytest.raises(openai.BadRequestError) as e:
            ask(bad)
        assert e.value.body["param"] == "prompt", bad
    with pytest.raises(openai.BadRequestError) as e:
        ask(["x"] * 17, n=4)  # 68 choices, over the limit of 64
    assert "choices" in e.value.body["message"]


def test_stop_string_cuts_the_text(client):
    prompt = "class Stack:\n"
    full = client.completions.create(model="default", prompt=prompt, max_tokens=24,
                                     temperature=0).choices[0].text
    stop = full[5:8]  # a string the greedy text contains
    cut = full[: full.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model="default", prompt=prompt, max_tokens=24,
                                      temperature=0, stop=[stop], stream=stream)
        if stream:
            chunks = list(r)
            assert "".join(c.choices[0].text for c in chunks) == cut
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"


@functools.cache
def _ids_by_text() -> dict[str, int]:
    """The bundled tokenizer's token ids by their text, for the texts one id alone has."""
    from collections import Counter

    from qfuse.loading import DEFAULT_MODEL, load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    texts = [tokenizer.decode([i]) for i in range(tokenizer.get_vocab_size())]
    count = Counter(texts)
    return {t: i for i, t in enumerate(texts) if count[t] == 1}


def _a_stop_token(tokens: list[str], ids: dict[str, int]) -> tuple[int, int]:
    """(k, id): a token of the greedy reply ``tokens`` (their texts), k > 0, whose
    id is known from its text and which first appears at k."""
    return next((k, ids[t]) for k, t in enumerate(tokens)
                if k and t in ids and t not in tokens[:k])


def test_stop_token_ids_end_the_text_before_the_token(client):
    ids = _ids_by_text()
    prompt = "def fibonacci(n):"
    tokens = client.completions.create(model="default", prompt=prompt, max_tokens=24,
                                       temperature=0, logprobs=0).choices[0].logprobs.tokens
    k, stop = _a_stop_token(tokens, ids)
    for stream in (False, True):
        r = client.completions.create(
            model="default", prompt=prompt, max_tokens=24, temperature=0, stream=stream,
            extra_body={"stop_token_ids": [stop]},
            **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            text, reason, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        # The stop token is neither in the text nor counted, as the EOS token is not.
        assert (text, reason, usage.completion_tokens) == ("".join(tokens[:k]), "stop", k)

    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    content = client.chat.completions.create(model="default", messages=messages,
                                             max_tokens=24, temperature=0,
                                             logprobs=True).choices[0].logprobs.content
    tokens = [entry.token for entry in content]
    k, stop = _a_stop_token(tokens, ids)
    chunks = list(client.chat.completions.create(
        model="default", messages=messages, max_tokens=24, temperature=0, stream=True,
        extra_body={"stop_token_ids": [stop, next(i for t, i in ids.items()
                                                  if t not in tokens)]}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "".join(tokens[:k])
    assert chunks[-1].choices[0].finish_reason == "stop"

    for bad in ([len(ids) * 100], [-1], ["1"], list(range(65))):  # checked at the door
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="default", messages=messages, max_tokens=2,
                                           extra_body={"stop_token_ids": bad})
        assert e.value.body["param"] == "stop_token_ids", e.value.body


def test_seed_reproduces_and_n_choices(client):
    def ask(seed, n=1):
        return client.completions.create(model="default", prompt="def main():\n", n=n,
                                         max_tokens=16, temperature=1.0, top_p=0.95,
                                         seed=seed)

    a, b = ask(7), ask(7)
    assert a.choices[0].text == b.choices[0].text
    others = {ask(s).choices[0].text for s in (8, 9, 10)}
    assert len(others | {a.choices[0].text}) > 1  # sampling, not greedy
    two = ask(7, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == a.choices[0].text  # choice i samples with seed + i
    assert two.usage.completion_tokens == sum(
        len(client.completions.create(model="default", prompt="def main():\n", max_tokens=16,
                                      temperature=1.0, top_p=0.95, seed=7 + i,
                                      logprobs=0).choices[0].logprobs.tokens)
        for i in range(2))


def test_logprobs(client):
    r = client.chat.completions.create(model="default", max_tokens=8, temperature=0,
                                       messages=[{"role": "user", "content": "hi"}],
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the top
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_penalties_change_the_greedy_text(client):
    def ask(**kw):
        return client.completions.create(model="default", prompt="x = [", max_tokens=24,
                                         temperature=0, **kw).choices[0].text

    plain = ask()
    assert ask(frequency_penalty=2.0) != plain
    assert ask(extra_body={"repetition_penalty": 1.5}) != plain


def test_errors_have_statuses_and_the_server_keeps_serving(client, port):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong",
                      max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt="x", max_tokens=5000)
    assert "context" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt="x", max_tokens=2, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", max_tokens=2, messages=[
            {"role": "user", "content": "x"}], tools=[{"type": "function", "function": {
                "name": "f", "parameters": {}}}])
    assert e.value.body["param"] == "tools"

    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    status, _, body = _raw(port, "POST", "/v1/completions", b'{"prompt": "x",', auth)
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, _, body = _raw(port, "POST", "/v1/completions", b"[1, 2]", auth)
    assert status == 400 and "object" in body["error"]["message"]
    huge = json.dumps({"prompt": "x" * (9 << 20), "max_tokens": 1}).encode()
    status, _, body = _raw(port, "POST", "/v1/completions", huge, auth)
    assert status == 413 and body["error"]["code"] == "body_too_large"
    status, _, body = _raw(port, "GET", "/v1/nothing", None, auth)
    assert status == 404 and "error" in body
    assert client.completions.create(model="default", prompt="x", max_tokens=2,
                                     temperature=0).usage.completion_tokens >= 1


def test_concurrent_streams_match_their_solo_text(client, port):
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n", "for i in range(",
               "x = [", "def main():\n", "try:\n", "with open(", "if __name__ ==",
               "return ", "while True:\n", "print(", "from typing import", "async def ",
               "# sort the list\n", "lambda x:"]

    def run(prompt):
        stream = client.completions.create(model="default", prompt=prompt, max_tokens=16,
                                           temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream)

    alone = [run(p) for p in prompts]
    # 16 streams over 4 slots: most wait in the queue and join between decode steps.
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(run, prompts))
    assert together == alone
    assert _health(port)["active"] == 0


def test_disconnect_frees_the_slot(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = json.dumps({"prompt": "def f():\n", "max_tokens": 900, "temperature": 0,
                       "stream": True}).encode()
    before = _health(port)["tokens_total"]
    conn.request("POST", "/v1/completions", body=body, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    r.fp.readline()  # the first event: the request holds a slot and is decoding
    assert _health(port)["active"] == 1
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + SETTLE_S
    while _health(port)["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _health(port)["active"] == 0
    tokens = _health(port)["tokens_total"]
    assert tokens - before < 900  # freed before its 900 tokens, not at their end
    time.sleep(0.3)
    assert _health(port)["tokens_total"] == tokens  # its generation has stopped


def test_burst_over_a_small_queue_gets_503(small_port):
    port = small_port
    body = json.dumps({"prompt": "x", "max_tokens": 8, "temperature": 0}).encode()

    def post(_):
        return _raw(port, "POST", "/v1/completions", body,
                    {"Content-Type": "application/json"})

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(post, range(200)))
    statuses = [s for s, _, _ in results]
    assert set(statuses) == {200, 503} and statuses.count(200) >= 3
    busy = next(r for r in results if r[0] == 503)
    assert busy[1]["retry-after"] == "1" and busy[2]["error"]["code"] == "queue_full"
    ok = next(r for r in results if r[0] == 200)
    assert ok[2]["usage"]["completion_tokens"] >= 1
    assert post(0)[0] == 200  # still serving


ORIGIN = "http://localhost:3000"


def test_cors_is_off_by_default_and_answers_only_the_allowed_origins(small_port, port):
    origin = ORIGIN
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os"}
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    json_from = {"Content-Type": "application/json", "Origin": origin}
    # Off (this module's server): the preflight's 405 says why; no answer allows the origin.
    status, headers, text = _http(port, "OPTIONS", "/v1/completions", headers=preflight)
    assert status == 405 and headers["allow"] == "POST", (status, headers)
    assert "--allowed-origins" in json.loads(text)["error"]["message"]
    status, headers, _ = _http(port, "POST", "/v1/completions", body,
                               {**json_from, "Authorization": f"Bearer {KEY}"})
    assert status == 200 and "access-control-allow-origin" not in headers

    on = small_port
    status, headers, _ = _http(on, "OPTIONS", "/v1/completions", headers=preflight)
    assert status == 200 and headers["access-control-allow-origin"] == origin
    assert "POST" in headers["access-control-allow-methods"]
    assert headers["access-control-allow-headers"] == \
        preflight["Access-Control-Request-Headers"]  # the client's own headers too
    status, headers, _ = _http(on, "OPTIONS", "/v1/completions",
                               headers={**preflight, "Origin": "https://elsewhere.example"})
    assert status == 400 and "access-control-allow-origin" not in headers
    for allowed in (origin, "https://app.example.com"):
        for stream in (False, True):
            raw = json.dumps({"prompt": "x", "max_tokens": 2, "stream": stream}).encode()
            status, headers, _ = _http(on, "POST", "/v1/completions", raw,
                                       {**json_from, "Origin": allowed})
            assert status == 200 and headers["access-control-allow-origin"] == allowed
    # Another origin is answered too (CORS binds browsers), but not allowed to read it.
    status, headers, _ = _http(on, "POST", "/v1/completions", body,
                               {**json_from, "Origin": "https://elsewhere.example"})
    assert status == 200 and "access-control-allow-origin" not in headers
    status, headers, _ = _http(on, "GET", "/health", headers={"Origin": origin})
    assert status == 200 and headers["access-control-allow-origin"] == origin


def test_flag_and_address_errors_are_one_line_before_loading(qfuse_here, monkeypatch):
    import qfuse.from_flags

    def load_model_from_flags(args):  # in this process a missed check would serve on
        raise AssertionError("the model loaded before the mistake was reported")

    monkeypatch.setattr(qfuse.from_flags, "load_model_from_flags", load_model_from_flags)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for flags, message in (
                (["--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
                (["--host", "no-such-host.invalid"], "--host no-such-host.invalid"),
                (["--cuda-graph", "--device", "cpu"], "--cuda-graph needs a CUDA device"),
                (["--prefill-chunk", "-1"], "--prefill-chunk must be at least 0"),
                (["--allowed-origins", "http://localhost:3000/"],
                 "--allowed-origins: 'http://localhost:3000/' is not an origin"),
                (["--allowed-origins", "*,http://a.example"], "--allowed-origins: '*' is")):
            r = qfuse_here("serve", *flags)
            assert r.returncode == 2, r.stderr
            assert r.stderr.startswith(f"qfuse: error: {message}") and r.stderr.count("\n") == 1


def test_fields_that_would_break_the_step_are_400s_naming_them(client, port):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    nan, inf = float("nan"), float("inf")
    # Python's JSON writer sends NaN and Infinity, as Python's reader accepts them.
    for field, value in (("seed", 2 ** 63), ("seed", -2 ** 63 - 1), ("temperature", nan),
                         ("repetition_penalty", inf), ("presence_penalty", nan),
                         ("frequency_penalty", -inf), ("top_p", nan), ("min_p", inf),
                         ("max_tokens", 2 ** 70), ("n", True)):
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                   "content": "x"}]})):
            raw = json.dumps({**body, "max_tokens": 2, field: value}).encode()
            status, _, answer = _raw(port, "POST", path, raw, auth)
            assert status == 400 and answer["error"]["param"] == field, (raw, answer)
    status, _, answer = _raw(port, "POST", "/v1/completions",
                             b'{"prompt": "x", "temperature": 1e999}', auth)  # read as inf
    assert status == 400 and answer["error"]["param"] == "temperature", answer
    # A lone surrogate (JSON's escape of half a UTF-16 pair) and a 100k-deep body.
    for raw in (b'{"prompt": "caf\\udce9", "max_tokens": 2}',
                b'{"messages": [{"role": "user", "content": "caf\\udce9"}]}',
                b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                b"[" * 100_000):
        status, _, answer = _raw(port, "POST", "/v1/completions", raw, auth)
        assert status == 400 and answer["error"]["code"] == "invalid_json", answer
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", max_tokens=2, messages=[
            {"role": "robot", "content": "x"}])
    assert e.value.body["param"] == "messages" and "role" in e.value.body["message"]
    # The last seed with n=2: the second choice's seed wraps around within int64.
    r = client.completions.create(model="default", prompt="x", max_tokens=2, n=2,
                                  seed=2 ** 63 - 1, temperature=1.0)
    assert len(r.choices) == 2
    assert _health(port)["active"] == 0


def _stream(port: int, body: dict, headers: dict | None = None):
    """A streamed POST /v1/completions: the response, read line by line (r.fp.readline)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}).encode(),
                 headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    assert r.status == 200
    return r


def _events(r) -> list[dict]:
    """The rest of a stream's events, to [DONE] (as {"done": True}) or an error event."""
    out = []
    while not out or not ("done" in out[-1] or "error" in out[-1]):
        out.append(_event(r))
    return out


def _event(r) -> dict:
    """The next event of a stream (the raw chunked body: its size lines are skipped)."""
    while line := r.fp.readline():
        if line.startswith(b"data: "):
            data = line[6:].strip()
            return {"done": True} if data == b"[DONE]" else json.loads(data)
    raise AssertionError("the stream ended without [DONE] or an error event")


def _text(events: list[dict]) -> str:
    return "".join(c["text"] for e in events for c in e.get("choices", []))


# Loaded by the server's interpreter (PYTHONPATH): the sampling of the one request
# seeded POISON raises at its 3rd token, as a bug in one sequence's sampling would.
POISON = 13
_POISONED_SAMPLING = f'''"""qfuse serve's sampling, made to fail for one request (tests/test_serve.py)."""
import qfuse.serving.sampler as sampler

_real, _calls = sampler.sample, []


def sample(x, params, seen, generator):
    if params.seed == {POISON}:
        _calls.append(1)
        if len(_calls) == 3:
            raise RuntimeError("poisoned sampling")
    return _real(x, params, seen, generator)


sampler.sample = sample
'''


def test_a_poisoned_request_ends_alone_while_8_streams_go_on(start_server, tmp_path,
                                                             monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(_POISONED_SAMPLING)
    # The server started now imports it (the test's own path stays, after it).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    port = start_server(*TINY, "--max-batch", "9", "--deterministic")
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n", "for i in range(",
               "x = [", "def main():\n", "try:\n", "with open("]
    # 40 tokens each: still running when the poisoned one fails at its third.
    body = {"max_tokens": 40, "temperature": 0}
    alone = [_text(_events(_stream(port, {**body, "prompt": p}))) for p in prompts]
    assert all(alone)

    # 8 streams, each under way (its first event read) before the poisoned one comes.
    under_way = threading.Barrier(len(prompts) + 1, timeout=60)

    def run(prompt):
        r = _stream(port, {**body, "prompt": prompt})
        first = _event(r)
        under_way.wait()
        return _text([first] + _events(r))

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        streams = [pool.submit(run, p) for p in prompts]
        under_way.wait()
        poisoned = _events(_stream(port, {"prompt": "x = [", "max_tokens": 12,
                                          "temperature": 0.8, "seed": POISON}))
        in_flight = _health(port)["active"]  # the others outlive the poisoned one
        together = [f.result(timeout=60) for f in streams]
    assert in_flight > 0
    assert together == alone
    assert len(_text(poisoned)) > 0 and "error" in poisoned[-1], poisoned  # 2 tokens, then
    assert {"done": True} not in poisoned
    health = _health(port)
    assert health["active"] == 0 and health["waiting"] == 0
    assert _text(_events(_stream(port, {**body, "prompt": prompts[0]}))) == alone[0]



@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_first_ctrl_c_drains_the_streams_and_the_second_stops_at_once():
    from .test_cli_interrupts import Qfuse

    q = Qfuse("serve", "--port", "0")
    q.wait_for("the start line", lambda: "/v1 (" in q.err)
    port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", q.err)[1])
    short = {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0}
    alone = _text(_events(_stream(port, short)))
    # Both streams under way (a first event each): the short one ends within the
    # drain; the long one (900 tokens, far longer than this test) is still going.
    long, brief = _stream(port, {**short, "max_tokens": 900}), _stream(port, short)
    first_long, first_brief = _event(long), _event(brief)
    q.interrupt()
    q.wait_for("the draining line", lambda: "draining" in q.err)
    assert "qfuse serve: draining 2 requests in flight; press Ctrl-C again to stop at " \
           "once" in q.err, q.err
    _assert_draining(port)
    rest = _events(brief)
    assert _text([first_brief, *rest]) == alone and rest[-1] == {"done": True}
    assert _text([first_long, _event(long), _event(long)])  # still streaming after Ctrl-C
    assert q.proc.poll() is None
    q.interrupt()
    assert q.finish() == 130  # at once: the line below says the 900 tokens were cut off
    assert "qfuse serve: stopped at once; 1 request in flight cut off" in q.err, q.err
    assert "Traceback" not in q.err + q.out, q.err


def _assert_draining(port: int) -> None:
    """The server drains: /health and /metrics answer, new work is a 503 saying why."""
    import importlib.util

    status, _, text = _http(port, "GET", "/health")
    assert status == 200 and json.loads(text)["status"] == "draining", text
    status, _, text = _http(port, "GET", "/metrics")
    if importlib.util.find_spec("prometheus_client") is not None:
        assert status == 200 and "vllm:num_requests_running" in text, text
    else:  # the server runs without it, and says so
        assert status == 503 and "prometheus_client" in text, text
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "x"}]})):
        status, _, text = _http(port, "POST", path, json.dumps(body).encode(),
                                {"Content-Type": "application/json"})
        error = json.loads(text)["error"]
        assert status == 503 and error["code"] == "shutting_down", text
        assert "shutting down" in error["message"] and "\n" not in error["message"]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_drains_with_health_up_and_new_work_refused_then_exits():
    from .test_cli_interrupts import DEADLINE_S, Qfuse

    q = Qfuse("serve", "--port", "0")
    q.wait_for("the start line", lambda: "/v1 (" in q.err)
    port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", q.err)[1])
    short = {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0}
    alone = _text(_events(_stream(port, short)))
    # A long stream (900 tokens, far longer than this test) on a connection of its own,
    # which the test closes to end the drain, and a short one that finishes within it.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({**short, "max_tokens": 900, "stream": True}).encode())
    long = conn.getresponse()
    brief = _stream(port, short)
    first_long, first_brief = _event(long), _event(brief)
    q.proc.send_signal(signal.SIGTERM)
    q.wait_for("the draining line", lambda: "draining" in q.err)
    assert "qfuse serve: draining 2 requests in flight" in q.err, q.err
    _assert_draining(port)
    rest = _events(brief)
    assert _text([first_brief, *rest]) == alone and rest[-1] == {"done": True}
    assert _text([first_long, _event(long), _event(long)])  # still streaming
    _assert_draining(port)  # until the last request in flight is done
    assert q.proc.poll() is None
    conn.sock.shutdown(socket.SHUT_RDWR)  # its client goes: nothing is left in flight
    conn.close()
    q.proc.wait(timeout=DEADLINE_S)  # a hang guard: it stops on its own once drained
    # uvicorn raises the SIGTERM again once it has stopped, as it always has.
    assert q.finish() == -signal.SIGTERM, q.err
    assert "Traceback" not in q.err + q.out, q.err
