"""y = x·dequant(W)ᵀ for 1–32 bf16 rows over 4-bit weights in mma fragment order (GPU only).

Contract (`qmatmul_mma`, and `mlp` built on it): x [..., K] bf16 with 1..MAX_ROWS
rows; the weight a `fragments.FragmentWeight` [N, K] (4-bit, groups of 64 or 128,
bf16 scales), which `fragments_of` repacks from a QuantizedTensor on its first use
and keeps with it; bias [N] and residual [..., N] in bf16, or None; y [..., N]
bf16. Fast tier: the scales come out of each group's sum. Deterministic, and a
row's result does not depend on the batch it is in (the split of K depends on N,
K and the GPU only). The first call for a weight and device must run eagerly
(the repack and the semaphores); after that a call can be captured in a CUDA
graph. Needs sm_80 or newer; `unsupported_reason` says why inputs are refused.

The weight is `fragments.FragmentWeight` (repacked once, on first use). Each warp
runs `mma.sync.m16n8k16` (bf16 in, float32 out) with the codes themselves
as the A operand (128 + c, exact in bf16) and the rows of x as the eight
columns of B (more rows: one B per 8, over the same A registers); the scales
come out of each group's sum, as MLX's own Metal qmv computes:

    y[m, n] = Σ_g s[n,g]·D[n,m,g] + (b[n,g] − 128·s[n,g])·Σ_{k∈g} x[m,k]
    D[n,m,g] = Σ_{k∈g} (128 + c[n,k])·x[m,k]

Σx comes from the same mma with an all-ones A, so a thread needs nothing
from its neighbours. A thread's one 16-byte load holds the A registers of four
mmas (a LOP3 per pair of codes makes 128 + c), and the whole per-element step is
one inline-PTX block over registers, so the compiler cannot move the pairs
through shared memory.

The Triton tensors of a program are 1-D with one element per thread, the only
layout Triton can give them, so element i is lane i % 32 of warp i // 32, which
is what the mma needs (a 2-D tensor's thread layout is the compiler's choice and
has differed between Triton versions). The grid is (row-tile blocks) ×
(splits of K); splits meet through semaphores (the last program of a block sums
them in split order), so the result is deterministic. Each program walks its share
of K a few blocks a step, the next step's loads in flight during this step's mmas;
it issues the first step's weight loads before `gdc_wait` (programmatic dependent
launch) and reads x after.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...levers import interpreter_active
from ...quant import QuantizedTensor
from ..common.codes import split_codes
from ..common.pdl import enabled as pdl_enabled
from ..common.pdl import launch_options, sm_major
from . import fragments
from .fragments import BLOCK_K, TILE_N, FragmentWeight
from .splitk import k_shares, semaphores, sm_count, split_workspace, start_product

MAX_ROWS = 32  # four column tiles of the mma's N = 8 (64 rows would lose: NOTES)
# Launch defaults (bench/NOTES.md, "Quantized products"): one row tile
# per warp, four warps, K split for about four programs per SM, four blocks a step.
TILES_PER_WARP = 1
CHUNK = 4
NUM_WARPS = 4
PROGRAMS_PER_SM = 4
X_AHEAD = True


_STEP_REGS = [".reg .f32 d0, d1, d2, d3, e0, e1, e2, e3, sl, sh, bl, bh, u;",
               "mov.b32 one, 0x3F803F80;"] + [f"mov.f32 {r}, 0f00000000;" for r in
                                              ("d0", "d1", "d2", "d3", "e0", "e1", "e2", "e3")]


_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


def _sum_line(e: str, b: str) -> str:
    """One k16 step of Σx: the all-ones mma into the four registers ``e``."""
    return f"{_MMA} {{{e}}}, {{one, one, one, one}}, {b}, {{{e}}};"


def _mma_lines(a: str, b: str) -> list[str]:
    """One k16 step: the codes' mma into d, and the all-ones mma (Σx) into e."""
    return [f"{_MMA} {{d0, d1, d2, d3}}, {{{a}}}, {b}, {{d0, d1, d2, d3}};",
            _sum_line("e0, e1, e2, e3", b)]


def _scale_lines(scales: int, biases: int, acc: int) -> list[str]:
    """out $0-$3 = acc + s·d + (b − 128·s)·e, s/b the bf16 pairs in operands ``scales``
    and ``biases`` (row g low, row g + 8 high), acc in operands ``acc`` .. ``acc`` + 3."""
    lines = [f"shl.b32 t, ${scales}, 16;", "mov.b32 sl, t;",
             f"and.b32 t, ${scales}, 0xFFFF0000;", "mov.b32 sh, t;",
             f"shl.b32 t, ${biases}, 16;", "mov.b32 bl, t;",
             f"and.b32 t, ${biases}, 0xFFFF0000;", "mov.b32 bh, t;",
             "fma.rn.f32 bl, sl, 0fC3000000, bl;",  # b − 128·s
             "fma.rn.f32 bh, sh, 0fC3000000, bh;"]
    for out, sc, bi, d, e in ((0, "sl", "bl", "d0", "e0"), (1, "sl", "bl", "d1", "e1"),
                              (2, "sh", "bh", "d2", "e2"), (3, "sh", "bh", "d3", "e3")):
        lines.append(f"fma.rn.f32 u, {sc}, {d}, ${acc + out};")
        lines.append(f"fma.rn.f32 ${out}, {bi}, {e}, u;")
    return lines


def pair_lines(word: str, regs: list[str]) -> list[str]:
    """A register r = 128 + the code pair at nibbles r and r + 4 of ``word`` (bf16)."""
    lines = [f"lop3.b32 {regs[0]}, {word}, 0x000F000F, 0x43004300, 0xEA;"]
    for r in range(1, 4):
        lines.append(f"shr.u32 t, {word}, {4 * r};")
        lines.append(f"lop3.b32 {regs[r]}, t, 0x000F000F, 0x43004300, 0xEA;")
    return lines


def group_step_asm(scales: int = 16, biases: int = 17, acc: int = 18) -> str:
    """$0-$3 out (c0..c3), $4-$7 words, $8-$15 x pairs, then the scales, biases and the
    four accumulators in at the operands given (one register each here; a kernel that
    packs four elements per operand, as the ring kernel does, numbers them apart)."""
    asm = ["{", ".reg .b32 a0, a1, a2, a3, t, one;"] + _STEP_REGS
    for j in range(4):
        asm += pair_lines(f"${4 + j}", ["a0", "a1", "a2", "a3"])
        asm += _mma_lines("a0, a1, a2, a3", f"{{${8 + 2 * j}, ${9 + 2 * j}}}")
    return "\n".join(asm + _scale_lines(scales, biases, acc) + ["}"])


_GROUP_STEP_ASM = tl.constexpr(group_step_asm())


def extract_asm() -> str:
    """$0-$15 out (A registers r of mma j at 4j + r), $16-$19 words."""
    asm = ["{", ".reg .b32 t;"]
    for j in range(4):
        asm += pair_lines(f"${16 + j}", [f"${4 * j + r}" for r in range(4)])
    return "\n".join(asm + ["}"])


def column_step_asm(scales: int = 28, biases: int = 29, acc: int = 30) -> str:
    """The same arithmetic as `group_step_asm`, in the same order, for one 8-row column
    tile of x over A registers made once: $0-$3 out, $4-$19 A, $20-$27 x pairs, then the
    scales, biases and accumulators in at the operands given."""
    asm = ["{", ".reg .b32 t, one;"] + _STEP_REGS
    for j in range(4):
        asm += _mma_lines(", ".join(f"${4 + 4 * j + r}" for r in range(4)),
                          f"{{${20 + 2 * j}, ${21 + 2 * j}}}")
    return "\n".join(asm + _scale_lines(scales, biases, acc) + ["}"])


_EXTRACT_ASM = tl.constexpr(extract_asm())
_COLUMN_STEP_ASM = tl.constexpr(column_step_asm())


@triton.jit
def _extract(w):
    """The 16 A registers (128 + code pairs, bf16) of one block's four mmas."""
    return tl.inline_asm_elementwise(
        _EXTRACT_ASM, "=r," * 15 + "=r" + ",r,r,r,r", [w[0], w[1], w[2], w[3]],
        dtype=(tl.int32,) * 16, is_pure=True, pack=1)


@triton.jit
def _column_step(a, x, s, b, acc):
    """`_group_step` for one column tile of x, over A registers from `_extract`."""
    return tl.inline_asm_elementwise(
        _COLUMN_STEP_ASM, "=f,=f,=f,=f" + ",r" * 26 + ",f,f,f,f",
        [a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12],
         a[13], a[14], a[15], x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], s, b,
         acc[0], acc[1], acc[2], acc[3]],
        dtype=(tl.float32,) * 4, is_pure=True, pack=1)


@triton.jit
def _group_step(w, x, s, b, acc):
    """acc (4 float32 tensors: rows g/g+8 × columns 2q/2q+1 of the mma) plus one 64-column
    block: w the 4 fragment words, x the 8 bf16 pairs, s/b the packed scales/biases."""
    return tl.inline_asm_elementwise(
        _GROUP_STEP_ASM, "=f,=f,=f,=f" + ",r" * 14 + ",f,f,f,f",
        [w[0], w[1], w[2], w[3], x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], s, b,
         acc[0], acc[1], acc[2], acc[3]],
        dtype=(tl.float32,) * 4, is_pure=True, pack=1)


@triton.jit
def _load_blocks(w_ptrs, s_ptrs, b_ptrs, GROUP: tl.constexpr, TILES: tl.constexpr,
                 CHUNK: tl.constexpr):
    """The words, scales and biases of the CHUNK blocks that start at the pointers, for
    each row tile ([tile][block])."""
    words = ()
    scales = ()
    biases = ()
    for tt in tl.static_range(TILES):
        tw = ()
        ts = ()
        tb = ()
        for c in tl.static_range(CHUNK):
            # one 16-byte load per thread, split into the four words in registers
            tw = tw + (split_codes(tl.load(w_ptrs[tt][:, None] + c * 128
                                           + tl.arange(0, 4)[None, :],
                                           eviction_policy="evict_first"), 4),)
            ts = ts + (tl.load(s_ptrs[tt] + (c * 64 // GROUP) * 8),)
            tb = tb + (tl.load(b_ptrs[tt] + (c * 64 // GROUP) * 8),)
        words = words + (tw,)
        scales = scales + (ts,)
        biases = biases + (tb,)
    return words, scales, biases


@triton.jit
def load_x_pairs(x_ptrs, CHUNK: tl.constexpr, NT: tl.constexpr):
    """The B operands of the CHUNK blocks that start at ``x_ptrs`` ([column tile] of
    pointers): per column tile and block 8 bf16 pairs of one row of x, as two 16-byte
    loads ([column tile][block])."""
    out = ()
    for nt in tl.static_range(NT):
        xs = ()
        for c in tl.static_range(CHUNK):
            lo = split_codes(tl.load(x_ptrs[nt][:, None] + c * 32
                                     + tl.arange(0, 4)[None, :]), 4)
            hi = split_codes(tl.load(x_ptrs[nt][:, None] + c * 32 + 4
                                     + tl.arange(0, 4)[None, :]), 4)
            xs = xs + (lo + hi,)
        out = out + (xs,)
    return out


@triton.jit
def _step_operands(w_ptrs, s_ptrs, b_ptrs, x_ptrs, GROUP: tl.constexpr, TILES: tl.constexpr,
                   CHUNK: tl.constexpr, X_AHEAD: tl.constexpr, NT: tl.constexpr):
    """One step's words, scales, biases and x: x's operands now with X_AHEAD (a step
    ahead, in registers), else its pointers, for `_mma_blocks` to load just in time (x
    is hot in L1, and registers held a step ahead are not holding weights in flight)."""
    words, scales, biases = _load_blocks(w_ptrs, s_ptrs, b_ptrs, GROUP, TILES, CHUNK)
    if X_AHEAD:
        xs = load_x_pairs(x_ptrs, CHUNK, NT)
    else:
        xs = x_ptrs
    return words, scales, biases, xs


@triton.jit
def _advance(w_ptrs, s_ptrs, b_ptrs, x_ptrs, GROUP: tl.constexpr, CHUNK: tl.constexpr):
    """The pointers moved on by one step of CHUNK blocks."""
    w_out = ()
    s_out = ()
    b_out = ()
    for tt in tl.static_range(len(w_ptrs)):
        w_out = w_out + (w_ptrs[tt] + CHUNK * 128,)
        s_out = s_out + (s_ptrs[tt] + CHUNK * 64 // GROUP * 8,)
        b_out = b_out + (b_ptrs[tt] + CHUNK * 64 // GROUP * 8,)
    x_out = ()
    for nt in tl.static_range(len(x_ptrs)):
        x_out = x_out + (x_ptrs[nt] + CHUNK * 32,)
    return w_out, s_out, b_out, x_out


@triton.jit
def _mma_blocks(words, scales, biases, xs, accs, TILES: tl.constexpr,
                CHUNK: tl.constexpr, X_AHEAD: tl.constexpr, NT: tl.constexpr):
    """accs ([tile][column tile]: 4 float32 accumulators) plus CHUNK blocks of every tile;
    ``xs``: `load_x_pairs`'s operands (X_AHEAD) or its pointers. One column tile takes the
    fused step; more make each block's A registers once and reuse them."""
    if not X_AHEAD:
        xs = load_x_pairs(xs, CHUNK, NT)
    out = ()
    for tt in tl.static_range(TILES):
        tile_accs = accs[tt]
        for c in tl.static_range(CHUNK):
            if NT == 1:
                tile_accs = (_group_step(words[tt][c], xs[0][c], scales[tt][c], biases[tt][c],
                                         tile_accs[0]),)
            else:
                a = _extract(words[tt][c])
                stepped = ()
                for nt in tl.static_range(NT):
                    stepped = stepped + (_column_step(a, xs[nt][c], scales[tt][c],
                                                      biases[tt][c], tile_accs[nt]),)
                tile_accs = stepped
        out = out + (tile_accs,)
    return out


@triton.jit
def mma_product(
    x_ptr,  # int32 view of bf16 x [M, K]: element m·(K/2) + i holds x[m, 2i], x[m, 2i+1]
    w_ptr,  # int32 [T, KB, 32, 4] fragment words
    s_ptr, b_ptr,  # int32 [T, KB·64/GROUP, 8] packed bf16 pairs
    y_ptr,  # bf16 [M, N]
    bias_ptr,  # bf16 [N] or a dummy
    res_ptr,  # bf16 [M, N] or a dummy
    ws_ptr,  # float32 [SPLIT, M, N] partial sums (SPLIT > 1)
    sem_ptr,  # int32 semaphores, one per row-tile program, zero between calls
    M, N, T, KB, BPP, stride_ym, stride_rm,  # BPP: 64-column blocks per split of K
    GROUP: tl.constexpr,
    NW: tl.constexpr,  # num_warps: one row tile per warp and per TILES step
    TILES: tl.constexpr,  # row tiles per warp
    CHUNK: tl.constexpr,  # blocks per loop step: the next step's loads fly during this one
    X_AHEAD: tl.constexpr,  # x's operands loaded a step ahead too (else just in time)
    NT: tl.constexpr,  # column tiles: 8 rows of x each
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GDC: tl.constexpr,
):
    """The kernel's whole work, for kernels that add an epilogue: x·dequant(w)ᵀ (+ bias,
    + residual) for program_id(0)'s row tiles, stored to y by the last of the tile's
    splits to arrive; returns True in that program (every program when SPLIT is 1)."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    # 1-D tensors of exactly one element per thread: the only layout Triton can give them
    # puts element i on lane i % 32 of warp i // 32, which is what the mma needs.
    idx = tl.arange(0, 32 * NW)
    lane = idx % 32
    g = lane // 4
    q = lane % 4
    kb_lo = tl.program_id(2) * BPP
    n_steps = (tl.minimum(kb_lo + BPP, KB) - kb_lo) // CHUNK  # whole: the launcher's choice
    n_groups = KB * 64 // GROUP
    tiles_out = ()  # a warp past the last tile streams the last one and stores nothing
    w_ptrs = ()
    s_ptrs = ()
    b_ptrs = ()
    for tt in tl.static_range(TILES):
        tile = (tl.program_id(0) * TILES + tt) * NW + idx // 32
        tiles_out = tiles_out + (tile,)
        t = tl.minimum(tile, T - 1).to(tl.int64)
        w_ptrs = w_ptrs + (w_ptr + ((t * KB + kb_lo) * 32 + lane) * 4,)
        sb = (t * n_groups + kb_lo * 64 // GROUP) * 8 + g
        s_ptrs = s_ptrs + (s_ptr + sb,)
        b_ptrs = b_ptrs + (b_ptr + sb,)
    # The first step's weights before the wait: none of it depends on the previous kernel.
    words, scales, biases = _load_blocks(w_ptrs, s_ptrs, b_ptrs, GROUP, TILES, CHUNK)
    if GDC:
        tl.extra.cuda.gdc_wait()
    # B column g of column tile nt is row 8·nt + g of x; columns past the rows repeat
    # the last row (never stored)
    x_ptrs = ()
    for nt in tl.static_range(NT):
        x_ptrs = x_ptrs + (x_ptr + tl.minimum(8 * nt + g, M - 1).to(tl.int64) * (KB * 32)
                           + q * 8 + kb_lo * 32,)
    if X_AHEAD:  # x's operands a step ahead too, in registers
        xs = load_x_pairs(x_ptrs, CHUNK, NT)
    else:  # just in time (`_mma_blocks` loads them; x is hot in L1)
        xs = x_ptrs
    zero = tl.zeros((32 * NW,), tl.float32)
    accs = ()
    for tt in tl.static_range(TILES):
        tile_accs = ()
        for nt in tl.static_range(NT):
            tile_accs = tile_accs + ((zero, zero, zero, zero),)
        accs = accs + (tile_accs,)
    # Register double buffering, unrolled twice so the two buffers swap roles instead of
    # being copied: step s + 1's loads are issued before step s's mmas.
    for _ in range((n_steps - 1) // 2):
        w_ptrs, s_ptrs, b_ptrs, x_ptrs = _advance(w_ptrs, s_ptrs, b_ptrs, x_ptrs, GROUP, CHUNK)
        w2, s2, b2, x2 = _step_operands(w_ptrs, s_ptrs, b_ptrs, x_ptrs, GROUP, TILES, CHUNK,
                                        X_AHEAD, NT)
        accs = _mma_blocks(words, scales, biases, xs, accs, TILES, CHUNK, X_AHEAD, NT)
        w_ptrs, s_ptrs, b_ptrs, x_ptrs = _advance(w_ptrs, s_ptrs, b_ptrs, x_ptrs, GROUP, CHUNK)
        words, scales, biases, xs = _step_operands(w_ptrs, s_ptrs, b_ptrs, x_ptrs, GROUP, TILES,
                                                   CHUNK, X_AHEAD, NT)
        accs = _mma_blocks(w2, s2, b2, x2, accs, TILES, CHUNK, X_AHEAD, NT)
    if (n_steps - 1) % 2:
        w_ptrs, s_ptrs, b_ptrs, x_ptrs = _advance(w_ptrs, s_ptrs, b_ptrs, x_ptrs, GROUP, CHUNK)
        w2, s2, b2, x2 = _step_operands(w_ptrs, s_ptrs, b_ptrs, x_ptrs, GROUP, TILES, CHUNK,
                                        X_AHEAD, NT)
        accs = _mma_blocks(words, scales, biases, xs, accs, TILES, CHUNK, X_AHEAD, NT)
        accs = _mma_blocks(w2, s2, b2, x2, accs, TILES, CHUNK, X_AHEAD, NT)
    else:
        accs = _mma_blocks(words, scales, biases, xs, accs, TILES, CHUNK, X_AHEAD, NT)
    # accs[t][nt][i]: output row 16·tile + g + 8·(i // 2), row of x 8·nt + 2q + i % 2.
    # The accumulators cover disjoint outputs, so split K needs one [M, N] plane per split.
    last = True
    if SPLIT > 1:
        for tt in tl.static_range(TILES):
            for nt in tl.static_range(NT):
                for i in tl.static_range(4):
                    n = tiles_out[tt] * 16 + g + 8 * (i // 2)
                    m = 8 * nt + 2 * q + (i % 2)
                    tl.store(ws_ptr + tl.program_id(2) * (M * N) + m * N + n, accs[tt][nt][i],
                             mask=(n < N) & (m < M))
        tl.debug_barrier()  # every thread's partials are written before the count
        tile_sem = sem_ptr + tl.program_id(0)
        last = tl.atomic_add(tile_sem, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
    if last:
        for tt in tl.static_range(TILES):
            for nt in tl.static_range(NT):
                for i in tl.static_range(4):
                    n = tiles_out[tt] * 16 + g + 8 * (i // 2)
                    m = 8 * nt + 2 * q + (i % 2)
                    out_ok = (n < N) & (m < M)
                    a = accs[tt][nt][i]
                    if SPLIT > 1:  # every split's partial, in split order (deterministic)
                        a = tl.zeros_like(a)
                        for sp in range(SPLIT):
                            a += tl.load(ws_ptr + sp * (M * N) + m * N + n, mask=out_ok,
                                         other=0.0, cache_modifier=".cg")
                    if HAS_BIAS:
                        a += tl.load(bias_ptr + n, mask=out_ok, other=0.0).to(tl.float32)
                    if HAS_RES:
                        # Rounded as compat rounds: the projection to bf16 first, then the sum.
                        a = a.to(tl.bfloat16).to(tl.float32) + tl.load(
                            res_ptr + m.to(tl.int64) * stride_rm + n, mask=out_ok,
                            other=0.0).to(tl.float32)
                    tl.store(y_ptr + m.to(tl.int64) * stride_ym + n, a.to(tl.bfloat16),
                             mask=out_ok)
        if SPLIT > 1:
            tl.atomic_xchg(sem_ptr + tl.program_id(0), 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _qmm_mma_kernel(
    x_ptr,  # int32 view of bf16 x [M, K]: element m·(K/2) + i holds x[m, 2i], x[m, 2i+1]
    w_ptr,  # int32 [T, KB, 32, 4] fragment words
    s_ptr, b_ptr,  # int32 [T, KB·64/GROUP, 8] packed bf16 pairs
    y_ptr,  # bf16 [M, N]
    bias_ptr,  # bf16 [N] or a dummy
    res_ptr,  # bf16 [M, N] or a dummy
    ws_ptr,  # float32 [SPLIT, M, N] partial sums (SPLIT > 1)
    sem_ptr,  # int32 semaphores, one per row-tile program, zero between calls
    M, N, T, KB, BPP, stride_ym, stride_rm,  # BPP: 64-column blocks per split of K
    GROUP: tl.constexpr,
    NW: tl.constexpr,  # num_warps: one row tile per warp and per TILES step
    TILES: tl.constexpr,  # row tiles per warp
    CHUNK: tl.constexpr,  # blocks per loop step: the next step's loads fly during this one
    X_AHEAD: tl.constexpr,  # x's operands loaded a step ahead too (else just in time)
    NT: tl.constexpr,  # column tiles: 8 rows of x each
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GDC: tl.constexpr,
):
    """y = x·dequant(w)ᵀ (+ bias, + residual): `mma_product`."""
    mma_product(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr,
                M, N, T, KB, BPP, stride_ym, stride_rm, GROUP, NW, TILES, CHUNK,
                X_AHEAD, NT, SPLIT, HAS_BIAS, HAS_RES, GDC)


def unsupported_reason(x: torch.Tensor, w: FragmentWeight | QuantizedTensor) -> str | None:
    """None when the fragment kernel can take x·dequant(w)ᵀ (w repacked first if it is
    in the MLX layout), else why not."""
    if isinstance(w, QuantizedTensor):
        reason = fragments.unsupported_reason(w)
        if reason is not None:
            return reason
    if w.shape[-1] != x.shape[-1]:
        return f"x has {x.shape[-1]} features, the weight {w.shape[-1]}"
    if x.device.type != "cuda" or interpreter_active():
        return "needs a CUDA GPU (inline-PTX mma.sync)"
    if sm_major(x.device) < 8:
        return "needs sm_80 or newer (bf16 mma.sync)"
    if x.dtype != torch.bfloat16:
        return f"x dtype {x.dtype} (fragment kernel: bf16)"
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows (fragment kernel: 1..{MAX_ROWS})"
    return None


@functools.lru_cache(maxsize=1024)  # on the decode path: a handful of shapes per model
def mma_shape(N: int, K: int, group_size: int, device: torch.device, tiles: int | None = None,
              chunk: int | None = None, split: int | None = None,
              x_ahead: bool | None = None, per_sm: int | None = None) -> dict:
    """Grid of a fragment-kernel launch: K split so that about PROGRAMS_PER_SM programs
    per SM are in the grid, each looping over its share of 64-column blocks ``chunk`` at
    a time. ``tiles``, ``chunk`` and ``split`` are launch overrides the tests use to reach
    split-K paths on small shapes; `qmatmul_mma` sets ``x_ahead`` by row count. Depends on
    N, K and the GPU only, never on the rows, so a row's result does not depend on the
    batch it is in. ``per_sm``: programs per SM (PROGRAMS_PER_SM by default)."""
    tiles = tiles or TILES_PER_WARP
    T = triton.cdiv(N, TILE_N)
    KB = K // BLOCK_K
    # A step is whole groups and divides K, so the loop needs no masks.
    per_group = max(1, group_size // BLOCK_K)
    chunk = max(chunk or CHUNK, per_group)
    while KB % chunk or chunk % per_group:
        chunk //= 2
    programs = triton.cdiv(T, NUM_WARPS * tiles)
    split, bpp = k_shares(KB, chunk, programs, per_sm or PROGRAMS_PER_SM, sm_count(device),
                          split)
    return {"grid": (programs, 1, split), "NW": NUM_WARPS, "TILES": tiles, "CHUNK": chunk,
            "SPLIT": split, "BPP": bpp, "num_warps": NUM_WARPS,
            "X_AHEAD": X_AHEAD if x_ahead is None else x_ahead}


def qmatmul_mma(x: torch.Tensor, f: FragmentWeight, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, pdl: bool | None = None,
                checked: bool = False, **shape) -> torch.Tensor:
    """x [..., K] bf16 (1..32 rows) → residual + x·dequant(f)ᵀ + bias [..., N] bf16, scales
    factored out of each group's sum. Deterministic; graph-capturable after one eager
    call (the semaphores). ``shape``: `mma_shape`'s overrides. ``checked``: the caller
    has had None from `unsupported_reason` for inputs of this layout."""
    x2, y, bias, res2 = start_product(x, f, bias, residual, "qmatmul_mma",
                                     None if checked else unsupported_reason)
    K, N, M = f.k, f.n, x2.shape[0]
    if N == 0:
        return y.reshape(*x.shape[:-1], N)
    nt = triton.cdiv(M, 8)
    if nt > 1:
        # More column tiles hold more x registers: load x just in time (its rows are hot
        # in L1) so the registers keep weights in flight. Only the loads move: a row's
        # arithmetic is the same whatever the batch.
        shape.setdefault("x_ahead", False)
    ls = dict(mma_shape(N, K, f.group_size, x.device, **shape))  # a copy: popped below
    ws = split_workspace(ls["SPLIT"], (M, N), y)
    gdc = pdl_enabled(x.device) if pdl is None else pdl
    _qmm_mma_kernel[ls.pop("grid")](
        x2.view(torch.int32), f.words, f.scales, f.biases, y,
        bias if bias is not None else y, res2, ws, semaphores(x.device),
        M, N, f.words.shape[0], f.words.shape[1], ls.pop("BPP"), y.stride(0), res2.stride(0),
        GROUP=f.group_size, NT=nt, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, GDC=gdc, **ls, **launch_options(gdc))
    return y.reshape(*x.shape[:-1], N)


def fragments_of(w: QuantizedTensor) -> FragmentWeight:
    """w in fragment order, repacked on the first call and kept with w. Not inside CUDA
    graph capture: the first call must be eager (a warm-up), as for the semaphores."""
    def make(w):
        if w.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("qmatmul_mma repacks a weight on its first use, which must run "
                               "outside CUDA graph capture; run one eager call first")
        return fragments.repack(w)

    return w.derived("mma_fragments", make)


def stacked_fragments_of(ws: list) -> FragmentWeight:
    """The weights stacked along N in fragment order: the stacked weight itself where the
    model holds them as its views (`fragments.stacked_parent`); else, from the MLX
    layout, built by `fragments.concat` on the first call and kept with the first weight
    for as long as the others hold the same contents (their storage, its version
    counters and their `write_` count: a Python id can be reused). Only the stacked form
    is kept, not each part's, and only its latest version."""
    parent = fragments.stacked_parent(ws)
    if parent is not None:
        return parent
    key = "mma_stacked:" + ";".join(
        ",".join(f"{t.data_ptr()}.{t._version}" for t in (w.packed, w.scales, w.biases))
        + f".{w.generation}" for w in ws[1:])

    def make(first):
        if first.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("qmatmul_mma repacks a weight on its first use, which must run "
                               "outside CUDA graph capture; run one eager call first")
        return fragments.concat([fragments.repack(w) for w in ws])

    return ws[0].derived(key, make, supersedes="mma_stacked:")


def stacked_bias(ws: list, biases: list) -> torch.Tensor | None:
    """The biases of the stacked weights as one vector (zeros for a part without one;
    None when no part has one), kept with the first weight for as long as the biases
    hold the same contents: one concatenation, not one per call."""
    if all(b is None for b in biases):
        return None
    key = "stacked_bias:" + ",".join(
        "-" if b is None else f"{b.data_ptr()}.{b._version}" for b in biases)
    like = next(b for b in biases if b is not None)
    return ws[0].derived(key, lambda first: torch.cat(
        [b.detach() if b is not None else like.new_zeros(w.shape[0])
         for w, b in zip(ws, biases)]), supersedes="stacked_bias:")


def stack_unsupported_reason(x: torch.Tensor, ws: list, reason_of=None) -> str | None:
    """None when `qmatmul_mma` (or the product whose check is ``reason_of(x, w)``) can
    take x times the weights stacked along N, else why not."""
    reason_of = reason_of or unsupported_reason
    parent = fragments.stacked_parent(ws)
    if parent is not None:
        return reason_of(x, parent)
    for i, w in enumerate(ws):
        if not isinstance(w, QuantizedTensor):
            return f"weight {i} is neither in the MLX layout nor a part of one held stack"
        reason = reason_of(x, w)
        if reason is not None:
            return reason
        if (w.shape[-1], w.group_size) != (ws[0].shape[-1], ws[0].group_size):
            return f"weight {i} differs in K or group from weight 0"
        if i < len(ws) - 1 and w.shape[0] % TILE_N:
            return f"weight {i} has {w.shape[0]} rows, not whole tiles of {TILE_N}"
    return None


def mlp_unsupported_reason(x: torch.Tensor, gate, up, down,
                           residual: torch.Tensor | None, reason_of=None) -> str | None:
    """None when `mlp` can take the three projections (MLX-layout or fragment-held) with
    the fragment kernel (or the product whose check is ``reason_of(x, w)``), else why
    not."""
    reason_of = reason_of or unsupported_reason
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        if not isinstance(w, (QuantizedTensor, FragmentWeight)):
            return f"{name} is not quantized"
    reason = reason_of(x, gate) or reason_of(x, up)
    if reason is None and down.shape != (x.shape[-1], gate.shape[0]):
        reason = f"down {down.shape} does not close the MLP"
    if reason is None:  # down's input: x's rows, gate's rows as features (a view, no copy)
        reason = reason_of(x[..., :1].expand(*x.shape[:-1], gate.shape[0]), down)
    if reason is None and residual is not None and (
            residual.shape != x.shape or residual.dtype != x.dtype):
        reason = f"residual {tuple(residual.shape)} {residual.dtype} (x: {tuple(x.shape)})"
    return reason


def held_fragments(w) -> FragmentWeight:
    """w in fragment order: as held, or repacked once from the MLX layout."""
    return w if isinstance(w, FragmentWeight) else fragments_of(w)
