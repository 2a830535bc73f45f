"""`qfuse info [MODEL_DIR]`: versions, the device, and for every fused kernel its switch and
whether a call on this device would run it or the reference; with a model, the plan of its
decode step (each op site, the kernel chosen for it, and why) and how the checkpoint stores
each weight (its source format, grouped by layers; what the model's dtype rounds)."""

from __future__ import annotations

import importlib.metadata
import os
import platform

from .. import __version__, levers
from .flags import DTYPES


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="versions, device, kernels; with a model, its decode plan")
    p.add_argument("model", nargs="?", default=None,
                   help="a model folder: also print its decode step's plan (each op site, "
                        "the kernel chosen for it, and why)")
    p.add_argument("--rows", type=int, default=1, metavar="N",
                   help="sequences in the planned decode step (default 1)")
    p.add_argument("--kv-bits", type=int, default=0, choices=(0, 4, 8),
                   help="KV cache bits of the planned step (0: the model's dtype)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="the model's dtype: the plan's, and what the weights section says "
                        "it rounds (default: bfloat16 on cuda, float32 on cpu)")


def run(args) -> int:
    print("\n".join(info_lines()))
    if args.model is not None:
        import torch

        dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
        dtype = getattr(torch, dtype)
        print("\n".join(plan_lines(args.model, args.rows, args.kv_bits, dtype)))
        print("\n".join(weight_lines(args.model, dtype)))
    return 0


def weight_lines(model_dir: str, dtype) -> list[str]:
    """How the checkpoint in ``model_dir`` stores each weight, grouped (`formats.sources`),
    with what holding it in ``dtype`` rounds and by how much."""
    from ..formats.sources import dtype_name, summarize
    from ..loading import weight_sources

    sources = weight_sources(model_dir)
    lines = summarize({name: s.line(dtype) for name, s in sources.items()})
    exact = all(s.rounding(dtype) is None for s in sources.values())
    title = (f"weights of {model_dir} as stored, held in {dtype_name(dtype)}"
             f"{' (nothing rounds)' if exact else ''}:")
    return ["", title, *lines]


def plan_lines(model_dir: str, rows: int, kv_bits: int, dtype=None) -> list[str]:
    """The decode plan of the model in ``model_dir`` (`Decoder.decode_plan`), loaded in
    ``dtype`` (default float32)."""
    import torch

    from ..errors import UserError
    from ..loading import load_model

    if rows < 1:
        raise UserError(f"--rows must be at least 1, got {rows}")
    model = load_model(model_dir, dtype=dtype or torch.float32)
    plan = model.decode_plan(rows, kv_bits)
    counts = ", ".join(f"{k} {n}" for k, n in sorted(plan.kernels().items()))
    device = model.model.norm.weight.device
    return ["", f"decode plan of {model_dir}: {rows} row(s), "
                f"{f'{kv_bits}-bit' if kv_bits else 'dense'} KV cache, on {device}, "
                f"tier {levers.tier(device).name.lower()}",
            f"{len(plan.sites)} op sites: {counts}", "", *plan.describe()]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def info_lines() -> list[str]:
    """What `qfuse info` prints: versions, device, and each kernel's status per device."""
    import torch

    lines = [f"qfuse {__version__}", f"python {platform.python_version()}"]
    for dist in ("torch", "triton", "safetensors", "tokenizers", "numpy"):
        lines.append(f"{dist} {_version(dist)}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name() if cuda else "none (CPU only)"
    lines += [f"GPU: {name}", f"device used by default: {device}"]
    lines.append(f"tier on {device}: {levers.tier(device).name.lower()}"
                 f" (QFUSE_TIER={os.environ.get('QFUSE_TIER', 'unset')})")
    lines.append(f"kernels: {_kernels_status(device)}")
    lines.append("")
    header = f"{'kernel':<18}{'min tier':<10}{'switch':<28}{'on ' + device.type:<10}summary"
    lines.append(header)
    lines.append("-" * len(header))
    for k in levers.KERNELS.values():
        lines.append(
            f"{k.name:<18}{k.min_tier.name.lower():<10}"
            f"{k.env_var + ('=1' if levers.kernel_enabled(k.name) else '=0'):<28}"
            f"{_would_run(k.name, device):<10}{k.summary}"
        )
    return lines


def _kernels_status(device) -> str:
    """Whether the fused kernels can run here at all, and if not, why."""
    if not levers.triton_available():
        return "unavailable: no Triton (every op runs the PyTorch reference)"
    if device.type != "cuda" and not levers.interpreter_active():
        return (f"not on {device.type}: they need a CUDA GPU (TRITON_INTERPRET=1 runs them "
                "on the CPU, slowly, for tests)")
    return "available (the table says which a call would run)"


def _would_run(name: str, device) -> str:
    """'kernel' or 'reference': what a supported call on ``device`` would use now."""
    from ..ops import use_kernel

    return "kernel" if use_kernel(name, device) else "reference"
