"""Flash-decoding over a 4/8-bit (MLX layout) or dense KV cache, GQA inside the kernel.

One query token per sequence. The KV length is cut into splits of a FIXED
size (SPLIT tokens, independent of the batch and of the lengths); one program
handles one split of one (sequence, kv head) for all the query heads that
share that kv head, so a KV tile is loaded and dequantized once per group of
query heads. Each program writes (running max, sum of exponentials, unnormalised
output) in float32; a second kernel merges the splits of each query head in
split order. No atomics: a sequence's output is bitwise reproducible and does
not depend on the rest of the batch.

Quantized caches run the codes kernel by default (`_decode_split_codes_kernel`):
the codes themselves are the mma operands and the scales come out of the sums, so
not even registers hold a dequantized value; the older kernels dequantize in
registers (packed words expanded with shifts and masks, turned into floats with
the 2**23 magic-number trick, then scaled) and remain for what the codes kernel
does not take (fewer than 16 words per token, very wide GQA groups) and as
`_path` options. Neither scores nor a dequantized cache ever reach memory.

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
from . import pdl
from .codes import (
    code_f32,
    code_offset,
    code_operand,
    codes4_bf16,
    dequant_words,
    join_codes,
    magic_halves,
)
from .precise_math import tanh_f32, use_libdevice

SUPPORTED_HEAD_DIMS = (64, 128, 256, 512)
SUPPORTED_BITS = (4, 8)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)

# Tokens per split for caches up to 16k tokens (4x that beyond: split_size).
# The partial outputs add (D + 2)·4 bytes per query head per split: ~3% over
# a 4-bit cache's bytes at D=256, G=2 with 256-token splits.
SPLIT = 256
LOG2E = 1.4426950408889634
# The CUDA-core kernel for quantized caches (opt-in: `_path="cuda_cores"`) takes
# at most this many query heads per kv head: every head adds 8 accumulators.
# It beats the dequantizing tensor-core kernel at G=2 (kv4 128k: 432 against 549
# µs) but the codes kernel beats both (145 µs; ab-archive:bench/ab/ab13, ab16), so it is
# never chosen by default.
CUDA_CORE_MAX_G = 2
# The codes kernel's output accumulators: R·D float32 per program, at most 64 per thread
# of 4 warps (D=256, G=2, g=64: R=16, 4096 floats, 32 per thread).
CODES_MAX_ACC = 8192
# Splits merged per step: [16, D] float32 partials, 16 values per thread at D=256.
MERGE_CHUNK = 16


@triton.jit
def _kv_words(packed_ptr, tok, tok_mask, stride_tok, D: tl.constexpr, BITS: tl.constexpr):
    """The packed words [BLOCK_N, W] of a quantized K or V tile (0 for masked tokens)."""
    w_idx = tl.arange(0, D * BITS // 32)
    return tl.load(packed_ptr + tok[:, None] * stride_tok + w_idx[None, :],
                   mask=tok_mask[:, None], other=0).to(tl.int32, bitcast=True)


@triton.jit
def _kv_scales(scales_ptr, biases_ptr, tok, tok_mask, stride_sb_tok, D: tl.constexpr,
               BITS: tl.constexpr, GROUP: tl.constexpr):
    """Scales and biases [BLOCK_N, W] of a quantized K or V tile, one per word (a word's
    codes share one group, 8 | g), as stored (bf16/fp16); zeros for masked tokens."""
    EPW: tl.constexpr = 32 // BITS
    w_idx = tl.arange(0, D // EPW)
    sb_off = tok[:, None] * stride_sb_tok + (w_idx * EPW // GROUP)[None, :]
    s = tl.load(scales_ptr + sb_off, mask=tok_mask[:, None], other=0.0)
    b = tl.load(biases_ptr + sb_off, mask=tok_mask[:, None], other=0.0)
    return s, b


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
        words = _kv_words(packed_ptr, tok, tok_mask, stride_tok, D, BITS)
        s, b = _kv_scales(scales_ptr, biases_ptr, tok, tok_mask, stride_sb_tok, D, BITS, GROUP)
        x = dequant_words(words, s.to(tl.float32), b.to(tl.float32), BITS)
    return x


@triton.jit
def _window_start(length, window, WINDOW: tl.constexpr):
    """First attended token: length − window with a sliding window, else 0."""
    first = 0
    if WINDOW:
        first = tl.maximum(length - window, 0)
    return first


@triton.jit
def _split_tokens(lengths_ptr, window, HKV: tl.constexpr, SPLIT_N: tl.constexpr,
                  WINDOW: tl.constexpr):
    """This program's (split, sequence, kv head) and the tokens [lo, hi) it attends."""
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    length = tl.load(lengths_ptr + b)
    first = _window_start(length, window, WINDOW)
    lo = tl.maximum(split * SPLIT_N, first)
    hi = tl.minimum(split * SPLIT_N + SPLIT_N, length)
    return split, b, bh % HKV, lo, hi


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
    PREFETCH: tl.constexpr,  # quantized caches: scales/biases one tile ahead (opt-in)
    GDC: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.start(GDC)
    split, b, h_kv, lo, hi = _split_tokens(lengths_ptr, window, HKV, SPLIT_N, WINDOW)
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
    # Triton pipelines the packed words (cp.async) but not the 2-byte scales and
    # biases, which then wait a memory latency every tile; PREFETCH loads them one
    # tile ahead into registers (what took the quantized matmul from 32.8 to 28.2 µs).
    PRE: tl.constexpr = PREFETCH and BITS > 0
    if PRE:
        tok0 = split * SPLIT_N + tl.arange(0, BLOCK_N)
        valid0 = (tok0 >= lo) & (tok0 < hi)
        sk, bk = _kv_scales(k_scales_ptr + ks_off, k_biases_ptr + ks_off, tok0, valid0,
                            stride_ksn, D, BITS, GROUP)
        sv, bv = _kv_scales(v_scales_ptr + vs_off, v_biases_ptr + vs_off, tok0, valid0,
                            stride_vsn, D, BITS, GROUP)
    for t in range(SPLIT_N // BLOCK_N):
        tok = split * SPLIT_N + t * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = (tok >= lo) & (tok < hi)
        if PRE:
            nxt = tok + BLOCK_N
            nxt_valid = (nxt >= lo) & (nxt < hi)  # past the split: hi ≤ its end, so none
            sk_n, bk_n = _kv_scales(k_scales_ptr + ks_off, k_biases_ptr + ks_off, nxt,
                                    nxt_valid, stride_ksn, D, BITS, GROUP)
            sv_n, bv_n = _kv_scales(v_scales_ptr + vs_off, v_biases_ptr + vs_off, nxt,
                                    nxt_valid, stride_vsn, D, BITS, GROUP)
            k = dequant_words(_kv_words(k_base, tok, valid, stride_kn, D, BITS),
                               sk.to(tl.float32), bk.to(tl.float32), BITS)
        else:
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
        if PRE:
            v = dequant_words(_kv_words(v_base, tok, valid, stride_vn, D, BITS),
                               sv.to(tl.float32), bv.to(tl.float32), BITS)
            sk, bk, sv, bv = sk_n, bk_n, sv_n, bv_n
        else:
            v = _load_kv_tile(v_base, v_scales_ptr + vs_off, v_biases_ptr + vs_off, tok, valid,
                              stride_vn, stride_vsn, D, BITS, GROUP)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    row = (b * (HKV * G) + head).to(tl.int64) * n_splits + split
    tl.store(part_o_ptr + row[:, None] * D + d[None, :], acc, mask=(r < G)[:, None])
    tl.store(part_ml_ptr + row * 2, m_i, mask=r < G)
    tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=r < G)


@triton.jit
def _word_scales(s_ptr, b_ptr, tok, valid, stride_tok, W: tl.constexpr, EPW: tl.constexpr,
                 GROUP: tl.constexpr):
    """Scales and biases [BLOCK_N, W], one per word (all codes of a word share a group):
    loaded once per group, contiguous, then repeated over the group's words."""
    NG: tl.constexpr = W * EPW // GROUP
    off = tok[:, None] * stride_tok + tl.arange(0, NG)[None, :]
    s = tl.load(s_ptr + off, mask=valid[:, None], other=0.0).to(tl.float32)
    b = tl.load(b_ptr + off, mask=valid[:, None], other=0.0).to(tl.float32)
    shape: tl.constexpr = (tok.shape[0], NG, W // NG)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], shape), (tok.shape[0], W))
    b = tl.reshape(tl.broadcast_to(b[:, :, None], shape), (tok.shape[0], W))
    return s, b


@triton.jit
def _decode_split_cc_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr, k_scales_ptr, k_biases_ptr,  # quantized K cache
    v_ptr, v_scales_ptr, v_biases_ptr,  # quantized V cache
    lengths_ptr,  # int32 [B]
    part_o_ptr,  # float32 [B, Hq, n_splits, D]
    part_ml_ptr,  # float32 [B, Hq, n_splits, 2]
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vb, stride_vh, stride_vn,
    stride_vsb, stride_vsh, stride_vsn,
    n_splits,
    qk_scale_log2,
    softcap,
    window,
    HKV: tl.constexpr,
    G: tl.constexpr,  # query heads per kv head (each kept in its own registers)
    D: tl.constexpr,
    BITS: tl.constexpr,  # 4 or 8
    GROUP: tl.constexpr,
    SPLIT_N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    GDC: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    """Quantized split kernel on CUDA cores, for few query heads per kv head.

    Everything is a [BLOCK_N tokens, W words] tile in the layout the words are
    loaded in; the dequantized tile never exists. Per query head h (tuples,
    unrolled): score = Σ_w s·(Σ_k q_hk·c_k) + b·Σ_k q_hk, and the value side
    accumulates p·s·c_k per (token, word) in registers, reduced over tokens once
    per split. Softmax rescaling is lazy: the reference max moves only when a
    score exceeds it by more than 8 (log2 units), so p ≤ 256 and the
    accumulators are rescaled on a few tiles instead of every tile.
    """
    pdl.start(GDC)
    EPW: tl.constexpr = 32 // BITS
    W: tl.constexpr = D // EPW
    HALF: tl.constexpr = EPW // 2
    split, b, h_kv, lo, hi = _split_tokens(lengths_ptr, window, HKV, SPLIT_N, WINDOW)
    if lo >= hi:
        return

    w_idx = tl.arange(0, W)
    q_base = q_ptr + b * stride_qb + (h_kv * G) * stride_qh + w_idx * EPW
    # q per (code k, head h), with code k's in-word power of two folded in (exact).
    qk = ()
    qsum = ()
    for h in tl.static_range(G):
        qsum = qsum + (tl.zeros((W,), tl.float32),)
    for k in tl.static_range(EPW):
        sums = ()
        for h in tl.static_range(G):
            x = tl.load(q_base + h * stride_qh + k).to(tl.float32)
            qk = qk + (x * (1.0 / (1 << (BITS * (k % HALF)))),)
            sums = sums + (qsum[h] + x,)
        qsum = sums

    k_base = k_ptr + b.to(tl.int64) * stride_kb + h_kv * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + h_kv * stride_vh
    ks_base = b.to(tl.int64) * stride_ksb + h_kv * stride_ksh
    vs_base = b.to(tl.int64) * stride_vsb + h_kv * stride_vsh

    m_ref = ()
    l_i = ()
    acc_b = ()
    for h in tl.static_range(G):
        m_ref = m_ref + (tl.full((), float("-inf"), tl.float32),)
        l_i = l_i + (tl.zeros((), tl.float32),)
        acc_b = acc_b + (tl.zeros((BLOCK_N, W), tl.float32),)
    acc = ()
    for i in tl.static_range(EPW * G):
        acc = acc + (tl.zeros((BLOCK_N, W), tl.float32),)

    for t in range(SPLIT_N // BLOCK_N):
        tok = split * SPLIT_N + t * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = (tok >= lo) & (tok < hi)
        # ---- scores ----
        kw = tl.load(k_base + tok[:, None] * stride_kn + w_idx[None, :], mask=valid[:, None],
                     other=0).to(tl.int32, bitcast=True)
        kw_lo, kw_hi = magic_halves(kw)
        sk, bk = _word_scales(k_scales_ptr + ks_base, k_biases_ptr + ks_base, tok, valid,
                              stride_ksn, W, EPW, GROUP)
        dots = ()
        for h in tl.static_range(G):
            dots = dots + (tl.zeros((BLOCK_N, W), tl.float32),)
        for k in tl.static_range(EPW):
            c = code_f32(kw_lo, kw_hi, k, BITS, EPW)
            new = ()
            for h in tl.static_range(G):
                new = new + (dots[h] + c * qk[k * G + h][None, :],)
            dots = new
        scores = ()
        grow = tl.full((), float("-inf"), tl.float32)
        for h in tl.static_range(G):
            s = tl.sum(dots[h] * sk + bk * qsum[h][None, :], axis=1)  # [BLOCK_N]
            if SOFTCAP:
                s = softcap * tanh_f32(s * qk_scale_log2 / softcap, LIBDEVICE) * 1.4426950408889634
            else:
                s = s * qk_scale_log2
            s = tl.where(valid, s, float("-inf"))
            scores = scores + (s,)
            grow = tl.maximum(grow, tl.max(s, axis=0) - m_ref[h])
        # ---- lazy softmax rescale (NaN-safe: -inf - -inf compares false) ----
        if grow > 8.0:
            new_m = ()
            new_l = ()
            new_b = ()
            for h in tl.static_range(G):
                m_new = tl.maximum(m_ref[h], tl.max(scores[h], axis=0))
                alpha = tl.exp2(m_ref[h] - m_new)
                new_m = new_m + (m_new,)
                new_l = new_l + (l_i[h] * alpha,)
                new_b = new_b + (acc_b[h] * alpha,)
            new_acc = ()
            for i in tl.static_range(EPW * G):
                new_acc = new_acc + (acc[i] * tl.exp2(m_ref[i % G] - new_m[i % G]),)
            m_ref = new_m
            l_i = new_l
            acc_b = new_b
            acc = new_acc
        # ---- values ----
        vw = tl.load(v_base + tok[:, None] * stride_vn + w_idx[None, :], mask=valid[:, None],
                     other=0).to(tl.int32, bitcast=True)
        vw_lo, vw_hi = magic_halves(vw)
        sv, bv = _word_scales(v_scales_ptr + vs_base, v_biases_ptr + vs_base, tok, valid,
                              stride_vsn, W, EPW, GROUP)
        ps = ()
        new_l = ()
        new_b = ()
        for h in tl.static_range(G):
            m_safe = tl.where(m_ref[h] == float("-inf"), 0.0, m_ref[h])
            p = tl.exp2(scores[h] - m_safe)  # [BLOCK_N], at most 2**8
            new_l = new_l + (l_i[h] + tl.sum(p, axis=0),)
            new_b = new_b + (acc_b[h] + bv * p[:, None],)
            ps = ps + (sv * p[:, None],)
        l_i = new_l
        acc_b = new_b
        new_acc = ()
        for k in tl.static_range(EPW):
            c = code_f32(vw_lo, vw_hi, k, BITS, EPW)
            for h in tl.static_range(G):
                new_acc = new_acc + (acc[k * G + h] + c * ps[h],)
        acc = new_acc

    # Reduce over tokens, undo the in-word powers of two, add the bias term, store.
    d_idx = tl.arange(0, D)
    for h in tl.static_range(G):
        bias_w = tl.sum(acc_b[h], axis=0)  # [W]
        o = ()
        for k in tl.static_range(EPW):
            o = o + (tl.sum(acc[k * G + h], axis=0) * (1.0 / (1 << (BITS * (k % HALF)))) + bias_w,)
        row = (b * (HKV * G) + h_kv * G + h).to(tl.int64) * n_splits + split
        tl.store(part_o_ptr + row * D + d_idx, join_codes(o, EPW))
        tl.store(part_ml_ptr + row * 2, m_ref[h])
        tl.store(part_ml_ptr + row * 2 + 1, l_i[h])


@triton.jit
def _token_scales(s_ptr, b_ptr, tok, valid, stride_tok, NG: tl.constexpr):
    """Scales/biases [BLOCK_N, NG] in float32 (0 for tokens not attended)."""
    off = tok[:, None] * stride_tok + tl.arange(0, NG)[None, :]
    s = tl.load(s_ptr + off, mask=valid[:, None], other=0.0).to(tl.float32)
    b = tl.load(b_ptr + off, mask=valid[:, None], other=0.0).to(tl.float32)
    return s, b


@triton.jit
def _decode_split_codes_kernel(
    q_ptr, k_ptr, k_scales_ptr, k_biases_ptr, v_ptr, v_scales_ptr, v_biases_ptr,
    lengths_ptr, part_o_ptr, part_ml_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vb, stride_vh, stride_vn,
    stride_vsb, stride_vsh, stride_vsn,
    n_splits, qk_scale_log2, softcap, window,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
    GROUP: tl.constexpr, SPLIT_N: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, LIBDEVICE: tl.constexpr,
    R: tl.constexpr,  # mma columns: (head, group) pairs, padded to a power of 2 ≥ 16
    GDC: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    """Quantized split kernel on tensor cores over the raw codes: the cache is never
    dequantized, not even in registers.

    The mma operands are the codes themselves (OFF + c, exact in the operand type) and
    the scales come out of the sums, per group g. With columns/rows (head h, group g):
        K:  S[n, (h,g)] = Σ_{d∈g} (OFF + c_nd)·q_hd                 (tokens on mma rows)
            score[n, h] = Σ_g s_ng·S[n, (h,g)] + (b_ng − OFF·s_ng)·Σ_{d∈g} q_hd
        V:  P'[(h,g), n] = p_hn·s_ng (rounded to the operand type)
            out[h, d∈g] = Σ_n P'[(h,g), n]·(OFF + c_nd) + Σ_n (p_hn·b_ng − OFF·P'[(h,g), n])
    The correction uses the rounded P', so the OFF terms cancel exactly. A word's
    codes share one group, so each code position k inside the words is one mma over
    the words of a tile ([BLOCK_N, W]·[W, R] and [R, BLOCK_N]·[BLOCK_N, W]): the words
    stay [BLOCK_N, W], Triton stages them in shared memory as words and the codes are
    extracted straight in the mma operand layout (codes4_bf16: one instruction per
    code). Tokens on the score rows make the scales of a tile one [BLOCK_N, NG] load
    (once per token and group, not per head) and let the score mma be a wgmma; the
    per-token sums (softmax denominator, bias correction) stay in each thread until
    the split ends; the softmax reference moves lazily (by more than 8, log2 units),
    so accumulators are rescaled on few tiles.

    sm_90a SASS, kv4 D=256 G=2, 128-token tiles: 1309 instructions per tile; the
    same sums with (head, group) on the score rows took 1860 and the dequantizing
    tensor-core kernel 2560 per 64 tokens. H200, B=1, 128k: 165 µs against 179 and
    549 µs (ab-archive:bench/ab/ab13_result.json, ab14_result.json).
    """
    pdl.start(GDC)
    EPW: tl.constexpr = 32 // BITS
    W: tl.constexpr = D // EPW
    NG: tl.constexpr = D // GROUP
    RH: tl.constexpr = R // NG
    DT: tl.constexpr = q_ptr.dtype.element_ty
    OFF: tl.constexpr = code_offset(BITS, DT)
    ASM: tl.constexpr = LIBDEVICE and BITS == 4 and DT == tl.bfloat16
    split, b, h_kv, lo, hi = _split_tokens(lengths_ptr, window, HKV, SPLIT_N, WINDOW)
    if lo >= hi:
        return

    c = tl.arange(0, R)
    h_of_col = c // NG
    g_of_col = c % NG
    w_idx = tl.arange(0, W)
    word_col = ((w_idx * EPW // GROUP)[:, None] == g_of_col[None, :]) & (h_of_col < G)[None, :]
    q_cols = (q_ptr + b * stride_qb + (h_kv * G + h_of_col)[None, :] * stride_qh
              + (w_idx * EPW)[:, None])
    qk = ()  # qk[k]: [W, R]
    qsum = tl.zeros((R,), tl.float32)
    for k in tl.static_range(EPW):
        x = tl.load(q_cols + k, mask=word_col, other=0.0)
        qk = qk + (x,)
        qsum += tl.sum(x.to(tl.float32), axis=0)
    qsum3 = tl.reshape(qsum, (1, RH, NG))
    k_base = k_ptr + b.to(tl.int64) * stride_kb + h_kv * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + h_kv * stride_vh
    ks_off = b.to(tl.int64) * stride_ksb + h_kv * stride_ksh
    vs_off = b.to(tl.int64) * stride_vsb + h_kv * stride_vsh

    m_ref = tl.full((RH,), float("-inf"), tl.float32)
    l_acc = tl.zeros((BLOCK_N, RH), tl.float32)
    corr_acc = tl.zeros((R, BLOCK_N), tl.float32)
    acc = ()
    for k in tl.static_range(EPW):
        acc = acc + (tl.zeros((R, W), tl.float32),)
    for t in range(SPLIT_N // BLOCK_N):
        tok = split * SPLIT_N + t * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = (tok >= lo) & (tok < hi)
        # Words are read unmasked from in-bounds tokens (clamped to the last attended
        # one): any bits are finite codes, and an unattended token's codes meet a zero
        # scale (masked load) and a zero probability.
        tok_in = tl.minimum(tok, hi - 1)
        kw = tl.load(k_base + tok_in[:, None] * stride_kn + w_idx[None, :]).to(tl.int32, bitcast=True)
        if ASM:
            kc = codes4_bf16(kw)
        st = tl.zeros((BLOCK_N, R), tl.float32)
        for k in tl.static_range(EPW):
            if ASM:
                ck = kc[k]
            else:
                ck = code_operand(kw, k, BITS, DT)
            st = tl.dot(ck, qk[k], st)
        sk, bk = _token_scales(k_scales_ptr + ks_off, k_biases_ptr + ks_off, tok, valid,
                               stride_ksn, NG)
        s3 = (tl.reshape(st, (BLOCK_N, RH, NG)) * sk[:, None, :]
              + (bk - OFF * sk)[:, None, :] * qsum3)
        s = tl.sum(s3, axis=2)  # [BLOCK_N, RH]
        if SOFTCAP:
            s = softcap * tanh_f32(s * qk_scale_log2 / softcap, LIBDEVICE) * 1.4426950408889634
        else:
            s = s * qk_scale_log2
        s = tl.where(valid[:, None], s, float("-inf"))
        # ---- lazy softmax reference: it moves only when a score passes it by > 8 ----
        m_tile = tl.max(s, axis=0)
        if tl.max((m_tile > m_ref + 8.0).to(tl.int32), axis=0) > 0:  # -inf + 8 = -inf
            m_new = tl.maximum(m_ref, m_tile)
            # a head slot still at -inf (none attended yet) keeps its zeros
            alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp2(m_ref - m_new))
            alpha_c = tl.reshape(tl.broadcast_to(alpha[:, None], (RH, NG)), (R,))
            l_acc = l_acc * alpha[None, :]
            corr_acc = corr_acc * alpha_c[:, None]
            new_acc = ()
            for k in tl.static_range(EPW):
                new_acc = new_acc + (acc[k] * alpha_c[:, None],)
            acc = new_acc
            m_ref = m_new
        m_safe = tl.where(m_ref == float("-inf"), 0.0, m_ref)
        p = tl.exp2(s - m_safe[None, :])  # [BLOCK_N, RH], at most 2**8
        l_acc += p
        # ---- values ----
        vw = tl.load(v_base + tok_in[:, None] * stride_vn + w_idx[None, :]).to(tl.int32, bitcast=True)
        sv, bv = _token_scales(v_scales_ptr + vs_off, v_biases_ptr + vs_off, tok, valid,
                               stride_vsn, NG)
        # V as in the codes kernel: [R, BLOCK_N]·[BLOCK_N, W], the words in load order
        pvt = tl.trans(tl.reshape(p[:, :, None] * sv[:, None, :], (BLOCK_N, R)))  # [R, BLOCK_N]
        pv = pvt.to(DT)
        corr_acc += (tl.trans(tl.reshape(p[:, :, None] * bv[:, None, :], (BLOCK_N, R)))
                     - OFF * pv.to(tl.float32))
        if ASM:
            vc = codes4_bf16(vw)
        new_acc = ()
        for k in tl.static_range(EPW):
            if ASM:
                ck = vc[k]
            else:
                ck = code_operand(vw, k, BITS, DT)
            new_acc = new_acc + (tl.dot(pv, ck, acc[k]),)
        acc = new_acc

    # out[h, w·EPW + k] = acc[k][(h, g(w)), w] + corr[(h, g(w))]
    corr = tl.sum(corr_acc, axis=1)
    o = ()
    for k in tl.static_range(EPW):
        picked = tl.where(tl.trans(word_col), acc[k] + corr[:, None], 0.0)
        o = o + (tl.sum(tl.reshape(picked, (RH, NG, W)), axis=1),)  # [RH, W]
    hh = tl.arange(0, RH)
    row = (b * (HKV * G) + h_kv * G + hh).to(tl.int64) * n_splits + split
    tl.store(part_o_ptr + row[:, None] * D + tl.arange(0, D)[None, :], join_codes(o, EPW),
             mask=(hh < G)[:, None])
    tl.store(part_ml_ptr + row * 2, m_ref, mask=hh < G)
    tl.store(part_ml_ptr + row * 2 + 1, tl.sum(l_acc, axis=0), mask=hh < G)


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
    GDC: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.start(GDC)
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    length = tl.load(lengths_ptr + b)
    s_first = _window_start(length, window, WINDOW) // SPLIT_N
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


def codes_rows(G: int, D: int, group: int) -> int:
    """Mma rows of the codes kernel: one per (query head, group), padded to a power of two
    ≥ 16 (tl.dot's minimum)."""
    return _next_pow2_at_least_16(G * (D // group))


def codes_path_reason(G: int, D: int, bits: int, group: int) -> str | None:
    """Why the codes kernel cannot take this shape (None when it can)."""
    if not bits:
        return "a dense cache"
    if D * bits // 32 < 16:
        return f"{D * bits // 32} words per token (tl.dot needs ≥ 16)"
    # its accumulators are EPW tiles [R, W]: R·D floats per program
    if codes_rows(G, D, group) * D > CODES_MAX_ACC:
        return f"{G} query heads × {D // group} groups × head dim {D}: too many accumulators"
    return None


def codes_launch(D: int, bits: int, split: int) -> tuple[int, int | None]:
    """Tokens per tile and register cap of the codes kernel (H200, B=1, 2026-11-30,
    ab-archive:bench/ab/ab14_result.json and ab16_result.json; stages: 3 for 4-bit, 2 for 8-bit).

    At most 32k codes per tile (a thread's extracted codes take ~128 registers), and
    128 tokens where that allows: kv4 Gemma 8k 18.6 µs against 21.3 at 64, Llama 128k
    153 against 177. Long splits at D=256 instead take 64-token tiles capped at 128
    registers, 4 programs per SM instead of 2: Gemma kv4 128k 145 against 166 µs,
    kv8 222 against 258 (a cap of 104 spills: 183 µs; 32-token tiles: 244 µs)."""
    if D == 256 and split >= 1024:
        return 64, 128
    return min(128, 32768 // D), None


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
    # Offsets inside one sequence are 32-bit in the kernels (the batch term is 64-bit).
    for name, t in (("k", k), ("v", v)):
        for part in ((t.packed, t.scales, t.biases) if isinstance(t, QuantizedTensor) else (t,)):
            if max_offset(part, from_dim=1) >= 2**31:
                return f"{name}'s per-sequence offsets exceed 32 bits (strides {part.stride()})"
    if max_offset(q, from_dim=0) >= 2**31:
        return "q's offsets exceed 32 bits"
    return None


def max_offset(t: torch.Tensor, from_dim: int) -> int:
    """The largest element offset over dims >= from_dim (0 for an empty tensor)."""
    return sum((size - 1) * stride for size, stride in
               zip(t.shape[from_dim:], t.stride()[from_dim:]) if size > 0)


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
    _path: str | None = None, _num_warps: int | None = None, _prefetch: bool = False,
    _maxnreg: int | None = None,
) -> torch.Tensor:
    """Launch split + merge. Inputs must already be validated (ops does it).
    The underscored options are launch overrides for the A/B scripts and tests:
    ``_path`` picks a kernel ("codes", "tensor_cores", "cuda_cores"), ``_prefetch``
    makes the tensor-core kernel load scales/biases one tile ahead (measured slower,
    ab-archive:bench/ab/ab8), ``_maxnreg`` caps the codes kernel's registers."""
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
    lengths = lengths.to(torch.int32).contiguous()  # the kernels read lengths[b] densely
    kp, ks, kb, k_bits, k_group = _parts(k)
    vp, vs, vb, v_bits, v_group = _parts(v)
    if (k_bits, k_group) != (v_bits, v_group):
        raise ValueError(
            f"k and v must share one format, got k bits={k_bits} g={k_group}, "
            f"v bits={v_bits} g={v_group}"
        )
    qk_scale = scale if softcap is not None else scale * LOG2E
    codes_ok = codes_path_reason(G, D, k_bits, k_group) is None
    path = _path or ("codes" if codes_ok else "tensor_cores")
    if path == "cuda_cores" and not (k_bits and G <= CUDA_CORE_MAX_G):
        path = "tensor_cores"  # dense caches and larger GQA groups: tensor cores only
    if path == "codes" and not codes_ok:
        path = "tensor_cores"
    gdc = pdl.enabled(q.device)
    args = (
        q, kp, ks, kb, vp, vs, vb, lengths, part_o, part_ml,
        q.stride(0), q.stride(1),
        kp.stride(0), kp.stride(1), kp.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        vp.stride(0), vp.stride(1), vp.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2),
        n_splits, qk_scale, float(softcap or 1.0), int(window or 0),
    )
    common = dict(HKV=Hkv, G=G, D=D, BITS=k_bits, GROUP=k_group, SPLIT_N=split,
                  WINDOW=window is not None, SOFTCAP=softcap is not None,
                  LIBDEVICE=use_libdevice(), num_warps=_num_warps or 4, GDC=gdc,
                  **pdl.launch_options(gdc))
    if path == "codes":
        block_n, maxnreg = codes_launch(D, k_bits, split)
        maxnreg = _maxnreg or maxnreg
        _decode_split_codes_kernel[(n_splits, B * Hkv)](
            *args, R=codes_rows(G, D, k_group), BLOCK_N=_block_n or block_n,
            num_stages=_num_stages or (3 if k_bits == 4 else 2),
            **({"maxnreg": maxnreg} if maxnreg else {}), **common)
    elif path == "cuda_cores":
        words = D * k_bits // 32
        _decode_split_cc_kernel[(n_splits, B * Hkv)](
            # 32 tokens per tile: kv4 128k 431 µs (8: 415, 16: 442), 8k 36 µs (8: 55);
            # kv8 128k 414 µs (8: 447), 8k 35 µs (H200, D=256, G=2, 2026-11-30).
            *args, BLOCK_N=_block_n or max(8, min(32, 2048 // words)),
            num_stages=_num_stages or 3, **common)
    else:
        _decode_split_kernel[(n_splits, B * Hkv)](
            *args, GP=_next_pow2_at_least_16(G), BLOCK_N=_block_n or _default_block_n(D, k_bits),
            PREFETCH=_prefetch,
            num_stages=_num_stages or (2 if k_bits else 3), **common)
    _decode_merge_kernel[(B * Hq,)](
        part_o, part_ml, lengths, out, out.stride(0), out.stride(1),
        int(window or 0), N_SPLITS=n_splits, S_CHUNK=MERGE_CHUNK, HQ=Hq, D=D, SPLIT_N=split,
        WINDOW=window is not None, GDC=gdc, num_warps=4, **pdl.launch_options(gdc),
    )
    return out
