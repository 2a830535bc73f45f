"""Preallocated KV caches, written by index so the decode step can be captured in a graph.

Each layer holds K and V as dense tensors or as MLX-layout QuantizedTensors of
shape [B, Hkv, capacity, D]. Sliding-window layers keep only the last `window`
tokens in a ring buffer (slot = position mod window); full layers keep
everything up to `max_tokens`. `KVCache.lengths` (int32 [B], on the device)
counts the tokens of each sequence; the decode kernels read it from device
memory, never from the host.
"""

from __future__ import annotations

import torch

from ..errors import UserError
from ..quant import SUPPORTED_GROUP_SIZES, QuantizedTensor, batch_rows, dequantize
from .prompt_write import token_plan, write_tokens

# KV cache code widths: 0 is a dense cache; the decode kernels take 4 and 8 bits.
KV_BITS = (0, 4, 8)


def cache_problem(config, bits: int, group_size: int) -> str | None:
    """Why a KV cache of ``bits``-bit codes (0: dense) in groups of ``group_size`` cannot
    hold this model's heads (None when it can): the one rule the cache, a generation
    request and the command line share."""
    if bits not in KV_BITS:
        return f"KV cache bits must be one of {KV_BITS} (0: dense), got {bits}"
    if bits and group_size not in SUPPORTED_GROUP_SIZES:
        return f"the KV group size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}"
    if bits and config.head_dim % group_size:
        return (f"the KV group size {group_size} does not divide the model's head_dim of "
                f"{config.head_dim}")
    return None


class LayerCache:
    def __init__(self, B, Hkv, capacity, D, dtype, device, bits=0, group_size=64, ring=False):
        self.capacity, self.ring = capacity, ring
        if bits:
            def make():
                return QuantizedTensor(
                    torch.zeros(B, Hkv, capacity, D * bits // 32, dtype=torch.uint32, device=device),
                    torch.zeros(B, Hkv, capacity, D // group_size, dtype=dtype, device=device),
                    torch.zeros(B, Hkv, capacity, D // group_size, dtype=dtype, device=device),
                    group_size, bits)
        else:
            def make():
                return torch.zeros(B, Hkv, capacity, D, dtype=dtype, device=device)
        self.k, self.v = make(), make()

    def write_prompt(self, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                     past: int = 0) -> None:
        """k, v [B, Hkv, T, D] of right-padded prompts, or of the chunk at positions
        past..past+T-1 of each, ``lengths`` long in all (host-side, past included);
        keep the tokens a later step can see (the last `capacity` of each on a ring)."""
        firsts = [max(past, L - self.capacity) if self.ring else past for L in lengths]
        plan = token_plan(lengths, firsts, past, k.shape[2], k.device)
        slots = plan.positions % self.capacity if self.ring else plan.positions
        for store, src in ((self.k, k), (self.v, v)):
            write_tokens(store, src, plan, slots, plan.row_table)

    def read(self, first: int, stop: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions first..stop-1 of every sequence, [B, Hkv, stop - first,
        D] in ``dtype`` (dequantized from a quantized store): the keys a chunk of a
        prompt attends to besides its own. A ring holds only its last `capacity`
        positions of stop, so ``first`` must lie within them."""
        if self.ring and stop - first > self.capacity:
            raise ValueError(f"positions {first}..{stop - 1} do not fit a ring of "
                             f"{self.capacity}")
        if self.ring:
            where = torch.arange(first, stop, device=self.k.device) % self.capacity
        else:
            where = slice(first, stop)  # a view: no copy of a dense store
        return _read(self.k, where, dtype), _read(self.v, where, dtype)

    def step_args(self, indices: dict) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        """This layer's part of one decode step's `KVCache.step_indices()`: (slots of the
        new tokens, tokens attended, window, block table) for `ops.kv_append` and
        `ops.decode_attention`. No window (a ring holds only the window's tokens) and no
        table: `PagedLayerCache.step_args` is the paged cache's answer."""
        slots, attended = indices[self.capacity]
        return slots, attended, None, None

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes  # torch.Tensor and QuantizedTensor alike


def _read(store, where, dtype: torch.dtype) -> torch.Tensor:
    """store[:, :, where] in ``dtype``, dequantized from a quantized store as the
    reference attention dequantizes it."""
    if isinstance(store, QuantizedTensor):
        # As int32: CUDA has no uint32 gather (the words' bits are the same).
        packed = store.packed.view(torch.int32)[:, :, where].view(torch.uint32)
        return dequantize(packed, store.scales[:, :, where], store.biases[:, :, where],
                          store.group_size, store.bits, dtype)
    return store[:, :, where].to(dtype)


def layer_capacities(config, max_tokens: int) -> list[tuple[int, bool]]:
    """Per layer: (tokens its cache holds, whether it is a ring). A sliding-window layer
    keeps its last `sliding_window` tokens when the window is shorter than max_tokens."""
    out = []
    for kind in config.layer_types:
        window = config.sliding_window if kind == "sliding_attention" else None
        ring = window is not None and window < max_tokens
        out.append((window if ring else max_tokens, ring))
    return out


def bytes_per_head_token(config, dtype: torch.dtype, bits: int = 0, group_size: int = 64) -> int:
    """The bytes of one token's K (or V) for one KV head, slotted or paged alike."""
    D = config.head_dim
    # D codes of `bits` bits packed in uint32 words, and one scale and one bias per group
    # in the cache's dtype; dense: D values in the dtype.
    return (D * bits // 32 * 4 + 2 * (D // group_size) * dtype.itemsize) if bits \
        else D * dtype.itemsize


def kv_cache_bytes(config, batch_size: int, max_tokens: int, dtype: torch.dtype,
                   bits: int = 0, group_size: int = 64) -> int:
    """The bytes of `KVCache(config, batch_size, max_tokens, dtype, ..., bits, group_size)`
    (its K and V, as `KVCache.nbytes` counts them), computed without allocating it: what
    `qfuse serve` weighs against the free memory before it makes its cache."""
    per_head_token = bytes_per_head_token(config, dtype, bits, group_size)
    tokens = sum(capacity for capacity, _ in layer_capacities(config, max_tokens))
    return 2 * batch_size * config.num_key_value_heads * tokens * per_head_token  # K and V


class KVCache:
    """Caches for every layer of a model, for B sequences of at most `max_tokens` tokens."""

    def __init__(self, config, batch_size: int, max_tokens: int, dtype: torch.dtype,
                 device, bits: int = 0, group_size: int = 64):
        problem = cache_problem(config, bits, group_size)
        if problem is not None:
            raise ValueError(problem)
        self.max_tokens = max_tokens
        self.layers = [LayerCache(batch_size, config.num_key_value_heads, capacity,
                                  config.head_dim, dtype, device, bits, group_size, ring)
                       for capacity, ring in layer_capacities(config, max_tokens)]
        self.lengths = torch.zeros(batch_size, dtype=torch.int32, device=device)
        # A host copy of the lengths, kept by whoever advances them, so that a
        # decode step can refuse to overflow the cache without a device sync. Views
        # (`rows`, `slot`) share this list: `_host_rows` says which part is theirs.
        self._host = [0] * batch_size
        self._host_rows: slice | None = None

    @property
    def host_lengths(self) -> list[int]:
        """The lengths as the host knows them. A cache's own list (assign items or the
        whole); for a view of rows, a copy of its rows: assign the whole list, which
        writes the rows of the cache it views."""
        return self._host if self._host_rows is None else self._host[self._host_rows]

    @host_lengths.setter
    def host_lengths(self, values) -> None:
        values = list(values)
        rows = slice(None) if self._host_rows is None else self._host_rows
        if len(values) != len(self._host[rows]):
            raise ValueError(f"{len(values)} lengths for {len(self._host[rows])} sequences")
        self._host[rows] = values

    def reserve_step(self) -> None:
        """Account for one more token per sequence; ValueError if the cache is full."""
        if max(self.host_lengths, default=0) + 1 > self.max_tokens:
            raise ValueError(f"the KV cache holds {self.max_tokens} tokens per sequence and is "
                             f"full (lengths {self.host_lengths})")
        self.host_lengths = [n + 1 for n in self.host_lengths]

    def step_indices(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """For one decode step, per layer capacity: (int32 slot each sequence's new
        token goes to, int32 tokens each sequence then attends). Computed once per
        step, not per layer; a ring holds at most its capacity."""
        out = {}
        for layer in self.layers:
            if layer.capacity not in out:
                if layer.ring:
                    out[layer.capacity] = (self.lengths % layer.capacity,
                                           torch.clamp(self.lengths + 1, max=layer.capacity))
                else:
                    out[layer.capacity] = (self.lengths, self.lengths + 1)
        return out

    def rows(self, start: int, stop: int) -> KVCache:
        """A KVCache of sequences start..stop-1 whose tensors (lengths too) are views of
        this one's: a step over it advances those sequences here, its host lengths
        included (they live in this cache's list)."""
        view = object.__new__(KVCache)
        view.max_tokens, view._host = self.max_tokens, self._host
        base = 0 if self._host_rows is None else self._host_rows.start
        view._host_rows = slice(base + start, base + stop)
        view.lengths = self.lengths[start:stop]
        view.layers = []
        for layer in self.layers:
            one = object.__new__(LayerCache)
            one.capacity, one.ring = layer.capacity, layer.ring
            one.k, one.v = (batch_rows(t, start, stop) for t in (layer.k, layer.v))
            view.layers.append(one)
        return view

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


def check_cache_flags(config, kv_bits: int, kv_group_size: int, max_kv_size: int | None) -> None:
    """The command-line cache settings against a model's config: a UserError naming the
    flag that does not fit (the KV group must divide head_dim; --max-kv-size must fit
    the model's context)."""
    problem = cache_problem(config, kv_bits, kv_group_size)
    if problem is not None:
        raise UserError(f"--kv-bits {kv_bits} --kv-group-size {kv_group_size}: {problem}")
    if max_kv_size is not None and max_kv_size > config.max_position_embeddings:
        raise UserError(f"--max-kv-size {max_kv_size} exceeds the model's context of "
                        f"{config.max_position_embeddings} tokens")
