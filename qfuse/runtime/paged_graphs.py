"""Decode steps over a paged KV cache at a fixed batch, from fixed-address inputs, so that
a CUDA graph can replay them.

A CUDA graph replays kernels on the addresses it captured, so everything a paged decode
step reads that changes between steps lives in tensors made once and rewritten in place
before each step (`PagedStepInputs.prepare`): the token ids int64 [B], the lengths int32
[B] and one block table int32 [B, P] per page group (window). The pages themselves are
found on the host, outside the step: `prepare` first grows the step's rows by one token
in the `PagedKVCache` (taking, dropping or copying pages, all or nothing: `OutOfPages`
before anything changed), then copies the rows' tables, as the cache's device tables
hold them after that growth, into the fixed ones. A page a row takes between two
steps is therefore in the table the next replay reads.

The step has B rows whatever the number of sequences: row i of the step decodes cache
row rows[i], and a row with no sequence (rows[i] None, or i past the rows given) is
idle: length 0, its table the group's scratch page alone (`PagedKVCache(...,
scratch_page=True)`), so it writes and attends a page that no sequence holds and takes
none. That is what lets a serving engine replay one graph per batch bucket, and decode a
fixed batch at every step (its deterministic mode) on pages.

`PagedStepInputs` is itself the cache the decoder's step runs over (`Decoder.decode`
asks it for `reserve_step`, `lengths`, `step_indices` and `layers`): eagerly, or
captured by `GraphedPagedDecode`. The host lengths stay the truth; `prepare` also
writes the cache's own device lengths of the rows it grows, so an eager step over the
whole cache can follow a replayed one.
"""

from __future__ import annotations

import torch

from .paged_cache import PagedKVCache


class PagedStepInputs:
    """The fixed-address inputs of a decode step of ``batch_size`` rows over ``cache``
    (made with ``scratch_page=True``), and the cache-like object that step runs over.

    ``max_tokens``: the tokens a row may reach while bound to this step (default: the
    cache's); it sets the tables' width P = ceil(max_tokens / page_size), which sizes
    the attention's grid. A row that would grow past it is a ValueError, before
    anything changes (never a read past the table)."""

    def __init__(self, cache: PagedKVCache, batch_size: int, max_tokens: int | None = None):
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"PagedStepInputs takes a PagedKVCache, got {type(cache).__name__}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        missing = [w for w, g in cache.groups.items() if g.scratch is None]
        if missing:
            raise ValueError("a fixed-batch paged step needs a PagedKVCache made with "
                             "scratch_page=True (its idle rows decode on that page)")
        max_tokens = cache.max_tokens if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= cache.max_tokens:
            raise ValueError(f"max_tokens must lie in [1, {cache.max_tokens}] (the cache's), "
                             f"got {max_tokens!r}")
        device = cache.lengths.device
        self.cache, self.batch_size, self.max_tokens = cache, batch_size, max_tokens
        self.pages_per_seq = -(-max_tokens // cache.page_size)
        B, P = batch_size, self.pages_per_seq
        self.tokens = torch.zeros(B, dtype=torch.int64, device=device)
        self.lengths = torch.zeros(B, dtype=torch.int32, device=device)
        self.tables = {w: torch.full((B, P), -1, dtype=torch.int32, device=device)
                       for w in cache.groups}
        # An idle row's table: the scratch page holds its one token (position 0).
        self._idle = {}
        for w, g in cache.groups.items():
            row = torch.full((P,), -1, dtype=torch.int32, device=device)
            row[0] = g.scratch
            self._idle[w] = row
        self.layers = cache.layers  # the pools; each layer's step_args reads our tables
        self.prepare_idle()

    # ---- what `Decoder.decode` asks of its cache ----

    def reserve_step(self) -> None:
        """Nothing: `prepare` grew the rows on the host before the step (a captured
        step runs no Python, so the pages cannot be found inside it)."""

    def step_indices(self) -> dict[int | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """As `PagedKVCache.step_indices`, from the fixed tensors."""
        return {w: (self.lengths, self.lengths + 1, t) for w, t in self.tables.items()}

    # ---- before each step ----

    def prepare_idle(self) -> None:
        """Every row idle (a graph's warm-up and capture: no pages, no host state)."""
        self.tokens.zero_()
        self.lengths.zero_()
        for w, table in self.tables.items():
            table.copy_(self._idle[w].expand_as(table))

    def prepare(self, tokens: torch.Tensor, rows: list[int | None]) -> None:
        """Bind step row i to cache row ``rows[i]`` (None: idle; rows past len(rows):
        idle) feeding ``tokens[i]`` (int [len(rows)], on the cache's device; an idle
        row's is fed as given): grow each bound row by one token in the cache (its pages
        taken on the host; OutOfPages or ValueError before anything changes), then write
        the fixed tensors in place: the lengths before the step, the tables after the
        growth, the tokens."""
        B, P, cache = self.batch_size, self.pages_per_seq, self.cache
        rows = list(rows)
        bound = [b for b in rows if b is not None]
        if len(rows) > B:
            raise ValueError(f"{len(rows)} rows do not fit a step of {B} rows")
        host = cache.host_lengths  # a copy per read: read once
        if len(set(bound)) != len(bound) or not all(
                isinstance(b, int) and 0 <= b < len(host) for b in bound):
            raise ValueError(f"rows {rows} are not distinct rows of a cache of "
                             f"{len(host)} (or None)")
        if tokens.shape != (len(rows),):
            raise ValueError(f"tokens must be of shape ({len(rows)},), got "
                             f"{tuple(tokens.shape)}")
        for b in bound:
            if host[b] + 1 > P * cache.page_size:
                raise ValueError(f"row {b} would grow to {host[b] + 1} tokens, past the "
                                 f"step's block table of {P} pages of {cache.page_size}")
        cache.reserve_step(bound)  # the pages: host side, all or nothing
        # One host-to-device copy: each step row's cache row and idle flag, the lengths
        # before the step, then the bound rows and their lengths after it.
        n = len(bound)
        idle = [b is None for b in rows] + [True] * (B - len(rows))
        index = [0 if b is None else b for b in rows] + [0] * (B - len(rows))
        before = [0 if b is None else host[b] for b in rows] + [0] * (B - len(rows))
        plan = torch.tensor(index + idle + before + bound + [host[b] + 1 for b in bound],
                            dtype=torch.int64).to(self.lengths.device)
        index_d, idle_d = plan[:B], plan[B: 2 * B].bool()[:, None]
        self.lengths.copy_(plan[2 * B: 3 * B])
        for w, g in cache.groups.items():
            # After the growth above: a page the row took is in the table read next.
            torch.where(idle_d, self._idle[w], g.table[:, :P].index_select(0, index_d),
                        out=self.tables[w])
        self.tokens.zero_()
        self.tokens[: len(rows)].copy_(tokens)
        if n:  # the cache's device lengths after the step, as an eager step leaves them
            cache.lengths[plan[3 * B: 3 * B + n]] = plan[3 * B + n:].to(cache.lengths.dtype)

    def step(self, model, tokens: torch.Tensor, rows: list[int | None]) -> torch.Tensor:
        """`prepare`, then the decode step run eagerly: logits [batch_size, V], row i
        that of ``rows[i]`` (an idle row's are meaningless)."""
        self.prepare(tokens, rows)
        return model.decode(self.tokens, self)


class GraphedPagedDecode:
    """A decode step of ``batch_size`` rows over a paged ``cache`` (made with
    ``scratch_page=True``), captured once as a CUDA graph over `PagedStepInputs` and
    replayed per step. Capture runs with every row idle, so it takes no page and
    changes no host state; each call prepares the inputs (the pages on the host) and
    replays. Sampling stays outside the graph."""

    def __init__(self, model, cache: PagedKVCache, batch_size: int):
        self.inputs = inputs = PagedStepInputs(cache, batch_size)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            model.decode(inputs.tokens, inputs)  # warm-up: compiles kernels, RoPE tables
        torch.cuda.current_stream().wait_stream(stream)
        inputs.prepare_idle()  # the warm-up advanced the idle rows' lengths
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.logits = model.decode(inputs.tokens, inputs)

    def __call__(self, tokens: torch.Tensor, rows: list[int | None] | None = None
                 ) -> torch.Tensor:
        """Logits [batch_size, V] of one step; row i decodes cache row ``rows[i]``
        (default: rows 0..batch_size-1). The logits buffer is the graph's: the next call
        overwrites it."""
        rows = list(range(self.inputs.batch_size)) if rows is None else rows
        self.inputs.prepare(tokens, rows)
        self.graph.replay()
        return self.logits
