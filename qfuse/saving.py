"""Write model folders without losing anyone's files: sharded safetensors and staged folders.

`save_safetensors` writes one file when everything fits in ``max_shard_bytes``;
otherwise `model-0000i-of-0000n.safetensors` files plus
`model.safetensors.index.json` (`metadata.total_size` and a `weight_map` from
tensor name to file), which qfuse's loader, transformers and mlx-lm all read.
The default model bundled in the package is sharded this way to keep every
file under 16 MB. It never replaces or deletes a file it did not write in the
same call: a folder that already holds weights is refused. Tensors keep the names they
are given: a Decoder's `state_dict` holds Phi-3's fused projections split (q/k/v_proj,
gate/up_proj, as the loader splits qkv_proj and gate_up_proj), which qfuse loads back and
transformers' Phi3 does not.

`staged_folder` is how a whole model folder is written (`qfuse quantize`, `qfuse train`):
into a temporary folder beside the destination, moved into place only once every file
is there, so a failure leaves neither a half-written model nor an empty folder, and the
source can never be the destination or hold it. Replacing a model (``force``) touches
only the model files qfuse writes (`is_model_file`): the old ones are set aside, the new
ones moved in, and the old ones deleted last (put back if a move fails); every other
file in the folder (notes, a golden file) stays where it is, unread and unmoved. A
write error (a full disk) names the destination, never the temporary folder or the
source, and a destination without room for the estimated bytes is refused first.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from .errors import UserError

INDEX_NAME = "model.safetensors.index.json"
# What a model folder holds beside config.json and the weights, copied by `qfuse quantize`
# from its source: tokenizer, chat template, generation settings (end-of-turn ids) and the
# licence that must travel with the weights.
EXTRA_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
               "chat_template.jinja", "chat_template.json", "generation_config.json",
               "LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE", "USE_POLICY.md")
# The weight files save_safetensors writes (HF's names, which transformers writes too).
_WEIGHT_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors")


def is_model_file(name: str) -> bool:
    """Whether ``name`` is a file qfuse writes into a model folder (config.json, weights,
    their index, `EXTRA_FILES`): only these may be replaced or removed by ``force``."""
    return (name in ("config.json", INDEX_NAME) or name in EXTRA_FILES
            or _WEIGHT_FILE.fullmatch(name) is not None)


def foreign_files(folder: str | Path) -> list[str]:
    """The names in ``folder`` that are not model files qfuse writes (kept by ``force``)."""
    folder = Path(folder)
    return sorted(p.name for p in folder.iterdir() if not is_model_file(p.name)) \
        if folder.is_dir() else []


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
    """One safetensors file (a seam: tests make it fail to prove nothing is lost). An I/O
    error is an OSError naming ``path``: safetensors reports it as a SafetensorError whose
    text alone holds the errno ("... No space left on device (os error 28)")."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from e


def check_destination(dst: str | Path, protect: Iterable[str | Path] = (),
                      force: bool = False, need: int | None = None) -> Path:
    """The absolute destination path, or UserError if writing a model folder there could
    lose files: it is (or is inside, or holds) a ``protect`` path, it is not a folder, or it
    is a non-empty folder and ``force`` is off. With ``force`` a non-empty destination is
    accepted only if it holds a model (qfuse-named weights, or a config.json with a
    "model_type"), so a mistyped path cannot receive one, and only if no file qfuse would
    replace is a folder or link and no other *.safetensors (which a loader would read
    beside the new weights) lies there. ``need``: the bytes the model will take; OSError
    (ENOSPC) naming ``dst`` if its file system has less free space."""
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
            raise UserError(f"destination {dst} is not empty (--force replaces its model "
                            "files and keeps the others)")
        _check_replaceable(dst)
    if need is not None:
        free = shutil.disk_usage(next(p for p in (dst, *dst.parents) if p.exists())).free
        if free < need:
            raise OSError(errno.ENOSPC, f"not enough free space for the model: it needs about "
                                        f"{_size(need)}, {_size(free)} free", str(dst))
    return dst


def _check_replaceable(dst: Path) -> None:
    """UserError unless ``force`` may put a new model into the non-empty folder ``dst``."""
    names = [p.name for p in dst.iterdir()]
    if not (any(_WEIGHT_FILE.fullmatch(n) for n in names) or _is_model_config(dst / "config.json")):
        raise UserError(f"destination {dst} is not empty and holds no model (model*.safetensors "
                        "or a config.json with a model_type); qfuse writes only into model "
                        "folders, even with --force")
    odd = [n for n in sorted(names) if is_model_file(n)
           and ((dst / n).is_symlink() or not (dst / n).is_file())]
    if odd:
        raise UserError(f"destination {dst}: {', '.join(odd)} is not a plain file; qfuse "
                        "replaces only the files it writes")
    stray = sorted(n for n in names if n.endswith(".safetensors") and not is_model_file(n))
    if stray:
        # Kept, a loader that globs *.safetensors would read them beside the new weights;
        # deleted, a file qfuse did not write would be lost.
        raise UserError(f"destination {dst} holds {', '.join(stray)}, which qfuse did not "
                        "write and a loader would read with the new model; move it away first")


def _is_model_config(path: Path) -> bool:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "model_type" in config


def _size(n: int) -> str:
    return (f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6
            else f"{n / 1e3:.0f} kB")


@contextlib.contextmanager
def staged_folder(dst: str | Path, protect: Iterable[str | Path] = (),
                  force: bool = False, need: int | None = None) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``dst`` to write a model into. If the block
    raises, the temporary folder (and any parent folder made for it) is removed; if it ends
    normally, its files move into ``dst`` (see `_commit`: with ``force`` only model files
    are replaced, every other file is kept). See `check_destination` for what is refused
    before the block runs, ``need`` included. An OSError writing the temporary folder, or
    moving it into place, is raised again naming ``dst`` (a full disk reads
    "DST: No space left on device ..."), never the temporary folder or a source file."""
    protect = list(protect)
    dst = check_destination(dst, protect, force, need)
    made_dirs = _missing_dirs(dst.parent)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".qfuse-partial", dir=dst.parent))
    except OSError as e:
        _remove_empty(made_dirs)
        raise _naming(dst, e, need) from e
    except BaseException:
        _remove_empty(made_dirs)
        raise
    try:
        try:
            yield tmp
        except OSError as e:
            if _writing(e, tmp):  # a source that fails to read keeps its name
                raise _naming(dst, e, need) from e
            raise
        try:
            os.chmod(tmp, file_mode(folder=True))  # mkdtemp makes it 0700
            _commit(tmp, check_destination(dst, protect, force))
        except OSError as e:
            raise _naming(dst, e, need) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # only this run wrote there
        _remove_empty(made_dirs)
        raise


# Errors only a write gives: without a file name they are still the destination's.
_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def _writing(e: OSError, folder: Path) -> bool:
    """Whether ``e`` is an error writing into ``folder``: it names a path there
    (shutil.copyfile puts the source in ``filename`` and the destination in ``filename2``),
    or names none and only a write could fail that way."""
    if e.filename is None and e.filename2 is None:
        return e.errno in _WRITE_ERRORS
    for name in (e.filename, e.filename2):
        if isinstance(name, (str, bytes, os.PathLike)):
            path = Path(os.path.abspath(os.fsdecode(name)))
            if path == folder or folder in path.parents:
                return True
    return False


def _naming(dst: Path, e: OSError, need: int | None) -> OSError:
    """``e`` again, naming ``dst``: what the user asked qfuse to write."""
    if e.filename is not None and Path(os.fsdecode(e.filename)) == dst:
        return e
    what = e.strerror or str(e)
    if e.errno == errno.ENOSPC and need is not None:
        what += f" (the model needs about {_size(need)})"
    return OSError(e.errno, f"{what}; nothing there was changed", str(dst))


def _commit(tmp: Path, dst: Path) -> None:
    """Move the files of ``tmp`` into ``dst``. An absent or empty ``dst`` is replaced by
    renaming the folder. Otherwise the model files in ``dst`` (`is_model_file`) are moved
    into a folder set aside, the new files moved in (config.json last, so a loader never
    sees a config without its weights), and the set-aside folder deleted last; if a move
    fails, every move is undone. Files that are not model files are never touched."""
    if not dst.exists() or not any(dst.iterdir()):
        os.replace(tmp, dst)  # rename(2) replaces an empty folder and fails on a full one
        return
    new = sorted((p.name for p in tmp.iterdir()), key=lambda n: (n == "config.json", n))
    clash = [n for n in new if not is_model_file(n) and os.path.lexists(dst / n)]
    if clash:  # a writer's bug, not a user's: never replace a file qfuse does not own
        raise UserError(f"{dst} already holds {', '.join(clash)}; not replaced")
    old = sorted((p.name for p in dst.iterdir() if is_model_file(p.name)),
                 key=lambda n: (n != "config.json", n))  # config.json first: no half model
    aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".qfuse-old", dir=dst.parent))
    moves: list[tuple[Path, Path]] = []
    try:
        for name in old:
            _move(dst / name, aside / name, moves)
        for name in new:
            _move(tmp / name, dst / name, moves)
    except BaseException:
        _undo(moves, aside)
        raise
    for path in (aside, tmp):
        try:
            shutil.rmtree(path)  # only the old model's files, and an empty folder
        except OSError as e:  # the new model is in place; say what is left rather than fail
            logging.getLogger("qfuse").warning("could not remove %s: %s", path, e)


def _move(src: Path, dst: Path, moves: list[tuple[Path, Path]]) -> None:
    os.rename(src, dst)
    moves.append((src, dst))


def _undo(moves: list[tuple[Path, Path]], aside: Path) -> None:
    """Put every moved file back, newest first; if that fails, say where the old files are."""
    try:
        for src, dst in reversed(moves):
            os.rename(dst, src)
        aside.rmdir()
    except OSError as e:
        logging.getLogger("qfuse").error("could not put every file back (%s); the old model's "
                                         "files are in %s", e, aside)


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
