"""`PagedKVCache.select` and `shrink`: some rows of a paged cache as a cache of their own
(their growth takes the cache's pages, all or nothing; their table and lengths are
theirs, in the order asked), and a row put back to fewer tokens gives its pages back."""

from types import SimpleNamespace

import pytest
import torch

from qfuse.runtime.paged_cache import OutOfPages, PagedKVCache

CONFIG = SimpleNamespace(layer_types=("full_attention",), sliding_window=None,
                         num_key_value_heads=2, head_dim=64)


def _cache(num_pages=6):
    return PagedKVCache(CONFIG, 3, 64, torch.float32, "cpu", page_size=4, num_pages=num_pages)


def test_a_selection_grows_its_rows_only_and_gathers_their_table():
    cache = _cache()
    view = cache.select([2, 0])
    view.host_lengths = [5, 3]  # row 2: two pages, row 0: one
    assert cache.host_lengths == [3, 0, 5] and cache.free_pages == 3
    view.reserve_step()
    assert cache.host_lengths == [4, 0, 6]
    table = view.step_indices()[None][2]
    assert table[0, :2].tolist() == cache.groups[None].rows[2][:2]
    assert table[1, 0].item() == cache.groups[None].rows[0][0]
    # the device lengths are made from the host ones when a selection is made
    assert cache.select([0, 2]).lengths.tolist() == [4, 6]


def test_a_selection_that_runs_out_changes_nothing():
    cache = _cache(num_pages=3)
    view = cache.select([0, 1])
    view.host_lengths = [4, 4]  # 2 pages; the next step needs 2 more, 1 is free
    with pytest.raises(OutOfPages):
        view.reserve_step()
    assert cache.host_lengths == [4, 4, 0] and cache.free_pages == 1


def test_shrink_gives_the_pages_past_the_new_length_back():
    cache = _cache()
    cache.set_length(1, 9)  # 3 pages
    cache.shrink(1, 4)
    assert cache.host_lengths[1] == 4 and cache.free_pages == 5
    with pytest.raises(ValueError, match="cannot shrink from 4 to 5 tokens"):
        cache.shrink(1, 5)
    with pytest.raises(ValueError, match="not distinct rows"):
        cache.select([1, 1])
