"""Units of a kernel's output: the last program to finish a unit runs its epilogue.

A fused step (`kernels/steps/`) computes a product over a grid of column tiles × splits
of K (`splitk`), then an epilogue that needs a whole *unit* of the output at once: a head
(q/k norm, RoPE, the KV append) or every column of the rows (the residual joint and the
next RMSNorm). Decode attention's splits are units too: the merge of a (sequence, kv
head) needs all of its splits (`attention.decode_attention`, MERGE). Each program that
finishes its part of a unit stores it to memory and counts its arrival on the unit's
counter; the last to arrive reads the unit back (`.cg` loads: from L2, where the other
programs' stores are) and runs the epilogue. No float atomics: the epilogue reads values
in a fixed order, so the result does not depend on which program finished last.

Counters: int32 [UNIT_SLOTS] per device, zero between calls (the last arriver resets its
unit's), allocated and zeroed by the first call on a device, which must therefore run
eagerly (not under CUDA graph capture); launchers keep their units within UNIT_SLOTS.
One kernel at a time uses them (kernels on one stream, each counting after its
`pdl.start`). They are not splitk's semaphores, so a step's tiles and units never share
a count. This module imports no other kernel module but `rounding`, so every subject
may build on it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import bf16_bits_to_f32

UNIT_SLOTS = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def zeroed_once(store: dict, device: torch.device, slots: int) -> torch.Tensor | None:
    """``store``'s zeroed int32 [slots] buffer for ``device``, allocated and zeroed by the
    first call; None where it does not exist yet and this call is under CUDA graph capture
    (which would only record the zeroing: eager calls before the first replay would count
    from garbage). Each kernel family that counts (the units here, splitk's semaphores,
    the ring chain's counters) keeps its own ``store``."""
    buffer = store.get(device)
    if buffer is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buffer = store[device] = torch.zeros(slots, dtype=torch.int32, device=device)
    return buffer


def warm_up_first(what: str, kind: str) -> RuntimeError:
    """The error of a first call under CUDA graph capture (`zeroed_once` gave None)."""
    return RuntimeError(f"{what}'s first call on a device must run outside CUDA graph "
                        f"capture (it allocates and zeroes its {kind}); run one eager call "
                        "first, as a warm-up")


def unit_counters(device: torch.device) -> torch.Tensor:
    """The device's zeroed unit counters, allocated by the first call (eagerly: under a
    graph capture the zeroing would only be recorded)."""
    counters = ready_unit_counters(device)
    if counters is None:
        raise warm_up_first("a fused step", "unit counters")
    return counters


def ready_unit_counters(device: torch.device) -> torch.Tensor | None:
    """`unit_counters`, or None where they do not exist yet and this call is under CUDA
    graph capture (which cannot allocate them): a launcher with a form that needs no
    counters takes that one instead of refusing."""
    return zeroed_once(_COUNTERS, device, UNIT_SLOTS)


@triton.jit
def arrive_unit(cnt_ptr, unit, TILES: tl.constexpr):
    """Count this program's finished tile of ``unit`` (after its stores); True for the
    last of the unit's TILES tiles, which then owns the unit and resets its counter."""
    tl.debug_barrier()  # every thread's stores are issued before the count
    last = tl.atomic_add(cnt_ptr + unit, 1, sem="acq_rel", scope="gpu") == TILES - 1
    if last:
        tl.atomic_xchg(cnt_ptr + unit, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def wait_count_reached(cnt_ptr, count):
    """Spin until the counter at cnt_ptr reaches ``count`` (acquire: what the programs
    that counted stored before their count is visible after this). Only where every
    program that counts is resident (or, under the interpreter, already ran)."""
    seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    while seen < count:
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()  # no thread reads before the count is seen


@triton.jit
def load_scratch(ptrs, mask, BF16_BITS: tl.constexpr):
    """float32 values of a scratch output other programs stored (from L2: `.cg`; 0 where
    not ``mask``); bf16 bits (int16) when BF16_BITS."""
    if BF16_BITS:
        bits = tl.load(ptrs, mask=mask, other=0, cache_modifier=".cg").to(tl.int32)
        v = bf16_bits_to_f32(bits & 0xFFFF)
    else:
        v = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return v
