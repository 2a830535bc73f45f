"""The Q/K/V step's epilogue: one head of one row, read back from the step's scratch
product, normalized (q/k norms), rotated (RoPE) and sent where it goes: a query head
to the attention's input, a key or value head into the KV cache.

Each op rounds as its own kernel does (`pointwise.rms_norm`, `pointwise.rope`,
`attention.kv_append`), on the product as compat rounds it (y's dtype): the head's
norm sums in another order than PyTorch's (fast tier, as the RMSNorm kernel), the rest
is elementwise. A key or value token is written where `attention.kv_append` writes it
(slotted or paged, a 4/8-bit cache quantized bit for bit as `quant.quantize`, or a
dense cache), and a slot outside the cache writes nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..attention.kv_append import store_dense_token, store_token
from ..common.rounding import as_stored, round_like
from ..common.units import load_scratch
from ..pointwise.rms_norm import norm_factor, scale_normed
from ..pointwise.rope import rotated


@triton.jit
def head_epilogue(y_ptr, N, m, head, qn_ptr, kn_ptr, cos_ptr, sin_ptr, stride_cos, q_ptr,
                  k_ptr, ks_ptr, kb_ptr, v_ptr, vs_ptr, vb_ptr, slot_ptr, table_ptr,
                  stride_table, stride_cb, stride_ch, stride_cn, stride_sb, stride_sh,
                  stride_sn, n_max, n_rows, eps, inv_d,
                  HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                  QK_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, BF16_BITS: tl.constexpr,
                  KV_BITS: tl.constexpr, KV_GROUP: tl.constexpr, PAGE: tl.constexpr,
                  PAGED: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Head ``head`` (q heads, then k, then v) of row ``m`` of the scratch product y
    [rows, N]: q → q_ptr [rows, HQ, D]; k, v → their caches at slot_ptr[m] (KV_BITS 0:
    dense stores k_ptr/v_ptr; else words, scales, biases)."""
    d = tl.arange(0, D)
    half = D // 2
    partner = tl.where(d < half, d + half, d - half)
    row = y_ptr + m * N + head * D
    x = load_scratch(row + d, d < D, BF16_BITS)[None, :]
    if head < HQ + HKV:  # queries and keys: normalized, then rotated
        xp = load_scratch(row + partner, d < D, BF16_BITS)[None, :]
        if QK_NORM:
            is_q = head < HQ
            w = tl.where(is_q, tl.load(qn_ptr + d), tl.load(kn_ptr + d))
            wp = tl.where(is_q, tl.load(qn_ptr + partner), tl.load(kn_ptr + partner))
            r = norm_factor(x, eps, inv_d)
            x = scale_normed(x, r, w, y_ptr, UNIT_OFFSET, BF16_BITS)
            xp = scale_normed(xp, r, wp, y_ptr, UNIT_OFFSET, BF16_BITS)
        cos = tl.load(cos_ptr + m * stride_cos + d).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + m * stride_cos + d).to(tl.float32)[None, :]
        # rounded to y's dtype as the rotated tensor is (a key is quantized from it)
        x = round_like(rotated(x, xp, d < half, cos, sin, y_ptr, BF16_BITS, LIBDEVICE), y_ptr,
                       BF16_BITS)
    if head < HQ:
        tl.store(q_ptr + (m * HQ + head) * D + d[None, :], as_stored(x, q_ptr, BF16_BITS))
    else:
        is_k = head < HQ + HKV
        kv_head = tl.where(is_k, head - HQ, head - HQ - HKV)
        pos = tl.load(slot_ptr + m).to(tl.int64)
        seq = tl.program_id(0) * 0 + m  # the row as a tensor, as the address rule takes it
        if KV_BITS == 0:
            if is_k:
                store_dense_token(tl.reshape(x, (D,)), seq, kv_head, pos, k_ptr, table_ptr,
                                  stride_table, stride_cb, stride_ch, stride_cn, n_max, n_rows,
                                  D, BF16_BITS, PAGE, PAGED)
            else:
                store_dense_token(tl.reshape(x, (D,)), seq, kv_head, pos, v_ptr, table_ptr,
                                  stride_table, stride_cb, stride_ch, stride_cn, n_max, n_rows,
                                  D, BF16_BITS, PAGE, PAGED)
        else:
            if is_k:
                store_token(tl.reshape(x, (D,)), seq, kv_head, pos, k_ptr, ks_ptr, kb_ptr,
                            table_ptr, stride_table, stride_cb, stride_ch, stride_cn,
                            stride_sb, stride_sh, stride_sn, n_max, n_rows, D, KV_BITS,
                            KV_GROUP, LIBDEVICE, PAGE, PAGED)
            else:
                store_token(tl.reshape(x, (D,)), seq, kv_head, pos, v_ptr, vs_ptr, vb_ptr,
                            table_ptr, stride_table, stride_cb, stride_ch, stride_cn,
                            stride_sb, stride_sh, stride_sn, n_max, n_rows, D, KV_BITS,
                            KV_GROUP, LIBDEVICE, PAGE, PAGED)
