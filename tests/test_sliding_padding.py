"""Right-padded batched prefill with a sliding window: once the padding is at least a
window long, padded query rows see no key; they must not poison the real rows (NaN)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qfuse.loading import load_model

COMMON = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "max_position_embeddings": 256}


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_short_prompt_in_padded_sliding_batch_matches_transformers(family, tmp_path):
    torch.manual_seed(0)
    cfg = (transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=4,
                                    max_window_layers=0) if family == "qwen2"
           else transformers.Gemma2Config(**COMMON, sliding_window=4))
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path)
    ids = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        out = model(ids, torch.tensor([10, 2]))
        ref = hf(ids[1:, :2]).logits[0]
    assert torch.isfinite(out[1, :2]).all(), "short prompt's logits are NaN"
    assert (out[1, :2] - ref).abs().max().item() <= 1e-4
