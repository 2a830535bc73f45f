"""AWQ checkpoints (AutoAWQ's GEMM packing), read as MLX affine groups.

A quantized Linear `<p>` stores `qweight` int32 [in, out/8], `qzeros` int32 [in/G, out/8]
and `scales` float16 [in/G, out]; w[k, n] = (q[k, n] − z[k // G, n])·s[k // G, n]. Each
int32 holds 8 output columns, column 8c + ORDER[i] in bits [4i, 4i + 4) (AutoAWQ's
interleave, `ORDER` below); zeros are packed the same way and stored as they are (no +1).
Only `version: gemm` (the common one) and 4 bits exist in this layout.
"""

from __future__ import annotations

import torch

from .groups import FormatError

# Nibble i of a word holds output column 8c + ORDER[i].
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
MARKER = "qweight"
PARTS = ("qweight", "qzeros", "scales")


def check_config(q: dict) -> None:
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise FormatError(f"AWQ version {q.get('version')!r} is not supported (qfuse reads "
                          "version gemm)")
    bits = q.get("bits", q.get("w_bit", 4))
    if bits != 4:
        raise FormatError(f"AWQ with {bits} bits is not supported (gemm packing is 4-bit)")


def unpack_columns(words: torch.Tensor) -> torch.Tensor:
    """int64 codes [rows, 8·cols] from AWQ words [rows, cols], columns in natural order."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = 4 * torch.tensor(ORDER).argsort()  # column j sits in nibble ORDER.index(j)
    codes = (w.unsqueeze(-1) >> shifts) & 0xF
    return codes.reshape(w.shape[0], w.shape[1] * 8)


def layout(get_shape, get, module: str, q: dict) -> tuple[int, int, int, int]:
    """(out, in, group size, bits) of module from its tensors' shapes."""
    qw, sc = get_shape(f"{module}.qweight"), get_shape(f"{module}.scales")
    n_in, n_out = qw[0], qw[1] * 8
    group = q.get("group_size", q.get("q_group_size", 128))
    group = n_in if group in (-1, None) else int(group)
    if len(sc) != 2 or sc[1] != n_out:
        raise FormatError(f"{module}.scales has shape {tuple(sc)}, expected [groups, {n_out}]")
    return n_out, n_in, group, 4


def read(get, module: str, q: dict, n_out: int, n_in: int):
    """(codes [out, in], scale [out, S], zero [out, S]) of one module."""
    codes = unpack_columns(get(f"{module}.qweight")).T
    zeros = unpack_columns(get(f"{module}.qzeros")).T
    scales = get(f"{module}.scales").T
    return codes, scales, zeros
