"""Σx of each 64-column block of x's rows, made once per product instead of once per
weight tile: the term the fragment kernels multiply by the bias (GPU only).

The fragment kernels (`qmatmul_mma`, `qmatmul_ring`) factor each group's bias out of its
sum, so they need Σ_{k∈block} x[m, k] for every block and row of x. They make it with an
mma.sync of an all-ones A beside each block's code mma, in every warp, for every weight
tile: at 9-32 rows (two to four column tiles of x) that doubles the kernel's mma count,
though the sums depend on x alone. `block_sums` makes them once per call, with the same
instruction on the same operands (the x pairs as the kernels load them, the four k16
steps chained from zero: `qmatmul_mma.sums_asm`), so the kernels that read them
(``sums=True``) compute every output bit for bit as before: a row's result still does
not depend on the rows beside it, nor on which path made its sums.

Output: E float32 [KB, 8·NT] (KB blocks of 64 columns, NT column tiles of 8 rows of x),
E[kb, m] the sum for row m (rows past M repeat the last row, as the kernels' column
tiles do; never stored by them). Launched with PDL like the kernels around it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import enabled as pdl_enabled
from .pdl import launch_options
from .qmatmul_mma import load_x_pairs, sums_asm

NUM_WARPS = 4  # one block a warp
_SUMS_ASM = tl.constexpr(sums_asm())


@triton.jit
def _block_sums_kernel(x_ptr, e_ptr, M, KB, NW: tl.constexpr, GDC: tl.constexpr):
    """Grid (blocks / NW, NT): warp w of program p sums block p·NW + w of column tile
    program_id(1), as the fragment kernels' lanes hold it (lane 4g + q: x row 8·nt + g,
    its columns 16q .. 16q + 15 of the block as 8 bf16 pairs)."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # x comes from the kernel before
    idx = tl.arange(0, 32 * NW)
    lane = idx % 32
    g = lane // 4
    q = lane % 4
    nt = tl.program_id(1)
    kb = tl.program_id(0) * NW + idx // 32
    row = tl.minimum(8 * nt + g, M - 1).to(tl.int64)
    base = x_ptr + row * (KB * 32) + q * 8 + tl.minimum(kb, KB - 1) * 32
    xs = load_x_pairs((base,), 1, 1)[0][0]  # as the fragment kernels load a block of x
    e0, e1, _e2, _e3 = tl.inline_asm_elementwise(
        _SUMS_ASM, "=f,=f,=f,=f" + ",r" * 8,
        [xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7]],
        dtype=(tl.float32,) * 4, is_pure=True, pack=1)
    # the mma's columns 2q, 2q + 1 are rows 8·nt + 2q, + 1; alike in every lane g
    m = 8 * nt + 2 * q
    out = e_ptr + kb * (8 * tl.num_programs(1)) + m
    keep = (g == 0) & (kb < KB)
    tl.store(out, e0, mask=keep)
    tl.store(out + 1, e1, mask=keep)


def block_sums(x2: torch.Tensor, pdl: bool | None = None) -> torch.Tensor:
    """E float32 [K/64, 8·⌈M/8⌉] for x2 [M, K] bf16 (contiguous; the caller's product
    takes it: K a multiple of 64, 1..32 rows on a CUDA GPU)."""
    M, K = x2.shape
    KB, NT = K // 64, triton.cdiv(M, 8)
    e = torch.empty(KB, 8 * NT, dtype=torch.float32, device=x2.device)
    gdc = pdl_enabled(x2.device) if pdl is None else pdl
    _block_sums_kernel[(triton.cdiv(KB, NUM_WARPS), NT)](
        x2.view(torch.int32), e, M, KB, NW=NUM_WARPS, GDC=gdc, num_warps=NUM_WARPS,
        **launch_options(gdc))
    return e
