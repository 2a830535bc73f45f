"""A decode step over a slotted KV cache captured once as a CUDA graph and replayed per
token (`GraphedDecode`); the paged cache's graph is `paged_graphs.GraphedPagedDecode`.
"""

from __future__ import annotations

import torch

from .cache import KVCache
from .paged_cache import PagedKVCache


class GraphedDecode:
    """`model.decode(tokens, cache)` captured once as a CUDA graph and replayed per token.

    Everything the step reads lives in fixed buffers (the token buffer, the
    cache, its device-side lengths), so one capture serves every position.
    Sampling stays outside the graph."""

    def __init__(self, model, cache: KVCache, batch_size: int):
        if isinstance(cache, PagedKVCache):
            # Its step finds pages on the host, which a replay cannot do: the paged graph
            # reads fixed inputs that are prepared before each replay instead.
            raise TypeError("GraphedDecode takes a slotted KVCache; a PagedKVCache's graph "
                            "is paged_graphs.GraphedPagedDecode")
        device = cache.lengths.device
        self.cache = cache
        self.tokens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        saved, saved_host = cache.lengths.clone(), list(cache.host_lengths)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            model.decode(self.tokens, cache)  # warm-up: compiles kernels, caches RoPE tables
        torch.cuda.current_stream().wait_stream(stream)
        # The warm-up appended at each sequence's position; the real step will
        # overwrite those slots, so only the lengths need restoring.
        cache.lengths.copy_(saved)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.logits = model.decode(self.tokens, cache)
        cache.host_lengths = saved_host  # capture ran the Python side once, not the step

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.cache.reserve_step()
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits
