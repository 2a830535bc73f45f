"""`qfuse bench e2e`: decode tokens/s of real-sized models against the memory roofline.

Models are the Gemma 3 12B text and Llama 3 8B shapes with random weights
created directly on the GPU in the target format (no checkpoint is needed: the
decode step's speed does not depend on the values). For every configuration —
weights bf16 or 4-bit g64, KV cache bf16/8-bit/4-bit, context 1k/8k/32k, batch
1/8, tier compat/fast — the cache is filled with random contents up to the
context (prefill is not what is measured), then decode steps are timed after
warm-up (the fast tier replays a CUDA graph). Reported: tokens/s, ms per
token, peak memory, the bytes one step must read (every weight once plus the
KV actually attended: sliding-window layers see at most their window), the
achieved GB/s, and the share of the roofline (those bytes over the copy
bandwidth measured in the same run).

Written for the first GPU run of issue 8: not yet run on a GPU. The model
construction and byte counting are tested on CPU (tests/test_bench_e2e.py).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from ..cache import KVCache
from ..models import Decoder, ModelConfig
from ..models.decoder import Linear
from ..quant import QuantizedTensor
from . import common

GEMMA3_12B = {
    "model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
    "vocab_size": 262144, "sliding_window": 1024, "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256, "max_position_embeddings": 131072,
}
LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
}
MODELS = {"gemma3-12b": GEMMA3_12B, "llama3-8b": LLAMA3_8B}
GROUP = 64


@contextmanager
def _default(device, dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def random_model(raw_config: dict, weight_bits: int, device, dtype=torch.bfloat16) -> Decoder:
    """A Decoder of this shape whose Linears (and embedding) are dense or MLX-quantized
    with random contents, allocated directly on ``device``."""
    raw = dict(raw_config)
    if weight_bits:
        raw["quantization"] = {"group_size": GROUP, "bits": weight_bits}
    cfg = ModelConfig.from_dict(raw)
    spec = (lambda path: (GROUP, weight_bits)) if weight_bits else (lambda path: (0, 0))
    with _default(device, dtype), torch.no_grad():
        model = Decoder(cfg, spec)
        for module in model.modules():
            if isinstance(module, Linear):
                if module.bits:
                    unit = module.n_in ** -0.5 / 8
                    common.fill_random_quantized_(module.quantized(), 0.5 * unit, 1.5 * unit)
                else:
                    module.weight.normal_(0, module.n_in ** -0.5)
    return model.eval()


def fill_cache(cache: KVCache, context: int) -> None:
    """Random cache contents for `context` tokens per sequence, as if prefilled."""
    with torch.no_grad():
        for layer in cache.layers:
            for t in (layer.k, layer.v):
                if isinstance(t, QuantizedTensor):
                    common.fill_random_quantized_(t, 0.01, 0.05)
                else:
                    t.normal_()
    cache.lengths.fill_(context)
    cache.host_lengths = [context] * len(cache.host_lengths)


def step_bytes(model: Decoder, cache: KVCache, context: int) -> int:
    """Bytes one decode step must read: every weight once (the embedding: one row per
    sequence, ignored) plus the K/V each layer attends to."""
    total = sum(m.effective_weight().nbytes for name, m in model.named_modules()
                if isinstance(m, Linear) and name != "model.embed_tokens")
    if model.config.tie_word_embeddings:  # the embedding doubles as the head
        total += model.model.embed_tokens.effective_weight().nbytes
    B = cache.lengths.numel()
    for layer in cache.layers:
        attended = min(context, layer.capacity)
        per_token = layer.nbytes // (B * layer.capacity)  # K and V, one token, one sequence
        total += B * attended * per_token
    return total


def time_decode(model: Decoder, cache: KVCache, steps: int, graph: bool) -> float:
    """Milliseconds per decode step (the cache grows by `steps` tokens)."""
    from ..generate import GraphedDecode

    B = cache.lengths.numel()
    tokens = torch.zeros(B, dtype=torch.int64, device=cache.lengths.device)
    with torch.no_grad():
        step = GraphedDecode(model, cache, B) if graph else (lambda t: model.decode(t, cache))
        step(tokens)  # warm-up
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step(tokens)
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / steps


def run_config(model, name, weight_bits, kv_bits, context, B, tier, copy_gbs, steps) -> dict:
    row = {"model": name, "weights": f"{weight_bits}-bit" if weight_bits else "bf16",
           "kv": f"{kv_bits}-bit" if kv_bits else "bf16", "context": context, "batch": B,
           "tier": tier}
    os.environ["QFUSE_TIER"] = tier
    try:
        cache = KVCache(model.config, B, context + steps + 2, torch.bfloat16, "cuda", kv_bits, GROUP)
        fill_cache(cache, context)
        torch.cuda.reset_peak_memory_stats()
        ms = time_decode(model, cache, steps, graph=tier == "fast")
        nbytes = step_bytes(model, cache, context)
        row.update(tokens_per_s=B * 1000 / ms, ms_per_token=ms,
                   peak_memory_GB=torch.cuda.max_memory_allocated() / 1e9, step_bytes=nbytes,
                   GBps=nbytes / (ms * 1e-3) / 1e9, roofline_share=nbytes / (ms * 1e-3) / 1e9 / copy_gbs)
        del cache
    except Exception as exc:  # noqa: BLE001 -- a configuration that cannot run is reported
        row["not_run"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    finally:
        os.environ.pop("QFUSE_TIER", None)
        torch.cuda.empty_cache()
    return row


def main(out_dir: str = "bench/results", quick: bool = False) -> int:
    meta = common.metadata()
    copy_gbs = common.copy_bandwidth_gbs()
    rows = []
    contexts = [1024, 8192] if quick else [1024, 8192, 32768]
    for name, raw in MODELS.items():
        for weight_bits in (0, 4):
            model = random_model(raw, weight_bits, "cuda")
            for kv_bits in (0, 8, 4):
                for context in contexts:
                    for B in (1, 8):
                        for tier in ("fast", "compat"):
                            steps = 3 if tier == "compat" else 20
                            rows.append(run_config(model, name, weight_bits, kv_bits, context, B,
                                                   tier, copy_gbs, steps))
                            print(rows[-1], flush=True)
            del model
            torch.cuda.empty_cache()
    payload = {"meta": meta, "copy_GBps": copy_gbs,
               "note": "random weights created on the GPU in the target format; no checkpoint",
               "transformers_baseline": "not run: not implemented yet", "rows": rows}
    common.write_results(out_dir, "e2e", payload)
    common.print_table(rows, ["model", "weights", "kv", "context", "batch", "tier", "tokens_per_s",
                              "ms_per_token", "GBps", "roofline_share", "not_run"])
    return 0
