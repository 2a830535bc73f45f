"""Model configurations small enough for Triton's interpreter, shared by the tests that
build a decoder from a config: two layers of Gemma 3 (q/k norms, sandwich joints,
GeGLU; a sliding layer, then a full one)."""

GEMMA3 = {"model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 64, "sliding_window": 8,
          "layer_types": ["sliding_attention", "full_attention"]}
