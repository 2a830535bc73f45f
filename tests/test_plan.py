"""The decode plan: once a step has run, later steps read no lever from the environment,
ask no kernel whether it supports its inputs and choose no kernel; the dispatch counters
still say which path ran, and a lever changed through `levers` gives a new plan."""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

import pytest
import torch

from qfuse import choose, levers
from qfuse.convert import quantize_model
from qfuse.models.config import ModelConfig
from qfuse.models.decoder import Decoder
from qfuse.runtime.cache import KVCache

STEPS = 3
# Gemma 3's sites (q/k norms, sandwich joints, sliding and full layers), two layers small
# enough for Triton's interpreter.
CONFIG = {"model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 64, "sliding_window": 8,
          "layer_types": ["sliding_attention", "full_attention"]}


def _model(bits: int = 4) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(ModelConfig.from_dict(CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model = model.to(_device(), torch.float16)
    return quantize_model(model, bits, 64) if bits else model


def _device() -> str:
    """Where the fast tier's kernels run: the GPU, else the CPU under the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class _CountingEnviron(MutableMapping):
    """os.environ, counting reads of the variables qfuse's levers are made of."""

    def __init__(self, real):
        self.real, self.reads = real, 0

    def _note(self, key):
        if isinstance(key, str) and (key.startswith("QFUSE_") or key == "TRITON_INTERPRET"):
            self.reads += 1

    def __getitem__(self, key):
        self._note(key)
        return self.real[key]

    def get(self, key, default=None):
        self._note(key)
        return self.real.get(key, default)

    def __contains__(self, key):
        self._note(key)
        return key in self.real

    def __setitem__(self, key, value):
        self.real[key] = value

    def __delitem__(self, key):
        del self.real[key]

    def __iter__(self):
        return iter(self.real)

    def __len__(self):
        return len(self.real)


def _is_decision(name: str) -> bool:
    """Support checks (`*_reason`) and choices (`choose_*`, `refusal`, `admitted`, routes,
    the ring's shape rule) of qfuse's dispatch and kernels."""
    return (name.endswith("_reason") or name.startswith("choose_") or name in (
        "refusal", "admitted", "use_kernel", "fragment_route", "preferred", "choose_path",
        "holds_fragments", "tier", "kernel_enabled"))


@pytest.fixture
def decisions(monkeypatch):
    """Counts the calls of every decision function, by every name a qfuse module binds it
    to (a `from x import f as g` too)."""
    calls: dict[str, int] = {}
    wrapped: dict[int, object] = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("qfuse") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            if not callable(value) or not _is_decision(getattr(value, "__name__", "")) \
                    or not getattr(value, "__module__", "").startswith("qfuse"):
                continue
            if id(value) not in wrapped:
                def counted(*args, _f=value, **kwargs):
                    calls[_f.__qualname__] = calls.get(_f.__qualname__, 0) + 1
                    return _f(*args, **kwargs)
                wrapped[id(value)] = counted
            monkeypatch.setattr(mod, attr, wrapped[id(value)])
    return calls


def _steps(model, cache, tokens, n):
    with torch.no_grad():
        for _ in range(n):
            tokens = model.decode(tokens, cache).argmax(-1)
    return tokens


@pytest.mark.parametrize("tier,fused", [("compat", "1"), ("fast", "1"), ("fast", "0")])
def test_after_the_first_step_nothing_is_decided(tier, fused, decisions, monkeypatch):
    """In compat, and in the fast tier both as fused steps and layer by layer."""
    monkeypatch.setenv("QFUSE_TIER", tier)
    monkeypatch.setenv("QFUSE_FUSED_STEPS", fused)
    levers.reload()
    model = _model()
    cache = KVCache(model.config, 2, 16, model.dtype, _device(), 4, 64)
    prompt = torch.tensor([[5, 6, 7], [8, 9, 10]], device=_device())
    with torch.no_grad():
        tokens = model(prompt, cache=cache, logits="last").argmax(-1)
    tokens = _steps(model, cache, tokens, 1)  # the decode plan's choices are made here
    assert decisions, "the fixture counts nothing: the decision functions moved"

    environ = _CountingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", environ)
    decisions.clear()
    levers.reset_counters()
    _steps(model, cache, tokens, STEPS)

    assert environ.reads == 0
    assert decisions == {}
    counts = levers.counters()
    layers = model.config.num_hidden_layers
    if tier == "compat":
        assert counts["ref:decode_attention"] == STEPS * layers
        assert not any(k for k in counts if not k.startswith("ref:"))
    elif fused == "1":  # four fused launches a layer, the attention, the first norm
        assert counts["decode_attention"] == STEPS * layers
        assert counts["fused_steps"] == 4 * STEPS * layers
        assert counts["rms_norm"] == STEPS and "kv_append" not in counts
    else:  # on the GPU, or under the interpreter on a CPU: the kernels that take fp16
        assert counts["decode_attention"] == STEPS * layers
        assert counts["kv_append"] == 2 * STEPS * layers
        assert counts["rms_norm"] > 0 and counts["rope"] > 0


def test_the_plan_lists_each_site_with_its_kernel_and_reason(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    levers.reload()
    model = _model(bits=0)
    plan = model.decode_plan(rows=1, kv_bits=4)
    names = [s.name for s in plan.sites]
    layers = model.config.num_hidden_layers
    for i in range(layers):
        for site in ("input_norm", "self_attn.qkv", "self_attn.attention", "mlp"):
            assert f"layers.{i}.{site}" in names
    assert names[-2:] == ["norm", "head"]
    by_name = {s.name: s.choice for s in plan.sites}
    assert by_name["layers.0.self_attn.attention"].kernel == "decode_attention"
    assert by_name["layers.0.self_attn.append_k"].kernel == "kv_append"
    assert all(s.choice.reason for s in plan.sites)
    assert len(plan.describe()) == len(plan.sites)


def test_a_lever_changed_through_levers_makes_a_new_plan():
    model = _model(bits=0)
    with levers.use_tier("fast"):
        fast = model.decode_plan(rows=1, kv_bits=4)
        with levers.setting("QFUSE_DECODE_ATTENTION", "0"):
            off = model.decode_plan(rows=1, kv_bits=4)
    with levers.use_tier("compat"):
        compat = model.decode_plan(rows=1, kv_bits=4)
    attention = "layers.0.self_attn.attention"
    kernel = {name: {s.name: s.choice.kernel for s in p.sites}[attention]
              for name, p in (("fast", fast), ("off", off), ("compat", compat))}
    assert kernel == {"fast": "decode_attention", "off": "reference", "compat": "reference"}
    reason = {s.name: s.choice.reason for s in off.sites}[attention]
    assert "QFUSE_DECODE_ATTENTION" in reason


def test_a_choice_runs_what_the_per_call_op_runs():
    """ops.rms_norm is choose_rms_norm's choice, run: one rule, not two."""
    x, w = torch.randn(3, 64), torch.randn(64)
    with levers.use_tier("compat"):
        c = choose.choose_rms_norm(x, w, 1e-6)
        assert c.kernel == "reference"
        from qfuse import ops

        assert torch.equal(c(x), ops.rms_norm(x, w, 1e-6))


def test_a_copied_or_reloaded_model_plans_anew():
    """Kept choices bind weights: a deep copy, new tensors assigned or a move must not
    run the old ones."""
    import copy

    model = _model(bits=0)
    ids = torch.tensor([[3, 4, 5]], device=_device())
    with torch.no_grad():
        before = model(ids)
        twin = copy.deepcopy(model)
        for p in twin.parameters():
            p.add_(0.1)
        assert not torch.equal(twin(ids), before)
        state = {k: v + 0.1 for k, v in model.state_dict().items()}
        model.load_state_dict(state, assign=True)
        assert torch.equal(model(ids), twin(ids))


def test_with_gradients_each_mlp_op_is_chosen_from_the_real_tensors():
    """A quantized MLP whose input needs a gradient keeps autograd's graph: the products
    and the activation are chosen from the call's own tensors, not from placeholders."""
    from qfuse import ops
    from qfuse.quant import QuantizedTensor, quantize

    torch.manual_seed(0)
    H, I = 64, 128
    ws = [torch.randn(n, k) for n, k in ((I, H), (I, H), (H, I))]
    gate, up, down = (QuantizedTensor(*quantize(w, 64, 4), 64, 4) for w in ws)
    x = torch.randn(2, H, requires_grad=True)
    with levers.use_tier("fast"):
        levers.reset_counters()
        y = ops.mlp(x, gate, up, down, "silu")
    assert y.requires_grad
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    counts = levers.counters()
    assert counts.get("ref:linear") == 3 and "qmatmul" not in counts


@pytest.mark.parametrize("tier,fused", [("compat", "0"), ("fast", "0"), ("fast", "1")])
def test_a_deleted_model_is_freed_without_the_garbage_collector(tier, fused, monkeypatch):
    """A model holds its plans; they must not hold it, its modules or its weights back (a
    cycle keeps a GPU's weights until the next collection: measured as 6.7 GB still held
    after `del model`, then as a dropped model's 24 GB while the next one was timed)."""
    import gc
    import weakref

    monkeypatch.setenv("QFUSE_FUSED_STEPS", fused)
    levers.reload()
    model = _model()
    cache = KVCache(model.config, 1, 8, torch.float16, _device(), 4, 64)
    with levers.use_tier(tier), torch.no_grad():
        model(torch.zeros(1, 1, dtype=torch.int64, device=_device()), cache=cache,
              logits="none")
        model.decode(torch.zeros(1, dtype=torch.int64, device=_device()), cache)
    assert len(list(model.plans)) == 2
    layer = model.model.layers[0]
    held = {"model": model, "o_proj": layer.self_attn.o_proj, "mlp": layer.mlp,
            "head weight": model.model.embed_tokens.effective_weight()}
    alive = {name: weakref.ref(obj) for name, obj in held.items()}
    del cache, layer, held
    gc.disable()
    try:
        del model
        assert [name for name, ref in alive.items() if ref() is not None] == []
    finally:
        gc.enable()


def _holders(obj, depth: int = 3) -> str:
    """What holds ``obj``, a few referrers deep (the message of a failed freeing)."""
    import gc
    import types

    lines, frontier = [], [obj]
    for level in range(depth):
        nxt = []
        for o in frontier:
            for r in gc.get_referrers(o):
                if isinstance(r, types.FrameType) or r is frontier or r is nxt:
                    continue
                lines.append(f"{'  ' * level}{type(r).__name__}: {repr(r)[:120]}")
                nxt.append(r)
        frontier = nxt[:8]
    return "\n".join(lines[:40])


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [0, 4], ids=["bf16", "4-bit"])
def test_gpu_a_model_decoded_under_graphs_is_freed_without_the_collector(bits):
    """The fast tier's held weights, its plans and a graphed decode step must not hold
    the model in a cycle (seen on an H100: a dropped model's weights held until the next
    collection, while the next model was timed)."""
    import gc
    import weakref

    from qfuse.bench.e2e import random_model
    from qfuse.runtime.slotted_graphs import GraphedDecode

    model = random_model(CONFIG, bits, "cuda")  # held as a loaded model's weights are
    with levers.use_tier("fast"), torch.no_grad():
        cache = KVCache(model.config, 1, 16, torch.bfloat16, "cuda", 4, 64)
        model(torch.zeros(1, 1, dtype=torch.int64, device="cuda"), cache=cache, logits="none")
        step = GraphedDecode(model, cache, 1)
        step(torch.zeros(1, dtype=torch.int64, device="cuda"))
        torch.cuda.synchronize()
    del step, cache
    held = {"model": model, "o_proj": model.model.layers[0].self_attn.o_proj,
            "head weight": model.model.embed_tokens.effective_weight()}
    alive = {name: weakref.ref(obj) for name, obj in held.items()}
    del held
    gc.collect()
    gc.disable()
    try:
        del model
        kept = {name: ref() for name, ref in alive.items() if ref() is not None}
        assert not kept, "\n".join(f"{name}:\n{_holders(obj)}" for name, obj in kept.items())
    finally:
        gc.enable()
