"""Load checkpoints: HF safetensors (single or sharded), MLX-quantized ones, and AWQ, GPTQ
and compressed-tensors ones and .gguf files converted to MLX groups as they load
(`qfuse.formats`). Never pickle.

`load_model(path)` reads config.json, builds the Decoder with each Linear stored
as the checkpoint stores it (dense, or MLX `weight`/`scales`/`biases` with the
`quantization` block's group size and bits, per-module overrides included),
then fills it tensor by tensor, checking names, shapes and dtypes. A missing
tensor, a wrong shape, a dtype that is not a float where the model keeps floats
(an integer projection) or, unless ``check_weights=False``, a NaN/inf gets a
`CheckpointError` naming the tensor; a corrupt or truncated shard, or a broken JSON file, one
naming the file. Fused projections (Phi-3's `self_attn.qkv_proj`, q then k then v rows, and
`mlp.gate_up_proj`, gate then up) are split into the decoder's q/k/v and gate/up as they
load, dense or MLX-quantized (row slices of the weight, scales and biases), one fused
tensor at a time. `check_checkpoint(path)` runs every check that needs no
weights, so a command can refuse a broken folder before it spends time loading.
Conversations become prompts through the checkpoint's chat template
(`load_chat_template`, `render_chat`), or `render_plain` where it has none. A .gguf file
with no tokenizer.json beside it brings its own tokenizer, chat template and special
tokens, built from its metadata (`formats.gguf_tokenizer`). `weight_sources(path)` says
how the checkpoint stores each weight, from the headers alone (`qfuse info MODEL`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import os
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from . import formats
from .errors import UserError
from .models import Decoder, ModelConfig

# The model `qfuse train` made for the package: what `qfuse generate` runs without a model.
DEFAULT_MODEL = Path(__file__).resolve().parent / "assets" / "default"

# Tensors some checkpoints carry that the model recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Fused projections (Phi-3) → the decoder's modules they hold, in row order.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PART_OF = {part: fused for fused, parts in _FUSED.items() for part in parts}
# Multimodal Gemma 3 checkpoints nest the text model.
_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
             "language_model.lm_head.": "lm_head."}


class CheckpointError(UserError, ValueError):
    """A model folder qfuse cannot load; the message names the file or tensor. A
    ValueError too, for callers that caught ValueError before it existed."""


def check_checkpoint(path: str | Path, tokenizer: bool = True) -> ModelConfig:
    """The folder's config, after every check that needs no weights: the folder,
    config.json, the safetensors shards' headers (a truncated shard fails here),
    and with ``tokenizer`` tokenizer.json. CheckpointError/ConfigError otherwise."""
    path = Path(path)
    what = "a model folder holds config.json, *.safetensors and tokenizer.json"
    _check_reachable(path)
    if _is_gguf(path):
        config = _gguf_config(_open_gguf(path), path)
        if tokenizer and not (path.parent / "tokenizer.json").is_file():
            # No tokenizer.json beside it: the file's own, from its metadata.
            from .formats import gguf_tokenizer

            try:
                gguf_tokenizer.check(_gguf_metadata(path), config.vocab_size)
            except formats.FormatError as e:
                raise CheckpointError(f"{path}: {e}") from e
        return config
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder ({what})")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json ({what})")
    config = _with_generation_eos(ModelConfig.from_file(path), path)
    _format(config, path)  # a quantization_config qfuse cannot read
    for file in safetensors_files(path):
        with _open(file):
            pass
    if tokenizer and not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{path} has no tokenizer.json ({what})")
    return config


def _check_reachable(path: Path) -> None:
    """CheckpointError saying why the model folder ``path`` is not there: missing, a
    symbolic link to nothing, a symbolic link loop. Permission denied stays the
    PermissionError it is (an error of the environment, not of the request)."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        if path.is_symlink():
            raise CheckpointError(f"model folder {path} is a symbolic link to "
                                  f"{os.readlink(path)}, which does not exist") from None
        raise CheckpointError(f"model folder {path} does not exist") from None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        what = (f"model folder {path} is" if path.is_symlink() else
                f"the path to model folder {path} runs into")
        raise CheckpointError(f"{what} a symbolic link loop (links that lead back to "
                              "themselves)") from None


def _open(file: Path):
    """safe_open, with a corrupt or truncated file named in a CheckpointError."""
    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as e:
        raise CheckpointError(f"{file} is corrupt or truncated ({e})") from e
    except OSError:
        # safetensors says "No such file or directory" whatever kept the file from
        # opening: opening it here raises the real error (permission denied, ...).
        with open(file, "rb"):
            pass
        raise


def _read_json(file: Path):
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e})") from e


def quant_spec(config: ModelConfig, quantized_modules: set[str] | None = None):
    """path → (group_size, bits) for every Linear, from the `quantization` block.

    ``quantized_modules``: the modules the checkpoint stores with `.scales` (as
    mlx-lm decides: it leaves a Linear dense, unlisted, when its input size does
    not divide by the group size); None trusts the config alone."""
    q = config.quantization or {}
    # Override keys are module paths without a trailing dot; canonical_name matches
    # prefixes like "language_model.lm_head." on tensor names, hence the dot.
    overrides = {canonical_name(k + ".")[:-1]: v for k, v in q.items() if isinstance(v, (dict, bool))}

    def spec(path: str) -> tuple[int, int]:
        if not q or (quantized_modules is not None and path not in quantized_modules):
            return 0, 0
        override = overrides.get(path)
        if override is False:
            return 0, 0
        if isinstance(override, dict):
            return int(override.get("group_size", q["group_size"])), int(override.get("bits", q["bits"]))
        return int(q["group_size"]), int(q["bits"])

    return spec


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        raw = _read_json(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in {path} (pickled checkpoints are not "
                              "loaded)")
    for f in files:
        if not f.exists():
            raise CheckpointError(f"checkpoint shard {f} listed in {index.name} is missing")
    return files


def canonical_name(name: str) -> str:
    """A tensor name with a multimodal wrapper's prefix (e.g. "language_model.model.")
    replaced by the plain decoder's ("model.")."""
    for old, new in _PREFIXES.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu",
               check_weights: bool = True, progress: bool = False, shard=None) -> Decoder:
    """check_weights: refuse a floating tensor holding NaN or inf, by one min/max pass
    over it as it is read, on the CPU in the checkpoint's dtype (measured on one core:
    ~0.25 s per GB of large tensors; ~17 ms of the bundled model's ~100 ms load); False
    skips the pass.
    progress: a bar on stderr (bytes read) once loading takes more than a second.

    shard: one tensor-parallel rank's part (`qfuse.parallel.sharding.RankShard`): the
    model is built with that rank's shapes (``shard.build(config, quant)``) and each
    tensor is read as that rank's slice (``shard.read(f, raw_name, name)``), so a rank
    never holds the whole checkpoint; every check below applies to the slices."""
    from tqdm import tqdm

    path = Path(path)
    if _is_gguf(path):
        if shard is not None:
            raise CheckpointError(f"{path}: tensor-parallel loading of a GGUF file is not "
                                  "supported")
        return _load_gguf(path, dtype, device, check_weights)
    config = check_checkpoint(path, tokenizer=False)
    files = safetensors_files(path)
    fmt = _format(config, path)
    if fmt is not None and shard is not None:
        raise CheckpointError(f"{path}: tensor-parallel loading of a "
                              f"{config.quantization['quant_method']} checkpoint is not "
                              "supported (convert it with `qfuse quantize` first)")
    with contextlib.ExitStack() as stack:
        if fmt is None:
            quantized = set()
            for file in files:
                with _open(file) as f:
                    quantized |= {canonical_name(n)[: -len(".scales")]
                                  for n in f.keys()  # noqa: SIM118
                                  if n.endswith(".scales")}
            try:
                spec = _fused_spec(quant_spec(config, quantized))
            except ValueError as e:  # e.g. a quantization block with bits or a group size MLX lacks
                raise CheckpointError(f"{path / 'config.json'}: {e}") from e
            items = _split_fused(_stored_tensors(files, shard), config, shard)
        else:
            handles = {file: stack.enter_context(_open(file)) for file in files}
            index = {n: h for h in handles.values() for n in h.keys()}  # noqa: SIM118
            try:
                converted = formats.Converted(fmt, config.quantization, index, canonical_name)
            except formats.FormatError as e:
                raise CheckpointError(f"{path}: {e}") from e
            spec = _fused_spec(converted.spec)
            items = _split_fused(_converted_tensors(converted, path), config, shard)
        try:
            model = shard.build(config, spec) if shard else Decoder(config, spec)
        except ValueError as e:  # e.g. a quantization block with bits or a group size MLX lacks
            raise CheckpointError(f"{path / 'config.json'}: {e}") from e
        expected = dict(model.state_dict())
        seen = set()
        bar = tqdm(total=sum(f.stat().st_size for f in files), desc="loading", unit="B",
                   unit_scale=True, file=sys.stderr, delay=1.0, disable=not progress,
                   leave=False)
        with bar:
            for raw_name, file, tensor in items:
                name = canonical_name(raw_name)
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name not in expected:
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # tied: the embedding serves as the head
                    raise CheckpointError(
                        f"checkpoint tensor {raw_name!r} ({file}) has no place in a "
                        f"{config.model_type} model of this config")
                tensor = tensor()
                bar.update(tensor.nbytes)
                _fill(expected[name], tensor, raw_name, file, check_weights)
                seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensors, "
                              f"e.g. {missing[:3]}")
    if fmt is not None:
        _gather_inputs(model, converted.input_perm)
    model = model.to(device=device, dtype=dtype)
    # One resident form per weight: the decode kernel's, where it will run (a GPU).
    model.hold_kernel_forms()
    return model


def _gather_inputs(model, perms: dict) -> None:
    """Give each act-order Linear its input permutation (`formats.Converted.input_perm`,
    by canonical module; a fused projection's input is each of its parts')."""
    for module, perm in perms.items():
        prefix, _, last = module.rpartition(".")
        for part in _FUSED.get(last, (last,)):
            model.get_submodule(f"{prefix}.{part}").input_perm = perm


def weight_sources(path: str | Path) -> dict[str, formats.Source]:
    """Canonical name (less ".weight") → how the checkpoint at ``path`` stores that weight
    (`formats.Source`: "awq 4-bit g128", "mlx 4-bit g64", "dense bfloat16", "gguf Q4_K"),
    from the headers alone (and GPTQ's small g_idx tensors); `qfuse info MODEL` prints it."""
    path = Path(path)
    if _is_gguf(path):
        return _open_gguf(path).sources()
    config = check_checkpoint(path, tokenizer=False)
    fmt = _format(config, path)
    out: dict[str, formats.Source] = {}
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(_open(f)) for f in safetensors_files(path)]
        index = {n: h for h in handles for n in h.keys()}  # noqa: SIM118
        raw = {canonical_name(n): n for n in index}
        owned: set[str] = set()
        if fmt is not None:
            try:
                converted = formats.Converted(fmt, config.quantization, index, canonical_name)
            except formats.FormatError as e:
                raise CheckpointError(f"{path}: {e}") from e
            out.update(converted.sources())
            owned = converted.owned
        scaled = {n[: -len(".scales")] for n in raw if n.endswith(".scales")}
        spec = quant_spec(config, scaled) if fmt is None else lambda m: (0, 0)

        def dtype(name):
            return formats.DTYPES.get(index[raw[name]].get_slice(raw[name]).get_dtype())

        for name, raw_name in raw.items():
            module, _, part = name.rpartition(".")
            if raw_name in owned or name.endswith(_IGNORED_SUFFIXES):
                continue
            if spec(module) != (0, 0):  # MLX groups: one line for weight, scales, biases
                if part == "weight":
                    group, bits = spec(module)
                    stored = dtype(f"{module}.scales")
                    out[module] = formats.Source(
                        f"mlx {bits}-bit g{group}",
                        stored=(stored, "scales, biases") if stored is not None else None)
                continue
            stored = dtype(name)
            out[name.removesuffix(".weight")] = formats.dense(stored) if stored is not None \
                else formats.Source(f"dense {index[raw_name].get_slice(raw_name).get_dtype()}")
    return out


def _is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and path.is_file()


def _open_gguf(path: Path):
    from .formats.gguf import GGUFCheckpoint

    try:
        return GGUFCheckpoint(path)
    except formats.FormatError as e:
        raise CheckpointError(str(e)) from e


@functools.lru_cache(maxsize=1)
def _gguf_metadata_at(path: str, mtime_ns: int, size: int) -> dict:
    from .formats.gguf_file import GGUFFile

    try:
        return GGUFFile(path).metadata
    except formats.FormatError as e:
        raise CheckpointError(str(e)) from e


def _gguf_metadata(path: Path) -> dict:
    """A .gguf file's metadata, parsed once while the file stays as it is (the tokenizer,
    its chat template and its special tokens all read it; a vocabulary of 150k tokens
    takes ~0.5 s to parse)."""
    st = path.stat()
    return _gguf_metadata_at(str(path.resolve()), st.st_mtime_ns, st.st_size)


def _gguf_config(gguf, path: Path) -> ModelConfig:
    try:
        return ModelConfig.from_dict(gguf.config)
    except UserError as e:
        raise CheckpointError(f"{path}: {e}") from e


def _load_gguf(path: Path, dtype, device, check_weights: bool) -> Decoder:
    """A Decoder from one .gguf file (`formats.gguf.GGUFCheckpoint`): quantized tensors
    converted to MLX groups one at a time, the rest copied, every `_fill` check applied."""
    gguf = _open_gguf(path)
    config = _gguf_config(gguf, path)
    model = Decoder(config, gguf.spec)
    expected = dict(model.state_dict())
    seen = set()
    for name, _, read in _converted_tensors(gguf, path):
        tensor = read()
        if name not in expected:
            raise CheckpointError(f"{path}: tensor {name!r} has no place in a "
                                  f"{config.model_type} model of this config")
        _fill(expected[name], tensor, name, path, check_weights)
        seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model = model.to(device=device, dtype=dtype)
    model.hold_kernel_forms()
    return model


def _format(config: ModelConfig, path: Path):
    """The `qfuse.formats` reader of a folder's quantization_config, None for MLX or
    dense; CheckpointError naming config.json for a format qfuse cannot read."""
    try:
        return formats.reader(config.quantization)
    except formats.FormatError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from e


def _stored_tensors(files: list[Path], shard):
    """(raw name, file, read) for every tensor of the shards, read as stored (or as one
    tensor-parallel rank's slice)."""
    for file in files:
        with _open(file) as f:
            for raw_name in f.keys():  # noqa: SIM118 -- safe_open is not iterable
                def read(f=f, raw_name=raw_name, file=file):
                    try:
                        return shard.read(f, raw_name, canonical_name(raw_name)) if shard \
                            else f.get_tensor(raw_name)
                    except SafetensorError as e:
                        raise CheckpointError(f"{file}: tensor {raw_name!r} is unreadable "
                                              f"({e})") from e
                yield raw_name, file, read


def _fused_spec(spec):
    """``spec`` (module path → (group size, bits)) that also answers for a part of a fused
    module (`...self_attn.q_proj` of a checkpoint holding `...self_attn.qkv_proj`) with the
    fused module's."""
    def spec_of(path: str) -> tuple[int, int]:
        head, _, module = path.rpartition(".")
        found = spec(path)
        if found == (0, 0) and module in _PART_OF:
            return spec(f"{head}.{_PART_OF[module]}")
        return found

    return spec_of


def _split_fused(items, config, shard):
    """``items`` (raw name, file, read) with each fused projection tensor (weight, MLX
    scales/biases, bias) given as its parts' row slices, named as the decoder names them.
    The fused tensor is read once, when its first part is, and released after its last."""
    D, I = config.head_dim, config.intermediate_size
    rows = {"qkv_proj": (config.num_attention_heads * D, config.num_key_value_heads * D,
                         config.num_key_value_heads * D),
            "gate_up_proj": (I, I)}
    for raw_name, file, read in items:
        head, _, tail = raw_name.rpartition(".")  # tail: weight, scales, biases or bias
        prefix, _, module = head.rpartition(".")
        if module not in _FUSED:
            yield raw_name, file, read
            continue
        if shard is not None:
            raise CheckpointError(f"{raw_name!r} ({file}): tensor-parallel loading of fused "
                                  "projections (qkv_proj, gate_up_proj) is not supported")
        whole = functools.cache(functools.partial(_fused_rows, read, raw_name, file,
                                                  sum(rows[module])))
        start = 0
        for part, n in zip(_FUSED[module], rows[module]):
            yield (f"{prefix}.{part}.{tail}", file,
                   lambda whole=whole, start=start, n=n: whole()[start:start + n])
            start += n


def _fused_rows(read, raw_name: str, file, expected: int) -> torch.Tensor:
    """The fused tensor ``raw_name``, after checking it has the rows its parts need."""
    tensor = read()
    if tensor.dim() == 0 or tensor.shape[0] != expected:
        raise CheckpointError(f"fused tensor {raw_name!r} ({file}) has shape "
                              f"{tuple(tensor.shape)}, the config implies {expected} rows")
    return tensor


def _converted_tensors(converted, path: Path):
    """(name, folder, read) for every tensor of a converted checkpoint (`qfuse.formats`),
    quantized modules already in the MLX layout; a FormatError becomes a CheckpointError."""
    tensors = converted.tensors()
    while True:
        try:
            raw_name, tensor = next(tensors)
        except StopIteration:
            return
        except formats.FormatError as e:
            raise CheckpointError(f"{path}: {e}") from e
        except SafetensorError as e:
            raise CheckpointError(f"{path}: a tensor is unreadable ({e})") from e
        yield raw_name, path, lambda tensor=tensor: tensor


def _fill(target: torch.Tensor, tensor: torch.Tensor, raw_name: str, file, check_weights: bool):
    """Copy checkpoint tensor ``tensor`` into the model's ``target``, after the checks
    that name it: shape, floats where floats go, finite values, uint32 codes."""
    if tuple(tensor.shape) != tuple(target.shape):
        raise CheckpointError(
            f"tensor {raw_name!r} ({file}) has shape {tuple(tensor.shape)}, the "
            f"config implies {tuple(target.shape)}")
    if target.is_floating_point() and not tensor.is_floating_point():
        # copy_ would convert the integers to floats without a word.
        raise CheckpointError(
            f"tensor {raw_name!r} ({file}) is {_dtype_name(tensor.dtype)}; "
            "the model keeps it as floats (float32, bfloat16 or float16)")
    if check_weights and tensor.is_floating_point() and not all_finite(tensor):
        raise CheckpointError(f"tensor {raw_name!r} ({file}) holds NaN or "
                              "inf (a broken save or training run)")
    if target.dtype == torch.uint32:
        if tensor.dtype not in (torch.uint32, torch.int32):
            raise CheckpointError(f"quantized tensor {raw_name!r} ({file}) must be "
                                  f"uint32, got {tensor.dtype}")
        target.view(torch.int32).copy_(tensor.view(torch.int32))
    else:
        target.copy_(tensor)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite: its min and max are (NaN propagates
    into both, an inf shows in one), one pass without a tensor of flags."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _dtype_name(dtype: torch.dtype) -> str:
    """float32, int32, uint8, ... (without torch's "torch." prefix)."""
    return str(dtype).removeprefix("torch.")


def _with_generation_eos(config: ModelConfig, path: Path) -> ModelConfig:
    """Add generation_config.json's end-of-sequence ids (chat models end turns there:
    gemma-2-it lists [1, 107] where config.json has only 1)."""
    gen = path / "generation_config.json"
    if not gen.exists():
        return config
    raw = _read_json(gen)
    eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
    eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
    merged = tuple(dict.fromkeys([*config.eos_token_ids, *eos]))
    return dataclasses.replace(config, eos_token_ids=merged)


def _folder(path: str | Path) -> Path:
    """Where a model's tokenizer files sit: the folder, or the folder of a .gguf file."""
    path = Path(path)
    return path.parent if _is_gguf(path) else path


def _lone_gguf(path: str | Path) -> Path | None:
    """The .gguf file ``path`` when no tokenizer.json sits beside it (its tokenizer, chat
    template and special tokens then come from its metadata), else None."""
    path = Path(path)
    return path if _is_gguf(path) and not (path.parent / "tokenizer.json").exists() else None


def load_tokenizer(path: str | Path):
    """The `tokenizers` tokenizer from tokenizer.json, or from the metadata of a .gguf file
    with none beside it (CheckpointError if missing or broken)."""
    from tokenizers import Tokenizer

    gguf = _lone_gguf(path)
    if gguf is not None:
        from .formats import gguf_tokenizer

        try:
            return gguf_tokenizer.build(_gguf_metadata(gguf))
        except formats.FormatError as e:
            raise CheckpointError(f"{gguf}: {e}") from e
    file = _folder(path) / "tokenizer.json"
    if not file.exists():
        raise CheckpointError(f"no tokenizer.json in {_folder(path)}")
    try:
        # Read here, not by the library: an unreadable file then says why (permission
        # denied is an OSError of its own, not "not a tokenizer").
        return Tokenizer.from_str(file.read_text(encoding="utf-8"))
    except OSError:
        raise
    except Exception as e:  # `tokenizers` raises a bare Exception
        raise CheckpointError(f"{file} is not a tokenizer the tokenizers library reads ({e})") from e


def load_chat_template(path: str | Path) -> str | None:
    """The chat template string of tokenizer_config.json (or chat_template.jinja), if any;
    for a .gguf file without those beside it, its metadata's `tokenizer.chat_template`."""
    gguf, path = Path(path), _folder(path)
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text()
    cfg = path / "tokenizer_config.json"
    if not cfg.exists():
        if _is_gguf(gguf):
            from .formats import gguf_tokenizer

            try:
                return gguf_tokenizer.chat_template(_gguf_metadata(gguf))
            except formats.FormatError as e:
                raise CheckpointError(f"{gguf}: {e}") from e
        return None
    raw = _read_json(cfg)
    template = raw.get("chat_template") if isinstance(raw, dict) else None
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


# Without a chat template the model would go on to write the user's next turn: this
# stop string ends its reply there (`qfuse chat` and `qfuse serve` both add it).
PLAIN_STOP = "\nUser:"


def render_plain(messages: list[dict]) -> str:
    """A conversation for a model without a chat template: one "Role: text" line per
    message, then "Assistant:" for the reply (end it at PLAIN_STOP)."""
    turns = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
    return turns + "Assistant:"


def render_chat(template: str, messages: list[dict], special_tokens: dict | None = None) -> str:
    """Render a chat template with a sandboxed jinja2 environment, as HF does
    (messages, add_generation_prompt=True, plus the special tokens it names)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise CheckpointError(f"chat template: {message}")

    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                **(special_tokens or {}))
    except TemplateError as e:
        raise CheckpointError(f"chat template: {e}") from e


def special_tokens(path: str | Path) -> dict:
    """The special tokens a chat template may name (bos/eos/pad/unk), from the folder's
    tokenizer_config.json, or a .gguf file's metadata without one beside it; {} without
    either."""
    cfg = _folder(path) / "tokenizer_config.json"
    if not cfg.exists():
        if _is_gguf(Path(path)):
            from .formats import gguf_tokenizer

            try:
                return gguf_tokenizer.special_tokens(_gguf_metadata(Path(path)))
            except formats.FormatError as e:
                raise CheckpointError(f"{path}: {e}") from e
        return {}
    raw = _read_json(cfg)
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = raw.get(key) if isinstance(raw, dict) else None
        out[key] = value.get("content") if isinstance(value, dict) else value
    return out
