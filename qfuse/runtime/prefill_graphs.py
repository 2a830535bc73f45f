"""One prompt's whole prefill at a fixed length into any slot of a slotted KV cache, so
that a CUDA graph captured once per length serves every prompt that fits it
(`GraphedPrefill`); `PaddedPrefill` runs the same pass eagerly.

A prefill's forward (`Decoder.forward`) is shaped by host values: the prompt's length T
(every tensor of the pass), the row of the cache it writes (a view's addresses), the
lengths read back to the host (a device sync) and the tokens each layer writes to the
cache (a plan of n kept tokens made on the host: `prompt_write.token_plan`). Here
those become fixed: the prompt is right-padded to the bucket's ``length`` L, and its real
length n and its slot live in a device buffer that each call rewrites in place (one
copy from pinned memory), so the pass has the same shapes and addresses for any prompt
of 1..L tokens and any slot.

Why right-padding is sound: a real query i < n attends keys j <= i only (the causal
mask), so pad tokens never reach a real token's hidden state, and the logits come from
row n - 1 (`logits="last"` gathers it by the device length). Each layer writes a fixed
set of cache slots (`_SlotLayer.write_prompt`): slot s of a full layer gets position s
(s < L), slot s of a ring of C slots the last position p < n with p ≡ s (mod C), or, where
no real position maps to it (s >= n), pad position s. Pad keys and values therefore only
land on slots past the prompt's last position, which a decode step overwrites before any
query reads them (step t writes position t, then attends 0..t); no real slot is ever
written with a pad token. The cache's device length of the slot becomes n in the pass;
its host length is set before it (`prepare`).

What is not the same as an exact-length prefill: products and attention run over L rows
and L keys, and a kernel may sum a row in another order at another row count (cuBLAS and
SDPA pick kernels by shape; on a CPU so does the BLAS below 16 rows), so the real tokens'
logits and keys can differ from an exact-length pass's in the last bits, as a batched
right-padded prefill's already do. A graph's replay and the eager pass at the same L
give the same bits.

Limits: one prompt, the first chunk (no cached tokens before it), a slotted `KVCache`
(not a view, not paged), a `Decoder` (not a tensor-parallel leader), L at most the
cache's max_tokens.
"""

from __future__ import annotations

import inspect

import torch

from ..quant import QuantizedTensor
from .cache import KVCache
from .host_copies import to_device
from .prompt_write import TokenPlan, write_tokens


class _SlotLayer:
    """One layer of `_SlotView`: the whole store of the cache's layer, written at the
    slot the view's device buffer names."""

    def __init__(self, layer, view: _SlotView):
        self.capacity, self.ring = layer.capacity, layer.ring
        self.k, self.v = layer.k, layer.v
        self.view = view

    def write_prompt(self, k: torch.Tensor, v: torch.Tensor, lengths, past: int = 0) -> None:
        """k, v [1, Hkv, L, D] of the padded prompt (``lengths``, the host's, unused:
        the real length is the view's device tensor): the fixed set of slots in the
        module's docstring, by one gather and one `ops.kv_append` each."""
        if past:
            raise ValueError("a fixed-length prefill writes a prompt's first chunk only")
        plan = self.view.plan(k.shape[2], self.capacity, k.device)
        for store, src in ((self.k, k), (self.v, v)):
            write_tokens(store, src, plan, plan.positions, plan.row_table)


class _SlotView:
    """What `Decoder.forward` takes as its cache for a prompt written into the slot that
    ``slot`` (int64 [1], on the device) names, ``length`` (int64 [1]) tokens long: every
    layer's whole store, so no address depends on the slot."""

    def __init__(self, cache: KVCache, length: torch.Tensor, slot: torch.Tensor):
        self.max_tokens = cache.max_tokens
        self.length, self.slot = length, slot
        self.layers = [_SlotLayer(layer, self) for layer in cache.layers]
        # The forward writes lengths here; the pass's own step puts them in the cache.
        self.lengths = torch.zeros(1, dtype=torch.int64, device=length.device)
        self.host_lengths = [0]
        self.plans: dict[tuple[int, int], TokenPlan] = {}  # this pass's, per (L, capacity)

    def plan(self, L: int, C: int, device) -> TokenPlan:
        """The tokens a layer of C slots keeps of the padded prompt of L (the module's
        docstring: slot s gets column cols[s]), made once a pass per C from the device
        length; every token on the slot's row, as a one-page table."""
        plan = self.plans.get((L, C))
        if plan is None:
            s = torch.arange(min(L, C), device=device)
            n = self.length
            # The last real position on slot s (s < n); a pad position, past the prompt, else.
            latest = s + C * torch.div((n - 1 - s).clamp(min=0), C, rounding_mode="floor")
            table = self.slot.to(torch.int32).expand(len(s))[:, None]
            plan = self.plans[L, C] = TokenPlan(len(s), torch.zeros_like(s),
                                                torch.where(s < n, latest, s), s, table)
        return plan


class PaddedPrefill:
    """A prompt of 1..``length`` tokens prefilled into any slot of ``cache`` (a slotted
    `KVCache`) by one pass of fixed shape, run eagerly: the prompt right-padded to
    ``length``, its length and slot in device tensors. Returns the logits at its last
    real token, [1, vocab]."""

    def __init__(self, model, cache: KVCache, length: int):
        # a Decoder, by what the pass needs of it (the runtime sits below the models)
        forward = getattr(model, "forward", None)
        if forward is None or "host_lengths" not in inspect.signature(forward).parameters:
            raise TypeError("a fixed-length prefill runs a Decoder (its forward takes "
                            f"host_lengths), got {type(model).__name__}")
        if not isinstance(cache, KVCache) or cache._host_rows is not None:
            raise TypeError("a fixed-length prefill writes a whole slotted KVCache (not a "
                            "view of its rows, not paged)")
        if not isinstance(length, int) or not 1 <= length <= cache.max_tokens:
            raise ValueError(f"length must lie in [1, {cache.max_tokens}] (the cache's "
                             f"max_tokens), got {length!r}")
        self.model, self.cache, self.length = model, cache, length
        device = cache.lengths.device
        # One buffer, one copy a call: the padded ids, then the prompt's length and slot.
        self.inputs = torch.zeros(length + 2, dtype=torch.int64, device=device)
        self.ids = self.inputs[:length][None]
        self.n, self.slot = self.inputs[length: length + 1], self.inputs[length + 1:]
        self.view = _SlotView(cache, self.n, self.slot)

    def prepare(self, ids: list[int], slot: int) -> None:
        """Check the prompt and slot, set the slot's host length, and copy the padded ids,
        the length and the slot into the fixed buffer (behind the stream's work)."""
        n, B = len(ids), len(self.cache.host_lengths)
        if not 1 <= n <= self.length:
            raise ValueError(f"a prompt of {n} tokens does not fit a prefill of "
                             f"{self.length}")
        if not isinstance(slot, int) or not 0 <= slot < B:
            raise ValueError(f"slot must lie in [0, {B}), got {slot!r}")
        self.inputs.copy_(to_device([*ids, *[0] * (self.length - n), n, slot],
                                    self.inputs.device))
        self.cache.host_lengths[slot] = n  # the cache's own list: an item assigned

    def run(self) -> torch.Tensor:
        """The pass over the fixed buffers (what a graph captures): logits [1, vocab]."""
        self.view.plans.clear()  # made again from this pass's length
        logits = self.model(self.ids, self.n, self.view, logits="last",
                            host_lengths=[self.length])
        self.cache.lengths.index_copy_(0, self.slot, self.n.to(self.cache.lengths.dtype))
        return logits

    def __call__(self, ids: list[int], slot: int) -> torch.Tensor:
        """Prefill ``ids`` into ``slot``: logits [1, vocab] at the last real token."""
        self.prepare(ids, slot)
        with torch.no_grad():
            return self.run()


class GraphedPrefill(PaddedPrefill):
    """`PaddedPrefill`'s pass captured once as a CUDA graph and replayed per prompt. The
    warm-up before the capture runs the pass over slot 0: that slot's cache and the
    device lengths are saved first and put back after, so a graph may be made while
    slot 0 holds a sequence; the host lengths are not touched. Returns a copy of the
    graph's logits (the next replay overwrites its own)."""

    def __init__(self, model, cache: KVCache, length: int):
        super().__init__(model, cache, length)
        self.n.fill_(1)
        saved = [(t, t.clone()) for t in _slot_tensors(cache, 0)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            self.run()  # warm-up: plans chosen, kernels compiled, tables made
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.logits = self.run()
        for t, copy in saved:
            t.copy_(copy)

    def __call__(self, ids: list[int], slot: int) -> torch.Tensor:
        self.prepare(ids, slot)
        self.graph.replay()
        return self.logits.clone()


def _slot_tensors(cache: KVCache, slot: int) -> list[torch.Tensor]:
    """Every tensor a prefill into ``slot`` writes, as views: each layer's K and V rows
    (codes, scales and biases of a quantized store) and the slot's device length."""
    out = [cache.lengths[slot: slot + 1]]
    for layer in cache.layers:
        for store in (layer.k, layer.v):
            parts = (store.packed, store.scales, store.biases) \
                if isinstance(store, QuantizedTensor) else (store,)
            out += [t[slot: slot + 1] for t in parts]
    return out


def fitting(prefills: dict[int, PaddedPrefill], n: int) -> PaddedPrefill | None:
    """The prefill of the shortest length that holds ``n`` tokens, or None."""
    return next((prefills[L] for L in sorted(prefills) if L >= n), None)
