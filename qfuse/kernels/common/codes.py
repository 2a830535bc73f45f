"""MLX codes inside Triton kernels: turn packed words into floats without
integer→float conversions, and move per-code-position tensors in and out of
their interleaved layout.

A 32-bit word holds EPW = 32/BITS codes, code k in bits [k·BITS, (k+1)·BITS).
`magic_halves` ORs each 16-bit half of the word into the mantissa of 2**23
(0x4B000000) once per word; `code_f32` then masks one code in place (one
LOP3 that keeps the exponent bits, one FADD): the result is exactly
code·2**(BITS·pos), pos = k mod EPW/2, which stays below 2**23. Callers fold
the power of two into whatever multiplies the code (an integer→float
conversion runs at a quarter of the FMA rate on Hopper).
"""

import triton
import triton.language as tl


def nibbles_asm(lo_base: int, hi_base: int) -> str:
    """Inline PTX: two words in ($8, $9) → 8 registers, each a pair of 16-bit floats (one
    code position of word 0 in the low half, of word 1 in the high half): byte j gives
    outputs 2j (its low nibble ORed into lo_base's mantissa) and 2j + 1 (the high nibble
    into hi_base's). PRMT puts byte j of both words in one register, LOP3 (a & b) | c
    makes the low nibbles' pair, SHR + LOP3 the high nibbles': 4 instructions per 4 codes."""
    lo, hi = lo_base | (lo_base << 16), hi_base | (hi_base << 16)
    asm = "{ .reg .b32 t;\n"
    for j in range(4):
        sel = j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12)
        asm += (f"prmt.b32 t, $8, $9, {sel:#x};\n"
                f"lop3.b32 ${2 * j}, t, 0x000F000F, {lo:#x}, 0xEA;\n"
                "shr.b32 t, t, 4;\n"
                f"lop3.b32 ${2 * j + 1}, t, 0x000F000F, {hi:#x}, 0xEA;\n")
    return asm + "}"


_CODES4_BF16_ASM = tl.constexpr(nibbles_asm(0x4300, 0x4300))  # bf16 128 + code


@triton.jit
def magic_halves(words):
    """The low and high 16 bits of each int32 word, each OR-ed into 2**23."""
    lo = (words & 0xFFFF) | 0x4B000000
    hi = ((words >> 16) & 0xFFFF) | 0x4B000000
    return lo, hi


@triton.jit
def code_f32(lo, hi, k: tl.constexpr, BITS: tl.constexpr, EPW: tl.constexpr):
    """Code k of every word as the float32 code·2**(BITS·(k mod EPW/2))."""
    HALF: tl.constexpr = EPW // 2
    if k < HALF:
        src = lo
    else:
        src = hi
    pos: tl.constexpr = k % HALF
    c = src & (0x4B000000 | (((1 << BITS) - 1) << (pos * BITS)))
    return c.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def code_scale(k: tl.constexpr, BITS: tl.constexpr, EPW: tl.constexpr):
    """2**-(BITS·(k mod EPW/2)): what turns code_f32's value back into the code."""
    return 1.0 / (1 << (BITS * (k % (EPW // 2))))


@triton.jit
def join_codes(o, EPW: tl.constexpr):
    """Per-code tensors o[k] ([W] or [N, W]) → [..., W·EPW], element w·EPW + k = o[k][.., w]."""
    if EPW == 8:
        # nested joins index (a, b, c) hold code 4a + 2b + c
        x = tl.join(tl.join(tl.join(o[0], o[4]), tl.join(o[2], o[6])),
                    tl.join(tl.join(o[1], o[5]), tl.join(o[3], o[7])))
    else:
        # index (hi, lo) holds code 2·hi + lo
        x = tl.join(tl.join(o[0], o[2]), tl.join(o[1], o[3]))
    if len(o[0].shape) == 1:
        y = tl.reshape(x, (o[0].shape[0] * EPW,))
    else:
        y = tl.reshape(x, (o[0].shape[0], o[0].shape[1] * EPW))
    return y


@triton.jit
def split_codes(x, EPW: tl.constexpr):
    """[W, EPW] → tuple of EPW vectors [W], the k-th holding column k (join_codes' inverse)."""
    if EPW == 8:
        t = tl.reshape(x, (x.shape[0], 2, 2, 2))  # axes: bits 2, 1, 0 of k
        e, o = tl.split(t)
        e0, e1 = tl.split(e)
        o0, o1 = tl.split(o)
        x0, x4 = tl.split(e0)
        x2, x6 = tl.split(e1)
        x1, x5 = tl.split(o0)
        x3, x7 = tl.split(o1)
        r = (x0, x1, x2, x3, x4, x5, x6, x7)
    else:
        t = tl.reshape(x, (x.shape[0], 2, 2))
        e, o = tl.split(t)
        x0, x2 = tl.split(e)
        x1, x3 = tl.split(o)
        r = (x0, x1, x2, x3)
    return r


@triton.jit
def dequant_words(words, s, b, BITS: tl.constexpr):
    """[R, W] int32 words with float32 per-word scales/biases → [R, W·32/BITS] float32
    s·q + b in natural code order (the decode-attention K/V tiles, the prefill weight).

    Dequantize per code position k inside a word on [R, W] tensors, then interleave
    with tl.join, which adds the new axis inside each thread, so the final reshape moves
    no data. The power-of-two rescale of code_f32 is exact, so each value is s·q
    exactly before b is added."""
    EPW: tl.constexpr = 32 // BITS
    lo, hi = magic_halves(words)
    xs = ()
    for k in tl.static_range(EPW):
        xs = xs + (code_f32(lo, hi, k, BITS, EPW) * code_scale(k, BITS, EPW) * s + b,)
    return join_codes(xs, EPW)


@triton.jit
def codes4_bf16(words):
    """The 8 codes of 4-bit words as bf16 128 + c (exact), code k in the k-th of 8 tensors
    shaped like words. GPU only (inline PTX). It takes two words per instance, so each
    output register is a bf16 pair (one code of two neighbouring words): when words
    sit in an mma operand layout, the pairs are what the mma reads, with no repacking.
    1 instruction per code, against 2.5 for shift + mask + 16-bit packing."""
    return tl.inline_asm_elementwise(_CODES4_BF16_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                     dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)


@triton.jit
def code_operand(words, k: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr):
    """Code k of each word as DT (an mma operand type), exactly code_offset + c: the
    code OR-ed into the mantissa of a power of two, no integer→float conversion.
    bf16 cannot hold 128 + an 8-bit code, so 8-bit bf16 goes through float32."""
    c = (words >> (k * BITS)) & ((1 << BITS) - 1)
    if DT == tl.float16:
        x = (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + c
    elif BITS == 4:
        x = (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + c
    else:
        x = ((c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0).to(tl.bfloat16)
    return x


@triton.jit
def code_offset(BITS: tl.constexpr, DT: tl.constexpr):
    """What code_operand (and codes4_bf16) add to every code."""
    if DT == tl.float16:
        off = 1024.0
    elif BITS == 4:
        off = 128.0
    else:
        off = 0.0
    return off
