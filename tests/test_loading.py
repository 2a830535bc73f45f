"""Loading checkpoints: HF and MLX-quantized folders (single and sharded), the errors
that name a broken one, pickles refused, and chat templates."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qfuse.convert import quantize_checkpoint
from qfuse.loading import load_model
from qfuse.models import Decoder

from .conftest import VOCAB


def test_quantized_checkpoint_loads_and_matches_dequantized(checkpoint, tmp_path):
    overrides = {"model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 32},
                 "model.layers.1.self_attn.o_proj": False}
    dst = quantize_checkpoint(checkpoint, tmp_path / "q4", bits=4, group_size=64,
                              overrides=overrides)
    block = json.loads((dst / "config.json").read_text())["quantization"]
    assert block["bits"] == 4 and block["model.layers.1.self_attn.o_proj"] is False
    q = load_model(dst)
    down = q.model.layers[0].mlp.down_proj
    assert (down.bits, down.group_size) == (8, 32)
    assert q.model.layers[1].self_attn.o_proj.bits == 0
    # The same model with every quantized weight dequantized into dense storage.
    dense = Decoder(q.config)
    state = {}
    for name, module in q.named_modules():
        if getattr(module, "bits", 0):
            state[f"{name}.weight"] = module.quantized().dequantize(torch.float32)
    for name, t in q.state_dict().items():
        base = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) or f"{base}.weight" in state:
            continue
        state[name] = t
    dense.load_state_dict(state)
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        assert torch.equal(q(ids), dense(ids))


def test_bad_checkpoints_name_the_problem(checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match="lacks"):
        load_model(bad)
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_model(bad)
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match="NaN"):  # checked by default
        load_model(bad)
    load_model(bad, check_weights=False)  # the check's opt-out loads it as it is
    cfg = json.loads((checkpoint / "config.json").read_text())
    for field, value, match in (("model_type", "gpt2", "model_type"),
                                ("num_key_value_heads", 3, "multiple"),
                                ("hidden_size", None, "hidden_size")):
        broken = dict(cfg)
        if value is None:
            del broken[field]
        else:
            broken[field] = value
        (bad / "config.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=match):
            load_model(bad)


def test_sharded_checkpoint_loads(tmp_path):
    torch.manual_seed(1)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = load_model(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    missing_shard = next(iter(set(index["weight_map"].values())))
    (tmp_path / missing_shard).unlink()
    with pytest.raises(ValueError, match="missing"):
        load_model(tmp_path)


def test_pickle_only_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 32}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path)


def test_chat_template_renders(tmp_path):
    from qfuse.loading import load_chat_template, render_chat

    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": {"content": "<s>"}}))
    messages = [{"role": "user", "content": "hi"}]
    got = render_chat(load_chat_template(tmp_path), messages, {"bos_token": "<s>"})
    assert got == "<s><|user|>hi<|end|><|assistant|>"
    bad = "{{ raise_exception('no system role') }}"
    with pytest.raises(ValueError, match="no system role"):
        render_chat(bad, messages)
