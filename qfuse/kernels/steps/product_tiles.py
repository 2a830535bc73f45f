"""The product half of a fused step: one column tile of y = x·dequant(W)ᵀ + bias, stored
to the step's scratch output by the program that finishes it.

The grid is (column tiles of BLOCK_N weight rows) × 1 × (splits of K), as the CUDA-core
GEMV's (`products.qmatmul.gemv_tile`, whose arithmetic it is: compat's dequantized
weights, exact float32 products, float32 sums); with a split, the last split of a tile to
arrive sums every split's partial in split order (`splitk`). That program adds the bias,
rounds to y's dtype as compat rounds a product, stores the tile, and returns True: it is
the one that goes on to count the tile toward its unit (`units`). Every other program
returns False.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.rounding import as_stored
from ..products.qmatmul import gemv_tile
from ..products.splitk import arrive_last, sum_splits


@triton.jit
def product_tile(x_ptr, w_ptr, s_ptr, b_ptr, bias_ptr, y_ptr, ws_ptr, sem_ptr, N, K, magic,
                 stride_xm, stride_wn, stride_sn, stride_bn,
                 ROWS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                 GPI: tl.constexpr, ITERS: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_N: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                 Y_BF16_BITS: tl.constexpr, ROUND: tl.constexpr, PAIRS: tl.constexpr,
                 NATIVE: tl.constexpr, GDC: tl.constexpr):
    """Column tile program_id(0) of y [ROWS, N] (rows ROWS·N apart, contiguous): True in
    the program that stored it. GDC: the dependents may launch now, and the tile's first
    weights are requested before the wait for the previous kernel (x is its output)."""
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
            tl.store(y_ptr + m * N + rows[:, None], as_stored(acc, y_ptr, Y_BF16_BITS),
                     mask=out_ok)
    return last
