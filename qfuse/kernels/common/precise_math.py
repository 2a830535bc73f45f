"""Float32 math helpers that match PyTorch's CUDA kernels bit for bit on the GPU.

PyTorch's CUDA element-wise kernels call the CUDA math library (`tanhf`,
`expf`) and divide with IEEE rounding. Triton's `tl.exp` is the fast
approximate exponential and its `/` is the approximate division, which made
an fp16 SiLU differ from PyTorch's in many elements; libdevice and
`tl.math.div_rn` match it (`docs/design.md`, "Rounding like PyTorch").

Triton's CPU interpreter has no libdevice (its functions return None), so each
helper takes ``LIBDEVICE: tl.constexpr`` and, when it is False, uses a portable
expression: close to the libdevice result, never bit-exact, and only ever used
by CPU tests.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ...levers import interpreter_active


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
def mul_rn_f32(x, y, LIBDEVICE: tl.constexpr):
    """x·y rounded on its own. A plain `*` may be contracted with a later add into one
    FMA; when the product is then rounded to bf16/fp16, LLVM first narrows it to a
    bf16/fp16 multiply and the NVPTX backend fuses that with the add into
    `fma.rn.bf16` (seen in the rope kernel's sm_90 PTX), skipping the product's own
    rounding that PyTorch's separate multiply kernel performs. Inline PTX rather than
    libdevice's mul_rn, which Triton builds with flush-to-zero (`mul.rn.ftz.f32`)."""
    if LIBDEVICE:
        z = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [x, y],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        z = x * y  # the interpreter evaluates each operation with numpy: no contraction
    return z


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
