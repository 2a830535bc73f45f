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
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
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
                        P: gl.constexpr, GROUP: gl.constexpr, CB: gl.constexpr,
                        STAGES: gl.constexpr):
        """Default partition: the TMA copies of every item's stages, in list order, one
        ring count across items (it waits only for free slots)."""
        pid = gl.program_id(0)
        pos = 0
        for it in range(gl.load(n_items_ptr + pid)):
            prod, pid0, pid2 = _item(items_ptr, pid, L, it)
            _, kb_lo, n_steps = _share(meta_ptr, prod, pid2, CB)
            for j in gl.static_range(P):
                if prod == j:
                    w_desc, s_desc, b_desc = descs[j]
                    for i in range(n_steps):
                        ring.issue_stage(w_desc, s_desc, b_desc, w_s, s_s, b_s, ready, empty,
                                         pos + i, pid0 * _TT, kb_lo + i * CB, GROUP, _TT, CB,
                                         STAGES)
            pos += n_steps

    @gluon.jit
    def _chain_consumer(x_ptr, yw_ptr, y_ptr, ws_ptr, sem_ptr, cnt_ptr, items_ptr, n_items_ptr,
                        meta_ptr, w_s, s_s, b_s, ready, empty, M, L, exit_target,
                        wid: gl.constexpr, MAXP: gl.constexpr, GROUP: gl.constexpr,
                        CB: gl.constexpr, STAGES: gl.constexpr, NT: gl.constexpr,
                        GDC: gl.constexpr):
        """One warp, row tile ``wid`` of every item in the program's list: wait for the
        product it reads, `qmatmul_ring`'s steps and outputs, count the stored lanes."""
        w_flat, s_flat, b_flat = ring.ring_views(w_s, s_s, b_s, GROUP, _TT, CB, STAGES)
        g, q, r, zero_i = ring.lane_indices()
        lanes = _lane_ids()
        if GDC:
            gdc_wait()  # x, and the counters the launch before zeroed last
        pid = gl.program_id(0)
        pos = 0
        for it in range(gl.load(n_items_ptr + pid)):
            prod, pid0, pid2 = _item(items_ptr, pid, L, it)
            KB, kb_lo, n_steps = _share(meta_ptr, prod, pid2, CB)
            xp = x_ptr
            if prod > 0:  # x is y_{prod-1}: wait until all its lanes are counted
                _wait_count(cnt_ptr + prod - 1, gl.load(meta_ptr + (prod - 1) * 8 + 4), lanes)
                xp = yw_ptr + M * gl.load(meta_ptr + (prod - 1) * 8 + 7) // 2
            x_offs = ring.x_offsets(g, q, r, zero_i, M, KB, kb_lo, NT)
            acc = ()
            for nt in gl.static_range(NT):
                acc = acc + (gl.zeros([8, 4, 4], gl.float32, _L3),)
            acc = ring.consume_steps(xp, x_offs, acc, w_flat, s_flat, b_flat, ready, empty, pos,
                                     n_steps, wid, 0, 1, GROUP, _TT, CB, STAGES, NT)
            pos += n_steps
            N = gl.load(meta_ptr + prod * 8)
            stored = ring.store_outputs(
                y_ptr + M * gl.load(meta_ptr + prod * 8 + 7), y_ptr, y_ptr,
                ws_ptr + M * gl.load(meta_ptr + prod * 8 + 6),
                sem_ptr + gl.load(meta_ptr + prod * 8 + 5), acc, g, q, r, M, N,
                pid0 * _TT + wid, pid0, pid2, N, N, wid, _TT, NT, gl.load(meta_ptr + prod * 8 + 3),
                False, False)
            _count_lanes(cnt_ptr + prod, stored, lanes)
        _exit_and_reset(cnt_ptr, exit_target, lanes, MAXP)

    @gluon.jit
    def _ring_chain_kernel(x_ptr, yw_ptr, y_ptr, ws_ptr, sem_ptr, cnt_ptr, items_ptr, n_items_ptr,
                           meta_ptr, w0, s0, b0, w1, s1, b1, w2, s2, b2, w3, s3, b3, M, L,
                           exit_target, P: gl.constexpr, MAXP: gl.constexpr,
                           GROUP: gl.constexpr, CB: gl.constexpr, STAGES: gl.constexpr,
                           NT: gl.constexpr, GDC: gl.constexpr, CONSUMER_REGS: gl.constexpr):
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
                               meta_ptr, L, P, GROUP, CB, STAGES)),
            (_chain_consumer, (x_ptr, yw_ptr, y_ptr, ws_ptr, sem_ptr, cnt_ptr, items_ptr,
                               n_items_ptr, meta_ptr, w_s, s_s, b_s, ready, empty, M, L,
                               exit_target, 0, MAXP, GROUP, CB, STAGES, NT, GDC)),
            (_chain_consumer, (x_ptr, yw_ptr, y_ptr, ws_ptr, sem_ptr, cnt_ptr, items_ptr,
                               n_items_ptr, meta_ptr, w_s, s_s, b_s, ready, empty, M, L,
                               exit_target, 1, MAXP, GROUP, CB, STAGES, NT, GDC)),
            (_chain_consumer, (x_ptr, yw_ptr, y_ptr, ws_ptr, sem_ptr, cnt_ptr, items_ptr,
                               n_items_ptr, meta_ptr, w_s, s_s, b_s, ready, empty, M, L,
                               exit_target, 2, MAXP, GROUP, CB, STAGES, NT, GDC)),
            (_chain_consumer, (x_ptr, yw_ptr, y_ptr, ws_ptr, sem_ptr, cnt_ptr, items_ptr,
                               n_items_ptr, meta_ptr, w_s, s_s, b_s, ready, empty, M, L,
                               exit_target, 3, MAXP, GROUP, CB, STAGES, NT, GDC)),
        ], [1, 1, 1, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS])


def kernel():
    """The Gluon chain kernel (None without Gluon)."""
    return _ring_chain_kernel if gluon is not None else None


def stage_bytes(cb: int, group_size: int) -> int:
    """Bytes of one ring stage: CB blocks of TT row tiles, their scales and biases."""
    return TT * cb * 512 + 2 * TT * (cb * BLOCK_K // group_size) * 32


def chain_stages(cb: int, group_size: int) -> int:
    """Stages of the ring: RING_BYTES' worth (module docstring: residency)."""
    return max(2, min(MAX_STAGES, RING_BYTES // stage_bytes(cb, group_size)))


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
    split workspace and its first bf16 of the outputs."""

    def __init__(self, weights: Sequence[FragmentWeight], splits: Sequence[int | None] | None = None,
                 stages: int | None = None):
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
            self.programs * TT, P=len(self.weights), MAXP=MAX_PRODUCTS, GROUP=f0.group_size,
            CB=self.cb, STAGES=self.stages, NT=triton.cdiv(M, 8), GDC=gdc,
            CONSUMER_REGS=ring.MAXNREG_ONE_TILE + 32, num_warps=4,
            maxnreg=ring.MAXNREG_ONE_TILE, **({"launch_pdl": True} if gdc else {}))
        out, start = [], 0
        for f in self.weights:
            out.append(y[start * M:(start + f.n) * M].view(*x.shape[:-1], f.n))
            start += f.n
        return out


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
