"""The Q/K/V step: one launch for a decoder layer's stacked Q/K/V product, its q/k norms,
RoPE and the append of the new key and value to the KV cache.

Contract (`qkv_step`):

    x          [M, H], 1..MAX_ROWS rows of the layer's normalized input, fp16/bf16/fp32
    w          QuantizedTensor [(HQ + 2·HKV)·D, H], 4 or 8 bits, MLX layout: the q, k
               and v projections stacked in that order (`stacked`)
    bias       None or [(HQ + 2·HKV)·D] in x's dtype
    q_norm, k_norm   None (no q/k norms) or [D] each
    cos, sin   [M, D] in x's dtype (each row's position; equal strides)
    k_cache, v_cache  a slotted or paged layer cache's stores: QuantizedTensor (4/8 bits,
               `attention.kv_append`'s layout) or dense tensors [rows, HKV, tokens, D]
    slots      int32 [M]: where each row's token goes (a paged cache: its position,
               through ``table`` int32 [M, P])
    returns    q [M, HQ, D], normalized and rotated; the key and value are in the cache

The product is the CUDA-core GEMV's (`products.qmatmul.gemv_product`); a column tile is
BLOCK_N rows of one head, and the last tile of a head to finish runs the head's epilogue
(`heads`): equal, op for op, to the stacked product, `pointwise`'s norm-and-rotate and
two `kv_append`s, but for the order of the sums in the product and the norms (fast
tier). Deterministic (no float atomics; splits and heads meet through counters).
The first call on a device must run eagerly (its counters); later calls can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import QuantizedTensor
from ..attention import kv_append
from ..common import pdl
from ..common.precise_math import use_libdevice
from ..common.rounding import emulates_bf16, stored_view
from ..common.units import arrive_unit, unit_counters
from ..products.qmatmul import gemv_product, gemv_shape, gemv_unsupported_reason, weight_rounding
from ..products.splitk import semaphores, split_workspace
from .heads import head_epilogue

MAX_ROWS = 8
BLOCK_N = 128  # rows of a column tile at most (the GEMV's); a head is 1 or more tiles


@triton.jit
def _qkv_step_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, bias_ptr,
    y_ptr,  # scratch [M, N]: the product, read back by each head's epilogue
    ws_ptr, sem_ptr, cnt_ptr,
    qn_ptr, kn_ptr, cos_ptr, sin_ptr,
    q_ptr,  # [M, HQ, D]
    k_ptr, ks_ptr, kb_ptr, v_ptr, vs_ptr, vb_ptr,  # caches (dense: the values only)
    slot_ptr, table_ptr, stride_table,
    stride_cb, stride_ch, stride_cn, stride_sb, stride_sh, stride_sn, n_max, n_rows,
    N, K, magic, stride_xm, stride_wn, stride_wsn, stride_wbn, stride_cos, eps, inv_d,
    ROWS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GPI: tl.constexpr,
    ITERS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
    HAS_BIAS: tl.constexpr, Y_BF16_BITS: tl.constexpr, ROUND: tl.constexpr,
    PAIRS: tl.constexpr, NATIVE: tl.constexpr,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr, KV_BITS: tl.constexpr, KV_GROUP: tl.constexpr,
    PAGE: tl.constexpr, PAGED: tl.constexpr, LIBDEVICE: tl.constexpr, GDC: tl.constexpr,
):
    stored = gemv_product(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, bias_ptr, y_ptr, ws_ptr,
                          sem_ptr, N, K, magic, stride_xm, stride_wn, stride_wsn, stride_wbn, N,
                          N, ROWS, BITS, GROUP, GPI, ITERS, SPLIT, BLOCK_N, EVEN, HAS_BIAS,
                          False, Y_BF16_BITS, ROUND, PAIRS, NATIVE, GDC)
    if stored:
        TILES: tl.constexpr = D // BLOCK_N
        head = tl.program_id(0) // TILES
        if arrive_unit(cnt_ptr, head, TILES):
            for m in tl.static_range(ROWS):
                head_epilogue(y_ptr, N, m, head, qn_ptr, kn_ptr, cos_ptr, sin_ptr, stride_cos,
                              q_ptr, k_ptr, ks_ptr, kb_ptr, v_ptr, vs_ptr, vb_ptr, slot_ptr,
                              table_ptr, stride_table, stride_cb, stride_ch, stride_cn,
                              stride_sb, stride_sh, stride_sn, n_max, n_rows, eps, inv_d, HQ,
                              HKV, D, QK_NORM, UNIT_OFFSET, Y_BF16_BITS, KV_BITS, KV_GROUP,
                              PAGE, PAGED, LIBDEVICE)


def stacked(ws: list[QuantizedTensor]) -> QuantizedTensor:
    """The q, k and v weights as one [(HQ + 2·HKV)·D, H] QuantizedTensor (a copy), as the
    step reads them."""
    first = ws[0]
    if any((w.bits, w.group_size, w.shape[1]) != (first.bits, first.group_size, first.shape[1])
           for w in ws):
        raise ValueError("q, k and v weights of different bits, group sizes or widths")
    return QuantizedTensor(torch.cat([w.packed for w in ws]), torch.cat([w.scales for w in ws]),
                           torch.cat([w.biases for w in ws]), first.group_size, first.bits)


def cache_parts(cache) -> tuple:
    """(values or words, scales, biases, bits, group) of a layer cache's store."""
    if isinstance(cache, QuantizedTensor):
        return cache.packed, cache.scales, cache.biases, cache.bits, cache.group_size
    return cache, cache, cache, 0, 1


def unsupported_reason(x: torch.Tensor, w: QuantizedTensor, n_heads: int, n_kv_heads: int,
                       head_dim: int, cos: torch.Tensor, k_cache, v_cache) -> str | None:
    """None when `qkv_step` takes these inputs, else why not."""
    reason = gemv_unsupported_reason(x, w, MAX_ROWS) if isinstance(w, QuantizedTensor) \
        else "the weight is not MLX-quantized"
    if reason is not None:
        return reason
    D = head_dim
    if D & (D - 1) or D < 2:
        return f"head dim {D} is not a power of two"
    if w.shape[0] != (n_heads + 2 * n_kv_heads) * D:
        return f"weight rows {w.shape[0]} are not (HQ + 2·HKV)·D = {(n_heads + 2 * n_kv_heads) * D}"
    if cos.shape[-1] != D or cos.dtype != x.dtype:
        return f"cos/sin {tuple(cos.shape)} {cos.dtype} (step: [rows, {D}] {x.dtype})"
    for cache in (k_cache, v_cache):
        if isinstance(cache, QuantizedTensor):
            reason = kv_append.unsupported_reason(x[..., :D], cache)
            if reason is not None:
                return reason
        elif cache.dtype != x.dtype or cache.stride(-1) != 1:
            return f"dense cache {cache.dtype} (step: {x.dtype}, contiguous heads)"
    if cache_parts(k_cache)[1].stride() != cache_parts(v_cache)[1].stride() or \
            cache_parts(k_cache)[0].stride() != cache_parts(v_cache)[0].stride():
        return "k and v caches laid out differently"
    return None


def qkv_step(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None, n_heads: int,
             n_kv_heads: int, head_dim: int, q_norm: torch.Tensor | None,
             k_norm: torch.Tensor | None, eps: float, unit_offset: bool, cos: torch.Tensor,
             sin: torch.Tensor, k_cache, v_cache, slots: torch.Tensor,
             table: torch.Tensor | None = None, checked: bool = False) -> torch.Tensor:
    """The module docstring's step: q [M, HQ, D]; the new key and value in the caches.
    ``checked``: the caller has had None from `unsupported_reason` for this layout."""
    if not checked:
        reason = unsupported_reason(x, w, n_heads, n_kv_heads, head_dim, cos, k_cache,
                                    v_cache)
        if reason is not None:
            raise ValueError(f"qkv_step cannot take these inputs: {reason}")
    K, D, (N, _) = x.shape[-1], head_dim, w.shape
    x2 = x.reshape(-1, K)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    q = torch.empty(M, n_heads, D, dtype=x.dtype, device=x.device)
    ls = gemv_shape(N, K, w, block_n=min(BLOCK_N, D))
    if ls["BLOCK_N"] > D:
        raise ValueError(f"{N} product rows need tiles wider than a head of {D}")
    ws = split_workspace(ls["SPLIT"], (M, N), y)
    kc, ks, kb, kv_bits, kv_group = cache_parts(k_cache)
    vc, vs, vb, _, _ = cache_parts(v_cache)
    paged = table is not None
    n_max = kc.shape[2] * table.shape[1] if paged else kc.shape[2]
    cos2, sin2 = cos.reshape(M, D), sin.reshape(M, D)
    gdc = pdl.enabled(x.device)
    _qkv_step_kernel[ls.pop("grid")](
        x2, w.packed, w.scales, w.biases, bias if bias is not None else y, stored_view(y), ws,
        semaphores(x.device), unit_counters(x.device),
        q_norm if q_norm is not None else y, k_norm if k_norm is not None else y, cos2, sin2,
        stored_view(q), stored_view(kc) if not kv_bits else kc, ks, kb,
        stored_view(vc) if not kv_bits else vc, vs, vb,
        slots, table if paged else slots, table.stride(0) if paged else 0,
        kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        n_max, kc.shape[0], N, K, 0x43004300, x2.stride(0), w.packed.stride(0),
        w.scales.stride(0), w.biases.stride(0), cos2.stride(0), eps, 1.0 / D,
        ROWS=M, BITS=w.bits, GROUP=w.group_size, HAS_BIAS=bias is not None,
        Y_BF16_BITS=emulates_bf16(x.dtype), **weight_rounding(x, w), **ls,
        HQ=n_heads, HKV=n_kv_heads, D=D, QK_NORM=q_norm is not None, UNIT_OFFSET=unit_offset,
        KV_BITS=kv_bits, KV_GROUP=kv_group, PAGE=kc.shape[2] if paged else 1, PAGED=paged,
        LIBDEVICE=use_libdevice(), GDC=gdc, **pdl.launch_options(gdc))
    return q
