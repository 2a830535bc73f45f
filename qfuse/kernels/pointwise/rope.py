"""Rotary position embedding in one launch: x·cos + rotate_half(x)·sin (HF convention).

Contract (`apply_rotary`):

    x         [B, H, T, D] fp16/bf16/fp32, any strides but a contiguous last
              dimension (q and k arrive as transposed views of the projections);
              D even, at most MAX_HEAD_DIM
    cos, sin  [B, T, D] in x's dtype, equal strides, contiguous last dimension (a
              stride of 0 is allowed, as expanded positions give)
    returns   a new tensor with x's shape, dtype and layout

Bit-identical to `reference.apply_rotary`: it is elementwise and rounds where
PyTorch rounds (each product to x's dtype, then their sum), so it belongs to the
exact tier (QFUSE_ROPE=0 opts out). Deterministic; the grid depends on shapes
only and nothing is read on the host, so it can be captured in a CUDA graph.

Why a kernel: spelled out, RoPE is five PyTorch kernels per rotated tensor (neg,
cat, two multiplies, add), ten per decoder layer and step.

One program rotates ROWS (b, h, t) rows of ~2048 elements in all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import pdl
from ..common.precise_math import mul_rn_f32, use_libdevice
from ..common.rounding import as_stored, emulates_bf16, round_like, stored_view

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 1024


@triton.jit
def rotated(x, xp, first_half, cos, sin, out_ptr, BF16_BITS: tl.constexpr,
            LIBDEVICE: tl.constexpr):
    """x·cos + rotate_half(x)·sin over float32 tiles [ROWS, BLOCK_D], xp holding each
    element's partner (d ± D/2) and first_half [BLOCK_D] marking d < D/2. The two products
    are rounded to out_ptr's dtype, their float32 sum is not (the store rounds it)."""
    # × -1 rather than unary minus, which Triton emits as 0 - x: +0 for +0 where
    # torch.neg gives -0
    rot = tl.where(first_half[None, :], xp * -1.0, xp)
    # PyTorch rounds x·cos and rotate_half(x)·sin to x's dtype, then their sum; the
    # products must not be contracted into an FMA with the add (mul_rn_f32)
    return (round_like(mul_rn_f32(x, cos, LIBDEVICE), out_ptr, BF16_BITS)
            + round_like(mul_rn_f32(rot, sin, LIBDEVICE), out_ptr, BF16_BITS))


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, H, T, D,
                 sx_b, sx_h, sx_t, sc_b, sc_t, so_b, so_h, so_t,
                 ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BF16_BITS: tl.constexpr,
                 LIBDEVICE: tl.constexpr, GDC: tl.constexpr):
    pdl.start(GDC)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # flat (b, h, t)
    t = r % T
    h = (r // T) % H
    b = r // (T * H)
    d = tl.arange(0, BLOCK_D)
    half = D // 2
    # rotate_half(x)[d] = -x[d + D/2] for the first half, x[d - D/2] for the second
    partner = tl.where(d < half, d + half, d - half)
    ok = (r[:, None] < n_rows) & (d[None, :] < D)
    x_row = (x_ptr + b[:, None].to(tl.int64) * sx_b + h[:, None].to(tl.int64) * sx_h
             + t[:, None].to(tl.int64) * sx_t)
    c_row = b[:, None].to(tl.int64) * sc_b + t[:, None].to(tl.int64) * sc_t
    x = tl.load(x_row + d[None, :], mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(x_row + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + c_row + d[None, :], mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + c_row + d[None, :], mask=ok, other=0.0).to(tl.float32)
    y = rotated(x, xp, d < half, cos, sin, out_ptr, BF16_BITS, LIBDEVICE)
    out_row = (out_ptr + b[:, None].to(tl.int64) * so_b + h[:, None].to(tl.int64) * so_h
               + t[:, None].to(tl.int64) * so_t)
    tl.store(out_row + d[None, :], as_stored(y, out_ptr, BF16_BITS), mask=ok)


def unsupported_reason(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """None when the kernel takes these inputs, else why not."""
    if x.dim() != 4:
        return f"x of {x.dim()} dims (kernel: [B, H, T, D])"
    B, _, T, D = x.shape
    if x.dtype not in SUPPORTED_DTYPES:
        return f"x dtype {x.dtype} (kernel: fp16, bf16, fp32)"
    if D % 2 or D > MAX_HEAD_DIM:
        return f"head dim {D} (kernel: even, at most {MAX_HEAD_DIM})"
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != x.dtype:
            return f"{name} dtype {t.dtype} differs from x's {x.dtype}"
        if t.shape != (B, T, D):
            return f"{name} shape {tuple(t.shape)} (kernel: [{B}, {T}, {D}])"
        if t.stride(-1) != 1:
            return f"{name} needs a contiguous last dimension"
    if cos.stride() != sin.stride():
        return "cos and sin strides differ"
    if x.stride(-1) != 1:
        return "x needs a contiguous last dimension"
    return None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 checked: bool = False) -> torch.Tensor:
    """`reference.apply_rotary` in one launch, bitwise: x [B, H, T, D], cos/sin [B, T, D].
    ``checked``: the caller has had None from `unsupported_reason` for this layout."""
    reason = None if checked else unsupported_reason(x, cos, sin)
    if reason is not None:
        raise ValueError(f"rope kernel cannot take these inputs: {reason}")
    B, H, T, D = x.shape
    out = torch.empty_like(x)  # x's layout, as PyTorch's elementwise result keeps it
    n_rows = B * H * T
    if n_rows == 0:
        return out
    block_d = triton.next_power_of_2(D)
    rows = max(1, min(64, 2048 // block_d))  # ~2048 elements per program
    gdc = pdl.enabled(x.device)
    _rope_kernel[(triton.cdiv(n_rows, rows),)](
        x, cos, sin, stored_view(out), n_rows, H, T, D,
        x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        ROWS=rows, BLOCK_D=block_d, BF16_BITS=emulates_bf16(out.dtype),
        LIBDEVICE=use_libdevice(), GDC=gdc, num_warps=4, **pdl.launch_options(gdc))
    return out
