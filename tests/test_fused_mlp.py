"""Quantized fused MLP (deterministic variant, bf16 on tensor cores) under the CPU
interpreter: mixed bit widths and group sizes, both activations, with and without
residual, split K."""

import pytest
import torch

from qfuse import levers, ops, reference
from qfuse.quant import QuantizedTensor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
fm = pytest.importorskip("qfuse.kernels.fused_mlp")


def weights(H, I, specs, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = ((I, H), (I, H), (H, I))
    return [QuantizedTensor.from_float(
        (torch.randn(s, generator=g) * s[1] ** -0.5).bfloat16().to(DEVICE), group, bits)
        for s, (bits, group) in zip(shapes, specs)]


@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("specs", [((4, 64), (4, 64), (4, 64)), ((4, 64), (8, 32), (4, 128))])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("split", [1, 2])
def test_within_twice_compat_error(act, M, specs, with_residual, split):
    H, I = 128, 384
    gate, up, down = weights(H, I, specs, seed=M)
    x = torch.randn(M, H, device=DEVICE).bfloat16()
    res = torch.randn(M, H, device=DEVICE).bfloat16() if with_residual else None
    out = fm.fused_mlp(x, gate, up, down, act, res, split=split)
    deq = [w.dequantize(torch.float32) for w in (gate, up, down)]
    ref32 = reference.mlp(x.float(), *deq, act, None if res is None else res.float())
    compat = reference.mlp(x, gate, up, down, act, res)
    err = (out.float() - ref32).abs().max().item()
    err_compat = (compat.float() - ref32).abs().max().item()
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


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("specs", [((4, 64), (4, 64), (4, 64)), ((4, 64), (8, 32), (4, 128)),
                                   ((8, 64), (8, 64), (8, 32))])
@pytest.mark.parametrize("with_residual", [False, True])
def test_atomic_variant_within_twice_compat_error(M, specs, with_residual):
    H, I = 128, 384
    gate, up, down = weights(H, I, specs, seed=10 + M)
    x = torch.randn(M, H, device=DEVICE).bfloat16()
    res = torch.randn(M, H, device=DEVICE).bfloat16() if with_residual else None
    out = fm.fused_mlp_atomic(x, gate, up, down, "gelu_tanh", res)
    deq = [w.dequantize(torch.float32) for w in (gate, up, down)]
    ref32 = reference.mlp(x.float(), *deq, "gelu_tanh", None if res is None else res.float())
    compat = reference.mlp(x, gate, up, down, "gelu_tanh", res)
    err = (out.float() - ref32).abs().max().item()
    err_compat = (compat.float() - ref32).abs().max().item()
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)


def test_variant_lever(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    gate, up, down = weights(64, 128, ((4, 64),) * 3, seed=0)
    x = torch.randn(1, 64, device=DEVICE).bfloat16()
    calls = []
    monkeypatch.setattr(fm, "fused_mlp_atomic", lambda *a: calls.append("atomic") or x)
    with torch.no_grad():
        ops.mlp(x, gate, up, down, "silu")
        monkeypatch.setenv("QFUSE_FUSED_MLP_VARIANT", "atomic")
        ops.mlp(x, gate, up, down, "silu")
        monkeypatch.setenv("QFUSE_FUSED_MLP_VARIANT", "fastest")
        with pytest.raises(ValueError, match="QFUSE_FUSED_MLP_VARIANT"):
            ops.mlp(x, gate, up, down, "silu")
    assert calls == ["atomic"] and levers.counters()["fused_mlp"] == 3


def test_inconsistent_weights_raise():
    gate, up, down = weights(64, 128, ((4, 64),) * 3, seed=0)
    with pytest.raises(ValueError, match="MLP"):
        fm.fused_mlp(torch.randn(1, 64, device=DEVICE).bfloat16(), gate, up, gate, "silu")
    with pytest.raises(ValueError, match="rows"):
        fm.fused_mlp(torch.randn(17, 64, device=DEVICE).bfloat16(), gate, up, down, "silu")


def test_residual_shapes():
    """A residual of x's shape works with 3-dim x in both variants; the atomic variant
    never adds into the caller's tensor; a broadcast residual takes the reference."""
    gate, up, down = weights(64, 128, ((4, 64),) * 3, seed=2)
    x = torch.randn(2, 1, 64, device=DEVICE).bfloat16()
    res = torch.randn(2, 1, 64, device=DEVICE).bfloat16()
    res_copy = res.clone()
    compat = reference.mlp(x, gate, up, down, "silu", res)
    for fn in (fm.fused_mlp, fm.fused_mlp_atomic):
        out = fn(x, gate, up, down, "silu", res)
        assert out.shape == x.shape
        assert (out.float() - compat.float()).abs().max().item() <= 0.05
    assert torch.equal(res, res_copy)
    with pytest.raises(ValueError, match="residual"):
        fm.fused_mlp_atomic(x, gate, up, down, "silu", res[0])
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
    deq = [w.dequantize(torch.float32) for w in (gate, up, down)]
    ref32 = reference.mlp(x.float(), *deq, "silu", res.float())
    assert out.dtype == dtype and not out.isnan().any()
    if dtype == torch.float32:
        # compat is the float32 reference itself here: only the order of the sums differs
        torch.testing.assert_close(out, ref32, rtol=1e-5, atol=1e-5)
    else:
        compat = reference.mlp(x, gate, up, down, "silu", res)
        err = (out.float() - ref32).abs().max().item()
        err_compat = (compat.float() - ref32).abs().max().item()
        assert err <= 2 * err_compat, (err, err_compat)
