"""Tests for qfuse.reference (the compat tier) on CPU.

Every op is checked against an independent float64 computation written here
from the math (never by calling reference.py's helpers), in float32 and, where
the op has low-precision use, in float16/bfloat16. The oracle takes the *same*
(already rounded) inputs as the op under test, so a tolerance bounds only the
rounding the op itself does. Elementwise ops and a single matmul get a
(dtype → tolerance) table; composite ops (mlp, decode attention) get a
per-element first-order error bound propagated from those tables, so no
tolerance below is a tuned number. Where Hugging Face defines the op (RMSNorm,
the tanh GELU, SiLU, RoPE, eager attention) compat must also be bitwise equal to
HF's, because compat's contract is to round exactly where HF rounds.

Shapes: B batch, Hq/Hkv query/KV heads, N cache length, D head dim,
K/I/H features. Odd sizes (5, 97, 123) sit next to real ones.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from qfuse import reference as ref
from qfuse.quant import QuantizedTensor, unpack

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Machine epsilon (one ulp at 1.0): float32 2^-23, float16 2^-10, bfloat16 2^-7.
# Rounding to nearest moves a value by at most EPS/2 relative ("half an ulp").
EPS = {dt: torch.finfo(dt).eps for dt in DTYPES}
# Smallest positive subnormal: the absolute rounding step near 0.
TINY = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}
U32 = 2.0**-24  # half an ulp of float32 at 1.0

ACTS = ("gelu_tanh", "silu")


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------


def randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32):
    """Seeded normal samples, drawn in float64 and rounded once to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def check(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol=0.0, what: str = ""):
    """Assert |actual − expected| <= atol + rtol·|expected| elementwise (atol may be a
    tensor: a per-element bound), and that ``actual`` is finite."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a, e = actual.to(torch.float64), expected.to(torch.float64)
    assert torch.isfinite(a).all(), f"{what}: non-finite values in the output"
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    bad = err > bound
    if bad.any():
        i = int((err / bound.clamp_min(1e-300)).flatten().argmax())
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
    """±0, ±inf, NaN, subnormals, extremes and the region where 1 + tanh cancels."""
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


def act_slope64(x: torch.Tensor, act: str) -> torch.Tensor:
    """|act'(x)| in float64 (for error propagation)."""
    x = x.to(torch.float64).detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(ACT64[act](x).sum(), x)
    return grad.abs()


def rms_norm64(x, w, eps: float, unit_offset: bool) -> torch.Tensor:
    x, w = x.to(torch.float64), w.to(torch.float64)
    rms = torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return x / rms * ((1.0 + w) if unit_offset else w)


def rotate64(x, cos, sin) -> torch.Tensor:
    """Rotate-half RoPE: pair (i, i + D/2) turned by the angle whose cos/sin sit at i."""
    x, cos, sin = x.to(torch.float64), cos.to(torch.float64), sin.to(torch.float64)
    D = x.shape[-1]
    out = torch.empty_like(x)
    for i in range(D // 2):
        j = i + D // 2
        out[..., i] = x[..., i] * cos[..., i] - x[..., j] * sin[..., i]
        out[..., j] = x[..., j] * cos[..., j] + x[..., i] * sin[..., j]
    return out


def rope_angles64(positions: torch.Tensor, head_dim: int, base: float) -> torch.Tensor:
    """[..., T, D] angles p·base^(-2i/D), i = 0..D/2-1, repeated for the pair's second half."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    ang = positions.to(torch.float64)[..., None] * base ** (-2.0 * i / head_dim)
    return torch.cat([ang, ang], dim=-1)


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


def attended(L: int, window: int | None) -> range:
    """Positions sequence of length L attends to: [max(0, L − window), L)."""
    return range(0 if window is None else max(0, L - window), L)


def decode_attention64(q, k, v, lengths, scale, window=None, softcap=None) -> torch.Tensor:
    """Explicit loops: sequence b, query head h reads KV head h // (Hq/Hkv) at the
    attended positions only; softmax over those positions; nothing → zeros."""
    q, k, v = q.to(torch.float64), dense64(k), dense64(v)
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        pos = attended(int(lengths[b]), window)
        if not pos:
            continue
        for h in range(Hq):
            kh, vh = k[b, h // G, pos.start : pos.stop], v[b, h // G, pos.start : pos.stop]
            s = (kh @ q[b, h]) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            p = torch.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ vh
    return out


# ----------------------------------------------------------------------------
# Activations and gated activations
# ----------------------------------------------------------------------------

# (rtol, atol) of one elementwise result. PyTorch's CPU kernels compute act in
# float32 and round the result to the dtype.
#  float32: Sleef's tanh/exp are accurate to 1 ulp, plus the roundings of the
#           polynomial, the division and the gate product: 4 ulps.
#  float16/bfloat16: act(a) rounded once, act(a)·b rounded again: two half-ulp
#           roundings = 1 ulp; the float32 work inside adds < 1e-3 ulp: 1.01 ulps.
#  atol: the subnormal step (two half-steps), for results that underflow.
# Worst err/bound seen below: 0.50 (float32), 0.93 (float16, bfloat16: the two
# roundings really do add up to almost a whole ulp).
ACT_TOL = {
    torch.float32: (4 * EPS[torch.float32], TINY[torch.float32]),
    torch.float16: (1.01 * EPS[torch.float16], TINY[torch.float16]),
    torch.bfloat16: (1.01 * EPS[torch.bfloat16], TINY[torch.bfloat16]),
}
# GELU's 1 + tanh(y) cancels in float32 for a ≲ -3: tanh(y) ≈ -1 is known to
# ~1 ulp of 1 (2^-23), so gelu(a) carries an *absolute* error up to
# 0.5·|a|·2^-23 whatever the output dtype (·|b| after the gate). That is the
# formula's float32 conditioning, HF's too; the bound adds it per element.
GELU_CANCEL = 0.5 * 2.0**-23


def act_bound(a: torch.Tensor, act: str, dtype: torch.dtype, b: torch.Tensor | None = None):
    """(rtol, per-element atol) for act(a) (·b)."""
    rtol, atol = ACT_TOL[dtype]
    if act != "gelu_tanh":
        return rtol, atol
    cancel = GELU_CANCEL * a.to(torch.float64).abs()
    if b is not None:
        cancel = cancel * b.to(torch.float64).abs()
    return rtol, atol + cancel


ELEM_SHAPES = [(5,), (123,), (3, 4096)]


@pytest.mark.parametrize("shape", ELEM_SHAPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activation_matches_float64(dtype, act, shape):
    a = randn(*shape, seed=1, scale=3.0, dtype=dtype)  # |a| up to ~13: both tails
    y = ref.activation(a, act)
    assert y.dtype == dtype
    rtol, atol = act_bound(a, act, dtype)
    check(y, ACT64[act](a), rtol, atol, f"{act} {dtype}")


@pytest.mark.parametrize("shape", ELEM_SHAPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_act_matches_float64(dtype, act, shape):
    a = randn(*shape, seed=2, scale=3.0, dtype=dtype)
    b = randn(*shape, seed=3, dtype=dtype)
    y = ref.gated_act(a, b, act)
    assert y.dtype == dtype
    rtol, atol = act_bound(a, act, dtype, b)
    check(y, ACT64[act](a) * b.to(torch.float64), rtol, atol, f"gated {act} {dtype}")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_act_bitwise_equals_pytorch_and_hf(dtype, act):
    """compat rounds where HF's MLP rounds: act(a) in the dtype, then ·b."""
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
        ref.gated_act(a, a, "gelu")  # the exact-erf GELU is not the tanh one


# ----------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------

# (rtol, atol) of RMSNorm. The float32 part: a sum of K squares (vectorised, far
# below its K·u worst case), rsqrt (~1 ulp) and two products: 8 ulps of float32.
# In float16/bfloat16 Llama rounds x/rms to the dtype and again after ·w (two
# half-ulp roundings = 1 ulp); Gemma rounds once. 1.01 ulps covers both plus the
# float32 part. atol: the subnormal step, for outputs that underflow in float16.
# Worst err/bound seen below: 0.30 (float32), 0.92 (float16, bfloat16; Llama).
RMS_TOL = {
    torch.float32: (8 * EPS[torch.float32], TINY[torch.float32]),
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




# ----------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------


def inv_freq_rtol(base: float) -> float:
    """Relative error of float32 1/base^(2i/D): 2i/D is rounded (half an ulp, which
    base^e turns into ln(base)·e <= ln(base) half-ulps); pow and 1/x add ~1.5 ulps."""
    return (math.log(base) + 3) * U32


@pytest.mark.parametrize("base", [10000.0, 1e6])
@pytest.mark.parametrize("head_dim", [8, 64, 256])
def test_rope_inv_freq_matches_float64(head_dim, base):
    inv = ref.rope_inv_freq(head_dim, base)
    assert inv.dtype == torch.float32 and inv.shape == (head_dim // 2,)
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    check(inv, base ** (-2.0 * i / head_dim), inv_freq_rtol(base), 0.0, "inv_freq")


def angle_err(ang: torch.Tensor, base: float) -> torch.Tensor:
    """Absolute error of the float32 angle p·θ_i: θ_i's relative error plus half an
    ulp for the product, times |p·θ_i|. cos and sin are 1-Lipschitz, so this also
    bounds what it does to them."""
    return ang.abs() * (inv_freq_rtol(base) + U32)


@pytest.mark.parametrize("scaling", [1.0, 0.7])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_cos_sin_matches_float64(dtype, scaling):
    D, base = 128, 500000.0
    positions = torch.tensor(
        [[0, 1, 2, 7, 97, 1000, 4095, 8191], [3, 5, 123, 0, 1, 2, 40000, 131071]]
    )
    cos, sin = ref.rope_cos_sin(positions, ref.rope_inv_freq(D, base), dtype, scaling)
    assert cos.shape == sin.shape == (2, 8, D) and cos.dtype == sin.dtype == dtype
    ang = rope_angles64(positions, D, base)
    # The float32 angle error (it grows with the position: HF computes the same),
    # float32 cos/sin and the ·scaling product (~2 ulps of 1), and the rounding of
    # a value in [-1, 1] to the dtype (at most half an ulp of 1).
    atol = angle_err(ang, base) + 4 * U32 + EPS[dtype] / 2
    check(cos, scaling * torch.cos(ang), 0.0, atol, f"cos {dtype}")
    check(sin, scaling * torch.sin(ang), 0.0, atol, f"sin {dtype}")


def pair_swap(x: torch.Tensor) -> torch.Tensor:
    """x with its halves swapped: element i holds its RoPE partner i ± D/2."""
    half = x.shape[-1] // 2
    return torch.cat([x[..., half:], x[..., :half]], dim=-1)


@pytest.mark.parametrize("D", [8, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_apply_rotary_matches_float64(dtype, D):
    B, H, T = 2, 3, 5
    x = randn(B, H, T, D, seed=20, dtype=dtype)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 97, 123, 1000, 4095]])
    cos, sin = ref.rope_cos_sin(positions, ref.rope_inv_freq(D, 10000.0), dtype)
    y = ref.apply_rotary(x, cos, sin)
    assert y.shape == x.shape and y.dtype == dtype
    c, s = cos[:, None], sin[:, None]  # the op's own inputs: no angle error here
    # y_i = x_i·c ∓ x_j·s: both products and the sum are rounded to the dtype, three
    # half-ulp roundings of magnitudes <= |x_i·c| + |x_j·s|: 1 ulp of that (+1%),
    # and the subnormal step for float16 products that underflow.
    mag = (x.double() * c.double()).abs() + (pair_swap(x).double() * s.double()).abs()
    atol = 1.01 * EPS[dtype] * mag + 2 * TINY[dtype]
    check(y, rotate64(x, c, s), 0.0, atol, f"rotary {dtype}")


def test_rope_end_to_end_matches_float64_and_preserves_norm():
    """inv_freq → cos/sin → rotate in float32 against rotation by exact angles."""
    D, base = 64, 10000.0
    x = randn(1, 2, 6, D, seed=21)
    positions = torch.tensor([[0, 1, 5, 97, 123, 511]])
    cos, sin = ref.rope_cos_sin(positions, ref.rope_inv_freq(D, base), torch.float32)
    y = ref.apply_rotary(x, cos, sin)
    ang = rope_angles64(positions, D, base)[:, None]  # [1, 1, T, D]
    expected = rotate64(x, torch.cos(ang), torch.sin(ang))
    # Each output moves by (cos/sin error) · (|x_i| + |x_j|): the angle error and
    # float32 cos/sin (test_rope_cos_sin), plus the rotation's own 3 roundings.
    pair = x.double().abs() + pair_swap(x).double().abs()
    atol = pair * (angle_err(ang, base) + 4 * U32) + 3 * U32 * pair
    check(y, expected, 0.0, atol, "rope float32")
    # A rotation keeps every (i, i + D/2) pair's length (to float32 rounding).
    half = D // 2
    n_in = x[..., :half].double() ** 2 + x[..., half:].double() ** 2
    n_out = y[..., :half].double() ** 2 + y[..., half:].double() ** 2
    check(n_out, n_in, 1e-5, 0.0, "pair norms")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_bitwise_equals_hf(dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

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

# (rtol, acc) of one matmul output y = Σ_k x_k·w_k (+ bias): |err| <= rtol·|y| +
# acc·M with M = Σ_k |x_k·w_k| (+ |bias|). The classic worst case is acc = K·u;
# blocked float32 accumulation stays far below it: 16 ulps of float32.
#  float16/bfloat16: CPU matmuls accumulate in float32 and round the result once
#  (half an ulp, relative). Worst err/bound seen below: 0.06 (float32), 0.99
#  (float16, bfloat16: the single rounding is the whole error).
LINEAR_TOL = {
    torch.float32: (0.0, 16 * EPS[torch.float32]),
    torch.float16: (0.5 * EPS[torch.float16], 16 * EPS[torch.float32]),
    torch.bfloat16: (0.5 * EPS[torch.bfloat16], 16 * EPS[torch.float32]),
}


def weight_err(w, dtype: torch.dtype) -> torch.Tensor:
    """Bound on |dense_weight(w, dtype) − dense64(w)|: 0 for a dense weight already in
    ``dtype``; for a quantized one, s·q + e in float32 (two roundings, each at most
    half an ulp of |s·q| + |e|) and, below float32, the rounding to the dtype."""
    if not isinstance(w, QuantizedTensor):
        assert w.dtype == dtype
        return torch.zeros(w.shape, dtype=torch.float64)
    codes = unpack(w.packed, w.bits).to(torch.float64)
    g = codes.reshape(*codes.shape[:-1], -1, w.group_size)
    s, e = w.scales.to(torch.float64)[..., None], w.biases.to(torch.float64)[..., None]
    err = (2 * U32 * ((g * s).abs() + e.abs())).reshape(codes.shape)
    if dtype != torch.float32:
        err = err + EPS[dtype] / 2 * dequant64(w).abs()
    return err


def linear_bound(x: torch.Tensor, w, bias, dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound on |linear(x, w, bias) − linear64(x, w, bias)| for an exact x."""
    rtol, acc = LINEAR_TOL[dtype]
    x64 = x.to(torch.float64).abs()
    M = x64 @ dense64(w).abs().T
    if bias is not None:
        M = M + bias.to(torch.float64).abs()
    y = linear64(x, w, bias).abs()
    return rtol * y + acc * M + x64 @ weight_err(w, dtype).T + TINY[dtype]


def make_weight(N: int, K: int, dtype, quant, seed: int):
    """Dense [N, K] weight in ``dtype`` (W ~ N(0, 1/K): outputs O(1)) or a
    QuantizedTensor made from it with quant = (group_size, bits)."""
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
    check(y, linear64(x, w, bias), 0.0, linear_bound(x, w, bias, dtype), f"linear {dtype}")


def test_linear_quantized_equals_dense_dequantized():
    """A quantized weight acts exactly as its dequantized dense copy."""
    x = randn(3, 256, seed=33)
    w = make_weight(64, 256, torch.float32, (64, 4), seed=34)
    assert_bitwise(ref.linear(x, w), ref.linear(x, w.dequantize(torch.float32)))


def mlp_bound(x, gate, up, down, act, residual, dtype) -> torch.Tensor:
    """First-order bound on |mlp − mlp64|, propagated from the tables above:
    g = x·Gᵀ, u = x·Uᵀ (linear_bound each); h = act(g)·u adds the gated rounding
    (ACT_TOL) and inherits |act'(g)·u|·δg + |act(g)|·δu; y = h·Dᵀ inherits Σ|δh|·|D|
    and adds its own linear_bound; the residual add rounds once more.
    Worst err/bound seen: 0.02 (float32), 0.70 (float16), 0.63 (bfloat16)."""
    g, u = linear64(x, gate), linear64(x, up)
    e_g, e_u = linear_bound(x, gate, None, dtype), linear_bound(x, up, None, dtype)
    a = ACT64[act](g)
    h = a * u
    rtol, atol = act_bound(g, act, dtype, u)
    e_h = act_slope64(g, act) * u.abs() * e_g + a.abs() * e_u + rtol * h.abs() + atol
    e_y = e_h @ dense64(down).abs().T + linear_bound(h, down, None, dtype)
    if residual is not None:
        y = linear64(h, down) + residual.to(torch.float64)
        e_y = e_y + EPS[dtype] / 2 * y.abs()
    return e_y


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
    bound = mlp_bound(x, gate, up, down, act, residual, dtype)
    check(y, mlp64(x, gate, up, down, act, residual), 0.0, bound, f"mlp {act} {dtype}")




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
        expected = [n in attended(L, window) for n in range(N)]
        assert mask[b].tolist() == expected, f"sequence {b} (L={L}, window={window})"


def decode_attention_bound(q, k, v, lengths, scale, window, softcap, dtype) -> torch.Tensor:
    """First-order bound on |decode_attention − decode_attention64| per output element,
    for HF's rounding (u = half an ulp of the dtype, ACC = LINEAR_TOL's float32
    accumulation constant):
      score  s = (q·k)·scale: δs <= scale·(ACC·Σ|q||k| + u·|q·k| + Σ|q|·δk) + u·|s|
             (δk: dequantization, weight_err); the softcap c·tanh(s/c) is
             1-Lipschitz and adds three roundings: + u·|s| + (2u + 2u32)·|s'|;
      probs  softmax in float32 then rounded: δp_n <= p_n·(δs_n + Σ_m p_m·δs_m
             + u + 4u32);
      out    Σ p·v accumulated in float32 and rounded: Σ δp_n·|v_n| +
             Σ p_n·(ACC·|v_n| + δv_n) + u·|out|.
    Worst err/bound seen: 0.20 (float32, 4-bit KV), 0.41 (float16, bfloat16)."""
    u, acc = EPS[dtype] / 2, LINEAR_TOL[dtype][1]
    q64, k64, v64 = q.to(torch.float64), dense64(k), dense64(v)
    dk = weight_err(k, dtype) if isinstance(k, QuantizedTensor) else torch.zeros_like(k64)
    dv = weight_err(v, dtype) if isinstance(v, QuantizedTensor) else torch.zeros_like(v64)
    B, Hq, D = q.shape
    G = Hq // k64.shape[1]
    bound = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        pos = attended(int(lengths[b]), window)
        if not pos:
            continue  # exact zeros, checked separately
        sl = slice(pos.start, pos.stop)
        for h in range(Hq):
            qh, kh, vh = q64[b, h], k64[b, h // G, sl], v64[b, h // G, sl]
            qk = kh @ qh
            s = qk * scale
            e_s = scale * (acc * (kh.abs() @ qh.abs()) + u * qk.abs() + dk[b, h // G, sl] @ qh.abs())
            e_s = e_s + u * s.abs()
            if softcap is not None:
                s_capped = softcap * torch.tanh(s / softcap)
                e_s = e_s + u * s.abs() + (2 * u + 2 * U32) * s_capped.abs()
                s = s_capped
            p = torch.softmax(s, dim=0)
            e_p = p * (e_s + (p * e_s).sum() + u + 4 * U32)
            out = p @ vh
            bound[b, h] = (
                e_p @ vh.abs() + p @ (acc * vh.abs() + dv[b, h // G, sl]) + u * out.abs()
            )
    return bound + TINY[dtype]


def make_cache(B, Hkv, N, D, lengths, dtype, seed, quant=None, poison=None):
    """k, v [B, Hkv, N, D] ~ N(0, 1). Slots where ``poison`` [B, N] is True (default:
    n >= L_b, past each length) hold NaN; for a quantized cache their scales are
    NaN, so every element of those slots dequantizes to NaN."""
    k = randn(B, Hkv, N, D, seed=seed, dtype=dtype)
    v = randn(B, Hkv, N, D, seed=seed + 1, dtype=dtype)
    if poison is None:
        poison = torch.arange(N)[None, :] >= lengths.to(torch.int64)[:, None]
    if quant is None:
        for t in (k, v):
            t[poison[:, None, :, None].expand_as(t)] = math.nan
        return k, v
    group, bits = quant
    out = []
    for t in (k, v):
        qt = QuantizedTensor.from_float(t, group_size=group, bits=bits)
        scales = qt.scales.clone()
        scales[poison[:, None, :, None].expand_as(scales)] = math.nan
        out.append(QuantizedTensor(qt.packed, scales, qt.biases, group, bits))
    return tuple(out)


def attention_case(dtype, B, Hq, Hkv, N, D, lengths, seed=50, quant=None, q_scale=1.0, poison=None):
    lengths = torch.tensor(lengths, dtype=torch.int32)
    q = randn(B, Hq, D, seed=seed, scale=q_scale, dtype=dtype)
    k, v = make_cache(B, Hkv, N, D, lengths, dtype, seed + 2, quant, poison)
    return q, k, v, lengths


def check_attention(out, q, k, v, lengths, scale, window, softcap, what=""):
    """Shape, dtype, no leaked NaN, exact zeros for empty sequences, float64 bound."""
    dtype = q.dtype
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), f"{what}: NaN from unattended slots leaked"
    for b in range(q.shape[0]):
        if not attended(int(lengths[b]), window):
            assert torch.equal(out[b], torch.zeros_like(out[b])), f"{what}: sequence {b} not 0"
    expected = decode_attention64(q, k, v, lengths, scale, window, softcap)
    bound = decode_attention_bound(q, k, v, lengths, scale, window, softcap, dtype)
    check(out, expected, 0.0, bound, what)


LENGTHS = [97, 1, 5, 0]  # B = 4: very different lengths, one empty sequence
GQA = [(4, 4), (4, 2), (8, 2)]  # (Hq, Hkv): ratios 1, 2, 4
# q is scaled up with the softcap so that |s| (up to ~25) reaches well past it.
CAP = 5.0


@pytest.mark.parametrize("softcap", [None, CAP], ids=["nocap", "cap"])
@pytest.mark.parametrize("window", [None, 1, 4, 5, 1000], ids=lambda w: f"win{w}")
@pytest.mark.parametrize("Hq,Hkv", GQA, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_matches_float64(dtype, Hq, Hkv, window, softcap):
    D, N = 64, 100
    q, k, v, lengths = attention_case(
        dtype, 4, Hq, Hkv, N, D, LENGTHS, q_scale=1.0 if softcap is None else 8.0
    )
    scale = D**-0.5
    out = ref.decode_attention(q, k, v, lengths, scale, window=window, softcap=softcap)
    check_attention(out, q, k, v, lengths, scale, window, softcap, f"{dtype} w={window}")


@pytest.mark.parametrize("D", [5, 123, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_odd_head_dims(dtype, D):
    q, k, v, lengths = attention_case(dtype, 3, 6, 3, 97, D, [97, 2, 50], seed=60)
    out = ref.decode_attention(q, k, v, lengths, 0.3)
    check_attention(out, q, k, v, lengths, 0.3, None, None, f"D={D} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_ignores_slots_outside_the_window(dtype):
    """Slots before the window start (still < L) may hold anything too, e.g. NaN."""
    lengths, window, N = [40, 3, 17], 7, 48
    poison = torch.tensor([[n not in attended(L, window) for n in range(N)] for L in lengths])
    q, k, v, L = attention_case(dtype, 3, 4, 2, N, 32, lengths, seed=65, poison=poison)
    out = ref.decode_attention(q, k, v, L, 0.2, window=window, softcap=CAP)
    check_attention(out, q, k, v, L, 0.2, window, CAP, f"{dtype}")


def test_decode_attention_softcap_bends_scores():
    """With large scores the softcap must change the result (else the tests above
    would not see a missing or misplaced cap)."""
    q, k, v, lengths = attention_case(torch.float32, 1, 2, 2, 16, 64, [16], q_scale=8.0)
    capped = ref.decode_attention(q, k, v, lengths, 0.125, softcap=2.0)
    plain = ref.decode_attention(q, k, v, lengths, 0.125)
    assert (capped - plain).abs().max() > 1e-2
    check_attention(capped, q, k, v, lengths, 0.125, None, 2.0, "softcap 2")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_all_empty_gives_zeros(dtype):
    q, k, v, lengths = attention_case(dtype, 2, 4, 2, 8, 32, [0, 0], seed=70)
    for window in (None, 3):
        out = ref.decode_attention(q, k, v, lengths, 0.2, window=window, softcap=3.0)
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_is_per_sequence(dtype):
    """A sequence's output does not depend on the batch it sits in."""
    q, k, v, lengths = attention_case(dtype, 3, 4, 2, 40, 32, [40, 3, 17], seed=80)
    full = ref.decode_attention(q, k, v, lengths, 0.2, window=7)
    for b in range(3):
        one = slice(b, b + 1)
        alone = ref.decode_attention(q[one], k[one], v[one], lengths[one], 0.2, window=7)
        # Both are within the bound of the same float64 value.
        bound = decode_attention_bound(q[one], k[one], v[one], lengths[one], 0.2, 7, None, dtype)
        check(alone, full[one].to(torch.float64), 0.0, 2 * bound, f"sequence {b}")


QUANT_KV = [(32, 4), (64, 4), (32, 8), (64, 8)]  # (group_size, bits)


@pytest.mark.parametrize("window,softcap", [(None, None), (6, CAP)], ids=["plain", "win6cap"])
@pytest.mark.parametrize("Hq,Hkv", GQA, ids=str)
@pytest.mark.parametrize("group,bits", QUANT_KV, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_quantized_kv_matches_float64(dtype, group, bits, Hq, Hkv, window, softcap):
    """Against the float64 computation on the *dequantized* cache (s·q + e)."""
    D, N = 128, 101
    q, k, v, lengths = attention_case(
        dtype, 4, Hq, Hkv, N, D, LENGTHS, seed=90, quant=(group, bits),
        q_scale=1.0 if softcap is None else 8.0,
    )
    assert isinstance(k, QuantizedTensor) and k.shape == (4, Hkv, N, D) and k.dtype == dtype
    scale = D**-0.5
    out = ref.decode_attention(q, k, v, lengths, scale, window=window, softcap=softcap)
    check_attention(out, q, k, v, lengths, scale, window, softcap, f"{bits}-bit g{group}")


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    data=st.data(),
    B=st.integers(1, 4),
    Hkv=st.integers(1, 3),
    G=st.sampled_from([1, 2, 4]),
    D=st.integers(1, 40),
    N=st.integers(1, 70),
    window=st.one_of(st.none(), st.integers(1, 80)),
    softcap=st.one_of(st.none(), st.floats(0.5, 30.0)),
)
def test_decode_attention_random_configs_float32(data, B, Hkv, G, D, N, window, softcap):
    lengths = data.draw(st.lists(st.integers(0, N), min_size=B, max_size=B), label="lengths")
    q, k, v, L = attention_case(torch.float32, B, Hkv * G, Hkv, N, D, lengths, q_scale=3.0)
    scale = D**-0.5
    out = ref.decode_attention(q, k, v, L, scale, window=window, softcap=softcap)
    check_attention(out, q, k, v, L, scale, window, softcap, "random")


@pytest.mark.parametrize("softcap", [None, CAP], ids=["nocap", "cap"])
@pytest.mark.parametrize("window", [None, 4], ids=lambda w: f"win{w}")
@pytest.mark.parametrize("Hq,Hkv", GQA, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_agrees_with_hf_eager(dtype, Hq, Hkv, window, softcap):
    """HF's eager attention (Gemma2's: it has the softcap) with an additive mask built
    from the definition: same masking, window and soft-cap semantics. Compat rounds
    as the flash kernels do (float32 scores), HF eager rounds scores to the model
    dtype, so both must lie within the float64 bound, and in float32 (where the
    two roundings coincide up to summation order) within the sum of the two bounds."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    B, N, D = 3, 97, 64
    lengths = [97, 5, 40]  # HF has no notion of an empty sequence
    q, _, _, L = attention_case(dtype, B, Hq, Hkv, N, D, lengths, seed=100, q_scale=2.0)
    k = randn(B, Hkv, N, D, seed=101, dtype=dtype)  # no NaN: HF's 0·NaN would leak
    v = randn(B, Hkv, N, D, seed=102, dtype=dtype)
    scale = D**-0.5
    mask = torch.full((B, 1, 1, N), torch.finfo(dtype).min, dtype=dtype)
    for b, Lb in enumerate(lengths):
        for n in attended(Lb, window):
            mask[b, 0, 0, n] = 0
    module = types.SimpleNamespace(num_key_value_groups=Hq // Hkv, training=False)
    hf, _ = eager_attention_forward(module, q[:, :, None], k, v, mask, scaling=scale, softcap=softcap)
    hf = hf[:, 0]  # [B, 1, Hq, D] → [B, Hq, D]
    out = ref.decode_attention(q, k, v, L, scale, window=window, softcap=softcap)
    if dtype == torch.float32:
        # One formula, but the BLAS sums q·k in its kernel's order (compat: [G, D] blocks,
        # HF: a row per head; MKL picks kernels by CPU). Scores with scale·Σ|q||k| ≈ 13
        # carry ~1 ulp (9.5e-7), so the former atol=1e-6 failed on AVX-512 (1.1e-6) and
        # passed on AVX2. Each side is within the float32 bound; their difference twice it.
        bound = decode_attention_bound(q, k, v, L, scale, window, softcap, dtype)
        check(out, hf, 0.0, 2 * bound, "compat vs HF (float32)")
    check_attention(out, q, k, v, L, scale, window, softcap, "compat")
    check_attention(hf, q, k, v, L, scale, window, softcap, "HF")


def test_decode_attention_accepts_int64_lengths():
    q, k, v, lengths = attention_case(torch.float32, 2, 2, 1, 9, 16, [9, 4], seed=95)
    a = ref.decode_attention(q, k, v, lengths, 0.25)
    b = ref.decode_attention(q, k, v, lengths.to(torch.int64), 0.25)
    assert_bitwise(a, b)
