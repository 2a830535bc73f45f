"""A decoder layer from the attention's output on as one persistent launch: programs
walking instruction tables.

Contract (`MlpProgram`, built once per layer and row count; `MlpProgram.__call__`):

    x          [M, H], the layer's normalized MLP input (M = the program's rows); with
               ``o`` (`OPart`), the attention's output [M, Hq·D]
    residual   [M, H] in x's dtype: the residual stream before the MLP (with ``o``,
               before the O product)
    returns    (h, n) as `joint_step` over down_proj returns them: h = residual +
               post_norm(down(act(gate(x))·up(x))) (or + the product), n = next_norm(h)
               (None without a next norm); with ``o`` the MLP's x and residual are the O
               joint's n and h first

The same work as the fused launches it replaces (`joint_step.joint_step` over o_proj,
`fused_mlp.gate_up_act_gemv`, `joint_step.joint_step` over down_proj), in the same tiles,
splits of K and sums, so the bits are theirs. What differs is who runs what: a grid of
as many programs as the SMs hold at once (one per SM at the first call, then as many as
the compiled kernel's registers let an SM hold, up to 4, so that their waits between
instructions overlap; one under the interpreter, which runs programs one after another),
each walking its own list of instructions, dealt round-robin from one ordered list:

- O_PRODUCT (tile, split), O_JOINT (row): the O product's tiles, then once O counts
  every tile, each row's joint (the MLP's residual and normalized input), counted on MID;
- GATE_UP (tile, split): that split of K of a gate tile and the same up tile (after MID
  counts every row, with ``o``); the last split to arrive sums the splits in order,
  applies the activation, stores the tile of the activation and counts it on ACT;
- DOWN (tile, split): waits until ACT counts every activation tile; the last split
  stores the product tile (+ bias) and counts it on DOWN;
- JOINT (row): waits until DOWN counts every tile, then the row's residual joint and
  next norm (`joint.joint_epilogue`); the last row to finish zeroes the counts.

A product instruction that waits has requested its first weights before the wait, so no
launch boundary separates the products and each program's next weights are in flight
while it waits for its inputs: what a persistent decode program keeps across every
operation of a step, tried here on one product kind. Deadlock-free because the grid
never exceeds what the SMs hold (every program is resident) and each list keeps the
ordered list's order, in which every wait is on instructions before it. Counters and split
semaphores are the program's own (zero between calls): the first call must run eagerly,
later calls can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ...levers import interpreter_active
from ...quant import QuantizedTensor
from ..common import pdl
from ..common.precise_math import use_libdevice
from ..common.rounding import as_stored, emulates_bf16, stored_view
from ..common.units import count_done, wait_count_reached
from ..pointwise.gated_act import ACT_IDS
from ..products.fused_mlp import gate_up_gemv_shapes, gated
from ..products.qmatmul import gemv_shape, gemv_tile, weight_rounding
from ..products.splitk import split_workspace
from .joint import joint_epilogue

# Opcodes, and the counters' slots: five counts, then one semaphore per gate/up tile, per
# down tile and per O tile.
GATE_UP, DOWN, JOINT, O_PRODUCT, O_JOINT = (tl.constexpr(i) for i in range(5))
ACT_COUNT, DOWN_COUNT, JOINT_COUNT, O_COUNT, MID_COUNT = (tl.constexpr(i) for i in range(5))
FIRST_SEMAPHORE = tl.constexpr(5)


@triton.jit
def _arrive_split(ws_ptr, sem_ptr, acc, plane, split, ws_off, out_ok, N,
                  PLANES: tl.constexpr, SPLIT: tl.constexpr, LAST_PLANE: tl.constexpr):
    """Store split ``split``'s float32 partial (plane ``plane``); with LAST_PLANE, count
    the split on its tile's semaphore: True for the tile's last split to arrive, which
    resets the semaphore."""
    tl.store(ws_ptr + (split * PLANES + plane) * N + ws_off, acc, mask=out_ok)
    last = False
    if LAST_PLANE:
        last = count_done(sem_ptr) == SPLIT - 1
        if last:
            tl.atomic_xchg(sem_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _summed(ws_ptr, plane, ws_off, out_ok, N, PLANES: tl.constexpr, SPLIT: tl.constexpr):
    """Plane ``plane`` summed over the splits in split order (as `splitk.sum_splits`)."""
    total = tl.zeros(ws_off.shape, tl.float32)
    for sp in range(SPLIT):
        total += tl.load(ws_ptr + (sp * PLANES + plane) * N + ws_off, mask=out_ok, other=0.0,
                         cache_modifier=".cg")
    return total


@triton.jit
def _gate_up(tile, split, x_ptr, stride_xm, g_ptr, gs_ptr, gb_ptr, u_ptr, us_ptr, ub_ptr,
             stride_gn, stride_gsn, stride_gbn, stride_un, stride_usn, stride_ubn, act_ptr,
             ws_ptr, cnt_ptr, wait_ptr, wait_count, I, H, magic,
             ROWS: tl.constexpr, G_BITS: tl.constexpr, G_GROUP: tl.constexpr,
             G_GPI: tl.constexpr, G_ITERS: tl.constexpr, U_BITS: tl.constexpr,
             U_GROUP: tl.constexpr, U_GPI: tl.constexpr, U_ITERS: tl.constexpr,
             SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
             ACT: tl.constexpr, LIBDEVICE: tl.constexpr, BF16_BITS: tl.constexpr,
             G_ROUND: tl.constexpr, G_PAIRS: tl.constexpr, U_ROUND: tl.constexpr,
             U_PAIRS: tl.constexpr, NATIVE: tl.constexpr, WAIT: tl.constexpr,
             GDC: tl.constexpr):
    """GATE_UP (module docstring): `fused_mlp._gate_up_act_gemv_kernel`'s program
    (tile, split), its arithmetic op for op. WAIT: x is this launch's own (the O joint's
    norm), ready once wait_ptr counts ``wait_count``; else the previous kernel's (GDC)."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < I
    if WAIT:
        gate = gemv_tile(x_ptr, stride_xm, g_ptr, gs_ptr, gb_ptr, stride_gn, stride_gsn,
                         stride_gbn, rows, row_ok, split * (G_ITERS * G_GPI), H // G_GROUP,
                         magic, ROWS, G_BITS, G_GROUP, G_GPI, G_ITERS, BLOCK_N, EVEN, G_ROUND,
                         G_PAIRS, NATIVE, False, wait_ptr, wait_count)
    else:
        gate = gemv_tile(x_ptr, stride_xm, g_ptr, gs_ptr, gb_ptr, stride_gn, stride_gsn,
                         stride_gbn, rows, row_ok, split * (G_ITERS * G_GPI), H // G_GROUP,
                         magic, ROWS, G_BITS, G_GROUP, G_GPI, G_ITERS, BLOCK_N, EVEN, G_ROUND,
                         G_PAIRS, NATIVE, GDC)
    up = gemv_tile(x_ptr, stride_xm, u_ptr, us_ptr, ub_ptr, stride_un, stride_usn, stride_ubn,
                   rows, row_ok, split * (U_ITERS * U_GPI), H // U_GROUP, magic, ROWS,
                   U_BITS, U_GROUP, U_GPI, U_ITERS, BLOCK_N, EVEN, U_ROUND, U_PAIRS, NATIVE)
    out_ok = row_ok[:, None]
    ws_off = rows[:, None]
    last = True
    if SPLIT > 1:  # planes [SPLIT, 2·ROWS, I]: gate of row m at plane m, up at ROWS + m
        sem = cnt_ptr + FIRST_SEMAPHORE + tile
        for m in tl.static_range(ROWS):
            _arrive_split(ws_ptr, sem, gate[m], m, split, ws_off, out_ok, I, 2 * ROWS, SPLIT,
                          False)
        for m in tl.static_range(ROWS):
            last = _arrive_split(ws_ptr, sem, up[m], ROWS + m, split, ws_off, out_ok, I,
                                 2 * ROWS, SPLIT, m == ROWS - 1)
    if last:
        for m in tl.static_range(ROWS):
            gm = gate[m]
            um = up[m]
            if SPLIT > 1:
                gm = _summed(ws_ptr, m, ws_off, out_ok, I, 2 * ROWS, SPLIT)
                um = _summed(ws_ptr, ROWS + m, ws_off, out_ok, I, 2 * ROWS, SPLIT)
            h = gated(gm, um, ACT, LIBDEVICE, x_ptr, BF16_BITS)
            tl.store(act_ptr + m * I + ws_off, as_stored(h, act_ptr, BF16_BITS), mask=out_ok)
        count_done(cnt_ptr + ACT_COUNT)


@triton.jit
def _product(tile, split, x_ptr, K, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn,
             bias_ptr, y_ptr, N, ws_ptr, sem_ptr, done_ptr, wait_ptr, wait_count, magic,
             ROWS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GPI: tl.constexpr,
             ITERS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
             EVEN: tl.constexpr, HAS_BIAS: tl.constexpr, BF16_BITS: tl.constexpr,
             ROUND: tl.constexpr, PAIRS: tl.constexpr, NATIVE: tl.constexpr,
             WAIT: tl.constexpr, GDC: tl.constexpr):
    """DOWN or O (module docstring): `qmatmul.gemv_product`'s program (tile, split) of
    y [ROWS, N] = x [ROWS, K]·dequant(w)ᵀ (+ bias); the tile's last split stores it and
    counts it at done_ptr. WAIT: x is ready once wait_ptr counts ``wait_count`` (else
    the previous kernel's, GDC); the first weights are requested before either wait."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    if WAIT:
        ys = gemv_tile(x_ptr, K, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn, rows,
                       row_ok, split * (ITERS * GPI), K // GROUP, magic, ROWS, BITS, GROUP,
                       GPI, ITERS, BLOCK_N, EVEN, ROUND, PAIRS, NATIVE, False, wait_ptr,
                       wait_count)
    else:
        ys = gemv_tile(x_ptr, K, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn, rows,
                       row_ok, split * (ITERS * GPI), K // GROUP, magic, ROWS, BITS, GROUP,
                       GPI, ITERS, BLOCK_N, EVEN, ROUND, PAIRS, NATIVE, GDC)
    out_ok = row_ok[:, None]
    ws_off = rows[:, None]
    last = True
    if SPLIT > 1:  # planes [SPLIT, ROWS, N]
        sem = sem_ptr + tile
        for m in tl.static_range(ROWS):
            last = _arrive_split(ws_ptr, sem, ys[m], m, split, ws_off, out_ok, N, ROWS, SPLIT,
                                 m == ROWS - 1)
    if last:
        for m in tl.static_range(ROWS):
            acc = ys[m]
            if SPLIT > 1:
                acc = _summed(ws_ptr, m, ws_off, out_ok, N, ROWS, SPLIT)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptr + m * N + ws_off, as_stored(acc, y_ptr, BF16_BITS), mask=out_ok)
        count_done(done_ptr)


@triton.jit
def _joint(row, a_ptr, res_ptr, stride_res, post_w_ptr, next_w_ptr, h_ptr, n_ptr, N, eps,
           inv_d, wait_ptr, wait_count, done_ptr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
           HAS_POST: tl.constexpr, HAS_NEXT: tl.constexpr, UNIT_OFFSET: tl.constexpr,
           BF16_BITS: tl.constexpr, GDC: tl.constexpr):
    """JOINT or O_JOINT: row ``row``'s residual joint (`joint.joint_epilogue`) once
    wait_ptr counts ``wait_count``; counts the row at done_ptr and returns the count
    before it."""
    wait_count_reached(wait_ptr, wait_count)
    if GDC:  # the residual may be an earlier kernel's
        tl.extra.cuda.gdc_wait()
    joint_epilogue(a_ptr, res_ptr, stride_res, post_w_ptr, next_w_ptr, h_ptr, n_ptr, N, eps,
                   inv_d, row, ROWS, ROWS, BLOCK_D, HAS_POST, HAS_NEXT, UNIT_OFFSET, BF16_BITS)
    return count_done(done_ptr)


@triton.jit
def _mlp_program_kernel(
    table_ptr, n_instructions,  # int32 [programs, n_instructions, 3]: op, a, b (op < 0: none)
    x_ptr, g_ptr, gs_ptr, gb_ptr, u_ptr, us_ptr, ub_ptr,
    d_ptr, ds_ptr, db_ptr, bias_ptr,
    act_ptr, a_ptr,  # scratch [M, I], [M, H]
    gu_ws_ptr, d_ws_ptr, cnt_ptr,
    res_ptr, post_w_ptr, next_w_ptr, h_ptr, n_ptr,
    # the O product and its joint (WITH_O): x_ptr and res_ptr are then its outputs
    ox_ptr, o_ptr, os_ptr, ob_ptr, o_bias_ptr, ao_ptr, o_ws_ptr, o_res_ptr, o_post_w_ptr,
    o_next_w_ptr,
    I, H, KO, act_tiles, down_tiles, o_tiles, magic, stride_xm, stride_gn, stride_gsn,
    stride_gbn, stride_un, stride_usn, stride_ubn, stride_dn, stride_dsn, stride_dbn,
    stride_on, stride_osn, stride_obn, stride_res, stride_o_res, eps, inv_d,
    ROWS: tl.constexpr,
    G_BITS: tl.constexpr, G_GROUP: tl.constexpr, G_GPI: tl.constexpr, G_ITERS: tl.constexpr,
    U_BITS: tl.constexpr, U_GROUP: tl.constexpr, U_GPI: tl.constexpr, U_ITERS: tl.constexpr,
    GU_SPLIT: tl.constexpr, GU_BLOCK: tl.constexpr, GU_EVEN: tl.constexpr,
    G_ROUND: tl.constexpr, G_PAIRS: tl.constexpr, U_ROUND: tl.constexpr,
    U_PAIRS: tl.constexpr,
    D_BITS: tl.constexpr, D_GROUP: tl.constexpr, D_GPI: tl.constexpr, D_ITERS: tl.constexpr,
    D_SPLIT: tl.constexpr, D_BLOCK: tl.constexpr, D_EVEN: tl.constexpr,
    D_ROUND: tl.constexpr, D_PAIRS: tl.constexpr, HAS_BIAS: tl.constexpr,
    D_SEMAPHORE: tl.constexpr,
    WITH_O: tl.constexpr, O_BITS: tl.constexpr, O_GROUP: tl.constexpr, O_GPI: tl.constexpr,
    O_ITERS: tl.constexpr, O_SPLIT: tl.constexpr, O_BLOCK: tl.constexpr,
    O_EVEN: tl.constexpr, O_ROUND: tl.constexpr, O_PAIRS: tl.constexpr,
    O_HAS_BIAS: tl.constexpr, O_SEMAPHORE: tl.constexpr, O_HAS_POST: tl.constexpr,
    ACT: tl.constexpr, LIBDEVICE: tl.constexpr, BF16_BITS: tl.constexpr, NATIVE: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_POST: tl.constexpr, HAS_NEXT: tl.constexpr,
    UNIT_OFFSET: tl.constexpr, GDC: tl.constexpr,
):
    if GDC:  # every program has started before the next kernel may: no deadlock with it
        tl.extra.cuda.gdc_launch_dependents()
    mine = table_ptr + tl.program_id(0) * n_instructions * 3
    next_op = tl.load(mine)
    next_a = tl.load(mine + 1)
    next_b = tl.load(mine + 2)
    for i in range(n_instructions):
        op = next_op
        a = next_a
        b = next_b
        # the next row is requested before this instruction runs: its latency hides
        more = i + 1 < n_instructions
        next_op = tl.load(mine + i * 3 + 3, mask=more, other=-1)
        next_a = tl.load(mine + i * 3 + 4, mask=more, other=0)
        next_b = tl.load(mine + i * 3 + 5, mask=more, other=0)
        if op == O_PRODUCT:
            if WITH_O:  # compiled only where the table can hold it
                _product(a, b, ox_ptr, KO, o_ptr, os_ptr, ob_ptr, stride_on, stride_osn,
                         stride_obn, o_bias_ptr, ao_ptr, H, o_ws_ptr, cnt_ptr + O_SEMAPHORE,
                         cnt_ptr + O_COUNT, cnt_ptr, 0, magic, ROWS, O_BITS, O_GROUP, O_GPI,
                         O_ITERS, O_SPLIT, O_BLOCK, O_EVEN, O_HAS_BIAS, BF16_BITS, O_ROUND,
                         O_PAIRS, NATIVE, False, GDC)
        elif op == O_JOINT:
            if WITH_O:
                _joint(a, ao_ptr, o_res_ptr, stride_o_res, o_post_w_ptr, o_next_w_ptr,
                       res_ptr, x_ptr, H, eps, inv_d, cnt_ptr + O_COUNT, o_tiles,
                       cnt_ptr + MID_COUNT, ROWS, BLOCK_D, O_HAS_POST, True, UNIT_OFFSET,
                       BF16_BITS, GDC)
        elif op == GATE_UP:
            _gate_up(a, b, x_ptr, stride_xm, g_ptr, gs_ptr, gb_ptr, u_ptr, us_ptr, ub_ptr,
                     stride_gn, stride_gsn, stride_gbn, stride_un, stride_usn, stride_ubn,
                     act_ptr, gu_ws_ptr, cnt_ptr, cnt_ptr + MID_COUNT, ROWS, I, H, magic,
                     ROWS, G_BITS, G_GROUP, G_GPI, G_ITERS, U_BITS, U_GROUP, U_GPI, U_ITERS,
                     GU_SPLIT, GU_BLOCK, GU_EVEN, ACT, LIBDEVICE, BF16_BITS, G_ROUND, G_PAIRS,
                     U_ROUND, U_PAIRS, NATIVE, WITH_O, GDC)
        elif op == DOWN:
            _product(a, b, act_ptr, I, d_ptr, ds_ptr, db_ptr, stride_dn, stride_dsn,
                     stride_dbn, bias_ptr, a_ptr, H, d_ws_ptr, cnt_ptr + D_SEMAPHORE,
                     cnt_ptr + DOWN_COUNT, cnt_ptr + ACT_COUNT, act_tiles, magic, ROWS,
                     D_BITS, D_GROUP, D_GPI, D_ITERS, D_SPLIT, D_BLOCK, D_EVEN, HAS_BIAS,
                     BF16_BITS, D_ROUND, D_PAIRS, NATIVE, True, False)
        elif op == JOINT:
            before = _joint(a, a_ptr, res_ptr, stride_res, post_w_ptr, next_w_ptr, h_ptr,
                            n_ptr, H, eps, inv_d, cnt_ptr + DOWN_COUNT, down_tiles,
                            cnt_ptr + JOINT_COUNT, ROWS, BLOCK_D, HAS_POST, HAS_NEXT,
                            UNIT_OFFSET, BF16_BITS, GDC)
            if before == ROWS - 1:
                # every instruction has passed its wait: nothing reads a counter again
                for c in tl.static_range(FIRST_SEMAPHORE):
                    tl.atomic_xchg(cnt_ptr + c, 0, sem="relaxed", scope="gpu")


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def program_count(device: torch.device, instructions: int, per_sm: int = 1) -> int:
    """The grid: ``per_sm`` programs per SM at most (all resident: the waits cannot
    deadlock), one under the interpreter or on a CPU (programs run one after another
    there)."""
    if device.type != "cuda" or interpreter_active():
        return 1
    return max(1, min(_sm_count(device) * per_sm, instructions))


def resident_per_sm(compiled, num_warps: int, device: torch.device, most: int = 4) -> int:
    """How many programs of a compiled kernel an SM holds at once (by registers, threads
    and shared memory; at most ``most``): several programs per SM hide one another's
    latency between instructions, where one program would wait out each alone."""
    props = torch.cuda.get_device_properties(device)
    threads = 32 * num_warps
    regs_per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256  # allocated per warp, in 256s
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * num_warps)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    shared = compiled.metadata.shared
    by_shared = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) // shared \
        if shared else most
    return max(1, min(most, by_regs, by_threads, by_shared))


def deal(instructions: list[tuple[int, int, int]], programs: int) -> torch.Tensor:
    """int32 [programs, ceil(len / programs), 3]: instruction i to program i mod programs,
    each list in the ordered list's order, padded with op -1."""
    per = -(-len(instructions) // programs)
    table = torch.full((programs, per, 3), -1, dtype=torch.int32)
    for i, ins in enumerate(instructions):
        table[i % programs, i // programs] = torch.tensor(ins, dtype=torch.int32)
    return table


@dataclasses.dataclass
class OPart:
    """The O product and its joint, for a program that starts after the attention: the
    weight [H, Hq·D], its bias, and the joint's norms (the post norm Gemma's sandwich has,
    and the MLP's input norm)."""

    weight: QuantizedTensor
    bias: torch.Tensor | None
    post_weight: torch.Tensor | None
    next_weight: torch.Tensor


def _product_args(prefix: str, w: QuantizedTensor, ls: dict, like: torch.Tensor) -> dict:
    """A product's constexprs in the kernel's names (``prefix``: G, U, D or O)."""
    rounding = weight_rounding(like, w)
    return {f"{prefix}_BITS": w.bits, f"{prefix}_GROUP": w.group_size,
            f"{prefix}_GPI": ls["GPI"], f"{prefix}_ITERS": ls["ITERS"],
            f"{prefix}_ROUND": rounding["ROUND"], f"{prefix}_PAIRS": rounding["PAIRS"]}


class MlpProgram:
    """The module docstring's launch for one layer at ``rows`` rows of ``dtype`` on
    ``device`` (with ``o``: from the attention's output on); its shapes, instruction
    tables, counters and workspaces are made here, once."""

    def __init__(self, gate: QuantizedTensor, up: QuantizedTensor, down: QuantizedTensor,
                 down_bias: torch.Tensor | None, act: str, post_weight: torch.Tensor | None,
                 next_weight: torch.Tensor | None, eps: float, unit_offset: bool, rows: int,
                 dtype: torch.dtype, device: torch.device, programs: int | None = None,
                 o: OPart | None = None):
        I, H = gate.shape
        like = torch.empty(rows, H, dtype=dtype, device=device)
        self.g_ls, self.u_ls, reason = gate_up_gemv_shapes(H, gate, up)
        if reason is not None:
            raise ValueError(reason)
        self.d_ls = gemv_shape(H, I, down)
        self.o_ls = gemv_shape(H, o.weight.shape[1], o.weight) if o is not None else None
        self.gate, self.up, self.down, self.bias, self.o = gate, up, down, down_bias, o
        self.post_weight, self.next_weight = post_weight, next_weight
        self.eps, self.unit_offset = eps, unit_offset
        self.rows, self.I, self.H, self.dtype = rows, I, H, dtype
        gu_tiles, gu_split = self.g_ls["grid"][0], self.g_ls["SPLIT"]
        d_tiles, d_split = self.d_ls["grid"][0], self.d_ls["SPLIT"]
        o_tiles, o_split = self.o_ls["grid"][0] if o else 0, self.o_ls["SPLIT"] if o else 1
        self.tiles = (gu_tiles, d_tiles, o_tiles)
        instructions = [(O_PRODUCT.value, t, s) for t in range(o_tiles) for s in range(o_split)]
        instructions += [(O_JOINT.value, m, 0) for m in range(rows if o else 0)]
        instructions += [(GATE_UP.value, t, s) for t in range(gu_tiles)
                         for s in range(gu_split)]
        instructions += [(DOWN.value, t, s) for t in range(d_tiles) for s in range(d_split)]
        instructions += [(JOINT.value, m, 0) for m in range(rows)]
        # one program per SM until the first launch says how many an SM holds (`__call__`)
        self.instructions, self.fixed = instructions, programs is not None
        self.residency: dict | None = None  # registers and programs an SM holds (GPU)
        self.table = deal(instructions, programs or program_count(device, len(instructions)))
        self.table = self.table.to(device)
        self.semaphores = (FIRST_SEMAPHORE.value + gu_tiles,
                           FIRST_SEMAPHORE.value + gu_tiles + d_tiles)  # down's, O's
        self.counters = torch.zeros(self.semaphores[1] + o_tiles, dtype=torch.int32,
                                    device=device)
        self.gu_ws = split_workspace(gu_split, (2 * rows, I), like)
        self.d_ws = split_workspace(d_split, (rows, H), like)
        self.o_ws = split_workspace(o_split, (rows, H), like)
        self.constants = {
            "ROWS": rows, **_product_args("G", gate, self.g_ls, like),
            **_product_args("U", up, self.u_ls, like), **_product_args("D", down, self.d_ls, like),
            **(_product_args("O", o.weight, self.o_ls, like) if o else
               {f"O_{k}": 0 for k in ("BITS", "GROUP", "GPI", "ITERS", "ROUND", "PAIRS")}),
            "GU_SPLIT": gu_split, "GU_BLOCK": self.g_ls["BLOCK_N"],
            "GU_EVEN": self.g_ls["EVEN"] and self.u_ls["EVEN"], "D_SPLIT": d_split,
            "D_BLOCK": self.d_ls["BLOCK_N"], "D_EVEN": self.d_ls["EVEN"],
            "HAS_BIAS": down_bias is not None, "D_SEMAPHORE": self.semaphores[0],
            "WITH_O": o is not None, "O_SPLIT": o_split,
            "O_BLOCK": self.o_ls["BLOCK_N"] if o else 1, "O_EVEN": bool(o and self.o_ls["EVEN"]),
            "O_HAS_BIAS": bool(o and o.bias is not None), "O_SEMAPHORE": self.semaphores[1],
            "O_HAS_POST": bool(o and o.post_weight is not None), "ACT": ACT_IDS[act],
            "LIBDEVICE": use_libdevice(), "BF16_BITS": emulates_bf16(dtype),
            "NATIVE": weight_rounding(like, gate)["NATIVE"],
            "BLOCK_D": triton.next_power_of_2(H), "HAS_POST": post_weight is not None,
            "HAS_NEXT": next_weight is not None, "UNIT_OFFSET": unit_offset,
            "num_warps": self.g_ls["num_warps"]}

    @property
    def programs(self) -> int:
        return self.table.shape[0]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor):
        """(h, n) from x (the MLP's normalized input; with ``o``, the attention's output
        [M, Hq·D]) and the residual before it."""
        M, H, I, o = self.rows, self.H, self.I, self.o
        x2 = x.reshape(M, x.shape[-1])
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        res = residual.reshape(M, H)
        res = res if res.stride(-1) == 1 else res.contiguous()
        act = torch.empty(M, I, dtype=x.dtype, device=x.device)
        a = torch.empty(M, H, dtype=x.dtype, device=x.device)
        h = torch.empty_like(a)
        n = torch.empty_like(a) if self.next_weight is not None else None
        if o is not None:  # the MLP's input and residual come from the O joint
            ox, o_res, mlp_x, mlp_res = x2, res, torch.empty_like(a), torch.empty_like(a)
            ao = torch.empty_like(a)
            ow = o.weight
        else:
            ox, o_res, mlp_x, mlp_res, ao, ow = a, a, x2, res, a, self.gate
        g, u, d = self.gate, self.up, self.down
        gdc = pdl.enabled(x.device)

        def some(t):  # a tensor the kernel never reads where there is none
            return t if t is not None else a

        compiled = _mlp_program_kernel[(self.programs,)](
            self.table, self.table.shape[1], mlp_x, g.packed, g.scales, g.biases, u.packed,
            u.scales, u.biases, d.packed, d.scales, d.biases, some(self.bias),
            stored_view(act), stored_view(a), self.gu_ws, self.d_ws, self.counters, mlp_res,
            some(self.post_weight), some(self.next_weight), stored_view(h),
            stored_view(n if n is not None else h),
            ox, ow.packed, ow.scales, ow.biases, some(o and o.bias), stored_view(ao),
            self.o_ws, o_res, some(o and o.post_weight), some(o and o.next_weight),
            I, H, ox.shape[1], self.tiles[0], self.tiles[1], self.tiles[2], 0x43004300,
            mlp_x.stride(0), g.packed.stride(0), g.scales.stride(0), g.biases.stride(0),
            u.packed.stride(0), u.scales.stride(0), u.biases.stride(0), d.packed.stride(0),
            d.scales.stride(0), d.biases.stride(0), ow.packed.stride(0), ow.scales.stride(0),
            ow.biases.stride(0), mlp_res.stride(0), o_res.stride(0), self.eps, 1.0 / H,
            GDC=gdc, **self.constants, **pdl.launch_options(gdc))
        if not self.fixed:  # the first call, eager: deal over every program SMs hold
            self.fixed = True
            if x.device.type == "cuda" and not interpreter_active():
                per_sm = resident_per_sm(compiled, self.constants["num_warps"], x.device)
                self.residency = {"registers": compiled.n_regs, "per_sm": per_sm}
                self.table = deal(self.instructions, program_count(
                    x.device, len(self.instructions), per_sm)).to(x.device)
        return h, n
