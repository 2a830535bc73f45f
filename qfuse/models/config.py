"""Model configuration read from a Hugging Face `config.json`, with HF field names.

One config class serves every supported family. What differs between families
is expressed as fields (norm offset, extra norms, embedding scale, q/k norm,
biases, soft-caps, per-layer attention type), filled from the family's
defaults where config.json is silent, so the decoder has no per-model
branches. Unknown fields are ignored; a missing required field, a size that is
not a positive integer (vocabulary, widths, layers, heads, head_dim, context,
window), heads that do not divide as the model needs, an inconsistent shape or
an unsupported family is a `ConfigError` naming the field (and, from
`from_file`, the file), before anything is allocated.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..reference import ACTIVATION_ALIASES

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3_text")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Family traits: what a family's HF implementation does that config.json does not say.
_FAMILY = {
    "llama": {"norm_unit_offset": False, "sandwich_norms": False, "embed_scale": False,
               "qk_norm": False, "default_act": "silu", "default_bias": False},
    "qwen2": {"norm_unit_offset": False, "sandwich_norms": False, "embed_scale": False,
               "qk_norm": False, "default_act": "silu", "default_bias": True, "o_proj_bias": False},
    "qwen3": {"norm_unit_offset": False, "sandwich_norms": False, "embed_scale": False,
               "qk_norm": True, "default_act": "silu", "default_bias": False},
    "gemma2": {"norm_unit_offset": True, "sandwich_norms": True, "embed_scale": True,
               "qk_norm": False, "default_act": "gelu_pytorch_tanh", "default_bias": False},
    "gemma3_text": {"norm_unit_offset": True, "sandwich_norms": True, "embed_scale": True,
               "qk_norm": True, "default_act": "gelu_pytorch_tanh", "default_bias": False},
}
_REQUIRED = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "vocab_size")
# Sizes that must be positive integers wherever config.json gives them (null: the
# family's default or a value derived from the others, as in HF).
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
# What a family's HF config class assumes when config.json leaves a field out.
_FIELD_DEFAULTS = {
    "qwen2": {"max_window_layers": 28},
    "qwen3": {"head_dim": 128, "max_window_layers": 28},
    "gemma2": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "eos_token_id": 1, "bos_token_id": 2},
    "gemma3_text": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "eos_token_id": 1, "bos_token_id": 2},
}
# Gemma3TextConfig's defaults, which the sparse `text_config` of multimodal Gemma 3
# checkpoints relies on (google/gemma-3-4b-it lists only what differs).
_GEMMA3_TEXT_SIZES = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                      "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4}


class ConfigError(UserError, ValueError):
    """config.json does not describe a model qfuse supports. A ValueError too, for
    callers that caught ValueError before it existed."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    hidden_act: str
    attention_bias: bool  # biases on q/k/v (and o unless o_proj_bias says otherwise)
    o_proj_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None
    layer_types: tuple[str, ...]  # "full_attention" or "sliding_attention" per layer
    rope: dict[str, RopeConfig]  # per layer type
    attn_scale: float  # softmax scale
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    norm_unit_offset: bool  # Gemma: x·(1 + w)
    sandwich_norms: bool  # Gemma 2/3: norms after attention and around the MLP
    embed_scale: bool  # Gemma: embeddings × sqrt(hidden)
    qk_norm: bool  # Qwen 3, Gemma 3: RMSNorm on q and k per head
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    quantization: dict | None = field(default=None, compare=False)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"the config must be a JSON object, got {type(raw).__name__}")
        if raw.get("model_type") == "gemma3" and "text_config" in raw:
            top = {k: raw[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings",
                                       "quantization", "quantization_config") if k in raw}
            raw = {**_GEMMA3_TEXT_SIZES, **top, **raw["text_config"], "model_type": "gemma3_text"}
        raw = {**_FIELD_DEFAULTS.get(raw.get("model_type"), {}), **raw}
        mt = raw.get("model_type")
        # An unsupported family first: its missing fields would only hide the real cause.
        if mt is not None and mt not in _FAMILY:
            raise ConfigError(f"model_type {mt!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)} (and gemma3 with a text_config)")
        for name in _REQUIRED:
            if name not in raw:
                raise ConfigError(f"required field {name!r} is missing")
        fam = _FAMILY[mt]
        for name in _SIZES:
            _check_positive_int(raw, name)
        H, n_heads = raw["hidden_size"], raw["num_attention_heads"]
        n_kv = raw.get("num_key_value_heads") or n_heads
        if raw.get("head_dim") is None and H % n_heads:
            raise ConfigError(f"hidden_size ({H}) is not a multiple of num_attention_heads "
                              f"({n_heads}), and no head_dim says the size of a head")
        head_dim = raw.get("head_dim") or H // n_heads
        if head_dim % 2:  # RoPE rotates the two halves of each head
            raise ConfigError(f"head_dim must be even (RoPE rotates halves of a head), got "
                              f"{head_dim}")
        if n_heads % n_kv:
            raise ConfigError(
                f"num_attention_heads ({n_heads}) is not a multiple of num_key_value_heads ({n_kv})")
        if mt == "gemma3_text" and not raw.get("layer_types"):
            _check_positive_int(raw, "sliding_window_pattern")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping"):
            _check_positive_number(raw, name)
        n_layers = raw["num_hidden_layers"]
        layer_types = tuple(raw.get("layer_types") or _default_layer_types(mt, raw, n_layers))
        if mt in ("qwen2", "qwen3") and not raw.get("use_sliding_window"):
            layer_types = ("full_attention",) * n_layers  # HF drops the window then
        if len(layer_types) != n_layers:
            raise ConfigError(f"layer_types has {len(layer_types)} entries for {n_layers} layers")
        bad = set(layer_types) - {"full_attention", "sliding_attention"}
        if bad:
            raise ConfigError(f"layer_types holds unsupported attention types {sorted(bad)}")
        window = raw.get("sliding_window")
        if "sliding_attention" in layer_types and not _is_positive_int(window):
            raise ConfigError(f"sliding_attention layers need a sliding_window that is a "
                              f"positive integer, got {window!r}")
        act = raw.get("hidden_activation") or raw.get("hidden_act") or fam["default_act"]
        if act not in ACTIVATION_ALIASES:  # else the first forward would fail, not the load
            raise ConfigError(f"hidden activation {act!r} is not supported; supported: "
                              f"{', '.join(sorted(ACTIVATION_ALIASES))}")
        scalar = raw.get("query_pre_attn_scalar")
        eos = raw.get("eos_token_id")
        return cls(
            model_type=mt, hidden_size=H, intermediate_size=raw["intermediate_size"],
            num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_kv,
            head_dim=head_dim, vocab_size=raw["vocab_size"],
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            hidden_act=act,
            attention_bias=bool(raw.get("attention_bias", fam["default_bias"])),
            o_proj_bias=bool(raw.get("attention_bias", fam["default_bias"]))
            and fam.get("o_proj_bias", True),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", mt.startswith("gemma"))),
            max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
            sliding_window=window if "sliding_attention" in layer_types else None,
            layer_types=layer_types,
            rope=_rope_configs(mt, raw),
            attn_scale=(scalar if scalar else head_dim) ** -0.5,
            attn_logit_softcapping=raw.get("attn_logit_softcapping"),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            norm_unit_offset=fam["norm_unit_offset"], sandwich_norms=fam["sandwich_norms"],
            embed_scale=fam["embed_scale"], qk_norm=fam["qk_norm"],
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            bos_token_id=raw.get("bos_token_id"),
            quantization=raw.get("quantization") or raw.get("quantization_config"),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not UTF-8 text ({e.reason})") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} "
                              f"column {e.colno}") from e
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            # A field of the wrong kind ("hidden_size": "big") fails deep inside from_dict.
            raise ConfigError(f"{path}: a field has a value of the wrong kind ({e!r})") from e

    @property
    def embed_multiplier(self) -> float:
        return math.sqrt(self.hidden_size) if self.embed_scale else 1.0


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_positive_int(raw: dict, name: str) -> None:
    """ConfigError naming ``name`` unless raw[name] is absent, null or a positive integer
    (a negative vocab_size would otherwise fail deep inside torch.zeros)."""
    value = raw.get(name)
    if value is not None and not _is_positive_int(value):
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _check_positive_number(raw: dict, name: str) -> None:
    """ConfigError naming ``name`` unless raw[name] is absent, null or a finite number
    above 0 (a scale or soft-cap of 0 or below divides by zero or takes a negative root)."""
    value = raw.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a number above 0, got {value!r}")


def _default_layer_types(mt: str, raw: dict, n_layers: int) -> list[str]:
    if mt == "gemma2":  # even layers slide
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    if mt == "gemma3_text":  # every `sliding_window_pattern`-th layer is global
        pattern = raw.get("sliding_window_pattern", 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(n_layers)]
    if mt in ("qwen2", "qwen3") and raw.get("use_sliding_window") and raw.get("sliding_window"):
        first = raw["max_window_layers"]
        return ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    return ["full_attention"] * n_layers


def _rope(params: dict | None, theta_default: float) -> RopeConfig:
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope_type {rope_type!r} is not supported; supported: "
                          f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    return RopeConfig(
        theta=float(params.get("rope_theta", theta_default)), rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _rope_configs(mt: str, raw: dict) -> dict[str, RopeConfig]:
    """RoPE per layer type, from `rope_parameters` (transformers 5) or the older
    `rope_theta` / `rope_scaling` / `rope_local_base_freq` fields."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = _rope(params["full_attention"], 10000.0)
        local = _rope(params.get("sliding_attention") or params["full_attention"], full.theta)
        return {"full_attention": full, "sliding_attention": local}
    theta = raw.get("rope_theta", 1_000_000.0 if mt == "gemma3_text" else 10000.0)
    full = _rope({"rope_theta": theta, **(params or raw.get("rope_scaling") or {})}, theta)
    if mt == "gemma3_text":  # local layers: their own base and never scaled
        local = RopeConfig(theta=float(raw.get("rope_local_base_freq", 10000.0)))
    else:
        local = full
    return {"full_attention": full, "sliding_attention": local}
