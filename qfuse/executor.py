"""A CPU executor of a `Schedule`'s per-SM instruction tables, with the reference ops.

`execute(schedule, model, tokens, cache, n_sms, seed)` runs one decode step as the
persistent program would: ``n_sms`` SMs each walk their own int32 table
(`Schedule.sm_tables`) in order; at every step one SM whose next instruction's counter
has reached its expected count is picked at random (seeded), runs that instruction with
the reference ops of `qfuse.reference`, stores its tile and increments its counter. It
returns the step's logits [B, vocab] and advances ``cache`` as `Decoder.decode` does
(the new token's K/V appended, lengths + 1).

It proves a schedule rather than trusting it; each fault raises its own `ScheduleFault`
(``check_reads=False`` leaves premature reads to show as the NaN they read, as on a GPU):
- `Deadlock`: every unfinished SM waits on a counter that can no longer reach its count;
- `PrematureRead`: an instruction reads a column no instruction has stored yet (every
  buffer, and the new token's K/V slot, starts as NaN and unwritten);
- `WrittenTwice`: a column stored twice;
- `Unwritten`: once every SM is done, a column nothing stored.

Arithmetic, per instruction, is the compat tier's (float32 where it is float32): a
product tile is `reference.linear` over the weight's rows of that tile; norms, RoPE, the
append and the gated activation are the reference functions on a head's or a tile's
slice. Attention follows `reference.decode_attention`'s rounding per split of the
cache's slots (scores and softmax in float32, exp(s - m) rounded to the model dtype for
the value product) and a merge in split order. Measured against `Decoder.decode` in the
compat tier (`tests/test_schedule.py`: Gemma 2/3 and Llama shapes, fp16/bf16/fp32, dense
and 4-bit weights and caches):
- one split per KV head: the logits and the cache are bitwise equal. On the CPU a
  product tile is bitwise the whole product's columns; the one exception seen is a
  transcendental function over a tile narrower than ATen's vector loop (GELU-tanh over
  16-wide fp16 tiles, on AVX2: rare elements computed by the scalar tail), so the test
  compares against the plain path with its activation computed in the same tiles (at
  32-wide tiles the untouched plain path matched too);
- several splits: each split rounds its exponentials against its own maximum, so the
  logits move by rounding, within 8·eps·max|logit| (the test's bound, and why).
"""

from __future__ import annotations

import random

import torch

from . import reference
from .quant import QuantizedTensor
from .schedule import (
    ATTENTION,
    COLUMNS,
    EMBED,
    GATED_ACT,
    KV_APPEND,
    MERGE,
    PRODUCT,
    RESIDUAL,
    RMS_NORM,
    ROTATE,
    SOFTCAP,
    Schedule,
    split_slots,
)

_C = {name: i for i, name in enumerate(COLUMNS)}


class ScheduleFault(RuntimeError):
    """A schedule that does not compute the step (module docstring)."""


class Deadlock(ScheduleFault):
    pass


class PrematureRead(ScheduleFault):
    pass


class WrittenTwice(ScheduleFault):
    pass


class Unwritten(ScheduleFault):
    pass


def execute(schedule: Schedule, model, tokens: torch.Tensor, cache, n_sms: int = 4,
            seed: int | None = 0, check_reads: bool = True) -> torch.Tensor:
    """One decode step of ``model`` (a `Decoder` on the CPU) for ``tokens`` [B] over
    ``cache`` (a `KVCache` with B = schedule.rows sequences), by the schedule's tables
    dealt over ``n_sms`` SMs, in the order ``seed`` draws; ``seed=None``: latest first
    (each step runs the ready instruction latest in the list: readers as early as their
    counters let them, the order that makes a count too low read early for certain).
    Returns logits [B, vocab].
    ``check_reads=False`` drops the `PrematureRead` check, as a GPU has none: a
    premature read then shows only as the NaN it read."""
    return _Run(schedule, model, tokens, cache, check_reads).run(n_sms, seed)


class _Run:
    """The state of one step: buffers, what of them is written, the counters."""

    def __init__(self, schedule: Schedule, model, tokens, cache, check_reads: bool):
        if tokens.shape != (schedule.rows,):
            raise ValueError(f"tokens of shape {tuple(tokens.shape)} for a schedule of "
                             f"{schedule.rows} rows")
        self.s, self.model, self.cfg, self.cache = schedule, model, model.config, cache
        self.tokens, self.dtype, self.check_reads = tokens, model.dtype, check_reads
        B = schedule.rows
        cache.reserve_step()
        self.positions = cache.lengths.to(torch.int64)[:, None]
        indices = cache.step_indices()
        args = [layer.step_args(indices) for layer in cache.layers]
        if any(a[3] is not None for a in args):
            raise ValueError("the executor reads a slotted KVCache; a paged cache's block "
                             "tables are not in the schedule yet")
        self.steps = [a[:2] for a in args]  # per layer: the new token's slot, tokens attended
        self.rows = torch.arange(B)
        self.data = [None if b.cache else torch.full(
            (B, b.columns), float("nan"), dtype=torch.float32 if b.wide else self.dtype)
            for b in schedule.buffers]
        self.written = [torch.zeros(b.columns, dtype=torch.bool) for b in schedule.buffers]
        for layer, (slots, _) in zip(cache.layers, self.steps):
            for store in (layer.k, layer.v):  # a premature read of the new token shows
                _poison(store, self.rows, slots)
        self.counters = [0] * len(schedule.counters)  # the program's global int32 array
        self.params = [self._resolve(w.paths) for w in schedule.weights]

    def _resolve(self, paths):
        """A product's dense weight [ΣN, K] and bias (stacked along N), or a norm."""
        mods = [self.model.get_submodule(p) for p in paths]
        if hasattr(mods[0], "eps"):
            return mods[0]
        w = torch.cat([m.dense_weight(self.dtype) for m in mods])  # act-order put back
        b = None if mods[0].bias is None else torch.cat([m.bias for m in mods])
        return w, b

    def run(self, n_sms: int, seed: int) -> torch.Tensor:
        lists = self.s.sm_lists(n_sms)
        tables = [t.tolist() for t in self.s.sm_tables(n_sms)]
        at = [0] * n_sms
        rng = random.Random(seed)
        while True:
            live = [sm for sm in range(n_sms) if at[sm] < len(tables[sm])]
            if not live:
                break
            ready = [sm for sm in live if self._ready(tables[sm][at[sm]])]
            if not ready:
                raise Deadlock("every SM waits: " + "; ".join(
                    f"SM {sm} at {self.s.describe(lists[sm][at[sm]])} (counter at "
                    f"{self.counters[tables[sm][at[sm]][_C['wait']]]})" for sm in live))
            sm = rng.choice(ready) if seed is not None else max(
                ready, key=lambda sm: lists[sm][at[sm]])
            self._perform(tables[sm][at[sm]], lists[sm][at[sm]])
            at[sm] += 1
        for b, done in zip(self.s.buffers, self.written):
            if not done.all():
                cols = (~done).nonzero().flatten().tolist()
                raise Unwritten(f"{b.name}: columns {cols[0]}..{cols[-1]} ({len(cols)}) "
                                "never stored")
        self.cache.lengths += 1
        return self.data[self.s.logits].clone()

    def _ready(self, row) -> bool:
        wait = row[_C["wait"]]
        return wait < 0 or self.counters[wait] >= row[_C["expected"]]

    def _read(self, row, n: int, index: int) -> torch.Tensor:
        b, start, stop = (row[_C[f"in{n}_{f}"]] for f in ("buf", "start", "stop"))
        if self.check_reads and not self.written[b][start:stop].all():
            raise PrematureRead(f"{self.s.describe(index)}: reads "
                                f"{self.s.buffers[b].name}[{start}:{stop}] before it is stored")
        return self.data[b][:, start:stop] if self.data[b] is not None else None

    def _perform(self, row, index: int) -> None:
        op, layer, unit = row[_C["op"]], row[_C["layer"]], row[_C["unit"]]
        inputs = [self._read(row, n, index) for n in range(3) if row[_C[f"in{n}_buf"]] >= 0]
        param = self.params[row[_C["weight"]]] if row[_C["weight"]] >= 0 else None
        b, start, stop = row[_C["out_buf"]], row[_C["out_start"]], row[_C["out_stop"]]
        if self.written[b][start:stop].any():
            raise WrittenTwice(f"{self.s.describe(index)}: stores "
                               f"{self.s.buffers[b].name}[{start}:{stop}] again")
        if op == KV_APPEND:
            store = self.cache.layers[layer].k if self.s.buffers[b].name.startswith(
                "cache_k") else self.cache.layers[layer].v
            _append(store, self.rows, unit, self.steps[layer][0], inputs[0])
        else:
            self.data[b][:, start:stop] = self._compute(op, layer, unit, row, inputs, param)
        self.written[b][start:stop] = True
        if row[_C["signal"]] >= 0:
            self.counters[row[_C["signal"]]] += 1

    def _compute(self, op, layer, unit, row, inputs, param) -> torch.Tensor:
        cfg = self.cfg
        if op == EMBED:
            h = self.model.model.embed_tokens.lookup(self.tokens[:, None], self.dtype)[:, 0]
            return h * self.model.embed_multiplier(h.dtype) if cfg.embed_scale else h
        if op == RMS_NORM:
            return reference.rms_norm(inputs[0], param.weight, param.eps, param.unit_offset)
        if op == PRODUCT:
            w, bias = param
            s, e = row[_C["out_start"]], row[_C["out_stop"]]
            return reference.linear(inputs[0], w[s:e], None if bias is None else bias[s:e])
        if op == ROTATE:
            x = inputs[0][:, None, None, :]  # one head: [B, 1, T=1, D]
            if param is not None:
                x = reference.rms_norm(x, param.weight, param.eps, param.unit_offset)
            attn = self.model.model.layers[layer].self_attn
            cos, sin = attn.rope_cos_sin(self.positions, x.dtype)
            return reference.apply_rotary(x, cos, sin)[:, 0, 0]
        if op == ATTENTION:
            return self._attention(layer, unit, row[_C["split"]], inputs[0])
        if op == MERGE:
            return _merge(inputs[0], row[_C["split"]], cfg.head_dim, self.dtype)
        if op == RESIDUAL:
            a, r = inputs
            if param is not None:
                a = reference.rms_norm(a, param.weight, param.eps, param.unit_offset)
            return r + a
        if op == GATED_ACT:
            return reference.gated_act(inputs[0], inputs[1], cfg.hidden_act)
        if op == SOFTCAP:
            cap = cfg.final_logit_softcapping
            return torch.tanh(inputs[0] / cap) * cap
        raise ValueError(f"unknown opcode {op}")

    def _attention(self, layer: int, g: int, split: int, q: torch.Tensor) -> torch.Tensor:
        """The partials of KV head g over one split of the layer's cache slots:
        [B, G·(D+2)], per query head (max, sum of exp, unnormalised output [D]), float32,
        rounded as `reference.decode_attention` rounds."""
        cfg, dtype = self.cfg, self.dtype
        D, B = cfg.head_dim, q.shape[0]
        first, stop = split_slots(self.s.capacities[layer], self.s.kv_splits, split)
        lc = self.cache.layers[layer]
        keys, values = (_slots(t, g, first, stop, dtype) for t in (lc.k, lc.v))  # [B, n, D]
        attended = self.steps[layer][1].to(torch.int64)
        valid = torch.arange(first, stop)[None, :] < attended[:, None]  # [B, n]
        values = torch.where(valid[:, :, None], values, 0)
        scores = torch.matmul(q.reshape(B, -1, D).float(), keys.float().transpose(-1, -2))
        scores = scores * cfg.attn_scale  # [B, G, n]
        if cfg.attn_logit_softcapping is not None:
            cap = cfg.attn_logit_softcapping
            scores = torch.tanh(scores / cap) * cap
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        top = scores.amax(-1, keepdim=True) if stop > first else torch.full(
            (B, scores.shape[1], 1), float("-inf"))
        numer = torch.exp(scores - torch.where(torch.isfinite(top), top, 0))
        total = numer.sum(-1, keepdim=True)
        out = torch.matmul(numer.to(dtype).float(), values.float())  # [B, G, D]
        return torch.cat([top, total, out], -1).reshape(B, -1)


def _merge(partials: torch.Tensor, splits: int, D: int, dtype) -> torch.Tensor:
    """[B, splits·G·(D+2)] partials of one KV head → its G heads' outputs [B, G·D], the
    splits combined in order (no atomics: bitwise reproducible)."""
    B = partials.shape[0]
    p = partials.reshape(B, splits, -1, D + 2)
    top, total, out = p[..., 0], p[..., 1], p[..., 2:]
    m = top.amax(1)  # [B, G]
    base = torch.where(torch.isfinite(m), m, 0)
    acc_out, acc_total = None, None
    for s in range(splits):
        w = torch.exp(top[:, s] - base)
        o, t = out[:, s] * w[..., None], total[:, s] * w
        acc_out = o if acc_out is None else acc_out + o
        acc_total = t if acc_total is None else acc_total + t
    result = acc_out / acc_total[..., None]
    # Nothing attended (a length-0 sequence): zeros, as the reference defines it.
    result = torch.where(torch.isfinite(m)[..., None], result, 0)
    return result.to(dtype).reshape(B, -1)


def _slots(store, g: int, first: int, stop: int, dtype) -> torch.Tensor:
    """Slots [first, stop) of KV head g of a layer's K or V store: [B, n, D] in dtype."""
    if isinstance(store, QuantizedTensor):
        return QuantizedTensor(store.packed[:, g, first:stop], store.scales[:, g, first:stop],
                               store.biases[:, g, first:stop], store.group_size,
                               store.bits).dequantize(dtype)
    return store[:, g, first:stop].to(dtype)


def _poison(store, rows, slots) -> None:
    """NaN into each sequence's new-token slot (a quantized store: its scales)."""
    slots = slots.to(torch.int64)
    if isinstance(store, QuantizedTensor):
        store.scales[rows, :, slots] = float("nan")
        store.biases[rows, :, slots] = float("nan")
    else:
        store[rows, :, slots] = float("nan")


def _append(store, rows, g: int, slots, x: torch.Tensor) -> None:
    """KV head g of the new token, x [B, D], into each sequence's slot, as the reference
    append writes it (a quantized store quantizes it as `quant.quantize` does)."""
    slots = slots.to(torch.int64)
    if isinstance(store, QuantizedTensor):
        store.write_((rows, g, slots), x)
    else:
        store[rows, g, slots] = x.to(store.dtype)
