"""Request parsing of `qfuse serve` without a server: chat messages for a model with no
chat template become the same plain "Role: text" prompt `qfuse chat` sends."""

from qfuse.loading import DEFAULT_MODEL, PLAIN_STOP, load_tokenizer, render_plain
from qfuse.serving.protocol import ModelInfo, parse_chat


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
