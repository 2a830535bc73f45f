"""ops checks each op's inputs beside the op, before choosing a path: a mistake is one
ValueError naming it in every tier, whether a kernel or the reference would have run.
(The reference only computes; decode attention's checks: test_decode_attention.py.)"""

import pytest
import torch

from qfuse import levers, ops
from qfuse.quant import QuantizedTensor

TIERS = ["compat", "fast"]  # fast on CPU tensors: the kernels under the interpreter


@pytest.fixture(params=TIERS)
def tier(request):
    with levers.use_tier(request.param):
        yield request.param


def test_gated_act_refuses_mismatched_inputs(tier):
    a = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="one shape"):
        ops.gated_act(a, torch.zeros(4, 5), "silu")
    with pytest.raises(ValueError, match="one dtype"):
        ops.gated_act(a, a.half(), "silu")
    with pytest.raises(ValueError, match="activation must be one of"):
        ops.gated_act(a, a, "gelu")  # the exact-erf GELU is not the tanh one


def test_rms_norm_refuses_a_wrong_weight_shape(tier):
    with pytest.raises(ValueError, match="weight shape"):
        ops.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-6)


def test_linear_refuses_a_feature_mismatch(tier):
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="64 features but the weight expects 65"):
        ops.linear(x, torch.zeros(8, 65))
    wq = QuantizedTensor.from_float(torch.randn(8, 128), group_size=32, bits=4)
    with pytest.raises(ValueError, match="64 features but the weight expects 128"):
        ops.linear(x.half(), wq)
    with pytest.raises(ValueError, match="64 features but the weight expects 128"):
        ops.linear_stacked(x, [torch.zeros(8, 64), wq], [None, None])


def test_mlp_refuses_weights_that_do_not_chain(tier):
    H, I = 64, 128
    x = torch.zeros(2, H)
    gate, up, down = torch.zeros(I, H), torch.zeros(I, H), torch.zeros(H, I)
    with torch.no_grad():
        with pytest.raises(ValueError, match="residual shape .* does not broadcast"):
            ops.mlp(x, gate, up, down, "silu", residual=torch.zeros(2, H + 1))
        with pytest.raises(ValueError, match="do not form an MLP over 65 features"):
            ops.mlp(torch.zeros(2, H + 1), gate, up, down, "silu")
        with pytest.raises(ValueError, match="do not form an MLP"):
            ops.mlp(x, gate, up, torch.zeros(H, I + 1), "silu")
        # a residual that broadcasts is an input, not a mistake
        out = ops.mlp(x, gate, up, down, "silu", residual=torch.ones(H))
    assert torch.equal(out, torch.ones(2, H))


def test_quantized_mlp_refusal_is_the_same_in_both_tiers(tier):
    """The fused MLP kernels would take these 4-bit weights in the fast tier; ops
    refuses a chain that does not fit before either path."""
    H, I = 64, 128
    q = [QuantizedTensor.from_float(torch.randn(*s).half(), 32, 4)
         for s in ((I, H), (I, H), (H, I))]
    with torch.no_grad(), pytest.raises(ValueError, match="do not form an MLP"):
        ops.mlp(torch.zeros(1, H).half(), q[0], q[1], q[0], "silu")


def test_quantized_linear_keeps_the_gradient_of_x(monkeypatch):
    """The product kernels have no backward: with x needing a gradient the fast tier
    takes the reference, whose gradient is the dequantized weight's."""
    monkeypatch.setenv("QFUSE_TIER", "fast")
    w = QuantizedTensor.from_float(torch.randn(16, 64).half(), 32, 4)
    x = torch.randn(1, 64).half().requires_grad_()
    levers.reset_counters()
    y = ops.linear(x, w)
    (y2,) = ops.linear_stacked(x, [w], [None])
    (y.float().sum() + y2.float().sum()).backward()
    assert "qmatmul" not in levers.counters() and levers.counters()["ref:linear"] == 2
    torch.testing.assert_close(x.grad, 2 * w.dequantize(torch.float16).sum(0, keepdim=True))
    with torch.no_grad():
        ops.linear(x, w)
    assert levers.counters()["qmatmul"] == 1  # without autograd the kernel runs
