"""`GET /metrics` of `qfuse serve` on loopback: what it counts is what was served.

One live server in this process (`serving.server.Background` over an engine with the
tiny test model, 2 slots, an API key), driven by the official openai client: after a whole
completion and a streamed chat, the scrape parses as Prometheus text and its counters
move by the usage the two replies report (TTFT and end-to-end counts by 2, inter-token
gaps by one less than each reply's tokens); at rest nothing runs, waits or holds KV,
and while a stream decodes, it runs and holds a slot. Without prometheus-client the app
still serves and /metrics is a 503 that says why.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import sys
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families

KEY = "test-key"
SLOTS = 2
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format


@pytest.fixture(scope="module")
def loaded(tiny_loaded):
    """The tiny test model: these tests are of the server, not of the bundled model."""
    return tiny_loaded


def _serve(model, tokenizer, max_batch: int):
    """(engine, server): a started engine and a live server over it on a free port."""
    from qfuse.serving.engine import Engine
    from qfuse.serving.in_process import serve_in_process

    engine = Engine(model, tokenizer, max_batch=max_batch)
    server = serve_in_process(engine, tokenizer, model.config.vocab_size, api_key=KEY)
    return engine, server


@pytest.fixture(scope="module")
def served(loaded):
    engine, server = _serve(*loaded, SLOTS)
    yield engine, server.port
    server.stop()  # its lifespan stops the engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served[1]}/v1", api_key=KEY,
                         max_retries=0, timeout=60)


def _get(port: int, path: str, headers: dict | None = None) -> tuple[int, str, str]:
    """(status, content type, body) of GET ``path``, without the API key."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.getheader("content-type"), r.read().decode()
    finally:
        conn.close()


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels but model_name): value}; every sample
    must carry model_name="default"."""
    status, content_type, text = _get(port, "/metrics")
    assert status == 200, text
    assert content_type == TEXT_FORMAT
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == "default", s
            out[s.name, tuple(sorted(labels.items()))] = s.value
    return out


def _moved(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


def test_counters_and_histograms_move_by_what_was_served(client, served):
    _, port = served
    before = _scrape(port)
    start = time.monotonic()
    whole = client.completions.create(model="default", prompt="def fibonacci(n):",
                                      max_tokens=8, temperature=0)
    whole_s = time.monotonic() - start
    start = time.monotonic()
    chunks = list(client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Add two numbers."}],
        max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}))
    stream_s = time.monotonic() - start
    streamed = chunks[-1].usage
    reasons = [whole.choices[0].finish_reason,
               [c.choices[0].finish_reason for c in chunks if c.choices][-1]]
    after = _scrape(port)

    usages = (whole.usage, streamed)
    assert _moved(before, after, "vllm:prompt_tokens_total") == \
        sum(u.prompt_tokens for u in usages)
    assert _moved(before, after, "vllm:generation_tokens_total") == \
        sum(u.completion_tokens for u in usages)
    assert all(u.completion_tokens >= 1 for u in usages)
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert _moved(before, after, name + "_count") == 2
        assert _moved(before, after, name + "_bucket", le="+Inf") == 2
    # The first tokens came within each request's time, and the last events too.
    assert 0 < _moved(before, after, "vllm:time_to_first_token_seconds_sum") \
        < whole_s + stream_s
    assert 0 < _moved(before, after, "vllm:e2e_request_latency_seconds_sum") \
        < whole_s + stream_s
    assert _moved(before, after, "vllm:inter_token_latency_seconds_count") == \
        sum(u.completion_tokens - 1 for u in usages)
    for reason in ("stop", "length"):
        assert _moved(before, after, "vllm:request_success_total",
                      finished_reason=reason) == reasons.count(reason)

    # At rest: nothing runs, waits or holds the KV cache.
    for name, value in (("vllm:num_requests_running", 0), ("vllm:num_requests_waiting", 0),
                        ("vllm:kv_cache_usage_perc", 0), ("qfuse:kv_cache_slots_used", 0),
                        ("qfuse:kv_cache_slots_free", SLOTS), ("qfuse:kv_cache_tokens", 0),
                        ("qfuse:kv_cache_capacity_tokens", SLOTS * served[0].context)):
        assert after[name, ()] == value, name


def test_a_decoding_stream_runs_and_holds_a_slot(served):
    _, port = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    prompt = [5, 6, 7, 8]
    body = json.dumps({"prompt": prompt, "max_tokens": 900, "temperature": 0,
                       "stream": True}).encode()
    conn.request("POST", "/v1/completions", body=body, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    while not r.fp.readline().startswith(b"data: "):  # its first event: it is decoding
        pass
    during = _scrape(port)
    conn.sock.shutdown(socket.SHUT_RDWR)  # 900 tokens would take far longer than this test
    conn.close()
    assert during["vllm:num_requests_running", ()] == 1
    assert during["qfuse:kv_cache_slots_used", ()] == 1
    assert during["qfuse:kv_cache_slots_free", ()] == SLOTS - 1
    assert during["vllm:kv_cache_usage_perc", ()] == 1 / SLOTS
    assert during["qfuse:kv_cache_tokens", ()] >= len(prompt)
    deadline = time.monotonic() + 300  # a hang guard only: the slot frees in well under 1 s
    while _scrape(port)["vllm:num_requests_running", ()] and time.monotonic() < deadline:
        time.sleep(0.05)
    rest = _scrape(port)
    assert rest["vllm:num_requests_running", ()] == 0 and rest["qfuse:kv_cache_tokens", ()] == 0


def test_prometheus_text_whatever_the_scraper_prefers(served):
    # Prometheus 2's Accept header prefers OpenMetrics, whose prometheus-client writer
    # would spell vLLM's colons two ways (see `Metrics.expose`).
    accept = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
              "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
    status, content_type, text = _get(served[1], "/metrics", {"Accept": accept})
    assert status == 200 and content_type == TEXT_FORMAT
    assert "vllm:time_to_first_token_seconds_bucket{" in text and "vllm_" not in text


def test_without_prometheus_client_metrics_is_a_503_and_the_rest_serves(loaded, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # its import fails
    _, server = _serve(*loaded, 1)
    try:
        status, _, text = _get(server.port, "/metrics")
        assert status == 503 and text.count("\n") == 1
        assert "prometheus-client" in text and "qfuse[serve]" in text
        reply = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY,
                              max_retries=0, timeout=60).completions.create(
            model="default", prompt="x", max_tokens=2, temperature=0)
        assert reply.usage.completion_tokens >= 1
    finally:
        server.stop()


@pytest.mark.parametrize("created", [True, False])
def test_the_per_token_metrics_write_what_prometheus_client_writes(created, monkeypatch):
    """The two metrics every token moves are plain numbers in the app; a scrape writes
    them exactly as prometheus-client's own Counter and Histogram write the same
    observations (samples, labels, order, the sum to the last bit), with or without
    _created samples."""
    import random

    import prometheus_client.metrics
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from qfuse.serving import metrics

    if not created:  # what PROMETHEUS_DISABLE_CREATED_SERIES does, undone after the test
        monkeypatch.setattr(prometheus_client.metrics, "_use_created", False)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    counter = metrics.TokenCounter("a:tokens", "Tokens.", "m")
    histogram = metrics.TokenHistogram("a:gaps_seconds", "Gaps.", "m", metrics.ITL_BUCKETS)
    ours.register(counter)
    ours.register(histogram)
    their_counter = Counter("a:tokens", "Tokens.", ["model_name"], registry=theirs).labels("m")
    their_histogram = Histogram("a:gaps_seconds", "Gaps.", ["model_name"],
                                buckets=metrics.ITL_BUCKETS, registry=theirs).labels("m")
    rng = random.Random(0)
    gaps = [rng.expovariate(50) for _ in range(5000)] + list(metrics.ITL_BUCKETS) + [0.0, 1e4]
    for gap in gaps:
        counter.value += 1
        their_counter.inc()
        histogram.observe(gap)
        their_histogram.observe(gap)
    def masked(registry):  # creation times: each made its own
        text = generate_latest(registry).decode()
        return re.sub(r'(_created\{model_name="m"\}) \S+', r"\1 T", text), text

    (ours_text, raw), (their_text, _) = masked(ours), masked(theirs)
    assert ours_text == their_text
    assert ours_text.count(" T\n") == (2 if created else 0)
    assert f" {float(len(gaps))}\n" in raw
