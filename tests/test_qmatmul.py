"""Quantized GEMV (decode path) under the CPU interpreter and on the GPU (marked `gpu`:
real sizes, bf16 one row and fp16 rows, every launch shape), against the compat path and
a float32 reference on the dequantized weight. Odd N, several K, 1–4 rows, 4/8 bits,
every group size, split K, bias and residual; bitwise reproducible."""

import pytest
import torch

from qfuse import levers, ops, reference
from qfuse.quant import QuantizedTensor
from qfuse.testing import kernel_device, linear_case, linear_errors

DEVICE = kernel_device()
qm = pytest.importorskip("qfuse.kernels.products.qmatmul")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("M,N,K", [(1, 5, 128), (3, 123, 256), (4, 70, 384)])
@pytest.mark.parametrize("split_k", [1, 2])
def test_within_twice_compat_error(bits, group_size, M, N, K, split_k):
    torch.manual_seed(M * N + K)
    w = QuantizedTensor.from_float(torch.randn(N, K, device=DEVICE), group_size, bits)
    x = torch.randn(M, K, device=DEVICE).to(torch.float16)
    out = qm.qgemv(x, w, split=split_k)
    err, err_compat = linear_errors(out, x, w)
    assert not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)


@pytest.mark.parametrize("groups_per_iter", [2, 4])
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_several_groups_per_iteration(groups_per_iter, split_k):
    """7 groups of 32: tiles of 2 or 4 groups run past K and past each split's share."""
    torch.manual_seed(groups_per_iter + split_k)
    w = QuantizedTensor.from_float(torch.randn(37, 224, device=DEVICE), 32, 4)
    x = torch.randn(2, 224, device=DEVICE)
    torch.testing.assert_close(
        qm.qgemv(x, w, split=split_k, groups_per_iter=groups_per_iter),
        x @ w.dequantize(torch.float32).T, rtol=1e-5, atol=1e-4)


def test_fp32_is_accurate():
    w = QuantizedTensor.from_float(torch.randn(33, 192, device=DEVICE), 64, 4)
    x = torch.randn(2, 192, device=DEVICE)
    torch.testing.assert_close(qm.qgemv(x, w), x @ w.dequantize(torch.float32).T,
                               rtol=1e-5, atol=1e-4)


def test_dispatch_by_dtype_and_rows(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    w = QuantizedTensor.from_float(torch.randn(16, 64, device=DEVICE).bfloat16(), 64, 4)
    ops.linear(torch.randn(1, 64, device=DEVICE).half(), w)  # CUDA-core GEMV
    ops.linear(torch.randn(9, 64, device=DEVICE).half(), w)  # fp16, 9 rows: the reference
    ops.linear(torch.randn(9, 64, device=DEVICE).bfloat16(), w)  # bf16: tensor cores, any rows
    assert levers.counters() == {"qmatmul": 2, "ref:linear": 1}
    levers.reset_counters()
    monkeypatch.setenv("QFUSE_QMATMUL", "0")
    ops.linear(torch.randn(1, 64, device=DEVICE).bfloat16(), w)
    assert levers.counters() == {"ref:linear": 1}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 3])
def test_bias_and_residual_round_as_compat(dtype, M):
    """bias inside the product, the product rounded to x's dtype, then the residual added:
    within twice compat's error of the float32 result, and bitwise reproducible."""
    torch.manual_seed(M)
    N, K = 77, 320
    w = QuantizedTensor.from_float(torch.randn(N, K, device=DEVICE), 64, 4)
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    bias = torch.randn(N, device=DEVICE).to(dtype)
    res = torch.randn(M, N, device=DEVICE).to(dtype)
    out = qm.qgemv(x, w, bias, res, block_n=32, groups_per_iter=2, iters=1)
    err, err_compat = linear_errors(out, x, w, bias, res)
    assert out.dtype == dtype and not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)
    assert torch.equal(out, qm.qgemv(x, w, bias, res, block_n=32, groups_per_iter=2, iters=1))


def test_gemv_rejects_bad_inputs():
    w = QuantizedTensor.from_float(torch.randn(16, 128, device=DEVICE), 64, 4)
    with pytest.raises(ValueError, match="features"):
        qm.qgemv(torch.randn(1, 64, device=DEVICE), w)
    with pytest.raises(ValueError, match="rows"):
        qm.qgemv(torch.randn(5, 128, device=DEVICE), w)
    with pytest.raises(ValueError, match="bias"):
        qm.qgemv(torch.randn(1, 128, device=DEVICE), w, torch.zeros(15, device=DEVICE))


@pytest.mark.parametrize("bits", [4, 8])
def test_bf16_weights_round_as_compat(bits):
    """bf16: the GEMV multiplies compat's bf16 weights, so its outputs differ from compat's
    only where float32 sums in another order round to another bf16 (rare, one ulp)."""
    torch.manual_seed(bits)
    w = QuantizedTensor.from_float((torch.randn(256, 512, device=DEVICE) * 512**-0.5).bfloat16(),
                                   64, bits)
    x = torch.randn(1, 512, device=DEVICE).bfloat16()
    y, c = qm.qgemv(x, w).float(), reference.linear(x, w).float()
    assert (y == c).float().mean() >= 0.98
    assert ((y - c).abs() <= c.abs() * 2**-7).all()


def test_dispatch_of_zero_rows(monkeypatch):
    """No rows: an empty result of the right shape from the dispatch, whatever the dtype."""
    monkeypatch.setenv("QFUSE_TIER", "fast")
    w = QuantizedTensor.from_float(torch.randn(16, 64, device=DEVICE).bfloat16(), 64, 4)
    for dtype in (torch.bfloat16, torch.float16):
        y = ops.linear(torch.randn(0, 64, device=DEVICE).to(dtype), w)
        assert y.shape == (0, 16) and y.dtype == dtype


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("M,dtype", [(1, torch.bfloat16), (4, torch.float16)])
def test_gemv_big_shapes(bits, group, M, dtype):
    x, w = linear_case(M, 15360, 3840, bits, group, seed=M + bits + group, dtype=dtype,
                       device="cuda")
    out = qm.qgemv(x, w)
    err, err_compat = linear_errors(out, x, w)
    assert not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)
    assert torch.equal(out, qm.qgemv(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [
    {"block_n": 256, "groups_per_iter": 1, "iters": 2, "num_warps": 4},
    {"block_n": 128, "groups_per_iter": 2, "iters": 4, "num_warps": 4},
    {"split": 1}, {"split": 7}])
@pytest.mark.parametrize("N,K", [(3840, 15360), (4097, 4096), (130, 1088)])
def test_gemv_launch_shapes_and_odd_sizes(shape, N, K):
    x, w = linear_case(1, N, K, 4, 64, seed=N, device="cuda")
    res = torch.randn(1, N, device="cuda").bfloat16()
    bias = torch.randn(N, device="cuda").bfloat16()
    out = qm.qgemv(x, w, bias, res, **shape)
    err, err_compat = linear_errors(out, x, w, bias, res)
    assert not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)
    assert torch.equal(out, qm.qgemv(x, w, bias, res, **shape))
