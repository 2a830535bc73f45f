"""The decode prologue in one launch (q/k norms, RoPE, KV append) against the separate
kernels it replaces: q and every cache byte bitwise equal, for dense and 4/8-bit caches,
with and without norms (Llama and Gemma forms), several head tiles, ring slots; the
dispatch rule (off by default; each replaced op's lever respected); on the GPU, bf16 and
CUDA-graph replay."""

import pytest
import torch

from qfuse import levers, ops, reference
from qfuse.quant import QuantizedTensor
from qfuse.testing import kernel_device

from .conftest import save_tiny_gemma

pytest.importorskip("triton")
DEVICE = kernel_device()
gpu = pytest.mark.gpu


def make_step(B, Hq, Hkv, D, N, bits, dtype, device, norm, seed=0, group_size=64):
    """Product rows q, k, v [B, 1, H·D] (views of one stacked row, as the model has them),
    norm weights, cos/sin [B, 1, D], two pairs of identical caches and slots."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    fused = torch.randn(B, 1, (Hq + 2 * Hkv) * D, generator=g).mul(3).to(dtype).to(device)
    q, k, v = fused.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    weights = None
    if norm:
        weights = tuple((torch.rand(D, generator=g) + 0.5).to(dtype).to(device) for _ in range(2))
    positions = torch.randint(0, 5000, (B, 1), generator=g).to(device)
    cos, sin = reference.rope_cos_sin(positions, reference.rope_inv_freq(D, 1e4, device), dtype)

    def caches():
        dense = torch.randn(B, Hkv, N, D, generator=torch.Generator().manual_seed(seed + 1))
        dense = dense.to(dtype).to(device)
        if bits:
            return [QuantizedTensor.from_float(dense, group_size, bits) for _ in range(2)]
        return [dense.clone(), dense.clone()]

    slots = torch.randint(0, N, (B,), generator=g, dtype=torch.int32).to(device)
    return q, k, v, weights, cos, sin, caches(), caches(), slots


def separate(q, k, v, weights, cos, sin, k_cache, v_cache, slots, unit_offset):
    """The ops the fused kernel replaces, each through its own kernel."""
    B, D = q.shape[0], k_cache.shape[-1]
    qh, kh, vh = (t.view(B, 1, -1, D).transpose(1, 2) for t in (q, k, v))
    if weights is not None:
        qh = ops.rms_norm(qh, weights[0], 1e-6, unit_offset)
        kh = ops.rms_norm(kh, weights[1], 1e-6, unit_offset)
    qh, kh = ops.apply_rotary(qh, cos, sin), ops.apply_rotary(kh, cos, sin)
    ops.kv_append(kh[:, :, 0], slots, k_cache, positions_checked=True)
    ops.kv_append(vh[:, :, 0], slots, v_cache, positions_checked=True)
    return qh


def fused(q, k, v, weights, cos, sin, k_cache, v_cache, slots, unit_offset):
    return ops.qkv_prologue(q, k, v, *(weights or (None, None)), 1e-6, unit_offset, cos, sin,
                            k_cache, v_cache, slots)


def same_cache(a, b):
    if isinstance(a, QuantizedTensor):
        return (torch.equal(a.packed.view(torch.int32), b.packed.view(torch.int32))
                and torch.equal(a.scales, b.scales) and torch.equal(a.biases, b.biases))
    return torch.equal(a, b)


def check_equal(case, unit_offset, device, monkeypatch):
    q, k, v, weights, cos, sin, (k1, k2), (v1, v2), slots = case
    monkeypatch.setenv("QFUSE_TIER", "fast")
    with torch.no_grad():
        want = fused(q, k, v, weights, cos, sin, k1, v1, slots, unit_offset)
        # off by default: the separate kernels ran
        apart = {"rope": 2, "kv_append": 2 if isinstance(k1, QuantizedTensor) else 0}
        apart["rms_norm"] = 2 if weights is not None else 0
        assert {name: levers.counters().get(name, 0) for name in apart} == apart
        assert "qkv_prologue" not in levers.counters()
        monkeypatch.setenv("QFUSE_QKV_PROLOGUE", "1")
        levers.reset_counters()
        got = fused(q, k, v, weights, cos, sin, k2, v2, slots, unit_offset)
    assert levers.counters() == {"qkv_prologue": 1}
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.view(torch.int16) if got.dtype != torch.float32 else got,
                       want.view(torch.int16) if want.dtype != torch.float32 else want)
    assert same_cache(k1, k2) and same_cache(v1, v2)


@pytest.mark.parametrize("bits", [0, 4, 8])
@pytest.mark.parametrize("norm,unit_offset", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("B,Hq,Hkv,D", [(2, 4, 2, 64), (3, 20, 3, 256)])
def test_bitwise_equal_to_the_separate_kernels(bits, norm, unit_offset, dtype, B, Hq, Hkv, D,
                                               monkeypatch):
    """(3, 20, 3, 256): two q tiles of 16 heads, one partly empty; k and v tiles of 3."""
    case = make_step(B, Hq, Hkv, D, 40, bits, dtype, DEVICE, norm, seed=B + D + bits)
    check_equal(case, unit_offset, DEVICE, monkeypatch)


def test_writes_only_the_slot(monkeypatch):
    q, k, v, weights, cos, sin, (_, kc), (_, vc), slots = make_step(
        2, 4, 2, 64, 16, 4, torch.float16, DEVICE, True, seed=7)
    parts = [kc.packed.view(torch.int32), kc.scales, kc.biases, vc.packed.view(torch.int32),
             vc.scales, vc.biases]
    before = [t.clone() for t in parts]
    monkeypatch.setenv("QFUSE_TIER", "fast")
    monkeypatch.setenv("QFUSE_QKV_PROLOGUE", "1")
    with torch.no_grad():
        fused(q, k, v, weights, cos, sin, kc, vc, slots, False)
    keep = torch.ones(2, 16, dtype=torch.bool, device=DEVICE)
    keep[torch.arange(2), slots.long()] = False
    for new, old in zip(parts, before):
        written = ~torch.eq(new, old).permute(0, 2, 1, 3).flatten(2).all(-1)  # [B, N]
        assert not (written & keep).any()
        assert written[~keep].any()  # the slots themselves were written


@pytest.mark.parametrize("lever", ["QFUSE_ROPE", "QFUSE_RMS_NORM", "QFUSE_KV_APPEND"])
def test_a_replaced_op_turned_off_keeps_the_separate_ops(lever, monkeypatch):
    case = make_step(2, 4, 2, 64, 16, 4, torch.float16, DEVICE, True)
    q, k, v, weights, cos, sin, (k1, _), (v1, _), slots = case
    monkeypatch.setenv("QFUSE_TIER", "fast")
    monkeypatch.setenv("QFUSE_QKV_PROLOGUE", "1")
    monkeypatch.setenv(lever, "0")
    with torch.no_grad():
        fused(q, k, v, weights, cos, sin, k1, v1, slots, False)
    counts = levers.counters()
    assert "qkv_prologue" not in counts
    # the separate ops ran, the one turned off through its reference
    ran = {"QFUSE_ROPE": "apply_rotary", "QFUSE_RMS_NORM": "rms_norm",
           "QFUSE_KV_APPEND": "kv_append"}[lever]
    assert counts.get(f"ref:{ran}") == 2 and counts.get("rope", 0) + counts.get(
        "ref:apply_rotary", 0) == 2


def test_unsupported_inputs_are_named():
    from qfuse.kernels import qkv_prologue as kp

    q, k, v, _, cos, sin, (kc, _), (vc, _), slots = make_step(
        1, 4, 2, 48, 8, 0, torch.float16, "cpu", False)
    rows = [t.reshape(1, -1) for t in (q, k, v)]
    reason = kp.unsupported_reason(*rows, None, None, cos.reshape(1, -1), sin.reshape(1, -1),
                                   kc, vc, slots)
    assert "head dim 48" in reason
    with pytest.raises(ValueError, match="head dim 48"):
        kp.qkv_prologue(*rows, None, None, 1e-6, False, cos.reshape(1, -1), sin.reshape(1, -1),
                        kc, vc, slots)


@gpu
@pytest.mark.parametrize("bits", [0, 4, 8])
@pytest.mark.parametrize("shape,norm,unit_offset", [((1, 16, 8, 256), True, True),  # Gemma 3
                                                    ((8, 32, 8, 128), False, False),  # Llama 3
                                                    ((4, 32, 8, 128), True, False)])  # Qwen 3
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_bitwise_equal_to_the_separate_kernels(bits, shape, norm, unit_offset, dtype,
                                                   monkeypatch):
    case = make_step(*shape, 4096, bits, dtype, "cuda", norm, seed=bits)
    check_equal(case, unit_offset, "cuda", monkeypatch)


@gpu
def test_gpu_graph_replay_follows_the_slots(monkeypatch):
    q, k, v, weights, cos, sin, (k1, k2), (v1, v2), slots = make_step(
        2, 16, 8, 256, 512, 4, torch.bfloat16, "cuda", True)
    monkeypatch.setenv("QFUSE_TIER", "fast")
    monkeypatch.setenv("QFUSE_QKV_PROLOGUE", "1")
    with torch.no_grad():
        fused(q, k, v, weights, cos, sin, k2, v2, slots, True)  # compiles, writes a slot
        separate(q, k, v, weights, cos, sin, k1, v1, slots, True)  # the same slot in k1, v1
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused(q, k, v, weights, cos, sin, k2, v2, slots, True)
        for new in ([5, 9], [500, 0]):
            slots.copy_(torch.tensor(new, dtype=torch.int32))
            graph.replay()
            torch.cuda.synchronize()
            want = separate(q, k, v, weights, cos, sin, k1, v1, slots, True)
            assert torch.equal(out.view(torch.int16), want.view(torch.int16))
            assert same_cache(k1, k2) and same_cache(v1, v2)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A tiny random Gemma 3: q/k norms, sliding-window layers on a ring cache."""
    return save_tiny_gemma(
        tmp_path_factory.mktemp("gemma"), vocab_size=256, hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, sliding_window=8,
        max_position_embeddings=128, layer_types=["sliding_attention", "full_attention"])


def decode_logits(model, cache_args, device, steps):
    from qfuse.cache import KVCache

    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3)).to(device)
    cache = KVCache(model.config, 2, 32, *cache_args)
    with torch.no_grad():
        model(ids, torch.tensor([12, 7], device=device), cache)
        tok, logits = ids[:, 0], []
        for _ in range(steps):  # the prompts are past the window of 8: the ring wraps
            out = model.decode(tok, cache)
            logits.append(out.clone())
            tok = out.argmax(-1)
    return torch.stack(logits)


@pytest.mark.parametrize("kv_bits,device,dtype", [
    (0, DEVICE, torch.float16), (4, DEVICE, torch.float16),
    pytest.param(4, "cuda", torch.bfloat16, marks=gpu),
    pytest.param(8, "cuda", torch.bfloat16, marks=gpu)])
def test_model_decode_unchanged_by_the_fusion(gemma, kv_bits, device, dtype, monkeypatch):
    from qfuse.loading import load_model

    monkeypatch.setenv("QFUSE_TIER", "fast")
    model = load_model(gemma, dtype=dtype, device=device)
    apart = decode_logits(model, (dtype, device, kv_bits), device, 4)
    assert "qkv_prologue" not in levers.counters()
    monkeypatch.setenv("QFUSE_QKV_PROLOGUE", "1")
    levers.reset_counters()
    fused_logits = decode_logits(model, (dtype, device, kv_bits), device, 4)
    assert levers.counters()["qkv_prologue"] == 2 * 4  # layers × steps
    assert torch.equal(apart, fused_logits)
