"""`qfuse bench serve --quick` on the CPU with the bundled model: a live server on
loopback, both engine modes, streams of 1 and 4 clients; the JSON has every figure,
each sane, and the plot is written."""

import importlib.util
import json
import math

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("matplotlib")


def test_quick_bench_writes_sane_figures(tmp_path):
    from qfuse.bench import serve

    if importlib.util.find_spec("httpx") is None and importlib.util.find_spec("httpx2") is None:
        pytest.skip("needs httpx (or httpx2)")
    assert serve.main(out_dir=str(tmp_path), quick=True) == 0
    data = json.loads((tmp_path / "serve.json").read_text())
    assert data["meta"]["date"] and data["meta"]["torch"] and data["quick"] is True
    assert (tmp_path / "serve.png").stat().st_size > 1000
    assert data["in_process"]["decode_tokens_per_s"] > 0
    settings = data["settings"]
    rows = {(r["mode"], r["streams"]): r for r in data["rows"]}
    assert set(rows) == {(m, n) for m in ("deterministic", "bucketed") for n in (1, 4)}
    for (mode, n), r in rows.items():
        assert r["completion_tokens"] == n * settings["max_tokens"]  # no stream ended early
        for key in ("decode_tokens_per_s", "throughput_tokens_per_s", "ttft_p50_ms",
                    "itl_p50_ms"):
            assert r[key] > 0, key
        assert r["ttft_p99_ms"] >= r["ttft_p50_ms"] and r["itl_p99_ms"] >= r["itl_p50_ms"]
        steps = {int(b): k for b, k in r["steps_by_batch"].items()}
        assert sum(steps.values()) >= settings["max_tokens"] - 1
        if mode == "deterministic":
            assert set(steps) == {4}  # every step decodes all 4 slots
    # Alone, a bucketed stream decodes at batch 1: one step per token after the first.
    assert rows["bucketed", 1]["steps_by_batch"] == {"1": settings["max_tokens"] - 1}
    figures = data["figures"]
    assert len(figures) == 7 and all(math.isfinite(v) for v in figures.values())
    assert figures["invariance_cost_worst (<= 0.10: default)"] == max(
        figures["invariance_cost_at_1_streams"], figures["invariance_cost_at_4_streams"])
    assert figures["deterministic_1_stream_vs_in_process (>= 0.95)"] > 0


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
    assert s["throughput_tokens_per_s"] == pytest.approx(7 / 4)


def test_number_tokenizer_round_trips_prefix_stably():
    from qfuse.bench.serve import NumberTokenizer

    tok = NumberTokenizer(262144)
    assert tok.encode(" 5 262143 0").ids == [5, 262143, 0]
    assert tok.decode([5, 262143]) + tok.decode([0]) == tok.decode([5, 262143, 0])
