"""The fused steps over weights held in mma fragment order (GPU only): the same three
product steps as `qkv_step`, `joint_step` and the gate/up GEMV with its activation, with
the fragment kernel's product (`products.qmatmul_mma.mma_product`: bf16 rows, 4-bit
g64/g128 weights, scales factored out of each group's sum, fast tier) in place of the
CUDA-core GEMV's. A model on a GPU holds its 4-bit weights so and only so, so these are
the steps it can run.

The epilogues are the portable steps' own (`heads`, `joint`, `products.fused_mlp.gated`):
a program of the fragment kernel covers 16·NW·TILES weight rows (64 by default), a head
is D / 64 programs (its unit), the joint's unit is every program, and the gate/up unit
is the pair of programs holding the same rows of gate and of up (the stacked weight's
halves). Contracts as the portable steps'; rows 1..MAX_ROWS bf16; the first call on a
device must be eager (counters, semaphores), later calls can be captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.pdl import enabled as pdl_enabled
from ..common.pdl import launch_options
from ..common.precise_math import use_libdevice
from ..common.units import arrive_unit, load_scratch, unit_counters
from ..pointwise.gated_act import ACT_IDS
from ..products.fragments import TILE_N, FragmentWeight
from ..products.fused_mlp import gated
from ..products.qmatmul_mma import NUM_WARPS, TILES_PER_WARP, mma_product, mma_shape
from ..products.splitk import semaphores, split_workspace
from .heads import head_epilogue
from .joint import arrive_joint, joint_epilogue, joint_owners
from .qkv_step import cache_parts

MAX_ROWS = 8
ROWS_PER_PROGRAM = TILE_N * NUM_WARPS * TILES_PER_WARP


@triton.jit
def _qkv_fragments_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, bias_ptr, ws_ptr, sem_ptr, cnt_ptr,
    M, N, T, KB, BPP,
    qn_ptr, kn_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, ks_ptr, kb_ptr, v_ptr, vs_ptr, vb_ptr,
    slot_ptr, table_ptr, stride_table, stride_cb, stride_ch, stride_cn, stride_sb, stride_sh,
    stride_sn, n_max, n_rows, stride_cos, eps, inv_d,
    GROUP: tl.constexpr, NW: tl.constexpr, TILES: tl.constexpr, CHUNK: tl.constexpr,
    X_AHEAD: tl.constexpr, NT: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    GDC: tl.constexpr, ROWS: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
    D: tl.constexpr, QK_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
    KV_BITS: tl.constexpr, KV_GROUP: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr,
    LIBDEVICE: tl.constexpr, HEAD_PROGRAMS: tl.constexpr,
):
    stored = mma_product(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, bias_ptr, y_ptr, ws_ptr, sem_ptr,
                         M, N, T, KB, BPP, N, N, GROUP, NW, TILES, CHUNK, X_AHEAD, NT, SPLIT,
                         HAS_BIAS, False, GDC)
    if stored:
        head = tl.program_id(0) // HEAD_PROGRAMS
        if arrive_unit(cnt_ptr, head, HEAD_PROGRAMS):
            for m in tl.static_range(ROWS):
                head_epilogue(y_ptr, N, m, head, qn_ptr, kn_ptr, cos_ptr, sin_ptr, stride_cos,
                              q_ptr, k_ptr, ks_ptr, kb_ptr, v_ptr, vs_ptr, vb_ptr, slot_ptr,
                              table_ptr, stride_table, stride_cb, stride_ch, stride_cn,
                              stride_sb, stride_sh, stride_sn, n_max, n_rows, eps, inv_d, HQ,
                              HKV, D, QK_NORM, UNIT_OFFSET, False, KV_BITS, KV_GROUP, PAGE,
                              PAGED, LIBDEVICE)


@triton.jit
def _joint_fragments_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, a_ptr, bias_ptr, ws_ptr, sem_ptr, cnt_ptr,
    M, N, T, KB, BPP, res_ptr, stride_res, post_w_ptr, next_w_ptr, h_ptr, n_ptr, eps, inv_d,
    GROUP: tl.constexpr, NW: tl.constexpr, TILES: tl.constexpr, CHUNK: tl.constexpr,
    X_AHEAD: tl.constexpr, NT: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    GDC: tl.constexpr, ROWS: tl.constexpr, PROGRAMS: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_POST: tl.constexpr, HAS_NEXT: tl.constexpr, UNIT_OFFSET: tl.constexpr,
    OWNERS: tl.constexpr,
):
    stored = mma_product(x_ptr, w_ptr, s_ptr, b_ptr, a_ptr, bias_ptr, a_ptr, ws_ptr, sem_ptr,
                         M, N, T, KB, BPP, N, N, GROUP, NW, TILES, CHUNK, X_AHEAD, NT, SPLIT,
                         HAS_BIAS, False, GDC)
    if stored:  # only a program that stored its tile counts it
        owner = arrive_joint(cnt_ptr, PROGRAMS, OWNERS)  # one unit: every column of the rows
        if owner >= 0:
            joint_epilogue(a_ptr, res_ptr, stride_res, post_w_ptr, next_w_ptr, h_ptr, n_ptr, N,
                           eps, inv_d, owner, ROWS, OWNERS, BLOCK_D, HAS_POST, HAS_NEXT,
                           UNIT_OFFSET, False)


@triton.jit
def _gate_up_fragments_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, sem_ptr, cnt_ptr, M, N, T, KB, BPP, h_ptr,
    GROUP: tl.constexpr, NW: tl.constexpr, TILES: tl.constexpr, CHUNK: tl.constexpr,
    X_AHEAD: tl.constexpr, NT: tl.constexpr, SPLIT: tl.constexpr, GDC: tl.constexpr,
    ROWS: tl.constexpr, HALF_PROGRAMS: tl.constexpr, R: tl.constexpr, ACT: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """y = x·[gate; up]ᵀ (scratch [M, 2I]); the pair of programs holding rows r of gate and
    of up meet on one counter, and the second writes act(gate)·up for those rows."""
    stored = mma_product(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, y_ptr, y_ptr, ws_ptr, sem_ptr,
                         M, N, T, KB, BPP, N, N, GROUP, NW, TILES, CHUNK, X_AHEAD, NT, SPLIT,
                         False, False, GDC)
    if stored:
        unit = tl.program_id(0) % HALF_PROGRAMS
        if arrive_unit(cnt_ptr, unit, 2):
            I = N // 2
            r = unit * R + tl.arange(0, R)
            for m in tl.static_range(ROWS):
                g = load_scratch(y_ptr + m * N + r, r < I, False)
                u = load_scratch(y_ptr + m * N + I + r, r < I, False)
                h = gated(g, u, ACT, LIBDEVICE, h_ptr, False)
                tl.store(h_ptr + m * I + r, h.to(tl.bfloat16), mask=r < I)


def unsupported_reason(x: torch.Tensor, f) -> str | None:
    """Why the fragment steps cannot take rows x over the held weight f (None: they can)."""
    if not isinstance(f, FragmentWeight):
        return "the weight is not held in fragment order"
    if x.device.type != "cuda":
        return "needs a CUDA GPU (mma.sync)"
    if x.dtype != torch.bfloat16:
        return f"x dtype {x.dtype} (fragment steps: bf16)"
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows (fragment steps: 1..{MAX_ROWS})"
    if x.shape[-1] != f.k:
        return f"x has {x.shape[-1]} features, the weight {f.k}"
    return None


def _launch(f: FragmentWeight, x2: torch.Tensor) -> tuple[tuple, dict]:
    """(grid, the fragment kernel's launch constants) of a product over f for rows x2."""
    M = x2.shape[0]
    ls = dict(mma_shape(f.n, f.k, f.group_size, x2.device))
    nt = triton.cdiv(M, 8)
    if nt > 1:
        ls["X_AHEAD"] = False  # as `qmatmul_mma` launches more than 8 rows
    grid = ls.pop("grid")
    return grid, {**ls, "NT": nt, "GROUP": f.group_size}


def _rows(x: torch.Tensor, K: int) -> torch.Tensor:
    return x.reshape(-1, K).contiguous()


def qkv_step_fragments(x, f: FragmentWeight, bias, n_heads: int, n_kv_heads: int,
                       head_dim: int, q_norm, k_norm, eps: float, unit_offset: bool, cos, sin,
                       k_cache, v_cache, slots, table=None) -> torch.Tensor:
    """`qkv_step.qkv_step` over the stacked Q/K/V weight f held in fragment order."""
    D = head_dim
    if D % ROWS_PER_PROGRAM:
        raise ValueError(f"head dim {D} is not a multiple of {ROWS_PER_PROGRAM} rows")
    x2 = _rows(x, f.k)
    M, N = x2.shape[0], f.n
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    q = torch.empty(M, n_heads, D, dtype=x.dtype, device=x.device)
    grid, ls = _launch(f, x2)
    ws = split_workspace(ls["SPLIT"], (M, N), y)
    kc, ks, kb, kv_bits, kv_group = cache_parts(k_cache)
    vc, vs, vb, _, _ = cache_parts(v_cache)
    paged = table is not None
    n_max = kc.shape[2] * table.shape[1] if paged else kc.shape[2]
    cos2, sin2 = cos.reshape(M, D), sin.reshape(M, D)
    gdc = pdl_enabled(x.device)
    _qkv_fragments_kernel[grid](
        x2.view(torch.int32), f.words, f.scales, f.biases, y, bias if bias is not None else y,
        ws, semaphores(x.device), unit_counters(x.device), M, N, f.words.shape[0],
        f.words.shape[1], ls.pop("BPP"),
        q_norm if q_norm is not None else y, k_norm if k_norm is not None else y, cos2, sin2,
        q, kc, ks, kb, vc, vs, vb, slots, table if paged else slots,
        table.stride(0) if paged else 0, kc.stride(0), kc.stride(1), kc.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2), n_max, kc.shape[0], cos2.stride(0), eps,
        1.0 / D, HAS_BIAS=bias is not None, GDC=gdc, ROWS=M, HQ=n_heads, HKV=n_kv_heads,
        D=D, QK_NORM=q_norm is not None, UNIT_OFFSET=unit_offset, KV_BITS=kv_bits,
        KV_GROUP=kv_group, PAGE=kc.shape[2] if paged else 1, PAGED=paged,
        LIBDEVICE=use_libdevice(), HEAD_PROGRAMS=D // ROWS_PER_PROGRAM, **ls,
        **launch_options(gdc))
    return q


def joint_step_fragments(x, f: FragmentWeight, bias, residual, post_weight, next_weight,
                         eps: float, unit_offset: bool, owners: int | None = None):
    """`joint_step.joint_step` over the weight f held in fragment order."""
    x2 = _rows(x, f.k)
    M, N = x2.shape[0], f.n
    res2 = residual.reshape(M, N)
    res2 = res2 if res2.stride(-1) == 1 else res2.contiguous()
    a = torch.empty(M, N, dtype=x.dtype, device=x.device)
    h = torch.empty_like(a)
    n = torch.empty_like(a) if next_weight is not None else None
    grid, ls = _launch(f, x2)
    ws = split_workspace(ls["SPLIT"], (M, N), a)
    gdc = pdl_enabled(x.device)
    _joint_fragments_kernel[grid](
        x2.view(torch.int32), f.words, f.scales, f.biases, a, bias if bias is not None else a,
        ws, semaphores(x.device), unit_counters(x.device), M, N, f.words.shape[0],
        f.words.shape[1], ls.pop("BPP"), res2, res2.stride(0),
        post_weight if post_weight is not None else a,
        next_weight if next_weight is not None else a, h, n if n is not None else h, eps,
        1.0 / N, HAS_BIAS=bias is not None, GDC=gdc, ROWS=M, PROGRAMS=grid[0],
        BLOCK_D=triton.next_power_of_2(N), HAS_POST=post_weight is not None,
        HAS_NEXT=next_weight is not None, UNIT_OFFSET=unit_offset,
        OWNERS=owners or joint_owners(M, grid[0], x.device), **ls, **launch_options(gdc))
    return h.reshape(residual.shape), (n.reshape(residual.shape) if n is not None else None)


def gate_up_step_fragments(x, f: FragmentWeight, act: str) -> torch.Tensor:
    """act(x·gateᵀ)·(x·upᵀ) [M, I] over the stacked [gate; up] weight f in fragment order."""
    I = f.n // 2
    if I % ROWS_PER_PROGRAM:
        raise ValueError(f"{I} gate rows are not whole programs of {ROWS_PER_PROGRAM}")
    x2 = _rows(x, f.k)
    M = x2.shape[0]
    y = torch.empty(M, f.n, dtype=x.dtype, device=x.device)
    hidden = torch.empty(M, I, dtype=x.dtype, device=x.device)
    grid, ls = _launch(f, x2)
    ws = split_workspace(ls["SPLIT"], (M, f.n), y)
    gdc = pdl_enabled(x.device)
    _gate_up_fragments_kernel[grid](
        x2.view(torch.int32), f.words, f.scales, f.biases, y, ws, semaphores(x.device),
        unit_counters(x.device), M, f.n, f.words.shape[0], f.words.shape[1], ls.pop("BPP"),
        hidden, GDC=gdc, ROWS=M, HALF_PROGRAMS=grid[0] // 2, R=ROWS_PER_PROGRAM,
        ACT=ACT_IDS[act], LIBDEVICE=use_libdevice(), **ls, **launch_options(gdc))
    return hidden
