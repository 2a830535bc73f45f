"""The serving engine's fixed-batch decode steps on a paged KV cache (`paged_graphs`):
deterministic mode on pages (every slot at its own row, idle ones on the scratch page)
gives each request the tokens it gets alone, and the slotted deterministic engine's,
with every page free afterwards, preemption included; graphs need CUDA. On the GPU (marked `gpu`): CUDA graphs per
bucket on pages give each request its alone-greedy tokens, as the eager paged engine
does, deterministic or not, and through preemption."""

import pytest

import qfuse
from qfuse.serving.engine import Engine
from qfuse.serving.in_process import Followed

# Short prompts: with 40 tokens each stays within the sliding window (128), where the
# paged attention is bitwise the slotted one; the last one goes in chunks of 32.
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n" * 10, "x = [", "hello world"]
CONTEXT = 256  # one sequence: 16 pages of 16 tokens


@pytest.fixture(scope="module")
def bundled():
    return qfuse.load(progress=False)


@pytest.fixture
def loaded(request):
    """The tiny test model for the CPU cases (tests of the engine); the cases marked
    `gpu` keep the bundled model they were checked on."""
    gpu = request.node.get_closest_marker("gpu") is not None
    return request.getfixturevalue("bundled" if gpu else "tiny_loaded")


def _run(loaded, prompts, max_tokens, **kw):
    """Each prompt's greedy tokens, all submitted before the start, and the engine."""
    model, tokenizer = loaded
    engine = Engine(model, tokenizer, max_batch=4, context=CONTEXT, prefill_chunk=32, **kw)
    jobs = [Followed(engine, tokenizer, p, max_tokens) for p in prompts]
    engine.start()
    try:
        tokens = [job.wait() for job in jobs]
        assert all(job.reason in ("length", "stop") for job in jobs)
    finally:
        engine.stop()
    return tokens, engine


def _alone(loaded, max_tokens, **kw):
    return [_run(loaded, [p], max_tokens, **kw)[0][0] for p in PROMPTS]


def _all_free(engine) -> bool:
    return all(g.allocator.free_pages == g.allocator.num_pages
               for g in engine.cache.groups.values())


def test_deterministic_on_pages_is_batch_invariant_and_the_slotted_one(loaded):
    kw = {"kv_page_size": 16, "deterministic": True}
    alone = _alone(loaded, 40, **kw)
    together, engine = _run(loaded, PROMPTS, 40, **kw)
    slotted, _ = _run(loaded, PROMPTS, 40, deterministic=True)
    assert together == alone and together == slotted
    assert all(len(t) == 40 for t in together)
    # Every step decoded the whole batch, idle slots on the scratch page.
    assert set(engine.steps_by_batch) == {4} and engine.steps_by_batch[4] > 0
    assert engine.stats()["deterministic"] is True and _all_free(engine)


@pytest.mark.parametrize("fixed", [{"deterministic": True},
                                   pytest.param({"cuda_graph": True}, marks=pytest.mark.gpu)],
                         ids=["deterministic", "graphs"])
def test_fixed_batches_on_pages_keep_the_alone_tokens_through_preemption(loaded, fixed):
    kw = {"kv_page_size": 16, **fixed}
    alone = _alone(loaded, 150, **kw)
    tight, engine = _run(loaded, PROMPTS, 150, kv_pages=16, **kw)
    assert engine.stats()["kv_pages"]["preemptions"] > 0, "no preemption: nothing tested"
    assert tight == alone and _all_free(engine)


def test_graphs_on_pages_need_cuda(loaded):
    model, tokenizer = loaded
    if model.model.norm.weight.device.type != "cuda":
        with pytest.raises(ValueError, match="cuda_graph needs the model on a CUDA device"):
            Engine(model, tokenizer, max_batch=2, context=CONTEXT, kv_page_size=16,
                   cuda_graph=True)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_graphs_on_pages_give_each_request_its_alone_tokens(loaded, deterministic):
    kw = {"kv_page_size": 16, "deterministic": deterministic}
    alone = _alone(loaded, 40, cuda_graph=True, **kw)
    graphed, engine = _run(loaded, PROMPTS, 40, cuda_graph=True, **kw)
    eager, _ = _run(loaded, PROMPTS, 40, cuda_graph=False, **kw)
    assert graphed == alone and graphed == eager
    assert set(engine.steps_by_batch) <= set(engine.buckets)
    assert sum(engine.steps_by_batch.values()) > 0 and _all_free(engine)
