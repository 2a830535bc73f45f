"""`qfuse bench e2e_tp`: decode tokens/s of tensor parallel (TP=N) against one GPU (TP=1).

Run under torchrun, one process per GPU:

    torchrun --nproc-per-node 2 -m qfuse bench e2e_tp [--quick]

On CUDA, with random weights made on each GPU in the target format (the step's speed
does not depend on the values; `qfuse.bench.e2e.random_model` builds them, at one
rank's shapes for TP=N), for the Gemma 3 12B shape at 4-bit weights (g64) and 4-bit
KV, 8k context, batch 1, fast tier, the decode step replayed from a CUDA graph:

- each all-reduce kind alone (`allreduce_rows`): µs per call at 1, 8 and 32 rows, and
  whether it gives the exact sum;
- TP=1 on rank 0 alone (the others wait), then TP=N on every rank with each all-reduce
  kind (NCCL, PyTorch symmetric memory's one-shot, qfuse's p2p kernel; a kind that
  fails is reported in its row as not_run, never hidden);
- the TP=N step's profile (CUDA graph replays): the time of each all-reduce kernel;
- without --quick, the Llama 3 70B shape in bf16, which does not fit one H200 (its
  weights alone are 141 GB), at TP=N only.

Rank 0 writes bench/results/e2e_tp.json. ms per token is the slowest rank's (they
move in lockstep). On CPU, --quick times the bundled model in the compat tier over
gloo (eager steps, wall clock): a smoke test of the machinery, not a figure.

`tp_rows(...)` is the function a caller such as `qfuse bench e2e` can use for one
configuration's TP=1 and TP=N rows on an initialized `comm.Comm`.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import time

import torch

from .. import levers
from ..bench import common, e2e
from ..models import ModelConfig
from ..runtime.cache import KVCache
from .comm import ALLREDUCE_KINDS, Comm, ParallelError, init, shutdown, world_from_env
from .layers import parallelize
from .runtime import rank_device
from .sharding import check_world, rank_raw_config
from .stopping import QuietStop, agree_on_failure, finish, raise_after_shutdown

LLAMA3_70B = {
    "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
}
MODELS = {**e2e.MODELS, "llama3-70b": LLAMA3_70B}
HEADLINE = ("gemma3-12b", 4, 4, 8192, 1)  # model, weight bits, KV bits, context, batch
STEPS = 20


def _gather_float(comm: Comm, value: float) -> list[float]:
    """Every rank's ``value`` (host side, on the control group)."""
    if comm.world == 1:
        return [value]
    import torch.distributed as dist

    mine = torch.tensor([value], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(comm.world)]
    comm.collective("exchange of timings", lambda: dist.all_gather(every, mine, group=comm.control))
    return [float(t) for t in every]


def rank_model(name: str, weight_bits: int, comm: Comm):
    """This rank's random-weight model of shape ``name`` (all of it at comm.world 1)."""
    raw = MODELS[name]
    quant = (lambda path: (e2e.GROUP, weight_bits)) if weight_bits else (lambda path: (0, 0))
    check_world(ModelConfig.from_dict(raw), comm.world, quant)
    if comm.world == 1:
        return e2e.random_model(raw, weight_bits, comm.device)
    model = e2e.random_model(rank_raw_config(raw, comm.world), weight_bits, comm.device)
    return parallelize(model, comm)


def _allreduce_kernels(profile: dict) -> dict:
    """The all-reduce kernels of a step profile: calls per step and µs per call."""
    rows = [k for k in profile.get("top_kernels", [])
            if "allreduce" in k["name"].lower().replace("_", "")]
    calls = sum(k["calls_per_step"] for k in rows)
    ms = sum(k["ms_per_step"] for k in rows)
    return {"kernels": [k["name"] for k in rows], "calls_per_step": calls,
            "us_per_call": ms * 1e3 / calls if calls else None, "ms_per_step": ms}


def time_cuda(model, comm: Comm, kv_bits: int, context: int, B: int, profile: bool) -> dict:
    """ms per graphed decode step on this rank, and with ``profile`` its kernels."""
    from ..runtime.slotted_graphs import GraphedDecode

    cache = KVCache(model.config, B, context + STEPS + 16, torch.bfloat16, comm.device, kv_bits,
                    e2e.GROUP)
    e2e.fill_cache(cache, context)
    out = {"step_bytes": e2e.step_bytes(model, cache, context)}
    comm.barrier("the start of a timing")
    out["ms"] = e2e.time_decode(model, cache, STEPS, graph=True)
    if profile:
        # Profiled with PDL off: under PDL a kernel starts while the one before still
        # runs, so its listed time would include that wait (the step's timing has PDL).
        from ..kernels.common import pdl  # Triton: CUDA only, like the profile

        tokens = torch.zeros(B, dtype=torch.int64, device=comm.device)
        with torch.no_grad(), pdl.off():
            graphed = GraphedDecode(model, cache, B)
            graphed(tokens)
            torch.cuda.synchronize()
            comm.barrier("the start of a profile")
            out["profile"] = common.gpu_profile(lambda: graphed(tokens), 3, top=60)
        out["allreduce"] = _allreduce_kernels(out["profile"])
        del graphed
    del cache
    return out


@contextlib.contextmanager
def _allreduce_kind(comm: Comm, kind: str):
    """comm's all-reduce is ``kind`` inside the block, its own again after."""
    saved, comm.allreduce = comm.allreduce, kind
    try:
        yield
    finally:
        comm.allreduce = saved


def _seeded_rows(device, n: int, hidden: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(n, hidden, generator=g, device=device).bfloat16()


def _measure_allreduce(comm: Comm, mine: torch.Tensor, want: torch.Tensor):
    """(whether comm's all-reduce of ``mine`` gives ``want`` exactly, µs per call)."""
    got = comm.all_reduce(mine.clone())
    torch.cuda.synchronize()
    exact = bool(torch.equal(got, want))
    comm.barrier("the start of an all-reduce timing")
    x = mine.clone()
    return exact, common.time_graph_us(comm.all_reduce, [(x,)], min_calls=24)


def allreduce_rows(comm: Comm, hidden: int = 3840, row_counts=(1, 8, 32),
                   kinds=ALLREDUCE_KINDS) -> list[dict]:
    """Each all-reduce kind alone, side by side: µs per call (CUDA-graph replays of 24
    calls, every rank alike) for [rows, hidden] bf16, and whether the result equals
    the float32 sum over ranks in rank order, rounded once (every rank builds every
    rank's input from its seed, so it knows the exact answer)."""
    out = []
    for kind in kinds:
        for n in row_counts:
            parts = [_seeded_rows(comm.device, n, hidden, 1000 + r) for r in range(comm.world)]
            want = sum(p.float() for p in parts).bfloat16()
            row = {"allreduce": kind, "rows": n, "hidden": hidden}
            with _allreduce_kind(comm, kind):
                got, error = _try(functools.partial(_measure_allreduce, comm,
                                                    parts[comm.rank], want))
            exact, us = got or (False, None)
            try:
                _agree_row(comm, error)
                row.update({"us_per_call": max(_gather_float(comm, us)), "exact": all(
                    v > 0 for v in _gather_float(comm, float(exact)))})
            except _RowFailed as exc:
                row["not_run"] = str(exc)
            out.append(row)
    return out


def tp_rows(comm: Comm, name: str, weight_bits: int, kv_bits: int, context: int, B: int,
            tp1: bool = True, allreduces=ALLREDUCE_KINDS, copy_gbs: float | None = None,
            ) -> list[dict]:
    """Rows for one configuration: TP=1 on rank 0 (if ``tp1``; the others wait), then
    TP=comm.world with each all-reduce kind. Every rank must call it; rank 0's rows
    are the result (the others get the same list)."""
    base = {"model": name, "weights": f"{weight_bits}-bit" if weight_bits else "bf16",
            "kv": f"{kv_bits}-bit" if kv_bits else "bf16", "context": context, "batch": B}
    rows = []
    if tp1:
        row = {**base, "tp": 1, "allreduce": None}
        if comm.rank == 0:
            row.update(_run_row(Comm(device=comm.device), name, weight_bits, kv_bits, context,
                                B, copy_gbs, profile=True))
        comm.barrier("rank 0's TP=1 run")  # the other ranks wait here, idle
        rows.append(row)
    for kind in allreduces:
        row = {**base, "tp": comm.world, "allreduce": kind}
        with _allreduce_kind(comm, kind):
            row.update(_run_row(comm, name, weight_bits, kv_bits, context, B, copy_gbs,
                                profile=True))
        rows.append(row)
    return rows


class _RowFailed(Exception):
    """A row that did not run on some rank (its message, the same on every rank)."""


def _agree_row(comm: Comm, error: Exception | None) -> None:
    """Every rank learns whether any failed, so that all mark the row not_run together
    and none waits in a collective for a rank that gave up on it."""
    mine = None if error is None else f"{type(error).__name__}: {str(error)[:200]}"
    failures = comm.agree(mine)
    if failures:
        rank, message = failures[0]
        raise _RowFailed(message if comm.world == 1 else f"rank {rank}: {message}")


def _try(fn):
    """(fn(), None), or (None, the error) for any but a lost rank's."""
    try:
        return fn(), None
    except ParallelError:
        raise  # a lost rank ends the run: the others would wait forever
    except Exception as exc:  # noqa: BLE001 -- a configuration that cannot run is reported
        return None, exc


def _run_row(comm: Comm, name, weight_bits, kv_bits, context, B, copy_gbs, profile) -> dict:
    try:
        with levers.use_tier("fast"):
            model, error = _try(lambda: rank_model(name, weight_bits, comm))
            _agree_row(comm, error)
            torch.cuda.reset_peak_memory_stats()
            got, error = _try(lambda: time_cuda(model, comm, kv_bits, context, B, profile))
            _agree_row(comm, error)
        model = None  # its memory, before the exchanges below
        ms = max(_gather_float(comm, got["ms"]))
        nbytes = sum(_gather_float(comm, float(got["step_bytes"])))
        row = {"tokens_per_s": B * 1e3 / ms, "ms_per_token": ms,
               "peak_memory_GB_rank0": torch.cuda.max_memory_allocated() / 1e9,
               "step_bytes_all_ranks": nbytes,
               "GBps_all_ranks": nbytes / (ms * 1e-3) / 1e9}
        if copy_gbs:
            row["roofline_share"] = row["GBps_all_ranks"] / (copy_gbs * comm.world)
        if "allreduce" in got:
            row["allreduce_kernels"] = got["allreduce"]
            row["profile_gpu_ms_per_step"] = got["profile"]["gpu_ms_per_step"]
            row["profile_top_kernels"] = got["profile"]["top_kernels"][:16]
        return row
    except _RowFailed as exc:
        return {"not_run": str(exc)}
    finally:
        torch.cuda.empty_cache()


def figures(rows: list[dict]) -> dict:
    """The headline figures, each key naming its target (None where a row did not run)."""
    def find(name, tp, allreduce):
        for r in rows:
            if (r["model"], r["tp"], r["allreduce"]) == (name, tp, allreduce) and \
                    "tokens_per_s" in r:
                return r
        return None

    one = find("gemma3-12b", 1, None)
    out = {}
    for kind in ALLREDUCE_KINDS:
        many = next((r for r in rows if r["model"] == "gemma3-12b" and r["tp"] > 1
                     and r["allreduce"] == kind and "tokens_per_s" in r), None)
        out[f"gemma_4bit_kv4_8k_tpN_vs_tp1_{kind} (>= 1.7)"] = (
            many["tokens_per_s"] / one["tokens_per_s"] if many and one else None)
        out[f"gemma_allreduce_us_per_call_{kind} (<= 6)"] = (
            many.get("allreduce_kernels", {}).get("us_per_call") if many else None)
    big = next((r for r in rows if r["model"] == "llama3-70b" and "tokens_per_s" in r), None)
    out["llama70b_bf16_tpN_tokens_per_s"] = big and big["tokens_per_s"]
    return out


def _cpu_quick(comm: Comm, out_dir: str) -> int:
    """The bundled model on CPU, compat tier: TP=1 on rank 0, then TP=N (eager steps)."""
    from ..loading import DEFAULT_MODEL, load_model
    from .sharding import RankShard

    steps, prompt = 16, 64
    rows = []

    def load(c: Comm):
        return (load_model(DEFAULT_MODEL) if c.world == 1
                else load_model(DEFAULT_MODEL, shard=RankShard(c)))

    def run(c: Comm, model) -> float:
        cache = KVCache(model.config, 1, prompt + steps + 2, model.dtype, "cpu")
        ids = torch.arange(prompt)[None] % model.config.vocab_size
        tokens = torch.zeros(1, dtype=torch.int64)
        with torch.no_grad():
            model(ids, None, cache)
            model.decode(tokens, cache)  # warm-up
            c.barrier("the start of a timing")
            t = time.perf_counter()
            for _ in range(steps):
                model.decode(tokens, cache)
            return (time.perf_counter() - t) / steps * 1e3

    with levers.use_tier("compat"):
        # What fails on one rank alone (rank 0's TP=1 run, a shard's loading) is agreed
        # on before the next collective: every rank stops, rank 0 says why.
        ms, error = _try(lambda: run(Comm(), load(Comm()))) if comm.rank == 0 else (None, None)
        agree_on_failure(comm, error)
        if comm.rank == 0:
            rows.append({"model": "bundled", "tp": 1, "ms_per_token": ms,
                         "tokens_per_s": 1e3 / ms})
        if comm.world > 1:
            model, error = _try(lambda: load(comm))
            agree_on_failure(comm, error)
            ms = max(_gather_float(comm, run(comm, model)))
            rows.append({"model": "bundled", "tp": comm.world, "ms_per_token": ms,
                         "tokens_per_s": 1e3 / ms})
    if comm.rank == 0:
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": "cpu", "torch": torch.__version__,
                "qfuse_source_sha256": common.source_digest()}
        common.write_results(out_dir, "e2e_tp", {
            "meta": meta, "quick": True, "world": comm.world, "tier": "compat",
            "note": "CPU smoke test over gloo (wall clock, eager steps): not a figure",
            "rows": rows})
        common.print_table(rows, ["model", "tp", "tokens_per_s", "ms_per_token"])
    return 0


def plot(payload: dict, path) -> None:
    """Left: decode tokens/s of each row; right: each all-reduce kind's µs per call alone."""
    plt = common.pyplot(path)
    if plt is None:
        return

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    done = [r for r in payload["rows"] if "tokens_per_s" in r]
    labels = [f"{r['model']}\n{r['weights']}/{r['kv']} TP={r['tp']}"
              + (f"\n{r['allreduce']}" if r["allreduce"] else "") for r in done]
    left.bar(range(len(done)), [r["tokens_per_s"] for r in done], color="tab:blue")
    left.set_xticks(range(len(done)), labels, fontsize=7)
    left.set_ylabel("decode tokens/s, batch 1, 8k context")
    left.set_title("tensor parallel against one GPU")
    for kind in dict.fromkeys(r["allreduce"] for r in payload.get("allreduce_alone", [])):
        pts = [(r["rows"], r["us_per_call"]) for r in payload["allreduce_alone"]
               if r["allreduce"] == kind and r.get("us_per_call")]
        if pts:
            right.plot(*zip(*pts), marker="o", label=kind)
    right.axhline(6, color="gray", linestyle="--", linewidth=1, label="target (6 µs)")
    right.set_xlabel("rows of 3840 bf16")
    right.set_ylabel("µs per all-reduce (CUDA graph)")
    right.set_title(f"all-reduce alone, {payload['world']} GPUs")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(out_dir: str = "bench/results", quick: bool = False) -> int:
    world = world_from_env()
    cuda = torch.cuda.is_available()
    if cuda:
        device = rank_device("cuda")
    elif quick:
        device = torch.device("cpu")
    else:
        from ..errors import UserError

        raise UserError("qfuse bench e2e_tp needs CUDA GPUs; without them only --quick runs "
                        "(the bundled model on CPU)")
    comm = init(device, timeout_s=900.0) if world > 1 else Comm(device=device)
    if world == 1:
        return _main(comm, world, cuda, out_dir, quick)
    try:
        code = _main(comm, world, cuda, out_dir, quick)
        comm.barrier("the end of the benchmark")
    except QuietStop as q:
        finish(q.code, clean=shutdown())  # rank 0 reports why
        return q.code
    except BaseException as e:  # noqa: BLE001 -- re-raised after the teardown
        raise_after_shutdown(comm, e)
    finish(code, clean=shutdown())
    return code


def _main(comm: Comm, world: int, cuda: bool, out_dir: str, quick: bool) -> int:
    if not cuda:
        return _cpu_quick(comm, out_dir)
    meta = common.metadata() if comm.rank == 0 else {}
    copy_gbs = common.copy_bandwidth_gbs() if comm.rank == 0 else None
    micro = allreduce_rows(comm) if world > 1 else []
    if comm.rank == 0:
        common.print_table(micro, ["allreduce", "rows", "hidden", "us_per_call", "exact",
                                   "not_run"])
    rows = tp_rows(comm, *HEADLINE, allreduces=ALLREDUCE_KINDS if world > 1 else (),
                   copy_gbs=copy_gbs)
    if comm.rank == 0:
        for row in rows:
            print({k: v for k, v in row.items() if k != "profile_top_kernels"}, flush=True)
    payload = {"meta": meta, "world": world, "quick": quick, "copy_GBps": copy_gbs,
               "note": "random weights created on each GPU at its rank's shapes",
               "allreduce_alone": micro, "rows": rows}
    if comm.rank == 0:  # written before the slow 70B run, which may run out of time
        common.write_results(out_dir, "e2e_tp", {**payload, "figures": figures(rows)})
    if not quick and world > 1:
        rows += tp_rows(comm, "llama3-70b", 0, 0, 8192, 1, tp1=False,
                        allreduces=("p2p",), copy_gbs=copy_gbs)
        if comm.rank == 0:
            print(rows[-1], flush=True)
    if comm.rank == 0:
        figs = figures(rows)
        path = common.write_results(out_dir, "e2e_tp", {**payload, "rows": rows,
                                                         "figures": figs})
        plot({**payload, "rows": rows}, path.with_suffix(".png"))
        common.print_table(rows, ["model", "weights", "kv", "tp", "allreduce",
                                  "tokens_per_s", "ms_per_token", "not_run"])
        for k, v in figs.items():
            print(f"{k}: {v if v is None else round(v, 3)}")
    return 0
