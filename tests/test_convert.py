"""Quantizing: `quantize_model` in memory equals `quantize_checkpoint` on disk, and
`qfuse quantize` writes a checkpoint `qfuse generate` runs."""

import json

import torch

from qfuse.convert import quantize_checkpoint, quantize_model
from qfuse.loading import load_model

from .conftest import VOCAB


def test_quantize_model_matches_quantize_checkpoint(checkpoint, tmp_path):
    dense = load_model(checkpoint)
    on_disk = load_model(quantize_checkpoint(checkpoint, tmp_path / "q", bits=4, group_size=64))
    in_memory = quantize_model(dense, 4, 64)
    ids = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        assert torch.equal(in_memory(ids), on_disk(ids))


def test_cli_quantize_and_generate(checkpoint, tmp_path, capsys):
    from qfuse.commands.cli import main

    dst = tmp_path / "cli-q"
    assert main(["quantize", str(checkpoint), str(dst), "--bits", "8", "--group-size", "32",
                 "--override", "model.layers.0.mlp.down_proj=4:64",
                 "--override", "lm_head=dense"]) == 0
    block = json.loads((dst / "config.json").read_text())["quantization"]
    assert block["model.layers.0.mlp.down_proj"] == {"bits": 4, "group_size": 64}
    assert block["lm_head"] is False
    assert main(["generate", str(dst), "def add", "--max-tokens", "4"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[1].startswith("def add") and "tok/s" in out.err
