"""Quantized fused MLP (bf16 on tensor cores) under the CPU interpreter and on the GPU
(marked `gpu`: the Gemma 3 12B shape): mixed bit widths and group sizes, both
activations, with and without residual, split K; bitwise reproducible."""

import pytest
import torch

from qfuse import levers, ops, reference
from qfuse.quant import QuantizedTensor
from qfuse.testing import kernel_device, mlp_errors

DEVICE = kernel_device()
fm = pytest.importorskip("qfuse.kernels.products.fused_mlp")


def weights(H, I, specs, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = ((I, H), (I, H), (H, I))
    return [QuantizedTensor.from_float(
        (torch.randn(s, generator=g) * s[1] ** -0.5).bfloat16().to(DEVICE), group, bits)
        for s, (bits, group) in zip(shapes, specs)]


MIXED = ((4, 64), (8, 32), (4, 128))
# The GPU's: Gemma 3 12B's H and I, gelu_tanh, with a residual, the kernel's split.
GEMMA_CASES = [pytest.param("gelu_tanh", 3840, 15360, M, tuple((b, 64) for b in bits), True,
                            None, marks=pytest.mark.gpu)
               for M in (1, 16) for bits in [(4, 4, 4), (4, 8, 4), (8, 8, 8)]]
CASE_NAMES = "act,H,I,M,specs,with_residual,split"


@pytest.mark.parametrize(CASE_NAMES, [
    *((act, 128, 384, M, specs, with_residual, split) for act in ("gelu_tanh", "silu")
      for M in (1, 3) for specs in (((4, 64),) * 3, MIXED) for with_residual in (False, True)
      for split in (1, 2)),
    *GEMMA_CASES])
def test_within_twice_compat_error(act, H, I, M, specs, with_residual, split):
    gate, up, down = weights(H, I, specs, seed=M)
    x = torch.randn(M, H, device=DEVICE).bfloat16()
    res = torch.randn(M, H, device=DEVICE).bfloat16() if with_residual else None
    out = fm.fused_mlp(x, gate, up, down, act, res, split=split)
    err, err_compat = mlp_errors(out, x, gate, up, down, act, res)
    assert not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)
    assert torch.equal(out, fm.fused_mlp(x, gate, up, down, act, res, split=split))


def test_dispatch(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    gate, up, down = weights(64, 128, ((4, 64),) * 3, seed=0)
    x = torch.randn(1, 64, device=DEVICE).bfloat16()
    with torch.no_grad():
        ops.mlp(x, gate, up, down, "silu")
        assert levers.counters()["fused_mlp"] == 1
        levers.reset_counters()
        monkeypatch.setenv("QFUSE_FUSED_MLP", "0")
        ops.mlp(x, gate, up, down, "silu")  # three quantized matmuls and the activation
    assert "fused_mlp" not in levers.counters() and levers.counters()["qmatmul"] == 3


def test_inconsistent_weights_raise():
    gate, up, down = weights(64, 128, ((4, 64),) * 3, seed=0)
    with pytest.raises(ValueError, match="MLP"):
        fm.fused_mlp(torch.randn(1, 64, device=DEVICE).bfloat16(), gate, up, gate, "silu")
    with pytest.raises(ValueError, match="rows"):
        fm.fused_mlp(torch.randn(17, 64, device=DEVICE).bfloat16(), gate, up, down, "silu")


def test_residual_shapes():
    """A residual of x's shape works with 3-dim x and is never added into in place; a
    broadcast residual takes the reference."""
    gate, up, down = weights(64, 128, ((4, 64),) * 3, seed=2)
    x = torch.randn(2, 1, 64, device=DEVICE).bfloat16()
    res = torch.randn(2, 1, 64, device=DEVICE).bfloat16()
    res_copy = res.clone()
    compat = reference.mlp(x, gate, up, down, "silu", res)
    out = fm.fused_mlp(x, gate, up, down, "silu", res)
    assert out.shape == x.shape
    assert (out.float() - compat.float()).abs().max().item() <= 0.05
    assert torch.equal(res, res_copy)
    assert "residual" in fm.unsupported_reason(x, gate, up, down, res[0, 0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("M", [1, 4])
def test_fp16_fp32_rows_on_the_gemv(dtype, M):
    """fp16/fp32 activations (up to 4 rows) take the CUDA-core GEMV kernels, rounding as
    compat rounds in that dtype."""
    torch.manual_seed(M)
    H, I = 128, 256
    gate, up, down = weights(H, I, ((4, 64), (8, 32), (4, 64)), seed=M)
    gate, up, down = (type(w)(w.packed, w.scales.to(dtype), w.biases.to(dtype), w.group_size,
                              w.bits) for w in (gate, up, down))
    x = torch.randn(M, H, device=DEVICE).to(dtype)
    res = torch.randn(M, H, device=DEVICE).to(dtype)
    out = fm.fused_mlp(x, gate, up, down, "silu", res)
    assert out.dtype == dtype and not out.isnan().any()
    if dtype == torch.float32:
        # compat is the float32 reference itself here: only the order of the sums differs
        deq = [w.dequantize(torch.float32) for w in (gate, up, down)]
        ref32 = reference.mlp(x.float(), *deq, "silu", res.float())
        torch.testing.assert_close(out, ref32, rtol=1e-5, atol=1e-5)
    else:
        err, err_compat = mlp_errors(out, x, gate, up, down, "silu", res)
        assert err <= 2 * err_compat, (err, err_compat)
