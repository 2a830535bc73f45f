"""The O and down steps: one launch for a product and the residual joint after it.

Contract (`joint_step`):

    x          [M, K], 1..MAX_ROWS rows (the attention's output for O, the gated
               activation for down), fp16/bf16/fp32
    w          QuantizedTensor [N, K], 4 or 8 bits, MLX layout; bias None or [N]
    residual   [M, N] in x's dtype: the residual stream before the joint
    post_weight, next_weight   None or [N]: the norm of the product before the add (Gemma's
               sandwich norms) and the norm after it (the next op's input norm)
    returns    (h, n): h = residual + post_norm(a) (or + a) and n = next_norm(h) (None
               without a next weight), a = x·dequant(w)ᵀ + bias rounded to x's dtype

Equal, op for op, to the product (`products.qmatmul`) followed by
`pointwise.rms_norm.residual_rms_norm`, but for the order of the float32 sums (fast
tier): every column tile of the product is one tile of the row unit, and the last to
finish runs the joint over whole rows (`joint`). A post-norm in the Llama form or in
float32 is refused, as the residual-joint kernel refuses it. Deterministic; the first
call on a device must run eagerly (its counters), later calls can be captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import QuantizedTensor
from ..common import pdl
from ..common.rounding import emulates_bf16, stored_view
from ..common.units import unit_counters
from ..pointwise import rms_norm
from ..products.qmatmul import gemv_product, gemv_shape, gemv_unsupported_reason, weight_rounding
from ..products.splitk import semaphores, split_workspace
from .joint import arrive_joint, joint_epilogue, joint_owners

MAX_ROWS = 8


@triton.jit
def _joint_step_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, bias_ptr,
    a_ptr,  # scratch [M, N]: the product, read back by the joint
    ws_ptr, sem_ptr, cnt_ptr, res_ptr, post_w_ptr, next_w_ptr, h_ptr, n_ptr,
    N, K, magic, stride_xm, stride_wn, stride_wsn, stride_wbn, stride_res, eps, inv_d,
    ROWS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GPI: tl.constexpr,
    ITERS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
    HAS_BIAS: tl.constexpr, Y_BF16_BITS: tl.constexpr, ROUND: tl.constexpr,
    PAIRS: tl.constexpr, NATIVE: tl.constexpr, TILES: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_POST: tl.constexpr, HAS_NEXT: tl.constexpr, UNIT_OFFSET: tl.constexpr,
    OWNERS: tl.constexpr, GDC: tl.constexpr,
):
    stored = gemv_product(x_ptr, w_ptr, s_ptr, b_ptr, a_ptr, bias_ptr, a_ptr, ws_ptr,
                          sem_ptr, N, K, magic, stride_xm, stride_wn, stride_wsn, stride_wbn, N,
                          N, ROWS, BITS, GROUP, GPI, ITERS, SPLIT, BLOCK_N, EVEN, HAS_BIAS,
                          False, Y_BF16_BITS, ROUND, PAIRS, NATIVE, GDC)
    if stored:  # only a program that stored its tile counts it
        owner = arrive_joint(cnt_ptr, TILES, OWNERS)  # one unit: every column of the rows
        if owner >= 0:
            joint_epilogue(a_ptr, res_ptr, stride_res, post_w_ptr, next_w_ptr, h_ptr, n_ptr, N,
                           eps, inv_d, owner, ROWS, OWNERS, BLOCK_D, HAS_POST, HAS_NEXT,
                           UNIT_OFFSET, Y_BF16_BITS)


def unsupported_reason(x: torch.Tensor, w, residual: torch.Tensor,
                       post_weight: torch.Tensor | None, next_weight: torch.Tensor | None,
                       unit_offset: bool) -> str | None:
    """None when `joint_step` takes these inputs, else why not."""
    if not isinstance(w, QuantizedTensor):
        return "the weight is not MLX-quantized"
    reason = gemv_unsupported_reason(x, w, MAX_ROWS)
    if reason is not None:
        return reason
    a = residual  # the product has the residual's shape and dtype
    if residual.shape[:-1] != x.shape[:-1] or residual.shape[-1] != w.shape[0]:
        return f"residual {tuple(residual.shape)} (step: {(*x.shape[:-1], w.shape[0])})"
    if residual.dtype != x.dtype:
        return f"residual dtype {residual.dtype} differs from x's {x.dtype}"
    return rms_norm.residual_unsupported_reason(a, residual, post_weight, next_weight,
                                                unit_offset) \
        if (post_weight is not None or next_weight is not None) else None


def joint_step(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None,
               residual: torch.Tensor, post_weight: torch.Tensor | None,
               next_weight: torch.Tensor | None, eps: float, unit_offset: bool,
               checked: bool = False, owners: int | None = None):
    """The module docstring's step: (h, n) shaped like ``residual``. ``checked``: the
    caller has had None from `unsupported_reason` for this layout. ``owners``: the
    programs sharing the joint's rows (`joint.joint_owners` unless given)."""
    if not checked:
        reason = unsupported_reason(x, w, residual, post_weight, next_weight, unit_offset)
        if reason is not None:
            raise ValueError(f"joint_step cannot take these inputs: {reason}")
    K, (N, _) = x.shape[-1], w.shape
    x2 = x.reshape(-1, K)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    res2 = residual.reshape(-1, N)
    res2 = res2 if res2.stride(-1) == 1 else res2.contiguous()
    M = x2.shape[0]
    a = torch.empty(M, N, dtype=x.dtype, device=x.device)
    h = torch.empty_like(a)
    n = torch.empty_like(a) if next_weight is not None else None
    ls = gemv_shape(N, K, w)
    ws = split_workspace(ls["SPLIT"], (M, N), a)
    grid = ls.pop("grid")
    gdc = pdl.enabled(x.device)
    _joint_step_kernel[grid](
        x2, w.packed, w.scales, w.biases, bias if bias is not None else a, stored_view(a), ws,
        semaphores(x.device), unit_counters(x.device), res2,
        post_weight if post_weight is not None else a,
        next_weight if next_weight is not None else a, stored_view(h),
        stored_view(n if n is not None else h), N, K, 0x43004300, x2.stride(0),
        w.packed.stride(0), w.scales.stride(0), w.biases.stride(0), res2.stride(0), eps, 1.0 / N,
        ROWS=M, BITS=w.bits, GROUP=w.group_size, HAS_BIAS=bias is not None,
        Y_BF16_BITS=emulates_bf16(x.dtype), **weight_rounding(x, w), **ls, TILES=grid[0],
        BLOCK_D=triton.next_power_of_2(N), HAS_POST=post_weight is not None,
        HAS_NEXT=next_weight is not None, UNIT_OFFSET=unit_offset,
        OWNERS=owners or joint_owners(M, grid[0], x.device), GDC=gdc,
        **pdl.launch_options(gdc))
    shape = residual.shape
    return h.reshape(shape), (n.reshape(shape) if n is not None else None)
