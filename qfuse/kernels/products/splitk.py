"""Split-K over programs: what the quantized-product launchers share.

Host side: the product's input check (`check_product`), what the Hopper TMA kernels
over fragment-held weights refuse alike (`tma_fragment_reason`), x as rows (`as_rows`), the
output, bias and residual views (`product_outputs`), and how far to split K
(`sm_count`, `choose_split`); device side, the workspace and semaphores below.

A decode product has few output tiles, too few programs to fill the GPU, so K is
split across programs: grid axis 2 (``tl.program_id(2)``) is the split, and each
of the SPLIT programs of an output tile sums its share of K. Used by
`qmatmul_tc`, `qmatmul` (the CUDA-core GEMV), `qmatmul_mma` and `fused_mlp`.

Contract:

    workspace   float32 [SPLIT, PLANES, *tile space] (`split_workspace`): each
                split writes its float32 partial tile(s) to its own plane(s)
                (`arrive_last`); without a split (SPLIT = 1) it is never read and
                any tensor stands in.
    semaphores  int32 [SEMAPHORE_SLOTS] per device (`semaphores`), one per output
                tile, zero between calls (`arrive_last` indexes them by program
                ids 0 and 1; `qmatmul_mma` counts in its own kernel, by program
                id 0). Each split counts its arrival after its partials are
                written; the last to arrive sums the planes in split order
                (`sum_splits`: the result does not depend on which program
                finished first), writes y, and resets the tile's semaphore to
                zero, so one zeroed buffer per device serves every call.
                Launchers keep the tile count within MAX_SEMAPHORES.

The buffer is allocated and zeroed by the first call on a device, which must
therefore run eagerly (not under CUDA graph capture); later calls can be
captured. Calls on concurrent streams must not share it (qfuse decodes on one
stream).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...levers import interpreter_active
from ...quant import QuantizedTensor
from ..common.pdl import sm_major
from ..common.units import warm_up_first, zeroed_once
from . import fragments

MAX_SEMAPHORES = 1 << 16  # output tiles a launcher may count on (one semaphore each)
# The buffer's length: more than MAX_SEMAPHORES because `qmatmul_ring` counts per thread
# (one semaphore per thread of each row-tile group). Kernels share it safely: each leaves
# its semaphores zero, and a kernel touches them only after the one before it has ended.
SEMAPHORE_SLOTS = 1 << 18

_SEMAPHORES: dict[torch.device, torch.Tensor] = {}


def semaphores(device: torch.device) -> torch.Tensor:
    """The device's zeroed semaphores, allocated by the first call. Not inside a CUDA
    graph capture: there the zeroing would only be recorded, and eager calls before the
    first replay would count from garbage."""
    sem = zeroed_once(_SEMAPHORES, device, SEMAPHORE_SLOTS)
    if sem is None:
        raise warm_up_first("a split-K product", "semaphores")
    return sem


def split_workspace(split: int, shape: tuple[int, ...], single: torch.Tensor) -> torch.Tensor:
    """The float32 partial sums [split, *shape] that the programs of a split reduction
    write for the last one to add up; a kernel without a split never reads it, so
    ``single`` (any tensor) stands in."""
    if split > 1:
        return torch.empty(split, *shape, dtype=torch.float32, device=single.device)
    return single


def check_product(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None,
                  residual: torch.Tensor | None) -> tuple[int, int]:
    """(K, N) of a valid residual + x·dequant(w)ᵀ + bias, else a ValueError naming the
    mismatch (features, bias shape/dtype, residual shape/dtype)."""
    K = x.shape[-1]
    N, Kw = w.shape
    if Kw != K:
        raise ValueError(f"x has {K} features but the weight expects {Kw}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{N}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if residual is not None and (residual.shape != (*x.shape[:-1], N)
                                 or residual.dtype != x.dtype):
        raise ValueError(f"residual must be {(*x.shape[:-1], N)} {x.dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    return K, N


def as_rows(x: torch.Tensor, K: int) -> torch.Tensor:
    """x [..., K] as rows [M, K] with a unit last stride (a view where it can be)."""
    x2 = x.reshape(-1, K)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def tma_fragment_reason(x: torch.Tensor, w, kernel: str, max_rows: int) -> str | None:
    """Why a Hopper kernel that streams a fragment-held weight by TMA (``kernel``: its
    name in the message) cannot take x·dequant(w)ᵀ for 1..``max_rows`` bf16 rows, or
    None; an MLX-layout weight is judged as its repacked form would be (fresh tensors:
    contiguous and aligned), so a caller can ask before repacking. The caller checks
    that Gluon imports."""
    if isinstance(w, QuantizedTensor):
        reason = fragments.unsupported_reason(w)
        if reason is not None:
            return reason
    elif not isinstance(w, fragments.FragmentWeight):
        return "the weight is neither quantized in the MLX layout nor held in fragment order"
    if w.shape[-1] != x.shape[-1]:
        return f"x has {x.shape[-1]} features, the weight {w.shape[-1]}"
    if x.device.type != "cuda" or interpreter_active():
        return f"needs a CUDA GPU (TMA, {kernel})"
    if sm_major(x.device) != 9:
        return f"needs sm_90 (TMA and Hopper Gluon, {kernel})"
    if x.dtype != torch.bfloat16:
        return f"x dtype {x.dtype} ({kernel}: bf16)"
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 1 <= rows <= max_rows:
        return f"{rows} rows ({kernel}: 1..{max_rows})"
    if isinstance(w, QuantizedTensor):
        return None
    parts = (w.words, w.scales, w.biases)
    if not all(t.is_contiguous() for t in parts):
        return "the weight's words, scales or biases are not contiguous (TMA boxes)"
    if any(t.data_ptr() % 16 for t in parts):
        return "the weight's words, scales or biases are not 16-byte aligned (TMA)"
    return None


def start_product(x: torch.Tensor, f, bias: torch.Tensor | None,
                  residual: torch.Tensor | None, name: str, reason_of):
    """What every launcher of a product over a fragment-order weight f starts with: x's
    features checked against f's, the kernel's ``reason_of(x, f)`` refusal raised in one
    line, x as contiguous rows x2 [M, K], and `product_outputs`. Returns (x2, y, bias,
    residual rows)."""
    if x.shape[-1] != f.k:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects {f.k}")
    reason = None if reason_of is None else reason_of(x, f)
    if reason is not None:
        raise ValueError(f"{name} cannot take these inputs: {reason}")
    x2 = x.reshape(-1, f.k).contiguous()
    return (x2, *product_outputs(x2, f.n, bias, residual))


def product_outputs(x2: torch.Tensor, N: int, bias: torch.Tensor | None,
                    residual: torch.Tensor | None):
    """y [M, N] (uninitialised, x's dtype), bias with unit stride, and the residual's
    rows (y standing in when there is none): what both product launchers pass."""
    y = torch.empty(x2.shape[0], N, dtype=x2.dtype, device=x2.device)
    if bias is not None:
        bias = bias.contiguous()  # the kernels read it with unit stride
    res2 = as_rows(residual, N) if residual is not None else y
    return y, bias, res2


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 132 (an H200) off CUDA, where only the
    interpreter runs."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def k_shares(KB: int, step: int, programs: int, per_sm: int, sms: int,
             split: int | None = None) -> tuple[int, int]:
    """(split, blocks per share) of KB blocks walked ``step`` at a time: ``split`` (or
    about ``per_sm`` programs per SM over ``programs`` row programs when None), at most
    one step a share, every share whole steps (the last may be shorter)."""
    if split is None:
        split = round(per_sm * sms / programs)
    split = max(1, min(split, KB // step))
    bpp = -(-(KB // step) // split) * step
    return -(-KB // bpp), bpp


def choose_split(n_tiles: int, n_steps: int, per_sm: int, sms: int, divide: bool) -> int:
    """Split K (doubling) until about ``per_sm`` programs per SM are in the grid. With
    ``divide`` the split must divide the ``n_steps`` loop steps (every program gets the
    same whole share); without, it stops at one step per split."""
    split = 1
    while n_tiles * split < per_sm * sms and (
            n_steps % (2 * split) == 0 if divide else split * 2 <= n_steps):
        split *= 2
    return split


@triton.jit
def arrive_last(ws_ptr, sem_ptr, acc, plane: tl.constexpr, ws_off, out_ok, M, N,
                SPLIT: tl.constexpr, PLANES: tl.constexpr):
    """Write this split's partial tile (plane ``plane`` of PLANES per split) and count the
    arrival; True for the last of the tile's splits to arrive. Call with plane
    PLANES - 1 last: the count is taken then."""
    pid_k = tl.program_id(2)
    tl.store(ws_ptr + (pid_k * PLANES + plane) * (M * N) + ws_off, acc, mask=out_ok)
    last = False
    if plane == PLANES - 1:
        tl.debug_barrier()  # every thread's partials are written before the count
        tile_sem = sem_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        last = tl.atomic_add(tile_sem, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
    return last


@triton.jit
def sum_splits(ws_ptr, sem_ptr, plane: tl.constexpr, ws_off, out_ok, M, N,
               SPLIT: tl.constexpr, PLANES: tl.constexpr):
    """Plane ``plane`` summed over the splits in split order, shaped like ``ws_off`` (the
    last arriver only); the call for plane PLANES - 1 also resets the tile's semaphore
    for the next call."""
    total = tl.zeros(ws_off.shape, tl.float32)
    for sp in range(SPLIT):
        total += tl.load(ws_ptr + (sp * PLANES + plane) * (M * N) + ws_off, mask=out_ok,
                         other=0.0, cache_modifier=".cg")
    if plane == PLANES - 1:
        tile_sem = sem_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        tl.atomic_xchg(tile_sem, 0, sem="relaxed", scope="gpu")
    return total
