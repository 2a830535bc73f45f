"""A chain of dependent 4-bit products in one persistent launch, every weight streamed
through one TMA shared-memory ring (Hopper, Gluon): y_0 = x·W_0ᵀ, y_1 = y_0·W_1ᵀ, ...

Contract: weights W_0..W_{P-1} (`FragmentWeight`, 4-bit, one group size, 1 ≤ P ≤
MAX_PRODUCTS) with K_{i+1} = N_i; x [..., K_0] bf16 of 1..MAX_ROWS rows. Returns every y_i
[..., N_i] bf16, each bit for bit ``qmatmul_ring(y_{i-1}, W_i)`` at the same split of K
(the launcher's own choice per product unless ``splits`` says otherwise): each work item
runs `qmatmul_ring`'s consumer steps (`consume_steps`) and outputs (`store_outputs`) on
the same operands in the same order. Deterministic, and a row's bits do not depend on the
rows beside it (the splits depend on N, K and the GPU only).

Why one ring: between separate launches the weight stream stops at each boundary (the
drain of one grid, the fill of the next; PDL only hides the launch). Here each program's
producer partition (`qmatmul_ring.issue_stage`) issues the TMA loads of ALL its work
items' weights in list order and waits only for free ring slots, never for data, so the
next product's weights are in flight while this product's last tiles are computed.

Work items: (product, row-tile group of 4 × 16 rows, split of K), exactly the programs
`qmatmul_ring` would launch for each product. `RingChain` deals them once, in chain order,
to G = min(SMs, items) programs (each product's items to the programs least loaded within
that product, then overall), as int32 tables. Each program's four 1-warp consumers walk
the same list: before an item of product p > 0 they spin (every lane an ``ld.acquire.gpu``
of one counter) until product p-1 has counted all its output lanes (programs × 4 warps ×
32 lanes; a warp adds how many of its lanes stored, one ``red.release.gpu`` after a warp
barrier), then consume the item's stages. Split K meets through `qmatmul_ring`'s
per-thread semaphores (a region per product). When a consumer warp has finished its list
it counts itself on an exit counter; the last of all zeroes every counter, so they are zero
between launches.

Deadlock-free: (1) every program is resident at once: G ≤ SMs, and the ring takes more
than half an SM's shared memory (STAGES), so the hardware places one program per SM; the
kernel before this one (PDL) ends on its own, and the kernel after starts only once every
program has run ``gdc_launch_dependents``. (2) every list is in chain order, so by
induction on p every item of product p completes: its wait is for products < p, all
complete, and the items before it in its list are of products ≤ p. Producers never wait on
counters, only on slots their own consumers free in order.

Calls: the first for a device must run eagerly (it allocates and zeroes the counters and
the split semaphores); later calls can be captured in a CUDA graph. Consumers read
counters, semaphores and x only after ``gdc_wait``, so a launch never sees the counts of
the one before. The counters are one set per device: launches on one stream only (as
qfuse decodes). Not on the decode path yet (no lever, no plan entry): a product kernel to
time against separate `qmatmul_ring` launches (`qfuse bench products`, bench/NOTES.md "The
ring chain (Gluon)").

Timed form (``RingChain(..., timed=True)``, the kernel's TIMED; off, the kernel is compiled
as before, instruction for instruction): each role of each program (the producer, the four
consumer warps) adds the SM cycles between its own clock reads to buckets, the producer's
waits for free slots and its issuing, a consumer's waits on the launch before, on the
previous product's counter and on the ring's full barriers (data not yet arrived), its
computing and its storing, and writes them with its start and end stamps to an int64
buffer [G, SLOTS] (lane 0 writes). `fold_timing` turns the buffer into shares of each
program's span (`ChainTiming`). The outputs are the untimed chain's bits: a step is the
same `consume_steps` on the same operands, called one stage at a time.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
import triton

from ..common.gluon_hopper import gdc_launch_dependents, gdc_wait, gl, gluon, mbarrier
from ..common.pdl import enabled as pdl_enabled
from ..common.units import warm_up_first, zeroed_once
from . import qmatmul_ring as ring
from .fragments import BLOCK_K, FragmentWeight
from .splitk import SEMAPHORE_SLOTS, semaphores, sm_count

MAX_PRODUCTS = 4  # descriptor triples the kernel takes (a longer chain: several launches)
MAX_ROWS = 8  # one column tile of the mma's N (the consumers' 80-register budget)
TT = ring.CONSUMERS  # row tiles per work item, one consumer warp each
# Ring bytes a program aims at: more than half of an SM's 228 KB, so one program per SM
# (residency, module docstring), and ~16 stages of 9 KB in flight per SM.
RING_BYTES = 144 * 1024
MAX_STAGES = 64
META = 8  # int32 fields per product in the meta table (see `RingChain`)
_COUNTERS: dict[torch.device, torch.Tensor] = {}
# The timed form's buffer: per program ROLES blocks of ROLE int64 slots, the producer's then
# each consumer warp's: start and end %clock64, start and end %globaltimer, then its buckets
# (cycles) in the order below from slot 4 on.
ROLES = 1 + TT
ROLE = 9
SLOTS = ROLES * ROLE
PRODUCER_BUCKETS = ("slot_wait", "issue")
CONSUMER_BUCKETS = ("launch_wait", "counter_wait", "ready_wait", "compute", "store")


def counters(device: torch.device) -> torch.Tensor:
    """The device's zeroed chain counters (one per product, then the exit counter),
    allocated by the first call, which must not be under CUDA graph capture."""
    cnt = zeroed_once(_COUNTERS, device, MAX_PRODUCTS + 1)
    if cnt is None:
        raise warm_up_first("a ring chain", "counters")
    return cnt


if gluon is not None:
    _TT = gl.constexpr(TT)  # the host constant, as the kernels see it
    # A consumer warp's [8, 4] lane grid (one element per lane), as `qmatmul_ring`'s
    # [8 (g), 4 (q), 4] tensors without their in-thread dimension.
    _L3 = gl.constexpr(gl.BlockedLayout([1, 1, 4], [8, 4, 1], [1, 1, 1], [2, 1, 0]))
    _LANES = gl.constexpr(gl.SliceLayout(2, _L3))
    _LG = gl.constexpr(gl.SliceLayout(1, _LANES))
    _LQ = gl.constexpr(gl.SliceLayout(0, _LANES))
    # The producer's (default partition's) four warps, one element a thread: the launcher's
    # num_warps=4.
    _THREADS = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))
    _SLOTS = gl.constexpr(SLOTS)
    _ROLE = gl.constexpr(ROLE)

    @gluon.jit
    def _lane_ids():
        """[8, 4] int32: each lane's id (4g + q) in the consumers' lane grid."""
        return (gl.expand_dims(gl.arange(0, 8, layout=_LG), 1) * 4
                + gl.expand_dims(gl.arange(0, 4, layout=_LQ), 0))

    @gluon.jit
    def _wait_count(cnt_ptr, target, lanes):
        """Spin until the counter reaches ``target``: every lane loads it with
        ld.acquire.gpu (one transaction a warp), so each lane's later loads of what the
        counting warps stored see it."""
        ptrs = cnt_ptr + lanes * 0
        seen = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptrs],
                                         dtype=gl.int32, is_pure=False, pack=1)
        while gl.min(gl.min(seen, 1), 0) < target:
            # a pause between polls: up to 528 warps poll one L2 line that the counting
            # warps' red.release must also reach
            seen = gl.inline_asm_elementwise(
                "{ nanosleep.u32 32; ld.acquire.gpu.global.b32 $0, [$1]; }", "=r,l", [ptrs],
                dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _count_lanes(cnt_ptr, stored, lanes):
        """Add how many lanes of this warp stored (``stored`` [8, 4]) to the counter: a
        warp barrier (orders every lane's stores before lane 0's release), then one
        red.release.gpu from lane 0 (none when no lane stored)."""
        n = gl.sum(gl.sum(stored.to(gl.int32), 1), 0) + lanes * 0
        gl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 l; bar.warp.sync -1; mov.u32 l, %laneid; "
            "setp.eq.u32 p, l, 0; setp.ne.and.s32 p, $2, 0, p; "
            "@p red.release.gpu.global.add.s32 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [cnt_ptr + lanes * 0, n], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _exit_and_reset(cnt_ptr, exit_target, lanes, MAXP: gl.constexpr):
        """Count this warp's end on the exit counter (cnt_ptr[MAXP]); the last warp of the
        launch (every other warp has waited and counted for the last time) zeroes every
        counter for the next launch."""
        old = gl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 l; .reg .s32 o; bar.warp.sync -1; "
            "mov.u32 l, %laneid; setp.eq.u32 p, l, 0; mov.s32 o, 0; "
            "@p atom.acq_rel.gpu.global.add.s32 o, [$1], 1; "
            "shfl.sync.idx.b32 $0, o, 0, 0x1f, -1; }",
            "=r,l", [cnt_ptr + MAXP + lanes * 0], dtype=gl.int32, is_pure=False, pack=1)
        last = old == exit_target - 1
        gl.store(cnt_ptr + lanes, lanes * 0, mask=last & (lanes <= MAXP))

    # The timed form's clocks. Intervals are %clock (the SM's cycle counter, low 32 bits of
    # %clock64): one per cycle, and every warp of a program reads the same counter, so a
    # role's buckets add up to at most its span exactly (consecutive reads, telescoping).
    # %globaltimer (ns, one clock for the whole GPU, but it may advance in coarse steps,
    # up to a µs on some GPUs) only stamps each role's start and end, to place programs
    # against each other.
    @gluon.jit
    def _clock(like):
        """%clock, one per element of ``like`` (int32)."""
        return gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r,r", [like],
                                         dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _tick(t, bucket, like):
        """(now, bucket + the cycles since ``t``)."""
        now = _clock(like)
        return now, bucket + (now - t)

    @gluon.jit
    def _put(role_ptr, k, v, like):
        """Slot k of a role's block := v, from the element of ``like`` that is 0."""
        gl.store(role_ptr + k + like * 0, v.to(gl.int64), mask=like == 0)

    @gluon.jit
    def _stamp(role_ptr, k, like):
        """Slots k, k + 2 := %clock64, %globaltimer; returns the clock's low 32 bits."""
        clk, ns = gl.inline_asm_elementwise(
            "mov.u64 $0, %clock64; mov.u64 $1, %globaltimer;", "=l,=l,r", [like],
            dtype=(gl.int64, gl.int64), is_pure=False, pack=1)
        _put(role_ptr, k, clk, like)
        _put(role_ptr, k + 2, ns, like)
        return clk.to(gl.int32)

    @gluon.jit
    def _time_end(role_ptr, like, buckets, FIRST: gl.constexpr):
        """A role's end stamps, and its buckets from slot FIRST on."""
        _stamp(role_ptr, 1, like)
        for k in gl.static_range(len(buckets)):
            _put(role_ptr, FIRST + k, buckets[k], like)

    @gluon.jit
    def _item(items_ptr, pid, L, it):
        """Work item ``it`` of program ``pid``: (product, row-tile group, split)."""
        base = items_ptr + (pid * L + it) * 4
        return gl.load(base), gl.load(base + 1), gl.load(base + 2)

    @gluon.jit
    def _share(meta_ptr, prod, pid2, CB: gl.constexpr):
        """(KB, first block, ring steps) of split pid2 of product ``prod``."""
        KB = gl.load(meta_ptr + prod * 8 + 1)
        BPP = gl.load(meta_ptr + prod * 8 + 2)
        kb_lo = pid2 * BPP
        return KB, kb_lo, (gl.minimum(kb_lo + BPP, KB) - kb_lo) // CB

    @gluon.jit
    def _chain_producer(descs, w_s, s_s, b_s, ready, empty, items_ptr, n_items_ptr, meta_ptr, L,
                        tim_ptr, P: gl.constexpr, GROUP: gl.constexpr, CB: gl.constexpr,
                        STAGES: gl.constexpr, TIMED: gl.constexpr):
        """Default partition: the TMA copies of every item's stages, in list order, one
        ring count across items (it waits only for free slots). TIMED: the wait for each
        slot apart (issue_stage's own wait then passes at once), the rest as issuing."""
        pid = gl.program_id(0)
        if TIMED:
            tid = gl.arange(0, 128, layout=_THREADS)
            role = tim_ptr + pid * _SLOTS
            t = _stamp(role, 0, tid)
            waited = t * 0
            issued = t * 0
        pos = 0
        for it in range(gl.load(n_items_ptr + pid)):
            prod, pid0, pid2 = _item(items_ptr, pid, L, it)
            _, kb_lo, n_steps = _share(meta_ptr, prod, pid2, CB)
            for j in gl.static_range(P):
                if prod == j:
                    w_desc, s_desc, b_desc = descs[j]
                    for i in range(n_steps):
                        if TIMED:
                            t, issued = _tick(t, issued, tid)
                            k = pos + i
                            mbarrier.wait(empty.index(k % STAGES), ((k // STAGES) & 1) ^ 1)
                            t, waited = _tick(t, waited, tid)
                        ring.issue_stage(w_desc, s_desc, b_desc, w_s, s_s, b_s, ready, empty,
                                         pos + i, pid0 * _TT, kb_lo + i * CB, GROUP, _TT, CB,
                                         STAGES)
            pos += n_steps
        if TIMED:
            t, issued = _tick(t, issued, tid)
            _time_end(role, tid, (waited, issued), 4)

    @gluon.jit
    def _chain_consumer(x_ptr, yw_ptr, y_ptr, ws_ptr, sem_ptr, cnt_ptr, items_ptr, n_items_ptr,
                        meta_ptr, w_s, s_s, b_s, ready, empty, M, L, exit_target, tim_ptr,
                        wid: gl.constexpr, MAXP: gl.constexpr, GROUP: gl.constexpr,
                        CB: gl.constexpr, STAGES: gl.constexpr, NT: gl.constexpr,
                        GDC: gl.constexpr, TIMED: gl.constexpr):
        """One warp, row tile ``wid`` of every item in the program's list: wait for the
        product it reads, `qmatmul_ring`'s steps and outputs, count the stored lanes.
        TIMED: each stage's full barrier waited for apart, then its step (consume_steps
        over that one stage: its wait passes at once)."""
        w_flat, s_flat, b_flat = ring.ring_views(w_s, s_s, b_s, GROUP, _TT, CB, STAGES)
        g, q, r, zero_i = ring.lane_indices()
        lanes = _lane_ids()
        if TIMED:
            role = tim_ptr + gl.program_id(0) * _SLOTS + (1 + wid) * _ROLE
            t = _stamp(role, 0, lanes)
        if GDC:
            gdc_wait()  # x, and the counters the launch before zeroed last
        if TIMED:
            t, launch_wait = _tick(t, t * 0, lanes)
            _put(role, 4, launch_wait, lanes)
            counted = t * 0
            arriving = t * 0
            computing = t * 0
            storing = t * 0
        pid = gl.program_id(0)
        pos = 0
        for it in range(gl.load(n_items_ptr + pid)):
            prod, pid0, pid2 = _item(items_ptr, pid, L, it)
            KB, kb_lo, n_steps = _share(meta_ptr, prod, pid2, CB)
            if TIMED:
                t, computing = _tick(t, computing, lanes)
            xp = x_ptr
            if prod > 0:  # x is y_{prod-1}: wait until all its lanes are counted
                _wait_count(cnt_ptr + prod - 1, gl.load(meta_ptr + (prod - 1) * 8 + 4), lanes)
                if TIMED:
                    t, counted = _tick(t, counted, lanes)
                xp = yw_ptr + M * gl.load(meta_ptr + (prod - 1) * 8 + 7) // 2
            x_offs = ring.x_offsets(g, q, r, zero_i, M, KB, kb_lo, NT)
            acc = ()
            for nt in gl.static_range(NT):
                acc = acc + (gl.zeros([8, 4, 4], gl.float32, _L3),)
            if TIMED:
                for i in range(n_steps):
                    k = pos + i
                    mbarrier.wait(ready.index(k % STAGES), (k // STAGES) & 1)
                    t, arriving = _tick(t, arriving, lanes)
                    # step i's x columns: the base moved by its stage's words
                    acc = ring.consume_steps(xp + i * (CB * 32), x_offs, acc, w_flat, s_flat,
                                             b_flat, ready, empty, k, 1, wid, 0, 1, GROUP, _TT,
                                             CB, STAGES, NT)
                    t, computing = _tick(t, computing, lanes)
            else:
                acc = ring.consume_steps(xp, x_offs, acc, w_flat, s_flat, b_flat, ready, empty,
                                         pos, n_steps, wid, 0, 1, GROUP, _TT, CB, STAGES, NT)
            pos += n_steps
            N = gl.load(meta_ptr + prod * 8)
            stored = ring.store_outputs(
                y_ptr + M * gl.load(meta_ptr + prod * 8 + 7), y_ptr, y_ptr,
                ws_ptr + M * gl.load(meta_ptr + prod * 8 + 6),
                sem_ptr + gl.load(meta_ptr + prod * 8 + 5), acc, g, q, r, M, N,
                pid0 * _TT + wid, pid0, pid2, N, N, wid, _TT, NT, gl.load(meta_ptr + prod * 8 + 3),
                False, False)
            _count_lanes(cnt_ptr + prod, stored, lanes)
            if TIMED:
                t, storing = _tick(t, storing, lanes)
        _exit_and_reset(cnt_ptr, exit_target, lanes, MAXP)
        if TIMED:
            _time_end(role, lanes, (counted, arriving, computing, storing), 5)

    @gluon.jit
    def _ring_chain_kernel(x_ptr, yw_ptr, y_ptr, ws_ptr, sem_ptr, cnt_ptr, items_ptr, n_items_ptr,
                           meta_ptr, w0, s0, b0, w1, s1, b1, w2, s2, b2, w3, s3, b3, M, L,
                           exit_target, tim_ptr, P: gl.constexpr, MAXP: gl.constexpr,
                           GROUP: gl.constexpr, CB: gl.constexpr, STAGES: gl.constexpr,
                           NT: gl.constexpr, GDC: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           TIMED: gl.constexpr):
        if GDC:
            gdc_launch_dependents()
        descs = ((w0, s0, b0), (w1, s1, b1), (w2, s2, b2), (w3, s3, b3))
        w_s = gl.allocate_shared_memory(gl.int32, [STAGES * CB] + w0.block_type.shape, w0.layout)
        s_s = gl.allocate_shared_memory(gl.int32, [STAGES] + s0.block_type.shape, s0.layout)
        b_s = gl.allocate_shared_memory(gl.int32, [STAGES] + b0.block_type.shape, b0.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=_TT)
        # one entry per partition, spelled out: a kernel body takes no comprehension
        gl.warp_specialize([
            (_chain_producer, (descs, w_s, s_s, b_s, ready, empty, items_ptr, n_items_ptr,
                               meta_ptr, L, tim_ptr, P, GROUP, CB, STAGES, TIMED)),
            (_chain_consumer, (x_ptr, yw_ptr, y_ptr, ws_ptr, sem_ptr, cnt_ptr, items_ptr,
                               n_items_ptr, meta_ptr, w_s, s_s, b_s, ready, empty, M, L,
                               exit_target, tim_ptr, 0, MAXP, GROUP, CB, STAGES, NT, GDC,
                               TIMED)),
            (_chain_consumer, (x_ptr, yw_ptr, y_ptr, ws_ptr, sem_ptr, cnt_ptr, items_ptr,
                               n_items_ptr, meta_ptr, w_s, s_s, b_s, ready, empty, M, L,
                               exit_target, tim_ptr, 1, MAXP, GROUP, CB, STAGES, NT, GDC,
                               TIMED)),
            (_chain_consumer, (x_ptr, yw_ptr, y_ptr, ws_ptr, sem_ptr, cnt_ptr, items_ptr,
                               n_items_ptr, meta_ptr, w_s, s_s, b_s, ready, empty, M, L,
                               exit_target, tim_ptr, 2, MAXP, GROUP, CB, STAGES, NT, GDC,
                               TIMED)),
            (_chain_consumer, (x_ptr, yw_ptr, y_ptr, ws_ptr, sem_ptr, cnt_ptr, items_ptr,
                               n_items_ptr, meta_ptr, w_s, s_s, b_s, ready, empty, M, L,
                               exit_target, tim_ptr, 3, MAXP, GROUP, CB, STAGES, NT, GDC,
                               TIMED)),
        ], [1, 1, 1, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS])


def kernel():
    """The Gluon chain kernel (None without Gluon)."""
    return _ring_chain_kernel if gluon is not None else None


def chain_stages(cb: int, group_size: int) -> int:
    """Stages of the ring: RING_BYTES' worth (module docstring: residency)."""
    return max(2, min(MAX_STAGES, RING_BYTES // ring.stage_bytes(cb, group_size)))


def deal(costs: Sequence[Sequence[int]], programs: int) -> list[list[tuple[int, int]]]:
    """Each program's list of (product, item) for items of ``costs[p][item]`` (ring
    steps), dealt in chain order: an item goes to the program least loaded within its
    product, then overall, then lowest index. Every list is in chain order."""
    lists: list[list[tuple[int, int]]] = [[] for _ in range(programs)]
    total = [0] * programs
    for p, items in enumerate(costs):
        heap = [(0, total[g], g) for g in range(programs)]
        heapq.heapify(heap)
        for i, c in enumerate(items):
            here, _, g = heapq.heappop(heap)
            lists[g].append((p, i))
            total[g] += c
            heapq.heappush(heap, (here + c, total[g], g))
    return lists


class RingChain:
    """The plan of one chain over fixed weights, built once (eagerly): the split of K of
    each product (`qmatmul_ring.ring_shape`'s unless ``splits`` overrides it), the work
    tables and the descriptors. ``chain(x)`` launches it and returns [y_0, ..., y_{P-1}].

    Tables (int32, on the device): items [G, L, 4] (product, row-tile group, split, 0),
    counts [G]; meta [P, META]: N, KB, blocks per split, SPLIT, the lanes product p counts
    (programs × TT × 32), its first semaphore, and per row of x its first float32 of the
    split workspace and its first bf16 of the outputs.

    ``timed``: launch the timed form; ``timing`` [G, SLOTS] int64 then holds the last
    launch's clocks (`fold_timing` reads it), else None."""

    def __init__(self, weights: Sequence[FragmentWeight], splits: Sequence[int | None] | None = None,
                 stages: int | None = None, timed: bool = False):
        reason = chain_reason(weights)
        if reason is not None:
            raise ValueError(f"ring_chain cannot take these weights: {reason}")
        self.weights = list(weights)
        P = len(weights)
        device = weights[0].device
        group = weights[0].group_size
        splits = list(splits) if splits is not None else [None] * P
        if len(splits) != P:
            raise ValueError(f"{len(splits)} splits for {P} products")
        self.shapes = [ring.ring_shape(f.n, f.k, group, device, split=sp)
                       for f, sp in zip(weights, splits)]
        self.cb = min(ls["CB"] for ls in self.shapes)  # powers of two: divides every share
        self.stages = stages or chain_stages(self.cb, group)
        costs, meta = [], []
        sem_base = ws_row = y_row = 0
        for f, ls in zip(weights, self.shapes):
            programs, split, bpp = ls["grid"][0], ls["SPLIT"], ls["BPP"]
            KB = f.k // BLOCK_K
            steps = [(min((sp + 1) * bpp, KB) - sp * bpp) // self.cb for sp in range(split)]
            costs.append([steps[sp] for _ in range(programs) for sp in range(split)])
            meta.append([f.n, KB, bpp, split, programs * TT * 32, sem_base, ws_row, y_row])
            if split > 1:
                sem_base += programs * TT * 32
                ws_row += split * f.n
            y_row += f.n
        if sem_base > SEMAPHORE_SLOTS:
            raise ValueError(f"the chain's split semaphores ({sem_base}) exceed "
                             f"{SEMAPHORE_SLOTS}")
        self.ws_per_row, self.y_per_row = ws_row, y_row
        self.programs = min(sm_count(device), sum(len(c) for c in costs))
        lists = deal(costs, self.programs)
        L = max(len(items) for items in lists)
        table = torch.zeros(self.programs, L, 4, dtype=torch.int32)
        for g, items in enumerate(lists):
            for k, (p, i) in enumerate(items):
                split = self.shapes[p]["SPLIT"]
                table[g, k, :3] = torch.tensor([p, i // split, i % split])
        self.items = table.to(device)
        self.counts = torch.tensor([len(items) for items in lists], dtype=torch.int32,
                                   device=device)
        self.meta = torch.tensor(meta, dtype=torch.int32, device=device)
        self.L = L
        self.descriptors = [ring.descriptors(f, self.cb) for f in weights]
        self.timing = (torch.zeros(self.programs, SLOTS, dtype=torch.int64, device=device)
                       if timed else None)

    def __call__(self, x: torch.Tensor, pdl: bool | None = None) -> list[torch.Tensor]:
        f0 = self.weights[0]
        reason = input_reason(x, f0)
        if reason is not None:
            raise ValueError(f"ring_chain cannot take these inputs: {reason}")
        x2 = x.reshape(-1, f0.k).contiguous()
        M = x2.shape[0]
        # even length: the consumers read the outputs back as int32 words
        y = torch.empty(-(-M * self.y_per_row // 2) * 2, dtype=torch.bfloat16, device=x.device)
        ws = torch.empty(max(1, M * self.ws_per_row), dtype=torch.float32, device=x.device)
        gdc = pdl_enabled(x.device) if pdl is None else pdl
        descs = [d for triple in self.descriptors for d in triple]
        descs += descs[:3] * (MAX_PRODUCTS - len(self.descriptors))  # unused slots
        _ring_chain_kernel[(self.programs,)](
            x2.view(torch.int32), y.view(torch.int32), y, ws, semaphores(x.device),
            counters(x.device), self.items, self.counts, self.meta, *descs, M, self.L,
            self.programs * TT, self.timing, P=len(self.weights), MAXP=MAX_PRODUCTS,
            GROUP=f0.group_size, CB=self.cb, STAGES=self.stages, NT=triton.cdiv(M, 8), GDC=gdc,
            CONSUMER_REGS=ring.MAXNREG_ONE_TILE + 32, TIMED=self.timing is not None, num_warps=4,
            maxnreg=ring.MAXNREG_ONE_TILE, **({"launch_pdl": True} if gdc else {}))
        out, start = [], 0
        for f in self.weights:
            out.append(y[start * M:(start + f.n) * M].view(*x.shape[:-1], f.n))
            start += f.n
        return out


@dataclass(frozen=True)
class ChainTiming:
    """Where each program's time went in one timed launch of a `RingChain` (`fold_timing`).

    A program's span runs from the first start to the last end of its roles (the producer,
    four consumer warps), in its SM's cycles; each share is a role's cycles in one bucket
    over that span, one value per program (``shares[name][g]``):

    - ``producer_slot_wait``: waiting for a free ring slot (every slot holds a stage not yet
      consumed); ``producer_issue``: the TMA issue and the walk of its list.
    - the mean over the four consumer warps of ``consumer_launch_wait`` (``gdc_wait``: the
      kernel before), ``consumer_counter_wait`` (spinning until the previous product is
      stored), ``consumer_ready_wait`` (a stage's data not yet arrived: streaming-bound),
      ``consumer_compute`` (a stage's shared loads and mma steps, each item's tables) and
      ``consumer_store`` (the outputs, the split-K semaphores and sum, the lane count).
    - ``producer_other`` and ``consumer_other``: the rest of the span (before the role
      started, after it ended, its exit); never negative, since a role's buckets are
      differences of its own consecutive clock reads within its start and end.

    ``first_ns``/``last_ns``: each program's first start and last end by %globaltimer (one
    clock for the GPU, possibly in steps of up to a µs), to place programs against each
    other."""

    span_cycles: tuple[int, ...]
    first_ns: tuple[int, ...]
    last_ns: tuple[int, ...]
    shares: dict[str, tuple[float, ...]]

    def summary(self) -> dict:
        """The launch (ns, globaltimer: first start to last end, and the spreads of the
        programs' starts and ends), the spans and each share: mean, min and max over the
        programs."""
        def stats(v):
            return {"mean": sum(v) / len(v), "min": min(v), "max": max(v)}
        return {"programs": len(self.span_cycles),
                "launch_ns": max(self.last_ns) - min(self.first_ns),
                "start_spread_ns": max(self.first_ns) - min(self.first_ns),
                "end_spread_ns": max(self.last_ns) - min(self.last_ns),
                "span_cycles": stats(self.span_cycles),
                "shares": {name: stats(v) for name, v in self.shares.items()}}


def fold_timing(timing: torch.Tensor) -> ChainTiming:
    """A timed launch's buffer ([G, SLOTS] int64, `RingChain.timing`) as shares of each
    program's span (`ChainTiming`)."""
    if timing.dim() != 2 or timing.shape[1] != SLOTS or timing.shape[0] == 0:
        raise ValueError(f"a timing buffer is [programs, {SLOTS}], not {list(timing.shape)}")
    spans, firsts, lasts = [], [], []
    names = ([f"producer_{b}" for b in PRODUCER_BUCKETS] + ["producer_other"]
             + [f"consumer_{b}" for b in CONSUMER_BUCKETS] + ["consumer_other"])
    shares: dict[str, list[float]] = {name: [] for name in names}
    for row in timing.cpu().tolist():
        roles = [row[r * ROLE:(r + 1) * ROLE] for r in range(ROLES)]
        span = max(r[1] for r in roles) - min(r[0] for r in roles)
        if span <= 0:
            raise ValueError(f"program {len(spans)} has no span: not a timed launch's buffer")
        spans.append(span)
        firsts.append(min(r[2] for r in roles))
        lasts.append(max(r[3] for r in roles))
        producer = roles[0][4:4 + len(PRODUCER_BUCKETS)]
        for b, cycles in zip(PRODUCER_BUCKETS, producer):
            shares[f"producer_{b}"].append(cycles / span)
        shares["producer_other"].append((span - sum(producer)) / span)
        consumers = [sum(r[4 + i] for r in roles[1:]) for i in range(len(CONSUMER_BUCKETS))]
        for b, cycles in zip(CONSUMER_BUCKETS, consumers):
            shares[f"consumer_{b}"].append(cycles / (TT * span))
        shares["consumer_other"].append((TT * span - sum(consumers)) / (TT * span))
    return ChainTiming(tuple(spans), tuple(firsts), tuple(lasts),
                       {name: tuple(v) for name, v in shares.items()})


def chain_reason(weights: Sequence) -> str | None:
    """None when the weights make a chain this kernel takes (host facts only: the device
    and input are `input_reason`'s), else why not."""
    if not 1 <= len(weights) <= MAX_PRODUCTS:
        return f"{len(weights)} products (1..{MAX_PRODUCTS} a launch)"
    if not all(isinstance(f, FragmentWeight) for f in weights):
        return "every weight must be held in fragment order (FragmentWeight)"
    for i, (a, b) in enumerate(pairwise(weights)):
        if b.k != a.n:
            return f"product {i + 1} takes {b.k} features but product {i} makes {a.n}"
    if len({f.group_size for f in weights}) > 1:
        return "the weights' group sizes differ"
    if len({f.device for f in weights}) > 1:
        return "the weights are on different devices"
    for i, f in enumerate(weights):
        probe = torch.empty(1, f.k, dtype=torch.bfloat16, device=f.device)
        reason = ring.unsupported_reason(probe, f)
        if reason is not None:
            return f"product {i}: {reason}"
    return None


def input_reason(x: torch.Tensor, f0: FragmentWeight) -> str | None:
    """None when x [..., K_0] can enter the chain, else why not."""
    if x.shape[-1] != f0.k:
        return f"x has {x.shape[-1]} features, the first weight {f0.k}"
    if x.dtype != torch.bfloat16:
        return f"x dtype {x.dtype} (bf16)"
    if x.device != f0.device:
        return f"x is on {x.device}, the weights on {f0.device}"
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows (1..{MAX_ROWS})"
    return None


def ring_chain(x: torch.Tensor, weights: Sequence[FragmentWeight],
               pdl: bool | None = None) -> list[torch.Tensor]:
    """[y_0, ..., y_{P-1}] of the chain, planning it for this call (eager; build a
    `RingChain` once to replay it from a graph)."""
    return RingChain(weights)(x, pdl=pdl)
