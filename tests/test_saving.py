"""Sharded safetensors saving: the index is consistent and the loader reads it back."""

import json

import torch

from qfuse.loading import load_model, safetensors_files
from qfuse.saving import save_safetensors


def _state():
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(64, 64, generator=g) for i in range(5)}  # 16 KiB each


def test_one_file_when_it_fits(tmp_path):
    paths = save_safetensors(_state(), tmp_path)
    assert [p.name for p in paths] == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_shards_respect_the_limit_and_the_index_maps_every_tensor(tmp_path):
    state = _state()
    paths = save_safetensors(state, tmp_path, max_shard_bytes=40_000)
    assert len(paths) == 3 and all(p.stat().st_size < 40_000 + 1024 for p in paths)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == 5 * 64 * 64 * 4
    assert safetensors_files(tmp_path) == sorted(paths)
    # A later unsharded save removes the shards (a glob-based loader would mix them).
    save_safetensors(state, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_sharded_checkpoint_loads_like_the_unsharded_one(tmp_path):
    from qfuse.models import Decoder, ModelConfig
    from qfuse.train import TrainSettings, _init, hf_config

    s = TrainSettings(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8)
    cfg = hf_config(s)
    model = Decoder(ModelConfig.from_dict(cfg))
    _init(model, 0)
    for folder, limit in (("one", None), ("sharded", 8_000)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps(cfg))
        save_safetensors(model.state_dict(), tmp_path / folder, limit)
    assert len(safetensors_files(tmp_path / "sharded")) > 1
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        a, b = load_model(tmp_path / "one")(ids), load_model(tmp_path / "sharded")(ids)
    assert torch.equal(a, b)
    assert torch.equal(a, model(ids).detach())
