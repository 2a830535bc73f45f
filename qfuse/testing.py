"""Case builders and float32 references shared by tests and benches.

Decode attention: caches whose unused slots hold NaN (so a kernel that reads past a
sequence's length shows it), and the kernel-vs-compat error pair of the gate rule.
"""

from __future__ import annotations

import torch

from qfuse import reference
from qfuse.quant import QuantizedTensor


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
