"""Quantized checkpoints of other tools, converted at load time into MLX affine groups.

config.json's `quantization_config.quant_method` names the format: "awq" (AutoAWQ GEMM),
"gptq" (AutoGPTQ / GPTQModel) or "compressed-tensors" (`pack-quantized`, llm-compressor);
`reader(quantization)` returns None for any other block (MLX's `quantization`, a dense
model). `Converted` then serves the loader (`loading.load_model`): `spec(path)`, the
(group size, bits) each Linear is built with, from the safetensors headers (and the small
`g_idx`/`weight_shape` tensors), and `tensors()`, every tensor as the Decoder holds it,
converted one module at a time (`groups.to_mlx`: bias = −z·s, its precision stated
there), so no dense copy of the model is ever made, and `sources()`, each quantized
module's stored form (`sources.Source`: what a model dtype then rounds). GGUF files are
read by `formats.gguf` (the container: `gguf_file`; the tokenizer: `gguf_tokenizer`).

Act-order (a `g_idx` whose groups are not runs of columns, GPTQ's desc_act): the
columns are sorted by group at load (`groups.act_order_permutation`, `perm` per module),
so each group is a run of columns as the MLX layout needs; the product then needs
x[..., perm]. Where that costs nothing it is folded: down_proj's input is the MLP's
hidden, so the rows of gate_proj and up_proj (whose outputs it is) are permuted to
match. Everywhere else the module gathers its input (`input_perm`: canonical module →
perm, which the loader gives the Linear, one small gather a product). o_proj is not
folded into v_proj's rows: attention keeps features per head, so only a permutation
within each KV head (the same for every query head sharing it) would commute with it,
and GPTQ's orders (by the Hessian's diagonal) span the whole input. A malformed g_idx
(wrong length, groups out of range, groups of unequal sizes) is refused in one line
naming the tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ..quant import unpack
from . import awq, compressed, gptq
from .groups import FormatError, act_order_permutation, group_columns, mlx_group, to_mlx
from .sources import DTYPES, Source, dense, group_text

FORMATS = {"awq": awq, "gptq": gptq, "compressed-tensors": compressed}
# Where an act-order permutation of down_proj's input goes: the rows of these siblings.
_ROW_SIBLINGS = {"mlp.down_proj": ("mlp.gate_proj", "mlp.up_proj")}

__all__ = ["DTYPES", "FORMATS", "Converted", "FormatError", "Source", "dense", "reader"]


def reader(quantization) -> object | None:
    """The format module for a config's quantization block, None where it names no
    quant_method (MLX, dense); FormatError for a method or setting qfuse cannot read."""
    if not isinstance(quantization, dict) or "quant_method" not in quantization:
        return None
    method = quantization["quant_method"]
    fmt = FORMATS.get(str(method).lower())
    if fmt is None:
        raise FormatError(f"quant_method {method!r} is not supported (qfuse reads "
                          f"{', '.join(FORMATS)}, MLX and dense checkpoints)")
    fmt.check_config(quantization)
    return fmt


class Converted:
    """A quantized checkpoint of one of `FORMATS` over its safetensors files.

    index: raw tensor name → an open safetensors handle holding it; canonical: the
    loader's name mapping (multimodal prefixes)."""

    def __init__(self, fmt, quantization: dict, index: dict, canonical: Callable[[str], str]):
        self.fmt, self.q, self.index, self.canonical = fmt, quantization, index, canonical
        marker = "." + fmt.MARKER
        self.modules = sorted(n[: -len(marker)] for n in index if n.endswith(marker))
        self.owned = {f"{m}.{p}" for m in self.modules for p in fmt.PARTS}
        self.layouts: dict[str, tuple] = {}  # raw module → (out, in, column groups, bits)
        self.row_perm: dict[str, torch.Tensor] = {}  # canonical module → row permutation
        self.col_perm: dict[str, torch.Tensor] = {}  # raw module → input permutation
        # canonical module → the permutation its input is gathered by (not folded)
        self.input_perm: dict[str, torch.Tensor] = {}
        self.perm_tensor: dict[str, str] = {}  # canonical module → its g_idx's name
        self._spec: dict[str, tuple[int, int]] = {}
        for m in self.modules:
            self._plan(m)

    def shape(self, name: str) -> tuple[int, ...]:
        handle = self.index.get(name)
        if handle is None:
            raise FormatError(f"tensor {name!r} is missing (a quantized module needs it)")
        return tuple(handle.get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype | None:
        """The stored float dtype of tensor ``name`` (from its header), None for another."""
        return DTYPES.get(self.index[name].get_slice(name).get_dtype())

    def sources(self) -> dict[str, Source]:
        """canonical module → how it is stored ("gptq 4-bit g128 act-order"), for every
        quantized module (`sources.Source`: what a model dtype then rounds)."""
        name = next(k for k, v in FORMATS.items() if v is self.fmt)
        out = {}
        for m in self.modules:
            n_out, n_in, columns, bits = self.layouts[m]
            group = columns if isinstance(columns, int) else n_in // self._scale_groups(m)
            text = group_text(name, bits, min(group, n_in), n_in)
            scale = f"{m}.{'weight_scale' if self.fmt is compressed else 'scales'}"
            if self.fmt is compressed and self.shape(scale)[0] != n_out:
                text = f"{name} {bits}-bit per-tensor"
            if m in self.col_perm:
                text += " act-order"
            # Symmetric compressed-tensors (no zero points): the bias −2^(b−1)·s is exact
            # wherever the scale is.
            symmetric = self.fmt is compressed and f"{m}.weight_zero_point" not in self.index
            stored = self.dtype(scale)
            out[self.canonical(m + ".")[:-1]] = Source(
                text, stored=(stored, "scales") if stored is not None else None,
                zero_bits=0 if symmetric else bits)
        return out

    def get(self, name: str, required: bool = True) -> torch.Tensor | None:
        handle = self.index.get(name)
        if handle is None:
            if not required:
                return None
            raise FormatError(f"tensor {name!r} is missing (a quantized module needs it)")
        return handle.get_tensor(name)

    def _plan(self, m: str) -> None:
        n_out, n_in, group, bits = self.fmt.layout(self.shape, self.get, m, self.q)
        g_name = next((f"{m}.{p}" for p in ("g_idx", "weight_g_idx") if f"{m}.{p}" in self.index),
                      None)
        columns: int | torch.Tensor = group
        if g_name is None:
            g = mlx_group(group, n_in, m)
        else:
            g_idx = self.get(g_name)
            n_groups = self._scale_groups(m)
            g = group_columns(g_idx, n_in, n_groups, g_name)
            columns = g_idx.to(torch.int64)
            if g is None:  # true act-order
                cm = self.canonical(m + ".")[:-1]
                site = next((s for s in _ROW_SIBLINGS if cm.endswith(s)), None)
                perm = act_order_permutation(g_idx, n_groups, g_name)
                self.col_perm[m] = perm
                columns = columns[perm]
                g = group_columns(columns, n_in, n_groups, g_name)
                if site is None:  # gathered at each product
                    self.input_perm[cm], self.perm_tensor[cm] = perm, g_name
                else:  # folded into the rows of the modules whose outputs are its input
                    for sib in _ROW_SIBLINGS[site]:
                        self.row_perm[cm[: -len(site)] + sib] = perm
        self.layouts[m] = (n_out, n_in, columns, bits)
        self._spec[self.canonical(m + ".")[:-1]] = (g, bits)

    def _scale_groups(self, m: str) -> int:
        shape = self.shape(f"{m}.{'weight_scale' if self.fmt is compressed else 'scales'}")
        return shape[-1] if self.fmt is compressed else shape[0]

    def spec(self, path: str) -> tuple[int, int]:
        """(group size, bits) of the Linear at canonical ``path``; (0, 0) if dense."""
        return self._spec.get(path, (0, 0))

    def module_tensors(self, m: str) -> dict[str, torch.Tensor]:
        """The MLX tensors `<m>.weight`, `.scales`, `.biases` (float32) of module ``m``."""
        n_out, n_in, columns, bits = self.layouts[m]
        codes, scale, zero = self.fmt.read(self.get, m, self.q, n_out, n_in)
        if not scale.is_floating_point():
            raise FormatError(f"{m}: scales are {scale.dtype}, not floats")
        width = n_in * bits // 32 if codes.dtype == torch.uint32 else n_in
        if tuple(codes.shape) != (n_out, width):
            raise FormatError(f"{m}: the packed codes hold {tuple(codes.shape)}, expected "
                              f"[{n_out}, {width}]")
        if m in self.col_perm:
            if codes.dtype == torch.uint32:
                codes = unpack(codes, bits)
            codes = codes[:, self.col_perm[m]]
        packed, scales, biases = to_mlx(codes, scale, zero, columns, bits, m)
        return {f"{m}.weight": packed, f"{m}.scales": scales, f"{m}.biases": biases}

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(raw name, tensor) for every tensor the model holds: quantized modules as MLX
        tensors (named `<module>.weight/.scales/.biases`), the rest as stored, the rows of
        act-order siblings permuted."""
        for name in sorted(self.index):
            if name in self.owned:
                continue
            yield name, self._rows(name, self.get(name))
        for m in self.modules:
            for name, t in self.module_tensors(m).items():
                yield name, self._rows(name, t)

    def _rows(self, name: str, t: torch.Tensor) -> torch.Tensor:
        module, _, _ = self.canonical(name).rpartition(".")
        perm = self.row_perm.get(module)
        if perm is None or t.dim() == 0:
            return t
        if t.shape[0] != perm.numel():
            raise FormatError(f"{name}: {t.shape[0]} rows, but down_proj's act-order "
                              f"permutes {perm.numel()}")
        if t.dtype == torch.uint32:  # no index_select for uint32
            return t.view(torch.int32)[perm].view(torch.uint32)
        return t[perm]
