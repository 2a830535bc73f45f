"""The figures of the README and docs/, generated from bench/results/*.json so they cannot drift.

    python -m qfuse.bench.readme           # rewrite the generated sections of every page
    python -m qfuse.bench.readme --check   # exit 1 if a page differs from the JSON files

Each section lies between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->` in the
page PAGES names for it (README.md: the bundled model and the headline figures;
docs/measured.md: every benchmark's tables; docs/training.md: the training record) and
is rewritten whole; text outside the markers is left alone and holds no figures. The
JSON files are read loosely: a table is built from whatever keys a file holds (a
benchmark re-measured with other figures or shapes still renders), a missing file gives
one line saying so (a headline row whose file or row is missing is left out), and
nothing is ever rounded into a claim the file does not make.
tests/test_readme_figures.py fails when a page is stale.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def fmt(x) -> str:
    """A number as the README shows it: 3 significant digits, integers whole."""
    if x is None:
        return ""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 1000:
            return f"{x:.0f}"
        if abs(x) < 1e-3:
            return f"{x:.2e}"
        return f"{x:.3g}"
    return str(x)


def _table(head: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return out


def _load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _source(name: str, d: dict) -> str:
    """Where a figure came from: file, GPU, date, and the copy bandwidth of the run."""
    meta = d.get("meta", {})
    parts = [f"`bench/results/{name}.json`", meta.get("gpu"), str(meta.get("date", ""))[:10]]
    if "copy_GBps" in d:
        parts.append(f"copy bandwidth {fmt(d['copy_GBps'])} GB/s (read + written)")
    return "Source: " + ", ".join(p for p in parts if p) + "."


def _figures(figs) -> list[str]:
    """The file's target figures, in either form the benchmarks write: a dict
    "name (target)" → value, or a list of {figure, measured, pass[, shape]}."""
    if isinstance(figs, dict) and figs:
        rows = []
        for key, value in figs.items():
            if value is None:  # a part of the benchmark that did not run this time
                continue
            # The target is the last parenthesis: "... generate() (>= 0.95)".
            m = re.fullmatch(r"(.*?)\s*\(([^()]*)\)", key)
            name, target = (m.group(1), m.group(2)) if m else (key, "")
            rows.append([name.replace("_", " "), target, value])
        return _table(["figure", "target", "measured"], rows)
    if isinstance(figs, list) and figs:
        return _columns(figs, ["shape", "figure", "measured", "pass"])
    return []


def _pivot(rows: list[dict], where: dict, row_key: str, col_key: str, value: str,
           label: str) -> list[str]:
    """value of the rows matching ``where``, one table row per row_key, one column per
    col_key; nothing when the rows lack these keys (a re-measured file may)."""
    picked = [r for r in rows if all(r.get(k) == v for k, v in where.items())
              and row_key in r and col_key in r and value in r]
    if not picked:
        return []
    cols = sorted({r[col_key] for r in picked}, key=lambda c: (isinstance(c, str), c))
    names = list(dict.fromkeys(r[row_key] for r in picked))
    cell = {(r[row_key], r[col_key]): r[value] for r in picked}
    return _table([label] + [f"{col_key}={c}" for c in cols],
                  [[n] + [cell.get((n, c), "") for c in cols] for n in names])


def _columns(rows: list[dict], wanted: list[str]) -> list[str]:
    """The rows as a table over those of ``wanted`` that any row has."""
    keys = [k for k in wanted if any(k in r for r in rows)]
    return _table(keys, [[r.get(k, "") for k in keys] for r in rows]) if keys else []


def _block(title: str, *parts: list[str]) -> list[str]:
    out = [f"### {title}", ""]
    for p in parts:
        if p:
            out += p + [""]
    return out


def _act(d: dict) -> list[str]:
    rows = d.get("rows", [])
    tables = []
    for I in dict.fromkeys(r.get("I") for r in rows):
        tables.append(_pivot(rows, {"I": I}, "method", "rows", "fwd_us",
                             f"forward µs, I={I}"))
        tables.append(_pivot(rows, {"I": I}, "method", "rows", "fwd_bwd_us",
                             f"forward+backward µs, I={I}"))
    memory = d.get("memory")
    mem = _table(["training memory", "value"], [[k.replace("_", " "), v]
                                               for k, v in memory.items()]) if memory else []
    return _block(f"Gated activation (`qfuse bench act`, {d.get('dtype', '')} "
                  f"{d.get('activation', '')})", *tables, mem)


def _attention(d: dict) -> list[str]:
    rows = d.get("rows", [])
    tables = [_pivot(rows, {"shape": s, "B": 1}, "method", "N", "us", f"µs at B=1, {s}")
              for s in dict.fromkeys(r.get("shape") for r in rows)]
    return _block("Decode attention (`qfuse bench attention`)", _figures(d.get("figures")),
                  *tables)


def _mlp(d: dict) -> list[str]:
    rows = d.get("rows", [])
    shapes = dict.fromkeys(r.get("shape") for r in rows)
    tables = [_pivot(rows, {"shape": s, "bits": b}, "method", "M", "us", f"µs, {s}, {b}-bit")
              for s in shapes for b in dict.fromkeys(r.get("bits") for r in rows)]
    return _block(f"Quantized matmul and MLP (`qfuse bench mlp`, group size "
                  f"{d.get('group_size', '?')})", _figures(d.get("figures")), *tables)


def _e2e(d: dict) -> list[str]:
    base = d.get("transformers_baseline")
    base_t = _table(["transformers baseline", "value"],
                    [[k.replace("_", " "), v] for k, v in base.items()]) if base else []
    prof = d.get("profile", {})
    prof_t = []
    if prof.get("top_kernels"):
        # C++ template names run to hundreds of characters; their start names them.
        top = [{**k, "name": str(k.get("name", ""))[:48]} for k in prof["top_kernels"][:6]]
        prof_t = _columns(top, ["name", "ms_per_step", "calls_per_step"])
        if "gpu_ms_per_step" in prof:
            prof_t = [(f"GPU time per step: {fmt(prof['gpu_ms_per_step'])} ms; the longest "
                      "kernels:"), ""] + prof_t
    title = "End to end (`qfuse bench e2e" + (" --quick" if d.get("quick") else "") + "`)"
    return _block(title, _figures(d.get("figures")),
                  _columns(d.get("rows", []), ["model", "weights", "kv", "context", "batch",
                                               "tier", "ms_per_token", "tokens_per_s",
                                               "roofline_share", "peak_memory_GB"]),
                  base_t, prof_t)


def _gate(d: dict) -> list[str]:
    """The gates against the oracle, one row per configuration: its prompt nearest the
    agreement floor and its prompt nearest the KL limit (`qfuse.gates`, the rule)."""
    configs = d.get("gates", [])
    rows = []
    for g in configs:
        r = g.get("rows") or []
        ag = min(r, key=lambda x: x["fast_agreement"] - x["agreement_floor"]) if r else {}
        kl = max(r, key=lambda x: x["fast_mean_kl"] / x["kl_limit"]) if r else {}
        n = ag.get("positions", "?")
        rows.append([g.get("quantization"), g.get("verdict"),
                     (g.get("exact") or {}).get("verdict", ""),
                     f"{ag.get('fast_agreement', '?')}/{n}" if ag else "",
                     f"{ag.get('compat_agreement', '?')}/{n}" if ag else "",
                     ag.get("agreement_floor", ""), kl.get("fast_mean_kl", ""),
                     kl.get("compat_mean_kl", ""), kl.get("kl_limit", ""),
                     max((x.get("fast_compat_mean_kl", 0) for x in r), default=""),
                     (g.get("quantization_cost") or {}).get("mean_kl", "")])
    table = _table(["configuration", "fast tier", "exact tier", "fast agreement",
                    "compat agreement", "floor", "fast mean KL", "compat mean KL", "limit",
                    "fast vs compat mean KL (worst)", "quantization cost, mean KL"],
                   rows) if rows else []
    note = [(f"Rule: {d['rule']}. Agreement: the prompt nearest its floor; KL: the prompt "
            "nearest its limit; all against the float32 oracle (the same quantized model, "
            "nothing rounded to bf16), along its greedy trajectories. Quantization cost: the "
            "configuration's oracle against the dense one.")] if d.get("rule") else []
    title = f"Gates (`qfuse bench gate`, the {d.get('model', '')} model, {d.get('dtype', '')}"
    title += ", --quick)" if d.get("quick") else ")"
    return _block(title, table, note)


def _train(d: dict) -> list[str]:
    runs = [(k, v) for k, v in d.items() if isinstance(v, dict) and "step_ms" in v]
    t = _table(["training step", "ms", "peak MB"],
               [[k.replace("_", " "), v["step_ms"], v.get("peak_MB", "")] for k, v in runs])
    return _block("Training (`qfuse bench train`, one step of the default model)",
                  t if runs else [])


def _e2e_tp(d: dict) -> list[str]:
    alone = _columns(d.get("allreduce_alone", []), ["allreduce", "rows", "hidden",
                                                    "us_per_call", "exact"])
    title = (f"Tensor parallel (`qfuse bench e2e_tp`, {d.get('world', '?')} ranks"
             + (", --quick)" if d.get("quick") else ")"))
    return _block(title, _figures(d.get("figures")),
                  _columns(d.get("rows", []), ["model", "weights", "kv", "context", "batch",
                                               "tp", "allreduce", "ms_per_token",
                                               "tokens_per_s", "peak_memory_GB_rank0"]),
                  [f"All-reduce alone, µs per call:", ""] + alone if alone else [])


def _serve(d: dict) -> list[str]:
    title = "Serving (`qfuse bench serve`" + (", --quick" if d.get("quick") else "") + ")"
    about = [f"{d['model']}; prompts of {d.get('prompt_tokens', '?')} tokens."] \
        if d.get("model") else []
    return _block(title, about, _figures(d.get("figures")),
                  _columns(d.get("rows", []), ["config", "streams", "decode_tokens_per_s",
                                               "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms"]))


BENCHMARKS: dict[str, Callable[[dict], list[str]]] = {
    "act": _act, "attention": _attention, "mlp": _mlp, "e2e": _e2e, "gate": _gate,
    "train": _train, "e2e_tp": _e2e_tp, "serve": _serve}


def measured(results: Path) -> str:
    out = []
    for name, render in BENCHMARKS.items():
        d = _load(results, name)
        if d is None:
            out += [f"*`bench/results/{name}.json`: not measured yet.*", ""]
            continue
        out += render(d) + [_source(name, d), ""]
    return "\n".join(out).rstrip("\n")


def _pick(rows: list[dict], **where) -> dict | None:
    """The first row holding every key of ``where`` with its value."""
    return next((r for r in rows if all(r.get(k) == v for k, v in where.items())), None)


def headline(results: Path) -> str:
    """The README's one table: a few figures from the benchmark files, each with its GPU,
    date and file. A row whose file or row is missing is left out."""
    rows = []

    def add(name: str, d: dict | None, what: str, value) -> None:
        if d is None or value is None:
            return
        meta = d.get("meta", {})
        where = ", ".join(p for p in (meta.get("gpu"), str(meta.get("date", ""))[:10]) if p)
        rows.append([what, value, f"{where}, `{name}.json`" if where else f"`{name}.json`"])

    def tokens(r: dict | None) -> str | None:
        return f"{fmt(r['tokens_per_s'])} tokens/s" if r and "tokens_per_s" in r else None

    e2e = _load(results, "e2e")
    if e2e:
        runs = e2e.get("rows", [])
        at = dict(context=8192, tier="fast")
        add("e2e", e2e, "Gemma 3 12B decode, 4-bit weights and KV cache, 8k context, 1 sequence",
            tokens(_pick(runs, model="gemma3-12b", weights="4-bit", kv="4-bit", batch=1, **at)))
        add("e2e", e2e, "the same in bf16 (qfuse)",
            tokens(_pick(runs, model="gemma3-12b", weights="bf16", kv="bf16", batch=1, **at)))
        base = e2e.get("transformers_baseline") or {}
        if base.get("model") == "gemma3-12b":
            add("e2e", e2e, f"the same in bf16, Hugging Face transformers "
                f"(`{base.get('mode', '?')}`)", tokens(base))
        add("e2e", e2e, "Gemma 3 12B decode, 4-bit weights and KV cache, 8k context, 32 sequences",
            tokens(_pick(runs, model="gemma3-12b", weights="4-bit", kv="4-bit", batch=32, **at)))
        add("e2e", e2e, "Llama 3 8B decode, 4-bit weights and KV cache, 8k context, 1 sequence",
            tokens(_pick(runs, model="llama3-8b", weights="4-bit", kv="4-bit", batch=1, **at)))
    attention = _load(results, "attention")
    if attention:
        runs = attention.get("rows", [])
        shape = next((r["shape"] for r in runs if str(r.get("shape")).startswith("gemma3-12b")),
                     None)
        ours = _pick(runs, shape=shape, B=1, N=131072, method="qfuse kv4")
        theirs = _pick(runs, shape=shape, B=1, N=131072, method="sdpa-flash bf16")
        if ours and theirs:
            add("attention", attention, "decode attention over 128k tokens of a 4-bit KV cache "
                "(Gemma 3 12B heads), against PyTorch's flash SDPA on a bf16 cache",
                f"{fmt(ours['us'])} µs against {fmt(theirs['us'])} µs")
    gate = _load(results, "gate")
    if gate and gate.get("gates"):
        passed = sum(g.get("verdict") == "PASS" for g in gate["gates"])
        add("gate", gate, "the gate, fast tier against the float32 oracle (the bundled model; "
            "dense, 8-bit and 4-bit weights × KV cache)",
            f"{passed} of {len(gate['gates'])} configurations pass")
    if not rows:
        return "*No benchmark results yet (`bench/results/`).*"
    lines = _table(["", "measured", "GPU, date, file under `bench/results/`"], rows)
    if e2e and e2e.get("note"):
        lines += ["", f"End to end: the named models' shapes, {e2e['note']}."]
    return "\n".join(lines)


def bundled_model(results: Path) -> str:
    """One sentence on the bundled model, from its training record."""
    rec = _load(results, "train_record")
    if rec is None:
        return "*`bench/results/train_record.json`: no training record yet.*"
    s = rec.get("settings", {})
    params = rec.get("parameters")
    size = f"{params / 1e6:.1f} M parameters" if isinstance(params, int) else "? parameters"
    tokens = rec.get("tokens_train")
    tokens = f"{tokens / 1e6:.1f} M tokens" if isinstance(tokens, int) else "? tokens"
    device = {"cuda": "one GPU", "cpu": "a CPU"}.get(rec.get("device"), rec.get("device", "?"))
    return (f"The bundled model (`qfuse/assets/default`) is a Gemma 3 text model of {size} "
            f"({s.get('num_hidden_layers', '?')} layers, hidden size "
            f"{s.get('hidden_size', '?')}, a byte-level BPE of {s.get('vocab_size', '?')} "
            f"tokens), trained from scratch by `qfuse train` in "
            f"{fmt(rec.get('seconds', float('nan')))} s on {device}, on {tokens} of the Python "
            "standard library's own sources (source: `bench/results/train_record.json`).")


def default_model(results: Path) -> str:
    rec = _load(results, "train_record")
    if rec is None:
        return "*`bench/results/train_record.json`: no training record yet.*"
    s = rec.get("settings", {})
    lines = [f"- parameters: {rec.get('parameters', '?'):,}",
             (f"- architecture: {s.get('num_hidden_layers', '?')} layers, hidden "
             f"{s.get('hidden_size', '?')}, vocabulary {s.get('vocab_size', '?')}"),
             (f"- training: {s.get('steps', '?')} steps of {s.get('batch_size', '?')}×"
             f"{s.get('seq_len', '?')} tokens on {rec.get('tokens_train', '?'):,} training "
             f"tokens, {fmt(rec.get('seconds', float('nan')))} s on {rec.get('device', '?')}")]
    if "best_val_loss" in rec:
        lines.append(f"- validation loss: **{rec['best_val_loss']:.3f} nats/token** at step "
                     f"{rec.get('best_step', -1) + 1}, the best of the run (the checkpoint is "
                     f"that step's) on {rec.get('tokens_validation', '?'):,} validation tokens")
    lines.append("")
    lines.append("Source: `bench/results/train_record.json`.")
    return "\n".join(lines)


SECTIONS: dict[str, Callable[[Path], str]] = {
    "bundled-model": bundled_model, "headline": headline, "default-model": default_model,
    "measured": measured}

# Which page, relative to the checkout, holds which sections.
PAGES: dict[str, tuple[str, ...]] = {
    "README.md": ("bundled-model", "headline"),
    "docs/measured.md": ("measured",),
    "docs/training.md": ("default-model",)}


def render(text: str, results: Path, names: tuple[str, ...]) -> str:
    """A page's text with its generated sections ``names`` rewritten from the JSON files."""
    for name in names:
        make = SECTIONS[name]
        start, end = f"<!-- figures:{name} -->", f"<!-- /figures:{name} -->"
        if text.count(start) != 1 or text.count(end) != 1:
            raise ValueError(f"the page needs exactly one {start} ... {end} pair")
        head, rest = text.split(start)
        _, tail = rest.split(end)
        text = f"{head}{start}\n{make(results)}\n{end}{tail}"
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qfuse.bench.readme", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=ROOT,
                   help="the checkout whose README.md and docs/ to write")
    p.add_argument("--results", type=Path, default=None,
                   help="the results folder (default: ROOT/bench/results)")
    p.add_argument("--check", action="store_true", help="exit 1 if a page is stale")
    args = p.parse_args(argv)
    results = args.results or args.root / "bench" / "results"
    stale = []
    for page, names in PAGES.items():
        path = args.root / page
        old = path.read_text()
        new = render(old, results, names)
        if new == old:
            continue
        if args.check:
            stale.append(page)
        else:
            path.write_text(new)
            print(f"rewrote the generated sections of {path}")
    if stale:
        print(f"stale: {', '.join(stale)}: run python -m qfuse.bench.readme", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
