"""The one-launch rotary embedding under the CPU interpreter and on the GPU (marked
`gpu`: the Gemma 3 12B and Llama 3 8B head shapes, prefill and decode): bit for bit
(zero signs included) the reference's result, in the reference's layout (fp32, fp16,
and bf16 through its bit-exact rounding) on q/k as the model makes them (transposed
views), expanded cos/sin, odd sizes; dispatch on by default (QFUSE_ROPE=0 opts out);
bad input.

Its first GPU run (2026-11-30) failed in bf16: LLVM had narrowed the float32 products
to bf16 multiplies and fused them with the add into `fma.rn.bf16`, skipping the
product's rounding. The kernel now multiplies with `mul.rn.f32` (precise_math)."""

import pytest
import torch

from qfuse import levers, ops, reference
from qfuse.testing import assert_bitwise_equal, kernel_device

DEVICE = kernel_device()
k = pytest.importorskip("qfuse.kernels.pointwise.rope")


def rotary_inputs(B, H, T, D, dtype, seed=0, theta=10000.0, start=5, signed_zeros=False):
    g = torch.Generator().manual_seed(seed)
    # As the model: a projection [B, T, H·D] viewed and transposed to [B, H, T, D]
    x = (torch.randn(B, T, H * D, generator=g) * 3).to(dtype).to(DEVICE)
    if signed_zeros:  # zeros of both signs: the sign of a zero result must match too
        x[..., ::7] = 0.0
        x[..., ::11] = -0.0
    x = x.view(B, T, H, D).transpose(1, 2)
    positions = torch.arange(T, device=DEVICE).expand(B, T) + start
    inv_freq = reference.rope_inv_freq(D, theta, DEVICE)
    cos, sin = reference.rope_cos_sin(positions, inv_freq, dtype)
    return x, cos, sin


# B, H, T, D, theta, first position; the GPU's at the models' head shapes and θ = 1e6.
BITWISE_CASES = [
    (1, 16, 1, 256, 1e4, 5), (2, 3, 7, 64, 1e4, 5), (1, 2, 33, 128, 1e4, 5), (3, 1, 2, 6, 1e4, 5),
    *(pytest.param(*shape, 1e6, 1000, marks=pytest.mark.gpu)
      for shape in [(1, 16, 1, 256), (8, 8, 1, 256), (1, 32, 1, 128), (2, 16, 2048, 256),
                    (1, 8, 4097, 128)])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,H,T,D,theta,start", BITWISE_CASES)
def test_bitwise_equal_to_reference(dtype, B, H, T, D, theta, start):
    x, cos, sin = rotary_inputs(B, H, T, D, dtype, seed=B * T + D, theta=theta, start=start,
                                signed_zeros=True)
    out = k.apply_rotary(x, cos, sin)
    ref = reference.apply_rotary(x, cos, sin)
    assert out.shape == ref.shape and out.dtype == dtype
    # the same layout (a size-1 dim's stride is free: PyTorch and empty_like differ there)
    assert [s for s, n in zip(out.stride(), out.shape) if n > 1] == \
        [s for s, n in zip(ref.stride(), ref.shape) if n > 1]
    assert_bitwise_equal(out, ref)


def test_dispatch_on_by_default_and_opt_out(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "exact")
    x, cos, sin = rotary_inputs(1, 4, 3, 64, torch.float16)
    with torch.no_grad():
        assert torch.equal(ops.apply_rotary(x, cos, sin), reference.apply_rotary(x, cos, sin))
        ops.apply_rotary(x, cos.float(), sin.float())  # mixed dtypes: the reference
        assert levers.counters() == {"rope": 1, "ref:apply_rotary": 1}
        levers.reset_counters()
        monkeypatch.setenv("QFUSE_ROPE", "0")
        ops.apply_rotary(x, cos, sin)
        assert levers.counters() == {"ref:apply_rotary": 1}


def test_bad_input_names_the_problem():
    x, cos, sin = rotary_inputs(1, 2, 3, 64, torch.float32)
    with pytest.raises(ValueError, match="cos shape"):
        k.apply_rotary(x, cos[:, :2], sin[:, :2])
    with pytest.raises(ValueError, match="head dim"):
        k.apply_rotary(x[..., :63], cos[..., :63], sin[..., :63])
    with pytest.raises(ValueError, match="dims"):
        k.apply_rotary(x[0], cos, sin)


def test_exact_tier_model_logits_unchanged(monkeypatch):
    """The bundled model in the exact tier, prefill and two cached decode steps: the same
    logits bit for bit with the kernel on as with the reference."""
    from qfuse.loading import DEFAULT_MODEL, load_model
    from qfuse.runtime.cache import KVCache

    model = load_model(DEFAULT_MODEL, dtype=torch.float16, device=DEVICE)

    def run():
        cache = KVCache(model.config, 1, 64, model.dtype, DEVICE, 0, 64)
        with torch.no_grad():
            out = [model(torch.tensor([[1, 2, 3, 4, 5]], device=DEVICE), cache=cache)]
            tok = torch.tensor([9], device=DEVICE)
            for _ in range(2):
                out.append(model.decode(tok, cache))
        return out

    monkeypatch.setenv("QFUSE_TIER", "exact")
    reference_logits = run()
    monkeypatch.setenv("QFUSE_ROPE", "1")
    levers.reset_counters()
    kernel_logits = run()
    assert levers.counters()["rope"] == 2 * 3 * model.config.num_hidden_layers
    assert all(torch.equal(a, b) for a, b in zip(reference_logits, kernel_logits))
