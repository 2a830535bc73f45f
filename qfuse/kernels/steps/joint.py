"""The O and down steps' epilogue: a decoder layer's residual joint over whole rows, read
back from the step's scratch product: h = residual + post_norm(a) (or + a), then
n = next_norm(h), rounded where the spelled-out ops round (`pointwise.rms_norm`'s
`joint_rows`, the residual-joint kernel's own arithmetic).

Who runs it: every column tile of the product is a tile of one unit (all the rows), so no
row can start before the last tile is stored. The last OWNERS programs to arrive share the
rows, row r to owner r mod OWNERS: the last one alone under the interpreter (which runs
programs one after another, so an owner waiting for later programs would wait forever),
on a GPU one owner per row, so that 2-8 rows do not run one after another in one program
while every other SM idles (`joint_owners`). Each row's arithmetic is the same whoever
runs it, so the result does not depend on OWNERS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.rounding import as_stored
from ..common.units import arrive_unit, load_scratch, wait_count_reached
from ..pointwise.rms_norm import joint_rows


def joint_owners(rows: int, tiles: int, device: torch.device) -> int:
    """How many of the last programs to arrive share a joint's ``rows`` (module docstring).
    On a GPU an owner waits for the tiles still running; that cannot deadlock: they have
    all started (under PDL the next kernel launches only once every program of this one
    has, and without it the programs that finished free their SMs)."""
    return min(rows, tiles) if device.type == "cuda" else 1


@triton.jit
def arrive_joint(cnt_ptr, TILES: tl.constexpr, OWNERS: tl.constexpr):
    """Count this program's stored tile on the joint's counter (cnt_ptr[0]; cnt_ptr[1]
    counts the owners done waiting). Returns which owner this program is, 0..OWNERS-1, or
    -1 if it is none; an owner returns once all TILES tiles are stored. The counters are
    zero again once every owner has returned."""
    if OWNERS == 1:  # the last to arrive alone: a unit's own arrival
        owner = arrive_unit(cnt_ptr, 0, TILES).to(tl.int32) - 1
    else:
        tl.debug_barrier()  # every thread's stores are issued before the count
        owner = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") - (TILES - OWNERS)
        if owner >= 0:
            wait_count_reached(cnt_ptr, TILES)
            # the last owner to have seen every tile resets both counts: no owner reads
            # them after that
            if tl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel", scope="gpu") == OWNERS - 1:
                tl.atomic_xchg(cnt_ptr + 1, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
    return owner


@triton.jit
def joint_epilogue(a_ptr, res_ptr, stride_res, post_w_ptr, next_w_ptr, h_ptr, n_ptr, N, eps,
                   inv_d, owner, ROWS: tl.constexpr, OWNERS: tl.constexpr,
                   BLOCK_D: tl.constexpr, HAS_POST: tl.constexpr, HAS_NEXT: tl.constexpr,
                   UNIT_OFFSET: tl.constexpr, BF16_BITS: tl.constexpr):
    """Rows owner, owner + OWNERS, ... of the scratch product a [ROWS, N]: those rows of
    h [ROWS, N], and of n (HAS_NEXT)."""
    cols = tl.arange(0, BLOCK_D)
    ok = cols < N
    # a weight the joint lacks is never read: its pointer stands in for the load
    post_w = tl.load(post_w_ptr + cols, mask=ok & HAS_POST, other=0.0)
    next_w = tl.load(next_w_ptr + cols, mask=ok & HAS_NEXT, other=0.0)
    for m in range(owner, ROWS, OWNERS):
        a = load_scratch(a_ptr + m * N + cols, ok, BF16_BITS)[None, :]  # 0 past N
        res = tl.load(res_ptr + m * stride_res + cols, mask=ok, other=0.0)[None, :]
        h, n = joint_rows(a, res, post_w, next_w, h_ptr, n_ptr, eps, inv_d, HAS_POST, HAS_NEXT,
                          UNIT_OFFSET, BF16_BITS)
        tl.store(h_ptr + m * N + cols[None, :], as_stored(h, h_ptr, BF16_BITS),
                 mask=ok[None, :])
        if HAS_NEXT:
            tl.store(n_ptr + m * N + cols[None, :], as_stored(n, n_ptr, BF16_BITS),
                     mask=ok[None, :])
