"""Decode attention on the GPU: bf16/fp16, every head dim, GQA ratios, big lengths,
reproducibility, batch independence, CUDA-graph capture with growing lengths."""

import pytest
import torch

from qfuse import levers, ops
from qfuse.kernels.decode_attention import decode_attention_quantized_kv
from qfuse.quant import QuantizedTensor

from qfuse.testing import errors, make_case


def run(q, k, v, lengths, scale, window=None, softcap=None, path=None):
    out = torch.full_like(q, float("nan"))
    # "prefetch": the tensor-core kernel with scales/biases one tile ahead (opt-in)
    decode_attention_quantized_kv(q, k, v, lengths, scale, window, softcap, out=out,
                                  _path=None if path == "prefetch" else path,
                                  _prefetch=path == "prefetch")
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,path", [(0, None), (4, "cuda_cores"), (4, "tensor_cores"),
                                       (8, "cuda_cores"), (8, "tensor_cores"), (4, "prefetch"),
                                       (8, "prefetch"), (4, "codes"), (8, "codes")])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 8, 8), (128, 32, 8), (256, 16, 8), (512, 8, 1)])
def test_within_twice_compat_error(dtype, bits, path, D, Hq, Hkv):
    """cuda_cores applies to G <= 2 (64/8/8 and 256/16/8), codes (the default for
    quantized caches) to ≥ 16 words per token and R·D ≤ 8192 (not kv4 D=64, nor 512/8/1
    at g=64: R=64); other shapes fall back."""
    q, k, v, lengths = make_case(5, Hq, Hkv, D, 4200, [1, 97, 1025, 4097, 0], bits, dtype, "cuda")
    out = run(q, k, v, lengths, D**-0.5, path=path)
    assert not out.isnan().any()
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    err, err_compat = errors(out, q, k, v, lengths, D**-0.5)
    assert err <= 2 * err_compat, (err, err_compat)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("Hq,Hkv,D,group_size", [(2, 1, 512, 64), (4, 1, 64, 32), (8, 2, 128, 128)])
def test_codes_kernel_other_shapes(bits, Hq, Hkv, D, group_size):
    """Head dims 512 (64 tokens per tile) and 64 (kv8 only: kv4 falls back), group sizes
    32 and 128, G = 4."""
    q, k, v, lengths = make_case(3, Hq, Hkv, D, 3000, [2999, 1, 1500], bits, torch.bfloat16,
                                 "cuda", group_size=group_size)
    out = run(q, k, v, lengths, D**-0.5, path="codes")
    err, err_compat = errors(out, q, k, v, lengths, D**-0.5)
    assert not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("window,softcap", [(1024, None), (None, 50.0), (700, 30.0)])
@pytest.mark.parametrize("path", ["cuda_cores", "tensor_cores", "prefetch", "codes"])
def test_window_softcap_groups(group_size, window, softcap, path):
    q, k, v, lengths = make_case(3, 16, 8, 256, 3000, [2999, 600, 1500], 4, torch.bfloat16,
                                 "cuda", group_size=group_size)
    out = run(q, k, v, lengths, 0.0625, window, softcap, path)
    err, err_compat = errors(out, q, k, v, lengths, 0.0625, window, softcap)
    assert not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)


@pytest.mark.parametrize("path", [None, "tensor_cores"])
def test_long_context_128k(path):
    q, k, v, lengths = make_case(1, 16, 8, 256, 131072, [131072], 4, torch.bfloat16, "cuda")
    out = run(q, k, v, lengths, 0.0625, path=path)
    err, err_compat = errors(out, q, k, v, lengths, 0.0625)
    assert err <= 2 * err_compat, (err, err_compat)


@pytest.mark.parametrize("Hq,D,path", [(32, 128, None), (16, 256, None), (16, 256, "tensor_cores")])
def test_reproducible_and_batch_independent(Hq, D, path):
    q, k, v, lengths = make_case(8, Hq, 8, D, 5000, [4999, 3, 77, 1024, 2048, 4097, 1, 256],
                                 4, torch.bfloat16, "cuda")
    a, b = run(q, k, v, lengths, 0.088, path=path), run(q, k, v, lengths, 0.088, path=path)
    assert torch.equal(a, b)
    for i in (0, 5):
        ki = QuantizedTensor(k.packed[i:i + 1], k.scales[i:i + 1], k.biases[i:i + 1], 64, 4)
        vi = QuantizedTensor(v.packed[i:i + 1], v.scales[i:i + 1], v.biases[i:i + 1], 64, 4)
        assert torch.equal(run(q[i:i + 1], ki, vi, lengths[i:i + 1], 0.088, path=path)[0], a[i])


def test_cuda_graph_replay_with_growing_lengths(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    q, k, v, lengths = make_case(2, 16, 8, 256, 2048, [100, 500], 4, torch.bfloat16, "cuda")
    static_len = lengths.clone()
    ops.decode_attention(q, k, v, static_len, 0.0625)  # warm-up compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.decode_attention(q, k, v, static_len, 0.0625)
    for n in ([100, 500], [101, 777], [1000, 1300]):
        static_len.copy_(torch.tensor(n, dtype=torch.int32))
        # make the newly valid slots real data (make_case filled them with NaN)
        for t in (k, v):
            fresh = QuantizedTensor.from_float(torch.randn(2, 8, 2048, 256, device="cuda",
                                                           dtype=torch.bfloat16), 64, 4)
            t.packed.copy_(fresh.packed)
            t.scales.copy_(fresh.scales)
            t.biases.copy_(fresh.biases)
        graph.replay()
        torch.cuda.synchronize()
        eager = decode_attention_quantized_kv(q, k, v, static_len, 0.0625)
        assert torch.equal(out, eager)
    assert levers.counters()["decode_attention"] >= 2


@pytest.mark.parametrize("bits", [4, 8])
def test_kv_append_graph_capturable_and_exact(bits, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    from qfuse.quant import quantize

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


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kv_append_bit_exact_many_draws(bits, group_size, dtype, monkeypatch):
    """20 seeded draws of varied magnitude; any mismatch reports where and what."""
    monkeypatch.setenv("QFUSE_TIER", "fast")
    from qfuse.quant import quantize

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
