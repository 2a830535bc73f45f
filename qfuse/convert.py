"""`qfuse quantize`: write an MLX-layout quantized checkpoint from an HF one, or rewrite an
AWQ, GPTQ or compressed-tensors one in the MLX layout (its own codes and groups, no
requantization: `qfuse.formats`).

Every Linear weight of the decoder (attention and MLP projections, the
embedding and an untied lm_head) becomes `<p>.weight` (uint32 packed),
`<p>.scales` and `<p>.biases`; norms and biases stay dense. config.json gains
`"quantization": {"group_size": g, "bits": b, <module path>: {...} | false}`,
which both qfuse and mlx-lm read.

The source is only read. Every request is checked before a byte is written (a
destination that is the source, a bad setting, an override naming no module, a
file system without room for the estimated output), and the new model appears
only once complete (`saving.staged_folder`: ``force`` replaces only the model
files qfuse writes and keeps every other file); the tokenizer, chat template
and generation config are copied beside the weights.
"""

from __future__ import annotations

import difflib
import json
import math
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from . import formats
from .errors import UserError
from .loading import canonical_name, safetensors_files
from .models import ModelConfig
from .quant import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, quantize
from .saving import EXTRA_FILES, check_destination, save_safetensors, staged_folder

# Weight names (after the model prefix) that are quantized: every Linear plus the embedding.
_QUANTIZABLE = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")
# Bytes per element of the safetensors dtypes a checkpoint may hold.
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
                "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def parse_overrides(items: list[str]) -> dict[str, dict | bool]:
    """`--override` values (MODULE=BITS[:GROUP] or MODULE=dense) as `quantize_checkpoint`'s
    ``overrides``; UserError naming a malformed one."""
    out: dict[str, dict | bool] = {}
    for item in items:
        module, _, value = item.partition("=")
        bits, _, group = value.partition(":")
        if not module or not value:
            raise UserError(f"--override {item!r}: expected MODULE=BITS[:GROUP] or MODULE=dense")
        if value == "dense":
            out[module] = False
            continue
        if not bits.isdigit() or (group and not group.isdigit()) or value.endswith(":"):
            raise UserError(f"--override {item!r}: expected MODULE=BITS[:GROUP] or MODULE=dense "
                            "with whole numbers")
        out[module] = {"bits": int(bits), **({"group_size": int(group)} if group else {})}
    return out


def _check_settings(bits, group_size, what: str) -> None:
    if bits not in SUPPORTED_BITS:
        raise UserError(f"{what}bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, "
                        f"got {bits!r}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise UserError(f"{what}group size must be one of "
                        f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))}, got {group_size!r}")


def _read_source(src: Path) -> tuple[dict, list[Path], dict[str, tuple[str, list[int], str]]]:
    """config.json, the weight files and each tensor's (raw name, shape, safetensors dtype)
    by canonical name, read from the headers alone; UserError if ``src`` is not a dense
    model folder."""
    if not src.is_dir():
        raise UserError(f"source {src} is not a folder" if src.exists()
                        else f"source {src} does not exist")
    if not (src / "config.json").is_file():
        raise UserError(f"source {src} has no config.json (not a model folder)")
    try:
        config = json.loads((src / "config.json").read_text())
        ModelConfig.from_dict(config)
    except (UserError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise UserError(f"source {src}/config.json: {e}") from e
    if config.get("quantization") or config.get("quantization_config"):
        raise UserError(f"source {src} is already quantized")
    try:
        files = safetensors_files(src)
        tensors = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for raw in f.keys():  # noqa: SIM118 -- safe_open is not iterable
                    info = f.get_slice(raw)
                    tensors[canonical_name(raw)] = (raw, list(info.get_shape()), info.get_dtype())
    except Exception as e:  # a missing or corrupt shard: safetensors raises its own types
        raise UserError(f"source {src}: {e}") from e
    return config, files, tensors


def _plan(tensors: dict, tied: bool, bits: int, group_size: int,
          overrides: dict) -> dict[str, tuple[int, int] | None]:
    """Module path → (group_size, bits), or None to keep it dense, for every quantizable
    module; UserError for an override naming no such module or settings that do not fit."""
    modules = {name[: -len(".weight")]: shape for name, (_, shape, _) in tensors.items()
               if name.endswith(_QUANTIZABLE) and len(shape) == 2
               and not (tied and name == "lm_head.weight")}  # tied: the embedding is the head
    plan: dict[str, tuple[int, int] | None] = {m: (group_size, bits) for m in modules}
    for key, spec in overrides.items():
        module = canonical_name(key + ".")[:-1]  # as the loader reads override keys
        if module not in modules:
            near = difflib.get_close_matches(module, modules, n=1) or sorted(modules)[:1]
            raise UserError(f"--override {key}: the source has no quantizable module of that "
                            f"name{f' (nearest: {near[0]})' if near else ''}")
        if spec is False:
            plan[module] = None
            continue
        if not isinstance(spec, dict) or set(spec) - {"bits", "group_size"}:
            raise UserError(f"--override {key}: expected bits/group_size or dense, got {spec!r}")
        g, b = spec.get("group_size", group_size), spec.get("bits", bits)
        _check_settings(b, g, f"--override {key}: ")
        plan[module] = (g, b)
    for module, setting in plan.items():
        if setting and modules[module][-1] % setting[0]:
            raise UserError(f"{module}: {modules[module][-1]} input features are not a multiple "
                            f"of group size {setting[0]} (--override {module}=dense keeps it dense)")
    return plan


def _setting(name: str, plan: dict) -> tuple[int, int] | None:
    """The (group_size, bits) tensor ``name`` is quantized with, or None to keep it dense:
    one rule for `_quantize_one` and for `_output_bytes`, its estimate."""
    return plan.get(name[: -len(".weight")]) if name.endswith(".weight") else None


def _output_bytes(src: Path, tensors: dict, plan: dict, tied: bool, dtype) -> int:
    """The bytes `quantize_checkpoint` will write (weights as `_quantize_one` makes them,
    plus the copied files), less the few kB of headers and config: what must be free."""
    total = sum((src / extra).stat().st_size for extra in EXTRA_FILES if (src / extra).is_file())
    for name, (_, shape, kind) in tensors.items():
        if name == "lm_head.weight" and tied:
            continue
        size = _DTYPE_BYTES.get(kind, 4)
        if dtype is not None and kind.startswith(("F", "BF")):
            size = dtype.itemsize
        setting = _setting(name, plan)
        n = math.prod(shape)
        if setting is None:
            total += n * size
        else:  # packed uint32 codes, and a scale and a bias (the input dtype) per group
            group_size, bits = setting
            total += n * bits // 8 + 2 * (n // group_size) * size
    return total


def quantize_checkpoint(src: str | Path, dst: str | Path, bits: int = 4, group_size: int = 64,
                        overrides: dict[str, dict | bool] | None = None, dtype=None,
                        force: bool = False) -> Path:
    """Quantize ``src`` into the new folder ``dst``; returns dst's absolute path.
    overrides: module path → {"bits", "group_size"}, or False to keep that module dense.

    Everything is checked before anything is written (UserError): dst must not be src, be
    inside it or hold it, and must be empty or absent unless ``force``; OSError (ENOSPC)
    naming dst if its file system lacks the room the output needs. The model is written
    into a temporary folder beside dst and moved into place when complete; ``force`` then
    replaces the model files of an existing dst and keeps every other file (see
    `saving.staged_folder`). A write error names dst, and leaves dst as it was."""
    src = Path(src)
    target = check_destination(dst, [src], force)
    _check_settings(bits, group_size, "")
    converted = _format_source(src)
    if converted is not None:
        if overrides:
            raise UserError(f"source {src} is a {converted} checkpoint: its modules keep the "
                            "bits and groups it has (--override does not apply)")
        return _write_converted(src, dst, dtype, force, target)
    config, files, tensors = _read_source(src)
    tied = ModelConfig.from_dict(config).tie_word_embeddings
    plan = _plan(tensors, tied, bits, group_size, overrides or {})
    quant_block: dict = {"group_size": group_size, "bits": bits}
    for module, setting in sorted(plan.items()):
        if setting != (group_size, bits):
            quant_block[module] = False if setting is None else dict(zip(("group_size", "bits"),
                                                                          setting))
    need = _output_bytes(src, tensors, plan, tied, dtype)
    with staged_folder(dst, [src], force, need) as tmp:
        out: dict[str, torch.Tensor] = {}
        with tqdm(total=len(tensors), desc="quantizing", unit="tensor", file=sys.stderr) as bar:
            for file in files:
                bar.set_postfix_str(file.name)
                with safe_open(str(file), framework="pt") as f:
                    for raw in f.keys():  # noqa: SIM118 -- safe_open is not iterable
                        _quantize_one(canonical_name(raw), f.get_tensor(raw), plan, tied, dtype, out)
                        bar.update()
        config["quantization"] = quant_block
        _write_mlx_folder(tmp, out, config, src)
    return target


def _write_mlx_folder(tmp, out: dict, config: dict, src) -> None:
    """The MLX folder's files into ``tmp``: the weights, config.json, and the source's
    tokenizer and generation files."""
    save_safetensors(out, tmp, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in EXTRA_FILES:
        if (src / extra).is_file():
            # copyfile, not copy: the new file takes this umask's mode, not the source's.
            shutil.copyfile(src / extra, tmp / extra)


def _format_source(src: Path) -> str | None:
    """The quant_method of an AWQ/GPTQ/compressed-tensors source folder, None otherwise
    (and for anything `_read_source` will refuse with its own message)."""
    try:
        raw = json.loads((src / "config.json").read_text())
        return raw["quantization_config"]["quant_method"] if formats.reader(
            raw.get("quantization_config")) is not None else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _write_converted(src: Path, dst, dtype, force: bool, target: Path) -> Path:
    """An AWQ/GPTQ/compressed-tensors folder rewritten in the MLX layout (`qfuse.formats`:
    the same codes, scales and biases −z·s, no requantization; scales and biases float32
    unless ``dtype``), one `quantization` block with an override per module whose group
    size or bits differ from the most common. Act-order folded into sibling rows
    (down_proj's) is written so; a module that gathers its input (act-order elsewhere)
    is refused naming its g_idx: the MLX layout has no input permutation, and writing
    its columns back in their own order would split its groups (re-quantizing would
    change the weights)."""
    from collections import Counter
    from contextlib import ExitStack

    config = json.loads((src / "config.json").read_text())
    files = safetensors_files(src)
    out: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
        index = {n: h for h in handles for n in h.keys()}  # noqa: SIM118
        try:
            conv = formats.Converted(formats.reader(config["quantization_config"]),
                                     config["quantization_config"], index, canonical_name)
            if conv.input_perm:
                module = next(iter(conv.input_perm))
                raise formats.FormatError(
                    f"{conv.perm_tensor[module]}: act-order groups on the input of {module} "
                    "need an input permutation, which the MLX layout cannot hold (load the "
                    "folder as it is: qfuse serves it)")
            for name, t in conv.tensors():
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                out[canonical_name(name)] = t.contiguous()
        except formats.FormatError as e:
            raise UserError(f"source {src}: {e}") from e
    settings = {m: conv.spec(m) for m in (canonical_name(n + ".")[:-1] for n in conv.modules)}
    group_size, bits = Counter(settings.values()).most_common(1)[0][0]
    block: dict = {"group_size": group_size, "bits": bits}
    for module, (g, b) in sorted(settings.items()):
        if (g, b) != (group_size, bits):
            block[module] = {"group_size": g, "bits": b}
    need = sum(t.numel() * t.element_size() for t in out.values())
    with staged_folder(dst, [src], force, need) as tmp:
        del config["quantization_config"]
        config["quantization"] = block
        _write_mlx_folder(tmp, out, config, src)
    return target


def _quantize_one(name: str, t: torch.Tensor, plan: dict, tied: bool, dtype,
                  out: dict[str, torch.Tensor]) -> None:
    """Put tensor ``name`` into ``out`` as the plan says: packed weight, scales and biases,
    or dense as it is."""
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    if name == "lm_head.weight" and tied:
        return  # tied: the (quantized) embedding is the head
    setting = _setting(name, plan)
    if setting is None:
        out[name] = t.contiguous()
        return
    module = name[: -len(".weight")]
    packed, scales, biases = quantize(t, *setting)
    out[f"{module}.weight"] = packed
    out[f"{module}.scales"] = scales
    out[f"{module}.biases"] = biases


def quantize_model(model, bits: int = 4, group_size: int = 64):
    """An in-memory copy of a dense Decoder with every Linear (and the embedding)
    quantized in the MLX layout, as `quantize_checkpoint` would write it."""
    from dataclasses import replace

    from .models import Decoder
    from .models.decoder import Linear
    from .quant import quantize

    cfg = replace(model.config, quantization={"group_size": group_size, "bits": bits})
    qmodel = Decoder(cfg, lambda path: (group_size, bits)).to(model.model.norm.weight.device)
    dense_modules = dict(model.named_modules())
    state = {}
    for name, module in qmodel.named_modules():
        if isinstance(module, Linear):  # Embedding is a Linear too
            src = dense_modules[name]
            packed, scales, biases = quantize(src.weight.detach(), group_size, bits)
            state[f"{name}.weight"], state[f"{name}.scales"] = packed, scales
            state[f"{name}.biases"] = biases
            if src.bias is not None:
                state[f"{name}.bias"] = src.bias.detach()
    for key, value in model.state_dict().items():
        state.setdefault(key, value)
    qmodel.load_state_dict(state)
    return qmodel.to(dtype=model.dtype)
