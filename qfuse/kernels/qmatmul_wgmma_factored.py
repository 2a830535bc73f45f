"""The wgmma product with the fragment kernel's arithmetic (issue 30, item 5): Hopper,
Gluon, opt-in, not dispatched: bit for bit `qmatmul_mma` on the H200, but 0.35-0.68x the
plain wgmma kernel (stop 41; bench/NOTES.md, "Batched rows" → Open).

Why: a row's bits may not depend on its batch, yet 1-32 rows take the fragment kernel
(`qmatmul_mma`: mma.sync over the raw codes, each group's scale and bias factored out of
its sum) and 33-256 rows the wgmma kernel (`qmatmul_wgmma`: each weight dequantized to
bf16 first), which round differently. This kernel computes every output as the fragment
kernel does, on warpgroup tensor cores:
    per 64-column block:  D[n, m] = Σ_{k∈block} (128 + c[n, k])·x[m, k]
                          (four k16 wgmma chained from zero, the k slots in the fragment's
                          order, as the fragment kernel chains its four mma.sync),
                          b' = fma(s, -128, b),  acc = fma(b', e[m], fma(s, D, acc))
with e[m] each block's Σx from `block_sums` (the fragment kernel's own all-ones mma.sync
chain), s and b the block's group scale and bias of row n, the fold on the CUDA cores in
the fragment kernel's order (`qmatmul_mma._scale_lines`), the fragment kernel's split of
K (`qmatmul_mma.mma_shape`: the same shares of blocks, each from zero, the planes summed
in split order) and its epilogue's rounding of the bias and the residual. So the output
equals `qmatmul_mma`'s bit for bit if, and only if, wgmma adds a k16 chunk's products as
mma.sync does, which no document says and `bench/mma_agreement.py` measured: it does
(stop 41, every case).

Cost against `qmatmul_wgmma`: each block's products are waited for before their fold
(a drain per block, not per step), D beside the accumulator (row blocks of 64 only), and
the A operand is the codes alone (the two packed FMAs of the dequantization are gone).
The ring, the copies and the epilogue are `qmatmul_wgmma`'s. `OVERLAP` issues each
block's products before the previous block's fold (built offline, not yet run).
"""

from __future__ import annotations

import functools

import torch
import triton

from .fragments import BLOCK_K, FragmentWeight
from .gluon_hopper import (  # optional: gluon is None without it
    TensorDescriptor,
    gl,
    gluon,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from .qmatmul_mma import pair_lines
from .qmatmul_wgmma import descriptors, launch_shape, permuted_rows, unsupported_reason
from .splitk import semaphores, split_workspace, start_product

BLOCK_M = 64  # rows of x per program: D and the accumulator side by side fit at 64

# Whether `ops` sends batched rows (33-256) here instead of to `qmatmul_wgmma`: only once
# its GPU test has shown it gives `qmatmul_mma`'s bits (then 1-256 rows are one
# row-invariant class, `ops.summing_class`) at a cost `qfuse bench mlp` has measured.
DISPATCHED = False
# Whether a stage's blocks overlap: block c + 1's products issued before block c's fold
# waits, so two accumulators D are in flight and the fold and the next codes run under
# the products (stop 41: without it the kernel ran at 0.35-0.68x the plain wgmma kernel,
# the tensor cores idle through each block's fold). Built offline, not yet run: off.
OVERLAP = False

# One word → its four pairs of 128 + code (pair r: nibbles r and r + 4), the very lines the
# fragment kernel makes its A registers with (`qmatmul_mma.pair_lines`): the
# dequantization's LOP3 without its FMAs.
CODES_ASM = "\n".join(["{ .reg .b32 t;", *pair_lines("$4", ["$0", "$1", "$2", "$3"]), "}"])


if gluon is not None:
    from .qmatmul_wgmma import (
        a_layout_of,
        acc_layout_of,
        allocate_ring,
        block_words,
        fill,
        finish_program,
        pairs_operand,
        program_share,
        stage_views,
    )

    _CODES: gl.constexpr = gl.constexpr(CODES_ASM)
    _BM: gl.constexpr = gl.constexpr(BLOCK_M)

    @gluon.jit
    def _codes_operand(w_stage, c: gl.constexpr, a_layout: gl.constexpr, W: gl.constexpr):
        """Block c of a ring stage as the A operand of 128 + code, [16·W, 64] bf16."""
        p0, p1, p2, p3 = gl.inline_asm_elementwise(
            _CODES, "=r,=r,=r,=r,r", [block_words(w_stage, c, W)],
            dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
        return pairs_operand(p0, p1, p2, p3, a_layout, 16 * W)

    @gluon.jit
    def _row_values(ptr, tile0, n_tiles, group, n_groups, ROW: gl.constexpr,
                    ROWS: gl.constexpr):
        """The scale (or bias) of each weight row of the program in one group, float32
        [ROWS] in ROW, from the weight's bf16 pairs [T, groups, 8] (row g low, row g + 8
        high; L1/L2-resident), widened as the fragment kernel widens them: a shift or a
        mask. Tiles past the weight's last read its last (as the fragment kernel's do;
        their rows are never stored)."""
        r = gl.arange(0, ROWS, layout=ROW)  # 16·tile + 8·h + g
        tile = gl.minimum(tile0 + r // 16, n_tiles - 1).to(gl.int64)
        pair = gl.load(ptr + (tile * n_groups + group) * 8 + r % 8)
        bits = gl.where((r // 8) % 2 == 0, pair << 16, pair & -65536)
        return bits.to(gl.float32, bitcast=True)

    @gluon.jit
    def _block_terms(s_ptr, b_ptr, n_tiles, n_groups, tile0, e_ptr, e_stride, e_rows, m,
                     block, GROUP: gl.constexpr, ROW: gl.constexpr, ROWS: gl.constexpr):
        """What the fold of one 64-column block takes besides its products: each weight
        row's scale s and b' = fma(s, -128, b), and each x row's Σx e."""
        group = block * 64 // GROUP
        s = _row_values(s_ptr, tile0, n_tiles, group, n_groups, ROW, ROWS)
        bp = gl.fma(s, -128.0, _row_values(b_ptr, tile0, n_tiles, group, n_groups, ROW, ROWS))
        e = gl.load(e_ptr + block * e_stride + m, mask=m < e_rows, other=0.0)
        return s, bp, e

    @gluon.jit
    def _fold(acc, d, s, bp, e):
        """acc + s·D + b'·e, element for element as the fragment kernel folds a block."""
        s2, d = gl.broadcast(gl.expand_dims(s, 1), d)
        u = gl.fma(s2, d, acc)
        bp2, e2 = gl.broadcast(gl.expand_dims(bp, 1), gl.expand_dims(e, 0))
        return gl.fma(bp2, e2, u)

    @gluon.jit
    def _factored_step(acc, zero, x_blocks, w_stage, slot, s_ptr, b_ptr, n_tiles, n_groups,
                       tile0, e_ptr, e_stride, e_rows, kb, m0, GROUP: gl.constexpr,
                       CB: gl.constexpr, a_layout: gl.constexpr, acc_layout: gl.constexpr,
                       W: gl.constexpr, OVERLAP: gl.constexpr):
        """One ring stage's CB blocks folded into acc, each as the fragment kernel folds a
        block: its codes' products waited for, then the scales and Σx on the CUDA cores.
        OVERLAP: block c + 1's products are issued before block c's wait, so its fold
        and the next codes run under them (two D in flight; the same sums, in the same
        order)."""
        ROW: gl.constexpr = gl.SliceLayout(1, acc_layout)
        COL: gl.constexpr = gl.SliceLayout(0, acc_layout)
        m = m0 + gl.arange(0, _BM, layout=COL)
        if OVERLAP:
            a = _codes_operand(w_stage, 0, a_layout, W)
            d = warpgroup_mma(a, x_blocks.index(slot * CB).permute((1, 0)), zero,
                              use_acc=False, is_async=True)
            for c in gl.static_range(CB):
                if c + 1 < CB:
                    a_next = _codes_operand(w_stage, c + 1, a_layout, W)
                    d_next = warpgroup_mma(a_next,
                                           x_blocks.index(slot * CB + c + 1).permute((1, 0)),
                                           zero, use_acc=False, is_async=True)
                    s, bp, e = _block_terms(s_ptr, b_ptr, n_tiles, n_groups, tile0, e_ptr,
                                            e_stride, e_rows, m, kb + c, GROUP, ROW, 16 * W)
                    d, a = warpgroup_mma_wait(num_outstanding=1, deps=(d, a))
                    acc = _fold(acc, d, s, bp, e)
                    d = d_next
                    a = a_next
                else:
                    s, bp, e = _block_terms(s_ptr, b_ptr, n_tiles, n_groups, tile0, e_ptr,
                                            e_stride, e_rows, m, kb + c, GROUP, ROW, 16 * W)
                    d, a = warpgroup_mma_wait(num_outstanding=0, deps=(d, a))
                    acc = _fold(acc, d, s, bp, e)
        else:
            for c in gl.static_range(CB):
                a = _codes_operand(w_stage, c, a_layout, W)
                d = warpgroup_mma(a, x_blocks.index(slot * CB + c).permute((1, 0)), zero,
                                  use_acc=False, is_async=True)
                # under the products: the block's row scales and biases, and its Σx
                s, bp, e = _block_terms(s_ptr, b_ptr, n_tiles, n_groups, tile0, e_ptr,
                                        e_stride, e_rows, m, kb + c, GROUP, ROW, 16 * W)
                d, a = warpgroup_mma_wait(num_outstanding=0, deps=(d, a))
                acc = _fold(acc, d, s, bp, e)
        return acc

    @gluon.jit
    def _qmm_factored_kernel(x_desc, w_desc, s_desc, b_desc, y_ptr, bias_ptr, res_ptr, ws_ptr,
                             sem_ptr, e_ptr, s_ptr, b_ptr, M, N, KB, BPP, stride_ym, stride_rm,
                             e_stride, e_rows, n_tiles, n_groups, GROUP: gl.constexpr,
                             WG: gl.constexpr,
                             CB: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                             HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr,
                             OVERLAP: gl.constexpr):
        """`qmatmul_wgmma._qmm_wgmma_kernel`'s ring and epilogue around `_factored_step`."""
        W: gl.constexpr = 4 * WG
        ROWS: gl.constexpr = 16 * W
        GPS: gl.constexpr = CB * 64 // GROUP
        acc_layout: gl.constexpr = acc_layout_of(W, _BM)
        a_layout: gl.constexpr = a_layout_of(W, _BM)
        tile0, m0, kb_lo, n_steps = program_share(W, _BM, BPP, KB, CB)

        x_s, w_s, s_s, b_s = allocate_ring(x_desc, w_desc, s_desc, b_desc, STAGES)
        # the ring's scales and biases go unread: the fold takes each row's from L1/L2
        x_blocks, w_flat, _, _ = stage_views(x_s, w_s, s_s, b_s, STAGES, CB, _BM, W, GPS)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        for i in gl.static_range(STAGES):
            if i < n_steps:
                fill(x_desc, w_desc, s_desc, b_desc, x_s, w_s, s_s, b_s, ready, i,
                     kb_lo + i * CB, m0, tile0, GROUP)

        zero = gl.zeros([ROWS, _BM], gl.float32, acc_layout)
        acc = gl.zeros([ROWS, _BM], gl.float32, acc_layout)
        for i in range(n_steps):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            acc = _factored_step(acc, zero, x_blocks, w_flat.index(slot), slot, s_ptr, b_ptr,
                                 n_tiles, n_groups, tile0, e_ptr, e_stride, e_rows, kb_lo + i * CB, m0,
                                 GROUP, CB, a_layout, acc_layout, W, OVERLAP)
            gl.thread_barrier()  # every warp is done with the stage: refill it
            nxt = i + STAGES
            if nxt < n_steps:
                fill(x_desc, w_desc, s_desc, b_desc, x_s, w_s, s_s, b_s, ready,
                     slot, kb_lo + nxt * CB, m0, tile0, GROUP)
        finish_program(acc, ready, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, tile0, m0, M, N,
                       stride_ym, stride_rm, STAGES, W, _BM, SPLIT, HAS_BIAS, HAS_RES)


def factored_shape(N: int, K: int, group_size: int, device: torch.device,
                   wg: int = 1, stages: int | None = None) -> dict:
    """`launch_shape` at row blocks of 64 with the fragment kernel's step and split of K
    (`qmatmul_mma.mma_shape`); ValueError where the two cannot agree (then the bits could
    not either)."""
    from .qmatmul_mma import mma_shape

    ms = mma_shape(N, K, group_size, device)
    ls = launch_shape(N, K, group_size, BLOCK_M, device, wg=wg, cb=ms["CHUNK"],
                      split=ms["SPLIT"], stages=stages, ws=False)
    if (ls["SPLIT"], ls["BPP"]) != (ms["SPLIT"], ms["BPP"]):
        raise ValueError(f"the ring cannot take the fragment kernel's split of K: "
                         f"{ls['SPLIT']} shares of {ls['BPP']} blocks against "
                         f"{ms['SPLIT']} of {ms['BPP']}")
    return ls


@functools.lru_cache(maxsize=256)
def takes_shape(N: int, K: int, group_size: int, device: torch.device) -> bool:
    """Whether the ring can take the fragment kernel's split for this weight shape (else
    `factored_shape` refuses it, and the plain wgmma kernel keeps it)."""
    try:
        factored_shape(N, K, group_size, device)
    except ValueError:
        return False
    return True


def qmatmul_wgmma_factored(x: torch.Tensor, f: FragmentWeight,
                           bias: torch.Tensor | None = None,
                           residual: torch.Tensor | None = None, wg: int = 1,
                           stages: int | None = None, overlap: bool | None = None
                           ) -> torch.Tensor:
    """x [..., K] bf16 (1..256 rows) → residual + x·dequant(f)ᵀ + bias [..., N] bf16
    with `qmatmul_mma`'s arithmetic on wgmma (module docstring). ``overlap``: each
    block's products issued before the previous block's fold (None: `OVERLAP`)."""
    from .block_sums import block_sums

    x2, y, bias, res2 = start_product(x, f, bias, residual, "qmatmul_wgmma_factored",
                                      unsupported_reason)
    K, N, M = f.k, f.n, x2.shape[0]
    if N == 0:
        return y.reshape(*x.shape[:-1], N)
    ls = factored_shape(N, K, f.group_size, x.device, wg, stages)
    e = block_sums(x2)  # [KB, 8·⌈M/8⌉]
    xp = permuted_rows(x2)
    cb = ls["CB"]
    layout = gl.NVMMASharedLayout.get_default_for([cb, BLOCK_M, 64], gl.bfloat16)
    x_desc = TensorDescriptor(xp, [K // BLOCK_K, M, 64], [64, K, 1], [cb, BLOCK_M, 64], layout)
    wd, sd, bd = descriptors(f, ls["WG"], cb)
    ws = split_workspace(ls["SPLIT"], (M, N), y)
    grid = (ls["programs"], triton.cdiv(M, BLOCK_M), ls["SPLIT"])
    _qmm_factored_kernel[grid](
        x_desc, wd, sd, bd, y, bias if bias is not None else y, res2, ws,
        semaphores(x.device), e, f.scales, f.biases, M, N, K // BLOCK_K, ls["BPP"],
        y.stride(0), res2.stride(0), e.stride(0), e.shape[1], f.scales.shape[0],
        f.scales.shape[1],
        GROUP=f.group_size, WG=ls["WG"], CB=cb,
        STAGES=ls["STAGES"], SPLIT=ls["SPLIT"], HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, OVERLAP=OVERLAP if overlap is None else overlap,
        num_warps=4 * ls["WG"])
    return y.reshape(*x.shape[:-1], N)

