"""`GET /metrics` of `qfuse serve`: Prometheus text (prometheus-client), named as vLLM names
its metrics where it has one, so that dashboards made for vLLM read qfuse's.

Each app has its own CollectorRegistry (not the process's default one), so that several
apps in one process (tests, `qfuse bench serve`) keep their counts apart. Every metric has
a ``model_name`` label, the served model's name.

Read from the engine at each scrape (one `Engine.stats` snapshot): vllm:num_requests_running
and vllm:num_requests_waiting, qfuse:num_requests_prefilling (running requests whose long
prompt is still being prefilled in chunks: their TTFT ends at the last chunk's token),
vllm:kv_cache_usage_perc and qfuse's own KV gauges. The default cache is slotted
(max_batch slots of the context's tokens each), so the slots stand where vLLM counts
blocks; with --kv-page-size the cache is paged, vllm:kv_cache_usage_perc is the share of
its pages held by sequences (cached prefix pages that none holds count as free, as vLLM
counts them) and qfuse:kv_blocks_used / qfuse:kv_blocks_free / qfuse:kv_blocks_cached /
qfuse:kv_block_size count them (vllm:num_preemptions_total: sequences preempted for
pages). The HELP text of each says which.

Prefix caching (on by default with pages): vllm:prefix_cache_queries_total and
vllm:prefix_cache_hits_total, the prompt tokens looked up in the prefix cache and found
there, at each new request's admission (vLLM v1's counters; a resumed preempted sequence
is not counted).

Recorded by the app as the engine's events reach it (on the event loop, not in the
engine's step): vllm:prompt_tokens_total, vllm:generation_tokens_total,
vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
vllm:e2e_request_latency_seconds and vllm:request_success_total, per choice (a request
with n choices is n engine requests, as vLLM counts n child requests). The two that every
token moves (generation tokens, inter-token latency) are plain numbers that each scrape
writes as prometheus-client writes its Counter and Histogram (`TokenCounter`,
`TokenHistogram`).

Without prometheus-client the server still starts; `/metrics` answers 503 with the reason.
"""

from __future__ import annotations

import bisect
import time

INSTALL = "pip install 'qfuse[serve]'"
# What `prometheus_client.generate_latest` writes. Spelled out: 0.26 names it
# CONTENT_TYPE_PLAIN_0_0_4, which 0.20 lacks, and its CONTENT_TYPE_LATEST is version 1.0.0.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket bounds in seconds. Fine around the targets (TTFT ≤ 300 ms under load,
# ITL p99 ≤ 2× p50 at a few ms per token on a GPU), coarse past them.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
               1200.0, 3600.0)


class Clock:
    """One HTTP request's times: when it arrived, and per choice when its last output
    came (None before the first)."""

    __slots__ = ("arrived", "last")

    def __init__(self, choices: int, arrived: float | None = None):
        self.arrived = time.monotonic() if arrived is None else arrived
        self.last: list[float | None] = [None] * choices


class Metrics:
    """The metrics of one app over ``engine``, for the model served as ``model_name``."""

    available = True

    def __init__(self, engine, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        label = ["model_name"]

        def counter(name, doc, labels=()):
            return Counter(name, doc, label + list(labels), registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, label, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self._prompt = counter(
            "vllm:prompt_tokens", "Prompt tokens prefilled, counted when a choice's first "
            "output comes (each of n choices prefills its prompt)").labels(model_name)
        # The two that every token moves: plain numbers (`TokenCounter`, `TokenHistogram`).
        self._generated = TokenCounter(
            "vllm:generation_tokens", "Tokens generated, as usage.completion_tokens counts "
            "them (an end-of-sequence token is not one)", model_name)
        self.registry.register(self._generated)
        self._success = counter(
            "vllm:request_success", "Choices finished, by finish reason (stop, length); "
            "errors and clients that went away are not counted", ["finished_reason"])
        self._success_by = {r: self._success.labels(model_name, r) for r in ("stop", "length")}
        self._ttft = histogram(
            "vllm:time_to_first_token_seconds", "Seconds from a request's arrival to a "
            "choice's first output reaching the server's event loop (queue and prefill "
            "included)", TTFT_BUCKETS)
        self._itl = TokenHistogram(
            "vllm:inter_token_latency_seconds", "Seconds between successive tokens of a "
            "choice, as they reach the server's event loop", model_name, ITL_BUCKETS)
        self.registry.register(self._itl)
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Seconds from a request's arrival to a "
            "choice's last event, for the choices request_success counts", E2E_BUCKETS)

    def observe(self, clock: Clock, i: int, event, prompt_tokens: int) -> None:
        """Record choice ``i``'s ``event`` (never an error event), which reached the
        event loop now; ``prompt_tokens``: its prompt's."""
        now = time.monotonic()
        last = clock.last[i]
        if last is None:  # its first output: the prompt has been prefilled
            self._ttft.observe(now - clock.arrived)
            self._prompt.inc(prompt_tokens)
        elif event.token is not None:
            self._itl.observe(now - last)
        if event.token is not None:
            self._generated.value += 1
            clock.last[i] = now
        elif last is None:
            clock.last[i] = now
        success = self._success_by.get(event.finish_reason)
        if success is not None:
            success.inc()
            self._e2e.observe(now - clock.arrived)

    def expose(self) -> tuple[bytes, str]:
        """The scrape's body and content type: the Prometheus text format, whatever the
        scraper's Accept header prefers. Every Prometheus reads it, and prometheus-client's
        OpenMetrics output is unsafe for vLLM's names: under the default escaping it writes
        a colon as ``_`` in the samples but not in their HELP and TYPE lines
        (prometheus/client_python issue 1177, open in 0.26)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry), CONTENT_TYPE


class NoMetrics:
    """What an app has without prometheus-client: it records nothing, `reason` says why."""

    available = False

    def __init__(self, reason: str):
        self.reason = reason

    def observe(self, clock: Clock, i: int, event, prompt_tokens: int) -> None:
        pass


def make_metrics(engine, model_name: str) -> Metrics | NoMetrics:
    try:
        return Metrics(engine, model_name)
    except ImportError as e:
        return NoMetrics(f"qfuse serve: /metrics needs prometheus-client ({INSTALL}); "
                         f"{e.name or 'it'} is missing")


def _created_series() -> bool:
    """Whether prometheus-client writes _created samples (off through
    PROMETHEUS_DISABLE_CREATED_SERIES or `disable_created_metrics`): asked of a counter of
    its own, as it decides that for its metrics at each collection."""
    from prometheus_client import Counter

    return any(s.name.endswith("_created")
               for s in Counter("probe", "", registry=None).collect()[0].samples)


class TokenCounter:
    """A counter that every token moves, of one model_name: ``value``, a plain number,
    written at each scrape as prometheus-client's Counter writes its own (the same samples
    and labels, its creation time). Its inc and the Histogram's observe take locks and
    check their arguments: ~2 µs a token between them, a sixth of the event loop's time a
    streamed token at 256 streams (py-spy, NOTES "Serving"); these take ~0.5 µs."""

    def __init__(self, name: str, doc: str, model_name: str):
        self.name, self.doc, self.model_name = name, doc, model_name
        self.value = 0
        self.created = time.time()

    def describe(self):
        from prometheus_client.core import CounterMetricFamily

        return [CounterMetricFamily(self.name, self.doc, labels=["model_name"])]

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(self.name, self.doc, labels=["model_name"])
        family.add_metric([self.model_name], float(self.value),
                          created=self.created if _created_series() else None)
        return [family]


class TokenHistogram:
    """A histogram that every token moves, of one model_name: `observe` counts a value in
    its bucket and adds it to the sum in the order observed, as prometheus-client's
    Histogram does (so the sum is the same float), and each scrape writes what that
    Histogram writes (cumulative buckets, count, sum, creation time)."""

    def __init__(self, name: str, doc: str, model_name: str, buckets: tuple[float, ...]):
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = [float(b) for b in buckets]
        if self.bounds[-1] != float("inf"):  # as the Histogram adds it
            self.bounds.append(float("inf"))
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        """Count ``value`` (a time, never NaN) in the first bucket whose bound holds it."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def describe(self):
        from prometheus_client.core import HistogramMetricFamily

        return [HistogramMetricFamily(self.name, self.doc, labels=["model_name"])]

    def collect(self):
        from prometheus_client.core import HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        buckets, seen = [], 0.0
        for bound, n in zip(self.bounds, self.counts):
            seen += n
            buckets.append((floatToGoString(bound), seen))
        family.add_metric([self.model_name], buckets, self.sum)
        if _created_series():
            family.add_sample(self.name + "_created", {"model_name": self.model_name},
                              self.created)
        return [family]


class _EngineCollector:
    """The engine's gauges from one `Engine.stats` snapshot per scrape."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def describe(self):
        return []  # unchecked names: the engine is read at scrapes only

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.engine.stats()
        slots, used = s["slots"], s["active"]

        def family(kind, name, doc, value):
            f = kind(name, doc, labels=["model_name"])
            f.add_metric([self.model_name], value)
            return f

        def gauge(name, doc, value):
            return family(GaugeMetricFamily, name, doc, value)

        def counter(name, doc, value):
            return family(CounterMetricFamily, name, doc, value)

        yield gauge("vllm:num_requests_running", "Requests holding a KV-cache slot (prefilled "
                    "or decoding)", used)
        yield gauge("vllm:num_requests_waiting", "Requests queued for a free slot", s["waiting"])
        yield gauge("qfuse:num_requests_prefilling", "Of the running requests, those whose "
                    "long prompt is still being prefilled in chunks (no token yet)",
                    s["prefilling"])
        pages = s.get("kv_pages")
        if pages is None:
            yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent. The "
                        "cache is slotted, not paged: the share of its slots held by requests "
                        "(at 1, new requests wait)", used / slots)
        else:
            yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent: the "
                        "share of the paged cache's blocks held by sequences (cached prefix "
                        "blocks that none holds count as free)",
                        pages["used"] / pages["total"])
            yield gauge("qfuse:kv_blocks_used", "KV-cache blocks (pages) held by sequences",
                        pages["used"])
            yield gauge("qfuse:kv_blocks_free", "KV-cache blocks (pages) free for new tokens "
                        "and waiting requests, the cached ones included", pages["free"])
            yield gauge("qfuse:kv_blocks_cached", "Of the free KV-cache blocks, those holding "
                        "a cached prompt prefix (reused by a request that shares it, evicted "
                        "least recently used first when blocks run short)", pages["cached"])
            yield gauge("qfuse:kv_block_size", "Tokens per KV-cache block (page)",
                        pages["page_size"])
            yield counter("vllm:num_preemptions", "Sequences preempted for KV-cache blocks "
                          "(they wait and resume)", pages["preemptions"])
        prefix = s.get("prefix_cache")
        if prefix is not None:
            queries = ("Prefix-cache queries, in prompt tokens looked up (each new request's "
                       "prompt, at its admission)")
            hits = ("Prefix-cache hits, in prompt tokens found cached (whole blocks, never a "
                    "prompt's last token)")
            for name, key, doc in (("vllm:prefix_cache_queries", "queries", queries),
                                   ("vllm:prefix_cache_hits", "hits", hits)):
                yield counter(name, doc, prefix[key])
        yield gauge("qfuse:kv_cache_slots_used", "KV-cache slots held by requests (each holds "
                    "one sequence of up to the context's tokens; slots stand for blocks until "
                    "the cache is paged)", used)
        yield gauge("qfuse:kv_cache_slots_free", "KV-cache slots free for waiting requests",
                    slots - used)
        yield gauge("qfuse:kv_cache_tokens", "Tokens of the sequences in the KV-cache slots "
                    "(prompt and generated)", s["kv_tokens"])
        yield gauge("qfuse:kv_cache_capacity_tokens", "Tokens the KV cache holds at most: "
                    "slots times the context, all reserved at start-up", slots * self.engine.context)
