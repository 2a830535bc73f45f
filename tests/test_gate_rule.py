"""The fast tier's KL limit scales with the configuration's own quantization cost
(`gates.kl_limit`), and the gate still fails a fast path with a real bug: a product
that drops one quantization group, or one whose biases are off by one bf16 ulp.

The "fast path" here is the reference product with the bug planted and a dispatch
counted, so the gate sees a kernel run; the other kernels are off, so the CPU runs
quickly (the interpreter is not involved)."""

import pytest
import torch

from qfuse import gates, levers, ops, reference
from qfuse.convert import quantize_model
from qfuse.loading import DEFAULT_MODEL, load_model
from qfuse.quant import QuantizedTensor

KV_BITS = 4


def test_limit_floor_and_scale():
    assert gates.kl_limit(None) == gates.KL_FLOOR == 1e-3
    assert gates.kl_limit(2e-3) == 1e-3  # cheap quantization: the floor
    assert gates.kl_limit(3.1e-2) == pytest.approx(3.1e-3)


@pytest.fixture(scope="module")
def setup():
    model = load_model(DEFAULT_MODEL, dtype=torch.float32)
    golden = gates.load_golden(DEFAULT_MODEL / "golden.json")
    # one prompt, 24 golden tokens: the CPU reference dequantizes every weight per token
    golden = {**golden, "trajectories": [{**t, "continuation": t["continuation"][:24]}
                                         for t in golden["trajectories"][:1]]}
    cost = {r["config"]: r["mean_kl"]
            for r in gates.quantization_cost(model, golden, kv_bits=(KV_BITS,), progress=False)}
    return quantize_model(model, 4, 64), golden, gates.kl_limit(
        cost[f"4-bit weights, {KV_BITS}-bit KV"])


def _drop_group(w: QuantizedTensor) -> QuantizedTensor:
    s, b = w.scales.clone(), w.biases.clone()
    s[:, 0] = 0
    b[:, 0] = 0
    return QuantizedTensor(w.packed, s, b, w.group_size, w.bits)


def _bias_one_ulp(w: QuantizedTensor) -> QuantizedTensor:
    b = w.biases.to(torch.bfloat16)
    up = torch.nextafter(b, torch.full_like(b, float("inf")))
    return QuantizedTensor(w.packed, w.scales, up.to(w.biases.dtype), w.group_size, w.bits)


def _gate(setup, monkeypatch, bug):
    qmodel, golden, limit = setup
    for k in levers.KERNELS.values():
        monkeypatch.setenv(k.env_var, "0")

    def linear(x, w, bias=None):
        if isinstance(w, QuantizedTensor) and levers.tier(x.device) == levers.Tier.FAST:
            levers.count("planted_product")
            return reference.linear(x, bug(w) if bug else w, bias)
        return reference.linear(x, w, bias)

    monkeypatch.setattr(ops, "linear", linear)
    rows = gates.run_gate(qmodel, golden, "fast", KV_BITS, 64, progress=False)
    assert gates.kernels_run(rows) == {"planted_product": gates.kernels_run(rows)["planted_product"]}
    return gates.verdict(rows, "fast", limit), max(r.mean_kl for r in rows), limit


def test_the_harness_passes_a_faithful_path(setup, monkeypatch):
    verdict, kl, _ = _gate(setup, monkeypatch, None)
    assert verdict == "PASS" and kl == 0.0


@pytest.mark.parametrize("bug", [_drop_group, _bias_one_ulp], ids=["drop-one-group", "bias-1ulp"])
def test_a_real_bug_fails(setup, monkeypatch, bug):
    verdict, kl, limit = _gate(setup, monkeypatch, bug)
    assert limit > gates.KL_FLOOR  # the scaled limit is the one in force here
    print(f"{bug.__name__}: worst mean KL {kl:.2e}, limit {limit:.2e}")
    assert verdict == "FAIL", (kl, limit)
