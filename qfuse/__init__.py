"""qfuse: fused Triton kernels and a lean runtime for quantized LLM decoding.

Generate text from Python (the bundled default model when no path is given):

    import qfuse

    model, tokenizer = qfuse.load()                      # or qfuse.load("path/to/model")
    text = qfuse.generate(model, tokenizer, "def fibonacci(n):", max_tokens=64)
    for r in qfuse.stream_generate(model, tokenizer, "import os\\n", max_tokens=32,
                                   temperature=0.8, seed=1):
        print(r.text, end="", flush=True)
    print(f"\\nGenerated {r.generation_tokens} tokens at {r.generation_tps:.1f} tokens/s "
          f"(finish: {r.finish_reason}).")

- load(path=None, *, device=None, dtype=None, progress=True, check_weights=True)
  -> (model, tokenizer); check_weights refuses NaN/inf weights (one min/max pass per
  tensor, ~0.25 s per GB on one CPU core; False skips it).
- generate(model, tokenizer, prompt, max_tokens=256, *, verbose=False, ...) -> str;
  a list of prompts is decoded as one batch and gives a list of str.
- stream_generate(model, tokenizer, prompt, max_tokens=256, ...) yields a
  GenerationResponse per token: text, token, prompt_tokens, prompt_tps,
  generation_tokens, generation_tps, peak_memory (GB), finish_reason, and
  logprobs (the log-probabilities the token was drawn from; r.logprob is the
  token's own).
- Options of both: temperature, top_k, top_p, min_p, repetition_penalty, seed,
  stop (a string or a list of them), kv_bits (0, 4, 8), kv_group_size, max_kv_size, cuda_graph,
  add_special_tokens.
- use_tier(name): a context manager; the ops inside the block run in tier
  compat, exact or fast (over QFUSE_TIER; per thread, blocks nest).
- Mistakes in a request (a value or type an argument does not take, a broken
  checkpoint, a bad QFUSE_* variable) raise qfuse.UserError with a one-line message.

Layers, lowest first: quant (MLX affine format) → reference (compat tier) →
kernels (Triton) → ops (dispatch by tier) → runtime (loading, generation, gates).
`import qfuse` loads none of them; the functions above import what they need.
"""

from .errors import UserError

__version__ = "0.1.0"
__all__ = ["GenerationResponse", "UserError", "generate", "load", "stream_generate", "use_tier"]
_API = {"GenerationResponse", "generate", "load", "stream_generate", "use_tier"}


def __getattr__(name: str):
    # The API's module comes in on first use, so `import qfuse` (the `qfuse` script's
    # first step, where Ctrl-C is not handled yet) stays a few standard-library imports.
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'qfuse' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _API)
