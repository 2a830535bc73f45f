"""Kernel edge cases: out-of-range positions, strided inputs, odd head dims, bias layouts.

All writes that would land out of bounds are arranged to hit memory the test
owns (a cache view into a bigger buffer), so a failure never corrupts the heap.
"""

import pytest
import torch

from qfuse import levers, ops, reference
from qfuse.quant import QuantizedTensor
from qfuse.testing import kernel_device, make_case

DEV = kernel_device()


def _qcache(B, H, N, D, bits=4, g=64):
    return QuantizedTensor.from_float(torch.zeros(B, H, N, D, dtype=torch.float16, device=DEV), g, bits)


def _slice_cache(c, lo, hi):
    return QuantizedTensor(c.packed[:, :, lo:hi], c.scales[:, :, lo:hi], c.biases[:, :, lo:hi],
                           c.group_size, c.bits)


def test_decode_attention_strided_int32_lengths(monkeypatch):
    # lengths = column of an int32 [B, 2] tensor: the kernels read lengths_ptr + b.
    monkeypatch.setenv("QFUSE_TIER", "fast")
    q, k, v, L = make_case(3, 4, 2, 64, 300, [10, 300, 150], 4, torch.float16, DEV)
    L2 = torch.stack([L, torch.ones_like(L)], dim=1)
    Ls = L2[:, 0]
    out = ops.decode_attention(q, k, v, Ls, 0.125)
    assert levers.counters().get("decode_attention") == 1
    ref = reference.decode_attention(q, k, v, Ls, 0.125)
    assert (out.float() - ref.float()).abs().max().item() < 1e-2


@pytest.mark.parametrize("pos", [8, -1])
def test_kv_append_position_outside_cache_is_rejected(pos, monkeypatch):
    # Cache of capacity 8 viewed inside a 10-slot buffer: slot 0 and 9 are guards.
    monkeypatch.setenv("QFUSE_TIER", "fast")
    big = _qcache(1, 1, 10, 64)
    cache = _slice_cache(big, 1, 9)
    x = torch.randn(1, 1, 64, dtype=torch.float16, device=DEV)
    before = big.scales.clone()
    # The kernel cannot check on the host without a sync: it writes nothing.
    ops.kv_append(x, torch.tensor([pos], device=DEV), cache)
    assert torch.equal(big.scales, before), "kernel wrote outside the cache"
    assert levers.counters() == {"kv_append": 1}
    monkeypatch.setenv("QFUSE_TIER", "compat")  # the reference path says so
    with pytest.raises(ValueError, match="positions"):
        ops.kv_append(x, torch.tensor([pos], device=DEV), cache)
    assert torch.equal(big.scales, before)


def test_kv_append_strided_int32_positions(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    x = torch.randn(2, 1, 64, dtype=torch.float16, device=DEV)
    P = torch.tensor([[3, 0], [5, 0]], dtype=torch.int32, device=DEV)
    c1, c2 = _qcache(2, 1, 8, 64), _qcache(2, 1, 8, 64)
    ops.kv_append(x, P[:, 0], c1)
    ops.kv_append(x, P[:, 0].contiguous(), c2)
    assert torch.equal(c1.packed, c2.packed) and torch.equal(c1.scales, c2.scales)


def test_kv_append_x_with_non_unit_last_stride(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    x = torch.randn(2, 1, 128, dtype=torch.float16, device=DEV)[..., ::2]
    pos = torch.tensor([1, 2], device=DEV)
    c1, c2 = _qcache(2, 1, 8, 64), _qcache(2, 1, 8, 64)
    ops.kv_append(x, pos, c1)
    ops.kv_append(x.contiguous(), pos, c2)
    assert torch.equal(c1.packed, c2.packed) and torch.equal(c1.scales, c2.scales)


@pytest.mark.parametrize("bits", [4, 8])
def test_kv_append_head_dim_not_power_of_two(bits, monkeypatch):
    # D=96 with g=32 is a valid MLX layout; the kernel's tiles take power-of-two head
    # dims only, so the reference writes it, quantized as the kernel would.
    monkeypatch.setenv("QFUSE_TIER", "fast")
    x = torch.randn(1, 1, 96, dtype=torch.float16, device=DEV)
    c = _qcache(1, 1, 4, 96, bits, 32)
    ops.kv_append(x, torch.tensor([2], device=DEV), c)
    assert levers.counters() == {"ref:kv_append": 1}
    packed = QuantizedTensor.from_float(x, 32, bits).packed
    assert torch.equal(c.packed[:, :, 2], packed)


def test_kv_append_biases_with_own_layout(monkeypatch):
    # The kernel addresses biases with the scales' strides, so biases laid out
    # otherwise go to the reference, which writes them where they are.
    monkeypatch.setenv("QFUSE_TIER", "fast")
    c = _qcache(1, 2, 8, 64)
    bview = torch.zeros(1, 2, 8, 3, dtype=torch.float16, device=DEV)[..., 1:2]
    c2 = QuantizedTensor(c.packed.clone(), c.scales.clone(), bview, 64, 4)
    x = torch.randn(1, 2, 64, dtype=torch.float16, device=DEV)
    ops.kv_append(x, torch.tensor([3], device=DEV), c2)
    assert levers.counters() == {"ref:kv_append": 1}
    ref = QuantizedTensor.from_float(x, 64, 4)
    assert torch.equal(c2.biases[:, :, 3], ref.biases)


def test_qgemv_biases_with_own_layout(monkeypatch):
    # qgemv addresses biases with the scales' row stride.
    monkeypatch.setenv("QFUSE_TIER", "fast")
    monkeypatch.setenv("QFUSE_QMATMUL", "1")
    qt = QuantizedTensor.from_float(torch.randn(70, 256, device=DEV), 64, 4)
    buf = torch.zeros(70, 12, dtype=qt.biases.dtype, device=DEV)
    buf[:, 4:8] = qt.biases
    qt2 = QuantizedTensor(qt.packed, qt.scales, buf[:, 4:8], 64, 4)
    x = torch.randn(1, 256, device=DEV)
    y = ops.linear(x, qt2)
    assert levers.counters().get("qmatmul") == 1
    torch.testing.assert_close(y, reference.linear(x, qt2), atol=1e-3, rtol=1e-3)
