"""MLX-quantized checkpoint variants that mlx-lm loads: qfuse loads them too."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from qfuse.convert import quantize_checkpoint
from qfuse.loading import load_model


def _hf(path, tie=False):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64, tie_word_embeddings=tie)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path)
    return path


def test_quantization_config_key_only(tmp_path):
    """Some MLX/HF exports carry the block as `quantization_config` (mlx-lm writes both);
    qfuse reads only `quantization` and then reports a shape mismatch."""
    q = quantize_checkpoint(_hf(tmp_path / "src"), tmp_path / "q", bits=4, group_size=32)
    raw = json.loads((q / "config.json").read_text())
    raw["quantization_config"] = raw.pop("quantization")
    (q / "config.json").write_text(json.dumps(raw))
    load_model(q)


def test_unlisted_dense_module_in_mlx_checkpoint(tmp_path):
    """mlx-lm leaves a Linear dense when its input size is not a multiple of the group size
    without writing an override, and decides per module by the presence of `<p>.scales`."""
    q = quantize_checkpoint(_hf(tmp_path / "src"), tmp_path / "q", bits=4, group_size=32,
                            overrides={"model.layers.0.mlp.down_proj": False})
    raw = json.loads((q / "config.json").read_text())
    del raw["quantization"]["model.layers.0.mlp.down_proj"]
    (q / "config.json").write_text(json.dumps(raw))
    load_model(q)


def test_quantize_tied_checkpoint_that_carries_lm_head(tmp_path):
    """load_model accepts a tied checkpoint holding a redundant lm_head.weight, but
    quantize_checkpoint turns it into lm_head.{weight,scales,biases}, which load_model rejects."""
    src = _hf(tmp_path / "src", tie=True)
    tensors = load_file(src / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    load_model(src)  # fine
    load_model(quantize_checkpoint(src, tmp_path / "q", bits=4, group_size=32))
