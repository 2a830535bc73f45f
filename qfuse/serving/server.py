"""`qfuse serve`: check the flags, bind the port, load the model, start the engine, run uvicorn.

Flag mistakes, a broken model folder and an address that cannot be bound (a port
in use) are one-line errors before anything loads. The server binds to 127.0.0.1
unless --host says otherwise. `Background` runs the same server in a thread, for
`qfuse bench serve` and tests.

Ctrl-C (or SIGTERM): the first drains, and a line says how many requests are in flight
and that a second Ctrl-C stops at once. While it drains, the port stays open: /health
(status "draining") and /metrics answer, new completions get a 503 saying the server is
shutting down, and the requests in flight finish; then uvicorn shuts down as ever. The
second Ctrl-C ends the process at once, exit 130, without a traceback.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from ..errors import UserError
from ..from_flags import device_from_flags


def check_args(args) -> None:
    if args.max_batch is not None and args.max_batch < 1:
        raise UserError(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.max_queue < 0:
        raise UserError(f"--max-queue must be at least 0, got {args.max_queue}")
    if args.max_prefill_tokens < 1:
        raise UserError(f"--max-prefill-tokens must be at least 1, got {args.max_prefill_tokens}")
    if args.prefill_chunk < 0:
        raise UserError(f"--prefill-chunk must be at least 0 (0: off), got {args.prefill_chunk}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must lie in [0, 65535], got {args.port}")
    if args.max_kv_size is not None and args.max_kv_size < 2:
        raise UserError(f"--max-kv-size must be at least 2, got {args.max_kv_size}")
    if args.cuda_graph and device_from_flags(args).type != "cuda":
        raise UserError("--cuda-graph needs a CUDA device (--device cuda)")
    allowed_origins(args)
    check_page_args(args)


# scheme://host[:port], as a browser sends it in Origin: no path, not even a final "/"
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s*]+", re.IGNORECASE)


def allowed_origins(args) -> list[str] | None:
    """--allowed-origins as a list ("*" alone: any origin), None when absent; a
    UserError for an entry that no browser would send as its Origin."""
    text = getattr(args, "allowed_origins", None)
    if text is None:
        return None
    # Lower case, as browsers send the scheme and host; starlette compares exactly.
    origins = [o.strip().lower() for o in text.split(",") if o.strip()]
    if origins == ["*"]:
        return origins
    if not origins:
        raise UserError("--allowed-origins needs an origin (http://localhost:3000), a "
                        "comma-separated list of them, or * for any")
    for origin in origins:
        if not _ORIGIN.fullmatch(origin):
            hint = " (* stands alone)" if "*" in origin or "*" in origins else \
                " (no path or final /)" if "://" in origin else ""
            raise UserError(f"--allowed-origins: {origin!r} is not an origin: scheme://host"
                            f"[:port], such as http://localhost:3000{hint}")
    return origins


def check_page_args(args) -> None:
    """--kv-page-size and --kv-pages: one-line errors for values the paged cache refuses."""
    size, pages = getattr(args, "kv_page_size", None), getattr(args, "kv_pages", None)
    if pages is not None and size is None:
        raise UserError("--kv-pages sizes a paged KV cache: give --kv-page-size too")
    if getattr(args, "enable_prefix_caching", None) and size is None:
        raise UserError("--enable-prefix-caching shares the pages of a paged KV cache: give "
                        "--kv-page-size too")
    if getattr(args, "async_scheduling", False) and size is not None:
        raise UserError("--async-scheduling runs the slotted KV cache's steps (a paged "
                        "step takes its pages on the host first): leave out --kv-page-size")
    mixed, step_tokens = getattr(args, "mixed_steps", False), getattr(args, "step_tokens", None)
    if mixed and size is None:
        raise UserError("--mixed-steps runs prompt pieces beside the decode rows of a paged "
                        "KV cache: give --kv-page-size too")
    if mixed and getattr(args, "deterministic", False):
        raise UserError("--mixed-steps cuts prompts by the load, which --deterministic may "
                        "not: leave one of them out")
    if step_tokens is not None and not mixed:
        raise UserError("--step-tokens is the budget of --mixed-steps: give it too")
    if step_tokens is not None and step_tokens < 1:
        raise UserError(f"--step-tokens must be at least 1, got {step_tokens}")
    if size is None:
        return
    if size < 1 or size & (size - 1):
        raise UserError(f"--kv-page-size must be a power of two (1, 2, 4, ...), got {size}")
    if pages is not None and pages < 1:
        raise UserError(f"--kv-pages must be at least 1, got {pages}")


def check_pages_hold_a_sequence(args, max_positions: int) -> None:
    """--kv-pages must hold one sequence of the context (the engine's rule: the oldest
    sequence alone always fits, so preempting the others always ends)."""
    if args.kv_page_size is None or args.kv_pages is None:
        return
    context = min(args.max_kv_size or max_positions, max_positions)
    need = -(-context // args.kv_page_size)
    if args.kv_pages < need:
        raise UserError(f"--kv-pages {args.kv_pages} pages of {args.kv_page_size} tokens hold "
                        f"less than one sequence of {context} tokens ({need} pages; "
                        f"--max-kv-size sets the tokens per sequence)")


def plan_from_flags(model, args):
    """`sizing.plan` for ``model`` (loaded) under the serve flags: the slots, KV pages and
    CUDA graphs to start with; a UserError when --max-batch or --kv-pages cannot fit."""
    from .sizing import plan

    return plan(model, max_batch=args.max_batch, context=args.max_kv_size,
                kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                cuda_graph=args.cuda_graph, deterministic=args.deterministic,
                max_prefill_tokens=args.max_prefill_tokens, prefill_chunk=args.prefill_chunk,
                kv_page_size=getattr(args, "kv_page_size", None),
                kv_pages=getattr(args, "kv_pages", None),
                prefix_caching=prefix_caching(args),
                mixed_steps=getattr(args, "mixed_steps", False))


def prefix_caching(args) -> bool:
    """Whether the engine keeps a prefix cache: on by default with pages
    (check_page_args refused it without)."""
    return getattr(args, "kv_page_size", None) is not None \
        and getattr(args, "enable_prefix_caching", None) is not False


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) for uvicorn to listen on (port 0: a free one);
    UserError when the address cannot be bound."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UserError(f"--host {host}: not an address of this machine ({e.strerror})") from e
    sock = socket.socket(family, kind, proto)
    # As uvicorn does: a restart may bind while the last run's connections linger.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        # Listening now: a client that connects once the start line is printed waits in
        # the backlog until uvicorn accepts, instead of being refused.
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}; pick another --port "
                        "(or --host)") from e
    return sock


def _say(line: str) -> None:
    """One line on stderr from a signal handler: os.write, as a print there could meet
    the main thread's own print mid-write and raise."""
    lead = "\n" if sys.stderr.isatty() else ""  # past the terminal's ^C
    os.write(sys.stderr.fileno(), f"{lead}{line}\n".encode())


def make_server(config, engine):
    """uvicorn's Server for ``config`` (`app.make_app` over ``engine``), whose Ctrl-C and
    SIGTERM say what they do. The first drains with the port still open (`app.drain`:
    /health and /metrics answer, new work is a 503) until the engine holds no request,
    then hands the signal to uvicorn, which stops listening, waits for the responses
    under way and re-raises it; a second Ctrl-C exits at once (uvicorn would still wait
    for the engine's step)."""
    import uvicorn

    from .app import drain

    class Server(uvicorn.Server):
        draining: int | None = None  # the signal that started the drain

        def handle_exit(self, sig, frame):
            if sig not in (signal.SIGINT, signal.SIGTERM):
                return super().handle_exit(sig, frame)
            left = engine.in_flight()
            requests = f"{left} request{'s' if left != 1 else ''} in flight"
            if self.draining is not None:  # the second
                if sig == signal.SIGINT:
                    _say("qfuse serve: stopped at once"
                         + (f"; {requests} cut off" if left else ""))
                    # The engine thread may be inside a model call: nothing short of
                    # ending the process stops it at once, and serving has no file to finish.
                    os._exit(130)
                return None  # a repeated SIGTERM: the drain goes on
            self.draining = sig
            drain(self.config.app)
            _say(f"qfuse serve: draining {requests}; press Ctrl-C again to stop at once"
                 if left else "qfuse serve: stopping")
            return None

        async def on_tick(self, counter: int) -> bool:
            # Every 0.1 s: once the engine holds no request, uvicorn shuts down as on a
            # signal (a request the app takes meanwhile is answered before it stops).
            if self.draining is not None and not self.should_exit and not engine.in_flight():
                super().handle_exit(self.draining, None)
            return await super().on_tick(counter)

    return Server(config)


class Background:
    """uvicorn serving ``app`` on the bound ``sock`` in a thread; `stop()` shuts it down
    (and the app's lifespan stops its engine)."""

    def __init__(self, app, sock: socket.socket, log_level: str = "warning"):
        import uvicorn

        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="qfuse-serve", daemon=True)
        self._sock = sock

    def start(self, timeout: float = 30.0) -> Background:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and self._thread.is_alive() \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            self.stop()
            raise RuntimeError(f"the background server did not start within {timeout} s")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sock.close()


def run_serve(args) -> int:
    try:
        import uvicorn

        from .app import make_app
    except ImportError as e:
        raise UserError(f"qfuse serve needs the serve extra: pip install 'qfuse[serve]' "
                        f"({e.name} is missing)") from e
    from ..from_flags import load_model_from_flags
    from ..loading import check_checkpoint, load_chat_template, load_tokenizer, special_tokens
    from ..runtime.cache import check_cache_flags
    from .engine import Engine
    from .protocol import ModelInfo

    check_args(args)
    path = Path(args.model)
    config = check_checkpoint(path)
    check_cache_flags(config, args.kv_bits, args.kv_group_size, args.max_kv_size)
    check_pages_hold_a_sequence(args, config.max_position_embeddings)
    sock = bind(args.host, args.port)  # before loading: a port in use costs no loading time
    tokenizer = load_tokenizer(path)
    template = load_chat_template(path)
    device = device_from_flags(args)
    model = load_model_from_flags(args)
    chosen = plan_from_flags(model, args)  # the slots the memory left holds; graphs on CUDA
    print(chosen.line(), file=sys.stderr, flush=True)
    try:
        engine = Engine(model, tokenizer, max_batch=chosen.slots, max_queue=args.max_queue,
                        context=args.max_kv_size, kv_bits=args.kv_bits,
                        kv_group_size=args.kv_group_size, cuda_graph=chosen.cuda_graph,
                        deterministic=args.deterministic,
                        max_prefill_tokens=args.max_prefill_tokens,
                        prefill_chunk=args.prefill_chunk, kv_page_size=args.kv_page_size,
                        kv_pages=chosen.kv_pages, prefix_caching=prefix_caching(args),
                        async_scheduling=args.async_scheduling,
                        mixed_steps=args.mixed_steps, step_tokens=args.step_tokens)
    except ValueError as e:  # a value the paged cache refuses that no check above caught
        raise UserError(str(e)) from None
    info = ModelInfo(args.served_model_name or path.name, tokenizer, engine.context,
                     config.bos_token_id, template, special_tokens(path),
                     vocab_size=config.vocab_size)
    app = make_app(engine, info, api_key=args.api_key, startup=chosen.as_dict(),
                   allowed_origins=allowed_origins(args))
    engine.start()
    port = sock.getsockname()[1]  # --port 0 binds a free port: say which
    pages = "" if chosen.kv_page_size is None else \
        f"{chosen.kv_pages} KV pages of {chosen.kv_page_size} tokens, "
    print(f"qfuse serve: {info.name} at http://{args.host}:{port}/v1 "
          f"({chosen.slots} slots of {engine.context} tokens, {pages}{device}, "
          f"{'batch-invariant' if args.deterministic else 'bucketed'} steps of "
          f"{'/'.join(map(str, engine.buckets))} rows"
          f"{', async scheduling' if args.async_scheduling else ''}"
          f"{f', mixed steps of {engine.step_tokens} tokens' if engine.mixed_steps else ''})",
          file=sys.stderr, flush=True)
    make_server(uvicorn.Config(app, log_level=args.log_level), engine).run(sockets=[sock])
    return 0
