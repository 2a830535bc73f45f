"""A checkpoint written by `qfuse quantize` loads in Apple's mlx-lm and gives qfuse's logits.

`quantize_checkpoint` writes the MLX affine layout (`<module>.weight` packed uint32,
`.scales`, `.biases`, and a `quantization` block in config.json, per-module overrides
included). This test quantizes the bundled gemma3_text model (plain 4-bit, and 4-bit with
an 8-bit override on one module), loads each result with `mlx_lm.utils.load_model` and with
`qfuse.loading.load_model`, and compares the logits of both on a prompt longer than the
model's 128-token sliding window. So mlx-lm accepts the tensor names, packing, scale/bias
layout and quantization block that qfuse writes, and mlx-lm and qfuse's compat tier compute
the same function from them.

Both sides run in float32. mlx's CPU quantized matmul in bf16 accumulates in bf16: the
scalar `_qmm_t` in mlx/backend/cpu/quantized.cpp starts from `T sum = 0`. Against an fp32
reference its median relative error grows with K, from 1% at K=64 to 6% at K=4096. On this
model, mlx-lm's bf16 logits are up to 0.78 away from its own float32 ones, with 20-30% of
the argmaxes changed, so a bf16 comparison would measure mlx's CPU rounding rather than the
checkpoint.

There is one known difference between the two. mlx-lm's gemma3_text always rounds the
embedding multiplier sqrt(hidden_size) to bf16, whatever dtype it computes in:
`h *= mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)` (sqrt(384) =
19.5959 becomes 19.625). qfuse rounds it to the model dtype, as HF does, so in float32 it
stays 19.5959. With qfuse's multiplier set to mlx-lm's value, the two agree to float32 noise.
Unchanged, they still agree closely (max |Δlogit| 0.02, KL 2e-5); the argmax differs only
at near-ties.

The `dev` extra installs mlx[cpu] and mlx-lm on Linux x86-64, so CI runs this; elsewhere it
skips where mlx-lm is not installed (pip install "mlx[cpu]" mlx-lm).
"""

import math

import pytest

mlx_lm = pytest.importorskip("mlx_lm")

import mlx.core as mx
import numpy as np
import torch
from mlx_lm.utils import load_model as mlx_load_model

from qfuse.convert import quantize_checkpoint
from qfuse.loading import DEFAULT_MODEL, load_model, load_tokenizer
from qfuse.models import ModelConfig

OVERRIDE = "model.layers.0.mlp.down_proj"
VARIANTS = {
    "q4": {},
    "q4_down0_q8": {OVERRIDE: {"bits": 8, "group_size": 64}},
}
SNIPPET = ("def fibonacci(n):\n    if n < 2:\n        return n\n"
           "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx_interop")
    return {name: quantize_checkpoint(DEFAULT_MODEL, root / name, bits=4, group_size=64,
                                      overrides=ov)
            for name, ov in VARIANTS.items()}


def _log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _compare(ref, other):
    """(max |Δlogit|, max over positions of KL(ref ‖ other), argmax agreement fraction)."""
    lr, lo = _log_softmax(ref), _log_softmax(other)
    kl = (np.exp(lr) * (lr - lo)).sum(-1)
    return (float(np.abs(ref - other).max()), float(kl.max()),
            float((ref.argmax(-1) == other.argmax(-1)).mean()))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mlx_lm_matches_qfuse(checkpoints, variant, monkeypatch):
    dst = checkpoints[variant]
    tok = load_tokenizer(dst)
    # "def fibonacci(n):\n", then more code: longer than the 128-token sliding window, so the
    # sliding-window layers' mask counts too (attention is causal, so positions 0..9 are
    # also the logits of the short prompt alone).
    ids = tok.encode("def fibonacci(n):\n").ids + tok.encode(SNIPPET * 6).ids
    assert len(ids) > 128

    # mlx-lm side: it read the quantization block, override included.
    mlx_model, _ = mlx_load_model(dst)
    assert mlx_model.model.embed_tokens.bits == 4  # tied: the quantized embedding is the head
    assert mlx_model.model.layers[0].mlp.down_proj.bits == (8 if variant != "q4" else 4)
    assert mlx_model.model.layers[1].mlp.down_proj.bits == 4
    mlx_model.set_dtype(mx.float32)  # scales/biases and norms; packed uint32 weights stay
    out = mlx_model(mx.array([ids]))
    assert out.dtype == mx.float32
    mlx_logits = np.array(out)[0]

    # qfuse side: compat tier, float32, CPU.
    monkeypatch.setenv("QFUSE_TIER", "compat")
    model = load_model(dst)
    with torch.no_grad():
        qfuse_logits = model(torch.tensor([ids])).float().numpy()[0]
    # Measured (mlx 0.32.4, mlx-lm 0.32.2, 267 tokens): max |Δ| 0.0217 on logits up to ~15,
    # max KL 2.3e-5, both variants. This comes from the bf16-vs-exact embedding multiplier
    # (relative 1.5e-3) carried through the residual stream. Argmax: 267/267 for q4. For
    # the override variant, 266/267: position 13 is a near-tie (top-2 gap 3e-4 in qfuse,
    # 9e-4 in mlx), so argmax agreement is required only where qfuse's top-2 gap exceeds
    # 2 x 0.05, the bound on |Δ|. The bounds are about 2x what was measured.
    max_abs, kl, _ = _compare(qfuse_logits, mlx_logits)
    assert kl < 1e-4, f"{variant}: max KL {kl:.3g}"
    assert max_abs < 0.05, f"{variant}: max |Δlogit| {max_abs:.4g}"
    top2 = np.sort(qfuse_logits, -1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.1
    flips = np.nonzero(clear & (qfuse_logits.argmax(-1) != mlx_logits.argmax(-1)))[0]
    assert flips.size == 0, f"{variant}: argmax differs at clear positions {flips.tolist()}"

    # With mlx-lm's bf16-rounded multiplier, nothing else is left: measured max |Δ| 2.3e-5,
    # max KL 3e-11, argmax 267/267 (the smallest top-2 gap is 9e-4, far above the noise).
    # The bound allows only for float32 reduction-order noise.
    bf16_sqrt = float(mx.array(math.sqrt(model.config.hidden_size), mx.bfloat16).item())
    monkeypatch.setattr(ModelConfig, "embed_multiplier", bf16_sqrt)
    # A fresh model: the Decoder caches its multiplier per dtype at the first forward,
    # so the one above would keep using the exact value and the patch would do nothing.
    matched_model = load_model(dst)
    assert matched_model.embed_multiplier(torch.float32) == bf16_sqrt
    with torch.no_grad():
        matched = matched_model(torch.tensor([ids])).float().numpy()[0]
    max_abs, kl, agree = _compare(matched, mlx_logits)
    assert agree == 1.0, f"{variant}: argmax agreement {agree:.3f}"
    assert kl < 1e-8, f"{variant}: max KL {kl:.3g}"
    assert max_abs < 1e-3, f"{variant}: max |Δlogit| {max_abs:.4g}"
