"""The fast tier against the oracle (`qfuse.oracle`: the quantized model in float32),
beside compat: per prompt, the oracle's greedy trajectory with compat teacher-forced
along it (`oracle_references`, which several tier runs may share), then the fast tier
along the same tokens (`run_oracle_gate`). A prompt passes when fast's agreement with
the oracle is at least compat's minus one per `AGREEMENT_PER` positions and its mean
KL(oracle ‖ fast) at most `KL_RATIO` × compat's + `KL_SLACK` (`RULE`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .. import levers
from ..oracle import oracle_model, oracle_trajectory
from .measures import (
    kernel_dispatches,
    kernels_run,
    kl_divergence,
    progress_bar,
    teacher_forced,
    verdict_sentence,
)

# The fast tier against the oracle (module docstring): per prompt, its agreement with the
# oracle's argmax at least compat's minus one per AGREEMENT_PER positions, its mean
# KL(oracle ‖ fast) at most KL_RATIO × compat's + KL_SLACK. The slack keeps the rule
# meaningful where compat is nearly the oracle (a float32 model: compat is the oracle
# bit for bit), leaving room for a kernel's own summation order there.
AGREEMENT_PER = 64


KL_RATIO = 2.0


KL_SLACK = 1e-4


def agreement_floor(compat_agreement: int, positions: int) -> int:
    """The least agreement with the oracle the fast tier may have on a prompt."""
    return compat_agreement - positions // AGREEMENT_PER


def fast_kl_limit(compat_mean_kl: float) -> float:
    """The largest mean KL(oracle ‖ fast) the fast tier may have on a prompt."""
    return KL_RATIO * compat_mean_kl + KL_SLACK


RULE = (f"against the oracle: agreement ≥ compat's − 1 per {AGREEMENT_PER}, mean KL ≤ "
        f"{KL_RATIO:g} × compat's + {KL_SLACK:g}, per prompt")


@dataclass
class OracleReference:
    """One prompt's judging reference: the oracle's greedy continuation (``tokens``) with
    its logits [n, V] and hidden states [layers, n, H], and compat's teacher-forced
    along it."""
    prompt: str
    prompt_ids: list[int]
    tokens: list[int]
    logits: torch.Tensor
    hidden: torch.Tensor
    compat_logits: torch.Tensor
    compat_hidden: torch.Tensor


@dataclass
class OracleRow:
    """One prompt of the fast tier's gate against the oracle (`run_oracle_gate`)."""
    prompt: str
    positions: int
    fast_agreement: int  # positions where fast's argmax is the oracle's
    compat_agreement: int
    fast_mean_kl: float  # KL(oracle ‖ fast) per position
    fast_max_kl: float
    compat_mean_kl: float
    compat_max_kl: float
    fast_layer_divergence: float  # max over layers and positions, relative to the oracle
    compat_layer_divergence: float
    # information: fast against compat along the same tokens
    fast_compat_agreement: int
    fast_compat_mean_kl: float
    kernels: dict[str, int] = field(default_factory=dict)

    @property
    def agreement_floor(self) -> int:
        return agreement_floor(self.compat_agreement, self.positions)

    @property
    def kl_limit(self) -> float:
        return fast_kl_limit(self.compat_mean_kl)

    @property
    def passed(self) -> bool:
        return self.fast_agreement >= self.agreement_floor and self.fast_mean_kl <= self.kl_limit


def oracle_references(model, golden: dict, kv_bits: int = 0, kv_group_size: int = 64,
                      oracle=None, progress: bool = True) -> list[OracleReference]:
    """Per golden prompt, the oracle's trajectory (as many tokens as the golden
    continuation) and compat teacher-forced along it. ``oracle``: `oracle.oracle_model`
    of ``model``, made here when not given."""
    oracle = oracle_model(model) if oracle is None else oracle
    refs = []
    for t in progress_bar(golden["trajectories"], "oracle and compat", progress):
        tokens, logits, hidden = oracle_trajectory(oracle, t["prompt_ids"],
                                                   len(t["continuation"]), kv_bits,
                                                   kv_group_size)
        with levers.use_tier("compat"):
            compat_logits, compat_hidden = teacher_forced(model, t["prompt_ids"], tokens,
                                                          kv_bits, kv_group_size)
        refs.append(OracleReference(t["prompt"], t["prompt_ids"], tokens, logits, hidden,
                                    compat_logits, compat_hidden))
    return refs


def _divergence(hidden: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((hidden - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max())


def run_oracle_gate(model, golden: dict, kv_bits: int = 0, kv_group_size: int = 64,
                    references: list[OracleReference] | None = None, oracle=None,
                    progress: bool = True) -> list[OracleRow]:
    """The fast tier against the oracle, per golden prompt (`OracleRow`; the rule:
    `oracle_passes`). ``references``: `oracle_references` of the same model and KV
    setting, made here when not given (several tier runs may share one)."""
    if references is None:
        references = oracle_references(model, golden, kv_bits, kv_group_size, oracle, progress)
    rows = []
    for ref in progress_bar(references, "gate (fast)", progress):
        before = levers.counters()
        with levers.use_tier("fast"):
            logits, hidden = teacher_forced(model, ref.prompt_ids, ref.tokens, kv_bits,
                                            kv_group_size)
        kernels = kernel_dispatches(before, levers.counters())
        best = ref.logits.argmax(-1)
        fast_kl, compat_kl = kl_divergence(ref.logits, logits), kl_divergence(ref.logits,
                                                                              ref.compat_logits)
        rows.append(OracleRow(
            prompt=ref.prompt, positions=len(ref.tokens),
            fast_agreement=int((logits.argmax(-1) == best).sum()),
            compat_agreement=int((ref.compat_logits.argmax(-1) == best).sum()),
            fast_mean_kl=float(fast_kl.mean()), fast_max_kl=float(fast_kl.max()),
            compat_mean_kl=float(compat_kl.mean()), compat_max_kl=float(compat_kl.max()),
            fast_layer_divergence=_divergence(hidden, ref.hidden),
            compat_layer_divergence=_divergence(ref.compat_hidden, ref.hidden),
            fast_compat_agreement=int((logits.argmax(-1) == ref.compat_logits.argmax(-1)).sum()),
            fast_compat_mean_kl=float(kl_divergence(ref.compat_logits, logits).mean()),
            kernels=kernels))
    return rows


def oracle_passes(rows: list[OracleRow]) -> bool:
    """Whether every prompt meets the rule (whatever ran: see `oracle_verdict`)."""
    return all(r.passed for r in rows)


def oracle_verdict(rows: list[OracleRow]) -> str:
    """PASS or FAIL under the oracle rule when a fused kernel ran; NOT TESTED when none did."""
    if not kernels_run(rows):
        return "NOT TESTED"
    return "PASS" if oracle_passes(rows) else "FAIL"


def oracle_verdict_line(rows: list[OracleRow], device: str) -> str:
    """The sentence `qfuse gate --tier fast` ends with: the verdict, the rule, the kernels."""
    return verdict_sentence(rows, "fast", device, oracle_verdict(rows), f" ({RULE})")


def oracle_report(rows: list[OracleRow]) -> str:
    """The table: per prompt, fast's and compat's agreement with the oracle and mean KL
    from it side by side, the limits they set, and fast against compat (information)."""
    head = (f"{'prompt':<24}{'fast agree':>11}{'compat':>8}{'floor':>6}{'fast KL':>10}"
            f"{'compat KL':>10}{'limit':>10}{'fast/compat':>13}{'KL':>10}{'':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.prompt[:22].encode('unicode_escape').decode():<24}"
                     f"{r.fast_agreement:>7}/{r.positions:<3}{r.compat_agreement:>8}"
                     f"{r.agreement_floor:>6}{r.fast_mean_kl:>10.2e}{r.compat_mean_kl:>10.2e}"
                     f"{r.kl_limit:>10.2e}{r.fast_compat_agreement:>9}/{r.positions:<3}"
                     f"{r.fast_compat_mean_kl:>10.2e}{'ok' if r.passed else 'FAIL':>6}")
    lines.append("agree: next-token argmax equal to the oracle's, along the oracle's greedy "
                 "trajectory; KL: mean KL(oracle ‖ tier); floor, limit: what fast needs "
                 "(from compat's); fast/compat: fast against compat (information)")
    return "\n".join(lines)


def oracle_rows_as_dicts(rows: list[OracleRow]) -> list[dict]:
    return [{**asdict(r), "agreement_floor": r.agreement_floor, "kl_limit": r.kl_limit,
             "pass": r.passed} for r in rows]
