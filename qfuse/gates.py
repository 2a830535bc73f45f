"""Gates: proof that a tier says what the compat tier says, on a fixed prompt suite.

A golden file freezes, per prompt, the prompt's token ids and the compat tier's
greedy continuation. A tier is then run teacher-forced along that trajectory
(prefill of the prompt, then one cached decode step per golden token, so the
decode kernels are exercised) and compared with compat run the same way:

- argmax agreement: positions where the tier's next-token argmax equals
  compat's, run the same way with the same quantization (with the golden's own
  settings compat reproduces the golden tokens; `compat_matches_golden` checks
  that the golden file still describes this model), per prompt;
- KL(compat ‖ tier) per position, mean and max;
- per-layer hidden-state relative divergence ‖h_tier − h_compat‖ / ‖h_compat‖.

Targets: exact tier — logits bitwise equal to compat on the GPU; fast tier — at
least 63/64 agreement per prompt and a mean KL per prompt within `kl_limit`:
max(1e-3, 0.1 × the configuration's own quantization cost), that cost being the
mean KL of compat with the configuration's quantization against compat dense, on
the same prompts in the same run (`quantization_cost`). A fast path that adds less
than a tenth of what the quantization itself costs is equivalent for a user (each
configuration's measured cost is in bench/results/gate.json); a dense configuration,
or one whose cost was not measured, keeps 1e-3.

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
from .cache import KVCache
from .errors import UserError

DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
)


def _progress(items, desc: str, show: bool, unit: str = "prompt"):
    """A progress bar on stderr over a gate's slow loop (seconds per prompt on a CPU)."""
    return tqdm(items, desc=desc, unit=unit, leave=False, disable=not show, file=sys.stderr)


def _cache(model, n_tokens: int, kv_bits: int = 0, kv_group_size: int = 64) -> KVCache:
    """A one-sequence cache for ``n_tokens``, its capacity rounded up to 256 slots: every
    prompt then shares one set of kernel specializations (the attention merge is
    compiled per split count) instead of compiling per prompt length."""
    capacity = -(-n_tokens // 256) * 256
    return KVCache(model.config, 1, capacity, model.dtype, model.model.norm.weight.device,
                   kv_bits, kv_group_size)


@torch.no_grad()
def teacher_forced(model, prompt_ids: list[int], continuation: list[int], kv_bits: int = 0,
                   kv_group_size: int = 64):
    """Logits [len(continuation), V] predicting each continuation token, and per-layer
    hidden states [layers, len(continuation), H], from prefill + cached decode steps."""
    device = model.model.norm.weight.device
    ids = torch.tensor([prompt_ids], device=device)
    cache = _cache(model, len(prompt_ids) + len(continuation), kv_bits, kv_group_size)
    hidden: list[torch.Tensor] = []
    logits = [model(ids, cache=cache, hidden_states=hidden)[0, -1]]
    layers = [[h[0, -1]] for h in hidden]
    for token in continuation[:-1]:
        hidden = []
        logits.append(model.decode(torch.tensor([token], device=device), cache, hidden)[0])
        for i, h in enumerate(hidden):
            layers[i].append(h[0, -1])
    return torch.stack(logits).float(), torch.stack([torch.stack(x) for x in layers]).float()


@torch.no_grad()
def make_golden(model, tokenizer, prompts=DEFAULT_PROMPTS, n_tokens: int = 64) -> dict:
    """Greedy compat continuations of the prompts (the frozen trajectories)."""
    out = []
    with levers.use_tier("compat"):
        for p in _progress(prompts, "golden (compat)", True):
            ids = tokenizer.encode(p).ids
            device = model.model.norm.weight.device
            cache = _cache(model, len(ids) + n_tokens)
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


def _kernel_dispatches(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
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
        kernels = _kernel_dispatches(before, levers.counters())
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


KL_FLOOR = 1e-3  # the fast tier's mean-KL limit where quantization costs less than 1e-2
KL_SHARE_OF_QUANTIZATION = 0.1


def kl_limit(quantization_kl: float | None) -> float:
    """The fast tier's mean-KL limit for a configuration whose quantization costs
    ``quantization_kl`` (compat quantized against compat dense; None: not measured)."""
    if quantization_kl is None:
        return KL_FLOOR
    return max(KL_FLOOR, KL_SHARE_OF_QUANTIZATION * quantization_kl)


def passes(rows: list[GateRow], tier_name: str, limit: float = KL_FLOOR) -> bool:
    """Whether the rows meet the tier's targets (whatever ran: see `verdict`); ``limit``
    is the mean-KL limit (`kl_limit`)."""
    if tier_name == "exact":
        return all(r.bitwise_equal for r in rows)
    return all(r.agreement >= r.positions - r.positions // 64 and r.mean_kl <= limit
               for r in rows)


def kernels_run(rows: list[GateRow]) -> dict[str, int]:
    """Fused kernel → dispatches over all rows' tier runs."""
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
    """The sentence `qfuse gate` ends with: the verdict, the KL limit it used and which
    kernels it covers."""
    ran = kernels_run(rows)
    if not ran:
        return (f"{tier_name} tier: NOT TESTED: no fused kernel ran on {device} (every op "
                "fell back to the reference), so this compared compat with itself")
    eligible = [k.name for k in levers.KERNELS.values()  # switched off: not expected to run
                if k.min_tier <= levers.Tier[tier_name.upper()] and levers.kernel_enabled(k.name)]
    unused = [k for k in eligible if k not in ran]
    line = f"{tier_name} tier: {verdict(rows, tier_name, limit)}"
    if tier_name != "exact":
        line += f" (mean-KL limit {limit:.2g})"
    line += " (kernels run: " + ", ".join(f"{k} ×{n}" for k, n in ran.items()) + ")"
    if unused:
        line += f"; not run here (the reference served them): {', '.join(unused)}"
    return line


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


@torch.no_grad()
def quantization_cost(model, golden: dict, bits: int = 4, group_size: int = 64,
                      kv_bits=(8, 4), kv_group_size: int = 64,
                      progress: bool = True) -> list[dict]:
    """What quantization itself costs: for quantized weights and quantized KV caches,
    mean KL and top-1 agreement against the model's own weights with a dense cache,
    along the golden trajectories, all in the compat tier (the cost `kl_limit` scales
    with)."""
    from .convert import quantize_model

    kv_group_size = min(kv_group_size, model.config.head_dim)  # small test models
    qmodel = quantize_model(model, bits, group_size)
    variants = [(f"{bits}-bit weights, dense KV", qmodel, 0)]
    variants += [(f"dense weights, {b}-bit KV", model, b) for b in kv_bits]
    variants += [(f"{bits}-bit weights, {b}-bit KV", qmodel, b) for b in kv_bits]
    with levers.use_tier("compat"):
        refs = [teacher_forced(model, t["prompt_ids"], t["continuation"])[0]
                for t in golden["trajectories"]]
    rows = []
    for name, m, kb in _progress(variants, "quantization cost", progress, "config"):
        kls, agree, total = [], 0, 0
        for t, ref in zip(golden["trajectories"], refs):
            with levers.use_tier("compat"):
                out, _ = teacher_forced(m, t["prompt_ids"], t["continuation"], kb,
                                        kv_group_size)
            kls.append(kl_divergence(ref, out))
            agree += int((out.argmax(-1) == ref.argmax(-1)).sum())
            total += ref.shape[0]
        kl = torch.cat(kls)
        rows.append({"config": name, "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
                     "top1_agreement": agree / total})
    return rows


def cost_report(cost: list[dict]) -> str:
    """`quantization_cost`'s rows, one line per configuration."""
    return "\n".join(f"  {r['config']:<28} mean KL {r['mean_kl']:.2e}  max KL "
                     f"{r['max_kl']:.2e}  top-1 {r['top1_agreement']:.3f}" for r in cost)


def gate_command(load: Callable[[], tuple], model_dir: str | Path, *, golden: str | None = None,
                 write_golden: bool = False, tier_name: str = "fast", n_tokens: int = 64,
                 kv_bits: int = 0, kv_group_size: int = 64, json_path: str | None = None,
                 with_quantization_cost: bool = False) -> int:
    """`qfuse gate`: print the report and the verdict; 0 PASS, 1 FAIL, 3 NOT TESTED.

    The model folder is checked first (a missing folder is the mistake to name, not
    the golden file it would hold), then the report's path and the golden file (that
    it is one, or with write_golden that it may be written: `save_golden`), then
    load() gives (model, tokenizer), so every mistake is reported before loading. The
    golden file (default MODEL/golden.json) is written only with write_golden
    (`--make-golden`); without one, UserError says how to make it."""
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
    model, tokenizer = load()
    if write_golden:
        trajectories = make_golden(model, tokenizer, n_tokens=n_tokens)
        save_golden(trajectories, golden_path)
        print(f"wrote golden trajectories ({n_tokens} tokens per prompt) to {golden_path}")
    rows = run_gate(model, trajectories, tier_name, kv_bits, kv_group_size)
    device = str(model.model.norm.weight.device)
    print(report(rows))
    cost, own_cost = None, None
    if with_quantization_cost:
        cost = quantization_cost(model, trajectories, kv_group_size=kv_group_size)
        print("\nquantization cost (compat quantized against compat dense):")
        print(cost_report(cost))
        # This run's own configuration: a dense model with a quantized KV cache; a model
        # loaded quantized has no dense reference here, so its limit stays the floor.
        if kv_bits and not any(getattr(m, "bits", 0) for m in model.modules()):
            own_cost = next((r["mean_kl"] for r in cost
                             if r["config"] == f"dense weights, {kv_bits}-bit KV"), None)
    limit = kl_limit(own_cost)
    print(verdict_line(rows, tier_name, device, limit))
    result = verdict(rows, tier_name, limit)
    if json_path:
        Path(json_path).write_text(json.dumps(
            {"tier": tier_name, "device": device, "verdict": result, "pass": result == "PASS",
             "kl_limit": limit,
             "kernels_run": kernels_run(rows), "rows": rows_as_dicts(rows),
             "quantization_cost": cost}, indent=2) + "\n")
    return {"PASS": 0, "FAIL": 1}.get(result, 3)
