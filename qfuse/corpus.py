"""The training corpus: the Python standard library sources of the running interpreter.

Every fresh machine with Python has them, so the corpus needs no download. They
are gathered deterministically (files sorted by their path relative to the
standard library root; tests, `site-packages` and generated encodings tables
skipped) and split into train/validation by a hash of that relative path, so
the split does not depend on the order files are read. The sources are under
the Python Software Foundation License (https://docs.python.org/3/license.html).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

_SKIP_PARTS = {"test", "tests", "site-packages", "dist-packages", "idlelib", "__pycache__",
               "encodings", "lib2to3", "pydoc_data"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[Path]:
    root = root or stdlib_root()
    files = []
    for folder, dirs, names in os.walk(root, followlinks=True):
        # skipped folders are pruned, not walked: site-packages is most of the tree
        dirs[:] = [d for d in dirs if d not in _SKIP_PARTS]
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_validation(relative: str, fraction: float = 0.02) -> bool:
    digest = hashlib.sha256(relative.encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32 < fraction


def load_corpus(max_chars: int | None = None, root: Path | None = None) -> tuple[str, str]:
    """(train text, validation text); files joined by a blank line. ``max_chars``
    caps each part (small settings for tests)."""
    root = root or stdlib_root()
    train, val = [], []
    n_train = n_val = 0
    for path in source_files(root):
        rel = path.relative_to(root).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if is_validation(rel):
            if max_chars is None or n_val < max_chars:
                val.append(text)
                n_val += len(text)
        elif max_chars is None or n_train < max_chars:
            train.append(text)
            n_train += len(text)
        if max_chars is not None and n_train >= max_chars and n_val >= max_chars:
            break
    if not train or not val:
        raise ValueError(f"no Python sources found under {root}")
    return "\n\n".join(train), "\n\n".join(val)
