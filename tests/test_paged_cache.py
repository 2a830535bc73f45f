"""The paged KV cache: the page allocator's counts, pages that follow the tokens (and the
window), admission and refusals that change nothing, fork and copy-on-write, and a
prompt plus decode steps on it attending exactly as the slotted cache (full layers) and
as the whole token history with the window (sliding layers), dense, 4- and 8-bit."""

from types import SimpleNamespace

import pytest
import torch

from qfuse import ops, reference
from qfuse.quant import QuantizedTensor
from qfuse.runtime.cache import KVCache
from qfuse.runtime.paged_cache import OutOfPages, PageAllocator, PagedKVCache
from qfuse.testing import kernel_device

DEVICE = kernel_device()
CONFIG = SimpleNamespace(layer_types=("full_attention", "sliding_attention"), sliding_window=24,
                         num_key_value_heads=2, head_dim=64)


def test_allocator_counts_and_refusals():
    a = PageAllocator(4)
    assert a.allocate(3) == [0, 1, 2] and a.free_pages == 1
    with pytest.raises(OutOfPages, match="2 pages needed, 1 of 4 free"):
        a.allocate(2)
    assert a.free_pages == 1  # a refusal takes nothing
    a.share([1])
    a.free([1])
    assert a.refcount(1) == 1 and a.free_pages == 1  # still held by its other holder
    a.free([0, 1])
    assert a.free_pages == 3 and a.allocate(1) == [0]  # the lowest free page first
    with pytest.raises(ValueError, match="page 1 is not held"):
        a.free([1])
    with pytest.raises(ValueError, match="num_pages must be a positive integer"):
        PageAllocator(0)


@pytest.mark.parametrize("kwargs,match", [({"page_size": 24}, "page_size must be a power of two"),
                                          ({"page_size": 0}, "page_size must be a positive"),
                                          ({"num_pages": 0}, "num_pages must be a positive"),
                                          ({"bits": 4, "group_size": 48}, "group size")])
def test_bad_sizes_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PagedKVCache(CONFIG, 2, 96, torch.float16, DEVICE, **kwargs)


def test_pages_follow_the_tokens_and_the_window():
    cache = PagedKVCache(CONFIG, 3, 96, torch.float16, DEVICE, page_size=16, num_pages=9)
    full, sliding = cache.groups[None], cache.groups[24]
    assert cache.can_admit(96) and not cache.can_admit(97)
    cache.set_length(0, 50)
    assert sum(p >= 0 for p in full.rows[0]) == 4  # ceil(50 / 16)
    assert [p >= 0 for p in sliding.rows[0]][:4] == [False, True, True, True]  # keeps 26..49
    for _ in range(30):  # decode steps: the sliding row never holds more than its budget
        cache.reserve_step()
        assert sum(p >= 0 for p in sliding.rows[0]) <= -(-24 // 16) + 1  # ceil(window / page) + 1
    assert cache.host_lengths == [80, 30, 30] and full.allocator.free_pages == 9 - 5 - 2 - 2
    assert cache.free_pages == 0 and not cache.can_admit(1)
    table = full.table.clone()
    with pytest.raises(OutOfPages, match="pages needed for window None"):
        cache.set_length(1, 40)  # page 2 of row 1: none free
    assert cache.host_lengths == [80, 30, 30] and torch.equal(full.table, table)  # unchanged
    cache.release(0)
    assert cache.free_pages == 5 and cache.host_lengths == [0, 30, 30]
    assert (full.table[0] == -1).all() and (sliding.table[0] == -1).all()
    cache.set_length(1, 40)
    with pytest.raises(ValueError, match="length 10 outside"):
        cache.set_length(1, 10)


def test_fork_shares_pages_and_copies_before_a_write():
    cache = PagedKVCache(CONFIG, 2, 64, torch.float32, DEVICE, page_size=16)
    full = cache.groups[None]
    cache.set_length(0, 20)
    k = torch.randn(2, 2, 20, 64, device=DEVICE)
    for layer in cache.layers:
        layer.write_prompt(k, k, [20, 0])
    cache.fork(0, 1)
    assert full.rows[1] == full.rows[0] and full.allocator.refcount(full.rows[0][1]) == 2
    before = cache.layers[0].k[full.rows[0][1]].clone()
    cache.set_length(1, 21)  # row 1 writes into page 1: it gets its own copy first
    assert full.rows[1][0] == full.rows[0][0] and full.rows[1][1] != full.rows[0][1]
    assert torch.equal(cache.layers[0].k[full.rows[1][1]], before)  # the copy holds the tokens
    ops.kv_append(torch.ones(2, 2, 64, device=DEVICE)[1:], torch.tensor([20], device=DEVICE,
                  dtype=torch.int32), cache.layers[0].k, block_table=full.table[1:])
    assert torch.equal(cache.layers[0].k[full.rows[0][1]], before)  # row 0's page untouched
    with pytest.raises(ValueError, match="row 1 holds tokens"):
        cache.fork(0, 1)


@pytest.mark.parametrize("bits", [0, 4, 8])
def test_prompt_and_decode_attend_as_the_slotted_cache(bits, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "compat")
    g = torch.Generator(device="cpu").manual_seed(bits)
    lengths, steps, B, N = [0, 37, 50], 9, 3, 96
    T = max(lengths)
    k_all = torch.randn(2, B, 2, T + steps, 64, generator=g).half().to(DEVICE)  # [layer, ...]
    v_all = torch.randn(2, B, 2, T + steps, 64, generator=g).half().to(DEVICE)
    slotted = KVCache(CONFIG, B, N, torch.float16, DEVICE, bits, 32)
    paged = PagedKVCache(CONFIG, B, N, torch.float16, DEVICE, bits, 32, page_size=16)
    for cache in (slotted, paged):
        cache.host_lengths = lengths
        cache.lengths.copy_(torch.tensor(lengths))
        for i, layer in enumerate(cache.layers):
            layer.write_prompt(k_all[i, :, :, :T], v_all[i, :, :, :T], lengths)
    for _ in range(steps):
        for cache in (slotted, paged):
            cache.reserve_step()
        pos = slotted.lengths.long()  # each row's new token: position pos of its history
        for i in range(2):
            new_k = k_all[i][torch.arange(B), :, pos]  # [B, Hkv, D]
            new_v = v_all[i][torch.arange(B), :, pos]
            s_layer, p_layer = slotted.layers[i], paged.layers[i]
            slots = slotted.step_indices()[s_layer.capacity][0]
            positions, _, table = paged.step_indices()[p_layer.window]
            for store, p_store, x in ((s_layer.k, p_layer.k, new_k),
                                      (s_layer.v, p_layer.v, new_v)):
                ops.kv_append(x, slots, store)
                ops.kv_append(x, positions, p_store, block_table=table)
        for cache in (slotted, paged):
            cache.lengths += 1
    L = slotted.lengths
    q = torch.randn(B, 4, 64, generator=g).half().to(DEVICE)
    full_s, full_p = slotted.layers[0], paged.layers[0]
    want = reference.decode_attention(q, full_s.k, full_s.v, L, 0.125)
    got = ops.decode_attention(q, full_p.k, full_p.v, L, 0.125, block_table=full_p.block_table)
    assert torch.equal(got, want)
    # The sliding layer: the whole history with the window (a ring would reorder the sums).
    sliding = paged.layers[1]
    history = [t[1, :, :, :N].clone() for t in (k_all, v_all)]
    history = [torch.nn.functional.pad(h, (0, 0, 0, N - h.shape[2])) for h in history]
    if bits:
        history = [QuantizedTensor.from_float(h, 32, bits) for h in history]
    want = reference.decode_attention(q, *history, L, 0.125, window=24)
    got = ops.decode_attention(q, sliding.k, sliding.v, L, 0.125, window=24,
                               block_table=sliding.block_table)
    assert torch.equal(got, want)
    assert sum(p >= 0 for row in paged.groups[24].rows for p in row) <= B * (-(-24 // 16) + 1)


def test_decode_kernels_on_the_paged_cache_match_the_slotted(monkeypatch):
    """The fast tier (kernels under the interpreter): the same bits as the slotted cache."""
    monkeypatch.setenv("QFUSE_TIER", "fast")
    g = torch.Generator(device="cpu").manual_seed(7)
    lengths, B = [5, 0, 40], 3
    slotted = KVCache(CONFIG, B, 64, torch.float16, DEVICE, 8, 32)
    paged = PagedKVCache(CONFIG, B, 64, torch.float16, DEVICE, 8, 32, page_size=16)
    k = torch.randn(B, 2, 40, 64, generator=g).half().to(DEVICE)
    for cache in (slotted, paged):
        cache.host_lengths = lengths
        cache.lengths.copy_(torch.tensor(lengths))
        cache.layers[0].write_prompt(k, -k, lengths)
        cache.reserve_step()
    x = torch.randn(B, 2, 64, generator=g).half().to(DEVICE)
    positions, attended, table = paged.step_indices()[None]
    ops.kv_append(x, slotted.lengths, slotted.layers[0].k)
    ops.kv_append(x, positions, paged.layers[0].k, block_table=table)
    ops.kv_append(-x, slotted.lengths, slotted.layers[0].v)
    ops.kv_append(-x, positions, paged.layers[0].v, block_table=table)
    q = torch.randn(B, 4, 64, generator=g).half().to(DEVICE)
    want = ops.decode_attention(q, slotted.layers[0].k, slotted.layers[0].v, attended, 0.125)
    got = ops.decode_attention(q, paged.layers[0].k, paged.layers[0].v, attended, 0.125,
                               block_table=table)
    assert torch.equal(got, want) and not got.isnan().any()
