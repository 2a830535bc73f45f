"""The `qfuse` command line: `qfuse info`, `qfuse bench <name>`.

Each subcommand is a thin wrapper; the work lives in the modules it names.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys

import torch

from . import __version__, levers


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def info_lines() -> list[str]:
    """What `qfuse info` prints: versions, device, and each kernel's status per device."""
    lines = [f"qfuse {__version__}", f"python {platform.python_version()}"]
    for dist in ("torch", "triton", "safetensors", "tokenizers", "numpy"):
        lines.append(f"{dist} {_version(dist)}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name() if cuda else "none (CPU only)"
    lines += [f"GPU: {name}", f"device used by default: {device}"]
    lines.append(f"tier on {device}: {levers.tier(device).name.lower()}"
                 f" (QFUSE_TIER={os.environ.get('QFUSE_TIER', 'unset')})")
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


def _would_run(name: str, device: torch.device) -> str:
    """'kernel' or 'reference': what a supported call on ``device`` would use now."""
    from .ops import use_kernel

    return "kernel" if use_kernel(name, device) else "reference"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qfuse", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, device, kernels and the tier each op would use")
    bench = sub.add_parser("bench", help="GPU benchmarks (JSON + PNG in bench/results/)")
    bench.add_argument("name", choices=["act", "attention"])
    bench.add_argument("--out", default="bench/results", help="folder for <name>.json/.png")
    bench.add_argument("--quick", action="store_true", help="fewer shapes (smoke test)")
    args = parser.parse_args(argv)

    if args.command == "info":
        print("\n".join(info_lines()))
        return 0
    if args.command == "bench":
        if not torch.cuda.is_available():
            print("qfuse bench needs a CUDA GPU; none is visible", file=sys.stderr)
            return 2
        module = importlib.import_module(f"qfuse.bench.{args.name}")
        return module.main(out_dir=args.out, quick=args.quick)
    return 2
