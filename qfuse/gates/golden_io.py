"""The golden file: a few prompts (their token ids) with the compat tier's greedy
continuation of each, frozen (`make_golden`); written only where no file or an earlier
golden file is, atomically (`save_golden`, `check_golden_destination`), and read back
checked, a UserError naming the file when it is not one or belongs to another model's
vocabulary (`load_golden`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .. import levers
from ..errors import UserError
from ..oracle import gate_cache
from .measures import progress_bar

DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
)


@torch.no_grad()
def make_golden(model, tokenizer, prompts=DEFAULT_PROMPTS, n_tokens: int = 64) -> dict:
    """Greedy compat continuations of the prompts (the frozen trajectories)."""
    out = []
    with levers.use_tier("compat"):
        for p in progress_bar(prompts, "golden (compat)", True):
            ids = tokenizer.encode(p).ids
            device = model.model.norm.weight.device
            cache = gate_cache(model, len(ids) + n_tokens)
            tok = model(torch.tensor([ids], device=device), cache=cache)[0, -1].argmax()
            cont = [int(tok)]
            for _ in range(n_tokens - 1):
                tok = model.decode(tok.view(1), cache)[0].argmax()
                cont.append(int(tok))
            out.append({"prompt": p, "prompt_ids": ids, "continuation": cont})
    return {"n_tokens": n_tokens, "trajectories": out}


def save_golden(golden: dict, path: str | Path) -> None:
    """Write ``golden`` to ``path``, only where no file is or an earlier golden file is
    (`check_golden_destination`: any other file is the user's, and stays), atomically:
    a temporary file beside it, renamed over it when complete, so a failure leaves the
    old file whole. A symbolic link is written through (its target replaced)."""
    path = Path(path)
    check_golden_destination(path)
    if path.is_symlink():
        path = path.resolve()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(golden) + "\n")
            f.flush()
            os.fsync(f.fileno())
        # mkstemp makes the file private (0600): give it the mode a plain write would.
        if path.exists():
            shutil.copymode(path, tmp)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_golden_destination(path: str | Path) -> None:
    """UserError unless ``path`` may receive a golden file: a missing file in an
    existing folder, or a file that already is a golden file (by its content)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise UserError(f"cannot write the golden file {path}: folder {path.parent} does "
                        "not exist")
    if not path.exists() and not path.is_symlink():
        return
    try:
        load_golden(path)
    except UserError as e:
        raise UserError(f"{e}; qfuse writes a golden file only where none is or over an "
                        "earlier one, so it leaves this file alone: choose another --golden "
                        "path, or move the file") from None


def load_golden(path: str | Path, vocab_size: int | None = None) -> dict:
    """The golden file at ``path``, checked; a UserError naming the file when it is not
    one (not JSON, not what `make_golden` writes, or with ``vocab_size`` token ids
    that vocabulary lacks: a file written for another model)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a folder, not a golden file")
    try:
        golden = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not a golden file: it is not JSON ({e})") from None
    problem = _golden_problem(golden, vocab_size)
    if problem is not None:
        raise UserError(f"{path} is not a golden file: {problem}")
    return golden


def _golden_problem(golden, vocab_size: int | None) -> str | None:
    """What keeps ``golden`` (parsed JSON) from being a golden file, or None."""
    if not isinstance(golden, dict) or not isinstance(golden.get("trajectories"), list) \
            or not golden["trajectories"]:
        return 'it has no list of "trajectories"'
    if not _is_count(golden.get("n_tokens")):
        return 'it has no "n_tokens" count'
    for i, t in enumerate(golden["trajectories"]):
        for key in ("prompt_ids", "continuation"):
            ids = t.get(key) if isinstance(t, dict) else None
            if not isinstance(ids, list) or not ids or not all(_is_count(x, 0) for x in ids):
                return f'trajectory {i} has no "{key}" token ids'
            if vocab_size is not None and max(ids) >= vocab_size:
                return (f"trajectory {i} holds token id {max(ids)}, outside this model's "
                        f"vocabulary of {vocab_size} (a golden file of another model)")
    return None


def _is_count(x, least: int = 1) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= least
