"""`qfuse bench serve`: a live `qfuse serve` under N concurrent streaming HTTP clients.

The server runs in this process (uvicorn on 127.0.0.1, a free port, in a thread,
with the serving engine's own thread beside it); the clients are asyncio tasks of
the main thread, each streaming one `/v1/completions` request (greedy, a fixed
prompt and max_tokens, no EOS so every stream runs to its length) through httpx.
For N in 1, 8 and 32 streams it reports:

- decode tokens/s: every stream's tokens arriving while all N are decoding (from
  the last stream's first token to the first stream's last), over that window:
  the steady aggregate rate at concurrency N;
- time to first token (request sent → first text chunk) p50/p99, and inter-token
  latency (gap between a stream's consecutive text chunks) p50/p99.

Both engine modes run the same loads: batch-invariant (every step decodes all
max_batch slots) and bucketed (only the busy rows, rounded up to a power of two);
the figures give the invariance's cost at 32 streams. Beside them, the in-process
`generate()` of the same model and prompt at one stream, timed the same way
(first token to last), against which one served stream should be ≤ 5% slower.

On a GPU the model is the Gemma 3 12B shape at 4-bit weights and 4-bit KV with
random weights, built by `bench e2e`'s `random_model` (no checkpoint; its EOS is
removed so that generations run their full length), with a tokenizer that spells
token ids as numbers; decode steps replay CUDA graphs (one per bucket). `--quick`
runs the bundled model with its own tokenizer and a few short streams, on the CPU
too (the only `qfuse bench` that runs without a GPU). Writes serve.json and
serve.png.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch

from . import common


@dataclass(frozen=True)
class Settings:
    streams: tuple[int, ...] = (1, 8, 32)
    prompt_tokens: int = 128  # the random model's prompt; the bundled model's is text
    max_tokens: int = 256
    kv_bits: int = 4
    kv_group_size: int = 64
    cuda_graph: bool = True
    timeout_s: float = 300.0  # for one whole load: a stuck server fails the bench, not hangs it


QUICK = Settings(streams=(1, 4), max_tokens=16, kv_group_size=32)  # graphs only on CUDA
PROMPT = "def fibonacci(n):\n    "  # the bundled model writes code


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


def _percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile by linear interpolation between order statistics."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _httpx():
    try:
        import httpx
    except ImportError:  # the openai client's newer releases bring httpx2, the same API
        import httpx2 as httpx
    return httpx


async def _stream(client, url: str, body: dict) -> dict:
    """One streaming completion: send time, each text chunk's arrival, usage."""
    sent = time.perf_counter()
    arrivals, usage = [], None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {r.status_code}: {await r.aread()!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
    return {"sent": sent, "arrivals": arrivals,
            "completion_tokens": usage["completion_tokens"] if usage else len(arrivals)}


async def drive(port: int, model_name: str, prompt: str, max_tokens: int, n: int,
                timeout_s: float) -> list[dict]:
    """N concurrent greedy streaming completions of ``prompt``; each stream's timings."""
    httpx = _httpx()
    body = {"model": model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    url = f"http://127.0.0.1:{port}/v1/completions"
    limits = httpx.Limits(max_connections=n + 2, max_keepalive_connections=n + 2)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        return await asyncio.wait_for(
            asyncio.gather(*(_stream(client, url, body) for _ in range(n))), timeout_s)


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
    else:  # streams that never overlapped (too short to): the whole span instead
        decode_tps = sum(len(s["arrivals"]) - 1 for s in streams) / (max(lasts) - min(firsts))
    total = sum(s["completion_tokens"] for s in streams)
    return {"streams": len(streams), "completion_tokens": total,
            "decode_tokens_per_s": decode_tps,
            "throughput_tokens_per_s": total / (max(lasts) - min(s["sent"] for s in streams)),
            "ttft_p50_ms": _percentile(ttft, 50), "ttft_p99_ms": _percentile(ttft, 99),
            "itl_p50_ms": _percentile(itl, 50), "itl_p99_ms": _percentile(itl, 99)}


def in_process(model, tokenizer, prompt: str, settings: Settings) -> dict:
    """One stream through `generate()`, timed as the server's streams are: decode
    tokens/s from the first token to the last (the best of two runs after a warm-up)."""
    from ..generation import SamplingParams, Step, generate

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


def _on_cuda(model) -> bool:
    return model.model.norm.weight.device.type == "cuda"


def serve_loads(model, tokenizer, prompt: str, settings: Settings,
                deterministic: bool) -> list[dict]:
    """A live server over a fresh engine in one mode; each load's figures."""
    from ..serving.app import make_app
    from ..serving.engine import Engine
    from ..serving.protocol import ModelInfo
    from ..serving.server import Background, bind

    n_prompt = len(tokenizer.encode(prompt).ids)
    engine = Engine(model, tokenizer, max_batch=max(settings.streams),
                    max_queue=max(settings.streams), context=n_prompt + settings.max_tokens + 8,
                    kv_bits=settings.kv_bits, kv_group_size=settings.kv_group_size,
                    cuda_graph=settings.cuda_graph and _on_cuda(model),
                    deterministic=deterministic)
    info = ModelInfo("bench", tokenizer, engine.context, vocab_size=model.config.vocab_size)
    server = Background(make_app(engine, info), bind("127.0.0.1", 0))
    engine.start()
    server.start()
    rows = []
    try:
        # Warm-up at the widest load: the prefill kernels for this prompt compiled, every
        # bucket's step run once.
        asyncio.run(drive(server.port, "bench", prompt, 4, max(settings.streams),
                          settings.timeout_s))
        for n in settings.streams:
            before = dict(engine.steps_by_batch)
            streams = asyncio.run(drive(server.port, "bench", prompt, settings.max_tokens, n,
                                        settings.timeout_s))
            row = {"mode": "deterministic" if deterministic else "bucketed", **summarize(streams),
                   "steps_by_batch": {str(b): engine.steps_by_batch[b] - before[b]
                                      for b in before if engine.steps_by_batch[b] > before[b]}}
            rows.append(row)
            print(row, flush=True)
    finally:
        server.stop()  # its lifespan stops the engine
        engine.stop()
    return rows


def run(model, tokenizer, prompt: str, settings: Settings) -> dict:
    """Both modes' loads, the in-process figure, and the figures against their targets
    (`figures`)."""
    base = in_process(model, tokenizer, prompt, settings)
    print("in-process generate(), 1 stream:", base, flush=True)
    rows = []
    for deterministic in (True, False):
        rows += serve_loads(model, tokenizer, prompt, settings, deterministic)
        if _on_cuda(model):
            torch.cuda.empty_cache()
    return {"settings": asdict(settings), "prompt_tokens": len(tokenizer.encode(prompt).ids),
            "in_process": base, "rows": rows, "figures": figures(rows, base, settings)}


def figures(rows: list[dict], base: dict, settings: Settings) -> dict:
    def tps(mode, n):
        return next((r["decode_tokens_per_s"] for r in rows
                     if r["mode"] == mode and r["streams"] == n), None)

    top, one = max(settings.streams), min(settings.streams)
    out = {}
    for mode in ("deterministic", "bucketed"):
        out[f"{mode}_{one}_stream_vs_in_process (>= 0.95)"] = \
            tps(mode, one) / base["decode_tokens_per_s"]
        # target: 32 streams decode at least 8× the tokens/s of one
        target = " (>= 8)" if (one, top) == (1, 32) else ""
        out[f"{mode}_{top}_streams_vs_{one}{target}"] = tps(mode, top) / tps(mode, one)
    # The rule: batch invariance is the default if it costs at most 10% of
    # throughput; the cost at every load is reported, and the worst decides.
    costs = {n: 1 - tps("deterministic", n) / tps("bucketed", n) for n in settings.streams}
    for n, cost in costs.items():
        out[f"invariance_cost_at_{n}_streams"] = cost
    out["invariance_cost_worst (<= 0.10: default)"] = max(costs.values())
    return out


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
    """(model, tokenizer, prompt, settings, description) for the run."""
    if quick:
        from ..api import load

        model, tokenizer = load(progress=False)
        return model, tokenizer, PROMPT, QUICK, "the bundled model"
    from .e2e import GEMMA3_12B, random_model

    # No EOS: a random model's greedy text would otherwise end wherever it hits one.
    model = random_model({**GEMMA3_12B, "eos_token_id": []}, 4, "cuda")
    tokenizer = NumberTokenizer(GEMMA3_12B["vocab_size"])
    settings = Settings()
    # A fixed prompt of distinct ids spread over the vocabulary.
    prompt = " ".join(str(3 + 7919 * i % (GEMMA3_12B["vocab_size"] - 3))
                      for i in range(settings.prompt_tokens))
    return model, tokenizer, prompt, settings, \
        "Gemma 3 12B shape, 4-bit weights (g64) + 4-bit KV, random weights"


def main(out_dir: str = "bench/results", quick: bool = False) -> int:
    from ..errors import UserError

    if not quick and not torch.cuda.is_available():
        raise UserError("qfuse bench serve needs a CUDA GPU (--quick runs on the CPU)")
    try:
        _httpx()
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(f"qfuse bench serve needs starlette, uvicorn and httpx ({e.name} is "
                        "missing)") from e
    model, tokenizer, prompt, settings, what = build(quick)
    payload = {"meta": metadata(model), "quick": quick, "model": what,
               **run(model, tokenizer, prompt, settings)}
    common.write_results(out_dir, "serve", payload)
    plot(payload, os.path.join(out_dir, "serve.png"))
    common.print_table(payload["rows"], ["mode", "streams", "decode_tokens_per_s",
                                         "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                                         "itl_p99_ms"])
    print("in-process, 1 stream:", round(payload["in_process"]["decode_tokens_per_s"], 1),
          "tokens/s")
    for k, v in payload["figures"].items():
        print(f"{k}: {round(v, 3)}")
    return 0


def plot(payload: dict, path: str) -> None:
    """Decode tokens/s, time to first token and inter-token latency against streams."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("decode_tokens_per_s", None, "aggregate decode tokens/s"),
              ("ttft_p50_ms", "ttft_p99_ms", "time to first token (ms)"),
              ("itl_p50_ms", "itl_p99_ms", "inter-token latency (ms)")]
    for ax, (p50, p99, label) in zip(axes, panels):
        for i, mode in enumerate(("deterministic", "bucketed")):
            pts = sorted((r["streams"], r[p50], r[p99] if p99 else None) for r in rows
                         if r["mode"] == mode)
            if not pts:
                continue
            n, a, b = zip(*pts)
            ax.plot(n, a, marker="o", color=f"C{i}", label=f"{mode}" + (" p50" if p99 else ""))
            if p99:
                ax.plot(n, b, marker="s", ls="--", color=f"C{i}", label=f"{mode} p99")
        if p99 is None:
            ax.axhline(payload["in_process"]["decode_tokens_per_s"], color="k", ls=":", lw=1,
                       label="in-process, 1 stream")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(f"qfuse serve: {payload['model']} ({payload['meta'].get('gpu') or 'CPU'})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
