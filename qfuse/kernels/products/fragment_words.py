"""A fragment-order 4-bit weight back to MLX words, or to dense bf16, in one kernel each
(GPU; interpreter).

A loaded model holds each 4-bit weight once, in the fragment order of
`fragments` (the decode product's form). What still reads the MLX layout (the
prefill product's dequantization for cuBLAS, saving, a user's `.packed`) gets
the words from here: `fragments.to_mlx`'s permutation without torch's int64
temporaries (a [15360×3840] weight would need ~470 MB of them per pass).

Program (t, kb) reads the 128 words of fragment block (t, kb) and writes the
16 rows × 8 MLX words of that block (BLOCK_K = 64 columns): nibble i of output word ω of row ρ is
column k = 8ω + i of the block, which `fragments` stores in lane 4g + q, word j,
nibble 4e + 2h + r for ρ = g + 8r and k = 16q + 4j + 2h + e. Integer only, so
the result is exact under the interpreter too.

``f`` is a `fragments.FragmentWeight`, read by its fields (words, scales, biases, n, k,
group_size): `fragments` calls into this module, so it imports nothing from there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...levers import interpreter_active
from ..common.rounding import bf16_bits_to_f32, stored_view, to_stored

# Rows of a fragment tile, `fragments.TILE_N` (a block's 32 lanes × 4 words × 8 codes
# over its 64 columns; tests/test_fragments.py checks they agree).
TILE_ROWS = 16
_ROWS = tl.constexpr(TILE_ROWS)  # a kernel reads only constexpr globals


@triton.jit
def _codes_at(frag_ptr, t, kb, KB, rho, k):
    """The codes (int32) of rows ρ, columns k of fragment block (t, kb): lane 4g + q, word
    j, nibble 4e + 2h + r for ρ = g + 8r and k = 16q + 4j + 2h + e (module docstring)."""
    g, r = rho % 8, rho // 8
    q, j, h, e = k // 16, (k % 16) // 4, (k % 4) // 2, k % 2
    word = tl.load(frag_ptr + ((t.to(tl.int64) * KB + kb) * 32 + 4 * g + q) * 4 + j)
    return (word >> (4 * (4 * e + 2 * h + r))) & 0xF


@triton.jit
def _mlx_words_kernel(
    frag_ptr,  # int32 [T, KB, 32, 4]: the fragment words
    out_ptr,  # int32 [N, K/8]: MLX words (uint32 bits)
    N,  # rows of the weight (the last tile may be partial)
    KB,  # 64-column blocks
):
    t = tl.program_id(0)
    kb = tl.program_id(1)
    slot = tl.arange(0, _ROWS * 8 * 8)  # (row ρ, output word ω, nibble i)
    rho = slot // 64
    omega = (slot // 8) % 8
    i = slot % 8
    code = _codes_at(frag_ptr, t, kb, KB, rho, 8 * omega + i)
    # Disjoint nibbles: their sum is their OR. int64 so the top nibble cannot overflow.
    packed = tl.sum(tl.reshape(code.to(tl.int64) << (4 * i).to(tl.int64), (_ROWS * 8, 8)), axis=1)
    row = 16 * t + tl.arange(0, _ROWS * 8) // 8
    col = kb * 8 + tl.arange(0, _ROWS * 8) % 8
    wrapped = tl.where(packed >= 2**31, packed - 2**32, packed).to(tl.int32)
    tl.store(out_ptr + row.to(tl.int64) * (KB * 8) + col, wrapped, mask=row < N)


def mlx_words(f) -> torch.Tensor:
    """The MLX words uint32 [N, K/8] of ``f`` (bit for bit those `fragments.repack` read)."""
    T, KB = f.words.shape[:2]
    out = torch.empty(f.n, f.k // 8, dtype=torch.int32, device=f.words.device)
    if f.n and KB:
        _mlx_words_kernel[(T, KB)](f.words.contiguous(), out, f.n, KB, num_warps=4)
    return out.view(torch.uint32)



@triton.jit
def _bf16_kernel(
    frag_ptr,  # int32 [T, KB, 32, 4]: the fragment words
    scales_ptr, biases_ptr,  # int32 [T, G, 8]: bf16 pairs (row g low half, row g + 8 high)
    out_ptr,  # [N, K] bf16 (or its stored view under the interpreter)
    N, KB, G,
    GROUP: tl.constexpr,
    NATIVE: tl.constexpr,
):
    """Program (t, kb): the 16 rows × 64 columns of fragment block (t, kb) as bf16, the
    float32 s·q + b rounded once (s·q is exact, so this is `quant.dequantize`'s value)."""
    t = tl.program_id(0)
    kb = tl.program_id(1)
    slot = tl.arange(0, _ROWS * 64)  # (row ρ, column k of the block)
    rho, k = slot // 64, slot % 64
    code = _codes_at(frag_ptr, t, kb, KB, rho, k).to(tl.float32)
    pair = (t.to(tl.int64) * G + (kb * 64) // GROUP) * 8 + rho % 8
    half = 16 * (rho // 8)  # row g's scale in the low half, row g + 8's in the high
    s = bf16_bits_to_f32((tl.load(scales_ptr + pair) >> half) & 0xFFFF)
    b = bf16_bits_to_f32((tl.load(biases_ptr + pair) >> half) & 0xFFFF)
    row = 16 * t + rho
    tl.store(out_ptr + row.to(tl.int64) * (KB * 64) + kb * 64 + k, to_stored(code * s + b, NATIVE),
             mask=row < N)


def dequantize_bf16(f) -> torch.Tensor:
    """The dense weight bf16 [N, K], bit for bit ``to_mlx(f).dequantize(torch.bfloat16)``,
    in one pass over the fragment words: what a prefill's cuBLAS product reads, without
    the MLX words and scales made first (two kernels and some twenty torch ops a weight,
    which held a 512-token prefill's host at 250 ms: NOTES "Serving")."""
    T, KB = f.words.shape[:2]
    out = torch.empty(f.n, f.k, dtype=torch.bfloat16, device=f.words.device)
    if f.n and KB:
        _bf16_kernel[(T, KB)](f.words.contiguous(), f.scales.contiguous(),
                              f.biases.contiguous(), stored_view(out), f.n, KB,
                              f.scales.shape[1], GROUP=f.group_size,
                              NATIVE=not interpreter_active(), num_warps=4)
    return out
