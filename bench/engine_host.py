"""The serving engine's host time per decode step, with the model's part taken out: the
bundled model prefills N one-line prompts, then every decode step's model call is a stub
that returns fixed logits (EOS never wins), so the time between steps is what the engine
does on the host at N streams: the step's token tensor, sampling (one argmax, here on the
CPU), detokenizing, stop strings, events to N trivial callbacks. Runs on any machine;
a diagnostic for issue 30 (NOTES "Serving"), not a `qfuse bench`:

    python bench/engine_host.py [STREAMS [TOKENS]]     # default 256 streams, 256 tokens
"""

import itertools
import sys
import threading
import time

import torch

from qfuse.api import load
from qfuse.generation import encode_prompts
from qfuse.serving.engine import Engine, Request


def main(streams: int = 256, tokens: int = 256) -> None:
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

    for rows in list(engine._decoders):
        engine._decoders[rows] = stub(rows)
    finished, lock = [0], threading.Lock()

    def emit(event):
        if event.finish_reason:
            with lock:
                finished[0] += 1
                if finished[0] == streams:
                    engine._stopping = True  # the loop returns after this step

    ids = encode_prompts(tokenizer, ["def f(x):\n"])[0]
    for _ in range(streams):
        engine.submit(Request(list(ids), tokens, emit=emit))
    engine._loop()  # on this thread: no server, no other thread
    gaps = sorted(b - a for a, b in itertools.pairwise(stamps))
    print(f"{streams} streams x {tokens} tokens: {len(stamps)} steps, host ms per step "
          f"median {1e3 * gaps[len(gaps) // 2]:.2f}, mean {1e3 * sum(gaps) / len(gaps):.2f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
