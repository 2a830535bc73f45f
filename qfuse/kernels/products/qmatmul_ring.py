"""y = x·dequant(W)ᵀ for 1–32 bf16 rows, the fragment-ordered 4-bit weights streamed
through a shared-memory ring by TMA (Hopper, Gluon).

The arithmetic is `qmatmul_mma`'s, instruction for instruction (the same inline-PTX
steps: the codes as the mma's A operand, Σx from the all-ones mma, the scales out of
each group's sum), and the split of K is chosen the same way, so for the same split the
two kernels give the same bits. What differs is how the weights arrive. In
`qmatmul_mma` each warp loads its next blocks into registers, so the bytes in flight
per SM are bounded by the register file; here a producer warp keeps STAGES stages of
(TT row tiles × CB blocks) in flight with TMA, whatever the consumers hold, and issues
the first stages before the kernel waits on the previous one (PDL): the weights do not
depend on it, so they stream while it drains.

Per program (grid: row-tile groups × 1 × splits of K): the default partition (one
warp) is the producer: words [T, KB, 128] int32 (a view of `FragmentWeight.words`) one
box [TT, 1, 128] per block, scales and biases one box [TT, groups, 8] per stage, onto
ready/empty mbarriers. Four 1-warp consumer partitions each own one row tile: they wait
on the previous kernel (``gdc_wait``) before reading x, take each stage's words and
scales into registers (one 16-byte shared load per block and thread), release the
stage, and run the mma steps. A thread's registers hold its lane's four words, so the
tensors are [8 (g), 4 (q), 4] with the last dimension in-thread, and the inline PTX
packs four elements per operand.

Split K meets without a block barrier: every thread owns fixed outputs, writes its
partials, and counts its own arrival on its own semaphore (acq_rel); the thread whose
count is the last sums the planes in split order. Deterministic; a row's result does not
depend on the batch (the split depends on N, K and the GPU only). The first call for a
weight must run eagerly (the semaphores and the cached descriptors); then calls can be
captured in a CUDA graph. `unsupported_reason` says what is refused.
"""

from __future__ import annotations

import functools

import torch
import triton

from ..common.gluon_hopper import (  # optional: gluon is None without it (GLUON_ERROR)
    GLUON_ERROR,
    TensorDescriptor,
    fence_async_shared,
    gdc_launch_dependents,
    gdc_wait,
    gl,
    gluon,
    mbarrier,
    tma,
)
from ..common.pdl import enabled as pdl_enabled
from .fragments import BLOCK_K, TILE_N, FragmentWeight
from .qmatmul_mma import MAX_ROWS, column_step_asm, extract_asm, group_step_asm
from .splitk import (
    SEMAPHORE_SLOTS,
    k_shares,
    semaphores,
    sm_count,
    split_workspace,
    start_product,
    tma_fragment_reason,
)

CONSUMERS = 4  # 1-warp consumer partitions per program, one row tile each
# Launch defaults (bench/NOTES.md, "Quantized products"): blocks per stage, stages, and
# programs per SM that the split of K aims at.
BLOCKS_PER_STAGE = 4
STAGES = 4
PROGRAMS_PER_SM = 2
# Registers per thread at launch: ptxas holds every partition to it, so it is set by
# what the consumers need (no spill at 1-8 rows with 80); 8 warps × 80 leave room for
# three programs per SM, or the next kernel's programs beside this one's. The consumers
# take 32 more (16 with two warps a tile) from the producer's partition, which keeps 48.
MAXNREG_ONE_TILE = 80
MAXNREG_MORE_TILES = 128
SMEM_BYTES = 227 * 1024

# The asm operands with four elements packed per operand (see the module docstring).
_GROUP_STEP_ASM4 = group_step_asm(scales=16, biases=20, acc=24)
_EXTRACT_ASM4 = extract_asm()
_COLUMN_STEP_ASM4 = column_step_asm(scales=28, biases=32, acc=36)


if gluon is not None:
    from triton.runtime.jit import constexpr_function

    # A consumer warp's tensors: [8 (g), 4 (q), 4] with the last dimension in-thread (lane
    # 4g + q), its slices, and a lane's four words as shared memory holds them.
    _L3 = gl.constexpr(gl.BlockedLayout([1, 1, 4], [8, 4, 1], [1, 1, 1], [2, 1, 0]))
    _L2 = gl.constexpr(gl.SliceLayout(2, _L3))
    _LG = gl.constexpr(gl.SliceLayout(1, _L2))
    _LQ = gl.constexpr(gl.SliceLayout(0, _L2))
    _LR = gl.constexpr(gl.SliceLayout(0, gl.SliceLayout(1, _L3)))
    _LW = gl.constexpr(gl.BlockedLayout([1, 4], [32, 1], [1, 1], [1, 0]))

    @constexpr_function
    def _asm(name):
        return {"group": _GROUP_STEP_ASM4, "extract": _EXTRACT_ASM4,
                "column": _COLUMN_STEP_ASM4}[name]

    @gluon.jit
    def _group_step(w, xlo, xhi, s, b, acc):
        return gl.inline_asm_elementwise(
            _asm("group"), "=f,=f,=f,=f" + ",r" * 20 + ",f,f,f,f",
            [w, xlo, xhi, s, b, acc], dtype=gl.float32, is_pure=True, pack=4)

    @gluon.jit
    def _extract(w):
        return gl.inline_asm_elementwise(
            _asm("extract"), "=r," * 15 + "=r" + ",r,r,r,r", [w],
            dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=4)

    @gluon.jit
    def _column_step(a, xlo, xhi, s, b, acc):
        return gl.inline_asm_elementwise(
            _asm("column"), "=f,=f,=f,=f" + ",r" * 32 + ",f,f,f,f",
            [a[0], a[1], a[2], a[3], xlo, xhi, s, b, acc], dtype=gl.float32, is_pure=True,
            pack=4)

    @gluon.jit
    def issue_stage(w_desc, s_desc, b_desc, w_s, s_s, b_s, ready, empty, i, tile0, kb,
                    GROUP: gl.constexpr, TT: gl.constexpr, CB: gl.constexpr,
                    STAGES: gl.constexpr):
        """Ring step ``i`` (counted over the ring's whole life, so `ring_chain` keeps
        counting across products): wait for its slot to be free, then the TMA copies of
        blocks kb..kb + CB of row tiles tile0..tile0 + TT, with their scales and biases."""
        NBYTES: gl.constexpr = TT * CB * 512 + 2 * TT * (CB * 64 // GROUP) * 32
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        fence_async_shared()  # the consumers' shared loads of this slot come first
        bar = ready.index(s)
        mbarrier.expect(bar, NBYTES)
        for c in gl.static_range(CB):
            tma.async_copy_global_to_shared(w_desc, [tile0, kb + c, 0], bar,
                                            w_s.index(s * CB + c))
        g0 = kb * 64 // GROUP
        tma.async_copy_global_to_shared(s_desc, [tile0, g0, 0], bar, s_s.index(s))
        tma.async_copy_global_to_shared(b_desc, [tile0, g0, 0], bar, b_s.index(s))

    @gluon.jit
    def _producer(w_desc, s_desc, b_desc, w_s, s_s, b_s, ready, empty, tile0, kb_lo, n_steps,
                  GROUP: gl.constexpr, TT: gl.constexpr, CB: gl.constexpr,
                  STAGES: gl.constexpr):
        """Default partition (four warps, a multiple Gluon requires; one thread issues the
        copies): each stage's TMA copies."""
        for i in range(n_steps):
            issue_stage(w_desc, s_desc, b_desc, w_s, s_s, b_s, ready, empty, i, tile0,
                        kb_lo + i * CB, GROUP, TT, CB, STAGES)

    @gluon.jit
    def ring_views(w_s, s_s, b_s, GROUP: gl.constexpr, TT: gl.constexpr, CB: gl.constexpr,
                   STAGES: gl.constexpr):
        """The ring as the consumers read it: the same bytes, flat per stage (a stage is
        CB boxes [TT, 1, 128] of words, then [TT, CB·64/GROUP, 8] of scales and of
        biases)."""
        GPS: gl.constexpr = CB // (GROUP // 64)  # scale groups per stage
        FLAT2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        FLAT1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        w_flat = w_s._reinterpret(gl.int32, [STAGES, CB * TT * 32, 4], FLAT2)
        s_flat = s_s._reinterpret(gl.int32, [STAGES, TT * GPS * 8], FLAT1)
        b_flat = b_s._reinterpret(gl.int32, [STAGES, TT * GPS * 8], FLAT1)
        return w_flat, s_flat, b_flat

    @gluon.jit
    def lane_indices():
        """A consumer lane's coordinates in its warp's [8 (g), 4 (q), 4] tensors, and
        zeros of that shape."""
        g = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=_LG), 1), 2)
        q = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=_LQ), 0), 2)
        r = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=_LR), 0), 1)
        zero_i = gl.zeros([8, 4, 4], gl.int32, _L3)
        return g, q, r, zero_i

    @gluon.jit
    def x_offsets(g, q, r, zero_i, M, KB, kb_lo, NT: gl.constexpr):
        """Offsets (int32 words of x [M, KB·64] bf16) of a lane's x pairs, one tensor per
        column tile: B column g of column tile nt is row 8·nt + g of x (the last row past
        M, never stored); a thread's x pairs of a block: 4 at q·8 and 4 at q·8 + 4."""
        x_offs = ()
        for nt in gl.static_range(NT):
            row = gl.minimum(8 * nt + g, M - 1)
            x_offs = x_offs + (row * (KB * 32) + q * 8 + r + zero_i + kb_lo * 32,)
        return x_offs

    @gluon.jit
    def consume_steps(x_ptr, x_offs, acc, w_flat, s_flat, b_flat, ready, empty, i0, n_steps,
                      wid: gl.constexpr, half: gl.constexpr, KW: gl.constexpr,
                      GROUP: gl.constexpr, TT: gl.constexpr, CB: gl.constexpr,
                      STAGES: gl.constexpr, NT: gl.constexpr):
        """One warp's mma steps over n_steps ring stages from ring step ``i0`` (the
        producer's count), the x columns from x_offs on: each stage's words and scales
        into registers, the stage released, then the blocks in order onto ``acc``."""
        PER_GROUP: gl.constexpr = GROUP // 64  # blocks per scale group
        GPS: gl.constexpr = CB // PER_GROUP  # scale groups per stage
        zero_i = gl.zeros([8, 4, 4], gl.int32, _L3)
        for i in range(n_steps):
            s = (i0 + i) % STAGES
            mbarrier.wait(ready.index(s), ((i0 + i) // STAGES) & 1)
            words = ()
            for c in gl.static_range(half, CB, KW):
                w2 = w_flat.index(s).slice((c * TT + wid) * 32, 32).load(_LW)
                words = words + (gl.convert_layout(gl.reshape(w2, [8, 4, 4]), _L3),)
            scales = ()
            biases = ()
            for gi in gl.static_range(GPS):
                sv = s_flat.index(s).slice((wid * GPS + gi) * 8, 8).load(_LG)
                bv = b_flat.index(s).slice((wid * GPS + gi) * 8, 8).load(_LG)
                scales = scales + (gl.expand_dims(gl.expand_dims(sv, 1), 2) + zero_i,)
                biases = biases + (gl.expand_dims(gl.expand_dims(bv, 1), 2) + zero_i,)
            mbarrier.arrive(empty.index(s), count=1)  # the stage is in registers now
            for c in gl.static_range(half, CB, KW):
                sc = scales[c // PER_GROUP]
                bi = biases[c // PER_GROUP]
                col = (i * CB + c) * 32
                if NT == 1:
                    xlo = gl.load(x_ptr + x_offs[0] + col)
                    xhi = gl.load(x_ptr + x_offs[0] + col + 4)
                    acc = (_group_step(words[c // KW], xlo, xhi, sc, bi, acc[0]),)
                else:
                    a = _extract(words[c // KW])
                    stepped = ()
                    for nt in gl.static_range(NT):
                        xlo = gl.load(x_ptr + x_offs[nt] + col)
                        xhi = gl.load(x_ptr + x_offs[nt] + col + 4)
                        stepped = stepped + (_column_step(a, xlo, xhi, sc, bi, acc[nt]),)
                    acc = stepped
        return acc

    @gluon.jit
    def _consumer(x_ptr, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, w_s, s_s, b_s,
                  ready, empty, M, N, KB, tile0, kb_lo, n_steps, stride_ym, stride_rm,
                  red, wid: gl.constexpr, half: gl.constexpr, KW: gl.constexpr,
                  GROUP: gl.constexpr, TT: gl.constexpr, CB: gl.constexpr,
                  STAGES: gl.constexpr, NT: gl.constexpr, SPLIT: gl.constexpr,
                  HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, GDC: gl.constexpr):
        """One warp: row tile tile0 + wid over the program's share of K (with KW warps a
        tile, the blocks c of every stage with c % KW == half), then its outputs (the
        warp of half 0, after adding the other's accumulators: a fixed order)."""
        w_flat, s_flat, b_flat = ring_views(w_s, s_s, b_s, GROUP, TT, CB, STAGES)
        g, q, r, zero_i = lane_indices()
        if GDC:
            gdc_wait()  # x and the residual come from the kernels before
        x_offs = x_offsets(g, q, r, zero_i, M, KB, kb_lo, NT)
        acc = ()
        for nt in gl.static_range(NT):
            acc = acc + (gl.zeros([8, 4, 4], gl.float32, _L3),)
        acc = consume_steps(x_ptr, x_offs, acc, w_flat, s_flat, b_flat, ready, empty, 0,
                            n_steps, wid, half, KW, GROUP, TT, CB, STAGES, NT)
        if KW > 1:
            red_s, done = red
            if half == 1:
                for nt in gl.static_range(NT):
                    red_s.slice((wid * NT + nt) * 8, 8).store(acc[nt])
                mbarrier.arrive(done.index(wid), count=1)
            else:
                mbarrier.wait(done.index(wid), 0)
                summed = ()
                for nt in gl.static_range(NT):
                    summed = summed + (acc[nt] + red_s.slice((wid * NT + nt) * 8, 8).load(_L3),)
                acc = summed
        if half == 0:
            store_outputs(y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, acc, g, q, r, M, N,
                          tile0 + wid, gl.program_id(0), gl.program_id(2), stride_ym,
                          stride_rm, wid, TT, NT, SPLIT, HAS_BIAS, HAS_RES)

    @gluon.jit
    def store_outputs(y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, acc, g, q, r, M, N, tile,
                      pid0, pid_k, stride_ym, stride_rm, wid: gl.constexpr, TT: gl.constexpr,
                      NT: gl.constexpr, SPLIT, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr):
        """One warp's outputs of row tile ``tile`` (of row-tile group pid0, split pid_k):
        through the split planes when K is split (the thread whose own count is last sums
        them), bias, residual, y. ``SPLIT`` may be a constexpr or a runtime value (the
        chain's). Returns which lanes stored ([8, 4]: all of them without a split)."""
        # acc[nt][g, q, i]: output row 16·tile + g + 8·(i // 2), row of x 8·nt + 2q + i % 2
        n = tile * 16 + g + 8 * (r // 2)
        last = gl.full([8, 4], 1, gl.int1, _L2)
        # this thread's partials are released by its own count (no block barrier)
        sem = sem_ptr + (pid0 * TT + wid) * 32 + gl.expand_dims(
            gl.arange(0, 8, layout=_LG), 1) * 4 + gl.expand_dims(gl.arange(0, 4, layout=_LQ), 0)
        one = gl.full([8, 4], 1, gl.int32, _L2)
        if SPLIT > 1:
            for nt in gl.static_range(NT):
                m = 8 * nt + 2 * q + r % 2
                ok = (n < N) & (m < M)
                gl.store(ws_ptr + pid_k * (M * N) + m * N + n, acc[nt], mask=ok)
            last = gl.atomic_add(sem, one, sem="acq_rel", scope="gpu") == SPLIT - 1
        last3 = gl.expand_dims(last, 2)
        for nt in gl.static_range(NT):
            m = 8 * nt + 2 * q + r % 2
            ok = (n < N) & (m < M) & last3
            a = acc[nt]
            if SPLIT > 1:  # every split's partial, in split order (deterministic)
                a = gl.zeros([8, 4, 4], gl.float32, _L3)
                for sp in range(SPLIT):
                    a += gl.load(ws_ptr + sp * (M * N) + m * N + n, mask=ok, other=0.0,
                                 cache_modifier=".cg")
            if HAS_BIAS:
                a += gl.load(bias_ptr + n, mask=ok, other=0.0).to(gl.float32)
            if HAS_RES:
                # Rounded as compat rounds: the projection to bf16 first, then the sum.
                a = a.to(gl.bfloat16).to(gl.float32) + gl.load(
                    res_ptr + m.to(gl.int64) * stride_rm + n, mask=ok, other=0.0).to(gl.float32)
            gl.store(y_ptr + m.to(gl.int64) * stride_ym + n, a.to(gl.bfloat16), mask=ok)
        if SPLIT > 1:
            gl.atomic_xchg(sem, one * 0, mask=last, sem="relaxed", scope="gpu")
        return last

    @gluon.jit
    def _qmm_ring_kernel(x_ptr, w_desc, s_desc, b_desc, y_ptr, bias_ptr, res_ptr, ws_ptr,
                         sem_ptr, M, N, KB, BPP, stride_ym, stride_rm,
                         GROUP: gl.constexpr, CB: gl.constexpr, STAGES: gl.constexpr,
                         NT: gl.constexpr, SPLIT: gl.constexpr,
                         KW: gl.constexpr,
                         HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, GDC: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr):
        if GDC:
            gdc_launch_dependents()
        TT: gl.constexpr = 4  # row tiles per program, KW consumer warps each
        tile0 = gl.program_id(0) * TT
        kb_lo = gl.program_id(2) * BPP
        n_steps = (gl.minimum(kb_lo + BPP, KB) - kb_lo) // CB  # whole: the launcher's choice
        w_s = gl.allocate_shared_memory(gl.int32, [STAGES * CB] + w_desc.block_type.shape,
                                        w_desc.layout)
        s_s = gl.allocate_shared_memory(gl.int32, [STAGES] + s_desc.block_type.shape,
                                        s_desc.layout)
        b_s = gl.allocate_shared_memory(gl.int32, [STAGES] + b_desc.block_type.shape,
                                        b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=TT * KW)
        # one entry per partition, spelled out: a kernel body takes no comprehension
        if KW == 1:
            red = (w_s, ready)  # unused
            gl.warp_specialize([
                (_producer, (w_desc, s_desc, b_desc, w_s, s_s, b_s, ready, empty, tile0, kb_lo,
                             n_steps, GROUP, TT, CB, STAGES)),
                (_consumer, (x_ptr, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, w_s, s_s, b_s, ready,
                             empty, M, N, KB, tile0, kb_lo, n_steps, stride_ym, stride_rm, red,
                             0, 0, KW, GROUP, TT, CB, STAGES, NT, SPLIT, HAS_BIAS, HAS_RES, GDC)),
                (_consumer, (x_ptr, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, w_s, s_s, b_s, ready,
                             empty, M, N, KB, tile0, kb_lo, n_steps, stride_ym, stride_rm, red,
                             1, 0, KW, GROUP, TT, CB, STAGES, NT, SPLIT, HAS_BIAS, HAS_RES, GDC)),
                (_consumer, (x_ptr, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, w_s, s_s, b_s, ready,
                             empty, M, N, KB, tile0, kb_lo, n_steps, stride_ym, stride_rm, red,
                             2, 0, KW, GROUP, TT, CB, STAGES, NT, SPLIT, HAS_BIAS, HAS_RES, GDC)),
                (_consumer, (x_ptr, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, w_s, s_s, b_s, ready,
                             empty, M, N, KB, tile0, kb_lo, n_steps, stride_ym, stride_rm, red,
                             3, 0, KW, GROUP, TT, CB, STAGES, NT, SPLIT, HAS_BIAS, HAS_RES, GDC)),
            ], [1, 1, 1, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS])
        else:
            # the second warp of each tile hands its accumulators over in shared memory
            RED: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
            # shared shapes are powers of two: 3 column tiles (17-24 rows) get room for 4
            RED_NT: gl.constexpr = 4 if NT > 2 else NT
            red_s = gl.allocate_shared_memory(gl.float32, [TT * RED_NT * 8, 4, 4], RED)
            done = gl.allocate_shared_memory(gl.int64, [TT, 1], mbarrier.MBarrierLayout())
            for t in gl.static_range(TT):
                mbarrier.init(done.index(t), count=1)
            red = (red_s, done)
            gl.warp_specialize([
                (_producer, (w_desc, s_desc, b_desc, w_s, s_s, b_s, ready, empty, tile0, kb_lo,
                             n_steps, GROUP, TT, CB, STAGES)),
                (_consumer, (x_ptr, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, w_s, s_s, b_s, ready,
                             empty, M, N, KB, tile0, kb_lo, n_steps, stride_ym, stride_rm, red,
                             0, 0, KW, GROUP, TT, CB, STAGES, NT, SPLIT, HAS_BIAS, HAS_RES, GDC)),
                (_consumer, (x_ptr, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, w_s, s_s, b_s, ready,
                             empty, M, N, KB, tile0, kb_lo, n_steps, stride_ym, stride_rm, red,
                             1, 0, KW, GROUP, TT, CB, STAGES, NT, SPLIT, HAS_BIAS, HAS_RES, GDC)),
                (_consumer, (x_ptr, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, w_s, s_s, b_s, ready,
                             empty, M, N, KB, tile0, kb_lo, n_steps, stride_ym, stride_rm, red,
                             2, 0, KW, GROUP, TT, CB, STAGES, NT, SPLIT, HAS_BIAS, HAS_RES, GDC)),
                (_consumer, (x_ptr, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, w_s, s_s, b_s, ready,
                             empty, M, N, KB, tile0, kb_lo, n_steps, stride_ym, stride_rm, red,
                             3, 0, KW, GROUP, TT, CB, STAGES, NT, SPLIT, HAS_BIAS, HAS_RES, GDC)),
                (_consumer, (x_ptr, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, w_s, s_s, b_s, ready,
                             empty, M, N, KB, tile0, kb_lo, n_steps, stride_ym, stride_rm, red,
                             0, 1, KW, GROUP, TT, CB, STAGES, NT, SPLIT, HAS_BIAS, HAS_RES, GDC)),
                (_consumer, (x_ptr, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, w_s, s_s, b_s, ready,
                             empty, M, N, KB, tile0, kb_lo, n_steps, stride_ym, stride_rm, red,
                             1, 1, KW, GROUP, TT, CB, STAGES, NT, SPLIT, HAS_BIAS, HAS_RES, GDC)),
                (_consumer, (x_ptr, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, w_s, s_s, b_s, ready,
                             empty, M, N, KB, tile0, kb_lo, n_steps, stride_ym, stride_rm, red,
                             2, 1, KW, GROUP, TT, CB, STAGES, NT, SPLIT, HAS_BIAS, HAS_RES, GDC)),
                (_consumer, (x_ptr, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, w_s, s_s, b_s, ready,
                             empty, M, N, KB, tile0, kb_lo, n_steps, stride_ym, stride_rm, red,
                             3, 1, KW, GROUP, TT, CB, STAGES, NT, SPLIT, HAS_BIAS, HAS_RES, GDC)),
            ], [1, 1, 1, 1, 1, 1, 1, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS,
                                          CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS])


# Where the ring kernel is the default (bench/NOTES.md, "Quantized products", stop 34,
# `qfuse bench products --quick`): at 1-8 rows it was faster only where K needs no split
# and the grid is many waves deep (the 262144-row head: 86% of copy against 78%), slower
# at the layer products, whose grids are one wave; at 9-32 rows the opposite: faster at
# every layer product (Gemma O 13.9 against 22.3 µs, gate+up 82 against 102), slower at
# the head. One threshold on the grid's depth separates the two.
MANY_WAVES_PROGRAMS_PER_SM = 8
ONE_TILE_ROWS = 8


def preferred(x: torch.Tensor, f: FragmentWeight) -> bool:
    """Whether the decode path should take the ring kernel for this product (the rule
    above), before `unsupported_reason` is asked."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 1 <= rows <= MAX_ROWS or x.device.type != "cuda":
        return False
    ls = ring_shape(f.n, f.k, f.group_size, x.device)
    many_waves = ls["grid"][0] >= MANY_WAVES_PROGRAMS_PER_SM * sm_count(x.device)
    if rows <= ONE_TILE_ROWS:
        return ls["SPLIT"] == 1 and many_waves
    return not many_waves


def kernel():
    """The Gluon product kernel (None without Gluon)."""
    return _qmm_ring_kernel if gluon is not None else None


def unsupported_reason(x: torch.Tensor, w) -> str | None:
    """None when the ring kernel can take x·dequant(w)ᵀ, else why not."""
    if gluon is None:
        return f"Gluon is not importable ({GLUON_ERROR})"
    return tma_fragment_reason(x, w, "ring kernel, inline-PTX mma.sync", MAX_ROWS)


@functools.lru_cache(maxsize=1024)  # on the decode path: a handful of shapes per model
def ring_shape(N: int, K: int, group_size: int, device: torch.device, cb: int | None = None,
               stages: int | None = None, per_sm: int | None = None,
               split: int | None = None, kw: int = 1) -> dict:
    """Grid and constants of a launch: K split so that about ``per_sm`` programs per SM
    are in the grid, each share whole stages of ``cb`` blocks. Depends on N, K and the
    GPU only (never on the rows). ``split`` overrides the split (tests, and the bitwise
    comparison with `qmatmul_mma` at the same split). ``kw``: consumer warps per row tile
    (2: each takes every other block of a stage; the sum then differs from
    `qmatmul_mma`'s in order)."""
    T = triton.cdiv(N, TILE_N)
    KB = K // BLOCK_K
    per_group = max(1, group_size // BLOCK_K)
    cb = max(cb or BLOCKS_PER_STAGE, per_group * kw)
    while KB % cb or cb % (per_group * kw):
        cb //= 2
    if cb == 0:
        raise ValueError(f"{KB} blocks do not split over {kw} warps a tile in whole groups")
    stages = stages or STAGES
    programs = triton.cdiv(T, CONSUMERS)
    split, bpp = k_shares(KB, cb, programs, per_sm or PROGRAMS_PER_SM, sm_count(device), split)
    if split > 1 and programs * CONSUMERS * 32 > SEMAPHORE_SLOTS:
        split, bpp = 1, KB
    return {"grid": (programs, 1, split), "CB": cb, "STAGES": stages, "SPLIT": split,
            "BPP": bpp, "KW": kw}


def stage_bytes(cb: int, group_size: int) -> int:
    """Bytes of one ring stage: CB blocks of the CONSUMERS row tiles, their scales and
    biases (`issue_stage`'s NBYTES)."""
    return CONSUMERS * cb * 512 + 2 * CONSUMERS * (cb * 64 // group_size) * 32


def shared_bytes(cb: int, stages: int, group_size: int) -> int:
    """Shared memory of one program: the ring and its barriers."""
    return stages * (stage_bytes(cb, group_size) + 16)


def descriptors(f: FragmentWeight, cb: int):
    """TMA descriptors of the words ([T, KB, 128], a box per block) and the scales and
    biases ([T, groups, 8], a box per stage), made once per weight and stage size."""
    def make(f):
        T, KB = f.words.shape[:2]
        flat = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
        words = f.words.view(T, KB, 128)
        wd = TensorDescriptor(words, [T, KB, 128], [KB * 128, 128, 1], [CONSUMERS, 1, 128], flat)
        G = f.scales.shape[1]
        gps = cb * BLOCK_K // f.group_size
        sd = TensorDescriptor(f.scales, [T, G, 8], [G * 8, 8, 1], [CONSUMERS, gps, 8], flat)
        bd = TensorDescriptor(f.biases, [T, G, 8], [G * 8, 8, 1], [CONSUMERS, gps, 8], flat)
        return wd, sd, bd
    return f.derived(f"ring_descriptors:{cb}", make)


def qmatmul_ring(x: torch.Tensor, f: FragmentWeight, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, pdl: bool | None = None,
                 checked: bool = False, **shape) -> torch.Tensor:
    """x [..., K] bf16 (1..32 rows) → residual + x·dequant(f)ᵀ + bias [..., N] bf16, as
    `qmatmul_mma` computes it. ``shape``: `ring_shape`'s overrides. ``checked``: the
    caller has had None from `unsupported_reason` for inputs of this layout."""
    x2, y, bias, res2 = start_product(x, f, bias, residual, "qmatmul_ring",
                                     None if checked else unsupported_reason)
    K, N, M = f.k, f.n, x2.shape[0]
    if N == 0:
        return y.reshape(*x.shape[:-1], N)
    ls = ring_shape(N, K, f.group_size, x.device, **shape)
    wd, sd, bd = descriptors(f, ls["CB"])
    ws = split_workspace(ls["SPLIT"], (M, N), y)
    gdc = pdl_enabled(x.device) if pdl is None else pdl
    maxnreg = MAXNREG_ONE_TILE if M <= ONE_TILE_ROWS else MAXNREG_MORE_TILES
    _qmm_ring_kernel[ls["grid"]](
        x2.view(torch.int32), wd, sd, bd, y, bias if bias is not None else y, res2, ws,
        semaphores(x.device), M, N, f.words.shape[1], ls["BPP"],
        y.stride(0), res2.stride(0),
        GROUP=f.group_size, CB=ls["CB"], STAGES=ls["STAGES"], NT=triton.cdiv(M, 8),
        SPLIT=ls["SPLIT"], KW=ls["KW"], HAS_BIAS=bias is not None, HAS_RES=residual is not None, GDC=gdc,
        CONSUMER_REGS=maxnreg + 32 // ls["KW"], num_warps=4, maxnreg=maxnreg,
        **({"launch_pdl": True} if gdc else {}))
    return y.reshape(*x.shape[:-1], N)
