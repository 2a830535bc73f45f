"""A decoder layer's MLP as one persistent launch: programs walking instruction tables.

Contract (`MlpProgram`, built once per layer and row count; `MlpProgram.__call__`):

    x          [M, H], the layer's normalized MLP input (M = the program's rows)
    residual   [M, H] in x's dtype: the residual stream before the MLP
    returns    (h, n) as `joint_step` over down_proj returns them: h = residual +
               post_norm(down(act(gate(x))·up(x))) (or + the product), n = next_norm(h)
               (None without a next norm)

The same work as the two fused launches it replaces, `fused_mlp.gate_up_act_gemv` then
`joint_step.joint_step` over down_proj, in the same tiles, splits of K and sums, so the
bits are theirs. What differs is who runs what: a grid of at most one program per SM
(one under the interpreter, which runs programs one after another), each walking its
own list of instructions, dealt round-robin from one ordered list:

- GATE_UP (tile, split): that split of K of a gate tile and the same up tile; the last
  split to arrive sums the splits in order, applies the activation, stores the tile of
  the activation and counts it on ACT;
- DOWN (tile, split): waits until ACT counts every activation tile, having requested its
  first weights before the wait; the last split stores the product tile (+ bias) and
  counts it on DOWN;
- JOINT (row): waits until DOWN counts every tile, then the row's residual joint and
  next norm (`joint.joint_epilogue`); the last row to finish zeroes the counters.

So no launch boundary separates the gate/up product from the down product, and each
program's next weights are in flight while it waits for its inputs: what a persistent
decode program keeps across every operation of a step, tried here on one product kind.
Deadlock-free because the grid never exceeds the SMs (every program is resident) and
each list keeps the ordered list's order, in which every wait is on instructions before
it. Counters and split semaphores are the program's own (zero between calls): the first
call must run eagerly, later calls can be captured in a CUDA graph.
"""

from __future__ import annotations

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

# Opcodes, and the counters' slots: ACT, DOWN, JOINT, then one semaphore per gate/up
# tile, then one per down tile.
GATE_UP, DOWN, JOINT = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
ACT_COUNT, DOWN_COUNT, JOINT_COUNT = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
FIRST_SEMAPHORE = tl.constexpr(3)


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
             ws_ptr, cnt_ptr, I, H, magic,
             ROWS: tl.constexpr, G_BITS: tl.constexpr, G_GROUP: tl.constexpr,
             G_GPI: tl.constexpr, G_ITERS: tl.constexpr, U_BITS: tl.constexpr,
             U_GROUP: tl.constexpr, U_GPI: tl.constexpr, U_ITERS: tl.constexpr,
             SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
             ACT: tl.constexpr, LIBDEVICE: tl.constexpr, BF16_BITS: tl.constexpr,
             G_ROUND: tl.constexpr, G_PAIRS: tl.constexpr, U_ROUND: tl.constexpr,
             U_PAIRS: tl.constexpr, NATIVE: tl.constexpr, GDC: tl.constexpr):
    """GATE_UP (module docstring): `fused_mlp._gate_up_act_gemv_kernel`'s program
    (tile, split), its arithmetic op for op."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < I
    gate = gemv_tile(x_ptr, stride_xm, g_ptr, gs_ptr, gb_ptr, stride_gn, stride_gsn, stride_gbn,
                     rows, row_ok, split * (G_ITERS * G_GPI), H // G_GROUP, magic, ROWS,
                     G_BITS, G_GROUP, G_GPI, G_ITERS, BLOCK_N, EVEN, G_ROUND, G_PAIRS, NATIVE,
                     GDC)
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
def _down(tile, split, act_ptr, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn,
          bias_ptr, a_ptr, ws_ptr, cnt_ptr, act_tiles, N, I, magic,
          ROWS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GPI: tl.constexpr,
          ITERS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
          EVEN: tl.constexpr, HAS_BIAS: tl.constexpr, BF16_BITS: tl.constexpr,
          ROUND: tl.constexpr, PAIRS: tl.constexpr, NATIVE: tl.constexpr,
          SEMAPHORE: tl.constexpr):
    """DOWN (module docstring): `qmatmul.gemv_product`'s program (tile, split) over the
    activation, once ACT counts ``act_tiles``."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ys = gemv_tile(act_ptr, I, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, stride_bn, rows,
                   row_ok, split * (ITERS * GPI), I // GROUP, magic, ROWS, BITS, GROUP, GPI,
                   ITERS, BLOCK_N, EVEN, ROUND, PAIRS, NATIVE, False,
                   cnt_ptr + ACT_COUNT, act_tiles)
    out_ok = row_ok[:, None]
    ws_off = rows[:, None]
    last = True
    if SPLIT > 1:  # planes [SPLIT, ROWS, N]
        sem = cnt_ptr + SEMAPHORE + tile
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
            tl.store(a_ptr + m * N + ws_off, as_stored(acc, a_ptr, BF16_BITS), mask=out_ok)
        count_done(cnt_ptr + DOWN_COUNT)


@triton.jit
def _mlp_program_kernel(
    table_ptr, n_instructions,  # int32 [programs, n_instructions, 3]: op, a, b (op < 0: none)
    x_ptr, g_ptr, gs_ptr, gb_ptr, u_ptr, us_ptr, ub_ptr,
    d_ptr, ds_ptr, db_ptr, bias_ptr,
    act_ptr, a_ptr,  # scratch [M, I], [M, N]
    gu_ws_ptr, d_ws_ptr, cnt_ptr,
    res_ptr, post_w_ptr, next_w_ptr, h_ptr, n_ptr,
    I, H, act_tiles, down_tiles, magic, stride_xm, stride_gn, stride_gsn, stride_gbn,
    stride_un, stride_usn, stride_ubn, stride_dn, stride_dsn, stride_dbn, stride_res, eps,
    inv_d,
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
    ACT: tl.constexpr, LIBDEVICE: tl.constexpr, BF16_BITS: tl.constexpr, NATIVE: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_POST: tl.constexpr, HAS_NEXT: tl.constexpr,
    UNIT_OFFSET: tl.constexpr, GDC: tl.constexpr,
):
    if GDC:  # every program has started before the next kernel may: no deadlock with it
        tl.extra.cuda.gdc_launch_dependents()
    mine = table_ptr + tl.program_id(0) * n_instructions * 3
    for i in range(n_instructions):
        op = tl.load(mine + i * 3)
        a = tl.load(mine + i * 3 + 1)
        b = tl.load(mine + i * 3 + 2)
        if op == GATE_UP:
            _gate_up(a, b, x_ptr, stride_xm, g_ptr, gs_ptr, gb_ptr, u_ptr, us_ptr, ub_ptr,
                     stride_gn, stride_gsn, stride_gbn, stride_un, stride_usn, stride_ubn,
                     act_ptr, gu_ws_ptr, cnt_ptr, I, H, magic, ROWS, G_BITS, G_GROUP, G_GPI,
                     G_ITERS, U_BITS, U_GROUP, U_GPI, U_ITERS, GU_SPLIT, GU_BLOCK, GU_EVEN,
                     ACT, LIBDEVICE, BF16_BITS, G_ROUND, G_PAIRS, U_ROUND, U_PAIRS, NATIVE,
                     GDC)
        elif op == DOWN:
            _down(a, b, act_ptr, d_ptr, ds_ptr, db_ptr, stride_dn, stride_dsn, stride_dbn,
                  bias_ptr, a_ptr, d_ws_ptr, cnt_ptr, act_tiles, H, I, magic, ROWS, D_BITS,
                  D_GROUP, D_GPI, D_ITERS, D_SPLIT, D_BLOCK, D_EVEN, HAS_BIAS, BF16_BITS,
                  D_ROUND, D_PAIRS, NATIVE, D_SEMAPHORE)
        elif op == JOINT:
            wait_count_reached(cnt_ptr + DOWN_COUNT, down_tiles)
            joint_epilogue(a_ptr, res_ptr, stride_res, post_w_ptr, next_w_ptr, h_ptr, n_ptr,
                           H, eps, inv_d, a, ROWS, ROWS, BLOCK_D, HAS_POST, HAS_NEXT,
                           UNIT_OFFSET, BF16_BITS)
            if count_done(cnt_ptr + JOINT_COUNT) == ROWS - 1:
                # every instruction has passed its wait: nothing reads a counter again
                tl.atomic_xchg(cnt_ptr + ACT_COUNT, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(cnt_ptr + DOWN_COUNT, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(cnt_ptr + JOINT_COUNT, 0, sem="relaxed", scope="gpu")


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def program_count(device: torch.device, instructions: int) -> int:
    """The grid: one program per SM at most (all resident: the waits cannot deadlock),
    one under the interpreter or on a CPU (programs run one after another there)."""
    if device.type != "cuda" or interpreter_active():
        return 1
    return max(1, min(_sm_count(device), instructions))


def deal(instructions: list[tuple[int, int, int]], programs: int) -> torch.Tensor:
    """int32 [programs, ceil(len / programs), 3]: instruction i to program i mod programs,
    each list in the ordered list's order, padded with op -1."""
    per = -(-len(instructions) // programs)
    table = torch.full((programs, per, 3), -1, dtype=torch.int32)
    for i, ins in enumerate(instructions):
        table[i % programs, i // programs] = torch.tensor(ins, dtype=torch.int32)
    return table


class MlpProgram:
    """The module docstring's launch for one layer at ``rows`` rows of ``dtype`` on
    ``device``: its shapes, instruction tables, counters and workspaces made here, once."""

    def __init__(self, gate: QuantizedTensor, up: QuantizedTensor, down: QuantizedTensor,
                 down_bias: torch.Tensor | None, act: str, post_weight: torch.Tensor | None,
                 next_weight: torch.Tensor | None, eps: float, unit_offset: bool, rows: int,
                 dtype: torch.dtype, device: torch.device, programs: int | None = None):
        I, H = gate.shape
        like = torch.empty(rows, H, dtype=dtype, device=device)
        self.g_ls, self.u_ls, reason = gate_up_gemv_shapes(H, gate, up)
        if reason is not None:
            raise ValueError(reason)
        self.d_ls = gemv_shape(H, I, down)
        self.gate, self.up, self.down, self.bias = gate, up, down, down_bias
        self.post_weight, self.next_weight = post_weight, next_weight
        self.act, self.eps, self.unit_offset = ACT_IDS[act], eps, unit_offset
        self.rows, self.I, self.H, self.dtype = rows, I, H, dtype
        gu_tiles, gu_split = self.g_ls["grid"][0], self.g_ls["SPLIT"]
        d_tiles, d_split = self.d_ls["grid"][0], self.d_ls["SPLIT"]
        self.act_tiles, self.down_tiles = gu_tiles, d_tiles
        instructions = [(GATE_UP.value, t, s) for t in range(gu_tiles)
                        for s in range(gu_split)]
        instructions += [(DOWN.value, t, s) for t in range(d_tiles) for s in range(d_split)]
        instructions += [(JOINT.value, m, 0) for m in range(rows)]
        programs = programs or program_count(device, len(instructions))
        self.table = deal(instructions, programs).to(device)
        self.d_semaphore = FIRST_SEMAPHORE.value + gu_tiles
        self.counters = torch.zeros(self.d_semaphore + d_tiles, dtype=torch.int32,
                                    device=device)
        self.gu_ws = split_workspace(gu_split, (2 * rows, I), like)
        self.d_ws = split_workspace(d_split, (rows, H), like)
        self.rounding = (weight_rounding(like, gate), weight_rounding(like, up),
                         weight_rounding(like, down))

    @property
    def programs(self) -> int:
        return self.table.shape[0]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor):
        M, H, I = self.rows, self.H, self.I
        x2 = x.reshape(M, H)
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        res = residual.reshape(M, H)
        res = res if res.stride(-1) == 1 else res.contiguous()
        act = torch.empty(M, I, dtype=x.dtype, device=x.device)
        a = torch.empty(M, H, dtype=x.dtype, device=x.device)
        h = torch.empty_like(a)
        n = torch.empty_like(a) if self.next_weight is not None else None
        g, u, d = self.gate, self.up, self.down
        g_r, u_r, d_r = self.rounding
        gdc = pdl.enabled(x.device)
        _mlp_program_kernel[(self.programs,)](
            self.table, self.table.shape[1], x2, g.packed, g.scales, g.biases, u.packed,
            u.scales, u.biases, d.packed, d.scales, d.biases,
            self.bias if self.bias is not None else a, stored_view(act), stored_view(a),
            self.gu_ws, self.d_ws, self.counters, res,
            self.post_weight if self.post_weight is not None else a,
            self.next_weight if self.next_weight is not None else a, stored_view(h),
            stored_view(n if n is not None else h), I, H, self.act_tiles, self.down_tiles,
            0x43004300, x2.stride(0), g.packed.stride(0), g.scales.stride(0),
            g.biases.stride(0), u.packed.stride(0), u.scales.stride(0), u.biases.stride(0),
            d.packed.stride(0), d.scales.stride(0), d.biases.stride(0), res.stride(0),
            self.eps, 1.0 / H,
            ROWS=M, G_BITS=g.bits, G_GROUP=g.group_size, G_GPI=self.g_ls["GPI"],
            G_ITERS=self.g_ls["ITERS"], U_BITS=u.bits, U_GROUP=u.group_size,
            U_GPI=self.u_ls["GPI"], U_ITERS=self.u_ls["ITERS"], GU_SPLIT=self.g_ls["SPLIT"],
            GU_BLOCK=self.g_ls["BLOCK_N"], GU_EVEN=self.g_ls["EVEN"] and self.u_ls["EVEN"],
            G_ROUND=g_r["ROUND"], G_PAIRS=g_r["PAIRS"], U_ROUND=u_r["ROUND"],
            U_PAIRS=u_r["PAIRS"], D_BITS=d.bits, D_GROUP=d.group_size,
            D_GPI=self.d_ls["GPI"], D_ITERS=self.d_ls["ITERS"], D_SPLIT=self.d_ls["SPLIT"],
            D_BLOCK=self.d_ls["BLOCK_N"], D_EVEN=self.d_ls["EVEN"], D_ROUND=d_r["ROUND"],
            D_PAIRS=d_r["PAIRS"], HAS_BIAS=self.bias is not None,
            D_SEMAPHORE=self.d_semaphore, ACT=self.act, LIBDEVICE=use_libdevice(),
            BF16_BITS=emulates_bf16(x.dtype), NATIVE=g_r["NATIVE"],
            BLOCK_D=triton.next_power_of_2(H), HAS_POST=self.post_weight is not None,
            HAS_NEXT=self.next_weight is not None, UNIT_OFFSET=self.unit_offset, GDC=gdc,
            num_warps=self.g_ls["num_warps"], **pdl.launch_options(gdc))
        return h, n
