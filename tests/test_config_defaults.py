"""config.json fields that HF fills from family defaults: qfuse fills them the same way."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qfuse.loading import load_model
from qfuse.models import ModelConfig

COMMON = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "max_position_embeddings": 256}


def _save_then_drop(cfg, path, *keys):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    hf.save_pretrained(path, safe_serialization=True)
    raw = json.loads((path / "config.json").read_text())
    for k in keys:
        raw.pop(k, None)
    (path / "config.json").write_text(json.dumps(raw))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    return hf


def test_gemma2_query_pre_attn_scalar_defaults_to_256(tmp_path):
    """HF: absent query_pre_attn_scalar -> 256 (Gemma2Config default); qfuse uses head_dim."""
    hf = _save_then_drop(transformers.Gemma2Config(**COMMON, sliding_window=8), tmp_path,
                         "query_pre_attn_scalar")
    model = load_model(tmp_path)
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4


def test_gemma_sliding_window_defaults_to_4096(tmp_path):
    """HF: absent sliding_window -> 4096; qfuse raises ValueError on a valid config."""
    hf = _save_then_drop(transformers.Gemma3TextConfig(**COMMON, query_pre_attn_scalar=16),
                         tmp_path, "sliding_window")
    model = load_model(tmp_path)
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4


def test_nested_gemma3_config_keeps_top_level_eos():
    """model_type 'gemma3' with text_config: eos_token_id lives at the top level
    ([1, 106] on the Hub); qfuse drops it, so generation never stops on EOS."""
    raw = {"model_type": "gemma3", "eos_token_id": [1, 106],
           "text_config": {"model_type": "gemma3_text", **COMMON, "sliding_window": 8}}
    assert ModelConfig.from_dict(raw).eos_token_ids == (1, 106)


def test_nested_gemma3_sparse_text_config_loads():
    """google/gemma-3-4b-it's text_config names only a few fields and relies on
    Gemma3TextConfig defaults (heads, head_dim, vocab ...); qfuse refuses it."""
    raw = {"model_type": "gemma3", "eos_token_id": [1, 106],
           "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
                           "intermediate_size": 10240, "num_hidden_layers": 34,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024}}
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.num_attention_heads, cfg.head_dim, cfg.vocab_size) == (8, 256, 262208)


def test_unsupported_model_type_is_named_before_missing_fields():
    from qfuse.models.config import ConfigError

    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        ModelConfig.from_dict({"model_type": "gpt2", "n_embd": 768})
    with pytest.raises(ConfigError, match="required field 'model_type' is missing"):
        ModelConfig.from_dict({"hidden_size": 8})
