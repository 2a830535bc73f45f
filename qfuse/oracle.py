"""The oracle the gates judge tiers against: the quantized model itself, in float32.

`oracle_model(model)` is a dense float32 Decoder whose every weight is the value the
model's quantized weight stands for, s·q + b computed in float32 from the same codes,
scales and biases (bf16 and fp16 scales widen to float32 exactly), and whose other
parameters are the model's, widened. It runs the compat tier's spelled-out ops, so
nothing in it rounds to bf16: activations, norms, attention, the KV cache and the
constants a model rounds to its dtype (RoPE tables, Gemma's embedding multiplier) are
float32. A quantized KV cache follows the model's rule (MLX affine groups of the same
bits and group size, `quant.quantize`), applied to float32 keys and values with float32
scales and biases. Its logits are bit for bit those of the compat tier on the quantized
model widened to float32 (`model.to(torch.float32)`): holding the weights dequantized
once only saves dequantizing every weight at every token.

Why float32 and not float64: the KV rule is defined over float32 statistics (MLX's, and
`quant.quantize` takes float32 at most), so a float32 oracle applies the very rule the
model's cache does; its own rounding (float32 sums) is ~2^-16 of a bf16 tier's.

It is a reference for judging, not a tier a user runs: it holds the model dense at 4
bytes a weight. `decode_along` runs a model (oracle or tier) over a prompt: greedy (the
oracle's trajectory) or teacher-forced along given tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import torch

from . import levers
from .runtime.cache import KVCache


def oracle_model(model):
    """A dense float32 copy of ``model`` (a `models.Decoder`, dense or quantized, its
    weights in the MLX layout or held in a kernel's order) on the model's device: each
    Linear's weight is its float32 dequantization, everything else widened to float32."""
    from .models import Decoder
    from .models.decoder import Linear

    device = model.model.norm.weight.device
    oracle = Decoder(replace(model.config, quantization=None))  # every Linear dense
    state = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, Linear):  # Embedding is one too
                # in x's own column order (an act-order weight's put back)
                state[f"{name}.weight"] = module.dense_weight(torch.float32).to(device)
                if module.bias is not None:
                    state[f"{name}.bias"] = module.bias.float()
            else:
                for p, t in [*module.named_parameters(recurse=False),
                             *module.named_buffers(recurse=False)]:
                    state[f"{name}.{p}" if name else p] = t.float()
    oracle.load_state_dict(state, assign=True)
    return oracle.to(device).eval()


def gate_cache(model, n_tokens: int, kv_bits: int = 0, kv_group_size: int = 64) -> KVCache:
    """A one-sequence cache for ``n_tokens``, its capacity rounded up to 256 slots: every
    prompt then shares one set of kernel specializations (the attention merge is
    compiled per split count) instead of compiling per prompt length. The oracle's
    cache is made the same way, so its sliding layers wrap at the same slots."""
    capacity = -(-n_tokens // 256) * 256
    return KVCache(model.config, 1, capacity, model.dtype, model.model.norm.weight.device,
                   kv_bits, kv_group_size)


@contextlib.contextmanager
def _full_float32() -> Iterator[None]:
    """float32 products in float32 on a GPU (TF32 off: it keeps 10 mantissa bits, fewer
    than bf16's activations would lose), restored afterwards."""
    if not torch.cuda.is_available():
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@torch.no_grad()
def decode_along(model, prompt_ids: list[int], n_tokens: int, kv_bits: int = 0,
                 kv_group_size: int = 64, continuation: list[int] | None = None):
    """(tokens, logits [n_tokens, V] float32, hidden [layers, n_tokens, H] float32):
    prefill of the prompt, then ``n_tokens - 1`` cached decode steps, in the tier in
    force (the oracle's callers run it in compat). Step i is fed ``continuation[i]``
    (teacher forcing), or without a continuation the argmax of the step before
    (greedy: ``tokens`` is then the model's own continuation; given one, ``tokens``
    is that continuation). Row i of the logits predicts token i."""
    device = model.model.norm.weight.device
    cache = gate_cache(model, len(prompt_ids) + n_tokens, kv_bits, kv_group_size)
    hidden: list[torch.Tensor] = []
    rows = [model(torch.tensor([prompt_ids], device=device), cache=cache,
                  hidden_states=hidden)[0, -1]]
    layers = [[h[0, -1]] for h in hidden]
    tokens = [int(rows[0].argmax())] if continuation is None else list(continuation[:n_tokens])
    for i in range(n_tokens - 1):
        hidden = []
        rows.append(model.decode(torch.tensor([tokens[i]], device=device), cache, hidden)[0])
        for j, h in enumerate(hidden):
            layers[j].append(h[0, -1])
        if continuation is None:
            tokens.append(int(rows[-1].argmax()))
    return (tokens, torch.stack(rows).float(),
            torch.stack([torch.stack(x) for x in layers]).float())


def oracle_trajectory(oracle, prompt_ids: list[int], n_tokens: int, kv_bits: int = 0,
                      kv_group_size: int = 64):
    """The oracle's greedy continuation of a prompt with its logits and hidden states
    (`decode_along`), in the compat tier with full-float32 products."""
    with levers.use_tier("compat"), _full_float32():
        return decode_along(oracle, prompt_ids, n_tokens, kv_bits, kv_group_size)


def oracle_forced(oracle, prompt_ids: list[int], continuation: list[int], kv_bits: int = 0,
                  kv_group_size: int = 64):
    """The oracle's logits and hidden states teacher-forced along ``continuation``."""
    with levers.use_tier("compat"), _full_float32():
        return decode_along(oracle, prompt_ids, len(continuation), kv_bits, kv_group_size,
                            continuation)[1:]
