"""The O and down steps' epilogue: a decoder layer's residual joint over whole rows, read
back from the step's scratch product: h = residual + post_norm(a) (or + a), then
n = next_norm(h), rounded where the spelled-out ops round (`pointwise.rms_norm`'s
`joint_rows`, the residual-joint kernel's own arithmetic)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.rounding import as_stored
from ..common.units import load_scratch
from ..pointwise.rms_norm import joint_rows


@triton.jit
def joint_epilogue(a_ptr, res_ptr, stride_res, post_w_ptr, next_w_ptr, h_ptr, n_ptr, N, eps,
                   inv_d, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_POST: tl.constexpr,
                   HAS_NEXT: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                   BF16_BITS: tl.constexpr):
    """Rows 0..ROWS of the scratch product a [ROWS, N]: h [ROWS, N], and n (HAS_NEXT)."""
    cols = tl.arange(0, BLOCK_D)
    ok = cols < N
    # a weight the joint lacks is never read: its pointer stands in for the load
    post_w = tl.load(post_w_ptr + cols, mask=ok & HAS_POST, other=0.0)
    next_w = tl.load(next_w_ptr + cols, mask=ok & HAS_NEXT, other=0.0)
    for m in tl.static_range(ROWS):
        a = load_scratch(a_ptr + m * N + cols, ok, BF16_BITS)[None, :]  # 0 past N
        res = tl.load(res_ptr + m * stride_res + cols, mask=ok, other=0.0)[None, :]
        h, n = joint_rows(a, res, post_w, next_w, h_ptr, n_ptr, eps, inv_d, HAS_POST, HAS_NEXT,
                          UNIT_OFFSET, BF16_BITS)
        tl.store(h_ptr + m * N + cols[None, :], as_stored(h, h_ptr, BF16_BITS),
                 mask=ok[None, :])
        if HAS_NEXT:
            tl.store(n_ptr + m * N + cols[None, :], as_stored(n, n_ptr, BF16_BITS),
                     mask=ok[None, :])
