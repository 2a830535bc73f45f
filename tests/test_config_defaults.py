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


@pytest.mark.parametrize("family,hf_class", [("mistral", "MistralConfig"), ("phi3", "Phi3Config")])
def test_mistral_and_phi3_defaults_are_hf_config_defaults(family, hf_class):
    """Fields a Mistral or Phi-3 config.json may leave out take the HF config class's
    defaults (Mistral's window of 4096, Phi-3's eps of 1e-5, ...)."""
    hf = getattr(transformers, hf_class)()
    sizes = {k: v for k, v in COMMON.items() if k != "max_position_embeddings"}
    cfg = ModelConfig.from_dict({"model_type": family, **sizes})
    assert cfg.sliding_window == hf.sliding_window
    assert cfg.layer_types == (("sliding_attention",) * 2 if hf.sliding_window
                               else ("full_attention",) * 2)
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.eos_token_ids == (hf.eos_token_id,) and cfg.bos_token_id == hf.bos_token_id


def test_mistral_null_sliding_window_attends_everything():
    """Mistral 7B v0.2+ write "sliding_window": null: every layer attends the whole context."""
    cfg = ModelConfig.from_dict({"model_type": "mistral", **COMMON, "sliding_window": None})
    assert cfg.sliding_window is None and set(cfg.layer_types) == {"full_attention"}


def _phi3_longrope_raw(rope_type: str) -> dict:
    """A Phi-3-mini-128k-style config.json: the old rope_scaling block without a factor,
    original_max_position_embeddings at the top level."""
    half = COMMON["head_dim"] // 2
    return {"model_type": "phi3", **COMMON, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
            "rope_scaling": {"type": rope_type,
                             "short_factor": [1.0 + 0.05 * i for i in range(half)],
                             "long_factor": [1.0 + 3.0 * i for i in range(half)]}}


@pytest.mark.parametrize("rope_type", ["longrope", "su"])
def test_phi3_longrope_matches_transformers_parameters(rope_type):
    """LongRoPE's short and long inverse frequencies and its cos/sin scale are those of
    transformers' longrope RoPE for the same config.json."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from qfuse.models.decoder import rope_inv_freq

    raw = _phi3_longrope_raw(rope_type)
    hf = transformers.Phi3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    init = ROPE_INIT_FUNCTIONS["longrope"]
    short, scale = init(hf, "cpu")
    long, _ = init(hf, "cpu", seq_len=4097)
    rope = ModelConfig.from_dict(raw).rope["full_attention"]
    assert rope.rope_type == "longrope" and rope.original_max_position_embeddings == 4096
    assert rope.attention_factor == pytest.approx(scale, rel=1e-12) and scale > 1
    assert torch.equal(rope_inv_freq(rope, COMMON["head_dim"]), short)
    assert torch.equal(rope_inv_freq(rope, COMMON["head_dim"], long=True), long)


@pytest.mark.parametrize("where", ["top", "rope_scaling"])
def test_partial_rotary_factor_is_refused_by_name(where):
    """Phi-4-mini rotates 3/4 of each head; qfuse rotates whole heads and says so."""
    from qfuse.models.config import ConfigError

    raw = {"model_type": "phi3", **COMMON}
    if where == "top":
        raw["partial_rotary_factor"] = 0.75
    else:
        raw["rope_scaling"] = {"rope_type": "default", "partial_rotary_factor": 0.75}
    with pytest.raises(ConfigError, match="partial_rotary_factor 0.75 is not supported"):
        ModelConfig.from_dict(raw)
    raw.pop("partial_rotary_factor", None)
    raw.pop("rope_scaling", None)
    ModelConfig.from_dict({**raw, "partial_rotary_factor": 1.0})  # whole heads: fine


def test_longrope_factors_of_the_wrong_length_are_named():
    from qfuse.models.config import ConfigError

    raw = _phi3_longrope_raw("longrope")
    raw["rope_scaling"]["long_factor"] = raw["rope_scaling"]["long_factor"][:-1]
    with pytest.raises(ConfigError, match="long_factor must be a list of 8 numbers"):
        ModelConfig.from_dict(raw)
