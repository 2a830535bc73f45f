"""The engine and the server driven from this process: a live `qfuse serve` app on a free
loopback port (`serve_in_process`), and one request followed token by token
(`Followed`): what the server's tests (and a notebook) use, so that one place knows the
order of starting and stopping, how a request's events are collected, when an engine has
gone idle (`until_idle`) and what a GET of the live server answers (`get_text`)."""

from __future__ import annotations

import http.client
import threading
import time

from ..runtime.prompts import encode_prompts
from .app import make_app
from .engine import Request
from .protocol import ModelInfo
from .server import Background, bind


def serve_in_process(engine, tokenizer, vocab_size: int, api_key: str | None = None):
    """A live `qfuse serve` app over ``engine`` on a free loopback port, in this process:
    the engine started, then the server (the engine stopped again if the server cannot
    start). The server's ``stop()`` stops the engine too (the app's lifespan)."""
    info = ModelInfo("default", tokenizer, engine.context, vocab_size=vocab_size)
    server = Background(make_app(engine, info, api_key=api_key), bind("127.0.0.1", 0))
    engine.start()
    try:
        server.start()
    except BaseException:
        engine.stop()
        raise
    return server


class Followed:
    """One request submitted to ``engine``: its tokens and last finish_reason as its emit
    callback receives them; ``started`` set at its first token, ``done`` at its finish;
    ``on_token(self)`` (optional) called after each token, on the engine's thread."""

    def __init__(self, engine, tokenizer, prompt: str, max_tokens: int, on_token=None):
        self.ids = encode_prompts(tokenizer, [prompt])[0]
        self.tokens, self.reason, self.on_token = [], None, on_token
        self.started, self.done = threading.Event(), threading.Event()
        self.req = Request(self.ids, max_tokens, emit=self.emit)
        engine.submit(self.req)

    def emit(self, event) -> None:
        if event.token is not None:
            self.tokens.append(event.token)
            self.started.set()
            if self.on_token is not None:
                self.on_token(self)
        if event.finish_reason:
            self.reason = event.finish_reason
            self.done.set()

    def wait(self, timeout: float = 60) -> list[int]:
        """Its tokens once it has finished (AssertionError after ``timeout`` seconds)."""
        assert self.done.wait(timeout), f"the request did not finish within {timeout:g} s"
        return self.tokens


def until_idle(engine, timeout: float = 30.0) -> bool:
    """Whether ``engine`` has nothing running or waiting within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["active"] == 0 and s["waiting"] == 0:
            return True
        time.sleep(0.01)
    return False


def get_text(port: int, path: str) -> str:
    """The body of a GET of ``path`` on the live server at loopback ``port``
    (AssertionError unless it answers 200)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        assert r.status == 200, (path, r.status)
        return r.read().decode()
    finally:
        conn.close()
