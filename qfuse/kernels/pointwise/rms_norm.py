"""RMSNorm in one pass: y = x·rsqrt(mean(x²) + eps)·w, or ·(1 + w) (Gemma), and a
decoder layer's residual joint in one pass: h = residual + RMSNorm(a), n = RMSNorm(h).

Why: the spelled-out form is about ten PyTorch kernels per call, and a decode step
runs one or more per layer.

Rounding follows `reference.rms_norm` operation by operation (float32 math, the mean
as sum × (1/D), rsqrt of mean + eps, then for Llama/Qwen rounding the normalized row
to x's dtype before multiplying by w, for Gemma multiplying by 1 + w in float32 and
rounding once). Only the order of the float32 sum of squares differs from PyTorch's
reduction, so an output can differ from compat by one rounding step where that sum
lands near a rounding boundary: a fast-tier kernel (QFUSE_RMS_NORM=0 opts out of
both). The joint rounds h as the add of two tensors of its dtype does, and its sums
reduce in the RMSNorm kernel's order (`tiling`), so its h and n equal the three ops
apart; a post-norm in the Llama form or in float32 is not taken (bench/NOTES.md, "The
residual joint in one launch").

One program normalizes ROWS rows of up to BLOCK_D = next_pow2(D) columns held in
registers (D ≤ 16384). Both kernels are PDL-ready and graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import pdl
from ..common.rounding import as_stored, emulates_bf16, round_like, stored_view

MAX_DIM = 16384
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def norm_factor(x, eps, inv_d):
    """rsqrt(mean(x²) + eps) per row of a float32 tile [ROWS, BLOCK_D] (compat's
    h.pow(2).mean(-1) is PyTorch's sum times the float32 1/D). The sum's order is the
    tile's (`tiling`), shared by the RMSNorm and residual-joint kernels."""
    return tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_d + eps)


@triton.jit
def scale_normed(x, r, w, out_ptr, UNIT_OFFSET: tl.constexpr, OUT_BF16_BITS: tl.constexpr):
    """float32 rows x [ROWS, BLOCK_D] times their `norm_factor` r, scaled by w [BLOCK_D],
    rounded as compat rounds (a float32 tile holding values of out_ptr's dtype)."""
    h = x * r[:, None]
    if UNIT_OFFSET:
        y = round_like(h * (1.0 + w.to(tl.float32))[None, :], out_ptr, OUT_BF16_BITS)
    else:
        # compat rounds the normalized row to x's dtype, then multiplies by w in
        # x's dtype (float32 arithmetic, one rounding)
        y = round_like(round_like(h, out_ptr, OUT_BF16_BITS) * w.to(tl.float32)[None, :],
                       out_ptr, OUT_BF16_BITS)
    return y


@triton.jit
def normed(x, w, out_ptr, eps, inv_d, UNIT_OFFSET: tl.constexpr, OUT_BF16_BITS: tl.constexpr):
    """float32 rows x [ROWS, BLOCK_D] normalized and scaled by w, rounded as compat rounds."""
    return scale_normed(x, norm_factor(x, eps, inv_d), w, out_ptr, UNIT_OFFSET, OUT_BF16_BITS)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, D, stride_x, stride_out, eps, inv_d,
                     UNIT_OFFSET: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                     OUT_BF16_BITS: tl.constexpr, GDC: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < D)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)  # a weight: before the wait
    pdl.start(GDC)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=ok,
                other=0.0).to(tl.float32)
    y = normed(x, w, out_ptr, eps, inv_d, UNIT_OFFSET, OUT_BF16_BITS)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :],
             as_stored(y, out_ptr, OUT_BF16_BITS), mask=ok)


@triton.jit
def joint_rows(a, res, post_w, next_w, h_ptr, n_ptr, eps, inv_d, HAS_POST: tl.constexpr,
               HAS_NEXT: tl.constexpr, UNIT_OFFSET: tl.constexpr, OUT_BF16_BITS: tl.constexpr):
    """The joint's arithmetic on float32 rows a [ROWS, BLOCK_D] and the residual's rows
    res (columns past D zero in both): (h, n) as float32 tiles holding values of h's and
    n's dtypes, h = res + post_norm(a) (or + a) and n = next_norm(h) (h without a next
    weight), each step rounded where the spelled-out ops round."""
    if HAS_POST:
        a = normed(a, post_w, h_ptr, eps, inv_d, UNIT_OFFSET, OUT_BF16_BITS)
    # the add of two tensors of the output's dtype: a float32 sum, rounded once
    h = round_like(res.to(tl.float32) + a, h_ptr, OUT_BF16_BITS)
    n = h
    if HAS_NEXT:
        n = normed(h, next_w, n_ptr, eps, inv_d, UNIT_OFFSET, OUT_BF16_BITS)
    return h, n


@triton.jit
def _residual_rms_norm_kernel(a_ptr, res_ptr, post_w_ptr, next_w_ptr, h_ptr, n_ptr, n_rows, D,
                              stride_a, stride_res, eps, inv_d, HAS_POST: tl.constexpr,
                              HAS_NEXT: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                              ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                              OUT_BF16_BITS: tl.constexpr, GDC: tl.constexpr):
    """h = residual + post_norm(a) (or + a), then n = next_norm(h) (`joint_rows`)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < D)
    # a weight the joint lacks is never read: its pointer stands in for the load
    post_w = tl.load(post_w_ptr + cols, mask=(cols < D) & HAS_POST, other=0.0)
    next_w = tl.load(next_w_ptr + cols, mask=(cols < D) & HAS_NEXT, other=0.0)
    pdl.start(GDC)
    r64 = rows[:, None].to(tl.int64)
    a = tl.load(a_ptr + r64 * stride_a + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + r64 * stride_res + cols[None, :], mask=ok, other=0.0)
    h, y = joint_rows(a, res, post_w, next_w, h_ptr, n_ptr, eps, inv_d, HAS_POST, HAS_NEXT,
                      UNIT_OFFSET, OUT_BF16_BITS)
    tl.store(h_ptr + r64 * D + cols[None, :], as_stored(h, h_ptr, OUT_BF16_BITS), mask=ok)
    if HAS_NEXT:
        tl.store(n_ptr + r64 * D + cols[None, :], as_stored(y, n_ptr, OUT_BF16_BITS), mask=ok)


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor,
                       unit_offset: bool = False) -> str | None:
    """None when the kernel takes these inputs, else why not."""
    if x.dtype not in SUPPORTED_DTYPES:
        return f"x dtype {x.dtype} (kernel: fp16, bf16, fp32)"
    D = x.shape[-1]
    if D == 0 or D > MAX_DIM:
        return f"last dim {D} (kernel: 1..{MAX_DIM})"
    if weight.dim() != 1 or weight.shape[0] != D or weight.stride(0) != 1:
        return f"weight {tuple(weight.shape)} (kernel: contiguous [{D}])"
    if weight.dtype not in SUPPORTED_DTYPES:
        return f"weight dtype {weight.dtype}"
    if not unit_offset and weight.dtype != x.dtype:
        # the Llama form multiplies by w in x's dtype; compat promotes a weight of
        # another dtype, which the kernel does not
        return f"weight dtype {weight.dtype} differs from x's {x.dtype} (Llama form)"
    if x.stride(-1) != 1:
        return "x needs a contiguous last dimension"
    return None


def tiling(D: int) -> tuple[int, int, int]:
    """(rows per program, BLOCK_D, warps) for rows of D: about 4096 elements per program
    (one row of a 3840-wide hidden state, 16 rows of a 256-wide head), one warp per 1024.
    Both kernels use it, so their float32 sums reduce in the same order."""
    block_d = triton.next_power_of_2(D)
    rows = max(1, min(64, 4096 // block_d))
    return rows, block_d, max(1, min(8, rows * block_d // 1024))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             unit_offset: bool = False, checked: bool = False) -> torch.Tensor:
    """`reference.rms_norm` in one launch: x [..., D] → [..., D] in x's dtype. ``checked``:
    the caller has had None from `unsupported_reason` for inputs of this layout."""
    reason = None if checked else unsupported_reason(x, weight, unit_offset)
    if reason is not None:
        raise ValueError(f"rms_norm kernel cannot take these inputs: {reason}")
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    n_rows = x2.shape[0]
    out = torch.empty(n_rows, D, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return out.reshape(x.shape)
    rows, block_d, warps = tiling(D)
    gdc = pdl.enabled(x.device)
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x2, weight, stored_view(out), n_rows, D,
        x2.stride(0), out.stride(0), eps, 1.0 / D, UNIT_OFFSET=unit_offset, ROWS=rows,
        BLOCK_D=block_d, OUT_BF16_BITS=emulates_bf16(out.dtype), GDC=gdc,
        num_warps=warps, **pdl.launch_options(gdc))
    return out.reshape(x.shape)


def residual_unsupported_reason(a: torch.Tensor, residual: torch.Tensor,
                                post_weight: torch.Tensor | None,
                                next_weight: torch.Tensor | None,
                                unit_offset: bool = False) -> str | None:
    """None when `residual_rms_norm` takes these inputs, else why not."""
    if post_weight is None and next_weight is None:
        return "no norm to fuse"
    if a.shape != residual.shape or a.dtype != residual.dtype:
        return (f"a {tuple(a.shape)} {a.dtype} and residual {tuple(residual.shape)} "
                f"{residual.dtype} differ")
    if residual.stride(-1) != 1:
        return "residual needs a contiguous last dimension"
    if post_weight is not None and (not unit_offset or a.dtype == torch.float32):
        # Seen on the H200: in float32 the add contracts into an FMA with the norm's
        # product; in the Llama form it differed by one ulp, cause not yet found.
        return "a post-norm in the Llama form or in float32 (kept as separate launches)"
    for w in (post_weight, next_weight):
        reason = None if w is None else unsupported_reason(a, w, unit_offset)
        if reason is not None:
            return reason
    return None


def residual_rms_norm(a: torch.Tensor, residual: torch.Tensor,
                      post_weight: torch.Tensor | None, next_weight: torch.Tensor | None,
                      eps: float, unit_offset: bool = False, checked: bool = False):
    """One launch for ``h = residual + rms_norm(a, post_weight)`` (``+ a`` without a post
    weight) and ``n = rms_norm(h, next_weight)`` (None without a next weight): (h, n),
    the values `rms_norm`, the add and `rms_norm` give as three launches."""
    reason = None if checked else residual_unsupported_reason(a, residual, post_weight,
                                                              next_weight, unit_offset)
    if reason is not None:
        raise ValueError(f"residual_rms_norm kernel cannot take these inputs: {reason}")
    D = a.shape[-1]
    a2, res2 = a.reshape(-1, D), residual.reshape(-1, D)
    n_rows = a2.shape[0]
    h = torch.empty(n_rows, D, dtype=a.dtype, device=a.device)
    n = torch.empty_like(h) if next_weight is not None else None
    if n_rows:
        rows, block_d, warps = tiling(D)
        gdc = pdl.enabled(a.device)
        _residual_rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
            a2, res2, post_weight if post_weight is not None else a2,
            next_weight if next_weight is not None else a2, stored_view(h),
            stored_view(n if n is not None else h), n_rows, D, a2.stride(0), res2.stride(0),
            eps, 1.0 / D, HAS_POST=post_weight is not None, HAS_NEXT=next_weight is not None,
            UNIT_OFFSET=unit_offset, ROWS=rows, BLOCK_D=block_d,
            OUT_BF16_BITS=emulates_bf16(a.dtype), GDC=gdc, num_warps=warps,
            **pdl.launch_options(gdc))
    return h.reshape(a.shape), (n.reshape(a.shape) if n is not None else None)
