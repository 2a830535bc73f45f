"""The tensor-core quantized matmul (bf16) under the CPU interpreter and on the GPU
(marked `gpu`: real sizes): against a float32 reference on the dequantized weight and the
compat path (dequantize to bf16, then F.linear), for decode and prefill row counts, odd
N, K not a multiple of the tile, every group size, 4 and 8 bits, split K (the semaphore
reduction), bias and residual; deterministic, prefill the compat product itself, and
replayable from a CUDA graph."""

import pytest
import torch

from qfuse import reference
from qfuse.testing import kernel_device, linear_case, linear_errors

DEVICE = kernel_device()
tc = pytest.importorskip("qfuse.kernels.products.qmatmul_tc")
splitk = pytest.importorskip("qfuse.kernels.products.splitk")


def case(M, N, K, bits, group, seed):
    return linear_case(M, N, K, bits, group, seed, device=DEVICE)


# M, N, K, split, block_n, prefetch (None: the kernel's choice). The GPU's: the Gemma 3
# 12B MLP's N and K, decode rows and prefill (2048 rows).
CASES = [*((M, N, K, split, 64, prefetch)
           for M, N, K, split in [(1, 64, 256, 1), (3, 70, 384, 2), (1, 130, 512, 4),
                                  (16, 96, 256, None)]
           for prefetch in (True, False)),
         *(pytest.param(M, 15360 if M <= 64 else 4096, 3840, None, None, None,
                        marks=pytest.mark.gpu) for M in [1, 4, 16, 17, 64, 2048])]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("M,N,K,split,block_n,prefetch", CASES)
def test_within_twice_compat_error(bits, group, M, N, K, split, block_n, prefetch):
    if K % group:
        pytest.skip("K must be a multiple of the group")
    x, w = case(M, N, K, bits, group, seed=M * N + K + bits)
    out = tc.qmatmul_tc(x, w, split=split, block_n=block_n, prefetch=prefetch)
    err, err_compat = linear_errors(out, x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    assert not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)
    assert torch.equal(out, tc.qmatmul_tc(x, w, split=split, block_n=block_n, prefetch=prefetch))
    if M > 16:  # prefill: dequantize once, then cuBLAS: the compat product itself
        assert torch.equal(out, reference.linear(x, w))


def test_split_does_not_change_the_result_beyond_rounding_and_is_deterministic():
    x, w = case(2, 64, 512, 4, 64, seed=5)
    a = tc.qmatmul_tc(x, w, split=1, block_n=64)
    b = tc.qmatmul_tc(x, w, split=4, block_n=64)
    assert torch.equal(b, tc.qmatmul_tc(x, w, split=4, block_n=64))
    # float32 partial sums in another order: equal up to the final bf16 rounding
    assert (a.float() - b.float()).abs().max().item() <= 2 * a.float().abs().max().item() / 256
    # the semaphores were reset by the last split: a second call still reduces
    assert torch.equal(splitk.semaphores(x.device)[:8], torch.zeros(8, dtype=torch.int32,
                                                                    device=x.device))


def test_bias_and_residual():
    x, w = case(3, 64, 256, 4, 64, seed=7)
    bias = torch.randn(64).bfloat16().to(DEVICE)
    res = torch.randn(3, 64).bfloat16().to(DEVICE)
    out = tc.qmatmul_tc(x, w, bias, res, split=2, block_n=64)
    err, err_compat = linear_errors(out, x, w, bias, res)
    assert err <= 2 * err_compat, (err, err_compat)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_dequantize_bf16_is_bit_identical(bits, group):
    _, w = case(1, 70, 640 if group != 64 else 384, bits, group, seed=bits + group)
    assert torch.equal(tc.dequantize_bf16(w), w.dequantize(torch.bfloat16))


def test_prefill_is_the_compat_product():
    x, w = case(17, 70, 384, 4, 64, seed=9)
    bias, res = torch.randn(70).bfloat16().to(DEVICE), torch.randn(17, 70).bfloat16().to(DEVICE)
    assert torch.equal(tc.qmatmul_tc(x, w, bias, res), res + reference.linear(x, w, bias))


def test_bad_inputs_raise():
    x, w = case(1, 64, 256, 4, 64, seed=1)
    with pytest.raises(ValueError, match="features"):
        tc.qmatmul_tc(x[:, :128], w)
    with pytest.raises(ValueError, match="bias"):
        tc.qmatmul_tc(x, w, torch.zeros(63, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="residual"):
        tc.qmatmul_tc(x, w, residual=torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE))
    assert "bf16" in tc.unsupported_reason(x.half(), w)


def test_strided_bias_and_dtype_checks():
    x, w = case(2, 64, 256, 4, 64, seed=11)
    wide = torch.randn(128).bfloat16().to(DEVICE)
    out = tc.qmatmul_tc(x, w, wide[::2])
    assert torch.equal(out, tc.qmatmul_tc(x, w, wide[::2].contiguous()))
    with pytest.raises(ValueError, match="bias"):
        tc.qmatmul_tc(x, w, wide[:64].float())
    with pytest.raises(ValueError, match="residual"):
        tc.qmatmul_tc(x, w, residual=torch.zeros(2, 64, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("split", [1, 2, 8, 30])
@pytest.mark.parametrize("N,K", [(3840, 15360), (4097, 4096), (130, 1088)])
def test_split_k_and_odd_shapes(split, N, K, prefetch):
    x, w = linear_case(3, N, K, 4, 64, seed=split, device="cuda")
    res = torch.randn(3, N, device="cuda").bfloat16()
    out = tc.qmatmul_tc(x, w, residual=res, split=split, prefetch=prefetch)
    err, err_compat = linear_errors(out, x, w, residual=res)
    assert not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)
    assert torch.equal(out, tc.qmatmul_tc(x, w, residual=res, split=split, prefetch=prefetch))


@pytest.mark.gpu
@pytest.mark.parametrize("product", ["tensor_cores", "dispatch"])
def test_cuda_graph_replay(product):
    """qmatmul dispatches one bf16 row to the GEMV."""
    from qfuse.kernels.products.qmatmul import qmatmul

    product = {"tensor_cores": tc.qmatmul_tc, "dispatch": qmatmul}[product]
    x, w = linear_case(1, 15360, 3840, 4, 64, seed=3, device="cuda")
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
