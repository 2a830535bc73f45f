"""`kv_cache_bytes`, the KV cache's size before it is made, against the bytes an allocated
cache of the bundled model holds: dense and 4/8-bit codes, ring and full layers."""

import pytest
import torch

from qfuse.loading import DEFAULT_MODEL, check_checkpoint
from qfuse.quant import QuantizedTensor
from qfuse.runtime.cache import KVCache, kv_cache_bytes


@pytest.fixture(scope="module")
def config():
    return check_checkpoint(DEFAULT_MODEL)


def _allocated(cache: KVCache) -> int:
    """The bytes of the storages behind every layer's K and V, counted tensor by tensor."""
    total = 0
    for layer in cache.layers:
        for store in (layer.k, layer.v):
            parts = (store.packed, store.scales, store.biases) \
                if isinstance(store, QuantizedTensor) else (store,)
            total += sum(t.untyped_storage().nbytes() for t in parts)
    return total


def test_kv_cache_bytes_are_those_of_the_allocated_cache(config):
    # The bundled model has ring layers and a full one: both capacities are counted.
    assert "sliding_attention" in config.layer_types and "full_attention" in config.layer_types
    window, context = config.sliding_window, config.max_position_embeddings
    assert window < context
    for tokens in (window // 2, window, context):
        for bits, group in ((0, 64), (4, 32), (4, 64), (8, 64)):
            for dtype in (torch.float32, torch.bfloat16):
                for B in (1, 3):
                    cache = KVCache(config, B, tokens, dtype, "cpu", bits, group)
                    assert kv_cache_bytes(config, B, tokens, dtype, bits, group) == \
                        _allocated(cache), (tokens, bits, group, dtype, B)
    # Dense at the full context, spelled out: ring layers hold the window, the others all.
    rings = config.layer_types.count("sliding_attention")
    full = len(config.layer_types) - rings
    assert kv_cache_bytes(config, 3, context, torch.bfloat16) == \
        2 * 3 * config.num_key_value_heads * config.head_dim * 2 * (rings * window + full * context)
