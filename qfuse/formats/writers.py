"""AWQ, GPTQ, compressed-tensors and GGUF checkpoints written from a dense model, for the
gates (`qfuse bench gate --parts formats`) and the tests of the readers.

`write_checkpoint(src, dst, kind)` copies a dense safetensors model folder into a new
folder ``dst`` whose decoder projections (`model.layers.N.*.*_proj.weight`) are stored in
the layout ``kind`` names (`KINDS`); the other tensors, the tokenizer files and config.json
(plus its `quantization_config`) are kept. The packers (`pack_awq`, `pack_sequential`) and
`format_tensors`/`quantization_config` follow the layouts the readers document
(`awq`, `gptq`, `compressed`), so a test may write codes of its own with them.

Codes come from round to nearest over each group (`round_to_nearest`): asymmetric
s = (max − min)/(2^b − 1) over the group's range widened to hold 0 (GPTQ's quantizer does
the same), z = round(−min/s); symmetric (compressed-tensors only) s = max|w|/((2^b − 1)/2),
z = 2^(b−1). Not a calibrated quantizer (no AWQ scale search, no GPTQ error feedback):
a gate judges how qfuse reads and runs a format, which round-to-nearest codes exercise as
calibrated ones do. GPTQ's act-order (`gptq-act-order`): the columns are grouped in
descending order of their weight's column norm, summed over the projections that share an
input (GPTQ orders q/k/v, and gate/up, by one Hessian) — a stand-in for the Hessian's
diagonal — so groups are not runs of columns and the loader sorts and gathers them.

Scales are float16 (AutoAWQ and AutoGPTQ write float16), bfloat16 for compressed-tensors
(llm-compressor keeps the model's dtype). The GGUF kinds ("gguf-q8_0", "gguf-q4_0") are
`gguf_writer`'s: a folder holding model.gguf (blocks of 32 from the `gguf` package's
quantizers) and the tokenizer files. ``dst`` must not exist (nothing is overwritten).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import UserError
from ..quant import pack
from . import gguf_writer
from .awq import ORDER
from .write_checks import dense_source_config, dense_state

# kind → (the format `format_tensors` writes, act-order, symmetric)
KINDS = {
    "awq": ("awq", False, False),
    "gptq": ("gptq", False, False),
    "gptq-act-order": ("gptq", True, False),
    "compressed-tensors": ("compressed-tensors", False, False),
    "compressed-tensors-symmetric": ("compressed-tensors", False, True),
    **{kind: ("gguf", False, False) for kind in gguf_writer.KINDS},
}
# A decoder projection's weight: what the formats quantize (embeddings, norms, the head stay).
_PROJECTION = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.weight$")
# Projections that share an input, so GPTQ gives them one act-order.
_SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                 "up_proj": "gate_up"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")


def int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) (or already signed) as int32 with the same 32 bits."""
    words = words.to(torch.int64) & 0xFFFFFFFF
    return torch.where(words < 2**31, words, words - 2**32).to(torch.int32)


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing of 4-bit codes [rows, cols] into int32 [rows, cols/8]:
    nibble i of word c holds column 8c + ORDER[i] (`awq.ORDER`)."""
    rows, cols = codes.shape
    out = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i, col in enumerate(ORDER):
        out |= codes[:, col::8].to(torch.int64) << (4 * i)
    return int32(out)


def pack_sequential(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """32/bits consecutive codes along ``dim`` per int32, the first in the lowest bits
    (GPTQ's qweight and qzeros, compressed-tensors' zero points)."""
    per = 32 // bits
    c = codes.to(torch.int64).movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    out = (c << (torch.arange(per) * bits)).sum(-1)
    return int32(out).movedim(-1, dim).contiguous()


def round_to_nearest(w: torch.Tensor, group: int, bits: int, symmetric: bool = False,
                     dtype: torch.dtype = torch.float16):
    """(codes int64 [out, in], scale ``dtype`` [out, in/group], zero int64 [out, in/group])
    with w ≈ (codes − zero)·scale per run of ``group`` columns (module docstring). The
    stored scale is rounded up, never down, and the codes computed from it: no code
    clips, so every weight is within half a step of (codes − zero)·scale."""
    n_out, n_in = w.shape
    g = w.to(torch.float32).reshape(n_out, n_in // group, group)
    n = 2**bits - 1
    if symmetric:
        scale = _at_least(g.abs().amax(-1) / (n / 2), dtype)
        zero = torch.full(scale.shape, 2 ** (bits - 1), dtype=torch.int64)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = _at_least((hi - lo) / n, dtype)
        zero = torch.round(-lo / scale.to(torch.float32)).clamp(0, n).to(torch.int64)
    s = scale.to(torch.float32).unsqueeze(-1)
    codes = (torch.round(g / s) + zero.unsqueeze(-1)).clamp(0, n).to(torch.int64)
    return codes.reshape(n_out, n_in), scale, zero


def _at_least(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``exact`` (float32, at least 1e-5) in ``dtype``, rounded up where nearest is below."""
    exact = exact.clamp(min=1e-5)
    s = exact.to(dtype)
    up = torch.nextafter(s, torch.tensor(float("inf"), dtype=dtype))
    return torch.where(s.to(torch.float32) < exact, up, s)


def format_tensors(kind: str, name: str, codes: torch.Tensor, scale: torch.Tensor,
                   zero: torch.Tensor, bits: int, g_idx: torch.Tensor | None = None,
                   symmetric: bool = False) -> dict[str, torch.Tensor]:
    """The tensors module ``name`` stores in format ``kind`` ("awq", "gptq",
    "compressed-tensors") for codes [out, in], scale and integer zero [out, S]: AWQ's
    transposed interleaved words, GPTQ's row-packed words with its zeros stored as z − 1
    and `g_idx` (column order unless given), compressed-tensors' `weight_packed` (codes
    u = q + 2^(b−1), MLX's word order) with signed zero points packed along the output dim
    (none when ``symmetric``: the reader takes z = 2^(b−1))."""
    n_out, n_in = codes.shape
    if kind == "awq":
        return {f"{name}.qweight": pack_awq(codes.T), f"{name}.qzeros": pack_awq(zero.T),
                f"{name}.scales": scale.T.contiguous()}
    if kind == "gptq":
        if g_idx is None:
            g_idx = torch.arange(n_in) // (n_in // scale.shape[1])
        stored = (zero - 1) & (2**bits - 1)  # the original format's z − 1
        return {f"{name}.qweight": pack_sequential(codes.T, bits, 0),
                f"{name}.qzeros": pack_sequential(stored.T, bits, 1),
                f"{name}.scales": scale.T.contiguous(), f"{name}.g_idx": g_idx.to(torch.int32)}
    if kind == "compressed-tensors":
        out = {f"{name}.weight_packed": pack(codes, bits).view(torch.int32),
               f"{name}.weight_shape": torch.tensor([n_out, n_in]),
               f"{name}.weight_scale": scale.contiguous()}
        if not symmetric:  # zp + 2^(b−1) as a bit stream, as pack_to_int32 offsets it
            out[f"{name}.weight_zero_point"] = pack_sequential(zero, bits, 0)
        if g_idx is not None:  # llm-compressor's actorder=group
            out[f"{name}.weight_g_idx"] = g_idx.to(torch.int32)
        return out
    raise ValueError(f"unknown format {kind!r} (awq, gptq, compressed-tensors)")


def quantization_config(kind: str, bits: int, group: int, act_order: bool = False,
                        symmetric: bool = False) -> dict:
    """config.json's `quantization_config` for format ``kind`` ("awq", "gptq",
    "compressed-tensors"), as each tool writes it."""
    if kind == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "version": "gemm",
                "zero_point": True}
    if kind == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group,
                "desc_act": act_order, "sym": False}
    if kind == "compressed-tensors":
        return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": bits, "type": "int", "symmetric": symmetric,
                    "strategy": "group", "group_size": group}}}}
    raise ValueError(f"unknown format {kind!r} (awq, gptq, compressed-tensors)")


def act_order(weights: list[torch.Tensor]) -> torch.Tensor:
    """The input columns in descending order of their norm over ``weights`` (projections
    sharing one input): the order act-order groups are cut from (module docstring)."""
    norms = sum(w.to(torch.float32).square().sum(0) for w in weights)
    return torch.sort(norms, descending=True, stable=True).indices


def weight_bits(kind: str, bits: int = 4) -> int:
    """The bits of the projections `write_checkpoint` writes for ``kind``: ``bits``, or
    the GGUF kind's own."""
    return gguf_writer.bits(kind) if kind in gguf_writer.KINDS else bits


def write_checkpoint(src: str | Path, dst: str | Path, kind: str, bits: int = 4,
                     group: int = 64) -> Path:
    """A checkpoint of format ``kind`` (`KINDS`) at ``dst`` (a new folder) from the dense
    safetensors model folder ``src``: its projections quantized (``bits``, groups of
    ``group`` columns; a GGUF kind's own type and blocks of 32), everything else as
    stored. Returns what `loading.load_model` opens: ``dst``, or the .gguf file in it."""
    if kind not in KINDS:
        raise UserError(f"unknown checkpoint format {kind!r} (one of {', '.join(KINDS)})")
    method, ordered, symmetric = KINDS[kind]
    if method == "gguf":
        return gguf_writer.write_gguf(src, dst, kind)
    src, dst = Path(src), Path(dst)
    config = dense_source_config(src, dst, "checkpoint")
    state = dense_state(src)
    projections = {n: m for n in state if (m := _PROJECTION.match(n))}
    orders: dict[tuple[str, str], torch.Tensor] = {}
    if ordered:
        by_input: dict[tuple[str, str], list[torch.Tensor]] = {}
        for n, m in projections.items():
            key = (m[1], _SHARED_INPUT.get(m[3], m[3]))
            by_input.setdefault(key, []).append(state[n])
        orders = {key: act_order(ws) for key, ws in by_input.items()}
    scale_dtype = torch.bfloat16 if method == "compressed-tensors" else torch.float16
    for n, m in projections.items():
        w = state.pop(n)
        module = n[: -len(".weight")]
        g_idx = None
        if ordered:
            perm = orders[(m[1], _SHARED_INPUT.get(m[3], m[3]))]
            codes_p, scale, zero = round_to_nearest(w[:, perm], group, bits, symmetric,
                                                    scale_dtype)
            codes = torch.empty_like(codes_p)
            codes[:, perm] = codes_p  # back to the stored column order
            g_idx = torch.empty(w.shape[1], dtype=torch.int64)
            g_idx[perm] = torch.arange(w.shape[1]) // group
        else:
            codes, scale, zero = round_to_nearest(w, group, bits, symmetric, scale_dtype)
        state |= format_tensors(method, module, codes, scale, zero, bits, g_idx, symmetric)
    dst.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"))
    config.pop("quantization", None)
    config["quantization_config"] = quantization_config(method, bits, group, ordered,
                                                        symmetric)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in _TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    return dst
