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

Targets (issue text): exact tier — logits bitwise equal to compat on the GPU;
fast tier — at least 63/64 agreement per prompt and mean KL ≤ 1e-3.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import levers
from .cache import KVCache

DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
)


def tier(name: str):
    """Run the block under QFUSE_TIER=name (restored afterwards)."""
    return levers.setting("QFUSE_TIER", name)


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
    with tier("compat"):
        for p in prompts:
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


def run_gate(model, golden: dict, tier_name: str, kv_bits: int = 0,
             kv_group_size: int = 64) -> list[GateRow]:
    rows = []
    for t in golden["trajectories"]:
        with tier("compat"):
            ref_logits, ref_hidden = teacher_forced(model, t["prompt_ids"], t["continuation"],
                                                    kv_bits, kv_group_size)
        with tier(tier_name):
            logits, hidden = teacher_forced(model, t["prompt_ids"], t["continuation"],
                                            kv_bits, kv_group_size)
        target = torch.tensor(t["continuation"], device=logits.device)
        kl = kl_divergence(ref_logits, logits)
        div = ((hidden - ref_hidden).norm(dim=-1) / ref_hidden.norm(dim=-1).clamp_min(1e-30))
        rows.append(GateRow(
            prompt=t["prompt"], agreement=int((logits.argmax(-1) == ref_logits.argmax(-1)).sum()),
            positions=len(t["continuation"]), mean_kl=float(kl.mean()), max_kl=float(kl.max()),
            max_layer_divergence=float(div.max()),
            bitwise_equal=bool(torch.equal(logits, ref_logits)),
            compat_matches_golden=int((ref_logits.argmax(-1) == target).sum())))
    return rows


def passes(rows: list[GateRow], tier_name: str) -> bool:
    if tier_name == "exact":
        return all(r.bitwise_equal for r in rows)
    return all(r.agreement >= r.positions - r.positions // 64 and r.mean_kl <= 1e-3 for r in rows)


def save_golden(golden: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(golden) + "\n")


def load_golden(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def report(rows: list[GateRow]) -> str:
    head = f"{'prompt':<28}{'agree':>9}{'mean KL':>11}{'max KL':>11}{'layer div':>11}{'bitwise':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.prompt[:26].encode('unicode_escape').decode():<28}"
                     f"{r.agreement:>5}/{r.positions:<3}{r.mean_kl:>11.2e}{r.max_kl:>11.2e}"
                     f"{r.max_layer_divergence:>11.2e}{r.bitwise_equal!s:>9}")
    return "\n".join(lines)


def rows_as_dicts(rows: list[GateRow]) -> list[dict]:
    return [asdict(r) for r in rows]


@torch.no_grad()
def quantization_cost(model, golden: dict, bits: int = 4, group_size: int = 64,
                      kv_bits=(8, 4), kv_group_size: int = 64) -> list[dict]:
    """What quantization itself costs, as figures (not a gate): for quantized weights
    and quantized KV caches, mean KL and top-1 agreement against the same tier with
    the model's own weights and a dense cache, along the golden trajectories."""
    from .convert import quantize_model

    kv_group_size = min(kv_group_size, model.config.head_dim)  # small test models
    qmodel = quantize_model(model, bits, group_size)
    variants = [(f"{bits}-bit weights, dense KV", qmodel, 0)]
    variants += [(f"dense weights, {b}-bit KV", model, b) for b in kv_bits]
    variants += [(f"{bits}-bit weights, {b}-bit KV", qmodel, b) for b in kv_bits]
    refs = [teacher_forced(model, t["prompt_ids"], t["continuation"])[0]
            for t in golden["trajectories"]]
    rows = []
    for name, m, kb in variants:
        kls, agree, total = [], 0, 0
        for t, ref in zip(golden["trajectories"], refs):
            out, _ = teacher_forced(m, t["prompt_ids"], t["continuation"], kb, kv_group_size)
            kls.append(kl_divergence(ref, out))
            agree += int((out.argmax(-1) == ref.argmax(-1)).sum())
            total += ref.shape[0]
        kl = torch.cat(kls)
        rows.append({"config": name, "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
                     "top1_agreement": agree / total})
    return rows
