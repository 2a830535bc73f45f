"""`qfuse serve` on loopback with the bundled model, driven by the official openai client.

Two live servers, each started by conftest's `start_server` on a free port and
stopped after the module: one with an API key and 4 slots (answers, errors,
concurrency, a client that disconnects), one with 1 slot and a queue of 2 (a burst
gets 503s). Every request is bounded in time. The chat page in a browser:
test_chat_page.py.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

KEY = "test-key"


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


@pytest.fixture(scope="module")
def port(start_server) -> int:
    # Batch invariant, so that a request's greedy text is the same alone and in company.
    return start_server("--api-key", KEY, "--max-batch", "4", "--deterministic")


@pytest.fixture(scope="module")
def client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0,
                         timeout=60)


def _health(port: int) -> dict:
    return _raw(port, "GET", "/health")[2]


def test_models_and_health(client, port):
    assert [m.id for m in client.models.list().data] == ["default"]
    health = _health(port)
    assert health["status"] == "ok" and health["slots"] == 4


def test_completion_matches_the_python_api(client):
    import qfuse

    model, tokenizer = qfuse.load(progress=False)
    prompt = "def fibonacci(n):"
    expected = qfuse.generate(model, tokenizer, prompt, max_tokens=24)
    r = client.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "length"
    n_prompt = len(tokenizer.encode(prompt).ids)
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
    conn.request("POST", "/v1/completions", body=body, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    r.fp.readline()  # the first event: the request holds a slot and is decoding
    assert _health(port)["active"] == 1
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 10  # 900 tokens would take far longer than this
    while _health(port)["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _health(port)["active"] == 0
    tokens = _health(port)["tokens_total"]
    time.sleep(0.3)
    assert _health(port)["tokens_total"] == tokens  # its generation has stopped


def test_burst_over_a_small_queue_gets_503(start_server):
    port = start_server("--max-batch", "1", "--max-queue", "2")
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


def test_flag_and_address_errors_are_one_line_before_loading():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for flags, message in (
                (["--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
                (["--host", "no-such-host.invalid"], "--host no-such-host.invalid"),
                (["--cuda-graph", "--device", "cpu"], "--cuda-graph needs a CUDA device")):
            r = subprocess.run([sys.executable, "-m", "qfuse", "serve", *flags],
                               check=False, capture_output=True, text=True, timeout=60)
            assert r.returncode == 2, r.stderr
            assert r.stderr.startswith(f"qfuse: error: {message}") and r.stderr.count("\n") == 1
