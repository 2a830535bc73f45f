"""The bundled default model decoding on a `PagedKVCache` as on the slotted `KVCache`:
`generate` gives the same greedy tokens (dense and 4-bit KV) for a prompt past the
sliding window; a prefill, chunked or whole, and the decode steps after it give the
same logits; a cache out of pages refuses the step in one line and changes nothing;
`generate` refuses the requests a paged cache cannot serve before any compute."""

import pytest
import torch

import qfuse
from qfuse.errors import RequestError
from qfuse.runtime.cache import KVCache
from qfuse.runtime.generation import Summary, generate
from qfuse.runtime.paged_cache import OutOfPages, PagedKVCache
from qfuse.runtime.prompts import encode_prompts, pad_prompts

# 200 tokens: past the bundled model's sliding window (128), so the slotted cache's ring
# layers wrap while the paged ones drop their first pages.
LONG = "class Stack:\n" * 40
SHORT = "def add(a, b):"


@pytest.fixture(scope="module")
def loaded():
    # On the CPU in float32 wherever the tests run: they compare caches to 1e-4 and
    # build them on the CPU (the GPU's bf16 decode is checked on its own below).
    return qfuse.load(device="cpu", progress=False)


def _steps(model, cache, batch, lengths, n):
    """Logits [B, V] of the prefill's last tokens, then of ``n`` greedy decode steps."""
    out = []
    with torch.no_grad():
        logits = model(batch, lengths, cache, logits="last")
        out.append(logits)
        for _ in range(n):
            logits = model.decode(logits.argmax(-1), cache)
            out.append(logits)
    return torch.stack(out)


def _run(model, tokenizer, **kw):
    """(tokens of each step, their log-probabilities [steps, B, V]) of a greedy generate."""
    events = list(generate(model, tokenizer, [LONG, SHORT], max_tokens=6, logprobs=True,
                           **kw))
    assert isinstance(events[-1], Summary)
    steps = events[:-1]
    return [s.tokens for s in steps], torch.stack([s.logprobs for s in steps])


@pytest.mark.parametrize("kv_bits", [0, 4])
def test_generate_on_pages_gives_the_slotted_caches_greedy_tokens(loaded, kv_bits):
    model, tokenizer = loaded
    assert model.config.sliding_window == 128
    slotted, slotted_lp = _run(model, tokenizer, kv_bits=kv_bits)
    paged, paged_lp = _run(model, tokenizer, kv_bits=kv_bits, kv_page_size=16)
    assert len(slotted) == 6 and paged == slotted
    # Not bit for bit: once the ring wraps it holds the window's keys in ring order (slot
    # = position mod 128), the paged cache in position order, and the attention sums its
    # float32 products in that order (within the window both are bitwise equal: below).
    assert torch.allclose(paged_lp, slotted_lp, rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_bits", [0, 4])
def test_on_the_gpu_pages_give_the_slotted_caches_greedy_tokens(kv_bits):
    """bf16 on CUDA: the paged cache's attention kernels (through the block table) and
    the slotted cache's give the same greedy tokens; the first step, from the prefill
    alone, is bitwise the same (decode steps sum the attention in other orders)."""
    model, tokenizer = qfuse.load(progress=False)
    slotted, slotted_lp = _run(model, tokenizer, kv_bits=kv_bits)
    paged, paged_lp = _run(model, tokenizer, kv_bits=kv_bits, kv_page_size=16)
    assert len(slotted) == 6 and paged == slotted
    assert torch.equal(paged_lp[0], slotted_lp[0])


def test_within_the_window_paged_decoding_is_bitwise_the_slotted(loaded):
    model, tokenizer = loaded
    batch, lengths = pad_prompts(encode_prompts(tokenizer, [SHORT, "import os\nprint("]),
                                 "cpu")
    # 40 tokens in all: the sliding layers hold every token, no ring wraps.
    slotted = KVCache(model.config, 2, 40, model.dtype, "cpu")
    paged = PagedKVCache(model.config, 2, 40, model.dtype, "cpu", page_size=8)
    expected = _steps(model, slotted, batch, lengths, 8)
    got = _steps(model, paged, batch, lengths, 8)
    assert torch.equal(got, expected)
    assert paged.host_lengths == slotted.host_lengths
    assert torch.equal(paged.lengths, slotted.lengths)


@pytest.mark.parametrize("chunk", [16, 50, 129])  # 129: a chunk longer than the window
def test_a_chunked_prefill_on_pages_is_the_slotted_one(loaded, chunk):
    model, tokenizer = loaded
    ids = encode_prompts(tokenizer, [LONG])[0]
    slotted = KVCache(model.config, 1, 256, model.dtype, "cpu")
    # chunk_tokens: the sliding layers hold the window and a whole chunk at once.
    paged = PagedKVCache(model.config, 1, 256, model.dtype, "cpu", page_size=16,
                         chunk_tokens=chunk)
    logits = {}
    with torch.no_grad():
        for name, cache in (("slotted", slotted), ("paged", paged)):
            parts = [model(torch.tensor([ids[s: s + chunk]]), None, cache, past=s)
                     for s in range(0, len(ids), chunk)]
            token = parts[-1][:, -1].argmax(-1)
            for _ in range(3):  # decode steps after the chunks read what they wrote
                parts.append(model.decode(token, cache)[:, None])
                token = parts[-1][:, 0].argmax(-1)
            logits[name] = torch.cat(parts, 1)
    # The chunks: the same products over the same rows in the same order (a chunk's
    # cached keys come back from either cache in position order).
    assert torch.equal(logits["paged"][:, :200], logits["slotted"][:, :200])
    # The decode steps: not bit for bit once the ring wraps, as in generate (above).
    assert torch.equal(logits["paged"].argmax(-1), logits["slotted"].argmax(-1))
    assert torch.allclose(logits["paged"], logits["slotted"], rtol=0, atol=1e-4)
    assert paged.host_lengths == [203] == slotted.host_lengths


def test_out_of_pages_refuses_the_step_and_changes_nothing(loaded):
    model, tokenizer = loaded
    ids = encode_prompts(tokenizer, [LONG])[0][:32]
    # Two pages of 16 for the full-attention layer: the 32-token prompt, no more.
    cache = PagedKVCache(model.config, 1, 256, model.dtype, "cpu", page_size=16, num_pages=2)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), None, cache, logits="last")
        table = cache.groups[None].table.clone()
        with pytest.raises(OutOfPages) as err:
            model.decode(logits.argmax(-1), cache)
        assert "\n" not in str(err.value) and "1 pages needed for window None" in str(err.value)
        assert cache.host_lengths == [32] and cache.lengths.tolist() == [32]
        assert torch.equal(cache.groups[None].table, table)
        # A prefill that does not fit is refused before the device lengths move.
        cache.release(0)
        with pytest.raises(OutOfPages):
            model(torch.tensor([ids + ids[:1]]), None, cache)
        assert cache.host_lengths == [0] and cache.lengths.tolist() == [0]


def test_a_chunk_longer_than_the_caches_chunk_tokens_runs_out_of_pages(loaded):
    model, tokenizer = loaded
    ids = encode_prompts(tokenizer, [LONG])[0]
    cache = PagedKVCache(model.config, 1, 256, model.dtype, "cpu", page_size=16)
    with torch.no_grad():
        model(torch.tensor([ids[:150]]), None, cache, logits="none")
        with pytest.raises(OutOfPages, match="for window 128"):
            model(torch.tensor([ids[150:]]), None, cache, past=150, logits="none")
    assert cache.host_lengths == [150]


@pytest.mark.parametrize("kw, message", [
    ({"kv_page_size": 16, "kv_pages": 2}, "kv_pages=2 pages of 16 tokens hold fewer"),
    ({"kv_page_size": 12}, "page_size must be a power of two"),
    ({"kv_pages": 4}, "give kv_page_size too"),
])
def test_generate_refuses_what_a_paged_cache_cannot_serve(loaded, kw, message):
    model, tokenizer = loaded
    with pytest.raises(RequestError, match=message):
        next(generate(model, tokenizer, [SHORT], max_tokens=64, **kw))
