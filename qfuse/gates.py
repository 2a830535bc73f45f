"""Gates: proof that a tier says what the quantized model says, on a fixed prompt suite.

A golden file freezes a few prompts (their token ids) with the compat tier's greedy
continuation of each. The fast tier is judged against the oracle (`qfuse.oracle`): the
same quantized model, the same codes, scales, biases and KV quantization rule, computed
in float32 with no rounding to bf16. Per prompt, the oracle's greedy trajectory is
computed (as many tokens as the golden continuation holds), and compat and the fast
tier are run teacher-forced along it (prefill of the prompt, then one cached decode
step per token, so the decode kernels run) and compared with the oracle:

- argmax agreement with the oracle's next token, fast's and compat's;
- KL(oracle ‖ tier) per position, mean and max, fast's and compat's;
- per-layer hidden-state relative divergence from the oracle.

The fast tier passes a prompt when its agreement is at least compat's minus one token
per 64 positions, and its mean KL is at most 2 × compat's + 1e-4 (FlashAttention's
rule, a fast kernel's error at most twice the spelled-out path's in the same precision,
lifted to the model: `fast_kl_limit`, `agreement_floor`); a configuration passes when
every prompt does. Compat is thereby a yardstick of how far the bf16 arithmetic may
stray from the model, not the truth: a fast path closer to the quantized model than
compat (its products sum s·q + b in float32 where compat rounds each weight to bf16
first) passes, a bug does not. Fast against compat (agreement, KL) is reported beside,
as information. The exact tier's rule is unchanged: logits bitwise equal to compat's,
teacher-forced along the golden trajectory (`run_gate`, which the tensor-parallel gate
also uses, with its own limits against compat).

What the quantization itself costs (`quantization_cost`): the oracle of the quantized
model against the oracle of the dense one, along the dense oracle's trajectory; it
needs a dense source (the model itself when dense) and is reported, not a limit.

A gate is only as true as the kernels it ran: each row records the fused kernels
dispatched while the tier ran, and where none ran (a CPU without the Triton
interpreter falls back to the reference for every op) the verdict is NOT TESTED,
never PASS. The golden file is written only when asked (`write_golden=True`,
`qfuse gate --make-golden`), never as a side effect of a gate.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from . import levers
from .errors import UserError
from .oracle import decode_along, gate_cache, oracle_forced, oracle_model, oracle_trajectory

DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
)


def _progress(items, desc: str, show: bool, unit: str = "prompt"):
    """A progress bar on stderr over a gate's slow loop (seconds per prompt on a CPU)."""
    return tqdm(items, desc=desc, unit=unit, leave=False, disable=not show, file=sys.stderr)


def teacher_forced(model, prompt_ids: list[int], continuation: list[int], kv_bits: int = 0,
                   kv_group_size: int = 64):
    """Logits [len(continuation), V] predicting each continuation token, and per-layer
    hidden states [layers, len(continuation), H], from prefill + cached decode steps
    (`oracle.decode_along`), in the tier in force."""
    return decode_along(model, prompt_ids, len(continuation), kv_bits, kv_group_size,
                        continuation)[1:]


@torch.no_grad()
def make_golden(model, tokenizer, prompts=DEFAULT_PROMPTS, n_tokens: int = 64) -> dict:
    """Greedy compat continuations of the prompts (the frozen trajectories)."""
    out = []
    with levers.use_tier("compat"):
        for p in _progress(prompts, "golden (compat)", True):
            ids = tokenizer.encode(p).ids
            device = model.model.norm.weight.device
            cache = gate_cache(model, len(ids) + n_tokens)
            tok = model(torch.tensor([ids], device=device), cache=cache)[0, -1].argmax()
            cont = [int(tok)]
            for _ in range(n_tokens - 1):
                tok = model.decode(tok.view(1), cache)[0].argmax()
                cont.append(int(tok))
            out.append({"prompt": p, "prompt_ids": ids, "continuation": cont})
    return {"n_tokens": n_tokens, "trajectories": out}


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) ‖ softmax(logits)) per row, in float64: near-equal
    distributions give KLs of 1e-8 and below, which float32 sums turn negative."""
    logp_ref = torch.log_softmax(ref_logits.double(), -1)
    return (logp_ref.exp() * (logp_ref - torch.log_softmax(logits.double(), -1))).sum(-1)


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


def kernel_dispatches(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Fused-kernel dispatches between two `levers.counters()` (``ref:`` keys are the
    reference's)."""
    return {k: n - before.get(k, 0) for k, n in sorted(after.items())
            if not k.startswith("ref:") and n > before.get(k, 0)}


def run_gate(model, golden: dict, tier_name: str, kv_bits: int = 0,
             kv_group_size: int = 64, progress: bool = True) -> list[GateRow]:
    rows = []
    for t in _progress(golden["trajectories"], f"gate ({tier_name})", progress):
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


def kernels_run(rows) -> dict[str, int]:
    """Fused kernel → dispatches over all rows' tier runs (`GateRow`s or `OracleRow`s)."""
    total: dict[str, int] = {}
    for r in rows:
        for k, n in r.kernels.items():
            total[k] = total.get(k, 0) + n
    return dict(sorted(total.items()))


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
    return _verdict_sentence(rows, tier_name, device, verdict(rows, tier_name, limit), rule)


def _verdict_sentence(rows, tier_name: str, device: str, result: str, rule: str) -> str:
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
    for t in _progress(golden["trajectories"], "oracle and compat", progress):
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
    for ref in _progress(references, "gate (fast)", progress):
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
    return _verdict_sentence(rows, "fast", device, oracle_verdict(rows), f" ({RULE})")


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


def save_golden(golden: dict, path: str | Path) -> None:
    """Write ``golden`` to ``path``, only where no file is or an earlier golden file is
    (`check_golden_destination`: any other file is the user's, and stays), atomically:
    a temporary file beside it, renamed over it when complete, so a failure leaves the
    old file whole. A symbolic link is written through (its target replaced)."""
    path = Path(path)
    check_golden_destination(path)
    if path.is_symlink():
        path = path.resolve()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(golden) + "\n")
            f.flush()
            os.fsync(f.fileno())
        # mkstemp makes the file private (0600): give it the mode a plain write would.
        if path.exists():
            shutil.copymode(path, tmp)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_golden_destination(path: str | Path) -> None:
    """UserError unless ``path`` may receive a golden file: a missing file in an
    existing folder, or a file that already is a golden file (by its content)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise UserError(f"cannot write the golden file {path}: folder {path.parent} does "
                        "not exist")
    if not path.exists() and not path.is_symlink():
        return
    try:
        load_golden(path)
    except UserError as e:
        raise UserError(f"{e}; qfuse writes a golden file only where none is or over an "
                        "earlier one, so it leaves this file alone: choose another --golden "
                        "path, or move the file") from None


def load_golden(path: str | Path, vocab_size: int | None = None) -> dict:
    """The golden file at ``path``, checked; a UserError naming the file when it is not
    one (not JSON, not what `make_golden` writes, or with ``vocab_size`` token ids
    that vocabulary lacks: a file written for another model)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a folder, not a golden file")
    try:
        golden = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not a golden file: it is not JSON ({e})") from None
    problem = _golden_problem(golden, vocab_size)
    if problem is not None:
        raise UserError(f"{path} is not a golden file: {problem}")
    return golden


def _golden_problem(golden, vocab_size: int | None) -> str | None:
    """What keeps ``golden`` (parsed JSON) from being a golden file, or None."""
    if not isinstance(golden, dict) or not isinstance(golden.get("trajectories"), list) \
            or not golden["trajectories"]:
        return 'it has no list of "trajectories"'
    if not _is_count(golden.get("n_tokens")):
        return 'it has no "n_tokens" count'
    for i, t in enumerate(golden["trajectories"]):
        for key in ("prompt_ids", "continuation"):
            ids = t.get(key) if isinstance(t, dict) else None
            if not isinstance(ids, list) or not ids or not all(_is_count(x, 0) for x in ids):
                return f'trajectory {i} has no "{key}" token ids'
            if vocab_size is not None and max(ids) >= vocab_size:
                return (f"trajectory {i} holds token id {max(ids)}, outside this model's "
                        f"vocabulary of {vocab_size} (a golden file of another model)")
    return None


def _is_count(x, least: int = 1) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= least


def check_report_path(path: str | Path | None, flag: str = "--json") -> None:
    """UserError unless the report file ``path`` (None: none asked for) can be written
    once the gate has run: not a folder, in a folder that exists."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; name a file in it (e.g. {path / 'gate.json'})")
    if not path.parent.is_dir():
        raise UserError(f"{flag} {path}: folder {path.parent} does not exist")


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


def weights_label(model) -> str:
    """How ``model`` stores its weights, as the cost and bench tables name it: "dense
    weights", "4-bit weights", or "quantized weights (4/8-bit)" for mixed widths."""
    from .models.decoder import Linear

    bits = sorted({m.bits for m in model.modules() if isinstance(m, Linear) and m.bits})
    if not bits:
        return "dense weights"
    if len(bits) == 1:
        return f"{bits[0]}-bit weights"
    return f"quantized weights ({'/'.join(map(str, bits))}-bit)"


@dataclass
class CostReference:
    """One prompt's dense reference for the quantization cost: the dense model's oracle,
    its greedy ``tokens`` with a dense cache and its logits along them."""
    prompt_ids: list[int]
    tokens: list[int]
    logits: torch.Tensor


def cost_references(dense_oracle, golden: dict, progress: bool = True) -> list[CostReference]:
    """Per golden prompt, the dense oracle's greedy trajectory (as many tokens as the
    golden continuation) and its logits."""
    refs = []
    for t in _progress(golden["trajectories"], "dense oracle", progress):
        tokens, logits, _ = oracle_trajectory(dense_oracle, t["prompt_ids"],
                                              len(t["continuation"]))
        refs.append(CostReference(t["prompt_ids"], tokens, logits))
    return refs


def cost_row(config: str, oracle, kv_bits: int, kv_group_size: int,
             refs: list[CostReference]) -> dict:
    """One configuration's cost: ``oracle`` (of the quantized model, or the dense one with
    a quantized cache) teacher-forced along the dense references; mean and max
    KL(dense ‖ it) over all positions, and its top-1 agreement with the dense oracle."""
    kls, agree, total = [], 0, 0
    for ref in refs:
        logits, _ = oracle_forced(oracle, ref.prompt_ids, ref.tokens, kv_bits, kv_group_size)
        kls.append(kl_divergence(ref.logits, logits))
        agree += int((logits.argmax(-1) == ref.logits.argmax(-1)).sum())
        total += len(ref.tokens)
    kl = torch.cat(kls)
    return {"config": config, "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "top1_agreement": agree / total}


@torch.no_grad()
def quantization_cost(dense, golden: dict, quantized=None, bits: int = 4, group_size: int = 64,
                      kv_bits=(8, 4), kv_group_size: int = 64,
                      progress: bool = True) -> list[dict]:
    """What the quantization itself costs, both sides in the oracle (`oracle.oracle_model`:
    float32, no bf16 rounding, so the figure is the quantization's and not the bf16
    arithmetic's): for the quantized weights with a dense cache and with each of
    ``kv_bits``, and for the dense weights with each quantized cache, `cost_row` along
    the dense oracle's greedy trajectories (`cost_references`). ``dense``: a Decoder with
    dense weights; ``quantized``: the same model with quantized weights (default:
    ``dense`` quantized here to ``bits`` in groups of ``group_size``)."""
    from .convert import quantize_model

    if weights_label(dense) != "dense weights":
        raise ValueError(f"the dense source holds {weights_label(dense)}")
    kv_group_size = min(kv_group_size, dense.config.head_dim)  # small test models
    dense_oracle = oracle_model(dense)
    if quantized is None:
        quantized = quantize_model(dense, bits, group_size)
    label = weights_label(quantized)
    if label == "dense weights":
        raise ValueError("the quantized model holds dense weights")
    q_oracle = oracle_model(quantized)
    variants = [(f"{label}, dense KV", q_oracle, 0)]
    variants += [(f"dense weights, {b}-bit KV", dense_oracle, b) for b in kv_bits]
    variants += [(f"{label}, {b}-bit KV", q_oracle, b) for b in kv_bits]
    refs = cost_references(dense_oracle, golden, progress)
    return [cost_row(name, orc, kb, kv_group_size, refs)
            for name, orc, kb in _progress(variants, "quantization cost", progress, "config")]


def cost_report(cost: list[dict]) -> str:
    """`quantization_cost`'s rows, one line per configuration."""
    return "\n".join(f"  {r['config']:<28} mean KL {r['mean_kl']:.2e}  max KL "
                     f"{r['max_kl']:.2e}  top-1 {r['top1_agreement']:.3f}" for r in cost)


# Fields two configs must share for one checkpoint to be the dense source of the other.
_SAME_MODEL = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")


def check_cost_source(config, model_dir: str | Path, dense: str | Path | None) -> None:
    """UserError, before anything loads, unless the quantization cost has a dense source:
    ``dense`` (`--dense DIR`: an unquantized checkpoint of the same model), or, without
    one, the model itself being dense."""
    from .loading import check_checkpoint

    if dense is None:
        if config.quantization:
            bits = config.quantization.get("bits", "?")
            raise UserError(f"--quantization-cost needs the dense model: {model_dir} holds "
                            f"{bits}-bit weights; pass --dense DIR, the unquantized "
                            "checkpoint it was made from")
        return
    if not config.quantization:
        raise UserError(f"--dense names the dense source of a quantized model, and {model_dir} "
                        "is dense: its quantization is measured against itself (drop --dense)")
    try:
        dense_config = check_checkpoint(dense, tokenizer=False)
    except UserError as e:
        raise UserError(f"--dense {dense}: {e}") from None
    if dense_config.quantization:
        raise UserError(f"--dense {dense} holds quantized weights; name the unquantized "
                        "checkpoint")
    for name in _SAME_MODEL:
        here, there = getattr(config, name, None), getattr(dense_config, name, None)
        if here != there:
            raise UserError(f"--dense {dense} is another model than {model_dir}: {name} "
                            f"{there} there, {here} here")


def gate_command(load: Callable[[], tuple], model_dir: str | Path, *, golden: str | None = None,
                 write_golden: bool = False, tier_name: str = "fast", n_tokens: int = 64,
                 kv_bits: int = 0, kv_group_size: int = 64, json_path: str | None = None,
                 with_quantization_cost: bool = False, dense: str | Path | None = None,
                 load_dense: Callable[[], object] | None = None) -> int:
    """`qfuse gate`: print the report and the verdict; 0 PASS, 1 FAIL, 3 NOT TESTED.

    The fast tier is judged against the oracle (`run_oracle_gate`), the exact tier
    bitwise against compat along the golden trajectories (`run_gate`). The model folder
    is checked first (a missing folder is the mistake to name, not the golden file it
    would hold), then the report's path, the golden file (that it is one, or with
    write_golden that it may be written: `save_golden`) and with the quantization cost
    its dense source (`check_cost_source`; ``dense`` is `--dense DIR`, loaded by
    ``load_dense``), then load() gives (model, tokenizer), so every mistake is reported
    before loading. The golden file (default MODEL/golden.json) is written only with
    write_golden (`--make-golden`); without one, UserError says how to make it."""
    from .loading import check_checkpoint

    config = check_checkpoint(model_dir)
    golden_path = Path(golden) if golden else Path(model_dir) / "golden.json"
    check_report_path(json_path)
    if write_golden:
        check_golden_destination(golden_path)
    elif not golden_path.exists():
        raise UserError(f"no golden file at {golden_path}; `qfuse gate --make-golden` writes "
                        "one from this model's compat tier on this device")
    else:
        trajectories = load_golden(golden_path, config.vocab_size)
    if with_quantization_cost:
        check_cost_source(config, model_dir, dense)
    model, tokenizer = load()
    if write_golden:
        trajectories = make_golden(model, tokenizer, n_tokens=n_tokens)
        save_golden(trajectories, golden_path)
        print(f"wrote golden trajectories ({n_tokens} tokens per prompt) to {golden_path}")
    device = str(model.model.norm.weight.device)
    if tier_name == "exact":
        rows = run_gate(model, trajectories, tier_name, kv_bits, kv_group_size)
        print(report(rows))
        result, line = verdict(rows, tier_name), verdict_line(rows, tier_name, device)
        extra = {"rows": rows_as_dicts(rows)}
    else:
        rows = run_oracle_gate(model, trajectories, kv_bits, kv_group_size)
        print(oracle_report(rows))
        result, line = oracle_verdict(rows), oracle_verdict_line(rows, device)
        extra = {"rule": RULE, "rows": oracle_rows_as_dicts(rows)}
    cost = None
    if with_quantization_cost:
        if dense is None:  # check_cost_source: the model itself is dense
            cost = quantization_cost(model, trajectories, kv_group_size=kv_group_size)
        else:
            cost = quantization_cost(load_dense(), trajectories, quantized=model,
                                     kv_group_size=kv_group_size)
        print("\nquantization cost (the oracle: quantized against dense, float32):")
        print(cost_report(cost))
    print(line)
    if json_path:
        Path(json_path).write_text(json.dumps(
            {"tier": tier_name, "device": device, "verdict": result, "pass": result == "PASS",
             "kernels_run": kernels_run(rows), **extra, "quantization_cost": cost},
            indent=2) + "\n")
    return {"PASS": 0, "FAIL": 1}.get(result, 3)
