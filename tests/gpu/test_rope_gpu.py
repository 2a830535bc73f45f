"""The one-launch rotary embedding on the GPU: bit for bit (zero signs included) the
reference's result at the Gemma 3 12B and Llama 3 8B head shapes, prefill and decode,
in bf16, fp16 and fp32.

Its first GPU run (2026-11-30) failed in bf16: LLVM had narrowed the float32 products
to bf16 multiplies and fused them with the add into `fma.rn.bf16`, skipping the
product's rounding. The kernel now multiplies with `mul.rn.f32` (precise_math)."""

import pytest
import torch

from qfuse import reference
from qfuse.kernels.rope import apply_rotary

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B,H,T,D", [(1, 16, 1, 256), (8, 8, 1, 256), (1, 32, 1, 128),
                                     (2, 16, 2048, 256), (1, 8, 4097, 128)])
def test_bitwise_equal(B, H, T, D, dtype):
    g = torch.Generator(device="cuda").manual_seed(B * T + D)
    x = (torch.randn(B, T, H * D, generator=g, device="cuda") * 3).to(dtype)
    x[..., ::7] = 0.0  # zeros of both signs: the sign of a zero result must match too
    x[..., ::11] = -0.0
    x = x.view(B, T, H, D).transpose(1, 2)
    positions = torch.arange(T, device="cuda").expand(B, T) + 1000
    cos, sin = reference.rope_cos_sin(positions, reference.rope_inv_freq(D, 1e6, "cuda"),
                                      dtype)
    got, want = apply_rotary(x, cos, sin), reference.apply_rotary(x, cos, sin)
    # the same layout (a size-1 dim's stride is free: PyTorch and empty_like differ there)
    assert [s for s, n in zip(got.stride(), got.shape) if n > 1] == \
        [s for s, n in zip(want.stride(), want.shape) if n > 1]
    assert torch.equal(got.view(BITS[dtype]), want.view(BITS[dtype]))
