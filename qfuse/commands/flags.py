"""Flags and helpers shared by several `qfuse` commands: the KV cache, generation and
tensor-parallel flags, the model folder default, and a progress line for waits."""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
from pathlib import Path

from .. import levers
from ..errors import UserError

DTYPES = ["float32", "bfloat16", "float16"]


def add_kv_cache_args(p: argparse.ArgumentParser) -> None:
    from ..quant import SUPPORTED_GROUP_SIZES
    from ..runtime.cache import KV_BITS

    p.add_argument("--kv-bits", type=int, default=0, choices=KV_BITS, help="0: dense KV cache")
    p.add_argument("--kv-group-size", type=int, default=64, choices=SUPPORTED_GROUP_SIZES,
                   help="KV cache quantization group (with --kv-bits 4|8)")


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="default: bfloat16 on cuda, float32 on cpu")


def add_model_option(p: argparse.ArgumentParser) -> None:
    """--model MODEL, the spelled-out twin of a command's positional [MODEL]."""
    p.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                   help="checkpoint folder, instead of the positional (default: the "
                        "bundled model)")


def chosen_model(args) -> str:
    """The positional [MODEL] or --model MODEL (both: a UserError), else the bundled
    model; stored back in ``args.model``."""
    if args.model_option is not None:
        if args.model is not None:
            raise UserError(f"two models: {args.model} and --model {args.model_option}")
        args.model = args.model_option
    args.model = str(model_dir(args.model))
    return args.model


def add_generation_args(p: argparse.ArgumentParser) -> None:
    """Sampling, cache, device and tier flags of `generate` and `chat`."""
    add_model_option(p)
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest; 0: off")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample within the smallest set of this mass, in (0, 1]")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens under this fraction of the likeliest's probability, in [0, 1)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already seen; 1: off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh one)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--max-kv-size", type=int, default=None, metavar="N",
                   help="KV cache size in tokens (default: the model's context). A prompt that "
                        "does not fit with --max-tokens is an error without it; with it, the "
                        "prompt's start is dropped to keep its last N - max-tokens tokens (chat "
                        "drops the oldest turns first). Unlike mlx-lm's rotating cache, "
                        "generation never runs past N tokens")
    add_kv_cache_args(p)
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false", default=None,
                   help="decode eagerly on CUDA (default: replay the step as a CUDA graph)")
    add_device_args(p)
    add_check_weights_arg(p)
    p.add_argument("--tier", default=None, choices=[t.name.lower() for t in levers.Tier],
                   help="the ops' tier, as QFUSE_TIER (which it overrides): compat, the "
                        "PyTorch reference; exact, only kernels bit-identical to it; fast, "
                        "every kernel (default: QFUSE_TIER, else fast on cuda, compat on cpu)")


def add_check_weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-check-weights", dest="check_weights", action="store_false",
                   default=True,
                   help="load without looking for NaN/inf in the weights (by default one "
                        "min/max pass over each tensor as it is read: ~0.25 s per GB on one "
                        "CPU core, seconds for a model of many GB)")


def chosen_tier(args):
    """A block running in ``--tier`` (from add_generation_args), or as set outside."""
    return levers.use_tier(args.tier) if args.tier else contextlib.nullcontext()


def add_tp_args(p: argparse.ArgumentParser, command: str) -> None:
    """The tensor-parallel flags, in a group of their own that --help lists after the
    common flags (they matter only on several GPUs)."""
    p = p.add_argument_group("tensor parallel (several GPUs, under torchrun)")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help=f"tensor parallel over N GPUs: start as `torchrun --nproc-per-node N -m "
                        f"qfuse {command} ...` (default: torchrun's process count, 1 without it)")
    p.add_argument("--tp-allreduce", default="p2p", choices=["p2p", "nccl", "symm_mem"],
                   help="the all-reduce of tensor parallel on CUDA: p2p (default): qfuse's "
                        "one-shot kernel, decode rows pushed to the peers over NVLink, NCCL "
                        "for prefill; nccl; symm_mem: PyTorch symmetric memory's one-shot")
    p.add_argument("--tp-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="how long a rank waits for the others (start, loading, each "
                        "collective) before it stops with an error")


def world_size() -> int:
    """The torchrun job's process count (1 outside torchrun)."""
    from ..parallel.comm import world_from_env

    return world_from_env()


def model_dir(model: str | None) -> Path:
    """The model folder to use: the argument, else the model bundled in the package."""
    from ..loading import DEFAULT_MODEL

    if model is not None:
        return Path(model)
    if not (DEFAULT_MODEL / "config.json").exists():
        raise UserError("no model given and no default model is bundled in this build yet "
                        f"(expected {DEFAULT_MODEL}); pass a checkpoint folder")
    return DEFAULT_MODEL


class Elapsed:
    """A progress line (tqdm, stderr) for a wait with nothing to count: its elapsed
    time, refreshed by a thread twice a second until closed."""

    def __init__(self, desc: str):
        from tqdm import tqdm

        self._bar = tqdm(desc=desc, total=None, bar_format="{desc}: {elapsed}", leave=False,
                         file=sys.stderr)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        while not self._done.wait(0.5):
            self._bar.refresh()

    def close(self) -> None:
        if not self._done.is_set():
            self._done.set()
            self._thread.join()
            self._bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
