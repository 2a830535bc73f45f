"""The Python API at the top of the package: qfuse.load / generate / stream_generate (CPU)."""

import dataclasses
import pydoc
import subprocess
import sys

import pytest
import torch

import qfuse
from qfuse.generation import Summary
from qfuse.generation import generate as engine

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
    with pytest.raises(qfuse.UserError, match="no model folder"):
        qfuse.load(tmp_path / "missing")
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
