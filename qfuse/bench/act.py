"""`qfuse bench act`: the fused gated activation against the spelled-out path.

Byte counts (the floor, with N = rows·I elements of s bytes):
forward reads a and b and writes out: 3·N·s. Backward reads a, b and the
incoming gradient and writes da and db: 5·N·s. Forward+backward: 8·N·s, since
a and b (hundreds of MB at the big shapes) cannot stay in the 60 MB L2 between
the two passes. Floor time = bytes / copy bandwidth measured in this run.

Peak memory: forward+backward through 8 MLP blocks (hidden 2048, I 16384,
4096 tokens, bf16), memory above what parameters and input already hold.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from .. import ops, reference
from ..kernels.pointwise.gated_act import gated_act_forward
from . import common

SHAPES = [(1, 15360), (64, 15360), (8192, 15360), (1, 14336), (64, 14336), (8192, 14336)]
# torch.compile costs ~10 s of compile per shape and direction: the headline shapes only.
COMPILED_SHAPES = {(1, 15360), (8192, 15360)}
ACT = "gelu_tanh"


def spelled_out(a, b):
    return F.gelu(a, approximate="tanh") * b


def _liger_geglu():
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    from liger_kernel.ops.geglu import LigerGELUMulFunction

    return LigerGELUMulFunction.apply


def _fwd_bwd(fn):
    def run(a, b, g):
        y = fn(a, b)
        return torch.autograd.grad(y, (a, b), g)

    return run


def _count_launches(fn, *args) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def bench_shapes(copy_gbs: float, quick: bool) -> list[dict]:
    rows = []
    liger = _liger_geglu()
    compiled = torch.compile(spelled_out, dynamic=False)
    for M, I in SHAPES[:2] if quick else SHAPES:
        n = M * I
        set_bytes = 3 * n * 2
        sets = [
            tuple(torch.randn(M, I, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(2))
            for _ in range(common.n_rotations(set_bytes, cap=2048))
        ]
        grad_sets = [
            (a.requires_grad_(), b.requires_grad_(), torch.randn_like(a)) for a, b in sets
        ]
        methods = {
            "qfuse": (lambda a, b: gated_act_forward(a, b, ACT)),
            "eager": spelled_out,
        }
        if (M, I) in COMPILED_SHAPES:
            methods["torch.compile"] = compiled
        if liger is not None:
            methods["liger"] = liger
        for name, fn in methods.items():
            with torch.no_grad():
                fwd_us = common.time_graph_us(fn, [s[:2] for s in sets])
            bwd_fn = _fwd_bwd(lambda a, b, fn=fn: ops.gated_act(a, b, ACT)) if name == "qfuse" \
                else _fwd_bwd(fn)
            fb_us = common.time_graph_us(bwd_fn, grad_sets, min_calls=10)
            floor_fwd = 3 * n * 2 / (copy_gbs * 1e9) * 1e6
            floor_fb = 8 * n * 2 / (copy_gbs * 1e9) * 1e6
            row = {
                "rows": M, "I": I, "method": name,
                "fwd_us": fwd_us, "fwd_GBps": 3 * n * 2 / (fwd_us * 1e-6) / 1e9,
                "fwd_share_of_copy": floor_fwd / fwd_us,
                "fwd_bwd_us": fb_us, "fwd_bwd_over_floor": fb_us / floor_fb,
            }
            if M == 1:
                with torch.no_grad():
                    row["launches"] = _count_launches(fn, *sets[0][:2])
            rows.append(row)
        del sets, grad_sets
    return rows


class _Stack(torch.nn.Module):
    def __init__(self, blocks: int, hidden: int, inter: int, fused: bool):
        super().__init__()
        mk = lambda o, i: torch.nn.Parameter(
            torch.randn(o, i, device="cuda", dtype=torch.bfloat16) * i**-0.5)
        self.weights = torch.nn.ParameterList(
            [p for _ in range(blocks) for p in (mk(inter, hidden), mk(inter, hidden), mk(hidden, inter))]
        )
        self.fused = fused

    def forward(self, x):
        mlp = ops.mlp if self.fused else reference.mlp
        w = list(self.weights)
        for i in range(0, len(w), 3):
            x = mlp(x, w[i], w[i + 1], w[i + 2], ACT, residual=x)
        return x


def bench_memory(blocks=8, hidden=2048, inter=16384, tokens=4096) -> dict:
    out = {"blocks": blocks, "hidden": hidden, "I": inter, "tokens": tokens}
    for fused in (False, True):
        torch.cuda.empty_cache()
        model = _Stack(blocks, hidden, inter, fused)
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2):  # the second step is measured (first compiles the kernels)
            model.zero_grad(set_to_none=True)
            x.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(x).float().sum().backward()
            end.record()
            torch.cuda.synchronize()
        key = "fused" if fused else "spelled_out"
        out[f"{key}_peak_above_params_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        out[f"{key}_peak_total_MB"] = torch.cuda.max_memory_allocated() / 2**20
        out[f"{key}_step_ms"] = start.elapsed_time(end)
        del model, x
    out["reduction_above_params"] = 1 - out["fused_peak_above_params_MB"] / out[
        "spelled_out_peak_above_params_MB"]
    out["reduction_total"] = 1 - out["fused_peak_total_MB"] / out["spelled_out_peak_total_MB"]
    return out


def plot(rows: list[dict], copy_gbs: float, path: str) -> None:
    plt = common.pyplot(path)
    if plt is None:
        return

    shapes = sorted({(r["rows"], r["I"]) for r in rows}, key=lambda s: (s[1], s[0]))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        by = {(r["rows"], r["I"]): r for r in rows if r["method"] == m}
        xs = [i + j * width for i, s in enumerate(shapes) if s in by]
        ax1.bar(xs, [by[s]["fwd_GBps"] for s in shapes if s in by], width, label=m)
        ax2.bar(xs, [by[s]["fwd_bwd_over_floor"] for s in shapes if s in by], width, label=m)
    labels = [f"{m}×{i}" for m, i in shapes]
    for ax in (ax1, ax2):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], labels, rotation=20)
    ax1.axhline(copy_gbs, color="k", ls="--", lw=1, label=f"copy {copy_gbs:.0f} GB/s")
    ax1.set_ylabel("forward GB/s (3 tensors)")
    ax1.set_title("GeGLU forward, bf16")
    ax2.axhline(1.0, color="k", ls="--", lw=1, label="byte floor")
    ax2.set_yscale("log")
    ax2.set_ylabel("forward+backward time / byte floor")
    ax2.set_title("GeGLU forward+backward, bf16 (lower is better)")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(out_dir: str = "bench/results", quick: bool = False) -> int:
    meta = common.metadata()
    copy_gbs = common.copy_bandwidth_gbs()
    rows = bench_shapes(copy_gbs, quick)
    memory = bench_memory(blocks=2 if quick else 8)
    payload = {"meta": meta, "copy_GBps": copy_gbs, "activation": ACT, "dtype": "bfloat16",
               "liger": "importable" if _liger_geglu() else "not importable: not run",
               "rows": rows, "memory": memory}
    path = common.write_results(out_dir, "act", payload)
    plot(rows, copy_gbs, str(path.with_suffix(".png")))
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; Liger: {payload['liger']}")
    print("memory:", {k: round(v, 3) if isinstance(v, float) else v for k, v in memory.items()})
    common.print_table(rows, ["rows", "I", "method", "fwd_us", "fwd_GBps", "fwd_share_of_copy",
                              "fwd_bwd_us", "fwd_bwd_over_floor", "launches"])
    return 0
