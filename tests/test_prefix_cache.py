"""The prefix cache's pages: an allocator that keeps an index's pages cached (free to take,
evicted least recently used first), the index's lookups (the longest prefix of whole
pages, never a whole prompt; a sliding group's window of them), pages attached to a new
row holding exactly the K/V the first row wrote (a write into one copies it first), a
hash collision that is a miss, and a sliding layer's part-written page that is never
shared."""

from types import SimpleNamespace

import pytest
import torch

from qfuse.runtime.paged_cache import OutOfPages, PageAllocator, PagedKVCache
from qfuse.runtime.prefix_cache import PrefixCache

CONFIG = SimpleNamespace(layer_types=("full_attention", "sliding_attention"), sliding_window=24,
                         num_key_value_heads=2, head_dim=64)
PS = 8  # tokens per page


def test_kept_pages_stay_cached_and_are_evicted_least_recently_used_first():
    a, evicted = PageAllocator(4), []
    a.on_evict = evicted.append
    pages = a.allocate(3)
    for p in pages:
        a.keep(p)
    a.free([2, 0])  # released in this order: 2 is the least recently used
    assert a.free_pages == 3 and a.cached_pages == 2 and a.refcount(0) == 1
    a.share([0])  # attached again: no longer free
    assert a.free_pages == 2 and not a.is_cached(0)
    assert a.allocate(1) == [3] and evicted == []  # a free page before any cached one
    assert a.allocate(1) == [2] and evicted == [2] and not a.is_kept(2)
    with pytest.raises(OutOfPages, match="1 pages needed, 0 of 4 free"):
        a.allocate(1)
    with pytest.raises(ValueError, match="page 0 is kept already"):
        a.keep(0)


def _prompt(cache, b, n, seed):
    """Row ``b`` grown to ``n`` tokens with random K/V written in every layer; the K/V."""
    cache.set_length(b, n)
    g = torch.Generator().manual_seed(seed)
    kv = [(torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g))
          for _ in cache.layers]
    for layer, (k, v) in zip(cache.layers, kv):
        layer.write_prompt(k, v, [n], rows=[b])
    return kv


def test_an_attached_prefix_reads_the_k_v_its_first_row_wrote():
    cache = PagedKVCache(CONFIG, 3, 96, torch.float32, "cpu", page_size=PS, num_pages=16,
                         chunk_tokens=48, prefix_pages=True)
    index = PrefixCache(cache)
    ids = list(range(100, 140))  # 40 tokens: 5 whole pages
    kv = _prompt(cache, 0, 40, seed=0)
    index.register(0, ids, 40)
    assert len(index) == 10  # 5 pages of each group (the sliding one wrote the whole prompt)
    assert index.lookup(ids).tokens == 32  # not the whole prompt: its last token is computed
    hit = index.lookup(ids + [7] * 9)
    assert hit.tokens == 40 and sorted(hit.pages[24]) == [2, 3, 4]  # (40 + 1 - 24) // 8 ..
    assert index.lookup(ids[:20] + [1] * 20).tokens == 16
    assert index.lookup([5] + ids[1:]).tokens == 0

    cache.attach(1, hit.tokens, hit.pages)
    assert cache.host_lengths[1] == 40 and cache.groups[None].allocator.refcount(
        cache.groups[None].rows[1][0]) == 3  # row 0, row 1 and the index
    for layer, (k, v) in zip(cache.layers, kv):
        first = 0 if layer.window is None else 40 + 1 - 24  # what the next query sees
        got_k, got_v = layer.read(first, 40, torch.float32, rows=torch.tensor([1]))
        assert torch.equal(got_k, k[:, :, first:40]) and torch.equal(got_v, v[:, :, first:40])
    cache.set_length(1, 45)  # its next tokens go to a page of its own
    full_rows = cache.groups[None].rows
    assert full_rows[1][5] not in full_rows[0]
    # Were it to write into a shared page (put back to 36 tokens, then grown), it copies
    # the page first: the cached one keeps the K/V of the prefix.
    shared = full_rows[1][4]
    cache.shrink(1, 36)
    cache.set_length(1, 40)
    assert full_rows[1][4] != shared and full_rows[0][4] == shared
    assert hit.pages[None][4] == shared and index.lookup(ids + [7]).pages[None][4] == shared
    k = cache.layers[0].k
    assert torch.equal(k[full_rows[1][4]], k[shared])  # a copy, till row 1 writes it

    cache.release(0)
    cache.release(1)
    full = cache.groups[None].allocator
    assert full.free_pages == 16 and full.cached_pages == 5
    # 12 pages: the 11 free ones, then the least recently used cached one, the prefix's
    # last (a row gives its last page back first): the shorter prefixes stay found.
    _prompt(cache, 2, 96, seed=1)
    assert full.cached_pages == 4 and index.lookup(ids + [7]).tokens == 32
    _prompt(cache, 1, 32, seed=2)  # 4 more: every cached page goes
    assert full.cached_pages == 0 and index.lookup(ids + [7]).tokens == 0
    assert len(index) == 5  # the sliding group's pages, till its own pool needs them


def _registered(n: int, prefix_pages: bool = True):
    """(a two-row cache, its prefix index, ids 0..n-1): row 0 prefilled with ``n``
    tokens and registered."""
    cache = PagedKVCache(CONFIG, 2, 96, torch.float32, "cpu", page_size=PS, chunk_tokens=48,
                         prefix_pages=prefix_pages)
    index = PrefixCache(cache)
    ids = list(range(n))
    _prompt(cache, 0, n, seed=0)
    index.register(0, ids, n)
    return cache, index, ids


def test_a_page_that_is_not_this_prefix_is_a_miss():
    _, index, ids = _registered(24)
    assert index.lookup(ids + [1]).tokens == 24
    entry = index._entries[index._keys(ids)[1]]
    entry.tokens = tuple(reversed(entry.tokens))  # as if another prefix hashed the same
    assert index.lookup(ids + [1]).tokens == 8


def test_a_part_written_sliding_page_is_never_shared():
    """Without prefix_pages a sliding layer writes a whole prompt's last window only: the
    page holding its first written position is part-written and stays out of the index,
    so no longer prefix is found (its window reaches before what was written)."""
    for prefix_pages, found in ((False, 0), (True, 40)):
        # sliding: written from 20, the page of 16..23 kept
        cache, index, ids = _registered(44, prefix_pages)
        assert cache.groups[24].written_from[0] == (0 if prefix_pages else 20)
        assert index.lookup(ids + [1]).tokens == found


def test_attach_refuses_pages_that_do_not_make_a_row():
    cache, index, ids = _registered(40)
    hit = index.lookup(ids + [1])
    with pytest.raises(ValueError, match="window 24: pages \\[3, 4\\] attached for 40 tokens"):
        cache.attach(1, 40, {None: hit.pages[None], 24: {3: hit.pages[24][3],
                                                         4: hit.pages[24][4]}})
    with pytest.raises(ValueError, match="row 0 holds tokens"):
        cache.attach(0, 40, hit.pages)
    assert cache.host_lengths[1] == 0  # refused before anything changed
