"""Quantize one new token's K or V per (sequence, kv head) into a quantized cache slot.

Bit-exact with ``quant.quantize`` (the MLX affine formula, float32 statistics,
IEEE division, round half to even), so a cache filled token by token equals
one quantized in a single call. The write position comes from a device tensor,
so the launch is capturable in a CUDA graph and serves every decode step.

Tensors:
    x          [B, Hkv, D]  new K or V (fp16/bf16/fp32)
    positions  int32 [B]    slot to write in each sequence
    packed     uint32 [B, Hkv, Nmax, D·bits/32]
    scales, biases [B, Hkv, Nmax, D/g]

A paged cache (``block_table`` int32 [B, P]): packed/scales/biases are pools
[num_pages, Hkv, PAGE, ...] and ``positions`` are each sequence's token index, written
at page block_table[b, pos // PAGE], place pos % PAGE (`paging`, the address rule the
decode attention kernels read by).

bits ∈ {4, 8} and D a power of two (`unsupported_reason` decides; `ops.kv_append`
gives other caches the reference). A position outside [0, Nmax) (paged: [0, P·PAGE),
or on a table entry that names no page of the pool) writes nothing, since checking it
on the host would need a device sync. Exact tier (QFUSE_KV_APPEND=0 opts out).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import QuantizedTensor
from ..common import pdl
from ..common.paging import kv_offsets_in, kv_row
from ..common.precise_math import rint_f32, use_libdevice
from ..common.rounding import as_stored

SUPPORTED_BITS = (4, 8)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def quantize_groups(x, BITS: tl.constexpr, LIBDEVICE: tl.constexpr):
    """MLX affine quantization of float32 groups x [ROWS, NG, GROUP] (`quant.quantize`'s
    formula: float32 statistics, IEEE division, round half to even): (codes int32
    [ROWS, NG, GROUP], scales, biases [ROWS, NG] as float32). Elementwise and min/max
    only, so the result does not depend on the tile's layout."""
    n_levels = (1 << BITS) - 1.0
    w_max = tl.max(x, axis=2)
    w_min = tl.min(x, axis=2)
    scale = tl.maximum(tl.math.div_rn(w_max - w_min, n_levels), 1e-7)
    min_is_edge = tl.abs(w_min) > tl.abs(w_max)
    edge = tl.where(min_is_edge, w_min, w_max)
    scale = tl.where(min_is_edge, scale, -scale)
    q0 = rint_f32(tl.math.div_rn(edge, scale), LIBDEVICE)
    nonzero = q0 != 0
    scale = tl.where(nonzero, tl.math.div_rn(edge, tl.where(nonzero, q0, 1.0)), scale)
    bias = tl.where(nonzero, edge, 0.0)
    q = rint_f32(tl.math.div_rn(x - bias[:, :, None], scale[:, :, None]), LIBDEVICE)
    q = tl.minimum(tl.maximum(q, 0.0), n_levels).to(tl.int32)
    return q, scale, bias


@triton.jit
def pack_codes(q, D: tl.constexpr, BITS: tl.constexpr):
    """Codes [ROWS, NG, GROUP] (int32) of rows of D as MLX words [ROWS, D·BITS/32] (int32;
    the first code in the lowest bits)."""
    EPW: tl.constexpr = 32 // BITS
    q = tl.reshape(q, (q.shape[0], D // EPW, EPW))
    # Codes never overlap inside a word, so the sum of shifted codes is their OR.
    return tl.sum(q << (tl.arange(0, EPW) * BITS)[None, None, :], axis=2)


@triton.jit
def store_token(x, b, h, pos, packed_ptr, scales_ptr, biases_ptr, table_ptr, stride_table,
                stride_pb, stride_ph, stride_pn, stride_sb, stride_sh, stride_sn, n_max, n_rows,
                D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                LIBDEVICE: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr):
    """Quantize one token x (float32 [D]) and write it as sequence b's token ``pos`` (int64)
    of kv head h: slotted, or paged through table_ptr (module docstring). A position
    outside [0, n_max), or a table entry outside the store's n_rows, writes nothing."""
    NG: tl.constexpr = D // GROUP
    EPW: tl.constexpr = 32 // BITS
    q, scale, bias = quantize_groups(tl.reshape(x, (1, NG, GROUP)), BITS, LIBDEVICE)
    words = tl.reshape(pack_codes(q, D, BITS), (D // EPW,))
    scale = tl.reshape(scale, (NG,))
    bias = tl.reshape(bias, (NG,))
    # The conditions are built on vectors: Triton 3.9's interpreter rejects a scalar
    # store mask.
    w_off = tl.arange(0, D // EPW)
    w_pos = pos + w_off * 0
    w_in = (w_pos >= 0) & (w_pos < n_max)
    w_row = kv_row(table_ptr, stride_table, b, w_pos, w_in, PAGE, PAGED)
    w_in = w_in & (w_row + w_off * 0 >= 0) & (w_row + w_off * 0 < n_rows)  # slotted: a scalar row
    base = kv_offsets_in(w_row, w_pos, stride_pb, stride_pn, PAGE, PAGED) \
        + h.to(tl.int64) * stride_ph
    tl.store(packed_ptr + base + w_off, words.to(tl.uint32, bitcast=True), mask=w_in)
    g_off = tl.arange(0, NG)
    g_pos = pos + g_off * 0
    inside = (g_pos >= 0) & (g_pos < n_max)
    g_row = kv_row(table_ptr, stride_table, b, g_pos, inside, PAGE, PAGED)
    inside = inside & (g_row + g_off * 0 >= 0) & (g_row + g_off * 0 < n_rows)
    sb = kv_offsets_in(g_row, g_pos, stride_sb, stride_sn, PAGE, PAGED) \
        + h.to(tl.int64) * stride_sh + g_off
    tl.store(scales_ptr + sb, scale.to(scales_ptr.dtype.element_ty), mask=inside)
    tl.store(biases_ptr + sb, bias.to(biases_ptr.dtype.element_ty), mask=inside)


@triton.jit
def store_dense_token(x, b, h, pos, ptr, table_ptr, stride_table, stride_pb, stride_ph,
                      stride_pn, n_max, n_rows, D: tl.constexpr, BF16_BITS: tl.constexpr,
                      PAGE: tl.constexpr, PAGED: tl.constexpr):
    """`store_token` for a dense cache: x (float32 [D], values of the store's dtype) as is."""
    off = tl.arange(0, D)
    p = pos + off * 0
    inside = (p >= 0) & (p < n_max)
    row = kv_row(table_ptr, stride_table, b, p, inside, PAGE, PAGED)
    inside = inside & (row + off * 0 >= 0) & (row + off * 0 < n_rows)
    base = kv_offsets_in(row, p, stride_pb, stride_pn, PAGE, PAGED) + h.to(tl.int64) * stride_ph
    tl.store(ptr + base + off, as_stored(x, ptr, BF16_BITS), mask=inside)


@triton.jit
def _kv_append_kernel(
    x_ptr,  # [B, Hkv, D]
    pos_ptr,  # int32 [B]
    packed_ptr, scales_ptr, biases_ptr,
    table_ptr,  # int32 [B, P] block table (PAGED), else unused
    stride_table,
    stride_xb, stride_xh,
    stride_pb, stride_ph, stride_pn,  # packed strides (b or page, head, token)
    stride_sb, stride_sh, stride_sn,  # scales/biases strides
    n_max,  # tokens per sequence: a position outside [0, n_max) writes nothing
    n_rows,  # rows of the store (B, or pages): a table entry outside writes nothing
    HKV: tl.constexpr,
    D: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    PAGE: tl.constexpr,  # tokens per page of a paged cache
    PAGED: tl.constexpr,  # the cache is a pool of pages written through table_ptr
    GDC: tl.constexpr,  # programmatic dependent launch (kernels/common/pdl.py)
):
    pdl.start(GDC)
    bh = tl.program_id(0)
    b = bh // HKV
    h = bh % HKV
    pos = tl.load(pos_ptr + b).to(tl.int64)
    x = tl.load(x_ptr + b.to(tl.int64) * stride_xb + h * stride_xh + tl.arange(0, D))
    store_token(x.to(tl.float32), b, h, pos, packed_ptr, scales_ptr, biases_ptr, table_ptr,
                stride_table, stride_pb, stride_ph, stride_pn, stride_sb, stride_sh, stride_sn,
                n_max, n_rows, D, BITS, GROUP, LIBDEVICE, PAGE, PAGED)


def unsupported_reason(x: torch.Tensor, cache: QuantizedTensor) -> str | None:
    """Why the kernel cannot write x into this cache (None when it can)."""
    D = x.shape[-1]
    if cache.bits not in SUPPORTED_BITS or cache.packed.stride(-1) != 1:
        return f"{cache.bits}-bit cache (kernel: 4, 8) or strided words"
    if cache.biases.stride() != cache.scales.stride():
        return "scales and biases laid out differently"
    if D & (D - 1):
        return f"head dim {D} is not a power of two"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"x dtype {x.dtype}"
    return None


def kv_append_quantized(x: torch.Tensor, positions: torch.Tensor, cache: QuantizedTensor,
                        block_table: torch.Tensor | None = None) -> None:
    """Write quantize(x[b, h]) into cache[b, h, positions[b]] for every (b, h), or with a
    ``block_table`` (int32 [B, P], contiguous rows) into the pool's page of that
    position (module docstring). In place."""
    B, Hkv, D = x.shape
    positions = positions.to(torch.int32).contiguous()  # the kernel reads positions[b] densely
    if x.stride(-1) != 1:  # rows may be strided (views of the stacked Q/K/V product)
        x = x.contiguous()
    p, s = cache.packed, cache.scales
    gdc = pdl.enabled(x.device)
    paged = block_table is not None
    if paged and (block_table.dtype != torch.int32 or block_table.stride(-1) != 1):
        raise ValueError(f"the block table must be int32 with a contiguous last dim, got "
                         f"{block_table.dtype}")
    n_max = p.shape[2] * block_table.shape[1] if paged else p.shape[2]
    _kv_append_kernel[(B * Hkv,)](
        x, positions, p, s, cache.biases,
        block_table if paged else positions, block_table.stride(0) if paged else 0,
        x.stride(0), x.stride(1),
        p.stride(0), p.stride(1), p.stride(2),
        s.stride(0), s.stride(1), s.stride(2), n_max, p.shape[0],
        HKV=Hkv, D=D, BITS=cache.bits, GROUP=cache.group_size, LIBDEVICE=use_libdevice(),
        PAGE=p.shape[2] if paged else 1, PAGED=paged, GDC=gdc, num_warps=1 if D <= 128 else 2, **pdl.launch_options(gdc),
    )
