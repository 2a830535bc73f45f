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

from ..levers import interpreter_active
from ..quant import QuantizedTensor
from .codes import code_f32, magic_halves, split_codes
from .qmatmul_tc import _arrive_last, _round_bf16, _rows, _sum_splits, _to_y

MAX_ROWS = 4
SUPPORTED_BITS = (4, 8)


@triton.jit
def _round_like(x, y_ptr, BF16_BITS: tl.constexpr):
    """float32 x rounded to y_ptr's element type, as float32 (bf16 emulated with
    round-to-nearest-even when BF16_BITS: y_ptr then holds int16 bits)."""
    if BF16_BITS:
        r = _round_bf16(x, False)
    else:
        r = x.to(y_ptr.dtype.element_ty).to(tl.float32)
    return r


@triton.jit
def _as_y(x, y_ptr, BF16_BITS: tl.constexpr):
    """float32 x as stored through y_ptr (bf16 bits when BF16_BITS)."""
    if BF16_BITS:
        r = _to_y(x, False)
    else:
        r = x.to(y_ptr.dtype.element_ty)
    return r


@triton.jit
def _gemv_tile(x_ptr, stride_xm, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn,
               rows, row_ok, g_first, n_groups, ROWS: tl.constexpr, BITS: tl.constexpr,
               GROUP: tl.constexpr, GPI: tl.constexpr, ITERS: tl.constexpr,
               BLOCK_N: tl.constexpr, EVEN: tl.constexpr):
    """Σ over groups [g_first, g_first + ITERS·GPI) ∩ [0, n_groups) of x[m]·dequant(W[rows])ᵀ:
    a tuple of ROWS float32 [BLOCK_N, 1] tiles.

    The loop is unrolled (static_range) and has no loop-carried dependence but the
    accumulators, so the compiler can issue every iteration's loads before the first
    one's arithmetic: a GEMV is bound by bytes in flight per SM long before it is bound
    by bandwidth, and a plain `range` loop waits one memory latency per iteration."""
    EPW: tl.constexpr = 32 // BITS
    WG: tl.constexpr = GROUP // EPW  # words per group
    HALF: tl.constexpr = EPW // 2
    gi = tl.arange(0, GPI)
    wi = tl.arange(0, WG)
    e_idx = tl.arange(0, EPW)
    # 2**-(BITS·(k mod EPW/2)) per code position, built from exponent bits (exact).
    pow2 = ((127 - (e_idx % HALF) * BITS) << 23).to(tl.float32, bitcast=True)
    row_off = rows.to(tl.int64)
    acc = ()
    acc_b = ()
    for m in tl.static_range(ROWS):
        acc = acc + (tl.zeros((BLOCK_N, GPI, WG), tl.float32),)
        acc_b = acc_b + (tl.zeros((BLOCK_N, GPI), tl.float32),)
    for it in tl.static_range(ITERS):
        g = g_first + it * GPI + gi  # [GPI]
        w_ptrs = w_ptr + row_off[:, None, None] * stride_wn + g[None, :, None] * WG + wi[None, None, :]
        s_ptrs = s_ptr + row_off[:, None] * stride_sn + g[None, :]
        b_ptrs = b_ptr + row_off[:, None] * stride_bn + g[None, :]
        x_off = g[:, None, None] * GROUP + (wi[:, None] * EPW + e_idx[None, :])[None, :, :]
        if EVEN:
            words = tl.load(w_ptrs)
            s = tl.load(s_ptrs)
            b = tl.load(b_ptrs)
        else:
            # Scalar bounds broadcast explicitly (rows·0 + g): the interpreter rejects
            # masks that mix scalar and vector comparisons.
            g_ok = (g < n_groups) & (g < g_first + ITERS * GPI)
            ok = row_ok[:, None] & g_ok[None, :]
            words = tl.load(w_ptrs, mask=ok[:, :, None], other=0)
            s = tl.load(s_ptrs, mask=ok, other=0.0)
            b = tl.load(b_ptrs, mask=ok, other=0.0)
        lo, hi = magic_halves(words.to(tl.int32, bitcast=True))
        s = s.to(tl.float32)
        b = b.to(tl.float32)
        new_a = ()
        new_b = ()
        for m in tl.static_range(ROWS):
            if EVEN:
                xt = tl.load(x_ptr + m * stride_xm + x_off)
            else:
                xt = tl.load(x_ptr + m * stride_xm + x_off, mask=g_ok[:, None, None], other=0.0)
            xt = xt.to(tl.float32)  # [GPI, WG, EPW]
            xsum = tl.sum(tl.sum(xt, axis=2), axis=1)  # [GPI]
            xk = split_codes(tl.reshape(xt * pow2[None, None, :], (GPI * WG, EPW)), EPW)
            d = tl.zeros((BLOCK_N, GPI, WG), tl.float32)
            for k in tl.static_range(EPW):
                d += code_f32(lo, hi, k, BITS, EPW) * tl.reshape(xk[k], (GPI, WG))[None, :, :]
            new_a = new_a + (acc[m] + d * s[:, :, None],)
            new_b = new_b + (acc_b[m] + b * xsum[None, :],)
        acc = new_a
        acc_b = new_b
    out = ()
    for m in tl.static_range(ROWS):
        out = out + ((tl.sum(tl.sum(acc[m], axis=2), axis=1) + tl.sum(acc_b[m], axis=1))[:, None],)
    return out


@triton.jit
def _qgemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # uint32 [N, K·BITS/32]
    s_ptr, b_ptr,  # [N, K/GROUP]
    y_ptr,  # [M, N], x's dtype (bf16 as int16 bits under the interpreter)
    bias_ptr,  # [N] or a dummy
    res_ptr,  # [M, N] residual added to y, or a dummy
    ws_ptr,  # float32 [SPLIT, M, N] partial sums (SPLIT > 1)
    sem_ptr,  # int32 semaphores, one per column tile, zero between calls
    N, K,
    stride_xm, stride_wn, stride_sn, stride_bn, stride_ym, stride_rm,
    ROWS: tl.constexpr,  # M
    BITS: tl.constexpr, GROUP: tl.constexpr,
    GPI: tl.constexpr,  # quantization groups per unrolled step
    ITERS: tl.constexpr,  # unrolled steps per program (its share of K)
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    Y_BF16_BITS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ys = _gemv_tile(x_ptr, stride_xm, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn,
                    rows, row_ok, tl.program_id(2) * (ITERS * GPI), K // GROUP,
                    ROWS, BITS, GROUP, GPI, ITERS, BLOCK_N, EVEN)
    out_ok = row_ok[:, None]
    last = True
    if SPLIT > 1:
        # Partials as planes [SPLIT, ROWS, N]: plane m of split p at (p·ROWS + m)·N.
        for m in tl.static_range(ROWS):
            last = _arrive_last(ws_ptr, sem_ptr, ys[m], m, rows[:, None], out_ok, 1, N, SPLIT,
                                ROWS)
    if last:
        for m in tl.static_range(ROWS):
            acc = ys[m]
            if SPLIT > 1:
                acc = _sum_splits(ws_ptr, sem_ptr, m, rows[:, None], out_ok, 1, N, SPLIT, ROWS,
                                  BLOCK_N, 1)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            if HAS_RES:
                # Rounded as compat rounds: the product to y's dtype first, then the sum.
                res = tl.load(res_ptr + m * stride_rm + rows[:, None], mask=out_ok, other=0.0)
                acc = _round_like(acc, y_ptr, Y_BF16_BITS) + res.to(tl.float32)
            tl.store(y_ptr + m * stride_ym + rows[:, None], _as_y(acc, y_ptr, Y_BF16_BITS),
                     mask=out_ok)


def unsupported_reason(x: torch.Tensor, w: QuantizedTensor) -> str | None:
    """None when `qmatmul` has a kernel for these inputs, else why not."""
    from .qmatmul_tc import unsupported_reason as tc_reason

    if x.dtype == torch.bfloat16:
        return tc_reason(x, w)
    return gemv_unsupported_reason(x, w)


def qmatmul(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] → residual + x·dequant(w)ᵀ + bias [..., N], by the kernel for x's dtype
    and row count."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.dtype == torch.bfloat16 and rows > BF16_GEMV_ROWS:
        from .qmatmul_tc import qmatmul_tc

        return qmatmul_tc(x, w, bias, residual)
    return qgemv(x, w, bias, residual)


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


# Launch defaults; bench/ab/ab9_gemv.py measures the alternatives on the GPU.
BLOCK_N = 32
GROUPS_PER_ITER = 2
ITERS = 2
NUM_WARPS = 4
# bf16 activations with at most this many rows take the GEMV; more go to the
# tensor-core kernel (which does the same work for up to 16 rows).
BF16_GEMV_ROWS = 1


def gemv_shape(M: int, N: int, K: int, w: QuantizedTensor, block_n: int | None = None,
               split: int | None = None, groups_per_iter: int | None = None,
               iters: int | None = None, num_warps: int | None = None) -> dict:
    """Grid and tiles of a `qgemv` launch. ``split`` fixes how many programs share K
    (some may get no groups); otherwise each program takes ``groups_per_iter`` ×
    ``iters`` groups."""
    from .qmatmul_tc import MAX_SEMAPHORES

    n_groups = K // w.group_size
    block_n = block_n or BLOCK_N
    # One semaphore per column tile.
    block_n = max(block_n, triton.next_power_of_2(triton.cdiv(N, MAX_SEMAPHORES)))
    gpi = groups_per_iter or GROUPS_PER_ITER
    if split is not None:
        per_split = triton.cdiv(n_groups, split)
        gpi = min(gpi, triton.next_power_of_2(per_split))
        steps = triton.cdiv(per_split, gpi)
    else:
        gpi = min(gpi, triton.next_power_of_2(n_groups))
        steps = min(iters or ITERS, triton.cdiv(n_groups, gpi))
        split = triton.cdiv(n_groups, gpi * steps)
    grid_n = triton.cdiv(N, block_n)
    return dict(grid=(grid_n, 1, split), BLOCK_N=block_n, GPI=gpi, ITERS=steps, SPLIT=split,
                EVEN=N % block_n == 0 and split * steps * gpi == n_groups,
                num_warps=num_warps or NUM_WARPS)


def qgemv(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None = None,
          residual: torch.Tensor | None = None, **shape) -> torch.Tensor:
    """x [..., K] with at most 4 rows → residual + x·dequant(w)ᵀ + bias, [..., N] in
    x's dtype (bias and residual in x's dtype too). ``shape``: `gemv_shape`'s
    overrides (block_n, split, groups_per_iter, iters, num_warps)."""
    from .qmatmul_tc import _semaphores

    K = x.shape[-1]
    N, Kw = w.shape
    if Kw != K:
        raise ValueError(f"x has {K} features but the weight expects {Kw}")
    reason = gemv_unsupported_reason(x, w)
    if reason is not None:
        raise ValueError(f"qgemv cannot take these inputs: {reason}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{N}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if residual is not None and (residual.shape != (*x.shape[:-1], N)
                                 or residual.dtype != x.dtype):
        raise ValueError(f"residual must be {(*x.shape[:-1], N)} {x.dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    x2 = _rows(x, K)
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if N == 0:
        return y.reshape(*x.shape[:-1], N)
    if bias is not None:
        bias = bias.contiguous()  # read with unit stride
    res2 = _rows(residual, N) if residual is not None else y
    ls = gemv_shape(M, N, K, w, **shape)
    split = ls["SPLIT"]
    ws = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else y
    bf16_bits = x.dtype == torch.bfloat16 and interpreter_active()
    _qgemv_kernel[ls.pop("grid")](
        x2, w.packed, w.scales, w.biases, y.view(torch.int16) if bf16_bits else y,
        bias if bias is not None else y, res2, ws, _semaphores(x.device), N, K,
        x2.stride(0), w.packed.stride(0), w.scales.stride(0), w.biases.stride(0), y.stride(0),
        res2.stride(0), ROWS=M, BITS=w.bits, GROUP=w.group_size, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, Y_BF16_BITS=bf16_bits, **ls)
    return y.reshape(*x.shape[:-1], N)
