"""The one-launch rotary embedding on the GPU: bitwise equal to the reference in bf16 at
the Gemma 3 12B and Llama 3 8B head shapes, prefill and decode. Written 2026-11-30 after
the session's device time was spent: not yet run; QFUSE_ROPE stays off by default until
it passes."""

import pytest
import torch

from qfuse import reference
from qfuse.kernels.rope import apply_rotary


@pytest.mark.parametrize("B,H,T,D", [(1, 16, 1, 256), (8, 8, 1, 256), (1, 32, 1, 128),
                                     (2, 16, 2048, 256), (1, 8, 4097, 128)])
def test_bf16_bitwise_equal(B, H, T, D):
    g = torch.Generator(device="cuda").manual_seed(B * T + D)
    x = (torch.randn(B, T, H * D, generator=g, device="cuda") * 3).bfloat16()
    x = x.view(B, T, H, D).transpose(1, 2)
    positions = torch.arange(T, device="cuda").expand(B, T) + 1000
    cos, sin = reference.rope_cos_sin(positions, reference.rope_inv_freq(D, 1e6, "cuda"),
                                      torch.bfloat16)
    assert torch.equal(apply_rotary(x, cos, sin), reference.apply_rotary(x, cos, sin))
