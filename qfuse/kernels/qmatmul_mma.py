"""y = x·dequant(W)ᵀ for 1–8 bf16 rows over 4-bit weights in mma fragment order (GPU only).

The weight is `fragments.FragmentWeight` (repacked once at load). Each warp
runs `mma.sync.m16n8k16` (bf16 in, float32 out) with the codes themselves
as the A operand (128 + c, exact in bf16) and the rows of x as the eight
columns of B; the scales come out of each group's sum, as MLX's own Metal
qmv computes:

    y[m, n] = Σ_g s[n,g]·D[n,m,g] + (b[n,g] − 128·s[n,g])·Σ_{k∈g} x[m,k]
    D[n,m,g] = Σ_{k∈g} (128 + c[n,k])·x[m,k]

Σx comes from the same mma with an all-ones A, so a thread needs nothing
from its neighbours. Per thread and 32 codes: one 16-byte load, seven
instructions to make the four A registers of each of 4 mmas (one LOP3 per
pair, three shifts), 8 mmas, and the scale arithmetic; the whole
per-element step is one inline-PTX block over registers, so the compiler
cannot move the pairs through shared memory.

The Triton tensors of a program are 1-D with one element per thread, the only
layout Triton can give them, so element i is lane i % 32 of warp i // 32, which
is what the mma needs (2-D [tiles, 32] tensors were laid out differently by
Triton 3.6 on the GPU than by 3.9 on the CPU). The grid is (row-tile blocks) ×
(splits of K); splits meet through `qmatmul_tc`'s semaphores (the last program
of a block sums them in split order), so the result is deterministic. Every
program issues all its weight loads before `gdc_wait` (programmatic dependent
launch) and reads x after.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..levers import interpreter_active
from ..quant import QuantizedTensor
from . import fragments
from .codes import split_codes
from .fragments import BLOCK_K, TILE_N, FragmentWeight
from .gated_act import gated_act_forward
from .qmatmul_tc import (
    _arrive_last,
    _product_outputs,
    _semaphores,
    _split_workspace,
    _sum_splits,
)

MAX_ROWS = 8  # the mma's N
# Launch defaults (bench/NOTES.md, "Weight products in mma fragment order"): four
# 64-column blocks per program, one row tile per warp, four warps.
TILES_PER_WARP = 1
ITERS = 4
NUM_WARPS = 4


def _group_step_asm() -> str:
    # $0-$3 out (c0..c3), $4-$7 words, $8-$15 x pairs, $16 scales, $17 biases, $18-$21 acc in.
    asm = ["{", ".reg .b32 a0, a1, a2, a3, t, one;",
           ".reg .f32 d0, d1, d2, d3, e0, e1, e2, e3, sl, sh, bl, bh, u;",
           "mov.b32 one, 0x3F803F80;"]
    for r in ("d0", "d1", "d2", "d3", "e0", "e1", "e2", "e3"):
        asm.append(f"mov.f32 {r}, 0f00000000;")
    for j in range(4):
        w = f"${4 + j}"
        asm.append(f"lop3.b32 a0, {w}, 0x000F000F, 0x43004300, 0xEA;")
        for r in range(1, 4):
            asm.append(f"shr.u32 t, {w}, {4 * r};")
            asm.append(f"lop3.b32 a{r}, t, 0x000F000F, 0x43004300, 0xEA;")
        b = f"{{${8 + 2 * j}, ${9 + 2 * j}}}"
        asm.append("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                   f"{{d0, d1, d2, d3}}, {{a0, a1, a2, a3}}, {b}, {{d0, d1, d2, d3}};")
        asm.append("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                   f"{{e0, e1, e2, e3}}, {{one, one, one, one}}, {b}, {{e0, e1, e2, e3}};")
    asm += ["shl.b32 t, $16, 16;", "mov.b32 sl, t;",
            "and.b32 t, $16, 0xFFFF0000;", "mov.b32 sh, t;",
            "shl.b32 t, $17, 16;", "mov.b32 bl, t;",
            "and.b32 t, $17, 0xFFFF0000;", "mov.b32 bh, t;",
            "fma.rn.f32 bl, sl, 0fC3000000, bl;",  # b − 128·s
            "fma.rn.f32 bh, sh, 0fC3000000, bh;"]
    for out, s, b, d, e in ((0, "sl", "bl", "d0", "e0"), (1, "sl", "bl", "d1", "e1"),
                            (2, "sh", "bh", "d2", "e2"), (3, "sh", "bh", "d3", "e3")):
        asm.append(f"fma.rn.f32 u, {s}, {d}, ${18 + out};")
        asm.append(f"fma.rn.f32 ${out}, {b}, {e}, u;")
    asm.append("}")
    return "\n".join(asm)


_GROUP_STEP_ASM = tl.constexpr(_group_step_asm())


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
def _qmm_mma_kernel(
    x_ptr,  # int32 view of bf16 x [M, K]: element m·(K/2) + i holds x[m, 2i], x[m, 2i+1]
    w_ptr,  # int32 [T, KB, 32, 4] fragment words
    s_ptr, b_ptr,  # int32 [T, KB·64/GROUP, 8] packed bf16 pairs
    y_ptr,  # bf16 [M, N]
    bias_ptr,  # bf16 [N] or a dummy
    res_ptr,  # bf16 [M, N] or a dummy
    ws_ptr,  # float32 [SPLIT, 4·TILES, M, N] partial sums (SPLIT > 1)
    sem_ptr,  # int32 semaphores, one per program column, zero between calls
    M, N, T, KB, stride_ym, stride_rm,
    GROUP: tl.constexpr,
    NW: tl.constexpr,  # num_warps: one row tile per warp and per TILES step
    TILES: tl.constexpr,  # row tiles per warp
    ITERS: tl.constexpr,  # 64-column blocks per program
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GDC: tl.constexpr,
):
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    # 1-D tensors of exactly one element per thread: the only layout Triton can give them
    # puts element i on lane i % 32 of warp i // 32, which is what the mma needs.
    idx = tl.arange(0, 32 * NW)
    lane = idx % 32
    g = lane // 4
    q = lane % 4
    kb0 = tl.program_id(2) * ITERS
    n_groups = KB * 64 // GROUP
    tiles = ()
    for tt in tl.static_range(TILES):
        tiles = tiles + ((tl.program_id(0) * TILES + tt) * NW + idx // 32,)
    # Weights first: none of it depends on the previous kernel.
    words = ()  # [tile][block]: 4 words
    scales = ()
    biases = ()
    for tt in tl.static_range(TILES):
        t = tl.minimum(tiles[tt], T - 1).to(tl.int64)
        tw = ()
        ts = ()
        tb = ()
        for it in tl.static_range(ITERS):
            kb = kb0 + it
            ok = kb < KB
            kb_c = tl.minimum(kb, KB - 1)
            base = w_ptr + ((t * KB + kb_c) * 32 + lane) * 4
            # one 16-byte load per thread, split into the four words in registers
            tw = tw + (split_codes(tl.load(base[:, None] + tl.arange(0, 4)[None, :], mask=ok,
                                           other=0, eviction_policy="evict_first"), 4),)
            sb_off = (t * n_groups + kb_c * 64 // GROUP) * 8 + g
            ts = ts + (tl.load(s_ptr + sb_off, mask=ok, other=0),)
            tb = tb + (tl.load(b_ptr + sb_off, mask=ok, other=0),)
        words = words + (tw,)
        scales = scales + (ts,)
        biases = biases + (tb,)
    if GDC:
        tl.extra.cuda.gdc_wait()
    x_row = x_ptr + g.to(tl.int64) * (KB * 32) + q * 8  # B column g is row g of x
    x_ok = g < M
    xs = ()
    for it in tl.static_range(ITERS):
        kb = tl.minimum(kb0 + it, KB - 1)
        x8 = ()  # (one 32-byte load would be re-laid out through shared memory)
        for i in tl.static_range(8):
            x8 = x8 + (tl.load(x_row + kb * 32 + i, mask=x_ok, other=0),)
        xs = xs + (x8,)
    last = True
    accs = ()
    for tt in tl.static_range(TILES):
        zero = tl.zeros((32 * NW,), tl.float32)
        acc = (zero, zero, zero, zero)
        for it in tl.static_range(ITERS):
            acc = _group_step(words[tt][it], xs[it], scales[tt][it], biases[tt][it], acc)
        accs = accs + (acc,)
        # acc[i]: row 16t + g + 8·(i // 2), column (row of x) 2q + i % 2
        if SPLIT > 1:
            for i in tl.static_range(4):
                n = tiles[tt] * 16 + g + 8 * (i // 2)
                m = 2 * q + (i % 2)
                last = _arrive_last(ws_ptr, sem_ptr, acc[i], tt * 4 + i, m * N + n,
                                    (n < N) & (m < M), M, N, SPLIT, 4 * TILES)
    if last:
        for tt in tl.static_range(TILES):
            for i in tl.static_range(4):
                n = tiles[tt] * 16 + g + 8 * (i // 2)
                m = 2 * q + (i % 2)
                out_ok = (n < N) & (m < M)
                a = accs[tt][i]
                if SPLIT > 1:
                    a = _sum_splits(ws_ptr, sem_ptr, tt * 4 + i, m * N + n, out_ok, M, N, SPLIT,
                                    4 * TILES)
                if HAS_BIAS:
                    a += tl.load(bias_ptr + n, mask=out_ok, other=0.0).to(tl.float32)
                if HAS_RES:
                    # Rounded as compat rounds: the projection to bf16 first, then the sum.
                    a = a.to(tl.bfloat16).to(tl.float32) + tl.load(
                        res_ptr + m.to(tl.int64) * stride_rm + n, mask=out_ok,
                        other=0.0).to(tl.float32)
                tl.store(y_ptr + m.to(tl.int64) * stride_ym + n, a.to(tl.bfloat16), mask=out_ok)


@functools.cache
def _sm_major(device: torch.device) -> int:
    """The GPU's compute capability major (asked once per device: it is on the decode path)."""
    return torch.cuda.get_device_capability(device)[0]


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
    if _sm_major(x.device) < 8:
        return "needs sm_80 or newer (bf16 mma.sync)"
    if x.dtype != torch.bfloat16:
        return f"x dtype {x.dtype} (fragment kernel: bf16)"
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows (fragment kernel: 1..{MAX_ROWS})"
    return None


def mma_shape(N: int, K: int, device: torch.device, tiles: int | None = None,
              iters: int | None = None, num_warps: int | None = None) -> dict:
    """Grid of a fragment-kernel launch: K split into shares of ``iters`` 64-column blocks
    (overrides for A/B sweeps)."""
    num_warps = num_warps or NUM_WARPS
    tiles = tiles or TILES_PER_WARP
    T = triton.cdiv(N, TILE_N)
    KB = K // BLOCK_K
    iters = min(iters or ITERS, KB)
    return {"grid": (triton.cdiv(T, num_warps * tiles), 1, triton.cdiv(KB, iters)),
            "NW": num_warps, "TILES": tiles, "ITERS": iters, "SPLIT": triton.cdiv(KB, iters),
            "num_warps": num_warps}


def qmatmul_mma(x: torch.Tensor, f: FragmentWeight, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, pdl: bool | None = None,
                **shape) -> torch.Tensor:
    """x [..., K] bf16 (1..8 rows) → residual + x·dequant(f)ᵀ + bias [..., N] bf16, scales
    factored out of each group's sum. Deterministic; graph-capturable after one eager
    call (the semaphores). ``shape``: `mma_shape`'s overrides."""
    K, N = x.shape[-1], f.n
    if K != f.k:
        raise ValueError(f"x has {K} features but the weight expects {f.k}")
    reason = unsupported_reason(x, f)
    if reason is not None:
        raise ValueError(f"qmatmul_mma cannot take these inputs: {reason}")
    x2 = x.reshape(-1, K).contiguous()  # read as int32 pairs with row stride K/2
    M = x2.shape[0]
    y, bias, res2 = _product_outputs(x2, N, bias, residual)
    if N == 0:
        return y.reshape(*x.shape[:-1], N)
    ls = mma_shape(N, K, x.device, **shape)
    # One plane per accumulator (they cover disjoint outputs, so one plane would do; that
    # changes the kernel's reduction and waits for a GPU run to be verified).
    ws = _split_workspace(ls["SPLIT"], (4 * ls["TILES"], M, N), y)
    gdc = _sm_major(x.device) >= 9 if pdl is None else pdl
    extra = {"launch_pdl": True} if gdc else {}
    _qmm_mma_kernel[ls.pop("grid")](
        x2.view(torch.int32), f.words, f.scales, f.biases, y,
        bias if bias is not None else y, res2, ws, _semaphores(x.device),
        M, N, f.words.shape[0], f.words.shape[1], y.stride(0), res2.stride(0),
        GROUP=f.group_size, HAS_BIAS=bias is not None, HAS_RES=residual is not None, GDC=gdc,
        **ls, **extra)
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


def mlp_unsupported_reason(x: torch.Tensor, gate, up, down,
                           residual: torch.Tensor | None) -> str | None:
    """None when `mlp` can take the three projections, else why not."""
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        if not isinstance(w, QuantizedTensor):
            return f"{name} is not quantized"
    reason = unsupported_reason(x, gate) or unsupported_reason(x, up)
    if reason is None:
        reason = fragments.unsupported_reason(down)
    if reason is None and down.shape != (x.shape[-1], gate.shape[0]):
        reason = f"down {down.shape} does not close the MLP"
    if reason is None and residual is not None and (
            residual.shape != x.shape or residual.dtype != x.dtype):
        reason = f"residual {tuple(residual.shape)} {residual.dtype} (x: {tuple(x.shape)})"
    return reason


def mlp(x: torch.Tensor, gate: QuantizedTensor, up: QuantizedTensor, down: QuantizedTensor,
        act: str, residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + down(act(x·gateᵀ)·(x·upᵀ)) for 1-8 bf16 rows: the three products on the
    fragment kernel, the gated activation (rounded as compat rounds) between them, the
    residual added in the down product's epilogue."""
    a = qmatmul_mma(x, fragments_of(gate))
    b = qmatmul_mma(x, fragments_of(up))
    return qmatmul_mma(gated_act_forward(a, b, act), fragments_of(down), residual=residual)
