"""What a checkpoint stored each weight as, and what holding it in a model dtype rounds:
the weights section of `qfuse info MODEL`.

A `Source` names the stored form ("awq 4-bit g128", "gguf Q4_K", "dense bfloat16") and what
the conversion leaves to the model's dtype. In float32 every conversion here is exact (the
bias −z·s has at most 20 significant bits, GGUF's products at most 19, and stored 16-bit
floats widen exactly). A float16 or bfloat16 model (p = 11 or 8 significant bits) rounds
each such value once, to nearest:

- a bias −z·s of b-bit zero points (AWQ, GPTQ, compressed-tensors): within ½ ulp(z·s)
  ≤ 2^(b−1) ulp(s), i.e. 2^(b−p) of a quantization step s (`groups`; tests/test_formats.py
  checks the bound);
- a stored value of a wider or other 16-bit dtype (a float32 tensor, float16 scales in a
  bfloat16 model), or a product the conversion computes in float32 (GGUF K-quants' d·sc and
  −dmin·m, Q6_K's dequantized weights): relative error at most 2^−p. (bfloat16 values in a
  float16 model are exact, or out of its range.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Significant bits (the implicit one included) of the model dtypes.
PRECISION = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
# safetensors / GGUF dtype names → torch dtypes.
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fits(stored: torch.dtype, model: torch.dtype) -> bool:
    """Whether every value of ``stored`` is one of ``model``'s."""
    return stored == model or (model == torch.float32 and stored in (torch.float16,
                                                                       torch.bfloat16))


@dataclass(frozen=True)
class Source:
    """text: the stored form; stored: the dtype of the floats copied as stored (a dense
    tensor, a format's scales) and what they are; zero_bits: b where a bias is −z·s of
    b-bit zero points; products: the values the conversion computes in float32."""

    text: str
    stored: tuple[torch.dtype, str] | None = None
    zero_bits: int = 0
    products: str | None = None

    def rounding(self, dtype: torch.dtype) -> str | None:
        """What holding this weight in ``dtype`` rounds, and by how much; None if nothing."""
        p = PRECISION.get(dtype)
        if p is None:
            return None
        parts = []
        if self.zero_bits and dtype != torch.float32:
            e = self.zero_bits - p
            step = f"1/{2 ** -e}" if e < 0 else f"{2 ** e}"
            parts.append(f"bias −z·s ≤ {step} step")
        if self.stored is not None and not _fits(self.stored[0], dtype):
            stored, what = self.stored
            if stored == torch.bfloat16 and dtype == torch.float16:  # 8 bits fit in 11
                parts.append(f"bfloat16 {what} exact only within float16's range")
            else:
                parts.append(f"{dtype_name(stored)} {what} ≤ 2^-{p} relative")
        if self.products and dtype != torch.float32:
            parts.append(f"{self.products} ≤ 2^-{p} relative")
        return ", ".join(parts) or None

    def line(self, dtype: torch.dtype) -> str:
        """The stored form, then what ``dtype`` rounds: "awq 4-bit g128; in bfloat16: bias
        −z·s ≤ 1/16 step, float16 scales ≤ 2^-8 relative"."""
        rounds = self.rounding(dtype)
        return self.text if rounds is None else f"{self.text}; in {dtype_name(dtype)}: {rounds}"


def dense(dtype: torch.dtype) -> Source:
    return Source(f"dense {dtype_name(dtype)}", stored=(dtype, "weights"))


def group_text(fmt: str, bits: int, group: int, n_in: int) -> str:
    """"awq 4-bit g128", "gptq 8-bit per-channel"."""
    return f"{fmt} {bits}-bit {'per-channel' if group == n_in else f'g{group}'}"


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] → "0-2,5,7-8"."""
    out, start = [], None
    for i, n in enumerate(layers):
        if start is None:
            start = n
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ",".join(out)


# A layer's modules in the order its forward uses them.
_MODULES = ("input_layernorm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "o_proj",
            "post_attention_layernorm", "pre_feedforward_layernorm", "gate_proj", "up_proj",
            "down_proj", "post_feedforward_layernorm")


def _order(short: str) -> tuple[int, str]:
    base = short.removesuffix(".bias")
    return (_MODULES.index(base) if base in _MODULES else len(_MODULES), short)


def summarize(lines: dict[str, str]) -> list[str]:
    """One line per group of weights with the same description: ``lines`` maps a tensor's
    name (less ".weight": "model.layers.3.self_attn.q_proj") to its description; a layer's
    modules group by the set of layers they share it with ("layers 0-27 q_proj,k_proj: awq
    4-bit g128"), the others by description ("embed_tokens,norm: dense bfloat16"). In the
    model's order: embedding, layers, final norm and head."""
    layered: dict[tuple[str, str], list[int]] = {}
    top: dict[str, list[str]] = {}
    for name, text in lines.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 3 and parts[2].isdigit():
            short = parts[-1] if parts[-1] != "bias" else ".".join(parts[-2:])
            layered.setdefault((short, text), []).append(int(parts[2]))
        else:
            top.setdefault(text, []).append(name.removeprefix("model."))
    groups: dict[tuple[tuple[int, ...], str], list[str]] = {}
    for (short, text), layers in sorted(layered.items(), key=lambda kv: _order(kv[0][0])):
        groups.setdefault((tuple(sorted(set(layers))), text), []).append(short)
    first = [f"{','.join(names)}: {text}" for text, names in top.items()
             if any(n.startswith("embed") for n in names)]
    last = [f"{','.join(names)}: {text}" for text, names in top.items()
            if not any(n.startswith("embed") for n in names)]
    middle = [f"layer{'s' if len(layers) > 1 else ''} {_ranges(list(layers))} "
              f"{','.join(names)}: {text}"
              for (layers, text), names in sorted(groups.items(), key=lambda g: g[0][0])]
    return first + middle + last
