"""GGUF (llama.cpp) quantized tensors as MLX affine groups: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K.

Each row of a GGUF tensor is a run of blocks (ggml's layout, little-endian):

- Q4_0, 32 values in 18 bytes: d (float16), 16 bytes of nibbles (value j in the low
  nibble of byte j, value j + 16 in its high nibble); w = d·(q − 8) → 4-bit g32,
  scale d, bias −8d.
- Q4_1, 20 bytes: d, m (float16), the same nibbles; w = d·q + m → scale d, bias m.
- Q8_0, 34 bytes: d, 32 int8 q; w = d·q → 8-bit g32 codes q + 128, scale d, bias −128d.
- Q4_K, 256 values in 144 bytes: d, dmin (float16), 12 bytes of 6-bit scale and min codes
  (sc, m) for 8 sub-blocks of 32, 128 bytes of nibbles (64 values a 32-byte run: the
  low nibbles the first sub-block, the high nibbles the second); w = d·sc·q − dmin·m →
  4-bit g32, scale d·sc, bias −dmin·m.
- Q5_K, 176 bytes: as Q4_K, with 32 bytes `qh` after the scales holding each value's
  fifth bit (bit 2i of qh[l] for value l of the 64-run i's first half, bit 2i + 1 for its
  second) → 5-bit g32.

Precision: the scale d·sc and the bias −dmin·m (or −8d, −128d, m) are exact in float32
(at most 11 + 6 significant bits), so the groups read back exactly what ggml's
dequantization computes in float32; a float16/bfloat16 model rounds them once each, as
`groups` states. Q6_K (groups of 16) and the other types have no exact MLX form here and
are refused with one line naming the tensor.

The `gguf` package (optional: `pip install qfuse[gguf]`) reads the file; it is imported
only when a .gguf file is opened.
"""

from __future__ import annotations

import torch

from ..quant import pack
from .groups import FormatError

# type name → (values per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144),
          "Q5_K": (256, 176)}


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of every block [..., nbytes] (uint8), as float32 [..., 1]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes → [..., 2n] codes: the low nibbles, then the high ones."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit (scale, min) codes of a K-quant super-block from its 12 bytes."""
    s = s.to(torch.int64)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1), torch.cat([lo_m, hi_m], -1)


def to_mlx(data: torch.Tensor, qtype: str, n_cols: int, what: str):
    """(packed uint32 [rows, n_cols·bits/32], scales, biases float32 [rows, n_cols/32],
    group size 32, bits) of a GGUF tensor's bytes ``data`` (uint8 [rows, row bytes])."""
    if qtype not in BLOCKS:
        raise FormatError(f"{what}: GGUF type {qtype} is not supported (qfuse reads "
                          f"{', '.join(BLOCKS)})")
    per, nbytes = BLOCKS[qtype]
    rows = data.shape[0]
    if n_cols % per or data.shape[-1] != n_cols // per * nbytes:
        raise FormatError(f"{what}: {data.shape[-1]} bytes a row do not hold {n_cols} "
                          f"{qtype} values")
    b = data.reshape(rows, n_cols // per, nbytes)
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        d = _f16(b, 0)
        if qtype == "Q8_0":
            q = b[..., 2:].contiguous().view(torch.int8).to(torch.int64) + 128
            scale, bias, bits = d, -128 * d, 8
        else:
            start = 2 if qtype == "Q4_0" else 4
            q = _nibbles(b[..., start:start + 16]).to(torch.int64)
            scale, bias, bits = d, (-8 * d if qtype == "Q4_0" else _f16(b, 2)), 4
        codes = q.reshape(rows, n_cols)
        return (pack(codes, bits), scale.reshape(rows, -1), bias.reshape(rows, -1), 32, bits)
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k_scales(b[..., 4:16])
    qs = b[..., -128:].reshape(rows, -1, 4, 32)  # 4 runs of 64 values a super-block
    q = _nibbles(qs).to(torch.int64)  # [rows, blocks, 4, 64]
    bits = 4
    if qtype == "Q5_K":
        qh = b[..., 16:48].to(torch.int64)  # [rows, blocks, 32]
        shift = torch.arange(8).view(4, 2, 1)  # run i: bits 2i (first half), 2i + 1
        high = (qh.unsqueeze(-2).unsqueeze(-2) >> shift) & 1  # [rows, blocks, 4, 2, 32]
        q = q + 16 * high.reshape(*q.shape)
        bits = 5
    scale = (d * sc.to(torch.float32)).reshape(rows, -1)
    bias = (-(dmin * m.to(torch.float32))).reshape(rows, -1)
    return pack(q.reshape(rows, n_cols), bits), scale, bias, 32, bits
