"""The Python API at the top of the package: qfuse.load / generate / stream_generate (CPU)."""

import dataclasses
import pydoc
import re
import subprocess
import sys

import pytest
import torch

import qfuse
from qfuse.runtime.generation import Summary
from qfuse.runtime.generation import generate as engine

PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def default_model():
    return qfuse.load()


def test_import_stays_light():
    # The API imports torch inside its functions: `import qfuse` alone must not.
    code = "import sys, qfuse; print(sorted(m for m in ('torch', 'tokenizers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_help_documents_the_api():
    text = pydoc.render_doc(qfuse, renderer=pydoc.plaintext)
    for name in ("load(", "generate(", "stream_generate(", "GenerationResponse", "finish_reason"):
        assert name in text


def test_load_without_a_path_gives_the_bundled_model(default_model):
    model, tokenizer = default_model
    assert model.config.model_type == "gemma3_text"
    assert model.dtype == torch.float32 and model.model.norm.weight.device.type == "cpu"
    assert tokenizer.encode(PROMPT).ids


def test_load_refuses_what_is_not_there(tmp_path):
    with pytest.raises(qfuse.UserError, match="missing does not exist"):
        qfuse.load(tmp_path / "missing")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(qfuse.UserError, match="is a symbolic link loop"):
        qfuse.load(tmp_path / "loop")
    with pytest.raises(qfuse.UserError, match="dtype"):
        qfuse.load(dtype="float7")


def test_generate_returns_the_engines_text(default_model):
    model, tok = default_model
    text = qfuse.generate(model, tok, PROMPT, max_tokens=12)
    assert isinstance(text, str) and text
    summary = list(engine(model, tok, [PROMPT], max_tokens=12))[-1]
    assert isinstance(summary, Summary) and text == summary.outputs[0]


def test_stream_generate_yields_responses_with_running_stats(default_model):
    model, tok = default_model
    responses = list(qfuse.stream_generate(model, tok, PROMPT, max_tokens=10))
    assert len(responses) == 10
    assert {f.name for f in dataclasses.fields(qfuse.GenerationResponse)} >= {
        "text", "token", "prompt_tokens", "prompt_tps", "generation_tokens", "generation_tps",
        "peak_memory", "finish_reason"}
    n_prompt = len(tok.encode(PROMPT).ids)
    for i, r in enumerate(responses):
        assert isinstance(r, qfuse.GenerationResponse)
        assert isinstance(r.text, str) and isinstance(r.token, int)
        assert r.prompt_tokens == n_prompt and r.prompt_tps > 0
        assert r.generation_tokens == i + 1
        assert r.peak_memory > 0  # CPU: the process's peak resident memory
        assert r.finish_reason == (None if i < 9 else "length")
    assert responses[0].generation_tps == 0.0  # one token, no interval yet to divide by
    assert responses[-1].generation_tps > 0
    assert "".join(r.text for r in responses) == qfuse.generate(model, tok, PROMPT, max_tokens=10)
    # The tokens are the greedy ones: decoding them gives the text.
    assert tok.decode([r.token for r in responses]) == "".join(r.text for r in responses)


def test_stream_generate_stops_at_a_stop_string(default_model):
    model, tok = default_model
    text = qfuse.generate(model, tok, PROMPT, max_tokens=16)
    stop = text[text.index("\n", 1):][:2] if "\n" in text[1:] else text[3:5]
    responses = list(qfuse.stream_generate(model, tok, PROMPT, max_tokens=16, stop=[stop]))
    assert responses[-1].finish_reason == "stop" and len(responses) < 16
    assert "".join(r.text for r in responses) == text[: text.index(stop)]


def test_batched_prompts_give_each_prompts_text(default_model):
    model, tok = default_model
    prompts = [PROMPT, "import os\n", "class Stack:\n    def push(self, x):\n"]
    texts = qfuse.generate(model, tok, prompts, max_tokens=6)
    assert isinstance(texts, list) and len(texts) == 3
    assert texts == [qfuse.generate(model, tok, p, max_tokens=6) for p in prompts]


def test_sampling_options_are_passed_and_seeded(default_model):
    model, tok = default_model
    kw = {"max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": 3}
    assert qfuse.generate(model, tok, PROMPT, **kw) == qfuse.generate(model, tok, PROMPT, **kw)
    assert qfuse.generate(model, tok, PROMPT, max_tokens=8, kv_bits=8)  # quantized KV cache
    # A KV cache capped below the prompt keeps the prompt's end: fewer prompt tokens.
    capped = list(qfuse.stream_generate(model, tok, PROMPT * 4, max_tokens=4, max_kv_size=12))
    assert capped[-1].prompt_tokens == 12 - 4 < len(tok.encode(PROMPT * 4).ids)


def test_verbose_prints_text_and_stats(default_model, capsys):
    model, tok = default_model
    text = qfuse.generate(model, tok, PROMPT, max_tokens=5, verbose=True)
    out = capsys.readouterr()
    assert out.out == text + "\n"
    assert "prompt:" in out.err and "tokens/s" in out.err and "peak memory" in out.err


def test_user_mistakes_raise_user_error(default_model):
    model, tok = default_model
    with pytest.raises(qfuse.UserError, match="temperature"):
        qfuse.generate(model, tok, PROMPT, temperature=-1.0)
    with pytest.raises(qfuse.UserError, match="exceeds the model's context"):
        qfuse.generate(model, tok, PROMPT, max_tokens=10**6)
    with pytest.raises(qfuse.UserError, match="one prompt"):
        list(qfuse.stream_generate(model, tok, [PROMPT]))
    with pytest.raises(qfuse.UserError, match="KV cache bits"):
        qfuse.generate(model, tok, PROMPT, kv_bits=3)
    with pytest.raises(qfuse.UserError, match="does not divide the model's head_dim"):
        qfuse.generate(model, tok, PROMPT, kv_bits=4, kv_group_size=128)
    if not torch.cuda.is_available():
        with pytest.raises(qfuse.UserError, match="cuda_graph needs"):
            qfuse.generate(model, tok, PROMPT, cuda_graph=True)


def test_load_shows_progress_unless_asked_not_to(monkeypatch):
    import qfuse.loading

    seen = []
    real = qfuse.loading.load_model
    monkeypatch.setattr(qfuse.loading, "load_model",
                        lambda *a, **kw: seen.append(kw["progress"]) or real(*a, **kw))
    qfuse.load()
    qfuse.load(progress=False)
    assert seen == [True, False]  # load_model's bar appears once loading passes a second


def test_logprobs_are_the_distribution_each_token_came_from(default_model):
    model, tok = default_model
    responses = list(qfuse.stream_generate(model, tok, PROMPT, max_tokens=6))
    ids = torch.tensor([tok.encode(PROMPT).ids + [r.token for r in responses[:-1]]])
    with torch.no_grad():  # the same distributions, teacher-forced in one forward
        expected = torch.log_softmax(model(ids)[0, -len(responses):].float(), -1)
    for r, lp in zip(responses, expected):
        assert r.logprobs.shape == (model.config.vocab_size,)
        assert r.logprobs.dtype == torch.float32
        assert int(r.logprobs.argmax()) == r.token  # greedy
        assert r.logprob == float(r.logprobs[r.token]) <= 0
        assert abs(float(torch.logsumexp(r.logprobs, -1))) < 1e-4
        torch.testing.assert_close(r.logprobs, lp, atol=1e-4, rtol=0)
    # Before temperature (as mlx-lm reports them): sampling hot leaves the first step's
    # distribution as it was; the repetition penalty changes it.
    hot = next(qfuse.stream_generate(model, tok, PROMPT, max_tokens=1, temperature=2.0, seed=0))
    torch.testing.assert_close(hot.logprobs, responses[0].logprobs)
    penalized = next(qfuse.stream_generate(model, tok, PROMPT, max_tokens=1,
                                           repetition_penalty=1.5))
    assert not torch.equal(penalized.logprobs, responses[0].logprobs)


@pytest.mark.parametrize("options, message", [
    ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
    ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty must be a finite number"),
    ({"top_p": float("nan")}, "top_p must be a finite number"),
    ({"min_p": float("-inf")}, "min_p must be a finite number"),
    ({"seed": 2**63}, "seed must be an integer in [-2**63, 2**63) (int64)"),
    ({"seed": -2**63 - 1}, "seed must be an integer in [-2**63, 2**63) (int64)"),
    ({"seed": 1.5}, "seed must be an integer"),
])
def test_non_finite_values_and_seeds_past_int64_raise_user_error(default_model, options,
                                                                 message):
    """NaN passed every range check (and sampled garbage), inf broke the softmax, a seed
    past int64 overflowed in torch: each is a UserError before any compute."""
    model, tok = default_model
    with pytest.raises(qfuse.UserError, match=re.escape(message)):
        qfuse.generate(model, tok, PROMPT, max_tokens=2, **options)
    with pytest.raises(qfuse.UserError, match=re.escape(message)):
        next(qfuse.stream_generate(model, tok, PROMPT, max_tokens=2, **options))


def test_seeds_at_the_int64_bounds_sample(default_model):
    model, tok = default_model
    for seed in (2**63 - 1, -2**63):
        kw = {"max_tokens": 3, "temperature": 1.0, "seed": seed}
        assert qfuse.generate(model, tok, PROMPT, **kw) == qfuse.generate(model, tok, PROMPT, **kw)


def test_prompts_that_are_not_utf8_raise_user_error(default_model):
    """A lone surrogate (what Python makes of bytes that are not UTF-8) made the tokenizer
    raise a TypeError."""
    model, tok = default_model
    with pytest.raises(qfuse.UserError, match=re.escape(
            "the prompt is not valid UTF-8 (byte 0xe9 at character 3)")):
        qfuse.generate(model, tok, "caf\udce9")
    with pytest.raises(qfuse.UserError, match="the prompt is not valid UTF-8"):
        next(qfuse.stream_generate(model, tok, "caf\udce9"))
    with pytest.raises(qfuse.UserError, match=re.escape("prompt 1 is not valid UTF-8 (U+D800")):
        qfuse.generate(model, tok, [PROMPT, "\ud800"])


class _Clock:
    """time as `qfuse.runtime.generation` reads it: seconds pass only when a test says so."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_prompt_rate_excludes_the_warm_up_and_says_when_kernels_compiled(checkpoint,
                                                                         monkeypatch):
    """A model's first generation runs one untimed forward of one token first, so the
    one-time start-up (here a fake 1000 s) stays out of the prompt's tokens/s
    (bench/NOTES.md, "The stats line"); a prefill during which Triton compiles a kernel
    is marked as including it."""
    import qfuse.runtime.generation

    triton = pytest.importorskip("triton")
    model, tok = qfuse.load(checkpoint, progress=False)  # a fresh model: never warmed up
    clock, shapes, compile_during = _Clock(), [], []
    real_forward = model.forward

    def forward(ids, *args, **kwargs):
        shapes.append(tuple(ids.shape))
        clock.now += 1000.0 if len(shapes) == 1 else 1.0  # the one-time cost, then 1 s
        if compile_during:  # what Triton calls after compiling (or loading) a kernel
            triton.knobs.runtime.jit_post_compile_hook(key="k", repr="k", fn=None)
        return real_forward(ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    monkeypatch.setattr(qfuse.runtime.generation, "time", clock)
    n = len(tok.encode("def add(a, b):").ids)
    first = list(qfuse.stream_generate(model, tok, "def add(a, b):", max_tokens=2))
    assert shapes == [(1, 1), (1, n)]  # the warm-up, then the timed prefill
    assert first[0].prompt_tps == first[-1].prompt_tps == n / 1.0
    assert not first[0].prompt_compiled
    # Warm now: no second warm-up. A hook set before qfuse's still gets its calls.
    seen = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook",
                        lambda **kw: seen.append(kw["key"]))
    compile_during.append(True)
    summary = list(engine(model, tok, ["def add(a, b):"], max_tokens=2))[-1]
    assert shapes[2:] == [(1, n)] and seen == ["k"]
    assert summary.prompt_tps == n / 1.0 and summary.prompt_compiled


def test_generation_rate_needs_two_tokens(default_model, capsys):
    """The first token comes out of prefill: one token gives no rate (the engine's was
    1 token over a few microseconds: thousands of tokens/s)."""
    model, tok = default_model
    one = list(engine(model, tok, [PROMPT], max_tokens=1))[-1]
    assert one.generation_tokens == 1 and one.generation_tps is None
    three = list(engine(model, tok, [PROMPT], max_tokens=3))[-1]
    assert three.generation_tokens == 3 and three.generation_tps > 0
    qfuse.generate(model, tok, PROMPT, max_tokens=1, verbose=True)
    err = capsys.readouterr().err
    assert "generation: 1 token\n" in err and "prompt:" in err


def test_anew_prefill_shape_on_cuda_counts_as_compiling():
    """cuDNN attention plans each new shape inside the prefill, and no hook says so: on
    CUDA the first prefill of a shape is marked; the CPU pays nothing for a new shape."""
    from qfuse.runtime.generation import new_prefill_shape

    model, cuda, cpu = torch.nn.Linear(1, 1), torch.device("cuda"), torch.device("cpu")
    assert new_prefill_shape(model, cuda, (1, 5))
    assert not new_prefill_shape(model, cuda, (1, 5))
    assert new_prefill_shape(model, cuda, (1, 6)) and new_prefill_shape(model, cuda, (2, 5))
    assert new_prefill_shape(torch.nn.Linear(1, 1), cuda, (1, 5))  # per model
    assert not new_prefill_shape(model, cpu, (3, 7))


def test_a_vanishing_temperature_or_top_p_samples_the_likeliest_token(default_model):
    # float32 turns 1e-30 and 1e-50 into overflow and zero: sampling must still be
    # greedy in the limit, not NaN probabilities or an empty nucleus.
    model, tok = default_model
    greedy = qfuse.generate(model, tok, "def fib(n):", max_tokens=8)
    assert qfuse.generate(model, tok, "def fib(n):", max_tokens=8, temperature=1e-30,
                          seed=1) == greedy
    assert qfuse.generate(model, tok, "def fib(n):", max_tokens=8, temperature=1.0,
                          top_p=1e-50, seed=1) == greedy


@pytest.mark.parametrize("options, message", [
    ({"max_tokens": 1.5}, "max_tokens must be an integer, got 1.5 (float)"),
    ({"max_tokens": "8"}, "max_tokens must be an integer, got '8' (str)"),
    ({"max_tokens": None}, "max_tokens must be an integer, got None (NoneType)"),
    ({"max_tokens": True}, "max_tokens must be an integer, got True (bool)"),
    ({"stop": 5}, "stop must be a string or a list of strings, got 5 (int)"),
    ({"stop": ["\n", 3]}, ("stop must be a string or a list of strings, got a list whose item 1 "
                           "is 3 (int)")),
    ({"temperature": "x"}, "temperature must be a finite number, got 'x'"),
    ({"top_k": 1.5}, "top_k must be an integer, got 1.5"),
    ({"seed": "3"}, "seed must be an integer"),
    ({"kv_bits": "4"}, "kv_bits must be an integer (0, 4 or 8), got '4' (str)"),
    ({"kv_group_size": 64.0}, "kv_group_size must be an integer (32, 64 or 128), got 64.0"),
    ({"max_kv_size": 2.5}, "max_kv_size must be an integer or None, got 2.5 (float)"),
    ({"cuda_graph": "yes"}, "cuda_graph must be True, False or None, got 'yes' (str)"),
    ({"add_special_tokens": "no"}, "add_special_tokens must be True or False, got 'no'"),
])
def test_arguments_of_the_wrong_type_raise_user_error(default_model, options, message):
    """Each a raw TypeError from inside before (or a misleading message, or silence):
    now a UserError naming the argument and the type it takes, before any compute."""
    model, tok = default_model
    options = {"max_tokens": 4, **options}
    with pytest.raises(qfuse.UserError, match=re.escape(message)):
        qfuse.generate(model, tok, PROMPT, **options)
    with pytest.raises(qfuse.UserError, match=re.escape(message)):
        list(qfuse.stream_generate(model, tok, PROMPT, **options))
    with pytest.raises(qfuse.UserError, match=re.escape(message)):
        qfuse.generate(model, tok, [PROMPT, PROMPT], **options)


@pytest.mark.parametrize("prompt, message", [
    (None, "prompt must be a string or a list of strings, got None (NoneType)"),
    (5, "prompt must be a string or a list of strings, got 5 (int)"),
    (b"x = 1", "prompt must be a string or a list of strings, got b'x = 1' (bytes)"),
    ([PROMPT, None], ("prompt must be a string or a list of strings, got a list whose item 1 "
                      "is None (NoneType)")),
])
def test_a_prompt_of_the_wrong_type_raises_user_error(default_model, prompt, message):
    model, tok = default_model
    with pytest.raises(qfuse.UserError, match=re.escape(message)):
        qfuse.generate(model, tok, prompt, max_tokens=4)
    with pytest.raises(qfuse.UserError, match="stream_generate takes one prompt, a string"):
        list(qfuse.stream_generate(model, tok, prompt, max_tokens=4))


def test_options_generate_does_not_take_raise_user_error(default_model):
    model, tok = default_model
    with pytest.raises(qfuse.UserError, match=re.escape(
            "generate has no option 'temprature' (did you mean 'temperature'?)")):
        qfuse.generate(model, tok, PROMPT, max_tokens=4, temprature=0.5)
    with pytest.raises(qfuse.UserError, match="generate returns text only: stream_generate "
                                              "gives logprobs"):
        qfuse.generate(model, tok, PROMPT, max_tokens=4, logprobs=True)
    with pytest.raises(qfuse.UserError, match=re.escape("verbose must be True or False, got "
                                                        "'x' (str)")):
        qfuse.generate(model, tok, PROMPT, max_tokens=4, verbose="x")
    with pytest.raises(qfuse.UserError, match=re.escape(
            "check_weights must be True or False, got 'no' (str)")):
        qfuse.load(check_weights="no")


def test_a_lone_stop_string_is_one_stop_not_its_characters(default_model):
    """stop="ab" stopped at "a" or "b" (the string iterated); it is one stop string, as
    the OpenAI API takes it."""
    model, tok = default_model
    text = qfuse.generate(model, tok, PROMPT, max_tokens=16)
    # Two characters first met together at i, the second already seen before i: cut at
    # its characters, the text would end before i.
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1)
                if text[i + 1] in text[:i] and text.index(text[i:i + 2]) == i)
    assert min(text.index(c) for c in stop) < text.index(stop)
    assert qfuse.generate(model, tok, PROMPT, max_tokens=16, stop=stop) == \
        qfuse.generate(model, tok, PROMPT, max_tokens=16, stop=[stop]) == text[:text.index(stop)]
