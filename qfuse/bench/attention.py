"""`qfuse bench attention`: decode attention over 4/8-bit and bf16 KV caches.

For each head shape, context length N and batch B: qfuse kv4, kv8 and bf16,
torch SDPA (flash and cuDNN backends, bf16 KV, GQA via enable_gqa) and the
compat path (dequantize the cache, then attention; B=1 only, it is slow and
memory hungry). Achieved GB/s counts the bytes the kernel must read: packed
K/V + scales + biases (g=64) for qfuse's quantized caches, the dense cache
otherwise. The device-to-device copy bandwidth is measured in the same run.

Cache contents are random codes and scales created directly on the GPU (the
kernels' speed does not depend on the values; quantizing 34 GB of bf16 would
only cost time).

``main(sweep=FILE)`` times launch variants of qfuse's kernel side by side
instead (<FILE's stem>_sweep.json, so that several sweeps of one run keep their results;
no plot). FILE is JSON: "cases", each a head
shape (a SHAPES name such as "gemma3-12b", or [Hq, Hkv, D]), a cache kind
(kv4, kv8, bf16), N and B, and optionally "page": tokens per page, for a paged cache (a
pool of B·N/page pages in shuffled order read through a block table; N a multiple of
it); "variants", each a name and the fields of
`kernels.attention.decode_attention.AttentionLaunch` it sets ({} for today's defaults):

    {"cases": [{"shape": "gemma3-12b", "kind": "kv4", "N": 131072, "B": 1}],
     "variants": {"default": {}, "tensor cores": {"path": "tensor_cores"},
                  "codes bn32 s4": {"path": "codes", "block_n": 32, "num_stages": 4},
                  "two launches": {"merge": "separate"}}}

Every variant runs on every case; ``vs_first`` is the first variant's time over
this one's (above 1: faster than the first), ``vs_flash`` SDPA flash's over a bf16
cache of the case's shape, timed in the same run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import reference
from ..kernels.attention.decode_attention import AttentionLaunch, decode_attention_quantized_kv
from . import common

SHAPES = {"gemma3-12b (16q/8kv x 256)": (16, 8, 256), "llama3-8b (32q/8kv x 128)": (32, 8, 128)}
CONTEXTS = [1024, 4096, 8192, 32768, 131072]
BATCHES = [1, 8, 32]
GROUP = 64


def _make_kv(kind, B, H, N, D):
    if kind == "bf16":
        return tuple(torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bits = 4 if kind == "kv4" else 8
    return tuple(common.random_quantized((B, H, N, D), bits, GROUP, 0.05, 0.15)
                 for _ in range(2))


def _paged_kv(kind, B, H, N, D, page):
    """K and V as pools of B·N/page pages [pages, H, page, D] (`_make_kv`'s layouts)."""
    return _make_kv(kind, B * N // page, H, page, D)


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run(q, k, v, lengths):
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q[:, :, None, :], k, v, enable_gqa=True)

    return run


def bench_one(kind, method, Hq, Hkv, D, N, B, copy_gbs, launch=None, page=None):
    """One timed row; ``launch``: launch options for qfuse's kernel (method "qfuse");
    ``page``: its cache paged, pages of that many tokens (qfuse only)."""
    scale = D**-0.5
    kv_kind = "bf16" if method in ("sdpa-flash", "sdpa-cudnn") else kind
    paged = page is not None and method == "qfuse"

    def make():
        return _paged_kv(kv_kind, B, Hkv, N, D, page) if paged else _make_kv(kv_kind, B, Hkv, N, D)
    one = make()
    set_bytes = sum(t.nbytes for t in one)
    # compat materialises the dequantized cache: rotate just the one set.
    copies = 1 if method == "compat" else common.n_rotations(set_bytes, cap=64)
    sets = [one] + [make() for _ in range(copies - 1)]
    lengths = torch.full((B,), N, dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    # every sequence's pages scattered over the pool, as a serving cache's become
    table = (torch.randperm(B * N // page, device="cuda").view(B, N // page).to(torch.int32)
             if paged else None)
    if method == "qfuse":
        options = AttentionLaunch(**(launch or {}))
        fn = lambda k, v: decode_attention_quantized_kv(q, k, v, lengths, scale, launch=options,
                                                        block_table=table)
    elif method == "compat":
        fn = lambda k, v: reference.decode_attention(q, k, v, lengths, scale)
    else:
        sd = _sdpa(method.split("-")[1])
        fn = lambda k, v: sd(q, k, v, lengths)
    try:
        us = common.time_graph_us(fn, sets, min_calls=10 if N * B >= 32768 else 50,
                                  replays=3 if method == "compat" else 7,
                                  graph=method != "compat")  # compat allocates every call
    except Exception as exc:  # noqa: BLE001 -- a backend that cannot run a shape is reported
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    finally:
        del sets, one
    return {"us": us, "bytes": set_bytes, "GBps": set_bytes / (us * 1e-6) / 1e9,
            "share_of_copy": set_bytes / (us * 1e-6) / 1e9 / copy_gbs}


def run_all(copy_gbs, quick):
    rows = []
    contexts = [1024, 8192] if quick else CONTEXTS
    batches = [1] if quick else BATCHES
    for shape_name, (Hq, Hkv, D) in SHAPES.items():
        for B in batches:
            for N in contexts:
                cases = [("kv4", "qfuse"), ("kv8", "qfuse"), ("bf16", "qfuse"),
                         ("bf16", "sdpa-flash"), ("bf16", "sdpa-cudnn")]
                if B == 1:
                    cases.append(("kv4", "compat"))
                for kind, method in cases:
                    r = bench_one(kind, method, Hq, Hkv, D, N, B, copy_gbs)
                    label = f"qfuse {kind}" if method == "qfuse" else (
                        f"compat {kind}" if method == "compat" else f"{method} bf16")
                    rows.append({"shape": shape_name, "B": B, "N": N, "method": label, **r})
                    torch.cuda.empty_cache()
    return rows


def figures(rows):
    """The targets below, each as measured ratio and pass/fail."""
    def get(shape, B, N, method):
        for r in rows:
            if (r["shape"], r["B"], r["N"], r["method"]) == (shape, B, N, method) and "us" in r:
                return r
        return None

    out = []
    for shape in SHAPES:
        def ratio(B, N, slow, fast, shape=shape):
            a, b = get(shape, B, N, slow), get(shape, B, N, fast)
            return None if a is None or b is None else a["us"] / b["us"]

        checks = [
            ("kv4 B=1 N=128k share of copy >= 0.85",
             (get(shape, 1, 131072, "qfuse kv4") or {}).get("share_of_copy"), 0.85),
            ("kv4 B=1 N=128k speed-up vs sdpa-flash bf16 >= 3.3",
             ratio(1, 131072, "sdpa-flash bf16", "qfuse kv4"), 3.3),
            ("kv4 B=1 N=8k speed-up vs sdpa-flash bf16 >= 2",
             ratio(1, 8192, "sdpa-flash bf16", "qfuse kv4"), 2.0),
            ("kv8 B=1 N=128k speed-up vs sdpa-flash bf16 >= 1.8",
             ratio(1, 131072, "sdpa-flash bf16", "qfuse kv8"), 1.8),
            ("bf16 B=1 N=8k speed-up vs sdpa-flash bf16 >= 1.3",
             ratio(1, 8192, "sdpa-flash bf16", "qfuse bf16"), 1.3),
            ("kv4 B=1 N=128k speed-up vs compat >= 50",
             ratio(1, 131072, "compat kv4", "qfuse kv4"), 50.0),
        ]
        worst = None
        for r in rows:
            if r["shape"] == shape and r["method"] == "qfuse bf16" and "us" in r:
                x = ratio(r["B"], r["N"], "sdpa-flash bf16", "qfuse bf16")
                if x is not None and (worst is None or x < worst):
                    worst = x
        checks.append(("bf16 never slower than sdpa-flash (min speed-up >= 1)", worst, 1.0))
        for name, value, target in checks:
            out.append({"shape": shape, "figure": name, "measured": value,
                        "pass": value is not None and value >= target})
    return out


def plot(rows, copy_gbs, path):
    plt = common.pyplot(path)
    if plt is None:
        return

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    batches = sorted({r["B"] for r in rows})
    fig, axes = plt.subplots(len(shapes), len(batches), figsize=(5 * len(batches), 4 * len(shapes)),
                             squeeze=False)
    for i, shape in enumerate(shapes):
        for j, B in enumerate(batches):
            ax = axes[i][j]
            for method in dict.fromkeys(r["method"] for r in rows):
                pts = [(r["N"], r["GBps"]) for r in rows
                       if r["shape"] == shape and r["B"] == B and r["method"] == method and "us" in r]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=method)
            common.bandwidth_axes(ax, copy_gbs, f"{shape}, B={B}", "context N (tokens)",
                                  "GB/s on bytes read")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


LAUNCH_OPTIONS = tuple(f.name for f in dataclasses.fields(AttentionLaunch))
KINDS = ("kv4", "kv8", "bf16")


def load_sweep(path: str) -> tuple[list[dict], dict[str, dict]]:
    """The cases (each with its head shape resolved to Hq, Hkv, D) and the variants of a
    sweep file (module docstring); ValueError naming what does not fit."""
    with open(path) as f:
        spec = json.load(f)
    if not isinstance(spec, dict) or set(spec) != {"cases", "variants"}:
        raise ValueError(f"{path}: a sweep is an object with exactly 'cases' and 'variants'")
    variants = spec["variants"]
    if not isinstance(variants, dict) or not variants:
        raise ValueError(f"{path}: 'variants' must map names to launch options")
    for name, options in variants.items():
        if not isinstance(options, dict) or not set(options) <= set(LAUNCH_OPTIONS):
            raise ValueError(f"{path}: variant {name!r}: launch options are an object with keys "
                             f"among {', '.join(LAUNCH_OPTIONS)}, got {options!r}")
        try:
            AttentionLaunch(**options)
        except ValueError as exc:
            raise ValueError(f"{path}: variant {name!r}: {exc}") from None
    if not isinstance(spec["cases"], list) or not spec["cases"]:
        raise ValueError(f"{path}: 'cases' must be a list of cases")
    names = {name.split(" ")[0]: dims for name, dims in SHAPES.items()}
    cases = []
    for i, case in enumerate(spec["cases"]):
        if not isinstance(case, dict) or not {"shape", "kind", "N", "B"} <= set(case) \
                <= {"shape", "kind", "N", "B", "page"}:
            raise ValueError(f"{path}: case {i} must have exactly shape, kind, N and B "
                             f"(and optionally page)")
        shape = case["shape"]
        dims = names.get(shape) if isinstance(shape, str) else shape
        if not (isinstance(dims, (list, tuple)) and len(dims) == 3
                and all(isinstance(d, int) and d > 0 for d in dims)):
            raise ValueError(f"{path}: case {i}: shape is one of {', '.join(names)} or "
                             f"[Hq, Hkv, D], got {shape!r}")
        if case["kind"] not in KINDS:
            raise ValueError(f"{path}: case {i}: kind is one of {', '.join(KINDS)}")
        if not all(isinstance(case[k], int) and case[k] > 0 for k in ("N", "B")):
            raise ValueError(f"{path}: case {i}: N and B must be positive integers")
        page = case.get("page")
        if page is not None and not (isinstance(page, int) and page > 0
                                     and case["N"] % page == 0):
            raise ValueError(f"{path}: case {i}: page must be a positive integer dividing N")
        cases.append({**case, "shape": shape if isinstance(shape, str) else list(dims),
                      "dims": tuple(dims)})
    return cases, variants


def run_sweep(cases, variants, copy_gbs):
    """Every variant on every case, each beside SDPA flash over a bf16 cache of the same
    shape timed in the same run (``vs_flash``: flash's time over the variant's)."""
    rows = []
    for case in cases:
        flash = bench_one(case["kind"], "sdpa-flash", *case["dims"], case["N"], case["B"],
                          copy_gbs).get("us")
        torch.cuda.empty_cache()
        first = None
        for name, options in variants.items():
            r = bench_one(case["kind"], "qfuse", *case["dims"], case["N"], case["B"], copy_gbs,
                          launch=options, **({"page": case["page"]} if "page" in case else {}))
            if first is None:
                first = r.get("us")
            if first is not None and "us" in r:
                r["vs_first"] = first / r["us"]
            if flash is not None and "us" in r:
                r["vs_flash"] = flash / r["us"]
            rows.append({"shape": case["shape"], "kind": case["kind"], "N": case["N"],
                         "B": case["B"], "page": case.get("page"), "variant": name, **r})
            torch.cuda.empty_cache()
    return rows


def sweep_main(out_dir: str, sweep: str) -> int:
    cases, variants = load_sweep(sweep)
    meta = common.metadata()
    copy_gbs = common.copy_bandwidth_gbs()
    rows = run_sweep(cases, variants, copy_gbs)
    payload = {"meta": meta, "copy_GBps": copy_gbs, "group_size": GROUP, "sweep": sweep,
               "variants": variants, "note": "random cache contents created on the GPU",
               "rows": rows}
    common.write_results(out_dir, f"{Path(sweep).stem}_sweep", payload)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    common.print_table(rows, ["shape", "kind", "N", "B", "page", "variant", "us", "share_of_copy",
                              "vs_first", "vs_flash", "error"])
    return 0


def main(out_dir: str = "bench/results", quick: bool = False, sweep: str | None = None) -> int:
    if sweep is not None:
        return sweep_main(out_dir, sweep)
    meta = common.metadata()
    copy_gbs = common.copy_bandwidth_gbs()
    rows = run_all(copy_gbs, quick)
    figs = figures(rows)
    payload = {"meta": meta, "copy_GBps": copy_gbs, "group_size": GROUP,
               "note": "random cache contents created on the GPU", "rows": rows, "figures": figs}
    path = common.write_results(out_dir, "attention", payload)
    plot(rows, copy_gbs, str(path.with_suffix(".png")))
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    common.print_table(rows, ["shape", "B", "N", "method", "us", "GBps", "share_of_copy", "error"])
    print()
    common.print_table(figs, ["shape", "figure", "measured", "pass"])
    return 0
