"""`qfuse train` on CPU with tiny settings: the loss falls and the checkpoint is a
valid HF gemma3_text checkpoint (transformers computes the same logits); a destination
that would lose files is refused before training, and --force replaces a model folder."""

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys

import pytest
import torch

from qfuse.corpus import is_validation, load_corpus, source_files
from qfuse.errors import UserError
from qfuse.loading import load_model, load_tokenizer
from qfuse.train import TrainSettings, train

TINY = TrainSettings(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                     sliding_window=8, seq_len=32, batch_size=8, steps=40, lr=1e-2, warmup=5,
                     eval_every=20, eval_batches=2, max_chars=30_000)


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
        assert {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable) == {torch.bfloat16}


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
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _no_training(*args, **kwargs):
    raise AssertionError("training started although the destination is refused")


def test_full_destination_is_refused_before_training(trained, tmp_path, monkeypatch):
    out, _ = trained
    before = _hashes(out)
    monkeypatch.setattr("qfuse.train.load_corpus", _no_training)
    with pytest.raises(UserError, match=r"not empty \(--force replaces it\)"):
        train(out, TINY, device="cpu", log=lambda *a: None)
    junk = tmp_path / "notes"
    junk.mkdir()
    (junk / "todo.txt").write_text("mine")
    with pytest.raises(UserError, match="holds no config.json"):
        train(junk, TINY, device="cpu", log=lambda *a: None, force=True)
    assert _hashes(out) == before and (junk / "todo.txt").read_text() == "mine"


def test_cli_refuses_a_full_destination_at_once(trained):
    out, _ = trained
    before = _hashes(out)
    result = subprocess.run([sys.executable, "-m", "qfuse", "train", "--out", str(out),
                             "--steps", "1"], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()  # one line: no progress line before it
    assert len(lines) == 1 and lines[0].startswith("qfuse: error:") and "--force" in lines[0]
    assert "corpus" not in result.stdout
    assert _hashes(out) == before


def test_force_replaces_a_model_folder(trained, tmp_path):
    out, _ = trained
    dst = tmp_path / "model"
    shutil.copytree(out, dst)
    (dst / "stale.safetensors").write_bytes(b"old")  # a file this run did not write
    record = train(dst, dataclasses.replace(TINY, steps=2, eval_every=1), device="cpu",
                   log=lambda *a: None, force=True)
    assert record["best_step"] >= 0
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in out.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing set aside left
    load_model(dst)


@pytest.mark.parametrize("change, message", [
    ({"steps": 0}, "--steps must be at least 1"),
    ({"vocab_size": 100}, "--vocab-size must be at least 259"),
    ({"num_key_value_heads": 4}, "multiple of --num-key-value-heads"),
    ({"head_dim": 15}, "--head-dim must be even"),
    ({"lr": 0.0}, "--lr must be > 0"),
    ({"max_chars": 0}, "--max-chars must be at least 1"),
])
def test_unusable_settings_are_refused_before_any_work(change, message):
    with pytest.raises(UserError, match=message):
        dataclasses.replace(TrainSettings(), **change).check()


def test_corpus_too_short_for_the_sequence_is_refused(tmp_path):
    with pytest.raises(UserError, match="too short for --seq-len"):
        train(tmp_path / "m", dataclasses.replace(TINY, max_chars=300, seq_len=10**6),
              device="cpu", log=lambda *a: None)
    assert not (tmp_path / "m").exists()
