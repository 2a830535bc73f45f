"""y = x·dequant(W)ᵀ for 33–256 bf16 rows over fragment-ordered 4-bit weights, on the
warpgroup tensor cores of Hopper (wgmma, Gluon): the batched product of serving.

Contract (`qmatmul_wgmma`): x [..., K] bf16 with 1..MAX_ROWS rows (the decode path
sends it 33 and more); the weight a `fragments.FragmentWeight` [N, K] (4-bit, groups of
64 or 128, bf16 scales), the form the decode products already hold, so a loaded model
keeps one copy; bias [N] and residual [..., N] bf16 or None; y [..., N] bf16. Fast tier:
each weight is dequantized to bf16 once (s·q + b rounded once, as `qmatmul_tc`), the
sums in float32 on the tensor cores. A row's result does not depend on the rows beside
it: every row takes the same k order and the same split of K (chosen from N, K and the
GPU only, never from the rows). Needs sm_90; `unsupported_reason` says what is refused.

The weight is the A operand, straight from registers. In fragment order a thread's one
16-byte load holds the A registers of four k16 steps of `mma.sync.m16n8k16`, and a
warpgroup mma takes A from registers in the same per-warp layout: warp w of the
warpgroup supplies rows 16w..16w+15 of the 64-row A tile. So each thread turns its words
into bf16 pairs in place (a LOP3 per pair for 128 + c, then two packed FMAs: −128, then
·s + b) and no shared memory or shuffle sits between the load and the mma. The mma
reads its k16 slots in the fragment's order, which is a permutation of K within each
64-column block (`fragments`: slot 16j + 8h + 2q + e is column 16q + 4j + 2h + e), so x
is permuted the same way once per call (`permuted_rows`, one copy of x) and streamed
by TMA into a ring of shared-memory stages as the B operand ([rows, 64] boxes, rows past
M zero-filled).

Per program (grid: 64·WG weight rows × BLOCK_M rows of x × splits of K): WG warpgroups
(4·WG warps, one 16-row fragment tile each), an accumulator [64·WG, BLOCK_M] in float32.
Each step of CB blocks: x, the words, the scales and the biases arrive by TMA in one
ring of STAGES shared-memory stages (as many as fit), so STAGES - 1 steps are in flight
while this one's blocks are dequantized and multiplied, each block's mma running while
the next block is dequantized. A step ends with its mmas drained and its stage refilled:
an mma still in flight across the loop's back edge, or across the refill's barriers,
makes ptxas serialize every mma of the loop (C7513/C7515), which costs more than the
drain. Split K meets as the other products' splits do: partial
planes, one semaphore per output tile, the last program sums in split order.
"""

from __future__ import annotations

import functools

import torch
import triton

from ..common.gluon_hopper import (  # optional: gluon is None without it (GLUON_ERROR)
    GLUON_ERROR,
    TensorDescriptor,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from .fragments import BLOCK_K, TILE_N, FragmentWeight
from .splitk import (
    MAX_SEMAPHORES,
    k_shares,
    semaphores,
    sm_count,
    split_workspace,
    start_product,
    tma_fragment_reason,
)

MAX_ROWS = 256  # the widest wgmma (n = 256) covers them in one row block
# Launch defaults by row block (bench/NOTES.md, "Batched rows"): warpgroups per program,
# blocks per step, programs resident per SM (the ring takes as many stages as fit in
# their share of shared memory), and whether the warp-specialized variant (``ws``) runs:
# at 128 and 256 rows it is 7-20% faster; at 64 rows, one warpgroup, the two tie.
ROW_BLOCK_SHAPES = {64: {"wg": 1, "cb": 4, "per_sm": 2, "ws": False},
                    128: {"wg": 2, "cb": 4, "per_sm": 1, "ws": True},
                    256: {"wg": 2, "cb": 2, "per_sm": 1, "ws": True}}
# mmas left in flight while the next block is dequantized, at every row block (the
# sweep's 0: each block's mma waited for first)
MMAS_IN_FLIGHT = 1
# The warp-specialized variant (``ws``; the default at 128 and 256 rows: bench/NOTES.md,
# "Batched rows"): registers a consumer thread asks for by row block (the accumulator is
# 64·rows/128 of them), and the fewest the producer's four warps keep.
CONSUMER_REGS = {64: 128, 128: 200, 256: 232}
PRODUCER_REGS = 40
REGISTER_FILE = 65536  # 32-bit registers an SM holds


def ws_registers(wg: int, per_sm: int, block_m: int) -> tuple[int, int]:
    """(registers a thread gets at launch, a consumer's after setmaxnreg) for the
    warp-specialized variant with ``per_sm`` programs an SM: 4 producer and 4·wg consumer
    warps sharing 1/per_sm of the register file, in multiples of 8."""
    share = REGISTER_FILE // per_sm
    launch = min(256, share // (32 * (4 + 4 * wg)) // 8 * 8)
    # never fewer than at launch: the consumers only ever grow (setmaxnreg.inc)
    consumer = min(max(CONSUMER_REGS[block_m], launch),
                   (share - 128 * PRODUCER_REGS) // (128 * wg) // 8 * 8, 256)
    return launch, consumer
MAX_STAGES = 6
# The split of K is sized for one grid whatever the row block (2 warpgroups a program,
# one program an SM, a grain of 4 blocks): every row count gets the same split, so a
# row's sums do not depend on the rows beside it.
SPLIT_WARPGROUPS, SPLIT_PROGRAMS_PER_SM, SPLIT_GRAIN = 2, 1, 4
SMEM_BUDGET = 220 * 1024  # of the 227 KB a Hopper block may hold: the rest for barriers


def stage_bytes(block_m: int, wg: int, cb: int, group_size: int) -> int:
    """Shared memory of one ring stage: cb blocks of x ([block_m, 64] bf16) and of words
    (4·wg tiles × 512 bytes), and the step's scales and biases."""
    groups = cb * BLOCK_K // group_size
    return cb * (block_m * BLOCK_K * 2 + 4 * wg * 512) + 2 * 4 * wg * groups * 32

# Per thread: its word (four k16 steps' A registers of its lane, eight codes of rows g
# and g + 8) and the bf16 scale/bias pairs of its rows (row g low, row g + 8 high) in,
# four bf16 pairs out, pair r' = 2h + r: row g + 8r, columns 2h, 2h + 1 of the slot.
_DEQUANT_ASM = """{ .reg .b32 t, c, s0, s1, b0, b1, one, m128;
  mov.b32 one, 0x3F803F80;
  mov.b32 m128, 0xC300C300;
  prmt.b32 s0, $5, $5, 0x1010;
  prmt.b32 s1, $5, $5, 0x3232;
  prmt.b32 b0, $6, $6, 0x1010;
  prmt.b32 b1, $6, $6, 0x3232;
  lop3.b32 t, $4, 0x000F000F, 0x43004300, 0xEA;
  fma.rn.bf16x2 c, t, one, m128;
  fma.rn.bf16x2 $0, c, s0, b0;
  shr.u32 t, $4, 4;
  lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
  fma.rn.bf16x2 c, t, one, m128;
  fma.rn.bf16x2 $1, c, s1, b1;
  shr.u32 t, $4, 8;
  lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
  fma.rn.bf16x2 c, t, one, m128;
  fma.rn.bf16x2 $2, c, s0, b0;
  shr.u32 t, $4, 12;
  lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
  fma.rn.bf16x2 c, t, one, m128;
  fma.rn.bf16x2 $3, c, s1, b1; }"""


if gluon is not None:
    from triton.runtime.jit import constexpr_function

    _DEQUANT: gl.constexpr = gl.constexpr(_DEQUANT_ASM)

    @gluon.jit
    def _halves(p):
        """int32 bf16 pairs → bf16 [..., 2], the low half first."""
        return gl.join(p.to(gl.int16), (p >> 16).to(gl.int16)).to(gl.bfloat16, bitcast=True)

    @gluon.jit
    def _a_operand(words, s, b, a_layout: gl.constexpr, ROWS: gl.constexpr):
        """One 64-column block of the program's rows as the mma's A operand: words
        [4·WG (warp), 8 (g), 4 (q), 4 (j)] int32 and the scale/bias pairs of rows g, g + 8
        → bf16 [ROWS, 64] in `a_layout` (row 16w + 8r + g, slot 16j + 8h + 2q + e)."""
        p0, p1, p2, p3 = gl.inline_asm_elementwise(
            _DEQUANT, "=r,=r,=r,=r,r,r,r", [words, s, b],
            dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
        return pairs_operand(p0, p1, p2, p3, a_layout, ROWS)

    @gluon.jit
    def pairs_operand(p0, p1, p2, p3, a_layout: gl.constexpr, ROWS: gl.constexpr):
        """A thread's four bf16 pairs of a block ([w, g, q, j] each; pair r: row g + 8·(r
        % 2), columns 2·(r // 2), + 1 of its slot group) as the A operand [ROWS, 64]."""
        # [w, g, q, j, e, r, h]; the permute and reshape only rename registers
        a = gl.join(gl.join(_halves(p0), _halves(p1)), gl.join(_halves(p2), _halves(p3)))
        a = gl.reshape(gl.permute(a, (0, 5, 1, 3, 6, 2, 4)), [ROWS, 64])
        return gl.convert_layout(a, a_layout)

    @gluon.jit
    def fill(x_desc, w_desc, s_desc, b_desc, x_s, w_s, s_s, b_s, ready, sl, kb, m0, tile0,
              GROUP: gl.constexpr):
        """Ring stage ``sl`` ← the step that starts at block kb: x's blocks [CB, rows, 64],
        the words [tiles, CB, 128], the scales and the biases, one copy each (every copy
        of a kernel without a producer partition costs a block barrier)."""
        bar = ready.index(sl)
        mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes
                        + s_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [kb, m0, 0], bar, x_s.index(sl))
        tma.async_copy_global_to_shared(w_desc, [tile0, kb, 0], bar, w_s.index(sl))
        tma.async_copy_global_to_shared(s_desc, [tile0, kb * 64 // GROUP, 0], bar, s_s.index(sl))
        tma.async_copy_global_to_shared(b_desc, [tile0, kb * 64 // GROUP, 0], bar, b_s.index(sl))

    @constexpr_function
    def words_layout(W):
        """[warp, g, q, j]: a lane 4g + q's four words of a block in its registers."""
        return gl.BlockedLayout([1, 1, 1, 4], [1, 8, 4, 1], [W, 1, 1, 1], [3, 2, 1, 0])

    @constexpr_function
    def acc_layout_of(W, BLOCK_M):
        """The accumulator [16·W, BLOCK_M] of W warps' wgmma (one 16-row tile a warp)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                         instr_shape=[16, BLOCK_M, 16])

    @constexpr_function
    def a_layout_of(W, BLOCK_M):
        """The register A operand of that wgmma."""
        return gl.DotOperandLayout(operand_index=0, parent=acc_layout_of(W, BLOCK_M),
                                   k_width=2)

    @gluon.jit
    def program_share(W: gl.constexpr, BLOCK_M: gl.constexpr, BPP, KB, CB: gl.constexpr):
        """(first weight tile, first row of x, first block, steps of CB blocks) of this
        program of the grid (weight tiles of W × row blocks × splits of K); the steps
        are whole: the launcher's choice of BPP."""
        kb_lo = gl.program_id(2) * BPP
        return (gl.program_id(0) * W, gl.program_id(1) * BLOCK_M, kb_lo,
                (gl.minimum(kb_lo + BPP, KB) - kb_lo) // CB)

    @gluon.jit
    def block_words(w_stage, c: gl.constexpr, W: gl.constexpr):
        """Block c's words of a ring stage ([W tiles, CB·128] in shared memory) in
        `words_layout`: the same registers as the block's words [W, 128] read from
        shared memory."""
        lw2: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])
        return gl.convert_layout(gl.reshape(
            w_stage.slice(c * 128, 128, 1).load(lw2), [W, 8, 4, 4]), words_layout(W))

    @gluon.jit
    def _block_operand(w_stage, s_stage, b_stage, c: gl.constexpr, GROUP: gl.constexpr,
                       a_layout: gl.constexpr, W: gl.constexpr, ROWS: gl.constexpr):
        """Block c of a ring stage (its words [W tiles, CB·128], scale and bias pairs
        [W, groups·8]) as the A operand: read from shared memory, dequantized in
        registers (`_a_operand`)."""
        words = block_words(w_stage, c, W)
        lw: gl.constexpr = words_layout(W)
        l2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, lw))  # [warp, g]
        zero = gl.zeros([W, 8, 4, 4], gl.int32, lw)
        sc = gl.expand_dims(gl.expand_dims(
            s_stage.slice(c * 64 // GROUP * 8, 8, 1).load(l2), 2), 3)
        bi = gl.expand_dims(gl.expand_dims(
            b_stage.slice(c * 64 // GROUP * 8, 8, 1).load(l2), 2), 3)
        return _a_operand(words, sc + zero, bi + zero, a_layout, ROWS)

    @gluon.jit
    def _step_mmas(acc, a, x_blocks, w_stage, s_stage, b_stage, slot, GROUP: gl.constexpr,
                   CB: gl.constexpr, INFLIGHT: gl.constexpr, a_layout: gl.constexpr,
                   W: gl.constexpr):
        """One ring stage's CB blocks into acc (W warps' [16·W, rows] accumulator; ``a``:
        the operand of the last mma, retired): block c + 1 dequantized while block c's
        mma runs (INFLIGHT = 1), the step drained at its end. An mma still in flight
        across the loop's back edge or a block barrier makes ptxas serialize every mma
        of the loop (C7513/C7515), which costs more than the drain. Only the retired
        operand passes a wait: passing the in-flight one would count as redefining its
        registers."""
        for c in gl.static_range(CB):
            a_next = _block_operand(w_stage, s_stage, b_stage, c, GROUP, a_layout, W, 16 * W)
            acc = warpgroup_mma(a_next, x_blocks.index(slot * CB + c).permute((1, 0)), acc,
                                is_async=True)
            if c < CB - 1:
                acc, a = warpgroup_mma_wait(num_outstanding=INFLIGHT, deps=(acc, a))
            else:
                acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
            a = a_next
        return acc, a

    @gluon.jit
    def allocate_ring(x_desc, w_desc, s_desc, b_desc, STAGES: gl.constexpr):
        """The ring's STAGES stages of each operand, in its copies' layouts."""
        return (gl.allocate_shared_memory(gl.bfloat16, [STAGES] + x_desc.block_type.shape,
                                          x_desc.layout),
                gl.allocate_shared_memory(gl.int32, [STAGES] + w_desc.block_type.shape,
                                          w_desc.layout),
                gl.allocate_shared_memory(gl.int32, [STAGES] + s_desc.block_type.shape,
                                          s_desc.layout),
                gl.allocate_shared_memory(gl.int32, [STAGES] + b_desc.block_type.shape,
                                          b_desc.layout))

    @gluon.jit
    def stage_views(x_s, w_s, s_s, b_s, STAGES: gl.constexpr, CB: gl.constexpr,
                     BLOCK_M: gl.constexpr, TILES: gl.constexpr, GPS: gl.constexpr):
        """The ring's stages as the consumers read them: x's blocks one by one (in the
        128-byte swizzle the copies wrote), and the words, scales and biases unswizzled,
        indexed down to a step."""
        XB: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                rank=2)
        FLAT2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        return (x_s._reinterpret(gl.bfloat16, [STAGES * CB, BLOCK_M, 64], XB),
                w_s._reinterpret(gl.int32, [STAGES, TILES, CB * 128], FLAT2),
                s_s._reinterpret(gl.int32, [STAGES, TILES, GPS * 8], FLAT2),
                b_s._reinterpret(gl.int32, [STAGES, TILES, GPS * 8], FLAT2))

    @gluon.jit
    def epilogue(acc, y_ptr, bias_ptr, res_ptr, ws_ptr, sem, n0, m0, M, N, stride_ym,
                  stride_rm, ROWS: gl.constexpr, BLOCK_M: gl.constexpr,
                  out_layout: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr,
                  HAS_RES: gl.constexpr):
        """Outputs n0 .. n0 + ROWS of rows m0 .. of y from the accumulator, stored in
        ``out_layout``: through the split planes when K is split (the program whose count
        is last sums them in split order), bias, residual."""
        acc = gl.convert_layout(acc, out_layout)
        n = gl.expand_dims(n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out_layout)), 1)
        m = gl.expand_dims(m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout)), 0)
        ok = (n < N) & (m < M)
        last = True
        if SPLIT > 1:
            pid_k = gl.program_id(2)
            gl.store(ws_ptr + pid_k * (M * N) + m * N + n, acc, mask=ok)
            gl.thread_barrier()  # every thread's partials are written before the count
            last = gl.atomic_add(sem, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        if last:
            if SPLIT > 1:  # every split's partial, in split order (deterministic)
                acc = gl.zeros([ROWS, BLOCK_M], gl.float32, out_layout)
                for sp in range(SPLIT):
                    acc += gl.load(ws_ptr + sp * (M * N) + m * N + n, mask=ok, other=0.0,
                                   cache_modifier=".cg")
                gl.atomic_xchg(sem, 0, sem="relaxed", scope="gpu")
            if HAS_BIAS:
                acc += gl.load(bias_ptr + n, mask=n < N, other=0.0).to(gl.float32)
            if HAS_RES:
                # Rounded as compat rounds: the projection to bf16 first, then the sum.
                acc = acc.to(gl.bfloat16).to(gl.float32) + gl.load(
                    res_ptr + m.to(gl.int64) * stride_rm + n, mask=ok, other=0.0).to(gl.float32)
            gl.store(y_ptr + m.to(gl.int64) * stride_ym + n, acc.to(gl.bfloat16), mask=ok)

    @gluon.jit
    def _qmm_wgmma_kernel(x_desc, w_desc, s_desc, b_desc, y_ptr, bias_ptr, res_ptr, ws_ptr,
                          sem_ptr, M, N, KB, BPP, stride_ym, stride_rm,
                          GROUP: gl.constexpr, WG: gl.constexpr, BLOCK_M: gl.constexpr,
                          CB: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                          INFLIGHT: gl.constexpr, HAS_BIAS: gl.constexpr,
                          HAS_RES: gl.constexpr):
        W: gl.constexpr = 4 * WG  # warps = fragment tiles per program
        ROWS: gl.constexpr = 16 * W
        GPS: gl.constexpr = CB * 64 // GROUP  # scale groups per step
        acc_layout: gl.constexpr = acc_layout_of(W, BLOCK_M)
        a_layout: gl.constexpr = a_layout_of(W, BLOCK_M)
        tile0, m0, kb_lo, n_steps = program_share(W, BLOCK_M, BPP, KB, CB)

        x_s, w_s, s_s, b_s = allocate_ring(x_desc, w_desc, s_desc, b_desc, STAGES)
        x_blocks, w_flat, s_flat, b_flat = stage_views(x_s, w_s, s_s, b_s, STAGES, CB,
                                                        BLOCK_M, W, GPS)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        for i in gl.static_range(STAGES):  # the ring's first stages
            if i < n_steps:
                fill(x_desc, w_desc, s_desc, b_desc, x_s, w_s, s_s, b_s, ready, i,
                     kb_lo + i * CB, m0, tile0, GROUP)

        acc = gl.zeros([ROWS, BLOCK_M], gl.float32, acc_layout)
        a = gl.zeros([ROWS, 64], gl.bfloat16, a_layout)  # the operand "before" the first
        for i in range(n_steps):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            acc, a = _step_mmas(acc, a, x_blocks, w_flat.index(slot), s_flat.index(slot),
                                b_flat.index(slot), slot, GROUP, CB, INFLIGHT, a_layout, W)
            # Every warp's mmas over this step's stage are done: refill it.
            gl.thread_barrier()
            nxt = i + STAGES
            if nxt < n_steps:
                fill(x_desc, w_desc, s_desc, b_desc, x_s, w_s, s_s, b_s, ready,
                     slot, kb_lo + nxt * CB, m0, tile0, GROUP)
        acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
        finish_program(acc, ready, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, tile0, m0, M, N,
                       stride_ym, stride_rm, STAGES, W, BLOCK_M, SPLIT, HAS_BIAS, HAS_RES)

    @gluon.jit
    def finish_program(acc, ready, y_ptr, bias_ptr, res_ptr, ws_ptr, sem_ptr, tile0, m0, M, N,
                       stride_ym, stride_rm, STAGES: gl.constexpr, W: gl.constexpr,
                       BLOCK_M: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr,
                       HAS_RES: gl.constexpr):
        """The end of a one-partition program: its ring's barriers invalidated, its
        accumulator [16·W, BLOCK_M] through `epilogue` (one semaphore per output tile)."""
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
        # Threads along n (y's rows are contiguous in n), through shared memory.
        out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [1, W], [0, 1])
        sem = sem_ptr + gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)
        epilogue(acc, y_ptr, bias_ptr, res_ptr, ws_ptr, sem, tile0 * 16, m0, M, N, stride_ym,
                 stride_rm, 16 * W, BLOCK_M, out_layout, SPLIT, HAS_BIAS, HAS_RES)


    @gluon.jit
    def _ws_producer(x_desc, w_desc, s_desc, b_desc, x_s, w_s, s_s, b_s, ready, empty, m0,
                     tile0, kb_lo, n_steps, GROUP: gl.constexpr, CB: gl.constexpr,
                     STAGES: gl.constexpr):
        """Default partition of the warp-specialized variant (four warps, as Gluon asks;
        one thread issues): each step's copies into a stage the consumers have released."""
        for i in range(n_steps):
            sl = i % STAGES
            mbarrier.wait(empty.index(sl), ((i // STAGES) & 1) ^ 1)
            fence_async_shared()  # the consumers' shared loads of this stage come first
            fill(x_desc, w_desc, s_desc, b_desc, x_s, w_s, s_s, b_s, ready, sl,
                 kb_lo + i * CB, m0, tile0, GROUP)

    @gluon.jit
    def _ws_consumer(x_s, w_s, s_s, b_s, ready, empty, y_ptr, bias_ptr, res_ptr, ws_ptr,
                     sem_ptr, M, N, m0, tile0, n_steps, stride_ym, stride_rm,
                     wg: gl.constexpr, WG: gl.constexpr, GROUP: gl.constexpr,
                     BLOCK_M: gl.constexpr, CB: gl.constexpr, STAGES: gl.constexpr,
                     SPLIT: gl.constexpr, INFLIGHT: gl.constexpr, HAS_BIAS: gl.constexpr,
                     HAS_RES: gl.constexpr):
        """Worker partition ``wg`` (one warpgroup): the program's tiles 4·wg .. 4·wg + 3,
        its own accumulator, epilogue and semaphore; it releases each stage after its
        step's drain, never waiting for the other warpgroup."""
        W: gl.constexpr = 4
        ROWS: gl.constexpr = 64
        GPS: gl.constexpr = CB * 64 // GROUP
        acc_layout: gl.constexpr = acc_layout_of(W, BLOCK_M)
        a_layout: gl.constexpr = a_layout_of(W, BLOCK_M)
        x_blocks, w_flat, s_flat, b_flat = stage_views(x_s, w_s, s_s, b_s, STAGES, CB,
                                                        BLOCK_M, 4 * WG, GPS)
        acc = gl.zeros([ROWS, BLOCK_M], gl.float32, acc_layout)
        a = gl.zeros([ROWS, 64], gl.bfloat16, a_layout)
        for i in range(n_steps):
            sl = i % STAGES
            mbarrier.wait(ready.index(sl), (i // STAGES) & 1)
            acc, a = _step_mmas(acc, a, x_blocks, w_flat.index(sl).slice(wg * W, W),
                                s_flat.index(sl).slice(wg * W, W),
                                b_flat.index(sl).slice(wg * W, W), sl, GROUP, CB, INFLIGHT,
                                a_layout, W)
            # Drained: all four warps issued their mmas, so their loads of the stage are done.
            mbarrier.arrive(empty.index(sl), count=1)
        sem = sem_ptr + (gl.program_id(0) * WG + wg) * gl.num_programs(1) + gl.program_id(1)
        # Stored straight from the mma's layout: a convert through shared memory would
        # need its own scratch beside the ring (partitions run at once), which does not fit.
        epilogue(acc, y_ptr, bias_ptr, res_ptr, ws_ptr, sem, (tile0 + wg * W) * 16, m0, M, N,
                 stride_ym, stride_rm, ROWS, BLOCK_M, acc_layout, SPLIT, HAS_BIAS, HAS_RES)

    @gluon.jit
    def _qmm_wgmma_ws_kernel(x_desc, w_desc, s_desc, b_desc, y_ptr, bias_ptr, res_ptr, ws_ptr,
                             sem_ptr, M, N, KB, BPP, stride_ym, stride_rm,
                             GROUP: gl.constexpr, WG: gl.constexpr, BLOCK_M: gl.constexpr,
                             CB: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                             INFLIGHT: gl.constexpr, HAS_BIAS: gl.constexpr,
                             HAS_RES: gl.constexpr, CONSUMER_REGS: gl.constexpr):
        """The same product with a producer partition issuing the copies and one worker
        partition per warpgroup: no block barrier sits in a consumer's loop, so the two
        warpgroups drift apart and one's drain is covered by the other's mmas."""
        tile0, m0, kb_lo, n_steps = program_share(4 * WG, BLOCK_M, BPP, KB, CB)
        x_s, w_s, s_s, b_s = allocate_ring(x_desc, w_desc, s_desc, b_desc, STAGES)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
            mbarrier.init(empty.index(st), count=WG)
        # one entry per partition, spelled out: a kernel body takes no comprehension
        if WG == 1:
            gl.warp_specialize([
                (_ws_producer, (x_desc, w_desc, s_desc, b_desc, x_s, w_s, s_s, b_s, ready,
                                empty, m0, tile0, kb_lo, n_steps, GROUP, CB, STAGES)),
                (_ws_consumer, (x_s, w_s, s_s, b_s, ready, empty, y_ptr, bias_ptr, res_ptr,
                                ws_ptr, sem_ptr, M, N, m0, tile0, n_steps, stride_ym,
                                stride_rm, 0, WG, GROUP, BLOCK_M, CB, STAGES, SPLIT,
                                INFLIGHT, HAS_BIAS, HAS_RES)),
            ], [4], [CONSUMER_REGS])
        else:
            gl.warp_specialize([
                (_ws_producer, (x_desc, w_desc, s_desc, b_desc, x_s, w_s, s_s, b_s, ready,
                                empty, m0, tile0, kb_lo, n_steps, GROUP, CB, STAGES)),
                (_ws_consumer, (x_s, w_s, s_s, b_s, ready, empty, y_ptr, bias_ptr, res_ptr,
                                ws_ptr, sem_ptr, M, N, m0, tile0, n_steps, stride_ym,
                                stride_rm, 0, WG, GROUP, BLOCK_M, CB, STAGES, SPLIT,
                                INFLIGHT, HAS_BIAS, HAS_RES)),
                (_ws_consumer, (x_s, w_s, s_s, b_s, ready, empty, y_ptr, bias_ptr, res_ptr,
                                ws_ptr, sem_ptr, M, N, m0, tile0, n_steps, stride_ym,
                                stride_rm, 1, WG, GROUP, BLOCK_M, CB, STAGES, SPLIT,
                                INFLIGHT, HAS_BIAS, HAS_RES)),
            ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def unsupported_reason(x: torch.Tensor, w) -> str | None:
    """None when the wgmma kernel can take x·dequant(w)ᵀ, else why not."""
    if gluon is None:
        return f"Gluon is not importable ({GLUON_ERROR})"
    return tma_fragment_reason(x, w, "wgmma kernel", MAX_ROWS)


def row_block(M: int) -> int:
    """x rows per program: the smallest of 64, 128, 256 that holds M (every row gets the
    same arithmetic whichever it is: the k order and split do not change)."""
    return 64 if M <= 64 else 128 if M <= 128 else 256


@functools.lru_cache(maxsize=1024)
def launch_shape(N: int, K: int, group_size: int, block_m: int, device: torch.device,
                 wg: int | None = None, cb: int | None = None, stages: int | None = None,
                 per_sm: int | None = None, split: int | None = None,
                 inflight: int | None = None, ws: bool | None = None) -> dict:
    """Grid and constants for one row block: `ROW_BLOCK_SHAPES` unless overridden
    (``per_sm``: programs resident per SM, which the stages must fit). The split of K
    depends on N, K and the GPU only (`SPLIT_WARPGROUPS` and the rest), never on the row
    block; of the overrides, ``split`` and a ``cb`` wider than `SPLIT_GRAIN` change it."""
    defaults = ROW_BLOCK_SHAPES[block_m]
    wg, per_sm = wg or defaults["wg"], per_sm or defaults["per_sm"]
    inflight = MMAS_IN_FLIGHT if inflight is None else inflight
    ws = defaults["ws"] if ws is None else ws
    if cb is not None and (cb < 1 or cb & (cb - 1)):
        raise ValueError(f"blocks per step must be a power of two, got {cb}")
    if inflight not in (0, 1):  # more would leave an operand in flight with no reference
        raise ValueError(f"mmas in flight must be 0 or 1, got {inflight}")
    if wg not in (1, 2):
        raise ValueError(f"warpgroups per program must be 1 or 2, got {wg}")
    KB = K // BLOCK_K
    per_group = max(1, group_size // BLOCK_K)
    cb = max(cb or defaults["cb"], per_group)
    while cb and (KB % cb or cb % per_group):
        cb //= 2
    if cb == 0:
        raise ValueError(f"{KB} blocks of 64 do not make whole groups of {group_size}")
    grain = max(cb, SPLIT_GRAIN)
    while KB % grain:  # powers of two: stops at a multiple of cb
        grain //= 2
    tiles = triton.cdiv(N, TILE_N)
    split, bpp = k_shares(KB, grain, triton.cdiv(tiles, 4 * SPLIT_WARPGROUPS),
                          SPLIT_PROGRAMS_PER_SM, sm_count(device), split)
    if split > 1 and triton.cdiv(tiles, 4) * (MAX_ROWS // 64) > MAX_SEMAPHORES:
        split, bpp = 1, KB  # more tiles than semaphores, at the narrowest programs
    if bpp % cb:  # a share of whole steps, or blocks would be dropped
        raise ValueError(f"a share of {bpp} blocks is not whole steps of {cb}")
    per_stage = stage_bytes(block_m, wg, cb, group_size)
    budget = SMEM_BUDGET // per_sm
    stages = stages or min(MAX_STAGES, budget // per_stage)
    if stages < 2 or stages * per_stage > budget:
        raise ValueError(f"{stages} ring stages of {per_stage} bytes do not fit the "
                         f"{budget} bytes of shared memory of one of {per_sm} programs per "
                         f"SM (at least two are needed)")
    return {"programs": triton.cdiv(tiles, 4 * wg), "WG": wg, "CB": cb, "STAGES": stages,
            "INFLIGHT": inflight, "SPLIT": split, "BPP": bpp, "WS": ws, "PER_SM": per_sm}


def permuted_rows(x2: torch.Tensor) -> torch.Tensor:
    """x [M, K] with each 64-column block in the fragment's slot order (slot 16j + 8h +
    2q + e holds column 16q + 4j + 2h + e): one copy, what the mma's B operand reads."""
    M, K = x2.shape
    # columns move in bf16 pairs (e): permute int32 words, half the elements to move
    pairs = x2.contiguous().view(torch.int32).view(M, K // 64, 4, 4, 2)
    return pairs.permute(0, 1, 3, 4, 2).reshape(M, K // 2).view(torch.bfloat16)


def descriptors(f: FragmentWeight, wg: int, cb: int):
    """TMA descriptors of the words ([T, KB, 128], a box of 4·wg tiles × cb blocks) and the
    scales and biases ([T, groups, 8], a box per step), made once per weight and shape."""
    def make(f):
        T, KB = f.words.shape[:2]
        G = f.scales.shape[1]
        tiles, gps = 4 * wg, cb * BLOCK_K // f.group_size
        flat = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
        wd = TensorDescriptor(f.words.view(T, KB, 128), [T, KB, 128], [KB * 128, 128, 1],
                              [tiles, cb, 128], flat)
        sd = TensorDescriptor(f.scales, [T, G, 8], [G * 8, 8, 1], [tiles, gps, 8], flat)
        bd = TensorDescriptor(f.biases, [T, G, 8], [G * 8, 8, 1], [tiles, gps, 8], flat)
        return wd, sd, bd
    return f.derived(f"wgmma_descriptors:{wg}:{cb}", make)


def qmatmul_wgmma(x: torch.Tensor, f: FragmentWeight, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, block_m: int | None = None,
                  checked: bool = False, **shape) -> torch.Tensor:
    """x [..., K] bf16 (1..MAX_ROWS rows) → residual + x·dequant(f)ᵀ + bias [..., N] bf16.
    ``block_m`` and ``shape`` (`launch_shape`'s overrides): what the tests and the
    benchmark vary. ``checked``: the caller has had None from `unsupported_reason`."""
    x2, y, bias, res2 = start_product(x, f, bias, residual, "qmatmul_wgmma",
                                     None if checked else unsupported_reason)
    K, N, M = f.k, f.n, x2.shape[0]
    if N == 0:
        return y.reshape(*x.shape[:-1], N)
    bm = block_m or row_block(M)
    ls = launch_shape(N, K, f.group_size, bm, x.device, **shape)
    xp = permuted_rows(x2)
    # x as [blocks, rows, 64]: one box per step holds its CB blocks, each a [rows, 64] slab
    cb = ls["CB"]
    layout = gl.NVMMASharedLayout.get_default_for([cb, bm, 64], gl.bfloat16)
    x_desc = TensorDescriptor(xp, [K // BLOCK_K, M, 64], [64, K, 1], [cb, bm, 64], layout)
    wd, sd, bd = descriptors(f, ls["WG"], ls["CB"])
    ws = split_workspace(ls["SPLIT"], (M, N), y)
    grid = (ls["programs"], triton.cdiv(M, bm), ls["SPLIT"])
    args = (x_desc, wd, sd, bd, y, bias if bias is not None else y, res2, ws,
            semaphores(x.device), M, N, K // BLOCK_K, ls["BPP"], y.stride(0), res2.stride(0))
    meta = {"GROUP": f.group_size, "WG": ls["WG"], "BLOCK_M": bm, "CB": ls["CB"],
            "STAGES": ls["STAGES"], "SPLIT": ls["SPLIT"], "INFLIGHT": ls["INFLIGHT"],
            "HAS_BIAS": bias is not None, "HAS_RES": residual is not None}
    if ls["WS"]:
        # four producer warps, then one warpgroup per consumer: the registers the
        # consumers take (CONSUMER_REGS) come from what the producer gives back
        launch, consumer = ws_registers(ls["WG"], ls["PER_SM"], bm)
        _qmm_wgmma_ws_kernel[grid](*args, **meta, CONSUMER_REGS=consumer, num_warps=4,
                                   maxnreg=launch)
    else:
        _qmm_wgmma_kernel[grid](*args, **meta, num_warps=4 * ls["WG"])
    return y.reshape(*x.shape[:-1], N)
