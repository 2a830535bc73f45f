"""Sharded safetensors saving: the index is consistent, the loader reads it back, and a
save never replaces weights it did not write nor leaves a partial folder behind."""

import json
import os

import pytest
import torch

from qfuse import saving
from qfuse.errors import UserError
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


def test_a_folder_holding_weights_is_refused_and_kept(tmp_path):
    """Whoever wrote them, existing weights are neither overwritten nor deleted (a stale
    shard left beside new ones would also be read by a glob-based loader)."""
    save_safetensors(_state(), tmp_path, max_shard_bytes=40_000)
    (tmp_path / "notes.txt").write_text("keep")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for limit in (None, 40_000):
        with pytest.raises(UserError, match="already holds model weights"):
            save_safetensors(_state(), tmp_path, limit)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_failed_save_removes_what_it_wrote_and_the_folders_it_made(tmp_path, monkeypatch):
    real, calls = saving.write_shard, []

    def fail_on_second(tensors, path, metadata):
        calls.append(path)
        real(tensors, path, metadata)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(saving, "write_shard", fail_on_second)
    with pytest.raises(OSError):
        save_safetensors(_state(), tmp_path / "a" / "b", max_shard_bytes=40_000)
    assert list(tmp_path.iterdir()) == []
    # In a folder that already existed, only this call's files go; the others stay.
    (tmp_path / "config.json").write_text("{}")
    calls.clear()
    with pytest.raises(OSError):
        save_safetensors(_state(), tmp_path, max_shard_bytes=40_000)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_files_are_readable_by_others(tmp_path):
    old = os.umask(0o022)
    try:
        paths = save_safetensors(_state(), tmp_path, max_shard_bytes=40_000)
    finally:
        os.umask(old)
    for p in [*paths, tmp_path / "model.safetensors.index.json"]:
        assert (p.stat().st_mode & 0o777) == 0o644, p.name  # safetensors alone makes 0600


def test_staged_folder_puts_the_old_one_back_if_the_final_rename_fails(tmp_path, monkeypatch):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "config.json").write_text("old")
    real = os.rename

    def no_partial(a, b):
        if str(a).endswith(".qfuse-partial"):
            raise OSError(5, "I/O error")
        real(a, b)

    monkeypatch.setattr(os, "rename", no_partial)
    with pytest.raises(OSError, match="I/O error"), saving.staged_folder(dst, force=True) as tmp:
        (tmp / "config.json").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]
    assert (dst / "config.json").read_text() == "old"


def test_sharded_checkpoint_loads_like_the_unsharded_one(tmp_path):
    from qfuse.models import Decoder, ModelConfig
    from qfuse.train import TrainSettings, hf_config, init_weights

    s = TrainSettings(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8)
    cfg = hf_config(s)
    model = Decoder(ModelConfig.from_dict(cfg))
    init_weights(model, 0)
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
