"""The serving engine's prefix cache (``prefix_caching``) in-process on the CPU with the
tiny test model: a request whose prompt starts with a cached system prompt (longer than the
model's sliding window, 128) gets the greedy tokens of the request alone without the
cache, dense and with a 4-bit KV cache, and prefills only the tokens past the cached
pages; requests sharing a cached prefix admitted together are prefilled in one call (only
equal chunks when deterministic; within max_prefill_tokens), each with its tokens alone
(and alone again when that call fails);
more distinct prefixes than pages evict the least recently used and leave every
page free or cached; a cancelled request leaves the shared pages to the others; a
sequence preempted beside shared pages keeps its tokens; the counters move. Over HTTP, on
a live loopback server: two chats sharing a system prompt, and /metrics and /health
saying so. `qfuse serve` turns it on with --kv-page-size unless told not to, and
--enable-prefix-caching without pages is a one-line error."""

import http.client
import json
import time

import pytest

from qfuse.runtime.prompts import encode_prompts
from qfuse.serving.engine import Engine
from qfuse.serving.in_process import Followed, get_text, until_idle

SYSTEM = "You are a helpful assistant. " * 15  # 151 tokens: past the sliding window
QUESTIONS = ["What is a stack?", "Name a prime number.", "Say hello."]
CONTEXT = 256  # 16 pages of 16 tokens
PS = 16


@pytest.fixture(scope="module")
def loaded(tiny_loaded):
    """The tiny test model: these tests are of the engine, not of the bundled model."""
    return tiny_loaded


@pytest.fixture(scope="module")
def alone(loaded):
    """alone(prompts, max_tokens, **kw) -> each prompt's greedy tokens alone without the
    cache, each on an engine of its own (as `_one_by_one` gives them); a prompt asked
    again with the same max_tokens and engine settings is not decoded again (several
    tests and parametrizations ask for the same ones)."""
    model, tokenizer = loaded
    done: dict = {}

    def get(prompts, max_tokens, **kw):
        out = []
        for p in prompts:
            key = (p, max_tokens, tuple(sorted(kw.items())))
            if key not in done:
                done[key] = _one_by_one(model, tokenizer, [p], max_tokens, **kw)[0][0]
            out.append(list(done[key]))  # a copy: a caller's list is its own
        return out

    return get


class _Counting:
    """The model, recording (past, tokens) of each prefill call, and its rows."""

    def __init__(self, model):
        self._model, self.prefills, self.rows = model, [], []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, ids, lengths=None, cache=None, past=0, **kw):
        self.prefills.append((past, ids.shape[1]))
        self.rows.append(ids.shape[0])
        return self._model(ids, lengths, cache, past=past, **kw)

    def decode(self, tokens, cache):
        return self._model.decode(tokens, cache)


class _CountingAsOnHopper(_Counting):
    """Counting, and naming the row-invariant kernels a held 4-bit model's products take
    on Hopper (the fragment kernel over 1-32 token rows, the wgmma kernel over 33-256), so
    that deterministic chunks group here as there (on a CPU the model names none; its
    float32 products over these few rows are row-invariant in practice)."""

    @staticmethod
    def product_kernels(rows):
        return ("fragment",) if rows <= 32 else ("wgmma",) if rows <= 256 else None


def _one_by_one(model, tokenizer, prompts, max_tokens, **kw):
    """Each prompt's greedy tokens, one request after the other, and the stopped engine."""
    engine = Engine(model, tokenizer, max_batch=4, context=CONTEXT, kv_page_size=PS, **kw)
    engine.start()
    try:
        return [Followed(engine, tokenizer, p, max_tokens).wait() for p in prompts], engine
    finally:
        engine.stop()


def _alone_then_cached(loaded, alone, questions, kw, max_tokens=10, counting=_Counting):
    """(prompts: the system prompt and each question, each one's ``max_tokens`` greedy
    tokens alone without the cache (from the ``alone`` fixture), the ``counting`` model, a
    started engine with prefix caching)."""
    model, tokenizer = loaded
    prompts = [SYSTEM + q for q in questions]
    alone = alone(prompts, max_tokens, **kw)
    counting = counting(model)
    engine = Engine(counting, tokenizer, max_batch=4, context=CONTEXT, kv_page_size=PS,
                    prefix_caching=True, **kw)
    engine.start()
    return prompts, alone, counting, engine


def _shared(a: list[int], b: list[int]) -> int:
    """The tokens two prompts share at their start."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))



def _nothing_held(engine) -> bool:
    """Every page is free or cached (kept by the index alone), the index holds exactly
    the cached ones, and page_stats agrees."""
    kept = 0
    for g in engine.cache.groups.values():
        a = g.allocator
        if a.free_pages != a.num_pages or any(row != [-1] * len(row) for row in g.rows):
            return False
        if any(a.refcount(p) != a.is_cached(p) for p in range(a.num_pages)):
            return False
        kept += a.cached_pages
    pages = engine.stats()["kv_pages"]
    full = engine.cache.groups[None].allocator
    return (kept == len(engine.prefix) and pages["used"] == 0
            and pages["free"] == pages["total"] and pages["cached"] == full.cached_pages)


@pytest.mark.parametrize("kw", [{"prefill_chunk": 16},  # every cached prefix ends a chunk
                                {"prefill_chunk": 16, "kv_bits": 4, "kv_group_size": 32},
                                {"prefill_chunk": 0},  # the rest as one chunk, not whole
                                # the fixed batch's steps (`paged_graphs`) over shared pages
                                {"prefill_chunk": 16, "deterministic": True}],
                         ids=["dense", "4-bit", "unchunked", "deterministic"])
def test_a_cached_prefix_gives_the_tokens_alone_and_prefills_only_the_rest(loaded, alone, kw):
    tokenizer = loaded[1]
    prompts, alone, counting, engine = _alone_then_cached(loaded, alone, QUESTIONS, kw)
    try:
        cached, calls = [], []
        for p in prompts:
            before = len(counting.prefills)
            cached.append(Followed(engine, tokenizer, p, 10).wait())
            calls.append(counting.prefills[before:])  # its prefill calls: (past, tokens)
    finally:
        engine.stop()
    assert cached == alone
    ids = encode_prompts(tokenizer, prompts)
    # Each request's hit: the whole pages it shares with an earlier prompt.
    starts = [max([_shared(ids[i], ids[j]) // PS * PS for j in range(i)], default=0)
              for i in range(len(ids))]
    assert starts[0] == 0 and min(starts[1:]) >= 128
    # The first request computes its whole prompt; the others start at their hit.
    assert [c[0][0] for c in calls] == starts
    assert [sum(t for _, t in c) for c in calls] == [n - h for n, h in zip(map(len, ids), starts)]
    assert engine.stats()["prefix_cache"] == {"queries": sum(map(len, ids)),
                                              "hits": sum(starts)}
    assert _nothing_held(engine)


# 192 tokens each: rests of 48 (one chunk of 64), 3 x 48 rows in the product kernel of 48
SHORT_EQUAL = ["What is a stack?", "What is a queue?", "What is a heap?"]  # 157 tokens
EQUAL = [" ".join([q] * 6) for q in SHORT_EQUAL]
_4BIT = {"kv_bits": 4, "kv_group_size": 32}


@pytest.mark.parametrize("kw, questions, together", [
    ({"prefill_chunk": 16}, QUESTIONS, [3]),  # rests of 12 and 13 tokens, padded
    ({"prefill_chunk": 16, **_4BIT}, QUESTIONS, [3]),
    # Deterministic: rows of equal chunks share a call, padded ones do not (13, 12, 12).
    ({"prefill_chunk": 64, "deterministic": True}, EQUAL, [3]),
    ({"prefill_chunk": 64, "deterministic": True, **_4BIT}, EQUAL, [3]),
    ({"prefill_chunk": 16, "deterministic": True}, QUESTIONS, [1, 2]),
    # ... nor a third of 13 when 3 x 13 token rows would leave the fragment kernel (<= 32).
    ({"prefill_chunk": 16, "deterministic": True}, SHORT_EQUAL, [2, 1]),
    ({"prefill_chunk": 0}, QUESTIONS, [3]),  # the rests as one chunk each
    # 13 + 12 tokens fit a loop's 32, padded too (2 x 13); the third waits a loop.
    ({"prefill_chunk": 16, "max_prefill_tokens": 32}, QUESTIONS, [2, 1]),
    # ... nor any chunks where the model names no row-invariant kernel (on a CPU)
    ({"prefill_chunk": 64, "deterministic": True, "_names_none": True}, EQUAL, [1, 1, 1])],
    ids=["dense", "4-bit", "deterministic", "deterministic-4-bit", "deterministic-padded",
         "deterministic-kernel", "unchunked", "budget", "deterministic-no-kernel"])
def test_requests_sharing_a_cached_prefix_are_prefilled_together(loaded, alone, kw, questions,
                                                                 together):
    """together: the rows of each prefill call after the system prompt's."""
    tokenizer = loaded[1]
    kw = dict(kw)
    counting = _Counting if kw.pop("_names_none", False) or not kw.get("deterministic") \
        else _CountingAsOnHopper
    prompts, alone, counting, engine = _alone_then_cached(loaded, alone, questions, kw,
                                                          counting=counting)
    try:
        Followed(engine, tokenizer, SYSTEM + "Hi.", 2).wait()  # caches the system prompt
        before = len(counting.prefills)
        with engine._cv:  # held: the loop admits all three in one iteration
            jobs = [Followed(engine, tokenizer, p, 10) for p in prompts]
        cached = [job.wait() for job in jobs]
        calls, rows = counting.prefills[before:], counting.rows[before:]
    finally:
        engine.stop()
    assert cached == alone
    ids = encode_prompts(tokenizer, prompts)
    hit = min(_shared(ids[0], x) for x in ids) // PS * PS
    assert hit >= 128 and engine.stats()["prefix_cache"]["hits"] >= 3 * hit
    # Every rest is one chunk: alone, one call each.
    chunk = kw["prefill_chunk"] or CONTEXT
    assert all(hit < len(x) <= (hit // chunk + 1) * chunk for x in ids)
    assert rows == together and {past for past, _ in calls} == {hit}
    budget = kw.get("max_prefill_tokens", 2048)
    assert all(n * t <= budget for n, (_, t) in zip(rows, calls))
    assert until_idle(engine) and _nothing_held(engine)


class _FailsTogether(_Counting):
    """The model, failing every prefill of several rows after cached tokens."""

    def __call__(self, ids, lengths=None, cache=None, past=0, **kw):
        if past and ids.shape[0] > 1:
            self.prefills.append((past, ids.shape[1]))
            self.rows.append(ids.shape[0])
            raise RuntimeError("a batched chunk failed")
        return super().__call__(ids, lengths, cache, past=past, **kw)


def test_a_failed_batched_chunk_prefills_each_alone(loaded, alone):
    model, tokenizer = loaded
    prompts = [SYSTEM + q for q in QUESTIONS]
    alone = alone(prompts, 6, prefill_chunk=16)
    failing = _FailsTogether(model)
    engine = Engine(failing, tokenizer, max_batch=4, context=CONTEXT, kv_page_size=PS,
                    prefill_chunk=16, prefix_caching=True)
    engine.start()
    try:
        Followed(engine, tokenizer, SYSTEM + "Hi.", 2).wait()
        before = len(failing.rows)
        with engine._cv:
            jobs = [Followed(engine, tokenizer, p, 6) for p in prompts]
        assert [job.wait() for job in jobs] == alone
        assert [job.reason for job in jobs] == ["length"] * 3
        assert failing.rows[before:] == [3, 1, 1, 1]  # the batch, then each alone
        assert until_idle(engine) and _nothing_held(engine)
    finally:
        engine.stop()


def test_more_prefixes_than_pages_evict_the_least_recently_used(loaded):
    model, tokenizer = loaded
    # Nine prompts of 3 whole pages each and 3 tokens: 27 cached pages for a pool of 16.
    prompts = [f"{i} " + "class Stack:\n" * 10 for i in range(9)]
    assert all(len(ids) == 51 for ids in encode_prompts(tokenizer, prompts))
    engine = Engine(model, tokenizer, max_batch=2, context=CONTEXT, kv_page_size=PS,
                    kv_pages=16, prefix_caching=True)
    engine.start()
    try:
        for p in prompts:
            Followed(engine, tokenizer, p, 4).wait()
        assert until_idle(engine) and _nothing_held(engine)
        # The pool is full of prefixes, but for the last prompt's tail page (not whole).
        assert engine.stats()["kv_pages"]["cached"] == 15
        assert engine.stats()["prefix_cache"]["hits"] == 0
        again = Followed(engine, tokenizer, prompts[-1], 4)  # the newest: still cached
        again.wait()
        first = Followed(engine, tokenizer, prompts[0], 4)  # the oldest: evicted
        first.wait()
        assert engine.stats()["prefix_cache"]["hits"] == 48
        assert until_idle(engine) and _nothing_held(engine)
    finally:
        engine.stop()


def test_a_cancelled_request_leaves_the_shared_pages_to_the_others(loaded, alone):
    tokenizer = loaded[1]
    prompts, alone, _, engine = _alone_then_cached(loaded, alone, QUESTIONS,
                                                   {"prefill_chunk": 16},
                                                   max_tokens=30)
    try:
        first = Followed(engine, tokenizer, prompts[0], 30)
        assert first.started.wait(30)  # its prompt's pages are in the index

        def cancel_at_two(job):
            if len(job.tokens) == 2:
                engine.cancel(job.req)

        cancelled = Followed(engine, tokenizer, prompts[1], 30, on_token=cancel_at_two)
        deadline = time.monotonic() + 300  # a hang guard only
        while any(s is not None and s.req is cancelled.req for s in engine.slots) or \
                not cancelled.tokens:  # till its slot is freed
            assert time.monotonic() < deadline, "the cancelled request kept its slot"
            time.sleep(0.005)
        assert len(cancelled.tokens) < 30
        third = Followed(engine, tokenizer, prompts[2], 30)
        assert first.wait() == alone[0] and third.wait() == alone[2]
        assert cancelled.tokens == alone[1][:len(cancelled.tokens)]
        assert engine.stats()["prefix_cache"]["hits"] >= 2 * 128
        assert until_idle(engine) and _nothing_held(engine)
    finally:
        engine.stop()


def test_preemption_beside_shared_pages_keeps_the_greedy_tokens(loaded, alone):
    tokenizer = loaded[1]
    # Three sequences of ~205 tokens: 9 shared pages and 4 of their own each, in 16.
    prompts, alone, _, engine = _alone_then_cached(
        loaded, alone, QUESTIONS, {"prefill_chunk": 16, "kv_pages": 16}, max_tokens=48)
    try:
        jobs = [Followed(engine, tokenizer, p, 48) for p in prompts]
        assert [job.wait() for job in jobs] == alone
        assert engine.stats()["kv_pages"]["preemptions"] > 0, "no preemption: nothing tested"
        assert until_idle(engine) and _nothing_held(engine)
    finally:
        engine.stop()


def test_prefix_caching_without_pages_is_a_one_line_error(loaded, qfuse_here):
    model, tokenizer = loaded
    with pytest.raises(ValueError) as e:
        Engine(model, tokenizer, max_batch=2, prefix_caching=True)
    assert str(e.value) == ("prefix_caching shares the pages of a paged KV cache: give "
                            "kv_page_size too")
    r = qfuse_here("serve", "--port", "0", "--enable-prefix-caching")
    assert r.returncode == 2 and r.stderr == (
        "qfuse: error: --enable-prefix-caching shares the pages of a paged KV cache: give "
        "--kv-page-size too\n")


def test_serve_turns_prefix_caching_on_with_pages(qfuse_here, monkeypatch):
    import qfuse.serving.engine

    class Told(qfuse.serving.engine.Engine):  # says what `qfuse serve` asked for, and stops
        def __init__(self, *args, prefix_caching, **kw):
            raise ValueError(f"prefix_caching={prefix_caching}")

    monkeypatch.setattr(qfuse.serving.engine, "Engine", Told)
    for flags, on in ((["--kv-page-size", "16"], True),
                      (["--kv-page-size", "16", "--no-enable-prefix-caching"], False),
                      (["--kv-page-size", "16", "--enable-prefix-caching"], True),
                      ([], False)):
        r = qfuse_here("serve", "--port", "0", "--max-batch", "1", *flags)
        assert r.returncode == 2 and r.stderr.endswith(
            f"qfuse: error: prefix_caching={on}\n"), (flags, r.stderr)


def _post(port: int, path: str, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        return json.loads(r.read())
    finally:
        conn.close()



def test_two_chats_sharing_a_system_prompt_over_http(loaded):
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    parser = pytest.importorskip("prometheus_client.parser")
    from qfuse.serving.in_process import serve_in_process

    model, tokenizer = loaded

    def chats(prefix_caching):
        engine = Engine(model, tokenizer, max_batch=2, context=CONTEXT, kv_page_size=PS,
                        prefill_chunk=16, prefix_caching=prefix_caching)
        server = serve_in_process(engine, tokenizer, model.config.vocab_size)
        try:
            replies = [_post(server.port, "/v1/chat/completions", {
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": q}],
                "max_tokens": 8, "temperature": 0}) for q in QUESTIONS[:2]]
            samples = {s.name: s.value for family in
                       parser.text_string_to_metric_families(get_text(server.port, "/metrics"))
                       for s in family.samples}
            health = json.loads(get_text(server.port, "/health"))
        finally:
            server.stop()
        return replies, samples, health

    plain, _, _ = chats(False)
    replies, samples, health = chats(True)
    texts = [r["choices"][0]["message"]["content"] for r in replies]
    assert texts == [r["choices"][0]["message"]["content"] for r in plain]
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in replies)
    assert samples["vllm:prefix_cache_queries_total"] == prompt_tokens
    assert samples["vllm:prefix_cache_hits_total"] >= 128  # the second chat's system prompt
    assert health["prefix_cache"] == {"queries": prompt_tokens,
                                      "hits": samples["vllm:prefix_cache_hits_total"]}
    assert health["kv_pages"]["cached"] == samples["qfuse:kv_blocks_cached"] > 0
    assert samples["vllm:kv_cache_usage_perc"] == 0  # cached pages count as free
