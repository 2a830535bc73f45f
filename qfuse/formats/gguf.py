"""GGUF (llama.cpp) quantized tensors as MLX affine groups: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K.

Each row of a GGUF tensor is a run of blocks (ggml's layout, little-endian):

- Q4_0, 32 values in 18 bytes: d (float16), 16 bytes of nibbles (value j in the low
  nibble of byte j, value j + 16 in its high nibble); w = d·(q − 8) → 4-bit g32,
  scale d, bias −8d.
- Q4_1, 20 bytes: d, m (float16), the same nibbles; w = d·q + m → scale d, bias m.
- Q8_0, 34 bytes: d, 32 int8 q; w = d·q → 8-bit g32 codes q + 128, scale d, bias −128d.
- Q4_K, 256 values in 144 bytes: d, dmin (float16), 12 bytes of 6-bit scale and min codes
  (sc, m) for 8 sub-blocks of 32, 128 bytes of nibbles (64 values a 32-byte run: the
  low nibbles the first sub-block, the high nibbles the second); w = d·sc·q − dmin·m →
  4-bit g32, scale d·sc, bias −dmin·m.
- Q5_K, 176 bytes: as Q4_K, with 32 bytes `qh` after the scales holding each value's
  fifth bit (bit 2i of qh[l] for value l of the 64-run i's first half, bit 2i + 1 for its
  second) → 5-bit g32.

- Q6_K, 256 values in 210 bytes: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8
  scales (one per 16 values), d; w = d·sc·(q − 32). Groups of 16 have no MLX form (its
  groups are 32, 64 or 128), so a Q6_K tensor is held dense: `dense` computes ggml's
  float32 dequantization, which the model dtype rounds once.

Gemma 3 ("gemma3", as llama.cpp's converter writes it): its layers' names differ
(`ffn_norm` is the pre-feedforward norm, `post_attention_norm` and `post_ffw_norm` the
sandwich norms); every `*norm.weight` is stored as 1 + w in float32 (the converter adds
Gemma3RMSNorm's 1), so qfuse's unit-offset norms read w' − 1, refused in one line naming
the tensor where 1 + (w' − 1) is not w' in float32 (then qfuse's float32 norm would not
multiply by what llama.cpp multiplies by); each layer's six norms must be there. The rest
is llama.cpp's gemma3 loader's reading: layer i is local (sliding) unless i % 6 == 5 (or
as `attention.sliding_window_pattern` lists them: one bool a layer, or a period n),
`attention.sliding_window` is the window, `rope.freq_base` the global layers' base and
`rope.freq_base_swa` the local ones' (10000 where absent, llama.cpp's fixed value); the
attention scale is 1/sqrt(head_dim), 1/sqrt(hidden/heads) for the 62-layer model (the
file keeps no query_pre_attn_scalar: llama.cpp's rule, as query_pre_attn_scalar); the
embedding scale sqrt(hidden) is the family's; no `output.weight` means tied.

Llama 3.1's RoPE scaling reaches a GGUF file as the F32 tensor `rope_freqs.weight`
[head_dim/2]: llama.cpp divides each rotary frequency by its factor (its converter computes
them from rope_scaling's llama3 parameters, which the metadata does not keep). It is read
into the config (rope_scaling's `freq_factors`, `models.config`), not as a weight.

Precision: the scale d·sc and the bias −dmin·m (or −8d, −128d, m) are exact in float32
(at most 11 + 6 significant bits), so the groups read back exactly what ggml's
dequantization computes in float32; a float16/bfloat16 model rounds them once each, as
`groups` states. The other GGUF types are refused with one line naming the tensor.

`gguf_file.GGUFFile` reads the container (no dependency); `gguf_tokenizer` builds the
file's own tokenizer from its metadata.
"""

from __future__ import annotations

import torch

from ..quant import pack
from .gguf_file import GGUFFile
from .groups import FormatError
from .sources import Source

# type name → (values per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144),
          "Q5_K": (256, 176)}


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of every block [..., nbytes] (uint8), as float32 [..., 1]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes → [..., 2n] codes: the low nibbles, then the high ones."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit (scale, min) codes of a K-quant super-block from its 12 bytes."""
    s = s.to(torch.int64)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1), torch.cat([lo_m, hi_m], -1)


def dense(data: torch.Tensor, qtype: str, n_cols: int, what: str) -> torch.Tensor:
    """float32 [rows, n_cols] of a Q6_K tensor's bytes (uint8 [rows, row bytes]), computed
    as ggml computes it ((d·sc)·(q − 32) in float32)."""
    if qtype != "Q6_K":
        raise FormatError(f"{what}: GGUF type {qtype} is not held dense")
    rows = data.shape[0]
    if n_cols % 256 or data.shape[-1] != n_cols // 256 * 210:
        raise FormatError(f"{what}: {data.shape[-1]} bytes a row do not hold {n_cols} "
                          "Q6_K values")
    b = data.reshape(rows, n_cols // 256, 210)
    ql = b[..., :128].to(torch.int64).reshape(rows, -1, 2, 64)  # [.., half, 64]
    qh = b[..., 128:192].to(torch.int64).reshape(rows, -1, 2, 1, 32)
    sc = b[..., 192:208].contiguous().view(torch.int8).to(torch.float32)  # [.., 16]
    d = _f16(b, 208)
    low = torch.cat([ql & 0xF, ql >> 4], dim=-1).reshape(rows, -1, 2, 4, 32)  # 4 runs of 32
    high = (qh >> (2 * torch.arange(4).view(4, 1))) & 3  # run r: bits 2r, 2r + 1 of qh[l]
    q = (low | (high << 4)) - 32  # [rows, blocks, half, run, 32]
    scale = (d * sc).reshape(rows, -1, 2, 4, 2, 1)  # one per 16 values
    w = scale * q.reshape(rows, -1, 2, 4, 2, 16).to(torch.float32)
    return w.reshape(rows, n_cols)


def to_mlx(data: torch.Tensor, qtype: str, n_cols: int, what: str):
    """(packed uint32 [rows, n_cols·bits/32], scales, biases float32 [rows, n_cols/32],
    group size 32, bits) of a GGUF tensor's bytes ``data`` (uint8 [rows, row bytes])."""
    if qtype not in BLOCKS:
        raise FormatError(f"{what}: GGUF type {qtype} is not supported (qfuse reads "
                          f"{', '.join(BLOCKS)})")
    per, nbytes = BLOCKS[qtype]
    rows = data.shape[0]
    if n_cols % per or data.shape[-1] != n_cols // per * nbytes:
        raise FormatError(f"{what}: {data.shape[-1]} bytes a row do not hold {n_cols} "
                          f"{qtype} values")
    b = data.reshape(rows, n_cols // per, nbytes)
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        d = _f16(b, 0)
        if qtype == "Q8_0":
            q = b[..., 2:].contiguous().view(torch.int8).to(torch.int64) + 128
            scale, bias, bits = d, -128 * d, 8
        else:
            start = 2 if qtype == "Q4_0" else 4
            q = _nibbles(b[..., start:start + 16]).to(torch.int64)
            scale, bias, bits = d, (-8 * d if qtype == "Q4_0" else _f16(b, 2)), 4
        codes = q.reshape(rows, n_cols)
        return (pack(codes, bits), scale.reshape(rows, -1), bias.reshape(rows, -1), 32, bits)
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k_scales(b[..., 4:16])
    qs = b[..., -128:].reshape(rows, -1, 4, 32)  # 4 runs of 64 values a super-block
    q = _nibbles(qs).to(torch.int64)  # [rows, blocks, 4, 64]
    bits = 4
    if qtype == "Q5_K":
        qh = b[..., 16:48].to(torch.int64)  # [rows, blocks, 32]
        shift = torch.arange(8).view(4, 2, 1)  # run i: bits 2i (first half), 2i + 1
        high = (qh.unsqueeze(-2).unsqueeze(-2) >> shift) & 1  # [rows, blocks, 4, 2, 32]
        q = q + 16 * high.reshape(*q.shape)
        bits = 5
    scale = (d * sc.to(torch.float32)).reshape(rows, -1)
    bias = (-(dmin * m.to(torch.float32))).reshape(rows, -1)
    return pack(q.reshape(rows, n_cols), bits), scale, bias, 32, bits


# --- whole files ---------------------------------------------------------------------------

# GGUF architecture → the HF model_type whose tensors and config it carries.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
# GGUF tensor names (after "blk.N.") → HF names (after "model.layers.N.").
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's norms (llama.cpp's names for its sandwich): over LAYER_NAMES.
GEMMA3_NAMES = {"ffn_norm": "pre_feedforward_layernorm",
                "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
ROPE_FREQS = "rope_freqs.weight"  # RoPE frequency divisors: read into the config
_DENSE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_HELD_DENSE = ("Q6_K",)  # quantized, but with no MLX form: dequantized at load
GEMMA3_LAYER_NORMS = ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm",
                      "attn_q_norm", "attn_k_norm")
GEMMA3_PERIOD = 6  # llama.cpp's gemma3: every sixth layer global
GEMMA3_LOCAL_BASE = 10000.0  # llama.cpp's gemma3: the local layers' RoPE base


def layer_names(arch: str = "llama") -> dict[str, str]:
    """GGUF layer tensor names → HF ones for GGUF architecture ``arch``."""
    return {**LAYER_NAMES, **GEMMA3_NAMES} if arch == "gemma3" else LAYER_NAMES


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The HF tensor name of a GGUF one (blk.3.attn_q.weight → model.layers.3.self_attn.
    q_proj.weight) in a file of GGUF architecture ``arch``, None for a name qfuse does not
    know."""
    stem, _, kind = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        hf = layer_names(arch).get(part)
        return f"model.layers.{layer}.{hf}.{kind}" if hf and layer.isdigit() else None
    hf = TOP_NAMES.get(stem)
    return f"{hf}.{kind}" if hf else None



def gemma3_attn_scalar(hidden: int, heads: int, head_dim: int, layers: int) -> int:
    """Gemma 3's query_pre_attn_scalar as llama.cpp takes it (a GGUF file keeps none):
    head_dim, but hidden/heads (integers) for the 62-layer model."""
    return hidden // heads if layers == 62 else head_dim

class GGUFCheckpoint:
    """One .gguf file: `config` (a config.json-like dict from the metadata), `spec(path)`
    and `tensors()` as `formats.Converted` serves them. FormatError (one line) for a
    truncated file, an unknown architecture, a tensor type without an exact MLX form."""

    def __init__(self, path):
        file = GGUFFile(path)
        self.path = path
        self.metadata = file.metadata
        self.tensors_by_name = {t.name: t for t in file.tensors}
        self.arch = self.metadata.get("general.architecture")
        self.config = self._config()
        self._spec = {}
        for t in file.tensors:
            if t.name == ROPE_FREQS:
                continue
            hf = hf_name(t.name, self.arch)
            if hf is None:
                raise FormatError(f"{path}: tensor {t.name} has no place in a "
                                  f"{self.config['model_type']} model")
            if t.type in BLOCKS and hf.endswith(".weight") and len(t.shape) == 2:
                self._spec[hf[: -len(".weight")]] = (32, 5 if t.type == "Q5_K" else
                                                     8 if t.type == "Q8_0" else 4)
            elif t.type not in (*_DENSE, *_HELD_DENSE):
                raise FormatError(f"{path}: tensor {t.name} is {t.type}, which qfuse does not "
                                  f"read (it reads {', '.join((*BLOCKS, *_HELD_DENSE))} and "
                                  "float tensors)")
        if self.arch == "gemma3":
            self._check_gemma3_norms()

    def _check_gemma3_norms(self) -> None:
        """Every norm of a Gemma 3 layer and the final one, F32/F16/BF16 vectors (they
        hold 1 + w: `_unit_offset`); FormatError naming the first one missing."""
        names = [f"blk.{i}.{n}.weight" for i in range(self.config["num_hidden_layers"])
                 for n in GEMMA3_LAYER_NORMS] + ["output_norm.weight"]
        for name in names:
            t = self.tensors_by_name.get(name)
            if t is None:
                raise FormatError(f"{self.path}: tensor {name} is missing (a gemma3 model has "
                                  "it: its norms are " + ", ".join(GEMMA3_LAYER_NORMS) +
                                  " in every layer, and output_norm)")
            if t.type not in _DENSE:
                raise FormatError(f"{self.path}: tensor {name} is {t.type}; a gemma3 norm is "
                                  "read from float tensors (F32, F16, BF16) only")

    def _unit_offset(self, name: str) -> bool:
        """Whether tensor ``name`` holds 1 + w (llama.cpp's converter adds Gemma's 1)."""
        return self.arch == "gemma3" and name.endswith("norm.weight")

    def _field(self, key: str, default=None):
        arch = self.metadata.get("general.architecture")
        value = self.metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise FormatError(f"{self.path}: the metadata lacks {arch}.{key}")
        return value

    def _config(self) -> dict:
        arch = self.metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise FormatError(f"{self.path}: GGUF architecture {arch!r} is not supported "
                              f"(qfuse reads {', '.join(ARCHITECTURES)})")
        embed = self.tensors_by_name.get("token_embd.weight")
        if embed is None:
            raise FormatError(f"{self.path}: tensor token_embd.weight is missing")
        heads = int(self._field("attention.head_count"))
        hidden = int(self._field("embedding_length"))
        head_dim = int(self._field("attention.key_length", hidden // heads))
        value_dim = int(self._field("attention.value_length", head_dim))
        if value_dim != head_dim:
            raise FormatError(f"{self.path}: {arch}.attention.value_length is {value_dim}, "
                              f"key_length {head_dim}; qfuse's heads have one size")
        cfg = {
            "model_type": ARCHITECTURES[arch],
            "hidden_size": hidden,
            "intermediate_size": int(self._field("feed_forward_length")),
            "num_hidden_layers": int(self._field("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._field("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "vocab_size": int(embed.shape[-1]),
            "rms_norm_eps": float(self._field("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self._field("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._field("context_length", 8192)),
            "tie_word_embeddings": "output.weight" not in self.tensors_by_name,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors_by_name,
        }
        if arch == "gemma3":
            cfg |= self._gemma3(cfg)
        scaling = self.metadata.get(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise FormatError(f"{self.path}: RoPE scaling {scaling!r} is not supported")
            cfg["rope_scaling"] = {"rope_type": "linear",
                                   "factor": float(self._field("rope.scaling.factor"))}
        if ROPE_FREQS in self.tensors_by_name:
            cfg["rope_scaling"] = {"rope_type": "default", **cfg.get("rope_scaling", {}),
                                   "freq_factors": self._rope_freqs(cfg["head_dim"])}
        # llama.cpp ends generation at eos, and at eot/eom where the file names them
        # (Llama 3's <|eot_id|> ends a chat turn).
        eos = [int(self.metadata[f"tokenizer.ggml.{k}_token_id"]) for k in ("eos", "eot", "eom")
               if f"tokenizer.ggml.{k}_token_id" in self.metadata]
        if eos:
            cfg["eos_token_id"] = list(dict.fromkeys(eos))
        if "tokenizer.ggml.bos_token_id" in self.metadata:
            cfg["bos_token_id"] = int(self.metadata["tokenizer.ggml.bos_token_id"])
        return cfg

    def _gemma3(self, cfg: dict) -> dict:
        """The gemma3_text fields llama.cpp's gemma3 loader takes from the metadata or fixes
        (module docstring)."""
        n = cfg["num_hidden_layers"]
        pattern = self.metadata.get("gemma3.attention.sliding_window_pattern", GEMMA3_PERIOD)
        if isinstance(pattern, list):
            if len(pattern) != n or not all(isinstance(b, bool) for b in pattern):
                raise FormatError(f"{self.path}: gemma3.attention.sliding_window_pattern holds "
                                  f"{len(pattern)} values, not one bool for each of {n} layers")
            sliding = pattern
        elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
            # llama.cpp's set_swa_pattern(n): the last layer of every n is global; 0: none
            sliding = [bool(pattern) and i % pattern < pattern - 1 for i in range(n)]
        else:
            raise FormatError(f"{self.path}: gemma3.attention.sliding_window_pattern is "
                              f"{pattern!r}, not a layer period or one bool a layer")
        out = {"layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
               "sliding_window": int(self._field("attention.sliding_window")),
               "rope_local_base_freq": float(self.metadata.get("gemma3.rope.freq_base_swa",
                                                               GEMMA3_LOCAL_BASE)),
               "query_pre_attn_scalar": gemma3_attn_scalar(
                   cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"], n),
               "attention_bias": False}
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if f"gemma3.{key}" in self.metadata:
                out[key] = float(self.metadata[f"gemma3.{key}"])
        return out

    def _rope_freqs(self, head_dim: int) -> list[float]:
        """The rope_freqs tensor's head_dim/2 factors; FormatError naming it otherwise."""
        t = self.tensors_by_name[ROPE_FREQS]
        if t.type not in _DENSE or len(t.shape) != 1 or t.shape[0] != head_dim // 2:
            raise FormatError(f"{self.path}: tensor {ROPE_FREQS} is {t.type} of shape "
                              f"{tuple(t.shape)}, not {head_dim // 2} float factors (one "
                              f"per frequency of a head of {head_dim})")
        data = torch.from_numpy(t.data.copy()).view(_DENSE[t.type]).reshape(-1)
        return data.to(torch.float32).tolist()

    def spec(self, path: str) -> tuple[int, int]:
        return self._spec.get(path, (0, 0))

    def sources(self) -> dict[str, Source]:
        """HF name (less ".weight") → how the file stores it: "gguf Q4_K", ... and what a
        model dtype then rounds (`sources.Source`)."""
        out = {}
        for t in self.tensors_by_name.values():
            if t.name == ROPE_FREQS:
                continue
            name = hf_name(t.name, self.arch).removesuffix(".weight")
            text = f"gguf {t.type}"
            if self._unit_offset(t.name):  # w' − 1: exact in float32 (checked at load)
                out[name] = Source(f"{text} 1 + w", stored=(torch.float32, "weights"))
            elif t.type in _DENSE:
                out[name] = Source(text, stored=(_DENSE[t.type], "weights"))
            elif t.type in _HELD_DENSE:
                out[name] = Source(f"{text}, held dense", products="weights")
            elif t.type.endswith("_K"):
                out[name] = Source(text, products="scales d·sc, biases −dmin·m")
            else:  # Q4_0, Q4_1, Q8_0: d and m are float16; −8d, −128d as exact as d
                out[name] = Source(text, stored=(torch.float16, "scales, biases"))
        return out

    def _less_one(self, stored: torch.Tensor, name: str) -> torch.Tensor:
        """w = w' − 1 in float32 of a norm stored as w' = 1 + w; FormatError naming the
        tensor where 1 + w does not give w' back (w' below 0.5 with bits finer than 2^-24,
        or large negative: qfuse's norm would not multiply by w')."""
        w1 = stored.to(torch.float32)
        w = w1 - 1
        bad = ((w + 1 != w1) & w1.isfinite()).reshape(-1).nonzero()  # NaN: `_fill`'s
        if len(bad):
            i = int(bad[0])
            raise FormatError(f"{self.path}: tensor {name} holds {float(w1.reshape(-1)[i])!r} "
                              f"(at {i}), which as 1 + w has no float32 w (qfuse's Gemma norm "
                              "multiplies by 1 + w)")
        return w

    def _unpermute(self, hf: str):
        """Row order of a Llama q/k projection: llama.cpp's converter interleaves each
        head's two RoPE halves (row h·D + 2i + j holds HF row h·D + j·D/2 + i)."""
        if self.config["model_type"] != "llama" or not hf.endswith(("q_proj.weight",
                                                                   "k_proj.weight")):
            return None
        heads = self.config["num_attention_heads"] if "q_proj" in hf else \
            self.config["num_key_value_heads"]
        D = self.config["head_dim"]
        src = torch.arange(heads * D).reshape(heads, 2, D // 2).transpose(1, 2).reshape(-1)
        return torch.argsort(src)

    def tensors(self):
        """(HF name, tensor) for every tensor of the file, quantized ones as MLX
        `.weight`/`.scales`/`.biases`, one tensor at a time."""
        for t in self.tensors_by_name.values():
            if t.name == ROPE_FREQS:  # the config's, not a weight
                continue
            hf = hf_name(t.name, self.arch)
            data = torch.from_numpy(t.data.copy())  # uint8 [rows, row bytes]
            rows = self._unpermute(hf)
            kind = t.type
            if kind in _DENSE:
                data = data.view(_DENSE[kind]).reshape([int(n) for n in reversed(t.shape)])
                if self._unit_offset(t.name):
                    data = self._less_one(data, t.name)
                yield hf, data if rows is None else data[rows]
                continue
            n_cols = int(t.shape[0])
            if kind in _HELD_DENSE:
                w = dense(data, kind, n_cols, f"tensor {t.name}")
                yield hf, w if rows is None else w[rows]
                continue
            packed, scales, biases, _, _ = to_mlx(data, kind, n_cols, f"tensor {t.name}")
            if rows is not None:
                packed = packed.view(torch.int32)[rows].view(torch.uint32)
                scales, biases = scales[rows], biases[rows]
            module = hf[: -len(".weight")]
            yield f"{module}.weight", packed
            yield f"{module}.scales", scales
            yield f"{module}.biases", biases
