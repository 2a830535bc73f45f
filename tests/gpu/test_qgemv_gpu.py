"""The streaming CUDA-core GEMV (`qmatmul.qgemv`) on the GPU at real sizes, bf16 and fp16:
within twice the compat path's error against float32, deterministic through the split-K
semaphores, every launch shape of the A/B sweep, and replayable from a CUDA graph."""

import pytest
import torch

from qfuse import reference
from qfuse.kernels.qmatmul import qgemv, qmatmul
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
@pytest.mark.parametrize("M,dtype", [(1, torch.bfloat16), (4, torch.float16)])
def test_big_shapes(bits, group, M, dtype):
    x, w = case(M, 15360, 3840, bits, group, seed=M + bits + group, dtype=dtype)
    out = qgemv(x, w)
    check(out, x, w)
    assert torch.equal(out, qgemv(x, w))


@pytest.mark.parametrize("shape", [dict(block_n=256, groups_per_iter=1, iters=2, num_warps=4),
                                   dict(block_n=128, groups_per_iter=2, iters=4, num_warps=4),
                                   dict(split=1), dict(split=7)])
@pytest.mark.parametrize("N,K", [(3840, 15360), (4097, 4096), (130, 1088)])
def test_launch_shapes_and_odd_sizes(shape, N, K):
    x, w = case(1, N, K, 4, 64, seed=N)
    res = torch.randn(1, N, device="cuda").bfloat16()
    bias = torch.randn(N, device="cuda").bfloat16()
    out = qgemv(x, w, bias, res, **shape)
    ref = res + reference.linear(x, w, bias)
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 0.05 * ref.float().abs().max().item(), err
    assert torch.equal(out, qgemv(x, w, bias, res, **shape))


def test_cuda_graph_replay_through_dispatch():
    x, w = case(1, 15360, 3840, 4, 64, seed=3)
    eager = qmatmul(x, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        qmatmul(x, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qmatmul(x, w)
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
