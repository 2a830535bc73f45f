"""What every checkpoint writer checks before it writes: the destination is a new folder
(nothing the user has is overwritten) and the source a dense model (its config.json
without a quantization), whose config it returns."""

from __future__ import annotations

import json
from pathlib import Path

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
