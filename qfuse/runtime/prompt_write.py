"""Writing a prefill's K and V into a KV cache: every kept token of every row at once.

A prefill (or one chunk of it) hands each layer k, v [B, Hkv, T, D] of right-padded
prompts. Written row by row, a quantized cache quantizes each row with some thirty small
torch ops, and the reference quantizer's constants reach the device by a synchronous
copy: measured on the H200 (bench/step_profile.py, NOTES "Serving"), a 512-token Gemma
3 12B prefill spent 340 of its 411 ms on the host. Here the kept tokens of all rows are
found once per forward (the `TokenPlan`, shared by every layer of the same keep rule),
gathered in one indexing op and written by one `ops.kv_append` call, whose block table
says where each token goes: for a slotted store a table of one "page" per token, the
row itself (the page is then the whole row, ``capacity`` slots), for a paged pool the
row's real block table. The kernel quantizes exactly as `quant.quantize` does, so the
bits are those of the row-by-row write.
"""

from __future__ import annotations

import dataclasses

import torch

from .host_copies import to_device

# Plans of recent forwards: a forward's layers share one plan per keep rule, and a
# serving loop alternates a few shapes. Bounded: cleared whole when full.
_PLANS: dict[tuple, TokenPlan] = {}
_PLANS_KEPT = 16


@dataclasses.dataclass(frozen=True)
class TokenPlan:
    """The kept tokens of a prompt chunk, flattened: token i is batch row ``rows[i]``'s
    query ``cols[i]`` (an index into the chunk's T), at absolute position
    ``positions[i]``, int64 [n] on the device; ``row_table`` int32 [n, 1]: each token's
    row as a one-page block table (a slotted store read as a pool of B pages)."""

    n: int
    rows: torch.Tensor
    cols: torch.Tensor
    positions: torch.Tensor
    row_table: torch.Tensor


def token_plan(lengths: list[int], firsts: list[int], past: int, T: int,
               device) -> TokenPlan:
    """The plan for rows whose chunk covers positions past..past+T-1, row b keeping
    positions firsts[b]..lengths[b]-1 (``lengths`` count ``past``). Built on the host
    from host lists (no device sync) and copied to the device without waiting for it."""
    device = torch.device(device)
    key = (tuple(lengths), tuple(firsts), past, T, device)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    L = torch.tensor(lengths, dtype=torch.int64)
    first = torch.tensor(firsts, dtype=torch.int64)
    pos = torch.arange(past, past + T, dtype=torch.int64)
    keep = (pos[None, :] >= first[:, None]) & (pos[None, :] < L[:, None])
    rows, cols = keep.nonzero(as_tuple=True)
    rows, cols = to_device(rows, device), to_device(cols, device)
    plan = TokenPlan(int(rows.numel()), rows, cols, cols + past,
                     rows.to(torch.int32)[:, None])
    if len(_PLANS) >= _PLANS_KEPT:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def write_tokens(store, src: torch.Tensor, plan: TokenPlan, slots: torch.Tensor,
                 table: torch.Tensor) -> None:
    """store[table[i, slots[i] // PAGE], :, slots[i] % PAGE] = src[rows[i], :, cols[i]]
    for every token i of ``plan``, quantizing for a quantized store (PAGE: the store's
    dim 2; int32 ``table`` [n, P]). One gather and one `ops.kv_append`."""
    from .. import ops

    if plan.n == 0:
        return
    x = src[plan.rows, :, plan.cols]  # [n, Hkv, D]
    ops.kv_append(x, slots, store, positions_checked=True, block_table=table)
