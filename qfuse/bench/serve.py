"""`qfuse bench serve`: a live `qfuse serve` under N concurrent streaming HTTP clients.

The server runs in this process (`serving.in_process.serve_in_process`: uvicorn on a free
loopback port in a thread, the engine's own thread beside it); the clients run in a child
process (`serve_client`), so that their parsing does not take the interpreter lock from
the server. A load is N clients at once, each streaming one greedy `/v1/completions`
request of a fixed prompt and max_tokens (no EOS: every stream runs its length). For each
load, serve.json has a row with:

- decode tokens/s: every stream's tokens arriving while all N are decoding (from the last
  stream's first token to the first stream's last), over that window: the steady
  aggregate rate at concurrency N; and throughput (all tokens over the whole load);
- time to first token (request sent → first text chunk) p50/p99, inter-token latency
  (the gap between a stream's consecutive chunks) p50/p99 and their ratio;
- the engine thread's time per decode step (busy, of it waiting for the sampled tokens,
  and the rest: the host's own work; `engine_time`);
- the engine configuration it ran on (`engine`: slotted or paged KV and the page size,
  the prefill chunk, CUDA graphs on or off and why, deterministic, max_batch, the batch
  sizes it decodes at, ...) and the decode steps it ran per batch size;
- the share of its streams whose text is the text of the configuration's first load's
  (`same_text_as_alone`: every stream sends the same greedy prompt, so batch invariance
  is 1.0 at every load; the deterministic configuration's figure says whether it held).

What runs, in this order (the GPU run; `--quick` runs every part, smaller):

1. in-process `generate()` of the same model and prompt at one stream, timed as a stream
   is (first token to last): what one served stream is held against (≥ 0.95×);
2. ``slotted-bucketed`` (the server's default mode): the slotted KV cache, max_batch 256,
   CUDA graphs (one per bucket), loads of 1, 8, 32, 128 and 256 streams of 512-token
   prompts and 256 new tokens. 256 slots × 776 tokens of 4-bit KV take 20.5 GiB
   (`serving.sizing`), so the slotted cache holds every load;
2b. ``slotted-async`` (part ``async``): the same loads on the same configuration with
   async scheduling (`Engine(async_scheduling=True)`, `qfuse serve --async-scheduling`:
   each step launched before the last one's tokens are read), side by side with 2;
3. the prefix load: 64 requests sharing a 1000-token system prompt (each with its own
   16-token question, 8 new tokens) on a paged engine with prefix caching off, then on,
   after one request has put the system prompt in the cache (a warm cache, as a served
   system prompt's is): TTFT p50 with sharing against without (≤ 0.3×), and the
   engine's `vllm:prefix_cache_queries` / `_hits` over the load;
4. ``slotted-deterministic`` (batch invariance: every step decodes a bucket whose rows
   take the row-invariant product kernel that 256 rows take, `engine.step_buckets`: 64,
   128 or 256 rows on Hopper, else all 256 slots; every prompt is prefilled alone): the
   same five loads, so that the invariance's cost is known at every load;
5. ``paged-bucketed``: the paged KV cache (pages of 16 tokens, as many as the slots
   would hold), the big loads only (128 and 256 streams), with the paged CUDA graphs.
6. ``paged-mixed`` (part ``mixed``): the same loads with mixed steps
   (`Engine(mixed_steps=True)`, `qfuse serve --mixed-steps`: while prompts go in, each
   step runs every stream's next token and prompt pieces within `Settings.step_tokens`
   as one forward; the steps with no piece replay the paged graphs): its ITL p99 / p50
   and TTFT beside 5's.
7. part ``prefill_graphs``: time to first token at one stream, the prefill run eagerly
   (``slotted-prefill-eager``, today's path) and replayed from a CUDA graph per padded
   length (``slotted-prefill-graphs``: `Engine(prefill_buckets=...)`,
   `runtime.prefill_graphs`), side by side on engines of one slot: for each prompt length
   of `Settings.prefill_prompt_tokens` (the load's prompt cut to it), that many requests
   one after another (`Settings.prefill_requests`), each TTFT kept (results'
   ``prefill_graphs``) and its p50 and minimum; whether the graphs' text is the eager
   prefill's is reported, not required (a padded prefill may round a near tie apart).

The main loads pass ``prefix_caching=False``, so that their
identical prompts measure the engine, not its cache. Each configuration warms up
before its loads: a few streams of the load's prompt (its prefill shapes), and, for a
configuration without CUDA graphs, a burst of short prompts whose lengths make the
batch shrink step by step from the widest load (the kernels' row blocks).

Progress: a line on stderr (flushed, with the seconds since the start) at each phase:
the model built, each engine's start (each CUDA graph captured, with its bucket and
seconds, and the whole start's seconds), each warm-up and load started and finished with
its key figures; a run cut short says where it was.

Bounded in time: each engine's start has a limit (`Settings.start_timeout_s`, within the
budget): a start that runs past it is its configuration's failure (its rows say how long
it took) and the next configuration goes on. Between two CUDA graph captures the start is
stopped at once (`Engine`'s ``on_graph``); a start without graphs cannot be interrupted,
so its overrun is found when it returns. Each load has a timeout (a stuck server fails the load, not hangs the
bench: its row records the error, the configuration's later loads are not run, the next
configuration goes on, and the exit status is 1; an engine that cannot start fails its
configuration's loads the same way), and the whole run, model building included, a
budget (`Settings.budget_s`, 400 s) that no load runs past; on a GPU a watchdog dumps
every thread's traceback and exits 60 s after it, should something outside a load hang.
serve.json is written after every part, so a run cut short keeps what it measured.
Expected on an H200: about 5 minutes (estimated, not yet measured: the model built and
its kernels compiled in a minute or two, 256 × 512-token prefills in several seconds,
steps of 256 rows at 50–80 ms; the deterministic loads, every step at least 64 rows,
take the most).

On a GPU the model is the Gemma 3 12B shape at 4-bit weights and 4-bit KV with random
weights, built by `bench e2e`'s `random_model` (no checkpoint; its EOS removed so that
generations run their full length), with a tokenizer that spells token ids as numbers.
`--quick` runs the bundled model with its own tokenizer, a few short streams of every
part, on the CPU too (the only `qfuse bench` that runs without a GPU). Writes serve.json
and serve.png.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import hashlib
import os
import platform
import sys
import time
import traceback
import urllib.request
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace

import torch

from . import common
from .serve_client import Clients, httpx_module

SLOTTED, INVARIANT, PAGED = "slotted-bucketed", "slotted-deterministic", "paged-bucketed"
ASYNC, MIXED = "slotted-async", "paged-mixed"
PREFILL_EAGER, PREFILL_GRAPHS = "slotted-prefill-eager", "slotted-prefill-graphs"
# The parts a run may be limited to (`qfuse bench serve --parts`): one device call of
# ten minutes holds some of them, not all (NOTES "Serving" has the times).
PARTS = ("slotted", "async", "prefix", "deterministic", "paged", "mixed", "prefill_graphs")
# What a run without --parts runs: mixed steps and prefill graphs are asked for by name
# until measured.
DEFAULT_PARTS = PARTS[:-2]


@dataclass(frozen=True)
class Settings:
    streams: tuple[int, ...] = (1, 8, 32, 128, 256)  # the slotted configurations' loads
    paged_streams: tuple[int, ...] = (128, 256)
    prompt_tokens: int = 512  # the random model's prompt; the bundled model's is text
    max_tokens: int = 256
    max_batch: int = 256
    kv_bits: int = 4
    kv_group_size: int = 64
    kv_page_size: int = 16
    prefill_chunk: int = 512  # the server's default
    max_prefill_tokens: int = 2048  # the server's default
    step_tokens: int | None = None  # the mixed steps' budget; None: the server's default
    cuda_graph: bool = True  # where the engine takes them: on CUDA, over a cache they run on
    prefix_requests: int = 64
    prefix_system_tokens: int = 1000
    prefix_question_tokens: int = 16
    prefix_max_tokens: int = 8
    load_timeout_s: float = 120.0  # one load, warm-ups too
    # One engine's start: 9 buckets' graphs of up to 256 rows on the 12B shape (not yet
    # measured; the kill that asked for this limit came about 100 s into one).
    start_timeout_s: float = 180.0
    budget_s: float = 400.0  # from the start: no load runs past it (and no hang 60 s more)
    parts: tuple[str, ...] = DEFAULT_PARTS  # which run (the in-process baseline always does)
    # Part prefill_graphs: requests one after another, per prompt length cut from the
    # load's prompt; the padded lengths (None: `serving.engine.PREFILL_BUCKETS`).
    prefill_requests: int = 8
    prefill_prompt_tokens: tuple[int, ...] = (512, 100)
    prefill_max_tokens: int = 4
    prefill_buckets: tuple[int, ...] | None = None


# The bundled model on a CPU: every part of the run, small. Its prompts are short, so a
# chunk of 32 tokens makes the prefix load's prompts go in chunks as the GPU run's do.
QUICK = Settings(streams=(1, 4), paged_streams=(4,), max_tokens=16, max_batch=4,
                 kv_group_size=32, prefill_chunk=32, prefix_requests=4,
                 prefix_system_tokens=64, prefix_question_tokens=4, prefix_max_tokens=4,
                 load_timeout_s=60.0, start_timeout_s=60.0, budget_s=150.0,
                 prefill_requests=3, prefill_prompt_tokens=(8, 3), prefill_buckets=(4, 16))
PROMPT = "def fibonacci(n):\n    "  # the bundled model writes code
SYSTEM = ("You are a careful Python reviewer. Answer with code only.\n"
          "def add(a, b):\n    return a + b\n\nimport os\nprint(os.getcwd())\n") * 8


class NumberTokenizer:
    """A tokenizer for random-weight models: token id i is the text " i". Decoding is
    prefix-stable, as the engine's incremental decode needs, and covers any vocabulary."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        return SimpleNamespace(ids=[int(t) for t in text.split()])

    def decode(self, ids) -> str:
        return "".join(f" {i}" for i in ids)

    def get_vocab_size(self) -> int:
        return self.vocab_size


@dataclass
class Workload:
    """What the run sends: the loads' prompt (text, as `generate()` takes it too), a
    short prompt for warm-ups, and the prefix load's system prompt and questions (ids:
    the request's exact tokens; one question more than the requests, to warm the cache)."""
    prompt: str
    short: list[int]
    system: list[int]
    questions: list[list[int]]


class Budget:
    """The run's time: how long a load may still take (`timeout`), None once spent."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def timeout(self, limit: float) -> float | None:
        left = self.seconds - self.elapsed()
        return None if left < 1 else min(limit, left)

    def say(self, line: str) -> None:
        """A progress line on stderr, at once: a run killed from outside shows its phase."""
        print(f"bench serve [{self.elapsed():.0f} s] {line}", file=sys.stderr, flush=True)


class LoadFailed(Exception):
    """A load timed out or failed; the configuration's later loads are not run."""


class StartTimeout(Exception):
    """An engine's start ran past its limit (`Settings.start_timeout_s`)."""


def _percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile by linear interpolation between order statistics."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(streams: list[dict]) -> dict:
    """The figures of one load from its streams' timings (seconds → ms, tokens/s)."""
    firsts = [s["arrivals"][0] for s in streams]
    lasts = [s["arrivals"][-1] for s in streams]
    ttft = [(s["arrivals"][0] - s["sent"]) * 1e3 for s in streams]
    itl = [(b - a) * 1e3 for s in streams for a, b in zip(s["arrivals"], s["arrivals"][1:])]
    start, end = max(firsts), min(lasts)  # the window in which every stream decodes
    if end > start:
        tokens = sum(start < t <= end for s in streams for t in s["arrivals"])
        decode_tps = tokens / (end - start)
    elif max(lasts) > min(firsts):  # streams that never overlapped: the whole span instead
        decode_tps = sum(len(s["arrivals"]) - 1 for s in streams) / (max(lasts) - min(firsts))
    else:  # one chunk each, all at once: no decode to time
        decode_tps = None
    total = sum(s["completion_tokens"] for s in streams)
    itl50, itl99 = _percentile(itl, 50), _percentile(itl, 99)
    return {"streams": len(streams), "completion_tokens": total,
            "decode_tokens_per_s": decode_tps,
            "throughput_tokens_per_s": total / (max(lasts) - min(s["sent"] for s in streams)),
            "ttft_p50_ms": _percentile(ttft, 50), "ttft_p99_ms": _percentile(ttft, 99),
            "itl_p50_ms": itl50, "itl_p99_ms": itl99,
            "itl_p99_over_p50": itl99 / itl50 if itl50 else None}


def _on_cuda(model) -> bool:
    return model.model.norm.weight.device.type == "cuda"


def in_process(model, tokenizer, prompt: str, settings: Settings) -> dict:
    """One stream through `generate()`, timed as the server's streams are: decode
    tokens/s from the first token to the last (the best of two runs after a warm-up)."""
    from ..runtime.generation import Step, generate
    from ..runtime.sampling import SamplingParams

    def once(max_tokens: int) -> float:
        times = []
        for event in generate(model, tokenizer, [prompt], max_tokens, SamplingParams(),
                              kv_bits=settings.kv_bits, kv_group_size=settings.kv_group_size,
                              cuda_graph=settings.cuda_graph and _on_cuda(model)):
            if isinstance(event, Step):
                times.append(time.perf_counter())
        return (len(times) - 1) / (times[-1] - times[0])

    once(4)  # warm-up: kernels compiled, graph capture paid
    return {"decode_tokens_per_s": max(once(settings.max_tokens) for _ in range(2))}


def make_engine(model, tokenizer, settings: Settings, *, max_batch: int, context: int,
                deterministic: bool = False, paged: bool = False,
                async_scheduling: bool = False, mixed_steps: bool = False,
                prefix_caching: bool | None = None, budget: Budget | None = None,
                name: str = "engine", prefill_buckets: tuple[int, ...] = ()):
    """(an Engine, the record of its configuration). CUDA graphs asked for on CUDA (over
    pages too: the bench measures the paged graph, which `qfuse serve` runs only when
    asked; and over the fixed-length prefills of ``prefill_buckets``, when given);
    ``prefix_caching`` None is off. With ``budget``: progress lines under ``name``,
    and StartTimeout once the start runs past `Settings.start_timeout_s` (or the budget),
    between two graph captures or, where it cannot be interrupted, when it returns."""
    from ..serving.engine import Engine

    kw = {"max_batch": max_batch, "max_queue": max_batch, "context": context,
          "kv_bits": settings.kv_bits, "kv_group_size": settings.kv_group_size,
          "deterministic": deterministic, "max_prefill_tokens": settings.max_prefill_tokens,
          "prefill_chunk": settings.prefill_chunk, "prefix_caching": bool(prefix_caching)}
    if paged:
        kw["kv_page_size"] = settings.kv_page_size
    if async_scheduling:
        kw["async_scheduling"] = True
    if mixed_steps:
        kw.update(mixed_steps=True, step_tokens=settings.step_tokens)
    if prefill_buckets:
        kw["prefill_buckets"] = tuple(prefill_buckets)
    graphs = settings.cuda_graph and _on_cuda(model)
    note = None if graphs else ("off: the model is not on CUDA" if settings.cuda_graph
                                else "off: Settings.cuda_graph")
    limit = None
    if budget is not None:
        limit = budget.timeout(settings.start_timeout_s)
        if limit is None:
            raise StartTimeout(f"not started: the run's budget of {settings.budget_s:.0f} s "
                               "is spent")
    say = budget.say if budget is not None else (lambda line: None)
    began, captured = time.monotonic(), []

    def on_graph(bucket: int, seconds: float) -> None:
        captured.append(bucket)
        say(f"{name}: CUDA graph for {bucket} rows captured in {seconds:.1f} s")
        if limit is not None and time.monotonic() - began > limit:
            raise StartTimeout(f"the engine's start ran past {limit:g} s (graphs captured "
                               f"for buckets {captured}, then stopped)")

    say(f"{name}: starting the engine ({'paged' if paged else 'slotted'} KV, max_batch "
        f"{max_batch}, CUDA graphs {'asked for' if graphs else 'off'})")
    engine = Engine(model, tokenizer, cuda_graph=graphs, on_graph=on_graph, **kw)
    start_s = time.monotonic() - began
    say(f"{name}: engine started in {start_s:.1f} s"
        + (f" (CUDA graphs captured for buckets {captured})" if captured else ""))
    if limit is not None and start_s > limit:  # a start no capture could interrupt
        engine.stop()
        raise StartTimeout(f"the engine's start took {start_s:.1f} s, past its limit of "
                           f"{limit:g} s")
    record = {"kv_cache": "paged" if engine.paged else "slotted",
              "kv_page_size": settings.kv_page_size if engine.paged else None,
              "kv_pages": engine.page_stats()["total"] if engine.paged else None,
              "prefill_chunk": engine.prefill_chunk,
              "max_prefill_tokens": engine.max_prefill_tokens,
              "cuda_graph": graphs, "cuda_graph_note": note,
              "deterministic": engine.deterministic, "max_batch": engine.max_batch,
              "buckets": list(engine.buckets),
              "context": engine.context, "kv_bits": settings.kv_bits,
              "kv_group_size": settings.kv_group_size,
              "prefix_caching": kw["prefix_caching"],
              "async_scheduling": async_scheduling,
              "mixed_steps": engine.mixed_steps,
              "step_tokens": engine.step_tokens if engine.mixed_steps else None,
              "prefill_buckets": list(engine.prefill_buckets),
              "start_s": round(start_s, 1), "graphs_captured": captured}
    return engine, record


def _release(model) -> None:
    """The memory of an engine just stopped (its cache, its graphs) back to the GPU."""
    gc.collect()
    if _on_cuda(model):
        torch.cuda.empty_cache()


def _start_failed(e: Exception, budget: Budget | None = None, name: str = "") -> str:
    """Why a configuration did not start, said on stderr too; a traceback unless it
    only ran out of time."""
    if not isinstance(e, StartTimeout):
        traceback.print_exc()
    why = f"the engine or its server did not start: {type(e).__name__}: {e}"
    if budget is not None:
        budget.say(f"{name}: {why}")
    return why


def _said(figures: dict) -> str:
    """A load's key figures, for its progress line."""
    def f(key):
        v = figures.get(key)
        return "-" if v is None else f"{v:.0f}"

    return (f"decode {f('decode_tokens_per_s')} tokens/s, TTFT p50 {f('ttft_p50_ms')} ms, "
            f"ITL p50 {f('itl_p50_ms')} ms")


def _body(prompt, max_tokens: int) -> dict:
    return {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def _load(clients: Clients, port: int, bodies: list[dict], budget: Budget,
          settings: Settings) -> list[dict]:
    """One load's streams; LoadFailed (with why) if it timed out, failed, or the budget
    is spent."""
    timeout = budget.timeout(settings.load_timeout_s)
    if timeout is None:
        raise LoadFailed(f"not run: the run's budget of {settings.budget_s:.0f} s is spent")
    try:
        return clients.run(port, bodies, timeout)
    except (TimeoutError, RuntimeError) as e:
        raise LoadFailed(str(e)) from e


def _warm_up(clients, port, work: Workload, prompt, n: int, graphs: bool, budget,
             settings) -> None:
    """A few streams of ``prompt`` (the load's prefill shapes: up to 4 prompts a batch at
    the default budget); without graphs, ``n`` short prompts whose lengths spread over
    1..n/4 tokens, so that the batch shrinks by about 4 rows a step from n to none and
    each row block of the kernels runs once before it is timed."""
    _load(clients, port, [_body(prompt, 2)] * min(4, n), budget, settings)
    if not graphs:
        spread = max(2, n // 4)
        _load(clients, port, [_body(work.short, 1 + i % spread) for i in range(n)], budget,
              settings)


def serve_loads(model, tokenizer, work: Workload, settings: Settings, name: str,
                streams: tuple[int, ...], clients: Clients, budget: Budget) -> list[dict]:
    """A live server over a fresh engine of configuration ``name``; each load's row."""
    from ..serving.in_process import serve_in_process

    n_prompt = len(tokenizer.encode(work.prompt).ids)
    began = time.monotonic()
    try:
        engine, record = make_engine(model, tokenizer, settings, max_batch=settings.max_batch,
                                     context=n_prompt + settings.max_tokens + 8,
                                     deterministic=name == INVARIANT,
                                     paged=name in (PAGED, MIXED),
                                     async_scheduling=name == ASYNC,
                                     mixed_steps=name == MIXED, budget=budget, name=name)
        server = serve_in_process(engine, tokenizer, model.config.vocab_size)
    except Exception as e:  # noqa: BLE001 -- e.g. a graph not captured: these loads fail alone
        why = f"not run: {_start_failed(e, budget, name)}"
        start_s = round(time.monotonic() - began, 1)
        return [{"config": name, "streams": n, "error": why, "start_s": start_s}
                for n in streams]
    rows, failed = [], None
    alone = None  # the text of the configuration's first load's first stream (greedy)
    try:
        try:
            budget.say(f"{name}: warming up")
            _warm_up(clients, server.port, work, work.prompt, max(streams),
                     record["cuda_graph"], budget, settings)
        except LoadFailed as e:
            failed = f"not run: the warm-up failed: {e}"
            budget.say(f"{name}: {failed}")
        for n in streams:
            row = {"config": name, "streams": n}
            if failed:
                rows.append({**row, "error": failed, "engine": record})
                continue
            before = dict(engine.steps_by_batch)
            mixed_before = getattr(engine.steps, "mixed_runs", 0)
            preempted = engine.preemptions
            clock = _engine_clock(engine)
            budget.say(f"{name}: load of {_streams(n)} started")
            loaded = time.monotonic()
            try:
                timings = _load(clients, server.port, [_body(work.prompt, settings.max_tokens)]
                                * n, budget, settings)
            except LoadFailed as e:
                rows.append({**row, "error": str(e), "engine": record})
                failed = "not run: an earlier load of this configuration failed"
                print(rows[-1], flush=True)
                budget.say(f"{name}: load of {_streams(n)} failed: {e}")
                continue
            after = dict(engine.steps_by_batch)
            row.update(summarize(timings))
            # Every stream sends the same prompt, greedy: batch invariance means each one
            # gets the text the configuration's first (smallest) load got.
            alone = timings[0]["text"] if alone is None else alone
            row["same_text_as_alone"] = sum(t["text"] == alone for t in timings) / len(timings)
            # the text itself, short: configurations that should agree are compared by it
            row["first_text_sha1"] = hashlib.sha1(timings[0]["text"].encode()).hexdigest()
            row["steps_by_batch"] = {str(b): k - before.get(b, 0) for b, k in sorted(after.items())
                                     if k > before.get(b, 0)}
            if engine.paged:
                row["preemptions"] = engine.preemptions - preempted
            mixed = getattr(engine.steps, "mixed_runs", 0) - mixed_before
            if engine.mixed_steps:  # steps of decode rows and prompt pieces together
                row["mixed_steps"] = mixed
            row.update(engine_time(clock, _engine_clock(engine), sum(after.values())
                                   - sum(before.values()) + mixed))
            row["engine"] = record
            row["elapsed_s"] = round(budget.elapsed(), 1)
            rows.append(row)
            print({k: v for k, v in row.items() if k != "engine"}, flush=True)
            budget.say(f"{name}: load of {_streams(n)} done in "
                       f"{time.monotonic() - loaded:.1f} s: {_said(row)}")
    finally:
        server.stop()  # its lifespan stops the engine
        engine.stop()
    return rows


def metric_totals(port: int, names: tuple[str, ...]) -> dict[str, float] | None:
    """Each named counter of /metrics that the server exposes, summed over its labels (a
    counter may be exposed with `_total`); None where /metrics does not answer (no
    prometheus-client)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        metric = line.split("{", 1)[0].split(" ", 1)[0]
        base = metric.removesuffix("_total")
        if base in names:
            totals[base] = totals.get(base, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


PREFIX_METRICS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")


def prefix_run(model, tokenizer, work: Workload, settings: Settings, sharing: bool,
               clients: Clients, budget: Budget) -> dict:
    """The prefix load on a paged engine with prefix caching on or off: warm-ups, one
    request that puts the system prompt in the cache (a no-op without caching), then
    every request at once; its row."""
    from ..serving.in_process import serve_in_process

    n = settings.prefix_requests
    longest = max(len(q) for q in work.questions)
    row = {"config": "paged-prefix", "prefix_caching": sharing}
    name = f"paged-prefix, caching {'on' if sharing else 'off'}"
    try:
        engine, record = make_engine(model, tokenizer, settings, max_batch=n,
                                     context=len(work.system) + longest
                                     + settings.prefix_max_tokens + 8,
                                     paged=True, prefix_caching=sharing, budget=budget,
                                     name=name)
        server = serve_in_process(engine, tokenizer, model.config.vocab_size)
    except Exception as e:  # noqa: BLE001 -- this run fails alone (its row says why)
        return {**row, "error": _start_failed(e, budget, name)}
    try:
        # The same lengths and chunks, but no prefix in common with the system prompt (its
        # first token moved to the end).
        other = work.system[1:] + work.system[:1] + work.questions[0]
        budget.say(f"{name}: warming up")
        _warm_up(clients, server.port, work, other, n, record["cuda_graph"], budget, settings)
        _load(clients, server.port, [_body(work.system + work.questions[n], 2)], budget,
              settings)
        before = metric_totals(server.port, PREFIX_METRICS)
        budget.say(f"{name}: load of {n} requests started")
        loaded = time.monotonic()
        timings = _load(clients, server.port,
                        [_body(work.system + q, settings.prefix_max_tokens)
                         for q in work.questions[:n]], budget, settings)
        after = metric_totals(server.port, PREFIX_METRICS)
        row.update(summarize(timings))
        budget.say(f"{name}: load of {n} requests done in {time.monotonic() - loaded:.1f} s: "
                   f"{_said(row)}")
        for name in PREFIX_METRICS:  # None where the server does not count it
            known = before is not None and after is not None and name in after
            row[name] = after[name] - before.get(name, 0.0) if known else None
        row["engine"] = record
        row["elapsed_s"] = round(budget.elapsed(), 1)
    except LoadFailed as e:
        row["error"] = str(e)
        budget.say(f"{name}: failed: {e}")
    finally:
        server.stop()
        engine.stop()
    print({k: v for k, v in row.items() if k != "engine"}, flush=True)
    return row


def prefix_load(model, tokenizer, work: Workload, settings: Settings, clients: Clients,
                budget: Budget) -> dict:
    """The prefix load without and with prefix caching."""
    out = {"requests": settings.prefix_requests, "system_tokens": len(work.system),
           "question_tokens": max(len(q) for q in work.questions),
           "max_tokens": settings.prefix_max_tokens}
    rows = []
    for sharing in (False, True):
        rows.append(prefix_run(model, tokenizer, work, settings, sharing, clients, budget))
        _release(model)
    without, with_ = (r.get("ttft_p50_ms") for r in rows)
    return {**out, "rows": rows,
            "ttft_p50_with_vs_without": with_ / without if with_ and without else None}


def prefill_ttft(model, tokenizer, work: Workload, settings: Settings, clients: Clients,
                 budget: Budget) -> list[dict]:
    """Part prefill_graphs (the module's docstring, 7): TTFT at one stream with the prefill
    eager, then from a CUDA graph per padded length; a row per configuration and prompt
    length."""
    from ..serving.engine import PREFILL_BUCKETS
    from ..serving.in_process import serve_in_process

    ids = tokenizer.encode(work.prompt).ids
    prompts = {}
    for k in settings.prefill_prompt_tokens:
        prompts.setdefault(min(k, len(ids)), ids[:k])
    buckets = settings.prefill_buckets or PREFILL_BUCKETS
    rows = []
    for name in (PREFILL_EAGER, PREFILL_GRAPHS):
        try:
            engine, record = make_engine(
                model, tokenizer, settings, max_batch=1,
                context=max(prompts) + settings.prefill_max_tokens + 8, budget=budget,
                name=name, prefill_buckets=buckets if name == PREFILL_GRAPHS else ())
            server = serve_in_process(engine, tokenizer, model.config.vocab_size)
        except Exception as e:  # noqa: BLE001 -- this configuration fails alone
            why = f"not run: {_start_failed(e, budget, name)}"
            rows += [{"config": name, "prompt_tokens": n, "error": why} for n in prompts]
            continue
        try:
            budget.say(f"{name}: warming up")
            for prompt in prompts.values():  # each length's kernels (or graph) once
                _load(clients, server.port, [_body(prompt, 2)], budget, settings)
            for n, prompt in prompts.items():
                row = {"config": name, "streams": 1, "prompt_tokens": n}
                before = engine.prefill.fixed_runs
                ttft, texts = [], []
                try:
                    for _ in range(settings.prefill_requests):
                        one = _load(clients, server.port,
                                    [_body(prompt, settings.prefill_max_tokens)], budget,
                                    settings)[0]
                        ttft.append((one["arrivals"][0] - one["sent"]) * 1e3)
                        texts.append(one["text"])
                except LoadFailed as e:
                    rows.append({**row, "error": str(e), "engine": record})
                    budget.say(f"{name}: {n}-token prompts failed: {e}")
                    continue
                row.update({"requests": len(ttft), "ttft_ms": [round(t, 2) for t in ttft],
                            "ttft_p50_ms": _percentile(ttft, 50), "ttft_min_ms": min(ttft),
                            "fixed_prefills": engine.prefill.fixed_runs - before,
                            "same_text_every_request": len(set(texts)) == 1,
                            "first_text_sha1": hashlib.sha1(texts[0].encode()).hexdigest(),
                            "engine": record, "elapsed_s": round(budget.elapsed(), 1)})
                rows.append(row)
                budget.say(f"{name}: {len(ttft)} requests of {n} tokens, TTFT p50 "
                           f"{row['ttft_p50_ms']:.1f} ms, min {row['ttft_min_ms']:.1f} ms")
        finally:
            server.stop()
            engine.stop()
        _release(model)
    return rows


def prefill_figures(rows: list[dict]) -> dict:
    """Part prefill_graphs' figures: each configuration's TTFT p50 per prompt length, the
    graphs' against the eager prefill's, and whether their texts agree."""
    def row(config, n):
        return next((r for r in rows if r["config"] == config and r["prompt_tokens"] == n
                     and "error" not in r), None)

    out = {}
    for n in sorted({r["prompt_tokens"] for r in rows}, reverse=True):
        eager, graphs = row(PREFILL_EAGER, n), row(PREFILL_GRAPHS, n)
        for config, r in ((PREFILL_EAGER, eager), (PREFILL_GRAPHS, graphs)):
            out[f"{config}: TTFT p50 ms at 1 stream, {n}-token prompt"] = \
                r and r["ttft_p50_ms"]
        out[f"{PREFILL_GRAPHS} vs {PREFILL_EAGER}: TTFT p50 at 1 stream, {n}-token prompt"] = \
            graphs["ttft_p50_ms"] / eager["ttft_p50_ms"] if eager and graphs else None
        out[f"{PREFILL_GRAPHS}: text as {PREFILL_EAGER}'s, {n}-token prompt (1.0)"] = \
            float(graphs["first_text_sha1"] == eager["first_text_sha1"]) \
            if eager and graphs else None
    return out


def run(model, tokenizer, work: Workload, settings: Settings, save, budget: Budget) -> dict:
    """Every part (the module's docstring), in its order; ``save(results)`` after each,
    so that serve.json holds what a run cut short measured."""
    budget.say("in-process generate(), 1 stream: started")
    results = {"settings": asdict(settings),
               "prompt_tokens": len(tokenizer.encode(work.prompt).ids),
               "in_process": in_process(model, tokenizer, work.prompt, settings),
               "rows": [], "prefix": None}
    print("in-process generate(), 1 stream:", results["in_process"], flush=True)
    budget.say("in-process generate(), 1 stream: done, "
               f"{results['in_process']['decode_tokens_per_s']:.1f} tokens/s")
    save(results)
    def saved():
        _release(model)
        results["elapsed_s"] = round(budget.elapsed(), 1)
        save(results)

    clients = Clients()
    try:
        for part, name in (("slotted", SLOTTED), ("async", ASYNC)):
            if part in settings.parts:
                results["rows"] += serve_loads(model, tokenizer, work, settings, name,
                                               settings.streams, clients, budget)
                saved()
        # Before the deterministic loads, the longest part: a budget spent there costs
        # the paged loads alone.
        if "prefix" in settings.parts:
            results["prefix"] = prefix_load(model, tokenizer, work, settings, clients, budget)
            saved()
        else:
            results["prefix"] = {"requests": settings.prefix_requests,
                                 "system_tokens": len(work.system),
                                 "skipped": "not among this run's --parts"}
        for part, name, streams in (("deterministic", INVARIANT, settings.streams),
                                    ("paged", PAGED, settings.paged_streams),
                                    ("mixed", MIXED, settings.paged_streams)):
            if part in settings.parts:
                results["rows"] += serve_loads(model, tokenizer, work, settings, name,
                                               streams, clients, budget)
                saved()
        if "prefill_graphs" in settings.parts:
            results["prefill_graphs"] = prefill_ttft(model, tokenizer, work, settings,
                                                     clients, budget)
            saved()
    finally:
        clients.close()
    results["figures"] = figures(results["rows"], results["in_process"], results["prefix"],
                                 settings)
    if "prefill_graphs" in results:
        results["figures"].update(prefill_figures(results["prefill_graphs"]))
    return results


def figures(rows: list[dict], base: dict, prefix: dict | None, settings: Settings) -> dict:
    """The issue's figures, each named with its target where it has one; None where a
    load it needs did not run."""
    def row(config, n):
        return next((r for r in rows if r["config"] == config and r["streams"] == n
                     and "error" not in r), None)

    def tps(config, n):
        r = row(config, n)
        return r and r["decode_tokens_per_s"]

    def over(a, b):
        return a / b if a and b else None

    one = min(settings.streams)
    # the targets hold for the server's modes; the invariant one is reported
    modes = {SLOTTED: True, ASYNC: True, INVARIANT: False}
    out = {f"{config}: {one} stream vs in-process generate(){' (>= 0.95)' if aimed else ''}":
           over(tps(config, one), base["decode_tokens_per_s"])
           for config, aimed in modes.items()}
    targets = {32: " (>= 16)", 256: " (>= 40)"} if one == 1 else {}
    for n in settings.streams:
        if n != one:
            for config, aimed in modes.items():
                target = targets.get(n, "") if aimed else ""
                out[f"{config}: {n} streams vs {one}, decode tokens/s{target}"] = \
                    over(tps(config, n), tps(config, one))
    for config in (SLOTTED, ASYNC):
        for n in settings.streams:
            r = row(config, n)
            out[f"{config}: TTFT p50 ms at {_streams(n)}{' (<= 300)' if n == 32 else ''}"] = \
                r and r["ttft_p50_ms"]
    for n in settings.streams:
        out[f"{ASYNC} vs {SLOTTED} at {_streams(n)}, decode tokens/s"] = \
            over(tps(ASYNC, n), tps(SLOTTED, n))
    for r in rows:
        if "error" not in r:
            out[f"{r['config']}: ITL p99 / p50 at {_streams(r['streams'])} (<= 2)"] = \
                r["itl_p99_over_p50"]
    # Async scheduling changes when tokens are read, never which: each load's first
    # stream has the text it has without it.
    agree = [r["first_text_sha1"] == row(SLOTTED, r["streams"]).get("first_text_sha1")
             for r in rows if r["config"] == ASYNC and "first_text_sha1" in r
             and row(SLOTTED, r["streams"])]
    out[f"{ASYNC}: loads whose text is {SLOTTED}'s (1.0)"] = \
        sum(agree) / len(agree) if agree else None
    # Batch invariance holds if every stream of every load got the text of the first
    # load's (the same greedy prompt), in the deterministic configuration.
    same = [r["same_text_as_alone"] for r in rows
            if r["config"] == INVARIANT and "same_text_as_alone" in r]
    out[f"{INVARIANT}: every stream's text as alone, every load (1.0)"] = \
        min(same) if len(same) == len(settings.streams) else None
    # The rule (the issue's): batch invariance is the default if it costs at most 5% of
    # throughput; the cost at every load is reported, and the worst decides.
    costs = {}
    for n in settings.streams:
        ratio = over(tps(INVARIANT, n), tps(SLOTTED, n))
        costs[n] = None if ratio is None else 1 - ratio
        out[f"invariance cost at {_streams(n)}"] = costs[n]
    known = [c for c in costs.values() if c is not None]
    out["invariance cost, worst load (<= 0.05: default)"] = \
        max(known) if len(known) == len(costs) else None
    for n in settings.paged_streams:
        out[f"{PAGED} vs {SLOTTED} at {_streams(n)}, decode tokens/s"] = \
            over(tps(PAGED, n), tps(SLOTTED, n))
    for n in settings.paged_streams:  # mixed steps trade prompt speed for steady streams
        out[f"{MIXED} vs {PAGED} at {_streams(n)}, decode tokens/s"] = \
            over(tps(MIXED, n), tps(PAGED, n))
        mixed, paged = row(MIXED, n), row(PAGED, n)
        out[f"{MIXED} vs {PAGED} at {_streams(n)}, TTFT p50"] = \
            over(mixed and mixed["ttft_p50_ms"], paged and paged["ttft_p50_ms"])
    out["prefix sharing: TTFT p50 with vs without (<= 0.3)"] = \
        (prefix or {}).get("ttft_p50_with_vs_without")
    return out


def _engine_clock(engine) -> tuple[float, float]:
    """The engine thread's busy seconds and, of them, its waits for sampled tokens (0s
    for an engine without the counters)."""
    return getattr(engine, "busy_s", 0.0), getattr(engine, "token_wait_s", 0.0)


def engine_time(before: tuple[float, float], after: tuple[float, float], steps: int) -> dict:
    """Where the engine thread's time went over a load, per decode step: busy (all but the
    waits for work, prefills included), waiting for the GPU's sampled tokens, and the rest,
    the host's own work (scheduling, sampling launches, detokenizing, events; and any
    other wait on the GPU, such as a prefill's)."""
    if steps <= 0:
        return {}
    busy, wait = after[0] - before[0], after[1] - before[1]
    return {"engine_busy_ms_per_step": 1e3 * busy / steps,
            "token_wait_ms_per_step": 1e3 * wait / steps,
            "host_ms_per_step": 1e3 * (busy - wait) / steps}


def _streams(n: int) -> str:
    return f"{n} stream" if n == 1 else f"{n} streams"


def metadata(model) -> dict:
    """common.metadata() on a GPU; on the CPU (--quick) the same fields without the GPU's."""
    if _on_cuda(model):
        return common.metadata()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": None, "device": "cpu", "torch": torch.__version__,
            "qfuse": __import__("qfuse").__version__,
            "python": platform.python_version(),
            "qfuse_source_sha256": common.source_digest()}


def build(quick: bool):
    """(model, tokenizer, workload, settings, description) for the run."""
    if quick:
        from ..api import load
        from ..runtime.prompts import encode_prompts

        settings = QUICK
        model, tokenizer = load(progress=False)
        system = encode_prompts(tokenizer, [SYSTEM])[0][: settings.prefix_system_tokens]
        questions = [tokenizer.encode(f"# case {q}\n", add_special_tokens=False).ids
                     [: settings.prefix_question_tokens]
                     for q in range(settings.prefix_requests + 1)]
        work = Workload(PROMPT, encode_prompts(tokenizer, [PROMPT])[0], system, questions)
        return model, tokenizer, work, settings, "the bundled model"
    from .e2e import GEMMA3_12B, random_model

    # No EOS: a random model's greedy text would otherwise end wherever it hits one.
    model = random_model({**GEMMA3_12B, "eos_token_id": []}, 4, "cuda")
    vocab = GEMMA3_12B["vocab_size"]
    tokenizer = NumberTokenizer(vocab)
    settings = Settings()

    def ids(n: int, step: int, offset: int = 0) -> list[int]:
        """n distinct ids spread over the vocabulary (3 and up: clear of special ids)."""
        return [3 + (offset + step * i) % (vocab - 3) for i in range(n)]

    q = settings.prefix_question_tokens
    work = Workload(" ".join(map(str, ids(settings.prompt_tokens, 7919))), ids(16, 31),
                    ids(settings.prefix_system_tokens, 104729, 11),
                    [ids(q, 613, 5 + j * q * 613) for j in range(settings.prefix_requests + 1)])
    return model, tokenizer, work, settings, \
        "Gemma 3 12B shape, 4-bit weights (g64) + 4-bit KV, random weights"


def main(out_dir: str = "bench/results", quick: bool = False,
         settings: Settings | None = None, parts: tuple[str, ...] | None = None,
         budget_s: float | None = None) -> int:
    """The run; 0 if every load ran, 1 if one failed or did not run (serve.json says
    which and why). ``settings`` replaces the run's own (tests); ``parts`` (of PARTS) and
    ``budget_s`` replace its parts and budget."""
    from ..errors import UserError

    if not quick and not torch.cuda.is_available():
        raise UserError("qfuse bench serve needs a CUDA GPU (--quick runs on the CPU)")
    try:
        httpx_module()
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(f"qfuse bench serve needs starlette, uvicorn and httpx ({e.name} is "
                        "missing)") from e
    # The budget counts from here: building the model is part of the run.
    unknown = sorted(set(parts or ()) - set(PARTS))
    if unknown:
        raise UserError(f"unknown serve bench part(s) {', '.join(unknown)}; the parts are "
                        f"{', '.join(PARTS)}")
    if budget_s is not None and not budget_s > 0:
        raise UserError(f"the budget must be a positive number of seconds, got {budget_s}")
    chosen = {k: v for k, v in (("parts", tuple(parts) if parts else None),
                                ("budget_s", budget_s)) if v is not None}
    budget = Budget(budget_s if budget_s is not None
                    else (settings or (QUICK if quick else Settings())).budget_s)
    budget.say("building the model" + (" (the bundled one)" if quick else ""))
    model, tokenizer, work, own, what = build(quick)
    budget.say(f"model built in {budget.elapsed():.1f} s: {what}")
    settings = replace(settings or own, **chosen)
    head = {"meta": metadata(model), "quick": quick, "model": what}

    def save(results: dict) -> None:
        common.write_results(out_dir, "serve", {**head, "complete": "figures" in results,
                                                **results})

    if not quick:  # a hang outside a load (a graph capture, a stop): tracebacks, exit 1
        faulthandler.dump_traceback_later(settings.budget_s + 60, exit=True)
    try:
        results = run(model, tokenizer, work, settings, save, budget)
    finally:
        if not quick:
            faulthandler.cancel_dump_traceback_later()
    save(results)
    payload = {**head, **results}
    try:
        plot(payload, os.path.join(out_dir, "serve.png"))
    except Exception:  # noqa: BLE001 -- the figures are written; a plot bug costs the plot only
        traceback.print_exc()
    common.print_table(payload["rows"], ["config", "streams", "decode_tokens_per_s",
                                         "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                                         "itl_p99_ms", "host_ms_per_step",
                                         "token_wait_ms_per_step", "error"])
    print("in-process, 1 stream:", round(payload["in_process"]["decode_tokens_per_s"], 1),
          "tokens/s")
    if "prefill_graphs" in payload:
        common.print_table(payload["prefill_graphs"], ["config", "prompt_tokens", "requests",
                                                       "ttft_p50_ms", "ttft_min_ms",
                                                       "fixed_prefills", "error"])
    prefix = payload["prefix"]
    if "skipped" in prefix:
        print("prefix load skipped:", prefix["skipped"])
    for k, v in payload["figures"].items():
        print(f"{k}: {'not measured' if v is None else round(v, 3)}")
    print(f"serve bench: {budget.elapsed():.0f} s", flush=True)
    failed = [r for r in payload["rows"] + prefix.get("rows", [])
              + payload.get("prefill_graphs", []) if "error" in r]
    return 1 if failed else 0


def plot(payload: dict, path: str) -> None:
    """Decode tokens/s, time to first token and inter-token latency against streams, per
    configuration; the prefix load's TTFT with and without sharing."""
    plt = common.pyplot(path)
    if plt is None:
        return

    rows = [r for r in payload["rows"] if "error" not in r]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    panels = [("decode_tokens_per_s", None, "aggregate decode tokens/s"),
              ("ttft_p50_ms", "ttft_p99_ms", "time to first token (ms)"),
              ("itl_p50_ms", "itl_p99_ms", "inter-token latency (ms)")]
    for ax, (p50, p99, label) in zip(axes, panels):
        for i, config in enumerate((SLOTTED, INVARIANT, PAGED)):
            pts = sorted((r["streams"], r[p50], r[p99] if p99 else None) for r in rows
                         if r["config"] == config and r[p50] is not None)
            if not pts:
                continue
            n, a, b = zip(*pts)
            ax.plot(n, a, marker="o", color=f"C{i}", label=config + (" p50" if p99 else ""))
            if p99:
                ax.plot(n, b, marker="s", ls="--", color=f"C{i}", label=f"{config} p99")
        if p99 is None:
            ax.axhline(payload["in_process"]["decode_tokens_per_s"], color="k", ls=":", lw=1,
                       label="in-process, 1 stream")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    ax, prefix = axes[3], payload["prefix"]
    done = [r for r in prefix.get("rows", []) if "error" not in r]
    if done:
        names = ["with sharing" if r["prefix_caching"] else "without" for r in done]
        x = range(len(done))
        ax.bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in done], 0.4, label="p50")
        ax.bar([i + 0.2 for i in x], [r["ttft_p99_ms"] for r in done], 0.4, label="p99")
        ax.set_xticks(list(x), names)
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, prefix.get("skipped", "not measured"), ha="center", va="center",
                wrap=True, fontsize=8, transform=ax.transAxes)
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"{prefix['requests']} requests, a {prefix['system_tokens']}-token shared "
                 "system prompt", fontsize=8)
    fig.suptitle(f"qfuse serve: {payload['model']} ({payload['meta'].get('gpu') or 'CPU'})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

