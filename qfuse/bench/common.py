"""What every benchmark shares: CUDA-graph timing, copy bandwidth, metadata, output files.

Timing follows the method we hold ourselves to: warm-up is never timed; many
calls are captured in one CUDA graph and the replay is timed with CUDA events,
so launch gaps do not count; inputs are rotated over enough copies to exceed
twice the L2 cache, so small problems are not timed out of cache; the median of
several replays is reported.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import math
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..quant import QuantizedTensor


def l2_bytes() -> int:
    return torch.cuda.get_device_properties(0).L2_cache_size


def n_rotations(bytes_per_set: int, cap: int = 512) -> int:
    """Input copies needed so one pass over them streams 2x the L2 cache."""
    return max(1, min(cap, math.ceil(2 * l2_bytes() / max(bytes_per_set, 1))))


def time_graph_us(
    fn: Callable[..., object],
    input_sets: Sequence[tuple],
    min_calls: int = 20,
    replays: int = 7,
    graph: bool = True,
) -> float:
    """Median GPU time of one ``fn(*inputs)`` call in microseconds, from CUDA-graph
    replays (``graph=False``: from plain launches, for paths that sync the host)."""
    for inputs in input_sets[:2]:  # compile / autotune / allocate outside the timing
        fn(*inputs)
    torch.cuda.synchronize()
    calls = len(input_sets) * max(1, math.ceil(min_calls / len(input_sets)))
    if not graph:
        return _time_eager_us(fn, input_sets, calls, replays)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream, as graphs require
        for i in range(min(3, calls)):
            fn(*input_sets[i % len(input_sets)])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*input_sets[i % len(input_sets)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    times.sort()
    return times[len(times) // 2]


def _time_eager_us(fn, input_sets, calls, replays) -> float:
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(*input_sets[i % len(input_sets)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def gpu_profile(run: Callable[[], object], steps: int = 1, top: int = 8) -> dict:
    """Per-kernel GPU time of ``run`` (averaged over ``steps`` calls) from the profiler:
    the total and the ``top`` kernels. CUDA activity only: with CPU activity too, each
    operator's entry repeats its kernels' time and a sum over entries counts it twice."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    return {"gpu_ms_per_step": sum(e.self_device_time_total for e in events) / steps / 1e3,
            "launches_per_step": sum(e.count for e in events) / steps,
            "top_kernels": [{"name": e.key[:100], "ms_per_step": e.self_device_time_total
                             / steps / 1e3, "calls_per_step": e.count / steps}
                            for e in events[:top]]}


def copy_bandwidth_gbs(n_bytes: int = 1 << 31) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written.

    Timed from plain launches: inside a CUDA graph a copy becomes a memcpy node
    that the copy engines run, measured here at 2.7 TB/s against 4.3 TB/s for
    the SM copy kernel that eager PyTorch launches (H200, 2026-11-30).
    """
    src = torch.randn(n_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    us = time_graph_us(lambda: dst.copy_(src), [()], min_calls=10, graph=False)
    return 2 * n_bytes / (us * 1e-6) / 1e9


def source_digest() -> str:
    """sha256 over the package's Python sources (path and text, in path order): names the
    code that produced a result even where the checkout's git metadata is stale (the
    device tool copies the working tree with the session's first commit as HEAD)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def metadata() -> dict:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # A CPU run (`bench gate`'s smoke test) says so rather than failing here.
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)",
        "sm_count": (torch.cuda.get_device_properties(0).multi_processor_count
                     if torch.cuda.is_available() else 0),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": version("triton"),
        "qfuse": version("qfuse"),
        "python": platform.python_version(),
        "qfuse_source_sha256": source_digest(),
    }


def write_results(out_dir: str, name: str, payload: dict) -> Path:
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    target = path / f"{name}.json"
    target.write_text(json.dumps(payload, indent=2) + "\n")
    return target


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max([len(c), *(len(_fmt(r.get(c))) for r in rows)]) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)



def bandwidth_axes(ax, copy_gbs: float, title: str, xlabel: str, ylabel: str) -> None:
    """Log2 x axis, the copy bandwidth as a dashed line, labels."""
    ax.axhline(copy_gbs, color="k", ls="--", lw=1, label="copy")
    ax.set_xscale("log", base=2)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def fill_random_quantized_(qt: QuantizedTensor, scale_lo: float, scale_hi: float) -> None:
    """Benchmark data in place: random codes, scales uniform in [lo, hi), biases that
    centre the codes on zero. Kernel speed does not depend on the values."""
    with torch.no_grad():
        qt.packed.view(torch.int32).random_(-(2**31), 2**31 - 1)
        qt.scales.uniform_(scale_lo, scale_hi)
        qt.biases.copy_(-qt.scales * ((1 << qt.bits) - 1) / 2)


def random_quantized(shape: tuple[int, ...], bits: int, group_size: int, scale_lo: float,
                     scale_hi: float, device="cuda", dtype=torch.bfloat16) -> QuantizedTensor:
    """A QuantizedTensor of logical ``shape`` filled by fill_random_quantized_."""
    *lead, K = shape
    qt = QuantizedTensor(
        torch.empty(*lead, K * bits // 32, dtype=torch.uint32, device=device),
        torch.empty(*lead, K // group_size, dtype=dtype, device=device),
        torch.empty(*lead, K // group_size, dtype=dtype, device=device), group_size, bits)
    fill_random_quantized_(qt, scale_lo, scale_hi)
    return qt


def pyplot(path):
    """matplotlib.pyplot drawing to files (Agg), for the plot ``path``; None when
    matplotlib is not installed, after one line on stderr saying the plot needs the
    `bench` extra: a benchmark plots after writing its JSON, so its results stand."""
    try:
        import matplotlib
    except ImportError:
        print(f"qfuse: note: no plot {path}: it needs matplotlib, the `bench` extra "
              "(pip install 'qfuse[bench]'); the results are in the JSON beside it",
              file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
