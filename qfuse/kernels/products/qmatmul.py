"""y = residual + x·dequant(W)ᵀ + bias for MLX-layout 4/8-bit weights: dispatch, and the
CUDA-core GEMV.

Where it sits: `ops.linear` offers 1-32 bf16 rows of 4-bit g64/g128 weights to the
fragment kernel (`qmatmul_mma`) first; what that does not take comes to `qmatmul`
here, which sends one bf16 row, and fp16/fp32 x of at most 4 rows, to the GEMV
below (`qgemv`), and other bf16 rows to `qmatmul_tc` (tensor cores up to 16 rows,
dequantize once + cuBLAS beyond).

Contract of `qgemv`:

    x         [..., K], 1..MAX_ROWS (4) rows, fp16/bf16/fp32
    w         QuantizedTensor [N, K], 4 or 8 bits, contiguous last dimensions
    bias      None or [N], x's dtype
    residual  None or [..., N], x's dtype
    returns   [..., N], x's dtype

It multiplies compat's weights (dequantized and rounded to x's dtype,
`weight_rounding`) with exact float32 products and float32 sums, so it differs
from compat only in the order of the sums (fast tier). K is split across
programs and the last program of each column tile adds the partials in split
order (the semaphores of `splitk`): one launch, bitwise reproducible. The
first call on a device must be eager (it allocates the semaphores); later calls
can be captured in a CUDA graph.

Why this shape: a one-row product is limited by the bytes each SM has in
flight, long before bandwidth, so a K loop that waits one memory latency per
step is slow. The grid is (column tiles of BLOCK_N weight rows) × (splits of
K): thousands of short programs, each an unrolled share of K (ITERS steps of
GPI groups) whose loads can all issue before its arithmetic, and one
cross-thread reduction at the end. 4-bit codes with bf16 scales and bf16 x are
dequantized as packed bf16 pairs, as the tensor-core kernel does. Timings and
the remaining gap to the byte floor: bench/NOTES.md, "Quantized products" →
"Second GPU session on the quantized matmul".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...levers import interpreter_active
from ...quant import QuantizedTensor
from ..common.codes import code_f32, code_scale, magic_halves, split_codes
from ..common.rounding import as_stored, emulates_bf16, round_bf16, round_like, stored_view
from .qmatmul_tc import both_halves, pair_fma, qmatmul_tc
from .qmatmul_tc import unsupported_reason as tc_reason
from .splitk import (
    MAX_SEMAPHORES,
    arrive_last,
    as_rows,
    check_product,
    product_outputs,
    semaphores,
    split_workspace,
    sum_splits,
)

MAX_ROWS = 4
SUPPORTED_BITS = (4, 8)


@triton.jit
def _bf16_weights_4bit(words, s, b, magic, NATIVE: tl.constexpr):
    """4-bit words [R, G, W] with bf16 scales/biases [R, G] → for j = 0..3 the float32
    pairs (code j, code j + 4) of every word as compat's bf16 weights s·q + b: the
    tensor-core kernel's packed bf16x2 dequantization (`pair_fma`), then each half
    moved to the top of a float32 (one SHF or LOP3)."""
    s2 = both_halves(s)[:, :, None]
    b2 = both_halves(b)[:, :, None]
    out = ()
    for j in tl.static_range(4):
        p = pair_fma(((words >> (4 * j)) & 0x000F000F) | magic, s2, b2, NATIVE)
        out = out + ((p << 16).to(tl.float32, bitcast=True),
                     (p & -65536).to(tl.float32, bitcast=True))
    return out


@triton.jit
def _rounded_weights(words, s, b, BITS: tl.constexpr, ROUND: tl.constexpr,
                     NATIVE: tl.constexpr):
    """Words [R, G, W] with scales/biases [R, G] (any float type) → per code k (natural
    order) float32 s·q + b rounded as compat rounds its dequantized weight: to bf16
    (ROUND 1), fp16 (ROUND 2) or not at all (0, float32)."""
    EPW: tl.constexpr = 32 // BITS
    lo, hi = magic_halves(words)
    s32 = s.to(tl.float32)[:, :, None]
    b32 = b.to(tl.float32)[:, :, None]
    out = ()
    for k in tl.static_range(EPW):
        w = code_f32(lo, hi, k, BITS, EPW) * (s32 * code_scale(k, BITS, EPW)) + b32
        if ROUND == 1:
            w = round_bf16(w, NATIVE)
        elif ROUND == 2:
            w = w.to(tl.float16).to(tl.float32)
        out = out + (w,)
    return out


@triton.jit
def _weight_step(w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn, row_off, row_ok, g0,
                 g_first, n_groups, gi, wi, GPI: tl.constexpr, ITERS: tl.constexpr,
                 WG: tl.constexpr, EVEN: tl.constexpr):
    """One unrolled step's weights: words (int32) [R, GPI, WG], scales and biases [R, GPI]
    of groups g0 + gi (masked past the program's share and past K unless EVEN)."""
    g = g0 + gi
    w_ptrs = w_ptr + row_off[:, None, None] * stride_wn + g[None, :, None] * WG + wi[None, None, :]
    s_ptrs = s_ptr + row_off[:, None] * stride_sn + g[None, :]
    b_ptrs = b_ptr + row_off[:, None] * stride_bn + g[None, :]
    if EVEN:
        words = tl.load(w_ptrs)
        s = tl.load(s_ptrs)
        b = tl.load(b_ptrs)
    else:
        g_ok = (g < n_groups) & (g < g_first + ITERS * GPI)
        ok = row_ok[:, None] & g_ok[None, :]
        words = tl.load(w_ptrs, mask=ok[:, :, None], other=0)
        s = tl.load(s_ptrs, mask=ok, other=0.0)
        b = tl.load(b_ptrs, mask=ok, other=0.0)
    return words.to(tl.int32, bitcast=True), s, b


@triton.jit
def gemv_tile(x_ptr, stride_xm, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn,
              rows, row_ok, g_first, n_groups, magic, ROWS: tl.constexpr, BITS: tl.constexpr,
              GROUP: tl.constexpr, GPI: tl.constexpr, ITERS: tl.constexpr,
              BLOCK_N: tl.constexpr, EVEN: tl.constexpr, ROUND: tl.constexpr,
              PAIRS: tl.constexpr, NATIVE: tl.constexpr, GDC: tl.constexpr = False):
    """Σ over groups [g_first, g_first + ITERS·GPI) ∩ [0, n_groups) of x[m]·dequant(W[rows])ᵀ:
    a tuple of ROWS float32 [BLOCK_N, 1] tiles.

    The weights are compat's (dequantized and rounded to x's dtype, ROUND; PAIRS: 4-bit
    codes with bf16 scales and x, dequantized as bf16 pairs), the products exact and
    the sums float32: so the result differs from compat's cuBLAS product only in the
    order of the sums. (Factoring the scale out of each group, s·Σc·x + b·Σx, saves a
    few instructions per weight but multiplies unrounded weights, which raised the
    gate's KL several-fold on the default model: bench/NOTES.md.)

    The loop is unrolled (static_range) and has no loop-carried dependence but the
    accumulators, so the compiler can issue every step's loads before the first one's
    arithmetic: a GEMV is bound by bytes in flight per SM long before it is bound by
    bandwidth, and a plain `range` loop waits one memory latency per iteration.

    GDC (programmatic dependent launch): the first step's weights are requested before
    `gdc_wait`, x after it; the caller has let its dependents launch."""
    EPW: tl.constexpr = 32 // BITS
    WG: tl.constexpr = GROUP // EPW  # words per group
    gi = tl.arange(0, GPI)
    wi = tl.arange(0, WG)
    e_idx = tl.arange(0, EPW)
    row_off = rows.to(tl.int64)
    acc = ()
    for m in tl.static_range(ROWS):
        acc = acc + (tl.zeros((BLOCK_N, GPI, WG), tl.float32),)
    first = _weight_step(w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn, row_off, row_ok,
                         g_first, g_first, n_groups, gi, wi, GPI, ITERS, WG, EVEN)
    if GDC:  # the first weights are in flight; x is the previous kernel's output
        tl.extra.cuda.gdc_wait()
    for it in tl.static_range(ITERS):
        g = g_first + it * GPI + gi  # [GPI]
        x_off = g[:, None, None] * GROUP + (wi[:, None] * EPW + e_idx[None, :])[None, :, :]
        g_ok = (g < n_groups) & (g < g_first + ITERS * GPI)
        if it == 0:
            words, s, b = first
        else:
            words, s, b = _weight_step(w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn,
                                       row_off, row_ok, g_first + it * GPI, g_first, n_groups,
                                       gi, wi, GPI, ITERS, WG, EVEN)
        if PAIRS:
            wk = _bf16_weights_4bit(words, s, b, magic, NATIVE)  # codes 0, 4, 1, 5, ...
        else:
            wk = _rounded_weights(words, s, b, BITS, ROUND, NATIVE)  # codes 0, 1, 2, ...
        new_a = ()
        for m in tl.static_range(ROWS):
            if EVEN:
                xt = tl.load(x_ptr + m * stride_xm + x_off)
            else:
                xt = tl.load(x_ptr + m * stride_xm + x_off, mask=g_ok[:, None, None], other=0.0)
            xk = split_codes(tl.reshape(xt.to(tl.float32), (GPI * WG, EPW)), EPW)
            d = acc[m]
            for k in tl.static_range(EPW):
                # wk[k] holds code k, or with PAIRS code k/2 + 4·(k mod 2)
                d += wk[k] * tl.reshape(xk[(k // 2) + 4 * (k % 2) if PAIRS else k],
                                        (GPI, WG))[None, :, :]
            new_a = new_a + (d,)
        acc = new_a
    out = ()
    for m in tl.static_range(ROWS):
        out = out + (tl.sum(tl.sum(acc[m], axis=2), axis=1)[:, None],)
    return out


@triton.jit
def gemv_product(
    x_ptr,  # [M, K]
    w_ptr,  # uint32 [N, K·BITS/32]
    s_ptr, b_ptr,  # [N, K/GROUP]
    y_ptr,  # [M, N], x's dtype (bf16 as int16 bits under the interpreter)
    bias_ptr,  # [N] or a dummy
    res_ptr,  # [M, N] residual added to y, or a dummy
    ws_ptr,  # float32 [SPLIT, M, N] partial sums (SPLIT > 1)
    sem_ptr,  # int32 semaphores, one per column tile, zero between calls
    N, K, magic,
    stride_xm, stride_wn, stride_sn, stride_bn, stride_ym, stride_rm,
    ROWS: tl.constexpr,  # M
    BITS: tl.constexpr, GROUP: tl.constexpr,
    GPI: tl.constexpr,  # quantization groups per unrolled step
    ITERS: tl.constexpr,  # unrolled steps per program (its share of K)
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    Y_BF16_BITS: tl.constexpr, ROUND: tl.constexpr, PAIRS: tl.constexpr,
    NATIVE: tl.constexpr, GDC: tl.constexpr,
):
    """Column tile program_id(0) of y = residual + x·dequant(w)ᵀ + bias, stored by the last
    of the tile's splits to arrive (every program when SPLIT is 1): True in that program,
    for kernels that go on to an epilogue. GDC: the dependents may launch now, and the
    tile's first weights are requested before the wait for the previous kernel."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ys = gemv_tile(x_ptr, stride_xm, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn,
                   rows, row_ok, tl.program_id(2) * (ITERS * GPI), K // GROUP, magic,
                   ROWS, BITS, GROUP, GPI, ITERS, BLOCK_N, EVEN, ROUND, PAIRS, NATIVE, GDC)
    out_ok = row_ok[:, None]
    last = True
    if SPLIT > 1:
        # Partials as planes [SPLIT, ROWS, N]: plane m of split p at (p·ROWS + m)·N.
        for m in tl.static_range(ROWS):
            last = arrive_last(ws_ptr, sem_ptr, ys[m], m, rows[:, None], out_ok, 1, N, SPLIT,
                               ROWS)
    if last:
        for m in tl.static_range(ROWS):
            acc = ys[m]
            if SPLIT > 1:
                acc = sum_splits(ws_ptr, sem_ptr, m, rows[:, None], out_ok, 1, N, SPLIT, ROWS)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            if HAS_RES:
                # Rounded as compat rounds: the product to y's dtype first, then the sum.
                res = tl.load(res_ptr + m * stride_rm + rows[:, None], mask=out_ok, other=0.0)
                acc = round_like(acc, y_ptr, Y_BF16_BITS) + res.to(tl.float32)
            tl.store(y_ptr + m * stride_ym + rows[:, None], as_stored(acc, y_ptr, Y_BF16_BITS),
                     mask=out_ok)
    return last


@triton.jit
def _qgemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, N, K, magic,
    stride_xm, stride_wn, stride_sn, stride_bn, stride_ym, stride_rm,
    ROWS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GPI: tl.constexpr,
    ITERS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, Y_BF16_BITS: tl.constexpr,
    ROUND: tl.constexpr, PAIRS: tl.constexpr, NATIVE: tl.constexpr,
):
    """y = residual + x·dequant(w)ᵀ + bias: `gemv_product`."""
    gemv_product(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, N, K,
                 magic, stride_xm, stride_wn, stride_sn, stride_bn, stride_ym, stride_rm, ROWS,
                 BITS, GROUP, GPI, ITERS, SPLIT, BLOCK_N, EVEN, HAS_BIAS, HAS_RES, Y_BF16_BITS,
                 ROUND, PAIRS, NATIVE, False)


def unsupported_reason(x: torch.Tensor, w: QuantizedTensor) -> str | None:
    """None when `qmatmul` has a kernel for these inputs, else why not."""
    if x.dtype == torch.bfloat16:
        return tc_reason(x, w)
    return gemv_unsupported_reason(x, w)


def qmatmul(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, checked: bool = False) -> torch.Tensor:
    """x [..., K] → residual + x·dequant(w)ᵀ + bias [..., N], by the kernel for x's dtype
    and row count. ``checked``: the caller has had None from `unsupported_reason`."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.dtype == torch.bfloat16 and not 1 <= rows <= BF16_GEMV_ROWS:  # (0 rows too)
        return qmatmul_tc(x, w, bias, residual)
    return qgemv(x, w, bias, residual, checked=checked)


def gemv_unsupported_reason(x: torch.Tensor, w: QuantizedTensor,
                            max_rows: int = MAX_ROWS) -> str | None:
    """Why the CUDA-core GEMV cannot take these inputs; ``max_rows``: the caller's row limit
    (a fused step's own; `qgemv`'s launch defaults are sized for MAX_ROWS)."""
    if w.bits not in SUPPORTED_BITS:
        return f"{w.bits}-bit weights (kernel: 4, 8)"
    if w.packed.stride(-1) != 1 or w.scales.stride(-1) != 1 or w.biases.stride(-1) != 1:
        return "packed/scales/biases need a contiguous last dimension"
    if w.packed.dim() != 2:
        return f"weight of {w.packed.dim()} dims (kernel: [N, K])"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"x dtype {x.dtype}"
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or rows > max_rows:
        return f"{rows} rows (decode kernel: 1..{max_rows})"
    return None


# Launch defaults (bench/NOTES.md, "Quantized products"): two groups of 64 per unrolled
# step beat one, and the split stays at most MAX_SPLIT because the last program of a
# tile sums every split.
BLOCK_N = 128
WEIGHTS_PER_STEP = 128  # per row: 2 groups of 64, 4 of 32, 1 of 128
MIN_ITERS = 2
MAX_SPLIT = 32
MAX_STEPS = 16  # unrolled steps per program at most (code size, registers)
NUM_WARPS = 4
# bf16 activations with at most this many rows take the GEMV; more go to the
# tensor-core kernel (which does the same work for up to 16 rows).
BF16_GEMV_ROWS = 1


def gemv_shape(N: int, K: int, w: QuantizedTensor, block_n: int | None = None,
               split: int | None = None, groups_per_iter: int | None = None,
               iters: int | None = None, num_warps: int | None = None) -> dict:
    """Grid and tiles of a `qgemv` launch. ``split`` sets how many programs share K
    (some may get no groups; more when a share would exceed MAX_STEPS); otherwise each
    program takes ``groups_per_iter`` × ``iters`` groups. The row count does not enter:
    every row shares each program's weight tile."""
    n_groups = K // w.group_size
    block_n = block_n or BLOCK_N
    # One semaphore per column tile.
    block_n = max(block_n, triton.next_power_of_2(triton.cdiv(N, MAX_SEMAPHORES)))
    gpi = groups_per_iter or max(1, WEIGHTS_PER_STEP // w.group_size)
    if split is not None:
        per_split = triton.cdiv(n_groups, split)
        gpi = min(gpi, triton.next_power_of_2(per_split))
        steps = triton.cdiv(per_split, gpi)
        if steps > MAX_STEPS:  # the steps are unrolled: split more instead
            steps = MAX_STEPS
            split = triton.cdiv(n_groups, gpi * steps)
    else:
        gpi = min(gpi, triton.next_power_of_2(n_groups))
        steps = iters or max(MIN_ITERS, triton.cdiv(n_groups, gpi * MAX_SPLIT))
        steps = min(steps, triton.cdiv(n_groups, gpi))
        split = triton.cdiv(n_groups, gpi * steps)
    grid_n = triton.cdiv(N, block_n)
    return {"grid": (grid_n, 1, split), "BLOCK_N": block_n, "GPI": gpi, "ITERS": steps,
            "SPLIT": split, "EVEN": N % block_n == 0 and split * steps * gpi == n_groups,
            "num_warps": num_warps or NUM_WARPS}


def weight_rounding(x: torch.Tensor, w: QuantizedTensor) -> dict:
    """How `gemv_tile` rounds the dequantized weight: to x's dtype, as compat's
    ``dequantize(x.dtype)`` does (bf16 pairs when 4-bit codes, bf16 scales and bf16 x)."""
    native = not interpreter_active()
    round_kind = {torch.bfloat16: 1, torch.float16: 2}.get(x.dtype, 0)
    pairs = w.bits == 4 and x.dtype == torch.bfloat16 and w.scales.dtype == torch.bfloat16 \
        and w.biases.dtype == torch.bfloat16
    return {"ROUND": round_kind, "PAIRS": pairs, "NATIVE": native}


def qgemv(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None = None,
          residual: torch.Tensor | None = None, checked: bool = False,
          **shape) -> torch.Tensor:
    """x [..., K] with at most 4 rows → residual + x·dequant(w)ᵀ + bias, [..., N] in
    x's dtype (bias and residual in x's dtype too). ``shape``: `gemv_shape`'s
    overrides (block_n, split, groups_per_iter, iters, num_warps). ``checked``: the
    caller has had None from `gemv_unsupported_reason` for inputs of this layout."""
    K, N = check_product(x, w, bias, residual)
    reason = None if checked else gemv_unsupported_reason(x, w)
    if reason is not None:
        raise ValueError(f"qgemv cannot take these inputs: {reason}")
    x2 = as_rows(x, K)
    M = x2.shape[0]
    y, bias, res2 = product_outputs(x2, N, bias, residual)
    if N == 0:
        return y.reshape(*x.shape[:-1], N)
    ls = gemv_shape(N, K, w, **shape)
    ws = split_workspace(ls["SPLIT"], (M, N), y)
    _qgemv_kernel[ls.pop("grid")](
        x2, w.packed, w.scales, w.biases, stored_view(y),
        bias if bias is not None else y, res2, ws, semaphores(x.device), N, K, 0x43004300,
        x2.stride(0), w.packed.stride(0), w.scales.stride(0), w.biases.stride(0), y.stride(0),
        res2.stride(0), ROWS=M, BITS=w.bits, GROUP=w.group_size, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, Y_BF16_BITS=emulates_bf16(y.dtype), **weight_rounding(x, w), **ls)
    return y.reshape(*x.shape[:-1], N)
