"""Levers: the tier, the per-kernel opt-outs and the dispatch counters, read in one place.

Tiers, each admitting every kernel of the tiers below it and more:

- ``compat``: every op is the spelled-out PyTorch reference (the oracle).
- ``exact``: fused kernels whose output is bit-identical to compat; others fall back.
- ``fast``: every fused kernel, bit-exact or not (admitted through the gates).

The tier in force, read at every op call: the innermost ``use_tier(name)`` block
around the call (a context variable, so thread-safe: a block sets the tier of the
code in its own thread or asyncio task, never of another already running), else
``QFUSE_TIER``, else ``fast`` when the tensors live on a CUDA device and ``compat``
otherwise. Every kernel is on; its variable, ``QFUSE_<NAME>=0``, turns it off.
Environment variables are read at every call, so a test or a user can flip them
at run time. `check_environment` refuses, once at start-up, a QFUSE_* name qfuse does
not read and a value its reader would refuse or misread (the table `ENVIRONMENT`).

This module imports neither torch nor Triton (the CLI's flags read its tiers before
anything heavy is imported); `triton_available` is how the rest of the package asks
for Triton, which is optional.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import logging
import os
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger("qfuse")


class Tier(enum.IntEnum):
    """Ordered: a kernel admitted in a lower tier is admitted in every higher one."""

    COMPAT = 0
    EXACT = 1
    FAST = 2


@dataclass(frozen=True)
class KernelInfo:
    name: str  # the counter's key and the suffix of the opt-out variable
    min_tier: Tier  # EXACT for bit-identical kernels, FAST for the rest
    summary: str

    @property
    def env_var(self) -> str:
        return f"QFUSE_{self.name.upper()}"


# Every fused kernel the package knows; `qfuse info` prints this table.
KERNELS: dict[str, KernelInfo] = {
    k.name: k
    for k in (
        KernelInfo("gated_act", Tier.EXACT, "act(a)*b (GeGLU/SwiGLU), bit-exact, with backward"),
        KernelInfo(
            "decode_attention", Tier.FAST, "flash-decoding over a 4/8-bit or dense KV cache"
        ),
        KernelInfo("decode_attention_whole", Tier.FAST,
                   "decode attention without splits or merge, one program per (sequence, "
                   "kv head) over its whole context, for 8+ rows over caches of a few "
                   "thousand tokens; on a GPU only with =1 until measured faster"),
        KernelInfo("kv_append", Tier.EXACT, "quantize one new K/V token into the cache"),
        KernelInfo("prefill_sdpa", Tier.FAST, "prompt attention through torch SDPA"),
        KernelInfo("fused_mlp", Tier.FAST,
                   "quantized MLP where qmatmul_mma does not apply (1-16 bf16 or 1-4 "
                   "fp16/fp32 rows): 2 dispatches, deterministic"),
        KernelInfo("rope", Tier.EXACT,
                   "rotary embedding x·cos + rotate_half(x)·sin in one launch, bit-exact"),
        KernelInfo("rms_norm", Tier.FAST,
                   "RMSNorm in one launch (float32 sum of squares in its own order), and "
                   "a layer's residual joint (norm, add, next norm) in one"),
        KernelInfo("qmatmul_mma", Tier.FAST,
                   "x·Wᵀ and the MLP, 1-32 bf16 rows, 4-bit g64/g128: mma.sync over codes "
                   "repacked once per weight, scales factored per group"),
        KernelInfo("qmatmul_ring", Tier.FAST,
                   "x·Wᵀ over fragment-held 4-bit weights on Hopper, TMA ring + producer "
                   "warp: 1-8 rows where the grid is many waves deep (the head), 9-32 "
                   "rows where it is not (the layer products)"),
        KernelInfo("qmatmul_wgmma", Tier.FAST,
                   "x·Wᵀ over fragment-held 4-bit weights on Hopper for 33-256 bf16 rows "
                   "(serving batches): wgmma with the codes dequantized in registers"),
        KernelInfo("fused_steps", Tier.FAST,
                   "a decode layer as fused steps (Q/K/V + norms + RoPE + KV append; "
                   "attention; O + residual joint; gate/up + activation; down + joint + "
                   "next norm): MLX-layout 4/8-bit weights (1-4 rows) or fragment-held "
                   "(1-8 bf16 rows); on a GPU only with =1 until measured faster at every "
                   "row count"),
        KernelInfo("qmatmul", Tier.FAST,
                   "x·Wᵀ over 4/8-bit weights where qmatmul_mma does not apply (1 bf16 "
                   "or 1-4 fp16/fp32 rows: CUDA-core GEMV; more bf16 rows: tensor cores "
                   "to 16, then dequantize + cuBLAS)"),
    )
}

_counters: Counter[str] = Counter()
_said_once: set[tuple[str, str]] = set()


# The tier set by use_tier for the code running in this context; None outside any block.
_chosen_tier: contextvars.ContextVar[Tier | None] = contextvars.ContextVar(
    "qfuse_tier", default=None)


def _parse_tier(value: str | Tier, source: str) -> Tier:
    if isinstance(value, Tier):
        return value
    try:
        return Tier[str(value).strip().upper()]
    except KeyError:
        raise ValueError(f"{source} must be one of compat, exact, fast; got {value!r}") from None


def use_tier(name: str | Tier) -> contextlib.AbstractContextManager[Tier]:
    """A context manager: the ops called inside the block run in tier ``name``
    (compat, exact or fast), whatever QFUSE_TIER and the device say; leaving the
    block, by an exception too, brings back the tier before it. Blocks nest (the
    innermost wins) and hold in their own thread or asyncio task only: other
    threads keep their tier. A bad name raises ValueError at once."""
    return _tier_block(_parse_tier(name, "the tier"))


@contextlib.contextmanager
def _tier_block(chosen: Tier) -> Iterator[Tier]:
    token = _chosen_tier.set(chosen)
    try:
        yield chosen
    finally:
        _chosen_tier.reset(token)


def tier(device: torch.device | str | None = None) -> Tier:
    """The tier in force for tensors on ``device``: use_tier's, else QFUSE_TIER, else
    by device."""
    chosen = _chosen_tier.get()
    if chosen is not None:
        return chosen
    value = os.environ.get("QFUSE_TIER", "").strip().lower()
    if value:
        return _parse_tier(value, "QFUSE_TIER")
    if device is not None and not hasattr(device, "type"):  # "cuda:1", 0, ...
        import torch

        device = torch.device(device)
    if device is not None and device.type == "cuda":
        return Tier.FAST
    return Tier.COMPAT


def kernel_enabled(name: str) -> bool:
    """Every kernel is on unless its variable (QFUSE_<NAME>) says 0/false/off/no."""
    value = os.environ.get(KERNELS[name].env_var)
    return value is None or value.strip().lower() not in ("0", "false", "off", "no")


def kernel_requested(name: str) -> bool:
    """Whether QFUSE_<NAME> explicitly turns the kernel on (1/true/on/yes): for a kernel
    that runs by default only where it has been measured to pay."""
    value = os.environ.get(KERNELS[name].env_var)
    return value is not None and value.strip().lower() in ("1", "true", "on", "yes")


@contextlib.contextmanager
def setting(var: str, value: str) -> Iterator[None]:
    """Run the block with environment variable ``var`` set to ``value`` (the previous
    value, or its absence, restored afterwards), and the levers re-read on the way in
    and out (`reload`): a model's plans made before the block are not used inside it."""
    old = os.environ.get(var)
    os.environ[var] = value
    reload()
    try:
        yield
    finally:
        if old is None:
            del os.environ[var]
        else:
            os.environ[var] = old
        reload()


# Bumped by `reload`: plans made under an older generation are not used again.
_generation = 0
_interpreter: tuple[int, bool] | None = None  # (generation, TRITON_INTERPRET == "1")


def reload() -> None:
    """Say that the environment's levers may have changed (a test's monkeypatch, a
    program that sets QFUSE_* itself): plans are made anew, and TRITON_INTERPRET is read
    again. The per-call ops read the environment at every call and need no reload."""
    global _generation
    _generation += 1


def plan_state() -> tuple:
    """What a plan's choices depend on among the levers, read without the environment:
    the `use_tier` block in force (None outside one) and the generation of `reload`."""
    return _chosen_tier.get(), _generation


def interpreter_active() -> bool:
    """Triton's CPU interpreter runs kernels on CPU tensors (tests only; slow). Read once
    per `reload` generation: Triton itself reads it when a kernel is decorated, and the
    launchers ask it at every launch."""
    global _interpreter
    if _interpreter is None or _interpreter[0] != _generation:
        _interpreter = (_generation, os.environ.get("TRITON_INTERPRET", "0") == "1")
    return _interpreter[1]


@functools.cache  # asked on every op call: a missing module is not looked for each time
def triton_available() -> bool:
    """Whether Triton imports (the kernels need it; without it every op runs the reference)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def count(name: str) -> None:
    _counters[name] += 1


def counters() -> dict[str, int]:
    """Dispatches per kernel (and per reference op, keyed ``ref:<op>``) since the last reset."""
    return dict(_counters)


def reset_counters() -> None:
    _counters.clear()


def say_once(kernel: str, reason: str, instead: str = "the reference") -> None:
    """Log, once per (kernel, reason), why a call fell back to ``instead``."""
    if (kernel, reason) not in _said_once:
        _said_once.add((kernel, reason))
        log.debug("qfuse: %s falls back to %s: %s", kernel, instead, reason)


# Every QFUSE_* variable qfuse reads → the values it takes (an empty value is as unset).
# `check_environment` refuses any other QFUSE_* name and any other value, so a typo is
# one line at start-up rather than a lever silently ignored, or a failure mid-run.
_SWITCH_VALUES = ("0", "1", "false", "true", "off", "on", "no", "yes")
ENVIRONMENT: dict[str, tuple[str, ...]] = {
    "QFUSE_TIER": tuple(t.name.lower() for t in Tier),
    "QFUSE_PDL": ("0", "1"),  # kernels/common/pdl.py, read at import
    **{k.env_var: _SWITCH_VALUES for k in KERNELS.values()},
}
# Read as given (kernels/common/pdl.py compares with "0"): not stripped or lower-cased first.
_READ_AS_GIVEN = frozenset({"QFUSE_PDL"})


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse, as one UserError line naming each problem, a QFUSE_* variable of
    ``environ`` (default: the process's) that qfuse does not read (with the known name
    closest to it) or whose value its reader would refuse or misread: a tier other than
    compat/exact/fast, a kernel switch other than 0/1 (or off/on, false/true, no/yes).
    The entry points call it once at start-up (the CLI, `qfuse serve`, `qfuse.load`)."""
    import difflib

    from .errors import UserError

    environ = os.environ if environ is None else environ
    problems = []
    for name in sorted(n for n in environ if n.startswith("QFUSE_")):
        raw = environ[name]
        if name not in ENVIRONMENT:
            # Compared without the prefix every name shares, which would make all close.
            close = difflib.get_close_matches(name[len("QFUSE_"):],
                                              [k[len("QFUSE_"):] for k in ENVIRONMENT], n=1)
            hint = (f"did you mean QFUSE_{close[0]}?" if close else
                    "it reads QFUSE_TIER, QFUSE_PDL and a QFUSE_<KERNEL> switch per kernel "
                    "of `qfuse info`")
            problems.append(f"{name} is not a variable qfuse reads ({hint})")
            continue
        value = raw if name in _READ_AS_GIVEN else raw.strip().lower()
        allowed = ENVIRONMENT[name]
        if value == "" or value in allowed:
            continue
        if allowed is _SWITCH_VALUES:
            what = "0 or 1 (off or on)"
        elif len(allowed) == 2:
            what = " or ".join(allowed)
        else:
            what = "one of " + ", ".join(allowed)
        problems.append(f"{name} must be {what}, got {raw!r}")
    if problems:
        raise UserError("; ".join(problems))
