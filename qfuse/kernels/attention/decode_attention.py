"""Flash-decoding over a 4/8-bit (MLX layout) or dense KV cache, GQA inside the kernel.

One query token per sequence. The KV length is cut into splits of a FIXED
size (SPLIT tokens, independent of the batch and of the lengths); one program
handles one split of one (sequence, kv head) for all the query heads that
share that kv head, so a KV tile is loaded and dequantized once per group of
query heads. Each program writes (running max, sum of exponentials, unnormalised
output) in float32, and the splits of each query head are merged in split order
(`merge_head`). No float atomics: a sequence's output is bitwise reproducible and
does not depend on the rest of the batch.

The merge (`AttentionLaunch.merge`): by default the Triton split kernels merge their
own splits, one launch in all (MERGE): every program of a (sequence, kv head), its
split empty or not, counts its arrival on that pair's unit counter
(`kernels/common/units.py`, left zero), and the last to arrive merges the pair's G
query heads from the others' partials. "separate" merges in a second kernel, one
program per query head; the ws kernel always does. Both forms run the same `merge_head`
on the same warps, so they give the same bits. The fused form needs a counter per
(sequence, kv head) (B·Hkv ≤ `units.UNIT_SLOTS`) and its device's counters allocated
by an eager call; where either fails, the default merges separately. Like the fused
steps, it assumes one kernel at a time on the device counts on them.

Split kernels (`AttentionLaunch.path`, by default `choose_path`): quantized caches run
the codes kernel (`_decode_split_codes_kernel`): the codes themselves are the mma
operands and the scales come out of the sums, so not even registers hold a dequantized
value. On Hopper, 4-bit caches of head dim 128 (`WS_BY_DEFAULT`) run the
warp-specialized kernel of `decode_attention_ws.py` instead. The tensor-core kernel
(`_decode_split_kernel`) dequantizes in registers and takes dense caches and what the
codes kernel does not (fewer than 16 words per token, very wide GQA groups). All write
the same partials, merged by `merge_head`. Neither scores nor a dequantized cache ever
reach memory. `unsupported_reason` is the one place that decides whether the kernels
take an input.

Whole contexts (`AttentionLaunch.whole`; many short sequences, where the partials and the
merge cost more than the programs the splits add): the codes or tensor-core kernel with
one program per (sequence, kv head), walking only the tiles that hold the tokens it
attends and writing the normalised output; no partials, no merge, no counters. Bit for
bit the split kernel run with one split of `whole_split` tokens and the same tiles: the
tiles it skips are wholly masked there and add exact zeros, and a merge of one split is
acc / l (with acc + 0, as its sum with the empty slots turns −0 into +0).

Graph capture: the grid depends only on shapes (B, Hkv, Nmax), never on the
lengths, which the kernels read from device memory; programs past a sequence's
end exit at once (having counted their arrival, when they merge). A graph captured
before any eager call on its device merges separately (the counters are allocated
eagerly).

Tensors:
    q        [B, Hq, D]                 bf16/fp16, D ∈ {64, 128, 256, 512}
    k, v     quantized: packed uint32 [B, Hkv, Nmax, D·bits/32] with
             scales/biases [B, Hkv, Nmax, D/g] (q's dtype), bits ∈ {4, 8},
             g ∈ {32, 64, 128}; or dense [B, Hkv, Nmax, D] in q's dtype.
             The last dimension must be contiguous.
    lengths  int32 [B]; sequence b attends to [max(0, L_b − window), L_b).
    out      [B, Hq, D] in q's dtype.

Paged caches (``block_table`` given; not the ws kernel): k and v are pools of pages,
[num_pages, Hkv, PAGE, ...] in the layouts above, and block_table int32 [B, P] names
the page of each PAGE tokens of each sequence (`paging.kv_row` and `kv_offsets_in`, the
one address rule of every path). The splits cover P·PAGE tokens, from shapes alone, so a
sequence's result is the same bits as over a slotted cache of that capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...quant import QuantizedTensor
from ..common import pdl
from ..common.codes import code_offset, code_operand, codes4_bf16, dequant_words, join_codes
from ..common.paging import kv_offsets_in, kv_row
from ..common.precise_math import tanh_f32, use_libdevice
from ..common.units import UNIT_SLOTS, arrive_unit, ready_unit_counters

SUPPORTED_HEAD_DIMS = (64, 128, 256, 512)
SUPPORTED_BITS = (4, 8)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)

# Tokens per split for caches up to 16k tokens (4x that beyond: split_size).
# The partial outputs add (D + 2)·4 bytes per query head per split: ~3% over
# a 4-bit cache's bytes at D=256, G=2 with 256-token splits.
SPLIT = 256
LOG2E = 1.4426950408889634
# The codes kernel's output accumulators: R·D float32 per program, at most 64 per thread
# of 4 warps (D=256, G=2, g=64: R=16, 4096 floats, 32 per thread).
CODES_MAX_ACC = 8192
# Splits merged per step: [16, D] float32 partials, 16 values per thread at D=256.
MERGE_CHUNK = 16
# The merge in the split kernel (its last split to arrive merges): on a GPU bit for bit
# the two-launch form (its GPU tests pass), one launch fewer a layer; the GPU default
# once `bench/attention_merge.json` has timed it no slower (bench/NOTES.md, "Decode
# attention"); until then a GPU merges in a second kernel unless
# `AttentionLaunch(merge="fused")` asks. The interpreter takes it by default.
FUSED_MERGE_ON_CUDA = False


@triton.jit
def _kv_words(packed_ptr, tok_off, tok_mask, D: tl.constexpr, BITS: tl.constexpr):
    """The packed words [BLOCK_N, W] of a quantized K or V tile (0 for masked tokens);
    ``tok_off``: each token's offset (`paging.kv_offsets_in`)."""
    w_idx = tl.arange(0, D * BITS // 32)
    return tl.load(packed_ptr + tok_off[:, None] + w_idx[None, :],
                   mask=tok_mask[:, None], other=0).to(tl.int32, bitcast=True)


@triton.jit
def _kv_scales(scales_ptr, biases_ptr, sb_tok_off, tok_mask, D: tl.constexpr,
               BITS: tl.constexpr, GROUP: tl.constexpr):
    """Scales and biases [BLOCK_N, W] of a quantized K or V tile, one per word (a word's
    codes share one group, 8 | g), as stored (bf16/fp16); zeros for masked tokens."""
    EPW: tl.constexpr = 32 // BITS
    w_idx = tl.arange(0, D // EPW)
    sb_off = sb_tok_off[:, None] + (w_idx * EPW // GROUP)[None, :]
    s = tl.load(scales_ptr + sb_off, mask=tok_mask[:, None], other=0.0)
    b = tl.load(biases_ptr + sb_off, mask=tok_mask[:, None], other=0.0)
    return s, b


@triton.jit
def _load_kv_tile(
    packed_ptr,  # uint32 words (quantized) or values (dense) of one kv head
    scales_ptr,
    biases_ptr,
    tok_off,  # [BLOCK_N] each token's offset in `packed_ptr` (paging.kv_offsets_in)
    sb_tok_off,  # [BLOCK_N] each token's offset in scales/biases
    tok_mask,  # [BLOCK_N] which tokens are attended
    D: tl.constexpr,
    BITS: tl.constexpr,  # 0 for a dense cache
    GROUP: tl.constexpr,
):
    """[BLOCK_N, D] float32 tile of K or V, zeros for masked tokens."""
    if BITS == 0:
        d = tl.arange(0, D)
        x = tl.load(packed_ptr + tok_off[:, None] + d[None, :],
                    mask=tok_mask[:, None], other=0.0).to(tl.float32)
    else:
        words = _kv_words(packed_ptr, tok_off, tok_mask, D, BITS)
        s, b = _kv_scales(scales_ptr, biases_ptr, sb_tok_off, tok_mask, D, BITS, GROUP)
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
                  WINDOW: tl.constexpr, WHOLE: tl.constexpr):
    """This program's (split, sequence, kv head), the tokens [lo, hi) it attends and the
    sequence's length (WHOLE: split 0 holds every attended token)."""
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    length = tl.load(lengths_ptr + b)
    first = _window_start(length, window, WINDOW)
    if WHOLE:
        lo = first
        hi = length
    else:
        lo = tl.maximum(split * SPLIT_N, first)
        hi = tl.minimum(split * SPLIT_N + SPLIT_N, length)
    return split, b, bh % HKV, lo, hi, length


@triton.jit
def _tiles(lo, hi, SPLIT_N: tl.constexpr, BLOCK_N: tl.constexpr, WHOLE: tl.constexpr):
    """The tiles [first, stop) a program walks. A split: every tile of the split, a static
    count (tokens outside [lo, hi) masked), so the loop reads no bounds from memory.
    WHOLE: the tiles that hold [lo, hi) only; the split's other tiles are wholly masked
    and add exact zeros, so skipping them keeps the bits of one split of the capacity."""
    first = 0
    stop = SPLIT_N // BLOCK_N
    if WHOLE:
        first = lo // BLOCK_N
        stop = tl.cdiv(hi, BLOCK_N)
    return first, stop


@triton.jit
def _store_whole(out_ptr, stride_ob, stride_oh, b, head, head_ok, acc, l):
    """WHOLE's epilogue: out rows ``head`` of sequence b = acc / l, rounded as `merge_head`
    rounds one split's partials (acc + 0 is its sum with the empty slots: −0 becomes +0;
    l = 0, nothing attended, gives zeros)."""
    D: tl.constexpr = acc.shape[1]
    out = tl.where(l[:, None] > 0, (acc + 0.0) / tl.where(l > 0, l, 1.0)[:, None], 0.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh
             + tl.arange(0, D)[None, :], out.to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None])


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr, k_scales_ptr, k_biases_ptr,  # K cache (scales/biases unused when dense)
    v_ptr, v_scales_ptr, v_biases_ptr,  # V cache
    lengths_ptr,  # int32 [B]
    table_ptr,  # int32 [B, max pages] block table (PAGED), else unused
    part_o_ptr,  # float32 [B, Hq, n_splits, D] unnormalised partial outputs
    part_ml_ptr,  # float32 [B, Hq, n_splits, 2]: running max (log2 units), sum of exp2
    stride_table,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,  # K packed/dense strides (b or page, head, token)
    stride_ksb, stride_ksh, stride_ksn,  # K scales/biases strides
    stride_vb, stride_vh, stride_vn,
    stride_vsb, stride_vsh, stride_vsn,
    n_splits,
    qk_scale_log2,  # softmax scale · log2(e) (without soft-cap), or softmax scale (with)
    softcap,  # soft-cap value (used when SOFTCAP)
    window,  # attend to the last `window` tokens (used when WINDOW)
    out_ptr, stride_ob, stride_oh,  # out [B, Hq, D] (MERGE)
    cnt_ptr,  # int32 unit counters, one per (sequence, kv head) (MERGE; units.py)
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
    PAGE: tl.constexpr,  # tokens per page of a paged cache
    PAGED: tl.constexpr,  # the cache is a pool of pages read through table_ptr
    GDC: tl.constexpr,  # programmatic dependent launch (kernels/common/pdl.py)
    MERGE: tl.constexpr,  # the last split program of a (sequence, kv head) merges its heads
    N_SPLITS: tl.constexpr,  # split slots, the grid's first dim (MERGE; else 0)
    S_CHUNK: tl.constexpr,  # splits merged per step (MERGE)
    WHOLE: tl.constexpr,  # one program per (sequence, kv head): every token, out normalised
):
    pdl.start(GDC)
    split, b, h_kv, lo, hi, length = _split_tokens(lengths_ptr, window, HKV, SPLIT_N, WINDOW,
                                                   WHOLE)
    if lo >= hi:  # nothing to attend in this split; the merge never reads it
        if MERGE:  # but the merge waits for every split program to arrive
            _merge_when_last(part_o_ptr, part_ml_ptr, cnt_ptr, out_ptr, stride_ob, stride_oh,
                             b, h_kv, length, window, HKV, G, N_SPLITS, S_CHUNK, D, SPLIT_N,
                             WINDOW)
        if WHOLE:  # nothing attended: defined zeros, as the merge gives
            rz = tl.arange(0, GP)
            _store_whole(out_ptr, stride_ob, stride_oh, b, h_kv * G + rz, rz < G,
                         tl.zeros((GP, D), tl.float32), tl.zeros((GP,), tl.float32))
        return

    r = tl.arange(0, GP)
    d = tl.arange(0, D)
    head = h_kv * G + r
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=(r < G)[:, None], other=0.0)
    # Bases of this kv head; each token's offset from them comes from paging.
    k_head = k_ptr + h_kv * stride_kh
    v_head = v_ptr + h_kv * stride_vh
    ks_head = h_kv * stride_ksh
    vs_head = h_kv * stride_vsh

    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    # A split: a static trip count over the whole split (tokens outside [lo, hi) are
    # masked): every program walks the same token grid (`_tiles`).
    t_first, t_stop = _tiles(lo, hi, SPLIT_N, BLOCK_N, WHOLE)
    for t in range(t_first, t_stop):
        tok = split * SPLIT_N + t * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = (tok >= lo) & (tok < hi)
        # the tile's pages, read once from the block table for K, V and their scales
        row = kv_row(table_ptr, stride_table, b, tok, valid, PAGE, PAGED)
        k_off = kv_offsets_in(row, tok, stride_kb, stride_kn, PAGE, PAGED)
        ks_off = kv_offsets_in(row, tok, stride_ksb, stride_ksn, PAGE, PAGED)
        k = _load_kv_tile(k_head, k_scales_ptr + ks_head, k_biases_ptr + ks_head, k_off, ks_off,
                          valid, D, BITS, GROUP)
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
        v_off = kv_offsets_in(row, tok, stride_vb, stride_vn, PAGE, PAGED)
        vs_off = kv_offsets_in(row, tok, stride_vsb, stride_vsn, PAGE, PAGED)
        v = _load_kv_tile(v_head, v_scales_ptr + vs_head, v_biases_ptr + vs_head, v_off, vs_off,
                          valid, D, BITS, GROUP)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    if WHOLE:
        _store_whole(out_ptr, stride_ob, stride_oh, b, head, r < G, acc, l_i)
        return
    row = (b * (HKV * G) + head).to(tl.int64) * n_splits + split
    tl.store(part_o_ptr + row[:, None] * D + d[None, :], acc, mask=(r < G)[:, None])
    tl.store(part_ml_ptr + row * 2, m_i, mask=r < G)
    tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=r < G)
    if MERGE:
        _merge_when_last(part_o_ptr, part_ml_ptr, cnt_ptr, out_ptr, stride_ob, stride_oh,
                         b, h_kv, length, window, HKV, G, N_SPLITS, S_CHUNK, D, SPLIT_N, WINDOW)


@triton.jit
def _token_scales(s_ptr, b_ptr, tok_off, valid, NG: tl.constexpr):
    """Scales/biases [BLOCK_N, NG] in float32 (0 for tokens not attended); ``tok_off``:
    each token's offset (`paging.kv_offsets_in`)."""
    off = tok_off[:, None] + tl.arange(0, NG)[None, :]
    s = tl.load(s_ptr + off, mask=valid[:, None], other=0.0).to(tl.float32)
    b = tl.load(b_ptr + off, mask=valid[:, None], other=0.0).to(tl.float32)
    return s, b


@triton.jit
def _decode_split_codes_kernel(
    q_ptr, k_ptr, k_scales_ptr, k_biases_ptr, v_ptr, v_scales_ptr, v_biases_ptr,
    lengths_ptr, table_ptr, part_o_ptr, part_ml_ptr,
    stride_table,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vb, stride_vh, stride_vn,
    stride_vsb, stride_vsh, stride_vsn,
    n_splits, qk_scale_log2, softcap, window,
    out_ptr, stride_ob, stride_oh, cnt_ptr,  # the merge's (MERGE), as in _decode_split_kernel
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
    GROUP: tl.constexpr, SPLIT_N: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, LIBDEVICE: tl.constexpr,
    R: tl.constexpr,  # mma columns: (head, group) pairs, padded to a power of 2 ≥ 16
    PAGE: tl.constexpr,  # tokens per page of a paged cache
    PAGED: tl.constexpr,  # the cache is a pool of pages read through table_ptr
    GDC: tl.constexpr,  # programmatic dependent launch (kernels/common/pdl.py)
    MERGE: tl.constexpr, N_SPLITS: tl.constexpr, S_CHUNK: tl.constexpr,  # as in _decode_split_kernel
    WHOLE: tl.constexpr,  # as in _decode_split_kernel
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
    so accumulators are rescaled on few tiles. (Why tokens and not heads on the score
    rows, in SASS counts and µs: bench/NOTES.md, "Decode attention", History.)
    """
    pdl.start(GDC)
    EPW: tl.constexpr = 32 // BITS
    W: tl.constexpr = D // EPW
    NG: tl.constexpr = D // GROUP
    RH: tl.constexpr = R // NG
    DT: tl.constexpr = q_ptr.dtype.element_ty
    OFF: tl.constexpr = code_offset(BITS, DT)
    ASM: tl.constexpr = LIBDEVICE and BITS == 4 and DT == tl.bfloat16
    split, b, h_kv, lo, hi, length = _split_tokens(lengths_ptr, window, HKV, SPLIT_N, WINDOW,
                                                   WHOLE)
    if lo >= hi:  # nothing to attend in this split, but MERGE counts every arrival
        if MERGE:
            _merge_when_last(part_o_ptr, part_ml_ptr, cnt_ptr, out_ptr, stride_ob, stride_oh,
                             b, h_kv, length, window, HKV, G, N_SPLITS, S_CHUNK, D, SPLIT_N,
                             WINDOW)
        if WHOLE:  # nothing attended: defined zeros, as the merge gives
            hz = tl.arange(0, RH)
            _store_whole(out_ptr, stride_ob, stride_oh, b, h_kv * G + hz, hz < G,
                         tl.zeros((RH, D), tl.float32), tl.zeros((RH,), tl.float32))
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
    # Bases of this kv head; each token's offset from them comes from paging.
    k_head = k_ptr + h_kv * stride_kh
    v_head = v_ptr + h_kv * stride_vh
    ks_head = h_kv * stride_ksh
    vs_head = h_kv * stride_vsh

    m_ref = tl.full((RH,), float("-inf"), tl.float32)
    l_acc = tl.zeros((BLOCK_N, RH), tl.float32)
    corr_acc = tl.zeros((R, BLOCK_N), tl.float32)
    acc = ()
    for k in tl.static_range(EPW):
        acc = acc + (tl.zeros((R, W), tl.float32),)
    t_first, t_stop = _tiles(lo, hi, SPLIT_N, BLOCK_N, WHOLE)
    for t in range(t_first, t_stop):
        tok = split * SPLIT_N + t * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = (tok >= lo) & (tok < hi)
        # Words are read unmasked from in-bounds tokens (clamped to the last attended
        # one): any bits are finite codes, and an unattended token's codes meet a zero
        # scale (masked load) and a zero probability.
        # (Paged: a token not attended maps to page 0, which is in bounds too.)
        tok_in = tl.minimum(tok, hi - 1)
        # the tile's pages, read once (page 0 where not attended: tok_in and tok agree
        # on every attended token, and the rest only needs an in-bounds page)
        row = kv_row(table_ptr, stride_table, b, tok, valid, PAGE, PAGED)
        kw_off = kv_offsets_in(row, tok_in, stride_kb, stride_kn, PAGE, PAGED)
        kw = tl.load(k_head + kw_off[:, None] + w_idx[None, :]).to(tl.int32, bitcast=True)
        if ASM:
            kc = codes4_bf16(kw)
        st = tl.zeros((BLOCK_N, R), tl.float32)
        for k in tl.static_range(EPW):
            if ASM:
                ck = kc[k]
            else:
                ck = code_operand(kw, k, BITS, DT)
            st = tl.dot(ck, qk[k], st)
        ks_off = kv_offsets_in(row, tok, stride_ksb, stride_ksn, PAGE, PAGED)
        sk, bk = _token_scales(k_scales_ptr + ks_head, k_biases_ptr + ks_head, ks_off, valid, NG)
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
        vw_off = kv_offsets_in(row, tok_in, stride_vb, stride_vn, PAGE, PAGED)
        vw = tl.load(v_head + vw_off[:, None] + w_idx[None, :]).to(tl.int32, bitcast=True)
        vs_off = kv_offsets_in(row, tok, stride_vsb, stride_vsn, PAGE, PAGED)
        sv, bv = _token_scales(v_scales_ptr + vs_head, v_biases_ptr + vs_head, vs_off, valid, NG)
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
    if WHOLE:
        _store_whole(out_ptr, stride_ob, stride_oh, b, h_kv * G + hh, hh < G,
                     join_codes(o, EPW), tl.sum(l_acc, axis=0))
        return
    row = (b * (HKV * G) + h_kv * G + hh).to(tl.int64) * n_splits + split
    tl.store(part_o_ptr + row[:, None] * D + tl.arange(0, D)[None, :], join_codes(o, EPW),
             mask=(hh < G)[:, None])
    tl.store(part_ml_ptr + row * 2, m_ref, mask=hh < G)
    tl.store(part_ml_ptr + row * 2 + 1, tl.sum(l_acc, axis=0), mask=hh < G)
    if MERGE:
        _merge_when_last(part_o_ptr, part_ml_ptr, cnt_ptr, out_ptr, stride_ob, stride_oh,
                         b, h_kv, length, window, HKV, G, N_SPLITS, S_CHUNK, D, SPLIT_N, WINDOW)


@triton.jit
def merge_head(
    part_o_ptr,  # float32 [B, Hq, n_splits, D] (`partials`)
    part_ml_ptr,  # float32 [B, Hq, n_splits, 2]
    bh,  # the query head's row of the partials: sequence · Hq + head
    length,  # the sequence's length
    window,  # used when WINDOW
    out_ptr,  # the head's output row [D] (q's dtype)
    N_SPLITS: tl.constexpr,  # split slots per head (from Nmax; a multiple of S_CHUNK)
    S_CHUNK: tl.constexpr,  # splits merged per step
    D: tl.constexpr,
    SPLIT_N: tl.constexpr,
    WINDOW: tl.constexpr,
    CACHE: tl.constexpr,  # the partials' load cache modifier: ".cg" where this launch wrote them
):
    """One query head's output: its splits that hold tokens merged in split order (a
    sequence of length 0 gives zeros). The one arithmetic of both merge forms: the merge
    kernel and the split kernels' MERGE epilogue give the same bits.

    The order of the sums over a chunk's splits follows the register layout Triton gives
    the [S_CHUNK, 1, D] tile, and Triton sizes a load's layout by every memory access of
    the same shape in the kernel. The tile is 3-D so that no access of the split kernels
    shares its shape: inside them it gets the layout it gets in the merge kernel (that
    of the [S_CHUNK, D] tile it replaces), so the same sums in the same order.
    """
    s_first = _window_start(length, window, WINDOW) // SPLIT_N
    s_last = tl.cdiv(length, SPLIT_N)
    d = tl.arange(0, D)[None, :]
    m = tl.full((), float("-inf"), tl.float32)
    l_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((1, D), tl.float32)
    # Only the splits in [s_first, s_last) were written. Walk all split slots
    # in fixed chunks and order (masked), so the loop bounds are constants.
    for c in range(0, N_SPLITS, S_CHUNK):
        sp = c + tl.arange(0, S_CHUNK)
        ok = (sp >= s_first) & (sp < s_last)
        row = bh.to(tl.int64) * N_SPLITS + sp
        m_s = tl.load(part_ml_ptr + row * 2, mask=ok, other=float("-inf"), cache_modifier=CACHE)
        l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=ok, other=0.0, cache_modifier=CACHE)
        o_s = tl.load(part_o_ptr + row[:, None, None] * D + d[None, :, :], mask=ok[:, None, None],
                      other=0.0, cache_modifier=CACHE)  # [S_CHUNK, 1, D]
        m_new = tl.maximum(m, tl.max(m_s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a_old = tl.exp2(m - m_safe)
        w = tl.exp2(m_s - m_safe)
        l_sum = l_sum * a_old + tl.sum(l_s * w, axis=0)
        acc = acc * a_old + tl.sum(o_s * w[:, None, None], axis=0)
        m = m_new
    # A sequence with nothing to attend (length 0) has l_sum = 0: define its output as 0.
    out = tl.where(l_sum > 0, acc / tl.where(l_sum > 0, l_sum, 1.0), 0.0)
    tl.store(out_ptr + d, out.to(out_ptr.dtype.element_ty))


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
    GDC: tl.constexpr,  # programmatic dependent launch (kernels/common/pdl.py)
):
    """The separate merge: one program per (sequence, query head)."""
    pdl.start(GDC)
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    length = tl.load(lengths_ptr + b)
    # the previous launch wrote the partials: plain loads
    merge_head(part_o_ptr, part_ml_ptr, bh, length, window,
               out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh,
               N_SPLITS, S_CHUNK, D, SPLIT_N, WINDOW, "")


@triton.jit
def _merge_when_last(part_o_ptr, part_ml_ptr, cnt_ptr, out_ptr, stride_ob, stride_oh,
                     b, h_kv, length, window, HKV: tl.constexpr, G: tl.constexpr,
                     N_SPLITS: tl.constexpr, S_CHUNK: tl.constexpr, D: tl.constexpr,
                     SPLIT_N: tl.constexpr, WINDOW: tl.constexpr):
    """The split kernels' MERGE epilogue, in every split program once its partials are
    stored (or at once, with none to store): the (sequence, kv head)'s N_SPLITS programs
    count their arrivals on its unit counter, and the last merges the G query heads that
    share the kv head, reading the others' partials from L2 (`.cg`)."""
    if arrive_unit(cnt_ptr, b * HKV + h_kv, N_SPLITS):
        for j in range(G):
            h = h_kv * G + j
            merge_head(part_o_ptr, part_ml_ptr, b * (HKV * G) + h, length, window,
                       out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh,
                       N_SPLITS, S_CHUNK, D, SPLIT_N, WINDOW, ".cg")


def _next_pow2_at_least_16(g: int) -> int:
    return max(16, triton.next_power_of_2(g))


def _default_block_n(D: int, bits: int) -> int:
    """Tokens per tile of the tensor-core kernel (bench/NOTES.md, "Decode attention")."""
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
    """Tokens per tile and register cap (None: the compiler's) of the codes kernel: 128
    tokens, fewer where a tile would exceed 32k codes (beyond that a thread's extracted
    codes crowd its registers); splits of 1024 tokens or more at D=256 take 64-token
    tiles under a 128-register cap, so that more programs share an SM (bench/NOTES.md,
    "Decode attention")."""
    if D == 256 and split >= 1024:
        return 64, 128
    return min(128, 32768 // D), None


def whole_split(n_max: int) -> int:
    """The one split a whole-context launch stands for: ``n_max`` tokens rounded up to a
    multiple of 128 (every default tile size divides it). Its launch defaults (tiles,
    register cap) are those of the split kernel run with this split, so both give the
    same bits."""
    return triton.cdiv(max(n_max, 1), 128) * 128


def split_size(n_max: int) -> int:
    """Tokens per split, fixed for a given cache capacity (never from lengths or batch,
    so a sequence's result does not depend on its batch): short caches need many small
    splits to fill the SMs, long ones amortise each program's fixed work over longer
    splits."""
    return SPLIT if n_max <= 16384 else 4 * SPLIT


PATHS = ("codes", "tensor_cores", "ws")
MERGES = ("fused", "separate")


@dataclass(frozen=True)
class AttentionLaunch:
    """Launch knobs of `decode_attention_quantized_kv`; None keeps the shape's default.

    path: "codes" (tensor cores over the raw codes; the default for the quantized caches
    it takes but those of `WS_BY_DEFAULT`), "tensor_cores" (dequantize in registers, then
    mma; dense caches and what the codes kernel does not take) or "ws" (Hopper's
    warp-specialized kernel, `decode_attention_ws.py`; the default for `WS_BY_DEFAULT`).
    A path that cannot take the inputs is an error, not a silent fallback, so a sweep
    times what it names. The rest are launch options of the split kernel: ``block_n``
    tokens per tile (for "ws", per ring stage, shared by its four consumer warps),
    ``num_stages`` pipeline stages (ring stages), ``split`` tokens per split (a multiple
    of block_n), ``num_warps`` and ``maxnreg`` (the register cap; not for "ws", which
    sets its own).

    merge: "fused" (the split kernel's last program of each (sequence, kv head) merges
    its query heads: one launch; the default of the Triton paths where it can run,
    `fused_merge_reason`) or "separate" (a second kernel merges: the ws path's only form,
    kept for the benches and tests). Both give the same bits.

    whole: no splits and no merge: one program per (sequence, kv head) walks the tiles of
    every token the sequence attends and writes the normalised output (the codes or
    tensor-core kernel, never ws; `whole_split`). For many sequences of short contexts,
    where the splits' partials and merge cost more than the programs they add
    (`choose.choose_decode_attention` decides). Bit for bit the split kernel run with one
    split of `whole_split` tokens and the same tiles.
    """

    path: str | None = None
    block_n: int | None = None
    num_stages: int | None = None
    split: int | None = None
    num_warps: int | None = None
    maxnreg: int | None = None
    merge: str | None = None
    whole: bool | None = None

    def __post_init__(self):
        if self.whole is not None and not isinstance(self.whole, bool):
            raise ValueError(f"whole must be true or false, got {self.whole!r}")
        if self.whole and (self.path == "ws" or self.merge or self.split):
            raise ValueError("a whole-context launch has no splits and no merge "
                             "(path ws, merge and split do not apply)")
        if self.path is not None and self.path not in PATHS:
            raise ValueError(f"path must be one of {', '.join(PATHS)}, got {self.path!r}")
        if self.merge is not None and self.merge not in MERGES:
            raise ValueError(f"merge must be one of {', '.join(MERGES)}, got {self.merge!r}")
        if self.path == "ws" and self.merge == "fused":
            raise ValueError("the ws path keeps its separate merge")
        if self.path == "ws" and (self.num_warps or self.maxnreg):
            raise ValueError("the ws path sets its own warps and registers")
        for name in ("block_n", "num_stages", "split", "num_warps", "maxnreg"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _parts(t):
    if isinstance(t, QuantizedTensor):
        return t.packed, t.scales, t.biases, t.bits, t.group_size
    return t, t, t, 0, 32  # scales/biases pointers unused on the dense path


def unsupported_reason(q: torch.Tensor, k, v, block_table: torch.Tensor | None = None
                       ) -> str | None:
    """Why no split kernel can take these (validated) inputs; None when one can. The one
    place that decides it: `ops.decode_attention` falls back to the reference on a
    reason, `decode_attention_quantized_kv` refuses with it. ``block_table``: k and v
    are pools of pages read through it (module docstring)."""
    if block_table is not None and (block_table.dtype != torch.int32
                                    or block_table.stride(-1) != 1):
        return f"the block table must be int32 with a contiguous last dim, got {block_table.dtype}"
    if type(k) is not type(v):
        return "k and v differ in kind (one dense, one quantized)"
    if isinstance(k, QuantizedTensor) and (k.bits, k.group_size) != (v.bits, v.group_size):
        return "k and v differ in bits or group size"
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


def path_reason(path: str, q: torch.Tensor, k, v, block_table: torch.Tensor | None = None
                ) -> str | None:
    """Why split kernel ``path`` cannot take inputs that `unsupported_reason` accepts."""
    G, D = q.shape[1] // k.shape[1], q.shape[-1]
    bits, group = _parts(k)[3:]
    if path == "codes":
        return codes_path_reason(G, D, bits, group)
    if path == "ws":
        if block_table is not None:
            return "a paged cache (the ws kernel reads the slotted layout only)"
        from .decode_attention_ws import ws_unsupported_reason

        return ws_unsupported_reason(q, k, v)
    return None  # the tensor-core kernel takes every supported input


# (bits, head dim) of the caches the ws kernel takes by default: 1.1-1.4x the codes kernel
# from 8k tokens at batch 8 and from 32k at batch 1, at par (0.97x) at 8k batch 1
# (bench/NOTES.md, "Decode attention, warp-specialized"). Only with the Triton it was
# measured with: Gluon's API moves between releases.
WS_BY_DEFAULT = {(4, 128)}
WS_TRITON = "3.6."


def choose_path(q: torch.Tensor, k, v, block_table: torch.Tensor | None = None,
                whole: bool = False) -> str:
    """The default split kernel: the warp-specialized kernel for the caches of
    `WS_BY_DEFAULT` where it takes them (Hopper, slotted caches; not ``whole``), else the
    codes kernel where it applies, else tensor cores."""
    bits = _parts(k)[3]
    if not whole and (bits, q.shape[-1]) in WS_BY_DEFAULT \
            and triton.__version__.startswith(WS_TRITON) \
            and path_reason("ws", q, k, v, block_table) is None:
        return "ws"
    return "codes" if path_reason("codes", q, k, v) is None else "tensor_cores"


def max_offset(t: torch.Tensor, from_dim: int) -> int:
    """The largest element offset over dims >= from_dim (0 for an empty tensor)."""
    return sum((size - 1) * stride for size, stride in
               zip(t.shape[from_dim:], t.stride()[from_dim:]) if size > 0)


def split_kernel(path: str):
    """The Triton split kernel behind a path ("codes", "tensor_cores"), for offline
    compiles such as bench/sass_report.py."""
    kernels = {"codes": _decode_split_codes_kernel, "tensor_cores": _decode_split_kernel}
    if path not in kernels:
        raise ValueError(f"no Triton split kernel for path {path!r} (have: {', '.join(kernels)})")
    return kernels[path]


def merge_kernel():
    """The separate merge's kernel, for offline compiles (its layouts against the split
    kernels' MERGE epilogue: tests/test_decode_attention_merge.py)."""
    return _decode_merge_kernel


def partials(B: int, Hq: int, D: int, n_max: int, split: int, device):
    """Empty split partials: ``part_o`` float32 [B, Hq, n_splits, D] (unnormalised outputs)
    and ``part_ml`` float32 [B, Hq, n_splits, 2] (running max in log2 units, sum of
    exp2). Split slots are rounded up to whole merge chunks; extra slots are never
    written or read."""
    n_splits = triton.cdiv(max(1, triton.cdiv(n_max, split)), MERGE_CHUNK) * MERGE_CHUNK
    part_o = torch.empty(B, Hq, n_splits, D, dtype=torch.float32, device=device)
    part_ml = torch.empty(B, Hq, n_splits, 2, dtype=torch.float32, device=device)
    return part_o, part_ml


def tokens_per_sequence(k, block_table: torch.Tensor | None) -> int:
    """The most tokens a sequence can hold, from shapes alone (so the splits, which it
    sets, never depend on the lengths or the batch): Nmax of a slotted cache, pages per
    table row × tokens per page of a paged one."""
    return k.shape[2] if block_table is None else block_table.shape[1] * k.shape[2]


def merge_splits(part_o: torch.Tensor, part_ml: torch.Tensor, lengths: torch.Tensor,
                 out: torch.Tensor, window: int | None, split: int, gdc: bool,
                 num_warps: int = 4) -> torch.Tensor:
    """out [B, Hq, D] = the splits of `partials` that hold tokens, merged in split order
    (a sequence of length 0 gives zeros) by a kernel of their own. lengths: int32 [B],
    contiguous. ``num_warps``: the Triton split kernel's, where it could have merged
    (the order of the merge's sums follows the warps' layout)."""
    B, Hq, n_splits, D = part_o.shape
    _decode_merge_kernel[(B * Hq,)](
        part_o, part_ml, lengths, out, out.stride(0), out.stride(1),
        int(window or 0), N_SPLITS=n_splits, S_CHUNK=MERGE_CHUNK, HQ=Hq, D=D, SPLIT_N=split,
        WINDOW=window is not None, GDC=gdc, num_warps=num_warps, **pdl.launch_options(gdc),
    )
    return out


def merge_counters(units: int, device: torch.device) -> torch.Tensor | None:
    """The unit counters a Triton split kernel merging its own splits counts on, over
    ``units`` (sequence, kv head) pairs on ``device``; None where it cannot: more pairs
    than `units.UNIT_SLOTS`, or the device's first call under CUDA graph capture (the
    counters are allocated eagerly). Not a support check but the split kernels' resource,
    as `splitk.semaphores` is the products': the decode path asks it every call."""
    return ready_unit_counters(device) if units <= UNIT_SLOTS else None


def decode_attention_quantized_kv(
    q: torch.Tensor,
    k: torch.Tensor | QuantizedTensor,
    v: torch.Tensor | QuantizedTensor,
    lengths: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    launch: AttentionLaunch | None = None,
    supported: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Split + merge over inputs `ops.check_decode_attention_inputs` accepts (the module
    docstring gives the tensors): one launch where the split kernel merges (the Triton
    paths' default, ``launch.merge``; `merge_counters`), else two. ValueError with the
    reason when no kernel, or not the ``launch.path`` or ``launch.merge`` asked for, can
    take them. ``supported``: the caller has had None from
    `unsupported_reason` for these inputs, and ``launch.path`` where it names one comes
    from `choose_path` (`choose.choose_decode_attention`): neither is asked again on the
    decode path. ``block_table``: k and v are pools of pages read through it
    (None: the slotted layout)."""
    reason = None if supported else unsupported_reason(q, k, v, block_table)
    launch = launch or AttentionLaunch()
    whole = bool(launch.whole)
    if launch.path is None:  # the default path takes whatever unsupported_reason accepts
        path = "tensor_cores" if reason else choose_path(q, k, v, block_table, whole)
    else:
        path = launch.path  # `choose_path`'s answer, when the caller vouches (supported)
        reason = reason or (None if supported else path_reason(path, q, k, v, block_table))
    if reason:
        raise ValueError(f"decode attention ({path} kernel): {reason}")
    B, Hq, D = q.shape
    Hkv, n_max = k.shape[1], tokens_per_sequence(k, block_table)
    if path == "ws" and launch.merge == "fused":
        raise ValueError("decode attention (ws kernel): it keeps its separate merge")
    if out is None:
        out = torch.empty_like(q)
    lengths = lengths.to(torch.int32).contiguous()  # the kernels read lengths[b] densely
    kp, ks, kb, bits, group = _parts(k)
    vp, vs, vb = _parts(v)[:3]
    qk_scale = scale if softcap is not None else scale * LOG2E
    gdc = pdl.enabled(q.device)
    G = Hq // Hkv
    if whole:  # no partials, merge or counters (`_attend_whole`)
        return _attend_whole(q, k, (kp, ks, kb, vp, vs, vb), bits, group, lengths, qk_scale,
                             window, softcap, out, launch, path, block_table, n_max, gdc)
    counters = None
    wants_fused = launch.merge == "fused" or (
        launch.merge is None and (q.device.type != "cuda" or FUSED_MERGE_ON_CUDA))
    if path != "ws" and wants_fused:
        counters = merge_counters(B * Hkv, q.device)
        if counters is None and launch.merge == "fused":
            raise ValueError(f"decode attention (fused merge): {B * Hkv} (sequence, kv head) "
                             f"pairs and at most {UNIT_SLOTS} counters, allocated by an "
                             f"eager call (not under CUDA graph capture)")
    fused = counters is not None
    split = launch.split or split_size(n_max)
    part_o, part_ml = partials(B, Hq, D, n_max, split, q.device)
    n_splits = part_o.shape[2]
    if path == "ws":
        from . import decode_attention_ws as ws

        if launch.block_n and launch.block_n % ws.CONSUMERS:
            raise ValueError(f"block_n {launch.block_n}: the ws path's stages are shared by "
                             f"{ws.CONSUMERS} warps")
        ws.launch_split_ws(q, k, v, lengths, part_o, part_ml, n_splits, split, qk_scale,
                           softcap, int(window or 0), gdc, stages=launch.num_stages,
                           tokens_per_warp=launch.block_n // ws.CONSUMERS if launch.block_n
                           else None,
                           supported=True)  # choose_path or path_reason asked
        return merge_splits(part_o, part_ml, lengths, out, window, split, gdc)
    # the merge's unit counters: lengths stands in when not fused
    args = _split_kernel_args(q, (kp, ks, kb, vp, vs, vb), lengths, block_table, part_o,
                              part_ml, n_splits, qk_scale, softcap, window, out,
                              counters if fused else lengths)
    num_warps = launch.num_warps or 4
    # N_SPLITS only where it merges: the unmerged kernel is not compiled once per cache
    # capacity
    common = _split_kernel_constants(k, G, D, bits, group, split, window, softcap, num_warps,
                                     gdc, block_table, fused, n_splits if fused else 0,
                                     False)
    block_n, maxnreg = _tile_launch(path, D, bits, split, launch)
    if split % block_n:  # the kernels walk split // block_n whole tiles
        raise ValueError(f"split {split} is not a multiple of block_n {block_n}")
    _launch_split_kernel(path, (n_splits, B * Hkv), args, G, D, bits, group, block_n,
                         maxnreg, launch, common)
    if fused:
        return out
    # on the split kernel's warps, as the fused merge runs: the same bits either way
    return merge_splits(part_o, part_ml, lengths, out, window, split, gdc, num_warps)


def _tile_launch(path: str, D: int, bits: int, split: int, launch: AttentionLaunch
                 ) -> tuple[int, int | None]:
    """Tokens per tile and register cap of a Triton split kernel over splits of ``split``
    tokens: ``launch``'s where it sets them, else the path's defaults."""
    if path == "codes":
        block_n, maxnreg = codes_launch(D, bits, split)
        return launch.block_n or block_n, launch.maxnreg or maxnreg
    return launch.block_n or _default_block_n(D, bits), launch.maxnreg


def _launch_split_kernel(path: str, grid, args, G: int, D: int, bits: int, group: int,
                         block_n: int, maxnreg: int | None, launch: AttentionLaunch,
                         common: dict) -> None:
    """Launch the codes or tensor-core kernel over ``grid`` with ``args`` and the
    constexprs of ``common``."""
    if path == "codes":
        _decode_split_codes_kernel[grid](
            *args, R=codes_rows(G, D, group), BLOCK_N=block_n,
            num_stages=launch.num_stages or (3 if bits == 4 else 2),
            **({"maxnreg": maxnreg} if maxnreg else {}), **common)
    else:
        _decode_split_kernel[grid](
            *args, GP=_next_pow2_at_least_16(G), BLOCK_N=block_n,
            num_stages=launch.num_stages or (2 if bits else 3),
            **({"maxnreg": maxnreg} if maxnreg else {}), **common)


def _split_kernel_args(q, parts, lengths, block_table, part_o, part_ml, n_splits, qk_scale,
                       softcap, window, out, counters) -> tuple:
    """The split kernels' runtime arguments, in their order: q, the caches' parts (k's then
    v's values, scales, biases), the lengths and block table (slotted: lengths stands in
    for the table the kernels then never read), the partials, the strides, the softmax's
    scalars, the merge's output and unit counters."""
    kp, ks, kb, vp, vs, vb = parts
    table = lengths if block_table is None else block_table
    return (
        q, kp, ks, kb, vp, vs, vb, lengths, table, part_o, part_ml,
        0 if block_table is None else block_table.stride(0),
        q.stride(0), q.stride(1),
        kp.stride(0), kp.stride(1), kp.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        vp.stride(0), vp.stride(1), vp.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2),
        n_splits, qk_scale, float(softcap or 1.0), int(window or 0),
        out, out.stride(0), out.stride(1), counters,
    )


def _split_kernel_constants(k, G, D, bits, group, split_n, window, softcap, num_warps, gdc,
                            block_table, merge: bool, n_splits: int, whole: bool) -> dict:
    """The split kernels' constexprs and launch options (k: the key cache, for its page)."""
    return dict(HKV=k.shape[1], G=G, D=D, BITS=bits, GROUP=group, SPLIT_N=split_n,
                WINDOW=window is not None, SOFTCAP=softcap is not None,
                LIBDEVICE=use_libdevice(), num_warps=num_warps, GDC=gdc,
                PAGE=k.shape[2] if block_table is not None else 1,
                PAGED=block_table is not None, MERGE=merge, N_SPLITS=n_splits,
                S_CHUNK=MERGE_CHUNK, WHOLE=whole, **pdl.launch_options(gdc))


def _attend_whole(q, k, parts, bits, group, lengths, qk_scale, window, softcap, out, launch,
                  path, block_table, n_max, gdc):
    """`decode_attention_quantized_kv` with ``launch.whole`` (its inputs as it prepared
    them; ``path`` codes or tensor_cores, as `AttentionLaunch` and `choose_path` leave it):
    one program per (sequence, kv head) over its every attended token, out written
    normalised; no partials, no merge, no counters. Its tiles and register cap are the
    split kernel's defaults for one split of `whole_split` tokens; SPLIT_N is one tile
    (unused: the program's split is 0), so the kernel is compiled once whatever the
    capacity."""
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    block_n, maxnreg = _tile_launch(path, D, bits, whole_split(n_max), launch)
    # the partials' pointers (out) are never written, the counters (lengths) never read
    args = _split_kernel_args(q, parts, lengths, block_table, out, out, 1, qk_scale, softcap,
                              window, out, lengths)
    common = _split_kernel_constants(k, G, D, bits, group, block_n, window, softcap,
                                     launch.num_warps or 4, gdc, block_table, False, 0, True)
    _launch_split_kernel(path, (1, B * k.shape[1]), args, G, D, bits, group, block_n,
                         maxnreg, launch, common)
    return out
