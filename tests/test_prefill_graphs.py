"""A prompt prefilled at a fixed padded length into any slot (`runtime.prefill_graphs`).

On the CPU, eagerly (`PaddedPrefill`): for prompts of several lengths into several slots
of Gemma-3-shaped (sliding ring + full layers) and Llama-shaped models, 4-bit weights,
dense and 4-bit KV, the pass gives bit for bit what today's right-padded prefill of the
same length gives (the logits at the last real token, every kept cache slot, the lengths)
and writes no other slot; the greedy steps after it read the same bits (the pad tokens it
writes past the prompt are never read); several prompts in a row into different slots
each land as alone. In the fast tier under the interpreter the same holds. Against an
exact-length prefill: the same first token and continuation, the logits equal to
float32 rounding (not bitwise: the CPU's BLAS and reductions sum a row in another order
at another row count, as a batched right-padded prefill's rows already do). The engine's
``prefill_buckets`` serve the tokens the default path serves. On the GPU (marked
`gpu`): the graph's replay gives the eager pass's logits and cache bit for bit, several
prompts in a row into different slots, without a host sync; the engine with graphs
serves the eager engine's tokens.
"""

import pytest
import torch

from qfuse import levers
from qfuse.bench.e2e import random_model
from qfuse.quant import QuantizedTensor
from qfuse.runtime.cache import KVCache
from qfuse.runtime.paged_cache import PagedKVCache
from qfuse.runtime.prefill_graphs import GraphedPrefill, PaddedPrefill, fitting

from .engine_jobs import submit
from .small_models import GEMMA3

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 128,
         "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 64}
SLOTS, MAX_TOKENS = 4, 80
# (KV bits, padded length, prompt tokens, slot): a ring of 8 slots under prompts shorter
# and longer than it, one token, a prompt that fills its length; a dense cache too.
CASES = [(4, 16, 5, 0), (4, 16, 16, 3), (4, 64, 1, 1), (4, 64, 40, 2), (4, 32, 9, 3),
         (0, 16, 5, 0), (0, 64, 40, 2)]


@pytest.fixture(scope="module", params=["gemma", "llama"])
def model(request):
    torch.manual_seed(0)
    return random_model(GEMMA3 if request.param == "gemma" else LLAMA, 4, "cpu",
                        torch.float32)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cache(model, bits: int, device="cpu") -> KVCache:
    return KVCache(model.config, SLOTS, MAX_TOKENS, model.dtype, device, bits, 64)


def _stores(layer) -> list[torch.Tensor]:
    parts = []
    for t in (layer.k, layer.v):
        parts += [t.packed, t.scales, t.biases] if isinstance(t, QuantizedTensor) else [t]
    return parts


def _kept(layer, n: int) -> torch.Tensor:
    """The slots of a layer's row that hold a prompt of n tokens' kept positions."""
    first = max(0, n - layer.capacity) if layer.ring else 0
    return torch.tensor([p % layer.capacity for p in range(first, n)])


def _todays(model, cache, ids: list[int], L: int, slot: int) -> torch.Tensor:
    """Today's prefill of ``ids`` right-padded to L, through a view of the slot's row."""
    batch = torch.zeros(1, L, dtype=torch.int64, device=cache.lengths.device)
    batch[0, : len(ids)] = torch.tensor(ids)
    lengths = torch.tensor([len(ids)], device=cache.lengths.device)
    with torch.no_grad():
        return model(batch, lengths, cache.rows(slot, slot + 1), logits="last")


def _steps(model, cache, slot: int, first: torch.Tensor, n: int = 3) -> list[torch.Tensor]:
    """n greedy decode steps of the slot's row from ``first`` (logits [1, V]): each
    step's logits."""
    out, token = [], first.argmax(-1)
    with torch.no_grad():
        for _ in range(n):
            logits = model.decode(token, cache.rows(slot, slot + 1))
            out.append(logits)
            token = logits.argmax(-1)
    return out


def _assert_slot_as_todays(fixed: KVCache, todays: KVCache, slot: int, n: int):
    assert fixed.host_lengths[slot] == todays.host_lengths[slot] == n
    assert fixed.lengths[slot].item() == todays.lengths[slot].item() == n
    for a, b in zip(fixed.layers, todays.layers):
        kept = _kept(a, n)
        for x, y in zip(_stores(a), _stores(b)):
            assert torch.equal(x[slot][:, kept], y[slot][:, kept])


def _check_as_todays(model, bits: int, L: int, n: int, slot: int):
    fixed_cache, todays_cache = _cache(model, bits), _cache(model, bits)
    ids = _ids(n, seed=n)
    fixed = PaddedPrefill(model, fixed_cache, L)(ids, slot)
    todays = _todays(model, todays_cache, ids, L, slot)
    assert torch.equal(fixed, todays)
    _assert_slot_as_todays(fixed_cache, todays_cache, slot, n)
    others = [r for r in range(SLOTS) if r != slot]
    for layer in fixed_cache.layers:  # no other slot written
        assert not any(t[others].any() for t in _stores(layer))
    assert [fixed_cache.host_lengths[r] for r in others] == [0] * len(others)
    # The steps after it attend the same bits: the pads it wrote are never read.
    for a, b in zip(_steps(model, fixed_cache, slot, fixed),
                    _steps(model, todays_cache, slot, todays)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bits,L,n,slot", CASES)
def test_fixed_prefill_is_todays_padded_prefill_bit_for_bit(model, bits, L, n, slot):
    with levers.use_tier("compat"):
        _check_as_todays(model, bits, L, n, slot)


def test_fixed_prefill_in_the_fast_tier_under_the_interpreter(model):
    pytest.importorskip("triton")
    if not levers.interpreter_active():
        pytest.skip("the interpreter's case (a GPU runs the graph's tests)")
    with levers.use_tier("fast"):
        _check_as_todays(model, 4, 16, 11, 2)
    assert levers.counters().get("kv_append", 0) > 0  # the kernel wrote the cache


def test_prompts_in_a_row_into_different_slots_land_as_alone(model):
    """One fixed prefill serves prompts one after another into slots in any order,
    the same slot again with a shorter prompt too; each slot then holds what a prefill
    of its prompt alone into a fresh cache holds."""
    with levers.use_tier("compat"):
        fixed_cache = _cache(model, 4)
        prefill = PaddedPrefill(model, fixed_cache, 32)
        order = [(2, 30), (0, 7), (3, 19), (2, 4)]  # slot 2 again, shorter
        firsts = {slot: prefill(_ids(n, seed=slot * 100 + n), slot) for slot, n in order}
        for slot, n in dict(order).items():
            alone = _cache(model, 4)
            assert torch.equal(firsts[slot], _todays(model, alone, _ids(n, slot * 100 + n),
                                                     32, slot))
            _assert_slot_as_todays(fixed_cache, alone, slot, n)


@pytest.mark.parametrize("L,n,slot", [(16, 5, 0), (64, 40, 2), (32, 9, 3)])
def test_fixed_prefill_against_an_exact_length_prefill(model, L, n, slot):
    """The first token and the greedy steps after it as an exact-length prefill's; the
    logits equal to float32 rounding (torch's default tolerances for float32)."""
    ids = _ids(n, seed=n)
    with levers.use_tier("compat"):
        fixed_cache, exact_cache = _cache(model, 4), _cache(model, 4)
        fixed = PaddedPrefill(model, fixed_cache, L)(ids, slot)
        exact = _todays(model, exact_cache, ids, n, slot)
        torch.testing.assert_close(fixed, exact)
        assert fixed.argmax().item() == exact.argmax().item()
        a = _steps(model, fixed_cache, slot, fixed)
        b = _steps(model, exact_cache, slot, exact)
    assert [x.argmax().item() for x in a] == [y.argmax().item() for y in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_refusals(model):
    cache = _cache(model, 4)
    prefill = PaddedPrefill(model, cache, 16)
    with pytest.raises(ValueError, match="does not fit a prefill of 16"):
        prefill(_ids(17, 0), 0)
    with pytest.raises(ValueError, match="does not fit"):
        prefill([], 0)
    with pytest.raises(ValueError, match="slot must lie in"):
        prefill(_ids(3, 0), SLOTS)
    assert cache.host_lengths == [0] * SLOTS  # refused before anything changed
    with pytest.raises(ValueError, match="max_tokens"):
        PaddedPrefill(model, cache, MAX_TOKENS + 1)
    with pytest.raises(TypeError, match="whole slotted KVCache"):
        PaddedPrefill(model, cache.rows(1, 2), 16)
    paged = PagedKVCache(model.config, 2, 32, model.dtype, "cpu", page_size=8)
    with pytest.raises(TypeError, match="whole slotted KVCache"):
        PaddedPrefill(model, paged, 16)
    with pytest.raises(TypeError, match="runs a Decoder"):
        PaddedPrefill(object(), cache, 16)
    prefills = {L: object() for L in (64, 16, 32)}
    assert fitting(prefills, 16) is prefills[16] and fitting(prefills, 17) is prefills[32]
    assert fitting(prefills, 65) is None


def _serve(model, tokenizer, prompts: list[str], **kw) -> tuple[list[list[int]], object]:
    """Each prompt's greedy tokens through an engine, one request at a time (so each is
    prefilled alone), and the engine."""
    from qfuse.serving.engine import Engine

    engine = Engine(model, tokenizer, max_batch=2, context=200, kv_bits=4, **kw)
    engine.start()
    try:
        out = []
        for prompt in prompts:
            streams = submit(engine, tokenizer, [(prompt, 6, {})])
            assert streams.done.wait(60)
            out.append(streams.tokens[0])
        return out, engine
    finally:
        engine.stop()


def test_engine_prefill_buckets_serve_the_default_tokens(tiny_loaded):
    model, tokenizer = tiny_loaded
    prompts = ["def add(a, b):", "import os\nprint(os.getcwd())\n" * 3, "x = 1\n" * 40]
    with levers.use_tier("compat"):
        default, _ = _serve(model, tokenizer, prompts)
        bucketed, engine = _serve(model, tokenizer, prompts, prefill_buckets=(16, 64, 512))
    assert bucketed == default and all(len(t) == 6 for t in default)
    # 512 is past the context of 200: dropped; the third prompt (> 64 tokens) went eager.
    assert engine.prefill_buckets == (16, 64)
    assert engine.prefill.fixed_runs == 2


def test_engine_refuses_prefill_buckets_on_pages(tiny_loaded):
    from qfuse.serving.engine import Engine

    model, tokenizer = tiny_loaded
    with pytest.raises(ValueError, match="slotted KV cache"):
        Engine(model, tokenizer, kv_page_size=16, prefill_buckets=(64,))
    with pytest.raises(ValueError, match="positive lengths"):
        Engine(model, tokenizer, prefill_buckets=(0,))


# ---- on the GPU: graphs ----

@pytest.mark.gpu
@pytest.mark.parametrize("kv_bits", [0, 4])
def test_graph_replays_the_eager_pass_prompts_in_a_row(kv_bits):
    """Replayed from one graph per length, prompts of several lengths into different
    slots, one after another: each call's logits and the whole cache bit for bit those of
    the eager pass at the same length, and the replay side makes no host sync."""
    torch.manual_seed(0)
    model = random_model(GEMMA3, 4, "cuda")  # bf16, held as a loaded model's weights
    with levers.use_tier("fast"), torch.no_grad():
        eager_cache = _cache(model, kv_bits, "cuda")
        graph_cache = _cache(model, kv_bits, "cuda")
        eager = {L: PaddedPrefill(model, eager_cache, L) for L in (16, 64)}
        graphs = {L: GraphedPrefill(model, graph_cache, L) for L in (16, 64)}
        for slot, n in [(2, 40), (0, 5), (3, 16), (2, 9), (1, 64)]:
            ids = _ids(n, seed=slot + n)
            want = fitting(eager, n)(ids, slot)
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = fitting(graphs, n)(ids, slot)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert torch.equal(got, want), (slot, n)
            assert graph_cache.host_lengths == eager_cache.host_lengths
            assert torch.equal(graph_cache.lengths, eager_cache.lengths)
            for a, b in zip(graph_cache.layers, eager_cache.layers):
                for x, y in zip(_stores(a), _stores(b)):
                    assert torch.equal(x, y), (slot, n)


@pytest.mark.gpu
def test_graph_capture_leaves_slot_zero_as_it_was():
    """A graph made while slot 0 holds a prompt leaves that prompt's cache and length."""
    torch.manual_seed(0)
    model = random_model(GEMMA3, 4, "cuda")
    with levers.use_tier("fast"), torch.no_grad():
        cache = _cache(model, 4, "cuda")
        PaddedPrefill(model, cache, 64)(_ids(30, 1), 0)
        before = [t.clone() for layer in cache.layers for t in _stores(layer)]
        lengths = cache.lengths.clone()
        GraphedPrefill(model, cache, 64)
        after = [t for layer in cache.layers for t in _stores(layer)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert torch.equal(cache.lengths, lengths) and cache.host_lengths[0] == 30


@pytest.mark.gpu
def test_engine_with_prefill_graphs_serves_the_eager_engines_tokens():
    import qfuse

    model, tokenizer = qfuse.load(progress=False)
    prompts = ["def add(a, b):", "import os\nprint(os.getcwd())\n" * 3, "class Stack:\n" * 12]
    eager, _ = _serve(model, tokenizer, prompts, prefill_buckets=(16, 64))
    graphed, engine = _serve(model, tokenizer, prompts, prefill_buckets=(16, 64),
                             cuda_graph=True)
    assert graphed == eager and engine.prefill.fixed_runs == 3
