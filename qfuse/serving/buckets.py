"""The batch sizes the serving engine's decode steps run at, and the paged cache it makes.

Bucketed (the default): the powers of two below max_batch, then max_batch; a step runs
the smallest bucket that holds its rows. Deterministic (batch invariance): only the
buckets at which every weight product takes the row-invariant kernel it takes at
max_batch rows, so a row's bits do not depend on which bucket a step runs; max_batch alone
where the model names no such kernel. docs/serving.md says why.
"""

from __future__ import annotations


def bucket_sizes(max_batch: int) -> list[int]:
    """The batch sizes a non-deterministic engine decodes at: the powers of two below
    max_batch, then max_batch itself."""
    sizes = [1]
    while sizes[-1] * 2 < max_batch:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def step_buckets(model, max_batch: int, deterministic: bool) -> list[int]:
    """The batch sizes an engine decodes at. Bucketed (the default): `bucket_sizes`.
    Deterministic: those of them at which every weight product takes the row-invariant
    kernel it takes at max_batch rows (`Decoder.product_kernels`: on Hopper, say, the
    fragment kernel or the TMA ring over 1-32 rows, the wgmma kernel over 33-256), so a
    row's bits do not depend on which of them a step runs; max_batch alone where the
    kernels are not row-invariant (on a CPU, dense weights, tensor parallelism: the model
    cannot tell)."""
    if not deterministic:
        return bucket_sizes(max_batch)
    kernels = product_kernels(model, max_batch)
    if kernels is None:
        return [max_batch]
    return [b for b in bucket_sizes(max_batch) if product_kernels(model, b) == kernels]


def batch_for(buckets: list[int], top: int) -> int:
    """The rows a step decodes when the highest busy slot is ``top - 1``."""
    return next(b for b in buckets if b >= top)


def product_kernels(model, rows: int) -> tuple[str, ...] | None:
    """`Decoder.product_kernels` of ``model`` (None for a model without it: a tensor-
    parallel leader, a stand-in)."""
    kernels_of = getattr(model, "product_kernels", None)
    return kernels_of(rows) if kernels_of is not None else None


def paged_cache_options(context: int, prefill_chunk: int, prefix_caching: bool,
                        fixed_batch: bool, mixed_steps: bool = False) -> dict:
    """The `PagedKVCache` keywords the engine makes its cache with (and `sizing` counts):
    a fixed-batch step (a graph's bucket, the deterministic batch) decodes its idle rows
    on a scratch page, which no sequence holds; a prompt after a cached prefix, or in
    mixed steps' pieces, is prefilled as a chunk, without chunks a whole prompt's."""
    whole = context if prefix_caching or mixed_steps else 1
    return {"chunk_tokens": prefill_chunk or whole,
            "scratch_page": fixed_batch, "prefix_pages": prefix_caching}
