"""GPTQ checkpoints (AutoGPTQ / GPTQModel, 2, 4 or 8 bits), read as MLX affine groups.

A quantized Linear `<p>` stores `qweight` int32 [in·b/32, out] (input rows packed
along dim 0, row 32/b·i + j of column n in bits [b·j, b·j + b) of word [i, n]), `qzeros`
int32 [S, out·b/32] (output columns packed the same way along dim 1), `scales` float16
[S, out] and `g_idx` int32 [in] (the group of each input row). w[k, n] = (q − z)·s of
group g_idx[k]. Writers of the original format (`checkpoint_format` "gptq", the default)
store z − 1: z = (stored + 1) mod 2^b, as AutoGPTQ's own kernels read it;
"gptq_v2" (GPTQModel) stores z. 3-bit packing (codes straddling words) is not read.
"""

from __future__ import annotations

from .groups import FormatError, unpack_words

MARKER = "qweight"
PARTS = ("qweight", "qzeros", "scales", "g_idx")


def check_config(q: dict) -> None:
    bits = q.get("bits", 4)
    if bits not in (2, 4, 8):
        raise FormatError(f"GPTQ with {bits} bits is not supported (qfuse reads 2, 4 and 8)")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise FormatError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")


def layout(get_shape, get, module: str, q: dict) -> tuple[int, int, int, int]:
    bits = int(q.get("bits", 4))
    qw, sc = get_shape(f"{module}.qweight"), get_shape(f"{module}.scales")
    n_in, n_out = qw[0] * 32 // bits, qw[1]
    group = q.get("group_size", 128)
    group = n_in if group in (-1, None) else int(group)
    if len(sc) != 2 or sc[1] != n_out:
        raise FormatError(f"{module}.scales has shape {tuple(sc)}, expected [groups, {n_out}]")
    return n_out, n_in, group, bits


def read(get, module: str, q: dict, n_out: int, n_in: int):
    bits = int(q.get("bits", 4))
    codes = unpack_words(get(f"{module}.qweight"), bits, 0).T
    zeros = unpack_words(get(f"{module}.qzeros"), bits, 1).T
    if zeros.shape[0] != n_out:
        raise FormatError(f"{module}.qzeros holds {zeros.shape[0]} columns for {n_out} outputs")
    if q.get("checkpoint_format", "gptq") == "gptq":
        zeros = (zeros + 1) & ((1 << bits) - 1)
    return codes, get(f"{module}.scales").T, zeros
