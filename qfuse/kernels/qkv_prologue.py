"""A decode step's attention prologue in one launch: after the Q/K/V product, every head
is normed (q_norm / k_norm, where the model has them), rotated (RoPE), and the new K and
V are written into the KV cache (quantized, or stored dense); q comes back rotated.

It replaces, per layer and step, up to six launches (two RMSNorms, two RoPEs, two KV
appends) with one, and rounds where those kernels round, through their own helpers:
`rms_norm.norm_factor` / `scale_normed` over tiles of `rms_norm.tiling`'s shape and
warps (the float32 sum of squares is the only order-dependent step), `rope.rotated`,
`kv_append.quantize_groups` / `pack_codes` (min, max and elementwise: exact in any
order). So its q and cache equal what the separate kernels give.

Contract (`qkv_prologue`):

    q, k, v    [B, Hq·D], [B, Hkv·D], [B, Hkv·D]: one decode row per sequence of the
               Q/K/V product (views with any row stride, contiguous last dimension),
               fp16/bf16/fp32, one dtype
    q_norm, k_norm   [D] weights in that dtype (the Llama form) or any float dtype
               (Gemma's 1 + w), or both None
    cos, sin   [B, D] in that dtype, contiguous last dimension, equal strides
    k_cache, v_cache  [B, Hkv, N, D]: QuantizedTensors of 4 or 8 bits with scales in
               that dtype, or dense tensors in it; the two laid out alike
    slots      int32 [B], each in [0, N) (the caller checks: `KVCache.step_indices`);
               a slot outside writes nothing
    returns    q normed and rotated, [B, Hq, D] contiguous

D is a power of two (≤ 1024). Deterministic, nothing read on the host, grid from shapes
only: capturable in a CUDA graph. PDL-ready: the norm weights load before the wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import QuantizedTensor
from . import pdl
from .kv_append import SUPPORTED_BITS, pack_codes, quantize_groups
from .precise_math import use_libdevice
from .rms_norm import norm_factor, scale_normed, tiling
from .rms_norm import unsupported_reason as norm_unsupported_reason
from .rope import rotated
from .rounding import as_stored, emulates_bf16, round_like, stored_view

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 1024


@triton.jit
def _normed_rotated(row_ptr, ok, d, partner, first_half, w, wp, cos, sin, out_ptr, eps,
                    inv_d, NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                    BF16_BITS: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Heads of one product row ([ROWS, 1] pointers to each head's first element), normed
    (NORM: weights w at d, wp at each partner) and rotated: float32 values rounded to
    out_ptr's dtype, but for the rotation's final sum (the store, or the caller, rounds)."""
    x = tl.load(row_ptr + d[None, :], mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(row_ptr + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    if NORM:
        # One factor per head, from x; the partners are the same head's elements, so
        # their normed values are those the separate RMSNorm stores at the partner.
        r = norm_factor(x, eps, inv_d)
        x = scale_normed(x, r, w, out_ptr, UNIT_OFFSET, BF16_BITS)
        xp = scale_normed(xp, r, wp, out_ptr, UNIT_OFFSET, BF16_BITS)
    return rotated(x, xp, first_half, cos, sin, out_ptr, BF16_BITS, LIBDEVICE)


@triton.jit
def _write_token(y, heads, head_ok, d, b, slot, n_max, cache_ptr, scales_ptr, biases_ptr,
                 stride_cb, stride_ch, stride_cn, stride_sb, stride_sh, stride_sn,
                 D: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr,
                 GROUP: tl.constexpr, BF16_BITS: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Heads [ROWS] of one token (float32 y [ROWS, D] holding values of the cache's dtype)
    into cache slot ``slot`` of sequence b: quantized as `quant.quantize` does (BITS 4/8)
    or stored (BITS 0). A slot outside [0, n_max) writes nothing."""
    # built on vectors: Triton 3.9's interpreter rejects a scalar in a store mask
    slot_v = slot + heads.to(tl.int64) * 0
    row_ok = (head_ok & (slot_v >= 0) & (slot_v < n_max))[:, None]  # [ROWS, 1]
    head_off = b.to(tl.int64) * stride_cb + heads.to(tl.int64) * stride_ch + slot * stride_cn
    if BITS == 0:
        tl.store(cache_ptr + head_off[:, None] + d[None, :],
                 as_stored(y, cache_ptr, BF16_BITS), mask=row_ok)
    else:
        NG: tl.constexpr = D // GROUP
        W: tl.constexpr = D * BITS // 32
        q, scale, bias = quantize_groups(tl.reshape(y, (ROWS, NG, GROUP)), BITS, LIBDEVICE)
        words = pack_codes(q, D, BITS)
        w_idx = tl.arange(0, W)
        tl.store(cache_ptr + head_off[:, None] + w_idx[None, :],
                 words.to(tl.uint32, bitcast=True), mask=row_ok)
        g_idx = tl.arange(0, NG)
        sb = (b.to(tl.int64) * stride_sb + heads.to(tl.int64) * stride_sh
              + slot * stride_sn)[:, None] + g_idx[None, :]
        tl.store(scales_ptr + sb, scale.to(scales_ptr.dtype.element_ty), mask=row_ok)
        tl.store(biases_ptr + sb, bias.to(biases_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _qkv_prologue_kernel(
    q_ptr, k_ptr, v_ptr,  # decode rows of the Q/K/V product: [B, H·D] each
    stride_q, stride_k, stride_v,  # their row strides
    q_norm_ptr, k_norm_ptr,  # [D] norm weights (read when NORM)
    cos_ptr, sin_ptr, stride_cs,  # [B, D] rotation tables, their row stride
    slots_ptr,  # int32 [B]: the cache slot of each sequence's new token
    q_out_ptr,  # [B, HQ, D] contiguous: q normed and rotated
    kc_ptr, ks_ptr, kb_ptr,  # K cache: packed words, scales, biases (dense: values)
    vc_ptr, vs_ptr, vb_ptr,  # V cache, laid out as K's
    stride_cb, stride_ch, stride_cn,  # words (or values) strides: sequence, head, slot
    stride_sb, stride_sh, stride_sn,  # scales/biases strides
    n_max,  # cache slots per sequence
    eps, inv_d,  # the norm's epsilon and 1/D
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    ROWS: tl.constexpr,  # heads per program (`rms_norm.tiling`'s rows)
    NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
    BITS: tl.constexpr,  # 0: dense cache
    GROUP: tl.constexpr, BF16_BITS: tl.constexpr, LIBDEVICE: tl.constexpr,
    GDC: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    b = tl.program_id(0)
    tile = tl.program_id(1)  # q head tiles, then k head tiles, then v head tiles
    NQ: tl.constexpr = (HQ + ROWS - 1) // ROWS
    NK: tl.constexpr = (HKV + ROWS - 1) // ROWS
    rows = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    first_half = d < D // 2
    # rotate_half(x)[d] = -x[d + D/2] for the first half, x[d - D/2] for the second
    partner = tl.where(first_half, d + D // 2, d - D // 2)
    # norm weights at each element and its partner: parameters, so before the wait
    if NORM:
        qw, qwp = tl.load(q_norm_ptr + d), tl.load(q_norm_ptr + partner)
        kw, kwp = tl.load(k_norm_ptr + d), tl.load(k_norm_ptr + partner)
    else:
        qw = d
        qwp = d
        kw = d
        kwp = d
    pdl.start(GDC)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    cs = b.to(tl.int64) * stride_cs + d
    if tile < NQ + NK:
        cos = tl.load(cos_ptr + cs).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + cs).to(tl.float32)[None, :]
        if tile < NQ:
            heads = tile * ROWS + rows
            ok = (heads < HQ)[:, None] & (d[None, :] < D)
            row = q_ptr + b.to(tl.int64) * stride_q + heads[:, None] * D
            y = _normed_rotated(row, ok, d, partner, first_half, qw, qwp, cos, sin,
                                q_out_ptr, eps, inv_d, NORM, UNIT_OFFSET, BF16_BITS, LIBDEVICE)
            out = q_out_ptr + (b.to(tl.int64) * HQ + heads[:, None]) * D + d[None, :]
            tl.store(out, as_stored(y, q_out_ptr, BF16_BITS), mask=ok)
        else:
            heads = (tile - NQ) * ROWS + rows
            ok = (heads < HKV)[:, None] & (d[None, :] < D)
            row = k_ptr + b.to(tl.int64) * stride_k + heads[:, None] * D
            y = _normed_rotated(row, ok, d, partner, first_half, kw, kwp, cos, sin,
                                q_out_ptr, eps, inv_d, NORM, UNIT_OFFSET, BF16_BITS, LIBDEVICE)
            # the rotated k as its dtype holds it (what the separate RoPE stores)
            y = round_like(y, q_out_ptr, BF16_BITS)
            _write_token(y, heads, heads < HKV, d, b, slot, n_max, kc_ptr, ks_ptr, kb_ptr,
                         stride_cb, stride_ch, stride_cn, stride_sb, stride_sh, stride_sn,
                         D, ROWS, BITS, GROUP, BF16_BITS, LIBDEVICE)
    else:
        heads = (tile - NQ - NK) * ROWS + rows
        ok = (heads < HKV)[:, None] & (d[None, :] < D)
        row = v_ptr + b.to(tl.int64) * stride_v + heads[:, None] * D
        y = tl.load(row + d[None, :], mask=ok, other=0.0).to(tl.float32)
        _write_token(y, heads, heads < HKV, d, b, slot, n_max, vc_ptr, vs_ptr, vb_ptr,
                     stride_cb, stride_ch, stride_cn, stride_sb, stride_sh, stride_sn,
                     D, ROWS, BITS, GROUP, BF16_BITS, LIBDEVICE)


def _cache_parts(c):
    if isinstance(c, QuantizedTensor):
        return c.packed, c.scales, c.biases
    return stored_view(c), c, c  # scales/biases unused for a dense cache


def unsupported_reason(q, k, v, q_norm, k_norm, cos, sin, k_cache, v_cache,
                       slots, unit_offset: bool = False) -> str | None:
    """Why the kernel cannot take these inputs (None when it can)."""
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} (kernel: one of fp16, bf16, fp32)"
    if q.dim() != 2 or k.dim() != 2 or v.dim() != 2:
        return "q, k, v must be decode rows [B, H·D]"
    if any(t.stride(-1) != 1 for t in (q, k, v, cos, sin)):
        return "q, k, v, cos and sin need a contiguous last dimension"
    if (q_norm is None) != (k_norm is None):
        return "q_norm and k_norm come together"
    if type(k_cache) is not type(v_cache):
        return "k and v caches differ in kind"
    B, Hkv, _, D = k_cache.shape
    if D & (D - 1) or D > MAX_HEAD_DIM or D < 2:
        return f"head dim {D} (kernel: a power of two up to {MAX_HEAD_DIM})"
    if q.shape[0] != B or q.shape[1] % D or k.shape != (B, Hkv * D) or v.shape != k.shape:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit the cache"
    if tuple(cos.shape) != (B, D) or cos.dtype != q.dtype or cos.stride() != sin.stride() \
            or sin.shape != cos.shape or sin.dtype != q.dtype:
        return f"cos/sin {tuple(cos.shape)} {cos.dtype} (kernel: [{B}, {D}] in q's dtype)"
    if slots.shape != (B,) or slots.dtype not in (torch.int32, torch.int64):
        return "slots must be int [B]"
    for w in (q_norm, k_norm):
        # what the RMSNorm kernel takes, so the fused values are that kernel's
        reason = None if w is None else norm_unsupported_reason(q[:, :D], w, unit_offset)
        if reason is not None:
            return f"the q/k norm: {reason}"
    if isinstance(k_cache, QuantizedTensor):
        for c in (k_cache, v_cache):
            if c.bits not in SUPPORTED_BITS or c.scales.dtype != q.dtype:
                return (f"{c.bits}-bit cache with {c.scales.dtype} scales (kernel: 4 or 8 bits, "
                        "scales in q's dtype)")
            if c.packed.stride(-1) != 1 or c.scales.stride(-1) != 1 \
                    or c.biases.stride() != c.scales.stride():
                return "cache words, scales and biases need one layout with a contiguous last dim"
        if (k_cache.bits, k_cache.group_size) != (v_cache.bits, v_cache.group_size) or \
                k_cache.packed.stride() != v_cache.packed.stride() or \
                k_cache.scales.stride() != v_cache.scales.stride():
            return "k and v caches differ in format or layout"
    elif k_cache.dtype != q.dtype or k_cache.stride() != v_cache.stride() \
            or k_cache.stride(-1) != 1:
        return "dense caches must share q's dtype and one layout with a contiguous last dim"
    return None


def qkv_prologue(q, k, v, q_norm, k_norm, eps: float, unit_offset: bool, cos, sin,
                 k_cache, v_cache, slots, supported: bool = False) -> torch.Tensor:
    """The module docstring's contract, in one launch: q [B, Hq, D] normed and rotated;
    k normed and rotated and v written into their caches at ``slots``. ``supported``: the
    caller has had None from `unsupported_reason` for these inputs (`ops.qkv_prologue`)."""
    reason = None if supported else unsupported_reason(
        q, k, v, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, unit_offset)
    if reason is not None:
        raise ValueError(f"qkv_prologue kernel cannot take these inputs: {reason}")
    B, Hkv, n_max, D = k_cache.shape
    Hq = q.shape[1] // D
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    rows, _, warps = tiling(D)  # the RMSNorm kernel's tile: its sums' order
    quantized = isinstance(k_cache, QuantizedTensor)
    kc, ks, kb = _cache_parts(k_cache)
    vc, vs, vb = _cache_parts(v_cache)
    norm = q_norm is not None
    gdc = pdl.enabled(q.device)
    grid = (B, 2 * triton.cdiv(Hkv, rows) + triton.cdiv(Hq, rows))
    _qkv_prologue_kernel[grid](
        q, k, v, q.stride(0), k.stride(0), v.stride(0),
        q_norm if norm else q, k_norm if norm else q, cos, sin, cos.stride(0),
        slots.to(torch.int32).contiguous(), stored_view(out), kc, ks, kb, vc, vs, vb,
        kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        n_max, eps, 1.0 / D,
        HQ=Hq, HKV=Hkv, D=D, ROWS=rows, NORM=norm, UNIT_OFFSET=unit_offset,
        BITS=k_cache.bits if quantized else 0, GROUP=k_cache.group_size if quantized else D,
        BF16_BITS=emulates_bf16(q.dtype), LIBDEVICE=use_libdevice(), GDC=gdc,
        num_warps=warps, **pdl.launch_options(gdc))
    return out
