"""`qfuse quantize` never loses a file: the source is only read, a destination that is the
source (or inside it, or holding it) is refused, a non-empty one needs --force, which
replaces the model files alone and keeps every other file, a failure (a full disk
included) leaves nothing behind and names the destination, and the result is a complete,
readable, loadable model folder."""

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from qfuse import convert, saving
from qfuse.commands.cli import main
from qfuse.convert import parse_overrides, quantize_checkpoint
from qfuse.errors import UserError
from qfuse.loading import load_model, load_tokenizer
from qfuse.models import Decoder, ModelConfig
from qfuse.runtime.generation import Summary, generate
from qfuse.saving import save_safetensors
from qfuse.train import TrainSettings, hf_config, init_weights, train_tokenizer

TINY = TrainSettings(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8)
EXTRAS = {"chat_template.jinja": "{{ messages[0]['content'] }}",
          "generation_config.json": '{"eos_token_id": [1, 2]}\n',
          "tokenizer_config.json": '{"model_max_length": 64}\n'}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny dense gemma3_text folder: two weight shards, tokenizer and chat extras."""
    path = tmp_path_factory.mktemp("src") / "model"  # alone in its parent
    cfg = hf_config(TINY)
    model = Decoder(ModelConfig.from_dict(cfg))
    init_weights(model, 0)
    save_safetensors(model.state_dict(), path, max_shard_bytes=30_000, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg))
    train_tokenizer("def add(a, b):\n    return a + b\n" * 50, TINY.vocab_size).save(
        str(path / "tokenizer.json"))
    for name, text in EXTRAS.items():
        (path / name).write_text(text)
    os.chmod(path / "tokenizer.json", 0o600)  # the copy must not inherit this
    assert len(list(path.glob("*.safetensors"))) > 1
    return path


def _hashes(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path → sha256): proof nothing changed."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _generates(folder: Path) -> None:
    model, tok = load_model(folder), load_tokenizer(folder)
    summary = next(e for e in generate(model, tok, ["def add(a"], max_tokens=4)
                   if isinstance(e, Summary))
    assert summary.generation_tokens >= 1


def test_same_folder_refused_and_source_untouched(source, qfuse_here):
    before = _hashes(source)
    with pytest.raises(UserError, match="is the source folder"):
        quantize_checkpoint(source, source, group_size=32)
    with pytest.raises(UserError, match="is the source folder"):
        quantize_checkpoint(source, source, group_size=32, force=True)
    result = qfuse_here("quantize", source, source, "--group-size", "32", "--force")
    assert result.returncode != 0
    assert "is the source folder" in result.stderr
    assert "Traceback" not in result.stderr
    assert _hashes(source) == before
    assert sorted(p.name for p in source.parent.iterdir()) == [source.name]  # no temp folder


def test_same_folder_by_another_spelling_refused(source, tmp_path):
    """`..` and a symlink to the source are the source too."""
    before = _hashes(source)
    link = tmp_path / "link"
    link.symlink_to(source)
    for dst in (source / ".." / source.name, link):
        with pytest.raises(UserError):
            quantize_checkpoint(source, dst, group_size=32, force=True)
    assert _hashes(source) == before


def test_destination_inside_source_refused(source, qfuse_here):
    before = _hashes(source)
    with pytest.raises(UserError, match="inside it"):
        quantize_checkpoint(source, source / "q4", group_size=32)
    result = qfuse_here("quantize", source, source / "q4", "--group-size", "32")
    assert result.returncode != 0 and "inside it" in result.stderr
    assert _hashes(source) == before and not (source / "q4").exists()


def test_destination_holding_source_refused_even_with_force(source):
    """Replacing the parent would delete the source with it."""
    before = _hashes(source)
    (source.parent / "config.json").write_text("{}")  # make the parent look like a model
    try:
        with pytest.raises(UserError, match="holds the source"):
            quantize_checkpoint(source, source.parent, group_size=32, force=True)
    finally:
        (source.parent / "config.json").unlink()
    assert _hashes(source) == before


def test_non_empty_destination_refused_without_force(source, tmp_path, qfuse_here):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"someone else's weights")
    (dst / "notes.txt").write_text("keep me")
    before = _hashes(dst)
    with pytest.raises(UserError, match="not empty"):
        quantize_checkpoint(source, dst, group_size=32)
    result = qfuse_here("quantize", source, dst, "--group-size", "32")
    assert result.returncode != 0 and "not empty" in result.stderr
    assert _hashes(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def _with_user_files(dst: Path) -> dict[str, str]:
    """Files qfuse's quantize did not write, put into the model folder ``dst`` by a user
    (notes) and by `qfuse gate --make-golden` (golden.json); their hashes."""
    (dst / "NOTES.md").write_text("how I made this model")
    (dst / "golden.json").write_text('{"prompts": []}\n')
    (dst / "runs").mkdir()
    (dst / "runs" / "eval.txt").write_text("scores")
    return {k: v for k, v in _hashes(dst).items() if k in ("NOTES.md", "golden.json",
                                                            "runs/eval.txt")}


def test_force_replaces_the_model_keeps_other_files_and_the_result_generates(source, tmp_path,
                                                                           qfuse_here):
    dst = tmp_path / "dst"
    quantize_checkpoint(source, dst, bits=8, group_size=32)
    user = _with_user_files(dst)
    src_before = _hashes(source)
    result = qfuse_here("quantize", source, dst, "--group-size", "32", "--force")
    assert result.returncode == 0, result.stderr
    assert "quantizing" in result.stderr  # the progress bar goes to stderr
    assert f"kept NOTES.md, golden.json, runs in {dst}" in result.stdout
    assert json.loads((dst / "config.json").read_text())["quantization"]["bits"] == 4
    assert {k: v for k, v in _hashes(dst).items() if k in user} == user
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # old copy and temp gone
    assert _hashes(source) == src_before
    _generates(dst)


def test_force_removes_the_old_models_stale_files(source, tmp_path):
    """A sharded old model, a chat template the new source lacks: they are the old model's,
    and left behind they would be read with the new one."""
    dst = tmp_path / "dst"
    dst.mkdir()
    save_safetensors({"w": torch.ones(8000)}, dst, max_shard_bytes=16_000)
    (dst / "config.json").write_text(json.dumps(hf_config(TINY)))
    (dst / "chat_template.json").write_text("{}")
    user = _with_user_files(dst)
    quantize_checkpoint(source, dst, group_size=32, force=True)
    assert sorted(p.name for p in dst.iterdir()) == sorted(
        ["config.json", "model.safetensors", *EXTRAS, "tokenizer.json", "NOTES.md",
         "golden.json", "runs"])
    assert {k: v for k, v in _hashes(dst).items() if k in user} == user
    load_model(dst)


def test_force_refuses_weights_it_did_not_write(source, tmp_path, qfuse_here):
    """An adapter.safetensors is a user's file that a loader would read with the model: not
    deleted, not kept beside the new weights, but refused with its name, before any work."""
    dst = quantize_checkpoint(source, tmp_path / "dst", group_size=32)
    (dst / "adapter.safetensors").write_bytes(b"someone's adapter")
    before = _hashes(dst)
    result = qfuse_here("quantize", source, dst, "--group-size", "32", "--force")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "holds adapter.safetensors" in result.stderr
    assert "quantizing" not in result.stderr
    assert _hashes(dst) == before


def test_force_refuses_a_folder_that_is_not_a_model(source, tmp_path):
    """A mistyped destination (a home folder, say) gets no model even with --force."""
    dst = tmp_path / "home"
    dst.mkdir()
    (dst / "thesis.tex").write_text("years of work")
    (dst / "config.json").write_text('{"editor": "vim"}')  # an application's, not a model's
    before = _hashes(dst)
    with pytest.raises(UserError, match="only into model folders"):
        quantize_checkpoint(source, dst, group_size=32, force=True)
    assert _hashes(dst) == before


def test_empty_destination_is_used(source, tmp_path):
    dst = tmp_path / "empty"
    dst.mkdir()
    quantize_checkpoint(source, dst, group_size=32)
    load_model(dst)


@pytest.mark.parametrize("force", [False, True])
def test_failure_mid_write_leaves_nothing_behind(source, tmp_path, monkeypatch, force):
    """The shard writer writes its file, then fails: no temp folder, no destination (or the
    old one, intact, with --force), no new parent folders, the source as it was."""
    real = saving.write_shard

    def write_then_fail(tensors, path, metadata):
        real(tensors, path, metadata)
        raise OSError(28, "No space left on device")

    src_before = _hashes(source)
    dst = tmp_path / "new" / "parents" / "dst"
    if force:
        dst.mkdir(parents=True)
        quantize_checkpoint(source, dst, group_size=32, force=True)
        _with_user_files(dst)
        old = _hashes(dst)
    monkeypatch.setattr(saving, "write_shard", write_then_fail)
    with pytest.raises(OSError, match="No space left") as e:
        quantize_checkpoint(source, dst, group_size=32, force=force)
    assert e.value.filename == str(dst)  # the destination, not the folder written first
    if force:
        assert _hashes(dst) == old
        assert sorted(p.name for p in dst.parent.iterdir()) == ["dst"]
    else:
        assert list(tmp_path.iterdir()) == []
    assert _hashes(source) == src_before


def test_full_disk_from_the_cli_is_one_line_naming_the_destination(source, tmp_path,
                                                                   monkeypatch, capsys):
    """safetensors' own error for ENOSPC (a SafetensorError naming no file) through
    `qfuse quantize`: one line, exit 1 (the environment), the destination named and not
    the source, the old model and the user's files as they were."""
    from safetensors import SafetensorError

    def full(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    dst = quantize_checkpoint(source, tmp_path / "dst", bits=8, group_size=32)
    _with_user_files(dst)
    before = _hashes(dst)
    monkeypatch.setattr(saving, "save_file", full)
    capsys.readouterr()
    assert main(["quantize", str(source), str(dst), "--group-size", "32", "--force"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"qfuse: error: {dst}: No space left on device (the model needs "
                          "about ") and err.endswith("; nothing there was changed")
    assert str(source) not in err and ".qfuse-partial" not in err
    assert _hashes(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]
    _generates(dst)


def test_full_disk_copying_the_tokenizer_names_the_destination(source, tmp_path, monkeypatch,
                                                               capsys):
    """shutil.copyfile puts the source in the error's filename (the destination is
    filename2): the message must still name the destination."""
    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(src), None, str(dst))

    monkeypatch.setattr(convert.shutil, "copyfile", full)
    dst = tmp_path / "dst"
    assert main(["quantize", str(source), str(dst), "--group-size", "32"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"qfuse: error: {dst}: No space left on device")
    assert str(source) not in err
    assert list(tmp_path.iterdir()) == []


def test_too_little_free_space_is_refused_before_quantizing(source, tmp_path, monkeypatch,
                                                            capsys):
    dst = quantize_checkpoint(source, tmp_path / "dst", bits=8, group_size=32)
    _with_user_files(dst)
    before = _hashes(dst)
    monkeypatch.setattr(saving.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    monkeypatch.setattr(convert, "_quantize_one", _never)
    capsys.readouterr()
    assert main(["quantize", str(source), str(dst), "--group-size", "32", "--force"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "quantizing" not in err[0]
    assert err[0].startswith(f"qfuse: error: {dst}: not enough free space for the model: it "
                             "needs about ") and err[0].endswith(" kB, 1 kB free")
    assert _hashes(dst) == before


def _never(*args):
    raise AssertionError("quantizing started although the destination has no room")


def test_interrupt_leaves_nothing_behind(source, tmp_path, monkeypatch):
    """Ctrl-C while writing is cleaned up like an error."""
    def interrupted(tensors, path, metadata):
        raise KeyboardInterrupt

    monkeypatch.setattr(saving, "write_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(source, tmp_path / "dst", group_size=32)
    assert list(tmp_path.iterdir()) == []


def test_files_are_readable_by_others(source, tmp_path):
    old = os.umask(0o022)
    try:
        dst = quantize_checkpoint(source, tmp_path / "dst", group_size=32)
    finally:
        os.umask(old)
    assert (dst.stat().st_mode & 0o777) == 0o755
    for p in dst.iterdir():
        assert (p.stat().st_mode & 0o777) == 0o644, p.name


def test_model_folder_files_are_copied(source, tmp_path):
    dst = quantize_checkpoint(source, tmp_path / "dst", group_size=32)
    for name, text in EXTRAS.items():
        assert (dst / name).read_text() == text
    assert (dst / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert load_model(dst).config.eos_token_ids == (1, 2)  # generation_config.json was read


def test_unknown_override_module_is_an_error(source, tmp_path, qfuse_here):
    with pytest.raises(UserError, match="no quantizable module.*nearest: model.layers.1.mlp"):
        quantize_checkpoint(source, tmp_path / "dst", group_size=32,
                            overrides={"model.layers.7.mlp.down_proj": False})
    with pytest.raises(UserError, match="model.norm"):  # exists, but is not quantizable
        quantize_checkpoint(source, tmp_path / "dst", group_size=32,
                            overrides={"model.norm": {"bits": 8}})
    result = qfuse_here("quantize", source, tmp_path / "dst", "--group-size", "32",
                        "--override", "model.layers.0.mlp.down=8")
    assert result.returncode != 0 and "model.layers.0.mlp.down" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_valid_overrides_are_written(source, tmp_path):
    overrides = parse_overrides(["model.layers.0.mlp.down_proj=8:32",
                                 "model.layers.1.self_attn.o_proj=dense"])
    dst = quantize_checkpoint(source, tmp_path / "dst", group_size=32, overrides=overrides)
    block = json.loads((dst / "config.json").read_text())["quantization"]
    assert block["model.layers.0.mlp.down_proj"] == {"group_size": 32, "bits": 8}
    assert block["model.layers.1.self_attn.o_proj"] is False
    model = load_model(dst)
    assert model.model.layers[0].mlp.down_proj.bits == 8
    assert model.model.layers[1].self_attn.o_proj.bits == 0


@pytest.mark.parametrize("item", ["model.layers.0.mlp.down_proj", "=8", "m=", "m=four",
                                  "m=8:", "m=8:x", "m=:32", "m=8:32:1"])
def test_malformed_override_spec(item):
    with pytest.raises(UserError, match="--override"):
        parse_overrides([item])


@pytest.mark.parametrize("kw, message", [
    ({"bits": 7}, "bits must be one of 2, 3, 4, 5, 6, 8"),
    ({"group_size": 48}, "group size must be one of 32, 64, 128"),
    ({"group_size": 32, "overrides": {"model.layers.0.mlp.down_proj": {"bits": 1}}}, "bits"),
    ({"group_size": 128}, "not a multiple of group size 128"),  # hidden size 32
])
def test_invalid_settings(source, tmp_path, kw, message):
    with pytest.raises(UserError, match=message):
        quantize_checkpoint(source, tmp_path / "dst", **kw)
    assert list(tmp_path.iterdir()) == []


def test_cli_rejects_bad_bits_and_group_size(source, tmp_path, qfuse_here):
    for flag, value in (("--bits", "7"), ("--group-size", "16")):
        result = qfuse_here("quantize", source, tmp_path / "dst", flag, value)
        assert result.returncode != 0 and "invalid choice" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_invalid_source(tmp_path, qfuse_here):
    empty = tmp_path / "empty"
    empty.mkdir()
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(hf_config(TINY)))
    for src, message in ((tmp_path / "missing", "does not exist"),
                         (empty, "has no config.json"),
                         (no_weights, "no .safetensors files")):
        with pytest.raises(UserError, match=message) as e:
            quantize_checkpoint(src, tmp_path / "dst")
        assert str(src) in str(e.value)
    result = qfuse_here("quantize", tmp_path / "missing", tmp_path / "dst")
    assert result.returncode != 0 and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "dst").exists()


def test_already_quantized_source(source, tmp_path):
    q = quantize_checkpoint(source, tmp_path / "q", group_size=32)
    with pytest.raises(UserError, match="already quantized"):
        quantize_checkpoint(q, tmp_path / "qq", group_size=32)
