"""The quantized matmul kernels and the fused MLP on the GPU at real sizes: the
tensor-core kernel (bf16) and the streaming CUDA-core GEMV (bf16 one row, fp16 rows):
within twice the compat path's error against float32, deterministic, correct when
split K reduces through the semaphores, and replayable from a CUDA graph."""

import pytest
import torch

from qfuse import reference
from qfuse.kernels.fused_mlp import fused_mlp, fused_mlp_atomic
from qfuse.kernels.qmatmul import qgemv, qmatmul
from qfuse.kernels.qmatmul_tc import qmatmul_tc
from qfuse.quant import QuantizedTensor


def case(M, N, K, bits, group, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = QuantizedTensor.from_float(
        (torch.randn(N, K, generator=g, device="cuda") * K**-0.5).bfloat16(), group, bits)
    return torch.randn(M, K, generator=g, device="cuda").to(dtype), w


def check(out, x, w, residual=None):
    ref32 = x.float() @ w.dequantize(torch.float32).T
    compat = reference.linear(x, w)
    if residual is not None:
        ref32, compat = ref32 + residual.float(), residual + compat
    err = (out.float() - ref32).abs().max().item()
    err_compat = (compat.float() - ref32).abs().max().item()
    assert not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("M", [1, 4, 16, 17, 64, 2048])
def test_big_shapes(bits, group, M):
    x, w = case(M, 15360 if M <= 64 else 4096, 3840, bits, group, seed=M + bits + group)
    out = qmatmul_tc(x, w)
    check(out, x, w)
    assert torch.equal(out, qmatmul_tc(x, w))
    if M > 16:  # prefill: dequantize once, then cuBLAS: the compat product itself
        assert torch.equal(out, reference.linear(x, w))


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("split", [1, 2, 8, 30])
@pytest.mark.parametrize("N,K", [(3840, 15360), (4097, 4096), (130, 1088)])
def test_split_k_and_odd_shapes(split, N, K, prefetch):
    x, w = case(3, N, K, 4, 64, seed=split)
    res = torch.randn(3, N, device="cuda").bfloat16()
    out = qmatmul_tc(x, w, residual=res, split=split, prefetch=prefetch)
    check(out, x, w, res)
    assert torch.equal(out, qmatmul_tc(x, w, residual=res, split=split, prefetch=prefetch))


@pytest.mark.parametrize("product", [qmatmul_tc, qmatmul], ids=["tensor_cores", "dispatch"])
def test_cuda_graph_replay(product):
    """qmatmul dispatches one bf16 row to the GEMV."""
    x, w = case(1, 15360, 3840, 4, 64, seed=3)
    eager = product(x, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        product(x, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = product(x, w)
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.parametrize("variant", ["deterministic", "atomic"])
@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("bits", [(4, 4, 4), (4, 8, 4), (8, 8, 8)])
def test_fused_mlp_gemma_shape(M, bits, variant):
    H, I = 3840, 15360
    g = torch.Generator(device="cuda").manual_seed(M)
    ws = [QuantizedTensor.from_float(
        (torch.randn(*s, generator=g, device="cuda") * s[1] ** -0.5).bfloat16(), 64, b)
        for s, b in zip(((I, H), (I, H), (H, I)), bits)]
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    res = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    mlp = fused_mlp if variant == "deterministic" else fused_mlp_atomic
    out = mlp(x, *ws, "gelu_tanh", res)
    deq = [w.dequantize(torch.float32) for w in ws]
    ref32 = reference.mlp(x.float(), *deq, "gelu_tanh", res.float())
    compat = reference.mlp(x, *ws, "gelu_tanh", res)
    err = (out.float() - ref32).abs().max().item()
    err_compat = (compat.float() - ref32).abs().max().item()
    assert err <= 2 * err_compat, (err, err_compat)
    if variant == "deterministic":
        assert torch.equal(out, fused_mlp(x, *ws, "gelu_tanh", res))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("M,dtype", [(1, torch.bfloat16), (4, torch.float16)])
def test_gemv_big_shapes(bits, group, M, dtype):
    x, w = case(M, 15360, 3840, bits, group, seed=M + bits + group, dtype=dtype)
    out = qgemv(x, w)
    check(out, x, w)
    assert torch.equal(out, qgemv(x, w))


@pytest.mark.parametrize("shape", [dict(block_n=256, groups_per_iter=1, iters=2, num_warps=4),
                                   dict(block_n=128, groups_per_iter=2, iters=4, num_warps=4),
                                   dict(split=1), dict(split=7)])
@pytest.mark.parametrize("N,K", [(3840, 15360), (4097, 4096), (130, 1088)])
def test_gemv_launch_shapes_and_odd_sizes(shape, N, K):
    x, w = case(1, N, K, 4, 64, seed=N)
    res = torch.randn(1, N, device="cuda").bfloat16()
    bias = torch.randn(N, device="cuda").bfloat16()
    out = qgemv(x, w, bias, res, **shape)
    ref32 = res.float() + (x.float() @ w.dequantize(torch.float32).T + bias.float())
    compat = res + reference.linear(x, w, bias)
    err = (out.float() - ref32).abs().max().item()
    err_compat = (compat.float() - ref32).abs().max().item()
    assert not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)
    assert torch.equal(out, qgemv(x, w, bias, res, **shape))
