"""`torchrun --nproc-per-node N -m qfuse serve ...`: rank 0 serves, the others follow.

Rank 0 binds the port (loopback unless --host says otherwise), loads the tokenizer,
runs the ordinary continuous-batching engine (`serving.engine.Engine`) over a
`Leader` and the ordinary HTTP app under uvicorn. The other ranks run no server:
they `follow` rank 0's model calls (a new cache of max_batch slots, a prompt
prefilled into one slot, a decode step over a bucket of rows), as under `generate`
(`runtime`). The engine itself is unchanged but for `ModelFailed`: a model call
that fails for want of a rank raises it, the engine fails its requests and stops,
the server shuts down, and rank 0 exits with one error line.

With CUDA graphs (the default on CUDA) the engine is told not to capture (its graph would hold rank 0's
broadcasts, which run once at capture); the ranks capture each bucket's step
together at start instead (`Leader.capture`), through the same runner as generate.

Stopping: SIGINT or SIGTERM to rank 0 ends uvicorn (it finishes the requests in
flight), then the engine, then rank 0 tells the followers to end; every rank exits.
While the server idles, `Leader.keepalive` sends no-ops every quarter of
--tp-timeout so that no follower times out waiting for work.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from .comm import ParallelError
from .runtime import Leader, run_tp

FORCE_EXIT_S = 5.0  # after a lost rank: how long requests in flight get to end


class _Stopped(Exception):
    """SIGTERM reached rank 0: a requested stop, not an error."""


class _ServeLeader(Leader):
    """A Leader whose lost rank stops the engine (`ModelFailed`) and the server."""

    def __init__(self, runner):
        super().__init__(runner)
        self.failure: ParallelError | None = None
        self.server = None  # the uvicorn Server, once made

    def fail(self, error: ParallelError) -> None:
        if self.failure is None:
            self.failure = error
        server = self.server
        if server is not None:
            server.should_exit = True
            # Requests in flight were told (the engine emits an error to each); one that
            # came in meanwhile would wait for an engine that is gone: cut it after a while.
            timer = threading.Timer(FORCE_EXIT_S, lambda: setattr(server, "force_exit", True))
            timer.daemon = True
            timer.start()

    def _guarded(self, call, *args, **kw):
        from ..serving.engine import ModelFailed

        try:
            return call(*args, **kw)
        except ParallelError as e:
            self.fail(e)
            raise ModelFailed(str(e)) from e

    def __call__(self, *args, **kw):
        return self._guarded(super().__call__, *args, **kw)

    def decode(self, *args, **kw):
        return self._guarded(super().decode, *args, **kw)


def run_serve_tp(args) -> int:
    """`qfuse serve` on every rank of a torchrun job (args as the CLI parsed them)."""
    try:
        import uvicorn  # noqa: F401 -- on every rank: all stop together when it is missing

        from ..serving import app  # noqa: F401
    except ImportError as e:
        from ..errors import UserError

        raise UserError(f"qfuse serve needs the serve extra: pip install 'qfuse[serve]' "
                        f"({e.name} is missing)") from e
    return run_tp(args, "serve", check_tp_args, lambda config: _setup(args),
                  lambda leader, state: _lead(leader, state, args), _ServeLeader)


def check_tp_args(args) -> None:
    """`check_args`, and a one-line error for the paged KV cache, which the ranks do not
    make yet: without it the start line would name pages the engine never made."""
    from ..errors import UserError
    from ..serving.server import check_args

    check_args(args)
    if getattr(args, "kv_page_size", None) is not None:
        raise UserError("--kv-page-size: the paged KV cache does not run tensor parallel "
                        "yet; leave it out under torchrun")
    if getattr(args, "async_scheduling", False):
        raise UserError("--async-scheduling does not run tensor parallel yet (the ranks "
                        "take each step's tokens from the host); leave it out under torchrun")


def _setup(args):
    """Rank 0, before loading: the socket (a port in use stops every rank), tokenizer,
    chat template and special tokens."""
    from ..loading import load_chat_template, load_tokenizer, special_tokens
    from ..serving.server import bind

    path = Path(args.model)
    sock = bind(args.host, args.port)
    try:
        return sock, load_tokenizer(path), load_chat_template(path), special_tokens(path)
    except BaseException:
        sock.close()
        raise


def _lead(leader: _ServeLeader, state, args) -> int:
    import uvicorn

    from ..loading import check_checkpoint
    from ..serving.app import make_app
    from ..serving.engine import Engine
    from ..serving.protocol import ModelInfo
    from ..serving.server import allowed_origins, plan_from_flags

    sock, tokenizer, template, specials = state
    config = check_checkpoint(args.model)
    path = Path(args.model)
    try:
        # Rank 0's shard and free memory stand for every rank's: the shards are alike.
        chosen = plan_from_flags(leader, args)
        print(chosen.line(), file=sys.stderr, flush=True)
        # cuda_graph=False: the runner captures each bucket's step on every rank, below
        # (when run_tp's rule, the plan's, says so).
        engine = Engine(leader, tokenizer, max_batch=chosen.slots, max_queue=args.max_queue,
                        context=args.max_kv_size, kv_bits=args.kv_bits,
                        kv_group_size=args.kv_group_size, cuda_graph=False,
                        deterministic=args.deterministic,
                        max_prefill_tokens=args.max_prefill_tokens,
                        prefill_chunk=args.prefill_chunk)
        leader.adopt(engine.cache)  # every rank makes its shard's cache of max_batch slots
        if leader.runner.cuda_graph:
            for b in engine.buckets:
                leader.capture(engine.cache if b == chosen.slots
                               else engine.cache.rows(0, b))
        leader.keepalive(leader.comm.timeout_s / 4, on_failure=leader.fail)
        info = ModelInfo(args.served_model_name or path.name, tokenizer, engine.context,
                         config.bos_token_id, template, specials,
                         vocab_size=config.vocab_size)
        app = make_app(engine, info, api_key=args.api_key, startup=chosen.as_dict(),
                       allowed_origins=allowed_origins(args))
        server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level))
        leader.server = server
        engine.start()
        port = sock.getsockname()[1]
        world, device = leader.comm.world, leader.comm.device
        print(f"qfuse serve: {info.name} at http://{args.host}:{port}/v1 "
              f"({chosen.slots} slots of {engine.context} tokens, tensor parallel over "
              f"{world} ranks, rank 0 on {device}, "
              f"{'batch-invariant' if args.deterministic else 'bucketed'} steps)",
              file=sys.stderr, flush=True)
        # uvicorn handles SIGTERM itself, then re-raises it once it has stopped: ours
        # turns it into a return, so that the followers are told to end.
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            server.run(sockets=[sock])
        except _Stopped:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
            engine.stop()  # the app's lifespan stopped it, unless uvicorn never started
    finally:
        sock.close()
    if leader.failure is not None:
        raise leader.failure
    return 0


def _on_sigterm(signum, frame):
    raise _Stopped
