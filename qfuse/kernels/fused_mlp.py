"""The quantized MLP for decode rows: out = residual + down(act(x·Wgᵀ) ⊙ (x·Wuᵀ)).

Deterministic two-dispatch variant: one kernel computes, for a block of the
intermediate dimension, both projections over the whole of K and applies the
gated activation in registers, writing only the hidden block (in x's dtype);
the down projection is the quantized GEMV (fixed-order split-K reduction), and
the residual is added to its output as the compat path adds it. gate/up/down may each have their own bits and group
size. No float atomics, so the result is bitwise reproducible.

Gemma's sandwich norms put a norm between the down projection and the residual
add, so the runtime calls this with residual=None there and adds the
post-norm and residual itself.

EXPERIMENTAL: interpreter-tested only; the one-dispatch atomic variant and the
GPU measurements (`qfuse bench mlp`) are still to do (issue 5).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import QuantizedTensor
from .gated_act import ACT_IDS, _act_f32
from .precise_math import use_libdevice
from .qmatmul import _dot_rows, qgemv
from .qmatmul import unsupported_reason as qmatmul_unsupported


@triton.jit
def _gate_up_act_kernel(
    x_ptr,  # [M, K]
    g_ptr, gs_ptr, gb_ptr,  # gate [I, K] quantized
    u_ptr, us_ptr, ub_ptr,  # up [I, K] quantized
    h_ptr,  # [M, I] hidden out
    I, K,
    stride_xm, stride_gn, stride_gsn, stride_gbn, stride_un, stride_usn, stride_ubn, stride_hm,
    M: tl.constexpr,
    G_BITS: tl.constexpr, G_GROUP: tl.constexpr, G_NG: tl.constexpr,
    U_BITS: tl.constexpr, U_GROUP: tl.constexpr, U_NG: tl.constexpr,
    ACT: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK_I: tl.constexpr,
    GPI: tl.constexpr,  # quantization groups per loop iteration
):
    rows = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = rows < I
    gate = _dot_rows(x_ptr, stride_xm, g_ptr, gs_ptr, gb_ptr, stride_gn, stride_gsn, stride_gbn,
                     rows, ok,
                     0, K // G_GROUP, M, G_NG, G_BITS, G_GROUP, BLOCK_I, GPI)
    up = _dot_rows(x_ptr, stride_xm, u_ptr, us_ptr, ub_ptr, stride_un, stride_usn, stride_ubn,
                   rows, ok,
                   0, K // U_GROUP, M, U_NG, U_BITS, U_GROUP, BLOCK_I, GPI)
    for m in tl.static_range(M):
        h = _act_f32(gate[m], ACT, LIBDEVICE) * up[m]
        tl.store(h_ptr + m * stride_hm + rows, h.to(h_ptr.dtype.element_ty), mask=ok)


def unsupported_reason(x: torch.Tensor, gate, up, down) -> str | None:
    """Why the fused MLP cannot take these inputs: each projection must suit the GEMV."""
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        if not isinstance(w, QuantizedTensor):
            return f"{name} is not quantized"
        reason = qmatmul_unsupported(x, w)
        if reason is not None:
            return f"{name}: {reason}"
    return None


def fused_mlp(x: torch.Tensor, gate: QuantizedTensor, up: QuantizedTensor, down: QuantizedTensor,
              act: str, residual: torch.Tensor | None = None, block_i: int = 64,
              _groups_per_iter: int = 1, _num_warps: int = 4) -> torch.Tensor:
    """x [..., H] (≤ 4 rows) → residual + down(act(x·gateᵀ)·(x·upᵀ)) [..., H] in x's dtype."""
    H = x.shape[-1]
    I = gate.shape[0]
    if gate.shape != (I, H) or up.shape != (I, H) or down.shape != (H, I):
        raise ValueError(f"weights do not form an MLP of hidden {H}: gate {gate.shape}, "
                         f"up {up.shape}, down {down.shape}")
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    hidden = torch.empty(M, I, dtype=x.dtype, device=x.device)
    _gate_up_act_kernel[(triton.cdiv(I, block_i),)](
        x2, gate.packed, gate.scales, gate.biases, up.packed, up.scales, up.biases, hidden,
        I, H, x2.stride(0), gate.packed.stride(0), gate.scales.stride(0), gate.biases.stride(0),
        up.packed.stride(0), up.scales.stride(0), up.biases.stride(0), hidden.stride(0),
        M=M, G_BITS=gate.bits, G_GROUP=gate.group_size, G_NG=H // gate.group_size,
        U_BITS=up.bits, U_GROUP=up.group_size, U_NG=H // up.group_size,
        ACT=ACT_IDS[act], LIBDEVICE=use_libdevice(), BLOCK_I=block_i,
        GPI=min(_groups_per_iter, triton.next_power_of_2(H // max(gate.group_size, up.group_size))),
        num_warps=_num_warps,
    )
    y = qgemv(hidden, down)
    if residual is not None:
        y = residual.reshape(y.shape) + y
    return y.reshape(x.shape)
