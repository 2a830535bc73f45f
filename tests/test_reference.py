"""Tests for qfuse.reference (the compat tier) on CPU.

Every op is checked against an independent float64 computation written here
from the math (never by calling reference.py's helpers), in float32 and, where
the op has low-precision use, in float16/bfloat16. The oracle always takes the
*same* (already rounded) inputs as the op under test, so the tolerances below
bound only the rounding the op itself performs. Where Hugging Face defines the
op (RMSNorm, the tanh GELU, SiLU, RoPE), the compat result must be bitwise equal
to HF's, because compat's contract is to round exactly where HF rounds.

Shapes: B batch, Hq/Hkv query/KV heads, N cache length, D head dim,
K/I/H features. Odd sizes (5, 123, 97) sit next to real ones.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qfuse import reference as ref
from qfuse.quant import QuantizedTensor, unpack

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOW_DTYPES = (torch.float16, torch.bfloat16)
# Machine epsilon (one ulp at 1.0): float32 2^-23, float16 2^-10, bfloat16 2^-7.
EPS = {dt: torch.finfo(dt).eps for dt in DTYPES}
# Smallest positive subnormal: the absolute rounding step near 0.
TINY = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}
U32 = 2.0**-24  # unit roundoff of float32: half an ulp at 1.0

ACTS = ("gelu_tanh", "silu")


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------


def randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32):
    """Seeded normal samples, drawn in float64 and rounded once to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def check(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol=0.0, what: str = ""):
    """Assert |actual - expected| <= atol + rtol·|expected| elementwise (atol may be a
    tensor: a per-element bound), with no NaN/inf in ``actual`` where expected is finite."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a, e = actual.to(torch.float64), expected.to(torch.float64)
    assert torch.isfinite(a).all(), f"{what}: non-finite values in the output"
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    bad = err > bound
    if bad.any():
        ratio = err / bound.clamp_min(1e-300)
        i = int(ratio.flatten().argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements out of tolerance; worst at flat "
            f"index {i}: got {a.flatten()[i].item()!r}, expected {e.flatten()[i].item()!r}, "
            f"|err| {err.flatten()[i].item():.3e} > bound {bound.flatten()[i].item():.3e}"
        )


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str = ""):
    """Same dtype, shape and bit pattern (any NaN matches any NaN; -0 differs from +0)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), f"{what}: NaN in different places"
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    bits_a = actual.masked_fill(nan_a, 0).view(ints[actual.dtype])
    bits_e = expected.masked_fill(nan_e, 0).view(ints[expected.dtype])
    diff = bits_a != bits_e
    if diff.any():
        i = int(diff.flatten().nonzero()[0])
        raise AssertionError(
            f"{what}: {int(diff.sum())} of {diff.numel()} elements differ bitwise; first at flat "
            f"index {i}: {actual.flatten()[i].item()!r} vs {expected.flatten()[i].item()!r}"
        )


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """±0, ±inf, NaN, subnormals, extremes and the cancellation region of 1 + tanh."""
    fi = torch.finfo(dtype)
    vals = [0.0, -0.0, math.inf, -math.inf, math.nan, fi.tiny, -fi.tiny, fi.tiny / 4,
            -fi.tiny / 4, fi.max, -fi.max, 1.0, -1.0, 3.0, -3.0, 5.0, -5.0, 8.0, -8.0,
            10.0, -10.0, 20.0, -20.0, 88.0, -88.0, 1e-3, -1e-3]
    return torch.tensor(vals, dtype=torch.float64).to(dtype)


# ----------------------------------------------------------------------------
# Float64 oracles, written from the math
# ----------------------------------------------------------------------------


def gelu_tanh64(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float64)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def silu64(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float64)
    return x / (1.0 + torch.exp(-x))


ACT64 = {"gelu_tanh": gelu_tanh64, "silu": silu64}


def rms_norm64(x, w, eps: float, unit_offset: bool) -> torch.Tensor:
    x, w = x.to(torch.float64), w.to(torch.float64)
    rms = torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return x / rms * ((1.0 + w) if unit_offset else w)


def rotate64(x, cos, sin) -> torch.Tensor:
    """Rotate-half RoPE: pair (i, i + D/2) rotated by the angle whose cos/sin sit at i."""
    x, cos, sin = x.to(torch.float64), cos.to(torch.float64), sin.to(torch.float64)
    D = x.shape[-1]
    out = torch.empty_like(x)
    for i in range(D // 2):
        j = i + D // 2
        out[..., i] = x[..., i] * cos[..., i] - x[..., j] * sin[..., i]
        out[..., j] = x[..., j] * cos[..., j] + x[..., i] * sin[..., j]
    return out


def rope_angles64(positions: torch.Tensor, head_dim: int, base: float) -> torch.Tensor:
    """[..., T, D/2] angles p · base^(-2i/D) in float64."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    return positions.to(torch.float64)[..., None] * base ** (-2.0 * i / head_dim)


def dequant64(w: QuantizedTensor) -> torch.Tensor:
    """s·q + e in float64 straight from the packed codes (not via quant.dequantize)."""
    codes = unpack(w.packed, w.bits).to(torch.float64)
    g = codes.reshape(*codes.shape[:-1], -1, w.group_size)
    out = g * w.scales.to(torch.float64)[..., None] + w.biases.to(torch.float64)[..., None]
    return out.reshape(codes.shape)


def dense64(w) -> torch.Tensor:
    return dequant64(w) if isinstance(w, QuantizedTensor) else w.to(torch.float64)


def linear64(x, w, bias=None) -> torch.Tensor:
    y = x.to(torch.float64) @ dense64(w).T
    return y if bias is None else y + bias.to(torch.float64)


def mlp64(x, gate, up, down, act, residual=None) -> torch.Tensor:
    h = ACT64[act](linear64(x, gate)) * linear64(x, up)
    y = linear64(h, down)
    return y if residual is None else y + residual.to(torch.float64)


def decode_attention64(q, k, v, lengths, scale, window=None, softcap=None) -> torch.Tensor:
    """Explicit loops: sequence b, query head h reads KV head h // (Hq/Hkv) over
    positions [max(0, L - window), L); softmax over those positions only."""
    q = q.to(torch.float64)
    k, v = dense64(k), dense64(v)
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        L = int(lengths[b])
        start = 0 if window is None else max(0, L - window)
        if L == 0:
            continue
        for h in range(Hq):
            kh, vh = k[b, h // G, start:L], v[b, h // G, start:L]  # [n, D]
            s = (kh @ q[b, h]) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            p = torch.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ vh
    return out


# ----------------------------------------------------------------------------
# Activations and gated activations
# ----------------------------------------------------------------------------

# (rtol, atol) of one rounded elementwise result, beyond the float32 work inside.
# PyTorch's CPU kernels compute act in float32 and round the result to the dtype.
#  float32: Sleef tanh/exp are accurate to 1 ulp, plus the roundings of the
#           polynomial, the division and the product: 4 ulps (measured: SiLU 1.1,
#           gated SiLU 1.4 ulps).
#  float16/bfloat16: act(a) rounded once, act(a)·b rounded again: two half-ulp
#           roundings = 1 ulp relative; the float32 work adds < 1e-4 ulp, so 1.01.
#           Measured (32k samples): 0.50 ulp (act), 0.96 ulp (gated). The atol is
#           the subnormal step (two half-steps) for results that underflow.
ACT_TOL = {
    torch.float32: (4 * EPS[torch.float32], 2 * TINY[torch.float32]),
    torch.float16: (1.01 * EPS[torch.float16], TINY[torch.float16]),
    torch.bfloat16: (1.01 * EPS[torch.bfloat16], TINY[torch.bfloat16]),
}
# GELU's 1 + tanh(y) cancels in float32 for a ≲ -3: tanh(y) ≈ -1 is known to
# ~1 ulp of 1 (2^-23), so act(a) carries an *absolute* error up to
# 0.5·|a|·2^-23 (·|b| after the gate) whatever the output dtype. That is the
# formula's float32 conditioning, same as HF's; it is added per element.
# Measured: 4.2e-7 at |a| ≈ 12 in float32 (bound 7e-7).
CANCEL = 0.5 * 2.0**-23


def act_bound(a: torch.Tensor, dtype: torch.dtype, b: torch.Tensor | None = None):
    rtol, atol = ACT_TOL[dtype]
    cancel = CANCEL * a.to(torch.float64).abs()
    if b is not None:
        cancel = cancel * b.to(torch.float64).abs()
    return rtol, atol + cancel


ELEM_SHAPES = [(5,), (123,), (3, 4096)]


@pytest.mark.parametrize("shape", ELEM_SHAPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activation_matches_float64(dtype, act, shape):
    a = randn(*shape, seed=1, scale=3.0, dtype=dtype)
    rtol, atol = act_bound(a, dtype)
    check(ref.activation(a, act), ACT64[act](a), rtol, atol, f"{act} {dtype}")


@pytest.mark.parametrize("shape", ELEM_SHAPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_act_matches_float64(dtype, act, shape):
    a = randn(*shape, seed=2, scale=3.0, dtype=dtype)
    b = randn(*shape, seed=3, dtype=dtype)
    y = ref.gated_act(a, b, act)
    assert y.dtype == dtype
    rtol, atol = act_bound(a, dtype, b)
    check(y, ACT64[act](a) * b.to(torch.float64), rtol, atol, f"gated {act} {dtype}")


@pytest.mark.parametrize("I", [5, 123, 1024])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_act_concat_matches_float64(dtype, act, I):
    gate_up = randn(3, 2 * I, seed=4, scale=3.0, dtype=dtype)
    a, b = gate_up[:, :I], gate_up[:, I:]  # the gate first, then up
    y = ref.gated_act_concat(gate_up, act)
    assert y.shape == (3, I)
    rtol, atol = act_bound(a, dtype, b)
    check(y, ACT64[act](a) * b.to(torch.float64), rtol, atol, f"concat {act} {dtype}")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_act_bitwise_equals_pytorch_and_hf(dtype, act):
    """compat rounds where HF's MLP rounds: act(a) in the dtype, then · b."""
    from transformers.activations import ACT2FN

    specials = special_values(dtype)
    a = torch.cat([randn(4096, seed=5, scale=4.0, dtype=dtype), specials, specials])
    b = torch.cat([randn(4096, seed=6, dtype=dtype), specials, specials.flip(0)])
    torch_act = (lambda t: F.gelu(t, approximate="tanh")) if act == "gelu_tanh" else F.silu
    hf_act = ACT2FN["gelu_pytorch_tanh" if act == "gelu_tanh" else "silu"]
    y = ref.gated_act(a, b, act)
    assert_bitwise(y, torch_act(a) * b, f"vs torch {act} {dtype}")
    assert_bitwise(y, hf_act(a) * b, f"vs HF ACT2FN {act} {dtype}")
    assert_bitwise(ref.activation(a, act), hf_act(a), f"activation vs HF {act} {dtype}")


def test_activation_names():
    assert ref.activation_name("gelu_pytorch_tanh") == "gelu_tanh"
    assert ref.activation_name("swish") == "silu"
    a = randn(7, seed=7)
    assert_bitwise(ref.activation(a, "swish"), ref.activation(a, "silu"))
    with pytest.raises(ValueError, match="activation must be one of"):
        ref.activation_name("relu")
    with pytest.raises(ValueError, match="activation must be one of"):
        ref.gated_act(a, a, "gelu")  # exact-erf GELU is not the tanh one


def test_gated_act_rejects_mismatched_inputs():
    a = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="one shape"):
        ref.gated_act(a, torch.zeros(4, 5), "silu")
    with pytest.raises(ValueError, match="one dtype"):
        ref.gated_act(a, a.half(), "silu")
    with pytest.raises(ValueError, match="must be even"):
        ref.gated_act_concat(torch.zeros(4, 7), "silu")


def test_split_gate_up_returns_views_in_order():
    gate_up = torch.arange(12.0).reshape(2, 6)
    g, u = ref.split_gate_up(gate_up)
    assert torch.equal(g, torch.tensor([[0.0, 1, 2], [6, 7, 8]]))
    assert torch.equal(u, torch.tensor([[3.0, 4, 5], [9, 10, 11]]))
    assert g.data_ptr() == gate_up.data_ptr()  # views, not copies


# ----------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------

# rtol of RMSNorm. The float32 part: a sum of K squares (pairwise/vectorised on
# CPU, error well under log2(K) ulps), rsqrt (~1 ulp) and two products: 8 ulps
# of float32 (measured 2.4 ulps at K=4096). In float16/bfloat16 Llama rounds
# x/rms to the dtype and again after · w (two half-ulp roundings = 1 ulp);
# Gemma rounds once (half an ulp). 1.01 ulp covers both plus the float32 part
# (< 1e-3 ulp of bfloat16/float16). atol: the subnormal step, for outputs that
# underflow (float16 values below 6e-5 exist among 4096 normal draws).
RMS_TOL = {
    torch.float32: (8 * EPS[torch.float32], 2 * TINY[torch.float32]),
    torch.float16: (1.01 * EPS[torch.float16], TINY[torch.float16]),
    torch.bfloat16: (1.01 * EPS[torch.bfloat16], TINY[torch.bfloat16]),
}


def rms_inputs(dim: int, dtype: torch.dtype, unit_offset: bool, seed: int = 10):
    x = randn(4, dim, seed=seed, scale=7.0, dtype=dtype)  # off unit scale on purpose
    x[1] *= 1e-2  # a row with a small RMS, where eps matters more
    # Llama weights live around 1, Gemma's around 0 (it multiplies by 1 + w).
    w = randn(dim, seed=seed + 1, scale=0.3, dtype=torch.float64)
    return x, (w if unit_offset else 1.0 + w).to(dtype)


@pytest.mark.parametrize("dim", [5, 123, 4096])
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_float64(dtype, unit_offset, dim):
    x, w = rms_inputs(dim, dtype, unit_offset)
    eps = 1e-6
    y = ref.rms_norm(x, w, eps, unit_offset=unit_offset)
    assert y.dtype == dtype
    rtol, atol = RMS_TOL[dtype]
    check(y, rms_norm64(x, w, eps, unit_offset), rtol, atol, f"rms_norm {dtype}")


@pytest.mark.parametrize("dim", [5, 123, 4096])
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_bitwise_equals_hf(dtype, unit_offset, dim):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, w = rms_inputs(dim, dtype, unit_offset, seed=12)
    eps = 1e-5
    hf = (GemmaRMSNorm(dim, eps=eps) if unit_offset else LlamaRMSNorm(dim, eps=eps)).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
        expected = hf(x)
    assert_bitwise(ref.rms_norm(x, w, eps, unit_offset=unit_offset), expected, f"{dtype}")


def test_rms_norm_rejects_wrong_weight_shape():
    with pytest.raises(ValueError, match="weight shape"):
        ref.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-6)


# ----------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("base", [10000.0, 1e6])
@pytest.mark.parametrize("head_dim", [8, 64, 256])
def test_rope_inv_freq_matches_float64(head_dim, base):
    inv = ref.rope_inv_freq(head_dim, base)
    assert inv.dtype == torch.float32 and inv.shape == (head_dim // 2,)
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    # 2i/D is rounded to float32 (half an ulp, relative); base^e turns a relative
    # exponent error into ln(base)·e times it (e < 1); pow and 1/x add ~1.5 ulps.
    rtol = (math.log(base) + 3) * U32
    check(inv, base ** (-2.0 * i / head_dim), rtol, 0.0, "inv_freq")


@pytest.mark.parametrize("scaling", [1.0, 0.7])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_cos_sin_matches_float64(dtype, scaling):
    D, base = 128, 500000.0
    positions = torch.tensor([[0, 1, 2, 7, 97, 1000, 4095, 8191], [3, 5, 123, 0, 1, 2, 40000, 131071]])
    cos, sin = ref.rope_cos_sin(positions, ref.rope_inv_freq(D, base), dtype, scaling)
    assert cos.shape == sin.shape == (2, 8, D) and cos.dtype == dtype
    ang = rope_angles64(positions, D, base)
    ang = torch.cat([ang, ang], dim=-1)  # the angle for i and i + D/2 is the same
    # The angle p·θ_i is formed in float32: θ_i carries (ln(base)+3)·2^-24 relative
    # error (test above) and the product half an ulp more, so the angle is off by up
    # to |p·θ_i|·(ln(base)+4)·2^-24 absolute; cos/sin are 1-Lipschitz. float32
    # cos/sin and the scaling product add ~2 ulps of 1; rounding |value| <= 1 to the
    # dtype adds at most half an ulp of 1 (eps/2). This is what HF computes too.
    atol = ang.abs() * (math.log(base) + 4) * U32 + 4 * U32 + EPS[dtype] / 2
    check(cos, scaling * torch.cos(ang), 0.0, atol, f"cos {dtype}")
    check(sin, scaling * torch.sin(ang), 0.0, atol, f"sin {dtype}")


@pytest.mark.parametrize("D", [8, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_apply_rotary_matches_float64(dtype, D):
    B, H, T = 2, 3, 5
    x = randn(B, H, T, D, seed=20, dtype=dtype)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 97, 123, 1000, 4095]])
    cos, sin = ref.rope_cos_sin(positions, ref.rope_inv_freq(D, 10000.0), dtype)
    y = ref.apply_rotary(x, cos, sin)
    assert y.shape == x.shape and y.dtype == dtype
    c, s = cos[:, None], sin[:, None]
    # y_i = x_i·c − x_j·s: each product and the sum are rounded to the dtype, so the
    # error is at most one ulp of |x_i·c| + |x_j·s| (three half-ulp roundings with
    # the sum's magnitude <= that). No other error: c, s are the op's own inputs.
    half = D // 2
    mag = x.double().abs() * c.double().abs() + torch.cat([x[..., half:], x[..., :half]], -1).double().abs() * s.double().abs()
    check(y, rotate64(x, c, s), 0.0, 1.5 * EPS[dtype] * mag + TINY[dtype], f"rotary {dtype}")


def test_rope_end_to_end_matches_float64_and_preserves_norm():
    """inv_freq → cos/sin → rotate in float32 against rotation by exact angles."""
    D, base = 64, 10000.0
    x = randn(1, 2, 6, D, seed=21)
    positions = torch.tensor([[0, 1, 5, 97, 123, 511]])
    cos, sin = ref.rope_cos_sin(positions, ref.rope_inv_freq(D, base), torch.float32)
    y = ref.apply_rotary(x, cos, sin)
    ang = rope_angles64(positions, D, base)[:, None]  # [1, 1, T, D/2]
    ang = torch.cat([ang, ang], -1)
    expected = rotate64(x, torch.cos(ang), torch.sin(ang))
    # Angle error (see test_rope_cos_sin) at p <= 511 is <= 511·13.2·2^-24 = 4e-4...
    # no: θ_i <= 1, so |p·θ_i| <= 511 and the angle is off by <= 511·(ln(base)+4)·2^-24
    # = 4.0e-4 at worst; the rotation moves each output by <= that · (|x_i| + |x_j|).
    half = D // 2
    pair = x.double().abs() + torch.cat([x[..., half:], x[..., :half]], -1).double().abs()
    atol = pair * (ang.abs() * (math.log(base) + 4) * U32 + 8 * U32)
    check(y, expected, 0.0, atol, "rope float32")
    # A rotation keeps every (i, i + D/2) pair's length.
    n_in = x[..., :half] ** 2 + x[..., half:] ** 2
    n_out = y[..., :half].double() ** 2 + y[..., half:].double() ** 2
    check(n_out, n_in.double(), 1e-5, 0.0, "pair norms")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_bitwise_equals_hf(dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    D, base = 128, 500000.0
    config = LlamaConfig(hidden_size=4 * D, num_attention_heads=4, head_dim=D, rope_theta=base)
    hf = LlamaRotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 5, 97, 123, 4095, 131071]])
    q = randn(1, 4, 7, D, seed=22, dtype=dtype)
    k = randn(1, 2, 7, D, seed=23, dtype=dtype)
    inv = ref.rope_inv_freq(D, base)
    assert_bitwise(inv, hf.inv_freq, "inv_freq")
    cos, sin = ref.rope_cos_sin(positions, inv, dtype)
    hf_cos, hf_sin = hf(q, positions)
    assert_bitwise(cos, hf_cos, "cos")
    assert_bitwise(sin, hf_sin, "sin")
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    assert_bitwise(ref.apply_rotary(q, cos, sin), hf_q, "q")
    assert_bitwise(ref.apply_rotary(k, cos, sin), hf_k, "k")


# ----------------------------------------------------------------------------
# linear and mlp, dense and quantized weights
# ----------------------------------------------------------------------------

# Inputs are scaled so that outputs are O(1): x ~ N(0, 1), W ~ N(0, 1/K). The
# error of a length-K dot product is measured against M = Σ_k |x_k·w_k| (the
# standard bound is K·u·M; blocked/pairwise float32 accumulation keeps it far
# below). (rtol, atol-per-unit-of-M):
#  float32: 16 ulps of M (measured 1.3 ulps at K=512).
#  float16/bfloat16: CPU matmuls accumulate in float32 and round the result once
#           (half an ulp, relative), plus the float32 part; the bias is added
#           before that single rounding.
LINEAR_TOL = {
    torch.float32: (0.0, 16 * EPS[torch.float32]),
    torch.float16: (0.5 * EPS[torch.float16], 16 * EPS[torch.float32] + TINY[torch.float16]),
    torch.bfloat16: (0.5 * EPS[torch.bfloat16], 16 * EPS[torch.float32]),
}


def magnitude(x, w, bias=None) -> torch.Tensor:
    """M = Σ_k |x_k|·|w_k| (+ |bias|) for every output element."""
    m = x.to(torch.float64).abs() @ dense64(w).abs().T
    return m if bias is None else m + bias.to(torch.float64).abs()


def make_weight(N: int, K: int, dtype, quant, seed: int):
    """Dense [N, K] weight in ``dtype`` or QuantizedTensor (group, bits) from it."""
    w = randn(N, K, seed=seed, scale=K**-0.5, dtype=dtype)
    return w if quant is None else QuantizedTensor.from_float(w, group_size=quant[0], bits=quant[1])


LINEAR_CASES = [  # (N, K, quant=(group_size, bits) or None)
    (5, 123, None),
    (123, 5, None),
    (256, 512, None),
    (5, 128, (32, 4)),
    (123, 256, (64, 4)),
    (123, 128, (32, 8)),
    (256, 512, (64, 8)),
]


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("N,K,quant", LINEAR_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_matches_float64(dtype, N, K, quant, with_bias):
    x = randn(2, 3, K, seed=30, dtype=dtype)
    w = make_weight(N, K, dtype, quant, seed=31)
    bias = randn(N, seed=32, dtype=dtype) if with_bias else None
    y = ref.linear(x, w, bias)
    assert y.shape == (2, 3, N) and y.dtype == dtype
    rtol, atol = LINEAR_TOL[dtype]
    if quant is not None and dtype != torch.float32:
        # The weight is dequantized in float32 and rounded to the dtype before the
        # product: half an ulp of each |w|, i.e. eps/2 of M on top.
        atol = atol + 0.5 * EPS[dtype]
    check(y, linear64(x, w, bias), rtol, atol * magnitude(x, w, bias), f"linear {dtype}")


def test_linear_quantized_equals_dense_dequantized():
    """A quantized weight behaves exactly as its dequantized dense copy."""
    x = randn(3, 256, seed=33)
    w = make_weight(64, 256, torch.float32, (64, 4), seed=34)
    assert_bitwise(ref.linear(x, w), ref.linear(x, w.dequantize(torch.float32)))


def test_linear_rejects_feature_mismatch():
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="64 features but the weight expects 65"):
        ref.linear(x, torch.zeros(8, 65))
    wq = QuantizedTensor.from_float(torch.randn(8, 128), group_size=32, bits=4)
    with pytest.raises(ValueError, match="64 features but the weight expects 128"):
        ref.linear(x, wq)


# mlp = down(act(x·Gᵀ)·(x·Uᵀ)) + r: three rounded matmuls and the gated product.
# The down projection's inputs h already carry the upstream error: in float32
# ~(16 + 4 + 16) ulps of |h| each; in float16/bfloat16 h = act(g)·u is built from
# g, u rounded once (eps/2 each), act rounded (eps/2) and the product rounded
# (eps/2): <= 2 ulps of |h|, and act' <= 1.13 (GELU) / 1.1 (SiLU) keeps the
# propagated share within that. So |err| <= c·M_down + rtol·|y|, with M_down =
# Σ_i |h_i|·|down_i| and c = (2 ulps of the dtype) + 40 ulps of float32;
# measured: bf16 0.23 ulp·M, fp16 0.17 ulp·M, f32 2.9 f32-ulps·M.
# The residual add is one more rounding (rtol eps/2 on top of the product's).
MLP_TOL = {
    torch.float32: (0.0, 40 * EPS[torch.float32]),
    torch.float16: (EPS[torch.float16], 2 * EPS[torch.float16] + 40 * EPS[torch.float32]),
    torch.bfloat16: (EPS[torch.bfloat16], 2 * EPS[torch.bfloat16] + 40 * EPS[torch.float32]),
}

MLP_CASES = [  # (H, I, quant)
    (5, 123, None),
    (123, 5, None),
    (256, 512, None),
    (128, 192, (32, 4)),
    (128, 192, (64, 8)),
    (256, 512, (64, 4)),
]


@pytest.mark.parametrize("with_residual", [False, True], ids=["nores", "res"])
@pytest.mark.parametrize("H,I,quant", MLP_CASES, ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mlp_matches_float64(dtype, act, H, I, quant, with_residual):
    x = randn(3, H, seed=40, dtype=dtype)
    gate = make_weight(I, H, dtype, quant, seed=41)
    up = make_weight(I, H, dtype, quant, seed=42)
    down = make_weight(H, I, dtype, quant, seed=43)
    residual = randn(3, H, seed=44, dtype=dtype) if with_residual else None
    y = ref.mlp(x, gate, up, down, act, residual)
    assert y.shape == (3, H) and y.dtype == dtype
    expected = mlp64(x, gate, up, down, act, residual)
    h64 = ACT64[act](linear64(x, gate)) * linear64(x, up)
    rtol, c = MLP_TOL[dtype]
    if quant is not None and dtype != torch.float32:
        c = c + 1.5 * EPS[dtype]  # the three dequantized weights rounded to the dtype
    atol = c * magnitude(h64, down) + TINY[dtype]
    check(y, expected, rtol, atol, f"mlp {act} {dtype}")


def test_mlp_rejects_bad_shapes():
    H, I = 8, 16
    x = torch.zeros(2, H)
    gate, up, down = torch.zeros(I, H), torch.zeros(I, H), torch.zeros(H, I)
    with pytest.raises(ValueError, match="residual shape"):
        ref.mlp(x, gate, up, down, "silu", residual=torch.zeros(2, H + 1))
    with pytest.raises(ValueError, match="features but the weight expects"):
        ref.mlp(torch.zeros(2, H + 1), gate, up, down, "silu")
    with pytest.raises(ValueError, match="features but the weight expects"):
        ref.mlp(x, gate, up, torch.zeros(H, I + 1), "silu")


# ----------------------------------------------------------------------------
# Attention mask and decode attention
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 1, 4, 97, 1000])
def test_attention_mask_matches_definition(window):
    lengths = torch.tensor([0, 1, 5, 97, 100], dtype=torch.int32)
    N = 100
    mask = ref.attention_mask(lengths, N, window)
    assert mask.dtype == torch.bool and mask.shape == (5, N)
    for b, L in enumerate(lengths.tolist()):
        start = 0 if window is None else max(0, L - window)
        expected = [start <= n < L for n in range(N)]
        assert mask[b].tolist() == expected, f"sequence {b} (L={L}, window={window})"


# Scores s = q·k·scale are O(1) here (q, k ~ N(0, 1), scale 1/√D); v ~ N(0, 1).
# Tolerances are in units of V = max|v| over the attended positions:
#  float32: matmuls and the float32 softmax contribute a few ulps each; 64 ulps
#           of float32 (measured 4.6 ulps·V).
#  float16/bfloat16 (HF's rounding): scores rounded to the dtype twice (matmul,
#           ·scale; the softcap adds three more) shift each probability by up to
#           ~|s|·eps relative, probabilities are rounded (eps/2) and the output
#           rounded (eps/2 of |out| <= V/2 · eps... ). With |s| <= 5 that is <= ~4
#           ulps·V in the worst case; measured 0.9 ulp·V (fp16) and 0.8 ulp·V
#           (bf16) over all cases below, so 4 ulps·V.
ATTN_TOL = {
    torch.float32: 64 * EPS[torch.float32],
    torch.float16: 4 * EPS[torch.float16],
    torch.bfloat16: 4 * EPS[torch.bfloat16],
}


def make_cache(B, Hkv, N, D, lengths, dtype, seed, quant=None):
    """k, v [B, Hkv, N, D], slots at n >= L_b poisoned with NaN (dense) or with a
    NaN scale (quantized: every element of those slots dequantizes to NaN)."""
    k = randn(B, Hkv, N, D, seed=seed, dtype=dtype)
    v = randn(B, Hkv, N, D, seed=seed + 1, dtype=dtype)
    past = torch.arange(N)[None, :] >= lengths.to(torch.int64)[:, None]  # [B, N]
    if quant is None:
        k[past[:, None, :, None].expand_as(k)] = math.nan
        v[past[:, None, :, None].expand_as(v)] = math.nan
        return k, v
    group, bits = quant
    out = []
    for t in (k, v):
        qt = QuantizedTensor.from_float(t, group_size=group, bits=bits)
        scales = qt.scales.clone()
        scales[past[:, None, :, None].expand_as(scales)] = math.nan
        out.append(QuantizedTensor(qt.packed, scales, qt.biases, group, bits))
    return tuple(out)


def attention_case(dtype, B, Hq, Hkv, N, D, lengths, seed=50, quant=None, q_scale=1.0):
    lengths = torch.tensor(lengths, dtype=torch.int32)
    q = randn(B, Hq, D, seed=seed, scale=q_scale, dtype=dtype)
    k, v = make_cache(B, Hkv, N, D, lengths, dtype, seed + 2, quant)
    return q, k, v, lengths


def attention_atol(v, lengths, window, dtype) -> torch.Tensor:
    """ATTN_TOL·V per (b, ·, ·): V = max|v| over sequence b's attended slots."""
    v = dense64(v)
    V = torch.zeros(v.shape[0], 1, 1, dtype=torch.float64)
    for b in range(v.shape[0]):
        L = int(lengths[b])
        start = 0 if window is None else max(0, L - window)
        if L:
            V[b] = v[b, :, start:L].abs().max()
    return ATTN_TOL[dtype] * V + TINY[dtype]


LENGTHS = [97, 1, 5, 0]  # B = 4, very different lengths, one empty sequence
GQA = [(4, 4), (4, 2), (8, 2)]  # (Hq, Hkv): ratios 1, 2, 4


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["nocap", "cap5"])
@pytest.mark.parametrize("window", [None, 1, 4, 5, 1000], ids=lambda w: f"win{w}")
@pytest.mark.parametrize("Hq,Hkv", GQA, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_matches_float64(dtype, Hq, Hkv, window, softcap):
    D, N = 64, 100
    # q is scaled up with the softcap so that |s| reaches past it and tanh bends.
    q, k, v, lengths = attention_case(
        dtype, 4, Hq, Hkv, N, D, LENGTHS, q_scale=1.0 if softcap is None else 8.0
    )
    scale = D**-0.5
    out = ref.decode_attention(q, k, v, lengths, scale, window=window, softcap=softcap)
    assert out.shape == (4, Hq, D) and out.dtype == dtype
    assert torch.isfinite(out).all(), "NaN from the slots past a length leaked"
    expected = decode_attention64(q, k, v, lengths, scale, window, softcap)
    check(out, expected, 0.0, attention_atol(v, lengths, window, dtype), f"{dtype}")
    assert torch.equal(out[3], torch.zeros_like(out[3])), "a length-0 sequence must give zeros"


@pytest.mark.parametrize("D", [5, 123, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_odd_head_dims(dtype, D):
    q, k, v, lengths = attention_case(dtype, 3, 6, 3, 97, D, [97, 2, 50], seed=60)
    scale = 0.3
    out = ref.decode_attention(q, k, v, lengths, scale)
    expected = decode_attention64(q, k, v, lengths, scale)
    check(out, expected, 0.0, attention_atol(v, lengths, None, dtype), f"D={D} {dtype}")


def test_decode_attention_softcap_bends_scores():
    """With large scores the softcap must change the result (else the test is vacuous)."""
    q, k, v, lengths = attention_case(torch.float32, 1, 2, 2, 16, 64, [16], q_scale=8.0)
    capped = ref.decode_attention(q, k, v, lengths, 0.125, softcap=2.0)
    plain = ref.decode_attention(q, k, v, lengths, 0.125)
    assert (capped - plain).abs().max() > 1e-2
    check(capped, decode_attention64(q, k, v, lengths, 0.125, None, 2.0), 0.0,
          attention_atol(v, lengths, None, torch.float32), "softcap 2")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_all_empty_gives_zeros(dtype):
    q, k, v, lengths = attention_case(dtype, 2, 4, 2, 8, 32, [0, 0], seed=70)
    for window in (None, 3):
        out = ref.decode_attention(q, k, v, lengths, 0.2, window=window, softcap=3.0)
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_is_per_sequence(dtype):
    """A sequence's output does not depend on the batch it sits in (nor on the
    other sequences' garbage slots)."""
    q, k, v, lengths = attention_case(dtype, 3, 4, 2, 40, 32, [40, 3, 17], seed=80)
    full = ref.decode_attention(q, k, v, lengths, 0.2, window=7)
    for b in range(3):
        alone = ref.decode_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], lengths[b : b + 1], 0.2, window=7)
        check(alone, full[b : b + 1].double(), 0.0, 2 * attention_atol(v[b : b + 1], lengths[b : b + 1], 7, dtype))


QUANT_KV = [(32, 4), (64, 4), (32, 8), (64, 8)]  # (group_size, bits)


@pytest.mark.parametrize("window,softcap", [(None, None), (6, 5.0)], ids=["plain", "win6cap5"])
@pytest.mark.parametrize("Hq,Hkv", GQA, ids=str)
@pytest.mark.parametrize("group,bits", QUANT_KV, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_quantized_kv_matches_float64(dtype, group, bits, Hq, Hkv, window, softcap):
    D, N = 128, 101
    q, k, v, lengths = attention_case(
        dtype, 4, Hq, Hkv, N, D, LENGTHS, seed=90, quant=(group, bits),
        q_scale=1.0 if softcap is None else 8.0,
    )
    assert isinstance(k, QuantizedTensor) and k.shape == (4, Hkv, N, D)
    scale = D**-0.5
    out = ref.decode_attention(q, k, v, lengths, scale, window=window, softcap=softcap)
    assert out.dtype == dtype and torch.isfinite(out).all()
    # The oracle reads the *dequantized* cache (s·q + e in float64); compat
    # dequantizes in float32 and rounds to the dtype: half an ulp per K/V element,
    # which moves the output by <= ~(|s| + 1)·eps/2·V, inside ATTN_TOL's budget.
    expected = decode_attention64(q, k, v, lengths, scale, window, softcap)
    check(out, expected, 0.0, attention_atol(v, lengths, window, dtype), f"{bits}-bit g{group}")
    assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_decode_attention_accepts_int64_lengths():
    q, k, v, lengths = attention_case(torch.float32, 2, 2, 1, 9, 16, [9, 4], seed=95)
    a = ref.decode_attention(q, k, v, lengths, 0.25)
    b = ref.decode_attention(q, k, v, lengths.to(torch.int64), 0.25)
    assert_bitwise(a, b)


def test_decode_attention_rejects_bad_inputs():
    B, Hq, Hkv, N, D = 2, 4, 2, 8, 16
    q = torch.zeros(B, Hq, D)
    k = v = torch.zeros(B, Hkv, N, D)
    L = torch.tensor([3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="head dim"):
        ref.decode_attention(torch.zeros(B, Hq, D + 1), k, v, L, 1.0)
    with pytest.raises(ValueError, match="head dim"):
        ref.decode_attention(q, k, torch.zeros(B, Hkv, N, D + 1), L, 1.0)
    with pytest.raises(ValueError, match=r"q heads \(3\) must be a multiple of kv heads \(2\)"):
        ref.decode_attention(torch.zeros(B, 3, D), k, v, L, 1.0)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, Nmax=8\]"):
        ref.decode_attention(q, k, v, torch.tensor([3, 9], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, Nmax=8\]"):
        ref.decode_attention(q, k, v, torch.tensor([-1, 2], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="lengths must be int32/int64 of shape"):
        ref.decode_attention(q, k, v, torch.tensor([3, 8, 1], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="lengths must be int32/int64 of shape"):
        ref.decode_attention(q, k, v, torch.tensor([[3, 8]], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="lengths must be int32/int64 of shape"):
        ref.decode_attention(q, k, v, torch.tensor([3.0, 8.0]), 1.0)
    for window in (0, -2):
        with pytest.raises(ValueError, match="window must be a positive number"):
            ref.decode_attention(q, k, v, L, 1.0, window=window)
    with pytest.raises(ValueError, match="softcap must be positive"):
        ref.decode_attention(q, k, v, L, 1.0, softcap=0.0)
    with pytest.raises(ValueError, match="k has batch 3 but q has batch 2"):
        ref.decode_attention(q, torch.zeros(3, Hkv, N, D), v, L, 1.0)
    with pytest.raises(ValueError, match="must be \\[B, Hkv, Nmax, D\\]"):
        ref.decode_attention(q, torch.zeros(B, Hkv, D), v, L, 1.0)
    # The same checks hold for a quantized cache (head dim 32 vs q's 16).
    kq = QuantizedTensor.from_float(torch.zeros(B, Hkv, N, 32), group_size=32, bits=4)
    with pytest.raises(ValueError, match="head dim 32 but q has head dim 16"):
        ref.decode_attention(q, kq, kq, L, 1.0)
