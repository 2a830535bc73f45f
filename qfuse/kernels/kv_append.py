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

bits ∈ {4, 8} and D a power of two (`unsupported_reason` decides; `ops.kv_append`
gives other caches the reference). A position outside [0, Nmax) writes nothing, since checking it
on the host would need a device sync. Exact tier (QFUSE_KV_APPEND=0 opts out).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import QuantizedTensor
from . import pdl
from .precise_math import rint_f32, use_libdevice

SUPPORTED_BITS = (4, 8)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _quantize_groups(x, BITS: tl.constexpr, LIBDEVICE: tl.constexpr):
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
def _pack_codes(q, D: tl.constexpr, BITS: tl.constexpr):
    """Codes [ROWS, NG, GROUP] (int32) of rows of D as MLX words [ROWS, D·BITS/32] (int32;
    the first code in the lowest bits)."""
    EPW: tl.constexpr = 32 // BITS
    q = tl.reshape(q, (q.shape[0], D // EPW, EPW))
    # Codes never overlap inside a word, so the sum of shifted codes is their OR.
    return tl.sum(q << (tl.arange(0, EPW) * BITS)[None, None, :], axis=2)


@triton.jit
def _kv_append_kernel(
    x_ptr,  # [B, Hkv, D]
    pos_ptr,  # int32 [B]
    packed_ptr, scales_ptr, biases_ptr,
    stride_xb, stride_xh,
    stride_pb, stride_ph, stride_pn,  # packed strides (b, head, token)
    stride_sb, stride_sh, stride_sn,  # scales/biases strides
    n_max,  # cache capacity: a position outside [0, n_max) writes nothing
    HKV: tl.constexpr,
    D: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    GDC: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.start(GDC)
    bh = tl.program_id(0)
    b = bh // HKV
    h = bh % HKV
    pos = tl.load(pos_ptr + b).to(tl.int64)
    NG: tl.constexpr = D // GROUP
    EPW: tl.constexpr = 32 // BITS
    x = tl.load(x_ptr + b.to(tl.int64) * stride_xb + h * stride_xh + tl.arange(0, D))
    q, scale, bias = _quantize_groups(tl.reshape(x.to(tl.float32), (1, NG, GROUP)), BITS,
                                     LIBDEVICE)
    words = tl.reshape(_pack_codes(q, D, BITS), (D // EPW,))
    scale = tl.reshape(scale, (NG,))
    bias = tl.reshape(bias, (NG,))
    # Positions outside [0, n_max) write nothing. The condition is built on
    # vectors: Triton 3.9's interpreter rejects a scalar store mask.
    w_off = tl.arange(0, D // EPW)
    w_pos = pos + w_off * 0
    base = b.to(tl.int64) * stride_pb + h.to(tl.int64) * stride_ph + pos * stride_pn
    tl.store(packed_ptr + base + w_off, words.to(tl.uint32, bitcast=True),
             mask=(w_pos >= 0) & (w_pos < n_max))
    g_off = tl.arange(0, NG)
    g_pos = pos + g_off * 0
    inside = (g_pos >= 0) & (g_pos < n_max)
    sb = b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh + pos * stride_sn + g_off
    tl.store(scales_ptr + sb, scale.to(scales_ptr.dtype.element_ty), mask=inside)
    tl.store(biases_ptr + sb, bias.to(biases_ptr.dtype.element_ty), mask=inside)


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


def kv_append_quantized(x: torch.Tensor, positions: torch.Tensor, cache: QuantizedTensor) -> None:
    """Write quantize(x[b, h]) into cache[b, h, positions[b]] for every (b, h). In place."""
    B, Hkv, D = x.shape
    positions = positions.to(torch.int32).contiguous()  # the kernel reads positions[b] densely
    if x.stride(-1) != 1:  # rows may be strided (views of the stacked Q/K/V product)
        x = x.contiguous()
    p, s = cache.packed, cache.scales
    gdc = pdl.enabled(x.device)
    _kv_append_kernel[(B * Hkv,)](
        x, positions, p, s, cache.biases,
        x.stride(0), x.stride(1),
        p.stride(0), p.stride(1), p.stride(2),
        s.stride(0), s.stride(1), s.stride(2), p.shape[2],
        HKV=Hkv, D=D, BITS=cache.bits, GROUP=cache.group_size, LIBDEVICE=use_libdevice(),
        GDC=gdc, num_warps=1 if D <= 128 else 2, **pdl.launch_options(gdc),
    )
