"""Mixed steps (``Engine(mixed_steps=True)``) in-process on the CPU with the tiny test model:
every request gets the greedy tokens it gets alone (dense pages, a cached prefix, a
prompt preempted mid-prefill, a failing step run again piece by piece); a decoding stream
advances at every step while a long prompt is prefilled beside it; no step runs more
tokens than its budget, and a budget smaller than the decode rows still gives the prompts
MIN_PIECE tokens a step; a cancel mid-prefill frees the pages while the others go on; bad
values are one-line errors. Steps are counted through the model's calls, never timed."""

import threading

import pytest

from qfuse.serving.engine import DEFAULT_STEP_TOKENS, Engine
from qfuse.serving.in_process import Followed, until_idle
from qfuse.serving.scheduler import MIN_PIECE

SHORT = ["def fibonacci(n):", "import os\n", "x = ["]
LONG = "class Stack:\n" * 40  # 200 tokens: past the test model's sliding window (128)
CONTEXT = 320
PS = 16


@pytest.fixture(scope="module")
def alone(tiny_loaded):
    """alone(prompt, max_tokens) -> its greedy tokens on a paged engine of its own,
    without mixed steps (asked once per prompt and length)."""
    model, tokenizer = tiny_loaded
    done: dict = {}

    def get(prompt, max_tokens):
        if (prompt, max_tokens) not in done:
            engine = Engine(model, tokenizer, max_batch=4, context=CONTEXT, kv_page_size=PS,
                            mixed_steps=False)
            engine.start()
            try:
                done[prompt, max_tokens] = Followed(engine, tokenizer, prompt, max_tokens).wait()
            finally:
                engine.stop()
        return done[prompt, max_tokens]

    return get


class _Steps:
    """The model, recording each call: ("mixed", decode rows, chunk lengths), ("decode",
    rows) or ("prefill", tokens, past); ``before_mixed(chunks)`` runs before each mixed
    step (to block or fail one)."""

    def __init__(self, model, before_mixed=None):
        self._model, self.calls, self.before_mixed = model, [], before_mixed

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, ids, lengths=None, cache=None, past=0, **kw):
        self.calls.append(("prefill", ids.shape[1], past))
        return self._model(ids, lengths, cache, past=past, **kw)

    def decode(self, tokens, cache):
        self.calls.append(("decode", tokens.shape[0]))
        return self._model.decode(tokens, cache)

    def mixed(self, tokens, cache, decodes, chunks, logits_at):
        self.calls.append(("mixed", decodes, tuple(chunks)))
        if self.before_mixed is not None:
            self.before_mixed(chunks)
        return self._model.mixed(tokens, cache, decodes, chunks, logits_at)


def _engine(model, tokenizer, **kw):
    kw = {"max_batch": 4, "context": CONTEXT, "kv_page_size": PS, "mixed_steps": True, **kw}
    engine = Engine(model, tokenizer, **kw)
    engine.start()
    return engine


def _all_free(engine) -> bool:
    return all(g.allocator.free_pages == g.allocator.num_pages and
               all(p < 0 for row in g.rows for p in row) for g in engine.cache.groups.values())


def test_each_request_gets_its_tokens_alone_within_the_step_budget(tiny_loaded, alone):
    model, tokenizer = tiny_loaded
    prompts = [SHORT[0], LONG, SHORT[1], SHORT[2]]
    expected = [alone(p, 16) for p in prompts]
    steps = _Steps(model)
    # 24 tokens a step, a chunk boundary every 32: the long prompt goes in cut pieces.
    engine = _engine(steps, tokenizer, step_tokens=24, max_prefill_tokens=24,
                     prefill_chunk=32)
    try:
        jobs = [Followed(engine, tokenizer, p, 16) for p in prompts]
        assert [job.wait() for job in jobs] == expected
        assert until_idle(engine) and _all_free(engine)
    finally:
        engine.stop()
    mixed = [call for call in steps.calls if call[0] == "mixed"]
    assert all(d + sum(chunks) <= 24 for _, d, chunks in mixed)
    assert any(d and chunks for _, d, chunks in mixed), "no step mixed decodes and a prompt"
    # Every prompt token went through a mixed step, none through a separate prefill.
    assert sum(sum(chunks) for _, _, chunks in mixed) == sum(len(job.ids) for job in jobs)
    assert not any(call[0] == "prefill" for call in steps.calls)
    assert engine.stats()["mixed_steps"] == len(mixed) and engine.stats()["step_tokens"] == 24


def test_a_decoding_stream_advances_at_every_step_of_a_long_prefill(tiny_loaded, alone):
    model, tokenizer = tiny_loaded
    steps = _Steps(model)
    engine = _engine(steps, tokenizer, max_batch=2, step_tokens=20)
    try:
        stream = Followed(engine, tokenizer, SHORT[0], 60)
        assert stream.started.wait(30)
        before = len(steps.calls)
        long = Followed(engine, tokenizer, LONG, 4)
        assert long.wait() == alone(LONG, 4)
        assert stream.wait() == alone(SHORT[0], 60)
    finally:
        engine.stop()
    # From the long prompt's first piece to its last, every step decodes the stream too:
    # 19 prompt tokens a step beside it, 200 tokens in 11 steps.
    calls = steps.calls[before:]
    first = next(i for i, call in enumerate(calls) if call[0] == "mixed")
    pieces = calls[first: first + 11]
    assert [call[1] for call in pieces] == [1] * 11
    assert [sum(call[2]) for call in pieces] == [19] * 10 + [10]
    assert calls[first + 11] == ("decode", 2)  # then both decode
    assert len(stream.tokens) == 60  # it kept going before, during and after


def test_a_cached_prefix_keeps_the_tokens_alone(tiny_loaded, alone):
    model, tokenizer = tiny_loaded
    system = "class Stack:\n" * 12
    prompts = [system + q for q in ("def push(self, x):", "def pop(self):")] + SHORT[:2]
    expected = [alone(p, 12) for p in prompts]
    engine = _engine(model, tokenizer, prefix_caching=True, step_tokens=24, prefill_chunk=32)
    try:
        first = Followed(engine, tokenizer, prompts[0], 12)
        assert first.started.wait(30)  # its prompt's pages are in the index
        jobs = [first] + [Followed(engine, tokenizer, p, 12) for p in prompts[1:]]
        assert [job.wait() for job in jobs] == expected
        stats = engine.stats()
    finally:
        engine.stop()
    # The second prompt's shared pages came from the index.
    assert stats["prefix_cache"]["hits"] >= 48 and stats["mixed_steps"] > 0


def test_a_prompt_preempted_mid_prefill_gets_its_tokens_alone(tiny_loaded, alone):
    """Pages run out (OutOfPages, raised before anything changed, as the cache raises it)
    at the long prompt's third piece: the youngest sequence, that prompt, goes back to the
    queue and starts over; a budget of one token still gives it MIN_PIECE a step."""
    from qfuse.runtime.paged_cache import OutOfPages

    model, tokenizer = tiny_loaded
    prompt = "class Stack:\n" * 20  # 100 tokens

    def before_mixed(chunks):
        if not refused and steps.calls.count(("mixed", 1, (MIN_PIECE,))) == 3:
            refused.append(len(steps.calls) - 1)
            raise OutOfPages("2 pages needed, 1 of 12 free")

    refused, steps = [], _Steps(model, before_mixed)
    engine = _engine(steps, tokenizer, max_batch=2, step_tokens=1)
    preempt, mid_prefill = engine.scheduler.preempt, []

    def recording(seq):  # how far each preempted sequence's prompt had gone in
        mid_prefill.append((seq.prefilled, len(seq.feed)))
        preempt(seq)

    engine.scheduler.preempt = recording
    try:
        stream = Followed(engine, tokenizer, SHORT[0], 40)
        assert stream.started.wait(30)
        long = Followed(engine, tokenizer, prompt, 8)
        assert long.wait() == alone(prompt, 8) and stream.wait() == alone(SHORT[0], 40)
        assert until_idle(engine) and _all_free(engine)
    finally:
        engine.stop()
    assert mid_prefill == [(32, 100)] and engine.preemptions == 1
    # After the refused step, the prompt again from its start, 16 tokens a step.
    pieces = [call[2] for call in steps.calls[refused[0] + 1:] if call[0] == "mixed"]
    assert pieces == [(MIN_PIECE,)] * 6 + [(4,)]


def test_a_cancel_mid_prefill_frees_its_pages_and_the_stream_goes_on(tiny_loaded, alone):
    model, tokenizer = tiny_loaded
    reached, go = threading.Event(), threading.Event()

    def before_mixed(chunks):
        if not reached.is_set() and sum(chunks) > 1 and len(steps.calls) > 8:
            reached.set()  # hold the engine inside a step of the long prompt
            assert go.wait(30)

    steps = _Steps(model, before_mixed)
    engine = _engine(steps, tokenizer, max_batch=2, step_tokens=16)
    try:
        stream = Followed(engine, tokenizer, SHORT[1], 40)
        assert stream.started.wait(30)
        long = Followed(engine, tokenizer, LONG, 8)
        assert reached.wait(30)
        engine.cancel(long.req)
        go.set()
        assert stream.wait() == alone(SHORT[1], 40)
        assert until_idle(engine) and _all_free(engine)
        assert long.tokens == [] and engine.stats()["prefilling"] == 0
    finally:
        go.set()
        engine.stop()


def test_a_failing_mixed_step_runs_each_piece_and_row_alone(tiny_loaded, alone):
    model, tokenizer = tiny_loaded
    failed = []

    def before_mixed(chunks):
        if not failed and len(chunks) == 1 and chunks[0] > 1 and len(steps.calls) > 4:
            failed.append(len(steps.calls) - 1)  # this call's index
            raise RuntimeError("no memory for this step")

    steps = _Steps(model, before_mixed)
    engine = _engine(steps, tokenizer, max_batch=2, step_tokens=16)
    try:
        stream = Followed(engine, tokenizer, SHORT[0], 30)
        assert stream.started.wait(30)
        long = Followed(engine, tokenizer, LONG, 6)
        assert long.wait() == alone(LONG, 6) and stream.wait() == alone(SHORT[0], 30)
        assert until_idle(engine) and _all_free(engine)
    finally:
        engine.stop()
    assert failed, "no step failed: nothing tested"
    at = failed[0]
    # Then the piece as a chunk of its own, and the stream's row decoded alone.
    assert steps.calls[at][:2] == ("mixed", 1)
    kind, tokens, past = steps.calls[at + 1]
    assert kind == "prefill" and (tokens,) == steps.calls[at][2] and past % MIN_PIECE == 0
    assert steps.calls[at + 2] == ("decode", 1)


def test_bad_mixed_step_values_are_one_line_errors(tiny_loaded):
    model, tokenizer = tiny_loaded
    for kw, message in (({"mixed_steps": True}, "give kv_page_size too"),
                        ({"mixed_steps": True, "kv_page_size": PS, "deterministic": True},
                         "deterministic"),
                        ({"mixed_steps": True, "kv_page_size": PS, "step_tokens": 0},
                         "step_tokens must be at least 1, got 0")):
        with pytest.raises(ValueError, match=message):
            Engine(model, tokenizer, max_batch=4, context=CONTEXT, **kw)
    engine = Engine(model, tokenizer, max_batch=4, context=CONTEXT, kv_page_size=PS,
                    mixed_steps=True)
    assert engine.step_tokens == DEFAULT_STEP_TOKENS == 64


def test_bad_mixed_step_flags_are_one_line_errors():
    import argparse

    from qfuse.commands import cli
    from qfuse.errors import UserError
    from qfuse.serving.server import check_page_args

    sub = argparse.ArgumentParser().add_subparsers()
    parser = cli.command_module("serve").add_parser(sub) or sub.choices["serve"]
    for flags, message in (
            (["--mixed-steps"], ("--mixed-steps runs prompt pieces beside the decode rows "
                                 "of a paged KV cache: give --kv-page-size too$")),
            (["--kv-page-size", "16", "--mixed-steps", "--deterministic"],
             "--mixed-steps cuts prompts by the load"),
            (["--kv-page-size", "16", "--step-tokens", "64"], "--step-tokens is the budget"),
            (["--kv-page-size", "16", "--mixed-steps", "--step-tokens", "0"],
             "--step-tokens must be at least 1, got 0$")):
        with pytest.raises(UserError, match=f"^{message}"):
            check_page_args(parser.parse_args(["--device", "cpu", *flags]))
    args = parser.parse_args(["--device", "cpu", "--kv-page-size", "16", "--mixed-steps"])
    check_page_args(args)
    assert args.mixed_steps and args.step_tokens is None


@pytest.mark.gpu
def test_on_the_gpu_mixed_steps_give_the_tokens_alone_beside_graphed_decode_steps():
    """The bundled model on CUDA (fast tier, held 4-bit weights where it has them): the
    pieces' products run over decode rows and prompt tokens together, the steps without a
    piece replay the paged graphs; each request gets its greedy tokens alone."""
    import qfuse

    model, tokenizer = qfuse.load(progress=False)
    if model.model.norm.weight.device.type != "cuda":
        pytest.skip("the bundled model did not load on CUDA")
    prompts = [SHORT[0], LONG, SHORT[1], "class Stack:\n" * 10]
    kw = {"max_batch": 4, "context": CONTEXT, "kv_page_size": PS, "cuda_graph": True}

    def run(prompts, **more):
        engine = Engine(model, tokenizer, **kw, **more)
        engine.start()
        try:
            jobs = [Followed(engine, tokenizer, p, 40) for p in prompts]
            return [job.wait() for job in jobs], engine
        finally:
            engine.stop()

    alone = [run([p], mixed_steps=False)[0][0] for p in prompts]
    together, engine = run(prompts, mixed_steps=True, step_tokens=24)
    assert together == alone
    assert engine.stats()["mixed_steps"] > 0 and sum(engine.steps_by_batch.values()) > 0
