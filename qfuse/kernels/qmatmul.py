"""y = x·dequant(W)ᵀ for MLX-layout 4/8-bit weights: dispatch, and the CUDA-core GEMV.

`qmatmul` sends bf16 activations (any number of rows: decode and prefill) to
the tensor-core kernel of `qmatmul_tc`, and fp16/fp32 activations with at
most 4 rows to the CUDA-core GEMV below (`qgemv`).

W is packed uint32 [N, K·bits/32] with scales/biases [N, K/g]; x is [M, K]
(bf16/fp16/fp32), M ≤ 4. Each program owns BLOCK_N output columns and walks
K one quantization group at a time. Inside a group the codes are used as
they lie in their words (masked in place into the mantissa of 2**23, one LOP3
and one FADD per code; the in-word power of two is folded into x), so for
every row m the kernel accumulates, per (column, word),
    s·Σ_k x_k·c_k + b·Σ_k x_k,
and reduces over words once at the end: per weight element one LOP3, one
FADD and M FMAs. K may be split across programs (SPLIT_K) to fill the GPU;
the partial sums go to a float32 workspace that is summed in a fixed order,
so the result is deterministic.

On the H200 the GEMV reached 23-26% of the copy bandwidth at one row
(4-bit 15360x3840: 30 µs, tinygemm 20 µs; bench/ab/ab5_qgemv.py): it is
bound by latency, one unpipelined load per group in flight. The tensor-core
kernel replaces it for bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import QuantizedTensor
from .codes import code_f32, magic_halves, split_codes
from .qmatmul_tc import _rows, choose_split

MAX_ROWS = 4
SUPPORTED_BITS = (4, 8)


@triton.jit
def _dot_rows(x_ptr, stride_xm, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn, cols, col_ok,
              g_first, n_groups, M: tl.constexpr, GPS: tl.constexpr, BITS: tl.constexpr,
              GROUP: tl.constexpr, BLOCK_N: tl.constexpr, GPI: tl.constexpr = 1):
    """Σ over groups [g_first, g_first + GPS) ∩ [0, n_groups) of x[m]·dequant(W[cols]):
    a tuple of M float32 vectors [BLOCK_N]. GPI groups are loaded per iteration
    (more bytes in flight per load: a GEMV is bound by memory latency × bytes in
    flight long before it is bound by bandwidth)."""
    EPW: tl.constexpr = 32 // BITS
    WG: tl.constexpr = GROUP // EPW  # words per group
    KW: tl.constexpr = GPI * WG  # words per iteration
    HALF: tl.constexpr = EPW // 2
    w_idx = tl.arange(0, KW)
    e_idx = tl.arange(0, EPW)
    # 2**-(BITS·(k mod EPW/2)) per code position, built from exponent bits (exact).
    pow2 = ((127 - (e_idx % HALF) * BITS) << 23).to(tl.float32, bitcast=True)
    acc = ()
    acc_b = ()
    for m in tl.static_range(M):
        acc = acc + (tl.zeros((BLOCK_N, KW), tl.float32),)
        acc_b = acc_b + (tl.zeros((BLOCK_N, KW), tl.float32),)
    # A static trip count (the last split may run past K: those groups are masked).
    for it in range((GPS + GPI - 1) // GPI):
        g0 = g_first + it * GPI
        w_group = g0 + w_idx // WG  # the group of each word in the tile
        # Scalar conditions are broadcast explicitly (cols·0 + g): Triton 3.9's
        # interpreter rejects a mask that mixes a scalar and a vector comparison.
        g_ok = (w_group < n_groups) & (w_group < g_first + GPS)
        ok = col_ok[:, None] & g_ok[None, :]
        words = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + g0 * WG + w_idx[None, :],
                        mask=ok, other=0).to(tl.int32, bitcast=True)
        lo, hi = magic_halves(words)
        # Scales and biases per word (each loaded WG times from L1): no relayout of
        # a [BLOCK_N, GPI] tile into [BLOCK_N, KW] registers.
        sb_off = cols[:, None].to(tl.int64) * stride_sn + w_group[None, :]
        s = tl.load(s_ptr + sb_off, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols[:, None].to(tl.int64) * stride_bn + w_group[None, :],
                    mask=ok, other=0.0).to(tl.float32)
        dots = ()
        xsum = ()
        xk = ()  # per (row m, code k): [KW] inputs, code k's in-word power of two folded in
        for m in tl.static_range(M):
            dots = dots + (tl.zeros((BLOCK_N, KW), tl.float32),)
            xt = tl.load(x_ptr + m * stride_xm + g0 * GROUP + w_idx[:, None] * EPW + e_idx[None, :],
                         mask=g_ok[:, None], other=0.0).to(tl.float32)
            xsum = xsum + (tl.sum(xt, axis=1),)
            xk = xk + split_codes(xt * pow2[None, :], EPW)
        for k in tl.static_range(EPW):
            c = code_f32(lo, hi, k, BITS, EPW)
            new_d = ()
            for m in tl.static_range(M):
                new_d = new_d + (dots[m] + c * xk[m * EPW + k][None, :],)
            dots = new_d
        new_a = ()
        new_b = ()
        for m in tl.static_range(M):
            new_a = new_a + (acc[m] + dots[m] * s,)
            new_b = new_b + (acc_b[m] + b * xsum[m][None, :],)
        acc = new_a
        acc_b = new_b
    out = ()
    for m in tl.static_range(M):
        out = out + (tl.sum(acc[m] + acc_b[m], axis=1),)
    return out


@triton.jit
def _qgemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # uint32 [N, K·BITS/32]
    s_ptr, b_ptr,  # [N, K/GROUP]
    ws_ptr,  # float32 [SPLIT_K, M, N] partial sums
    N, K,
    stride_xm, stride_wn, stride_sn, stride_bn,
    M: tl.constexpr,
    GPS: tl.constexpr,  # quantization groups handled by one program along K
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GPI: tl.constexpr,  # groups per loop iteration
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ys = _dot_rows(x_ptr, stride_xm, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn,
                   cols, col_ok,
                   pid_k * GPS, K // GROUP, M, GPS, BITS, GROUP, BLOCK_N, GPI)
    for m in tl.static_range(M):
        tl.store(ws_ptr + (pid_k * M + m) * N + cols, ys[m], mask=col_ok)


def unsupported_reason(x: torch.Tensor, w: QuantizedTensor) -> str | None:
    """None when `qmatmul` has a kernel for these inputs, else why not."""
    from .qmatmul_tc import unsupported_reason as tc_reason

    if x.dtype == torch.bfloat16:
        return tc_reason(x, w)
    return gemv_unsupported_reason(x, w)


def qmatmul(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] → residual + x·dequant(w)ᵀ + bias [..., N], by the kernel for x's dtype."""
    if x.dtype == torch.bfloat16:
        from .qmatmul_tc import qmatmul_tc

        return qmatmul_tc(x, w, bias, residual)
    y = qgemv(x, w, bias)
    return y if residual is None else residual + y


def gemv_unsupported_reason(x: torch.Tensor, w: QuantizedTensor) -> str | None:
    """Why the CUDA-core GEMV cannot take these inputs."""
    if w.bits not in SUPPORTED_BITS:
        return f"{w.bits}-bit weights (kernel: 4, 8)"
    if w.packed.stride(-1) != 1 or w.scales.stride(-1) != 1 or w.biases.stride(-1) != 1:
        return "packed/scales/biases need a contiguous last dimension"
    if w.packed.dim() != 2:
        return f"weight of {w.packed.dim()} dims (kernel: [N, K])"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"x dtype {x.dtype}"
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or rows > MAX_ROWS:
        return f"{rows} rows (decode kernel: 1..{MAX_ROWS})"
    return None


# Launch defaults; `bench/ab/ab5_qgemv.py` measured the alternatives on the GPU.
PROGRAMS_PER_SM = 2
GROUPS_PER_ITER = 1
NUM_WARPS = 4


def qgemv(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None = None,
          block_n: int | None = None, split_k: int | None = None,
          _groups_per_iter: int | None = None, _programs_per_sm: int | None = None,
          _num_warps: int | None = None) -> torch.Tensor:
    """x [..., K] with at most 4 rows → [..., N] in x's dtype."""
    K = x.shape[-1]
    N = w.shape[0]
    x2 = _rows(x, K)
    M = x2.shape[0]
    # Columns per program: the sm_90a SASS (4-bit, g64) has 5.2 instructions per
    # weight at 256 columns against 6.1 at 128 and 8.9 at 64 (fixed per-group
    # work amortised); 2+ rows need the registers of 128.
    block_n = block_n or (256 if M == 1 else 128)
    n_groups = K // w.group_size
    grid_n = triton.cdiv(N, block_n)
    # Sized for 132 SMs (an H200) whatever the device, as measured.
    split = split_k or choose_split(grid_n, n_groups, _programs_per_sm or PROGRAMS_PER_SM, 132,
                                    divide=False)
    per_split = triton.cdiv(n_groups, split)
    gpi = min(_groups_per_iter or GROUPS_PER_ITER, triton.next_power_of_2(per_split))
    ws = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    _qgemv_kernel[(grid_n, split)](
        x2, w.packed, w.scales, w.biases, ws, N, K,
        x2.stride(0), w.packed.stride(0), w.scales.stride(0), w.biases.stride(0),
        M=M, GPS=per_split, BITS=w.bits, GROUP=w.group_size, BLOCK_N=block_n, GPI=gpi,
        num_warps=_num_warps or NUM_WARPS,
    )
    y = ws.sum(0) if split > 1 else ws[0]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], N)
