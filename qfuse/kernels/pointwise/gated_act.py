"""Fused gated activation act(a)·b (GeGLU, SwiGLU): one pass forward, one pass backward.

Forward is bit-identical to eager PyTorch on CUDA, ``F.gelu(a, approximate="tanh") * b``
and ``F.silu(a) * b``, because it rounds where PyTorch rounds: the activation
is computed in float32 with the same operation order (and the same fused
multiply-add nvcc forms in ``x + κ·x³``), rounded to the input dtype, then
multiplied by b in float32 and rounded again.

Backward recomputes the activation from the saved ``a`` (only a and b are
saved, never act(a)) and writes both gradients in one pass, in float32 with a
single rounding per output.

Tensors: a, b, out [..., I] with a contiguous last dimension.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import pdl
from ..common.precise_math import exp_f32, tanh_f32, use_libdevice

ACT_IDS = {"gelu_tanh": 0, "silu": 1}

# 2048 elements per program at 4 warps (16 per thread, two 16-byte loads per
# bf16 input): the fastest of the block/warp sweep in bench/NOTES.md.
BLOCK_SIZE = 2048
NUM_WARPS = 4

# kBeta = sqrt(2)·(2/sqrt(pi))·0.5 and kKappa, as PyTorch's GELU kernel rounds
# them to float32 (Triton float literals are float32).
GELU_BETA = tl.constexpr(0.7978845608028654)
GELU_KAPPA = tl.constexpr(0.044715)


@triton.jit
def act_f32(x, ACT: tl.constexpr, LIBDEVICE: tl.constexpr):
    """act(x) in float32, in PyTorch's CUDA operation order."""
    if ACT == 0:
        x_cube = x * x * x
        inner = GELU_BETA * tl.fma(GELU_KAPPA, x_cube, x)
        y = 0.5 * x * (1.0 + tanh_f32(inner, LIBDEVICE))
    else:
        y = tl.math.div_rn(x, 1.0 + exp_f32(-x, LIBDEVICE))
    return y


@triton.jit
def _gated_act_fwd_kernel(
    a_ptr,  # [M, I] rows of the activation input (gate)
    b_ptr,  # [M, I] rows of the multiplier (up)
    out_ptr,  # [M, I] act(a)·b
    stride_a,  # elements between rows of a
    stride_b,  # elements between rows of b
    stride_out,  # elements between rows of out
    n_cols,  # I
    n_col_blocks,  # cdiv(I, BLOCK)
    ACT: tl.constexpr,  # 0 gelu_tanh, 1 silu
    LIBDEVICE: tl.constexpr,  # False only under the CPU interpreter
    BLOCK: tl.constexpr,
    EVEN: tl.constexpr,  # n_cols % BLOCK == 0: no masks (measurably faster, NOTES)
    GDC: tl.constexpr,  # programmatic dependent launch (kernels/common/pdl.py)
):
    pdl.start(GDC)
    pid = tl.program_id(0)
    row = (pid // n_col_blocks).to(tl.int64)
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:  # every block full: no masks
        a = tl.load(a_ptr + row * stride_a + cols)
        b = tl.load(b_ptr + row * stride_b + cols)
    else:
        mask = cols < n_cols
        a = tl.load(a_ptr + row * stride_a + cols, mask=mask)
        b = tl.load(b_ptr + row * stride_b + cols, mask=mask)
    # Round act(a) to the input dtype first, as the spelled-out path stores it.
    act = act_f32(a.to(tl.float32), ACT, LIBDEVICE).to(a.dtype)
    out = (act.to(tl.float32) * b.to(tl.float32)).to(out_ptr.dtype.element_ty)
    if EVEN:
        tl.store(out_ptr + row * stride_out + cols, out)
    else:
        tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


@triton.jit
def _gated_act_bwd_kernel(
    a_ptr,  # [M, I] saved gate
    b_ptr,  # [M, I] saved up
    grad_ptr,  # [M, I] dL/d(out), contiguous rows
    da_ptr,  # [M, I] dL/da (out)
    db_ptr,  # [M, I] dL/db (out)
    stride_a,
    stride_b,
    stride_grad,
    stride_da,
    stride_db,
    n_cols,
    n_col_blocks,
    ACT: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = (pid // n_col_blocks).to(tl.int64)
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(a_ptr + row * stride_a + cols, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + cols, mask=mask).to(tl.float32)
    g = tl.load(grad_ptr + row * stride_grad + cols, mask=mask).to(tl.float32)
    if ACT == 0:
        # With u = β(x + κx³) and E = e^{-2u}: 1 + tanh(u) = 2/(1 + E) and
        # 1 - tanh(u) = 2E/(1 + E). Both keep full relative precision where
        # tanh(u) is near ∓1 and 1 ± tanh(u) would cancel (x ≈ -4 lost ~1e-4
        # relative through tanh in float32, failing the 2x error budget).
        x_sq = x * x
        u = GELU_BETA * (x + GELU_KAPPA * x_sq * x)
        e = exp_f32(-2.0 * u, LIBDEVICE)
        one_plus_t = 2.0 / (1.0 + e)
        # For u < 0, e > 1 may overflow; 2 - (1 + t) is then exact enough (≥ 1).
        one_minus_t = tl.where(e > 1.0, 2.0 - one_plus_t, 2.0 * e / (1.0 + e))
        act = 0.5 * x * one_plus_t
        # d/dx 0.5·x·(1 + tanh(u)) = 0.5(1 + t) + 0.5·x·(1 - t)(1 + t)·β(1 + 3κx²)
        dact = 0.5 * one_plus_t + 0.5 * x * one_minus_t * one_plus_t * GELU_BETA * (
            1.0 + 3.0 * GELU_KAPPA * x_sq
        )
    else:
        s = 1.0 / (1.0 + exp_f32(-x, LIBDEVICE))
        act = x * s
        dact = s * (1.0 + x * (1.0 - s))
    tl.store(da_ptr + row * stride_da + cols, (g * b * dact).to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + row * stride_db + cols, (g * act).to(db_ptr.dtype.element_ty), mask=mask)


def unsupported_reason(a: torch.Tensor) -> str | None:
    """Why the kernels cannot take a (and b, which ops has checked is a's twin)."""
    if a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {a.dtype} (supported: fp16, bf16, fp32)"
    if a.dim() == 0:
        return "0-d input"
    return None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D [M, I] view with unit column stride (copies only when no view exists)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.contiguous().view(-1, t.shape[-1])


def _grid(M: int, n_cols: int, block: int) -> tuple[tuple[int], int]:
    n_col_blocks = triton.cdiv(n_cols, block)
    return (M * n_col_blocks,), n_col_blocks


def _flat_if_possible(*ts: torch.Tensor) -> list[torch.Tensor] | None:
    """Contiguous tensors seen as one long row: no tail waste per row (I=15360 is
    3.75 blocks). Column offsets are int32, so the row must stay under 2**31."""
    if all(t.is_contiguous() for t in ts) and ts[0].numel() < 2**31:
        return [t.view(1, -1) for t in ts]
    return None


def gated_act_forward(
    a: torch.Tensor, b: torch.Tensor, act: str, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(a)·b. a, b: [..., I], one dtype (fp16/bf16/fp32) and device. Returns out [..., I]."""
    if out is None:
        out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    elif out.shape != a.shape or out.dtype != a.dtype or out.device != a.device:
        raise ValueError(
            f"out must be {tuple(a.shape)} {a.dtype} on {a.device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if a.numel() == 0:
        return out
    views = _flat_if_possible(a, b, out)
    if views is None:
        views = [_rows(a), _rows(b), out.view(-1, a.shape[-1])]
    a2, b2, out2 = views
    grid, n_col_blocks = _grid(a2.shape[0], a2.shape[1], BLOCK_SIZE)
    gdc = pdl.enabled(a.device)
    _gated_act_fwd_kernel[grid](
        a2, b2, out2, a2.stride(0), b2.stride(0), out2.stride(0), a2.shape[1], n_col_blocks,
        ACT=ACT_IDS[act], LIBDEVICE=use_libdevice(), BLOCK=BLOCK_SIZE,
        EVEN=a2.shape[1] % BLOCK_SIZE == 0, GDC=gdc, num_warps=NUM_WARPS, **pdl.launch_options(gdc),
    )
    return out


def gated_act_backward(
    a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor, act: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dL/da, dL/db) for out = act(a)·b, recomputing act(a). All [..., I]."""
    da = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    db = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    if a.numel() == 0:
        return da, db
    I = a.shape[-1]
    views = _flat_if_possible(a, b, grad, da, db)
    if views is None:
        views = [_rows(a), _rows(b), _rows(grad), da.view(-1, I), db.view(-1, I)]
    a2, b2, g2, da2, db2 = views
    grid, n_col_blocks = _grid(a2.shape[0], a2.shape[1], BLOCK_SIZE)
    _gated_act_bwd_kernel[grid](
        a2, b2, g2, da2, db2,
        a2.stride(0), b2.stride(0), g2.stride(0), da2.stride(0), db2.stride(0),
        a2.shape[1], n_col_blocks,
        ACT=ACT_IDS[act], LIBDEVICE=use_libdevice(), BLOCK=BLOCK_SIZE, num_warps=NUM_WARPS,
    )
    return da, db


class GatedActFunction(torch.autograd.Function):
    """Differentiable act(a)·b that saves only a and b."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, act: str) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.act = act
        return gated_act_forward(a, b, act)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        da, db = gated_act_backward(a, b, grad, ctx.act)
        return da, db, None


class GatedActDownFunction(torch.autograd.Function):
    """y = down(act(a)·b) for training: saves a, b and the weight, never the hidden
    h = act(a)·b, which backward recomputes with one more forward pass.

    The spelled-out MLP keeps four [T, I] tensors per block for backward (a,
    act(a), b and h); this keeps two. a, b: [..., I]; w_down: [H, I]; y: [..., H].
    """

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, w_down: torch.Tensor, act: str):
        ctx.save_for_backward(a, b, w_down)
        ctx.act = act
        return torch.nn.functional.linear(gated_act_forward(a, b, act), w_down)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b, w_down = ctx.saved_tensors
        grad = grad.to(w_down.dtype)
        d_hidden = grad @ w_down  # [..., I]
        d_w = None
        if ctx.needs_input_grad[2]:
            hidden = gated_act_forward(a, b, ctx.act)
            d_w = grad.reshape(-1, grad.shape[-1]).T @ hidden.reshape(-1, hidden.shape[-1])
            del hidden
        da, db = gated_act_backward(a, b, d_hidden, ctx.act)
        return da, db, d_w, None
