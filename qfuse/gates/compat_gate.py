"""A tier against compat along the golden trajectories (`run_gate`): per prompt, argmax
agreement, KL(compat ‖ tier), per-layer hidden-state divergence and bitwise equality of
the logits. The exact tier's gate (logits bitwise equal to compat's), and the tensor-
parallel gate's (at least 63/64 agreement and a mean KL within `KL_FLOOR`): `passes`,
`verdict`, `verdict_line`, the table (`report`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .. import levers
from .measures import (
    kernel_dispatches,
    kernels_run,
    kl_divergence,
    progress_bar,
    teacher_forced,
    verdict_sentence,
)


@dataclass
class GateRow:
    prompt: str
    agreement: int
    positions: int
    mean_kl: float
    max_kl: float
    max_layer_divergence: float
    bitwise_equal: bool
    compat_matches_golden: int  # positions where compat's argmax is the golden token
    # fused kernel → dispatches while the tier ran; empty: the tier ran the reference only
    kernels: dict[str, int] = field(default_factory=dict)


def run_gate(model, golden: dict, tier_name: str, kv_bits: int = 0,
             kv_group_size: int = 64, progress: bool = True) -> list[GateRow]:
    rows = []
    for t in progress_bar(golden["trajectories"], f"gate ({tier_name})", progress):
        with levers.use_tier("compat"):
            ref_logits, ref_hidden = teacher_forced(model, t["prompt_ids"], t["continuation"],
                                                    kv_bits, kv_group_size)
        before = levers.counters()
        with levers.use_tier(tier_name):
            logits, hidden = teacher_forced(model, t["prompt_ids"], t["continuation"],
                                            kv_bits, kv_group_size)
        kernels = kernel_dispatches(before, levers.counters())
        target = torch.tensor(t["continuation"], device=logits.device)
        kl = kl_divergence(ref_logits, logits)
        div = ((hidden - ref_hidden).norm(dim=-1) / ref_hidden.norm(dim=-1).clamp_min(1e-30))
        rows.append(GateRow(
            prompt=t["prompt"], agreement=int((logits.argmax(-1) == ref_logits.argmax(-1)).sum()),
            positions=len(t["continuation"]), mean_kl=float(kl.mean()), max_kl=float(kl.max()),
            max_layer_divergence=float(div.max()),
            bitwise_equal=bool(torch.equal(logits, ref_logits)),
            compat_matches_golden=int((ref_logits.argmax(-1) == target).sum()),
            kernels=kernels))
    return rows


KL_FLOOR = 1e-3  # the mean-KL limit of a tier judged against compat (the TP gate's)


def passes(rows: list[GateRow], tier_name: str, limit: float = KL_FLOOR) -> bool:
    """Whether rows against compat meet the tier's targets (whatever ran: see `verdict`):
    exact, bitwise equal logits; fast (the tensor-parallel gate's rule), at least 63/64
    agreement and a mean KL within ``limit``."""
    if tier_name == "exact":
        return all(r.bitwise_equal for r in rows)
    return all(r.agreement >= r.positions - r.positions // 64 and r.mean_kl <= limit
               for r in rows)


def verdict(rows: list[GateRow], tier_name: str, limit: float = KL_FLOOR) -> str:
    """PASS or FAIL when at least one fused kernel ran in the tier; NOT TESTED when
    none did (compat was compared with itself, which proves nothing)."""
    if not kernels_run(rows):
        return "NOT TESTED"
    return "PASS" if passes(rows, tier_name, limit) else "FAIL"


def verdict_line(rows: list[GateRow], tier_name: str, device: str,
                 limit: float = KL_FLOOR) -> str:
    """The sentence a gate against compat ends with: the verdict, the KL limit it used
    and which kernels it covers."""
    rule = "" if tier_name == "exact" else f" (mean-KL limit {limit:.2g})"
    return verdict_sentence(rows, tier_name, device, verdict(rows, tier_name, limit), rule)


def report(rows: list[GateRow]) -> str:
    """The table: per prompt, agreement with compat, KL, layer divergence, bitwise
    equality, and how many golden tokens compat itself still reproduces here (fewer
    than all: this device, dtype or KV setting is not the golden's)."""
    head = (f"{'prompt':<28}{'agree':>9}{'mean KL':>11}{'max KL':>11}{'layer div':>11}"
            f"{'bitwise':>9}{'golden':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.prompt[:26].encode('unicode_escape').decode():<28}"
                     f"{r.agreement:>5}/{r.positions:<3}{r.mean_kl:>11.2e}{r.max_kl:>11.2e}"
                     f"{r.max_layer_divergence:>11.2e}{r.bitwise_equal!s:>9}"
                     f"{r.compat_matches_golden:>5}/{r.positions:<3}")
    lines.append("golden: positions where compat's own argmax is still the golden token")
    return "\n".join(lines)


def rows_as_dicts(rows: list[GateRow]) -> list[dict]:
    return [asdict(r) for r in rows]
