"""The fixed-address inputs of a paged decode step (`paged_graphs.PagedStepInputs`), run
eagerly on whatever device the bundled model is on: after `prepare`, the fixed tables
and lengths are what the eager step over `PagedKVCache.select` reads (rows in any order,
pages taken across page boundaries between steps, a released row refilled), and the
step gives its logits bit for bit; idle rows sit on the scratch page and take none; a
row past the fixed table, too few pages or bad rows are refused before anything changes.
On the GPU (marked `gpu`): `generate` on pages replays the same tokens and bitwise the
same log-probabilities from CUDA graphs as eagerly, and the slotted cache's greedy
tokens."""

import pytest
import torch

import qfuse
from qfuse.errors import RequestError
from qfuse.runtime.generation import Summary, generate
from qfuse.runtime.paged_cache import OutOfPages, PagedKVCache
from qfuse.runtime.paged_graphs import PagedStepInputs
from qfuse.runtime.prompts import encode_prompts, pad_prompts
from qfuse.runtime.slotted_graphs import GraphedDecode

PROMPTS = ["def add(a, b):", "import os\nprint(", "class Stack:\n" * 12]  # 7, 5, 60 tokens
# Past the bundled model's sliding window (128): its sliding group drops pages.
LONG = "class Stack:\n" * 40
SHORT = "def add(a, b):"


@pytest.fixture(scope="module")
def loaded():
    return qfuse.load(progress=False)


def _device(model):
    return model.model.norm.weight.device


def _cache(model, rows=3, max_tokens=200, page_size=4, **kw):
    return PagedKVCache(model.config, rows, max_tokens, model.dtype, _device(model),
                        page_size=page_size, scratch_page=True, **kw)


def _prefill(model, tokenizer, cache, rows, prompts):
    """Prefill ``prompts`` into cache rows ``rows``; the first greedy tokens [len(rows)]."""
    batch, lengths = pad_prompts(encode_prompts(tokenizer, prompts), _device(model))
    with torch.no_grad():
        return model(batch, lengths, cache.select(rows), logits="last").argmax(-1)


def _twins(loaded, rows, prompts, **kw):
    """Two caches holding the same prefilled rows, and their first tokens."""
    model, tokenizer = loaded
    caches = [_cache(model, **kw) for _ in range(2)]
    firsts = [_prefill(model, tokenizer, c, rows, prompts) for c in caches]
    assert torch.equal(firsts[0], firsts[1])
    return caches, firsts[0]


def test_prepared_inputs_are_what_the_eager_step_reads(loaded):
    model, _ = loaded
    rows = [2, 0, 1]  # not the cache's order: the step's row i is cache row rows[i]
    (eager, fixed), token = _twins(loaded, rows, PROMPTS)
    inputs = PagedStepInputs(fixed, len(rows))
    addresses = {w: t.data_ptr() for w, t in inputs.tables.items()}
    grown = 0
    with torch.no_grad():
        for _ in range(10):  # pages of 4 tokens: every row crosses a boundary
            before = fixed.host_lengths
            expected = model.decode(token, eager.select(rows))
            inputs.prepare(token, rows)
            index = torch.tensor(rows, device=token.device)
            for w, g in eager.groups.items():
                assert torch.equal(inputs.tables[w], g.table[index])
                assert torch.equal(fixed.groups[w].table, g.table)
            assert inputs.lengths.tolist() == [before[b] for b in rows]
            assert fixed.host_lengths == eager.host_lengths
            grown += sum(n % 4 == 0 for n in before)  # this step's token took a page
            got = model.decode(inputs.tokens, inputs)
            assert torch.equal(got, expected)
            token = expected.argmax(-1)
    assert grown >= 3, "no row crossed a page boundary: the test tests nothing"
    # Rewritten in place, never reallocated: a captured graph reads these addresses.
    assert {w: t.data_ptr() for w, t in inputs.tables.items()} == addresses
    # The cache's own device lengths follow, as after eager steps over the whole cache.
    assert fixed.lengths.tolist() == fixed.host_lengths


def test_a_released_row_refilled_is_read_through_the_same_tensors(loaded):
    model, tokenizer = loaded
    (eager, fixed), token = _twins(loaded, [0, 1], PROMPTS[:2])
    inputs = PagedStepInputs(fixed, 2)
    with torch.no_grad():
        for cache in (eager, fixed):
            cache.release(0)
        # The freed pages go to the new prompt: the lowest free first, as before.
        new = [_prefill(model, tokenizer, c, [0], [PROMPTS[2]]) for c in (eager, fixed)]
        token = torch.stack([new[0][0], token[1]])
        for _ in range(6):
            expected = model.decode(token, eager.select([0, 1]))
            got = inputs.step(model, token, [0, 1])
            assert torch.equal(inputs.tables[None], eager.groups[None].table[:2])
            assert torch.equal(got, expected)
            token = expected.argmax(-1)
    assert fixed.host_lengths == eager.host_lengths == [66, 11, 0]


def test_idle_rows_sit_on_the_scratch_page_and_take_none(loaded):
    model, _ = loaded
    (cache, _), token = _twins(loaded, [0, 1], PROMPTS[:2])
    inputs = PagedStepInputs(cache, 4)
    for layer in cache.layers:  # one page past every page the allocator hands out
        assert layer.group.scratch == layer.group.allocator.num_pages == layer.k.shape[0] - 1
    free = {w: g.allocator.free_pages for w, g in cache.groups.items()}
    lengths = cache.host_lengths
    rows = [1, None, 0]  # step rows 1 and 3 idle
    with torch.no_grad():
        logits = inputs.step(model, torch.stack([token[1], token[0], token[0]]), rows)
    assert cache.host_lengths == [lengths[0] + 1, lengths[1] + 1, 0]
    for w, g in cache.groups.items():
        table = inputs.tables[w]
        for i in (1, 3):
            assert table[i, 0] == g.scratch and (table[i, 1:] == -1).all()
        assert torch.equal(table[[0, 2]], g.table[[1, 0]])
        # Rows 0 and 1 grew by a token within their pages (7, 5 tokens: pages of 4).
        assert g.allocator.free_pages == free[w]
    assert torch.isfinite(logits).all()
    assert inputs.lengths.tolist() == [lengths[1] + 1, 1, lengths[0] + 1, 1]  # after it


def test_a_row_past_the_fixed_table_is_refused_before_anything_changes(loaded):
    model, tokenizer = loaded
    cache = _cache(model, rows=1, max_tokens=32)
    _prefill(model, tokenizer, cache, [0], [PROMPTS[0]])  # 7 tokens
    inputs = PagedStepInputs(cache, 1, max_tokens=8)  # 2 pages of 4
    assert inputs.tables[None].shape == (1, 2)
    token = torch.zeros(1, dtype=torch.int64, device=_device(model))
    inputs.prepare(token, [0])  # the 8th token fits
    table, free = inputs.tables[None].clone(), cache.free_pages
    with pytest.raises(ValueError) as e:
        inputs.prepare(token, [0])
    assert str(e.value) == ("row 0 would grow to 9 tokens, past the step's block table "
                            "of 2 pages of 4")
    assert cache.host_lengths == [8] and cache.free_pages == free
    assert torch.equal(inputs.tables[None], table)


def test_too_few_pages_in_prepare_change_nothing(loaded):
    model, tokenizer = loaded
    cache = _cache(model, rows=2, num_pages=3)
    _prefill(model, tokenizer, cache, [0, 1], [PROMPTS[0], "x = ["])  # 2 pages, 1 page
    inputs = PagedStepInputs(cache, 2)
    token = torch.zeros(2, dtype=torch.int64, device=_device(model))
    inputs.prepare(token, [0, 1])  # 8 tokens and 4 (x = [ is 3): no new page
    tables = {w: t.clone() for w, t in inputs.tables.items()}
    lengths = inputs.lengths.clone()
    with pytest.raises(OutOfPages):  # both rows cross a boundary; no page is free
        inputs.prepare(token, [0, 1])
    assert cache.host_lengths == [8, 4]
    assert torch.equal(inputs.lengths, lengths)
    assert all(torch.equal(inputs.tables[w], t) for w, t in tables.items())


def test_bad_inputs_are_one_line_errors(loaded):
    model, _ = loaded
    device = _device(model)
    plain = PagedKVCache(model.config, 2, 64, model.dtype, device, page_size=16)
    with pytest.raises(ValueError, match="made with scratch_page=True"):
        PagedStepInputs(plain, 2)
    cache = _cache(model, rows=2, max_tokens=64)
    for kw, message in (({"batch_size": 0}, "batch_size must be a positive integer"),
                        ({"batch_size": 2, "max_tokens": 65}, r"max_tokens must lie in \[1, 64\]")):
        with pytest.raises(ValueError, match=message):
            PagedStepInputs(cache, **kw)
    inputs = PagedStepInputs(cache, 2)
    two = torch.zeros(2, dtype=torch.int64, device=device)
    for rows, tokens, message in (
            ([0, 1, None], torch.zeros(3, dtype=torch.int64, device=device),
             "3 rows do not fit a step of 2 rows"),
            ([1, 1], two, "are not distinct rows of a cache of 2"),
            ([0, 2], two, "are not distinct rows of a cache of 2"),
            ([0], two, r"tokens must be of shape \(1,\)")):
        with pytest.raises(ValueError, match=message) as e:
            inputs.prepare(tokens, rows)
        assert "\n" not in str(e.value)
    assert cache.host_lengths == [0, 0]
    with pytest.raises(TypeError, match="GraphedPagedDecode"):
        GraphedDecode(model, cache, 2)


def test_graphs_on_pages_need_cuda(loaded):
    model, tokenizer = loaded
    if _device(model).type == "cuda":
        pytest.skip("the refusal is the CPU's")
    with pytest.raises(RequestError, match="cuda_graph needs the model on a CUDA device"):
        next(generate(model, tokenizer, [SHORT], max_tokens=4, kv_page_size=16,
                      cuda_graph=True))


def _run(model, tokenizer, **kw):
    """(tokens of each step, their log-probabilities [steps, B, V]) of a greedy generate."""
    events = list(generate(model, tokenizer, [LONG, SHORT], max_tokens=16, logprobs=True,
                           **kw))
    assert isinstance(events[-1], Summary)
    steps = events[:-1]
    return [s.tokens for s in steps], torch.stack([s.logprobs for s in steps])


@pytest.mark.gpu
@pytest.mark.parametrize("kv_bits", [0, 4])
def test_generate_on_pages_replays_the_eager_steps_from_graphs(loaded, kv_bits):
    model, tokenizer = loaded
    assert _device(model).type == "cuda"
    eager, eager_lp = _run(model, tokenizer, kv_bits=kv_bits, kv_page_size=16,
                           cuda_graph=False)
    graphed, graphed_lp = _run(model, tokenizer, kv_bits=kv_bits, kv_page_size=16,
                               cuda_graph=True)
    slotted, _ = _run(model, tokenizer, kv_bits=kv_bits, cuda_graph=True)
    assert len(eager) == 16 and graphed == eager
    assert torch.equal(graphed_lp, eager_lp)  # the same kernels over the same inputs
    assert graphed == slotted


@pytest.mark.gpu
def test_generate_on_pages_takes_graphs_on_cuda(loaded, monkeypatch):
    """Asked for, one paged graph; by default on CUDA one too (the paged graph served the
    committed benchmark's paged loads, bench/results/serve_prefix.json); refused, none."""
    from qfuse.runtime import generation

    model, tokenizer = loaded
    made = []
    real = generation.GraphedPagedDecode
    monkeypatch.setattr(generation, "GraphedPagedDecode",
                        lambda *a: made.append(a) or real(*a))
    tokens, _ = _run(model, tokenizer, kv_page_size=16, cuda_graph=True)
    assert len(made) == 1 and len(tokens) == 16
    tokens, _ = _run(model, tokenizer, kv_page_size=16)
    assert len(made) == 2 and len(tokens) == 16
    tokens, _ = _run(model, tokenizer, kv_page_size=16, cuda_graph=False)
    assert len(made) == 2 and len(tokens) == 16
