"""Write model folders without losing anyone's files: sharded safetensors and staged folders.

`save_safetensors` writes one file when everything fits in ``max_shard_bytes``;
otherwise `model-0000i-of-0000n.safetensors` files plus
`model.safetensors.index.json` (`metadata.total_size` and a `weight_map` from
tensor name to file), which qfuse's loader, transformers and mlx-lm all read.
The default model bundled in the package is sharded this way to keep every
file under 16 MB. It never replaces or deletes a file it did not write in the
same call: a folder that already holds weights is refused.

`staged_folder` is how a whole model folder is written (`qfuse quantize`): into
a temporary folder beside the destination, renamed into place only once every
file is there, so a failure leaves neither a half-written model nor an empty
folder, and the source can never be the destination or hold it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from .errors import UserError

INDEX_NAME = "model.safetensors.index.json"


def file_mode(folder: bool = False) -> int:
    """The mode a new file (or folder) gets here: 0644 (0755) under umask 022."""
    # os.umask can only be read by setting it; set it straight back.
    mask = os.umask(0o022)
    os.umask(mask)
    return (0o777 if folder else 0o666) & ~mask


def save_safetensors(state: dict[str, torch.Tensor], dst: str | Path,
                     max_shard_bytes: int | None = None, metadata: dict | None = None) -> list[Path]:
    """Save ``state`` into folder ``dst`` (created if missing); returns the files written.
    Tensors are kept whole and in name order, so a shard exceeds the limit only when a
    single tensor does. UserError if ``dst`` already holds weights; on failure the files
    and folders this call made are removed again."""
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise UserError(f"{dst} exists and is not a folder")
    old = sorted(p.name for p in dst.glob("*.safetensors")) if dst.is_dir() else []
    if dst.is_dir() and (dst / INDEX_NAME).exists():
        old.append(INDEX_NAME)
    if old:
        # Overwriting would destroy them, and leftover shards would be read by a
        # loader that globs *.safetensors beside the new ones.
        raise UserError(f"{dst} already holds model weights ({', '.join(old[:3])}); "
                        "write to a new folder or remove them first")
    state = {k: v.detach().to("cpu").contiguous() for k, v in sorted(state.items())}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    made_dirs = _missing_dirs(dst)
    written: list[Path] = []
    try:
        dst.mkdir(parents=True, exist_ok=True)
        mode = file_mode()
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
        for name, shard in zip(names, shards):
            path = dst / name
            written.append(path)
            write_shard(shard, path, metadata)
            os.chmod(path, mode)  # safetensors creates its files 0600
        if len(shards) > 1:
            weight_map = {t: name for name, shard in zip(names, shards) for t in shard}
            total = sum(t.numel() * t.element_size() for t in state.values())
            written.append(dst / INDEX_NAME)
            (dst / INDEX_NAME).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        _remove_empty(made_dirs)
        raise
    return written[: len(shards)]


def write_shard(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None) -> None:
    """One safetensors file (a seam: tests make it fail to prove nothing is lost)."""
    save_file(tensors, str(path), metadata=metadata)


def check_destination(dst: str | Path, protect: Iterable[str | Path] = (),
                      force: bool = False) -> Path:
    """The absolute destination path, or UserError if writing a model folder there could
    lose files: it is (or is inside, or holds) a ``protect`` path, it is not a folder, or it
    is a non-empty folder and ``force`` is off. With ``force`` a non-empty destination is
    accepted only if it looks like a model folder (config.json or *.safetensors), so a
    mistyped path cannot replace, say, a home directory."""
    dst = Path(os.path.abspath(dst))
    if not dst.name:
        raise UserError(f"{dst} cannot be a model folder")
    dst = dst.parent.resolve() / dst.name  # keep the last part: a symlink there is refused below
    for src in protect:
        src = Path(src)
        if _within(dst, src):
            raise UserError(f"destination {dst} is the source folder {src} or inside it")
        if dst.exists() and _within(src, dst):
            raise UserError(f"destination {dst} holds the source folder {src}")
    if dst.is_symlink():
        raise UserError(f"destination {dst} is a symbolic link; give the folder itself")
    if dst.exists() and not dst.is_dir():
        raise UserError(f"destination {dst} exists and is not a folder")
    if dst.is_dir() and any(dst.iterdir()):
        if not force:
            raise UserError(f"destination {dst} is not empty (--force replaces it)")
        if not ((dst / "config.json").exists() or any(dst.glob("*.safetensors"))):
            raise UserError(f"destination {dst} is not empty and holds no config.json or "
                            "*.safetensors; qfuse replaces only model folders, even with --force")
    return dst


@contextlib.contextmanager
def staged_folder(dst: str | Path, protect: Iterable[str | Path] = (),
                  force: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``dst`` to write a model into. If the block
    raises, the temporary folder (and any parent folder made for it) is removed; if it ends
    normally, the folder becomes ``dst``. With ``force`` an existing ``dst`` is moved aside,
    the new folder renamed into place, and only then the old one removed (put back if the
    rename fails). See `check_destination` for what is refused."""
    protect = list(protect)
    dst = check_destination(dst, protect, force)
    made_dirs = _missing_dirs(dst.parent)
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".qfuse-partial", dir=dst.parent))
    except BaseException:
        _remove_empty(made_dirs)
        raise
    try:
        yield tmp
        os.chmod(tmp, file_mode(folder=True))  # mkdtemp makes it 0700
        _commit(tmp, check_destination(dst, protect, force))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # only this run wrote there
        _remove_empty(made_dirs)
        raise


def _commit(tmp: Path, dst: Path) -> None:
    """Rename ``tmp`` to ``dst``; a non-empty ``dst`` is set aside first and removed last."""
    if not dst.exists() or not any(dst.iterdir()):
        os.replace(tmp, dst)  # rename(2) replaces an empty folder and fails on a full one
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".qfuse-old", dir=dst.parent))
    os.rename(dst, aside / dst.name)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(aside / dst.name, dst)
        aside.rmdir()
        raise
    try:
        shutil.rmtree(aside)
    except OSError as e:  # the new model is in place; say what is left rather than fail
        logging.getLogger("qfuse").warning("could not remove the replaced folder %s: %s", aside, e)


def _within(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or inside it, by identity of existing folders (so
    symlinks, `..` and case-insensitive file systems do not hide it)."""
    if not folder.exists():
        return Path(os.path.abspath(path)) == Path(os.path.abspath(folder))
    path = Path(os.path.abspath(path))
    for p in (path, *path.parents):
        if p.exists() and os.path.samefile(p, folder):
            return True
    return False


def _missing_dirs(folder: Path) -> list[Path]:
    """The folders, deepest first, that creating ``folder`` with parents would make."""
    folder = Path(os.path.abspath(folder))
    return [p for p in (folder, *folder.parents) if not p.exists()]


def _remove_empty(folders: list[Path]) -> None:
    for p in folders:
        with contextlib.suppress(OSError):  # not empty, or gone: leave it
            p.rmdir()
