"""y = x·dequant(W)ᵀ for decode rows on tensor cores over the raw 4/8-bit codes (fast tier).

W is MLX-packed uint32 [N, K·bits/32] with scales/biases [N, K/g]; x is [M, K]
bf16 or fp16 with M ≤ MAX_ROWS. The weight is never dequantized: the mma
operands are the codes themselves (OFF + c, exact in x's dtype) and the
scales come out of the sums per group g, as MLX's own Metal qmv computes:

    y[m, n] = Σ_g s[n,g]·D[n,(m,g)] + (b[n,g] − OFF·s[n,g])·Σ_{k∈g} x[m,k]
    D[n,(m,g)] = Σ_{k∈g} (OFF + c[n,k])·x[m,k]

so each mma column is one (row of x, group) pair: x enters block-diagonally,
[KT words, BLOCK_M·GT], zero outside its group. A word's codes share one
group, so code position k of every word is its own mma over the words of a
tile ([BLOCK_N, KT]·[KT, R]): the words keep their loaded shape and the codes
are extracted straight in the operand layout (`codes.codes4_bf16`, one
instruction per code). The products are exact and the sums float32, but the
scale multiplies a sum of codes rather than each rounded weight, so the
result is not compat's bit for bit: fast tier, judged by the gates.

The grid is (column tiles) × (splits of K); a program takes ITERS tiles,
issues every tile's word loads before it touches x (with programmatic
dependent launch those loads overlap the previous kernel's tail: `gdc_wait`
sits between them and the first read of x or write of anything), and the
splits meet through `qmatmul_tc`'s semaphores (the last program of a column
tile sums the partials in split order), so the result is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..levers import interpreter_active
from ..quant import QuantizedTensor
from .codes import code_offset, code_operand, codes4_bf16
from .qmatmul_tc import (
    MAX_SEMAPHORES,
    _arrive_last,
    _product_outputs,
    _rows,
    _semaphores,
    _split_workspace,
    _sum_splits,
    check_product,
    sm_count,
)
from .rounding import _as_y, _round_like, emulates_bf16, stored_view

MAX_ROWS = 64
SUPPORTED_BITS = (4, 8)
# Launch defaults (bench/NOTES.md, "Weight products over raw codes").
BLOCK_N = 128
TILE_WORDS = 32  # words of one weight row per tile: 256 4-bit or 128 8-bit codes
PROGRAMS_PER_SM = 4
MAX_ITERS = 8  # tiles per program at most (they are unrolled)
NUM_WARPS = 4
STAGES = 0


@triton.jit
def _tile_words(w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn, row_off, wi, gi, t, KW,
                n_groups, KT: tl.constexpr, GT: tl.constexpr, EVEN: tl.constexpr):
    """Tile t of the weight rows: int32 words [BLOCK_N, KT], float32 scales and biases
    [BLOCK_N, GT] (zero past the last group, so a partial tile adds nothing)."""
    w_ptrs = w_ptr + row_off[:, None] * stride_wn + t * KT + wi[None, :]
    s_ptrs = s_ptr + row_off[:, None] * stride_sn + t * GT + gi[None, :]
    b_ptrs = b_ptr + row_off[:, None] * stride_bn + t * GT + gi[None, :]
    if EVEN:
        words = tl.load(w_ptrs, eviction_policy="evict_first")
        s = tl.load(s_ptrs)
        b = tl.load(b_ptrs)
    else:
        w_ok = (t * KT + wi) < KW
        g_ok = (t * GT + gi) < n_groups
        words = tl.load(w_ptrs, mask=w_ok[None, :], other=0, eviction_policy="evict_first")
        s = tl.load(s_ptrs, mask=g_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=g_ok[None, :], other=0.0)
    return words.to(tl.int32, bitcast=True), s.to(tl.float32), b.to(tl.float32)


@triton.jit
def _tile_product(words, s, b, x_tile, in_group, wi, t, KW, BITS: tl.constexpr,
                  KT: tl.constexpr, GT: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_M: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    """One tile's x·dequant(W)ᵀ, float32 [BLOCK_N, BLOCK_M]: one mma per code position
    into the (row of x, group) columns, then the scales and the offset/bias correction."""
    EPW: tl.constexpr = 32 // BITS
    R: tl.constexpr = BLOCK_M * GT
    DT: tl.constexpr = x_tile.dtype.element_ty
    OFF: tl.constexpr = code_offset(BITS, DT)
    if EVEN:
        x_ok = in_group
    else:
        x_ok = in_group & ((t * KT + wi) < KW)[:, None]
    if ASM:
        kc = codes4_bf16(words)
    d = tl.zeros((BLOCK_N, R), tl.float32)
    xsum = tl.zeros((R,), tl.float32)
    for k in tl.static_range(EPW):
        xk = tl.load(x_tile + t * (KT * EPW) + k, mask=x_ok, other=0.0)
        if ASM:
            ck = kc[k]
        else:
            ck = code_operand(words, k, BITS, DT)
        d = tl.dot(ck, xk, d)
        xsum += tl.sum(xk.to(tl.float32), axis=0)
    d3 = tl.reshape(d, (BLOCK_N, BLOCK_M, GT))
    corr = tl.reshape(xsum, (1, BLOCK_M, GT))
    return tl.sum(d3 * s[:, None, :] + (b - OFF * s)[:, None, :] * corr, axis=2)


@triton.jit
def _prefetch_l2(w_ptr, row_off, stride_wn, t_first, KW, KT: tl.constexpr,
                 ITERS: tl.constexpr):
    """Ask L2 for this program's weight rows (one prefetch per row and tile, the rows of
    a tile being KT·4 ≤ 256 bytes): with PDL this runs before `gdc_wait`, so the
    weights stream while the previous kernel drains, and the pipelined loop after it
    reads them from L2."""
    for it in tl.static_range(ITERS):
        w0 = tl.minimum((t_first + it) * KT, KW - 1)
        addr = w_ptr + row_off * stride_wn + w0
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [addr], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def codes_product_tile(x_ptr, stride_xm, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn,
                       rows, M, KW, n_groups, t_first,
                       BITS: tl.constexpr, GROUP: tl.constexpr, KT: tl.constexpr,
                       ITERS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                       EVEN: tl.constexpr, ASM: tl.constexpr, GDC: tl.constexpr,
                       STAGES: tl.constexpr):
    """Σ over word tiles [t_first, t_first + ITERS) of x·dequant(W[rows])ᵀ: float32
    [BLOCK_N, BLOCK_M] (column m is row m of x; rows m ≥ M read as zero). ``rows`` must
    be valid weight rows (callers clamp); tiles past the last word contribute nothing.

    STAGES = 0: the tiles are unrolled and every tile's words, scales and biases are
    loaded first, into registers (before `gdc_wait` with GDC). STAGES ≥ 1: a loop that
    Triton pipelines (cp.async into STAGES shared-memory buffers), the weights asked
    of L2 before `gdc_wait`."""
    EPW: tl.constexpr = 32 // BITS
    GT: tl.constexpr = KT * EPW // GROUP  # groups per tile
    R: tl.constexpr = BLOCK_M * GT  # mma columns: (row of x, group)
    col = tl.arange(0, R)
    m_of_col = col // GT
    wi = tl.arange(0, KT)
    gi = tl.arange(0, GT)
    in_group = ((wi * EPW // GROUP)[:, None] == (col % GT)[None, :]) & (m_of_col < M)[None, :]
    x_tile = x_ptr + m_of_col[None, :] * stride_xm + (wi * EPW)[:, None]  # [KT, R]
    row_off = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    if STAGES == 0:
        # The bytes in flight are what a decode product is bound by, and none of these
        # depends on the previous kernel.
        tiles = ()
        for it in tl.static_range(ITERS):
            tiles = tiles + (_tile_words(w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn,
                                         row_off, wi, gi, t_first + it, KW, n_groups, KT, GT,
                                         EVEN),)
        if GDC:
            tl.extra.cuda.gdc_wait()
        for it in tl.static_range(ITERS):
            words, s, b = tiles[it]
            acc += _tile_product(words, s, b, x_tile, in_group, wi, t_first + it, KW, BITS, KT,
                                 GT, BLOCK_N, BLOCK_M, EVEN, ASM)
    else:
        if GDC:
            _prefetch_l2(w_ptr, row_off, stride_wn, t_first, KW, KT, ITERS)
            tl.extra.cuda.gdc_wait()
        for it in tl.range(0, ITERS, num_stages=STAGES):
            t = t_first + it
            words, s, b = _tile_words(w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn,
                                      row_off, wi, gi, t, KW, n_groups, KT, GT, EVEN)
            acc += _tile_product(words, s, b, x_tile, in_group, wi, t, KW, BITS, KT, GT,
                                 BLOCK_N, BLOCK_M, EVEN, ASM)
    return acc


@triton.jit
def _qmm_codes_kernel(
    x_ptr,  # [M, K] bf16/fp16
    w_ptr,  # uint32 [N, KW = K·BITS/32]
    s_ptr, b_ptr,  # [N, K/GROUP]
    y_ptr,  # [M, N] x's dtype (bf16 as int16 bits under the interpreter)
    bias_ptr,  # [N] or a dummy
    res_ptr,  # [M, N] residual added to y, or a dummy
    ws_ptr,  # float32 [SPLIT, M, N] partial sums (SPLIT > 1)
    sem_ptr,  # int32 semaphores, one per column tile, zero between calls
    M, N, KW, n_groups,
    stride_xm, stride_wn, stride_sn, stride_bn, stride_ym, stride_rm,
    BITS: tl.constexpr, GROUP: tl.constexpr,
    KT: tl.constexpr,  # words of a weight row per tile
    ITERS: tl.constexpr,  # tiles per program
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    EVEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    Y_BF16_BITS: tl.constexpr, ASM: tl.constexpr, GDC: tl.constexpr,
    STAGES: tl.constexpr,  # 0: unrolled tiles; ≥ 1: a pipelined loop (codes_product_tile)
):
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    xr = tl.arange(0, BLOCK_M)
    acc = codes_product_tile(x_ptr, stride_xm, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn,
                             stride_bn, tl.minimum(rows, N - 1), M, KW, n_groups,
                             tl.program_id(2) * ITERS, BITS, GROUP, KT, ITERS, BLOCK_N,
                             BLOCK_M, EVEN, ASM, GDC, STAGES)
    out_ok = (rows[:, None] < N) & (xr[None, :] < M)
    ws_off = xr[None, :] * N + rows[:, None]
    last = True
    if SPLIT > 1:
        last = _arrive_last(ws_ptr, sem_ptr, acc, 0, ws_off, out_ok, M, N, SPLIT, 1)
    if last:
        if SPLIT > 1:
            acc = _sum_splits(ws_ptr, sem_ptr, 0, ws_off, out_ok, M, N, SPLIT, 1, BLOCK_N,
                              BLOCK_M)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[:, None]
        y_off = xr[None, :].to(tl.int64) * stride_ym + rows[:, None]
        if HAS_RES:
            # Rounded as compat rounds: the projection to y's dtype first, then the sum.
            res = tl.load(res_ptr + xr[None, :].to(tl.int64) * stride_rm + rows[:, None],
                          mask=out_ok, other=0.0)
            acc = _round_like(acc, y_ptr, Y_BF16_BITS) + res.to(tl.float32)
        tl.store(y_ptr + y_off, _as_y(acc, y_ptr, Y_BF16_BITS), mask=out_ok)


def unsupported_reason(x: torch.Tensor, w: QuantizedTensor) -> str | None:
    """None when the codes kernel can take x·dequant(w)ᵀ, else why not."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x dtype {x.dtype} (codes kernel: bf16, fp16)"
    if w.bits not in SUPPORTED_BITS:
        return f"{w.bits}-bit weights (codes kernel: 4, 8)"
    if w.packed.dim() != 2:
        return f"weight of {w.packed.dim()} dims (kernel: [N, K])"
    if w.packed.stride(-1) != 1 or w.scales.stride(-1) != 1 or w.biases.stride(-1) != 1:
        return "packed/scales/biases need a contiguous last dimension"
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows (codes kernel: 1..{MAX_ROWS})"
    if TILE_WORDS * (32 // w.bits) % w.group_size:
        return f"group size {w.group_size} does not divide a tile"
    return None


def codes_shape(M: int, N: int, K: int, w: QuantizedTensor, device: torch.device,
                block_n: int | None = None, tile_words: int | None = None,
                iters: int | None = None, split: int | None = None,
                num_warps: int | None = None, stages: int | None = None,
                programs_per_sm: int = PROGRAMS_PER_SM) -> dict:
    """Grid and tiles of a codes-kernel launch (the overrides are for A/B sweeps).
    Without ``iters``/``split``, K is split until about ``programs_per_sm`` programs per
    SM are in the grid, each taking at most MAX_ITERS tiles."""
    kt = tile_words or TILE_WORDS
    epw = 32 // w.bits
    gt = kt * epw // w.group_size
    if gt < 1 or kt * epw % w.group_size:
        raise ValueError(f"a tile of {kt} words does not hold whole groups of {w.group_size}")
    block_m = max(triton.next_power_of_2(M), triton.cdiv(16, gt))  # tl.dot: ≥ 16 columns
    block_n = block_n or BLOCK_N
    block_n = max(block_n, triton.next_power_of_2(triton.cdiv(N, MAX_SEMAPHORES)))
    kw = K * w.bits // 32
    n_tiles = triton.cdiv(kw, kt)
    grid_n = triton.cdiv(N, block_n)
    if iters is None:
        if split is None:
            split = max(1, min(n_tiles, programs_per_sm * sm_count(device) // grid_n))
        iters = min(MAX_ITERS, triton.cdiv(n_tiles, split))
    split = triton.cdiv(n_tiles, iters)
    return dict(grid=(grid_n, 1, split), BLOCK_N=block_n, BLOCK_M=block_m, KT=kt, ITERS=iters,
                SPLIT=split, EVEN=N % block_n == 0 and split * iters * kt == kw,
                STAGES=STAGES if stages is None else stages, num_warps=num_warps or NUM_WARPS)


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: on Hopper and newer GPUs, not under the interpreter."""
    return (device.type == "cuda" and not interpreter_active()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def asm_codes(x: torch.Tensor, w: QuantizedTensor) -> bool:
    """Whether the kernel extracts 4-bit codes with inline PTX (bf16 x, on the GPU)."""
    return w.bits == 4 and x.dtype == torch.bfloat16 and not interpreter_active()


def qmatmul_codes(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, pdl: bool | None = None,
                  **shape) -> torch.Tensor:
    """x [..., K] (1..MAX_ROWS rows, bf16/fp16) → residual + x·dequant(w)ᵀ + bias [..., N]
    in x's dtype, scales factored out of each group's sum (module docstring). bias and
    residual in x's dtype. Deterministic; graph-capturable after one eager call (the
    semaphores). ``shape``: `codes_shape`'s overrides; ``pdl``: launch with
    programmatic dependent launch (default: on Hopper)."""
    K, N = check_product(x, w, bias, residual)
    reason = unsupported_reason(x, w)
    if reason is not None:
        raise ValueError(f"qmatmul_codes cannot take these inputs: {reason}")
    x2 = _rows(x, K)
    M = x2.shape[0]
    y, bias, res2 = _product_outputs(x2, N, bias, residual)
    if N == 0 or K == 0:
        if K == 0:
            y.zero_()
            if bias is not None:
                y += bias
            if residual is not None:
                y += res2
        return y.reshape(*x.shape[:-1], N)
    ls = codes_shape(M, N, K, w, x.device, **shape)
    ws = _split_workspace(ls["SPLIT"], (M, N), y)
    gdc = use_pdl(x.device) if pdl is None else pdl
    extra = {"launch_pdl": True} if gdc else {}
    _qmm_codes_kernel[ls.pop("grid")](
        x2, w.packed, w.scales, w.biases, stored_view(y),
        bias if bias is not None else y, res2, ws, _semaphores(x.device),
        M, N, K * w.bits // 32, K // w.group_size,
        x2.stride(0), w.packed.stride(0), w.scales.stride(0), w.biases.stride(0), y.stride(0),
        res2.stride(0), BITS=w.bits, GROUP=w.group_size, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, Y_BF16_BITS=emulates_bf16(y.dtype),
        ASM=asm_codes(x, w), GDC=gdc, **ls, **extra)
    return y.reshape(*x.shape[:-1], N)
