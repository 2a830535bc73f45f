"""A dense model folder written as one .gguf file as llama.cpp's converter writes it, for
the gates (`qfuse bench gate --parts formats`) and the tests of the GGUF reader (`gguf`).

`write_gguf(src, dst, kind)` makes the new folder ``dst`` holding `model.gguf` and the
model's tokenizer files (the loader reads a tokenizer.json beside a .gguf file before the
file's own metadata, which here carries only the bos/eos ids), and returns the file's path.
Kinds (`KINDS`):

- "gguf-q8_0": every matrix Q8_0, as `convert_hf_to_gguf.py --outtype q8_0` writes;
- "gguf-q4_0": the decoder projections Q4_0, the token embedding (and an untied head) Q8_0:
  llama-quantize's Q4_0 gives those Q6_K, which the `gguf` package cannot quantize, and
  Q8_0 is the nearest type it can.

Blocks come from the `gguf` package's own quantizers (`gguf.quants.quantize`: ggml's round
to nearest, Q8_0 d = max|w|/127, Q4_0 d = −(the value of largest magnitude)/8) over the
weights in float32; vectors (norms, biases) are F32, as the converter keeps them.

Architectures, as the converter maps them (`gguf.LAYER_NAMES`, `GEMMA3_NAMES`):

- Gemma 3 text → "gemma3": every `*norm.weight` stored as 1 + w in float32 (the
  converter adds Gemma3RMSNorm's 1); the global layers' RoPE base as `rope.freq_base`, the
  local ones' as `rope.freq_base_swa`, `attention.sliding_window`. llama.cpp's gemma3
  loader takes every sixth layer as global and its attention scale as 1/sqrt(head_dim)
  (1/sqrt(hidden/heads) at 62 layers), whatever the file says: a model whose
  query_pre_attn_scalar gives another scale is refused (UserError), and one whose layer
  types are not every sixth global gets `attention.sliding_window_pattern` (one bool a
  layer, true: sliding), which qfuse reads and llama.cpp does not.
- Llama → "llama": q/k rows interleaved per head (the converter's permute).
- Qwen 2 / Qwen 3 → "qwen2" / "qwen3" (Qwen 2's q/k/v biases F32).

RoPE scaling of type linear is written as `rope.scaling.*`; other types are refused.
``dst`` must not exist (nothing is overwritten).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..models import ModelConfig
from . import gguf as reader
from .write_checks import dense_source_config, dense_state

# kind → (GGML type of the decoder projections, of the embedding and an untied head)
KINDS = {"gguf-q8_0": ("Q8_0", "Q8_0"), "gguf-q4_0": ("Q4_0", "Q8_0")}
# HF model_type → GGUF architecture
ARCHITECTURES = {"gemma3_text": "gemma3", "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
FILE_NAME = "model.gguf"


def bits(kind: str) -> int:
    """The bits of a kind's decoder projections (Q8_0: 8, Q4_0: 4)."""
    return 8 if KINDS[kind][0] == "Q8_0" else 4


def require_gguf() -> None:
    """UserError (one line) unless the `gguf` package can be imported."""
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise UserError("writing a GGUF file needs the gguf package (pip install gguf)") from e


def _hf_to_gguf(arch: str) -> dict[str, str]:
    """HF module names (after "model.layers.N." or at the top) → GGUF stems."""
    names = {hf: g for g, hf in reader.layer_names(arch).items()}
    return names | {hf: g for g, hf in reader.TOP_NAMES.items()}


def _check(cfg: ModelConfig, arch: str) -> None:
    """UserError for what a GGUF file of ``arch`` cannot say as the model has it."""
    full = cfg.rope["full_attention"]
    if full.rope_type not in ("default", "linear") or full.freq_factors:
        raise UserError(f"RoPE scaling {full.rope_type!r} is not written to GGUF by qfuse "
                        "(it writes none and linear)")
    if arch == "gemma3":
        scalar = reader.gemma3_attn_scalar(cfg.hidden_size, cfg.num_attention_heads,
                                           cfg.head_dim, cfg.num_hidden_layers)
        if cfg.attn_scale != scalar ** -0.5:
            raise UserError("query_pre_attn_scalar gives an attention scale llama.cpp's gemma3 "
                            "does not use (1/sqrt(head_dim); hidden/heads at 62 layers)")
        if cfg.rope["sliding_attention"].rope_type != "default":
            raise UserError("scaled RoPE on Gemma 3's local layers has no GGUF key")
    elif "sliding_attention" in cfg.layer_types:
        raise UserError(f"sliding-window layers of a {cfg.model_type} model are not written "
                        "to GGUF by qfuse")
    if len(cfg.eos_token_ids) > 3:
        raise UserError(f"{len(cfg.eos_token_ids)} eos ids; GGUF names three (eos, eot, eom)")


def _metadata(w, cfg: ModelConfig, arch: str, kind: str) -> None:
    import gguf

    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if KINDS[kind][0] == "Q8_0"
                    else gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    full = cfg.rope["full_attention"]
    w.add_rope_freq_base(full.theta)
    if full.rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full.factor)
    if arch == "llama":
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_vocab_size(cfg.vocab_size)
    if arch == "gemma3":
        w.add_rope_freq_base_swa(cfg.rope["sliding_attention"].theta)
        w.add_sliding_window(cfg.sliding_window or cfg.max_position_embeddings)
        sliding = [t == "sliding_attention" for t in cfg.layer_types]
        period = [i % reader.GEMMA3_PERIOD < reader.GEMMA3_PERIOD - 1
                  for i in range(cfg.num_hidden_layers)]
        if sliding != period:  # llama.cpp's gemma3 would not run these layer types
            w.add_sliding_window_pattern(sliding)
        if cfg.final_logit_softcapping is not None:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    for key, token in zip(("eos", "eot", "eom"), cfg.eos_token_ids):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", int(token))
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(int(cfg.bos_token_id))


def converter_permute(w, heads: int):
    """llama.cpp's converter's q/k permute (a numpy array or a tensor): HF rows → GGUF
    rows (each head's two RoPE halves interleaved; `gguf.GGUFCheckpoint._unpermute` undoes
    it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def write_gguf(src: str | Path, dst: str | Path, kind: str) -> Path:
    """``dst``/model.gguf of format ``kind`` (`KINDS`) from the dense safetensors model
    folder ``src``, its tokenizer files beside it (module docstring). Returns the file."""
    if kind not in KINDS:
        raise UserError(f"unknown GGUF kind {kind!r} (one of {', '.join(KINDS)})")
    require_gguf()
    import gguf
    from gguf import quants

    src, dst = Path(src), Path(dst)
    raw = dense_source_config(src, dst, "GGUF file")
    cfg = ModelConfig.from_dict(raw)
    arch = ARCHITECTURES.get(cfg.model_type)
    if arch is None:
        raise UserError(f"a {cfg.model_type} model is not written to GGUF by qfuse (it writes "
                        f"{', '.join(ARCHITECTURES)})")
    _check(cfg, arch)
    projection, embedding = (gguf.GGMLQuantizationType[t] for t in KINDS[kind])
    names = _hf_to_gguf(arch)
    state = dense_state(src)
    dst.mkdir(parents=True)
    path = dst / FILE_NAME
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, cfg, arch, kind)
    for name, tensor in state.items():
        module, _, suffix = name.rpartition(".")
        parts = module.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 3:
            stem = names.get(".".join(parts[3:]))
            gname = f"blk.{parts[2]}.{stem}.{suffix}"
        else:
            stem = names.get(module)
            gname = f"{stem}.{suffix}"
        if stem is None:
            raise UserError(f"{src}: tensor {name!r} has no GGUF name in a {arch} file")
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the embedding serves
        data = tensor.to(torch.float32).numpy()  # as the converter widens bf16
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + np.float32(1)  # Gemma3RMSNorm's (1 + w), as the converter adds it
        if arch == "llama" and stem in ("attn_q", "attn_k"):
            data = converter_permute(data, cfg.num_attention_heads if stem == "attn_q"
                               else cfg.num_key_value_heads)
        if data.ndim != 2:
            w.add_tensor(gname, np.ascontiguousarray(data))
            continue
        qtype = embedding if stem in ("token_embd", "output") else projection
        if data.shape[1] % 32:
            raise UserError(f"{src}: tensor {name!r} has rows of {data.shape[1]} values, not "
                            "whole blocks of 32 (Q8_0, Q4_0)")
        w.add_tensor(gname, quants.quantize(np.ascontiguousarray(data), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    return path
