"""What `qfuse serve` starts with: the slots the free memory holds (a faked free-memory
figure stands for a GPU's), an explicit --max-batch that cannot fit refused in one line,
CUDA graphs off on a CPU, and the start-up line and --help that say so."""

from types import SimpleNamespace

import pytest
import torch

from qfuse.cache import kv_cache_bytes
from qfuse.errors import UserError
from qfuse.loading import DEFAULT_MODEL, check_checkpoint
from qfuse.serving import sizing
from qfuse.serving.engine import bucket_sizes


@pytest.fixture(scope="module")
def config():
    return check_checkpoint(DEFAULT_MODEL)


def _model(config, device: str):
    """What `sizing.plan` reads of a loaded model, on ``device`` (named, not allocated)."""
    weight = SimpleNamespace(device=torch.device(device))
    return SimpleNamespace(config=config, dtype=torch.bfloat16,
                           model=SimpleNamespace(norm=SimpleNamespace(weight=weight)))


def _plan(model, **flags):
    return sizing.plan(model, **{"max_batch": None, "context": None, "kv_bits": 0,
                                 "kv_group_size": 64, "cuda_graph": None,
                                 "deterministic": False, "max_prefill_tokens": 2048, **flags})


def _fake_free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(sizing, "free_memory", lambda device: (free, 2 * free))


def _needs(config, slots: int, graphed: bool = True) -> int:
    """KV cache + activations of ``slots`` slots of the bundled model on CUDA (bf16)."""
    rows = sum(bucket_sizes(slots)) if graphed else slots
    context = config.max_position_embeddings
    return (kv_cache_bytes(config, slots, context, torch.bfloat16)
            + sizing.activation_bytes(config, torch.bfloat16,
                                      sizing.prefill_tokens(context, 2048, 512), rows, context))


def test_on_cuda_the_default_takes_the_most_slots_the_free_memory_holds(config, monkeypatch):
    gpu = _model(config, "cuda")
    # Free memory whose 90 % holds 5 slots and not 6: 5 are taken; a little less, 4.
    free = int(_needs(config, 5) / sizing.MEMORY_FRACTION) + 16
    assert _needs(config, 6) > sizing.MEMORY_FRACTION * free
    _fake_free(monkeypatch, free)
    chosen = _plan(gpu)
    assert (chosen.slots, chosen.slots_reason, chosen.cuda_graph) == (5, "auto", True)
    assert chosen.kv_cache_bytes == kv_cache_bytes(config, 5, 1024, torch.bfloat16)
    line = chosen.line()
    assert line.startswith(f"qfuse serve: slots 5 (as many as fit in "
                           f"{sizing.MEMORY_FRACTION:.0%} of the free memory: "
                           f"KV cache {sizing.gib(chosen.kv_cache_bytes)} of "
                           f"{sizing.gib(free)} free; --max-batch N to change)"), line
    assert line.endswith("CUDA graphs on (--no-cuda-graph to decode eagerly)"), line
    _fake_free(monkeypatch, int((_needs(config, 5) - 16) / sizing.MEMORY_FRACTION))
    assert _plan(gpu).slots == 4
    # Without graphs the buckets' steps share their buffers: the estimate is smaller.
    _fake_free(monkeypatch, int(_needs(config, 5, graphed=False) / sizing.MEMORY_FRACTION) + 16)
    assert _plan(gpu, cuda_graph=False).slots == 5 and _plan(gpu).slots == 4
    assert _plan(gpu, cuda_graph=False).line().endswith("CUDA graphs off (--no-cuda-graph)")


def test_with_pages_graphs_are_on_only_when_asked(config, monkeypatch):
    _fake_free(monkeypatch, 1000 * _needs(config, sizing.AUTO_MAX_BATCH))
    gpu = _model(config, "cuda")
    paged = _plan(gpu, paged=True)
    assert (paged.cuda_graph, paged.cuda_graph_reason) == (False, "default, paged")
    assert paged.line().endswith("CUDA graphs off (over --kv-page-size only when asked: "
                                 "--cuda-graph)"), paged.line()
    assert _plan(gpu, paged=True, cuda_graph=True).cuda_graph
    assert _plan(_model(config, "cpu"), paged=True).line().endswith(
        "CUDA graphs off (they need CUDA)")


def test_plenty_of_memory_gives_the_most_slots_by_default(config, monkeypatch):
    _fake_free(monkeypatch, 1000 * _needs(config, sizing.AUTO_MAX_BATCH))
    chosen = _plan(_model(config, "cuda"))
    assert (chosen.slots, chosen.slots_reason) == (sizing.AUTO_MAX_BATCH, "auto, capped")
    assert f"; {sizing.AUTO_MAX_BATCH} at most by default with CUDA; --max-batch N to " \
           "change)" in chosen.line()
    # An explicit --max-batch is taken as it is, above the default's most too.
    chosen = _plan(_model(config, "cuda"), max_batch=sizing.AUTO_MAX_BATCH + 8)
    assert (chosen.slots, chosen.slots_reason) == (sizing.AUTO_MAX_BATCH + 8, "--max-batch")
    assert chosen.line().startswith(f"qfuse serve: slots {sizing.AUTO_MAX_BATCH + 8} "
                                    "(--max-batch; KV cache ")


def test_on_a_cpu_graphs_are_off_and_the_slots_are_few(config, monkeypatch):
    _fake_free(monkeypatch, 1000 * _needs(config, sizing.AUTO_MAX_BATCH))
    chosen = _plan(_model(config, "cpu"))
    assert (chosen.slots, chosen.cuda_graph) == (sizing.CPU_MAX_BATCH, False)
    assert chosen.line().endswith("CUDA graphs off (they need CUDA)")


def test_slots_that_cannot_fit_are_refused_naming_the_memory(config, monkeypatch):
    gpu = _model(config, "cuda")
    free = _needs(config, 3)
    _fake_free(monkeypatch, free)
    with pytest.raises(UserError) as e:
        _plan(gpu, max_batch=64)
    kv = kv_cache_bytes(config, 64, 1024, torch.bfloat16)
    assert str(e.value).startswith(
        f"--max-batch 64: a KV cache of 64 slots x 1024 tokens needs {sizing.gib(kv)} "), e.value
    assert f"but {sizing.gib(free)} of GPU memory is free; at most 3 slots fit" in str(e.value)
    assert _plan(gpu, max_batch=3).slots == 3  # what fits the free memory is honoured
    # By default, not even one slot: the same kind of line.
    _fake_free(monkeypatch, _needs(config, 1) // 2)
    with pytest.raises(UserError, match="^one KV cache slot of 1024 tokens needs .* --kv-bits 4$"):
        _plan(gpu)


def test_serve_refuses_a_max_batch_over_the_free_memory_in_one_line(qfuse_here, monkeypatch):
    import qfuse.serving.server

    def make_server(config, engine):  # in this process a missed check would serve on
        raise AssertionError("the server started with slots that do not fit")

    monkeypatch.setattr(qfuse.serving.server, "make_server", make_server)
    monkeypatch.setattr(sizing, "free_memory", lambda device: (2**20, 2**30))  # 1 MiB free
    r = qfuse_here("serve", "--port", "0", "--max-batch", "64")
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("qfuse: error: --max-batch 64: a KV cache of 64 slots x "
                                "1024 tokens needs "), r.stderr
    assert "1.0 MiB of memory is free" in lines[-1] and "Traceback" not in r.stderr
    assert not any(line.startswith("qfuse serve:") for line in lines), r.stderr


def test_serve_on_a_cpu_says_what_it_chose_and_that_graphs_are_off(qfuse_here, monkeypatch):
    import qfuse.serving.server

    class Stopped:
        """Stands in for uvicorn's server: it stops the engine instead of serving."""

        def __init__(self, engine):
            self.engine = engine

        def run(self, sockets):
            self.engine.stop()
            sockets[0].close()

    monkeypatch.setattr(qfuse.serving.server, "make_server",
                        lambda config, engine: Stopped(engine))
    r = qfuse_here("serve", "--port", "0", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("qfuse serve:")]
    assert len(lines) == 2, r.stderr
    assert lines[0].startswith(f"qfuse serve: slots {sizing.CPU_MAX_BATCH} (KV cache "), lines
    assert lines[0].endswith("CUDA graphs off (they need CUDA)"), lines
    assert f"({sizing.CPU_MAX_BATCH} slots of 1024 tokens, cpu, bucketed steps)" in lines[1]


def test_help_says_how_to_change_the_slots_and_graphs(qfuse_here, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse would wrap lines inside flag names
    r = qfuse_here("serve", "--help")
    assert r.returncode == 0
    help_text = " ".join(r.stdout.split())
    assert "--max-batch N sequences decoded together" in help_text
    assert (f"Default: as many as fit in {sizing.MEMORY_FRACTION:.0%} of the memory free once the model is loaded, "
            f"at most {sizing.AUTO_MAX_BATCH} with CUDA, {sizing.CPU_MAX_BATCH} on a CPU"
            ) in help_text
    assert "--cuda-graph, --no-cuda-graph" in help_text
    assert ("Default: on with CUDA (with --kv-page-size only when asked), off on a CPU; "
            "--no-cuda-graph decodes eagerly") in help_text


def test_the_estimate_follows_the_prefill_chunk(config):
    """Chunking bounds one prefill call's tokens (a chunk, or a batch up to
    --max-prefill-tokens); without it a whole prompt of the context is one call."""
    assert sizing.prefill_tokens(131072, 2048, 512) == 2048
    assert sizing.prefill_tokens(131072, 256, 4096) == 4096
    assert sizing.prefill_tokens(1000, 2048, 512) == 1000
    assert sizing.prefill_tokens(131072, 2048, 0) == 131072
    chunked = sizing.activation_bytes(config, torch.bfloat16, 2048, 8, 131072)
    whole = sizing.activation_bytes(config, torch.bfloat16, 131072, 8)
    assert whole > chunked > sizing.activation_bytes(config, torch.bfloat16, 2048, 8)
