"""Repacking 4-bit MLX weights into mma fragment order: back to MLX words bit for bit at odd
shapes, the documented position of every code, and the inputs it refuses."""

import pytest
import torch

from qfuse.kernels import fragments
from qfuse.quant import QuantizedTensor, unpack


@pytest.mark.parametrize("N,K,group", [(5, 128, 64), (37, 256, 128), (16, 64, 64), (33, 384, 64)])
def test_round_trip_to_mlx_words(N, K, group):
    torch.manual_seed(N + K)
    w = QuantizedTensor.from_float(torch.randn(N, K).bfloat16(), group, 4)
    f = fragments.repack(w)
    assert f.words.shape == (-(-N // 16), K // 64, 32, 4) and f.scales.shape[1] == K // group
    back = fragments.to_mlx(f)
    assert torch.equal(back.packed.view(torch.int32), w.packed.view(torch.int32))
    assert torch.equal(back.scales.view(torch.int16), w.scales.view(torch.int16))
    assert torch.equal(back.biases.view(torch.int16), w.biases.view(torch.int16))


def test_code_positions_follow_the_docstring():
    """Nibble p = 4e + 2h + r of word j, lane 4g + q, block (t, kb) holds the code of row
    16t + 8r + g at k = 64kb + 16q + 4j + 2h + e; scales pair rows g and g + 8."""
    torch.manual_seed(0)
    N, K = 40, 192
    w = QuantizedTensor.from_float(torch.randn(N, K).bfloat16(), 64, 4)
    codes = unpack(w.packed, 4)
    f = fragments.repack(w)
    words = f.words.to(torch.int64) & 0xFFFFFFFF
    for t, kb, g, q, j, e, h, r in [(0, 0, 0, 0, 0, 0, 0, 0), (1, 2, 5, 3, 2, 1, 0, 1),
                                    (2, 1, 7, 1, 3, 1, 1, 0), (0, 2, 3, 2, 1, 0, 1, 1)]:
        row, k = 16 * t + 8 * r + g, 64 * kb + 16 * q + 4 * j + 2 * h + e
        nibble = (words[t, kb, 4 * g + q, j] >> (4 * (4 * e + 2 * h + r))) & 0xF
        expected = codes[row, k] if row < N else 0
        assert nibble == expected, (t, kb, g, q, j, e, h, r)
    s = f.scales.to(torch.int64) & 0xFFFFFFFF
    lo = (s[1, 2, 3] & 0xFFFF).to(torch.int16).view(torch.bfloat16)
    hi = (s[1, 2, 3] >> 16).to(torch.int16).view(torch.bfloat16)
    assert lo == w.scales[16 + 3, 2] and hi == w.scales[16 + 8 + 3, 2]


@pytest.mark.parametrize("bits,group,dtype,match", [
    (8, 64, torch.bfloat16, "8-bit"), (4, 32, torch.bfloat16, "group size 32"),
    (4, 64, torch.float16, "scales")])
def test_refuses_what_the_kernel_cannot_take(bits, group, dtype, match):
    w = QuantizedTensor.from_float(torch.randn(16, 128).to(dtype), group, bits)
    assert match in fragments.unsupported_reason(w)
    with pytest.raises(ValueError, match=match):
        fragments.repack(w)
