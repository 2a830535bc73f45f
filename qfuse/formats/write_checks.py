"""What every checkpoint writer checks and reads first: the destination is a new folder
(nothing the user has is overwritten) and the source a dense model (its config.json
without a quantization); then the source's tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import UserError


def dense_source_config(src: Path, dst: Path, what: str) -> dict:
    """``src``'s config.json as a dict; a one-line UserError if ``dst`` exists or ``src``
    is quantized (``what``: the format named in the message)."""
    if dst.exists():
        raise UserError(f"{dst} exists; the {what} is written into a new folder")
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization") or config.get("quantization_config"):
        raise UserError(f"{src} is quantized already; write {what} from a dense model")
    return config


def dense_state(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files of the model folder ``src``, by name."""
    state = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 -- a safe_open handle is no dict
                state[name] = f.get_tensor(name)
    return state
