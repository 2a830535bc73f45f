"""Independent oracle: qfuse's compat forward of a tiny random model of each family,
saved by Hugging Face transformers as safetensors and loaded by qfuse, matches
transformers' float32 logits on CPU within 1e-4, over a prompt that crosses the
sliding window. Also prefill + cached decode against the full forward.

Phi-3 (fused qkv_proj/gate_up_proj, split as qfuse loads them) runs plain and with
LongRoPE. HF picks LongRoPE's long factors for a pass whose sequence is longer than
original_max_position_embeddings: ORIGINAL < PROMPT, so the shared tests run the long
factors, and `test_longrope_short_and_long_factors` runs both sides of the boundary."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qfuse.loading import load_model
from qfuse.runtime.cache import KVCache

WINDOW = 5
PROMPT = 13  # > WINDOW: sliding layers must drop the oldest tokens

COMMON = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-6}


ORIGINAL = 8  # LongRoPE's original_max_position_embeddings: < PROMPT - 4
HALF = COMMON["head_dim"] // 2


def longrope():
    g = torch.Generator().manual_seed(1)
    short, long = (1 + torch.rand(HALF, generator=g) * k for k in (0.5, 8.0))
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short.tolist(),
            "long_factor": long.tolist(), "original_max_position_embeddings": ORIGINAL}


def hf_configs():
    c = transformers
    return {
        "llama": c.LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "mistral": c.MistralConfig(**COMMON, sliding_window=WINDOW),
        "mistral_no_window": c.MistralConfig(**COMMON, sliding_window=None),
        "phi3": c.Phi3Config(**COMMON, pad_token_id=0, eos_token_id=2),
        "phi3_longrope": c.Phi3Config(**COMMON, pad_token_id=0, eos_token_id=2, sliding_window=WINDOW,
                                      original_max_position_embeddings=ORIGINAL,
                                      rope_parameters=longrope()),
        "qwen2": c.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW,
                               max_window_layers=2),
        "qwen3": c.Qwen3Config(**COMMON),
        "gemma2": c.Gemma2Config(**COMMON, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        "gemma3_text": c.Gemma3TextConfig(**COMMON, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                          layer_types=["sliding_attention", "sliding_attention",
                                                       "full_attention", "sliding_attention"],
                                          rope_parameters={
                                              "full_attention": {"rope_type": "linear",
                                                                 "factor": 8.0,
                                                                 "rope_theta": 1e6},
                                              "sliding_attention": {"rope_type": "default",
                                                                    "rope_theta": 1e4}}),
    }


def save_hf(family: str, path):
    """A tiny random transformers model of ``family`` saved at ``path``; returns it."""
    torch.manual_seed(0)
    cfg = hf_configs()[family]
    cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    with torch.no_grad():  # norms start at 0 or 1: make them matter
        for name, p in hf.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.eval()
    hf.save_pretrained(path, safe_serialization=True)
    return hf


@pytest.fixture(scope="module", params=list(hf_configs()))
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, save_hf(request.param, path), path


def test_compat_forward_matches_transformers(saved):
    family, hf, path = saved
    model = load_model(path)
    ids = torch.randint(0, 128, (2, PROMPT))
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids)
    assert (out - ref).abs().max().item() <= 1e-4, family


def test_prefill_then_decode_matches_full_forward(saved):
    """Right-padded prompts of different lengths, then cached decode steps."""
    family, _hf, path = saved
    model = load_model(path)
    ids = torch.randint(0, 128, (2, PROMPT + 4))
    lengths = torch.tensor([PROMPT, PROMPT - 4])
    cache = KVCache(model.config, 2, max_tokens=PROMPT + 4, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        model(ids[:, :PROMPT], lengths, cache)
        for step in range(4):
            tok = ids[torch.arange(2), lengths + step]
            logits = model.decode(tok, cache)
            for b in range(2):
                full = model(ids[b:b + 1, : int(lengths[b]) + step + 1])[0, -1]
                assert (logits[b] - full).abs().max().item() <= 1e-4, (family, step, b)


def test_fast_tier_prefill_uses_sdpa_and_agrees(saved, monkeypatch):
    from qfuse import levers

    family, _hf, path = saved
    model = load_model(path)
    ids = torch.randint(0, 128, (2, PROMPT))
    lengths = torch.tensor([PROMPT, PROMPT - 3])
    with torch.no_grad():
        ref = model(ids, lengths)
        monkeypatch.setenv("QFUSE_TIER", "fast")
        levers.reload()  # the model has planned this shape under compat
        levers.reset_counters()
        out = model(ids, lengths)
    counts = levers.counters()
    if model.config.attn_logit_softcapping is None:
        assert counts.get("prefill_sdpa") == model.config.num_hidden_layers
    else:
        assert "prefill_sdpa" not in counts
    for b, L in enumerate(lengths.tolist()):
        assert (out[b, :L] - ref[b, :L]).abs().max().item() <= 1e-4, family


@pytest.mark.parametrize("length", [ORIGINAL, ORIGINAL + 1, 3 * ORIGINAL])
def test_longrope_short_and_long_factors(tmp_path, length):
    """Phi-3 with LongRoPE at, and past, original_max_position_embeddings: the short
    factors up to it, the long ones past it, as transformers picks them by length."""
    hf = save_hf("phi3_longrope", tmp_path)
    model = load_model(tmp_path)
    rope = model.config.rope["full_attention"]
    assert rope.rope_type == "longrope" and rope.attention_factor > 1  # 256 / 8: scaled
    ids = torch.randint(0, 128, (1, length))
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids)
    assert (out - ref).abs().max().item() <= 1e-4


def test_longrope_rows_pick_their_own_factors(tmp_path):
    """A right-padded batch: each row's logits are those of the row alone, the short
    row (≤ original_max_position_embeddings) on the short factors while the long row
    is past it."""
    save_hf("phi3_longrope", tmp_path)
    model = load_model(tmp_path)
    ids = torch.randint(0, 128, (2, PROMPT))
    lengths = torch.tensor([PROMPT, ORIGINAL])
    with torch.no_grad():
        both = model(ids, lengths)
        alone = model(ids[1:, :ORIGINAL])
    assert (both[1, :ORIGINAL] - alone[0]).abs().max().item() <= 1e-5


def test_mlx_quantized_fused_checkpoint_loads_split(tmp_path):
    """A Phi-3 checkpoint quantized with its projections fused (as mlx-lm and `qfuse
    quantize` keep them) loads split: the same logits as the quantized parts stored
    apart."""
    from safetensors.torch import load_file, save_file

    from qfuse.convert import quantize_checkpoint

    path = tmp_path / "hf"
    save_hf("phi3", path)
    quantize_checkpoint(path, tmp_path / "q", bits=4, group_size=32)
    model = load_model(tmp_path / "q")
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    assert any(".qkv_proj." in n for n in tensors) and any(".gate_up_proj." in n for n in tensors)
    assert model.model.layers[0].self_attn.q_proj.bits == 4
    split = {}
    for name, t in tensors.items():
        head, _, tail = name.rpartition(".")
        prefix, _, module = head.rpartition(".")
        if module == "qkv_proj":
            sizes = [4 * 16, 2 * 16, 2 * 16]
            parts = ("q_proj", "k_proj", "v_proj")
        elif module == "gate_up_proj":
            sizes, parts = [96, 96], ("gate_proj", "up_proj")
        else:
            split[name] = t
            continue
        for part, rows in zip(parts, t.split(sizes)):
            split[f"{prefix}.{part}.{tail}"] = rows.contiguous()
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "config.json").write_bytes((tmp_path / "q" / "config.json").read_bytes())
    save_file(split, tmp_path / "s" / "model.safetensors")
    ids = torch.randint(0, 128, (2, PROMPT))
    with torch.no_grad():
        assert torch.equal(model(ids), load_model(tmp_path / "s")(ids))


def test_fused_tensor_of_wrong_rows_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from qfuse.loading import CheckpointError

    path = tmp_path / "hf"
    save_hf("phi3", path)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16]
    (tmp_path / "bad").mkdir()
    save_file(tensors, tmp_path / "bad" / "model.safetensors")
    (tmp_path / "bad" / "config.json").write_bytes((path / "config.json").read_bytes())
    with pytest.raises(CheckpointError, match="qkv_proj.weight.*implies 128 rows"):
        load_model(tmp_path / "bad")
