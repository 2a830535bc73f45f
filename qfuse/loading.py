"""Load checkpoints: HF safetensors (single or sharded) and MLX-quantized ones. Never pickle.

`load_model(path)` reads config.json, builds the Decoder with each Linear stored
as the checkpoint stores it (dense, or MLX `weight`/`scales`/`biases` with the
`quantization` block's group size and bits, per-module overrides included),
then fills it tensor by tensor, checking names and shapes. A missing tensor,
a wrong shape or (with ``check_finite``) a NaN/inf gets a ValueError naming
the tensor.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open

from .models import Decoder, ModelConfig

# The model `qfuse train` made for the package (issue 7): `qfuse generate` without a model.
DEFAULT_MODEL = Path(__file__).resolve().parent / "assets" / "default"

# Tensors some checkpoints carry that the model recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Multimodal Gemma 3 checkpoints nest the text model.
_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
             "language_model.lm_head.": "lm_head."}


def quant_spec(config: ModelConfig, quantized_modules: set[str] | None = None):
    """path → (group_size, bits) for every Linear, from the `quantization` block.

    ``quantized_modules``: the modules the checkpoint stores with `.scales` (as
    mlx-lm decides: it leaves a Linear dense, unlisted, when its input size does
    not divide by the group size); None trusts the config alone."""
    q = config.quantization or {}
    # Override keys are module paths without a trailing dot; _canonical matches
    # prefixes like "language_model.lm_head." on tensor names, hence the dot.
    overrides = {_canonical(k + ".")[:-1]: v for k, v in q.items() if isinstance(v, (dict, bool))}

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
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {path} (pickled checkpoints are not loaded)")
    for f in files:
        if not f.exists():
            raise ValueError(f"checkpoint shard {f.name} listed in the index is missing")
    return files


def _canonical(name: str) -> str:
    for old, new in _PREFIXES.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu",
               check_finite: bool = False) -> Decoder:
    path = Path(path)
    config = _with_generation_eos(ModelConfig.from_file(path), path)
    files = safetensors_files(path)
    quantized = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            quantized |= {_canonical(n)[: -len(".scales")] for n in f.keys()  # noqa: SIM118
                          if n.endswith(".scales")}
    model = Decoder(config, quant_spec(config, quantized))
    expected = dict(model.state_dict())
    seen = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for raw_name in f.keys():  # noqa: SIM118 -- safe_open is not iterable
                name = _canonical(raw_name)
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name not in expected:
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # tied: the embedding serves as the head
                    raise ValueError(f"checkpoint tensor {raw_name!r} ({file.name}) has no place "
                                     f"in a {config.model_type} model of this config")
                tensor = f.get_tensor(raw_name)
                target = expected[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"tensor {raw_name!r} has shape {tuple(tensor.shape)}, the "
                                     f"config implies {tuple(target.shape)}")
                if check_finite and tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    raise ValueError(f"tensor {raw_name!r} holds NaN or inf")
                if target.dtype == torch.uint32:
                    if tensor.dtype not in (torch.uint32, torch.int32):
                        raise ValueError(f"quantized tensor {raw_name!r} must be uint32, got {tensor.dtype}")
                    target.view(torch.int32).copy_(tensor.view(torch.int32))
                else:
                    target.copy_(tensor)
                seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return model.to(device=device, dtype=dtype)


def _with_generation_eos(config: ModelConfig, path: Path) -> ModelConfig:
    """Add generation_config.json's end-of-sequence ids (chat models end turns there:
    gemma-2-it lists [1, 107] where config.json has only 1)."""
    gen = path / "generation_config.json"
    if not gen.exists():
        return config
    eos = json.loads(gen.read_text()).get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
    merged = tuple(dict.fromkeys([*config.eos_token_ids, *eos]))
    return dataclasses.replace(config, eos_token_ids=merged)


def load_tokenizer(path: str | Path):
    """The `tokenizers` tokenizer from tokenizer.json (ValueError if missing)."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    if not file.exists():
        raise ValueError(f"no tokenizer.json in {path}")
    return Tokenizer.from_file(str(file))


def load_chat_template(path: str | Path) -> str | None:
    """The chat template string of tokenizer_config.json (or chat_template.jinja), if any."""
    path = Path(path)
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text()
    cfg = path / "tokenizer_config.json"
    if not cfg.exists():
        return None
    template = json.loads(cfg.read_text()).get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def render_chat(template: str, messages: list[dict], special_tokens: dict | None = None) -> str:
    """Render a chat template with a sandboxed jinja2 environment, as HF does
    (messages, add_generation_prompt=True, plus the special tokens it names)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            **(special_tokens or {}))
