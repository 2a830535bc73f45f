"""The decode step as instructions: the list a persistent program walks, built on the host.

`decode_schedule(model, rows, max_tokens)` turns one decode step of a `Decoder` over
``rows`` sequences (a `KVCache` of ``max_tokens``) into data: named buffers, named
counters, a table of weights and an ordered list of `Instruction`s. Each instruction
computes one tile of one op and stores it:

- products (Q/K/V stacked, O, gate/up stacked, down, the head): the output features N
  cut into tiles of ``tile`` columns, each tile the whole K;
- per head: q/k norm + RoPE (`ROTATE`), the KV append of the new token; per KV head and
  split of the cache's slots: attention partials (max, sum of exp, unnormalised
  output, float32), then one `MERGE` per KV head in split order;
- whole rows: the embedding, RMSNorms and residual joints (a row's norm needs the whole
  row); per tile: the gated activation and the final logit soft-cap.

Dependencies are counters in one global array. An instruction waits until counter
``wait`` has reached ``expected`` and, once its tile is stored, adds one to counter
``signal``: one wait and one signal, so tiles are aligned with what their readers need
(a Q/K/V tile lies in one head: ``head_dim % tile == 0``; a gate/up tile in one half).
Every other input of an instruction is complete before it by transitivity (the residual
an O product's joint adds was complete before the norm that began the layer).
`Schedule.verify` proves that statically: each span an instruction reads is written by
instructions it is ordered after through counters.

The list is in an order that runs (a topological order); `Schedule.sm_lists(n)` deals it
round-robin over n SMs, each keeping the list's order, so the program cannot deadlock
when the counters are right. `Schedule.table(...)` is the int32 form a kernel reads, one
row an instruction, columns `COLUMNS`; a span is (buffer, first column, stop column) of
a buffer whose rows are the step's sequences. The new token's K/V slot of layer l is the
buffer `cache_k.l`/`cache_v.l`, columns = Hkv·D. `qfuse.executor` runs these tables on
the CPU with the reference ops.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .models.decoder import gathered_input
from .runtime.cache import layer_capacities

# Opcodes, the first column of a table row.
EMBED, RMS_NORM, PRODUCT, ROTATE, KV_APPEND, ATTENTION, MERGE, RESIDUAL, GATED_ACT, \
    SOFTCAP = range(10)
OPCODE_NAMES = ("embed", "rms_norm", "product", "rotate", "kv_append", "attention",
                "merge", "residual", "gated_act", "softcap")

# The int32 table's columns; an absent field (no wait, no weight, an unused read) is -1.
COLUMNS = ("op", "layer", "unit", "split", "weight", "wait", "expected", "signal",
           "out_buf", "out_start", "out_stop",
           "in0_buf", "in0_start", "in0_stop", "in1_buf", "in1_start", "in1_stop",
           "in2_buf", "in2_start", "in2_stop")
MAX_READS = 3


@dataclasses.dataclass(frozen=True)
class Buffer:
    """[rows, columns] of the model dtype, or float32 (``wide``: attention partials);
    ``cache``: the new token's slot of a layer's K or V cache, not an activation."""

    name: str
    columns: int
    wide: bool = False
    cache: bool = False


@dataclasses.dataclass(frozen=True)
class Span:
    """Columns [start, stop) of buffer ``buffer`` (an index into `Schedule.buffers`)."""

    buffer: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class Weight:
    """What an instruction multiplies or scales by: module paths of the `Decoder` (HF
    names): several for a product over weights stacked along N (Q/K/V, gate/up); one
    RMSNorm for a norm, a rotation's q/k norm or a joint's norm."""

    paths: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Instruction:
    op: int
    layer: int  # -1 outside the layers (embedding, final norm, head)
    unit: int  # the tile, head or KV head it computes
    split: int  # ATTENTION: the split of the cache's slots; MERGE: the splits; else 0
    weight: int  # index into Schedule.weights, or -1
    wait: int  # counter index, or -1 for none
    expected: int  # the count `wait` must reach
    signal: int  # counter incremented once the output is stored, or -1
    write: Span
    reads: tuple[Span, ...]

    def row(self) -> list[int]:
        """This instruction as a row of the int32 table (`COLUMNS`)."""
        reads = [v for s in self.reads for v in (s.buffer, s.start, s.stop)]
        reads += [-1] * (3 * MAX_READS - len(reads))
        return [self.op, self.layer, self.unit, self.split, self.weight, self.wait,
                self.expected, self.signal, self.write.buffer, self.write.start,
                self.write.stop, *reads]


@dataclasses.dataclass
class Schedule:
    """One decode step over ``rows`` sequences as data (module docstring)."""

    rows: int
    tile: int
    kv_splits: int
    capacities: tuple[int, ...]  # each layer's cache slots
    buffers: list[Buffer]
    counters: list[str]
    weights: list[Weight]
    instructions: list[Instruction]
    logits: int  # the buffer holding the step's logits

    def buffer(self, name: str) -> int:
        return next(i for i, b in enumerate(self.buffers) if b.name == name)

    def describe(self, i: int) -> str:
        """One instruction in words (for errors and reading)."""
        ins = self.instructions[i]
        b = self.buffers
        wait = "-" if ins.wait < 0 else f"{self.counters[ins.wait]}>={ins.expected}"
        reads = ", ".join(f"{b[s.buffer].name}[{s.start}:{s.stop}]" for s in ins.reads)
        return (f"#{i} {OPCODE_NAMES[ins.op]} layer {ins.layer} unit {ins.unit} "
                f"({reads}) -> {b[ins.write.buffer].name}[{ins.write.start}:"
                f"{ins.write.stop}] wait {wait}")

    def sm_lists(self, n_sms: int) -> list[list[int]]:
        """The instructions (indices) each of ``n_sms`` SMs walks: dealt round-robin in
        list order, so each SM's list keeps the list's (topological) order."""
        if n_sms < 1:
            raise ValueError(f"n_sms must be at least 1, got {n_sms}")
        return [list(range(sm, len(self.instructions), n_sms)) for sm in range(n_sms)]

    def table(self, indices: list[int] | None = None) -> torch.Tensor:
        """int32 [n, len(COLUMNS)]: the instructions ``indices`` (all by default)."""
        idx = range(len(self.instructions)) if indices is None else indices
        rows = [self.instructions[i].row() for i in idx]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), len(COLUMNS))

    def sm_tables(self, n_sms: int) -> list[torch.Tensor]:
        """The per-SM int32 tables a persistent program receives."""
        return [self.table(lst) for lst in self.sm_lists(n_sms)]

    def verify(self) -> None:
        """ValueError unless the counters order every read after its writes: each span an
        instruction reads is written, once, by instructions that precede it through
        counters whose expected counts equal their signallers (a lower count promises
        no particular producer), and every column of every buffer is written once."""
        signallers: dict[int, list[int]] = {}
        for i, ins in enumerate(self.instructions):
            if ins.signal >= 0:
                signallers.setdefault(ins.signal, []).append(i)
        writers: dict[tuple[int, int], int] = {}
        for i, ins in enumerate(self.instructions):
            for c in range(ins.write.start, ins.write.stop):
                if (ins.write.buffer, c) in writers:
                    raise ValueError(f"{self.describe(i)}: writes column {c} twice")
                writers[ins.write.buffer, c] = i
        for b, buf in enumerate(self.buffers):
            missing = [c for c in range(buf.columns) if (b, c) not in writers]
            if missing:
                raise ValueError(f"{buf.name}: columns {missing[0]}..{missing[-1]} are "
                                 "written by no instruction")
        # The instructions each is ordered after, as a bit set; producers come first in
        # a list that runs, so one pass in list order computes them.
        before: list[int] = []
        for i, ins in enumerate(self.instructions):
            producers = signallers.get(ins.wait, []) if ins.wait >= 0 else []
            if ins.wait >= 0 and len(producers) != ins.expected:
                raise ValueError(f"{self.describe(i)}: waits for {ins.expected} of "
                                 f"{len(producers)} signals")
            if any(p >= i for p in producers):
                raise ValueError(f"{self.describe(i)}: waits for a later instruction")
            mask = 0
            for p in producers:
                mask |= before[p] | (1 << p)
            before.append(mask)
            for s in ins.reads:
                for c in range(s.start, s.stop):
                    w = writers[s.buffer, c]
                    if not mask >> w & 1:
                        raise ValueError(f"{self.describe(i)}: reads "
                                         f"{self.buffers[s.buffer].name}[{c}] unordered "
                                         f"after its writer #{w}")


def _tiles(n: int, tile: int) -> list[tuple[int, int]]:
    return [(s, min(s + tile, n)) for s in range(0, n, tile)]


def decode_schedule(model, rows: int, max_tokens: int, tile: int = 64,
                    kv_splits: int = 1) -> Schedule:
    """The decode step of ``model`` (a `Decoder`) over ``rows`` sequences of a `KVCache`
    of ``max_tokens`` tokens, as instructions: products in tiles of ``tile`` output
    features, each layer's attention in ``kv_splits`` splits of its cache's slots per KV
    head. ValueError where the tiles cannot align with their readers."""
    cfg = model.config
    H, D, I, V = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    Hq, Hkv, L = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    G = Hq // Hkv
    if tile < 1 or D % tile or I % tile:
        raise ValueError(f"tile {tile} must divide head_dim {D} and intermediate_size {I}")
    gathered = gathered_input(model)  # the tables name weights in their stored order
    if gathered is not None:
        raise ValueError(f"no decode schedule: {gathered}")
    capacities = tuple(c for c, _ in layer_capacities(cfg, max_tokens))
    if not 1 <= kv_splits <= min(capacities):
        raise ValueError(f"kv_splits {kv_splits} must be 1..{min(capacities)}")
    buffers: list[Buffer] = []
    counters: list[str] = []
    weights: list[Weight] = []
    out: list[Instruction] = []

    def buf(name, columns, **kw) -> int:
        buffers.append(Buffer(name, columns, **kw))
        return len(buffers) - 1

    def counter(name) -> int:
        counters.append(name)
        return len(counters) - 1

    def weight(*paths) -> int:
        weights.append(Weight(tuple(paths)))
        return len(weights) - 1

    def emit(op, layer, unit, write, reads=(), weight=-1, wait=-1, expected=0, signal=-1,
             split=0):
        out.append(Instruction(op, layer, unit, split, weight, wait, expected, signal,
                               write, tuple(reads)))

    def whole(b) -> Span:
        return Span(b, 0, buffers[b].columns)

    def product(layer, name, x, w, n, wait, expected, signals):
        """Tiles of x·Wᵀ into a new buffer ``name`` [rows, n]; tile t signals
        ``signals[t]`` (or every tile the one counter ``signals``)."""
        y = buf(name, n)
        for t, (s, e) in enumerate(_tiles(n, tile)):
            emit(PRODUCT, layer, t, Span(y, s, e), [whole(x)], w, wait, expected,
                 signals[t] if isinstance(signals, list) else signals)
        return y

    x = buf("x.0", H)
    x_ready = counter("x.0")
    emit(EMBED, -1, 0, whole(x), signal=x_ready)
    for l in range(L):
        p = f"model.layers.{l}"
        a = f"{p}.self_attn"
        normed = buf(f"normed.{l}", H)
        c_normed = counter(f"normed.{l}")
        emit(RMS_NORM, l, 0, whole(normed), [whole(x)], weight(f"{p}.input_layernorm"),
             x_ready, 1, c_normed)
        # Q/K/V: one counter a head, each waited for by that head's rotation or append.
        heads = Hq + 2 * Hkv
        c_head = [counter(f"qkv.{l}.head{h}") for h in range(heads)]
        qkv = product(l, f"qkv.{l}", normed,
                      weight(f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"), heads * D,
                      c_normed, 1, [c_head[s // D] for s, _ in _tiles(heads * D, tile)])
        q, k = buf(f"q.{l}", Hq * D), buf(f"k.{l}", Hkv * D)
        ck, cv = buf(f"cache_k.{l}", Hkv * D, cache=True), buf(f"cache_v.{l}", Hkv * D,
                                                                 cache=True)
        # What a KV head's attention waits for: its G rotated queries, its K and V appended.
        c_group = [counter(f"attention_inputs.{l}.kv{g}") for g in range(Hkv)]
        c_krot = [counter(f"k.{l}.kv{g}") for g in range(Hkv)]
        q_norm = weight(f"{a}.q_norm") if cfg.qk_norm else -1
        k_norm = weight(f"{a}.k_norm") if cfg.qk_norm else -1
        per_head = D // tile
        for h in range(Hq):
            emit(ROTATE, l, h, Span(q, h * D, (h + 1) * D), [Span(qkv, h * D, (h + 1) * D)],
                 q_norm, c_head[h], per_head, c_group[h // G])
        for g in range(Hkv):
            col = (Hq + g) * D
            emit(ROTATE, l, Hq + g, Span(k, g * D, (g + 1) * D), [Span(qkv, col, col + D)],
                 k_norm, c_head[Hq + g], per_head, c_krot[g])
            emit(KV_APPEND, l, g, Span(ck, g * D, (g + 1) * D), [Span(k, g * D, (g + 1) * D)],
                 wait=c_krot[g], expected=1, signal=c_group[g])
            col = (Hq + Hkv + g) * D
            emit(KV_APPEND, l, g, Span(cv, g * D, (g + 1) * D), [Span(qkv, col, col + D)],
                 wait=c_head[Hq + Hkv + g], expected=per_head, signal=c_group[g])
        # Attention partials per (KV head, split): per query head max, sum, output[D].
        part = G * (D + 2)
        partials = buf(f"partials.{l}", Hkv * kv_splits * part, wide=True)
        attn = buf(f"attn.{l}", Hq * D)
        c_attn = counter(f"attn.{l}")
        for g in range(Hkv):
            c_part = counter(f"partials.{l}.kv{g}")
            reads = [Span(q, g * G * D, (g + 1) * G * D), Span(ck, g * D, (g + 1) * D),
                     Span(cv, g * D, (g + 1) * D)]
            for s in range(kv_splits):
                at = (g * kv_splits + s) * part
                emit(ATTENTION, l, g, Span(partials, at, at + part), reads, wait=c_group[g],
                     expected=G + 2, signal=c_part, split=s)
            first = g * kv_splits * part
            emit(MERGE, l, g, Span(attn, g * G * D, (g + 1) * G * D),
                 [Span(partials, first, first + kv_splits * part)], wait=c_part,
                 expected=kv_splits, signal=c_attn, split=kv_splits)
        c_o = counter(f"o.{l}")
        o = product(l, f"o.{l}", attn, weight(f"{a}.o_proj"), H, c_attn, Hkv, c_o)
        # The residual joint: h = x + o (Gemma: + post_attention_norm(o)); n = norm(h).
        h = buf(f"h.{l}", H)
        c_h = counter(f"h.{l}")
        post = weight(f"{p}.post_attention_layernorm") if cfg.sandwich_norms else -1
        emit(RESIDUAL, l, 0, whole(h), [whole(o), whole(x)], post, c_o,
             len(_tiles(H, tile)), c_h)
        n = buf(f"n.{l}", H)
        c_n = counter(f"n.{l}")
        emit(RMS_NORM, l, 1, whole(n), [whole(h)], weight(
            f"{p}.pre_feedforward_layernorm" if cfg.sandwich_norms
            else f"{p}.post_attention_layernorm"), c_h, 1, c_n)
        # gate/up stacked: tile t of the gate and tile t of the up meet in activation tile t.
        gate_tiles = I // tile
        c_pair = [counter(f"gate_up.{l}.tile{t}") for t in range(gate_tiles)]
        gu = product(l, f"gate_up.{l}", n, weight(f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"),
                     2 * I, c_n, 1, c_pair + c_pair)
        act = buf(f"act.{l}", I)
        c_act = counter(f"act.{l}")
        for t, (s, e) in enumerate(_tiles(I, tile)):
            emit(GATED_ACT, l, t, Span(act, s, e), [Span(gu, s, e), Span(gu, I + s, I + e)],
                 wait=c_pair[t], expected=2, signal=c_act)
        c_down = counter(f"down.{l}")
        down = product(l, f"down.{l}", act, weight(f"{p}.mlp.down_proj"), H, c_act,
                       gate_tiles, c_down)
        # out = h + down (Gemma: + post_feedforward_norm(down)): the next layer's input.
        x = buf(f"x.{l + 1}", H)
        x_ready = counter(f"x.{l + 1}")
        post = weight(f"{p}.post_feedforward_layernorm") if cfg.sandwich_norms else -1
        emit(RESIDUAL, l, 1, whole(x), [whole(down), whole(h)], post, c_down,
             len(_tiles(H, tile)), x_ready)
    final = buf("final", H)
    c_final = counter("final")
    emit(RMS_NORM, -1, 0, whole(final), [whole(x)], weight("model.norm"), x_ready, 1,
         c_final)
    head = "model.embed_tokens" if cfg.tie_word_embeddings else "lm_head"
    cap = cfg.final_logit_softcapping
    c_tile = [counter(f"logits.tile{t}") for t in range(len(_tiles(V, tile)))] if cap else []
    logits = product(-1, "logits", final, weight(head), V, c_final, 1, c_tile if cap else -1)
    if cap:
        raw, logits = logits, buf("capped", V)
        for t, (s, e) in enumerate(_tiles(V, tile)):
            emit(SOFTCAP, -1, t, Span(logits, s, e), [Span(raw, s, e)], wait=c_tile[t],
                 expected=1)
    return Schedule(rows, tile, kv_splits, capacities, buffers, counters, weights, out,
                    logits)


def split_slots(capacity: int, kv_splits: int, split: int) -> tuple[int, int]:
    """The cache slots [first, stop) of split ``split`` of ``kv_splits`` over a layer's
    ``capacity`` slots: equal blocks of ceil(capacity / kv_splits), the last shorter."""
    block = math.ceil(capacity / kv_splits)
    return min(split * block, capacity), min((split + 1) * block, capacity)
