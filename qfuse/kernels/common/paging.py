"""Where a KV token lives: the one address rule the KV kernels share, slotted or paged.

A slotted cache stores sequence b's token t at store[b, :, t]. A paged cache stores
it in a pool of fixed-size blocks, at pool[page, :, t % PAGE], with page =
block_table[b, t // PAGE] (`paged_cache.py` keeps the tables). Both are
[rows, Hkv, tokens, ...] tensors, so one element offset covers dense values, packed
words and scales alike: row·stride_row + token·stride_tok, with (row, token) = (b, t)
or (page, t % PAGE). `kv_row` (read once a tile: one page lookup serves K, V and
their scales) and `kv_offsets_in` are that rule; the decode attention and the KV append
kernels compute no address any other way.
"""

import triton
import triton.language as tl


@triton.jit
def kv_row(table_ptr, stride_table, b, tok, valid, PAGE: tl.constexpr, PAGED: tl.constexpr):
    """The row (int64) of the store that holds tokens ``tok`` of sequence
    ``b``: PAGED, the page table[b, tok // PAGE], read only where ``valid`` (page 0
    elsewhere: in bounds, so a caller may load it unmasked, its value meeting a zero
    weight); otherwise b (``table_ptr``, ``stride_table``, ``valid`` and PAGE unused)."""
    if PAGED:
        page = tl.load(table_ptr + b.to(tl.int64) * stride_table + tok // PAGE, mask=valid,
                       other=0)
        return page.to(tl.int64)
    else:
        return b.to(tl.int64)  # a scalar: the slotted path multiplies it once


@triton.jit
def kv_offsets_in(row, tok, stride_row, stride_tok, PAGE: tl.constexpr, PAGED: tl.constexpr):
    """Element offsets of tokens ``tok`` held in store rows ``row`` (`kv_row`), for a
    store whose rows are ``stride_row`` apart and tokens ``stride_tok`` apart."""
    if PAGED:
        return row * stride_row + (tok % PAGE) * stride_tok
    else:
        return row * stride_row + tok * stride_tok

