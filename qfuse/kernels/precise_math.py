"""Float32 math helpers that match PyTorch's CUDA kernels bit for bit on the GPU.

PyTorch's CUDA element-wise kernels call the CUDA math library (`tanhf`,
`expf`) and divide with IEEE rounding. Triton's `tl.exp` is the fast
approximate exponential and its `/` is the approximate division, which gave
thousands of fp16 SiLU mismatches in a probe (DESIGN.md); libdevice and
`tl.math.div_rn` give none.

Triton's CPU interpreter has no libdevice (its functions return None), so each
helper takes ``LIBDEVICE: tl.constexpr`` and, when it is False, uses a portable
expression: close to the libdevice result, never bit-exact, and only ever used
by CPU tests.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..levers import interpreter_active


def use_libdevice() -> bool:
    """The value to pass as LIBDEVICE: True on the GPU, False under the interpreter."""
    return not interpreter_active()


@triton.jit
def exp_f32(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def tanh_f32(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.tanh(x)
    else:
        # 1 - 2 / (e^{2x} + 1): saturates to ±1 correctly when e^{2x} is 0 or inf.
        y = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
    return y


@triton.jit
def rint_f32(x, LIBDEVICE: tl.constexpr):
    """Round half to even (torch.round)."""
    if LIBDEVICE:
        y = libdevice.rint(x)
    else:
        # Adding and subtracting 2**23 leaves no fraction bits: the FPU's
        # round-to-nearest-even does the rounding. Values ≥ 2**23 are integers.
        ax = tl.abs(x)
        r = (ax + 8388608.0) - 8388608.0
        y = tl.where(ax < 8388608.0, tl.where(x < 0, -r, r), x)
    return y
