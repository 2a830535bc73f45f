"""The serving engine in-process on the CPU: a quantized KV cache written slot by slot
gives each request the tokens it gets alone, prompts admitted together are prefilled
in one batch (within the token budget) with the tokens and KV entries each gets alone,
a seeded request samples the same tokens in company, a cancelled request frees
its slot, and a failure ends only the sequence it belongs to (a batched call that
fails is run again row by row), with async scheduling too."""

import threading
import time

import pytest
import torch

import qfuse
from qfuse.runtime.prompts import encode_prompts
from qfuse.runtime.sampling import SamplingParams
from qfuse.serving.engine import Engine, Request

from .engine_jobs import run_to_end, submit

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n", "for i in range(", "x = ["]


@pytest.fixture(scope="module")
def loaded(tiny_loaded):
    """The tiny test model: these tests are of the engine, not of the bundled model."""
    return tiny_loaded


@pytest.fixture(scope="module")
def bundled():
    """The bundled model, for a test that needs two prompts' greedy tokens to differ (the
    tiny model repeats one token after both)."""
    return qfuse.load(progress=False)


def _run(engine, tokenizer, prompts, max_tokens=12):
    streams = submit(engine, tokenizer, [(p, max_tokens, {}) for p in prompts])
    assert streams.done.wait(60)
    return dict(zip(prompts, streams.tokens))


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
        deadline = time.monotonic() + 300  # a hang guard only: the count below says when
        while engine.stats()["active"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats()["active"] == 0 and req.completion_tokens < 900
        assert engine.cache.host_lengths == [0, 0]
    finally:
        engine.stop()


def test_bucket_sizes():
    from qfuse.serving.engine import bucket_sizes

    assert bucket_sizes(1) == [1]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def _collect(engine, tokenizer, jobs):
    """Submit (prompt, max_tokens, kwargs) jobs before the engine starts, so that the
    first loop admits them all at once; run it; the tokens of each job."""
    return run_to_end(engine, tokenizer, jobs).tokens


def test_non_deterministic_engine_decodes_only_the_busy_bucket(loaded):
    model, tokenizer = loaded
    # Alone, a request decodes at batch 1: the same shapes as generate() at batch 1.
    engine = Engine(model, tokenizer, max_batch=4, deterministic=False)
    solo = _collect(engine, tokenizer, [(PROMPTS[0], 12, {})])[0]
    assert engine.steps_by_batch == {1: 11, 2: 0, 4: 0}  # the first token came from prefill
    expected = qfuse.generate(model, tokenizer, PROMPTS[0], max_tokens=12)
    assert tokenizer.decode(solo) == expected
    # Three at once in slots 0, 1, 2: batch 4 until slot 2 (4 tokens) is done, then 2
    # until slot 1 (8 tokens) is, then 1.
    engine = Engine(model, tokenizer, max_batch=4, deterministic=False)
    out = _collect(engine, tokenizer, [(p, m, {}) for p, m in zip(PROMPTS, (12, 8, 4))])
    assert [len(t) for t in out] == [12, 8, 4]
    assert engine.steps_by_batch == {1: 4, 2: 4, 4: 3}
    assert engine.cache.host_lengths == [0] * 4 and not engine.cache.lengths.any()
    assert engine.stats()["deterministic"] is False


def test_greedy_rows_share_one_argmax_with_the_per_row_result(bundled):
    model, tokenizer = bundled
    # logprobs sends a request down the per-row path; plain greedy ones share the argmax.
    engine = Engine(model, tokenizer, max_batch=3)
    jobs = [(PROMPTS[1], 10, {}), (PROMPTS[1], 10, {"logprobs": 0}), (PROMPTS[2], 10, {})]
    plain, per_row, other = _collect(engine, tokenizer, jobs)
    assert plain == per_row and len(plain) == 10 and other != plain


def test_cuda_graphs_per_bucket_replay_the_eager_steps(loaded):
    model, tokenizer = loaded
    if model.model.norm.weight.device.type == "cpu":
        with pytest.raises(ValueError, match="CUDA"):
            Engine(model, tokenizer, max_batch=2, cuda_graph=True)
        return
    jobs = [(p, m, {}) for p, m in zip(PROMPTS, (12, 8, 4))]
    for deterministic in (True, False):
        runs = []
        for graph in (False, True):
            engine = Engine(model, tokenizer, max_batch=4, kv_bits=4, kv_group_size=32,
                            cuda_graph=graph, deterministic=deterministic)
            runs.append((_collect(engine, tokenizer, jobs), dict(engine.steps_by_batch)))
        assert runs[0] == runs[1]


def test_cache_views_share_the_host_lengths(loaded):
    """A view of a cache's rows reads and writes that cache's host lengths: a step over
    the view (reserve_step) advances them in the cache, with no copying back."""
    from qfuse.runtime.cache import KVCache

    model, _ = loaded
    cache = KVCache(model.config, 4, 16, model.dtype, "cpu")
    cache.host_lengths = [3, 0, 5, 0]
    view = cache.rows(0, 2)
    assert view.host_lengths == [3, 0]
    view.reserve_step()
    assert cache.host_lengths == [4, 1, 5, 0]
    cache.rows(2, 3).host_lengths = [7]
    assert cache.host_lengths == [4, 1, 7, 0]
    with pytest.raises(ValueError, match="3 lengths for 2"):
        view.host_lengths = [1, 2, 3]


class _CountingPrefills:
    """The model, recording the (rows, padded length) of each prefill call."""

    def __init__(self, model):
        self._model, self.prefills = model, []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, ids, lengths=None, cache=None, **kw):
        self.prefills.append(tuple(ids.shape))
        return self._model(ids, lengths, cache, **kw)


# 9, 36, 100 and 150 tokens: the longest passes the test model's sliding window (128),
# so its ring layers wrap while the others' do not.
RAGGED = [PROMPTS[0], PROMPTS[1] * 12, "class Stack:\n" * 20, PROMPTS[4] * 50]


def test_prompts_admitted_together_prefill_in_one_batch_as_alone(loaded):
    model, tokenizer = loaded
    assert [len(x) for x in encode_prompts(tokenizer, RAGGED)] == [9, 36, 100, 150]
    jobs = [(p, 12, {}) for p in RAGGED]
    alone = []
    for job in jobs:
        engine = Engine(model, tokenizer, max_batch=4)
        alone.append(_collect(engine, tokenizer, [job])[0])
    counting = _CountingPrefills(model)
    engine = Engine(counting, tokenizer, max_batch=4)
    assert _collect(engine, tokenizer, jobs) == alone
    assert [rows for rows, _ in counting.prefills] == [4]
    assert all(len(t) == 12 for t in alone)

    # Each slot's KV entries are those of its prompt prefilled alone (up to rounding).
    engine = Engine(model, tokenizer, max_batch=4)
    _collect(engine, tokenizer, [(p, 1, {}) for p in RAGGED])  # no decode step runs
    ref = Engine(model, tokenizer, max_batch=4).cache
    with torch.no_grad():
        for s, ids in enumerate(encode_prompts(tokenizer, RAGGED)):
            model(torch.tensor([ids]), None, ref.rows(s, s + 1))
    for got, want in zip(engine.cache.layers, ref.layers):
        for a, b in ((got.k, want.k), (got.v, want.v)):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def test_prefill_token_budget_splits_the_batch(loaded):
    model, tokenizer = loaded
    lengths = [len(x) for x in encode_prompts(tokenizer, RAGGED)]
    jobs = [(p, 6, {}) for p in RAGGED]
    counting = _CountingPrefills(model)
    # The first two take 2 x 36 padded tokens; 3 x 100 is over the budget, so the third
    # waits for the next loop, where it comes first, and the fourth (2 x 150) for the one after.
    budget = 2 * lengths[1] + 10
    engine = Engine(counting, tokenizer, max_batch=4, max_prefill_tokens=budget)
    out = _collect(engine, tokenizer, jobs)
    assert counting.prefills == [(2, lengths[1]), (1, lengths[2]), (1, lengths[3])]
    # A prompt longer than the budget is prefilled alone; deterministic: each alone.
    for kw in ({"max_prefill_tokens": 1}, {"deterministic": True}):
        counting = _CountingPrefills(model)
        engine = Engine(counting, tokenizer, max_batch=4, **kw)
        assert _collect(engine, tokenizer, jobs) == out
        assert counting.prefills == [(1, n) for n in lengths]
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Engine(model, tokenizer, max_prefill_tokens=0)


def test_seeded_request_samples_the_same_tokens_in_company(loaded):
    model, tokenizer = loaded
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    unseeded = SamplingParams(temperature=1.0, top_p=0.9)
    job = (PROMPTS[3], 16, {"params": seeded})
    alone = _collect(Engine(model, tokenizer, max_batch=6, deterministic=True),
                     tokenizer, [job])[0]
    company = [(PROMPTS[0], 16, {"params": unseeded}), job,
               (PROMPTS[1], 16, {"params": unseeded, "logprobs": 2}),
               (PROMPTS[2], 16, {"params": SamplingParams(temperature=1.0, top_p=0.9, seed=4)}),
               (PROMPTS[4], 16, {}), (PROMPTS[3], 16, {"params": seeded})]
    out = _collect(Engine(model, tokenizer, max_batch=6, deterministic=True), tokenizer,
                   company)
    assert out[1] == out[5] == alone and len(alone) == 16


def test_unseeded_rows_sharing_their_sampling_share_one_draw(loaded):
    model, tokenizer = loaded
    # top_k=1 leaves one candidate: the shared draw must hand each row its own argmax.
    greedy = _collect(Engine(model, tokenizer, max_batch=4), tokenizer,
                      [(p, 10, {}) for p in PROMPTS[:4]])
    top1 = SamplingParams(temperature=0.7, top_k=1)
    jobs = [(p, 10, {"params": top1, "logprobs": 1 if i == 2 else None})
            for i, p in enumerate(PROMPTS[:4])]
    assert _collect(Engine(model, tokenizer, max_batch=4), tokenizer, jobs) == greedy


def _events(engine, tokenizer, jobs):
    """Like _collect, but each job's (tokens, last finish_reason), on an engine that may
    already run (started here if not)."""
    streams = submit(engine, tokenizer, jobs)
    if engine._thread is None:
        engine.start()
    assert streams.done.wait(60)
    return list(zip(streams.tokens, streams.reasons))


def _poisoned_seed() -> SamplingParams:
    """Parameters that slipped past validation: a seed torch refuses (over 2**64)."""
    params = SamplingParams(temperature=1.0, seed=1)
    object.__setattr__(params, "seed", 1 << 64)  # frozen: past the check, as a bug would be
    return params


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failing_sequence_ends_alone_and_the_others_get_their_tokens(loaded, monkeypatch,
                                                                       async_scheduling):
    from qfuse.serving import sampler as sampler_module

    model, tokenizer = loaded
    healthy = [(p, 10, {}) for p in PROMPTS[:4]] + [
        (PROMPTS[4], 10, {"params": SamplingParams(temperature=0.8, seed=5)}),
        (PROMPTS[0], 10, {"params": SamplingParams(temperature=0.8, top_k=1), "logprobs": 2})]
    engine = Engine(model, tokenizer, max_batch=10, deterministic=True,
                    async_scheduling=async_scheduling)
    try:
        alone = [_events(engine, tokenizer, [job])[0] for job in healthy]
        # The sampling of a sequence with seed 13 raises at its 3rd token: mid-stream.
        real, calls = sampler_module.sample, []

        def sample(x, params, seen, generator):
            if params.seed == 13:
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("poisoned")
            return real(x, params, seen, generator)

        monkeypatch.setattr(sampler_module, "sample", sample)
        poisoned = [
            (PROMPTS[1], 10, {"params": SamplingParams(temperature=0.8, seed=13)}),
            (PROMPTS[2], 10, {"params": _poisoned_seed()}),  # fails making its generator
            # A NaN penalty (Request does not check it) makes its draw raise.
            (PROMPTS[3], 10, {"params": SamplingParams(temperature=1.0),
                              "presence_penalty": float("nan")})]
        jobs = healthy[:2] + poisoned[:1] + healthy[2:4] + poisoned[1:] + healthy[4:]
        out = _events(engine, tokenizer, jobs)
        assert [out[jobs.index(job)] for job in healthy] == alone
        assert all(reason == "length" for _, reason in alone)
        for job in poisoned:
            assert out[jobs.index(job)][1] == "error"
        assert len(out[jobs.index(poisoned[0])][0]) == 2  # two tokens, then the error
        assert engine.stats()["active"] == 0 and engine.cache.host_lengths == [0] * 10
        assert _events(engine, tokenizer, [healthy[0]]) == [alone[0]]  # still serving
    finally:
        engine.stop()


class _FailingModel:
    """The model, whose prefill of several prompts and decode step over several rows
    raise (as out of memory would), and whose decode of slot ``bad`` raises even alone."""

    def __init__(self, model, bad: int):
        self._model, self.bad, self.failed = model, bad, []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, ids, lengths=None, cache=None, **kw):
        if ids.shape[0] > 1:
            self.failed.append(("prefill", ids.shape[0]))
            raise RuntimeError("no memory for a batch")
        return self._model(ids, lengths, cache, **kw)

    def decode(self, tokens, cache):
        slot = cache.lengths.storage_offset()  # a view of rows: its first slot
        if tokens.shape[0] > 1 or slot == self.bad:
            cache.reserve_step()  # as a step failing midway leaves its lengths
            self.failed.append(("decode", tokens.shape[0]))
            raise RuntimeError("no memory for a batch")
        return self._model.decode(tokens, cache)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failed_batched_call_runs_its_rows_alone(loaded, async_scheduling):
    model, tokenizer = loaded
    jobs = [(p, 8, {}) for p in PROMPTS[:4]]
    alone = [_collect(Engine(model, tokenizer, max_batch=4), tokenizer, [job])[0]
             for job in jobs]
    failing = _FailingModel(model, bad=2)
    engine = Engine(failing, tokenizer, max_batch=4, async_scheduling=async_scheduling)
    out = _events(engine, tokenizer, jobs)
    try:
        assert [tokens for tokens, _ in out[:2] + out[3:]] == alone[:2] + alone[3:]
        # Slot 2's first token came from its prefill (alone); its decode failed even alone.
        assert out[2] == (alone[2][:1], "error")
        assert ("prefill", 4) in failing.failed and ("decode", 4) in failing.failed
        assert engine.stats()["active"] == 0 and engine.cache.host_lengths == [0] * 4
        assert not engine.cache.lengths.any()
    finally:
        engine.stop()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failed_shared_draw_draws_each_row_alone(loaded, monkeypatch, async_scheduling):
    from qfuse.serving import sampler as sampler_module

    model, tokenizer = loaded
    greedy = _collect(Engine(model, tokenizer, max_batch=4), tokenizer,
                      [(p, 6, {}) for p in PROMPTS[:4]])
    real = sampler_module.sample

    def sample(x, params, seen, generator):
        if x.shape[0] > 1:
            raise RuntimeError("a batched draw failed")
        return real(x, params, seen, generator)

    monkeypatch.setattr(sampler_module, "sample", sample)
    top1 = SamplingParams(temperature=0.7, top_k=1)  # one candidate: each row's argmax
    jobs = [(p, 6, {"params": top1}) for p in PROMPTS[:4]]
    assert _collect(Engine(model, tokenizer, max_batch=4, async_scheduling=async_scheduling),
                    tokenizer, jobs) == greedy
