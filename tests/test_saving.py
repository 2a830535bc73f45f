"""Sharded safetensors saving: the index is consistent, the loader reads it back, and a
save never replaces weights it did not write nor leaves a partial folder behind."""

import errno
import json
import os
import shutil

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


def _old_model_folder(dst):
    """A model folder written by qfuse (two shards, index, config, tokenizer) beside files
    qfuse did not write: a user's notes, a golden file, a folder of runs."""
    save_safetensors(_state(), dst, max_shard_bytes=40_000)
    (dst / "config.json").write_text('{"model_type": "gemma3_text"}')
    (dst / "tokenizer.json").write_text("old tokenizer")
    (dst / "NOTES.md").write_text("mine")
    (dst / "golden.json").write_text('{"tokens": [1, 2]}')
    (dst / "runs").mkdir()
    (dst / "runs" / "log.txt").write_text("also mine")


def _tree(folder):
    """Every file under ``folder``: relative path -> (bytes, inode), so a file moved away
    and back, or rewritten, would show."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_ino)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _write_new_model(tmp):
    save_safetensors({"w": torch.ones(4)}, tmp)
    (tmp / "config.json").write_text('{"model_type": "llama"}')


USER_FILES = ("NOTES.md", "golden.json", "runs/log.txt")


def test_force_replaces_only_model_files_and_keeps_the_others_untouched(tmp_path):
    dst = tmp_path / "dst"
    _old_model_folder(dst)
    before = _tree(dst)
    with saving.staged_folder(dst, force=True) as tmp:
        _write_new_model(tmp)
    after = _tree(dst)
    # The user's files were neither rewritten nor moved (same inode).
    assert {k: after[k] for k in USER_FILES} == {k: before[k] for k in USER_FILES}
    # The old model's files are gone, stale shards and index included: a loader reading
    # the folder sees the new model alone.
    assert sorted(after) == sorted([*USER_FILES, "config.json", "model.safetensors"])
    assert safetensors_files(dst) == [dst / "model.safetensors"]
    assert (dst / "config.json").read_text() == '{"model_type": "llama"}'
    assert saving.foreign_files(dst) == ["NOTES.md", "golden.json", "runs"]
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]  # nothing set aside is left


@pytest.mark.parametrize("fail_at", [1, 7, 8])
def test_a_failed_move_puts_the_old_model_back(tmp_path, monkeypatch, fail_at):
    """The 6 old model files go aside, then the 2 new ones come in: a rename that fails at
    the first (1), when the new ones start (7) or at the last (8) undoes every move."""
    dst = tmp_path / "dst"
    _old_model_folder(dst)
    before = _tree(dst)
    real, calls = os.rename, []

    def failing(a, b):
        calls.append(a)
        if len(calls) == fail_at:
            raise OSError(5, "Input/output error", str(a))
        real(a, b)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="Input/output error") as e, \
            saving.staged_folder(dst, force=True) as tmp:
        _write_new_model(tmp)
    monkeypatch.undo()
    assert len(calls) == 2 * fail_at - 1  # the failed move, and each earlier one undone
    assert e.value.filename == str(dst)  # the destination, not the folder set aside
    assert _tree(dst) == before
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]


def test_a_full_disk_names_the_destination_and_changes_nothing(tmp_path, monkeypatch):
    """safetensors reports ENOSPC as a SafetensorError naming no file; it becomes an
    OSError naming the destination folder (not the temporary one qfuse wrote into)."""
    from safetensors import SafetensorError

    def full(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    dst = tmp_path / "dst"
    _old_model_folder(dst)
    before = _tree(dst)
    monkeypatch.setattr(saving, "save_file", full)
    with pytest.raises(OSError) as e, saving.staged_folder(dst, force=True, need=100) as tmp:
        _write_new_model(tmp)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(dst)
    assert "No space left on device (the model needs about" in e.value.strerror
    assert _tree(dst) == before
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]


def test_write_shard_keeps_other_safetensors_errors(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    def broken(tensors, filename, metadata=None):
        raise SafetensorError("invalid metadata")

    monkeypatch.setattr(saving, "save_file", broken)
    with pytest.raises(SafetensorError, match="invalid metadata"):
        saving.write_shard({"w": torch.ones(1)}, tmp_path / "x.safetensors", None)


def test_an_error_naming_another_file_keeps_its_name(tmp_path):
    """Only errors writing the new model are the destination's: a source that fails to read
    inside the block is still named."""
    source = str(tmp_path / "source" / "model.safetensors")
    with pytest.raises(OSError) as e, saving.staged_folder(tmp_path / "dst"):
        raise OSError(errno.EIO, "Input/output error", source)
    assert e.value.filename == source
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_too_little_free_space_is_refused_before_any_work(tmp_path, monkeypatch):
    dst = tmp_path / "new" / "dst"
    monkeypatch.setattr(saving.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 5_000_000, 5_000_000))
    with pytest.raises(OSError) as e, saving.staged_folder(dst, need=123_000_000):
        raise AssertionError("the block ran although the space is missing")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(dst)
    assert "needs about 123.0 MB, 5.0 MB free" in e.value.strerror
    assert list(tmp_path.iterdir()) == []
    saving.check_destination(dst, need=4_000_000)  # what fits is accepted


def _replace(name, make):
    def change(folder):
        (folder / name).unlink(missing_ok=True)
        make(folder / name, folder)
    return change


@pytest.mark.parametrize("change, message", [
    (_replace("adapter.safetensors", lambda p, d: p.write_bytes(b"x")),
     "holds adapter.safetensors, which qfuse did not write"),
    (_replace("tokenizer.json", lambda p, d: p.mkdir()), "tokenizer.json is not a plain file"),
    (_replace("config.json", lambda p, d: p.symlink_to(d / "NOTES.md")),
     "config.json is not a plain file"),
])
def test_force_refuses_what_it_could_not_replace_safely(tmp_path, change, message):
    """A *.safetensors qfuse did not write would be read beside the new weights, and a
    folder or link under a model file's name is not a file qfuse wrote: refused, kept."""
    dst = tmp_path / "dst"
    _old_model_folder(dst)
    change(dst)
    before = _tree(dst)
    with pytest.raises(UserError, match=message):
        saving.check_destination(dst, force=True)
    assert _tree(dst) == before


def test_force_refuses_a_folder_whose_config_is_not_a_model(tmp_path):
    """An application's config.json is not a model: it is not replaced, even with force."""
    (tmp_path / "config.json").write_text('{"theme": "dark"}')
    with pytest.raises(UserError, match="holds no model"):
        saving.check_destination(tmp_path, force=True)


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
