"""Where a KV token lives: the one address rule the KV kernels share, slotted or paged.

A slotted cache stores sequence b's token t at store[b, :, t]. A paged cache stores
it in a pool of fixed-size blocks, at pool[page, :, t % PAGE], with page =
block_table[b, t // PAGE] (`paged_cache.py` keeps the tables). Both are
[rows, Hkv, tokens, ...] tensors, so one element offset covers dense values, packed
words and scales alike: row·stride_row + token·stride_tok, with (row, token) = (b, t)
or (page, t % PAGE). `kv_token_offsets` is that rule; the decode attention and the
KV append kernels compute no address any other way.
"""

import triton
import triton.language as tl


@triton.jit
def kv_token_offsets(table_ptr, stride_table, b, tok, valid, stride_row, stride_tok,
                     PAGE: tl.constexpr, PAGED: tl.constexpr):
    """Element offsets (int64, tok's shape) of tokens ``tok`` of sequence ``b`` in a KV
    store whose rows are ``stride_row`` apart and tokens ``stride_tok`` apart.

    PAGED: row = table[b, tok // PAGE], token = tok % PAGE; the table is read only
    where ``valid``, and a token that is not maps to page 0 (in bounds, so a caller may
    load it unmasked: its value meets a zero weight). Otherwise the slotted layout: row
    b, token tok (``table_ptr``, ``stride_table``, ``valid`` and PAGE unused)."""
    if PAGED:
        page = tl.load(table_ptr + b.to(tl.int64) * stride_table + tok // PAGE, mask=valid,
                       other=0)
        return page.to(tl.int64) * stride_row + (tok % PAGE) * stride_tok
    else:
        return b.to(tl.int64) * stride_row + tok * stride_tok
