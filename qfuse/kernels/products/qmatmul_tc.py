"""y = x·dequant(W)ᵀ on tensor cores: MLX-layout 4/8-bit weights, bf16 activations, any rows.

Contract of `qmatmul_tc`:

    x         [..., K] bf16, any number of rows
    w         QuantizedTensor [N, K], 4 or 8 bits, bf16 scales/biases, contiguous
              last dimensions (`unsupported_reason` says what else is refused)
    bias      None or [N] bf16; residual: None or [..., N] bf16
    returns   residual + x·dequant(w)ᵀ + bias, [..., N] bf16

Decode rows are fast tier (float32 sums in another order than cuBLAS's, and
the rare one-ulp weight below) and bitwise reproducible; prefill rows are
bit-identical to compat. The first call on a device must run eagerly (it
allocates the semaphores below); after that the decode path can be captured
in a CUDA graph.

W is packed uint32 [N, K·bits/32] with scales/biases [N, K/g]. For decode
(M ≤ 16 rows) each program dequantizes a [BLOCK_N, KT] tile of W in
registers to bf16 (the weights the compat path multiplies, s·q + b rounded
once; compat rounds to float32 first, so a rare exact tie may differ by one
bf16 ulp) and feeds it to `tl.dot` as the A operand against a [KT, 16]
tile of xᵀ (the spare rows masked; the tensor cores have throughput to
spare), accumulating in float32, so the load pipeline Triton builds for
`tl.dot` (cp.async, several stages in flight) also streams the packed
weights. Prefill (more rows) dequantizes the weight once (`dequantize_bf16`)
and calls cuBLAS; `qmatmul_tc` says why.

Per 4-bit word (eight codes) the dequantization is four shifts+LOP3 that
lay codes j and j+4 into one 32-bit register as the bf16 pair 128 + c (the
"magic number" 0x4300 ORed into the mantissa), then per pair one packed
bf16x2 FMA that subtracts 128 (exact) and one that applies the scale and
bias, written as inline PTX so the pair never leaves its register (from
plain bf16 Triton code, ptxas splits each pair and re-packs it with extra
PRMT instructions). The dot does not care in which order K is summed, so
the tile keeps the codes in that register order (column 8w + 2j + h holds
code j + 4h of word w) and x is loaded permuted to match. 8-bit codes go
through float32 (the magic 2²³ trick of `codes.py`) and are rounded to bf16
in pairs.

Decode has few output rows per weight row, so K is split across programs
to fill the GPU (`splitk`); the float32 partial tiles go to a workspace and the last
program of each output tile to arrive (an integer semaphore) sums them in
split order and writes y: one launch, and the result does not depend on
which program finished first. The semaphores are reset to zero by that last
program, so one zeroed buffer per device serves every call (calls on
concurrent streams must not share it; qfuse decodes on one stream).

Under the Triton interpreter (CPU tests; NATIVE=False) inline PTX does not
run: the same dequantization is computed in float32 with an explicit
round-to-nearest-even to bf16 (the interpreter's own float→bf16 cast
truncates), and the dot is taken in float32 (the interpreter's dot misreads
bf16 tiles made by a bitcast).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...levers import interpreter_active
from ...quant import QuantizedTensor
from ..common.codes import code_f32, dequant_words, magic_halves
from ..common.rounding import bf16_bits_to_f32, bf16_rne_bits, round_bf16, stored_view, to_stored
from .splitk import (
    MAX_SEMAPHORES,
    arrive_last,
    as_rows,
    check_product,
    choose_split,
    product_outputs,
    semaphores,
    sm_count,
    split_workspace,
    sum_splits,
)

SUPPORTED_BITS = (4, 8)
DECODE_ROWS = 16  # rows up to which one BLOCK_M = 16 tile covers x (decode)

# Decode launch defaults, measured (bench/NOTES.md, "Quantized products").
BLOCK_N_DECODE = 128
NUM_WARPS_DECODE = 4
PROGRAMS_PER_SM = 4
STAGES = 3
# Scales, biases and x one iteration ahead (see tile_dot), for 4-bit weights only: it
# speeds up 4-bit and slows 8-bit, whose dequantization already needs the registers
# (bench/NOTES.md, "Quantized products").
PREFETCH_BITS = (4,)


@triton.jit
def pair_fma(t, s2, b2, NATIVE: tl.constexpr):
    """Each int32 of t holds two bf16 128 + c; returns the int32 pairs (c·s + b) as bf16,
    s2/b2 holding the scale/bias in both halves."""
    if NATIVE:
        w = tl.inline_asm_elementwise(
            "{ .reg .b32 one, m128, c;\n"
            "  mov.b32 one, 0x3F803F80;\n"
            "  mov.b32 m128, 0xC300C300;\n"
            "  fma.rn.bf16x2 c, $1, one, m128;\n"
            "  fma.rn.bf16x2 $0, c, $2, $3; }",
            "=r,r,r,r", [t, s2, b2], dtype=tl.int32, is_pure=True, pack=1)
    else:
        s = bf16_bits_to_f32(s2 & 0xFFFF)
        b = bf16_bits_to_f32(b2 & 0xFFFF)
        lo = bf16_bits_to_f32(t & 0xFFFF) - 128.0
        hi = bf16_bits_to_f32((t >> 16) & 0xFFFF) - 128.0
        w = bf16_rne_bits(lo * s + b) | (bf16_rne_bits(hi * s + b) << 16)
    return w


@triton.jit
def both_halves(v):
    """bf16 [..] → int32 [..] holding v in both 16-bit halves."""
    bits = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return bits | (bits << 16)


@triton.jit
def _pairs_to_bf16(p):
    """int32 pairs [..., P] → bf16 [..., P, 2] (low half first)."""
    return tl.join(p.to(tl.int16), (p >> 16).to(tl.int16)).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dequant_4bit(words, s, b, magic, NATIVE: tl.constexpr):
    """words int32 [R, G, W] (G groups of W words), s/b bf16 [R, G] → bf16 [R, G·W·8];
    column 8w' + 2j + h (w' counting words across groups) holds code j + 4h of word w'.
    ``magic`` is 0x43004300 passed at run time: as a literal, ptxas needs two LOP3s per
    pair instead of one."""
    s2 = both_halves(s)[:, :, None]
    b2 = both_halves(b)[:, :, None]
    p0 = pair_fma((words & 0x000F000F) | magic, s2, b2, NATIVE)
    p1 = pair_fma(((words >> 4) & 0x000F000F) | magic, s2, b2, NATIVE)
    p2 = pair_fma(((words >> 8) & 0x000F000F) | magic, s2, b2, NATIVE)
    p3 = pair_fma(((words >> 12) & 0x000F000F) | magic, s2, b2, NATIVE)
    p = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [R, G, W, 2 (j1), 2 (j0)]: j = 2·j1 + j0
    w = _pairs_to_bf16(p)  # [R, G, W, 2, 2, 2 (h)]
    return tl.reshape(w, (words.shape[0], words.shape[1] * words.shape[2] * 8))


@triton.jit
def _dequant_8bit(words, s, b, NATIVE: tl.constexpr):
    """words int32 [R, G, W], s/b bf16 [R, G] → bf16 [R, G·W·4] in natural k order."""
    lo, hi = magic_halves(words)
    s32 = s.to(tl.float32)[:, :, None]
    b32 = b.to(tl.float32)[:, :, None]
    c0 = code_f32(lo, hi, 0, 8, 4) * s32 + b32
    c1 = code_f32(lo, hi, 1, 8, 4) * (s32 * (1.0 / 256)) + b32
    c2 = code_f32(lo, hi, 2, 8, 4) * s32 + b32
    c3 = code_f32(lo, hi, 3, 8, 4) * (s32 * (1.0 / 256)) + b32
    if NATIVE:
        w = tl.join(tl.join(c0, c2), tl.join(c1, c3)).to(tl.bfloat16)  # [R, G, W, 2, 2]
    else:
        p = tl.join(bf16_rne_bits(c0) | (bf16_rne_bits(c1) << 16),
                    bf16_rne_bits(c2) | (bf16_rne_bits(c3) << 16))  # [R, G, W, 2 (pair)]
        w = _pairs_to_bf16(p)  # [R, G, W, 2, 2]: code 2·pair + half
    return tl.reshape(w, (words.shape[0], words.shape[1] * words.shape[2] * 4))


@triton.jit
def dequant(words, s, b, magic, BITS: tl.constexpr, NATIVE: tl.constexpr):
    """A [R, G, W] word tile with bf16 scales/biases [R, G] → bf16 [R, G·W·32/BITS] in
    the kernel's k order (see _dequant_4bit / _dequant_8bit)."""
    if BITS == 4:
        w = _dequant_4bit(words, s, b, magic, NATIVE)
    else:
        w = _dequant_8bit(words, s, b, NATIVE)
    return w


@triton.jit
def _scales_biases_x(s_ptrs, b_ptrs, x_ptrs, rows, x_ok, col, g, k0, it, N, K,
                     GROUP: tl.constexpr, ITERS: tl.constexpr, EVEN: tl.constexpr):
    """Iteration ``it``'s scales and biases [BLOCK_N, GPI] (groups ``g``) and x tile
    [KT, BLOCK_M] (from k0); zeros past the last iteration and, unless EVEN, past N, K."""
    live = rows[:, None] * 0 + it < ITERS  # [BLOCK_N, 1]
    if EVEN:
        ok = live & (g[None, :] * 0 == 0)
        k_ok = col * 0 + it < ITERS
    else:
        ok = live & (rows[:, None] < N) & (g[None, :] < K // GROUP)
        k_ok = (col * 0 + it < ITERS) & (k0 + col < K)
    s = tl.load(s_ptrs, mask=ok, other=0.0)
    b = tl.load(b_ptrs, mask=ok, other=0.0)
    xt = tl.load(x_ptrs, mask=x_ok & k_ok[:, None], other=0.0)
    return s, b, xt


@triton.jit
def tile_dot(x_ptr, stride_xm, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn,
             rows, xr, M, N, K, magic, g_first,
             BITS: tl.constexpr, GROUP: tl.constexpr, GPI: tl.constexpr, ITERS: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, EVEN: tl.constexpr,
             NATIVE: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr):
    """Σ over groups [g_first, g_first + ITERS·GPI) of dequant(W[rows])·x[xr]ᵀ: float32
    [BLOCK_N, BLOCK_M]. EVEN: every row < N and every group < K/GROUP (no masks)."""
    EPW: tl.constexpr = 32 // BITS
    WG: tl.constexpr = GROUP // EPW  # words per group
    KT: tl.constexpr = GPI * GROUP  # k per iteration
    n_groups = K // GROUP
    gi = tl.arange(0, GPI)
    wi = tl.arange(0, WG)
    col = tl.arange(0, KT)
    if BITS == 4:
        k_of_col = (col // 8) * 8 + (col % 8) // 2 + 4 * (col % 2)
    else:
        k_of_col = col
    row_off = rows.to(tl.int64)
    w_ptrs = (w_ptr + row_off[:, None, None] * stride_wn
              + (g_first + gi)[None, :, None] * WG + wi[None, None, :])
    s_ptrs = s_ptr + row_off[:, None] * stride_sn + (g_first + gi)[None, :]
    b_ptrs = b_ptr + row_off[:, None] * stride_bn + (g_first + gi)[None, :]
    x_ptrs = x_ptr + xr[None, :].to(tl.int64) * stride_xm + g_first * GROUP + k_of_col[:, None]
    x_ok = xr[None, :] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    # Triton pipelines only the packed words (cp.async into shared memory); the 2-byte
    # scales, biases and x stay plain loads that wait a full memory latency every
    # iteration. PREFETCH fetches them one iteration ahead into registers instead, at
    # the cost of registers (fewer programs per SM).
    if PREFETCH:
        s, b, xt = _scales_biases_x(s_ptrs, b_ptrs, x_ptrs, rows, x_ok, col, g_first + gi,
                                    g_first * GROUP, 0, N, K, GROUP, ITERS, EVEN)
    for it in tl.range(0, ITERS, num_stages=STAGES):
        if EVEN:
            words = tl.load(w_ptrs)
        else:
            g = g_first + it * GPI + gi
            ok = (rows[:, None] < N) & (g[None, :] < n_groups)
            words = tl.load(w_ptrs, mask=ok[:, :, None], other=0)
        if PREFETCH:
            s_next, b_next, x_next = _scales_biases_x(
                s_ptrs + GPI, b_ptrs + GPI, x_ptrs + KT, rows, x_ok, col,
                g_first + (it + 1) * GPI + gi, (g_first + (it + 1) * GPI) * GROUP, it + 1, N, K,
                GROUP, ITERS, EVEN)
        else:
            s, b, xt = _scales_biases_x(s_ptrs, b_ptrs, x_ptrs, rows, x_ok, col,
                                        g_first + it * GPI + gi, (g_first + it * GPI) * GROUP,
                                        it, N, K, GROUP, ITERS, EVEN)
        words = words.to(tl.int32, bitcast=True)
        w = dequant(words, s, b, magic, BITS, NATIVE)
        # Each step's dot starts from zero and is added with a rounded float32 add (in
        # PTX, which Triton cannot fold back into the dot's accumulator): the tensor
        # cores' own accumulation truncates, which over the 240 k16 steps of K=3840
        # drifts from what cuBLAS (compat) computes.
        if NATIVE:
            acc = tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f",
                                            [acc, tl.dot(w, xt)], dtype=tl.float32,
                                            is_pure=True, pack=1)
        else:  # the interpreter's dot misreads bf16 made by a bitcast: multiply in float32
            acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
        w_ptrs += GPI * WG
        s_ptrs += GPI
        b_ptrs += GPI
        x_ptrs += KT
        if PREFETCH:
            s, b, xt = s_next, b_next, x_next
    return acc


@triton.jit
def _qmm_tc_kernel(
    x_ptr,  # bf16 [M, K]
    w_ptr,  # uint32 [N, K·BITS/32]
    s_ptr, b_ptr,  # bf16 [N, K/GROUP]
    y_ptr,  # bf16 [M, N] (int16 bits under the interpreter)
    bias_ptr,  # [N] or a dummy
    res_ptr,  # [M, N] residual added to y, or a dummy
    ws_ptr,  # float32 [SPLIT, M, N] partial tiles (SPLIT > 1)
    sem_ptr,  # int32 semaphores, one per output tile, zero between calls
    M, N, K, magic,
    stride_xm, stride_wn, stride_sn, stride_bn, stride_ym, stride_rm,
    BITS: tl.constexpr, GROUP: tl.constexpr,
    GPI: tl.constexpr,  # quantization groups per loop iteration
    ITERS: tl.constexpr,  # loop iterations per program (its share of K)
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    EVEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    NATIVE: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows = output columns
    xr = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # x rows
    acc = tile_dot(x_ptr, stride_xm, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn,
                   rows, xr, M, N, K, magic, tl.program_id(2) * (ITERS * GPI),
                   BITS, GROUP, GPI, ITERS, BLOCK_N, BLOCK_M, EVEN, NATIVE, STAGES, PREFETCH)
    out_ok = (rows[:, None] < N) & (xr[None, :] < M)
    last = True
    if SPLIT > 1:
        ws_off = xr[None, :] * N + rows[:, None]
        last = arrive_last(ws_ptr, sem_ptr, acc, 0, ws_off, out_ok, M, N, SPLIT, 1)
    if last:
        if SPLIT > 1:
            acc = sum_splits(ws_ptr, sem_ptr, 0, ws_off, out_ok, M, N, SPLIT, 1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[:, None]
        if HAS_RES:
            # Rounded as compat rounds: the projection to bf16 first, then the sum.
            acc = round_bf16(acc, NATIVE) + tl.load(
                res_ptr + xr[None, :].to(tl.int64) * stride_rm + rows[:, None], mask=out_ok,
                other=0.0).to(tl.float32)
        tl.store(y_ptr + xr[None, :].to(tl.int64) * stride_ym + rows[:, None],
                 to_stored(acc, NATIVE), mask=out_ok)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, b_ptr, out_ptr, N, K,
                    stride_wn, stride_sn, stride_bn, stride_on,
                    BITS: tl.constexpr, GROUP: tl.constexpr, GPI: tl.constexpr,
                    BLOCK_N: tl.constexpr, NATIVE: tl.constexpr):
    """out = dequant(W) in bf16, natural k order, GPI groups of BLOCK_N rows per program:
    float32 s·q + b rounded once, as `quant.dequantize` computes it (so bit-identical)."""
    EPW: tl.constexpr = 32 // BITS
    WG: tl.constexpr = GROUP // EPW
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1) * GPI + tl.arange(0, GPI)
    wi = tl.arange(0, WG)
    ok = (rows[:, None] < N) & (g[None, :] < K // GROUP)
    row_off = rows.to(tl.int64)
    words = tl.load(w_ptr + row_off[:, None, None] * stride_wn + g[None, :, None] * WG
                    + wi[None, None, :], mask=ok[:, :, None], other=0).to(tl.int32, bitcast=True)
    s = tl.load(s_ptr + row_off[:, None] * stride_sn + g[None, :], mask=ok, other=0.0)
    b = tl.load(b_ptr + row_off[:, None] * stride_bn + g[None, :], mask=ok, other=0.0)
    words = tl.reshape(words, (BLOCK_N, GPI * WG))
    s32 = tl.reshape(tl.broadcast_to(s.to(tl.float32)[:, :, None], (BLOCK_N, GPI, WG)),
                     (BLOCK_N, GPI * WG))
    b32 = tl.reshape(tl.broadcast_to(b.to(tl.float32)[:, :, None], (BLOCK_N, GPI, WG)),
                     (BLOCK_N, GPI * WG))
    w = dequant_words(words, s32, b32, BITS)  # [BLOCK_N, GPI·GROUP], natural order
    col = tl.arange(0, GPI * GROUP)
    out_ok = (rows[:, None] < N) & (tl.program_id(1) * GPI * GROUP + col[None, :] < K)
    ptrs = out_ptr + row_off[:, None] * stride_on + tl.program_id(1) * GPI * GROUP + col[None, :]
    tl.store(ptrs, to_stored(w, NATIVE), mask=out_ok)


def dequantize_bf16(w: QuantizedTensor) -> torch.Tensor:
    """dequant(W) [N, K] in bf16, bit-identical to ``w.dequantize(torch.bfloat16)``, in one
    pass (the torch path unpacks into int32 and float32 temporaries first)."""
    N, K = w.shape
    out = torch.empty(N, K, dtype=torch.bfloat16, device=w.packed.device)
    gpi = max(1, 128 // w.group_size)
    native = not interpreter_active()
    _dequant_kernel[(triton.cdiv(N, 64), triton.cdiv(K // w.group_size, gpi))](
        w.packed, w.scales, w.biases, stored_view(out), N, K,
        w.packed.stride(0), w.scales.stride(0), w.biases.stride(0), out.stride(0),
        BITS=w.bits, GROUP=w.group_size, GPI=gpi, BLOCK_N=64, NATIVE=native, num_warps=4)
    return out


def unsupported_reason(x: torch.Tensor, w: QuantizedTensor) -> str | None:
    if x.dtype != torch.bfloat16:
        return f"x dtype {x.dtype} (tensor-core kernel: bf16)"
    if w.bits not in SUPPORTED_BITS:
        return f"{w.bits}-bit weights (kernel: 4, 8)"
    if w.packed.dim() != 2:
        return f"weight of {w.packed.dim()} dims (kernel: [N, K])"
    if w.scales.dtype != torch.bfloat16 or w.biases.dtype != torch.bfloat16:
        return f"scales/biases {w.scales.dtype} (kernel: bf16)"
    if w.packed.stride(-1) != 1 or w.scales.stride(-1) != 1 or w.biases.stride(-1) != 1:
        return "packed/scales/biases need a contiguous last dimension"
    return None


def launch_shape(M: int, N: int, K: int, w: QuantizedTensor, device, block_n=None,
                 groups_per_iter=None, split=None, num_warps=None) -> dict:
    """Tiles, split and warps for an [M ≤ 16, K] x [N, K]ᵀ product (measured defaults)."""
    if M > DECODE_ROWS:
        raise ValueError(f"the in-register kernel takes at most {DECODE_ROWS} rows, got {M}")
    block_m = 16
    block_n = block_n or BLOCK_N_DECODE
    # At least 64 k per tl.dot step (four k16 MMAs); 32-wide groups come two at a time.
    gpi = groups_per_iter or max(1, 64 // w.group_size)
    n_groups = K // w.group_size
    n_iters = triton.cdiv(n_groups, gpi)
    grid_n, grid_m = triton.cdiv(N, block_n), triton.cdiv(M, block_m)
    if split is None:
        split = choose_split(grid_n * grid_m, n_iters, PROGRAMS_PER_SM, sm_count(device), True)
    if grid_n * grid_m > MAX_SEMAPHORES:
        split = 1
    iters = triton.cdiv(n_iters, split)
    return {"grid": (grid_n, grid_m, split), "BLOCK_N": block_n, "BLOCK_M": block_m,
            "GPI": gpi, "ITERS": iters, "SPLIT": split,
            "EVEN": N % block_n == 0 and iters * split * gpi == n_groups,
            "num_warps": num_warps or NUM_WARPS_DECODE}


def qmatmul_tc(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, prefetch: bool | None = None,
               **shape) -> torch.Tensor:
    """x [..., K] bf16 → residual + x·dequant(w)ᵀ + bias, [..., N] bf16. ``shape``:
    launch_shape's overrides (block_n, groups_per_iter, split, num_warps), and
    ``prefetch``: launch overrides the tests use to reach the split-K and prefetch
    paths on small shapes. bias and residual must have x's dtype.

    More than DECODE_ROWS rows (prefill): the weight is dequantized once to bf16
    (`dequantize_bf16`) and multiplied by cuBLAS, bit-identical to compat: there the
    in-register kernel was slower (it repeats the dequantization per row tile) and, for
    8-bit g64, wrong for reasons not understood (bench/NOTES.md, "Quantized products"
    → "Prefill")."""
    K, N = check_product(x, w, bias, residual)
    x2 = as_rows(x, K)
    M = x2.shape[0]
    if M > DECODE_ROWS:
        y = torch.nn.functional.linear(x2, dequantize_bf16(w), bias)
        if residual is not None:
            y = as_rows(residual, N) + y
        return y.reshape(*x.shape[:-1], N)
    y, bias, res2 = product_outputs(x2, N, bias, residual)
    if M == 0 or N == 0:
        return y.reshape(*x.shape[:-1], N)
    ls = launch_shape(M, N, K, w, x.device, **shape)
    ws = split_workspace(ls["SPLIT"], (M, N), y)
    native = not interpreter_active()
    _qmm_tc_kernel[ls.pop("grid")](
        x2, w.packed, w.scales, w.biases, stored_view(y),
        bias if bias is not None else y, res2, ws, semaphores(x.device), M, N, K, 0x43004300,
        x2.stride(0), w.packed.stride(0), w.scales.stride(0), w.biases.stride(0), y.stride(0),
        res2.stride(0), BITS=w.bits, GROUP=w.group_size, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, NATIVE=native, STAGES=STAGES,
        PREFETCH=w.bits in PREFETCH_BITS if prefetch is None else prefetch, **ls)
    return y.reshape(*x.shape[:-1], N)
