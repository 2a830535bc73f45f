"""Warp-specialized split kernel for decode attention over a 4/8-bit (MLX layout) KV cache.

Hopper (sm_90) only, written in Gluon (``triton.experimental.gluon``, Triton 3.6 API).
It computes exactly the partials of the split kernels in ``decode_attention.py``, so
their merge (``decode_attention.merge_splits``) turns them into the output unchanged.
``decode_attention.choose_path`` picks it for 4-bit caches of head dim 128
(``WS_BY_DEFAULT``); ``AttentionLaunch(path="ws")`` asks for it for any cache it takes.

Contract:
    q        [B, Hq, D] bf16/fp16, last dim contiguous; Hq = G·Hkv (GQA in the kernel:
             one program serves the G query heads of one kv head).
    k, v     ``QuantizedTensor``: packed uint32 [B, Hkv, Nmax, D·bits/32], scales/biases
             [B, Hkv, Nmax, D/g] in q's dtype, bits ∈ {4, 8}; tokens × groups contiguous.
             Shapes taken: (D/g)·G ∈ {8, 16} (one or two mma column tiles), ≥ 16 words
             per token; ``ws_unsupported_reason`` names what else it refuses.
    lengths  int32 [B]; sequence b attends to [max(0, L_b − window), L_b) (no window: from 0).
    part_o   float32 [B, Hq, n_splits, D]: unnormalised partial outputs.
    part_ml  float32 [B, Hq, n_splits, 2]: (softmax reference in log2 units, sum of exp2).
             A split [split·S, split·S + S) with nothing to attend writes nothing.

Determinism: splits have a fixed size and tiles a fixed token grid, every consumer warp
owns fixed token slots, and the four warps' partials merge in a fixed order: a
sequence's partials are bitwise reproducible and do not depend on the batch. Graph
capture: the grid depends on shapes only; lengths are read on the device.
PDL (``gdc``): the whole program waits (``gdc_wait``) at its start, like the other
kernels.

Per program: a 4-warp default partition streams the split's K and V words and
scales/biases with TMA into a ring of shared-memory stages (ready/empty mbarriers) and
later merges; four 1-warp consumer partitions each take their own TPW tokens of every
stage, with their own softmax state, so no barrier is shared between warps in the
loop. Scores and values are mma.sync products over the raw codes (the same identity
as the codes kernel: Σ (s·c + b)·x = s·Σ c·x + b·Σ x, codes as OFF + c, exact):
    scores  S[tok, (h, g)] = Σ_k codes_k[tok, w] · q_k[w, (h, g)]   (tokens: mma rows)
    values  O_k[w, (h, g)] += codes_k[w, tok] · P'[tok, (h, g)],   P' = p·s_v (rounded)
The (head, group) columns fill one n8 mma tile at (D/g)·G = 8 (Gemma 3, Llama 3 at g64).
"""

from __future__ import annotations

import torch

from ...levers import interpreter_active
from ...quant import QuantizedTensor
from ..common.codes import nibbles_asm
from ..common.gluon_hopper import (  # optional: gluon is None without it (GLUON_ERROR)
    GLUON_ERROR,
    TensorDescriptor,
    fence_async_shared,
    gdc_launch_dependents,
    gdc_wait,
    gl,
    gluon,
    libdevice,
    mbarrier,
    mma_v2,
    tma,
)

CONSUMERS = 4  # 1-warp consumer partitions per program
MAX_CHUNK_WORDS = 32  # words per TMA box row: 128 B, the widest 128-byte-swizzled box
SUPPORTED_BITS = (4, 8)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SMEM_BYTES = 227 * 1024  # Hopper's shared memory per block


def code_bases(bits: int, dtype: torch.dtype) -> tuple[int, int, float]:
    """(low-nibble base, high-nibble base, OFF) of the operand codes: each nibble n is
    OR-ed into a 16-bit float whose value becomes base + n (4-bit: both nibbles are codes;
    8-bit: low n_lo → OFF_lo + n_lo and high → OFF_hi + 16·n_hi, whose sum is OFF + c)."""
    if dtype == torch.bfloat16:
        return (0x4300, 0x4300, 128.0) if bits == 4 else (0x4300, 0x4500, 2176.0)  # 128; 2048
    return (0x6400, 0x6400, 1024.0) if bits == 4 else (0x6400, 0x7400, 17408.0)  # 1024; 16384


def score_layout(tpw: int, G: int, NG: int):
    """The mma C layout of a [tpw, G·NG] tile (one warp, m16n8) seen as [tpw, G, NG]:
    column c = h·NG + g. Reshaping S into it is free; it gives the group sum and the
    per-(token, group) scales a layout to live in."""
    def split(basis):
        row, col = basis
        return [row, col // NG, col % NG]
    R = G * NG
    regs = [[0, 1], [8, 0]] + [[0, 8 << i] for i in range((R // 8).bit_length() - 1)]
    regs += [[16 << i, 0] for i in range((tpw // 16).bit_length() - 1)]
    lanes = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout([split(b) for b in regs], [split(b) for b in lanes], [], [],
                                      [tpw, G, NG])


if gluon is not None:
    from triton.runtime.jit import constexpr_function

    _NC = gl.constexpr(CONSUMERS)
    _nibbles_asm = constexpr_function(nibbles_asm)

    @gluon.jit
    def _codes(words, LO: gl.constexpr, HI: gl.constexpr, DT: gl.constexpr):
        if DT == gl.bfloat16:
            x = gl.inline_asm_elementwise(_nibbles_asm(LO, HI), "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                          dtype=(gl.bfloat16,) * 8, is_pure=True, pack=2)
        else:
            x = gl.inline_asm_elementwise(_nibbles_asm(LO, HI), "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                          dtype=(gl.float16,) * 8, is_pure=True, pack=2)
        return x

    @gluon.jit
    def _producer(descs, bufs, bars, b, h_kv, tok_first, n_tiles,
                  NCH: gl.constexpr, WC: gl.constexpr, NG: gl.constexpr, BN: gl.constexpr,
                  STAGES: gl.constexpr):
        """Default partition: one thread issues the TMA copies of each stage."""
        kw_desc, vw_desc, ks_desc, kb_desc, vs_desc, vb_desc = descs
        kw_s, vw_s, ks_s, kb_s, vs_s, vb_s = bufs
        ready, empty, _done = bars
        NBYTES: gl.constexpr = 2 * NCH * BN * WC * 4 + 4 * BN * NG * 2
        for i in range(n_tiles):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            fence_async_shared()  # the consumers' shared loads of this slot come first
            tok0 = tok_first + i * BN
            bar = ready.index(s)
            mbarrier.expect(bar, NBYTES)
            for c in gl.static_range(NCH):
                tma.async_copy_global_to_shared(kw_desc, [b, h_kv, tok0, c * WC], bar, kw_s.index(s * NCH + c))
                tma.async_copy_global_to_shared(vw_desc, [b, h_kv, tok0, c * WC], bar, vw_s.index(s * NCH + c))
            srow = tok0 * NG // 8
            tma.async_copy_global_to_shared(ks_desc, [b, h_kv, srow, 0], bar, ks_s.index(s))
            tma.async_copy_global_to_shared(kb_desc, [b, h_kv, srow, 0], bar, kb_s.index(s))
            tma.async_copy_global_to_shared(vs_desc, [b, h_kv, srow, 0], bar, vs_s.index(s))
            tma.async_copy_global_to_shared(vb_desc, [b, h_kv, srow, 0], bar, vb_s.index(s))

    @gluon.jit
    def _stage_words(buf, slot, wid: gl.constexpr, TPW: gl.constexpr, BN: gl.constexpr,
                     WC: gl.constexpr):
        """[BN, WC] words of one stage and chunk (the TMA box without its unit dims)."""
        return buf.index(slot).reshape([BN, WC]).slice(wid * TPW, TPW)

    @gluon.jit
    def _stage_scales(buf, slot, layout: gl.constexpr, wid: gl.constexpr, TPW: gl.constexpr,
                      BN: gl.constexpr, NG: gl.constexpr):
        x = buf.index(slot).reshape([BN, NG]).slice(wid * TPW, TPW).load(layout)
        return x.to(gl.float32)

    @gluon.jit
    def _consumer(q_ptr, stride_qb, stride_qh, bufs, bars, merge, b, h_kv, tok_first, n_tiles,
                  lo, hi, qk_scale_log2, softcap,
                  wid: gl.constexpr, G: gl.constexpr, NG: gl.constexpr, BITS: gl.constexpr,
                  NCH: gl.constexpr, WC: gl.constexpr, TPW: gl.constexpr, BN: gl.constexpr,
                  STAGES: gl.constexpr, SOFTCAP: gl.constexpr,
                  LO: gl.constexpr, HI: gl.constexpr, OFF: gl.constexpr, P3: gl.constexpr):
        """One warp: tokens [wid·TPW, (wid+1)·TPW) of every stage, its own softmax state."""
        kw_s, vw_s, ks_s, kb_s, vs_s, vb_s = bufs
        ready, empty, done = bars
        acc_sm, ml_sm = merge
        R: gl.constexpr = G * NG
        NCODE: gl.constexpr = 32 // BITS  # codes per word
        DT: gl.constexpr = q_ptr.dtype.element_ty
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                      instr_shape=[16, 8])
        A_OP: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
        B_OP: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
        COL: gl.constexpr = gl.SliceLayout(0, MMA)
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        S_LAYOUT: gl.constexpr = gl.SliceLayout(1, P3)  # scales [TPW, NG]
        W: gl.constexpr = NCH * WC
        D: gl.constexpr = W * NCODE
        GROUP: gl.constexpr = D // NG

        m_ref = gl.full([R], float("-inf"), gl.float32, COL)
        l_acc = gl.zeros([TPW, R], gl.float32, MMA)
        corr_acc = gl.zeros([TPW, R], gl.float32, MMA)
        acc = ()
        for i in gl.static_range(NCODE * NCH):
            acc = acc + (gl.zeros([WC, R], gl.float32, MMA),)
        # q per code position and word chunk as the score mma's B operand [WC, R]: column
        # (h, g) holds head h's values of group g's words, zeros elsewhere.
        wq = gl.arange(0, WC, layout=gl.SliceLayout(1, B_OP))
        rq = gl.arange(0, R, layout=gl.SliceLayout(0, B_OP))
        qsum = gl.zeros([R], gl.float32, gl.SliceLayout(0, B_OP))
        bq = ()
        for c in gl.static_range(NCH):
            w = c * WC + wq
            in_group = ((w * NCODE) // GROUP)[:, None] == (rq % NG)[None, :]
            ptr = (q_ptr + b * stride_qb + (h_kv * G + rq // NG)[None, :] * stride_qh
                   + (w * NCODE)[:, None])
            for k in gl.static_range(NCODE):
                x = gl.load(ptr + k, mask=in_group, other=0.0)
                bq = bq + (x,)
                qsum += gl.sum(x.to(gl.float32), axis=0)
        qsum3 = gl.expand_dims(gl.convert_layout(gl.reshape(qsum, [G, NG]), gl.SliceLayout(0, P3)), 0)
        rows = gl.arange(0, TPW, layout=ROW)

        for i in range(n_tiles):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            sk = gl.expand_dims(_stage_scales(ks_s, s, S_LAYOUT, wid, TPW, BN, NG), 1)
            bk = gl.expand_dims(_stage_scales(kb_s, s, S_LAYOUT, wid, TPW, BN, NG), 1)
            sv = gl.expand_dims(_stage_scales(vs_s, s, S_LAYOUT, wid, TPW, BN, NG), 1)
            bv = gl.expand_dims(_stage_scales(vb_s, s, S_LAYOUT, wid, TPW, BN, NG), 1)
            kw = ()
            for c in gl.static_range(NCH):
                kw = kw + (_stage_words(kw_s, s * NCH + c, wid, TPW, BN, WC).load(A_OP),)
            tok = tok_first + i * BN + wid * TPW + rows
            valid = gl.expand_dims((tok >= lo) & (tok < hi), 1)  # [TPW, 1]
            # ---- scores: two accumulators halve the dependent mma chain ----
            s_even = gl.zeros([TPW, R], gl.float32, MMA)
            s_odd = gl.zeros([TPW, R], gl.float32, MMA)
            for c in gl.static_range(NCH):
                kc = _codes(kw[c], LO, HI, DT)
                for k in gl.static_range(8):
                    qk = bq[c * NCODE + k * NCODE // 8]  # 8-bit: both nibbles of code k//2
                    if k % 2 == 0:
                        s_even = mma_v2(kc[k], qk, s_even)
                    else:
                        s_odd = mma_v2(kc[k], qk, s_odd)
            s3 = gl.convert_layout(gl.reshape(s_even + s_odd, [TPW, G, NG]), P3)
            # scale per (token, group), then the groups of a head summed; an unattended
            # token's scales may be NaN: `where` below drops them
            sc = gl.sum(s3 * sk + (bk - OFF * sk) * qsum3, axis=2)  # [TPW, G]
            if SOFTCAP:
                sc = softcap * libdevice.tanh(sc * qk_scale_log2 / softcap) * 1.4426950408889634
            else:
                sc = sc * qk_scale_log2
            zero3 = gl.zeros([TPW, G, NG], gl.float32, P3)  # broadcasts [TPW, G, 1], [TPW, 1, NG]
            sc = gl.convert_layout(gl.reshape(gl.broadcast(gl.expand_dims(sc, 2), zero3)[0], [TPW, R]), MMA)
            sc = gl.where(valid, sc, float("-inf"))
            # ---- lazy softmax reference: it moves only when a score passes it by > 8 ----
            over = gl.max(gl.max((sc > m_ref[None, :] + 8.0).to(gl.int32), axis=1), axis=0)
            if over > 0:
                m_new = gl.maximum(m_ref, gl.max(sc, axis=0))
                alpha = gl.where(m_new == float("-inf"), 1.0, gl.exp2(m_ref - m_new))
                l_acc = l_acc * alpha[None, :]
                corr_acc = corr_acc * alpha[None, :]
                new_acc = ()
                for j in gl.static_range(NCODE * NCH):
                    new_acc = new_acc + (acc[j] * alpha[None, :],)
                acc = new_acc
                m_ref = m_new
            m_safe = gl.where(m_ref == float("-inf"), 0.0, m_ref)
            p = gl.exp2(sc - m_safe[None, :])  # [TPW, R], one copy per group; ≤ 2**8
            l_acc += p
            # ---- values: P' = p·s_v as the B operand, straight from registers ----
            sv_r = gl.convert_layout(gl.reshape(gl.broadcast(sv, zero3)[0], [TPW, R]), MMA)
            bv_r = gl.convert_layout(gl.reshape(gl.broadcast(bv, zero3)[0], [TPW, R]), MMA)
            pv = gl.where(valid, p * sv_r, 0.0).to(DT)
            corr_acc += gl.where(valid, p * bv_r, 0.0) - OFF * pv.to(gl.float32)
            pb = gl.convert_layout(pv, B_OP)
            # V words only now: K's and V's words are never live together
            vw = ()
            for c in gl.static_range(NCH):
                vw = vw + (_stage_words(vw_s, s * NCH + c, wid, TPW, BN, WC).permute([1, 0]).load(A_OP),)
            mbarrier.arrive(empty.index(s), count=1)  # the stage is in registers now
            vc = ()
            for c in gl.static_range(NCH):
                vc = vc + (_codes(vw[c], LO, HI, DT),)
            new_acc = ()
            for j in gl.static_range(NCODE):  # acc[j·NCH + c]: code j, word chunk c
                for c in gl.static_range(NCH):
                    a = acc[j * NCH + c]
                    for n in gl.static_range(8 // NCODE):  # 8-bit: its two nibbles
                        a = mma_v2(vc[c][j * (8 // NCODE) + n], pb, a)
                    new_acc = new_acc + (a,)
            acc = new_acc

        # ---- hand (reference, sums, correction, accumulators) to the merge ----
        for j in gl.static_range(NCODE * NCH):
            acc_sm.slice((wid * NCODE * NCH + j) * WC, WC).store(acc[j])
        ml_sm.slice(wid * 4 * R, R).store(m_ref)
        ml_sm.slice((wid * 4 + 1) * R, R).store(gl.sum(l_acc, axis=0))
        ml_sm.slice((wid * 4 + 2) * R, R).store(gl.sum(corr_acc, axis=0))
        mbarrier.arrive(done, count=1)

    @gluon.jit
    def _merge(merge, done, part_o_ptr, part_ml_ptr, row0, split, n_splits,
               G: gl.constexpr, NG: gl.constexpr, BITS: gl.constexpr, NCH: gl.constexpr,
               WC: gl.constexpr, num_warps: gl.constexpr):
        """Default partition, after its producer loop: the consumers' partials merged in
        warp order, then the split's rows of part_o / part_ml written."""
        acc_sm, ml_sm = merge
        R: gl.constexpr = G * NG
        NCODE: gl.constexpr = 32 // BITS
        D: gl.constexpr = NCH * WC * NCODE
        GROUP: gl.constexpr = D // NG
        E2: gl.constexpr = gl.BlockedLayout([1, R], [32, 1], [num_warps, 1], [1, 0])
        EC: gl.constexpr = gl.SliceLayout(0, E2)
        mbarrier.wait(done, 0)
        ms = ()
        m_all = gl.full([R], float("-inf"), gl.float32, EC)
        for cw in gl.static_range(_NC):
            m_c = ml_sm.slice(cw * 4 * R, R).load(EC)
            ms = ms + (m_c,)
            m_all = gl.maximum(m_all, m_c)
        m_safe = gl.where(m_all == float("-inf"), 0.0, m_all)
        l_sum = gl.zeros([R], gl.float32, EC)
        o = gl.zeros([D, R], gl.float32, E2)
        for cw in gl.static_range(_NC):
            f = gl.where(ms[cw] == float("-inf"), 0.0, gl.exp2(ms[cw] - m_safe))
            l_sum += f * ml_sm.slice((cw * 4 + 1) * R, R).load(EC)
            corr = ml_sm.slice((cw * 4 + 2) * R, R).load(EC)
            a = acc_sm.slice(cw * D, D).load(E2)
            o += f[None, :] * (a + corr[None, :])
        # row i of o is (code k, chunk c, word-in-chunk): d = (c·WC + wl)·NCODE + k
        i = gl.arange(0, D, layout=gl.SliceLayout(1, E2))
        r = gl.arange(0, R, layout=EC)
        k = i // (NCH * WC)
        w = i % (NCH * WC)
        d = w * NCODE + k
        keep = ((w * NCODE) // GROUP)[:, None] == (r % NG)[None, :]  # only g(w)'s column
        row = (row0 + r // NG).to(gl.int64) * n_splits + split
        gl.store(part_o_ptr + row[None, :] * D + d[:, None], o, mask=keep)
        first = (r % NG) == 0
        gl.store(part_ml_ptr + row * 2, m_all, mask=first)
        gl.store(part_ml_ptr + row * 2 + 1, l_sum, mask=first)

    @gluon.jit
    def _default(descs, bufs, bars, merge, part_o_ptr, part_ml_ptr, b, h_kv, row0, split,
                 n_splits, tok_first, n_tiles,
                 G: gl.constexpr, NG: gl.constexpr, BITS: gl.constexpr, NCH: gl.constexpr,
                 WC: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
        _producer(descs, bufs, bars, b, h_kv, tok_first, n_tiles, NCH, WC, NG, BN, STAGES)
        _merge(merge, bars[2], part_o_ptr, part_ml_ptr, row0, split, n_splits, G, NG, BITS, NCH, WC,
               gl.num_warps())

    @gluon.jit
    def _ws_split_kernel(
        q_ptr, kw_desc, vw_desc, ks_desc, kb_desc, vs_desc, vb_desc,
        lengths_ptr, part_o_ptr, part_ml_ptr,
        stride_qb, stride_qh, n_splits, qk_scale_log2, softcap, window,
        HKV: gl.constexpr, G: gl.constexpr, NG: gl.constexpr, BITS: gl.constexpr,
        NCH: gl.constexpr, WC: gl.constexpr, TPW: gl.constexpr, STAGES: gl.constexpr,
        SPLIT_N: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr,
        GDC: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        LO: gl.constexpr, HI: gl.constexpr, OFF: gl.constexpr, P3: gl.constexpr,
    ):
        if GDC:
            gdc_launch_dependents()
            gdc_wait()  # everything below may depend on the previous kernel
        BN: gl.constexpr = _NC * TPW
        NCODE: gl.constexpr = 32 // BITS
        R: gl.constexpr = G * NG
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
        if lo < hi:  # else nothing to attend in this split; the merge never reads it
            tok_first = start + ((lo - start) // BN) * BN
            n_tiles = (hi - tok_first + BN - 1) // BN

            kw_s = gl.allocate_shared_memory(gl.int32, [STAGES * NCH] + kw_desc.block_type.shape, kw_desc.layout)
            vw_s = gl.allocate_shared_memory(gl.int32, [STAGES * NCH] + vw_desc.block_type.shape, vw_desc.layout)
            ks_s = gl.allocate_shared_memory(ks_desc.dtype, [STAGES] + ks_desc.block_type.shape, ks_desc.layout)
            kb_s = gl.allocate_shared_memory(kb_desc.dtype, [STAGES] + kb_desc.block_type.shape, kb_desc.layout)
            vs_s = gl.allocate_shared_memory(vs_desc.dtype, [STAGES] + vs_desc.block_type.shape, vs_desc.layout)
            vb_s = gl.allocate_shared_memory(vb_desc.dtype, [STAGES] + vb_desc.block_type.shape, vb_desc.layout)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            FLAT2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
            FLAT1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
            acc_sm = gl.allocate_shared_memory(gl.float32, [_NC * NCODE * NCH * WC, R], FLAT2)
            ml_sm = gl.allocate_shared_memory(gl.float32, [_NC * 4 * R], FLAT1)
            for s in gl.static_range(STAGES):
                mbarrier.init(ready.index(s), count=1)
                mbarrier.init(empty.index(s), count=_NC)
            mbarrier.init(done, count=_NC)

            descs = (kw_desc, vw_desc, ks_desc, kb_desc, vs_desc, vb_desc)
            bufs = (kw_s, vw_s, ks_s, kb_s, vs_s, vb_s)
            bars = (ready, empty, done)
            merge = (acc_sm, ml_sm)
            row0 = (b * HKV + h_kv) * G
            # one entry per partition, spelled out: a kernel body takes no comprehension
            gl.warp_specialize([
                (_default, (descs, bufs, bars, merge, part_o_ptr, part_ml_ptr, b, h_kv, row0,
                            split, n_splits, tok_first, n_tiles,
                            G, NG, BITS, NCH, WC, BN, STAGES)),
                (_consumer, (q_ptr, stride_qb, stride_qh, bufs, bars, merge, b, h_kv, tok_first,
                             n_tiles, lo, hi, qk_scale_log2, softcap, 0, G, NG, BITS, NCH, WC, TPW,
                             BN, STAGES, SOFTCAP, LO, HI, OFF, P3)),
                (_consumer, (q_ptr, stride_qb, stride_qh, bufs, bars, merge, b, h_kv, tok_first,
                             n_tiles, lo, hi, qk_scale_log2, softcap, 1, G, NG, BITS, NCH, WC, TPW,
                             BN, STAGES, SOFTCAP, LO, HI, OFF, P3)),
                (_consumer, (q_ptr, stride_qb, stride_qh, bufs, bars, merge, b, h_kv, tok_first,
                             n_tiles, lo, hi, qk_scale_log2, softcap, 2, G, NG, BITS, NCH, WC, TPW,
                             BN, STAGES, SOFTCAP, LO, HI, OFF, P3)),
                (_consumer, (q_ptr, stride_qb, stride_qh, bufs, bars, merge, b, h_kv, tok_first,
                             n_tiles, lo, hi, qk_scale_log2, softcap, 3, G, NG, BITS, NCH, WC, TPW,
                             BN, STAGES, SOFTCAP, LO, HI, OFF, P3)),
            ], [1] * _NC, [CONSUMER_REGS] * _NC)


def default_launch(D: int, bits: int) -> tuple[int, int]:
    """(stages, tokens per consumer warp). Stages of ~18 KB at kv4 (the plan in NOTES,
    "Decode attention, warp-specialized": 64-token stages at D=256, 128 at D=128), 3 of
    ~34 KB at kv8 so that the ring and the merge buffers leave room for a second program
    per SM. The best or tied of the variants swept (bench/NOTES.md, same section)."""
    words = D * bits // 32
    tpw = 32 if words <= 16 else 16
    return (4 if bits == 4 else 3), tpw


def shared_bytes(D: int, bits: int, G: int, NG: int, stages: int, tpw: int) -> int:
    """Shared memory of one program: the ring, the merge buffers and the barriers."""
    bn = CONSUMERS * tpw
    ring = stages * (2 * bn * D * bits // 8 + 4 * bn * NG * 2)
    merge = CONSUMERS * (D + 3) * G * NG * 4
    return ring + merge + 8 * (2 * stages + 1)


def shape_reason(G: int, D: int, bits: int, group: int) -> str | None:
    """Why the kernel's tiling cannot take G query heads per KV head, head dim D and
    ``bits``-bit codes in groups of ``group`` (None when it can)."""
    if bits not in SUPPORTED_BITS:
        return f"{bits}-bit codes (supported: 4, 8)"
    if D % group or group % (32 // bits):
        return f"group {group} with head dim {D}"
    NG = D // group
    if G * NG not in (8, 16):
        return f"{G} query heads × {NG} groups = {G * NG} mma columns (needs 8 or 16)"
    words = D * bits // 32
    if words < 16 or (words > MAX_CHUNK_WORDS and words % MAX_CHUNK_WORDS):
        return f"{words} words per token (needs 16, 32 or a multiple of 32)"
    return None


def ws_unsupported_reason(q: torch.Tensor, k, v) -> str | None:
    """Why the warp-specialized kernel cannot take these inputs (None when it can)."""
    if gluon is None:
        return f"Gluon is not importable ({GLUON_ERROR})"
    if not (isinstance(k, QuantizedTensor) and isinstance(v, QuantizedTensor)):
        return "a dense cache (the kernel reads 4/8-bit codes)"
    if q.device.type != "cuda":
        return f"q is on {q.device.type}, not CUDA"
    if interpreter_active():
        return "TRITON_INTERPRET is set, and the interpreter runs no Gluon kernel"
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return f"device capability {torch.cuda.get_device_capability(q.device)} (needs 9.x: TMA, wgmma-era Gluon)"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"q dtype {q.dtype} (supported: fp16, bf16)"
    if q.dim() != 3 or q.stride(-1) != 1:
        return "q must be [B, Hq, D] with a contiguous last dim"
    B, Hq, D = q.shape
    if (k.bits, k.group_size) != (v.bits, v.group_size):
        return "k and v in different formats"
    if k.packed.shape[0] != B or k.packed.shape[:3] != v.packed.shape[:3]:
        return f"q {tuple(q.shape)}, k {tuple(k.packed.shape)}, v {tuple(v.packed.shape)} disagree"
    Hkv = k.packed.shape[1]
    if Hq % Hkv:
        return f"{Hq} query heads over {Hkv} kv heads"
    reason = shape_reason(Hq // Hkv, D, k.bits, k.group_size)
    if reason:
        return reason
    stages, tpw = default_launch(D, k.bits)
    if shared_bytes(D, k.bits, Hq // Hkv, D // k.group_size, stages, tpw) > SMEM_BYTES:
        return "the ring does not fit in shared memory"
    for name, t in (("k", k), ("v", v)):
        if t.scales.dtype != q.dtype or t.biases.dtype != q.dtype:
            return f"{name} scales/biases are {t.scales.dtype}, q is {q.dtype}"
        reason = _tma_reason(name, t)
        if reason:
            return reason
    return None


def _tma_reason(name: str, t: QuantizedTensor) -> str | None:
    """TMA: 16-byte aligned bases and strides, unit last stride (scales/biases are read as
    16-byte rows of 8 values, so tokens × groups must be contiguous and fill whole rows)."""
    p = t.packed
    if p.stride(-1) != 1 or any(st * 4 % 16 for st in p.stride()[:-1]) or p.data_ptr() % 16:
        return f"{name}.packed strides {p.stride()} are not TMA-describable"
    NG = t.scales.shape[-1]
    for part_name, s in (("scales", t.scales), ("biases", t.biases)):
        if s.stride(-1) != 1 or s.stride(-2) != NG or s.shape[-2] * NG % 8:
            return f"{name}.{part_name} needs tokens × groups contiguous (strides {s.stride()})"
        if any(st * 2 % 16 for st in s.stride()[:2]) or s.data_ptr() % 16:
            return f"{name}.{part_name} strides {s.stride()} are not 16-byte aligned"
    return None


def _descriptors(t: QuantizedTensor, bn: int, wc: int):
    B, H, N, W = t.packed.shape
    words = t.packed.view(torch.int32)
    w_layout = gl.NVMMASharedLayout.get_default_for([1, 1, bn, wc], gl.int32)
    wdesc = TensorDescriptor(words, [B, H, N, W], list(words.stride()), [1, 1, bn, wc], w_layout)
    NG = t.scales.shape[-1]
    rows = N * NG // 8
    s_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=4)
    sb = []
    for x in (t.scales, t.biases):
        sb.append(TensorDescriptor(x, [B, H, rows, 8], [x.stride(0), x.stride(1), 8, 1],
                                   [1, 1, bn * NG // 8, 8], s_layout))
    return wdesc, sb[0], sb[1]


def kernel_constants(G: int, D: int, bits: int, group: int, dtype: torch.dtype, stages: int,
                     tpw: int, split: int, hkv: int, window: bool, softcap: bool,
                     gdc: bool) -> dict:
    """The constexpr arguments of `_ws_split_kernel` (also used by bench/sass_report.py)."""
    NG = D // group
    words = D * bits // 32
    wc = min(words, MAX_CHUNK_WORDS)
    lo, hi, off = code_bases(bits, dtype)
    return {"HKV": hkv, "G": G, "NG": NG, "BITS": bits, "NCH": words // wc, "WC": wc, "TPW": tpw,
            "STAGES": stages, "SPLIT_N": split, "WINDOW": window, "SOFTCAP": softcap, "GDC": gdc,
            "CONSUMER_REGS": CONSUMER_REGS, "LO": lo, "HI": hi,
            "OFF": off, "P3": score_layout(tpw, G, NG)}


# Registers per consumer thread (setmaxnreg); the launch cap MAXNREG gives the default
# partition the rest: 8 warps × 128 registers keeps two programs per SM.
CONSUMER_REGS = 192
MAXNREG = 128


def kernel():
    """The Gluon split kernel (None without Gluon)."""
    return _ws_split_kernel if gluon is not None else None


def launch_split_ws(q, k, v, lengths, part_o, part_ml, n_splits, split, qk_scale_log2, softcap,
                    window, gdc, stages=None, tokens_per_warp=None, supported=False):
    """Write the split partials of `decode_attention_quantized_kv`'s contract for
    (n_splits, B·Hkv) programs. ``softcap``: float or None (then ``qk_scale_log2`` is
    scale·log2 e; with it, the plain scale, as in decode_attention.py); ``window``: int,
    0 for none. ``supported``:
    the caller has had None from `ws_unsupported_reason` for these inputs."""
    reason = None if supported else ws_unsupported_reason(q, k, v)
    if reason:
        raise ValueError(f"decode_attention_ws cannot take these inputs: {reason}")
    B, Hq, D = q.shape
    Hkv = k.packed.shape[1]
    G = Hq // Hkv
    d_stages, d_tpw = default_launch(D, k.bits)
    stages, tpw = stages or d_stages, tokens_per_warp or d_tpw
    bn = CONSUMERS * tpw
    if split % bn:
        raise ValueError(f"split {split} is not a multiple of the {bn}-token stage")
    words = D * k.bits // 32
    wc = min(words, MAX_CHUNK_WORDS)
    kw, ks, kb = _descriptors(k, bn, wc)
    vw, vs, vb = _descriptors(v, bn, wc)
    consts = kernel_constants(G, D, k.bits, k.group_size, q.dtype, stages, tpw, split, Hkv,
                              bool(window), softcap is not None, gdc)
    _ws_split_kernel[(n_splits, B * Hkv)](
        q, kw, vw, ks, kb, vs, vb, lengths, part_o, part_ml,
        q.stride(0), q.stride(1), n_splits, float(qk_scale_log2), float(softcap or 1.0),
        int(window or 0), **consts, num_warps=4, maxnreg=MAXNREG,
        **({"launch_pdl": True} if gdc else {}))
