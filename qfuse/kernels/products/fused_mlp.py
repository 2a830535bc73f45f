"""The quantized MLP for decode rows: out = residual + down(act(x·Wgᵀ) ⊙ (x·Wuᵀ)).

Contract (`fused_mlp`):

    x         [..., H], at most MAX_ROWS = 16 rows: bf16 (scales/biases bf16 too),
              or fp16/fp32 with at most 4 rows (`qmatmul.MAX_ROWS`)
    gate, up  QuantizedTensor [I, H], 4 or 8 bits, MLX layout
    down      QuantizedTensor [H, I]; each projection has its own bits and group size
    act       "gelu_tanh" (GeGLU) or "silu" (SwiGLU)
    residual  None, or x's shape and dtype
    returns   [..., H] in x's dtype

`unsupported_reason` says why inputs are refused; `ops.mlp` then runs the
reference. It offers the fragment kernel's MLP (`choose.choose_mlp`: 4-bit, groups
of 64/128, 1-32 bf16 rows) first; this file takes the quantized MLPs that one
does not (8-bit or g32 weights, fp16/fp32 rows). Fast tier: the float32 sums run
in another order than compat's cuBLAS products. QFUSE_FUSED_MLP=0 turns it off.

`fused_mlp`: two launches. The first computes the gate and up
projections of a block of I, applies the activation in its epilogue and writes
only the hidden block [M, I]; the second is the down product, with the residual
added in its epilogue. Both round as compat rounds (each projection to x's
dtype, then act(gate), then the product; the down product before the residual
add). One bf16 row and fp16/fp32 rows run on the CUDA-core GEMV
(`qmatmul.gemv_tile`), 2-16 bf16 rows on the tensor-core tile
(`qmatmul_tc.tile_dot`). When H is split across programs, the last program of
a tile adds the float32 partials in split order: no float atomics, so the
result is bitwise reproducible and does not depend on which program finished
first. Under the GEMV, gate and up must share one split of H (a ValueError when
their group sizes forbid it).

Graph capture: the first call on a device allocates and zeroes the split
semaphores and must run eagerly (a warm-up); later calls can be captured. The
decoder passes no residual: its residual joint (`ops.residual_rms_norm`) adds
the residual together with the norms around it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...levers import interpreter_active
from ...quant import QuantizedTensor
from ..common import pdl
from ..common.precise_math import use_libdevice
from ..common.rounding import as_stored, emulates_bf16, round_like, stored_view, to_stored
from ..pointwise.gated_act import ACT_IDS, act_f32
from .qmatmul import BF16_GEMV_ROWS, gemv_shape, gemv_tile, qgemv, weight_rounding
from .qmatmul import unsupported_reason as qmatmul_unsupported
from .qmatmul_tc import PREFETCH_BITS, STAGES, launch_shape, qmatmul_tc, tile_dot
from .splitk import arrive_last, as_rows, semaphores, split_workspace, sum_splits

MAX_ROWS = 16


@triton.jit
def gated(gate, up, ACT: tl.constexpr, LIBDEVICE: tl.constexpr, x_ptr,
           BF16_BITS: tl.constexpr):
    """act(gate)·up from the float32 projections, rounding as compat does: each projection
    and act(gate) to x's dtype (x_ptr's element type; bf16 by hand when BF16_BITS); the
    product is returned unrounded, for the caller's store or its own rounding."""
    a = round_like(gate, x_ptr, BF16_BITS)
    act = round_like(act_f32(a, ACT, LIBDEVICE), x_ptr, BF16_BITS)
    return act * round_like(up, x_ptr, BF16_BITS)


@triton.jit
def _gate_up_act_kernel(
    x_ptr,  # bf16 [M, H]
    g_ptr, gs_ptr, gb_ptr,  # gate [I, H] quantized
    u_ptr, us_ptr, ub_ptr,  # up [I, H] quantized
    h_ptr,  # bf16 [M, I] hidden out (int16 bits under the interpreter)
    ws_ptr,  # float32 [SPLIT, 2, M, I] partial tiles (SPLIT > 1)
    sem_ptr,
    M, I, H, magic,
    stride_xm, stride_gn, stride_gsn, stride_gbn, stride_un, stride_usn, stride_ubn, stride_hm,
    G_BITS: tl.constexpr, G_GROUP: tl.constexpr, G_GPI: tl.constexpr, G_ITERS: tl.constexpr,
    U_BITS: tl.constexpr, U_GROUP: tl.constexpr, U_GPI: tl.constexpr, U_ITERS: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, EVEN: tl.constexpr,
    ACT: tl.constexpr, LIBDEVICE: tl.constexpr, NATIVE: tl.constexpr, STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    xr = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_k = tl.program_id(2)
    gate = tile_dot(x_ptr, stride_xm, g_ptr, gs_ptr, gb_ptr, stride_gn, stride_gsn, stride_gbn,
                    rows, xr, M, I, H, magic, pid_k * (G_ITERS * G_GPI),
                    G_BITS, G_GROUP, G_GPI, G_ITERS, BLOCK_N, BLOCK_M, EVEN, NATIVE, STAGES,
                    PREFETCH)
    up = tile_dot(x_ptr, stride_xm, u_ptr, us_ptr, ub_ptr, stride_un, stride_usn, stride_ubn,
                  rows, xr, M, I, H, magic, pid_k * (U_ITERS * U_GPI),
                  U_BITS, U_GROUP, U_GPI, U_ITERS, BLOCK_N, BLOCK_M, EVEN, NATIVE, STAGES,
                  PREFETCH)
    out_ok = (rows[:, None] < I) & (xr[None, :] < M)
    last = True
    if SPLIT > 1:
        ws_off = xr[None, :] * I + rows[:, None]
        arrive_last(ws_ptr, sem_ptr, gate, 0, ws_off, out_ok, M, I, SPLIT, 2)
        last = arrive_last(ws_ptr, sem_ptr, up, 1, ws_off, out_ok, M, I, SPLIT, 2)
    if last:
        if SPLIT > 1:
            gate = sum_splits(ws_ptr, sem_ptr, 0, ws_off, out_ok, M, I, SPLIT, 2)
            up = sum_splits(ws_ptr, sem_ptr, 1, ws_off, out_ok, M, I, SPLIT, 2)
        h = gated(gate, up, ACT, LIBDEVICE, x_ptr, not NATIVE)
        tl.store(h_ptr + xr[None, :].to(tl.int64) * stride_hm + rows[:, None], to_stored(h, NATIVE),
                 mask=out_ok)


@triton.jit
def _gate_up_act_gemv_kernel(
    x_ptr,  # [M ≤ 4, H]
    g_ptr, gs_ptr, gb_ptr,  # gate [I, H] quantized
    u_ptr, us_ptr, ub_ptr,  # up [I, H] quantized
    h_ptr,  # [M, I] hidden out, x's dtype (bf16 as int16 bits under the interpreter)
    ws_ptr,  # float32 [SPLIT, 2·M, I] partial sums (SPLIT > 1)
    sem_ptr,
    I, H, magic,
    stride_xm, stride_gn, stride_gsn, stride_gbn, stride_un, stride_usn, stride_ubn, stride_hm,
    ROWS: tl.constexpr,
    G_BITS: tl.constexpr, G_GROUP: tl.constexpr, G_GPI: tl.constexpr, G_ITERS: tl.constexpr,
    U_BITS: tl.constexpr, U_GROUP: tl.constexpr, U_GPI: tl.constexpr, U_ITERS: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
    ACT: tl.constexpr, LIBDEVICE: tl.constexpr, H_BF16_BITS: tl.constexpr,
    G_ROUND: tl.constexpr, G_PAIRS: tl.constexpr, U_ROUND: tl.constexpr, U_PAIRS: tl.constexpr,
    NATIVE: tl.constexpr, GDC: tl.constexpr,
):
    """The CUDA-core GEMV version of _gate_up_act_kernel (`qmatmul.gemv_tile`); GDC: under
    programmatic dependent launch, the gate's first weights requested before the wait."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < I
    pid_k = tl.program_id(2)
    gate = gemv_tile(x_ptr, stride_xm, g_ptr, gs_ptr, gb_ptr, stride_gn, stride_gsn, stride_gbn,
                     rows, row_ok, pid_k * (G_ITERS * G_GPI), H // G_GROUP, magic, ROWS,
                     G_BITS, G_GROUP, G_GPI, G_ITERS, BLOCK_N, EVEN, G_ROUND, G_PAIRS, NATIVE,
                     GDC)
    up = gemv_tile(x_ptr, stride_xm, u_ptr, us_ptr, ub_ptr, stride_un, stride_usn, stride_ubn,
                   rows, row_ok, pid_k * (U_ITERS * U_GPI), H // U_GROUP, magic, ROWS,
                   U_BITS, U_GROUP, U_GPI, U_ITERS, BLOCK_N, EVEN, U_ROUND, U_PAIRS, NATIVE)
    out_ok = row_ok[:, None]
    last = True
    if SPLIT > 1:
        # Planes [SPLIT, 2·ROWS, I]: gate of row m at plane m, up at plane ROWS + m.
        for m in tl.static_range(ROWS):
            arrive_last(ws_ptr, sem_ptr, gate[m], m, rows[:, None], out_ok, 1, I, SPLIT,
                        2 * ROWS)
        for m in tl.static_range(ROWS):
            last = arrive_last(ws_ptr, sem_ptr, up[m], ROWS + m, rows[:, None], out_ok, 1, I,
                               SPLIT, 2 * ROWS)
    if last:
        for m in tl.static_range(ROWS):
            gm = gate[m]
            um = up[m]
            if SPLIT > 1:
                gm = sum_splits(ws_ptr, sem_ptr, m, rows[:, None], out_ok, 1, I, SPLIT,
                                2 * ROWS)
                um = sum_splits(ws_ptr, sem_ptr, ROWS + m, rows[:, None], out_ok, 1, I, SPLIT,
                                2 * ROWS)
            h = gated(gm, um, ACT, LIBDEVICE, x_ptr, H_BF16_BITS)
            tl.store(h_ptr + m * stride_hm + rows[:, None], as_stored(h, h_ptr, H_BF16_BITS),
                     mask=out_ok)


def unsupported_reason(x: torch.Tensor, gate, up, down,
                       residual: torch.Tensor | None = None) -> str | None:
    """Why the fused MLP cannot take these inputs (each projection must suit the kernel;
    a residual must have x's shape and dtype, where compat would also broadcast)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or rows > MAX_ROWS:
        return f"{rows} rows (fused MLP: 1..{MAX_ROWS})"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return (f"residual {tuple(residual.shape)} {residual.dtype} (kernel: x's shape "
                f"{tuple(x.shape)} and dtype {x.dtype})")
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        if not isinstance(w, QuantizedTensor):  # dense, or held in fragment order
            return f"{name} is not in the MLX layout the fused MLP reads"
        reason = qmatmul_unsupported(x, w)
        if reason is not None:
            return f"{name}: {reason}"
    if rows <= BF16_GEMV_ROWS or x.dtype != torch.bfloat16:
        return gate_up_gemv_shapes(x.shape[-1], gate, up)[2]
    return None


def gate_up_gemv_shapes(H: int, gate: QuantizedTensor, up: QuantizedTensor, **shape):
    """(gate's, up's `qmatmul.gemv_shape`, None), or a reason in third place: one launch
    computes both, so they need one split of H, which the split rule can refuse
    (at H ≥ 65664 with different group sizes)."""
    I = gate.shape[0]
    g_ls = gemv_shape(I, H, gate, **shape)
    u_ls = gemv_shape(I, H, up, **{**shape, "split": g_ls["SPLIT"]})
    if u_ls["SPLIT"] != g_ls["SPLIT"]:
        return g_ls, u_ls, (f"gate (group size {gate.group_size}) and up (group size "
                            f"{up.group_size}) cannot share one split of H={H}")
    return g_ls, u_ls, None


def gate_up_act_gemv(x: torch.Tensor, gate: QuantizedTensor, up: QuantizedTensor, act: str,
                     **shape) -> torch.Tensor:
    """act(x·gateᵀ)·(x·upᵀ) on CUDA cores: [M ≤ 4, H] → [M, I] in x's dtype, one launch.
    ``shape``: `qmatmul.gemv_shape`'s overrides."""
    H = x.shape[-1]
    I = gate.shape[0]
    x2 = as_rows(x, H)
    M = x2.shape[0]
    hidden = torch.empty(M, I, dtype=x.dtype, device=x.device)
    g_ls, u_ls, reason = gate_up_gemv_shapes(H, gate, up, **shape)
    if reason is not None:
        raise ValueError(reason)
    split = g_ls["SPLIT"]
    ws = split_workspace(split, (2 * M, I), hidden)
    g_round, u_round = weight_rounding(x, gate), weight_rounding(x, up)
    gdc = pdl.enabled(x.device)
    _gate_up_act_gemv_kernel[g_ls["grid"]](
        x2, gate.packed, gate.scales, gate.biases, up.packed, up.scales, up.biases,
        stored_view(hidden), ws, semaphores(x.device), I, H,
        0x43004300,
        x2.stride(0), gate.packed.stride(0), gate.scales.stride(0), gate.biases.stride(0),
        up.packed.stride(0), up.scales.stride(0), up.biases.stride(0), hidden.stride(0),
        ROWS=M, G_BITS=gate.bits, G_GROUP=gate.group_size, G_GPI=g_ls["GPI"],
        G_ITERS=g_ls["ITERS"], U_BITS=up.bits, U_GROUP=up.group_size, U_GPI=u_ls["GPI"],
        U_ITERS=u_ls["ITERS"], SPLIT=split, BLOCK_N=g_ls["BLOCK_N"],
        EVEN=g_ls["EVEN"] and u_ls["EVEN"], ACT=ACT_IDS[act], LIBDEVICE=use_libdevice(),
        H_BF16_BITS=emulates_bf16(hidden.dtype), G_ROUND=g_round["ROUND"], G_PAIRS=g_round["PAIRS"],
        U_ROUND=u_round["ROUND"], U_PAIRS=u_round["PAIRS"], NATIVE=g_round["NATIVE"],
        GDC=gdc, num_warps=g_ls["num_warps"], **pdl.launch_options(gdc))
    return hidden


def gate_up_act(x: torch.Tensor, gate: QuantizedTensor, up: QuantizedTensor, act: str,
                **shape) -> torch.Tensor:
    """act(x·gateᵀ)·(x·upᵀ): [M, H] bf16 → [M, I] bf16, one launch (tensor cores)."""
    H = x.shape[-1]
    I = gate.shape[0]
    x2 = as_rows(x, H)
    M = x2.shape[0]
    hidden = torch.empty(M, I, dtype=x.dtype, device=x.device)
    g_ls = launch_shape(M, I, H, gate, x.device, **shape)
    split = g_ls["SPLIT"]
    u_ls = launch_shape(M, I, H, up, x.device, **{**shape, "split": split})
    ws = split_workspace(split, (2, M, I), hidden)
    native = not interpreter_active()
    _gate_up_act_kernel[g_ls["grid"]](
        x2, gate.packed, gate.scales, gate.biases, up.packed, up.scales, up.biases,
        stored_view(hidden), ws, semaphores(x.device),
        M, I, H, 0x43004300,
        x2.stride(0), gate.packed.stride(0), gate.scales.stride(0), gate.biases.stride(0),
        up.packed.stride(0), up.scales.stride(0), up.biases.stride(0), hidden.stride(0),
        G_BITS=gate.bits, G_GROUP=gate.group_size, G_GPI=g_ls["GPI"], G_ITERS=g_ls["ITERS"],
        U_BITS=up.bits, U_GROUP=up.group_size, U_GPI=u_ls["GPI"], U_ITERS=u_ls["ITERS"],
        SPLIT=split, BLOCK_N=g_ls["BLOCK_N"], BLOCK_M=g_ls["BLOCK_M"],
        EVEN=g_ls["EVEN"] and u_ls["EVEN"], ACT=ACT_IDS[act], LIBDEVICE=use_libdevice(),
        NATIVE=native, STAGES=STAGES, num_warps=g_ls["num_warps"],
        PREFETCH=gate.bits in PREFETCH_BITS and up.bits in PREFETCH_BITS,
    )
    return hidden


def _check_mlp(x, gate, up, down, residual, checked: bool = False) -> tuple[int, int]:
    """(H, I) of a valid fused-MLP call, else a ValueError that names the problem."""
    H = x.shape[-1]
    I = gate.shape[0]
    if gate.shape != (I, H) or up.shape != (I, H) or down.shape != (H, I):
        raise ValueError(f"weights do not form an MLP of hidden {H}: gate {gate.shape}, "
                         f"up {up.shape}, down {down.shape}")
    reason = None if checked else unsupported_reason(x, gate, up, down, residual)
    if reason is not None:
        raise ValueError(f"fused MLP cannot take these inputs: {reason}")
    return H, I


def fused_mlp(x: torch.Tensor, gate: QuantizedTensor, up: QuantizedTensor, down: QuantizedTensor,
              act: str, residual: torch.Tensor | None = None, checked: bool = False,
              **shape) -> torch.Tensor:
    """x [..., H] (≤ 16 bf16 or ≤ 4 fp16/fp32 rows) → residual + down(act(x·gateᵀ)·(x·upᵀ))
    [..., H]. bf16 with more than BF16_GEMV_ROWS rows runs on the tensor-core kernels, the
    rest on the CUDA-core GEMV's. ``shape``: launch overrides (``split``, ``block_n``) the
    tests use to reach split paths on small shapes. ``checked``: the caller has had None
    from `unsupported_reason` for inputs of this layout."""
    H, _ = _check_mlp(x, gate, up, down, residual, checked)
    rows = x.numel() // H
    if rows <= BF16_GEMV_ROWS or x.dtype != torch.bfloat16:
        hidden = gate_up_act_gemv(x, gate, up, act, **shape)
        res2 = residual.reshape(rows, H) if residual is not None else None
        return qgemv(hidden, down, residual=res2, checked=checked, **shape).reshape(x.shape)
    hidden = gate_up_act(x, gate, up, act, **shape)
    res2 = residual.reshape(hidden.shape[0], H) if residual is not None else None
    return qmatmul_tc(hidden, down, residual=res2, **shape).reshape(x.shape)
