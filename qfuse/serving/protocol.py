"""OpenAI request bodies → what the engine runs, or an `ApiError` naming the bad field.

`parse_completion(body, ...)` and `parse_chat(body, ...)` check every field the
server supports and return a `Job`: the prompts' token ids (chat messages go
through the model's chat template, or plain "User:/Assistant:" turns without
one; a completion's prompt may be a string, a list of strings, a list of token
ids or a list of such lists, n choices for each), the sampling parameters and how to answer (stream, n, logprobs). A request
the server cannot serve is an ApiError with the status and the OpenAI error
object's fields; it never reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserError
from ..generation import RequestError, SamplingParams, encode_prompts, fit_prompt
from ..loading import PLAIN_STOP, render_chat, render_plain


class ApiError(Exception):
    """An error the client sees as ``{"error": {...}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type_, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# Fields of the OpenAI API that this server does not implement: refused by name
# rather than silently ignored, so a client never gets an answer it did not ask for.
_UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "logit_bias",
                "response_format", "suffix", "best_of", "audio", "modalities", "prediction")


MAX_CHOICES = 64  # prompts × n in one request: more is a 400, not a flood of the queue


@dataclass
class Job:
    prompts: list[list[int]]  # one for chat; a completion may have several
    max_tokens: int
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: off; k: the sampled token's and the top k
    echoes: list[str] = field(default_factory=list)  # per prompt, with "echo": true

    @property
    def choices(self) -> int:
        """Choices in the answer: n for each prompt, prompt p's at p*n .. p*n + n-1."""
        return len(self.prompts) * self.n

    def echo(self, choice: int) -> str:
        return self.echoes[choice // self.n] if self.echoes else ""


@dataclass
class ModelInfo:
    """What parsing needs to know of the served model."""
    name: str
    tokenizer: object
    context: int  # tokens per sequence: prompt + max_tokens
    bos_token_id: int | None = None
    chat_template: str | None = None
    special_tokens: dict = field(default_factory=dict)
    vocab_size: int | None = None  # the embedding's rows, when it may differ from the tokenizer's


def _number(body: dict, name: str, default, kind=float, low=None, high=None):
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok:
        raise ApiError(400, f"{name} must be {'an integer' if kind is int else 'a number'}, "
                            f"got {value!r}", name)
    value = kind(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ApiError(400, f"{name} must lie in [{low}, {high}], got {value}", name)
    return value


def _check_model(body: dict, model: ModelInfo) -> None:
    """404 for a model this server does not serve (checked before the rest of the body)."""
    name = body.get("model")
    if name is not None and name != model.name:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                            f"{model.name!r}", "model", code="model_not_found")


def _common(body: dict, model: ModelInfo, prompts: list[list[int]], chat: bool) -> Job:
    for name in _UNSUPPORTED:
        if body.get(name) is not None:
            raise ApiError(400, f"{name} is not supported by this server", name)
    max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    # OpenAI's defaults: 16 tokens for completions; as many as fit for chat.
    max_tokens = _number(body, max_key, None, int, 1)
    if max_tokens is None:
        max_tokens = 16 if not chat else max(1, model.context - len(prompts[0]))
    try:
        params = SamplingParams(
            temperature=_number(body, "temperature", 1.0, float, 0, 2),
            top_p=_number(body, "top_p", 1.0), top_k=_number(body, "top_k", 0, int),
            min_p=_number(body, "min_p", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            seed=_number(body, "seed", None, int))
    except RequestError as e:
        raise ApiError(400, str(e), str(e).split()[0]) from e
    try:
        prompts = [fit_prompt(ids, max_tokens, model.context) for ids in prompts]
    except RequestError as e:
        # OpenAI's code for it, by which the chat page knows to drop its oldest turns.
        raise ApiError(400, str(e), "messages" if chat else "prompt",
                       code="context_length_exceeded") from e
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "stop must be a string or a list of at most 4 strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    n = _number(body, "n", 1, int, 1, 16)
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts × n={n} is over the {MAX_CHOICES} "
                            "choices one request may ask for", "prompt")
    return Job(prompts=prompts, max_tokens=max_tokens, params=params, stop=[s for s in stop if s],
               presence_penalty=_number(body, "presence_penalty", 0.0, float, -2, 2),
               frequency_penalty=_number(body, "frequency_penalty", 0.0, float, -2, 2),
               n=n, stream=stream,
               include_usage=bool(options.get("include_usage", False)))


def _encode(model: ModelInfo, text: str, special: bool) -> list[int]:
    try:
        return encode_prompts(model.tokenizer, [text], add_special_tokens=special)[0]
    except RequestError as e:
        raise ApiError(400, str(e), "prompt" if special else "messages") from e


def _is_ids(value) -> bool:
    # bool is an int in Python, but true is no token id.
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _completion_prompts(prompt, model: ModelInfo) -> list[list[int] | str]:
    """The prompts of a completion request, each a string or its token ids, as
    OpenAI accepts them: a string, a list of strings, a list of token ids, or a
    list of lists of token ids."""
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and (
            all(isinstance(p, str) for p in prompt) or all(_is_ids(p) for p in prompt)):
        prompts = prompt
    else:
        raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids "
                            "or a list of lists of token ids (none of them empty)", "prompt")
    # An id outside the vocabulary would index past the embedding: refuse it here.
    vocab = min(model.tokenizer.get_vocab_size(), model.vocab_size or 1 << 62)
    for p in prompts:
        if not isinstance(p, str) and not all(0 <= t < vocab for t in p):
            raise ApiError(400, f"a token id in prompt is outside [0, {vocab})", "prompt")
    return prompts


def parse_completion(body: dict, model: ModelInfo) -> Job:
    _check_model(body, model)
    prompts = _completion_prompts(body.get("prompt"), model)
    # Token ids go to the model as they are, without the tokenizer's special tokens.
    ids = [_encode(model, p, True) if isinstance(p, str) else list(p) for p in prompts]
    job = _common(body, model, ids, chat=False)
    job.logprobs = _number(body, "logprobs", None, int, 0, 20)
    if body.get("echo"):
        job.echoes = [p if isinstance(p, str) else model.tokenizer.decode(p) for p in prompts]
    return job


def render_messages(messages, model: ModelInfo) -> tuple[str, bool]:
    """(prompt, has_template): the conversation through the chat template, else as
    plain "Role: text" turns ending in "Assistant:"."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    turns = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(content, str):
            raise ApiError(400, f"messages[{i}] must be an object with a role and a text "
                                "content", "messages")
        turns.append({"role": m["role"], "content": content})
    if model.chat_template:
        try:
            return render_chat(model.chat_template, turns, model.special_tokens), True
        except UserError as e:
            raise ApiError(400, str(e), "messages") from e
    return render_plain(turns), False


def parse_chat(body: dict, model: ModelInfo) -> Job:
    _check_model(body, model)
    prompt, templated = render_messages(body.get("messages"), model)
    # A rendered template carries its own BOS; plain turns get the tokenizer's.
    job = _common(body, model, [_encode(model, prompt, not templated)], chat=True)
    if not templated:  # plain turns: the model would go on to write the user's next turn
        job.stop = list(dict.fromkeys([*job.stop, PLAIN_STOP]))
    if body.get("logprobs"):
        job.logprobs = _number(body, "top_logprobs", 0, int, 0, 20)
    elif body.get("top_logprobs") is not None:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return job
