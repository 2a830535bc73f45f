"""The Starlette application of `qfuse serve`: the OpenAI endpoints over an Engine.

POST /v1/chat/completions and /v1/completions (server-sent events with
"stream": true), GET /v1/models and /v1/models/{id}, GET /health (the model's context,
engine load: active slots, queue; the slots and CUDA graphs chosen at start), GET
/metrics (Prometheus text, `metrics`; no key needed, as for /health), and GET / the chat
page (chat.html beside this file, with its favicon.ico).
Every error is an OpenAI error object with its status (400, 401, 404, 405, 413, 503
with Retry-After, 500 for a bug, whose traceback goes to the server's log only).
A streaming client that disconnects cancels its requests, which frees their slots. A
stream's chunks are formatted by `chunks`, and the events waiting for a stream when it
runs go out in one write (one per step when it keeps up with the engine).

Cross-origin requests (CORS) are answered only for ``allowed_origins`` (starlette's
CORSMiddleware; off by default, so a page of another origin cannot use the API).
`drain(app)` (the server's first Ctrl-C or SIGTERM): new completions are 503s and /health
says "draining", while the requests in flight finish and /health and /metrics answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.resources
import json
import logging
import time
import uuid

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from .chunks import StreamChunks
from .engine import Engine, Event, QueueFull
from .engine import Request as EngineRequest
from .mailbox import for_loop
from .metrics import Clock, Metrics, NoMetrics, make_metrics
from .protocol import (
    ApiError,
    Job,
    ModelInfo,
    model_not_found,
    parse_chat,
    parse_completion,
    parse_json,
)

log = logging.getLogger("qfuse")

MAX_BODY_BYTES = 8 << 20  # far above any prompt that fits a context; a bigger body is 413


def _error(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _read_json(request: Request, limit: int) -> dict:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is over {limit} bytes", code="body_too_large")
    body, size = bytearray(), 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is over {limit} bytes",
                               code="body_too_large")
            body += chunk
    except ClientDisconnect as e:
        raise ApiError(400, "the client went away while sending the body") from e
    return parse_json(bytes(body))


class Handle:
    """The engine requests of one HTTP request (n for each prompt), their events
    on an asyncio queue as (choice index, Event); each event reaching the loop is
    recorded in ``metrics`` against ``clock`` (the request's arrival)."""

    def __init__(self, engine: Engine, job: Job, metrics: Metrics | NoMetrics, clock: Clock):
        self.engine, self.job = engine, job
        self.metrics, self.clock = metrics, clock
        mailbox = for_loop(asyncio.get_running_loop())  # one wake-up for a step's events
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.requests = []
        for c in range(job.choices):
            p, i = divmod(c, job.n)
            params = job.params
            if params.seed is not None and i:  # n samples with one seed: distinct, reproducible
                # seed + i wraps around within int64, as the seed itself must lie there.
                params = dataclasses.replace(params, seed=(params.seed + i + 2**63) % 2**64
                                             - 2**63)

            def emit(event, c=c):
                mailbox.post(self.queue, (c, event))
            self.requests.append(EngineRequest(
                job.prompts[p], job.max_tokens, params, job.stop, job.presence_penalty,
                job.frequency_penalty, job.logprobs, emit,
                stop_token_ids=frozenset(job.stop_token_ids)))

    def submit(self) -> None:
        try:
            for r in self.requests:
                self.engine.submit(r)
        except QueueFull:
            self.cancel()
            raise ApiError(503, "the server is busy: every slot and the queue are full; "
                                "retry later", type_="server_error", code="queue_full") from None

    def cancel(self) -> None:
        for r in self.requests:
            self.engine.cancel(r)

    async def events(self):
        """(index, Event) until every choice has finished."""
        async for batch in self.batches():
            for item in batch:
                yield item

    async def batches(self):
        """Lists of (index, Event) until every choice has finished, each list all the
        events waiting when its first came, so that a stream behind the engine writes
        them at once (an error event raises after the events before it)."""
        left, queue = len(self.requests), self.queue
        while left:
            waiting = [await queue.get()]
            while not queue.empty():
                waiting.append(queue.get_nowait())
            batch = []
            for i, event in waiting:
                if event.finish_reason == "error":
                    if batch:
                        yield batch
                    raise ApiError(500, "the engine failed on this request (see the server "
                                   "log)", type_="server_error")
                self.metrics.observe(self.clock, i, event, len(self.requests[i].ids))
                left -= event.finish_reason is not None
                batch.append((i, event))
            yield batch

    def usage(self) -> dict:
        done = sum(r.completion_tokens for r in self.requests)
        prompt = sum(len(ids) for ids in self.job.prompts)  # once per prompt, not per choice
        return {"prompt_tokens": prompt, "completion_tokens": done,
                "total_tokens": prompt + done}


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def _chat_logprobs(tokenizer, events: list[Event]) -> dict:
    def entry(token, logprob):
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**entry(e.token, e.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in e.top or []]}
                        for e in events if e.token is not None]}


def _completion_logprobs(tokenizer, events: list[Event], offset: int) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events:
        if e.token is None:
            continue
        text = _token_text(tokenizer, e.token)
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append({_token_text(tokenizer, t): lp for t, lp in e.top or []})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def drain(app: Starlette) -> None:
    """From now on ``app`` (of `make_app`) refuses new completions with 503 and /health
    says "draining"; requests already submitted go on."""
    app.state.draining = True


def make_app(engine: Engine, model: ModelInfo, api_key: str | None = None,
             max_body_bytes: int = MAX_BODY_BYTES, startup: dict | None = None,
             allowed_origins: list[str] | None = None) -> Starlette:
    """The app over ``engine``; ``startup``: what /health reports under "startup" (the
    slots and CUDA graphs the server chose and why, `sizing.Plan.as_dict`);
    ``allowed_origins``: the origins whose cross-origin requests are answered ("*": any;
    None: none)."""
    created = int(time.time())
    tokenizer = model.tokenizer
    # Read once: the page is static, and it needs no key (its requests carry the key).
    page = importlib.resources.files(__package__).joinpath("chat.html").read_text("utf-8")
    # Answered, so that a browser's automatic request for it is no 404 in the log.
    icon = importlib.resources.files(__package__).joinpath("favicon.ico").read_bytes()
    metrics = make_metrics(engine, model.name)
    entry = {"id": model.name, "object": "model", "created": created, "owned_by": "qfuse",
             "context_length": model.context}

    async def chat_page(request: Request) -> Response:
        return HTMLResponse(page)

    async def favicon(request: Request) -> Response:
        return Response(icon, media_type="image/vnd.microsoft.icon",
                        headers={"Cache-Control": "public, max-age=86400"})

    def check_key(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY",
                           code="invalid_api_key")

    async def health(request: Request) -> Response:
        # The context too: the chat page sizes its max tokens by it before any key is typed.
        status = "draining" if request.app.state.draining else "ok"
        return JSONResponse({"status": status, "model": model.name,
                             "context_length": model.context, **engine.stats(),
                             **({"startup": startup} if startup is not None else {})})

    async def metrics_page(request: Request) -> Response:
        if not metrics.available:  # the server runs without it; say what is missing
            return PlainTextResponse(metrics.reason + "\n", status_code=503)
        body, content_type = metrics.expose()
        return Response(body, headers={"Content-Type": content_type})

    async def models(request: Request) -> Response:
        try:
            check_key(request)
        except ApiError as e:
            return _error(e)
        return JSONResponse({"object": "list", "data": [entry]})

    async def model_by_id(request: Request) -> Response:
        try:
            check_key(request)
            if request.path_params["model_id"] != model.name:
                raise model_not_found(request.path_params["model_id"], model)
        except ApiError as e:
            return _error(e)
        return JSONResponse(entry)

    async def completions(request: Request, chat: bool) -> Response:
        arrived = time.monotonic()
        try:
            check_key(request)
            body = await _read_json(request, max_body_bytes)
            job = (parse_chat if chat else parse_completion)(body, model)
            if request.app.state.draining:  # checked with no await before the submit
                raise ApiError(503, "the server is shutting down: it finishes the requests "
                                    "in flight and takes no new ones", type_="server_error",
                               code="shutting_down")
            handle = Handle(engine, job, metrics, Clock(job.choices, arrived))
            handle.submit()
        except ApiError as e:
            return _error(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if job.stream:
            return StreamingResponse(_stream(handle, rid, chat), media_type="text/event-stream")
        try:
            return await _whole(request, handle, rid, chat)
        except ApiError as e:
            return _error(e)
        finally:
            handle.cancel()  # a no-op when all finished; frees the slots otherwise

    async def _whole(request: Request, handle: Handle, rid: str, chat: bool) -> Response:
        job = handle.job
        texts = [job.echo(c) for c in range(job.choices)]
        events: list[list[Event]] = [[] for _ in range(job.choices)]
        reasons = [None] * job.choices
        pending = asyncio.ensure_future(_collect(handle, texts, events, reasons))
        # Poll for a client that went away, so that its generation stops.
        while not pending.done():
            await asyncio.wait([pending], timeout=0.5)
            if not pending.done() and await request.is_disconnected():
                pending.cancel()
                return Response(status_code=499)
        pending.result()
        choices = []
        for i in range(job.choices):
            choice = {"index": i, "finish_reason": reasons[i]}
            if chat:
                choice["message"] = {"role": "assistant", "content": texts[i]}
                choice["logprobs"] = (_chat_logprobs(tokenizer, events[i])
                                      if job.logprobs is not None else None)
            else:
                choice["text"] = texts[i]
                choice["logprobs"] = (_completion_logprobs(tokenizer, events[i],
                                                           len(job.echo(i)))
                                      if job.logprobs is not None else None)
            choices.append(choice)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": model.name,
                             "choices": choices, "usage": handle.usage()})

    async def _collect(handle, texts, events, reasons):
        async for i, event in handle.events():
            texts[i] += event.text
            events[i].append(event)
            if event.finish_reason:
                reasons[i] = event.finish_reason

    async def _stream(handle: Handle, rid: str, chat: bool):
        job = handle.job
        kind = "chat.completion.chunk" if chat else "text_completion"
        chunks = StreamChunks(rid, kind, int(time.time()), model.name, job.include_usage)
        chunk = chunks.chunk
        offsets = [len(job.echo(c)) for c in range(job.choices)]
        try:
            for i in range(job.choices):  # the role first, as OpenAI does; echo for completions
                if chat:
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                elif job.echo(i):
                    yield chunk([{"index": i, "text": job.echo(i), "logprobs": None,
                                  "finish_reason": None}])
            plain = chunks.delta if chat else chunks.text  # a token's chunk without logprobs
            async for batch in handle.batches():
                out = []  # one write for the batch's chunks
                for i, event in batch:
                    if job.logprobs is None:
                        if event.text or event.finish_reason is not None:
                            out.append(plain(i, event.text, event.finish_reason))
                        # else text held back for a possible stop string
                        continue
                    choice = {"index": i, "finish_reason": event.finish_reason}
                    if chat:
                        choice["delta"] = {"content": event.text} if event.text else {}
                        choice["logprobs"] = _chat_logprobs(tokenizer, [event])
                    else:
                        choice["text"] = event.text
                        choice["logprobs"] = _completion_logprobs(tokenizer, [event], offsets[i])
                        offsets[i] += len(event.text)
                    out.append(chunk([choice]))
                if out:
                    yield "".join(out)
            yield (chunk([], handle.usage()) if job.include_usage else "") + "data: [DONE]\n\n"
        except ApiError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            # Also reached when the client disconnects (the generator is closed).
            handle.cancel()

    async def chat_completions(request: Request) -> Response:
        return await completions(request, chat=True)

    async def text_completions(request: Request) -> Response:
        return await completions(request, chat=False)

    async def not_found(request: Request, exc) -> Response:
        return _error(ApiError(404, f"no route {request.method} {request.url.path}"))

    async def method_not_allowed(request: Request, exc) -> Response:
        message = f"{request.method} is not allowed on {request.url.path}"
        if request.method == "OPTIONS" and not allowed_origins:  # a browser's CORS preflight
            message += ("; cross-origin requests (CORS) are off: start qfuse serve with "
                        "--allowed-origins to answer them")
        response = _error(ApiError(405, message))
        response.headers.update(getattr(exc, "headers", None) or {})  # Allow: the methods
        return response

    async def server_error(request: Request, exc) -> Response:
        log.error("qfuse serve: %s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(ApiError(500, "internal server error (see the server log)",
                               type_="server_error"))

    routes = [
        Route("/", chat_page, methods=["GET"]),
        Route("/favicon.ico", favicon, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_page, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        # :path, as a served name may hold a slash ("org/model")
        Route("/v1/models/{model_id:path}", model_by_id, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", text_completions, methods=["POST"]),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.stop()

    # Preflights are answered by the middleware before routing; the others get the
    # Access-Control-Allow-Origin of an allowed origin. Any request header may be asked
    # for (the OpenAI clients send their own); the origin is what is checked.
    middleware = [Middleware(CORSMiddleware, allow_origins=allowed_origins,
                             allow_methods=["GET", "POST"], allow_headers=["*"],
                             expose_headers=["Retry-After"])] if allowed_origins else []
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={404: not_found, 405: method_not_allowed,
                                        Exception: server_error},
                    lifespan=lifespan)
    app.state.draining = False
    return app
