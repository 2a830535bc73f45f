"""A decode step as fused steps: each decoder layer in five launches, for the whole model.

Per layer (`kernels.steps`): the Q/K/V product with the q/k norms, RoPE and the KV
append; the attention; the O product with the residual joint and the next norm; the
gate/up product with the activation; the down product with the residual joint and the
next layer's input norm (the last layer's: the final norm). The layer's input norm is
thus computed by the step before it, and the embedding's by one RMSNorm launch.

Chosen once per decode plan, for every layer or none (`refusal`: the first reason a
layer's weights, cache or rows do not fit the steps, shown in `qfuse info`); then each
step is a site of the plan like any other. The Q/K/V weights are stacked once, the
three Linears' buffers becoming views of the stack (`stacked_qkv`), so they are resident
once. Values are those of the layer-by-layer fast-tier kernels, op for op
(`tests/test_fused_steps.py`), but for the order of sums inside the norms and products.
"""

from __future__ import annotations

import torch

from .. import choose
from ..kernels.products import fragments
from ..plan import Site
from ..quant import QuantizedTensor

# The step kernels need Triton: imported where a plan is made (after `choose` has said
# Triton is there), so that qfuse loads without it.

# On a GPU the steps run only where QFUSE_FUSED_STEPS=1 asks, until they are measured
# faster at every row count they take (bench/NOTES.md, "Fused decode steps"): over
# fragment-held weights, on an H100, 17% faster at one row on Llama 3 8B's shape, within
# the spread between runs at one and four rows on Gemma 3 12B's; and a row's bits must not
# depend on the batch it is in, so one row alone cannot take them while two take the
# layer-by-layer path. The GEMV's steps never beat the fragment kernels.
DEFAULT_ON_CUDA = False


def stacked_qkv(attn) -> QuantizedTensor:
    """The attention's q, k and v weights as one stacked QuantizedTensor; made on the first
    call, after which the three Linears hold views of it (resident once)."""
    from ..kernels.steps import qkv_step

    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    kept = attn.__dict__.get("_stacked_qkv")
    if kept is not None and projs[0].weight is not None and \
            projs[0].weight.data_ptr() == kept.packed.data_ptr():
        return kept
    stack = qkv_step.stacked([p.quantized() for p in projs])
    row = 0
    for p in projs:  # the buffers become views: the separate copies are freed
        for name, t in (("weight", stack.packed), ("scales", stack.scales),
                        ("biases", stack.biases)):
            setattr(p, name, t[row:row + p.n_out])
        row += p.n_out
    attn.__dict__["_stacked_qkv"] = stack
    return stack


def _weights_refusal(linears) -> str | None:
    """Why MLX-layout weights cannot run as the portable steps (None: they can)."""
    from ..kernels.products import qmatmul

    for lin in linears:
        if lin.held is not None:
            return "some weights held in mma fragment order, some not"
        if not lin.bits:
            return "dense weights"
        if lin.bits not in qmatmul.SUPPORTED_BITS:
            return f"{lin.bits}-bit weights (steps: 4, 8)"
    return None


def held_stacks(layer):
    """(Q/K/V, gate/up) stacked fragment weights a layer holds, or None where its weights
    are not held in fragment order as stacks (`Decoder.hold_kernel_forms`)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = fragments.stacked_parent([p.held for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
    gate_up = fragments.stacked_parent([mlp.gate_proj.held, mlp.up_proj.held])
    if qkv is None or gate_up is None or attn.o_proj.held is None or mlp.down_proj.held is None:
        return None
    return qkv, gate_up


def _fragments_refusal(x, layer) -> str | None:
    """Why a layer whose weights are held in fragment order cannot run as the fragment
    steps (None: it can)."""
    from ..kernels.steps import fragment_steps

    cfg = layer.self_attn.cfg
    if held_stacks(layer) is None:
        return "weights held in fragment order but not as Q/K/V and gate/up stacks"
    why = fragment_steps.unsupported_reason(x, layer.self_attn.q_proj.held.parent)
    if why is not None:
        return why
    R = fragment_steps.ROWS_PER_PROGRAM
    if cfg.head_dim % R or cfg.intermediate_size % R:
        return f"head dim {cfg.head_dim} or MLP width {cfg.intermediate_size} not a multiple of {R}"
    return None


def refusal(model, h: torch.Tensor, cache) -> str | None:
    """None when every layer's decode step can run as fused steps for rows h [B, 1, H]
    over ``cache``, else the first reason why not."""
    x = h.reshape(-1, h.shape[-1])
    rows = x.shape[0]
    why = choose.steps_refusal(x)
    if why is not None:
        return why
    from ..kernels.pointwise import rms_norm
    from ..kernels.products import fused_mlp, qmatmul
    from ..kernels.steps import joint_step

    cfg = model.config
    held = model.model.layers[0].self_attn.q_proj.held is not None
    why = gpu_refusal(x.device)
    if why is not None:
        return why
    if x.device.type == "cuda" and not held and x.dtype == torch.bfloat16 \
            and rows > qmatmul.BF16_GEMV_ROWS:
        return f"{rows} bf16 rows: the tensor-core products serve them (the GEMV: 1 row)"
    if not rows_admitted(model, rows):
        return f"{rows} rows (steps: 1..{row_limit(model)})"
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                   mlp.up_proj, mlp.down_proj)
        if any(lin.input_perm is not None for lin in linears):
            # the steps read x in the weights' stored column order: no gather
            return f"layer {i}: a projection gathers its input (act-order weight)"
        store = cache.layers[i]
        n_like = torch.empty(rows, cfg.head_dim * (cfg.num_attention_heads
                                                   + 2 * cfg.num_key_value_heads),
                             dtype=x.dtype, device=x.device)[:, :cfg.head_dim]
        if held:
            why = _fragments_refusal(x, layer) or _cache_refusal(x, store, n_like)
            if why is None:
                post, nxt = _joint_norms(model, i, "attn")
                why = rms_norm.residual_unsupported_reason(x, x, _w(post), _w(nxt),
                                                           cfg.norm_unit_offset)
            if why is not None:
                return f"layer {i}: {why}"
            continue
        why = _weights_refusal(linears)
        if why is None:
            qkv = [p.quantized() for p in linears[:3]]
            if any((w.bits, w.group_size) != (qkv[0].bits, qkv[0].group_size) for w in qkv):
                why = "q, k and v weights of different bits or group sizes"
        if why is None:
            why = _qkv_refusal(x, qkv[0], attn, store, n_like)
        if why is None:
            out_like = torch.empty(rows, attn.o_proj.n_in, dtype=x.dtype, device=x.device)
            post, nxt = _joint_norms(model, i, "attn")
            why = joint_step.unsupported_reason(out_like, attn.o_proj.quantized(), x,
                                                _w(post), _w(nxt), cfg.norm_unit_offset)
        if why is None:
            gate, up = mlp.gate_proj.quantized(), mlp.up_proj.quantized()
            why = qmatmul.gemv_unsupported_reason(x, gate) or \
                qmatmul.gemv_unsupported_reason(x, up) or \
                fused_mlp.gate_up_gemv_shapes(x.shape[-1], gate, up)[2]
        if why is None:
            act_like = torch.empty(rows, mlp.down_proj.n_in, dtype=x.dtype, device=x.device)
            post, nxt = _joint_norms(model, i, "mlp")
            why = joint_step.unsupported_reason(act_like, mlp.down_proj.quantized(), x,
                                                _w(post), _w(nxt), cfg.norm_unit_offset)
        if why is not None:
            return f"layer {i}: {why}"
    return None


def _cache_refusal(x, store, n_like) -> str | None:
    """Why the steps cannot append to a layer's cache (None: they can)."""
    from ..kernels.attention import kv_append

    for part in (store.k, store.v):
        if isinstance(part, QuantizedTensor):
            why = kv_append.unsupported_reason(n_like, part)
            if why is not None:
                return why
        elif part.dtype != x.dtype or part.stride(-1) != 1:
            return f"dense cache {part.dtype} (steps: {x.dtype}, contiguous heads)"
    return None


def _qkv_refusal(x, w, attn, store, n_like) -> str | None:
    """Why the portable Q/K/V step cannot take this layer (None: it can)."""
    from ..kernels.products import qmatmul

    cfg = attn.cfg
    why = _cache_refusal(x, store, n_like)
    if why is not None:
        return why
    why = qmatmul.gemv_unsupported_reason(x, w)
    if why is not None:
        return why
    D = cfg.head_dim
    if D & (D - 1):
        return f"head dim {D} is not a power of two"
    return None


def _w(norm):
    return None if norm is None else norm.weight


def _joint_norms(model, i: int, which: str):
    """(post norm, next norm) modules of layer i's joint after the attention ("attn") or
    after the MLP ("mlp"): the next norm after the MLP is the next layer's input norm, or
    the final norm after the last layer."""
    layer = model.model.layers[i]
    if which == "attn":
        if layer.sandwich:
            return layer.post_attention_layernorm, layer.pre_feedforward_layernorm
        return None, layer.post_attention_layernorm
    layers = model.model.layers
    nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
    return (layer.post_feedforward_layernorm if layer.sandwich else None), nxt


def sites(model, i: int, prefix: str, order: list) -> dict[str, Site]:
    """Layer i's fused steps as plan sites (their choices made at the first call, which
    `refusal` has admitted). They hold the layer's modules, never the model (which holds
    its plans)."""
    cfg = model.config
    layer = model.model.layers[i]
    attn, mlp = layer.self_attn, layer.mlp
    eps, offset = cfg.rms_norm_eps, cfg.norm_unit_offset
    q_norm, k_norm = attn.qk_norms()
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)

    held = held_stacks(layer)

    def qkv(x, *rest):
        bias = None if projs[0].bias is None else torch.cat([p.bias for p in projs])
        weight = held[0] if held is not None else stacked_qkv(attn)
        return choose.choose_qkv_step(x, weight, bias, *heads, q_norm, k_norm, eps, offset)

    def joint(linear, which):
        post, nxt = (_w(m) for m in _joint_norms(model, i, which))
        return lambda x, r: choose.choose_joint_step(linear.effective_weight(), linear.bias,
                                                     post, nxt, eps, offset)

    def gate_up(x):
        if held is not None:
            return choose.choose_gate_up_step(held[1], None, mlp.act)
        return choose.choose_gate_up_step(mlp.gate_proj.quantized(), mlp.up_proj.quantized(),
                                          mlp.act)

    return {
        "qkv_step": Site(f"{prefix}.qkv_step", "q/k/v + norms + rope + kv append", qkv, order),
        "o_step": Site(f"{prefix}.o_step", "o_proj + residual joint",
                       joint(attn.o_proj, "attn"), order),
        "gate_up_step": Site(f"{prefix}.gate_up_step", "gate/up + activation", gate_up, order),
        "down_step": Site(f"{prefix}.down_step", "down_proj + residual joint + next norm",
                          joint(mlp.down_proj, "mlp"), order),
    }


def choose_layers(model, plan, h, positions, cache, indices, hidden_states=None):
    """The decode plan's choice for its layers: the fused steps, or (with the reason) the
    layer-by-layer sites. Either runs (model, plan, h, positions, cache, indices,
    hidden_states) → the last layer's output after the final norm."""
    why = refusal(model, h, cache)
    if why is None:
        return choose.Choice("fused_steps", "every layer in five launches", decode_layers)
    # the class's function, not the bound method: a plan must not hold its model
    return choose.Choice("layer_sites", f"layer by layer ({why})", type(model).decode_layers)


def decode_layers(model, plan, h, positions, cache, indices, hidden_states=None):
    """Every layer's decode step as fused steps: h [B, 1, H] (the embedded tokens) → the
    last layer's output normed by the final norm, [B, 1, H]."""
    B = h.shape[0]
    n = plan.layers[0]["input_norm"](h)  # the first layer's; the others come fused
    tables: dict = {}
    for layer, s in zip(model.model.layers, plan.layers):
        cos, sin = layer.self_attn.rotary_tables(h, positions, tables)
        store = cache.layers[layer.self_attn.layer]
        slots, attended, window, table = store.step_args(indices)
        q = s["qkv_step"](n.reshape(B, -1), cos, sin, store.k, store.v, slots, table)
        out = s["attention"](q, store.k, store.v, attended, window, table)
        h_mid, n = s["o_step"](out.reshape(B, -1), h.reshape(B, -1))
        h, n = s["down_step"](s["gate_up_step"](n), h_mid)
        h, n = h.reshape(B, 1, -1), n.reshape(B, 1, -1)
        if hidden_states is not None:
            hidden_states.append(h)
    return n


def gpu_refusal(device: torch.device) -> str | None:
    """Why the steps do not run on ``device`` by default (None: they may): on a GPU only
    where asked, until measured faster (`DEFAULT_ON_CUDA`)."""
    return choose.unmeasured_on_gpu("fused_steps", device, DEFAULT_ON_CUDA,
                                    " at every row count")


def row_limit(model) -> int:
    """The most rows the steps take for ``model``: the gate/up GEMV's over MLX-layout
    weights, the fragment steps' over held ones."""
    from ..kernels.products import qmatmul
    from ..kernels.steps import fragment_steps

    if model.model.layers[0].self_attn.q_proj.held is not None:
        return fragment_steps.MAX_ROWS
    return qmatmul.MAX_ROWS


def rows_admitted(model, rows: int) -> bool:
    """The part of `refusal` that depends on the row count alone (the rest holds for every
    batch size of one model and cache): whether ``rows`` rows may take the steps. Two
    batch sizes that differ here decode through different paths, so their rows' bits may
    differ (`Decoder.product_kernels`)."""
    return 1 <= rows <= row_limit(model)
