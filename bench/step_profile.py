"""Where a serving step's time goes: the Gemma 3 12B shape (4-bit weights, 4-bit KV,
random weights), one prefill of B prompts of T tokens and one eager decode step of R rows,
each timed (CUDA events, after a warm-up) and profiled (`bench.common.gpu_profile`: the
kernels by their own GPU time; the stop-38 results in bench/results were written by the
first version, 43f5385, which listed kernels by inclusive time under other keys). A diagnostic for issue 30's TTFT and batch scaling, not a `qfuse bench`:
run on the GPU as `python bench/step_profile.py OUT_DIR`; writes OUT_DIR/step_profile.json
and prints the tables. `python bench/step_profile.py OUT_DIR host` profiles the host side
of one-prompt prefills instead (cProfile: the functions by their own time).
"""

import json
import sys

import torch

from qfuse.bench import common
from qfuse.bench.e2e import GEMMA3_12B, random_model
from qfuse.models.config import ModelConfig
from qfuse.runtime.cache import KVCache

PREFILLS = [(1, 512), (8, 512)]  # (prompts, tokens each)
DECODES = [(32, 512), (256, 512)]  # (rows, tokens already cached)


def timed(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def host_profile(model, cfg):
    """cProfile of three one-prompt prefills after a warm-up: where the host's time goes."""
    import cProfile
    import pstats

    cache = KVCache(cfg, 1, 520, torch.bfloat16, "cuda", bits=4)
    ids = torch.randint(0, 1000, (1, 512), device="cuda")
    with torch.no_grad():
        model(ids, cache=cache, logits="last")
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            model(ids, cache=cache, logits="last")
        torch.cuda.synchronize()
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def main(out_dir, what="device"):
    model = random_model({**GEMMA3_12B, "eos_token_id": []}, 4, "cuda")
    cfg = ModelConfig.from_dict(GEMMA3_12B)
    if what == "host":
        return host_profile(model, cfg)
    result = {}
    with torch.no_grad():
        for B, T in PREFILLS:
            cache = KVCache(cfg, B, T + 8, torch.bfloat16, "cuda", bits=4)
            ids = torch.randint(0, 1000, (B, T), device="cuda")

            def prefill(ids=ids, cache=cache):
                model(ids, cache=cache, logits="last")

            result[f"prefill B={B} T={T}"] = {"ms": timed(prefill),
                                               **common.gpu_profile(prefill, top=18)}
        for R, N in DECODES:
            cache = KVCache(cfg, R, N + 16, torch.bfloat16, "cuda", bits=4)
            ids = torch.randint(0, 1000, (R, N), device="cuda")
            model(ids, cache=cache, logits="none")
            tokens = torch.randint(0, 1000, (R,), device="cuda")

            def step(tokens=tokens, cache=cache):
                model.decode(tokens, cache)
                cache.lengths -= 1
                cache.host_lengths = [n - 1 for n in cache.host_lengths]

            result[f"decode R={R} N={N}"] = {"ms": timed(step),
                                              **common.gpu_profile(step, top=18)}
    for name, r in result.items():
        print(f"== {name}: {r['ms']:.2f} ms wall, {r['gpu_ms_per_step']:.2f} ms in kernels")
        for k in r["top_kernels"]:
            print(f"  {k['ms_per_step']:9.3f} ms {k['calls_per_step']:6.0f}x  {k['name']}")
    with open(f"{out_dir}/step_profile.json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
