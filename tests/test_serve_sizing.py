"""What `qfuse serve` starts with: the slots the free memory holds (a faked free-memory
figure stands for a GPU's), an explicit --max-batch that cannot fit refused in one line,
CUDA graphs off on a CPU, and the start-up line and --help that say so."""

from types import SimpleNamespace

import pytest
import torch

from qfuse.errors import UserError
from qfuse.loading import DEFAULT_MODEL, check_checkpoint
from qfuse.runtime.cache import kv_cache_bytes
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


def test_with_pages_graphs_are_on_by_default_on_cuda(config, monkeypatch):
    _fake_free(monkeypatch, 1000 * _needs(config, sizing.AUTO_MAX_BATCH))
    gpu = _model(config, "cuda")
    paged = _plan(gpu, kv_page_size=16)
    assert (paged.cuda_graph, paged.cuda_graph_reason) == (True, "default")
    assert paged.line().endswith("CUDA graphs on (--no-cuda-graph to decode eagerly)"), \
        paged.line()
    assert not _plan(gpu, kv_page_size=16, cuda_graph=False).cuda_graph
    assert _plan(_model(config, "cpu"), kv_page_size=16).line().endswith(
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
    buckets = "/".join(map(str, bucket_sizes(sizing.CPU_MAX_BATCH)))
    assert f"({sizing.CPU_MAX_BATCH} slots of 1024 tokens, cpu, bucketed steps of {buckets} rows)" \
        in lines[1]


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
    assert ("Default: on with CUDA (paged or not), off on a CPU; "
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


@pytest.mark.parametrize("flags", [
    {},
    {"bits": 4, "group_size": 32, "num_pages": 70, "chunk_tokens": 64, "scratch_page": True},
    {"bits": 8, "page_size": 4, "chunk_tokens": 200},
    {"page_size": 128, "scratch_page": True},  # the window (128) is the full context's
])
def test_paged_bytes_are_those_of_the_cache_made(config, flags):
    """The estimate `plan` weighs is the cache's own count, sliding pools included."""
    from qfuse.runtime.paged_cache import PagedKVCache, paged_kv_cache_bytes

    made = PagedKVCache(config, 3, 300, torch.bfloat16, "cpu", **flags)
    assert paged_kv_cache_bytes(config, 3, 300, torch.bfloat16, **flags) == made.nbytes


def _pages(config, slots: int, pages: int, **flags) -> int:
    from qfuse.runtime.paged_cache import paged_kv_cache_bytes

    return paged_kv_cache_bytes(config, slots, config.max_position_embeddings,
                                torch.bfloat16, 0, 64, 16, pages, **flags)


def test_with_pages_on_cuda_the_pages_take_the_free_memory(config, monkeypatch):
    gpu = _model(config, "cuda")
    per_seq = config.max_position_embeddings // 16
    free = 200 * _needs(config, sizing.AUTO_MAX_BATCH)
    _fake_free(monkeypatch, free)
    chosen = _plan(gpu, kv_page_size=16, cuda_graph=False)  # eager: the simplest sum
    assert (chosen.slots, chosen.slots_reason) == (sizing.AUTO_MAX_BATCH, "auto, capped")
    assert chosen.kv_pages_reason == "auto"
    # The most pages whose pools and the activations fit 90 % of the free memory: far
    # more than every slot at the context (the slotted sizing), one more would not fit.
    assert chosen.kv_pages > 10 * sizing.AUTO_MAX_BATCH * per_seq
    budget = sizing.MEMORY_FRACTION * free - chosen.activation_bytes
    assert chosen.kv_cache_bytes == _pages(config, chosen.slots, chosen.kv_pages, chunk_tokens=512)
    assert chosen.kv_cache_bytes <= budget
    assert _pages(config, chosen.slots, chosen.kv_pages + 1, chunk_tokens=512) > budget
    line = chosen.line()
    assert line.startswith(
        f"qfuse serve: slots {sizing.AUTO_MAX_BATCH} (at most by default with CUDA; "
        f"--max-batch N to change; the pages decide admission), KV pages {chosen.kv_pages} "
        f"x 16 tokens ({sizing.gib(chosen.kv_cache_bytes)} of {sizing.gib(free)} free: as "
        f"many as fit in {sizing.MEMORY_FRACTION:.0%} of it; --kv-pages N to change), "
        "CUDA graphs off"), line
    startup = chosen.as_dict()  # what /health says under "startup"
    assert (startup["kv_page_size"], startup["kv_pages"], startup["kv_pages_reason"]) == \
        (16, chosen.kv_pages, "auto")
    # Graphs (the default with CUDA): their buckets' buffers and a scratch page per pool
    # come off first.
    graphed = _plan(gpu, kv_page_size=16)
    assert graphed.cuda_graph and graphed.kv_pages < chosen.kv_pages


def test_with_pages_little_memory_takes_fewer_slots_then_refuses(config, monkeypatch):
    gpu = _model(config, "cuda")
    per_seq = config.max_position_embeddings // 16
    # What 3 slots and one sequence's pages need, over 90 %: 3 slots, one sequence of pages.
    need3 = _pages(config, 3, per_seq, chunk_tokens=512) + sizing.activation_bytes(
        config, torch.bfloat16, 1024, 3, 1024)  # eager: the 3-row step's buffers
    _fake_free(monkeypatch, int(need3 / sizing.MEMORY_FRACTION) + 16)
    chosen = _plan(gpu, kv_page_size=16, cuda_graph=False)
    assert (chosen.slots, chosen.slots_reason, chosen.kv_pages) == (3, "auto", per_seq)
    assert "(as many as the free memory holds; --max-batch N to change;" in chosen.line()
    _fake_free(monkeypatch, 1024)
    with pytest.raises(UserError, match="^one sequence of 1024 tokens in pages needs "):
        _plan(gpu, kv_page_size=16)
    with pytest.raises(UserError, match="^--max-batch 4: 4 slots with one sequence of 1024 "):
        _plan(gpu, kv_page_size=16, max_batch=4)


def test_an_explicit_kv_pages_over_the_free_memory_is_refused(config, monkeypatch):
    gpu = _model(config, "cuda")
    free = 4 * _needs(config, sizing.AUTO_MAX_BATCH)
    _fake_free(monkeypatch, free)
    most = _plan(gpu, kv_page_size=16, max_batch=8).kv_pages
    assert _plan(gpu, kv_page_size=16, max_batch=8, kv_pages=most).kv_pages_reason == "--kv-pages"
    with pytest.raises(UserError) as e:
        _plan(gpu, kv_page_size=16, max_batch=8, kv_pages=100 * most)
    message = str(e.value)
    assert message.startswith(f"--kv-pages {100 * most}: {100 * most} pages of 16 tokens "
                              "need "), message
    assert f"{sizing.gib(free)} of GPU memory is free; at most " in message
    assert "\n" not in message
    # The most that fit the whole free memory: the default's, over 90 % of it, and more.
    fit = int(message.split("at most ")[1].split()[0])
    assert most < fit < 100 * most
    assert _plan(gpu, kv_page_size=16, max_batch=8, kv_pages=fit).kv_pages == fit
    with pytest.raises(UserError):
        _plan(gpu, kv_page_size=16, max_batch=8, kv_pages=fit + 1)


def test_with_pages_on_a_cpu_the_pages_are_every_slot_at_most(config, monkeypatch):
    _fake_free(monkeypatch, 1000 * _needs(config, sizing.AUTO_MAX_BATCH))
    chosen = _plan(_model(config, "cpu"), kv_page_size=16)
    assert (chosen.slots, chosen.kv_pages, chosen.kv_pages_reason) == \
        (sizing.CPU_MAX_BATCH, sizing.CPU_MAX_BATCH * 64, "auto, capped")
    assert (f"KV pages {sizing.CPU_MAX_BATCH * 64} x 16 tokens (" in chosen.line()
            and ": every slot at 1024 tokens; --kv-pages N to change)" in chosen.line())


def test_serve_refuses_kv_pages_over_the_free_memory_in_one_line(qfuse_here, monkeypatch):
    import qfuse.serving.server

    def make_server(config, engine):
        raise AssertionError("the server started with pages that do not fit")

    monkeypatch.setattr(qfuse.serving.server, "make_server", make_server)
    monkeypatch.setattr(sizing, "free_memory", lambda device: (2**30, 2**31))
    r = qfuse_here("serve", "--port", "0", "--device", "cpu", "--kv-page-size", "16",
                   "--kv-pages", "100000000")
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("qfuse: error: --kv-pages 100000000: 100000000 pages of 16 "
                                "tokens need "), r.stderr
    assert "1.0 GiB of memory is free; at most " in lines[-1] and "Traceback" not in r.stderr


def test_serve_with_pages_says_how_many_it_made(qfuse_here, monkeypatch):
    import qfuse.serving.server

    made = {}

    class Stopped:
        def __init__(self, engine):
            made["pages"] = engine.page_stats()["total"]
            self.engine = engine

        def run(self, sockets):
            self.engine.stop()
            sockets[0].close()

    import qfuse.serving.app

    make_app = qfuse.serving.app.make_app

    def recording(*args, startup=None, **kw):  # what /health will say under "startup"
        made["startup"] = startup
        return make_app(*args, startup=startup, **kw)

    monkeypatch.setattr(qfuse.serving.app, "make_app", recording)
    monkeypatch.setattr(qfuse.serving.server, "make_server",
                        lambda config, engine: Stopped(engine))
    r = qfuse_here("serve", "--port", "0", "--device", "cpu", "--kv-page-size", "16",
                   "--max-batch", "2")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("qfuse serve:")]
    assert lines[0].startswith("qfuse serve: slots 2 (--max-batch; the pages decide "
                               "admission), KV pages 128 x 16 tokens ("), lines
    assert "(2 slots of 1024 tokens, 128 KV pages of 16 tokens, cpu, " in lines[1], lines
    assert made["pages"] == 128  # the engine made what the line says
    startup = made["startup"]
    assert (startup["kv_page_size"], startup["kv_pages"], startup["kv_pages_reason"]) == \
        (16, 128, "auto, capped")
    assert startup["summary"] == lines[0]


def test_help_says_the_default_pages(qfuse_here, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    r = qfuse_here("serve", "--help")
    help_text = " ".join(r.stdout.split())
    assert (f"--kv-pages N with --kv-page-size: pages per full-attention layer, at least one "
            f"sequence of --max-kv-size tokens. Default: as many as fit in "
            f"{sizing.MEMORY_FRACTION:.0%} of the memory free once the model and the "
            "activations of --max-batch rows are counted") in help_text, help_text


def test_tensor_parallel_serve_refuses_pages_in_one_line():
    """The ranks make a slotted cache: under torchrun --kv-page-size is refused, not
    named in a start line over a cache that has no pages; so is --async-scheduling,
    whose steps the ranks cannot follow."""
    import argparse

    from qfuse.commands import cli
    from qfuse.parallel.serve import check_tp_args

    sub = argparse.ArgumentParser().add_subparsers()
    parser = cli.command_module("serve").add_parser(sub) or sub.choices["serve"]
    args = parser.parse_args(["--device", "cpu", "--kv-page-size", "16"])
    with pytest.raises(UserError, match="^--kv-page-size: the paged KV cache does not run "
                                        "tensor parallel yet; leave it out under torchrun$"):
        check_tp_args(args)
    args = parser.parse_args(["--device", "cpu", "--async-scheduling"])
    with pytest.raises(UserError, match="^--async-scheduling does not run tensor parallel"):
        check_tp_args(args)
    check_tp_args(parser.parse_args(["--device", "cpu"]))  # slotted: as before
