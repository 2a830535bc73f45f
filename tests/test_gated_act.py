"""The fused gated activation and its dispatch: under the Triton CPU interpreter
(fp16/fp32) and on the GPU (marked `gpu`).

Bitwise equality with eager PyTorch is a GPU property: there, inputs mix normal values,
large magnitudes (|x| up to 20 and beyond), denormals, signed zeros, ±inf and NaN; NaN
must appear exactly where PyTorch's output has NaN, and every other element must have
PyTorch's exact bit pattern. Under the interpreter the kernel swaps libdevice for
portable math, so there it must match the reference within the dtype's rounding.
"""

import pytest
import torch
import torch.nn.functional as F

from qfuse import levers, ops, reference
from qfuse.testing import assert_bitwise_equal, kernel_device

DEVICE = kernel_device()
SHAPES = [(1,), (5, 123), (3, 4231), (2, 3, 64)]
ACTS = ["gelu_tanh", "silu"]
# dtype → (rtol, atol) between kernel and reference. fp16: the portable tanh/exp
# may move act(a) by one ulp (2**-10 relative) before the product rounds again.
# fp32: two float32 tanh implementations differ by ~1 ulp of 1 (6e-8) where
# tanh is near -1, and 0.5·x·(1 + t) scales that by |x|/2 (≈8 for |x| ≈ 16):
# up to ~1e-6 absolute on outputs near zero, so atol 4e-6.
TOL = {torch.float32: (1e-5, 4e-6), torch.float16: (2.5e-3, 1e-4)}


def spelled_out(a, b, act):
    return (F.gelu(a, approximate="tanh") if act == "gelu_tanh" else F.silu(a)) * b


def inputs(shape, dtype, scale=4.0):
    a = (torch.randn(shape, device=DEVICE) * scale).to(dtype)
    b = torch.randn(shape, device=DEVICE).to(dtype)
    return a, b


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("act", ACTS)
def test_kernel_matches_reference(shape, dtype, act, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "exact")
    a, b = inputs(shape, dtype)
    out = ops.gated_act(a, b, act)
    assert levers.counters() == {"gated_act": 1}
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, spelled_out(a, b, act), rtol=rtol, atol=atol)


def test_strided_rows(monkeypatch):
    """Rows with a stride (a slice of a wider tensor) are read in place."""
    monkeypatch.setenv("QFUSE_TIER", "exact")
    wide = torch.randn(7, 300, device=DEVICE)
    a, b = wide[:, 10:110], wide[:, 150:250]
    torch.testing.assert_close(ops.gated_act(a, b, "silu"), spelled_out(a, b, "silu"),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("act", ACTS)
def test_special_values_fp32(act, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "exact")
    a = torch.tensor([0.0, -0.0, 20.0, -20.0, float("inf"), float("-inf"), float("nan"), 1e-40],
                     device=DEVICE)
    b = torch.tensor([1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 1.0, 3.0], device=DEVICE)
    out, ref = ops.gated_act(a, b, act), spelled_out(a, b, act)
    assert torch.equal(out.isnan(), ref.isnan())
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-30, equal_nan=True)


# dtype, rows M, width I, floor in units of the dtype's resolution near zero. The GPU
# cases, at the Gemma 3 12B width, take no floor.
BACKWARD_CASES = [*((dtype, 6, 257, 0.5) for dtype in TOL),
                  *(pytest.param(dtype, 64, 15360, 0.0, marks=pytest.mark.gpu)
                    for dtype in (torch.bfloat16, torch.float16))]


@pytest.mark.parametrize("dtype,M,I,floor_ulps", BACKWARD_CASES)
@pytest.mark.parametrize("act", ACTS)
def test_backward_within_twice_spelled_out_error(dtype, M, I, floor_ulps, act, monkeypatch):
    """Gradients against float64 autograd: at most 2x the spelled-out autograd error
    in the same dtype (plus, off the GPU, one unit of the dtype's resolution near zero)."""
    monkeypatch.setenv("QFUSE_TIER", "exact")
    gate_up = (torch.randn(M, 2 * I, device=DEVICE) * 3).to(dtype)
    grad = torch.randn(M, I, device=DEVICE).to(dtype)

    def grads(fn, x):
        x = x.detach().requires_grad_()
        fn(x).backward(grad.to(x.dtype))
        return x.grad

    fused = grads(lambda x: ops.gated_act(x[:, :I], x[:, I:], act), gate_up)
    assert levers.counters() == {"gated_act": 1}
    exact = grads(lambda x: spelled_out(x[:, :I], x[:, I:], act), gate_up.double())
    spelled = grads(lambda x: spelled_out(x[:, :I], x[:, I:], act), gate_up)
    err_fused = (fused.double() - exact).abs().max().item()
    err_spelled = (spelled.double() - exact).abs().max().item()
    floor = torch.finfo(dtype).eps * exact.abs().max().item() * floor_ulps
    assert not fused.isnan().any()
    assert err_fused <= 2 * err_spelled + floor, (err_fused, err_spelled)


def test_default_tier_on_cpu_runs_the_reference():
    a, b = inputs((4, 8), torch.float32)
    ops.gated_act(a, b, "silu")
    expected = "gated_act" if DEVICE == "cuda" else "ref:gated_act"
    assert levers.counters() == {expected: 1}


def test_opt_out_variable(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "exact")
    monkeypatch.setenv("QFUSE_GATED_ACT", "0")
    a, b = inputs((4, 8), torch.float32)
    assert torch.equal(ops.gated_act(a, b, "gelu_pytorch_tanh"), spelled_out(a, b, "gelu_tanh"))
    assert levers.counters() == {"ref:gated_act": 1}


def test_unsupported_dtype_falls_back(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "exact")
    a, b = inputs((4, 8), torch.float64)
    assert torch.equal(ops.gated_act(a, b, "silu"), reference.gated_act(a, b, "silu"))
    assert levers.counters() == {"ref:gated_act": 1}


@pytest.mark.parametrize(
    "a_shape,b_shape,b_dtype,match",
    [((4, 8), (4, 9), torch.float32, "shape"), ((4, 8), (4, 8), torch.float16, "dtype")],
)
def test_mismatched_inputs_raise(a_shape, b_shape, b_dtype, match, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "exact")
    a = torch.randn(a_shape, device=DEVICE)
    b = torch.randn(b_shape, device=DEVICE).to(b_dtype)
    with pytest.raises(ValueError, match=match):
        ops.gated_act(a, b, "silu")


def test_unknown_activation_raises():
    a, b = inputs((2, 4), torch.float32)
    with pytest.raises(ValueError, match="activation"):
        ops.gated_act(a, b, "relu")


def test_out_argument_is_checked():
    pytest.importorskip("triton")
    from qfuse.kernels.pointwise.gated_act import gated_act_forward

    a, b = inputs((2, 64), torch.float32)
    with pytest.raises(ValueError, match="out must be"):
        gated_act_forward(a, b, "silu", out=torch.empty(2, 63, device=DEVICE))


def hard_inputs(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, device="cuda", generator=g) * 3
    part = n // 8
    x[:part] = (torch.rand(part, device="cuda", generator=g) * 40 - 20)  # |x| up to 20
    x[part:2 * part] *= 1e3  # large magnitudes, gelu's x³ overflows in fp16 range
    tiny = torch.finfo(dtype).tiny
    x[2 * part:3 * part] = (torch.rand(part, device="cuda", generator=g) - 0.5) * tiny  # denormals
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")], device="cuda")
    x[3 * part:3 * part + 5 * 1000] = specials.repeat(1000)
    return x[torch.randperm(n, device="cuda", generator=g)].to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("act", ACTS)
def test_forward_bitwise_equal_to_eager(dtype, act, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "exact")
    n = 1 << 24  # 16M values
    a, b = hard_inputs(n, dtype, 1).view(4096, -1), hard_inputs(n, dtype, 2).view(4096, -1)
    out = ops.gated_act(a, b, act)
    assert levers.counters() == {"gated_act": 1}
    assert_bitwise_equal(out, spelled_out(a, b, act))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(1, 15360), (5, 123), (3, 4231), (1, 1)])
def test_odd_shapes_and_strided_halves_bitwise(dtype, act, shape, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "exact")
    M, I = shape
    gate_up = hard_inputs(M * 2 * I + 8 * 5000, dtype, 3)[: M * 2 * I].view(M, 2 * I)
    out = torch.full((M, I), float("nan"), device="cuda", dtype=dtype)
    from qfuse.kernels.pointwise.gated_act import gated_act_forward

    gated_act_forward(gate_up[:, :I], gate_up[:, I:], act, out=out)
    ref = spelled_out(gate_up[:, :I], gate_up[:, I:], act)
    assert_bitwise_equal(out, ref)
    assert_bitwise_equal(ops.gated_act(gate_up[:, :I], gate_up[:, I:], act), ref)


@pytest.mark.gpu
def test_grad_path_used_only_when_needed(monkeypatch):
    """With grad enabled and inputs requiring it the autograd function runs;
    its forward output equals the plain kernel's bit for bit."""
    monkeypatch.setenv("QFUSE_TIER", "exact")
    a = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = ops.gated_act(a, b, "gelu_tanh")
    assert y.grad_fn is not None and "GatedAct" in type(y.grad_fn).__name__
    with torch.no_grad():
        y2 = ops.gated_act(a, b, "gelu_tanh")
    assert y2.grad_fn is None
    assert torch.equal(y.detach(), y2)
