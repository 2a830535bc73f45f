"""A paged KV cache: K and V in pools of fixed-size pages, a block table per sequence.

Memory follows the tokens in use, not sequences × maximum length: a sequence holds
ceil(length / page_size) pages of each layer's pool, taken from a `PageAllocator` as it
grows and given back when it is released. Each layer's pool mirrors `cache.LayerCache`
with pages for sequences and page_size for capacity: dense [num_pages, Hkv, page_size,
D], or a QuantizedTensor of that shape (packed uint32 [..., D·bits/32], scales and
biases [..., D/g]). Token t of row b lives in page table[b, t // page_size], place
t % page_size: the rule `kernels/common/paging.py` holds for the kernels, `reference.gather_pages`
for the reference; -1 marks a table entry that holds no page.

Sliding-window layers keep only the pages that hold a token some later step can still
attend, and give the rest back: their own group (`PageGroup`: one allocator and one
table per window) with a fixed budget of ceil((window + chunk_tokens - 1) / page_size) + 1
pages per sequence (decode steps alone, chunk_tokens 1: ceil(window / page_size) + 1), so
they never limit admission. A prefill chunk after cached tokens holds the keys its first
query sees besides its own, so a cache that takes chunks of up to chunk_tokens tokens
says so. Full layers share the other group. Positions stay logical (no ring), so a
sliding layer attends with its window over the same table (`step_args`: what a decode
step passes the kernels, as `cache.LayerCache.step_args` for the slotted cache).

Admission: `can_admit(n_tokens)`; every growth (`set_length`, `reserve_step`) is
all-or-nothing and raises `OutOfPages` (a ValueError, one line) before anything changes.
`fork` shares a sequence's pages (reference counts); a page is copied before a shared one
would be written (copy-on-write), never overwritten in place.

Prefix caching (`prefix_cache.PrefixCache`, ``prefix_pages=True``): an index may keep a
reference to a full page (`PageAllocator.keep`); a kept page that no row holds any more is
cached, counted as free and evicted, least recently used first, when an allocation finds
too few free pages; `attach` gives a new row cached pages of its prefix. With
``prefix_pages`` a sliding layer writes every position of a prefill chunk, and its row holds
the chunk's pages until the next growth drops what left the window (the budget above
already holds a chunk and a window), so that each full page it fills is complete and can
be shared; `PageGroup.written_from` says from which position a row's pages are complete.

`select(rows)`: some rows, in any order, as a cache of their own (`PagedRows`) that a
prefill or a decode step runs over, so that a serving engine steps only the rows that
decode (an idle row would take a page for its dummy token). `shrink` puts a row back to
fewer tokens (a step that failed after taking its pages).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

import torch

from ..quant import QuantizedTensor, dequantize
from .cache import bytes_per_head_token, cache_problem, layer_capacities
from .host_copies import to_device
from .prompt_write import token_plan, write_tokens


class OutOfPages(ValueError):
    """The pool has fewer free pages than a growth needs (nothing was changed)."""


class PageAllocator:
    """Pages 0..num_pages-1 with a reference count each; the lowest free page first.

    A prefix index may `keep` a reference to a page: a kept page whose only holder is the
    index is cached, free to take (`free_pages` counts it) and evicted, least recently
    released first, only once no page is free; ``on_evict(page)`` tells the index."""

    def __init__(self, num_pages: int):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        # A min-heap, the lowest page first: a deterministic order at O(log n) a page, as
        # a pool sized by the free memory can hold hundreds of thousands of pages.
        self._free = list(range(num_pages))  # sorted: a heap already
        self._kept: set[int] = set()  # pages a prefix index holds a reference to
        # Kept pages no one else holds, least recently released first: the eviction order.
        self._cached: OrderedDict[int, None] = OrderedDict()
        self.on_evict: Callable[[int], None] | None = None

    @property
    def free_pages(self) -> int:
        """Pages an allocation may take: the free ones and the cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def cached_pages(self) -> int:
        """Of the free pages, those a prefix index keeps (evicted when needed)."""
        return len(self._cached)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def is_kept(self, page: int) -> bool:
        return page in self._kept

    def is_cached(self, page: int) -> bool:
        """Kept by the index alone: taking it (`share`) makes it no longer free."""
        return page in self._cached

    def allocate(self, n: int) -> list[int]:
        """n fresh pages (count 1 each), free ones first, then cached ones evicted (least
        recently used first); OutOfPages with none taken."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.free_pages:
            raise OutOfPages(f"{n} pages needed, {self.free_pages} of {self.num_pages} free")
        pages = [heapq.heappop(self._free) for _ in range(min(n, len(self._free)))]
        for _ in range(n - len(pages)):  # n <= free_pages: enough cached pages remain
            page, _ = self._cached.popitem(last=False)
            self._kept.discard(page)
            if self.on_evict is not None:
                self.on_evict(page)
            pages.append(page)
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder for each of these held pages (a fork, or a cached page
        attached to a row)."""
        self._check_held(pages)
        for p in pages:
            self._refs[p] += 1
            self._cached.pop(p, None)

    def keep(self, page: int) -> None:
        """A prefix index's reference to this held page: when every other holder has let
        it go, it stays cached instead of going back to the pool."""
        self._check_held([page])
        if page in self._kept:
            raise ValueError(f"page {page} is kept already")
        self._refs[page] += 1
        self._kept.add(page)

    def free(self, pages: list[int]) -> None:
        """One holder fewer for each page; a page no one holds goes back to the pool, a
        kept one that only the index still holds becomes cached (most recent last)."""
        self._check_held(pages)
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages {pages} name one page twice")
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                heapq.heappush(self._free, p)
            elif self._refs[p] == 1 and p in self._kept:
                self._cached[p] = None

    def _check_held(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages or self._refs[p] == 0:
                raise ValueError(f"page {p} is not held (pool of {self.num_pages})")


class PageGroup:
    """The pages of the layers that share one window (None: full attention): their
    allocator, each row's pages on the host, and the block table int32 [B, P] on the
    device that the kernels read."""

    def __init__(self, window: int | None, batch_size: int, pages_per_seq: int,
                 page_size: int, num_pages: int, device, scratch: int | None = None,
                 whole_chunks: bool = False):
        self.window, self.page_size = window, page_size
        # A sliding layer writes (and its row holds) a prefill chunk's every position.
        self.whole_chunks = whole_chunks and window is not None
        self.allocator = PageAllocator(num_pages)
        # A page of the pools past the allocator's (None: none): never any row's, so the
        # idle rows of a fixed-size step can write and read it (`paged_graphs`).
        self.scratch = scratch
        self.rows = [[-1] * pages_per_seq for _ in range(batch_size)]
        # Per row: the first position from which its pages hold every position's K/V
        # (a sliding layer that skips the start of a long chunk leaves a gap before it).
        self.written_from = [0] * batch_size
        self.table = torch.full((batch_size, pages_per_seq), -1, dtype=torch.int32,
                                device=device)
        self.layers: list[PagedLayerCache] = []

    def first_kept(self, old: int, new: int) -> int:
        """The first position a row growing from ``old`` to ``new`` tokens must keep: what
        the window lets a later query see, and for a chunk after cached tokens (old > 0)
        also what the chunk's first query sees (old + 1 - window); with whole_chunks,
        for a whole prompt too (the chunk is written whole)."""
        if self.window is None:
            return 0
        if old == 0 and not self.whole_chunks:
            return max(0, new - self.window)
        return max(0, min(new, old + 1) - self.window)

    def plan(self, b: int, old: int, new: int):
        """(pages to drop, table entries needing a page, entries to copy before writing)."""
        ps, row = self.page_size, self.rows[b]
        keep = self.first_kept(old, new) // ps
        drop = [j for j in range(keep) if row[j] >= 0]
        last = -(-new // ps)
        fill = [j for j in range(keep, last) if row[j] < 0]
        # Pages that take the new tokens [old, new) and that another row also holds.
        copy = [j for j in range(max(keep, old // ps), last)
                if row[j] >= 0 and self.allocator.refcount(row[j]) > 1]
        return drop, fill, copy

    def sync(self, b: int) -> None:
        self.table[b] = torch.tensor(self.rows[b], dtype=torch.int32)

    def copy_page(self, src: int, dst: int) -> None:
        for layer in self.layers:
            for store in (layer.k, layer.v):
                for part in _parts(store):
                    part[dst] = part[src]


def _parts(store):
    return (store.packed, store.scales, store.biases) if isinstance(store, QuantizedTensor) \
        else (store,)


class PagedLayerCache:
    """One layer's K and V pools, read and written through its group's table."""

    def __init__(self, group: PageGroup, num_pages, Hkv, D, dtype, device, bits, group_size):
        self.group, self.window, self.page_size = group, group.window, group.page_size
        shape = (num_pages, Hkv, group.page_size)
        if bits:
            def make():
                return QuantizedTensor(
                    torch.zeros(*shape, D * bits // 32, dtype=torch.uint32, device=device),
                    torch.zeros(*shape, D // group_size, dtype=dtype, device=device),
                    torch.zeros(*shape, D // group_size, dtype=dtype, device=device),
                    group_size, bits)
        else:
            def make():
                return torch.zeros(*shape, D, dtype=dtype, device=device)
        self.k, self.v = make(), make()
        group.layers.append(self)

    @property
    def block_table(self) -> torch.Tensor:
        return self.group.table

    def write_prompt(self, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                     past: int = 0, rows: list[int] | None = None,
                     index: torch.Tensor | None = None) -> None:
        """k, v [B, Hkv, T, D] of right-padded prompts, or of the chunk at positions
        past..past+T-1 of each, ``lengths`` long in all (past included; the cache's
        lengths, whose pages `PagedKVCache.set_length` has taken); keep what a later step
        can see (the last `window` tokens of each on a sliding layer). ``rows``: the cache
        row of each batch row (default: the same); ``index``: ``rows`` as int64 on the
        device, where the caller has it (a `PagedRows` view)."""
        ps, firsts = self.page_size, []
        for i, L in enumerate(lengths):
            b = i if rows is None else rows[i]
            first = past if self.window is None or self.group.whole_chunks \
                else max(past, L - self.window)
            if first > past or past == 0:  # positions before `first` were not written
                self.group.written_from[b] = first
            # Checked on the host: the kernel would write nothing for a missing page.
            if first < L and min(self.group.rows[b][first // ps:(L - 1) // ps + 1]) < 0:
                raise ValueError(f"row {b} holds no page for positions {first}..{L - 1}")
            firsts.append(first)
        plan = token_plan(lengths, firsts, past, k.shape[2], k.device)
        table = self.group.table
        if rows is not None:
            if index is None:
                index = to_device(rows, k.device)
            table = table[index]
        table = table[plan.rows]  # each token's row's block table
        for store, src in ((self.k, k), (self.v, v)):
            write_tokens(store, src, plan, plan.positions, table)

    def read(self, first: int, stop: int, dtype: torch.dtype,
             rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions first..stop-1 of every row (of ``rows``, int64 indices,
        if given), [B, Hkv, stop - first, D] in ``dtype`` (dequantized as the reference
        does): a chunked prefill's cached keys. A row holding no page there reads page 0
        (a row shorter than ``stop``)."""
        pos = torch.arange(first, stop, device=self.group.table.device)
        table = self.group.table if rows is None else self.group.table[rows]
        pages = table[:, pos // self.page_size].to(torch.int64).clamp(min=0)
        places = (pos % self.page_size)[None, :]

        def one(store):
            if isinstance(store, QuantizedTensor):
                # As int32: CUDA has no uint32 gather (the words' bits are the same).
                packed = store.packed.view(torch.int32)[pages, :, places].view(torch.uint32)
                x = dequantize(packed, store.scales[pages, :, places],
                               store.biases[pages, :, places], store.group_size, store.bits,
                               dtype)
            else:
                x = store[pages, :, places].to(dtype)
            return x.transpose(1, 2)  # [B, n, Hkv, D] -> [B, Hkv, n, D]
        return one(self.k), one(self.v)

    def step_args(self, indices: dict) -> tuple[torch.Tensor, torch.Tensor, int | None,
                                                torch.Tensor]:
        """This layer's part of one decode step's `PagedKVCache.step_indices()`, as
        `cache.LayerCache.step_args` gives it: (positions of the new tokens, tokens
        attended, window, block table). Positions are logical, so a sliding layer passes
        its window to the attention instead of a ring's clamped length."""
        positions, attended, table = indices[self.window]
        return positions, attended, self.window, table

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def layer_windows(config, max_tokens: int) -> list[int | None]:
    """Per layer, the window of the page group it belongs to: its sliding window where
    shorter than max_tokens, else None (full attention, or a window that sees it all)."""
    return [capacity if ring else None for capacity, ring in layer_capacities(config, max_tokens)]


def group_pages(config, batch_size: int, max_tokens: int, page_size: int,
                num_pages: int | None = None, chunk_tokens: int = 1) -> dict[int | None, int]:
    """Per page group (its window), the pages its allocator hands out (`PagedKVCache`'s
    arguments): ``num_pages`` for the full layers (default: every row at max_tokens), a
    fixed budget per row for each sliding window."""
    per_seq = -(-max_tokens // page_size)
    out: dict[int | None, int] = {}
    for window in layer_windows(config, max_tokens):
        if window in out:
            continue
        if window is None:
            out[window] = num_pages or batch_size * per_seq
        else:
            # A sliding row holds at most the window and a chunk less one token
            # (positions old + 1 - window .. old + chunk - 1), over one page more.
            span = window + chunk_tokens - 1
            out[window] = batch_size * min(per_seq, -(-span // page_size) + 1)
    return out


def page_bytes(config, page_size: int, dtype: torch.dtype, bits: int = 0,
               group_size: int = 64) -> int:
    """The bytes of one page of one layer's pool, K and V (`PagedLayerCache.nbytes` of a
    one-page pool)."""
    return 2 * config.num_key_value_heads * page_size * bytes_per_head_token(
        config, dtype, bits, group_size)


def paged_kv_cache_bytes(config, batch_size: int, max_tokens: int, dtype: torch.dtype,
                         bits: int = 0, group_size: int = 64, page_size: int = 16,
                         num_pages: int | None = None, chunk_tokens: int = 1,
                         scratch_page: bool = False) -> int:
    """The bytes of `PagedKVCache` made with these arguments (its pools' K and V, as
    `PagedKVCache.nbytes` counts them), computed without allocating it: what `qfuse
    serve` weighs against the free memory. The block tables and lengths (int32, a few
    per row) are left out."""
    pools = group_pages(config, batch_size, max_tokens, page_size, num_pages, chunk_tokens)
    one = page_bytes(config, page_size, dtype, bits, group_size)
    return sum((pools[w] + scratch_page) * one for w in layer_windows(config, max_tokens))


class PagedKVCache:
    """Paged caches for every layer of a model: ``batch_size`` rows of at most
    ``max_tokens`` tokens, pages of ``page_size`` tokens (a power of two), ``num_pages``
    per full-attention layer (default: enough for every row at max_tokens).
    ``chunk_tokens``: the longest prefill chunk after cached tokens (`Decoder.forward`
    with ``past``) a row takes; it sizes the sliding layers' budget (1: decode steps and
    whole prompts only). ``scratch_page``: each pool holds one page more than its
    allocator hands out (`PageGroup.scratch`), for the idle rows of a decode step of a
    fixed batch (`paged_graphs.PagedStepInputs`: CUDA graphs, the deterministic mode).
    ``prefix_pages``: sliding layers write whole chunks, so that every full page can go
    to a prefix cache (the module's docstring); a whole prompt is then a chunk too, so
    chunk_tokens must cover the longest one."""

    def __init__(self, config, batch_size: int, max_tokens: int, dtype: torch.dtype, device,
                 bits: int = 0, group_size: int = 64, page_size: int = 16,
                 num_pages: int | None = None, chunk_tokens: int = 1,
                 scratch_page: bool = False, prefix_pages: bool = False):
        problem = cache_problem(config, bits, group_size)
        if problem is not None:
            raise ValueError(problem)
        for name, value in (("batch_size", batch_size), ("max_tokens", max_tokens),
                            ("page_size", page_size), ("chunk_tokens", chunk_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if num_pages is not None and (not isinstance(num_pages, int) or num_pages < 1):
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        if page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        self.max_tokens, self.page_size = max_tokens, page_size
        per_seq = -(-max_tokens // page_size)
        self.groups: dict[int | None, PageGroup] = {}
        self.layers: list[PagedLayerCache] = []
        pool_pages = group_pages(config, batch_size, max_tokens, page_size, num_pages,
                                 chunk_tokens)
        for window in layer_windows(config, max_tokens):
            if window not in self.groups:
                pages = pool_pages[window]
                self.groups[window] = PageGroup(window, batch_size, per_seq, page_size, pages,
                                                device, pages if scratch_page else None,
                                                whole_chunks=prefix_pages)
            group = self.groups[window]
            self.layers.append(PagedLayerCache(
                group, group.allocator.num_pages + (group.scratch is not None),
                config.num_key_value_heads, config.head_dim, dtype, device, bits, group_size))
        self.lengths = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self._host = [0] * batch_size

    # As with `cache.KVCache`, whoever runs a step advances the device `lengths` (the
    # decoder: after a decode step, or to the prompts' lengths); the host lengths are
    # this cache's, and growing them takes the pages.
    @property
    def host_lengths(self) -> list[int]:
        return list(self._host)

    @host_lengths.setter
    def host_lengths(self, values) -> None:
        """Grow every row to these lengths (pages taken first; all or nothing)."""
        values = list(values)
        if len(values) != len(self._host):
            raise ValueError(f"{len(values)} lengths for {len(self._host)} sequences")
        self._grow(dict(enumerate(values)))

    def pages_needed(self, n_tokens: int) -> dict[int | None, int]:
        """Per group (its window), the pages a new row of ``n_tokens`` holds once past its
        prefill (a sliding one: its window's; during a whole chunk it may hold up to its
        budget, which the pool always has room for)."""
        ps = self.page_size
        return {w: -(-n_tokens // ps) - (0 if w is None else max(0, n_tokens - w) // ps)
                for w in self.groups}

    def can_admit(self, n_tokens: int) -> bool:
        """Whether a new row of ``n_tokens`` tokens fits the free pages of every group."""
        return n_tokens <= self.max_tokens and all(
            need <= self.groups[w].allocator.free_pages
            for w, need in self.pages_needed(n_tokens).items())

    @property
    def free_pages(self) -> int:
        """Free pages of the full-attention layers' pool (of the sliding one without)."""
        group = self.groups.get(None) or next(iter(self.groups.values()))
        return group.allocator.free_pages

    def set_length(self, b: int, n: int) -> None:
        """Grow row ``b`` to ``n`` tokens (`_grow`)."""
        self._grow({b: n})

    def reserve_step(self, rows: list[int] | None = None) -> None:
        """One more token for each of ``rows`` (default: every row): pages taken as
        `_grow` takes them (all or nothing: `OutOfPages`)."""
        rows = range(len(self._host)) if rows is None else rows
        self._grow({b: self._host[b] + 1 for b in rows})

    def _grow(self, new: dict[int, int]) -> None:
        """Give every row of ``new`` the pages its new length needs: out-of-window pages
        given back, missing pages taken, shared pages about to be written copied. Checked
        in full first: OutOfPages or ValueError before anything changes."""
        for b, n in new.items():
            if not 0 <= b < len(self._host):
                raise ValueError(f"row {b} is not a row of this cache ({len(self._host)})")
            if n < self._host[b] or n > self.max_tokens:
                raise ValueError(f"row {b}: length {n} outside [{self._host[b]}, "
                                 f"{self.max_tokens}] (release a row to shorten it)")
        plans = {w: {b: g.plan(b, self._host[b], n) for b, n in new.items()}
                 for w, g in self.groups.items()}
        for w, g in self.groups.items():
            dropped = {g.rows[b][j] for drop, _, _ in plans[w].values() for j in drop}
            # Dropping gives a page back only where this row was its last holder (besides
            # a prefix index, whose pages are cached: free to take).
            freed = sum(1 for p in dropped
                        if g.allocator.refcount(p) == 1 + g.allocator.is_kept(p))
            need = sum(len(fill) + len(copy) for _, fill, copy in plans[w].values())
            if need > g.allocator.free_pages + freed:
                raise OutOfPages(f"{need} pages needed for window {w}, "
                                 f"{g.allocator.free_pages + freed} of "
                                 f"{g.allocator.num_pages} free")
        for w, g in self.groups.items():
            for b, (drop, fill, copy) in plans[w].items():
                row = g.rows[b]
                if drop:
                    g.allocator.free([row[j] for j in drop])
                for j in drop:
                    row[j] = -1
                for j, page in zip(fill, g.allocator.allocate(len(fill))):
                    row[j] = page
                for j in copy:  # copy-on-write: this row gets its own copy of the page
                    fresh = g.allocator.allocate(1)[0]
                    g.copy_page(row[j], fresh)
                    g.allocator.free([row[j]])
                    row[j] = fresh
                if drop or fill or copy:
                    g.sync(b)
        for b, n in new.items():
            self._host[b] = n

    def release(self, b: int) -> None:
        """Give row ``b``'s pages back (a finished or preempted sequence); its length is 0."""
        for g in self.groups.values():
            # Last page first: a prefix's deeper pages become the older cached ones, evicted
            # before the pages that every longer prefix needs.
            held = [p for p in reversed(g.rows[b]) if p >= 0]
            if held:
                g.allocator.free(held)
            g.rows[b] = [-1] * len(g.rows[b])
            g.written_from[b] = 0
            g.sync(b)
        self._host[b] = 0
        self.lengths[b] = 0

    def shrink(self, b: int, n: int) -> None:
        """Put row ``b`` back to ``n`` tokens (at most its length): the pages past them go
        back. For undoing a step that failed after it took its pages; a sliding layer's
        pages dropped for being out of its window do not come back (a step drops none
        that its own position still sees)."""
        if not 0 <= n <= self._host[b]:
            raise ValueError(f"row {b}: cannot shrink from {self._host[b]} to {n} tokens")
        last = -(-n // self.page_size)
        for g in self.groups.values():
            held = [g.rows[b][j] for j in range(last, len(g.rows[b])) if g.rows[b][j] >= 0]
            if held:
                g.allocator.free(held)
                g.rows[b][last:] = [-1] * (len(g.rows[b]) - last)
                g.sync(b)
        self._host[b] = n
        self.lengths[b] = n

    def select(self, rows: list[int]) -> PagedRows:
        """Rows ``rows`` (distinct, in this order) as a cache a step runs over."""
        return PagedRows(self, rows)

    def fork(self, src: int, dst: int) -> None:
        """Row ``dst`` (empty) shares row ``src``'s pages and length: both read the same
        pages until one writes, which copies the page first."""
        if self._host[dst] or any(p >= 0 for g in self.groups.values() for p in g.rows[dst]):
            raise ValueError(f"row {dst} holds tokens; release it before forking into it")
        for g in self.groups.values():
            held = [p for p in g.rows[src] if p >= 0]
            g.allocator.share(held)
            g.rows[dst] = list(g.rows[src])
            g.written_from[dst] = g.written_from[src]
            g.sync(dst)
        self._host[dst] = self._host[src]
        self.lengths[dst] = self._host[src]

    def attach(self, b: int, n_tokens: int, pages: dict[int | None, dict[int, int]]) -> None:
        """Row ``b`` (empty) starts at ``n_tokens`` (whole pages) with these held pages
        shared, per group {table entry: page}: every page a row of that length needs (of
        a sliding group, those the next chunk's first query sees). A prefix cache's hit;
        the pages are only read (the row's next token goes to a page of its own)."""
        ps = self.page_size
        if self._host[b] or any(p >= 0 for g in self.groups.values() for p in g.rows[b]):
            raise ValueError(f"row {b} holds tokens; release it before attaching pages")
        if n_tokens % ps or not 0 < n_tokens < self.max_tokens or set(pages) != set(self.groups):
            raise ValueError(f"cannot attach {n_tokens} tokens of pages for windows "
                             f"{sorted(map(str, pages))} to row {b}")
        for w, g in self.groups.items():
            first = g.first_kept(n_tokens, n_tokens + 1) // ps
            if sorted(pages[w]) != list(range(first, n_tokens // ps)):
                raise ValueError(f"window {w}: pages {sorted(pages[w])} attached for "
                                 f"{n_tokens} tokens, entries {first}..{n_tokens // ps - 1} "
                                 f"needed")
        for w, g in self.groups.items():
            g.allocator.share(list(pages[w].values()))
            for j, page in pages[w].items():
                g.rows[b][j] = page
            g.written_from[b] = min(pages[w], default=0) * ps
            g.sync(b)
        self._host[b] = n_tokens
        self.lengths[b] = n_tokens

    def step_indices(self) -> dict[int | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """For one decode step (after `reserve_step`, before the device lengths advance),
        per group window: (int32 position of each row's new token, int32 tokens each row
        then attends, the block table)."""
        return {w: (self.lengths, self.lengths + 1, g.table) for w, g in self.groups.items()}

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


class PagedRows:
    """Some rows of a `PagedKVCache` as a cache of their own, for one prefill or decode
    step: the host lengths are the cache's (growing them takes its pages), the device
    lengths a copy made from them (the host lengths are the truth: a step's device
    advance need not come back), the block table gathered when a step asks for it."""

    def __init__(self, cache: PagedKVCache, rows: list[int]):
        rows = list(rows)
        if len(set(rows)) != len(rows) or not all(0 <= b < len(cache._host) for b in rows):
            raise ValueError(f"rows {rows} are not distinct rows of a cache of "
                             f"{len(cache._host)}")
        self.cache, self.rows, self.max_tokens = cache, rows, cache.max_tokens
        device = cache.lengths.device
        self.index = torch.tensor(rows, dtype=torch.int64, device=device)
        self.lengths = torch.tensor([cache._host[b] for b in rows], dtype=torch.int32,
                                    device=device)
        self.layers = [_RowsLayer(layer, self) for layer in cache.layers]

    def part(self, start: int, stop: int) -> PagedRows:
        """Rows start..stop-1 of this view as a view of their own, sharing its device
        index and lengths (slices: no copy), so its lengths are this view's as made."""
        sub = object.__new__(PagedRows)
        sub.cache, sub.rows, sub.max_tokens = self.cache, self.rows[start:stop], self.max_tokens
        sub.index, sub.lengths = self.index[start:stop], self.lengths[start:stop]
        sub.layers = [_RowsLayer(layer, sub) for layer in self.cache.layers]
        return sub

    @property
    def host_lengths(self) -> list[int]:
        return [self.cache._host[b] for b in self.rows]

    @host_lengths.setter
    def host_lengths(self, values) -> None:
        values = list(values)
        if len(values) != len(self.rows):
            raise ValueError(f"{len(values)} lengths for {len(self.rows)} sequences")
        self.cache._grow(dict(zip(self.rows, values)))

    def reserve_step(self) -> None:
        """One more token for each of these rows (all or nothing: `OutOfPages`)."""
        self.cache.reserve_step(self.rows)

    def step_indices(self) -> dict:
        """As `PagedKVCache.step_indices`, over these rows (after `reserve_step`)."""
        return {w: (self.lengths, self.lengths + 1, g.table[self.index])
                for w, g in self.cache.groups.items()}


class _RowsLayer:
    """One layer of a `PagedRows`: its writes and reads go to the selected rows."""

    def __init__(self, layer: PagedLayerCache, view: PagedRows):
        self.layer, self.view, self.window = layer, view, layer.window
        self.k, self.v, self.page_size = layer.k, layer.v, layer.page_size  # the pools

    def write_prompt(self, k, v, lengths, past: int = 0) -> None:
        self.layer.write_prompt(k, v, lengths, past, rows=self.view.rows, index=self.view.index)

    def read(self, first: int, stop: int, dtype: torch.dtype):
        return self.layer.read(first, stop, dtype, rows=self.view.index)

    def step_args(self, indices: dict):
        return self.layer.step_args(indices)
