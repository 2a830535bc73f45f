"""The decode step as instructions (`qfuse.schedule`), proven by the CPU executor
(`qfuse.executor`): every order the counters allow gives the same bits; with one split per
KV head those are `Decoder.decode`'s bits in the compat tier, with several they stay within
a stated rounding bound; a counter off by one, a dropped tile or a duplicated one fails
with its own fault, and `Schedule.verify` finds each statically."""

from __future__ import annotations

import copy
import dataclasses
import functools
from unittest import mock

import pytest
import torch

from qfuse import levers, reference
from qfuse.convert import quantize_model
from qfuse.executor import Deadlock, PrematureRead, Unwritten, WrittenTwice, execute
from qfuse.models.config import ModelConfig
from qfuse.models.decoder import Decoder
from qfuse.runtime.cache import KVCache
from qfuse.schedule import (
    ATTENTION,
    COLUMNS,
    GATED_ACT,
    KV_APPEND,
    MERGE,
    PRODUCT,
    RESIDUAL,
    RMS_NORM,
    ROTATE,
    SOFTCAP,
    decode_schedule,
)

ROWS, MAX_TOKENS = 3, 24
# Gemma 3 (q/k norms, sandwich joints, a sliding ring and a full layer; tests/test_plan.py's
# model), Llama (GQA 2:1, biases, an untied head whose last tile is ragged) and Gemma 2 (both
# soft-caps).
CONFIGS = {
    "gemma3": ({"model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 128,
                "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 64, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"]}, 32, 64),
    "llama": ({"model_type": "llama", "vocab_size": 200, "hidden_size": 128,
               "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": False,
               "attention_bias": True}, 32, 32),
    "gemma2": ({"model_type": "gemma2", "vocab_size": 256, "hidden_size": 128,
                "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 32, "sliding_window": 4,
                "final_logit_softcapping": 30.0, "attn_logit_softcapping": 5.0,
                "query_pre_attn_scalar": 32,
                "layer_types": ["sliding_attention", "full_attention"]}, 16, 32),
}


@functools.cache
def _model(name: str, dtype: torch.dtype = torch.float16, bits: int = 4) -> Decoder:
    raw, _, group = CONFIGS[name]
    torch.manual_seed(0)
    model = Decoder(ModelConfig.from_dict(raw))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model = model.to("cpu", dtype)
    return quantize_model(model, bits, group) if bits else model


def _prefilled(name: str, dtype=torch.float16, bits=4, kv_bits=4, seed=0, rows=ROWS):
    """(model, cache after a prefill of ``rows`` prompts, the next tokens): rows of 10,
    5 and 1 tokens, so the sliding layers' rings have wrapped for the first row only."""
    model = _model(name, dtype, bits)
    cache = KVCache(model.config, rows, MAX_TOKENS, dtype, "cpu", kv_bits, CONFIGS[name][2])
    prompts = torch.randint(0, 200, (rows, 10), generator=torch.Generator().manual_seed(seed))
    lengths = torch.tensor([10, 5, 1][:rows])
    with levers.use_tier("compat"), torch.no_grad():
        tokens = model(prompts, lengths, cache=cache, logits="last").argmax(-1)
    return model, cache, tokens


def _schedule(name, model, kv_splits=1, rows=ROWS):
    return decode_schedule(model, rows, MAX_TOKENS, CONFIGS[name][1], kv_splits)


def _plain(model, cache, tokens, act_tile=None):
    """Decoder.decode in the compat tier, on a copy of the cache: (logits, cache after);
    with ``act_tile``, its gated activation computed in slices of that many columns, as
    the schedule's tiles compute it."""
    cache = copy.deepcopy(cache)
    whole = reference.gated_act

    def tiled(a, b, act):
        return torch.cat([whole(a[..., s:s + act_tile], b[..., s:s + act_tile], act)
                          for s in range(0, a.shape[-1], act_tile)], -1)

    with levers.use_tier("compat"), torch.no_grad(), \
            mock.patch.object(reference, "gated_act", tiled if act_tile else whole):
        return model.decode(tokens, cache), cache


def _run(schedule, model, cache, tokens, **kw):
    with torch.no_grad():
        return execute(schedule, model, tokens, copy.deepcopy(cache), **kw)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("kv_splits", [1, 3])
def test_every_order_the_counters_allow_gives_the_same_bits(name, kv_splits):
    model, cache, tokens = _prefilled(name)
    schedule = _schedule(name, model, kv_splits)
    first = _run(schedule, model, cache, tokens, n_sms=1)
    orders = [(n, seed) for n in (2, 7, len(schedule.instructions)) for seed in range(4)]
    for n_sms, seed in orders:
        got = _run(schedule, model, cache, tokens, n_sms=n_sms, seed=seed)
        assert torch.equal(got, first), (n_sms, seed)
    assert torch.isfinite(first).all()


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits,kv_bits,rows", [(0, 0, 3), (4, 4, 3), (0, 4, 3), (4, 4, 1)])
def test_one_split_per_kv_head_gives_the_plain_decode_bitwise(name, dtype, bits, kv_bits,
                                                               rows):
    """Product tiles, per-head norms/RoPE/appends and the one-split attention are the
    compat ops on slices; on the CPU each is bitwise the slice of the whole op, except
    the activation's transcendental function in narrow tiles (a tile computed in
    ATen's scalar tail instead of its vector loop; measured on an AVX2 CPU: GELU-tanh
    over 16-wide fp16 tiles, rare elements, one prompt of three of the Gemma 2 model;
    32-wide tiles matched everywhere): the plain path here computes its activation in
    the same tiles."""
    model, cache, tokens = _prefilled(name, dtype, bits, kv_bits, rows=rows)
    want, want_cache = _plain(model, cache, tokens, act_tile=CONFIGS[name][1])
    after = copy.deepcopy(cache)
    with torch.no_grad():
        got = execute(_schedule(name, model, rows=rows), model, tokens, after, n_sms=5,
                      seed=3)
    assert torch.equal(got, want)
    # The cache advanced as the plain step advanced it: the appended K/V, the lengths.
    assert torch.equal(after.lengths, want_cache.lengths)
    for mine, theirs in zip(after.layers, want_cache.layers):
        for x, y in zip(_stores(mine), _stores(theirs)):
            assert torch.equal(x, y)


def _stores(layer):
    """The tensors a layer's cache keeps (a quantized store: words, scales, biases)."""
    out = []
    for t in (layer.k, layer.v):
        out += [t] if isinstance(t, torch.Tensor) else [t.packed, t.scales, t.biases]
    return out


# With several splits, each split's exp(s - m) is rounded to the model dtype against its own
# maximum before the value product, and the merge rescales in float32: not the plain path's
# rounding. Measured over the three models, fp16/bf16/fp32, dense and 4-bit weights and
# KV, three prompts, 2-4 splits: at most 5.6·eps·max|logit| (Gemma 2, fp16); bound: 8.
SPLIT_BOUND = 8


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_splits", [2, 4])
def test_split_attention_stays_within_rounding_of_the_plain_decode(name, dtype, kv_splits):
    model, cache, tokens = _prefilled(name, dtype)
    want, _ = _plain(model, cache, tokens, act_tile=CONFIGS[name][1])
    got = _run(_schedule(name, model, kv_splits), model, cache, tokens, n_sms=5, seed=3)
    bound = SPLIT_BOUND * torch.finfo(dtype).eps * want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= bound


def test_the_schedule_verifies_and_its_tables_hold_every_instruction():
    for name in CONFIGS:
        model = _model(name)
        for kv_splits in (1, 3):
            schedule = _schedule(name, model, kv_splits)
            schedule.verify()
            tables = schedule.sm_tables(7)
            assert all(t.dtype == torch.int32 and t.shape[1] == len(COLUMNS) for t in tables)
            dealt = sorted(i for lst in schedule.sm_lists(7) for i in lst)
            assert dealt == list(range(len(schedule.instructions)))
            assert sum(len(t) for t in tables) == len(schedule.instructions)


def test_tiles_that_would_straddle_a_head_are_refused():
    with pytest.raises(ValueError, match="must divide head_dim"):
        decode_schedule(_model("llama"), ROWS, MAX_TOKENS, tile=48)


# ---- planted faults -------------------------------------------------------------------

def _first(schedule, op, layer=0):
    return next(i for i, ins in enumerate(schedule.instructions)
                if ins.op == op and ins.layer == layer and ins.wait >= 0)


def _with(schedule, index, **changes):
    faulty = copy.copy(schedule)
    faulty.instructions = list(schedule.instructions)
    faulty.instructions[index] = dataclasses.replace(schedule.instructions[index], **changes)
    return faulty


def _without(schedule, index):
    faulty = copy.copy(schedule)
    faulty.instructions = schedule.instructions[:index] + schedule.instructions[index + 1:]
    return faulty


# Each op that waits, in the model that has it (Gemma 2's soft-cap).
WAITING_OPS = [("gemma3", op) for op in (RMS_NORM, PRODUCT, ROTATE, KV_APPEND, ATTENTION,
                                         MERGE, RESIDUAL, GATED_ACT)] + [("gemma2", SOFTCAP)]


@pytest.mark.parametrize("name,op", WAITING_OPS)
def test_a_counter_one_too_low_reads_an_incomplete_tile(name, op):
    """Every SM holding one instruction and the latest ready one run first: an instruction
    whose count is one short runs before its last input tile is stored."""
    model, cache, tokens = _prefilled(name)
    schedule = _schedule(name, model, kv_splits=2)
    i = _first(schedule, op, layer=-1 if op == SOFTCAP else 0)
    faulty = _with(schedule, i, expected=schedule.instructions[i].expected - 1)
    with pytest.raises(ValueError, match="waits for"):
        faulty.verify()
    with pytest.raises(PrematureRead, match=f"#{i} "):
        _run(faulty, model, cache, tokens, n_sms=len(faulty.instructions), seed=None)


def test_a_premature_read_shows_as_nan_without_the_read_check():
    """On a GPU nothing checks reads: the NaN an unwritten tile holds must reach the logits
    (a dense cache: a 4-bit append refuses to quantize NaN)."""
    model, cache, tokens = _prefilled("gemma3", kv_bits=0)
    schedule = _schedule("gemma3", model)
    i = _first(schedule, MERGE)
    faulty = _with(schedule, i, expected=0)  # the merge may run before its partials
    got = _run(faulty, model, cache, tokens, n_sms=len(faulty.instructions), seed=None,
               check_reads=False)
    assert torch.isnan(got).all()
    assert torch.isfinite(_run(schedule, model, cache, tokens, n_sms=len(faulty.instructions),
                               seed=None, check_reads=False)).all()


@pytest.mark.parametrize("op", [RMS_NORM, PRODUCT, ATTENTION, RESIDUAL])
def test_a_counter_one_too_high_deadlocks(op):
    model, cache, tokens = _prefilled("llama")
    schedule = _schedule("llama", model)
    i = _first(schedule, op)
    faulty = _with(schedule, i, expected=schedule.instructions[i].expected + 1)
    with pytest.raises(ValueError, match="waits for"):
        faulty.verify()
    for n_sms in (1, 4):
        with pytest.raises(Deadlock, match=f"#{i} "):
            _run(faulty, model, cache, tokens, n_sms=n_sms)


def test_a_head_tile_missing_from_the_list_leaves_the_logits_unwritten():
    model, cache, tokens = _prefilled("gemma3")  # no soft-cap: nothing waits for the head
    schedule = _schedule("gemma3", model)
    last = len(schedule.instructions) - 1
    assert schedule.instructions[last].op == PRODUCT and schedule.instructions[last].layer == -1
    faulty = _without(schedule, last)
    with pytest.raises(ValueError, match="written by no instruction"):
        faulty.verify()
    with pytest.raises(Unwritten, match="logits: columns 224..255"):
        _run(faulty, model, cache, tokens)


def test_a_tile_missing_inside_a_layer_deadlocks_its_reader():
    model, cache, tokens = _prefilled("gemma3")
    schedule = _schedule("gemma3", model)
    faulty = _without(schedule, _first(schedule, GATED_ACT))  # down waits for every tile
    with pytest.raises(Deadlock, match="product layer 0"):
        _run(faulty, model, cache, tokens)


def test_a_tile_missing_with_its_reader_counting_one_less_reads_it_unwritten():
    model, cache, tokens = _prefilled("gemma3")
    schedule = _schedule("gemma3", model)
    act = _first(schedule, GATED_ACT)
    down = next(i for i, ins in enumerate(schedule.instructions)
                if ins.wait == schedule.instructions[act].signal)
    fewer = _with(schedule, down, expected=schedule.instructions[down].expected - 1)
    faulty = _without(fewer, act)
    with pytest.raises(PrematureRead, match="reads act.0"):
        _run(faulty, model, cache, tokens)


def test_a_tile_listed_twice_is_stored_twice():
    model, cache, tokens = _prefilled("llama")
    schedule = _schedule("llama", model)
    i = _first(schedule, PRODUCT)
    faulty = copy.copy(schedule)
    faulty.instructions = schedule.instructions[:i + 1] + schedule.instructions[i:]
    with pytest.raises(ValueError, match="twice"):
        faulty.verify()
    with pytest.raises(WrittenTwice, match="qkv.0"):
        _run(faulty, model, cache, tokens, n_sms=1)
