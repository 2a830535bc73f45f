"""The runtime on the GPU: fast tier against compat on a tiny random model, and the
CUDA-graph decode step against eager decode."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qfuse import levers
from qfuse.cache import KVCache
from qfuse.generation import GraphedDecode
from qfuse.loading import load_model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=16,
        query_pre_attn_scalar=64, max_position_embeddings=256)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float()
    path = tmp_path_factory.mktemp("gemma")
    hf.save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("kv_bits", [0, 4, 8])
def test_graph_decode_equals_eager(gemma, kv_bits, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    model = load_model(gemma, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 512, (2, 40), device="cuda")
    lengths = torch.tensor([40, 23], device="cuda")
    outs = []
    for graphed in (False, True):
        cache = KVCache(model.config, 2, 64, torch.bfloat16, "cuda", kv_bits)
        with torch.no_grad():
            model(ids, lengths, cache)
            step = GraphedDecode(model, cache, 2) if graphed else (
                lambda t, c=cache: model.decode(t, c))
            tok = ids[:, 0]
            logits = []
            for _ in range(6):
                out = step(tok)
                logits.append(out.clone())
                tok = out.argmax(-1)
        outs.append(torch.stack(logits))
    assert torch.equal(outs[0], outs[1])
    assert levers.counters().get("decode_attention", 0) > 0


def test_fast_tier_close_to_compat(gemma, monkeypatch):
    model = load_model(gemma, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 512, (1, 30), device="cuda")
    res = {}
    for tier in ("compat", "fast"):
        monkeypatch.setenv("QFUSE_TIER", tier)
        cache = KVCache(model.config, 1, 48, torch.bfloat16, "cuda", 4)
        with torch.no_grad():
            model(ids, cache=cache)
            res[tier] = torch.stack([model.decode(ids[:, i], cache) for i in range(8)]).float()
    p = torch.log_softmax(res["compat"], -1)
    kl = (p.exp() * (p - torch.log_softmax(res["fast"], -1))).sum(-1)
    assert kl.mean().item() <= 1e-3  # the fast-tier gate target


@pytest.mark.parametrize("tier", ["compat", "fast"])
def test_quantized_model_runs_on_cuda(gemma, tier, monkeypatch):
    """A 4-bit model (quantized embedding included: CUDA cannot gather uint32) on the
    GPU gives the logits it gives on the CPU, to bf16 accuracy."""
    from qfuse.convert import quantize_model

    monkeypatch.setenv("QFUSE_TIER", tier)
    ids = torch.randint(0, 512, (1, 20))
    with torch.no_grad():
        cpu = quantize_model(load_model(gemma), 4, 64)(ids)
        gpu = quantize_model(load_model(gemma, dtype=torch.bfloat16, device="cuda"), 4, 64)(
            ids.cuda()).float().cpu()
    assert torch.isfinite(gpu).all()
    p = torch.log_softmax(cpu, -1)
    kl = (p.exp() * (p - torch.log_softmax(gpu, -1))).sum(-1)
    assert kl.mean().item() <= 1e-2  # bf16 end to end against float32
