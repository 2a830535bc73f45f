"""Fuzzing `qfuse serve`'s HTTP surface: no request may get a 500, hang, or harm the next.

Hypothesis generates a few hundred request bodies for both endpoints: every field the
server reads (and some it refuses or ignores), each with valid values, wrong types and
edge values (NaN, ±inf, -0.0, denormals, int64's bounds and beyond, bools for numbers,
empty and odd strings, lone surrogates), plus bodies that are not JSON objects (cut
short, not UTF-8, nested 100k deep). Against one live server on loopback (conftest's
`start_server`), each answer must be 200, 400 or 404 with the OpenAI shape (a stream:
events up to [DONE], no error event), within the socket timeout. Afterwards the server
still answers /health with no request left in a slot, and a greedy request gets the
same tokens as before the fuzzing.

Bounded so that it cannot be flaky or slow: derandomized (the same examples on every
run, no example database), no per-example deadline (a loaded CI machine), small
max_tokens and n (about 15 s on a 2-core machine).
"""

from __future__ import annotations

import http.client
import json

import pytest

pytest.importorskip("hypothesis")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

EXAMPLES = 300
TIMEOUT_S = 120  # a hang fails the example; the costliest request here takes about 1 s

# Values of every JSON type, edge values first: any field may get any of them.
_EDGE_INTS = [0, 1, -1, 2, 16, 17, 20, 21, 2 ** 31 - 1, 2 ** 31, 2 ** 63 - 1, 2 ** 63,
              -2 ** 63, -2 ** 63 - 1, 2 ** 64, 10 ** 30]
_EDGE_FLOATS = [0.0, -0.0, 1.0, 2.0, 2.0000001, -2.0, 0.5, 1e-9, 1e-300, 5e-324, 1e300,
                float("nan"), float("inf"), float("-inf"), 0.01, 0.0099]
_EDGE_TEXT = ["", " ", "x", "default", "caf\udce9", "\ud83d", "\x00", "日本語", "🦀" * 3,
              "\n", "User:"]
_scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(_EDGE_INTS), st.integers(-2 ** 70, 2 ** 70),
    st.sampled_from(_EDGE_FLOATS), st.floats(), st.sampled_from(_EDGE_TEXT),
    st.text(max_size=8))
_junk = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=6)


def _mostly(usual: st.SearchStrategy, other: st.SearchStrategy) -> st.SearchStrategy:
    """``usual`` most of the time, else ``other`` (hypothesis favours the bounds
    of an integer range, 0 above all: 0 picks ``usual``). Only the one picked is drawn:
    drawing both (most bodies' fields draw ``_junk`` as the other) cost most of the
    test's time."""
    return st.integers(0, 99).flatmap(lambda k: other if k >= 95 else usual)


def _field(*valid) -> st.SearchStrategy:
    """A field's values: mostly ones it accepts (so that a body with many fields gets
    past them all and reaches the engine), else anything at all."""
    return _mostly(st.one_of(*valid), _junk)


def _cheap(value) -> bool:
    """Not a token budget that would make a request slow: 4 to 1024 tokens (more is
    over the context, a 400); None is chat's default, the whole context."""
    return value is not None and not (type(value) is int and 4 <= value <= 1024)


_small = st.integers(1, 3)  # max_tokens: the cost of a request that passes
_budget = _mostly(_small, _junk.filter(_cheap))
_text = st.one_of(st.sampled_from(_EDGE_TEXT), st.text(max_size=12))
_ids = st.lists(_mostly(st.integers(0, 4095), st.sampled_from([-1, 4096, 10 ** 9, True])),
                min_size=1, max_size=6)
_SAMPLING = {
    "model": _field(st.just("default")),
    "max_tokens": _budget,
    "max_completion_tokens": _mostly(st.none(), _budget),  # None: max_tokens counts
    "temperature": _field(st.floats(0, 2)),
    "top_p": _field(st.floats(0, 1, exclude_min=True)),
    "top_k": _field(st.integers(0, 50)),
    "min_p": _field(st.floats(0, 1, exclude_max=True)),
    "repetition_penalty": _field(st.floats(0.01, 2)),
    "presence_penalty": _field(st.floats(-2, 2)),
    "frequency_penalty": _field(st.floats(-2, 2)),
    "seed": _field(st.integers(-2 ** 63, 2 ** 63 - 1)),
    "stop": _field(_text, st.lists(_text, max_size=5)),
    "n": _field(st.integers(1, 3)),
    "stream": _field(st.booleans()),
    "stream_options": _field(st.fixed_dictionaries({}, optional={"include_usage": _junk})),
    "user": _field(_text),
    # Refused by name unless null, and an unknown field (ignored).
    "tools": _mostly(st.none(), _junk), "logit_bias": _mostly(st.none(), _junk),
    "response_format": _mostly(st.none(), _junk), "foo": _junk,
}
_COMPLETION = {
    **_SAMPLING,
    "prompt": _field(_text, st.lists(_text, max_size=3), _ids,
                     st.lists(_ids, max_size=3)),
    "logprobs": _field(st.integers(0, 20)),
    "echo": _field(st.booleans()),
    "suffix": _mostly(st.none(), _junk),
}
_part = st.fixed_dictionaries({"type": _field(st.just("text")), "text": _field(_text)})
_message = st.fixed_dictionaries(
    {"role": _field(st.sampled_from(["user", "system", "developer", "assistant"])),
     "content": _field(_text, st.lists(_part, max_size=2))},
    optional={"name": _junk})
_CHAT = {
    **_SAMPLING,
    "messages": _field(st.lists(_message, min_size=1, max_size=3)),
    "logprobs": _field(st.booleans()),
    "top_logprobs": _field(st.integers(0, 20)),
}


def _body(fields: dict, required: str) -> st.SearchStrategy:
    """Bodies with max_tokens, the required field (but one time in ten) and any of the
    others."""
    full = st.fixed_dictionaries(
        {"max_tokens": fields["max_tokens"], required: fields[required]},
        optional={k: v for k, v in fields.items() if k not in ("max_tokens", required)})
    return _mostly(full, full.map(lambda body: {k: v for k, v in body.items()
                                                if k != required}))


def _encode(body: dict, ascii_only: bool) -> bytes:
    # Python writes NaN and ±Infinity, and a lone surrogate as its \u escape (or, not
    # ascii-only, as bytes that are no UTF-8).
    return json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


_raw_bodies = st.one_of(
    st.binary(max_size=16),
    st.sampled_from([b"", b"{", b'{"prompt": "x",', b"[]", b"null", b"1", b'"x"',
                     b"\xff\xfe", b'{"prompt": "x"}\x00', b"[" * 100_000,
                     b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"]))
_requests = _mostly(
    st.one_of(st.tuples(st.just("/v1/completions"),
                        st.builds(_encode, _body(_COMPLETION, "prompt"), st.booleans())),
              st.tuples(st.just("/v1/chat/completions"),
                        st.builds(_encode, _body(_CHAT, "messages"), st.booleans()))),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), _raw_bodies))


def _post(port: int, path: str, raw: bytes) -> tuple[int, str, bytes]:
    """(status, content type, body) of one POST, read to its end."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", path, body=raw, headers={"Content-Type": "application/json",
                                                     "Connection": "close"})
        r = conn.getresponse()
        return r.status, r.getheader("content-type", ""), r.read()
    finally:
        conn.close()


def _check_answer(status: int, kind: str, body: bytes, raw: bytes) -> None:
    where = f"{raw[:300]!r} -> {status} {body[:300]!r}"
    assert status in (200, 400, 404), where
    if status != 200:
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["message"], where
        assert error["param"] is None or isinstance(error["param"], str), where
        return
    if kind.startswith("text/event-stream"):
        events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
        assert events and events[-1] == b"[DONE]", where  # no error event, no cut stream
        for event in events[:-1]:
            assert "choices" in json.loads(event), where
    else:
        answer = json.loads(body)
        assert answer["choices"] and answer["usage"]["completion_tokens"] >= 0, where


@pytest.fixture(scope="module")
def port(start_server) -> int:
    return start_server("--max-batch", "4")


def _greedy(port: int) -> str:
    raw = json.dumps({"prompt": "def fibonacci(n):", "max_tokens": 12,
                      "temperature": 0}).encode()
    status, _, body = _post(port, "/v1/completions", raw)
    assert status == 200, body
    return json.loads(body)["choices"][0]["text"]


def test_fuzzed_requests_get_no_500_and_the_server_serves_on(port):
    usual = _greedy(port)
    seen = {"answered": 0, "200": 0}

    # No shrinking: a failure is reported as generated (a small body), because shrinking
    # would resend requests to a server that may hang, each until the timeout.
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])
    @given(_requests)
    def fuzz(request):
        path, raw = request
        status, kind, body = _post(port, path, raw)
        _check_answer(status, kind, body, raw)
        seen["answered"] += 1
        seen["200"] += status == 200

    fuzz()
    # The examples reached the engine too, not only the door.
    assert seen["answered"] >= EXAMPLES and seen["200"] >= EXAMPLES // 10, seen
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    conn.request("GET", "/health")
    health = json.loads(conn.getresponse().read())
    conn.close()
    assert health["status"] == "ok" and health["active"] == 0 and health["waiting"] == 0
    assert _greedy(port) == usual
