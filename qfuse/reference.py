"""The compat tier: the spelled-out PyTorch path for every op a kernel fuses.

Each function rounds where Hugging Face's eager implementation rounds, so the
compat tier is both the oracle for the kernels and a faithful copy of what the
original models compute. The functions here only compute: `ops` checks the
inputs a caller can get wrong beside each op, before either path runs. Everything
runs on CPU and GPU. Shapes use B (batch), T (tokens), H (heads), N (cache length),
D (head dim), K/I (features).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import QuantizedTensor

Weight = torch.Tensor | QuantizedTensor

# Hugging Face's `hidden_act` names → our activation names.
ACTIVATION_ALIASES = {
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "silu": "silu",
    "swish": "silu",
}


def activation_name(name: str) -> str:
    """Normalise an HF `hidden_act` name; ValueError for an unsupported one."""
    if name not in ACTIVATION_ALIASES:
        raise ValueError(
            f"activation must be one of {sorted(ACTIVATION_ALIASES)}, got {name!r}"
        )
    return ACTIVATION_ALIASES[name]


def activation(a: torch.Tensor, name: str) -> torch.Tensor:
    name = activation_name(name)
    if name == "gelu_tanh":
        return F.gelu(a, approximate="tanh")
    return F.silu(a)


def gated_act(a: torch.Tensor, b: torch.Tensor, act: str) -> torch.Tensor:
    """act(a) * b, two rounded steps in a's dtype exactly as HF MLPs compute it.
    a, b: [..., I], same dtype and shape."""
    return activation(a, act) * b


def dense_weight(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """A dense [out, in] weight in ``dtype``; quantized weights (MLX layout, or a kernel's
    own order such as `kernels.products.fragments.FragmentWeight`) are dequantized."""
    if not isinstance(w, torch.Tensor):
        return w.dequantize(dtype)
    return w.to(dtype)


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x·Wᵀ (+ bias). x [..., K]; w [N, K] dense or quantized; y [..., N] in x's dtype."""
    return F.linear(x, dense_weight(w, x.dtype), bias)


def mlp(
    x: torch.Tensor,
    gate: Weight,
    up: Weight,
    down: Weight,
    act: str,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """down(act(x·gateᵀ) * (x·upᵀ)) (+ residual). x [..., H]; gate/up [I, H]; down [H, I];
    residual broadcasts to [..., H]."""
    y = linear(gated_act(linear(x, gate), linear(x, up), act), down)
    return y if residual is None else residual + y


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    """RMSNorm over the last axis.

    unit_offset=False (Llama, Qwen): normalise in float32, round to x's dtype,
    then multiply by ``weight`` (HF LlamaRMSNorm).
    unit_offset=True (Gemma): multiply by (1 + weight) in float32, then round
    (HF GemmaRMSNorm).
    """
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (h * (1.0 + weight.to(torch.float32))).to(x.dtype)
    return weight * h.to(x.dtype)


def rope_inv_freq(head_dim: int, base: float, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], float32, as HF's default RoPE computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (base**exponents)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., T, D] in ``dtype`` for integer positions [..., T]."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by cos/sin [B, T, D] (HF's rotate-half convention)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def _kv_dense(t: torch.Tensor | QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    return t.dequantize(dtype) if isinstance(t, QuantizedTensor) else t.to(dtype)


def attention_mask(
    lengths: torch.Tensor, n_max: int, window: int | None = None
) -> torch.Tensor:
    """bool [B, N]: position n is attended iff max(0, L - window) <= n < L."""
    pos = torch.arange(n_max, device=lengths.device)
    L = lengths.to(torch.int64).unsqueeze(-1)
    valid = pos < L
    if window is not None:
        valid &= pos >= L - window
    return valid


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor | QuantizedTensor,
    v: torch.Tensor | QuantizedTensor,
    lengths: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence over a dense or quantized KV cache.

    q: [B, Hq, D]; k, v: [B, Hkv, Nmax, D] dense tensors or QuantizedTensors of
    that logical shape; lengths: int [B], tokens valid in each sequence.
    Sequence b attends to positions [max(0, L_b - window), L_b). Returns
    [B, Hq, D] in q's dtype; a length-0 sequence gives zeros. Rounds as
    FlashAttention-style kernels do (see `_attend`). The oracle: inputs are those
    `ops.check_decode_attention_inputs` accepts (ops checks them before either path).
    """
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    dtype = q.dtype
    valid = attention_mask(lengths, N, window)  # [B, N]
    keys = _kv_dense(k, dtype)
    # Slots past a sequence's end may hold anything (NaN in the tests): zero
    # them so 0-probability × garbage cannot poison the sum.
    values = torch.where(valid[:, None, :, None], _kv_dense(v, dtype), 0)
    qg = q.reshape(B, Hkv, Hq // Hkv, D)
    out = _attend(qg, keys, values, valid[:, None, None, :], scale, softcap)  # [B, Hkv, G, D]
    # A row with nothing to attend to (length 0) would be NaN: define it as zeros.
    out = torch.where(valid.any(-1)[:, None, None, None], out, 0)
    return out.reshape(B, Hq, D)


def gather_pages(pool: torch.Tensor | QuantizedTensor, block_table: torch.Tensor):
    """A paged cache as the slotted layout: pool [num_pages, Hkv, PAGE, D] (dense or
    quantized) and block_table int [B, P] → [B, Hkv, P·PAGE, D], sequence b's token t
    from page block_table[b, t // PAGE]. A negative entry (a page not held) reads page
    0: its tokens lie outside what the sequence attends."""
    pages = block_table.to(torch.int64).clamp(min=0)
    B, P = pages.shape

    def gather(t: torch.Tensor) -> torch.Tensor:
        x = t[pages.reshape(-1)]  # [B·P, Hkv, PAGE, ...]
        x = x.reshape(B, P, *t.shape[1:]).transpose(1, 2)  # [B, Hkv, P, PAGE, ...]
        return x.reshape(B, t.shape[1], P * t.shape[2], *t.shape[3:])

    if isinstance(pool, QuantizedTensor):
        # As int32: CUDA has no uint32 gather (the words' bits are the same).
        packed = gather(pool.packed.view(torch.int32)).view(torch.uint32)
        return QuantizedTensor(packed, gather(pool.scales), gather(pool.biases),
                               pool.group_size, pool.bits)
    return gather(pool)


def paged_decode_attention(q, k, v, block_table, lengths, scale, window=None, softcap=None):
    """`decode_attention` over a paged cache: k, v pools [num_pages, Hkv, PAGE, D] read
    through block_table int [B, P] (`gather_pages`); the same values as the slotted
    cache holding the same tokens."""
    return decode_attention(q, gather_pages(k, block_table), gather_pages(v, block_table),
                            lengths, scale, window, softcap)


def _attend(q, k, v, allowed, scale: float, softcap: float | None) -> torch.Tensor:
    """softmax(q·kᵀ·scale [soft-capped], masked) · v, rounded as the kernels round.

    Scores are float32 sums of exact products of the model-dtype q and k; the
    softmax is float32; its numerators exp(s - max) are rounded to the model
    dtype for the value product (tensor cores take them so, in our decode
    kernel and in FlashAttention), which is summed in float32 and divided by the
    float32 denominator; the output is rounded once. HF's eager attention
    instead rounds the scores themselves to bf16 (an error of ~0.06 on a score
    of 10, 6% in its probability): on the default model that alone moved the
    4-bit-KV logits by a mean KL of 1.4e-3 against this rounding, so compat
    follows the kernels and HF's default (SDPA) path here. In float32 both are
    the same exact softmax.
    """
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0)  # fully masked rows: no NaN from -inf - -inf
    numer = torch.exp(scores - top)
    denom = numer.sum(-1, keepdim=True)
    out = torch.matmul(numer.to(q.dtype).float(), v.float()) / denom
    return out.to(q.dtype)


def prompt_mask(lengths: torch.Tensor, T: int, window: int | None = None,
                past: int = 0) -> torch.Tensor:
    """bool [B, T, past + T]: the T queries are the last T of past + T keys (``past``:
    the tokens a chunked prefill already cached); query i, key past + i, sees key j iff
    j <= past + i, j < past + length and past + i - j < window.

    A padded query row (i >= length) may see no key at all once the window has
    slid past the prompt; it then sees itself instead, so its softmax stays
    finite (a NaN there would reach real rows through 0·NaN in the next layer)."""
    i = torch.arange(T, device=lengths.device)[:, None] + past  # each query's key index
    j = torch.arange(past + T, device=lengths.device)[None, :]
    allowed = (j <= i)[None] & (j[None] < past + lengths[:, None, None])
    if window is not None:
        allowed &= (i - j < window)[None]
    return allowed | (j == i)[None]


def prompt_attention(q, k, v, lengths, scale, window=None, softcap=None):
    """Causal attention over right-padded prompts, rounded as `_attend` rounds.
    q [B, Hq, T, D], k/v [B, Hkv, S, D] with S >= T: the keys of the S - T tokens
    before the queries (a chunked prefill's cached ones; none for a whole prompt), then
    the queries' own. lengths [B]: each row's real queries. Rows past a prompt's
    length are computed (they see the prompt) and ignored."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    allowed = prompt_mask(lengths, q.shape[2], window, k.shape[2] - q.shape[2])
    return _attend(q, k, v, allowed[:, None], scale, softcap)
