"""The serving engine's async scheduling: a slotted decode step is launched before the host reads
the last step's tokens (the rows fed from the device), and those tokens are emitted while
it runs. Checked on the CPU with the tiny test model: the same tokens as without it
for greedy, seeded and shared draws, for max_tokens and stop-string endings; no step
spent on a sequence whose last token is already in flight; a penalized or logprobs
request makes the step read its tokens first; a cancel mid-stream frees the slot. On a
GPU with CUDA graphs: the same tokens (greedy, seeded and shared draws), and neither the
launch side of a step nor its draws sync."""

import threading

import pytest
import torch

import qfuse
from qfuse.runtime.prompts import encode_prompts
from qfuse.runtime.sampling import SamplingParams
from qfuse.serving.engine import Engine, Request

from .engine_jobs import run_to_end

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n", "for i in range(", "x = ["]


@pytest.fixture(scope="module")
def bundled():
    return qfuse.load(progress=False)


@pytest.fixture
def loaded(request):
    """The tiny test model for the CPU cases (tests of the engine); the case marked `gpu`
    keeps the bundled model it was checked on."""
    gpu = request.node.get_closest_marker("gpu") is not None
    return request.getfixturevalue("bundled" if gpu else "tiny_loaded")


def _serve(engine, tokenizer, jobs, log=None):
    """Run the (prompt, max_tokens, kwargs) jobs to their end; each one's (tokens, text,
    finish_reason). ``log`` gets "token" per token emitted."""
    streams = run_to_end(engine, tokenizer, jobs, timeout=120, log=log)
    return [(tokens, "".join(text), reason) for tokens, text, reason
            in zip(streams.tokens, streams.text, streams.reasons)]


def _both(model, tokenizer, jobs, **kw):
    """The jobs served with async scheduling off and on (the global generator reseeded for
    each; no EOS, so that every stream runs to max_tokens or its stop string: a row
    dropped after an EOS would change a shared draw's company); both engines returned too."""
    runs = []
    for overlap in (False, True):
        torch.manual_seed(0)
        engine = _no_eos(Engine(model, tokenizer, async_scheduling=overlap, **kw))
        runs.append((_serve(engine, tokenizer, jobs), engine))
    return runs


def _no_eos(engine):
    engine.emission.eos = set()
    return engine


def test_overlap_gives_the_tokens_of_reading_each_step_first(loaded):
    model, tokenizer = loaded
    jobs = [(p, m, {}) for p, m in zip(PROMPTS, (12, 7, 3, 9, 5))]
    (off, sync), (on, ahead) = _both(model, tokenizer, jobs, max_batch=3, kv_bits=4,
                                     kv_group_size=32)
    assert on == off
    assert [len(t) for t, _, _ in on] == [12, 7, 3, 9, 5]
    assert all(reason == "length" for _, _, reason in on)
    assert ahead.cache.host_lengths == [0] * 3 and not ahead.cache.lengths.any()
    assert ahead.tokens_total == sync.tokens_total == 36
    assert ahead.stats()["async_scheduling"] is True
    assert sync.stats()["async_scheduling"] is False


def test_overlap_with_seeded_and_shared_draws(loaded):
    model, tokenizer = loaded
    hot = SamplingParams(temperature=0.9, top_p=0.95)
    jobs = [(PROMPTS[0], 10, {"params": SamplingParams(temperature=0.8, seed=7)}),
            (PROMPTS[1], 10, {"params": hot}), (PROMPTS[2], 10, {"params": hot}),
            (PROMPTS[3], 10, {})]
    (off, _), (on, _) = _both(model, tokenizer, jobs, max_batch=4)
    assert on == off and all(len(t) == 10 for t, _, _ in on)


def test_a_stop_string_ends_the_stream_where_it_does_without_overlap(loaded):
    model, tokenizer = loaded
    alone = _serve(_no_eos(Engine(model, tokenizer)), tokenizer, [(PROMPTS[0], 16, {})])[0]
    text = alone[1]
    stop = text[len(text) // 2: len(text) // 2 + 2]  # a string the stream reaches midway
    jobs = [(PROMPTS[0], 16, {"stop": [stop]}), (PROMPTS[1], 16, {})]
    (off, sync), (on, ahead) = _both(model, tokenizer, jobs, max_batch=2)
    assert on == off
    assert on[0][2] == "stop" and stop not in on[0][1] and len(on[0][0]) < 16
    # The row after the stop was computed for nothing (at most one step), then freed.
    assert sum(ahead.steps_by_batch.values()) - sum(sync.steps_by_batch.values()) <= 1
    assert ahead.cache.host_lengths == [0, 0] and not ahead.cache.lengths.any()


def test_steps_run_ahead_of_the_tokens_they_feed(loaded):
    model, tokenizer = loaded

    def order(overlap, kw):
        log = []
        engine = _no_eos(Engine(model, tokenizer, max_batch=1, async_scheduling=overlap))
        step = engine.steps.decoders[1]
        engine.steps.decoders[1] = lambda tokens: (log.append("step"), step(tokens))[1]
        _serve(engine, tokenizer, [(PROMPTS[0], 5, kw)], log)
        return log

    # The first token comes from the prefill; the step for the third is launched before
    # the second is read; the fifth, in flight, takes no step.
    assert order(True, {}) == ["token", "step", "step", "token", "step", "token",
                               "step", "token", "token"]
    expected_sync = ["token"] + ["step", "token"] * 4
    assert order(False, {}) == expected_sync
    # logprobs are read from the step's logits, which the next step overwrites: that
    # request's steps read their tokens first.
    assert order(True, {"logprobs": 0}) == expected_sync
    assert order(True, {"params": SamplingParams(repetition_penalty=1.2)}) == expected_sync


def test_penalized_and_logprobs_requests_beside_plain_ones(loaded):
    model, tokenizer = loaded
    jobs = [(PROMPTS[0], 8, {}), (PROMPTS[1], 8, {"logprobs": 2}),
            (PROMPTS[2], 8, {"params": SamplingParams(repetition_penalty=1.3)}),
            (PROMPTS[3], 8, {"presence_penalty": 0.5})]
    (off, _), (on, _) = _both(model, tokenizer, jobs, max_batch=4)
    assert on == off and all(len(t) == 8 for t, _, _ in on)


def test_a_cancel_while_a_step_runs_ahead_frees_the_slot(loaded):
    model, tokenizer = loaded
    engine = _no_eos(Engine(model, tokenizer, max_batch=2, async_scheduling=True))
    cancelled, ended = threading.Event(), threading.Event()
    req = None

    def emit(event):  # on the engine thread, between a step's launch and the next
        if event.token is not None and req.completion_tokens >= 3 and not req.cancelled:
            engine.cancel(req)
            cancelled.set()
        if event.finish_reason:
            ended.set()

    req = Request(encode_prompts(tokenizer, [PROMPTS[0]])[0], 500, emit=emit)
    engine.submit(req)
    engine.start()
    try:
        assert cancelled.wait(60)
        for _ in range(500):
            if not engine.stats()["active"]:
                break
            threading.Event().wait(0.01)
        assert engine.stats()["active"] == 0 and req.completion_tokens == 3
        assert engine.cache.host_lengths == [0, 0] and not engine.cache.lengths.any()
        assert not ended.is_set()  # a cancelled request's client is gone: no last event
    finally:
        engine.stop()


@pytest.mark.gpu
def test_overlap_on_cuda_graphs_never_syncs_to_launch(loaded):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, tokenizer = loaded  # on the GPU where one is visible
    hot = SamplingParams(temperature=0.9, top_p=0.95)
    jobs = [(p, 24, {}) for p in PROMPTS] + [
        (PROMPTS[0], 24, {"params": SamplingParams(temperature=0.8, seed=3)}),
        (PROMPTS[1], 24, {"params": hot}), (PROMPTS[2], 24, {"params": hot})]
    torch.manual_seed(0)
    off = _serve(_no_eos(Engine(model, tokenizer, max_batch=8, cuda_graph=True)), tokenizer,
                 jobs)
    engine = _no_eos(Engine(model, tokenizer, max_batch=8, cuda_graph=True,
                            async_scheduling=True))
    launched = []

    def no_sync(fn):
        def call(*args):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return call

    steps = engine.steps
    for b, step in list(steps.decoders.items()):
        steps.decoders[b] = no_sync(lambda tokens, step=step: (launched.append(1),
                                                               step(tokens))[1])
    steps.stage_step = no_sync(steps.stage_step)
    steps.stage_tokens = no_sync(steps.stage_tokens)
    engine.sampler.sample = no_sync(engine.sampler.sample)
    torch.manual_seed(0)
    assert _serve(engine, tokenizer, jobs) == off  # every job ends by max_tokens
    assert len(launched) >= 23
