"""The fused gated activation on the GPU: bitwise equality with eager PyTorch.

Inputs mix normal values, large magnitudes (|x| up to 20 and beyond), denormals,
signed zeros, ±inf and NaN. NaN must appear exactly where PyTorch's output has
NaN; every other element must have PyTorch's exact bit pattern.
"""

import pytest
import torch
import torch.nn.functional as F

from qfuse import levers, ops

ACTS = ["gelu_tanh", "silu"]
INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def spelled_out(a, b, act):
    return (F.gelu(a, approximate="tanh") if act == "gelu_tanh" else F.silu(a)) * b


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


def assert_bitwise_equal(out: torch.Tensor, ref: torch.Tensor) -> None:
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan), "NaN positions differ"
    iv = INT_VIEW[ref.dtype]
    mismatches = (out.view(iv) != ref.view(iv)) & ~nan
    assert int(mismatches.sum()) == 0, f"{int(mismatches.sum())} of {ref.numel()} elements differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("act", ACTS)
def test_forward_bitwise_equal_to_eager(dtype, act, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "exact")
    n = 1 << 24  # 16M values
    a, b = hard_inputs(n, dtype, 1).view(4096, -1), hard_inputs(n, dtype, 2).view(4096, -1)
    out = ops.gated_act(a, b, act)
    assert levers.counters() == {"gated_act": 1}
    assert_bitwise_equal(out, spelled_out(a, b, act))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(1, 15360), (5, 123), (3, 4231), (1, 1)])
def test_odd_shapes_and_strided_halves_bitwise(dtype, act, shape, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "exact")
    M, I = shape
    gate_up = hard_inputs(M * 2 * I + 8 * 5000, dtype, 3)[: M * 2 * I].view(M, 2 * I)
    out = torch.full((M, I), float("nan"), device="cuda", dtype=dtype)
    from qfuse.kernels.gated_act import gated_act_forward

    gated_act_forward(gate_up[:, :I], gate_up[:, I:], act, out=out)
    ref = spelled_out(gate_up[:, :I], gate_up[:, I:], act)
    assert_bitwise_equal(out, ref)
    assert_bitwise_equal(ops.gated_act(gate_up[:, :I], gate_up[:, I:], act), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ACTS)
def test_backward_within_twice_spelled_out_error(dtype, act, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "exact")
    M, I = 64, 15360
    gate_up = (torch.randn(M, 2 * I, device="cuda") * 3).to(dtype)
    grad = torch.randn(M, I, device="cuda").to(dtype)

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
    assert not fused.isnan().any()
    assert err_fused <= 2 * err_spelled, (err_fused, err_spelled)


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
