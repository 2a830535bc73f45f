"""A prefix cache over a `PagedKVCache`: full pages of prompt tokens, computed once, shared.

Each full page of a sequence (page_size tokens at positions j·page_size ...) is named by a
chained key: the hash of the previous page's key and this page's token ids, so that one key
stands for the whole prefix up to the page's end (the K/V of a token depend on every token
before it). An entry holds, per page group of the cache (its window; None: full attention),
the physical page with that prefix's K/V, and the index keeps a reference to it
(`PageAllocator.keep`): when the sequences holding it end, it stays cached (counted free,
evicted least recently used first when an allocation needs it) instead of going back to
the pool. Entries store their parent key and tokens, and a lookup checks both, so a hash
collision is a miss, never another prefix's K/V.

`lookup(ids)`: the longest prefix of whole pages, never the whole of ``ids`` (its last
token must be computed for its logits), whose pages every group has: all of them for a
full-attention group; for a sliding one, those its window lets the first computed query see
(positions from n + 1 - window), which must be complete (`PageGroup.written_from`: a layer
that skipped a long chunk's start left that page part-written, and it is never registered).
`register(row, ids, upto, since)`: the row's full pages of ``ids[:upto]`` (its cache holds
them) from the page of position ``since`` on, called after each prefill chunk (since: its
start), before a later growth drops a sliding layer's old pages.
A page already in the index for its key is left alone (two rows that prefilled the same
prefix at once: the second's copy goes back to the pool with its row).

Limits: a prefix longer than a sliding window, on a model whose layers all slide, is never
found (its chain's first pages are gone from every group, and entries without a page are
not kept); pages of generated tokens are registered only as a preempted sequence's prefill
computes them again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from .paged_cache import PagedKVCache


@dataclass
class _Entry:
    parent: int | None  # the previous page's key (None: the first page)
    tokens: tuple[int, ...]  # this page's token ids
    pages: dict[int | None, int] = field(default_factory=dict)  # window -> physical page


@dataclass
class Hit:
    """A lookup's answer: ``tokens`` cached (whole pages; 0: none) and, per group, the
    pages {table entry: page} to attach (`PagedKVCache.attach`)."""
    tokens: int = 0
    pages: dict[int | None, dict[int, int]] = field(default_factory=dict)


class PrefixCache:
    """The index of ``cache``'s full prompt pages (the module's docstring). Host-side
    bookkeeping on the engine's thread: no tensors are touched."""

    def __init__(self, cache: PagedKVCache):
        self.cache, self.page_size = cache, cache.page_size
        self._entries: dict[int, _Entry] = {}
        self._where: dict[tuple[int | None, int], int] = {}  # (window, page) -> key
        # id(ids) -> (ids, their keys), for the last few lists: a request waiting at the
        # queue's head is looked up every loop, a prompt under way registered every chunk
        # (one per row, twice over: a preempted one's feed too, and the queue's head).
        self._memo: OrderedDict[int, tuple[list[int], list[int]]] = OrderedDict()
        self._memo_size = 2 * len(cache.host_lengths) + 2
        for w, g in cache.groups.items():
            g.allocator.on_evict = lambda page, w=w: self._evicted(w, page)

    def __len__(self) -> int:
        """Pages the index holds, over every group."""
        return len(self._where)

    def _keys(self, ids: list[int]) -> list[int]:
        """The chained keys of the full pages of ``ids`` (remembered for the last lists
        asked for: a list of ids is never changed once submitted)."""
        got = self._memo.get(id(ids))
        if got is not None and got[0] is ids and len(got[1]) == len(ids) // self.page_size:
            self._memo.move_to_end(id(ids))
            return got[1]
        ps, keys, parent = self.page_size, [], None
        for j in range(len(ids) // ps):
            parent = hash((parent, tuple(ids[j * ps: (j + 1) * ps])))
            keys.append(parent)
        self._memo[id(ids)] = (ids, keys)  # holding ids: its id is not reused meanwhile
        if len(self._memo) > self._memo_size:
            self._memo.popitem(last=False)
        return keys

    def _entry(self, keys: list[int], ids: list[int], j: int) -> _Entry | None:
        """Page j's entry if it is the one of this very prefix (parent and tokens)."""
        entry = self._entries.get(keys[j])
        ps = self.page_size
        if entry is None or entry.parent != (keys[j - 1] if j else None) or \
                entry.tokens != tuple(ids[j * ps: (j + 1) * ps]):
            return None
        return entry

    def lookup(self, ids: list[int]) -> Hit:
        """The longest cached prefix of ``ids`` that leaves at least its last token to
        compute, with the pages each group's row needs at that length."""
        ps = self.page_size
        most = (len(ids) - 1) // ps
        keys = self._keys(ids)
        entries = []
        for j in range(most):
            entry = self._entry(keys, ids, j)
            # A full-attention group needs every page up to the prefix's end.
            if entry is None or (None in self.cache.groups and None not in entry.pages):
                break
            entries.append(entry)
        for k in range(len(entries), 0, -1):  # longest first; a sliding page may be gone
            pages = {}
            for w, g in self.cache.groups.items():
                first = g.first_kept(k * ps, k * ps + 1) // ps
                got = {j: entries[j].pages.get(w) for j in range(first, k)}
                if None in got.values():
                    break
                pages[w] = got
            else:
                return Hit(k * ps, pages)
        return Hit()

    def register(self, b: int, ids: list[int], upto: int, since: int = 0) -> None:
        """Keep row ``b``'s complete full pages of ``ids[:upto]`` (its cache holds them)
        under their keys, where the index has none for that key and group yet; from the
        page of position ``since`` on (a chunk's start: the pages before it are in)."""
        ps = self.page_size
        n = min(upto, self.cache.host_lengths[b]) // ps
        keys = self._keys(ids)
        for j in range(since // ps, n):
            entry = self._entries.get(keys[j])
            if entry is None:
                entry = _Entry(keys[j - 1] if j else None, tuple(ids[j * ps: (j + 1) * ps]))
            elif self._entry(keys, ids, j) is None:
                return  # a hash collision: the other prefix keeps its key; this one waits
            for w, g in self.cache.groups.items():
                page = g.rows[b][j]
                if w in entry.pages or page < 0 or j * ps < g.written_from[b]:
                    continue  # there already, dropped, or not completely written
                g.allocator.keep(page)
                entry.pages[w] = page
                self._where[(w, page)] = keys[j]
            if not entry.pages:
                return  # no group kept this page: the chain is broken here
            self._entries[keys[j]] = entry

    def _evicted(self, w: int | None, page: int) -> None:
        """The allocator of group ``w`` took back cached ``page``: forget it."""
        key = self._where.pop((w, page))
        entry = self._entries[key]
        del entry.pages[w]
        if not entry.pages:
            del self._entries[key]
