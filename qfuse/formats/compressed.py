"""compressed-tensors `pack-quantized` checkpoints (llm-compressor's W4A16, W8A16), read as
MLX affine groups.

A quantized Linear `<p>` stores `weight_packed` int32 [out, in·b/32] (each row one
little-endian bit stream of unsigned codes u = q + 2^(b−1): MLX's own word order, kept
as it is), `weight_shape` [out, in], `weight_scale` [out, S] (S = in/G per group, 1 per
channel or per tensor) and, when asymmetric, `weight_zero_point` (signed, packed along
the output dim as int32 [out·b/32, S], or unpacked int8 [out, S] from older writers);
w = (q − zp)·s = (u − 2^(b−1) − zp)·s. An act-order `weight_g_idx` [in] is read as
GPTQ's g_idx. Other formats (float-quantized, naive-quantized, FP4) are refused.
"""

from __future__ import annotations

import torch

from .groups import FormatError

MARKER = "weight_packed"
PARTS = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx")


def check_config(q: dict) -> None:
    formats = {q.get("format")} | {g.get("format") for g in (q.get("config_groups") or {}).values()
                                   if isinstance(g, dict)}
    formats -= {None}
    other = formats - {"pack-quantized"}
    if other:
        raise FormatError(f"compressed-tensors format {min(other)!r} is not supported "
                          "(qfuse reads pack-quantized)")
    for name, group in (q.get("config_groups") or {}).items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and weights.get("type", "int") != "int":
            raise FormatError(f"compressed-tensors group {name}: weights of type "
                              f"{weights.get('type')!r} are not supported (int)")
        if isinstance(group, dict) and group.get("input_activations"):
            # W4A8 and the like: running the activations unquantized would be another model.
            raise FormatError(f"compressed-tensors group {name}: quantized input activations "
                              "are not supported (qfuse reads weight-only W4A16/W8A16)")


def layout(get_shape, get, module: str, q: dict) -> tuple[int, int, int, int]:
    n_out, n_in = (int(v) for v in get(f"{module}.weight_shape").tolist())
    packed, scale = get_shape(f"{module}.weight_packed"), get_shape(f"{module}.weight_scale")
    if packed[0] != n_out or (packed[1] * 32) % n_in:
        raise FormatError(f"{module}.weight_packed has shape {tuple(packed)}, which does not "
                          f"hold a [{n_out}, {n_in}] weight")
    bits = packed[1] * 32 // n_in
    groups = scale[-1] if len(scale) == 2 and scale[0] == n_out else 1  # per tensor: one
    if n_in % groups:
        raise FormatError(f"{module}.weight_scale: {groups} groups do not divide the row of "
                          f"{n_in} input features")
    return n_out, n_in, n_in // groups, bits


def read(get, module: str, q: dict, n_out: int, n_in: int):
    packed = get(f"{module}.weight_packed")
    bits = packed.shape[1] * 32 // n_in
    scale = get(f"{module}.weight_scale")
    if scale.dim() != 2 or scale.shape[0] != n_out:  # per tensor: one scale for all rows
        scale = scale.reshape(1, -1).expand(n_out, -1)
    offset = 1 << (bits - 1)
    zp = get(f"{module}.weight_zero_point", required=False)
    if zp is None:
        zero = torch.full(scale.shape, offset, dtype=torch.int64)
    else:
        if zp.dtype == torch.int32 and zp.shape[0] != n_out:  # packed along the output dim
            zp = _unpack_rows(zp, bits, n_out)
        zero = zp.to(torch.int64).reshape(-1, scale.shape[1]).expand(n_out, -1) + offset
    return packed.view(torch.uint32), scale, zero


def _unpack_rows(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Signed codes [n, S] from int32 [n·bits/32, S] packed along dim 0 (one bit stream per
    column, offset by 2^(bits−1))."""
    from ..quant import unpack

    stream = words.T.contiguous()
    pad = (-stream.shape[1]) % bits  # unpack reads whole blocks of 32 codes
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    codes = unpack(stream.view(torch.uint32), bits)[:, :n]
    return (codes - (1 << (bits - 1))).T
