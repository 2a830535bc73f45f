"""Model configuration read from a Hugging Face `config.json`, with HF field names.

One config class serves every supported family (Llama, Mistral, Phi-3/Phi-4, Qwen 2/3,
Gemma 2/3). What differs between families
is expressed as fields (norm offset, extra norms, embedding scale, q/k norm,
biases, soft-caps, per-layer attention type), filled from the family's
defaults where config.json is silent, so the decoder has no per-model
branches. Unknown fields are ignored; a missing required field, a size that is
not a positive integer (vocabulary, widths, layers, heads, head_dim, context,
window), heads that do not divide as the model needs, an inconsistent shape or
an unsupported family or RoPE (a partial_rotary_factor other than 1) is a `ConfigError`
naming the field (and, from `from_file`, the file), before anything is allocated.

RoPE: default, linear, Llama 3 and LongRoPE (Phi-3's "longrope", once "su"): short and
long per-frequency divisors, the long ones for a sequence longer than
original_max_position_embeddings (as HF picks them, by the sequence's length), and a
cos/sin scale (`attention_factor`) from max_position_embeddings / original. A
`freq_factors` list in rope_scaling (qfuse's own key, no HF field: a GGUF file's
`rope_freqs` tensor, llama.cpp's form of Llama 3.1's scaling) divides each frequency by
its factor, after the rope_type's own scaling (not with LongRoPE, whose factors those are).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..reference import ACTIVATION_ALIASES

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "phi3", "qwen2", "qwen3", "gemma2", "gemma3_text")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")

# Family traits: what a family's HF implementation does that config.json does not say.
_FAMILY = {
    "llama": {"norm_unit_offset": False, "sandwich_norms": False, "embed_scale": False,
               "qk_norm": False, "default_act": "silu", "default_bias": False},
    "mistral": {"norm_unit_offset": False, "sandwich_norms": False, "embed_scale": False,
                "qk_norm": False, "default_act": "silu", "default_bias": False},
    # Phi-3/Phi-4: Llama-shaped; its fused qkv_proj/gate_up_proj are split as they load.
    "phi3": {"norm_unit_offset": False, "sandwich_norms": False, "embed_scale": False,
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
    # Mistral 7B v0.1 slides over 4096 tokens; v0.2+ write "sliding_window": null.
    "mistral": {"sliding_window": 4096, "max_position_embeddings": 4096 * 32,
                "bos_token_id": 1, "eos_token_id": 2},
    # Phi3Config always has original_max_position_embeddings, and HF lets it win over
    # rope_scaling's own.
    "phi3": {"max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 32000},
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
    # LongRoPE: the divisors of the frequencies (head_dim/2 each) at or below, and past,
    # original_max_position_embeddings tokens; cos and sin are multiplied by attention_factor.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    # Divisors of the frequencies (head_dim/2) after the type's scaling (GGUF's rope_freqs).
    freq_factors: tuple[float, ...] = ()


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
        if mt in ("mistral", "phi3") and raw.get("sliding_window") is not None:
            layer_types = ("sliding_attention",) * n_layers  # every layer, as HF masks them
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
            rope=_rope_configs(mt, raw, head_dim),
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


def _rope(params: dict | None, theta_default: float, mt: str, raw: dict,
          head_dim: int) -> RopeConfig:
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    # Phi3Config reads the old names "su" (and "yarn") as LongRoPE.
    if rope_type == "su" or (mt == "phi3" and rope_type == "yarn"):
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope_type {rope_type!r} is not supported; supported: "
                          f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise ConfigError(f"partial_rotary_factor {partial!r} is not supported (qfuse rotates "
                          "whole heads); supported: 1.0")
    rope = RopeConfig(
        theta=float(params.get("rope_theta", theta_default)), rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        freq_factors=_factors(params, "freq_factors", head_dim) if "freq_factors" in params
        else (),
    )
    if rope.freq_factors and rope_type == "longrope":
        raise ConfigError("freq_factors do not combine with longrope (its short_factor and "
                          "long_factor are its frequencies' divisors)")
    return _longrope(rope, params, raw, head_dim) if rope_type == "longrope" else rope


def _factors(params: dict, name: str, head_dim: int, owner: str = "") -> tuple[float, ...]:
    """params[name] as head_dim/2 divisors of the frequencies; ConfigError naming it
    (after ``owner``) unless a list of that many finite numbers above 0."""
    value = params.get(name)
    if not isinstance(value, list) or len(value) != head_dim // 2 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and v > 0 for v in value):
        raise ConfigError(f"{owner}{name} must be a list of {head_dim // 2} numbers above 0 "
                          f"(one per frequency of a head of {head_dim})")
    return tuple(float(v) for v in value)


def _longrope(rope: RopeConfig, params: dict, raw: dict, head_dim: int) -> RopeConfig:
    """LongRoPE's fields as HF reads them: the top-level original_max_position_embeddings
    first (Phi-3 keeps it there), then rope_scaling's, then max_position_embeddings; the
    factor, where not given, max_position_embeddings / original; the attention factor,
    where not given, sqrt(1 + ln(factor) / ln(original)) above a factor of 1."""
    original = raw.get("original_max_position_embeddings") \
        or params.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
    if not _is_positive_int(original):
        raise ConfigError(f"longrope needs original_max_position_embeddings, a positive "
                          f"integer, got {original!r}")
    factors = {name: _factors(params, name, head_dim, "longrope's ")
               for name in ("short_factor", "long_factor")}
    _check_positive_number(params, "factor")
    _check_positive_number(params, "attention_factor")
    factor = params.get("factor") or raw.get("max_position_embeddings", original) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(theta=rope.theta, rope_type="longrope", factor=float(factor),
                      original_max_position_embeddings=original,
                      attention_factor=float(attention), **factors)


def _rope_configs(mt: str, raw: dict, head_dim: int) -> dict[str, RopeConfig]:
    """RoPE per layer type, from `rope_parameters` (transformers 5) or the older
    `rope_theta` / `rope_scaling` / `rope_local_base_freq` fields."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = _rope(params["full_attention"], 10000.0, mt, raw, head_dim)
        local = _rope(params.get("sliding_attention") or params["full_attention"], full.theta,
                      mt, raw, head_dim)
        return {"full_attention": full, "sliding_attention": local}
    theta = raw.get("rope_theta", 1_000_000.0 if mt == "gemma3_text" else 10000.0)
    full = _rope({"rope_theta": theta, **(params or raw.get("rope_scaling") or {})}, theta,
                 mt, raw, head_dim)
    if mt == "gemma3_text":  # local layers: their own base and never scaled
        local = RopeConfig(theta=float(raw.get("rope_local_base_freq", 10000.0)))
    else:
        local = full
    return {"full_attention": full, "sliding_attention": local}
