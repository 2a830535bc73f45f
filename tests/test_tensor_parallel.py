"""Tensor parallel on CPU: 2 processes over gloo against 1, the sharding, and the errors.

The tensor-parallel gate on CPU: the test model at TP=2 (two processes, gloo, compat
tier) gives the logits of one process within float32 round-off, for a prefill of two
prompts of different lengths and 16 greedy decode steps, with a dense and a 4-bit
KV cache, and with dense and 4-bit weights (the 4-bit checkpoint is written by
`qfuse.convert` and every rank reads only its slices of it). The processes talk
through the real runtime: rank 0 drives a `Leader`, rank 1 `follow`s it.

The test model (`tp_model`) is the bundled model cut to 2 of its 6 layers, written at
test time: every width the bundled model's, so its shards at TP=2 are the same (6 query
heads and 2 KV heads of 64, intermediate 1024, vocabulary 4096; the tiny test model's
1 KV head does not split), with a third of the layers to compute.

Every process is started in its own session and killed at the end whatever
happened; each has a time bound, so a hang fails the test instead of the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qfuse.commands import cli
from qfuse.loading import DEFAULT_MODEL
from qfuse.models import ModelConfig
from qfuse.parallel.sharding import (
    RankShard,
    TensorParallelError,
    check_world,
    rank_config,
    shard_index,
    split_kind,
)
from qfuse.quant import QuantizedTensor

REPO = Path(__file__).resolve().parents[1]
BOUND_S = 120  # every process of this file ends within this, or the test fails
# A --tp-timeout far past BOUND_S: a rank that ends within BOUND_S noticed the others'
# failure, it did not wait out a collective's timeout (no test asks how soon it noticed).
NEVER_S = 10 * BOUND_S
STEPS = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int | None = None, world: int = 2, port: int | None = None, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    # One thread per process: the two ranks share two cores (OpenMP spinning otherwise).
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", QFUSE_TIER="compat", **extra)
    if rank is not None:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


class _Procs:
    """Processes started in their own sessions; all killed (with their children) on exit."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, args, env, **kw) -> subprocess.Popen:
        p = subprocess.Popen(args, env=env, start_new_session=True, text=True, **kw)
        self.procs.append(p)
        return p

    def python_ranks(self, code: str, port: int, world: int = 2) -> list[subprocess.Popen]:
        """``python -c code`` as each rank of a ``world``-process job (pipes for both
        streams)."""
        return [self.start([sys.executable, "-c", code], _env(r, world, port), cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for r in range(world)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                _kill(p)
            p.wait(timeout=10)


def _kill(p: subprocess.Popen) -> None:
    """SIGKILL p's session and its live children: torchrun puts each rank in a session
    of its own, which killing torchrun's alone would leave running (`_KillRanks`)."""
    with _KillRanks([]) as ranks:
        ranks.parent = p.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGSTOP)  # no new rank while its children are listed
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)


def _communicate(p: subprocess.Popen, timeout: float = BOUND_S) -> tuple[str, str]:
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(p)
        _out, err = p.communicate()
        pytest.fail(f"a process ran past {timeout} s; stderr: {err[-2000:]}")


# -- the 2-process gate ------------------------------------------------------------------

def worker(model_dirs: list[str], out_path: str) -> None:
    """One rank: for each model folder, rank 0 drives the TP=2 model through `Leader`
    (and the whole model alone, as the reference), rank 1 follows."""
    from safetensors.torch import save_file

    from qfuse.loading import load_model
    from qfuse.parallel.comm import init, shutdown
    from qfuse.parallel.runtime import Leader, Runner, follow
    from qfuse.parallel.sharding import RankShard
    from qfuse.runtime.cache import KVCache

    comm = init(torch.device("cpu"), timeout_s=60)
    results = {}
    for m, folder in enumerate(model_dirs):
        model = load_model(folder, shard=RankShard(comm))
        # It is a shard: half the heads, KV heads, intermediate units and vocabulary.
        attn = model.model.layers[0].self_attn
        assert attn.q_proj.n_out == 3 * 64 and attn.k_proj.n_out == 64, attn.q_proj.n_out
        assert model.model.layers[0].mlp.down_proj.n_in == 512
        assert model.model.embed_tokens.n_out == 2048 and model.config.vocab_size == 4096
        runner = Runner(model, comm, cuda_graph=False)
        if comm.rank:
            follow(runner)
            continue
        full = load_model(folder)
        leader = Leader(runner)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 4096, (2, 40), generator=g)
        lengths = torch.tensor([40, 23])
        for kv_bits in (0, 4):
            caches = [KVCache(x.config, 2, 40 + STEPS + 1, torch.float32, "cpu", kv_bits)
                      for x in (leader, full)]
            with torch.no_grad():
                tp = leader(ids, lengths, caches[0])
                ref = full(ids, lengths, caches[1])
                rows = torch.arange(2)
                got, want = [tp[rows, lengths - 1]], [ref[rows, lengths - 1]]
                results[f"m{m}_kv{kv_bits}_prefill"] = (tp, ref)
                for _ in range(STEPS):
                    token = got[-1].argmax(-1)  # the TP model's own greedy choice, fed to both
                    got.append(leader.decode(token, caches[0]))
                    want.append(full.decode(token, caches[1]))
            results[f"m{m}_kv{kv_bits}_decode"] = (torch.stack(got[1:]), torch.stack(want[1:]))
        leader.close()
    if comm.rank == 0:
        flat = {}
        for key, (a, b) in results.items():
            flat[f"{key}.tp"], flat[f"{key}.ref"] = a.contiguous(), b.contiguous()
        save_file(flat, out_path)
    shutdown()


# The bundled model's layers the test model keeps: its first (sliding window) and its
# last (full attention), so both kinds of layer are split.
KEPT_LAYERS = (0, 5)


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory) -> Path:
    """A model folder: the bundled model's embedding, final norm and KEPT_LAYERS (as
    layers 0 and 1), its tokenizer (linked), and a config saying so."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("tp_model")
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    config.update(num_hidden_layers=len(KEPT_LAYERS),
                  layer_types=[config["layer_types"][i] for i in KEPT_LAYERS])
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    (folder / "config.json").write_text(json.dumps(config))
    rename = {f"model.layers.{old}.": f"model.layers.{new}."
              for new, old in enumerate(KEPT_LAYERS)}
    tensors = {}
    for file in sorted(DEFAULT_MODEL.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 -- safe_open has no __iter__
                m = re.match(r"model\.layers\.\d+\.", name)
                if m is None:
                    tensors[name] = f.get_tensor(name)
                elif m[0] in rename:
                    tensors[rename[m[0]] + name[m.end():]] = f.get_tensor(name)
    assert len(tensors) == 2 + 13 * len(KEPT_LAYERS), sorted(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "tokenizer.json").symlink_to((DEFAULT_MODEL / "tokenizer.json").resolve())
    return folder


@pytest.fixture(scope="module")
def quantized_model(tmp_path_factory, tp_model) -> Path:
    from qfuse.convert import quantize_checkpoint

    return quantize_checkpoint(tp_model, tmp_path_factory.mktemp("q") / "q4", 4, 64)


def test_tp2_logits_match_one_process(tmp_path, tp_model, quantized_model):
    from safetensors.torch import load_file

    out = tmp_path / "logits.safetensors"
    port = _free_port()
    code = (f"from tests.test_tensor_parallel import worker; "
            f"worker({[str(tp_model), str(quantized_model)]!r}, {str(out)!r})")
    with _Procs() as procs:
        ps = procs.python_ranks(code, port)
        outs = [_communicate(p) for p in ps]
    for p, (_, err) in zip(ps, outs):
        assert p.returncode == 0, err[-3000:]
    logits = load_file(str(out))
    assert len(logits) == 2 * 2 * 2 * 2  # 2 models x 2 caches x (prefill, decode) x (tp, ref)
    for key in sorted({k.rsplit(".", 1)[0] for k in logits}):
        tp, ref = logits[f"{key}.tp"], logits[f"{key}.ref"]
        assert tp.shape == ref.shape and tp.shape[-1] == 4096, (key, tp.shape)
        if key.endswith("decode"):
            assert tp.shape[0] == STEPS
        # Float32 round-off: the shards sum o_proj and down_proj in two halves, a
        # different order than one product. Bound: 32 ulps of the largest logit (measured
        # 1.2e-5 = ~6 ulps at |logit| 16); a wrong head, a missing reduction or a shifted
        # vocabulary moves logits by whole units.
        bound = 32 * torch.finfo(torch.float32).eps * ref.abs().max().item()
        err = (tp - ref).abs().max().item()
        assert err <= bound, f"{key}: max |TP - 1 process| = {err} > {bound}"
        assert torch.equal(tp.argmax(-1), ref.argmax(-1)), key
        assert ref.abs().max() > 1, key  # the comparison is not between zeros


# -- the command line under torchrun --------------------------------------------------------

def test_torchrun_generate_prints_once_what_one_process_prints(qfuse_here, monkeypatch):
    args = ["generate", "--max-tokens", "8", "Once upon a time"]
    with _Procs() as procs:
        tp = procs.start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "-m", "qfuse", *args], _env(), cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # the one process, run here while torchrun's ranks start (its tier as theirs)
        monkeypatch.setenv("QFUSE_TIER", _env()["QFUSE_TIER"])
        one = qfuse_here(*args)
        tp_out, tp_err = _communicate(tp)
    assert one.returncode == 0, one.stderr
    assert tp.returncode == 0, tp_err[-3000:]
    assert tp_out == one.stdout and tp_out.startswith("Once upon a time")  # once: rank 1 is silent
    assert tp_err.count("[tp 2 | prompt") == 1, tp_err


def test_torchrun_gate_compares_tp2_with_the_tp1_golden(tmp_path):
    # The bundled golden file (TP=1 compat), cut to 2 prompts x 8 tokens: a greedy
    # trajectory's prefix is one too.
    golden = json.loads((DEFAULT_MODEL / "golden.json").read_text())
    golden["trajectories"] = [{**t, "continuation": t["continuation"][:8]}
                              for t in golden["trajectories"][:2]]
    (tmp_path / "small.json").write_text(json.dumps(golden))
    args = ["gate", "--golden", str(tmp_path / "small.json"), "--tier", "exact",
            "--json", str(tmp_path / "gate.json")]
    # Without the Triton interpreter (which the exact tier fails at TP=1 too: its tanh is
    # not libdevice's), every op takes the reference on CPU.
    env = {k: v for k, v in _env().items() if k != "TRITON_INTERPRET"}
    with _Procs() as procs:
        p = procs.start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc-per-node", "2", "-m", "qfuse", *args], env, cwd=REPO,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = _communicate(p)
    # On CPU no fused kernel runs, so the exact tier is NOT TESTED: rank 0 exits 3, which
    # torchrun reports as a failure (its own exit 1). The comparison with TP=1 still ran.
    assert p.returncode == 1 and "exitcode  : 3" in err, err[-3000:]
    assert out.count("TP=2 exact vs TP=1 golden (small.json): 16/16 teacher-forced") == 1, out
    assert out.count("NOT TESTED") == 1  # rank 1 printed nothing
    report = json.loads((tmp_path / "gate.json").read_text())
    assert report["tp"] == 2 and report["golden_agreement"] == [16, 16]
    assert all(r["bitwise_equal"] for r in report["rows"])  # TP=2 exact = TP=2 compat here


# -- a rank that dies, a rank that never comes ---------------------------------------------

def test_a_rank_killed_mid_generation_ends_rank_0_with_an_error(tmp_path):
    port = _free_port()
    args = [sys.executable, "-m", "qfuse", "generate", "--max-tokens", "600",
            "--tp-timeout", str(NEVER_S), "Once upon a time"]
    with open(tmp_path / "out0", "w") as out0, open(tmp_path / "out1", "w") as out1, \
            _Procs() as procs:
        outs = (out0, out1)
        ps = [procs.start(args, _env(r, 2, port), cwd=REPO, stdout=outs[r],
                          stderr=subprocess.PIPE) for r in (0, 1)]
        deadline = time.monotonic() + BOUND_S
        # Rank 0 echoes the prompt once the shards are loaded and agreed on.
        while (tmp_path / "out0").stat().st_size == 0 and ps[0].poll() is None:
            assert time.monotonic() < deadline, "rank 0 never started generating"
            time.sleep(0.05)
        os.killpg(ps[1].pid, signal.SIGKILL)
        _, err = _communicate(ps[0])  # within BOUND_S: it noticed, not timed out
    assert ps[0].returncode not in (0, None), err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("qfuse: error: rank 0 of 2:"), err
    assert "another rank stopped" in lines[0] and "Traceback" not in err


def test_a_rank_that_never_starts_is_an_error_after_the_timeout():
    args = [sys.executable, "-m", "qfuse", "generate", "--tp-timeout", "3", "hi"]
    with _Procs() as procs:
        p = procs.start(args, _env(0, 2, _free_port()), cwd=REPO, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE)
        _, err = _communicate(p, timeout=60)
    assert p.returncode == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("qfuse: error: rank 0 of 2: the 2 processes did not all start "
                               "within 3 s"), err


def fail_mid_forward(timeout_s: float) -> None:
    """One rank of a TP=2 run in which rank 0's own decode fails after its command went
    out: rank 1 is then inside that step's collectives."""
    from qfuse.loading import load_model
    from qfuse.parallel.comm import init
    from qfuse.parallel.runtime import Leader, Runner, follow
    from qfuse.parallel.sharding import RankShard
    from qfuse.runtime.cache import KVCache

    comm = init(torch.device("cpu"), timeout_s=timeout_s)
    runner = Runner(load_model(DEFAULT_MODEL, shard=RankShard(comm)), comm, cuda_graph=False)
    if comm.rank:
        follow(runner)
        raise AssertionError("rank 1 was told to end")
    leader = Leader(runner)

    def broken(*args):
        raise RuntimeError("the decode step broke\non rank 0")

    runner.decode = broken
    cache = KVCache(leader.config, 1, 16, torch.float32, "cpu")
    with torch.no_grad():
        logits = leader(torch.tensor([[5, 6, 7]]), None, cache)
        leader.decode(logits[:, -1].argmax(-1), cache)
    raise AssertionError("rank 0's decode returned")


def test_rank_0_failing_mid_step_ends_both_ranks_at_once():
    port = _free_port()
    code = f"from tests.test_tensor_parallel import fail_mid_forward; fail_mid_forward({NEVER_S})"
    with _Procs() as procs:
        ps = procs.python_ranks(code, port)
        outs = [_communicate(p, timeout=BOUND_S) for p in ps]
    lines = [x for x in outs[0][1].splitlines() if x.strip()]
    assert ps[0].returncode == 1, outs[0][1]
    assert lines == ["qfuse: error: the decode step broke on rank 0"], outs[0][1]
    # Rank 1 left its collective when rank 0 left (within BOUND_S: long before NEVER_S).
    assert ps[1].returncode != 0 and "another rank stopped" in outs[1][1], outs[1][1][-2000:]


def _threads() -> list[str]:
    """The names of this process's threads (Linux)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
    return sorted(names)


def shutdown_then_threads() -> None:
    """One rank: a few control collectives, then `comm.shutdown`; prints the process's
    threads before and after it, as JSON."""
    from qfuse.parallel.comm import init, shutdown

    comm = init(torch.device("cpu"), timeout_s=30)
    for _ in range(3):
        comm.broadcast(torch.zeros(8, dtype=torch.int64))
    before = _threads()
    clean = shutdown()
    print(json.dumps({"clean": clean, "before": before, "after": _threads()}))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through /proc")
def test_shutdown_leaves_no_gloo_thread_to_meet_the_exit():
    """A rank once aborted after its clean stop (SIGABRT, "terminate called without an
    active exception"): destroy_process_group left gloo's worker threads running while the
    Comm held the group, and a worker still releasing the last collective's tensors takes
    the GIL, which a finalizing interpreter answers by ending the thread inside a C++
    destructor. `shutdown` frees the group, so its threads are joined before the exit."""
    code = "from tests.test_tensor_parallel import shutdown_then_threads; shutdown_then_threads()"
    with _Procs() as procs:
        ps = procs.python_ranks(code, _free_port())
        outs = [_communicate(p) for p in ps]
    for p, (out, err) in zip(ps, outs):
        assert p.returncode == 0 and "Traceback" not in err, err[-2000:]
        report = json.loads(out.strip().splitlines()[-1])
        assert report["clean"] and "pt_gloo_runloop" in report["before"], report
        assert not [t for t in report["after"] if "gloo" in t], report


def bench_rows_one_rank_fails(out_dir: str) -> None:
    """TP=2 rows of `parallel.bench.tp_rows` where rank 1 alone cannot build the model of
    the first row (the NCCL one); the timing itself is a stand-in with a barrier in it."""
    from qfuse.parallel import bench
    from qfuse.parallel.comm import init, shutdown

    comm = init(torch.device("cpu"), timeout_s=30)

    def rank_model(name, weight_bits, c):
        if c.rank == 1 and c.allreduce == "nccl":
            raise RuntimeError("rank 1 has no room for it")
        return object()

    def time_cuda(model, c, kv_bits, context, B, profile):
        c.barrier("the start of a timing")
        return {"ms": 2.0 + c.rank, "step_bytes": 100}

    bench.rank_model, bench.time_cuda = rank_model, time_cuda
    for name in ("reset_peak_memory_stats", "empty_cache"):
        setattr(torch.cuda, name, lambda: None)
    torch.cuda.max_memory_allocated = lambda: 0
    rows = bench.tp_rows(comm, "gemma3-12b", 4, 4, 64, 1, tp1=False,
                         allreduces=("nccl", "symm_mem"))
    Path(out_dir, f"rows{comm.rank}.json").write_text(json.dumps(rows))
    shutdown()


def test_bench_rows_fail_on_every_rank_together(tmp_path):
    port = _free_port()
    code = (f"from tests.test_tensor_parallel import bench_rows_one_rank_fails as f; "
            f"f({str(tmp_path)!r})")
    with _Procs() as procs:
        ps = procs.python_ranks(code, port)
        outs = [_communicate(p, timeout=60) for p in ps]
    for p, (_, err) in zip(ps, outs):
        assert p.returncode == 0, err[-3000:]
    rows = [json.loads((tmp_path / f"rows{r}.json").read_text()) for r in (0, 1)]
    assert rows[0] == rows[1]  # in step: the same rows on both ranks
    nccl, symm = rows[0]
    assert nccl["allreduce"] == "nccl"
    assert nccl["not_run"] == "rank 1: RuntimeError: rank 1 has no room for it"
    assert symm["allreduce"] == "symm_mem" and "not_run" not in symm
    assert symm["ms_per_token"] == 3.0  # the slower rank's


def test_torchrun_gate_reports_a_shard_that_fails_to_load_on_rank_1(tmp_path):
    # Rank 1's reading of its shard fails; rank 0 would load fine and go on into the
    # gate's collectives. Both agree first: rank 0 names rank 1's error, rank 1 is silent.
    code = ("import os, sys, qfuse.loading as L\n"
            "if os.environ['RANK'] == '1':\n"
            "    def load_model(*a, **k): raise OSError('shard file unreadable on rank 1')\n"
            "    L.load_model = load_model\n"
            "from qfuse.commands import cli\n"
            f"sys.exit(cli.main(['gate', '--tier', 'exact', '--json', {str(tmp_path / 'g')!r}]))")
    env = {k: v for k, v in _env().items() if k != "TRITON_INTERPRET"}
    with _Procs() as procs:
        p = procs.start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc-per-node", "2", "--no-python", sys.executable, "-c", code],
                        env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _out, err = _communicate(p, timeout=BOUND_S)
    assert p.returncode == 1, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("qfuse:")]
    assert lines == ["qfuse: error: rank 1: shard file unreadable on rank 1"], err[-3000:]
    assert not (tmp_path / "g").exists()


# -- errors that need no second process ----------------------------------------------------

def _run_cli(monkeypatch, capsys, env: dict, *argv) -> tuple[int, str]:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


# (env, argv, the one-line error) that every TP command gives before any process group;
# {command} is the command's name.
TP_ARGUMENT_ERRORS = [
    ({}, ["--tp", "2"], ("qfuse: error: --tp 2 needs 2 processes, one per GPU: start it as "
                        "`torchrun --nproc-per-node 2 -m qfuse {command} ...`")),
    ({"WORLD_SIZE": "2", "RANK": "0"}, ["--tp", "4"],
     "qfuse: error: --tp 4 does not match the 2 processes torchrun started (--nproc-per-node 2)"),
    ({"WORLD_SIZE": "4", "RANK": "0"}, [],
     ("qfuse: error: tensor parallel over 4 ranks: the model's attention heads (6) does not "
      "divide by 4")),
]


@pytest.mark.parametrize("env, argv, message", TP_ARGUMENT_ERRORS + [
    ({"WORLD_SIZE": "3", "RANK": "0"}, [],
     ("qfuse: error: tensor parallel over 3 ranks: the model's key-value heads (2) does not "
     "divide by 3")),
    ({}, ["--tp", "0"], "qfuse: error: --tp must be at least 1, got 0"),
])
def test_cli_errors_are_one_line_before_any_process_group(monkeypatch, capsys, env, argv,
                                                          message):
    message = message.format(command="generate")
    code, err = _run_cli(monkeypatch, capsys, env, "generate", *argv, "hi")
    assert code == 2
    assert err.strip() == message


def test_ranks_other_than_0_print_no_error(monkeypatch, capsys):
    code, err = _run_cli(monkeypatch, capsys, {"WORLD_SIZE": "4", "RANK": "3"}, "generate", "hi")
    assert code == 2 and err == ""


def test_a_rank_other_than_0_names_itself_in_an_error_of_its_own(monkeypatch, capsys):
    from qfuse.parallel import comm, runtime

    def fails(error):
        def run(args):
            raise error
        return run

    monkeypatch.setattr(comm, "started", lambda: True)  # the process group started
    monkeypatch.setattr(runtime, "run_generate_tp", fails(OSError("its shard is unreadable")))
    code, err = _run_cli(monkeypatch, capsys, {"WORLD_SIZE": "2", "RANK": "1"}, "generate", "hi")
    assert code == 1 and err == "qfuse: error: rank 1: its shard is unreadable\n"
    # A ParallelError is one rank 0 reports (agreed on, or its own collective failing).
    monkeypatch.setattr(runtime, "run_generate_tp",
                        fails(comm.ParallelError("rank 1 of 2: broadcast failed")))
    code, err = _run_cli(monkeypatch, capsys, {"WORLD_SIZE": "2", "RANK": "1"}, "generate", "hi")
    assert code == 2 and err == ""


def test_other_commands_refuse_to_run_under_torchrun(monkeypatch, capsys):
    code, err = _run_cli(monkeypatch, capsys, {"WORLD_SIZE": "2", "RANK": "0"}, "info")
    assert code == 2 and "`qfuse info` does not run tensor parallel" in err


# -- the sharding itself ---------------------------------------------------------------------

def test_split_kinds_cover_every_parameter_and_refuse_unknown_ones():
    from qfuse.models import Decoder

    cfg = ModelConfig.from_file(DEFAULT_MODEL)
    kinds = {name: split_kind(name) for name in Decoder(cfg).state_dict()}
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "column"
    assert kinds["model.layers.2.mlp.down_proj.weight"] == "row"
    assert kinds["model.embed_tokens.weight"] == "vocab"
    assert kinds["model.layers.1.self_attn.k_norm.weight"] == "replicated"
    assert kinds["model.norm.weight"] == "replicated"
    assert split_kind("model.layers.0.self_attn.o_proj.bias") == "row_bias"
    with pytest.raises(ValueError, match="no tensor-parallel rule"):
        split_kind("model.layers.0.mlp.experts.weight")


def rank_reads(tmp_path, tensors: dict[str, torch.Tensor], world: int):
    """{name: [each rank's part]}, read from a safetensors file as the loader reads a
    checkpoint (`RankShard.read`)."""
    from types import SimpleNamespace

    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "part.safetensors"
    save_file(tensors, str(path))
    with safe_open(str(path), "pt") as f:
        return {name: [RankShard(SimpleNamespace(rank=r, world=world)).read(f, name, name)
                       for r in range(world)] for name in tensors}


@pytest.mark.parametrize("bits", [4, 3, 8])
@pytest.mark.parametrize("world", [2, 4])
def test_shards_of_a_quantized_weight_give_back_its_words_bit_for_bit(bits, world, tmp_path):
    g = torch.Generator().manual_seed(bits)
    w = QuantizedTensor.from_float(torch.randn(96, 512, generator=g), 64, bits)
    for name, dim in (("model.layers.0.mlp.down_proj", -1), ("model.layers.0.mlp.up_proj", 0)):
        leaves = (("weight", "packed"), ("scales", "scales"), ("biases", "biases"))
        read = rank_reads(tmp_path, {f"{name}.{leaf}": getattr(w, attr).contiguous()
                                     for leaf, attr in leaves}, world)
        parts = [read[f"{name}.{leaf}"] for leaf, _ in leaves]
        packed, scales, biases = (torch.cat(p, dim) for p in parts)
        assert torch.equal(packed.view(torch.int32), w.packed.view(torch.int32))
        assert torch.equal(scales, w.scales) and torch.equal(biases, w.biases)
        # Each shard is itself a valid MLX tensor, and dequantizes to its slice.
        for r in range(world):
            shard = QuantizedTensor(parts[0][r], parts[1][r], parts[2][r], 64, bits)
            index = shard_index(f"{name}.scales", (96, 512), r, world)
            full = w.dequantize(torch.float32)
            assert torch.equal(shard.dequantize(torch.float32), full[index])


def test_a_row_parallel_bias_lives_on_rank_0_only(tmp_path):
    b = torch.arange(8.0)
    read = rank_reads(tmp_path, {"model.layers.0.self_attn.o_proj.bias": b,
                                 "model.layers.0.self_attn.q_proj.bias": b.clone()}, 2)
    o, q = read["model.layers.0.self_attn.o_proj.bias"], read["model.layers.0.self_attn.q_proj.bias"]
    assert torch.equal(o[0], b) and torch.equal(o[1], torch.zeros(8))
    assert torch.equal(q[1], torch.arange(4.0, 8.0))


def test_world_checks_name_what_does_not_split():
    raw = json.loads((DEFAULT_MODEL / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    check_world(cfg, 2, lambda path: (64, 4))  # 384/2 and 1024/2 inputs are whole groups
    with pytest.raises(TensorParallelError, match=r"o_proj \(4-bit, groups of 128\) has 384 "
                                                  r"inputs, so each rank's 192 would cut"):
        check_world(cfg, 2, lambda path: (128, 4))
    odd = ModelConfig.from_dict({**raw, "intermediate_size": 1000})
    with pytest.raises(TensorParallelError, match=r"intermediate size \(1000\) does not divide "
                                                  r"by 16"):
        check_world(ModelConfig.from_dict({**raw, "num_attention_heads": 16,
                                           "num_key_value_heads": 16, "intermediate_size": 1000}),
                    16)
    with pytest.raises(TensorParallelError, match="vocabulary size"):
        check_world(ModelConfig.from_dict({**raw, "vocab_size": 4097}), 2)
    local = rank_config(odd, 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size,
            local.head_dim, local.vocab_size) == (3, 1, 500, 64, 4096)


# -- qfuse serve under torchrun ---------------------------------------------------------------

def _health(port: int) -> dict | None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        return json.loads(r.read()) if r.status == 200 else None
    except OSError:
        return None
    finally:
        conn.close()


def _started_port(log) -> int | None:
    """The port in rank 0's start line, once written to the file ``log`` (its stderr).
    --port 0 lets rank 0 bind a free port itself: one picked by the test and freed before
    rank 0 binds it could be taken meanwhile, by a parallel test worker's server, say."""
    # pread: the ranks write through the file's offset, which a read would move
    text = os.pread(log.fileno(), 1 << 20, 0).decode(errors="replace")
    started = re.search(r"qfuse serve: .* at http://127\.0\.0\.1:(\d+)/v1", text)
    return int(started[1]) if started else None


def _live_children(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is ``pid``, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class _KillRanks:
    """On exit, SIGKILL the ranks torchrun started (listed, or still its children):
    torchrun puts each in a session of its own, so killing torchrun's would leave
    them serving after a failed test."""

    def __init__(self, ranks: list[int]):
        self.ranks, self.parent = ranks, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        found = [] if self.parent is None else _live_children(self.parent)
        for pid in {*self.ranks, *found}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _engine_texts(prompts: list[str], max_tokens: int, max_batch: int) -> list[str]:
    """What one process's `qfuse serve --deterministic --max-batch B` answers to these
    prompts sent together (greedy): its engine, in this process, both submitted at once."""
    import threading

    import qfuse
    from qfuse.runtime.prompts import encode_prompts
    from qfuse.serving.engine import Engine, Request

    model, tokenizer = qfuse.load(progress=False)
    engine = Engine(model, tokenizer, max_batch=max_batch, deterministic=True)
    texts, done = [""] * len(prompts), threading.Semaphore(0)

    def emit(event, i):
        texts[i] += event.text
        if event.finish_reason:
            done.release()

    for i, prompt in enumerate(prompts):
        ids = encode_prompts(tokenizer, [prompt], add_special_tokens=True)[0]
        engine.submit(Request(ids, max_tokens, emit=lambda e, i=i: emit(e, i)))
    engine.start()
    try:
        for _ in prompts:
            assert done.acquire(timeout=60), "the in-process engine did not finish"
    finally:
        engine.stop()
    return texts


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_torchrun_serve_answers_as_one_process_and_ends_every_rank(tmp_path, monkeypatch):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    import concurrent.futures

    prompts, max_tokens = ["Once upon a time", "def fibonacci(n):"], 8
    timeout_s = 6
    # A context of 24 tokens per slot: a slot left idle while the other decodes would
    # overflow it on rank 1 within the requests below if rank 1 did not take rank 0's
    # lengths (rank 0's engine resets an idle row after each step).
    args = ["serve", "--port", "0", "--max-batch", "2", "--deterministic",
            "--max-kv-size", "24", "--tp-timeout", str(timeout_s)]
    start = time.monotonic()
    ranks: list[int] = []
    with open(tmp_path / "err", "w+") as err, _Procs() as procs, \
            _KillRanks(ranks) as kill_ranks:
        tp = procs.start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "-m", "qfuse", *args],
                         _env(PYTHONUNBUFFERED="1"), cwd=REPO, stdout=subprocess.DEVNULL,
                         stderr=err)
        kill_ranks.parent = tp.pid
        # The reference while the ranks load: the engine of one process, same tier.
        monkeypatch.setenv("QFUSE_TIER", "compat")
        expected = _engine_texts(prompts, max_tokens, 2)
        while (port := _started_port(err)) is None or (health := _health(port)) is None:
            if tp.poll() is not None or time.monotonic() - start > BOUND_S:
                err.seek(0)
                pytest.fail(f"the TP server did not come up: {err.read()[-3000:]}")
            time.sleep(0.1)
        assert health["slots"] == 2 and health["deterministic"]
        ranks += _live_children(tp.pid)
        assert len(ranks) == 2, ranks
        rank0 = [p for p in ranks
                 if b"\0RANK=0\0" in b"\0" + Path(f"/proc/{p}/environ").read_bytes()]
        assert len(rank0) == 1, ranks
        # Idle past --tp-timeout: rank 1 waits for rank 0's next command all along, and
        # lives on only through the keepalive.
        time.sleep(timeout_s + 1)
        assert tp.poll() is None and all(_alive(p) for p in ranks)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=60)

        def complete(prompt):
            r = client.completions.create(model="default", prompt=prompt,
                                          max_tokens=max_tokens, temperature=0)
            return r.choices[0].text, r.usage.completion_tokens

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, prompts))
        assert [t for t, _ in got] == expected and all(n == max_tokens for _, n in got), \
            (got, expected)
        assert all(expected)  # the comparison is not between empty texts
        # The first token comes from the prefill: 7 decode steps a request. They shared
        # steps (fewer than 14 of 2 rows), as in the reference.
        shared = _health(port)["steps_by_batch"]["2"]
        assert max_tokens - 1 <= shared < 2 * (max_tokens - 1), shared
        # One at a time, slot 1 idle: 21 more steps (batch invariance: the same text).
        for _ in range(3):
            assert complete(prompts[0]) == (expected[0], max_tokens)
        assert _health(port)["steps_by_batch"] == {"2": shared + 3 * (max_tokens - 1)}

        # SIGTERM to rank 0 alone (a service manager's stop): it tells rank 1 to end.
        # Every rank exits 0 with no error (below): rank 1 was told to end, it did not
        # time out.
        os.kill(rank0[0], signal.SIGTERM)
        try:
            tp.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun still runs {BOUND_S} s after SIGTERM to rank 0; ranks "
                        f"alive: {[p for p in ranks if _alive(p)]}")
        left = [p for p in ranks if _alive(p)]
        kill_ranks.ranks, kill_ranks.parent = left, None  # the others' pids may be reused
        err.seek(0)
        log = err.read()
    assert tp.returncode == 0, log[-3000:]  # every rank exited 0
    assert not left, "a rank outlived torchrun"
    assert "Traceback" not in log and "error" not in log.lower(), log[-3000:]
    assert log.count("qfuse serve: default at http://127.0.0.1:") == 1, log  # rank 0 only


def test_a_rank_killed_while_serving_ends_rank_0_with_an_error(tmp_path):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    master = _free_port()
    # Without torchrun, whose agent would stop rank 0 itself: rank 0 must notice alone.
    args = [sys.executable, "-m", "qfuse", "serve", "--port", "0", "--tp-timeout", str(NEVER_S)]
    with open(tmp_path / "err0", "w+") as err0, _Procs() as procs:
        ps = [procs.start(args, _env(r, 2, master), cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=err0 if r == 0 else subprocess.PIPE) for r in (0, 1)]
        deadline = time.monotonic() + BOUND_S
        while (port := _started_port(err0)) is None or _health(port) is None:
            assert ps[0].poll() is None and time.monotonic() < deadline, "no server came up"
            time.sleep(0.1)
        os.killpg(ps[1].pid, signal.SIGKILL)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=BOUND_S)
        # Within BOUND_S, long before NEVER_S: rank 0 noticed, it did not time out.
        with pytest.raises(openai.InternalServerError):  # the request fails, nothing hangs
            client.completions.create(model="default", prompt="hi", max_tokens=8)
        try:
            ps[0].wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still serves {BOUND_S} s after rank 1 was killed")
        err0.seek(0)
        err = err0.read()
    assert ps[0].returncode == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[0].startswith("qfuse serve: slots "), err  # what it chose, then the start
    assert lines[1].startswith("qfuse serve: default at http://127.0.0.1:"), err
    assert len(lines) == 3 and lines[2].startswith("qfuse: error: rank 0 of 2:"), err
    assert "another rank stopped" in lines[2] and "Traceback" not in err


@pytest.mark.parametrize("env, argv, message", TP_ARGUMENT_ERRORS)
def test_serve_tp_errors_are_one_line_before_any_process_group(monkeypatch, capsys, env, argv,
                                                               message):
    message = message.format(command="serve")
    code, err = _run_cli(monkeypatch, capsys, env, "serve", "--port", "0", *argv)
    assert code == 2
    assert err.strip() == message
