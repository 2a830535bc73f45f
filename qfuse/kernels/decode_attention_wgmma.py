"""Decode attention over a 4-bit KV cache on Hopper's warpgroup tensor cores, tokens as M
(issue 31). Gluon, sm_90 only. NOT wired into dispatch: nothing calls it but its tests.

State: built offline in stop 37; its GPU tests pass and it was timed in stop 38 (head
dim 128: 1.10–1.50× the dispatched kernel, 34% of copy; head dim 256: 0.68–0.79×;
bench/NOTES.md, "tokens-as-M wgmma consumer"). Stop 39 added stage prefixes for timing
(``UPTO``, `AttentionLaunch.upto`: the TMA ring alone, + the score products, + the
softmax; each padded in shared memory to the complete kernel's programs per SM, so that
differences measure the stages, not occupancy) and ``LATE_V`` (V's codes expanded after
the score products, not under them: fewer live registers, so with a register cap one more
program an SM), both compiled offline, not yet run.

Contract (`decode_attention_wgmma`, a standalone launcher): q [B, Hq, D] bf16; k, v
``QuantizedTensor`` 4-bit, groups of 64, slotted (packed [B, Hkv, Nmax, D/8], scales and
biases [B, Hkv, Nmax, D/64] bf16, tokens × groups contiguous); D ∈ {128, 256};
G = Hq/Hkv ∈ {2, 3, 4}; lengths int32 [B]; an optional sliding window and soft-cap
(stop 39, compiled offline, its GPU test not yet run). It writes the
split partials of `decode_attention.partials` and merges them with
`decode_attention.merge_splits`, so the split (`decode_attention.split_size`, from Nmax
alone: flash-decoding over tokens) and the merge are the existing ones.
`unsupported_reason` refuses everything else in one line: fp16, 8-bit, other groups or
head dims, paged caches (block tables), no CUDA, not sm_90.

Design. One program = one split (a token range) of one (sequence, kv head), one
warpgroup (4 warps). The split's 64-token tiles arrive by TMA in a ring of STAGES
shared-memory stages (K words, V words, their scales and biases), refilled after a
block barrier, so STAGES - 1 tiles are in flight while one is consumed. Both products
run on wgmma with the codes expanded in registers as the A operand (no dequantized tile
in shared memory). The sums are over raw codes, scales and biases factored out per
64-element group (the same identity as the codes kernel; codes enter as 128 + c, exact
in bf16):
  scores  Sᵀ_g[tok, h] = Σ_{d∈g} (128 + K_c[tok, d]) · q[h, d]     (M = 64 tokens, N = 8)
          S[tok, h] = Σ_g s_k[tok, g]·Sᵀ_g + (b_k − 128·s_k)[tok, g]·Σ_{d∈g} q[h, d]
  values  Oᵀ_g[d, h] += Σ_tok (128 + V_c[tok, d]) · P'_g[tok, h],   P'_g = bf16(p·s_v[:, g])
          (M = the 64 dims of group g, K = 64 tokens, N = 8), plus the per-column
          correction Σ_tok p·b_v − 128·P'_g kept beside it.
The GQA group's query heads are N, padded with zero columns to wgmma's n8.
A operands without any data movement: a thread's wgmma A registers cover rows
{16w + g, 16w + g + 8} and, per k16 step, the column pairs {2q, 2q + 1} and
{2q + 8, 2q + 9} (warp w, lane 4g + q). A sum does not care in which order its terms
are added, so the kernel chooses which element each register slot holds:
  K: the thread loads words 2q, 2q + 1 of its two tokens' group; one LOP3 (and a shift)
     per register makes the bf16 pair (nibble j, nibble j + 4) of a word; q is stored in
     shared memory permuted to match (slot 32·j1 + 16·j0 + 8·u + 2q + e holds
     d = 8·(2q + u) + j + 4e).
  V: the K dimension is tokens and must match P' as stored, but M (the head dims) may be
     permuted: row 16w + 8r + g holds d = 8g + 2w + r, so a thread needs byte w of word g
     of its 16 tokens, and one PRMT puts that byte of two neighbouring tokens in one
     register; LOP3 / SHR + LOP3 make the pairs (token t, t + 1) of nibbles 2w and 2w + 1.
     The output store undoes the permutation.
Softmax over tokens is a column reduction of the [64, 8] score tile (across the four
warps: the compiler's shared-memory reduction). P'ᵀ goes to shared memory as the value
product's B operand (K-major, like q).

Overlap in flight per warpgroup: V's codes and the four scale tiles are expanded while
the tile's score products run, and TMA keeps STAGES - 1 tiles in flight. The value
products are drained at the end of their tile: left in flight into the next tile (to
overlap the next K expansion, as first written) they crossed the loop's back edge and
ptxas serialized every wgmma of the loop (C7513). What is not done: any product in
flight during the softmax or across tiles (the issue's two-tiles-in-flight schedule:
it needs either a second warpgroup / warp specialization or a loop without the back
edge problem), paged caches, 8-bit and fp16, PDL, tuning of STAGES; the word
loads from unswizzled shared memory are bank-conflicted (8 rows at a 64/128-byte
stride), and the scale columns go through a layout conversion. See bench/NOTES.md for
what to measure first.
"""

from __future__ import annotations

import torch

from ..levers import interpreter_active
from ..quant import QuantizedTensor
from .decode_attention import (
    LOG2E,
    WGMMA_STAGES,
    merge_splits,
    partials,
    split_size,
    tokens_per_sequence,
)
from .gluon_hopper import (  # optional: gluon is None without it (GLUON_ERROR)
    GLUON_ERROR,
    TensorDescriptor,
    fence_async_shared,
    gl,
    gluon,
    libdevice,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from .qmatmul_wgmma import REGISTER_FILE

TILE = 64  # tokens per tile: the M of one warpgroup's wgmma
GROUP = 64  # elements per scale group: one group of V is one 64-row M tile of Oᵀ
HEAD_DIMS = (128, 256)
GQA = (2, 3, 4)  # query heads per kv head, padded to the n8 of wgmma
N_PAD = 8
DEFAULT_STAGES = {128: 4, 256: 3}  # ring depth: ~12 KB and ~17 KB stages
SMEM_BYTES = 227 * 1024


def code_slot_dim(col: int) -> int:
    """Head-dim offset (inside a 64-element group) that the score product's A slot
    ``col`` holds: slot 32·j1 + 16·j0 + 8·u + 2q + e ← d = 8·(2q + u) + (j0 + 2·j1) + 4e."""
    j1, j0, u, q, e = col >> 5 & 1, col >> 4 & 1, col >> 3 & 1, col >> 1 & 3, col & 1
    return 8 * (2 * q + u) + j0 + 2 * j1 + 4 * e


def value_row_dim(m: int) -> int:
    """Head-dim offset (inside a group) that row ``m`` of the value product Oᵀ_g holds:
    row 16w + 8r + g ← d = 8g + 2w + r."""
    return 8 * (m % 8) + 2 * (m // 16) + (m // 8) % 2


def stage_bytes(D: int) -> int:
    """Shared memory of one ring stage: K and V words and their scales and biases."""
    return 2 * TILE * D // 2 + 4 * TILE * (D // GROUP) * 2


def shared_bytes(D: int, stages: int) -> int:
    """The ring, q and P' (both [NG·8, 64] bf16) and the barriers."""
    ng = D // GROUP
    return stages * stage_bytes(D) + 2 * ng * N_PAD * 64 * 2 + 8 * stages


if gluon is not None:
    # One word → 4 bf16 pairs (128 + nibble j, 128 + nibble j + 4), j = 0..3: the pair is
    # the two halves of the word shifted by 4j, masked and OR-ed into 128's exponent.
    _K_ASM: gl.constexpr = gl.constexpr(
        "{ .reg .b32 t;\n"
        "lop3.b32 $0, $4, 0x000F000F, 0x43004300, 0xEA;\n"
        "shr.u32 t, $4, 4;\n"
        "lop3.b32 $1, t, 0x000F000F, 0x43004300, 0xEA;\n"
        "shr.u32 t, $4, 8;\n"
        "lop3.b32 $2, t, 0x000F000F, 0x43004300, 0xEA;\n"
        "shr.u32 t, $4, 12;\n"
        "lop3.b32 $3, t, 0x000F000F, 0x43004300, 0xEA; }")
    # Words of tokens t ($2) and t + 1 ($3), selector $4 (byte k of each into bytes 0
    # and 2): → (nibble 2k of t, of t + 1) and (nibble 2k + 1 of t, of t + 1) as bf16 pairs.
    _V_ASM: gl.constexpr = gl.constexpr(
        "{ .reg .b32 t;\n"
        "prmt.b32 t, $2, $3, $4;\n"
        "lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA;\n"
        "shr.u32 t, t, 4;\n"
        "lop3.b32 $1, t, 0x000F000F, 0x43004300, 0xEA; }")
    _OFF: gl.constexpr = gl.constexpr(128.0)

    @gluon.jit
    def _pairs(p):
        """int32 bf16 pairs → bf16 [..., 2], the low half first."""
        return gl.join(p.to(gl.int16), (p >> 16).to(gl.int16)).to(gl.bfloat16, bitcast=True)

    @gluon.jit
    def _k_operand(words_tile, g: gl.constexpr, KW: gl.constexpr, A: gl.constexpr):
        """Group g of a K tile ([64 tokens, D/8] words in shared memory) as the score
        product's A operand [64 tokens, 64 slots] (slot order: `code_slot_dim`)."""
        w = words_tile.slice(g * 8, 8, 1).load(KW)  # [tok, word]: u, r in regs; q, g lanes
        p0, p1, p2, p3 = gl.inline_asm_elementwise(
            _K_ASM, "=r,=r,=r,=r,r", [w], dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
            is_pure=True, pack=1)
        # [tok, word, e, j0, j1]; word = 2q + u → [tok, q, u, e, j0, j1]
        x = gl.join(gl.join(_pairs(p0), _pairs(p1)), gl.join(_pairs(p2), _pairs(p3)))
        x = gl.reshape(x, [64, 4, 2, 2, 2, 2])
        # slot = 32·j1 + 16·j0 + 8·u + 2q + e; the permute and reshape rename registers
        x = gl.reshape(gl.permute(x, (0, 5, 4, 2, 1, 3)), [64, 64])
        return gl.convert_layout(x, A)

    @gluon.jit
    def _v_operand(words_tile, g: gl.constexpr, VW3: gl.constexpr, A: gl.constexpr):
        """Group g of a V tile as the value product's A operand [64 dims, 64 tokens]
        (row order: `value_row_dim`). Each warp needs byte w of every word it holds,
        hence the 3-d [tok, word, byte] view: byte is the warp, so the selector is a
        tensor with a real coordinate."""
        w2 = words_tile.slice(g * 8, 8, 1).load(gl.SliceLayout(2, VW3))  # [tok, word]
        zero = gl.zeros([64, 8, 4], gl.int32, VW3)
        w3 = gl.expand_dims(w2, 2) + zero
        k = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, VW3)))
        sel = gl.expand_dims(gl.expand_dims(k | (k << 4) | ((k + 4) << 8) | ((k + 4) << 12), 0), 0)
        sel = sel + zero
        # tok = 2a + e: the two tokens of a pair apart
        wa, wb = gl.split(gl.permute(gl.reshape(w3, [32, 2, 8, 4]), (0, 2, 3, 1)))
        sa, _sb = gl.split(gl.permute(gl.reshape(sel, [32, 2, 8, 4]), (0, 2, 3, 1)))
        lo, hi = gl.inline_asm_elementwise(
            _V_ASM, "=r,=r,r,r,r", [wa, wb, sa], dtype=(gl.int32, gl.int32),
            is_pure=True, pack=1)
        x = gl.join(_pairs(lo), _pairs(hi))  # [a, word, byte, e, r]
        # row = 16·byte + 8r + word, column (token) = 2a + e
        x = gl.reshape(gl.permute(x, (2, 4, 1, 0, 3)), [64, 64])
        return gl.convert_layout(x, A)

    @gluon.jit
    def _v_operands(words_tile, VW3: gl.constexpr, A: gl.constexpr, NG: gl.constexpr):
        """Every group of a V tile as the value products' A operands (`_v_operand`)."""
        va = ()
        for g in gl.static_range(NG):
            va = va + (_v_operand(words_tile, g, VW3, A),)
        return va

    @gluon.jit
    def _scale_col(tile, g: gl.constexpr, SC: gl.constexpr, ROW: gl.constexpr,
                   NG: gl.constexpr):
        """Column g (float32 [64 tokens]) of a [64, NG] scale or bias tile, in the score
        accumulator's row layout."""
        x = tile.load(SC).to(gl.float32)
        col = gl.arange(0, NG, layout=gl.SliceLayout(0, SC))
        x = gl.sum(gl.where(gl.expand_dims(col == g, 0), x, 0.0), axis=1)
        return gl.convert_layout(x, ROW)

    @gluon.jit
    def _softmax(sacc, sk, bk, qsum, m_ref, l_acc, tok, lo, hi, qk_scale_log2, softcap,
                 zero_acc, NG: gl.constexpr, SOFTCAP: gl.constexpr):
        """One tile's online softmax over tokens (the columns of the [64, 8] score tile):
        the scores from the raw-code sums, scales and biases factored out per group
        (soft-capped with SOFTCAP: then ``qk_scale_log2`` is the plain scale); returns
        (m_ref, l_acc, p, alpha, valid) updated for the tile."""
        sc = zero_acc
        for g in gl.static_range(NG):
            sc = (sc + gl.expand_dims(sk[g], 1) * sacc[g]
                  + gl.expand_dims(bk[g] - _OFF * sk[g], 1) * gl.expand_dims(qsum[g], 0))
        valid = gl.expand_dims((tok >= lo) & (tok < hi), 1)
        if SOFTCAP:  # as the other split kernels cap: in natural units, then to log2
            sc = softcap * libdevice.tanh(sc * qk_scale_log2 / softcap) * 1.4426950408889634
        else:
            sc = sc * qk_scale_log2
        # an unattended token's scales may be NaN: `where` drops them
        sc = gl.where(valid, sc, float("-inf"))
        m_new = gl.maximum(m_ref, gl.max(sc, axis=0))
        alpha = gl.expand_dims(gl.where(m_new == float("-inf"), 1.0, gl.exp2(m_ref - m_new)), 0)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(sc - gl.expand_dims(m_safe, 0))
        return m_new, l_acc * alpha + p, p, alpha, valid

    @gluon.jit
    def _values(p, alpha, valid, sv, bv, corr, o, va, p_s, NG: gl.constexpr):
        """One tile's value products: P'_g = p·s_v to shared memory (transposed: K-major
        B), the bias corrections beside them, then Oᵀ_g += V_gᵀ · P'_g on wgmma, drained
        before returning (corr, o): an mma in flight across the loop's back edge makes
        ptxas serialize every wgmma of the loop (C7513)."""
        new_o = ()
        new_corr = ()
        for g in gl.static_range(NG):
            pv = gl.where(valid, p * gl.expand_dims(sv[g], 1), 0.0).to(gl.bfloat16)
            new_corr = new_corr + (corr[g] * alpha
                                   + gl.where(valid, p * gl.expand_dims(bv[g], 1), 0.0)
                                   - _OFF * pv.to(gl.float32),)
            new_o = new_o + (o[g] * alpha,)
            p_s.slice(g * 8, 8).store(gl.permute(pv, (1, 0)))
        fence_async_shared()
        gl.thread_barrier()  # all four warps' tokens are in P' before the mma
        o = ()
        for g in gl.static_range(NG):
            o = o + (warpgroup_mma(va[g], p_s.slice(g * 8, 8).permute((1, 0)), new_o[g],
                                   is_async=True),)
        o = warpgroup_mma_wait(num_outstanding=0, deps=o + va)[:NG]
        return new_corr, o

    @gluon.jit
    def _scale_cols(scales, biases, s, SC: gl.constexpr, ROW: gl.constexpr, NG: gl.constexpr):
        """Ring stage s's scale and bias columns, one float32 [64 tokens] per group each."""
        st = scales.index(s).reshape([64, NG])
        bt = biases.index(s).reshape([64, NG])
        cols_s = ()
        cols_b = ()
        for g in gl.static_range(NG):
            cols_s = cols_s + (_scale_col(st, g, SC, ROW, NG),)
            cols_b = cols_b + (_scale_col(bt, g, SC, ROW, NG),)
        return cols_s, cols_b

    @gluon.jit
    def _pad_shared(NBYTES: gl.constexpr):
        """Timing only: NBYTES (a power of two) of shared memory held, one store keeping
        the allocation."""
        pad = gl.allocate_shared_memory(gl.int32, [NBYTES // 4],
                                        gl.SwizzledSharedLayout(1, 1, 1, [0]))
        pad.slice(0, 128).store(gl.zeros([128], gl.int32, gl.BlockedLayout([1], [32], [4], [0])))

    @gluon.jit
    def _fill(descs, bufs, ready, s, b, h_kv, tok0, NG: gl.constexpr):
        """Ring stage s ← the tile at tok0: K, V words and the four scale/bias tiles."""
        kw_d, vw_d, ks_d, kb_d, vs_d, vb_d = descs
        kw_s, vw_s, ks_s, kb_s, vs_s, vb_s = bufs
        bar = ready.index(s)
        mbarrier.expect(bar, kw_d.block_type.nbytes * 2 + ks_d.block_type.nbytes * 4)
        tma.async_copy_global_to_shared(kw_d, [b, h_kv, tok0, 0], bar, kw_s.index(s))
        tma.async_copy_global_to_shared(vw_d, [b, h_kv, tok0, 0], bar, vw_s.index(s))
        srow = tok0 * NG // 8
        tma.async_copy_global_to_shared(ks_d, [b, h_kv, srow, 0], bar, ks_s.index(s))
        tma.async_copy_global_to_shared(kb_d, [b, h_kv, srow, 0], bar, kb_s.index(s))
        tma.async_copy_global_to_shared(vs_d, [b, h_kv, srow, 0], bar, vs_s.index(s))
        tma.async_copy_global_to_shared(vb_d, [b, h_kv, srow, 0], bar, vb_s.index(s))

    @gluon.jit
    def _wgmma_split_kernel(
        q_ptr, kw_d, vw_d, ks_d, kb_d, vs_d, vb_d, lengths_ptr, part_o_ptr, part_ml_ptr,
        stride_qb, stride_qh, n_splits, qk_scale_log2, softcap, window,
        HKV: gl.constexpr, G: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
        SPLIT_N: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr = False,
        LATE_V: gl.constexpr = False,
        UPTO: gl.constexpr = 4,
        PAD_A: gl.constexpr = 0, PAD_B: gl.constexpr = 0,
    ):
        NG: gl.constexpr = D // 64
        W: gl.constexpr = D // 8  # words per token
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, 8, 16])
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, ACC)  # per token (scores) or per dim (values)
        COL: gl.constexpr = gl.SliceLayout(0, ACC)  # per query head
        # K words [tok, word]: regs u (word 1), r (tok 8); lanes q (word 2, 4), g (tok 1,
        # 2, 4); warps tok 16, 32: exactly the rows and slot pairs of A (`_k_operand`).
        KW: gl.constexpr = gl.DistributedLinearLayout(
            [[0, 1], [8, 0]], [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]],
            [], [64, 8])
        # V words [tok, word, byte]: regs e, h8, j (tok 1, 8, 16, 32); lanes q (tok 2, 4),
        # g (word 1, 2, 4); warps byte 1, 2 (`_v_operand`).
        VW3: gl.constexpr = gl.DistributedLinearLayout(
            [[1, 0, 0], [8, 0, 0], [16, 0, 0], [32, 0, 0]],
            [[2, 0, 0], [4, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
            [[0, 0, 1], [0, 0, 2]], [], [64, 8, 4])
        # scale tiles [tok, group]: the groups in registers, the tokens as ROW's rows
        if NG == 2:
            SC: gl.constexpr = gl.DistributedLinearLayout(
                [[0, 1], [8, 0]], [[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
                [[16, 0], [32, 0]], [], [64, 2])
        else:
            SC: gl.constexpr = gl.DistributedLinearLayout(
                [[0, 1], [0, 2], [8, 0]], [[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
                [[16, 0], [32, 0]], [], [64, 4])
        QL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [1, 4], [1, 0])  # [8, 64]
        B_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                    element_bitwidth=16, rank=2)

        split = gl.program_id(0)
        bh = gl.program_id(1)
        b = bh // HKV
        h_kv = bh % HKV
        length = gl.load(lengths_ptr + b)
        first = 0
        if WINDOW:
            first = gl.maximum(length - window, 0)
        start = split * SPLIT_N
        lo = gl.maximum(start, first)
        hi = gl.minimum(start + SPLIT_N, length)
        if lo < hi:  # else nothing to attend here; the merge never reads this split
            tok_first = start + ((lo - start) // 64) * 64
            n_tiles = (hi - tok_first + 63) // 64

            kw_s = gl.allocate_shared_memory(gl.int32, [STAGES] + kw_d.block_type.shape, kw_d.layout)
            vw_s = gl.allocate_shared_memory(gl.int32, [STAGES] + vw_d.block_type.shape, vw_d.layout)
            ks_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + ks_d.block_type.shape, ks_d.layout)
            kb_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + kb_d.block_type.shape, kb_d.layout)
            vs_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + vs_d.block_type.shape, vs_d.layout)
            vb_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + vb_d.block_type.shape, vb_d.layout)
            q_s = gl.allocate_shared_memory(gl.bfloat16, [NG * 8, 64], B_SMEM)
            p_s = gl.allocate_shared_memory(gl.bfloat16, [NG * 8, 64], B_SMEM)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            # timing only: shared memory that holds an ablation's programs per SM down
            if PAD_A > 0:
                _pad_shared(PAD_A)
            if PAD_B > 0:
                _pad_shared(PAD_B)
            for st in gl.static_range(STAGES):
                mbarrier.init(ready.index(st), count=1)
            descs = (kw_d, vw_d, ks_d, kb_d, vs_d, vb_d)
            bufs = (kw_s, vw_s, ks_s, kb_s, vs_s, vb_s)
            for st in gl.static_range(STAGES):
                if st < n_tiles:
                    _fill(descs, bufs, ready, st, b, h_kv, tok_first + st * 64, NG)

            # q as the score product's B (K-major [8 heads, 64 slots] per group, slots
            # permuted as K's codes are), its per-group sums for the bias term.
            hq = gl.arange(0, 8, layout=gl.SliceLayout(1, QL))
            c = gl.arange(0, 64, layout=gl.SliceLayout(0, QL))
            dq = 8 * (2 * ((c >> 1) & 3) + ((c >> 3) & 1)) + ((c >> 4) & 1) + 2 * (c >> 5) + 4 * (c & 1)
            q_row = q_ptr + b * stride_qb + (h_kv * G + hq) * stride_qh
            qsum = ()
            for g in gl.static_range(NG):
                qv = gl.load(gl.expand_dims(q_row, 1) + g * 64 + gl.expand_dims(dq, 0),
                             mask=gl.expand_dims(hq < G, 1), other=0.0)
                q_s.slice(g * 8, 8).store(qv)
                qsum = qsum + (gl.convert_layout(gl.sum(qv.to(gl.float32), axis=1), COL),)
            fence_async_shared()
            gl.thread_barrier()

            rows = gl.arange(0, 64, layout=ROW)
            m_ref = gl.full([8], float("-inf"), gl.float32, COL)
            l_acc = gl.zeros([64, 8], gl.float32, ACC)
            zero_acc = gl.zeros([64, 8], gl.float32, ACC)
            o = ()
            corr = ()
            va = ()
            for g in gl.static_range(NG):
                o = o + (gl.zeros([64, 8], gl.float32, ACC),)
                corr = corr + (gl.zeros([64, 8], gl.float32, ACC),)
                va = va + (gl.zeros([64, 64], gl.bfloat16, A),)  # "the last tile's" V
            for i in range(n_tiles):
                s = i % STAGES
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                kt = kw_s.index(s).reshape([64, W])
                vt = vw_s.index(s).reshape([64, W])
                if UPTO >= 2:
                    # ---- scores: K codes expanded, then their products in flight ----
                    sacc = ()
                    ka = ()
                    for g in gl.static_range(NG):
                        a = _k_operand(kt, g, KW, A)
                        sacc = sacc + (warpgroup_mma(a, q_s.slice(g * 8, 8).permute((1, 0)),
                                                     zero_acc, use_acc=False, is_async=True),)
                        ka = ka + (a,)
                if UPTO >= 4 and not LATE_V:
                    # ---- V codes expanded while the score mmas run ----
                    va = _v_operands(vt, VW3, A, NG)
                if UPTO >= 3:
                    sk, bk = _scale_cols(ks_s, kb_s, s, SC, ROW, NG)
                if UPTO >= 4:
                    sv, bv = _scale_cols(vs_s, vb_s, s, SC, ROW, NG)
                if UPTO >= 2:
                    sacc = warpgroup_mma_wait(num_outstanding=0, deps=sacc + ka)[:NG]
                if UPTO >= 4 and LATE_V:
                    # ---- V codes expanded once K's registers are free: fewer live ----
                    va = _v_operands(vt, VW3, A, NG)
                # every warp has read stage s (words and scales are in registers): refill
                gl.thread_barrier()
                if i + STAGES < n_tiles:
                    _fill(descs, bufs, ready, s, b, h_kv, tok_first + (i + STAGES) * 64, NG)
                if UPTO == 2:  # timing only: the scores kept alive, nothing after them
                    for g in gl.static_range(NG):
                        l_acc = l_acc + sacc[g]
                if UPTO >= 3:
                    m_ref, l_acc, p, alpha, valid = _softmax(
                        sacc, sk, bk, qsum, m_ref, l_acc, tok_first + i * 64 + rows, lo, hi,
                        qk_scale_log2, softcap, zero_acc, NG, SOFTCAP)
                if UPTO >= 4:
                    corr, o = _values(p, alpha, valid, sv, bv, corr, o, va, p_s, NG)

            o = warpgroup_mma_wait(num_outstanding=0, deps=o + va)[:NG]
            for st in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(st))

            # ---- partials: rows h < G of part_o [B·Hq, n_splits, D] and part_ml ----
            hcol = gl.arange(0, 8, layout=COL)
            m_i = gl.arange(0, 64, layout=ROW)
            d_of_m = 8 * (m_i % 8) + 2 * (m_i // 16) + (m_i // 8) % 2
            row = ((b * HKV + h_kv) * G + hcol).to(gl.int64) * n_splits + split
            keep = gl.expand_dims(hcol < G, 0)
            for g in gl.static_range(NG):
                og = o[g] + gl.expand_dims(gl.sum(corr[g], axis=0), 0)
                gl.store(part_o_ptr + gl.expand_dims(row, 0) * D + g * 64
                         + gl.expand_dims(d_of_m, 1), og, mask=keep)
            gl.store(part_ml_ptr + row * 2, m_ref, mask=hcol < G)
            gl.store(part_ml_ptr + row * 2 + 1, gl.sum(l_acc, axis=0), mask=hcol < G)


def unsupported_reason(q: torch.Tensor, k, v, block_table: torch.Tensor | None = None
                       ) -> str | None:
    """Why `decode_attention_wgmma` cannot take these inputs, in one line (None: it can)."""
    if gluon is None:
        return f"Gluon is not importable ({GLUON_ERROR})"
    if not (isinstance(k, QuantizedTensor) and isinstance(v, QuantizedTensor)):
        return "a dense cache (the kernel reads 4-bit codes)"
    if block_table is not None:
        return "a paged cache (block tables are not done)"
    if not torch.cuda.is_available() or q.device.type != "cuda":
        return f"q is on {q.device.type}, not CUDA"
    if interpreter_active():
        return "TRITON_INTERPRET is set, and the interpreter runs no Gluon kernel"
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return f"device capability {torch.cuda.get_device_capability(q.device)} (needs sm_90: wgmma, TMA)"
    if q.dtype != torch.bfloat16:
        return f"q dtype {q.dtype} (only bf16)"
    if q.dim() != 3 or q.stride(-1) != 1:
        return "q must be [B, Hq, D] with a contiguous last dim"
    B, Hq, D = q.shape
    if (k.bits, k.group_size, v.bits, v.group_size) != (4, GROUP, 4, GROUP):
        return f"{k.bits}/{v.bits}-bit codes in groups of {k.group_size}/{v.group_size} (only 4-bit, 64)"
    if D not in HEAD_DIMS:
        return f"head dim {D} (only 128, 256)"
    if k.packed.shape[0] != B or k.packed.shape[:3] != v.packed.shape[:3] or k.packed.shape[-1] != D // 8:
        return f"q {tuple(q.shape)}, k {tuple(k.packed.shape)}, v {tuple(v.packed.shape)} disagree"
    Hkv = k.packed.shape[1]
    if Hq % Hkv or Hq // Hkv not in GQA:
        return f"{Hq} query heads over {Hkv} kv heads (needs 2-4 per kv head)"
    if shared_bytes(D, DEFAULT_STAGES[D]) > SMEM_BYTES:
        return "the ring does not fit in shared memory"
    for name, t in (("k", k), ("v", v)):
        reason = _tma_reason(name, t)
        if reason:
            return reason
    return None


def _tma_reason(name: str, t: QuantizedTensor) -> str | None:
    """TMA: 16-byte aligned bases and strides; scales and biases read as 16-byte rows of
    8 values, so tokens × groups must be contiguous and fill whole rows."""
    p = t.packed
    if p.stride(-1) != 1 or any(st * 4 % 16 for st in p.stride()[:-1]) or p.data_ptr() % 16:
        return f"{name}.packed strides {p.stride()} are not TMA-describable"
    ng = t.scales.shape[-1]
    for part, s in (("scales", t.scales), ("biases", t.biases)):
        if s.dtype != torch.bfloat16:
            return f"{name}.{part} are {s.dtype} (only bf16)"
        if s.stride(-1) != 1 or s.stride(-2) != ng or s.shape[-2] * ng % 8:
            return f"{name}.{part} needs tokens × groups contiguous (strides {s.stride()})"
        if any(st * 2 % 16 for st in s.stride()[:2]) or s.data_ptr() % 16:
            return f"{name}.{part} strides {s.stride()} are not 16-byte aligned"
    return None


def descriptors(t: QuantizedTensor):
    """TMA descriptors of one cache: words [B, H, N, D/8] in [1, 1, 64, D/8] boxes
    (unswizzled, so a stage reshapes to [64, D/8]), scales and biases as rows of 8
    in [1, 1, 64·NG/8, 8] boxes."""
    B, H, N, W = t.packed.shape
    words = t.packed.view(torch.int32)
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=4)
    wd = TensorDescriptor(words, [B, H, N, W], list(words.stride()), [1, 1, TILE, W], w_layout)
    ng = t.scales.shape[-1]
    s_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=4)
    sb = [TensorDescriptor(x, [B, H, N * ng // 8, 8], [x.stride(0), x.stride(1), 8, 1],
                           [1, 1, TILE * ng // 8, 8], s_layout) for x in (t.scales, t.biases)]
    return wd, sb[0], sb[1]


def kernel():
    """The Gluon split kernel (None without Gluon)."""
    return _wgmma_split_kernel if gluon is not None else None


# Timing only (`AttentionLaunch.upto`): the kernel's stages up to this one, the rest left
# out; its output is then meaningless. Differences between them place the time.
UPTO = {name: i + 1 for i, name in enumerate(WGMMA_STAGES)}
SM_SHARED = 228 * 1024  # an SM's shared memory; each resident program also holds 1 KB
ABLATION_PADS: dict[tuple, tuple[int, int]] = {}  # an ablation's shared-memory pads, by its launch


def programs_per_sm(kernel) -> int:
    """Programs (one warpgroup each) an SM holds of a compiled, launched kernel: by its
    registers (allocated per thread in eights) and by its shared memory."""
    by_regs = REGISTER_FILE // (-(-kernel.n_regs // 8) * 8 * 128)
    return min(by_regs, SM_SHARED // (kernel.metadata.shared + 1024), 16)


def ablation_pad(full_programs: int, shared: int) -> tuple[int, int]:
    """Shared-memory bytes to add to a program of ``shared`` bytes so that an SM holds no
    more of them than ``full_programs`` (the complete kernel's): an ablation that frees
    registers would otherwise run more programs at once, and its difference would
    measure occupancy too. Two buffers whose sizes are powers of two (Gluon's shapes
    are), each 0 or at least 512 bytes, summing to the least such total that suffices."""
    need = SM_SHARED // (full_programs + 1) + 1 - 1024 - shared
    if need <= 0:
        return 0, 0

    def up(n):  # the least power of two ≥ n, at least 512; 0 for nothing
        return 0 if n <= 0 else max(512, 1 << (n - 1).bit_length())

    pairs = [(p, up(need - p)) for p in (1 << e for e in range(9, up(need).bit_length()))]
    return min(pairs + [(up(need), 0)], key=lambda pair: (sum(pair), -pair[0]))


def launch_split_wgmma(q, k, v, lengths, part_o, part_ml, split, qk_scale_log2, softcap=None,
                       window=None, stages=None, upto: str | None = None, late_v: bool = False,
                       maxnreg: int | None = None):
    """The split partials of `decode_attention.partials` for (n_splits, B·Hkv) programs;
    the caller has had None from `unsupported_reason`. ``qk_scale_log2`` as the other
    split kernels take it: scale·log2(e), or the plain scale with a ``softcap``. ``late_v``: expand V's codes after
    the score products finish instead of under them (K's operand registers are free by
    then: 104 registers instead of 126 at head dim 128, 219 instead of 240 at 256);
    ``maxnreg``: ptxas's register limit (more programs an SM, at some spills). ``upto``
    (timing only, a key of `UPTO`): run the stages up to that one, at the complete
    kernel's programs per SM."""
    B, Hq, D = q.shape
    Hkv = k.packed.shape[1]
    if split % TILE:
        raise ValueError(f"split {split} is not a multiple of the {TILE}-token tile")
    kw, ks, kb = descriptors(k)
    vw, vs, vb = descriptors(v)
    n_splits = part_o.shape[2]
    launch = _wgmma_split_kernel[(n_splits, B * Hkv)]
    args = (q, kw, vw, ks, kb, vs, vb, lengths, part_o, part_ml, q.stride(0), q.stride(1),
            n_splits, float(qk_scale_log2), float(softcap or 1.0), int(window or 0))
    meta = {"HKV": Hkv, "G": Hq // Hkv, "D": D, "STAGES": stages or DEFAULT_STAGES[D],
            "SPLIT_N": split, "WINDOW": window is not None, "SOFTCAP": softcap is not None,
            "LATE_V": late_v, "num_warps": 4}
    if maxnreg:
        meta["maxnreg"] = maxnreg
    if upto is not None:
        key = (*sorted(meta.items()), upto)
        if key not in ABLATION_PADS:  # both compiled and launched once: their sizes are known
            full = launch(*args, **meta)
            alone = launch(*args, **meta, UPTO=UPTO[upto])
            ABLATION_PADS[key] = ablation_pad(programs_per_sm(full), alone.metadata.shared)
        meta.update(UPTO=UPTO[upto], PAD_A=ABLATION_PADS[key][0], PAD_B=ABLATION_PADS[key][1])
    launch(*args, **meta)


def decode_attention_wgmma(q, k, v, lengths, scale: float, window: int | None = None,
                           stages: int | None = None, late_v: bool = False,
                           maxnreg: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """out [B, Hq, D] bf16: decode attention of q over the 4-bit cache (k, v) up to each
    sequence's length (last ``window`` tokens if given), via the existing split size and
    merge. Raises ValueError with `unsupported_reason` for inputs it does not take."""
    reason = unsupported_reason(q, k, v)
    if reason:
        raise ValueError(f"decode_attention_wgmma cannot take these inputs: {reason}")
    B, Hq, D = q.shape
    n_max = tokens_per_sequence(k, None)
    split = split_size(n_max)
    part_o, part_ml = partials(B, Hq, D, n_max, split, q.device)
    # soft-capped, the scores are capped in natural units: the plain scale
    qk_scale = scale if softcap is not None else scale * LOG2E
    launch_split_wgmma(q, k, v, lengths, part_o, part_ml, split, qk_scale, softcap, window,
                       stages, late_v=late_v, maxnreg=maxnreg)
    out = torch.empty_like(q)
    return merge_splits(part_o, part_ml, lengths, out, window, split, gdc=False)
