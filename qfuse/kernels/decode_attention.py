"""Flash-decoding over a 4/8-bit (MLX layout) or dense KV cache, GQA inside the kernel.

One query token per sequence. The KV length is cut into splits of a FIXED
size (SPLIT tokens, independent of the batch and of the lengths); one program
handles one split of one (sequence, kv head) for all the query heads that
share that kv head, so a KV tile is loaded and dequantized once per group of
query heads. Each program writes (running max, sum of exponentials, unnormalised
output) in float32; a second kernel merges the splits of each query head in
split order. No atomics: a sequence's output is bitwise reproducible and does
not depend on the rest of the batch.

Dequantization happens in registers: packed words are expanded with shifts and
masks, turned into floats with the 2**23 magic-number trick (an OR and a
subtraction instead of an integer→float conversion, which runs at a quarter of
the FMA rate on Hopper), then scaled. Neither scores nor a dequantized cache
reach memory.

Graph capture: the grid depends only on shapes (B, Hkv, Nmax), never on the
lengths, which the kernels read from device memory; programs past a sequence's
end exit at once.

Tensors:
    q        [B, Hq, D]                 bf16/fp16, D ∈ {64, 128, 256, 512}
    k, v     quantized: packed uint32 [B, Hkv, Nmax, D·bits/32] with
             scales/biases [B, Hkv, Nmax, D/g] (q's dtype), bits ∈ {4, 8},
             g ∈ {32, 64, 128}; or dense [B, Hkv, Nmax, D] in q's dtype.
             The last dimension must be contiguous.
    lengths  int32 [B]; sequence b attends to [max(0, L_b − window), L_b).
    out      [B, Hq, D] in q's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import QuantizedTensor
from .precise_math import tanh_f32, use_libdevice

SUPPORTED_HEAD_DIMS = (64, 128, 256, 512)
SUPPORTED_BITS = (4, 8)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)

# Tokens per split for caches up to 16k tokens (4x that beyond: split_size).
# The partial outputs add (D + 2)·4 bytes per query head per split: ~3% over
# a 4-bit cache's bytes at D=256, G=2 with 256-token splits.
SPLIT = 256
LOG2E = 1.4426950408889634
# Splits merged per step: [16, D] float32 partials, 16 values per thread at D=256.
MERGE_CHUNK = 16


@triton.jit
def _dequant_code(words, k: tl.constexpr, BITS: tl.constexpr, s, b):
    """s·code_k + b for the k-th code of every word, computed in float32."""
    c = (words >> (k * BITS)) & ((1 << BITS) - 1)
    # 0x4B000000 is 2**23 as a float32: OR-ing a code < 2**23 into its mantissa
    # gives exactly 2**23 + code, with no integer→float conversion instruction.
    c = (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return c * s + b


@triton.jit
def _load_kv_tile(
    packed_ptr,  # uint32 words (quantized) or values (dense) of one (b, kv head)
    scales_ptr,
    biases_ptr,
    tok,  # [BLOCK_N] token indices
    tok_mask,  # [BLOCK_N] which tokens are attended
    stride_tok,  # elements between tokens of `packed_ptr`
    stride_sb_tok,  # elements between tokens of scales/biases
    D: tl.constexpr,
    BITS: tl.constexpr,  # 0 for a dense cache
    GROUP: tl.constexpr,
):
    """[BLOCK_N, D] float32 tile of K or V, zeros for masked tokens."""
    if BITS == 0:
        d = tl.arange(0, D)
        x = tl.load(packed_ptr + tok[:, None] * stride_tok + d[None, :],
                    mask=tok_mask[:, None], other=0.0).to(tl.float32)
    else:
        # Dequantize per code position k inside a word on [BLOCK_N, W] tensors,
        # then interleave with tl.join, which adds the new axis inside each
        # thread, so the final reshape moves no data. A word's codes share one
        # group (8 | g), so scales and biases are loaded once per word.
        EPW: tl.constexpr = 32 // BITS
        W: tl.constexpr = D // EPW
        w_idx = tl.arange(0, W)
        words = tl.load(packed_ptr + tok[:, None] * stride_tok + w_idx[None, :],
                        mask=tok_mask[:, None], other=0).to(tl.int32, bitcast=True)
        sb_off = tok[:, None] * stride_sb_tok + (w_idx * EPW // GROUP)[None, :]
        s = tl.load(scales_ptr + sb_off, mask=tok_mask[:, None], other=0.0).to(tl.float32)
        b = tl.load(biases_ptr + sb_off, mask=tok_mask[:, None], other=0.0).to(tl.float32)
        x0 = _dequant_code(words, 0, BITS, s, b)
        x1 = _dequant_code(words, 1, BITS, s, b)
        x2 = _dequant_code(words, 2, BITS, s, b)
        x3 = _dequant_code(words, 3, BITS, s, b)
        if BITS == 8:
            # index (hi, lo) of join(join(x0, x2), join(x1, x3)) is code 2·hi + lo
            x = tl.join(tl.join(x0, x2), tl.join(x1, x3))
        else:
            x4 = _dequant_code(words, 4, BITS, s, b)
            x5 = _dequant_code(words, 5, BITS, s, b)
            x6 = _dequant_code(words, 6, BITS, s, b)
            x7 = _dequant_code(words, 7, BITS, s, b)
            # index (a, b, c) of the nested joins is code 4a + 2b + c
            x = tl.join(tl.join(tl.join(x0, x4), tl.join(x2, x6)),
                        tl.join(tl.join(x1, x5), tl.join(x3, x7)))
        x = tl.reshape(x, (tok.shape[0], D))
    return x


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr, k_scales_ptr, k_biases_ptr,  # K cache (scales/biases unused when dense)
    v_ptr, v_scales_ptr, v_biases_ptr,  # V cache
    lengths_ptr,  # int32 [B]
    part_o_ptr,  # float32 [B, Hq, n_splits, D] unnormalised partial outputs
    part_ml_ptr,  # float32 [B, Hq, n_splits, 2]: running max (log2 units), sum of exp2
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,  # K packed/dense strides (b, head, token)
    stride_ksb, stride_ksh, stride_ksn,  # K scales/biases strides
    stride_vb, stride_vh, stride_vn,
    stride_vsb, stride_vsh, stride_vsn,
    n_splits,
    qk_scale_log2,  # softmax scale · log2(e) (without soft-cap), or softmax scale (with)
    softcap,  # soft-cap value (used when SOFTCAP)
    window,  # attend to the last `window` tokens (used when WINDOW)
    HKV: tl.constexpr,
    G: tl.constexpr,  # query heads per kv head
    GP: tl.constexpr,  # G padded to a power of two ≥ 16 (tl.dot's minimum)
    D: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    SPLIT_N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    h_kv = bh % HKV
    length = tl.load(lengths_ptr + b)
    first = 0
    if WINDOW:
        first = tl.maximum(length - window, 0)
    lo = tl.maximum(split * SPLIT_N, first)
    hi = tl.minimum(split * SPLIT_N + SPLIT_N, length)
    if lo >= hi:
        return  # nothing to attend in this split; the merge never reads it

    r = tl.arange(0, GP)
    d = tl.arange(0, D)
    head = h_kv * G + r
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=(r < G)[:, None], other=0.0)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + h_kv * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + h_kv * stride_vh
    ks_off = b.to(tl.int64) * stride_ksb + h_kv * stride_ksh
    vs_off = b.to(tl.int64) * stride_vsb + h_kv * stride_vsh

    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    # A static trip count over the whole split (tokens outside [lo, hi) are
    # masked): every program walks the same token grid, and the loop needs no
    # bounds read from memory.
    for t in range(SPLIT_N // BLOCK_N):
        tok = split * SPLIT_N + t * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = (tok >= lo) & (tok < hi)
        k = _load_kv_tile(k_base, k_scales_ptr + ks_off, k_biases_ptr + ks_off, tok, valid,
                          stride_kn, stride_ksn, D, BITS, GROUP)
        s = tl.dot(q, tl.trans(k.to(q.dtype)))  # [GP, BLOCK_N], float32 accumulate
        if SOFTCAP:
            s = softcap * tanh_f32(s * qk_scale_log2 / softcap, LIBDEVICE) * 1.4426950408889634
        else:
            s = s * qk_scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Until a valid token is seen m_new is -inf; subtracting 0 instead keeps
        # exp2(-inf - -inf) = NaN out.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(v_base, v_scales_ptr + vs_off, v_biases_ptr + vs_off, tok, valid,
                          stride_vn, stride_vsn, D, BITS, GROUP)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    row = (b * (HKV * G) + head).to(tl.int64) * n_splits + split
    tl.store(part_o_ptr + row[:, None] * D + d[None, :], acc, mask=(r < G)[:, None])
    tl.store(part_ml_ptr + row * 2, m_i, mask=r < G)
    tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=r < G)


@triton.jit
def _decode_merge_kernel(
    part_o_ptr,  # float32 [B, Hq, n_splits, D]
    part_ml_ptr,  # float32 [B, Hq, n_splits, 2]
    lengths_ptr,  # int32 [B]
    out_ptr,  # [B, Hq, D]
    stride_ob, stride_oh,
    window,
    N_SPLITS: tl.constexpr,  # split slots per head (from Nmax; a multiple of S_CHUNK)
    S_CHUNK: tl.constexpr,  # splits merged per step
    HQ: tl.constexpr,
    D: tl.constexpr,
    SPLIT_N: tl.constexpr,
    WINDOW: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    length = tl.load(lengths_ptr + b)
    first = 0
    if WINDOW:
        first = tl.maximum(length - window, 0)
    s_first = first // SPLIT_N
    s_last = tl.cdiv(length, SPLIT_N)
    d = tl.arange(0, D)
    m = tl.full((), float("-inf"), tl.float32)
    l_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    # Only the splits in [s_first, s_last) were written. Walk all split slots
    # in fixed chunks and order (masked), so the loop bounds are constants.
    for c in range(0, N_SPLITS, S_CHUNK):
        sp = c + tl.arange(0, S_CHUNK)
        ok = (sp >= s_first) & (sp < s_last)
        row = bh.to(tl.int64) * N_SPLITS + sp
        m_s = tl.load(part_ml_ptr + row * 2, mask=ok, other=float("-inf"))
        l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=ok, other=0.0)
        o_s = tl.load(part_o_ptr + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(m_s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a_old = tl.exp2(m - m_safe)
        w = tl.exp2(m_s - m_safe)
        l_sum = l_sum * a_old + tl.sum(l_s * w, axis=0)
        acc = acc * a_old + tl.sum(o_s * w[:, None], axis=0)
        m = m_new
    # A sequence with nothing to attend (length 0) has l_sum = 0: define its output as 0.
    out = tl.where(l_sum > 0, acc / tl.where(l_sum > 0, l_sum, 1.0), 0.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d,
             out.to(out_ptr.dtype.element_ty))


def _next_pow2_at_least_16(g: int) -> int:
    return max(16, triton.next_power_of_2(g))


def _default_block_n(D: int, bits: int) -> int:
    """Tokens per tile. Measured on the H200 (bench runs of 2026-11-30): dense
    D=256 best at 32, D=128 at 64; quantized best at 64 for D=128 and 256."""
    if bits:
        return max(16, min(64, 16384 // D))
    return max(16, 8192 // D)


def split_size(n_max: int) -> int:
    """Tokens per split, fixed for a given cache capacity (never from lengths or
    batch, so a sequence's result does not depend on its batch). Short caches
    need many small splits to fill 132 SMs (8k tokens: 23 µs at 256 against
    59 µs at 1024, dense D=256); long ones amortise per-program work over
    longer splits (128k: 257 µs at 1024 against 314 µs at 256)."""
    return SPLIT if n_max <= 16384 else 4 * SPLIT


def _parts(t):
    if isinstance(t, QuantizedTensor):
        return t.packed, t.scales, t.biases, t.bits, t.group_size
    return t, t, t, 0, 32  # scales/biases pointers unused on the dense path


def unsupported_reason(q: torch.Tensor, k, v) -> str | None:
    """Why the kernel cannot take these inputs (None when it can)."""
    if q.dtype not in SUPPORTED_DTYPES:
        return f"q dtype {q.dtype} (supported: fp16, bf16)"
    D = q.shape[-1]
    if D not in SUPPORTED_HEAD_DIMS:
        return f"head dim {D} (supported: {SUPPORTED_HEAD_DIMS})"
    for name, t in (("k", k), ("v", v)):
        if isinstance(t, QuantizedTensor):
            if t.bits not in SUPPORTED_BITS:
                return f"{name} has {t.bits}-bit codes (supported: 4, 8)"
            if t.scales.dtype != q.dtype:
                return f"{name} scales are {t.scales.dtype}, q is {q.dtype}"
            if t.packed.stride(-1) != 1 or t.scales.stride(-1) != 1 or t.biases.stride() != t.scales.stride():
                return f"{name}'s packed/scales/biases need a contiguous last dim and one layout"
        else:
            if t.dtype != q.dtype:
                return f"{name} dtype {t.dtype} differs from q's {q.dtype}"
            if t.stride(-1) != 1:
                return f"{name} needs a contiguous last dimension"
    if q.stride(-1) != 1:
        return "q needs a contiguous last dimension"
    return None


def decode_attention_quantized_kv(
    q: torch.Tensor,
    k: torch.Tensor | QuantizedTensor,
    v: torch.Tensor | QuantizedTensor,
    lengths: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    _block_n: int | None = None, _num_stages: int | None = None, _split: int | None = None,
) -> torch.Tensor:
    """Launch split + merge. Inputs must already be validated (ops does it)."""
    B, Hq, D = q.shape
    Hkv, n_max = k.shape[1], k.shape[2]
    G = Hq // Hkv
    # Round the split slots up to whole merge chunks (extra slots are never written or read).
    split = _split or split_size(n_max)
    n_splits = triton.cdiv(max(1, triton.cdiv(n_max, split)), MERGE_CHUNK) * MERGE_CHUNK
    if out is None:
        out = torch.empty_like(q)
    part_o = torch.empty(B, Hq, n_splits, D, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(B, Hq, n_splits, 2, dtype=torch.float32, device=q.device)
    if lengths.dtype != torch.int32:
        lengths = lengths.to(torch.int32)
    kp, ks, kb, k_bits, k_group = _parts(k)
    vp, vs, vb, v_bits, v_group = _parts(v)
    if (k_bits, k_group) != (v_bits, v_group):
        raise ValueError(
            f"k and v must share one format, got k bits={k_bits} g={k_group}, "
            f"v bits={v_bits} g={v_group}"
        )
    qk_scale = scale if softcap is not None else scale * LOG2E
    _decode_split_kernel[(n_splits, B * Hkv)](
        q, kp, ks, kb, vp, vs, vb, lengths, part_o, part_ml,
        q.stride(0), q.stride(1),
        kp.stride(0), kp.stride(1), kp.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        vp.stride(0), vp.stride(1), vp.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2),
        n_splits, qk_scale, float(softcap or 1.0), int(window or 0),
        HKV=Hkv, G=G, GP=_next_pow2_at_least_16(G), D=D, BITS=k_bits, GROUP=k_group,
        SPLIT_N=split, BLOCK_N=_block_n or _default_block_n(D, k_bits), WINDOW=window is not None,
        SOFTCAP=softcap is not None, LIBDEVICE=use_libdevice(),
        num_warps=4, num_stages=_num_stages or (2 if k_bits else 3),
    )
    _decode_merge_kernel[(B * Hq,)](
        part_o, part_ml, lengths, out, out.stride(0), out.stride(1),
        int(window or 0), N_SPLITS=n_splits, S_CHUNK=MERGE_CHUNK, HQ=Hq, D=D, SPLIT_N=split, WINDOW=window is not None,
        num_warps=4,
    )
    return out
