"""`torchrun --nproc-per-node N -m qfuse generate ...`: rank 0 drives, the others follow.

Rank 0 runs the ordinary single-GPU driver, `generation.generate`, over a `Leader`:
an object that looks like the Decoder to it and, before each model call, broadcasts
the call to the other ranks (a small command on the gloo control group: prefill
with the prompt's ids, a new KV cache's shape, or decode with the sampled ids).
The other ranks `follow`: they make the same call on their shard, so every
collective inside the model meets its peers. Tokenization, sampling, stop strings
and all output stay on rank 0; the other ranks print nothing unless they fail on
their own (their error then names the rank).

The decode step with its collectives is captured as one CUDA graph per rank
(`generation.GraphedDecode`), built at the same command on every rank; generate
itself is told not to build one, since rank 0's graph must be matched by the others.

Every step that can fail on one rank alone (the prompt on rank 0, loading a shard)
ends with `stopping.agree_on_failure`, so that all ranks stop together and rank 0
reports; every collective has a timeout (--tp-timeout), and the process group's
teardown, which can hang, is bounded (`comm.shutdown`).

The same protocol carries `qfuse serve`'s engine (`parallel.serve`): the Leader
then works on a cache of max_batch slots that rank 0 made (`Leader.adopt`) and on
views of its rows (`KVCache.rows`), which travel as their first row
and row count. A decode command carries the rows' lengths too, since the engine
resets idle and freed slots on rank 0 directly; the followers take rank 0's lengths
instead of tracking those resets. While the server idles, `Leader.keepalive` sends
a no-op now and then, so that no follower's wait for a command reaches the timeout.
All messages are int64 tensors; nothing is pickled.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

from ..errors import UserError
from ..models.decoder import LOGITS
from ..quant import QuantizedTensor
from ..runtime.cache import KVCache, check_cache_flags
from ..runtime.generation import generate
from ..runtime.prompts import encode_prompts
from ..runtime.slotted_graphs import GraphedDecode
from .comm import Comm, ParallelError, hard_exit, init, one_line, shutdown, world_from_env
from .sharding import RankShard, TensorParallelError, check_world
from .stopping import QuietStop, agree_on_failure, attempt, finish, raise_after_shutdown

END, NEW_CACHE, PREFILL, DECODE, NOOP, CAPTURE = range(6)
_INLINE = 64  # decode ids + lengths that travel inside the command (one broadcast a step)
_HEADER = 8 + _INLINE


def check_tp_flag(tp: int | None, command: str = "generate") -> int:
    """The number of ranks: --tp if given, which must match torchrun's world size."""
    world = world_from_env()
    if tp is None:
        return world
    if tp < 1:
        raise TensorParallelError(f"--tp must be at least 1, got {tp}")
    if tp != world:
        if world == 1:
            raise TensorParallelError(
                f"--tp {tp} needs {tp} processes, one per GPU: start it as `torchrun "
                f"--nproc-per-node {tp} -m qfuse {command} ...`")
        raise TensorParallelError(f"--tp {tp} does not match the {world} processes torchrun "
                                  f"started (--nproc-per-node {world})")
    return tp


class Runner:
    """The model calls every rank makes, in the same order: rank 0 through `Leader`,
    the others through `follow`. Holds the rank's one KV cache and its decode graphs,
    one per set of rows (first row, row count) the step runs over."""

    def __init__(self, model, comm: Comm, cuda_graph: bool):
        self.model, self.comm, self.cuda_graph = model, comm, cuda_graph
        self.cache: KVCache | None = None
        self.graphs: dict[tuple[int, int], GraphedDecode] = {}

    def new_cache(self, B: int, max_tokens: int, bits: int, group: int) -> KVCache:
        self.graphs = {}  # their buffers belong to the previous cache
        self.cache = KVCache(self.model.config, B, max_tokens, self.model.dtype,
                             self.comm.device, bits, group)
        return self.cache

    def rows(self, start: int, B: int) -> KVCache:
        """The cache's rows start..start+B-1 (the cache itself when that is all of it)."""
        if start == 0 and B == self.cache.lengths.numel():
            return self.cache
        return self.cache.rows(start, start + B)

    def prefill(self, ids, lengths, cache, past: int = 0, logits: str = "all"):
        with torch.no_grad():
            return self.model(ids, lengths, cache, past=past, logits=logits)

    def capture(self, cache: KVCache, start: int = 0) -> GraphedDecode:
        """The decode graph of these rows, captured now if it is not yet (warm-up and
        capture run the same collectives on all ranks, at the same command)."""
        B = cache.lengths.numel()
        graphed = self.graphs.get((start, B))
        if graphed is None:
            with torch.no_grad():
                graphed = self.graphs[(start, B)] = GraphedDecode(self.model, cache, B)
        return graphed

    def decode(self, tokens, cache, start: int = 0):
        with torch.no_grad():
            if not self.cuda_graph:
                return self.model.decode(tokens, cache)
            # Another view object of the same rows works too: its tensors and host
            # lengths are the graph's.
            return self.capture(cache, start)(tokens)


def _cache_spec(cache: KVCache) -> tuple[int, int, int, int]:
    k = cache.layers[0].k
    bits, group = (k.bits, k.group_size) if isinstance(k, QuantizedTensor) else (0, 64)
    return cache.lengths.numel(), cache.max_tokens, bits, group


def _first_row(view: KVCache, base: KVCache) -> int | None:
    """The row of ``base`` where the view ``view`` starts (`KVCache.rows`/`slot` share
    the base's lengths tensor); None if it is not a view of ``base``."""
    a, b = view.lengths, base.lengths
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return None
    return a.storage_offset() - b.storage_offset()


class Leader:
    """Rank 0's stand-in for the Decoder, for `generation.generate` and the serving
    engine: each call is sent to the other ranks, then made on rank 0's shard. One KV
    cache at a time: a new cache replaces the previous one on every rank; a view of
    the current cache's rows is sent as its first row and row count.

    Every command and the model call it announces run under one lock: the keepalive
    thread's no-ops must not fall between a command and the collectives of its call."""

    def __init__(self, runner: Runner):
        self.runner, self.comm = runner, runner.comm
        self.config = runner.model.config  # rank 0's: its KV heads, the full vocabulary
        self.model = runner.model.model  # generate reads the device from model.norm
        self._lock = threading.RLock()
        self._last_send = time.monotonic()
        self._keepalive: threading.Thread | None = None
        self._closed = threading.Event()

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.model.dtype

    def _sent(self, call, *args):
        """Rank 0's part of a command already sent: the other ranks are inside its
        collectives now, and would wait there until --tp-timeout if rank 0 raised and
        went on. A failure other than a lost rank (which the others see at once) ends
        this process with its one line; torchrun then stops the others."""
        try:
            return call(*args)
        except ParallelError:
            raise
        except Exception as e:  # noqa: BLE001 -- any failure here strands the others
            print(f"qfuse: error: {one_line(e)}", file=sys.stderr)
            hard_exit(2 if isinstance(e, UserError) else 1)

    def _send(self, *fields: int, ids: torch.Tensor | None = None) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[: len(fields)] = torch.tensor(fields)
        if ids is not None:
            header[8: 8 + ids.numel()] = ids.cpu()
        self.comm.broadcast(header, "rank 0's command")
        self._last_send = time.monotonic()

    def adopt(self, cache: KVCache) -> None:
        """Make ``cache`` (one rank 0 built for its shard) the current cache: every
        other rank makes one of the same shape for its own shard."""
        with self._lock:
            self._send(NEW_CACHE, *_cache_spec(cache))
            self.runner.cache, self.runner.graphs = cache, {}

    def _rows(self, cache: KVCache | None) -> int:
        """The first row of ``cache`` in the current cache; a cache that is no view of
        it becomes the current one (a new generation's)."""
        if cache is None:
            return 0
        current = self.runner.cache
        if cache is current:
            return 0
        start = None if current is None else _first_row(cache, current)
        if start is not None:
            return start
        if cache.lengths._base is not None:
            raise ValueError("a view of a KV cache that the other ranks do not have: "
                             "Leader.adopt its cache first")
        self.adopt(cache)
        return 0

    def __call__(self, input_ids, lengths=None, cache=None, hidden_states=None, past=0,
                 logits="all"):
        if hidden_states is not None:
            raise NotImplementedError("hidden states are not gathered under tensor parallel")
        if logits not in LOGITS:
            raise ValueError(f"logits must be one of {', '.join(LOGITS)}, got {logits!r}")
        B, T = input_ids.shape
        if lengths is None:
            lengths = torch.full((B,), T, dtype=torch.int64, device=input_ids.device)
        with self._lock:
            start = self._rows(cache)
            self._send(PREFILL, int(cache is not None), B, T, start, past, LOGITS.index(logits))
            payload = torch.cat([input_ids.reshape(-1),
                                 lengths.reshape(-1)]).to("cpu", torch.int64)
            self.comm.broadcast(payload, "the prompt's ids")
            return self._sent(self.runner.prefill, input_ids, lengths, cache, past, logits)

    def decode(self, tokens, cache, hidden_states=None):
        if hidden_states is not None:
            raise NotImplementedError("hidden states are not gathered under tensor parallel")
        with self._lock:
            start = self._rows(cache)
            B = tokens.shape[0]
            # The lengths as rank 0 keeps them on the host (no device sync).
            message = torch.cat([tokens.to("cpu", torch.int64),
                                 torch.tensor(cache.host_lengths, dtype=torch.int64)])
            if 2 * B <= _INLINE:
                self._send(DECODE, B, start, ids=message)
            else:
                self._send(DECODE, B, start)
                self.comm.broadcast(message, "the sampled ids")
            return self._sent(self.runner.decode, tokens, cache, start)

    def capture(self, cache: KVCache) -> None:
        """Capture the decode graph of these rows of the current cache on every rank
        now, rather than at their first step (which would stall the streams)."""
        with self._lock:
            start = self._rows(cache)
            self._send(CAPTURE, cache.lengths.numel(), start)
            self._sent(self.runner.capture, cache, start)

    def keepalive(self, interval_s: float, on_failure=None) -> None:
        """Send a no-op whenever nothing was sent for ``interval_s``, until `close`:
        the followers wait for each command with the group's timeout, and a server
        may idle far longer. ``on_failure(error)`` runs if a no-op fails."""

        def loop():
            while not self._closed.wait(max(0.05, self._last_send + interval_s
                                            - time.monotonic())):
                if time.monotonic() - self._last_send < interval_s:
                    continue
                try:
                    with self._lock:
                        if not self._closed.is_set():
                            self._send(NOOP)
                except ParallelError as e:
                    if on_failure is not None:
                        on_failure(e)
                    return

        self._keepalive = threading.Thread(target=loop, name="qfuse-tp-keepalive", daemon=True)
        self._keepalive.start()

    def close(self) -> None:
        """Tell the other ranks to stop following."""
        self._closed.set()
        with self._lock:
            self._send(END)


def follow(runner: Runner) -> None:
    """A rank other than 0: make rank 0's model calls until it sends END."""
    comm, device = runner.comm, runner.comm.device
    header = torch.zeros(_HEADER, dtype=torch.int64)
    while True:
        comm.broadcast(header, "rank 0's command")
        op = int(header[0])
        if op == END:
            return
        if op == NOOP:
            continue
        if op == NEW_CACHE:
            B, max_tokens, bits, group = header[1:5].tolist()
            runner.new_cache(B, max_tokens, bits, group)
        elif op == PREFILL:
            has_cache, B, T, start, past, logits = header[1:7].tolist()
            payload = comm.broadcast(torch.zeros(B * T + B, dtype=torch.int64), "the prompt's ids")
            payload = payload.to(device)
            runner.prefill(payload[: B * T].view(B, T), payload[B * T:],
                           runner.rows(start, B) if has_cache else None, past, LOGITS[logits])
        elif op == DECODE:
            B, start = header[1:3].tolist()
            if 2 * B <= _INLINE:
                message = header[8: 8 + 2 * B].clone()
            else:
                message = comm.broadcast(torch.zeros(2 * B, dtype=torch.int64), "the sampled ids")
            view = runner.rows(start, B)
            # Rank 0's lengths of these rows: its engine may have reset some since the
            # last step (a freed slot, the idle rows of a batch-invariant step).
            view.lengths.copy_(message[B:])
            view.host_lengths = message[B:].tolist()
            runner.decode(message[:B].to(device), view, start)
        elif op == CAPTURE:
            B, start = header[1:3].tolist()
            runner.capture(runner.rows(start, B), start)
        else:
            raise ParallelError(f"rank {comm.rank}: unknown command {op} from rank 0")


def rank_device(device: str | None) -> torch.device:
    """This rank's device: its own GPU (LOCAL_RANK) on CUDA, else the CPU. Every rank
    checks that the host's ranks (LOCAL_WORLD_SIZE) have a GPU each, so that rank 0,
    which speaks for all, reports a shortfall too."""
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    kind = torch.device(device).type if device else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {device}: no CUDA GPU is visible")
        on_host = int(os.environ.get("LOCAL_WORLD_SIZE", world_from_env()))
        if on_host > torch.cuda.device_count():
            raise TensorParallelError(f"{on_host} ranks on this host need a GPU each: only "
                                      f"{torch.cuda.device_count()} are visible")
        return torch.device("cuda", local)
    if kind != "cpu":
        raise UserError(f"--device {device}: qfuse runs on cpu or cuda")
    return torch.device("cpu")


def run_generate_tp(args) -> int:
    """`qfuse generate` on every rank of a torchrun job (args as the CLI parsed them)."""
    from ..from_flags import check_args

    return run_tp(args, "generate", check_args, lambda config: _check_prompt(args, config),
                  lambda leader, tokenizer: _lead(leader, tokenizer, args))


def run_tp(args, command: str, check_args, setup, lead, leader_class=None) -> int:
    """A torchrun command on every rank: check what needs no weights (identically on
    every rank), start the process group, ``setup(config)`` on rank 0 (what may fail
    there alone, before loading: the prompt, the port), load the shards, then rank 0
    runs ``lead(leader, setup's result)`` for its exit code while the others follow
    (leader: a ``leader_class``, default `Leader`).
    args carries --tp, --tp-timeout, --tp-allreduce, --model, --device, --dtype,
    --cuda-graph, --kv-bits, --kv-group-size and --max-kv-size."""
    from ..loading import check_checkpoint, load_model, quant_spec

    world = check_tp_flag(getattr(args, "tp", None), command)
    # What needs no weights, checked identically on every rank: all stop together.
    check_args(args)
    config = check_checkpoint(args.model)
    check_cache_flags(config, args.kv_bits, args.kv_group_size, args.max_kv_size)
    check_world(config, world, quant_spec(config))
    device = rank_device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    cuda_graph = device.type == "cuda" if args.cuda_graph is None else args.cuda_graph
    if cuda_graph and device.type != "cuda":
        raise UserError("cuda_graph needs the model on a CUDA device")
    comm = init(device, args.tp_timeout, args.tp_allreduce)
    leader = None
    try:
        if comm.rank == 0:
            state, error = attempt(lambda: setup(config))
        else:
            state, error = None, None
        agree_on_failure(comm, error)
        model, error = attempt(lambda: load_model(
            args.model, dtype=dtype, device=device, progress=comm.rank == 0,
            check_weights=getattr(args, "check_weights", True), shard=RankShard(comm)))
        agree_on_failure(comm, error)
        runner = Runner(model, comm, cuda_graph)
        if comm.rank:
            try:
                follow(runner)
            except ParallelError:
                raise QuietStop(1) from None  # rank 0 stopped: it reports, or torchrun does
            except (UserError, OSError, torch.OutOfMemoryError) as e:
                # Only this rank knows: say so, then leave (rank 0's collective fails).
                print(f"qfuse: error: rank {comm.rank}: {one_line(e)}", file=sys.stderr)
                raise QuietStop(1) from None
            code = 0
        else:
            leader = (leader_class or Leader)(runner)
            code = lead(leader, state)
            leader.close()
            leader = None
    except QuietStop as q:
        finish(q.code, clean=shutdown())
    # Every way out, Ctrl-C and SystemExit too, must close the leader and shut the
    # process group down on every rank, or the other ranks hang.
    except BaseException as e:  # noqa: BLE001
        if leader is not None:
            try:
                leader.close()
            except ParallelError:
                pass
        if isinstance(e, KeyboardInterrupt):
            finish(130, clean=shutdown(), quiet=True)
        # Rank 0's error: printed here, since a hung teardown may end the process first.
        if comm.rank == 0 and isinstance(e, (UserError, OSError, torch.OutOfMemoryError)):
            print(f"qfuse: error: {one_line(e)}", file=sys.stderr)
            finish(2 if isinstance(e, UserError) else 1, clean=shutdown())
        raise_after_shutdown(comm, e)
    finish(code, clean=shutdown())
    return code


def _check_prompt(args, config):
    """Rank 0: the tokenizer, after checking that the prompt fits (as `qfuse generate`)."""
    from ..from_flags import prompt_kept
    from ..loading import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    prompt_kept(config, encode_prompts(tokenizer, [args.prompt])[0], args)
    return tokenizer


def _lead(leader: Leader, tokenizer, args) -> int:
    from ..chat import print_stream, report
    from ..from_flags import sampling_params

    sys.stdout.write(args.prompt)
    sys.stdout.flush()  # the prompt shows once every shard is loaded
    # cuda_graph=False: the Leader's runner captures the step, matched on every rank.
    summary = print_stream(generate(
        leader, tokenizer, [args.prompt], args.max_tokens, sampling_params(args), args.stop,
        args.kv_bits, args.kv_group_size, cuda_graph=False, max_kv_size=args.max_kv_size))
    report(summary, label=f"tp {leader.comm.world} | ", where=" (rank 0)")
    return 0
