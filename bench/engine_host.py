"""The serving engine's host time per decode step, with the model's part taken out: the
bundled model prefills N one-line prompts, then every decode step's model call is a stub
that returns fixed logits (EOS never wins), so the time between steps is what the engine
does on the host at N streams: the step's token tensor, sampling (one argmax, here on the
CPU), detokenizing, stop strings, events to N trivial callbacks. With ``http``, the
events go to a live server on loopback instead (`serve_in_process`) and N streaming
clients in a child process (`serve_client.Clients`, as `qfuse bench serve` drives it), so
the server's event loop (server-sent events, metrics) takes its share of the interpreter
as it does when serving; it also prints what the clients saw, a stream's first to last
token over its gaps (median stream) and the whole load's first to last token over the
tokens a stream gets, since the engine may run ahead of a server that lags. torch runs
on one CPU thread: the GPU does the argmax, and an intra-op pool that spins between steps
took a core from the host's thread on a 2-core machine (a step of 12-23 ms against 4.8).
Runs on any machine; a diagnostic for issue 30 (NOTES "Serving"), not a `qfuse bench`:

    python bench/engine_host.py [STREAMS [TOKENS [http]]]   # default 256 streams, 256 tokens
"""

import itertools
import sys
import threading
import time

import torch

from qfuse.api import load
from qfuse.runtime.prompts import encode_prompts
from qfuse.serving.engine import Engine, Request


def main(streams: int = 256, tokens: int = 256, http: bool = False) -> None:
    torch.set_num_threads(1)
    model, tokenizer = load(progress=False)
    engine = Engine(model, tokenizer, max_batch=streams, max_queue=streams,
                    context=tokens + 16)
    logits = torch.randn(streams, model.config.vocab_size,
                         generator=torch.Generator().manual_seed(0))
    logits[:, list(model.config.eos_token_ids)] = -1e9
    stamps = []

    def stub(rows):
        def step(fed):
            stamps.append(time.perf_counter())
            engine.cache.lengths[:rows] += 1  # what a step does to the cache's lengths
            return logits[:rows]
        return step

    for rows in list(engine.steps.decoders):
        engine.steps.decoders[rows] = stub(rows)
    finished, lock = [0], threading.Lock()

    def emit(event):
        if event.finish_reason:
            with lock:
                finished[0] += 1
                if finished[0] == streams:
                    engine._stopping = True  # the loop returns after this step

    if http:
        from qfuse.bench.serve_client import Clients
        from qfuse.serving.in_process import serve_in_process

        server = serve_in_process(engine, tokenizer, model.config.vocab_size)
        clients = Clients()
        try:
            body = {"model": "default", "prompt": "def f(x):\n", "max_tokens": tokens,
                    "temperature": 0, "stream": True}
            served = clients.run(server.port, [body] * streams, timeout_s=600)
        finally:
            clients.close()
            server.stop()
        # What the clients saw: a stream's first to last text chunk over its gaps (the
        # engine can run ahead of a server that lags, so its own gaps alone say less).
        spans = sorted((s["arrivals"][-1] - s["arrivals"][0]) / (len(s["arrivals"]) - 1)
                       for s in served if len(s["arrivals"]) > 1)
        whole = (max(s["arrivals"][-1] for s in served)
                 - min(s["arrivals"][0] for s in served)) / (tokens - 1)
    else:
        ids = encode_prompts(tokenizer, ["def f(x):\n"])[0]
        for _ in range(streams):
            engine.submit(Request(list(ids), tokens, emit=emit))
        engine._loop()  # on this thread: no server, no other thread
    gaps = sorted(b - a for a, b in itertools.pairwise(stamps))
    print(f"{streams} streams x {tokens} tokens{' over HTTP' if http else ''}: {len(stamps)} "
          f"steps, host ms per step "
          f"median {1e3 * gaps[len(gaps) // 2]:.2f}, mean {1e3 * sum(gaps) / len(gaps):.2f}"
          + (f"; clients: ms per token, median stream {1e3 * spans[len(spans) // 2]:.2f}, "
             f"whole load {1e3 * whole:.2f}" if http else ""))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*(int(a) for a in args[:2]), http="http" in args[2:])
