"""A prefill continued at an offset (`Decoder.forward(..., past=)`, what the serving engine's
chunked prefill calls): chunks after chunks give the whole prompt's logits and KV entries
up to rounding, across a sliding window's ring; the cache reads back what it stores; the
attention mask of a chunk; and the calls that cannot work are refused."""

import pytest
import torch

import qfuse
from qfuse.reference import prompt_mask
from qfuse.runtime.cache import KVCache
from qfuse.runtime.prompts import encode_prompts

# 200 tokens: past the bundled model's sliding window (128), so its ring layers wrap.
LONG = "class Stack:\n" * 40


@pytest.fixture(scope="module")
def loaded():
    # On the CPU in float32 wherever the tests run: the caches are built there and
    # compared to 1e-4.
    return qfuse.load(device="cpu", progress=False)


def _chunked(model, ids, cache, chunk):
    """The logits [1, len(ids), V] of ``ids`` prefilled ``chunk`` tokens at a time."""
    with torch.no_grad():
        return torch.cat([model(torch.tensor([ids[s: s + chunk]]), None, cache, past=s)
                          for s in range(0, len(ids), chunk)], 1)


@pytest.mark.parametrize("chunk", [16, 100, 129])  # 129: a chunk longer than the window
def test_chunks_give_the_whole_prompts_logits_and_cache(loaded, chunk):
    model, tokenizer = loaded
    ids = encode_prompts(tokenizer, [LONG])[0]
    assert len(ids) == 200 and model.config.sliding_window == 128
    whole, parts = (KVCache(model.config, 1, 1024, model.dtype, "cpu") for _ in range(2))
    with torch.no_grad():
        expected = model(torch.tensor([ids]), None, whole)
    got = _chunked(model, ids, parts, chunk)
    # Not bit for bit on a CPU: MKL sums a product's rows in an order that depends on how
    # many rows it has (the MLP's down projection, over 16 rows and over 200, differs).
    assert torch.allclose(got, expected, rtol=0, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))  # every position's greedy token
    assert parts.host_lengths == [200] and parts.lengths.tolist() == [200]
    for a, b in zip(parts.layers, whole.layers):
        assert a.ring == (a.capacity == 128)
        assert torch.allclose(a.k, b.k, rtol=0, atol=1e-4)
        assert torch.allclose(a.v, b.v, rtol=0, atol=1e-4)


def test_a_quantized_cache_reads_back_what_it_stores_across_the_ring(loaded):
    model, _ = loaded
    cache = KVCache(model.config, 2, 512, model.dtype, "cpu", bits=4, group_size=32)
    ring = next(layer for layer in cache.layers if layer.ring)
    torch.manual_seed(0)
    k, v = (torch.randn(2, model.config.num_key_value_heads, 300, model.config.head_dim)
            for _ in range(2))
    ring.write_prompt(k[:, :, :200], v[:, :, :200], [200, 200])
    ring.write_prompt(k[:, :, 200:], v[:, :, 200:], [300, 300], past=200)
    got_k, got_v = ring.read(180, 300, model.dtype)  # positions 180..299, slots wrap at 128
    slots = torch.arange(180, 300) % 128
    assert torch.equal(got_k, ring.k.dequantize(model.dtype)[:, :, slots])
    assert torch.equal(got_v, ring.v.dequantize(model.dtype)[:, :, slots])
    # Each stored entry is its position's key, quantized (error well under the values' scale).
    assert (got_k - k[:, :, 180:]).abs().max() < 0.5
    with pytest.raises(ValueError, match="do not fit a ring of 128"):
        ring.read(100, 300, model.dtype)


def test_a_chunks_mask_sees_the_cached_keys_within_the_window():
    # Two queries after 3 cached keys, window 2, the second query padding: it sees the
    # prompt within its window, and itself.
    mask = prompt_mask(torch.tensor([1]), 2, window=2, past=3)
    assert mask.tolist() == [[[False, False, True, True, False],
                              [False, False, False, True, True]]]
    whole = prompt_mask(torch.tensor([3, 2]), 3)
    causal = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    assert torch.equal(whole[0], causal)
    assert torch.equal(whole[1], causal & torch.tensor([True, True, False]) | torch.eye(3).bool())


def test_calls_that_cannot_continue_a_prefill_are_refused(loaded):
    model, _ = loaded
    cache = KVCache(model.config, 1, 64, model.dtype, "cpu")
    with pytest.raises(ValueError, match="needs a cache"):
        model(torch.tensor([[1, 2]]), past=4)
    with pytest.raises(ValueError, match="a prompt of 66 tokens does not fit a cache of 64"):
        model(torch.tensor([[1, 2]]), None, cache, past=64)


@pytest.mark.parametrize("window", [None, 24])
def test_a_chunks_attention_takes_the_fast_path_and_agrees_with_the_reference(window,
                                                                              monkeypatch):
    """`ops.prompt_attention` over more keys than queries (a chunk after cached tokens)
    runs SDPA with the chunk's mask, so no float scores of every query and key are made
    (the fast tier on the CPU: under the interpreter, as the kernels' CPU tests run)."""
    from qfuse import levers, ops, reference

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("QFUSE_TIER", "fast")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 16, 32, generator=g)
    k, v = (torch.randn(2, 2, 16 + 40, 32, generator=g) for _ in range(2))
    lengths = torch.tensor([16, 9])
    levers.reset_counters()
    got = ops.prompt_attention(q, k, v, lengths, 32**-0.5, window)
    assert levers.counters().get("prefill_sdpa") == 1
    want = reference.prompt_attention(q, k, v, lengths, 32**-0.5, window)
    # rows past a prompt's length are ignored by the model
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, :, :9], want[1, :, :9], rtol=1e-5, atol=1e-5)


def test_a_pass_makes_each_windows_mask_once(monkeypatch):
    """The layers of one pass share their masks (``masks``): one per window and query
    stacking, and the same output as a mask made for the call alone."""
    from qfuse import ops, reference

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("QFUSE_TIER", "fast")
    made = []
    real = reference.prompt_mask
    monkeypatch.setattr(reference, "prompt_mask", lambda *a: made.append(a) or real(*a))
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 16, 32, generator=g)
    k, v = (torch.randn(2, 2, 16, 32, generator=g) for _ in range(2))
    lengths = torch.tensor([16, 9])
    masks: dict = {}
    for window in (None, 8, None, 8, None):  # the layers of a pass, two kinds
        got = ops.prompt_attention(q, k, v, lengths, 32**-0.5, window, masks=masks)
        alone = ops.prompt_attention(q, k, v, lengths, 32**-0.5, window)
        assert torch.equal(got, alone)
    assert len(made) == 2 + 5  # once per window with the shared dict, once per call without


def test_logits_for_the_last_token_or_none(loaded):
    """`logits="last"` is each row's last real position of the full logits (a padded
    batch: rows of different lengths), `"none"` returns nothing; others are refused."""
    model, _ = loaded
    ids = torch.randint(0, 100, (2, 12))
    lengths = torch.tensor([12, 7])
    with torch.no_grad():
        full = model(ids, lengths)
        last = model(ids, lengths, logits="last")
        assert model(ids, lengths, logits="none") is None
    want = full[torch.arange(2), lengths - 1]
    # the head's product over 2 rows, not 24: MKL's order of sums differs by row count
    assert torch.allclose(last, want, rtol=0, atol=1e-5)
    assert torch.equal(last.argmax(-1), want.argmax(-1))
    with pytest.raises(ValueError, match="logits must be one of"):
        model(ids, lengths, logits="first")
