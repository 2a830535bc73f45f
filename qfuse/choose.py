"""Choices: for one op over given inputs, which fused kernel runs it, or the reference, and why.

Each ``choose_*`` function looks at the tier (`levers.tier`), the kernel's switch, whether
Triton can run on the device, and the kernel's own support check, once, and returns a
`Choice`: the kernel's name (a `levers.KERNELS` key, or "reference"), the reason in words,
and the launcher with everything static bound (weights, eps, the activation, the launch
shape), already told its inputs are supported so it asks nothing again. Calling a Choice
bumps its dispatch counters (`levers.counters`) and runs the launcher: no environment
read, no support check, no kernel choice.

Two users: `ops` (the public per-call functions: choose, then run) and `plan` (a model's
op sites, each chosen once per plan and then run at every step). A choice holds for
inputs of the layout it was made with (dtype, device, row count, strides); the plan keys
its choices by what they depend on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import levers, reference
from .levers import KERNELS

REFERENCE = "reference"


@dataclass(frozen=True)
class Choice:
    """One op's resolved launcher. ``counts``: the dispatch counters each run bumps (a
    composite choice, whose parts count themselves, has none)."""

    kernel: str
    reason: str
    run: Callable
    counts: tuple[str, ...] = ()

    def __call__(self, *args, **kwargs):
        for name in self.counts:
            levers.count(name)
        return self.run(*args, **kwargs)


def refusal(name: str, device: torch.device, unsupported: str | None = None) -> str | None:
    """None when kernel ``name`` may run for tensors on ``device``, else why not (the tier,
    its switch, the device, Triton, or ``unsupported``: the kernel's own reason)."""
    info = KERNELS[name]
    tier = levers.tier(device)
    if tier < info.min_tier:
        return f"tier {tier.name.lower()} (the kernel needs {info.min_tier.name.lower()})"
    if not levers.kernel_enabled(name):
        return f"switched off ({info.env_var})"
    if device.type != "cuda" and not levers.interpreter_active():
        return f"tensors on {device.type} (Triton needs CUDA or TRITON_INTERPRET=1)"
    if not levers.triton_available():
        return "triton is not installed"
    return unsupported


def admitted(name: str, device: torch.device, unsupported: str | None = None) -> bool:
    """Whether kernel ``name`` runs (`refusal` is None); a refusal is logged once."""
    reason = refusal(name, device, unsupported)
    if reason is not None:
        levers.say_once(name, reason)
    return reason is None


def needs_grad(*tensors) -> bool:
    """Whether autograd must see this call (a kernel without a backward must not run)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _reference(op: str, run: Callable, why: str) -> Choice:
    return Choice(REFERENCE, why, run, (f"ref:{op}",))


# ---- norms and rotary ------------------------------------------------------------------

def choose_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    unit_offset: bool = False) -> Choice:
    """run(x) → RMSNorm(x) over the last axis."""
    why = "gradients are needed" if torch.is_grad_enabled() else None
    if why is None and levers.triton_available():
        from .kernels.pointwise import rms_norm as k

        why = refusal("rms_norm", x.device, k.unsupported_reason(x, weight, unit_offset))
        if why is None:
            return Choice("rms_norm", "fast tier, one launch",
                          lambda x: k.rms_norm(x, weight, eps, unit_offset, checked=True),
                          ("rms_norm",))
    return _reference("rms_norm", lambda x: reference.rms_norm(x, weight, eps, unit_offset),
                      why or "triton is not installed")


def choose_residual_rms_norm(a: torch.Tensor, residual: torch.Tensor,
                             post_weight: torch.Tensor | None,
                             next_weight: torch.Tensor | None, eps: float,
                             unit_offset: bool = False) -> Choice:
    """run(a, residual) → (h, n): h = residual + rms_norm(a, post_weight) (+ a without it),
    n = rms_norm(h, next_weight) (None without it): a decoder layer's residual joint, in
    one launch where the kernel takes it, else the norms chosen apart and an add."""
    why = "gradients are needed" if torch.is_grad_enabled() else None
    if why is None and levers.triton_available():
        from .kernels.pointwise import rms_norm as k

        why = refusal("rms_norm", a.device, k.residual_unsupported_reason(
            a, residual, post_weight, next_weight, unit_offset))
        if why is None:
            return Choice("rms_norm", "fast tier, the joint in one launch",
                          lambda a, r: k.residual_rms_norm(a, r, post_weight, next_weight, eps,
                                                           unit_offset, checked=True),
                          ("rms_norm",))
    post = None if post_weight is None else choose_rms_norm(a, post_weight, eps, unit_offset)
    h_like = torch.empty_like(residual, memory_format=torch.contiguous_format)  # r + s
    after = None if next_weight is None else choose_rms_norm(h_like, next_weight, eps,
                                                             unit_offset)

    def joint(a, r):
        h = r + (a if post is None else post(a))
        return h, (None if after is None else after(h))

    kernel = next((c.kernel for c in (post, after) if c is not None), REFERENCE)
    return Choice(kernel, f"norms apart and an add ({why or 'triton is not installed'})",
                  joint)


def choose_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Choice:
    """run(x, cos, sin) → x rotated (x [B, H, T, D], cos/sin [B, T, D])."""
    why = "gradients are needed" if torch.is_grad_enabled() else None
    if why is None and levers.triton_available():
        from .kernels.pointwise import rope as k

        why = refusal("rope", x.device, k.unsupported_reason(x, cos, sin))
        if why is None:
            return Choice("rope", "one launch, bit-exact",
                          functools.partial(k.apply_rotary, checked=True), ("rope",))
    return _reference("apply_rotary", reference.apply_rotary,
                      why or "triton is not installed")


def choose_norm_and_rotate(q, k, q_norm, k_norm, eps: float, unit_offset: bool, cos,
                           sin) -> Choice:
    """run(q, k, cos, sin) → (q, k) each normed per head (where the weights are given:
    Qwen 3, Gemma 3) and rotated."""
    qn = None if q_norm is None else choose_rms_norm(q, q_norm, eps, unit_offset)
    kn = None if k_norm is None else choose_rms_norm(k, k_norm, eps, unit_offset)
    # The rotation sees the normed tensors, whose layout the norm's output sets.
    q_in = q if qn is None else torch.empty_like(q, memory_format=torch.contiguous_format)
    k_in = k if kn is None else torch.empty_like(k, memory_format=torch.contiguous_format)
    rq, rk = choose_rotary(q_in, cos, sin), choose_rotary(k_in, cos, sin)

    def norm_and_rotate(q, k, cos, sin):
        if qn is not None:
            q, k = qn(q), kn(k)
        return rq(q, cos, sin), rk(k, cos, sin)

    return Choice(rq.kernel, rq.reason, norm_and_rotate)


# ---- products --------------------------------------------------------------------------

def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _ring_refusal(x: torch.Tensor, f) -> str | None:
    """None when decode rows of x over the fragment-order weight f take the TMA-ring kernel
    (its shape rule, its switch, its check) rather than `qmatmul_mma`, else why not."""
    from .kernels.products import qmatmul_ring as ring

    if not ring.preferred(x, f):
        return "the ring's shape rule prefers the fragment kernel here"
    return refusal("qmatmul_ring", x.device, ring.unsupported_reason(x, f))


def fragment_product_choice(x: torch.Tensor, f, bias, lead: tuple[str, ...] = ()) -> Choice:
    """run(x, residual=None) over the fragment-order weight f for decode rows: the ring
    kernel where it is preferred and admitted, else `qmatmul_mma`. ``lead``: counters
    bumped before the kernel's own (the quantized-product lever's)."""
    from .kernels.products import qmatmul_mma as mm
    from .kernels.products import qmatmul_ring

    why = _ring_refusal(x, f)
    if why is None:
        return Choice("qmatmul_ring", "decode rows; the ring's shape rule prefers it",
                      lambda x, residual=None: qmatmul_ring.qmatmul_ring(x, f, bias, residual,
                                                                         checked=True),
                      (*lead, "qmatmul_ring"))
    return Choice("qmatmul_mma", f"decode rows ({why})",
                  lambda x, residual=None: mm.qmatmul_mma(x, f, bias, residual, checked=True),
                  (*lead, "qmatmul_mma"))


def _batched_rows(x: torch.Tensor) -> bool:
    """Whether x has the rows of a serving batch: past the fragment kernel's 32, within
    the wgmma kernel's 256."""
    from .kernels.products import qmatmul_mma as mm
    from .kernels.products import qmatmul_wgmma as wg

    return mm.MAX_ROWS < _rows(x) <= wg.MAX_ROWS


def _batched_refusal(x: torch.Tensor, w) -> str | None:
    """None when batched rows of x go to the wgmma kernel, else why not."""
    from .kernels.products import qmatmul_wgmma as wg

    if not _batched_rows(x):
        return f"{_rows(x)} rows (wgmma kernel: 33-{wg.MAX_ROWS})"
    return refusal("qmatmul_wgmma", x.device, wg.unsupported_reason(x, w))


def _batched_product(f, bias, lead: tuple[str, ...] = ()) -> Choice:
    from .kernels.products import qmatmul_wgmma as wg

    return Choice("qmatmul_wgmma", "batched rows (33-256) on Hopper",
                  lambda x, residual=None: wg.qmatmul_wgmma(x, f, bias, residual, checked=True),
                  (*lead, "qmatmul_wgmma"))


def fragment_route(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> str:
    """Which kernel multiplies x by the fragment-held weight w: "fragment" (decode rows:
    `qmatmul_mma`), "ring" (decode rows where `qmatmul_ring.preferred`), "wgmma" (batched
    rows, 33-256 on Hopper), "cublas" (longer prefill rows, dequantized once), "tc"
    (`qmatmul_tc` over the MLX words made back) or "reference" (compat/exact, gradients,
    no Triton). Asked without running anything (`Decoder.product_kernels`)."""
    if not levers.triton_available() or needs_grad(x, bias) \
            or refusal("qmatmul", x.device) is not None:
        return "reference"
    from .kernels.products import qmatmul_mma as mm
    from .kernels.products.qmatmul_tc import DECODE_ROWS

    if refusal("qmatmul_mma", x.device, mm.unsupported_reason(x, w)) is None:
        return "ring" if _ring_refusal(x, w) is None else "fragment"
    if x.is_cuda and x.dtype == torch.bfloat16:
        if _batched_refusal(x, w) is None:
            return "wgmma"
        return "cublas" if x.numel() > DECODE_ROWS * w.k else "tc"
    return "reference"


def choose_product(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> Choice:
    """run(x) → x·Wᵀ (+ bias); w dense [N, K], a QuantizedTensor or a fragment-order
    weight. A quantized weight takes the quantized kernels in the fast tier unless x or
    bias needs a gradient (the reference keeps autograd's graph)."""
    from .kernels.products.fragments import FragmentWeight
    from .quant import QuantizedTensor

    if isinstance(w, FragmentWeight):
        return _choosefragment_product_choice(x, w, bias)
    why = "a dense weight"
    if isinstance(w, QuantizedTensor):
        why = "gradients are needed" if needs_grad(x, bias) else "triton is not installed"
        if levers.triton_available() and not needs_grad(x, bias):
            from .kernels.products import qmatmul
            from .kernels.products import qmatmul_mma as mm

            why = refusal("qmatmul", x.device, qmatmul.unsupported_reason(x, w))
            if why is None:
                mma_why = refusal("qmatmul_mma", x.device, mm.unsupported_reason(x, w))
                if mma_why is None:
                    return fragment_product_choice(x, mm.fragments_of(w), bias, ("qmatmul",))
                if _batched_refusal(x, w) is None:  # asked before the repack
                    return _batched_product(mm.fragments_of(w), bias, ("qmatmul",))
                return Choice("qmatmul", f"MLX-layout kernel ({mma_why})",
                              lambda x: qmatmul.qmatmul(x, w, bias, checked=True),
                              ("qmatmul",))
    return _reference("linear", lambda x: reference.linear(x, w, bias), why)


def _choosefragment_product_choice(x: torch.Tensor, w, bias) -> Choice:
    """`choose_product` over a weight held in fragment order (`Decoder.hold_kernel_forms`),
    by the kernel `fragment_route` names; the reference dequantizes the held form bit for
    bit as the MLX words."""
    route = fragment_route(x, w, bias)
    if route == "reference":
        return _reference("linear", lambda x: reference.linear(x, w, bias),
                          "compat/exact tier, gradients, or no Triton")
    if route in ("fragment", "ring"):
        return fragment_product_choice(x, w, bias, ("qmatmul",))
    if route == "wgmma":
        return _batched_product(w, bias, ("qmatmul",))
    from .kernels.products import fragment_words, fragments
    from .kernels.products.qmatmul_tc import qmatmul_tc
    from .kernels.products.splitk import as_rows

    if route == "cublas":  # dequantize once straight from the fragments, then cuBLAS
        def dequantized(x):
            y = torch.nn.functional.linear(as_rows(x, w.k), fragment_words.dequantize_bf16(w),
                                           bias)
            return y.reshape(*x.shape[:-1], w.n)
        return Choice("qmatmul", "prefill rows: dequantize, then cuBLAS", dequantized,
                      ("qmatmul",))
    return Choice("qmatmul", "tensor cores over the MLX words",
                  lambda x: qmatmul_tc(x, fragments.to_mlx(w), bias), ("qmatmul",))


def gather(x: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """x[..., perm]: an act-order module's input in its weight's sorted column order
    (`formats`); x itself without a permutation."""
    return x if perm is None else x.index_select(-1, perm)


def same_order(perms) -> bool:
    """Whether the input permutations ``perms`` (None: none) are all one, so that one
    gather serves every product over that input."""
    first = perms[0]
    return all((p is None) == (first is None)
               and (p is None or p is first or torch.equal(p, first)) for p in perms[1:])


def gathered(choice: Choice, perm: torch.Tensor | None) -> Choice:
    """``choice`` run over x[..., perm] (its first argument gathered, one small copy a
    call); ``choice`` itself without a permutation."""
    if perm is None:
        return choice
    return Choice(choice.kernel, f"{choice.reason}; input gathered (act-order)",
                  lambda x, *args, **kw: choice(gather(x, perm), *args, **kw))


def choose_stacked_product(x: torch.Tensor, ws: list, biases: list, perms=None) -> Choice:
    """run(x) → [x·Wᵀ + b for each weight], as one product over the weights stacked along
    N where the fragment kernel (decode rows) or the wgmma kernel (batched rows) takes
    them all (Q/K/V: one launch instead of three); the outputs are then views into one
    [..., ΣN] result. Otherwise each weight's own product. ``perms``: each weight's input
    permutation (act-order) or None: one gather before the stack where all are the same,
    else each weight's own gather and product (never stacked)."""
    if perms is not None and any(p is not None for p in perms):
        if same_order(perms):
            return gathered(choose_stacked_product(gather(x, perms[0]), ws, biases), perms[0])
        parts = [gathered(choose_product(gather(x, p), w, b), p)
                 for w, b, p in zip(ws, biases, perms)]
        return Choice(parts[0].kernel,
                      f"one product a weight, act-order input orders differ: {parts[0].reason}",
                      lambda x: [p(x) for p in parts])
    if levers.triton_available() and len(ws) > 1 and not needs_grad(x, *biases):
        from .kernels.products import qmatmul_mma as mm
        from .kernels.products import qmatmul_wgmma as wg

        sizes = [w.shape[0] for w in ws]
        # The quantized-product lever first, as `choose_product` asks it; the fragment
        # kernel's own check covers every weight being quantized and supported.
        lever = refusal("qmatmul", x.device)
        if lever is None and refusal("qmatmul_mma", x.device,
                                     mm.stack_unsupported_reason(x, ws)) is None:
            c = fragment_product_choice(x, mm.stacked_fragments_of(ws), mm.stacked_bias(ws, biases))
            return Choice(c.kernel, f"stacked: {c.reason}",
                          lambda x: list(c.run(x).split(sizes, dim=-1)), c.counts)
        if lever is None and _batched_rows(x) and refusal(
                "qmatmul_wgmma", x.device,
                mm.stack_unsupported_reason(x, ws, wg.unsupported_reason)) is None:
            c = _batched_product(mm.stacked_fragments_of(ws), mm.stacked_bias(ws, biases),
                                 ("qmatmul",))
            return Choice(c.kernel, f"stacked: {c.reason}",
                          lambda x: list(c.run(x).split(sizes, dim=-1)), c.counts)
    parts = [choose_product(x, w, b) for w, b in zip(ws, biases)]
    return Choice(parts[0].kernel, f"one product a weight: {parts[0].reason}",
                  lambda x: [p(x) for p in parts])


# ---- fused decode steps ----------------------------------------------------------------

def steps_refusal(x: torch.Tensor, unsupported: str | None = None) -> str | None:
    """None when the fused decode steps may run for rows x (tier, switch, device,
    Triton), else why not; ``unsupported``: a step's own reason, reported as is."""
    if not levers.triton_available():
        return "triton is not installed"
    if torch.is_grad_enabled():
        return "gradients are needed"
    return refusal("fused_steps", x.device, unsupported)


def choose_qkv_step(x: torch.Tensor, w, bias, n_heads: int, n_kv_heads: int, head_dim: int,
                    q_norm, k_norm, eps: float, unit_offset: bool) -> Choice:
    """run(x, cos, sin, k_cache, v_cache, slots, table) → q [rows, HQ, D], the new key and
    value appended (`kernels.steps.qkv_step`, or `fragment_steps` over a stacked weight
    held in fragment order); the caller has had None from its check."""
    from .kernels.steps import fragment_steps as fs
    from .kernels.steps import qkv_step as k
    from .quant import QuantizedTensor

    if isinstance(w, QuantizedTensor):
        def run(x, cos, sin, k_cache, v_cache, slots, table):
            return k.qkv_step(x, w, bias, n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps,
                              unit_offset, cos, sin, k_cache, v_cache, slots, table,
                              checked=True)
        how = "GEMV"
    else:
        def run(x, cos, sin, k_cache, v_cache, slots, table):
            return fs.qkv_step_fragments(x, w, bias, n_heads, n_kv_heads, head_dim, q_norm,
                                         k_norm, eps, unit_offset, cos, sin, k_cache, v_cache,
                                         slots, table)
        how = "fragment kernel"
    return Choice("fused_steps", f"Q/K/V ({how}), q/k norms, RoPE and the KV append in one "
                  "launch", run, ("fused_steps",))


def choose_joint_step(w, bias, post_weight, next_weight, eps: float,
                      unit_offset: bool) -> Choice:
    """run(x, residual) → (h, n): the product and the residual joint after it
    (`kernels.steps.joint_step`, or `fragment_steps` over a weight held in fragment order);
    the caller has had None from its check."""
    from .kernels.steps import fragment_steps as fs
    from .kernels.steps import joint_step as k
    from .quant import QuantizedTensor

    if isinstance(w, QuantizedTensor):
        return Choice("fused_steps", "the product (GEMV) and the residual joint in one launch",
                      lambda x, r: k.joint_step(x, w, bias, r, post_weight, next_weight, eps,
                                                unit_offset, checked=True), ("fused_steps",))
    return Choice("fused_steps", "the product (fragment kernel) and the residual joint in one "
                  "launch", lambda x, r: fs.joint_step_fragments(
                      x, w, bias, r, post_weight, next_weight, eps, unit_offset),
                  ("fused_steps",))


def choose_gate_up_step(gate, up, act: str) -> Choice:
    """run(x) → act(x·gateᵀ)·(x·upᵀ), one launch: `products.fused_mlp`'s first half over
    MLX-layout weights, or `fragment_steps` over the stacked [gate; up] weight held in
    fragment order (``gate`` that stack, ``up`` None)."""
    from .kernels.products import fused_mlp as k
    from .kernels.steps import fragment_steps as fs

    act = reference.activation_name(act)
    if up is None:
        return Choice("fused_steps", "gate/up (fragment kernel) and the activation in one "
                      "launch", lambda x: fs.gate_up_step_fragments(x, gate, act),
                      ("fused_steps",))
    return Choice("fused_steps", "gate/up (GEMV) and the activation in one launch",
                  lambda x: k.gate_up_act_gemv(x, gate, up, act), ("fused_steps",))


# ---- activation and MLP ----------------------------------------------------------------

def choose_gated_act(a: torch.Tensor, b: torch.Tensor, act: str) -> Choice:
    """run(a, b) → act(a)·b (act an activation name `reference.activation_name` takes);
    the kernel is bit-identical to the reference, so it runs in the exact tier; with
    gradients it runs the differentiable function that keeps only a and b."""
    act = reference.activation_name(act)
    why = "triton is not installed"
    if levers.triton_available():
        from .kernels.pointwise import gated_act as k

        why = refusal("gated_act", a.device, k.unsupported_reason(a))
        if why is None:
            if needs_grad(a, b):
                return Choice("gated_act", "bit-exact, differentiable",
                              lambda a, b: k.GatedActFunction.apply(a, b, act), ("gated_act",))
            return Choice("gated_act", "bit-exact, one launch",
                          lambda a, b: k.gated_act_forward(a, b, act), ("gated_act",))
    return _reference("gated_act", lambda a, b: reference.gated_act(a, b, act), why)


def choose_mlp(x: torch.Tensor, gate, up, down, act: str, residual=None, perms=None) -> Choice:
    """run(x, residual=None) → down(act(x·gateᵀ)·(x·upᵀ)) (+ residual), x [..., H]; gate/up
    [I, H] and down [H, I], dense, quantized or fragment-held. ``residual``: an example
    of the residual the calls pass (its layout matters to the kernels), or None.

    Without gradients: 1-32 bf16 rows over 4-bit g64/g128 weights take the fragment
    kernel's products (gate and up stacked, the activation on the halves, the residual in
    the down product's epilogue), 33-256 rows on Hopper the same over the wgmma kernel,
    other quantized decode rows the fused MLP kernels; otherwise the products and the
    activation are chosen apart. Training (dense weights) goes through one function that
    keeps only the two projections and recomputes the hidden activation in backward.
    ``perms``: gate's and up's input permutations (act-order) or None: one gather before
    the MLP where they are the same, else the ops apart, each product its own gather."""
    act = reference.activation_name(act)
    if perms is not None and any(p is not None for p in perms):
        if same_order(perms):
            return gathered(choose_mlp(gather(x, perms[0]), gate, up, down, act, residual),
                            perms[0])
        return _composed_mlp(x, gate, up, down, act,
                             "act-order input orders of gate and up differ", perms)
    why = "gradients are needed" if torch.is_grad_enabled() else "triton is not installed"
    if not torch.is_grad_enabled() and levers.triton_available():
        from .kernels.products import fused_mlp as fm
        from .kernels.products import qmatmul_mma as mm
        from .kernels.products import qmatmul_wgmma as wg

        lever = refusal("qmatmul", x.device)
        why = lever or refusal("qmatmul_mma", x.device,
                               mm.mlp_unsupported_reason(x, gate, up, down, residual))
        if why is None:
            return _fragment_mlp(x, gate, up, down, act, mm.unsupported_reason, False)
        batched = lever or _batched_refusal(x, gate) or refusal(
            "qmatmul_wgmma", x.device,
            mm.mlp_unsupported_reason(x, gate, up, down, residual, wg.unsupported_reason))
        if batched is None:
            return _fragment_mlp(x, gate, up, down, act, wg.unsupported_reason, True)
        fused = refusal("fused_mlp", x.device, fm.unsupported_reason(x, gate, up, down,
                                                                      residual))
        if fused is None:
            return Choice("fused_mlp", f"quantized decode rows ({why})",
                          lambda x, residual=None: fm.fused_mlp(x, gate, up, down, act,
                                                                residual, checked=True),
                          ("fused_mlp",))
    return _composed_mlp(x, gate, up, down, act, why)


def _fragment_mlp(x, gate, up, down, act, reason_of, batched: bool) -> Choice:
    """The MLP over fragment-order products (`choose_mlp`): gate and up as one product
    over the stacked weight (two where gate's rows are not whole tiles), the gated
    activation on the halves, the residual added in the down product's epilogue."""
    from .kernels.pointwise.gated_act import gated_act_forward
    from .kernels.products import qmatmul_mma as mm

    I = gate.shape[0]
    hidden = torch.empty(*x.shape[:-1], I, dtype=x.dtype, device=x.device)

    def product(example, f):
        return _batched_product(f, None) if batched else fragment_product_choice(example, f, None)

    if mm.stack_unsupported_reason(x, [gate, up], reason_of) is None:
        both = product(x, mm.stacked_fragments_of([gate, up]))

        def gate_up(x):
            y = both(x)
            return y[..., :I], y[..., I:]
    else:
        g, u = product(x, mm.held_fragments(gate)), product(x, mm.held_fragments(up))

        def gate_up(x):
            return g(x), u(x)
    out = product(hidden, mm.held_fragments(down))

    def mlp(x, residual=None):
        a, b = gate_up(x)
        return out(gated_act_forward(a, b, act), residual)

    return Choice(out.kernel, f"gate/up, activation, down: {out.reason}", mlp)


def _composed_mlp(x, gate, up, down, act: str, why: str, perms=(None, None)) -> Choice:
    """The MLP as its ops apart: two products, the gated activation, the down product,
    each chosen on its own. With gradients on, each is chosen at every call from the real
    tensors (whether autograd must see a product or the activation depends on them), and
    training over dense weights takes the function that recomputes the hidden."""
    if torch.is_grad_enabled():
        return Choice(REFERENCE, f"ops apart, chosen per call: gradients ({why})",
                      lambda x, residual=None: _mlp_per_call(x, gate, up, down, act, residual,
                                                             perms))
    pg, pu = perms
    g = gathered(choose_product(gather(x, pg), gate), pg)
    u = gathered(choose_product(gather(x, pu), up), pu)
    hidden = torch.empty(*x.shape[:-1], gate.shape[0], dtype=x.dtype, device=x.device)
    act_choice = choose_gated_act(hidden, hidden, act)
    d = choose_product(hidden, down)

    def mlp(x, residual=None):
        y = d(act_choice(g(x), u(x)))
        return y if residual is None else residual + y

    return Choice(g.kernel, f"ops apart ({why})", mlp)


def _mlp_per_call(x, gate, up, down, act: str, residual, perms=(None, None)):
    """`_composed_mlp` with every choice made from this call's tensors."""
    xg, xu = gather(x, perms[0]), gather(x, perms[1])
    a, b = choose_product(xg, gate)(xg), choose_product(xu, up)(xu)
    if isinstance(down, torch.Tensor) and needs_grad(a, b, down) \
            and levers.triton_available():
        from .kernels.pointwise import gated_act as k

        if admitted("gated_act", a.device, k.unsupported_reason(a)):
            levers.count("gated_act")
            y = k.GatedActDownFunction.apply(a, b, down.to(a.dtype), act)
            return y if residual is None else residual + y
    h = choose_gated_act(a, b, act)(a, b)
    y = choose_product(h, down)(h)
    return y if residual is None else residual + y


# ---- attention and the KV cache --------------------------------------------------------

# Decode attention without splits (`AttentionLaunch.whole`): from this many rows, where a
# sequence attends at most WHOLE_ATTENTION_MAX_TOKENS tokens (its cache's capacity, or its
# window if shorter). Provisional: the GPU sweep bench/attention_whole.json decides them
# (bench/NOTES.md, "Decode attention" → "Batched short contexts").
WHOLE_ATTENTION_MIN_ROWS = 8
WHOLE_ATTENTION_MAX_TOKENS = 4096
# On a GPU by default once that sweep has measured it faster; until then only with
# QFUSE_DECODE_ATTENTION_WHOLE=1 (a default is what was measured).
WHOLE_ATTENTION_ON_CUDA = False


def unmeasured_on_gpu(name: str, device: torch.device, default_on: bool,
                      measured: str = "") -> str | None:
    """Why kernel ``name`` does not run on ``device`` by default (None: it may): on a GPU,
    a kernel not yet measured faster (``default_on`` False) runs only where its switch
    asks with =1; ``measured``: where it must be faster (" at every row count")."""
    if device.type == "cuda" and not (default_on or levers.kernel_requested(name)):
        return (f"not measured faster on a GPU{measured} ({KERNELS[name].env_var}=1 "
                "asks)")
    return None


def whole_attention_refusal(device: torch.device, rows: int) -> str | None:
    """Why a decode step of ``rows`` rows on ``device`` keeps the split attention, as far
    as the levers and the row count say (None: it takes the whole-context kernel where
    the cache is short enough, `choose_decode_attention`). On a GPU only where
    QFUSE_DECODE_ATTENTION_WHOLE=1 asks, until measured faster. Two row counts that differ
    here attend through different kernels, so their rows' bits may differ
    (`Decoder.product_kernels`)."""
    why = refusal("decode_attention_whole", device) or unmeasured_on_gpu(
        "decode_attention_whole", device, WHOLE_ATTENTION_ON_CUDA)
    if why is None and rows < WHOLE_ATTENTION_MIN_ROWS:
        why = f"{rows} rows (whole contexts from {WHOLE_ATTENTION_MIN_ROWS})"
    return why


def decode_attention_route(device: torch.device, rows: int) -> str | None:
    """The decode attention's form at ``rows`` rows as far as the row count decides it,
    for `Decoder.product_kernels`: "attention_whole" or "attention_split" where the
    whole-context kernel may run on ``device`` at all (its lever, the tier, the device),
    None where every row count splits. Made without a cache: a cache too long for whole
    contexts splits at every row count, which two different answers here only make
    look different."""
    if refusal("decode_attention", device) is not None or whole_attention_refusal(
            device, WHOLE_ATTENTION_MIN_ROWS) is not None:
        return None
    whole = whole_attention_refusal(device, rows) is None
    return "attention_whole" if whole else "attention_split"


def choose_decode_attention(q, k, v, scale: float, softcap=None,
                            block_table=None, window=None) -> Choice:
    """run(q, k, v, lengths, window=None, block_table=None) → one query token per
    sequence over a dense
    or quantized KV cache (`ops.decode_attention` gives the tensors). The kernel (fast
    tier: online softmax is not bit-exact) takes 4/8-bit or dense fp16/bf16 caches of the
    head dims it supports; its split kernel and launch are chosen here too: whole
    contexts without splits (`whole_attention_refusal`) where q has enough rows and a
    sequence attends at most WHOLE_ATTENTION_MAX_TOKENS tokens (the cache's capacity,
    from shapes alone, or ``window``: the calls' window, fixed per layer), else splits.
    A choice made for a cache's shapes and window holds for all its calls, so every
    sequence of a row count attends through one kernel whatever the lengths."""
    why = "triton is not installed"
    if levers.triton_available():
        from .kernels.attention import decode_attention as attn

        why = refusal("decode_attention", q.device,
                      attn.unsupported_reason(q, k, v, block_table))
        if why is None:
            span = attn.tokens_per_sequence(k, block_table)
            span = span if window is None else min(span, window)
            whole_why = whole_attention_refusal(q.device, q.shape[0])
            if whole_why is None and span > WHOLE_ATTENTION_MAX_TOKENS:
                whole_why = f"{span} tokens a sequence (whole contexts to " \
                            f"{WHOLE_ATTENTION_MAX_TOKENS})"
            whole = whole_why is None
            launch = attn.AttentionLaunch(path=attn.choose_path(q, k, v, block_table, whole),
                                          whole=whole or None)

            def attend(q, k, v, lengths, window=None, block_table=None):
                return attn.decode_attention_quantized_kv(
                    q, k, v, lengths, scale, window, softcap, launch=launch,
                    supported=True, block_table=block_table)
            if whole:
                return Choice("decode_attention_whole",
                              f"{launch.path} kernel, whole contexts ({q.shape[0]} rows, "
                              f"≤ {span} tokens)", attend,
                              ("decode_attention", "decode_attention_whole"))
            return Choice("decode_attention", f"{launch.path} split kernel (not whole "
                          f"contexts: {whole_why})", attend, ("decode_attention",))

    def attend_reference(q, k, v, lengths, window=None, block_table=None):
        if block_table is not None:
            return reference.paged_decode_attention(q, k, v, block_table, lengths, scale,
                                                    window, softcap)
        return reference.decode_attention(q, k, v, lengths, scale, window, softcap)
    return _reference("decode_attention", attend_reference, why)


def choose_kv_append(x: torch.Tensor, cache) -> Choice:
    """run(x, positions, cache, block_table=None): write x [B, Hkv, D] at each sequence's
    position: the kernel that quantizes it into a quantized cache, or the reference write
    (a dense cache, or the kernel refused), which trusts the positions (`ops.kv_append`
    checks them first where the caller does not vouch for them)."""
    from .quant import QuantizedTensor

    why = "a dense cache"
    if isinstance(cache, QuantizedTensor):
        why = "triton is not installed"
        if levers.triton_available():
            from .kernels.attention import kv_append as k

            why = refusal("kv_append", x.device, k.unsupported_reason(x, cache))
            if why is None:
                return Choice("kv_append", "quantizes the token as quant.quantize does",
                              k.kv_append_quantized, ("kv_append",))
    return _reference("kv_append", _write_kv, why)


def _write_kv(x: torch.Tensor, positions: torch.Tensor, cache, block_table=None) -> None:
    """cache[b, :, positions[b]] = x[b] (through the block table's page where given), the
    positions trusted; a quantized cache quantizes as `quant.quantize` does."""
    from .quant import QuantizedTensor

    B = x.shape[0]
    pos = positions.to(torch.int64)
    if block_table is not None:
        idx = block_table[torch.arange(B, device=x.device), pos // cache.shape[2]].to(torch.int64)
        pos = pos % cache.shape[2]
    else:
        idx = torch.arange(B, device=x.device)
    if isinstance(cache, QuantizedTensor):
        cache.write_((idx, slice(None), pos), x)
    else:
        cache[idx, :, pos] = x.to(cache.dtype)


def choose_prompt_attention(q: torch.Tensor, scale: float, window=None,
                            softcap=None) -> Choice:
    """run(q, k, v, lengths, masks=None) → prefill attention over right-padded prompts
    (`ops.prompt_attention`): torch SDPA in the fast tier unless a logit soft-cap needs
    the eager path."""
    unsupported = "logit soft-capping (SDPA has none)" if softcap is not None else None
    why = refusal("prefill_sdpa", q.device, unsupported)
    if why is None:
        def sdpa(q, k, v, lengths, masks=None):
            return _sdpa_prompt_attention(q, k, v, lengths, scale, window, masks)
        return Choice("prefill_sdpa", "torch SDPA", sdpa, ("prefill_sdpa",))
    return _reference("prompt_attention",
                      lambda q, k, v, lengths, masks=None: reference.prompt_attention(
                          q, k, v, lengths, scale, window, softcap), why)


def _sdpa_prompt_attention(q, k, v, lengths, scale, window, masks):
    """GQA goes in as plain multi-head attention over each kv head's query heads stacked
    along the queries (their mask rows repeated): SDPA's own GQA with an explicit mask
    runs its math backend on CUDA, float scores of every query and key. ``masks``: a dict
    shared by the layers of one pass, where each mask is made once per window."""
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
