"""`qfuse train` on CPU with tiny settings: the loss falls and the checkpoint is a
valid HF gemma3_text checkpoint (transformers computes the same logits); a destination
that would lose files, or lacks the room, is refused before training; --force replaces
the model files of a model folder and keeps the other files; a full disk at the save
keeps the trained model elsewhere and says where, in one line naming the destination."""

import dataclasses
import errno
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from qfuse import saving
from qfuse.commands.cli import main
from qfuse.corpus import is_validation, load_corpus, source_files
from qfuse.errors import UserError
from qfuse.loading import load_model, load_tokenizer
from qfuse.train import ModelKeptError, TrainSettings, checkpoint_bytes, hf_config, train

DEFAULT = Path(__file__).parents[1] / "qfuse" / "assets" / "default"

TINY = TrainSettings(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                     sliding_window=8, seq_len=32, batch_size=8, steps=40, lr=1e-2, warmup=5,
                     eval_every=20, eval_batches=2, max_chars=30_000)
# The least training that saves a model: for the tests of what happens at the save.
ONE_STEP = dataclasses.replace(TINY, steps=1, eval_every=1, eval_batches=1)


def test_corpus_is_deterministic_and_split():
    files = source_files()
    assert len(files) > 100 and files == source_files()
    a, b = load_corpus(max_chars=20_000), load_corpus(max_chars=20_000)
    assert a == b and a[0] and a[1] and a[0] != a[1]
    assert is_validation("x.py") == is_validation("x.py")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    record = train(out, TINY, device="cpu", log=lambda *a: None)
    return out, record


def test_loss_falls(trained):
    _, record = trained
    losses = [loss for _, loss in record["train_loss"]]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert record["val_loss"][-1][1] < record["val_loss"][0][1] + 1e-6
    assert record["best_val_loss"] == min(v for _, v in record["val_loss"])


def test_checkpoint_is_the_best_validation_state_in_bfloat16(trained):
    from safetensors import safe_open

    out, _ = trained
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        # keys(): safe_open is not iterable
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118


def test_checkpoint_loads_in_qfuse_and_transformers(trained):
    transformers = pytest.importorskip("transformers")
    out, _ = trained
    model, tok = load_model(out), load_tokenizer(out)
    ids = torch.tensor([tok.encode("def main():\n    return 0\n").ids])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4
    assert json.loads((out / "config.json").read_text())["model_type"] == "gemma3_text"


def test_loss_curve_plot(trained, tmp_path):
    pytest.importorskip("matplotlib")
    from qfuse.bench.train import plot_record

    _, record = trained
    plot_record(record, str(tmp_path / "train.png"))
    assert (tmp_path / "train.png").stat().st_size > 1000


def _hashes(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _flags(s: TrainSettings) -> list[str]:
    """`qfuse train` flags for settings ``s`` (None: the flag's default)."""
    return [f for k, v in dataclasses.asdict(s).items() if v is not None
            for f in (f"--{k.replace('_', '-')}", str(v))]


def _model_with_user_files(trained, tmp_path) -> Path:
    """A copy of the trained model folder beside a user's notes, the golden file of
    `qfuse gate --make-golden` and a folder of runs."""
    dst = tmp_path / "model"
    shutil.copytree(trained[0], dst)
    (dst / "NOTES.md").write_text("mine")
    (dst / "golden.json").write_text('{"prompts": []}\n')
    (dst / "runs").mkdir()
    (dst / "runs" / "log.txt").write_text("also mine")
    return dst


@pytest.fixture
def spare(tmp_path, monkeypatch):
    """The temporary directory, where a model is kept when its destination is full (and a
    home folder that does not exist, so no test writes into the real one)."""
    folder = tmp_path / "spare"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setenv("HOME", str(tmp_path / "no-home"))
    return folder


def _full_except(folder: Path | None):
    """A shard writer for which every file system but ``folder``'s is full."""
    real = saving.write_shard

    def write(tensors, path, metadata):
        if folder is None or folder not in Path(path).parents:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(tensors, path, metadata)
    return write


def _no_training(*args, **kwargs):
    raise AssertionError("training started although the destination is refused")


def test_full_destination_is_refused_before_training(trained, tmp_path, monkeypatch):
    out, _ = trained
    before = _hashes(out)
    monkeypatch.setattr("qfuse.train.load_corpus", _no_training)
    with pytest.raises(UserError, match=r"not empty \(--force replaces its model files"):
        train(out, TINY, device="cpu", log=lambda *a: None)
    junk = tmp_path / "notes"
    junk.mkdir()
    (junk / "todo.txt").write_text("mine")
    with pytest.raises(UserError, match="holds no model"):
        train(junk, TINY, device="cpu", log=lambda *a: None, force=True)
    assert _hashes(out) == before and (junk / "todo.txt").read_text() == "mine"


def test_cli_refuses_a_full_destination_at_once(trained, qfuse_here):
    out, _ = trained
    before = _hashes(out)
    result = qfuse_here("train", "--out", out, "--steps", "1")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()  # one line: no progress line before it
    assert len(lines) == 1 and lines[0].startswith("qfuse: error:") and "--force" in lines[0]
    assert "corpus" not in result.stdout
    assert _hashes(out) == before


def test_force_replaces_the_model_files_and_keeps_the_others(trained, tmp_path):
    out, _ = trained
    dst = _model_with_user_files(trained, tmp_path)
    # A shard of an older, sharded model in the folder: the old model's, so replaced too.
    shutil.copyfile(out / "model.safetensors", dst / "model-00001-of-00002.safetensors")
    user = {k: v for k, v in _hashes(dst).items() if k in ("NOTES.md", "golden.json",
                                                            "runs/log.txt")}
    record = train(dst, ONE_STEP, device="cpu", log=lambda *a: None, force=True)
    assert record["best_step"] == 0
    assert sorted(p.name for p in dst.iterdir()) == sorted(
        [p.name for p in out.iterdir()] + ["NOTES.md", "golden.json", "runs"])
    assert {k: v for k, v in _hashes(dst).items() if k in user} == user
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing set aside left
    load_model(dst)


def test_force_refuses_weights_it_did_not_write_before_training(trained, tmp_path, monkeypatch):
    dst = _model_with_user_files(trained, tmp_path)
    (dst / "adapter.safetensors").write_bytes(b"someone's adapter")
    before = _hashes(dst)
    monkeypatch.setattr("qfuse.train.load_corpus", _no_training)
    with pytest.raises(UserError, match="holds adapter.safetensors, which qfuse did not write"):
        train(dst, ONE_STEP, device="cpu", log=lambda *a: None, force=True)
    assert _hashes(dst) == before


def test_a_full_disk_at_the_save_keeps_the_trained_model(trained, tmp_path, spare,
                                                         monkeypatch):
    dst = _model_with_user_files(trained, tmp_path)
    before = _hashes(dst)
    monkeypatch.setattr(saving, "write_shard", _full_except(spare))
    with pytest.raises(ModelKeptError) as e:
        train(dst, ONE_STEP, device="cpu", log=lambda *a: None, force=True)
    err = e.value
    assert err.errno == errno.ENOSPC and err.filename == str(dst)
    assert err.kept is not None and err.kept.parent == spare
    assert err.strerror.endswith(f"; the trained model is kept in {err.kept}")
    assert err.record["best_step"] == 0
    assert _hashes(dst) == before  # the old model and the user's files as they were
    kept = load_model(err.kept)
    assert kept.config.num_hidden_layers == ONE_STEP.num_hidden_layers
    load_tokenizer(err.kept)


def test_cli_full_disk_is_one_line_saying_where_the_model_is(tmp_path, spare, monkeypatch,
                                                             capsys):
    dst, record = tmp_path / "model", tmp_path / "record.json"
    monkeypatch.setattr(saving, "write_shard", _full_except(spare))
    code = main(["train", "--out", str(dst), "--device", "cpu", "--record", str(record),
                 *_flags(ONE_STEP)])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("qfuse: error:")]
    assert len(lines) == 1 and err.rstrip().endswith(lines[0])
    (kept,) = spare.iterdir()
    assert lines[0] == (f"qfuse: error: {dst}: No space left on device (the model needs about "
                        f"{checkpoint_bytes(ONE_STEP) / 1e3:.0f} kB); nothing there was "
                        f"changed; the trained model is kept in {kept}")
    assert not dst.exists()
    load_model(kept)
    assert json.loads(record.read_text())["best_step"] == 0  # the run's record is kept too


def test_a_full_disk_everywhere_says_so(tmp_path, spare, monkeypatch):
    monkeypatch.setattr(saving, "write_shard", _full_except(None))
    with pytest.raises(ModelKeptError) as e:
        train(tmp_path / "model", ONE_STEP, device="cpu", log=lambda *a: None)
    assert e.value.kept is None and "the trained model could not be kept either" in str(e.value)
    assert f"{spare}: No space left on device" in str(e.value)
    assert list(spare.iterdir()) == [] and not (tmp_path / "model").exists()


def test_too_little_free_space_is_refused_before_training(trained, tmp_path, monkeypatch,
                                                          capsys):
    dst = _model_with_user_files(trained, tmp_path)
    before = _hashes(dst)
    monkeypatch.setattr(saving.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    monkeypatch.setattr("qfuse.train.load_corpus", _no_training)
    with pytest.raises(OSError, match="not enough free space") as e:
        train(dst, TINY, device="cpu", log=lambda *a: None, force=True)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(dst)
    capsys.readouterr()
    assert main(["train", "--out", str(dst), "--force", *_flags(TINY)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    need = checkpoint_bytes(TINY) / 1e3  # a tiny model: tens of kB
    assert lines == [(f"qfuse: error: {dst}: not enough free space for the model: it needs "
                      f"about {need:.0f} kB, 1 kB free")]
    assert _hashes(dst) == before


def test_checkpoint_bytes_is_what_the_save_writes(trained):
    """The estimate is a lower bound, and a close one."""
    out, _ = trained
    written = sum(p.stat().st_size for p in out.iterdir())
    assert 0.8 * written < checkpoint_bytes(TINY) <= written


@pytest.mark.parametrize("change, message", [
    ({"steps": 0}, "--steps must be at least 1"),
    ({"vocab_size": 100}, "--vocab-size must be at least 259"),
    ({"num_key_value_heads": 4}, "multiple of --num-key-value-heads"),
    ({"head_dim": 15}, "--head-dim must be even"),
    ({"lr": 0.0}, "--lr must be > 0"),
    ({"max_chars": 0}, "--max-chars must be at least 1"),
    ({"sliding_window_pattern": 0}, "--sliding-window-pattern must be at least 1"),
    ({"tokenizer": "/nonexistent/tokenizer.json"}, "not a readable tokenizer.json"),
    ({"vocab_size": 300, "tokenizer": str(DEFAULT / "tokenizer.json")},
     "4096 entries, but --vocab-size is 300"),
])
def test_unusable_settings_are_refused_before_any_work(change, message):
    with pytest.raises(UserError, match=message):
        dataclasses.replace(TrainSettings(), **change).check()


def test_corpus_too_short_for_the_sequence_is_refused(tmp_path):
    with pytest.raises(UserError, match="too short for --seq-len"):
        train(tmp_path / "m", dataclasses.replace(TINY, max_chars=300, seq_len=10**6),
              device="cpu", log=lambda *a: None)
    assert not (tmp_path / "m").exists()


def test_every_nth_layer_attends_to_the_full_context():
    s = dataclasses.replace(TINY, num_hidden_layers=4, sliding_window_pattern=2)
    assert hf_config(s)["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert hf_config(TrainSettings())["layer_types"] == ["sliding_attention"] * 5 + [
        "full_attention"]


def test_a_given_tokenizer_is_trained_with_and_saved(tmp_path, qfuse_here):
    """`--tokenizer` reuses an existing tokenizer.json (the bundled model's, whose 4096
    entries no tokenizer trained on the capped corpus has): the model is saved with it."""
    s = dataclasses.replace(ONE_STEP, vocab_size=4096, tokenizer=str(DEFAULT / "tokenizer.json"))
    r = qfuse_here("train", "--out", tmp_path / "m", *_flags(s))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    saved, bundled = load_tokenizer(tmp_path / "m"), load_tokenizer(DEFAULT)
    assert saved.get_vocab() == bundled.get_vocab()
    text = "def main():\n    return 0\n"
    assert saved.encode(text).ids == bundled.encode(text).ids
    assert load_model(tmp_path / "m").config.vocab_size == 4096
