"""`qfuse bench serve --quick` on the CPU with the bundled model: live servers on loopback
for every configuration (slotted bucketed and deterministic at 1 and 4 streams, paged at
4), the prefix load without and with prefix caching; the JSON has every figure, each the
ratio its name says (the bound in a name is the GPU run's target, which a CPU run cannot
promise), each row its engine configuration, and the plot is written. A server whose
engine never runs fails its loads within their timeout instead of hanging the bench.
Engine starts past their limit are timed on a clock the test advances, not the wall. The
tests of the bench's logic (parts run alone, the prefix load, failures) run the quick
run's workload on the tiny test model, which shares the bundled model's tokenizer."""

import dataclasses
import importlib.util
import json
import math
import re
import time

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("matplotlib")
if importlib.util.find_spec("httpx") is None and importlib.util.find_spec("httpx2") is None:
    pytest.skip("needs httpx (or httpx2)", allow_module_level=True)


def test_quick_bench_writes_sane_figures(tmp_path, capsys):
    from qfuse.bench import serve

    # Bounded by the quick run's budget; `complete` below says no load ran out of it.
    assert serve.main(out_dir=str(tmp_path), quick=True) == 0
    # Its progress, phase by phase, on stderr.
    said = [line.split("] ", 1)[1] for line in capsys.readouterr().err.splitlines()
            if line.startswith("bench serve [")]
    assert said[0] == "building the model (the bundled one)", said
    assert said[1].startswith("model built in ") and said[1].endswith(" s: the bundled model")
    assert said[2] == "in-process generate(), 1 stream: started", said
    assert said[3].startswith("in-process generate(), 1 stream: done, "), said
    for name in ("slotted-bucketed", "slotted-async", "slotted-deterministic",
                 "paged-bucketed"):
        begun = [i for i, line in enumerate(said)
                 if line.startswith(f"{name}: starting the engine (")]
        assert len(begun) == 1, said
        assert said[begun[0] + 1].startswith(f"{name}: engine started in "), said
    assert "slotted-bucketed: load of 4 streams started" in said
    done = [line for line in said if line.startswith("slotted-bucketed: load of 4 streams done")]
    assert len(done) == 1 and " s: decode " in done[0] and "TTFT p50 " in done[0], said
    assert any(line.startswith("paged-prefix, caching on: load of 4 requests done in ")
               for line in said), said
    data = json.loads((tmp_path / "serve.json").read_text())
    assert data["meta"]["date"] and data["meta"]["torch"] and data["quick"] is True
    assert data["complete"] is True
    assert (tmp_path / "serve.png").stat().st_size > 1000
    assert data["in_process"]["decode_tokens_per_s"] > 0
    settings = data["settings"]
    rows = {(r["config"], r["streams"]): r for r in data["rows"]}
    assert set(rows) == {("slotted-bucketed", 1), ("slotted-bucketed", 4),
                         ("slotted-async", 1), ("slotted-async", 4),
                         ("slotted-deterministic", 1), ("slotted-deterministic", 4),
                         ("paged-bucketed", 4)}
    for (config, n), r in rows.items():
        assert "error" not in r, r
        assert r["completion_tokens"] == n * settings["max_tokens"]  # no stream ended early
        for key in ("decode_tokens_per_s", "throughput_tokens_per_s", "ttft_p50_ms",
                    "itl_p50_ms"):
            assert r[key] > 0, key
        assert r["ttft_p99_ms"] >= r["ttft_p50_ms"] and r["itl_p99_ms"] >= r["itl_p50_ms"]
        assert r["itl_p99_over_p50"] == pytest.approx(r["itl_p99_ms"] / r["itl_p50_ms"])
        # the engine thread's time a step: busy = waiting for tokens + the host's own
        assert r["engine_busy_ms_per_step"] > r["host_ms_per_step"] > 0
        assert r["token_wait_ms_per_step"] >= 0
        assert r["engine_busy_ms_per_step"] == pytest.approx(
            r["host_ms_per_step"] + r["token_wait_ms_per_step"])
        steps = {int(b): k for b, k in r["steps_by_batch"].items()}
        assert sum(steps.values()) >= settings["max_tokens"] - 1
        engine = r["engine"]
        assert engine["max_batch"] == settings["max_batch"] == 4
        assert engine["prefill_chunk"] == settings["prefill_chunk"]
        assert engine["deterministic"] is (config == "slotted-deterministic")
        assert engine["async_scheduling"] is (config == "slotted-async")
        assert engine["cuda_graph"] is False and "not on CUDA" in engine["cuda_graph_note"]
        if config == "paged-bucketed":
            assert (engine["kv_cache"], engine["kv_page_size"]) == ("paged", 16)
            assert engine["kv_pages"] > 0 and r["preemptions"] == 0
        else:
            assert (engine["kv_cache"], engine["kv_page_size"]) == ("slotted", None)
        if config == "slotted-deterministic":
            assert set(steps) == {4}  # every step decodes all 4 slots
    # Alone, a bucketed stream decodes at batch 1: one step per token after the first
    # (with async scheduling too: the last token in flight takes no step).
    for config in ("slotted-bucketed", "slotted-async"):
        assert rows[config, 1]["steps_by_batch"] == {"1": settings["max_tokens"] - 1}
    prefix = data["prefix"]
    assert prefix["requests"] == settings["prefix_requests"] and "skipped" not in prefix
    without, with_ = prefix["rows"]
    assert (without["prefix_caching"], with_["prefix_caching"]) == (False, True)
    assert prefix["ttft_p50_with_vs_without"] == pytest.approx(
        with_["ttft_p50_ms"] / without["ttft_p50_ms"])
    figures = data["figures"]
    for key, value in figures.items():
        assert value is None or math.isfinite(value), key
    assert figures["invariance cost, worst load (<= 0.05: default)"] == max(
        figures["invariance cost at 1 stream"], figures["invariance cost at 4 streams"])
    # the same greedy prompt in every stream: the deterministic engine gives each stream,
    # at every load, the text of the one alone (on the CPU: all 4 slots at every step)
    assert figures["slotted-deterministic: every stream's text as alone, every load (1.0)"] == 1.0
    assert all(0 <= rows[key]["same_text_as_alone"] <= 1 for key in rows)
    # async scheduling keeps the bucketed mode's tokens at every load
    assert figures["slotted-async: loads whose text is slotted-bucketed's (1.0)"] == 1.0
    # Each figure is the ratio its name says. The bound in parentheses is the GPU run's
    # target: on a shared 2-core CPU the tiny model's steps are as short as the HTTP
    # path's own work and the load's timing is the machine's, so no bound is promised.
    tps = {key: r["decode_tokens_per_s"] for key, r in rows.items()}
    alone = data["in_process"]["decode_tokens_per_s"]
    assert figures["slotted-bucketed: 1 stream vs in-process generate() (>= 0.95)"] == \
        pytest.approx(tps["slotted-bucketed", 1] / alone)
    assert figures["slotted-async: 1 stream vs in-process generate() (>= 0.95)"] == \
        pytest.approx(tps["slotted-async", 1] / alone)
    assert figures["paged-bucketed vs slotted-bucketed at 4 streams, decode tokens/s"] == \
        pytest.approx(tps["paged-bucketed", 4] / tps["slotted-bucketed", 4])
    assert figures["slotted-async vs slotted-bucketed at 4 streams, decode tokens/s"] == \
        pytest.approx(tps["slotted-async", 4] / tps["slotted-bucketed", 4])
    itl = figures["paged-bucketed: ITL p99 / p50 at 4 streams (<= 2)"]
    assert itl == rows["paged-bucketed", 4]["itl_p99_over_p50"] and itl >= 1


@pytest.fixture(scope="module")
def tiny_build(tiny_loaded):
    """`serve.build(quick=True)` with the tiny test model in place of the bundled one:
    the same tokenizer, so the same workload and settings, for the tests of the bench's
    logic (parts, loads, failures), which need not the bundled model's text."""
    import qfuse.api
    from qfuse.bench import serve

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qfuse.api, "load", lambda *args, **kw: tiny_loaded)
        model, tokenizer, work, settings, _ = serve.build(quick=True)
    assert model is tiny_loaded[0]
    return model, tokenizer, work, settings, "the tiny test model"


@pytest.fixture(scope="module")
def quick(tiny_build):
    """(model, tokenizer, workload, settings) of the quick run, on the tiny test model."""
    return tiny_build[:4]


def test_prefix_load_runs_without_then_with_prefix_caching(quick, monkeypatch):
    import qfuse.serving.engine
    from qfuse.bench import serve
    from qfuse.bench.serve_client import Clients

    taken = []

    class Prefixed(qfuse.serving.engine.Engine):
        """The engine with the prefix cache's keyword, which it records and ignores."""

        def __init__(self, *args, prefix_caching: bool | None = None, **kw):
            taken.append(prefix_caching)
            super().__init__(*args, **kw)

    monkeypatch.setattr(qfuse.serving.engine, "Engine", Prefixed)
    model, tokenizer, work, settings = quick
    clients = Clients()
    try:
        prefix = serve.prefix_load(model, tokenizer, work, settings, clients,
                                   serve.Budget(60))
    finally:
        clients.close()
    assert taken == [False, True]  # without sharing, then with
    assert "skipped" not in prefix
    without, with_ = prefix["rows"]
    for r, sharing in ((without, False), (with_, True)):
        assert "error" not in r, r
        assert r["prefix_caching"] is sharing and r["engine"]["prefix_caching"] is sharing
        assert r["engine"]["kv_cache"] == "paged" and r["streams"] == settings.prefix_requests
        assert r["ttft_p50_ms"] > 0
        # The server counts no prefix-cache metric yet: not measured, never a made-up 0.
        assert r["vllm:prefix_cache_hits"] is None and r["vllm:prefix_cache_queries"] is None
    assert prefix["ttft_p50_with_vs_without"] == pytest.approx(
        with_["ttft_p50_ms"] / without["ttft_p50_ms"])
    # The main loads' engines get the keyword too, turned off (not left to a default).
    _, record = serve.make_engine(model, tokenizer, settings, max_batch=2, context=64)
    assert taken[-1] is False and record["prefix_caching"] is False


def test_a_server_that_never_steps_fails_its_loads_within_the_timeout(quick, monkeypatch):
    import qfuse.serving.engine
    from qfuse.bench import serve
    from qfuse.bench.serve_client import Clients

    # The engine's thread never starts: every request waits in its queue for ever.
    monkeypatch.setattr(qfuse.serving.engine.Engine, "start", lambda self: None)
    model, tokenizer, work, settings = quick
    settings = dataclasses.replace(settings, load_timeout_s=2.0)
    clients = Clients()
    start = time.monotonic()
    try:
        rows = serve.serve_loads(model, tokenizer, work, settings, serve.SLOTTED, (1, 4),
                                 clients, serve.Budget(3600))
    finally:
        clients.close()
    # Only a hang guard: a load that did not keep its 2-s timeout would wait out the
    # hour's budget; the errors below say which timeout ended the loads.
    assert time.monotonic() - start < 600
    assert [r["streams"] for r in rows] == [1, 4]
    assert all("not run: the warm-up failed: the load of 4 streams did not finish within 2 s"
               == r["error"] for r in rows), rows
    assert all(r["engine"]["kv_cache"] == "slotted" for r in rows)


def test_an_engine_that_cannot_start_fails_its_loads_alone(quick, monkeypatch):
    import qfuse.serving.engine
    from qfuse.bench import serve

    def broken(self, *args, **kw):
        raise RuntimeError("no graph for you")

    monkeypatch.setattr(qfuse.serving.engine.Engine, "__init__", broken)
    model, tokenizer, work, settings = quick
    rows = serve.serve_loads(model, tokenizer, work, settings, serve.INVARIANT, (1, 4), None,
                             serve.Budget(60))
    assert [(r["streams"], r["error"]) for r in rows] == [
        (n, "not run: the engine or its server did not start: RuntimeError: no graph for you")
        for n in (1, 4)]
    row = serve.prefix_run(model, tokenizer, work, settings, True, None, serve.Budget(60))
    assert row["error"].endswith("RuntimeError: no graph for you")


def test_a_spent_budget_runs_no_load(quick):
    from qfuse.bench import serve

    model, tokenizer, work, settings = quick
    budget = serve.Budget(0)
    rows = serve.serve_loads(model, tokenizer, work, settings, serve.PAGED, (4,), None, budget)
    # Not even the engine is made: its start would be past the budget too.
    assert rows[0]["error"].startswith("not run: the engine or its server did not start: "
                                       "StartTimeout: not started: the run's budget"), rows


class _Clock:
    """Stands in for the `time` module in `qfuse.bench.serve`: its monotonic clock moves
    only when a test advances it; everything else is the real module's."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


class _SlowEngine:
    """Stands in for the serving engine: a start of 4 graph captures, ``seconds`` each on
    ``clock``, told to ``on_graph`` as the engine tells it (None: no hook)."""

    def __init__(self, seconds: float, clock: _Clock):
        self.seconds, self.clock, self.captured, self.stopped = seconds, clock, [], False

    def make(self, model, tokenizer, *, on_graph=None, **kw):
        for bucket in (1, 2, 4, 8):
            self.clock.now += self.seconds
            self.captured.append(bucket)
            if on_graph is not None:
                on_graph(bucket, self.seconds)
        engine = self

        class Made:
            paged, prefill_chunk, max_prefill_tokens = False, 0, 1
            deterministic, max_batch, context = False, 8, 64

            def stop(self):
                engine.stopped = True

        return Made()


def test_an_engine_start_past_its_limit_fails_its_configuration(quick, monkeypatch, capsys):
    import qfuse.serving.engine
    from qfuse.bench import serve

    model, tokenizer, work, settings = quick
    settings = dataclasses.replace(settings, start_timeout_s=0.5)
    clock = _Clock()
    monkeypatch.setattr(serve, "time", clock)
    slow = _SlowEngine(0.3, clock)
    monkeypatch.setattr(qfuse.serving.engine, "Engine", slow.make)
    rows = serve.serve_loads(model, tokenizer, work, settings, serve.SLOTTED, (1, 4), None,
                             serve.Budget(60))
    # Stopped after the capture that ran past 0.5 s, not after all four.
    assert slow.captured == [1, 2]
    assert [r["streams"] for r in rows] == [1, 4]
    assert all(r["error"] == "not run: the engine or its server did not start: StartTimeout: "
               "the engine's start ran past 0.5 s (graphs captured for buckets [1, 2], then "
               "stopped)" for r in rows), rows
    assert all(r["start_s"] == 0.6 for r in rows), rows
    err = capsys.readouterr().err
    assert "slotted-bucketed: CUDA graph for 2 rows captured in 0.3 s" in err, err
    assert "Traceback" not in err  # a timeout is said in one line, not a traceback
    # A start that nothing interrupts (no hook): its overrun is found when it returns.
    slow = _SlowEngine(0.2, clock)
    monkeypatch.setattr(qfuse.serving.engine, "Engine",
                        lambda model, tokenizer, on_graph=None, **kw:
                        slow.make(model, tokenizer, **kw))
    row = serve.prefix_run(model, tokenizer, work, settings, True, None, serve.Budget(60))
    assert slow.captured == [1, 2, 4, 8] and slow.stopped
    assert re.search(r"StartTimeout: the engine's start took (\d+\.\d) s, past its limit "
                     r"of 0\.5 s$", row["error"]), row
    assert float(re.search(r"took (\S+) s", row["error"])[1]) == 0.8


def test_summarize_counts_the_window_where_every_stream_decodes():
    from qfuse.bench.serve import summarize

    # Two streams sent at 0: one's tokens at 1, 2, 3, 4; the other's at 2.5, 3, 3.5.
    streams = [{"sent": 0.0, "arrivals": [1.0, 2.0, 3.0, 4.0], "completion_tokens": 4},
               {"sent": 0.0, "arrivals": [2.5, 3.0, 3.5], "completion_tokens": 3}]
    s = summarize(streams)
    # Window (2.5, 3.5]: 3.0 from the first, 3.0 and 3.5 from the second.
    assert s["decode_tokens_per_s"] == pytest.approx(3 / 1.0)
    assert s["ttft_p50_ms"] == pytest.approx(1750) and s["ttft_p99_ms"] == pytest.approx(2485)
    # Gaps: 1000 ms three times, 500 ms twice.
    assert s["itl_p50_ms"] == pytest.approx(1000) and s["itl_p99_ms"] == pytest.approx(1000)
    assert s["itl_p99_over_p50"] == pytest.approx(1.0)
    assert s["throughput_tokens_per_s"] == pytest.approx(7 / 4)


def test_metric_totals_sum_labels_and_leave_out_what_is_not_exposed(monkeypatch):
    import io
    import urllib.request

    from qfuse.bench import serve

    text = ("# HELP vllm:prefix_cache_hits_total hits\n"
            'vllm:prefix_cache_hits_total{model_name="default"} 30.0\n'
            'vllm:prefix_cache_hits_total{model_name="other"} 2.0\n'
            'vllm:prefix_cache_hits_created{model_name="default"} 1.7e9\n'
            'vllm:num_requests_running{model_name="default"} 1.0\n')

    class Answer(io.BytesIO):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(urllib.request, "urlopen",
                        lambda url, timeout: Answer(text.encode()))
    assert serve.metric_totals(1, serve.PREFIX_METRICS) == {"vllm:prefix_cache_hits": 32.0}


def test_engine_time_is_split_per_decode_step():
    from qfuse.bench.serve import engine_time

    split = engine_time((1.0, 0.25), (3.0, 1.25), steps=100)
    assert split == pytest.approx({"engine_busy_ms_per_step": 20.0,
                                   "token_wait_ms_per_step": 10.0, "host_ms_per_step": 10.0})
    assert engine_time((0.0, 0.0), (1.0, 0.5), steps=0) == {}


def test_number_tokenizer_round_trips_prefix_stably():
    from qfuse.bench.serve import NumberTokenizer

    tok = NumberTokenizer(262144)
    assert tok.encode(" 5 262143 0").ids == [5, 262143, 0]
    assert tok.decode([5, 262143]) + tok.decode([0]) == tok.decode([5, 262143, 0])


def test_parts_run_alone_and_an_unknown_part_is_named(tmp_path, tiny_build, monkeypatch):
    from qfuse.bench import serve
    from qfuse.errors import UserError

    monkeypatch.setattr(serve, "build", lambda quick: tiny_build)

    with pytest.raises(UserError, match="unknown serve bench part.*bogus.*the parts are"):
        serve.main(out_dir=str(tmp_path), quick=True, parts=("slotted", "bogus"))
    assert serve.main(out_dir=str(tmp_path), quick=True, parts=("deterministic",)) == 0
    data = json.loads((tmp_path / "serve.json").read_text())
    assert data["settings"]["parts"] == ["deterministic"]
    assert {r["config"] for r in data["rows"]} == {"slotted-deterministic"}
    assert all("error" not in r for r in data["rows"])
    assert data["prefix"]["skipped"] == "not among this run's --parts"


def test_prefill_graphs_part_times_ttft_eager_and_fixed_side_by_side(quick):
    """Part prefill_graphs: engines of one slot, the prefill eager then at fixed padded
    lengths (on the CPU run eagerly, not from graphs), each prompt length's requests one
    after another; its figures are the ratios their names say. Asked for by name only."""
    from qfuse.bench import serve
    from qfuse.bench.serve_client import Clients

    model, tokenizer, work, settings = quick
    assert "prefill_graphs" in serve.PARTS and "prefill_graphs" not in serve.DEFAULT_PARTS
    clients = Clients()
    try:
        rows = serve.prefill_ttft(model, tokenizer, work, settings, clients, serve.Budget(120))
    finally:
        clients.close()
    lengths = sorted({min(k, len(tokenizer.encode(work.prompt).ids))
                      for k in settings.prefill_prompt_tokens})
    assert [(r["config"], r["prompt_tokens"]) for r in rows] == [
        (config, n) for config in (serve.PREFILL_EAGER, serve.PREFILL_GRAPHS)
        for n in sorted(lengths, reverse=True)]
    for r in rows:
        assert "error" not in r, r
        assert r["requests"] == len(r["ttft_ms"]) == settings.prefill_requests
        assert r["ttft_min_ms"] == pytest.approx(min(r["ttft_ms"]), abs=0.01)
        assert r["ttft_p50_ms"] >= r["ttft_min_ms"] > 0
        assert r["same_text_every_request"] is True
        fixed = r["config"] == serve.PREFILL_GRAPHS
        # every request went through a fixed-length prefill, or none did
        assert r["fixed_prefills"] == (r["requests"] if fixed else 0)
        assert r["engine"]["prefill_buckets"] == (list(settings.prefill_buckets) if fixed
                                                  else [])
        assert r["engine"]["max_batch"] == 1
    figures = serve.prefill_figures(rows)
    for n in lengths:
        eager, graphs = (next(r for r in rows if r["config"] == c and r["prompt_tokens"] == n)
                         for c in (serve.PREFILL_EAGER, serve.PREFILL_GRAPHS))
        key = (f"{serve.PREFILL_GRAPHS} vs {serve.PREFILL_EAGER}: TTFT p50 at 1 stream, "
               f"{n}-token prompt")
        assert figures[key] == pytest.approx(graphs["ttft_p50_ms"] / eager["ttft_p50_ms"])
        assert figures[f"{serve.PREFILL_GRAPHS}: text as {serve.PREFILL_EAGER}'s, {n}-token "
                       "prompt (1.0)"] in (0.0, 1.0)
