"""Dispatch: for each op, pick a fused kernel or the compat reference, and count it.

The choice depends on the tier (``levers.tier``), the kernel's opt-out
variable, whether Triton can run on the tensors' device (a CUDA GPU, or CPU
tensors under ``TRITON_INTERPRET=1``), and whether the kernel supports the
dtype and shape. A fallback for an unsupported combination is logged once at
debug level with its reason; it never computes something else. Every call
bumps a counter, ``<kernel>`` or ``ref:<op>``, readable via
``qfuse.levers.counters()``.
"""

from __future__ import annotations

import os

import torch

from . import levers, reference
from .levers import KERNELS


def use_kernel(name: str, device: torch.device, unsupported: str | None = None) -> bool:
    """True when kernel ``name`` should run for tensors on ``device``.

    ``unsupported``: the kernel's own reason it cannot take these inputs, if any.
    """
    if levers.tier(device) < KERNELS[name].min_tier:
        return False
    if not levers.kernel_enabled(name):
        var = KERNELS[name].env_var
        levers.say_once(name, f"{var}={os.environ[var]}")
        return False
    if device.type != "cuda" and not levers.interpreter_active():
        levers.say_once(name, f"tensors on {device.type} (Triton needs CUDA or TRITON_INTERPRET=1)")
        return False
    if not levers.triton_available():
        levers.say_once(name, "triton is not installed")
        return False
    if unsupported is not None:
        levers.say_once(name, unsupported)
        return False
    return True


def _counted_reference(op: str):
    levers.count(f"ref:{op}")


def _needs_grad(*tensors) -> bool:
    """Whether autograd must see this call (a kernel without a backward must not run)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by cos/sin [B, T, D] (`reference.apply_rotary`); the
    bit-identical one-launch kernel unless QFUSE_ROPE=0, never while gradients are
    needed."""
    if not torch.is_grad_enabled() and levers.triton_available():
        from .kernels import rope as k

        if use_kernel("rope", x.device, k.unsupported_reason(x, cos, sin)):
            levers.count("rope")
            return k.apply_rotary(x, cos, sin)
    _counted_reference("apply_rotary")
    return reference.apply_rotary(x, cos, sin)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last axis (`reference.rms_norm`); the one-launch kernel in the
    fast tier unless QFUSE_RMS_NORM=0, never while gradients are needed."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match x's last dim "
                         f"{x.shape[-1]}")
    if not torch.is_grad_enabled() and levers.triton_available():
        from .kernels import rms_norm as k

        if use_kernel("rms_norm", x.device, k.unsupported_reason(x, weight, unit_offset)):
            levers.count("rms_norm")
            return k.rms_norm(x, weight, eps, unit_offset)
    _counted_reference("rms_norm")
    return reference.rms_norm(x, weight, eps, unit_offset)


def residual_rms_norm(a: torch.Tensor, residual: torch.Tensor,
                      post_weight: torch.Tensor | None, next_weight: torch.Tensor | None,
                      eps: float, unit_offset: bool = False):
    """(h, n): h = residual + rms_norm(a, post_weight) (+ a without it), n =
    rms_norm(h, next_weight) (None without it): a decoder layer's residual joint. The
    fast tier's RMSNorm kernel does it in one launch, with the same values as the three
    ops apart; otherwise it is those three ops."""
    if not torch.is_grad_enabled() and levers.triton_available():
        from .kernels import rms_norm as k

        reason = k.residual_unsupported_reason(a, residual, post_weight, next_weight, unit_offset)
        if use_kernel("rms_norm", a.device, reason):
            levers.count("rms_norm")  # one launch for the joint: one rms_norm dispatch
            return k.residual_rms_norm(a, residual, post_weight, next_weight, eps, unit_offset)
    s = a if post_weight is None else rms_norm(a, post_weight, eps, unit_offset)
    h = residual + s
    return h, (None if next_weight is None else rms_norm(h, next_weight, eps, unit_offset))


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x·Wᵀ (+ bias); w dense [N, K] or a QuantizedTensor. A quantized weight takes
    the quantized matmul in the fast tier (bf16: any rows; fp16/fp32: up to 4 rows),
    unless x or bias needs a gradient (the reference keeps autograd's graph)."""
    from .kernels.fragments import FragmentWeight
    from .quant import QuantizedTensor

    check_features(x, w)
    if isinstance(w, FragmentWeight):
        return _linear_fragments(x, w, bias)
    if isinstance(w, QuantizedTensor) and levers.triton_available() and not _needs_grad(x, bias):
        from .kernels import qmatmul

        if use_kernel("qmatmul", x.device, qmatmul.unsupported_reason(x, w)):
            levers.count("qmatmul")
            from .kernels import qmatmul_mma as mm

            if use_kernel("qmatmul_mma", x.device, mm.unsupported_reason(x, w)):
                return fragment_product(x, mm.fragments_of(w), bias)
            if _takes_batched(x, w):  # asked before the repack: a refusal costs no copy
                return _batched_product(x, mm.fragments_of(w), bias)
            return qmatmul.qmatmul(x, w, bias)
    _counted_reference("linear")
    return reference.linear(x, w, bias)


# Routes of `fragment_route` whose products give a row the same bits whatever rows sit
# beside it and however many (each tested bitwise on the GPU: the fragment kernel and the
# TMA ring each over 1-32 rows, the wgmma kernel over 1-256), so batch invariance may
# rest on them as long as a product keeps its route; the others (cuBLAS, the
# in-register kernel, the reference) promise nothing.
ROW_INVARIANT_ROUTES = ("fragment", "ring", "wgmma")


def fragment_route(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> str:
    """Which kernel `linear` multiplies x by the fragment-held weight w with: "fragment"
    (decode rows: `qmatmul_mma`), "ring" (decode rows where `qmatmul_ring.preferred`),
    "wgmma" (batched rows, 33-256 on Hopper), "cublas" (longer prefill rows, dequantized
    once), "tc" (`qmatmul_tc` over the MLX words made back) or "reference" (compat/exact,
    gradients, no Triton). Asked without running anything, so a caller can tell ahead
    which kernel a number of rows takes (`Decoder.product_kernels`)."""
    if levers.triton_available() and not _needs_grad(x, bias) and use_kernel("qmatmul", x.device):
        from .kernels import qmatmul_mma as mm
        from .kernels.qmatmul_tc import DECODE_ROWS

        if use_kernel("qmatmul_mma", x.device, mm.unsupported_reason(x, w)):
            return "ring" if _takes_ring(x, w) else "fragment"
        if x.is_cuda and x.dtype == torch.bfloat16:
            if _takes_batched(x, w):
                return "wgmma"
            return "cublas" if x.numel() > DECODE_ROWS * w.k else "tc"
    return "reference"


def _linear_fragments(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear` over a weight held in fragment order (`models.decoder.hold_kernel_forms`),
    by the kernel `fragment_route` names; compat/exact and gradients take the reference,
    whose dequantization is bit for bit that of the MLX words."""
    route = fragment_route(x, w, bias)
    if route == "reference":
        _counted_reference("linear")
        return reference.linear(x, w, bias)
    levers.count("qmatmul")
    if route in ("fragment", "ring"):
        return fragment_product(x, w, bias, ring=route == "ring")
    if route == "wgmma":
        return _batched_product(x, w, bias)
    from .kernels import fragment_words, fragments
    from .kernels.qmatmul_tc import qmatmul_tc
    from .kernels.splitk import as_rows

    if route == "cublas":  # dequantize once straight from the fragments, then cuBLAS
        y = torch.nn.functional.linear(as_rows(x, w.k), fragment_words.dequantize_bf16(w), bias)
        return y.reshape(*x.shape[:-1], w.n)
    return qmatmul_tc(x, fragments.to_mlx(w), bias)


def _batched_rows(x: torch.Tensor) -> bool:
    """Whether x has the rows of a serving batch: past the fragment kernel's 32, within
    the wgmma kernel's 256."""
    from .kernels import qmatmul_mma as mm
    from .kernels import qmatmul_wgmma as wg

    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return mm.MAX_ROWS < rows <= wg.MAX_ROWS


def _takes_batched(x: torch.Tensor, w) -> bool:
    """Whether batched rows of x go to the wgmma kernel (its lever, and its check of x
    and of w, held in fragment order or in the MLX layout it would be repacked from)."""
    from .kernels import qmatmul_wgmma as wg

    return _batched_rows(x) and use_kernel("qmatmul_wgmma", x.device,
                                           wg.unsupported_reason(x, w))


def _batched_product(x: torch.Tensor, f, bias: torch.Tensor | None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + x·dequant(f)ᵀ + bias by the wgmma kernel (the caller has asked)."""
    from .kernels import qmatmul_wgmma as wg

    levers.count("qmatmul_wgmma")
    return wg.qmatmul_wgmma(x, f, bias, residual)


def fragment_product(x: torch.Tensor, f, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None,
                     ring: bool | None = None) -> torch.Tensor:
    """residual + x·dequant(f)ᵀ + bias for decode rows over a fragment-order weight that
    the fragment kernel takes (the caller has asked): the TMA-ring kernel where its shape
    rule prefers it (`qmatmul_ring.preferred`) and its lever and inputs allow, else
    `qmatmul_mma`. ``ring``: the caller's answer to `_takes_ring`, if it has asked
    already (None: ask it)."""
    from .kernels import qmatmul_mma as mm
    from .kernels import qmatmul_ring

    if _takes_ring(x, f) if ring is None else ring:
        levers.count("qmatmul_ring")
        return qmatmul_ring.qmatmul_ring(x, f, bias, residual)
    levers.count("qmatmul_mma")
    return mm.qmatmul_mma(x, f, bias, residual)


def _takes_ring(x: torch.Tensor, f) -> bool:
    """Whether decode rows of x over the fragment-order weight f go to the TMA-ring kernel
    (its shape rule, its lever and its check of the inputs) rather than `qmatmul_mma`."""
    from .kernels import qmatmul_ring as ring

    return ring.preferred(x, f) and use_kernel("qmatmul_ring", x.device,
                                               ring.unsupported_reason(x, f))


def holds_fragments(w, always: bool = False) -> bool:
    """Whether a loaded model should hold quantized weight ``w`` in the fragment kernel's
    order alone: a 4-bit g64/g128 bf16 weight that its decode products will multiply (the
    fast tier, the qmatmul and qmatmul_mma levers on, a CUDA GPU of sm_80 or newer), as
    decided when the model is loaded. ``always``: whenever the layout allows (tests)."""
    from .kernels import fragments

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
    if levers.triton_available() and len(ws) > 1 and not _needs_grad(x, *biases):
        from .kernels import qmatmul_mma as mm

        # The quantized-product lever first, as `linear` asks it; the fragment kernel's
        # own check covers every weight being quantized (MLX words, or held as views of
        # one stacked fragment weight) and supported.
        if use_kernel("qmatmul", x.device) and use_kernel(
                "qmatmul_mma", x.device, mm.stack_unsupported_reason(x, ws)):
            y = fragment_product(x, mm.stacked_fragments_of(ws), mm.stacked_bias(ws, biases))
            return list(y.split([w.shape[0] for w in ws], dim=-1))
        from .kernels import qmatmul_wgmma as wg

        if use_kernel("qmatmul", x.device) and _batched_rows(x) and use_kernel(
                "qmatmul_wgmma", x.device, mm.stack_unsupported_reason(x, ws, wg.unsupported_reason)):
            levers.count("qmatmul")
            y = _batched_product(x, mm.stacked_fragments_of(ws), mm.stacked_bias(ws, biases))
            return list(y.split([w.shape[0] for w in ws], dim=-1))
    return [linear(x, w, b) for w, b in zip(ws, biases)]


def gated_act(a: torch.Tensor, b: torch.Tensor, act: str) -> torch.Tensor:
    """act(a)·b for a, b [..., I]; act in {gelu_tanh, silu} (HF names accepted).

    The kernel is bit-identical to the reference, so it runs in the exact tier.
    When grad is needed it goes through the differentiable function that saves
    only a and b.
    """
    check_gated_inputs(a, b)
    act = reference.activation_name(act)
    if levers.triton_available():
        from .kernels import gated_act as k

        if use_kernel("gated_act", a.device, k.unsupported_reason(a)):
            levers.count("gated_act")
            if _needs_grad(a, b):
                return k.GatedActFunction.apply(a, b, act)
            return k.gated_act_forward(a, b, act)
    _counted_reference("gated_act")
    return reference.gated_act(a, b, act)


def check_gated_inputs(a: torch.Tensor, b: torch.Tensor) -> None:
    """ValueError unless a and b share one shape, dtype and device."""
    if a.shape != b.shape:
        raise ValueError(f"a and b must have one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")


def mlp(x, gate, up, down, act: str, residual=None) -> torch.Tensor:
    """down(act(x·gateᵀ)·(x·upᵀ)) (+ residual), with the gated activation dispatched.

    x [..., H]; gate/up [I, H] and down [H, I], dense or QuantizedTensor. Without grad,
    4-bit g64/g128 weights and 1-32 bf16 rows take the fragment kernel's MLP
    (`qmatmul_mma.mlp`), 33-256 rows on Hopper the same MLP over the wgmma kernel, other
    quantized decode rows the fused MLP kernels.
    Training (grad enabled, dense weights, kernel admitted) goes through one
    function that keeps only the two projections for backward and recomputes
    the hidden activation there.
    """
    act = reference.activation_name(act)
    check_mlp_inputs(x, gate, up, down, residual)
    if not torch.is_grad_enabled() and levers.triton_available():
        from .kernels import fused_mlp as fm
        from .kernels import qmatmul_mma as mm

        # The quantized-product lever first, as `linear` asks it.
        if use_kernel("qmatmul", x.device) and use_kernel(
                "qmatmul_mma", x.device, mm.mlp_unsupported_reason(x, gate, up, down, residual)):
            return mm.mlp(x, gate, up, down, act, residual, product=fragment_product)
        from .kernels import qmatmul_wgmma as wg

        if use_kernel("qmatmul", x.device) and _batched_rows(x) and use_kernel(
                "qmatmul_wgmma", x.device, mm.mlp_unsupported_reason(
                    x, gate, up, down, residual, wg.unsupported_reason)):
            return mm.mlp(x, gate, up, down, act, residual, product=_batched_product,
                          reason_of=wg.unsupported_reason)

        if use_kernel("fused_mlp", x.device, fm.unsupported_reason(x, gate, up, down, residual)):
            levers.count("fused_mlp")
            return fm.fused_mlp(x, gate, up, down, act, residual)
    a, b = linear(x, gate), linear(x, up)
    training = isinstance(down, torch.Tensor) and _needs_grad(a, b, down)
    if training and levers.triton_available():
        from .kernels import gated_act as k

        if use_kernel("gated_act", a.device, k.unsupported_reason(a)):
            levers.count("gated_act")
            y = k.GatedActDownFunction.apply(a, b, down.to(a.dtype), act)
            return y if residual is None else residual + y
    y = linear(gated_act(a, b, act), down)
    return y if residual is None else residual + y


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
    (`kernels.decode_attention.unsupported_reason` decides); anything else runs
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
    if levers.triton_available():
        from .kernels import decode_attention as attn

        if use_kernel("decode_attention", q.device, attn.unsupported_reason(q, k, v, block_table)):
            levers.count("decode_attention")
            return attn.decode_attention_quantized_kv(q, k, v, lengths, scale, window, softcap,
                                                      supported=True, block_table=block_table)
    _counted_reference("decode_attention")
    if block_table is not None:
        return reference.paged_decode_attention(q, k, v, block_table, lengths, scale, window,
                                                softcap)
    return reference.decode_attention(q, k, v, lengths, scale, window, softcap)


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
    quantized = isinstance(cache, QuantizedTensor)
    if quantized and levers.triton_available():
        from .kernels import kv_append as k

        if use_kernel("kv_append", x.device, k.unsupported_reason(x, cache)):
            levers.count("kv_append")
            k.kv_append_quantized(x, positions, cache, block_table)
            return
    _counted_reference("kv_append")
    pos = positions.to(torch.int64)
    n_max = cache.shape[2] * (block_table.shape[1] if paged else 1)
    if not positions_checked and pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= n_max):
        raise ValueError(f"positions must lie in [0, {n_max}), got values in "
                         f"[{int(pos.min())}, {int(pos.max())}]")
    if paged:
        idx = block_table[torch.arange(B, device=x.device), pos // cache.shape[2]].to(torch.int64)
        if not positions_checked and idx.numel() and (
                int(idx.min()) < 0 or int(idx.max()) >= cache.shape[0]):
            raise ValueError(f"the block table names pages in [{int(idx.min())}, "
                             f"{int(idx.max())}] for these positions; the pool has "
                             f"0..{cache.shape[0] - 1}")
        pos = pos % cache.shape[2]
    else:
        idx = torch.arange(B, device=x.device)
    if quantized:
        cache.write_((idx, slice(None), pos), x)
    else:
        cache[idx, :, pos] = x.to(cache.dtype)


def norm_and_rotate(q, k, q_norm, k_norm, eps: float, unit_offset: bool, cos, sin):
    """q [B, Hq, T, D], k [B, Hkv, T, D] → each normed per head (where the weights are
    not None: Qwen 3, Gemma 3) and rotated by cos/sin [B, T, D]."""
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps, unit_offset), rms_norm(k, k_norm, eps, unit_offset)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


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
    unsupported = "logit soft-capping (SDPA has none)" if softcap is not None else None
    if use_kernel("prefill_sdpa", q.device, unsupported):
        levers.count("prefill_sdpa")
        B, Hq, T, D = q.shape
        Hkv, past = k.shape[1], k.shape[2] - T
        G = Hq // Hkv  # query heads kv*G .. kv*G + G - 1 share kv head kv
        key = ("prompt_mask", window, T, past, G)
        mask = None if masks is None else masks.get(key)
        if mask is None:
            mask = reference.prompt_mask(lengths, T, window, past)[:, None]  # [B, 1, T, S]
            if G > 1:  # each query head's rows, stacked as the queries are below
                mask = mask.expand(B, G, T, mask.shape[-1]).reshape(B, 1, G * T, mask.shape[-1])
            if masks is not None:
                masks[key] = mask
        if G == 1:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                    scale=scale)
        stacked = q.reshape(B, Hkv, G * T, D)
        out = torch.nn.functional.scaled_dot_product_attention(stacked, k, v, attn_mask=mask,
                                                               scale=scale)
        return out.reshape(B, Hq, T, D)
    _counted_reference("prompt_attention")
    return reference.prompt_attention(q, k, v, lengths, scale, window, softcap)
