"""The tensor-core quantized matmul (bf16) under the CPU interpreter: against a float32
reference on the dequantized weight and the compat path (dequantize to bf16, then
F.linear), for decode and prefill row counts, odd N, K not a multiple of the tile,
every group size, 4 and 8 bits, split K (the semaphore reduction), bias and residual."""

import pytest
import torch

from qfuse import reference
from qfuse.quant import QuantizedTensor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
tc = pytest.importorskip("qfuse.kernels.qmatmul_tc")
splitk = pytest.importorskip("qfuse.kernels.splitk")


def case(M, N, K, bits, group, seed):
    g = torch.Generator().manual_seed(seed)
    w = QuantizedTensor.from_float((torch.randn(N, K, generator=g) * K**-0.5).bfloat16().to(DEVICE),
                                   group, bits)
    x = torch.randn(M, K, generator=g).bfloat16().to(DEVICE)
    return x, w


def errors(out, x, w, bias=None, residual=None):
    ref32 = x.float() @ w.dequantize(torch.float32).T
    if bias is not None:
        ref32 = ref32 + bias.float()
    if residual is not None:
        ref32 = ref32 + residual.float()
    compat = reference.linear(x, w, bias)
    if residual is not None:
        compat = residual + compat
    return (out.float() - ref32).abs().max().item(), (compat.float() - ref32).abs().max().item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("M,N,K,split", [(1, 64, 256, 1), (3, 70, 384, 2), (1, 130, 512, 4),
                                         (16, 96, 256, None)])
@pytest.mark.parametrize("prefetch", [True, False])
def test_within_twice_compat_error(bits, group, M, N, K, split, prefetch):
    if K % group:
        pytest.skip("K must be a multiple of the group")
    x, w = case(M, N, K, bits, group, seed=M * N + K + bits)
    out = tc.qmatmul_tc(x, w, split=split, block_n=64, prefetch=prefetch)
    err, err_compat = errors(out, x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    assert not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)


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
    err, err_compat = errors(out, x, w, bias, res)
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
