"""Case builders and references for the tests (benches may use them too).

Decode attention: caches whose unused slots hold NaN (so a kernel that reads past a
sequence's length shows it), and the kernel-vs-compat error pair of the gate rule.

Quantized products: a weight and its input (`linear_case`), and the same error pair for
a linear or an MLP against a float32 or float64 reference on the dequantized weights
(`linear_errors`, `mlp_errors`). Bit patterns: `assert_bitwise_equal`.
"""

from __future__ import annotations

import torch

from qfuse import reference
from qfuse.quant import QuantizedTensor


def kernel_device() -> str:
    """Where kernel tests run: the GPU if there is one, else the CPU, where the tests'
    conftest has Triton's interpreter on."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_case(B, Hq, Hkv, D, n_max, lengths, bits, dtype, device, group_size=64, seed=0):
    """q, k, v, lengths, where k/v slots at or past each length are NaN (scales,
    biases and dense values) and their packed words are all ones."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g).to(dtype).to(device)
    kf = torch.randn(B, Hkv, n_max, D, generator=g).to(dtype).to(device)
    vf = torch.randn(B, Hkv, n_max, D, generator=g).to(dtype).to(device)
    lengths = torch.tensor(lengths, dtype=torch.int32, device=device)
    unused = torch.arange(n_max, device=device)[None, :] >= lengths[:, None].long()  # [B, N]
    if bits == 0:
        k, v = kf.clone(), vf.clone()
        for t in (k, v):
            t[unused[:, None, :, None].expand_as(t)] = float("nan")
    else:
        k = QuantizedTensor.from_float(kf, group_size, bits)
        v = QuantizedTensor.from_float(vf, group_size, bits)
        for t in (k, v):
            mask = unused[:, None, :].expand(t.scales.shape[:-1])
            t.scales[mask] = float("nan")
            t.biases[mask] = float("nan")
            t.packed.view(torch.int32)[mask] = -1
    return q, k, v, lengths


def float32_reference(q, k, v, lengths, scale, window=None, softcap=None):
    kd = k.dequantize(torch.float32) if isinstance(k, QuantizedTensor) else k.float()
    vd = v.dequantize(torch.float32) if isinstance(v, QuantizedTensor) else v.float()
    return reference.decode_attention(q.float(), kd, vd, lengths, scale, window, softcap)


def errors(out, q, k, v, lengths, scale, window=None, softcap=None):
    """(kernel error, compat error) in max-abs against the float32 reference."""
    ref32 = float32_reference(q, k, v, lengths, scale, window, softcap)
    compat = reference.decode_attention(q, k, v, lengths, scale, window, softcap)
    return ((out.float() - ref32).abs().max().item(),
            (compat.float() - ref32).abs().max().item())


def linear_case(M, N, K, bits, group, seed, dtype=torch.bfloat16, device="cpu"):
    """x [M, K] in ``dtype`` and a ``bits``-bit weight [N, K] quantized from bf16 values of
    scale K**-0.5 (outputs of about unit size), drawn from one generator on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = QuantizedTensor.from_float(
        (torch.randn(N, K, generator=g, device=device) * K**-0.5).bfloat16(), group, bits)
    return torch.randn(M, K, generator=g, device=device).to(dtype), w


def linear_errors(out, x, w, bias=None, residual=None, precision=torch.float32):
    """(kernel error, compat error) in max-abs against residual + x·dequant(w)ᵀ + bias in
    ``precision`` (float32 or float64), compat being `reference.linear` then the residual."""
    ref = x.to(precision) @ w.dequantize(torch.float32).to(precision).T
    if bias is not None:
        ref = ref + bias.to(precision)
    if residual is not None:
        ref = ref + residual.to(precision)
    compat = reference.linear(x, w, bias)
    if residual is not None:
        compat = residual + compat
    return ((out.to(precision) - ref).abs().max().item(),
            (compat.to(precision) - ref).abs().max().item())


def mlp_errors(out, x, gate, up, down, act, residual=None, precision=torch.float32):
    """(kernel error, compat error) in max-abs against `reference.mlp` in ``precision`` on
    the dequantized weights, compat being `reference.mlp` on the quantized ones."""
    deq = [w.dequantize(torch.float32).to(precision) for w in (gate, up, down)]
    ref = reference.mlp(x.to(precision), *deq, act,
                        None if residual is None else residual.to(precision))
    compat = reference.mlp(x, gate, up, down, act, residual)
    return ((out.to(precision) - ref).abs().max().item(),
            (compat.to(precision) - ref).abs().max().item())


_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def assert_bitwise_equal(out: torch.Tensor, ref: torch.Tensor) -> None:
    """NaN exactly where ``ref`` has NaN, and ``ref``'s bit pattern everywhere else (the
    sign of a zero included)."""
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan), "NaN positions differ"
    iv = _INT_VIEW[ref.dtype]
    mismatches = (out.view(iv) != ref.view(iv)) & ~nan
    assert int(mismatches.sum()) == 0, f"{int(mismatches.sum())} of {ref.numel()} elements differ"


def refill_(t: QuantizedTensor, seed: int = 0) -> None:
    """Overwrite every slot of a quantized cache with fresh random data, in place (for
    graph tests: the slots `make_case` filled with NaN become real once lengths grow)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    fresh = QuantizedTensor.from_float(torch.randn(t.shape, generator=g).to(t.scales.dtype)
                                       .to(t.packed.device), t.group_size, t.bits)
    t.packed.copy_(fresh.packed)
    t.scales.copy_(fresh.scales)
    t.biases.copy_(fresh.biases)
