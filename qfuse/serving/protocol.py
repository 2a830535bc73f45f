"""OpenAI request bodies → what the engine runs, or an `ApiError` naming the bad field.

`parse_json(raw)` reads a body (pydantic_core's parser: NaN and Infinity are read,
so that the field holding one is named below; a lone surrogate, invalid UTF-8 or
nesting past 200 levels is invalid JSON). `parse_completion(body, ...)` and
`parse_chat(body, ...)` validate it against pydantic models of the OpenAI schema
(`CompletionRequest`, `ChatRequest`: strict types, finite floats, bounded integers,
enumerated roles; unknown fields are ignored, those of the API this server does not
implement are refused by name) and return a `Job`: the prompts' token ids (chat
messages go through the model's chat template, or plain "User:/Assistant:" turns
without one; a completion's prompt may be a string, a list of strings, a list of
token ids or a list of such lists, n choices for each), the sampling parameters and
how to answer (stream, n, logprobs). A request the server cannot serve is an
ApiError with the status and the OpenAI error object's fields; it never reaches the
engine, whose step a NaN or an out-of-range seed would break.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from ..errors import RequestError, UserError
from ..loading import PLAIN_STOP, render_chat, render_plain
from ..runtime.prompts import encode_prompts, fit_prompt
from ..runtime.sampling import SamplingParams


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
_INT32 = (1 << 31) - 1  # the bound of counts (tokens, top_k): far above any context
# A temperature this small samples the argmax to float32 precision; dividing the logits
# by one smaller still can overflow to inf, and softmax then gives NaN (SGLang, too,
# samples greedily below 1e-6).
_GREEDY_BELOW = 1e-6
# The same for top_p: float32 (where sampling compares) rounds a denormal top_p to 0,
# which would drop every token; any top_p up to this one keeps only the likeliest.
_TOP_P_FLOOR = 1e-8


# ---- the OpenAI request bodies, as pydantic models ----

def _described(what: str) -> WrapValidator:
    """One error saying what the field must be, instead of one per member of a union."""
    def validate(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_type", what) from None
    return WrapValidator(validate)


def _finite(**bounds) -> type:
    return Annotated[float, Field(allow_inf_nan=False, **bounds)]


_Tokens = Annotated[int, Field(ge=1, le=_INT32)]
_Penalty = _finite(ge=-2, le=2)  # OpenAI's range of presence and frequency penalties
_Temperature = _finite(ge=0, le=2)
_TopP = _finite(gt=0, le=1)
_MinP = _finite(ge=0, lt=1)
# vLLM's range, with a floor: a penalty near 0 would divide the logits into inf.
_RepetitionPenalty = _finite(ge=0.01, le=2)
_Seed = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]  # int64, as torch seeds
_TopLogprobs = Annotated[int, Field(ge=0, le=20)]
_TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=_INT32)]], Field(min_length=1)]
_Stop = Annotated[str | Annotated[list[str], Field(max_length=4)],
                  _described("must be a string or a list of at most 4 strings")]
MAX_STOP_TOKEN_IDS = 64  # far more than any model's end tokens; each is a set lookup per token
_StopTokenIds = Annotated[list[Annotated[int, Field(ge=0, le=_INT32)]],
                          Field(max_length=MAX_STOP_TOKEN_IDS),
                          _described(f"must be a list of at most {MAX_STOP_TOKEN_IDS} "
                                     "token ids (integers from 0)")]
_Prompt = Annotated[
    str | Annotated[list[str], Field(min_length=1)] | _TokenIds
    | Annotated[list[_TokenIds], Field(min_length=1)],
    _described("must be a string, a list of strings, a list of token ids or a list of lists "
               "of token ids (none of them empty)")]


class _Schema(BaseModel):
    # strict: no "5" for 5, no true for 1, no 5.0 for an integer; unknown fields are
    # kept aside (model_extra), where the unsupported ones are looked for.
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Schema):
    include_usage: bool | None = None


class TextPart(_Schema):
    type: Literal["text"]
    text: str


class Message(_Schema):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str | list[TextPart], _described(
        'must be a string or a list of text parts ({"type": "text", "text": ...}); '
        "only text is supported")]


class _Sampling(_Schema):
    """The fields both endpoints share, with OpenAI's ranges (and vLLM's extensions
    top_k, min_p, repetition_penalty, stop_token_ids)."""
    model: str | None = None
    max_tokens: _Tokens | None = None
    max_completion_tokens: _Tokens | None = None
    temperature: _Temperature | None = None
    top_p: _TopP | None = None
    top_k: Annotated[int, Field(ge=-1, le=_INT32)] | None = None  # 0 or -1 (vLLM's): off
    min_p: _MinP | None = None
    repetition_penalty: _RepetitionPenalty | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    seed: _Seed | None = None
    stop: _Stop | None = None
    stop_token_ids: _StopTokenIds | None = None
    n: Annotated[int, Field(ge=1, le=16)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""
    prompt: _Prompt
    logprobs: _TopLogprobs | None = None
    echo: bool | None = None


class ChatRequest(_Sampling):
    """POST /v1/chat/completions."""
    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: _TopLogprobs | None = None


def _brief(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _validate(schema: type[_Sampling], body: dict) -> _Sampling:
    """``body`` as ``schema``; ApiError 400 naming the first bad field (OpenAI's error
    object has one param: the top-level field; the message gives the full path)."""
    try:
        request = schema.model_validate(body)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        loc = error["loc"]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        message = error["msg"]
        message = message[:1].lower() + message[1:]
        if error["type"] != "missing":
            message += f", got {_brief(error['input'])}"
        raise ApiError(400, f"{where or 'the body'}: {message}",
                       str(loc[0]) if loc else None) from None
    for name in _UNSUPPORTED:
        if (request.model_extra or {}).get(name) is not None:
            raise ApiError(400, f"{name} is not supported by this server", name)
    return request


def parse_json(raw: bytes) -> dict:
    """The JSON object of a request body; ApiError 400 (code invalid_json) otherwise."""
    try:
        value = pydantic_core.from_json(raw)
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON ({e})", code="invalid_json") from e
    if not isinstance(value, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return value


# ---- what the engine runs ----

@dataclass
class Job:
    prompts: list[list[int]]  # one for chat; a completion may have several
    max_tokens: int
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # each ends a choice, unseen
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


def model_not_found(name: str, model: ModelInfo) -> ApiError:
    """OpenAI's 404 for a model this server does not serve."""
    return ApiError(404, f"the model {name!r} does not exist; this server serves "
                         f"{model.name!r}", "model", code="model_not_found")


def _check_model(body: dict, model: ModelInfo) -> None:
    """404 for a model this server does not serve (checked before the rest of the body;
    a name that is no string is the schema's 400)."""
    name = body.get("model")
    if isinstance(name, str) and name != model.name:
        raise model_not_found(name, model)


def _vocab(model: ModelInfo) -> int:
    """Token ids below this one index the embedding and the tokenizer both."""
    return min(model.tokenizer.get_vocab_size(), model.vocab_size or 1 << 62)


def _common(request: _Sampling, model: ModelInfo, prompts: list[list[int]],
            chat: bool) -> Job:
    max_tokens = request.max_completion_tokens
    if max_tokens is None:
        max_tokens = request.max_tokens
    if max_tokens is None:  # OpenAI's defaults: 16 tokens for completions; as many as fit for chat
        max_tokens = 16 if not chat else max(1, model.context - len(prompts[0]))
    temperature = 1.0 if request.temperature is None else request.temperature
    if temperature < _GREEDY_BELOW:
        temperature = 0.0
    try:
        params = SamplingParams(
            temperature=temperature,
            top_p=1.0 if request.top_p is None else max(request.top_p, _TOP_P_FLOOR),
            top_k=max(request.top_k or 0, 0), min_p=request.min_p or 0.0,
            repetition_penalty=(1.0 if request.repetition_penalty is None
                                else request.repetition_penalty),
            seed=request.seed)
    except RequestError as e:
        raise ApiError(400, str(e), str(e).split()[0]) from e
    try:
        prompts = [fit_prompt(ids, max_tokens, model.context) for ids in prompts]
    except RequestError as e:
        # OpenAI's code for it, by which the chat page knows to drop its oldest turns.
        raise ApiError(400, str(e), "messages" if chat else "prompt",
                       code="context_length_exceeded") from e
    stop = request.stop
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    stop_token_ids = request.stop_token_ids or []
    vocab = _vocab(model)
    if any(t >= vocab for t in stop_token_ids):
        raise ApiError(400, f"stop_token_ids: a token id is outside [0, {vocab}), got "
                            f"{_brief(max(stop_token_ids))}", "stop_token_ids")
    n = request.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts × n={n} is over the {MAX_CHOICES} "
                            "choices one request may ask for", "prompt")
    options = request.stream_options
    return Job(prompts=prompts, max_tokens=max_tokens, params=params, stop=[s for s in stop if s],
               stop_token_ids=stop_token_ids,
               presence_penalty=request.presence_penalty or 0.0,
               frequency_penalty=request.frequency_penalty or 0.0,
               n=n, stream=bool(request.stream),
               include_usage=bool(options is not None and options.include_usage))


def _encode(model: ModelInfo, text: str, special: bool) -> list[int]:
    try:
        return encode_prompts(model.tokenizer, [text], add_special_tokens=special)[0]
    except RequestError as e:
        raise ApiError(400, str(e), "prompt" if special else "messages") from e


def parse_completion(body: dict, model: ModelInfo) -> Job:
    _check_model(body, model)
    request = _validate(CompletionRequest, body)
    prompt = request.prompt
    # A string or one list of ids is one prompt; any other list holds several.
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    # An id outside the vocabulary would index past the embedding: refuse it here.
    vocab = _vocab(model)
    for p in prompts:
        if not isinstance(p, str) and max(p) >= vocab:
            raise ApiError(400, f"a token id in prompt is outside [0, {vocab})", "prompt")
    # Token ids go to the model as they are, without the tokenizer's special tokens.
    ids = [_encode(model, p, True) if isinstance(p, str) else list(p) for p in prompts]
    job = _common(request, model, ids, chat=False)
    job.logprobs = request.logprobs
    if request.echo:
        job.echoes = [p if isinstance(p, str) else model.tokenizer.decode(p) for p in prompts]
    return job


def render_messages(messages: list[Message], model: ModelInfo) -> tuple[str, bool]:
    """(prompt, has_template): the conversation through the chat template, else as
    plain "Role: text" turns ending in "Assistant:"."""
    turns = [{"role": m.role, "content": m.content if isinstance(m.content, str)
              else "".join(part.text for part in m.content)} for m in messages]
    if model.chat_template:
        try:
            return render_chat(model.chat_template, turns, model.special_tokens), True
        except UserError as e:
            raise ApiError(400, str(e), "messages") from e
    return render_plain(turns), False


def parse_chat(body: dict, model: ModelInfo) -> Job:
    _check_model(body, model)
    request = _validate(ChatRequest, body)
    prompt, templated = render_messages(request.messages, model)
    # A rendered template carries its own BOS; plain turns get the tokenizer's.
    job = _common(request, model, [_encode(model, prompt, not templated)], chat=True)
    if not templated:  # plain turns: the model would go on to write the user's next turn
        job.stop = list(dict.fromkeys([*job.stop, PLAIN_STOP]))
    if request.logprobs:
        job.logprobs = request.top_logprobs or 0
    elif request.top_logprobs is not None:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return job
