"""The public per-call ops: check the inputs, then run what `choose` picks for them.

Each call asks `qfuse.choose` afresh (the tier, the kernel's switch, whether Triton can
run on the tensors' device, whether the kernel supports the dtype and shape) and runs
the choice: a fused kernel or the compat reference, never something else. The choice's
reason is on the `Choice` (a model's plan lists them: `qfuse info MODEL_DIR`). Every call
bumps a counter, ``<kernel>`` or ``ref:<op>``, readable via ``qfuse.levers.counters()``.
A model's forward does not come here: its plan keeps one choice per op site.
"""

from __future__ import annotations

import torch

from . import choose, levers, reference
from .levers import KERNELS


def use_kernel(name: str, device: torch.device, unsupported: str | None = None) -> bool:
    """True when kernel ``name`` should run for tensors on ``device`` (`choose.admitted`).

    ``unsupported``: the kernel's own reason it cannot take these inputs, if any.
    """
    return choose.admitted(name, device, unsupported)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by cos/sin [B, T, D] (`reference.apply_rotary`); the
    bit-identical one-launch kernel unless QFUSE_ROPE=0, never while gradients are
    needed."""
    return choose.choose_rotary(x, cos, sin)(x, cos, sin)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last axis (`reference.rms_norm`); the one-launch kernel in the
    fast tier unless QFUSE_RMS_NORM=0, never while gradients are needed."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match x's last dim "
                         f"{x.shape[-1]}")
    return choose.choose_rms_norm(x, weight, eps, unit_offset)(x)


def residual_rms_norm(a: torch.Tensor, residual: torch.Tensor,
                      post_weight: torch.Tensor | None, next_weight: torch.Tensor | None,
                      eps: float, unit_offset: bool = False):
    """(h, n): h = residual + rms_norm(a, post_weight) (+ a without it), n =
    rms_norm(h, next_weight) (None without it): a decoder layer's residual joint. The
    fast tier's RMSNorm kernel does it in one launch, with the same values as the three
    ops apart; otherwise it is those three ops."""
    return choose.choose_residual_rms_norm(a, residual, post_weight, next_weight, eps,
                                           unit_offset)(a, residual)


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x·Wᵀ (+ bias); w dense [N, K], a QuantizedTensor or held in fragment order. A
    quantized weight takes the quantized kernels in the fast tier (bf16: any rows;
    fp16/fp32: up to 4 rows), unless x or bias needs a gradient (`choose.choose_product`)."""
    check_features(x, w)
    return choose.choose_product(x, w, bias)(x)


# Routes of `fragment_route` whose products give a row the same bits whatever rows sit
# beside it and however many (each tested bitwise on the GPU: the fragment kernel and the
# TMA ring each over 1-32 rows, the wgmma kernel over 1-256), so batch invariance may
# rest on them as long as a product keeps its route; the others (cuBLAS, the
# in-register kernel, the reference) promise nothing.
ROW_INVARIANT_ROUTES = ("fragment", "ring", "wgmma")

fragment_route = choose.fragment_route


def fragment_product(x: torch.Tensor, f, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + x·dequant(f)ᵀ + bias for decode rows over a fragment-order weight that
    the fragment kernel takes: the TMA-ring kernel where its shape rule prefers it and
    its lever and inputs allow, else `qmatmul_mma`."""
    return choose.fragment_product_choice(x, f, bias)(x, residual)


def holds_fragments(w, always: bool = False) -> bool:
    """Whether a loaded model should hold quantized weight ``w`` in the fragment kernel's
    order alone: a 4-bit g64/g128 bf16 weight that its decode products will multiply (the
    fast tier, the qmatmul and qmatmul_mma levers on, a CUDA GPU of sm_80 or newer), as
    decided when the model is loaded. ``always``: whenever the layout allows (tests)."""
    from .kernels.products import fragments

    if fragments.unsupported_reason(w) is not None:
        return False
    if always:
        return True
    device = w.device
    if device.type != "cuda" or not levers.triton_available():
        return False
    return (levers.tier(device) >= KERNELS["qmatmul_mma"].min_tier
            and torch.cuda.get_device_capability(device)[0] >= 8
            and levers.kernel_enabled("qmatmul") and levers.kernel_enabled("qmatmul_mma")
            and not levers.interpreter_active())


def check_features(x: torch.Tensor, w) -> None:
    """ValueError unless x [..., K] fits weight w [N, K]."""
    if w.shape[-1] != x.shape[-1]:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects {w.shape[-1]}")


def linear_stacked(x: torch.Tensor, ws: list, biases: list) -> list[torch.Tensor]:
    """[`linear`(x, w, b) for each weight], as one product over the weights stacked
    along N where the fragment kernel (decode rows) or the wgmma kernel (batched rows)
    takes them all (Q/K/V: one launch instead of three); the outputs are then views into
    one [..., ΣN] result."""
    for w in ws:
        check_features(x, w)
    return choose.choose_stacked_product(x, ws, biases)(x)


def gated_act(a: torch.Tensor, b: torch.Tensor, act: str) -> torch.Tensor:
    """act(a)·b for a, b [..., I]; act in {gelu_tanh, silu} (HF names accepted).

    The kernel is bit-identical to the reference, so it runs in the exact tier.
    When grad is needed it goes through the differentiable function that saves
    only a and b.
    """
    check_gated_inputs(a, b)
    return choose.choose_gated_act(a, b, act)(a, b)


def check_gated_inputs(a: torch.Tensor, b: torch.Tensor) -> None:
    """ValueError unless a and b share one shape, dtype and device."""
    if a.shape != b.shape:
        raise ValueError(f"a and b must have one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")


def mlp(x, gate, up, down, act: str, residual=None) -> torch.Tensor:
    """down(act(x·gateᵀ)·(x·upᵀ)) (+ residual), with the gated activation dispatched
    (`choose.choose_mlp` says which kernels). x [..., H]; gate/up [I, H] and down [H, I],
    dense or QuantizedTensor."""
    act = reference.activation_name(act)
    check_mlp_inputs(x, gate, up, down, residual)
    return choose.choose_mlp(x, gate, up, down, act, residual)(x, residual)


def check_mlp_inputs(x: torch.Tensor, gate, up, down, residual) -> None:
    """ValueError unless gate/up [I, H] and down [H, I] form an MLP over x [..., H] and
    the residual broadcasts to the output [..., H]."""
    H, I = x.shape[-1], gate.shape[0]
    if tuple(gate.shape) != (I, H) or tuple(up.shape) != (I, H) or tuple(down.shape) != (H, I):
        raise ValueError(f"gate {tuple(gate.shape)}, up {tuple(up.shape)} and down "
                         f"{tuple(down.shape)} do not form an MLP over {H} features "
                         f"(gate/up [I, {H}], down [{H}, I])")
    if residual is not None:
        out = (*x.shape[:-1], H)
        try:
            fits = torch.broadcast_shapes(tuple(residual.shape), out) == out
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"residual shape {tuple(residual.shape)} does not broadcast to "
                             f"the output {out}")


def decode_attention(q, k, v, lengths, scale: float, window=None, softcap=None,
                     lengths_checked: bool = False, block_table=None):
    """One query token per sequence over a dense or quantized KV cache.

    q [B, Hq, D]; k, v [B, Hkv, Nmax, D] dense tensors or QuantizedTensors;
    lengths int [B]. The kernel (fast tier: online softmax is not bit-exact)
    takes 4/8-bit or dense fp16/bf16 caches with D in {64, 128, 256, 512}
    (`kernels.attention.decode_attention.unsupported_reason` decides); anything else runs
    the reference. ``block_table`` int32 [B, P]: k and v are pools of pages
    [num_pages, Hkv, PAGE, D] and sequence b's token t lives in page
    block_table[b, t // PAGE] (`paged_cache.py`); ``lengths_checked`` then vouches for
    the table's pages too.
    """
    # Checking lengths against Nmax reads them on the host (a device sync). Skipped
    # while a CUDA graph is captured and when the caller vouches for them
    # (``lengths_checked``: the runtime's cache checks its capacity on the host).
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    check_decode_attention_inputs(
        q, k, v, lengths, window, softcap, check_lengths=not (capturing or lengths_checked),
        block_table=block_table)
    return choose.choose_decode_attention(q, k, v, scale, softcap, block_table, window)(
        q, k, v, lengths, window, block_table)


def check_decode_attention_inputs(
    q: torch.Tensor,
    k,
    v,
    lengths: torch.Tensor,
    window: int | None,
    softcap: float | None,
    check_lengths: bool = True,
    block_table: torch.Tensor | None = None,
) -> None:
    """ValueError naming the argument unless q/k/v/lengths (and a paged cache's
    block_table) describe one decode step. Checking lengths reads them on the host; for
    a paged cache it also checks that every page a sequence attends is in the pool."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    B, Hq, D = q.shape
    paged = block_table is not None
    if paged and (block_table.dim() != 2 or block_table.shape[0] != B
                  or block_table.dtype != torch.int32):
        raise ValueError(f"block_table must be int32 of shape ({B}, pages per sequence), got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    for name, t in (("k", k), ("v", v)):
        if len(t.shape) != 4:
            layout = "[num_pages, Hkv, PAGE, D]" if paged else "[B, Hkv, Nmax, D]"
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
        if t.shape[0] != B and not paged:
            raise ValueError(f"{name} has batch {t.shape[0]} but q has batch {B}")
        if t.shape[3] != D:
            raise ValueError(f"{name} has head dim {t.shape[3]} but q has head dim {D}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape")
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if lengths.shape != (B,) or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"lengths must be int32/int64 of shape ({B},), got {lengths.dtype} {tuple(lengths.shape)}"
        )
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of tokens, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    n_max = k.shape[2] * (block_table.shape[1] if paged else 1)
    if check_lengths and lengths.numel():
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 0 or hi > n_max:
            raise ValueError(
                f"lengths must lie in [0, Nmax={n_max}], got values in [{lo}, {hi}]"
            )
        if paged:
            check_attended_pages(block_table, lengths, k.shape[2], k.shape[0], window)


def check_attended_pages(block_table: torch.Tensor, lengths: torch.Tensor, page: int,
                         num_pages: int, window: int | None) -> None:
    """ValueError unless every page that holds a token a sequence attends (lengths and
    window as in `decode_attention`) names a page of the pool (a host read)."""
    P = block_table.shape[1]
    start = torch.arange(P, device=lengths.device) * page  # first token of each table entry
    L = lengths.to(torch.int64)[:, None]
    first = (L - window).clamp(min=0) if window is not None else torch.zeros_like(L)
    attended = (start[None, :] < L) & (start[None, :] + page > first)
    bad = attended & ((block_table < 0) | (block_table >= num_pages))
    if bad.any():
        b, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page of "
                         f"the pool (0..{num_pages - 1}) but holds tokens sequence {b} attends")


def kv_append(x: torch.Tensor, positions: torch.Tensor, cache,
              positions_checked: bool = False, block_table=None) -> None:
    """Write x [B, Hkv, D] into cache[:, :, positions[b]] for each sequence b, in place.

    cache: a QuantizedTensor [B, Hkv, Nmax, D] (quantized exactly as
    ``quant.quantize`` would) or a dense tensor. Graph-capturable on CUDA. The
    kernel writes nothing for a position outside [0, Nmax) (it cannot check on
    the host without a sync); the reference path raises ValueError unless the
    caller vouches for the positions (``positions_checked``, as the runtime's
    cache does). ``block_table`` int32 [B, P]: cache is a pool of pages [num_pages, Hkv,
    PAGE, D] and positions[b] lands on page block_table[b, positions[b] // PAGE]
    (`paged_cache.py`); the reference path checks that page is in the pool, the kernel
    writes nothing where it is not.
    """
    from .quant import QuantizedTensor

    B, Hkv, D = x.shape
    paged = block_table is not None
    if paged and (block_table.dim() != 2 or block_table.shape[0] != B
                  or block_table.dtype != torch.int32):
        raise ValueError(f"block_table must be int32 of shape ({B}, pages per sequence), got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if (tuple(cache.shape[:2]) != (B, Hkv) and not paged) or cache.shape[1] != Hkv \
            or cache.shape[3] != D:
        raise ValueError(f"x {tuple(x.shape)} does not fit cache {tuple(cache.shape)}")
    if positions.shape != (B,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32/int64 of shape ({B},), got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    chosen = choose.choose_kv_append(x, cache)
    if chosen.kernel == choose.REFERENCE and not positions_checked:
        check_append_positions(positions, cache, block_table)
    chosen(x, positions, cache, block_table)


def check_append_positions(positions: torch.Tensor, cache, block_table=None) -> None:
    """ValueError unless every position lies in the cache and, with a block table, every
    page it lands on is in the pool (host reads)."""
    pos = positions.to(torch.int64)
    paged = block_table is not None
    n_max = cache.shape[2] * (block_table.shape[1] if paged else 1)
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= n_max):
        raise ValueError(f"positions must lie in [0, {n_max}), got values in "
                         f"[{int(pos.min())}, {int(pos.max())}]")
    if paged:
        B = positions.shape[0]
        idx = block_table[torch.arange(B, device=positions.device),
                          pos // cache.shape[2]].to(torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= cache.shape[0]):
            raise ValueError(f"the block table names pages in [{int(idx.min())}, "
                             f"{int(idx.max())}] for these positions; the pool has "
                             f"0..{cache.shape[0] - 1}")


def norm_and_rotate(q, k, q_norm, k_norm, eps: float, unit_offset: bool, cos, sin):
    """q [B, Hq, T, D], k [B, Hkv, T, D] → each normed per head (where the weights are
    not None: Qwen 3, Gemma 3) and rotated by cos/sin [B, T, D]."""
    return choose.choose_norm_and_rotate(q, k, q_norm, k_norm, eps, unit_offset, cos, sin)(
        q, k, cos, sin)


def prompt_attention(q, k, v, lengths, scale: float, window=None, softcap=None,
                     masks: dict | None = None):
    """Prefill attention over right-padded prompts; k/v may hold more tokens than q, the
    cached ones of a chunked prefill first (`reference.prompt_attention`). The fast tier
    hands it to torch SDPA (flash/cuDNN/efficient backends) unless a logit soft-cap needs
    the eager path. GQA goes in as plain multi-head attention over each kv head's query
    heads stacked along the queries (their mask rows repeated): SDPA's own GQA with an
    explicit mask runs its math backend on CUDA, float scores of every query and key.
    ``masks``: a dict shared by the layers of one pass (same lengths), where each mask is
    made once per window instead of once per layer."""
    return choose.choose_prompt_attention(q, scale, window, softcap)(q, k, v, lengths, masks)
