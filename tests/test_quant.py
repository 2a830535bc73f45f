"""Tests for qfuse/quant.py: bit-exactness with the MLX affine format
(`docs/design.md`, "The MLX affine format").

What is proven here, on CPU but for 7:

1. pack/unpack against uint32 words derived by hand for every bit width
   {2,3,4,5,6,8} (including the words that 3/5/6-bit codes straddle), and
   against an independent big-integer bit-stream packer; quantize against
   groups whose scales, biases and codes are derived by hand (positive and
   negative scales, all-negative, constant groups on both q0 branches,
   round-half-to-even, clamping, scales cast only after the codes).
2. quantize against an independent per-group scalar implementation of the
   docs/design.md formula in numpy float32, bit for bit, for all bits x group sizes
   {32,64,128} x float32/float16/bfloat16; dequantize bit for bit against
   ``s*q + bias`` in float32 cast to the dtype.
3. Round-trip error bounds, |dequantize(quantize(w)) - w| <= |s|/2 (+ a
   justified slack) for elements inside the grid, and pack(unpack(p)) == p.
4. Hypothesis properties over leading shapes, bits, group sizes, dtypes and
   values (large, tiny, constant rows, ties).
5. ValueError, naming the offending argument, for every malformed input.
6. QuantizedTensor: shape, dtype, nbytes, dequantize.
7. On CUDA (marked `gpu`), quantize is bit-identical to quantize on CPU (one format
   everywhere).
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qfuse.quant import (
    QuantizedTensor,
    check_layout,
    dequantize,
    pack,
    quantize,
    unpack,
)

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

F32 = np.float32


def words_of(packed: torch.Tensor) -> list:
    """uint32 tensor -> nested lists of Python ints in [0, 2**32)."""
    assert packed.dtype == torch.uint32
    return packed.to(torch.int64).tolist()


def u32(words: list) -> torch.Tensor:
    return torch.tensor(words, dtype=torch.uint32)


def f32_bits(x: float) -> bytes:
    """The float32 bit pattern of x (so -0.0 != 0.0 and the comparison is exact)."""
    return struct.pack("<f", x)


# --------------------------------------------------------------------------------------
# 1a. pack / unpack: hand-derived words
# --------------------------------------------------------------------------------------
# Each case is one row of 32 codes (the smallest legal K) and the `bits` uint32 words
# it must pack to. Element j occupies stream bits [j*b, (j+1)*b); stream bit i lives in
# word i // 32 at bit i % 32.

_ZERO32 = [0] * 32


def _with(**elems: int) -> list[int]:
    """32 zero codes with a few set: _with(e10=5) sets element 10 to 5."""
    codes = list(_ZERO32)
    for k, v in elems.items():
        codes[int(k[1:])] = v
    return codes


PACK_CASES = [
    # ---- 2 bits: 16 codes per word, never straddles.
    # codes 0,1,2,3 fill one byte as 0b11_10_01_00 = 0xE4, so elements 0..15 -> 0xE4E4E4E4;
    # codes 3,2,1,0 -> 0b00_01_10_11 = 0x1B, so elements 16..31 -> 0x1B1B1B1B.
    pytest.param(
        2,
        [j % 4 for j in range(16)] + [3 - j % 4 for j in range(16)],
        [0xE4E4E4E4, 0x1B1B1B1B],
        id="b2-pattern",
    ),
    # element 15 = 0b11 at bits 30..31 -> word0 = 0xC0000000; element 16 = 1 at bit 32
    # = word1 bit 0 -> word1 = 0x00000001 (the last code of word 0 ends exactly at bit 31).
    pytest.param(2, _with(e15=3, e16=1), [0xC0000000, 0x00000001], id="b2-word-edge"),
    # ---- 3 bits: 96 bits = 3 words per 32 codes; elements 10 and 21 straddle.
    # codes 0..7 make the 24-bit chunk 0o76543210 = 0xFAC688, repeated 4 times; as
    # little-endian bytes: 88 C6 FA | 88 C6 FA | 88 C6 FA | 88 C6 FA, so the words are
    # bytes 0-3 = 88 C6 FA 88 -> 0x88FAC688, bytes 4-7 = C6 FA 88 C6 -> 0xC688FAC6,
    # bytes 8-11 = FA 88 C6 FA -> 0xFAC688FA.
    pytest.param(
        3, [j % 8 for j in range(32)], [0x88FAC688, 0xC688FAC6, 0xFAC688FA], id="b3-pattern"
    ),
    # element 10 = 0b101 at bits 30..32: bit 30 = 1, bit 31 = 0 -> word0 = 0x40000000, and
    # bit 32 = 1 -> word1 bit 0. element 21 = 0b101 at bits 63..65: bit 63 = 1 -> word1
    # bit 31 (0x80000000), bits 64,65 = 0b10 -> word2 = 0x2.
    pytest.param(3, _with(e10=5, e21=5), [0x40000000, 0x80000001, 0x00000002], id="b3-straddle-a"),
    # element 10 = 0b110: bit 30 = 0, bit 31 = 1 -> word0 = 0x80000000; bit 32 = 1 -> word1
    # bit 0. element 21 = 0b011: bit 63 = 1 -> word1 |= 0x80000000; bits 64,65 = 0b01 ->
    # word2 = 0x1.
    pytest.param(3, _with(e10=6, e21=3), [0x80000000, 0x80000001, 0x00000001], id="b3-straddle-b"),
    # ---- 4 bits: 8 nibbles per word, first element in the lowest nibble.
    pytest.param(
        4,
        [j % 16 for j in range(32)],
        [0x76543210, 0xFEDCBA98, 0x76543210, 0xFEDCBA98],
        id="b4-pattern",
    ),
    # ---- 5 bits: 160 bits = 5 words; elements 6 (30..34), 12 (60..64), 19 (95..99) and
    # 25 (125..129) straddle. codes = j:
    # word0 = 1<<5 | 2<<10 | 3<<15 | 4<<20 | 5<<25 | (6 & 0b11)<<30
    #       = 0x20 + 0x800 + 0x18000 + 0x400000 + 0xA000000 + 0x80000000 = 0x8A418820
    # word1 = (6>>2) | 7<<3 | 8<<8 | 9<<13 | 10<<18 | 11<<23 | (12 & 0xF)<<28
    #       = 0x1 + 0x38 + 0x800 + 0x12000 + 0x280000 + 0x5800000 + 0xC0000000 = 0xC5A92839
    # word2 = (12>>4) | 13<<1 | 14<<6 | 15<<11 | 16<<16 | 17<<21 | 18<<26 | (19 & 1)<<31
    #       = 0 + 0x1A + 0x380 + 0x7800 + 0x100000 + 0x2200000 + 0x48000000 + 0x80000000
    #       = 0xCA307B9A
    # word3 = (19>>1) | 20<<4 | 21<<9 | 22<<14 | 23<<19 | 24<<24 | (25 & 0b111)<<29
    #       = 0x9 + 0x140 + 0x2A00 + 0x58000 + 0xB80000 + 0x18000000 + 0x20000000 = 0x38BDAB49
    # word4 = (25>>3) | 26<<2 | 27<<7 | 28<<12 | 29<<17 | 30<<22 | 31<<27
    #       = 0x3 + 0x68 + 0xD80 + 0x1C000 + 0x3A0000 + 0x7800000 + 0xF8000000 = 0xFFBBCDEB
    pytest.param(
        5,
        list(range(32)),
        [0x8A418820, 0xC5A92839, 0xCA307B9A, 0x38BDAB49, 0xFFBBCDEB],
        id="b5-pattern",
    ),
    # element 6 = 0b11111 at bits 30..34 -> word0 = 0xC0000000 (bits 30,31), word1 = 0x7.
    pytest.param(5, _with(e6=31), [0xC0000000, 0x7, 0, 0, 0], id="b5-straddle"),
    # ---- 6 bits: 192 bits = 6 words; elements 5, 10, 21, 26 straddle.
    # codes 63,0,63,0 make the 24-bit chunk 0b000000_111111_000000_111111 = 0x03F03F, bytes
    # 3F F0 03 repeating; words: 3F F0 03 3F -> 0x3F03F03F, F0 03 3F F0 -> 0xF03F03F0,
    # 03 3F F0 03 -> 0x03F03F03, then the same again.
    pytest.param(
        6,
        [63, 0] * 16,
        [0x3F03F03F, 0xF03F03F0, 0x03F03F03] * 2,
        id="b6-pattern",
    ),
    # element 5 = 0b100110 at bits 30..35: bits 30,31 = 0b10 -> word0 = 0x80000000, bits
    # 32..35 = 0b1001 -> word1 = 0x9. element 10 = 0b110101 at bits 60..65: bits 60..63 =
    # 0b0101 -> word1 |= 0x50000000, bits 64,65 = 0b11 -> word2 = 0x3.
    pytest.param(6, _with(e5=38, e10=53), [0x80000000, 0x50000009, 0x3, 0, 0, 0], id="b6-straddle"),
    # ---- 8 bits: one byte per code, first element in the lowest byte.
    pytest.param(
        8,
        list(range(32)),
        [0x03020100, 0x07060504, 0x0B0A0908, 0x0F0E0D0C,
         0x13121110, 0x17161514, 0x1B1A1918, 0x1F1E1D1C],
        id="b8-pattern",
    ),
    # codes 255-j: bytes FF FE FD FC ... -> words with the top bit set (exercises uint32).
    pytest.param(
        8,
        [255 - j for j in range(32)],
        [0xFCFDFEFF, 0xF8F9FAFB, 0xF4F5F6F7, 0xF0F1F2F3,
         0xECEDEEEF, 0xE8E9EAEB, 0xE4E5E6E7, 0xE0E1E2E3],
        id="b8-high",
    ),
]


@pytest.mark.parametrize("bits,codes,words", PACK_CASES)
def test_pack_unpack_hand_vectors(bits, codes, words):
    assert len(codes) == 32 and len(words) == bits
    # Two rows: the hand vector and all-(n) codes (every bit set -> every word 0xFFFFFFFF),
    # so rows must not leak into each other.
    n = (1 << bits) - 1
    q = torch.tensor([codes, [n] * 32], dtype=torch.int64)
    packed = pack(q, bits)
    assert packed.dtype == torch.uint32
    assert packed.shape == (2, bits)
    assert words_of(packed) == [words, [0xFFFFFFFF] * bits]
    assert unpack(u32([words, [0xFFFFFFFF] * bits]), bits).tolist() == [codes, [n] * 32]
    # unpack also reads the same bits stored as int32.
    assert unpack(u32([words]).view(torch.int32), bits).tolist() == [codes]
    # pack accepts any integer dtype that holds the codes.
    assert words_of(pack(torch.tensor([codes], dtype=torch.int32), bits)) == [words]


def _bitstream_pack(codes: list[int], bits: int) -> list[int]:
    """Independent packer: the row as one Python integer, element j at bit j*bits."""
    stream = 0
    for j, c in enumerate(codes):
        stream |= c << (j * bits)
    return [(stream >> (32 * i)) & 0xFFFFFFFF for i in range(len(codes) * bits // 32)]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("K", [32, 96, 256])
def test_pack_matches_bitstream_reference(bits, K):
    rng = np.random.default_rng(1000 * bits + K)
    codes = rng.integers(0, 1 << bits, size=(3, K))
    packed = pack(torch.from_numpy(codes), bits)
    assert packed.shape == (3, K * bits // 32)
    assert words_of(packed) == [_bitstream_pack(row.tolist(), bits) for row in codes]
    assert torch.equal(unpack(packed, bits), torch.from_numpy(codes))


# --------------------------------------------------------------------------------------
# 1b. quantize: hand-derived groups (group_size 32)
# --------------------------------------------------------------------------------------
# Every value below is exact in float32 unless written fl(.) (the float32 nearest).
# fl(a/b) for float32 a, b is what float32 division returns, and equals
# np.float32(a / b) computed in float64 (float64 has > 2*24+2 bits, so the double
# rounding is innocuous).

TINY = float(F32(1e-7))  # the floor on |s|, as float32: 1.00000001168e-07


def _pad(values: list[float], fill: float) -> list[float]:
    return values + [fill] * (32 - len(values))


QUANT_CASES = [
    # |min| > |max| -> positive scale, and round-half-to-even on the codes.
    # alpha = 1, beta = -3, n = 3: s = fl(4/3); |beta| > |alpha| -> e = -3, s > 0;
    # q0 = round(-3 / fl(4/3)) = round(-2.2499999) = -2 != 0 -> s = -3/-2 = 1.5, bias = -3.
    # codes = round((w + 3) / 1.5): -3 -> 0; 1 -> 2.67 -> 3; 0 -> 2; -1.5 -> 1;
    # -0.75 -> 1.5 -> 2; 0.75 -> 2.5 -> 2 (half-away-from-zero would give 3);
    # -2.25 -> 0.5 -> 0 (half-away would give 1).
    {
        "id": "min-dominates-positive-scale-ties",
        "bits": 2,
        "w": _pad([-3.0, 1.0, 0.0, -1.5, -0.75, 0.75, -2.25], 0.0),
        "scale": 1.5,
        "bias": -3.0,
        "codes": _pad([0, 3, 2, 1, 2, 2, 0], 2),
        "deq": _pad([-3.0, 1.5, 0.0, -1.5, 0.0, 0.0, -3.0], 0.0),
    },
    # max dominates -> negative scale. alpha = 7.5, beta = 0, n = 15: s = 7.5/15 = 0.5;
    # |0| > |7.5| is false -> e = 7.5, s = -0.5; q0 = round(7.5/-0.5) = -15 -> s = 7.5/-15
    # = -0.5, bias = 7.5. codes = (w - 7.5)/-0.5 = 15 - 2w: first half 15 - j, then j.
    {
        "id": "max-dominates-negative-scale",
        "bits": 4,
        "w": [0.5 * j for j in range(16)] + [7.5 - 0.5 * j for j in range(16)],
        "scale": -0.5,
        "bias": 7.5,
        "codes": [15 - j for j in range(16)] + [j for j in range(16)],
        "deq": [0.5 * j for j in range(16)] + [7.5 - 0.5 * j for j in range(16)],
    },
    # max dominates, and the tie is in q0. alpha = 2.5, beta = -0.5, n = 3: s = 3/3 = 1;
    # e = 2.5, s = -1; q0 = round(-2.5) = -2 (half-away would give -3 and s = -5/6);
    # s = 2.5/-2 = -1.25, bias = 2.5. codes = round((w - 2.5)/-1.25): 2.5 -> 0;
    # -0.5 -> 2.4 -> 2; 0 -> 2; 1.25 -> 1; 1.875 -> 0.5 -> 0 (tie, to even);
    # 0.625 -> 1.5 -> 2 (tie, to even).
    {
        "id": "max-dominates-q0-tie",
        "bits": 2,
        "w": _pad([2.5, -0.5, 0.0, 1.25, 1.875, 0.625], 0.0),
        "scale": -1.25,
        "bias": 2.5,
        "codes": _pad([0, 2, 2, 1, 0, 2], 2),
        "deq": _pad([2.5, 0.0, 0.0, 1.25, 2.5, 0.0], 0.0),
    },
    # all negative. alpha = -1, beta = -8, n = 15: s = fl(7/15); |-8| > |-1| -> e = -8,
    # s > 0; q0 = round(-8/fl(7/15)) = round(-17.14) = -17 -> s = -8/-17 = fl(8/17) =
    # 0.47058824 (the anchor moves the scale off (max-min)/n = 0.4667), bias = -8.
    # codes = round((w + 8)/fl(8/17)) ~ k*17/8 for w = -8 + k: 0, 2.125, 4.25, 6.375,
    # k=4: 4/fl(8/17) = 8.4999999683 rounds to the float32 8.5 (spacing 2^-20 there): a
    # tie -> 8 (half-away would give 9); 10.625, 12.75, 14.875 -> 0,2,4,6,8,11,13,15.
    {
        "id": "all-negative",
        "bits": 4,
        "w": _pad([-8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0], -8.0),
        "scale": float(F32(8.0 / 17.0)),
        "bias": -8.0,
        "codes": _pad([0, 2, 4, 6, 8, 11, 13, 15], 0),
    },
    # constant zero: alpha = beta = 0, s = max(0, 1e-7) = fl(1e-7); |0| > |0| false ->
    # e = 0, s = -fl(1e-7); q0 = round(-0) = 0 -> bias = 0 (+0.0), s stays -fl(1e-7);
    # codes = round(0/s) = 0.
    {
        "id": "constant-zero",
        "bits": 4,
        "w": [0.0] * 32,
        "scale": -TINY,
        "bias": 0.0,
        "codes": [0] * 32,
        "deq": [0.0] * 32,
    },
    # constant 3: e = 3, s = -fl(1e-7); 3/fl(1e-7) = 29999999.65 rounds to the float32
    # 3e7 (spacing 2 there) -> q0 = -3e7 != 0 -> s = 3/-3e7 = -fl(1e-7), bias = 3 (not 0,
    # as in the q0 == 0 branch); codes 0, and 0*s + 3 reads back exactly 3.
    {
        "id": "constant-positive",
        "bits": 4,
        "w": [3.0] * 32,
        "scale": -TINY,
        "bias": 3.0,
        "codes": [0] * 32,
        "deq": [3.0] * 32,
    },
    # constant -2: |beta| > |alpha| is false for equal edges -> e = -2, s = -fl(1e-7);
    # q0 = round(-2/-fl(1e-7)) = 2e7 -> s = -2/2e7 = -fl(1e-7), bias = -2.
    {
        "id": "constant-negative",
        "bits": 3,
        "w": [-2.0] * 32,
        "scale": -TINY,
        "bias": -2.0,
        "codes": [0] * 32,
        "deq": [-2.0] * 32,
    },
    # tiny constant, q0 == 0 branch although the values are nonzero: e = fl(4e-8),
    # s = -fl(1e-7), e/s = -0.4 -> q0 = 0 -> bias = 0, s = -fl(1e-7); codes 0 read back
    # as 0 (error 4e-8 <= |s|/2).
    {
        "id": "tiny-constant-q0-zero",
        "bits": 4,
        "w": [float(F32(4e-8))] * 32,
        "scale": -TINY,
        "bias": 0.0,
        "codes": [0] * 32,
        "deq": [0.0] * 32,
    },
    # tiny constant just past the branch: e = fl(6e-8), e/s = -0.59999996 -> q0 = -1 ->
    # s = e/-1 = -fl(6e-8), bias = fl(6e-8): read back exactly.
    {
        "id": "tiny-constant-q0-nonzero",
        "bits": 4,
        "w": [float(F32(6e-8))] * 32,
        "scale": -float(F32(6e-8)),
        "bias": float(F32(6e-8)),
        "codes": [0] * 32,
        "deq": [float(F32(6e-8))] * 32,
    },
    # symmetric group: the far edge is clamped. alpha = 1, beta = -1, n = 3: s = fl(2/3);
    # e = 1, s = -fl(2/3); 1/fl(2/3) = 1.49999996 rounds to the float32 1.5 -> q0 =
    # round(-1.5) = -2 -> s = 1/-2 = -0.5, bias = 1. codes: 1 -> 0; -1 -> -2/-0.5 = 4 ->
    # clamped to 3 (reads back -0.5: error |s|, not |s|/2); 0 -> 2; 0.5 -> 1.
    {
        "id": "symmetric-clamped",
        "bits": 2,
        "w": _pad([1.0, -1.0, 0.0, 0.5], 0.0),
        "scale": -0.5,
        "bias": 1.0,
        "codes": _pad([0, 3, 2, 1], 2),
        "deq": _pad([1.0, -0.5, 0.0, 0.5], 0.0),
    },
    # alpha = 0, beta = -17, n = 7: s = fl(17/7); e = -17, s > 0; q0 = round(-17/fl(17/7))
    # = -7 -> s = -17/-7 = fl(17/7) = 2.42857146, bias = -17.
    # codes: -17 -> 0; 0 -> 17/fl(17/7) = 6.9999999 -> 7; -1.25 -> 15.75/fl(17/7) = 6.485 -> 6.
    {
        "id": "scale-17/7-float32",
        "bits": 3,
        "w": _pad([-17.0, 0.0, -1.25], -17.0),
        "scale": float(F32(17.0 / 7.0)),
        "bias": -17.0,
        "codes": _pad([0, 7, 6], 0),
    },
    # The same group in bfloat16: the codes must be computed with the float32 scale and
    # only then the scale cast. bf16(2.42857146): spacing 2^-6 in [2, 4), 2.42857/2^-6 =
    # 155.43 -> 155 * 2^-6 = 2.421875. Had the scale been cast first, -1.25 would give
    # 15.75/2.421875 = 6.503 -> code 7 instead of 6.
    {
        "id": "scale-cast-after-codes-bf16",
        "bits": 3,
        "dtype": torch.bfloat16,
        "w": _pad([-17.0, 0.0, -1.25], -17.0),
        "scale": 2.421875,
        "bias": -17.0,
        "codes": _pad([0, 7, 6], 0),
    },
    # float16 storage of the 1e-7 floor: it is a float16 subnormal; 1e-7 / 2^-24 = 1.68
    # -> 2 ulps = 2^-23 = 1.1920928955078125e-07.
    {
        "id": "constant-zero-float16",
        "bits": 4,
        "dtype": torch.float16,
        "w": [0.0] * 32,
        "scale": -(2.0**-23),
        "bias": 0.0,
        "codes": [0] * 32,
        "deq": [0.0] * 32,
    },
]


@pytest.mark.parametrize("case", QUANT_CASES, ids=[c["id"] for c in QUANT_CASES])
def test_quantize_hand_vectors(case):
    dtype = case.get("dtype", torch.float32)
    bits = case["bits"]
    w = torch.tensor([case["w"]], dtype=torch.float32)
    assert torch.equal(w.to(dtype).to(torch.float32), w), "hand values must be exact in dtype"
    packed, scales, biases = quantize(w.to(dtype), group_size=32, bits=bits)
    assert packed.shape == (1, bits) and scales.shape == biases.shape == (1, 1)
    assert scales.dtype == biases.dtype == dtype
    assert f32_bits(scales.float().item()) == f32_bits(case["scale"]), scales.item()
    assert f32_bits(biases.float().item()) == f32_bits(case["bias"]), biases.item()
    assert unpack(packed, bits)[0].tolist() == case["codes"]
    if "deq" in case:
        got = dequantize(packed, scales, biases, 32, bits).float()[0].tolist()
        assert got == case["deq"]


# --------------------------------------------------------------------------------------
# 2. An independent scalar implementation of the docs/design.md formula
# --------------------------------------------------------------------------------------


def ref_quantize_group(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.float32, np.float32]:
    """docs/design.md's formula, literally, for one group of float32 values:
    (codes, s, bias) in float32."""
    assert w.dtype == np.float32
    n = F32((1 << bits) - 1)
    alpha, beta = w.max(), w.min()
    s = max((alpha - beta) / n, F32(1e-7))
    if abs(beta) > abs(alpha):
        e = beta  # s stays positive
    else:
        e, s = alpha, -s
    q0 = np.round(e / s)  # numpy rounds half to even
    if q0 != 0:
        s, bias = e / q0, e
    else:
        bias = F32(0.0)
    q = np.clip(np.round((w - bias) / s), F32(0), n)
    # Everything must have stayed float32 (numpy scalar promotion is easy to get wrong).
    assert all(isinstance(x, np.float32) for x in (alpha, beta, s, e, q0, bias)), (s, bias)
    assert q.dtype == np.float32
    return q.astype(np.int64), s, bias


def ref_quantize(w: torch.Tensor, group_size: int, bits: int):
    """Per-group loop over ref_quantize_group. w [..., K] -> codes int64 [..., K],
    s32, b32 float32 [..., K/g] (before the cast to w.dtype)."""
    lead, K = tuple(w.shape[:-1]), w.shape[-1]
    rows = w.to(torch.float32).reshape(-1, K).numpy()  # upcast to float32 is exact
    G = K // group_size
    codes = np.zeros(rows.shape, np.int64)
    s32 = np.zeros((rows.shape[0], G), np.float32)
    b32 = np.zeros((rows.shape[0], G), np.float32)
    for r in range(rows.shape[0]):
        for g in range(G):
            sl = slice(g * group_size, (g + 1) * group_size)
            codes[r, sl], s32[r, g], b32[r, g] = ref_quantize_group(rows[r, sl], bits)
    return codes.reshape(*lead, K), s32.reshape(*lead, G), b32.reshape(*lead, G)


def round_f32_to(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Round float32 values to `dtype` (nearest, ties to even), returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == torch.float32:
        return x
    if dtype == torch.float16:
        return x.astype(np.float16).astype(np.float32)
    assert dtype == torch.bfloat16
    # bfloat16 = the top 16 bits of the float32 pattern; add 0x7FFF plus the lowest kept
    # bit, then truncate: round to nearest, ties to even (finite inputs only).
    b = x.view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def as_f32_numpy(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float32).contiguous().numpy()


def assert_same_bits(a: np.ndarray, b: np.ndarray, what: str) -> None:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    bad = a.view(np.uint32) != b.view(np.uint32)
    assert not bad.any(), f"{what}: {int(bad.sum())} mismatches, e.g. {a[bad][:5]} vs {b[bad][:5]}"


def assert_matches_reference(w, packed, scales, biases, group_size, bits):
    codes, s32, b32 = ref_quantize(w, group_size, bits)
    assert torch.equal(unpack(packed, bits), torch.from_numpy(codes))
    assert_same_bits(as_f32_numpy(scales), round_f32_to(s32, w.dtype), "scales")
    assert_same_bits(as_f32_numpy(biases), round_f32_to(b32, w.dtype), "biases")
    return codes, s32, b32


def assert_dequantize_bit_exact(packed, scales, biases, codes, group_size, bits, dtype=None):
    """dequantize == fl_dtype(fl32(fl32(q * s) + bias)), s and bias the stored values."""
    out_dtype = dtype or scales.dtype
    got = dequantize(packed, scales, biases, group_size, bits, dtype)
    assert got.dtype == out_dtype and got.shape == codes.shape
    K = codes.shape[-1]
    q = codes.reshape(*codes.shape[:-1], K // group_size, group_size).astype(np.float32)
    s = as_f32_numpy(scales)[..., None]
    b = as_f32_numpy(biases)[..., None]
    want = round_f32_to((q * s + b).reshape(codes.shape), out_dtype)
    assert_same_bits(as_f32_numpy(got), want, "dequantize")


# Value limits: float16 saturates at 65504, and a group spanning about +-6e4 can read
# back one half-step past its edge and overflow to inf; keep fp16 data within 1e4 (the
# format, not the formula, is what would break). float32/bfloat16 stay below 2^100 ~
# 1.3e30 (exact in float32, as hypothesis wants) so that max - min cannot overflow.
_LIMIT = {torch.float32: 2.0**100, torch.bfloat16: 2.0**100, torch.float16: 1e4}
# log10 magnitude ranges per kind of data, per dtype family (fp16 has a narrow range).
_MAGNITUDES = {
    "normal": ((-2, 2), (-2, 2)),
    "large": ((20, 29), (2, 3.5)),
    "tiny": ((-12, -6), (-7, -4)),
    "mixed": ((-9, 9), (-6, 3.5)),
}
KINDS = ("normal", "large", "tiny", "mixed", "grid", "constant_rows")


def make_weights(seed: int, shape: tuple, group_size: int, dtype: torch.dtype,
                 kind: str = "mixed") -> torch.Tensor:
    """Random weights [..., K] with groups of varied character: per-group magnitudes,
    all-positive, all-negative and constant groups, and coarse grids full of ties."""
    rng = np.random.default_rng(seed)
    K = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    G = K // group_size
    w = rng.standard_normal((rows, G, group_size))
    if kind == "grid":  # multiples of 1/4 in [-4, 4]: many exact ties in the codes
        w = rng.integers(-16, 17, size=w.shape) / 4.0
    elif kind == "constant_rows":
        w = np.broadcast_to(rng.choice([0.0, 1.0, -3.5, 1e-8, 6e-8, 250.0], size=(rows, 1, 1)),
                            w.shape).copy()
    else:
        lo, hi = _MAGNITUDES[kind][dtype == torch.float16]
        w *= 10.0 ** rng.uniform(lo, hi, size=(rows, G, 1))
        style = rng.integers(0, 6, size=(rows, G, 1))
        w = np.where(style == 1, np.abs(w), w)  # all positive: max dominates
        w = np.where(style == 2, -np.abs(w), w)  # all negative: min dominates
        w = np.where(style == 3, w[..., :1], w)  # constant group
        w = np.where(style == 4, 0.0, w)  # constant zero group
    w = np.clip(w, -_LIMIT[dtype], _LIMIT[dtype])
    return torch.from_numpy(w.reshape(shape).astype(np.float32)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_quantize_matches_scalar_reference(bits, group_size, dtype):
    for i, kind in enumerate(("mixed", "grid", "normal")):
        w = make_weights(100 * bits + group_size + i, (3, 256), group_size, dtype, kind)
        packed, scales, biases = quantize(w, group_size, bits)
        assert packed.shape == (3, 256 * bits // 32) and packed.dtype == torch.uint32
        assert scales.shape == biases.shape == (3, 256 // group_size)
        assert scales.dtype == biases.dtype == dtype
        codes, _, _ = assert_matches_reference(w, packed, scales, biases, group_size, bits)
        assert_dequantize_bit_exact(packed, scales, biases, codes, group_size, bits)
        assert_dequantize_bit_exact(packed, scales, biases, codes, group_size, bits, torch.float32)


def test_layout_of_inputs_does_not_matter():
    # A transposed (non-contiguous) weight quantizes like its contiguous copy, and a
    # non-contiguous packed tensor reads back like a contiguous one.
    w = make_weights(3, (64, 96), 32, torch.float32, "mixed").t()  # [96, 64]
    assert not w.is_contiguous()
    got, want = quantize(w, 32, 3), quantize(w.contiguous(), 32, 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    packed, scales, biases = want
    packed_nc = packed.t().contiguous().t()
    assert not packed_nc.is_contiguous()
    assert torch.equal(unpack(packed_nc, 3), unpack(packed, 3))
    assert torch.equal(dequantize(packed_nc, scales, biases, 32, 3),
                       dequantize(packed, scales, biases, 32, 3))


# --------------------------------------------------------------------------------------
# 3. Round-trip error bounds
# --------------------------------------------------------------------------------------
# unit roundoff u (half an ulp, relative) and half the smallest subnormal eta (the
# absolute rounding error where values are subnormal) of each storage dtype.
_U = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
_ETA = {torch.float32: 2.0**-150, torch.float16: 2.0**-25, torch.bfloat16: 2.0**-134}


def assert_round_trip_bounds(w, packed, scales, biases, s32, b32, group_size, bits):
    """Check |w_hat - w| per element against the grid it was rounded to.

    With t = (w - bias)/s (exact), an element whose t lies in [-0.5, n + 0.5] is "in
    range" and rounds to the nearest grid point: error <= |s|/2. The formula guarantees
    t in [-0.5, n + 1] (the anchor maps to 0 and |q0| <= |e|/s0 + 1/2 stretches the
    other edge to at most n + 1), so a clamped element is off by |s|*(t - n) <= |s|.
    """
    dtype = w.dtype
    n = (1 << bits) - 1
    K = w.shape[-1]
    grouped = (*w.shape[:-1], K // group_size, group_size)
    w64 = w.to(torch.float64).reshape(grouped).numpy()
    q = unpack(packed, bits).reshape(grouped).numpy().astype(np.float64)
    s = s32.astype(np.float64)[..., None]
    b = b32.astype(np.float64)[..., None]

    t = (w64 - b) / s
    # Slack for float32 arithmetic inside quantize: fl32(fl32(w - b)/s) differs from t
    # by <= 2^-23 |t| relatively, which can tip a near-tie the other way and cost
    # |s| * 2^-23 |t| = 2^-23 |w - b|; we allow 2^-22 (|w| + |b|), twice that.
    slack32 = 2.0**-22 * (np.abs(w64) + np.abs(b))
    assert (t >= -0.5 - 1e-6).all() and (t <= n + 1 + 1e-6).all(), "t outside [-0.5, n+1]"
    in_range = t <= n + 0.5
    grid_err = np.abs(s * q + b - w64)  # exact in float64: s*q needs <= 32 bits
    allowed = np.where(in_range, np.abs(s) / 2, np.abs(s) * (t - n)) + slack32
    assert (grid_err <= allowed).all(), f"float32 grid: worst {(grid_err - allowed).max()}"

    # What dequantize returns additionally carries the storage dtype's rounding: the cast
    # of s (|q| <= n times u|s| + eta), of the bias (u|b| + eta), two float32 ops in
    # dequantize (2^-24 each on magnitudes <= n|s| + |b|) and the final cast of w_hat
    # (u|w_hat| + eta). With A = n|s| + |b| (either of s/s', b/b'), that is at most
    # (2u + 2^-23) A + (n + 2) eta, + 2^-23 A for |s'| vs |s| -> (2u + 2^-22) A + (n+2) eta.
    # The numbers: float32 2^-24 (no cast at all), float16 2^-11 = 4.9e-4 relative plus
    # 3.0e-8 absolute for its subnormals, bfloat16 2^-8 = 3.9e-3: for 8-bit bfloat16 the
    # scale's own storage error, 255 codes x 2^-9|s|, is ~0.5|s| -- a property of storing
    # scales in bf16, not a tolerance chosen to pass.
    u, eta = _U[dtype], _ETA[dtype]
    s_st = as_f32_numpy(scales).astype(np.float64)[..., None]
    b_st = as_f32_numpy(biases).astype(np.float64)[..., None]
    A = n * np.maximum(np.abs(s), np.abs(s_st)) + np.maximum(np.abs(b), np.abs(b_st))
    cast_slack = (2 * u + 2.0**-22) * A + (n + 2) * eta
    w_hat = dequantize(packed, scales, biases, group_size, bits).to(torch.float64)
    err = np.abs(w_hat.reshape(grouped).numpy() - w64)
    excess = err - allowed - cast_slack
    assert (excess <= 0).all(), f"dequantize: worst excess {excess.max()}"
    # ... and the in-range bound as stated: |w_hat - w| <= |s|/2 + slack.
    assert (err[in_range] <= (np.abs(s) / 2 + slack32 + cast_slack)[in_range]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_round_trip_error_bound(bits, group_size, dtype):
    for i, kind in enumerate(KINDS):
        w = make_weights(7 * bits + group_size + 1000 * i, (2, 256), group_size, dtype, kind)
        packed, scales, biases = quantize(w, group_size, bits)
        _, s32, b32 = ref_quantize(w, group_size, bits)
        assert_round_trip_bounds(w, packed, scales, biases, s32, b32, group_size, bits)


def test_symmetric_group_clamp_costs_a_full_step():
    # The bound above is tight: the hand case "symmetric-clamped" reads -1 back as -0.5.
    w = torch.tensor([_pad([1.0, -1.0], 0.0)])
    packed, scales, biases = quantize(w, 32, 2)
    err = (dequantize(packed, scales, biases, 32, 2) - w).abs()
    assert err.max().item() == abs(scales.item()) == 0.5


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("lead", [(), (3,), (2, 0), (2, 1, 3)], ids=str)
def test_pack_unpack_inverse_on_random_words(bits, lead):
    # 32 codes of b bits fill exactly b words with no padding bits, so every word
    # pattern is a valid packing and unpack/pack are mutually inverse bijections.
    rng = np.random.default_rng(bits)
    W = 4 * bits
    words = torch.from_numpy(rng.integers(0, 2**32, size=(*lead, W), dtype=np.int64))
    p = words.to(torch.uint32)
    codes = unpack(p, bits)
    assert codes.shape == (*lead, W * 32 // bits) and codes.dtype == torch.int64
    assert torch.equal(pack(codes, bits), p)
    assert torch.equal(unpack(pack(codes, bits), bits), codes)


# --------------------------------------------------------------------------------------
# 4. Properties (hypothesis)
# --------------------------------------------------------------------------------------


@st.composite
def quant_problems(draw):
    bits = draw(st.sampled_from(BITS))
    group_size = draw(st.sampled_from(GROUP_SIZES))
    dtype = draw(st.sampled_from(DTYPES))
    lead = tuple(draw(st.lists(st.integers(0, 3), min_size=0, max_size=3)))
    K = group_size * draw(st.integers(1, 3))
    kind = draw(st.sampled_from(KINDS))
    seed = draw(st.integers(0, 2**32 - 1))
    return bits, group_size, dtype, (*lead, K), kind, seed


def _check_all_properties(w, group_size, bits):
    dtype, lead, K = w.dtype, tuple(w.shape[:-1]), w.shape[-1]
    n = (1 << bits) - 1
    packed, scales, biases = quantize(w, group_size, bits)
    assert packed.dtype == torch.uint32 and packed.shape == (*lead, K * bits // 32)
    assert scales.shape == biases.shape == (*lead, K // group_size)
    assert scales.dtype == biases.dtype == dtype
    codes = unpack(packed, bits)
    assert codes.shape == w.shape
    if codes.numel():
        assert 0 <= int(codes.min()) and int(codes.max()) <= n
    assert torch.equal(pack(codes, bits), packed)
    ref_codes, s32, b32 = assert_matches_reference(w, packed, scales, biases, group_size, bits)
    assert_dequantize_bit_exact(packed, scales, biases, ref_codes, group_size, bits)
    assert_round_trip_bounds(w, packed, scales, biases, s32, b32, group_size, bits)
    qt = QuantizedTensor(packed, scales, biases, group_size, bits)
    assert qt.shape == tuple(w.shape)


@settings(max_examples=50, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(quant_problems())
def test_properties_random_shapes(problem):
    bits, group_size, dtype, shape, kind, seed = problem
    w = make_weights(seed, shape, group_size, dtype, kind)
    _check_all_properties(w, group_size, bits)


_SPECIAL = [0.0, -0.0, 1e-7, -1e-7, 5e-8, 1e-30, 0.5, -0.5, 1.5, 2.5, 65504.0, 1e4, -1e4]


@settings(max_examples=50, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_properties_explicit_values(data):
    # Let hypothesis choose (and shrink) every value of one or two rows directly.
    bits = data.draw(st.sampled_from(BITS), "bits")
    dtype = data.draw(st.sampled_from(DTYPES), "dtype")
    group_size = data.draw(st.sampled_from((32, 64)), "group_size")
    rows = data.draw(st.integers(1, 2), "rows")
    limit = _LIMIT[dtype]
    value = st.one_of(
        st.floats(-limit, limit, width=32, allow_nan=False, allow_infinity=False),
        st.sampled_from([x for x in _SPECIAL if abs(x) <= limit]),
        st.integers(-8, 8).map(lambda k: k / 4),
    )
    values = data.draw(st.lists(value, min_size=rows * group_size, max_size=rows * group_size))
    w = torch.tensor(values, dtype=torch.float32).reshape(rows, group_size).to(dtype)
    _check_all_properties(w, group_size, bits)


# --------------------------------------------------------------------------------------
# 5. Errors
# --------------------------------------------------------------------------------------


def _layout(bits=4, group_size=64, shape=(2, 128), dtype=torch.float32):
    return quantize(torch.randn(shape).to(dtype), group_size, bits)


@pytest.mark.parametrize("bad", [0, 1, 7, 16, 32])
def test_bad_bits(bad):
    w = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"^bits must be one of"):
        quantize(w, 64, bad)
    with pytest.raises(ValueError, match=r"^bits must be one of"):
        pack(torch.zeros(1, 32, dtype=torch.int64), bad)
    with pytest.raises(ValueError, match=r"^bits must be one of"):
        unpack(torch.zeros(1, 4, dtype=torch.uint32), bad)
    packed, scales, biases = _layout()
    with pytest.raises(ValueError, match=r"^bits must be one of"):
        dequantize(packed, scales, biases, 64, bad)


@pytest.mark.parametrize("bad", [0, 16, 48, 96, 256])
def test_bad_group_size(bad):
    with pytest.raises(ValueError, match=r"^group_size must be one of"):
        quantize(torch.randn(2, 768), bad, 4)
    packed, scales, biases = _layout()
    with pytest.raises(ValueError, match=r"^group_size must be one of"):
        dequantize(packed, scales, biases, bad, 4)
    with pytest.raises(ValueError, match=r"^group_size must be one of"):
        QuantizedTensor(packed, scales, biases, bad, 4)


@pytest.mark.parametrize(
    "shape,group_size", [((2, 96), 64), ((4, 32), 64), ((200,), 128), ((), 32)]
)
def test_last_dim_not_multiple_of_group_size(shape, group_size):
    msg = rf"^w's last dimension must be a multiple of group_size={group_size}"
    with pytest.raises(ValueError, match=msg):
        quantize(torch.zeros(shape), group_size, 4)


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.float64], ids=str
)
def test_quantize_rejects_non_float_dtypes(dtype):
    with pytest.raises(ValueError, match=r"^w must be float32, float16 or bfloat16"):
        quantize(torch.zeros(2, 64, dtype=dtype), 64, 4)


def test_pack_unpack_input_errors():
    with pytest.raises(ValueError, match=r"^q must be an integer tensor"):
        pack(torch.zeros(1, 32), 4)
    with pytest.raises(ValueError, match=r"^q must be an integer tensor"):
        pack(torch.zeros(1, 32, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match=r"^q's last dimension must be a multiple of 32, got 48"):
        pack(torch.zeros(1, 48, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match=r"^q holds values outside \[0, 16\) for bits=4"):
        pack(torch.full((1, 32), 16), 4)
    with pytest.raises(ValueError, match=r"^q holds values outside \[0, 8\) for bits=3"):
        pack(torch.full((1, 32), -1), 3)
    with pytest.raises(ValueError, match=r"^packed must be uint32"):
        unpack(torch.zeros(1, 4, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match=r"^packed's last dimension \(5\) .* multiple of bits=3"):
        unpack(torch.zeros(1, 5, dtype=torch.uint32), 3)


def test_mismatched_scales_biases_shapes():
    packed, scales, biases = _layout()
    with pytest.raises(ValueError, match=r"scales \(2, 2\) and biases \(2, 1\) differ in shape"):
        dequantize(packed, scales, biases[:, :1], 64, 4)
    with pytest.raises(ValueError, match=r"scales \(2, 2\) and biases \(2, 2, 1\) differ in shape"):
        QuantizedTensor(packed, scales, biases[..., None], 64, 4)


def test_mismatched_scales_biases_dtypes():
    packed, scales, biases = _layout()
    with pytest.raises(ValueError, match=r"scales and biases must share one float dtype"):
        dequantize(packed, scales, biases.half(), 64, 4)
    with pytest.raises(ValueError, match=r"scales and biases must share one float dtype"):
        dequantize(packed, scales.double(), biases.double(), 64, 4)


def test_inconsistent_packed_width():
    packed, scales, biases = _layout(bits=4, group_size=64)  # 128 x 4 bits = 16 words
    with pytest.raises(ValueError, match=r"packed width 15 words does not hold 128 elements of 4"):
        dequantize(packed[:, :15], scales, biases, 64, 4)
    # Right words for other bits: 16 words hold 128 4-bit codes, not 128 3-bit ones.
    with pytest.raises(ValueError, match=r"packed width 16 words .* \(expected 12 words"):
        dequantize(packed, scales, biases, 64, 3)
    # ... nor 256 codes of 4 bits (the scales say group_size=128 -> K = 256).
    with pytest.raises(ValueError, match=r"packed width 16 words does not hold 256 elements"):
        QuantizedTensor(packed, scales, biases, 128, 4)


def test_layout_errors_name_the_tensor():
    packed, scales, biases = _layout()
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.mlp: leading shape \(3,\)"):
        check_layout(torch.zeros(3, 16, dtype=torch.uint32), scales, biases, 64, 4,
                     name="model.layers.0.mlp")
    with pytest.raises(ValueError, match=r"^packed must be uint32, got dtype torch\.int64"):
        check_layout(packed.to(torch.int64), scales, biases, 64, 4)
    with pytest.raises(ValueError, match=r"^lm_head: packed width 15"):
        check_layout(packed[:, :15], scales, biases, 64, 4, name="lm_head")
    check_layout(packed, scales, biases, 64, 4)  # consistent: no error
    check_layout(packed.view(torch.int32), scales, biases, 64, 4)  # int32 bits accepted


# --------------------------------------------------------------------------------------
# 6. QuantizedTensor
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantized_tensor(dtype):
    w = make_weights(5, (3, 5, 128), 64, dtype, "normal")
    qt = QuantizedTensor.from_float(w, group_size=64, bits=4)
    packed, scales, biases = quantize(w, 64, 4)
    assert torch.equal(qt.packed, packed) and torch.equal(qt.scales, scales)
    assert torch.equal(qt.biases, biases)
    assert qt.shape == (3, 5, 128)
    assert qt.dtype == dtype and qt.device == torch.device("cpu")
    # 15 rows x (128 x 4 / 32 = 16 words x 4 bytes) + 2 x 15 rows x 2 groups x itemsize
    itemsize = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}[dtype]
    assert qt.nbytes == 15 * 16 * 4 + 2 * 15 * 2 * itemsize
    out = qt.dequantize()
    assert out.dtype == dtype and out.shape == w.shape
    assert torch.equal(out, dequantize(packed, scales, biases, 64, 4))
    out32 = qt.dequantize(torch.float32)
    assert out32.dtype == torch.float32
    assert torch.equal(out32.to(dtype), out)  # both are the float32 result, cast once
    _, s32, b32 = ref_quantize(w, 64, 4)
    assert_round_trip_bounds(w, qt.packed, qt.scales, qt.biases, s32, b32, 64, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        qt.bits = 8  # type: ignore[misc]


def test_quantized_tensor_hand_nbytes_and_shape():
    # 1-D weight, 3-bit, g=32: 96 elements -> 9 words (36 B) + 3 scales + 3 biases (bf16: 12 B).
    qt = QuantizedTensor.from_float(torch.zeros(96, dtype=torch.bfloat16), group_size=32, bits=3)
    assert qt.packed.shape == (9,) and qt.scales.shape == (3,)
    assert qt.shape == (96,)
    assert qt.nbytes == 36 + 12
    assert torch.equal(qt.dequantize(), torch.zeros(96, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_cpu(bits, group_size, dtype):
    g = torch.Generator().manual_seed(bits * 131 + group_size)
    w = (torch.randn(64, 512, generator=g) * torch.logspace(-3, 2, 64)[:, None]).to(dtype)
    cpu = quantize(w, group_size, bits)
    gpu = quantize(w.cuda(), group_size, bits)
    assert torch.equal(cpu[0].view(torch.int32), gpu[0].cpu().view(torch.int32))
    assert torch.equal(cpu[1], gpu[1].cpu())
    assert torch.equal(cpu[2], gpu[2].cpu())
