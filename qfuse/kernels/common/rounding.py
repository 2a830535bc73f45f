"""Rounding float32 results the way the compat path rounds them, inside Triton kernels.

Kernels compute in float32 and must round where PyTorch rounds (to bf16, fp16 or
not at all) to stay close to, or bit-identical with, the spelled-out path. Native
casts do that on the GPU; under the Triton interpreter (CPU tests, NATIVE=False /
BF16_BITS=True) the float32 → bf16 cast truncates, so bf16 is rounded to nearest
even by hand on the bits and stored through an int16 view of the output.
"""

import torch
import triton
import triton.language as tl

from ...levers import interpreter_active


def emulates_bf16(dtype: torch.dtype) -> bool:
    """True when a kernel writing ``dtype`` must round bf16 by hand and store bits: bf16
    under the interpreter (the kernels' BF16_BITS / not NATIVE)."""
    return dtype == torch.bfloat16 and interpreter_active()


def stored_view(out: torch.Tensor) -> torch.Tensor:
    """What a kernel stores into for ``out``: its int16 view when bf16 is emulated."""
    return out.view(torch.int16) if emulates_bf16(out.dtype) else out


@triton.jit
def bf16_rne_bits(x):
    """float32 → bf16 bits (int32, low 16 bits), rounding to nearest even (finite x)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


@triton.jit
def bf16_bits_to_f32(bits):
    """bf16 bits in the low half of an int32 → float32 (exact)."""
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def round_bf16(x, NATIVE: tl.constexpr):
    """float32 x rounded to bf16 (to nearest even), returned as float32."""
    if NATIVE:
        y = x.to(tl.bfloat16).to(tl.float32)
    else:
        y = bf16_bits_to_f32(bf16_rne_bits(x))
    return y


@triton.jit
def to_stored(acc, NATIVE: tl.constexpr):
    """An output tile as stored: bf16, or its round-to-nearest-even bits (interpreter)."""
    if NATIVE:
        out = acc.to(tl.bfloat16)
    else:
        out = bf16_rne_bits(acc).to(tl.int16)
    return out


@triton.jit
def round_like(x, y_ptr, BF16_BITS: tl.constexpr):
    """float32 x rounded to y_ptr's element type, as float32 (bf16 emulated with
    round-to-nearest-even when BF16_BITS: y_ptr then holds int16 bits)."""
    if BF16_BITS:
        r = round_bf16(x, False)
    else:
        r = x.to(y_ptr.dtype.element_ty).to(tl.float32)
    return r


@triton.jit
def as_stored(x, y_ptr, BF16_BITS: tl.constexpr):
    """float32 x as stored through y_ptr (bf16 bits when BF16_BITS)."""
    if BF16_BITS:
        r = to_stored(x, False)
    else:
        r = x.to(y_ptr.dtype.element_ty)
    return r
