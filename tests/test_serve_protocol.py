"""Request parsing of `qfuse serve` without a server: chat messages for a model with no
chat template become the same plain "Role: text" prompt `qfuse chat` sends; the
request schema refuses, naming the field, every value that could break the engine's
step (NaN, infinities, seeds outside int64, wrong types, unknown roles), and a body
that is no JSON object (a lone surrogate, invalid UTF-8, deep nesting) is a 400."""

import pytest

pytest.importorskip("pydantic")  # the `serve` extra's (the GPU machine's image lacks it)

from qfuse.loading import DEFAULT_MODEL, PLAIN_STOP, load_tokenizer, render_plain
from qfuse.serving.protocol import ApiError, ModelInfo, parse_chat, parse_completion, parse_json


def test_plain_turns_match_qfuse_chat():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "sum?"}]
    text = render_plain(messages)
    assert text == "System: be brief\nUser: hi\nAssistant: hello\nUser: sum?\nAssistant:"
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    info = ModelInfo("m", tokenizer, context=256, chat_template=None)
    job = parse_chat({"messages": messages, "max_tokens": 4, "stop": "x"}, info)
    assert job.prompts == [tokenizer.encode(text).ids]  # plain turns get the tokenizer's BOS
    assert job.stop == ["x", PLAIN_STOP]


# ---- the request schema (pydantic), field by field ----

@pytest.fixture(scope="module")
def info():
    return ModelInfo("default", load_tokenizer(DEFAULT_MODEL), context=256)


def _refused(parse, body, info) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(body, info)
    assert e.value.status == 400
    return e.value


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "x", "max_tokens": 2}
FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty")


@pytest.mark.parametrize("field", FLOATS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_every_float_field_must_be_finite(info, field, value):
    for parse, body in ((parse_completion, COMPLETION), (parse_chat, CHAT)):
        error = _refused(parse, {**body, field: value}, info)
        assert error.param == field and "finite" in error.message, error.message


def test_integers_are_bounded_and_strict(info):
    for seed in (-2 ** 63, 2 ** 63 - 1):
        assert parse_completion({**COMPLETION, "seed": seed}, info).params.seed == seed
    for field, value in (("seed", 2 ** 63), ("seed", -2 ** 63 - 1), ("seed", 1.5),
                         ("max_tokens", 0), ("max_tokens", 2 ** 64), ("max_tokens", 2.0),
                         ("max_tokens", "2"), ("max_tokens", True), ("n", 17), ("n", 0),
                         ("top_k", -2), ("logprobs", 21), ("max_completion_tokens", -1)):
        error = _refused(parse_completion, {**COMPLETION, field: value}, info)
        assert error.param == field and repr(value) in error.message, (field, value)


def test_ranges_types_and_roles(info):
    for field, value in (("temperature", 2.5), ("top_p", 0), ("min_p", 1),
                         ("repetition_penalty", 0.001), ("repetition_penalty", 2.5),
                         ("presence_penalty", -2.5), ("temperature", "1"), ("stream", 1),
                         ("stop", ["a"] * 5), ("stop", 3), ("stream_options", []),
                         ("model", 5), ("echo", "yes")):
        assert _refused(parse_completion, {**COMPLETION, field: value}, info).param == field
    for messages in ([], [{"role": "robot", "content": "x"}], [{"role": "user"}],
                     [{"role": "user", "content": 5}], ["hi"],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]):
        assert _refused(parse_chat, {**CHAT, "messages": messages}, info).param == "messages"
    assert _refused(parse_chat, {**CHAT, "top_logprobs": 2}, info).param == "top_logprobs"
    for prompt in ([], [[]], [1, "x"], [True], [-1], 5, None):
        assert _refused(parse_completion, {**COMPLETION, "prompt": prompt}, info).param \
            == "prompt"
    with pytest.raises(ApiError) as e:
        parse_completion({**COMPLETION, "model": "gpt-9"}, info)
    assert e.value.status == 404


def test_unsupported_fields_are_named_and_unknown_ones_ignored(info):
    for name in ("tools", "logit_bias", "response_format", "suffix"):
        assert _refused(parse_completion, {**COMPLETION, name: {}}, info).param == name
        parse_completion({**COMPLETION, name: None}, info)  # null: not asked for
    job = parse_chat({**CHAT, "user": "me", "metadata": {"a": 1}, "store": False}, info)
    assert job.max_tokens == 2


def test_top_k_minus_one_is_off_as_vllm_clients_send_it(info):
    assert parse_completion({**COMPLETION, "top_k": -1}, info).params.top_k == 0


def test_valid_values_reach_the_job(info):
    job = parse_completion({**COMPLETION, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
                            "min_p": 0.1, "repetition_penalty": 1.2, "seed": -3, "n": 2,
                            "presence_penalty": -2, "frequency_penalty": 2, "stop": "a",
                            "stream": True, "stream_options": {"include_usage": True},
                            "logprobs": 3, "echo": True}, info)
    p = job.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.seed) == \
        (0.7, 0.9, 5, 0.1, 1.2, -3)
    assert (job.n, job.presence_penalty, job.frequency_penalty, job.stop, job.stream,
            job.include_usage, job.logprobs, job.echoes) == (2, -2, 2, ["a"], True, True, 3,
                                                              ["x"])
    # Integers for floats (JSON has one number type); text parts of a message join.
    job = parse_chat({**CHAT, "temperature": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]}, info)
    assert job.prompts == parse_chat(CHAT, info).prompts and job.params.temperature == 1.0
    # A temperature too small to divide logits by in float32 samples greedily.
    assert parse_completion({**COMPLETION, "temperature": 5e-324}, info).params.temperature == 0
    # A top_p that float32 would round to 0 (dropping every token) keeps the likeliest.
    assert parse_completion({**COMPLETION, "top_p": 2.2e-313}, info).params.top_p == 1e-8


def test_stop_token_ids_are_at_most_64_ids_within_the_vocabulary(info):
    vocab = info.tokenizer.get_vocab_size()
    for parse, body in ((parse_completion, COMPLETION), (parse_chat, CHAT)):
        assert parse(body, info).stop_token_ids == []
        job = parse({**body, "stop_token_ids": [0, vocab - 1] + [7] * 62}, info)
        assert job.stop_token_ids == [0, vocab - 1] + [7] * 62
        for value in ([vocab], [1, 2 ** 40], [-1], [1.0], ["1"], [True], 5, [[1]],
                      [1] * 65):
            error = _refused(parse, {**body, "stop_token_ids": value}, info)
            assert error.param == "stop_token_ids", (value, error.message)
            assert error.message.startswith("stop_token_ids"), error.message


def test_bodies_that_are_no_json_object_are_400s():
    assert parse_json(b'{"a": NaN}')["a"] != parse_json(b'{"a": NaN}')["a"]  # read: named later
    for raw in (b'{"prompt": "caf\\udce9"}', b'{"prompt": "\\udce9x"}', b'{"p": "\xff"}',
                b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * 100_000, b"", b"{", b"[1]",
                b'"x"'):
        with pytest.raises(ApiError) as e:
            parse_json(raw)
        assert e.value.status == 400 and e.value.code == "invalid_json", raw[:20]
    assert parse_json(b'{"prompt": "caf\\u00e9 \\ud83d\\ude00"}') == {"prompt": "café 😀"}
