"""A live `qfuse serve` app in this process, on a free loopback port: what the tests of the
server (and a notebook) start, so that one place knows the order of starting and stopping
the engine and the server."""

from __future__ import annotations

from .app import make_app
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
