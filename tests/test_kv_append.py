"""KV append: one token per sequence written into a quantized cache, bit-exact with
`quant.quantize`, against the reference path, and (on the GPU) inside a CUDA graph."""

import pytest
import torch

from qfuse import levers, ops
from qfuse.quant import QuantizedTensor, quantize
from qfuse.testing import kernel_device

DEVICE = kernel_device()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kv_append_bit_exact_with_quantize(bits, dtype, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    B, H, N, D = 3, 2, 16, 128
    cache = QuantizedTensor.from_float(torch.randn(B, H, N, D, dtype=dtype, device=DEVICE), 32, bits)
    x = torch.randn(B, H, D, dtype=dtype, device=DEVICE) * 3
    x[0, 0, :32] = 0.5  # a constant group: the q0 == 0 branch
    x[1, 1, 32:64] = -torch.rand(32, device=DEVICE).to(dtype)  # all negative
    positions = torch.tensor([0, 7, 15], dtype=torch.int32, device=DEVICE)
    before = cache.packed.clone()
    ops.kv_append(x, positions, cache)
    assert levers.counters() == {"kv_append": 1}
    p, s, b = quantize(x, 32, bits)
    for i, pos in enumerate(positions.tolist()):
        assert torch.equal(cache.packed[i, :, pos].view(torch.int32), p[i].view(torch.int32))
        assert torch.equal(cache.scales[i, :, pos], s[i])
        assert torch.equal(cache.biases[i, :, pos], b[i])
    untouched = torch.ones(B, N, dtype=torch.bool)
    untouched[torch.arange(B), positions.long()] = False
    assert torch.equal(cache.packed.view(torch.int32)[untouched.nonzero(as_tuple=True)[0], :,
                                                      untouched.nonzero(as_tuple=True)[1]],
                       before.view(torch.int32)[untouched.nonzero(as_tuple=True)[0], :,
                                                untouched.nonzero(as_tuple=True)[1]])


def test_kv_append_reference_path_matches_kernel(monkeypatch):
    x = torch.randn(2, 2, 64, dtype=torch.float16, device=DEVICE)
    positions = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)
    caches = [QuantizedTensor.from_float(torch.zeros(2, 2, 4, 64, dtype=torch.float16,
                                                     device=DEVICE), 64, 4) for _ in range(2)]
    monkeypatch.setenv("QFUSE_TIER", "compat")
    ops.kv_append(x, positions, caches[0])
    monkeypatch.setenv("QFUSE_TIER", "fast")
    ops.kv_append(x, positions, caches[1])
    assert levers.counters() == {"ref:kv_append": 1, "kv_append": 1}
    assert torch.equal(caches[0].packed.view(torch.int32), caches[1].packed.view(torch.int32))
    assert torch.equal(caches[0].scales, caches[1].scales)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_kv_append_graph_capturable_and_exact(bits, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    cache = QuantizedTensor.from_float(torch.randn(4, 8, 64, 256, device="cuda",
                                                   dtype=torch.bfloat16), 64, bits)
    x = torch.randn(4, 8, 256, device="cuda", dtype=torch.bfloat16) * 5
    pos = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device="cuda")
    ops.kv_append(x, pos, cache)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.kv_append(x, pos, cache)
    pos.copy_(torch.tensor([60, 61, 62, 63], dtype=torch.int32))
    x.copy_(torch.randn_like(x) * 7)
    graph.replay()
    torch.cuda.synchronize()
    p, s, b = quantize(x, 64, bits)
    for i in range(4):
        assert torch.equal(cache.packed[i, :, 60 + i].view(torch.int32), p[i].view(torch.int32))
        assert torch.equal(cache.scales[i, :, 60 + i], s[i])
        assert torch.equal(cache.biases[i, :, 60 + i], b[i])


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_kv_append_bit_exact_many_draws(bits, group_size, dtype, monkeypatch):
    """20 seeded draws of varied magnitude; any mismatch reports where and what."""
    monkeypatch.setenv("QFUSE_TIER", "fast")
    B, H, N, D = 8, 8, 4, 256
    g = torch.Generator(device="cuda").manual_seed(bits * 1000 + group_size)
    for draw in range(20):
        cache = QuantizedTensor.from_float(torch.zeros(B, H, N, D, device="cuda", dtype=dtype),
                                           group_size, bits)
        scale = 10.0 ** (draw % 7 - 3)
        x = (torch.randn(B, H, D, device="cuda", generator=g) * scale).to(dtype)
        pos = torch.randint(0, N, (B,), device="cuda", generator=g, dtype=torch.int32)
        ops.kv_append(x, pos, cache)
        p, s, b = quantize(x, group_size, bits)
        idx = torch.arange(B, device="cuda")
        got_p = cache.packed.view(torch.int32)[idx, :, pos.long()]
        got_s = cache.scales[idx, :, pos.long()]
        got_b = cache.biases[idx, :, pos.long()]
        bad = (got_s != s) | (got_b != b)
        assert not bad.any(), (draw, bad.nonzero()[:3].tolist(), got_s[bad][:3], s[bad][:3],
                               got_b[bad][:3], b[bad][:3])
        bad_p = got_p != p.view(torch.int32)
        assert not bad_p.any(), (draw, bad_p.nonzero()[:3].tolist())
