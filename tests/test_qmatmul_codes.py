"""The codes product (tensor cores over raw 4/8-bit codes, scales factored out of each
group's sum) under the CPU interpreter in fp16, or on the GPU: against float64 with the
2×-compat-error rule, odd shapes, partial tiles, split K, bias and residual,
reproducibility, bad inputs."""

import pytest
import torch

from qfuse import reference
from qfuse.quant import QuantizedTensor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
qc = pytest.importorskip("qfuse.kernels.qmatmul_codes")
DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _errors(out, x, w, bias=None, res=None):
    """(kernel error, compat error) against float64 on the dequantized weight."""
    ref = x.double() @ w.dequantize(torch.float32).double().T
    compat = reference.linear(x, w, bias)
    if bias is not None:
        ref = ref + bias.double()
    if res is not None:
        ref = ref + res.double()
        compat = res + compat
    return ((out.double() - ref).abs().max().item(),
            (compat.double() - ref).abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("M,N,K", [(1, 5, 128), (3, 123, 256), (4, 70, 384), (7, 33, 640)])
def test_within_twice_compat_error(dtype, bits, group_size, M, N, K):
    if K % group_size:
        pytest.skip("K not a multiple of the group")
    torch.manual_seed(M * N + K + bits)
    w = QuantizedTensor.from_float(torch.randn(N, K, device=DEVICE) * K**-0.5, group_size, bits)
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    out = qc.qmatmul_codes(x, w, block_n=32 if DEVICE == "cpu" else None)
    err, err_compat = _errors(out, x, w)
    assert out.dtype == dtype and out.shape == (M, N) and not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)


@pytest.mark.parametrize("stages", [0, 3])
@pytest.mark.parametrize("iters,split", [(1, None), (2, None), (None, 3), (3, None)])
def test_split_and_partial_tiles(iters, split, stages):
    """K = 7 tiles of 16 words plus a partial one; tiles per program 1-3: programs run
    past K and the last split is short."""
    torch.manual_seed(11)
    N, K = 45, 8 * 16 * 7 + 64  # 4-bit: 120 words = 7.5 tiles of 16
    w = QuantizedTensor.from_float(torch.randn(N, K, device=DEVICE) * K**-0.5, 64, 4)
    x = torch.randn(2, K, device=DEVICE).half()
    out = qc.qmatmul_codes(x, w, block_n=16, tile_words=16, iters=iters, split=split,
                           stages=stages)
    err, err_compat = _errors(out, x, w)
    assert err <= 2 * err_compat, (err, err_compat)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_residual_and_reproducible(dtype):
    torch.manual_seed(5)
    M, N, K = 3, 77, 320
    w = QuantizedTensor.from_float(torch.randn(N, K, device=DEVICE) * K**-0.5, 64, 4)
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    bias = torch.randn(N, device=DEVICE).to(dtype)
    res = torch.randn(M, N, device=DEVICE).to(dtype)
    kw = {"block_n": 32, "tile_words": 16, "iters": 1}
    out = qc.qmatmul_codes(x, w, bias, res, **kw)
    err, err_compat = _errors(out, x, w, bias, res)
    assert err <= 2 * err_compat, (err, err_compat)
    assert torch.equal(out, qc.qmatmul_codes(x, w, bias, res, **kw))


def test_rows_do_not_change_each_other():
    """A row's result does not depend on the other rows of the call (the columns of
    the block-diagonal x operand are independent sums)."""
    torch.manual_seed(2)
    w = QuantizedTensor.from_float(torch.randn(40, 256, device=DEVICE) * 0.06, 64, 4)
    x = torch.randn(4, 256, device=DEVICE).half()
    both = qc.qmatmul_codes(x, w, block_n=32)
    for m in range(4):
        assert torch.equal(both[m], qc.qmatmul_codes(x[m:m + 1], w, block_n=32)[0])


def test_rejects_bad_inputs():
    w = QuantizedTensor.from_float(torch.randn(16, 128, device=DEVICE), 64, 4)
    with pytest.raises(ValueError, match="features"):
        qc.qmatmul_codes(torch.randn(1, 64, device=DEVICE).half(), w)
    with pytest.raises(ValueError, match="rows"):
        qc.qmatmul_codes(torch.randn(65, 128, device=DEVICE).half(), w)
    with pytest.raises(ValueError, match="dtype"):
        qc.qmatmul_codes(torch.randn(1, 128, device=DEVICE), w)
    w3 = QuantizedTensor.from_float(torch.randn(16, 128, device=DEVICE), 64, 3)
    with pytest.raises(ValueError, match="3-bit"):
        qc.qmatmul_codes(torch.randn(1, 128, device=DEVICE).half(), w3)
