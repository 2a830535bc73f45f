"""Small checkpoints of every read format, with the dense model each stands for: shared by
tests/test_formats.py, tests/test_formats_gguf.py and the GPU cases (tests/test_formats_gpu.py).

- `write_random(tmp_path, kind, ...)`: a tiny random Gemma 3 (`CONFIG`) whose projections
  hold random codes, scales and zeros in AWQ, GPTQ (act-order optional) or compressed-tensors
  (asymmetric or symmetric) layout, written by `qfuse.formats.writers`' packers; the dense
  model holds the formats' own dequantization (q − z)·s in float32.
- `write_gguf(path, ...)`: a tiny Llama (`LLAMA`) .gguf as llama.cpp's converter writes one,
  every projection in one of the read types (`TYPES`: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K),
  and the dense model it dequantizes to (the `gguf` package's writer and dequantization:
  callers import it, or skip, first).
"""

from __future__ import annotations

import json

import numpy as np
import torch
from safetensors.torch import save_file

from qfuse.formats import gguf as qgguf
from qfuse.formats import writers
from qfuse.formats.gguf_writer import converter_permute
from qfuse.models import Decoder, ModelConfig
from qfuse.models.decoder import Linear

CONFIG = {"model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 64, "sliding_window": 8,
          "layer_types": ["sliding_attention", "full_attention"]}
IDS = torch.tensor([[2, 17, 99, 5, 230, 41, 8, 77, 3, 150]])
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Modules of one layer that share an input (GPTQ orders them alike: one Hessian).
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                "up_proj": "gate_up"}
METHODS = {"awq": "awq", "gptq": "gptq", "ct": "compressed-tensors"}


def base_model() -> Decoder:
    """The tiny Gemma 3 of `CONFIG`, float32, its parameters N(0, 0.05) (seed 0)."""
    torch.manual_seed(0)
    model = Decoder(ModelConfig.from_dict(CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def linears(model: Decoder) -> dict[str, Linear]:
    """The decoder layers' projections by name."""
    return {n: m for n, m in model.named_modules()
            if type(m) is Linear and n.startswith("model.layers.")}


def random_groups(n_out, n_in, group, bits, gen):
    """Codes [out, in], float16 scales and integer zeros [out, in/group]."""
    codes = torch.randint(0, 2**bits, (n_out, n_in), generator=gen)
    S = n_in // group
    scale = (torch.rand(n_out, S, generator=gen) * 0.02 + 0.002).to(torch.float16)
    zero = torch.randint(0, 2**bits, (n_out, S), generator=gen)
    return codes, scale, zero


def reference(codes, scale, zero, g_idx, dtype=torch.float32):
    """The formats' own dequantization: (q − z)·s of each column's group, in ``dtype``."""
    s = scale[:, g_idx].to(dtype)
    return (codes - zero[:, g_idx]).to(dtype) * s


def write_random(tmp_path, kind: str, group: int = 64, bits: int = 4, act_order=(),
                 shared=True, symmetric=False, **extra):
    """A checkpoint of format ``kind`` ("awq", "gptq", "ct": compressed-tensors) in
    ``tmp_path/kind`` and the dense model it stands for (float32). ``act_order``: module
    name endings whose g_idx is a random order (desc_act); with ``shared``, the modules of
    a layer sharing an input get one order, as GPTQ gives them. ``symmetric``
    (compressed-tensors): every zero 2^(b−1), no zero points stored."""
    model, gen = base_model(), torch.Generator().manual_seed(1)
    state = dict(model.state_dict())
    orders: dict = {}
    for name, lin in linears(model).items():
        n_out, n_in = lin.n_out, lin.n_in
        G = n_in if group == -1 else group
        codes, scale, zero = random_groups(n_out, n_in, G, bits, gen)
        if symmetric:
            zero = torch.full_like(zero, 2 ** (bits - 1))
        g_idx = torch.arange(n_in) // G
        ordered = any(name.endswith(a) for a in act_order)
        if ordered:
            prefix, _, last = name.rpartition(".")
            key = (prefix, SHARED_INPUT.get(last, last)) if shared else name
            if key not in orders:
                orders[key] = torch.randperm(n_in, generator=gen)
            g_idx = g_idx[orders[key]]
        with torch.no_grad():
            lin.weight.copy_(reference(codes, scale, zero, g_idx))
        del state[f"{name}.weight"]
        state |= writers.format_tensors(METHODS[kind], name, codes, scale, zero, bits,
                                        g_idx if ordered or kind == "gptq" else None,
                                        symmetric)
    qcfg = writers.quantization_config(METHODS[kind], bits, group, bool(act_order), symmetric)
    qcfg.update(extra)
    folder = tmp_path / kind
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": qcfg}))
    return folder, model


# --- GGUF ----------------------------------------------------------------------------------

LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 256, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "max_position_embeddings": 64, "tie_word_embeddings": False}
# K-quants need rows of 256 (o_proj's are 128).
TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q8_0", "attn_output": "Q4_1",
         "ffn_gate": "Q5_K", "ffn_up": "Q4_0", "ffn_down": "Q4_K", "token_embd": "Q8_0",
         "output": "Q6_K"}
GGUF_NAMES = {v: k for k, v in {**qgguf.LAYER_NAMES, **qgguf.TOP_NAMES}.items()}


def write_gguf(path, vocab_size=128, metadata=None, config=None, rope=None,
               centered=False):
    """A Llama GGUF as llama.cpp's converter writes one (q/k rows interleaved per head),
    every projection in one of the read types, and the dense model it dequantizes to;
    ``metadata(writer)`` adds keys (a tokenizer); ``config``: keys over `LLAMA` for the
    dense model (its rope_scaling, say); ``rope(writer)`` writes the RoPE keys and tensors
    in place of rope.freq_base alone; ``centered``: K-quant weights of mean about 0 and
    the others' spread (`blocks_shaped`), a model whose bf16 rounding stays small."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    torch.manual_seed(0)
    model = Decoder(ModelConfig.from_dict({**LLAMA, "vocab_size": vocab_size,
                                           **(config or {})}))
    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(path), "llama")
    if metadata is not None:
        metadata(w)
    w.add_block_count(2)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(32)
    w.add_value_length(32)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_context_length(64)
    if rope is not None:
        rope(w)
    if metadata is None:
        w.add_eos_token_id(1)
    state = model.state_dict()
    with torch.no_grad():
        for name, p in state.items():
            module = name.rsplit(".", 1)[0]
            layer = module.split(".")[2] if module.startswith("model.layers.") else None
            stem = ".".join(module.split(".")[3:]) if layer else module
            gname = (f"blk.{layer}." if layer else "") + GGUF_NAMES[stem] + ".weight"
            kind = TYPES.get(GGUF_NAMES[stem])
            if kind is None:  # norms: float32, as llama.cpp keeps them
                p.copy_(torch.from_numpy(rng.normal(1, 0.1, p.shape).astype(np.float32)))
                w.add_tensor(gname, p.numpy())
                continue
            raw = blocks_shaped(kind, p.shape, rng, centered)
            hf = torch.from_numpy(quants.dequantize(raw, T[kind]))
            if stem in ("self_attn.q_proj", "self_attn.k_proj"):  # the converter's interleave
                heads = 4 if "q_proj" in stem else 2
                stored = hf
                hf = stored.reshape(heads, 16, 2, -1).transpose(1, 2).reshape(stored.shape)
                assert torch.equal(converter_permute(hf, heads), stored)
            p.copy_(hf)
            w.add_tensor(gname, raw, raw_dtype=T[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def blocks_shaped(kind, shape, rng, centered=False):
    """uint8 [rows, row bytes] of a ``kind`` tensor of ``shape``: Q4_0/Q4_1/Q8_0 from the
    `gguf` package's quantizer over N(0, 0.05), K-quants as random bytes with small finite
    d (and dmin): their weights d·sc·q − dmin·m then have a mean of about +0.02 and a
    spread of 0.3–0.6 (Q6_K: 0.4), which a bf16 model rounds coarsely. ``centered``: sc
    and m chosen so that m·dmin is sc·d times the codes' mean, and d smaller: weights of
    mean about 0 and spread about 0.05, like the others'."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    per, nbytes = qgguf.BLOCKS.get(kind, (256, 210))  # Q6_K: d last
    rows, cols = shape
    n = cols // per
    if kind == "Q6_K":
        raw = rng.integers(0, 256, (rows, n, nbytes), dtype=np.uint8)
        top = 0.00005 if centered else 0.0005
        d = (rng.random((rows, n, 1)) * top).astype(np.float16)
        raw[..., 208:210] = d.view(np.uint8)
        return raw.reshape(rows, -1)
    if not kind.endswith("_K"):
        return quants.quantize(rng.standard_normal(shape).astype(np.float32) * 0.05, T[kind])
    raw = rng.integers(0, 256, (rows, n, nbytes), dtype=np.uint8)
    if not centered:
        d_dmin = (rng.random((rows, n, 2)) * 0.002).astype(np.float16)
        raw[..., 0:4] = d_dmin.view(np.uint8).reshape(rows, n, 4)
        return raw.reshape(rows, -1)
    mean = 7.5 if kind == "Q4_K" else 15.5  # of the 4- or 5-bit codes
    sc = rng.integers(1, int(63 / mean) + 1, (rows, n, 8))
    m = np.round(sc * mean).astype(np.int64)  # dmin = d: w = d·sc·(q − m/sc)
    d = (0.001 + rng.random((rows, n, 1)) * 0.002).astype(np.float16)
    raw[..., 0:4] = np.concatenate([d, d], -1).view(np.uint8)
    raw[..., 4:16] = k_scale_bytes(sc, m)
    return raw.reshape(rows, -1)


def k_scale_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 bytes of a K-quant super-block holding its 8 six-bit scale and min codes
    [..., 8] each (ggml's get_scale_min_k4 read backwards: codes 0-3 in the low 6 bits of
    bytes 0-3 and 4-7, codes 4-7 split into a low nibble in bytes 8-11 and two high bits
    on top of bytes 0-7)."""
    out = np.zeros((*sc.shape[:-1], 12), np.int64)
    out[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    return out.astype(np.uint8)
