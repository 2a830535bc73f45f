"""Programmatic dependent launch (PDL), Hopper and newer: consecutive kernels overlap.

A kernel launched with PDL may start while the kernel before it on the stream is still
running; it must not read that kernel's output (or write what it reads) before
`gdc_wait()`, which returns once the previous kernel has finished and its writes are
visible. The previous kernel lets its dependents start early by calling
`gdc_launch_dependents()`. The decode step's own kernels (the fragment-order products,
RMSNorm, RoPE, KV append, the gated activation, decode attention and its merge) do
both at their start (the products first issue their first weight loads, which depend
on nothing), so each one's launch and prologue hide under the tail of the one before.
Because every such kernel waits before it finishes, the ordering stays transitive
along the stream; kernels launched plainly (torch's, the other products) simply wait
for the one before to finish.

``QFUSE_PDL=0`` (read at import) launches everything plainly: an opt-out.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

from ...levers import interpreter_active

ENABLED = os.environ.get("QFUSE_PDL", "1") != "0"


@functools.cache
def sm_major(device: torch.device) -> int:
    """The GPU's compute capability major (asked once per device: it is on the decode path)."""
    return torch.cuda.get_device_capability(device)[0]


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (CUDA, sm_90+, not the interpreter)."""
    return (ENABLED and device.type == "cuda" and not interpreter_active()
            and sm_major(device) >= 9)


@contextlib.contextmanager
def off():
    """Kernels launched inside the block do so plainly, as with QFUSE_PDL=0 (e.g. for a
    profile, where under PDL a kernel's listed time includes its wait for the one
    before); a graph captured inside keeps that."""
    global ENABLED
    saved, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = saved


def launch_options(on: bool) -> dict:
    """The extra launch keyword for a Triton kernel launched with PDL (``on``) or not."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def start(GDC: tl.constexpr):
    """Let the next kernel launch now, then wait for the previous one's output."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
