"""What both gates measure with: a tier's logits and hidden states teacher-forced along
given tokens (`teacher_forced`: prefill, then one cached decode step per token, so the
decode kernels run), KL(ref ‖ tier) in float64 (`kl_divergence`), the fused kernels that
ran while a tier ran (`kernel_dispatches`, `kernels_run`), the sentence a verdict ends
with (`verdict_sentence`: NOT TESTED where no fused kernel ran), and the progress bar
over a gate's slow loops.
"""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

from .. import levers
from ..oracle import decode_along


def teacher_forced(model, prompt_ids: list[int], continuation: list[int], kv_bits: int = 0,
                   kv_group_size: int = 64):
    """Logits [len(continuation), V] predicting each continuation token, and per-layer
    hidden states [layers, len(continuation), H], from prefill + cached decode steps
    (`oracle.decode_along`), in the tier in force."""
    return decode_along(model, prompt_ids, len(continuation), kv_bits, kv_group_size,
                        continuation)[1:]


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) ‖ softmax(logits)) per row, in float64: near-equal
    distributions give KLs of 1e-8 and below, which float32 sums turn negative."""
    logp_ref = torch.log_softmax(ref_logits.double(), -1)
    return (logp_ref.exp() * (logp_ref - torch.log_softmax(logits.double(), -1))).sum(-1)


def kernel_dispatches(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Fused-kernel dispatches between two `levers.counters()` (``ref:`` keys are the
    reference's)."""
    return {k: n - before.get(k, 0) for k, n in sorted(after.items())
            if not k.startswith("ref:") and n > before.get(k, 0)}


def kernels_run(rows) -> dict[str, int]:
    """Fused kernel → dispatches over all rows' tier runs (`GateRow`s or `OracleRow`s)."""
    total: dict[str, int] = {}
    for r in rows:
        for k, n in r.kernels.items():
            total[k] = total.get(k, 0) + n
    return dict(sorted(total.items()))


def progress_bar(items, desc: str, show: bool, unit: str = "prompt"):
    """A progress bar on stderr over a gate's slow loop (seconds per prompt on a CPU)."""
    return tqdm(items, desc=desc, unit=unit, leave=False, disable=not show, file=sys.stderr)


def verdict_sentence(rows, tier_name: str, device: str, result: str, rule: str) -> str:
    ran = kernels_run(rows)
    if not ran:
        return (f"{tier_name} tier: NOT TESTED: no fused kernel ran on {device} (every op "
                "fell back to the reference), so this compared compat with itself")
    eligible = [k.name for k in levers.KERNELS.values()  # switched off: not expected to run
                if k.min_tier <= levers.Tier[tier_name.upper()] and levers.kernel_enabled(k.name)]
    unused = [k for k in eligible if k not in ran]
    line = f"{tier_name} tier: {result}{rule}"
    line += " (kernels run: " + ", ".join(f"{k} ×{n}" for k, n in ran.items()) + ")"
    if unused:
        line += f"; not run here (the reference served them): {', '.join(unused)}"
    return line
