"""`qfuse quantize`: write an MLX-layout quantized checkpoint from an HF one.

Every Linear weight of the decoder (attention and MLP projections, the
embedding and an untied lm_head) becomes `<p>.weight` (uint32 packed),
`<p>.scales` and `<p>.biases`; norms and biases stay dense. config.json gains
`"quantization": {"group_size": g, "bits": b, <module path>: {...} | false}`,
which both qfuse and mlx-lm read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from .loading import _canonical, safetensors_files
from .models import ModelConfig
from .quant import quantize
from .saving import save_safetensors

# Weight names (after the model prefix) that are quantized: every Linear plus the embedding.
_QUANTIZABLE = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")


def quantize_checkpoint(src: str | Path, dst: str | Path, bits: int = 4, group_size: int = 64,
                        overrides: dict[str, dict | bool] | None = None, dtype=None) -> Path:
    """Quantize ``src`` into ``dst``. overrides: module path → {"bits", "group_size"}, or
    False to keep that module dense. Returns dst."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization"):
        raise ValueError(f"{src} is already quantized")
    overrides = overrides or {}
    tied = ModelConfig.from_dict(config).tie_word_embeddings
    dst.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    quant_block: dict = {"group_size": group_size, "bits": bits}
    files = safetensors_files(src)
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names = list(f.keys())
            for raw in tqdm(names, desc=f"quantizing {file.name}", unit="tensor"):
                name = _canonical(raw)
                t = f.get_tensor(raw)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                if name == "lm_head.weight" and tied:
                    continue  # tied: the (quantized) embedding is the head
                if not name.endswith(_QUANTIZABLE) or t.dim() != 2:
                    out[name] = t.contiguous()
                    continue
                module = name[: -len(".weight")]
                spec = overrides.get(module, True)
                if spec is False:
                    quant_block[module] = False
                    out[name] = t.contiguous()
                    continue
                g = spec.get("group_size", group_size) if isinstance(spec, dict) else group_size
                b = spec.get("bits", bits) if isinstance(spec, dict) else bits
                if t.shape[-1] % g:
                    raise ValueError(f"{name}: {t.shape[-1]} input features are not a multiple of "
                                     f"group size {g}")
                if (g, b) != (group_size, bits):
                    quant_block[module] = {"group_size": g, "bits": b}
                packed, scales, biases = quantize(t, g, b)
                out[f"{module}.weight"] = packed
                out[f"{module}.scales"] = scales
                out[f"{module}.biases"] = biases
    save_safetensors(out, dst, metadata={"format": "mlx"})
    config["quantization"] = quant_block
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "generation_config.json"):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)
    return dst


def quantize_model(model, bits: int = 4, group_size: int = 64):
    """An in-memory copy of a dense Decoder with every Linear (and the embedding)
    quantized in the MLX layout, as `quantize_checkpoint` would write it."""
    from dataclasses import replace

    from .models import Decoder
    from .models.decoder import Linear
    from .quant import quantize

    cfg = replace(model.config, quantization={"group_size": group_size, "bits": bits})
    qmodel = Decoder(cfg, lambda path: (group_size, bits)).to(model.model.norm.weight.device)
    dense_modules = dict(model.named_modules())
    state = {}
    for name, module in qmodel.named_modules():
        if isinstance(module, Linear):  # Embedding is a Linear too
            src = dense_modules[name]
            packed, scales, biases = quantize(src.weight.detach(), group_size, bits)
            state[f"{name}.weight"], state[f"{name}.scales"] = packed, scales
            state[f"{name}.biases"] = biases
            if src.bias is not None:
                state[f"{name}.bias"] = src.bias.detach()
    for key, value in model.state_dict().items():
        state.setdefault(key, value)
    qmodel.load_state_dict(state)
    return qmodel.to(dtype=model.dtype)
