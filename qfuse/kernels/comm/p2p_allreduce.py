"""One-shot all-reduce of a decode step's hidden rows by peer-to-peer NVLink stores.

Each rank pushes its partial rows straight into every rank's receive buffer (a
symmetric-memory allocation mapped into every process), raises a flag in each
rank's flag area, waits until every rank's flag for this call has arrived, then sums
the W received copies in rank order in float32 and rounds once. Every rank adds the
same values in the same order, so the replicated hidden state stays bitwise equal on
all ranks. Data and flag travel one way over NVLink (no round trip to read a peer),
which is the whole latency of the call at decode sizes.

Contract:
- x, out: [rows, H] (row stride free, unit column stride), bf16/fp16/fp32; rows ≤
  CHANNELS (one program, and one flag channel, per row); H a multiple of 8 up to
  MAX_HIDDEN (`unsupported_reason`).
- The workspace (`P2PWorkspace`, built by `qfuse.parallel.comm`) is, on every rank:
  ``CHANNELS × W`` int32 flags, then ``2 × W × CHANNELS × H`` elements of receive
  buffer (two halves used alternately), plus a local int32 epoch per channel.
- Flags carry epochs (the call's count on that channel plus one), never reset: a
  graph replayed any number of times, or mixed with eager calls, stays in step, as
  long as every rank makes the same calls (tensor parallelism does). Alternating
  halves keep a fast rank's next push from overwriting a half its peer still reads:
  to reach call e+2 it must have seen the peer's flag of e+1, which the peer raises
  only after finishing call e.
- A peer that never arrives makes the program trap after TIMEOUT_NS (the process
  then fails loudly instead of hanging inside a graph replay).
- PDL-ready: it lets the next kernel launch at once and reads x (and its epoch) only
  after `gdc_wait()`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import pdl

CHANNELS = 64  # rows per call at most: the decode buckets; prefill takes NCCL
MAX_HIDDEN = 16384
TIMEOUT_NS = 20_000_000_000  # 20 s: longer than any step, shorter than a user's patience
FLAG_BYTES_ALIGN = 256


@triton.jit
def _ld_acquire_sys(ptrs):
    return tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _st_release_sys(ptrs, values):
    # The dummy output keeps the asm from being dropped as unused.
    tl.inline_asm_elementwise("st.release.sys.global.b32 [$1], $2;\n\tmov.u32 $0, 0;",
                              "=r,l,r", [ptrs, values], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _trap():
    tl.inline_asm_elementwise("trap;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _p2p_allreduce_kernel(x_ptr, out_ptr, bases_ptr, epoch_ptr, rank, H, stride_x, stride_out,
                          data_offset, timeout_ns, W: tl.constexpr, CH: tl.constexpr,
                          BLOCK: tl.constexpr, GDC: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ranks = tl.arange(0, W)
    mask = cols < H
    pdl.start(GDC)
    e = tl.load(epoch_ptr + row)
    half = e & 1
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask)
    # push: my rows into slot [half][rank][row] of every rank's receive buffer
    slot = ((half * W + rank) * CH + row).to(tl.int64) * H + data_offset
    for r in tl.static_range(W):
        # the workspace is 16-byte aligned and H a multiple of 8 (unsupported_reason):
        # say so, or the stores go out two bytes at a time
        base = tl.multiple_of(tl.load(bases_ptr + r).to(tl.pointer_type(x.dtype)) + slot, 16)
        tl.store(base + cols, x, mask=mask)
    # every thread's stores precede the flag (bar.sync, then a release at system scope)
    tl.debug_barrier()
    target = e + 1
    flag_bases = tl.load(bases_ptr + ranks).to(tl.pointer_type(tl.int32))
    _st_release_sys(flag_bases + row * W + rank, tl.full([W], 0, tl.int32) + target)
    my_flags = tl.load(bases_ptr + rank).to(tl.pointer_type(tl.int32)) + row * W + ranks
    seen = _ld_acquire_sys(my_flags)
    t0 = _now_ns()
    # epochs wrap around int32: compare by difference
    while tl.min(seen - target, axis=0) < 0:
        seen = _ld_acquire_sys(my_flags)
        if _now_ns() - t0 > timeout_ns:
            _trap()
    tl.debug_barrier()
    mine = tl.load(bases_ptr + rank).to(tl.pointer_type(x.dtype))
    acc = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(W):
        src = ((half * W + r) * CH + row).to(tl.int64) * H + data_offset
        # .cg: from L2, where the peers' stores land, never a stale L1 line
        acc += tl.load(tl.multiple_of(mine + src, 16) + cols, mask=mask, other=0.0,
                       cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, acc.to(x.dtype), mask=mask)
    tl.store(epoch_ptr + row, target)


class P2PWorkspace:
    """One rank's view of the symmetric workspace for rows of width ``hidden``.

    bases: int64 [W] on the device, the address of each rank's allocation as mapped in
    this process; epochs: int32 [CHANNELS], this rank's call count per channel."""

    def __init__(self, bases: torch.Tensor, epochs: torch.Tensor, rank: int, world: int,
                 hidden: int, dtype: torch.dtype):
        self.bases, self.epochs, self.rank, self.world = bases, epochs, rank, world
        self.hidden, self.dtype = hidden, dtype
        # where the receive halves start, in elements of dtype from the allocation's start
        self.data_offset = flag_area_bytes(world) // dtype.itemsize

    @staticmethod
    def nbytes(world: int, hidden: int, dtype: torch.dtype) -> int:
        """Bytes of one rank's allocation: flags, then the two receive halves."""
        return flag_area_bytes(world) + 2 * world * CHANNELS * hidden * dtype.itemsize


def flag_area_bytes(world: int) -> int:
    """Bytes of the flag area at the start of the allocation (zeroed before first use)."""
    raw = CHANNELS * world * 4
    return -(-raw // FLAG_BYTES_ALIGN) * FLAG_BYTES_ALIGN


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def unsupported_reason(x: torch.Tensor) -> str | None:
    """None when one call can reduce x (through a workspace made for its last dimension
    and dtype), else why not: the caller then takes NCCL, and makes no workspace."""
    hidden = x.shape[-1]
    rows = x.numel() // max(hidden, 1)
    if x.device.type != "cuda":
        return "not a CUDA tensor"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} (kernel: fp16, bf16, fp32)"
    if rows > CHANNELS:
        return f"{rows} rows > {CHANNELS}"
    if hidden % 8 or hidden > MAX_HIDDEN:
        return f"hidden size {hidden} is not a multiple of 8 up to {MAX_HIDDEN}"
    return None


def p2p_all_reduce(x: torch.Tensor, ws: P2PWorkspace) -> torch.Tensor:
    """Σ over ranks of x [..., H] (every rank must call it with the same shape), as a
    new tensor; graph-capturable."""
    rows2d = x.reshape(-1, x.shape[-1])
    if rows2d.stride(-1) != 1:
        rows2d = rows2d.contiguous()
    out = torch.empty_like(rows2d)
    n_rows, hidden = rows2d.shape
    block = triton.next_power_of_2(hidden)
    gdc = pdl.enabled(x.device)
    _p2p_allreduce_kernel[(n_rows,)](
        rows2d, out, ws.bases, ws.epochs, ws.rank, hidden, rows2d.stride(0), out.stride(0),
        ws.data_offset, TIMEOUT_NS, W=ws.world, CH=CHANNELS, BLOCK=block, GDC=gdc,
        num_warps=4 if block <= 4096 else 8, **pdl.launch_options(gdc))
    return out.reshape(x.shape)
