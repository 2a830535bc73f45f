"""Batch-invariant steps at several batch sizes (`serving.engine.step_buckets`): a
deterministic engine decodes at the buckets where every weight product takes the
row-invariant kernel it takes at max_batch rows (`Decoder.product_kernels`), and at
max_batch alone where there is none (a CPU, dense weights, a model that cannot tell).

CPU: the choice of buckets from what the model answers; the bundled model and a held
4-bit one (the reference multiplies on a CPU) keep max_batch alone; an engine whose
model answers the same kernels for every batch decodes bucketed, slotted and paged, with
each request's tokens those it gets alone. GPU: a held 4-bit model's products keep their
kernels over 1-8 and over 9-32 rows and, on Hopper, take the wgmma kernel over 33-256,
and a deterministic engine over it gives each request its tokens alone while its steps
run at several batch sizes, eagerly and from CUDA graphs.
"""

import pytest
import torch

import qfuse
from qfuse import ops
from qfuse.convert import quantize_model
from qfuse.serving.engine import Engine, bucket_sizes, step_buckets

from .engine_jobs import run_to_end

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n", "for i in range(", "x = ["]


class _Answers:
    """A model stand-in that answers `product_kernels` by a rule over rows."""

    def __init__(self, rule):
        self.product_kernels = rule


def _gpu_classes(rows):  # what a held 4-bit model could answer on Hopper (two weights)
    if rows <= 8:
        return ("fragment", "ring")
    return ("ring", "ring") if rows <= 32 else ("wgmma", "wgmma") if rows <= 256 else None


def test_step_buckets_keep_the_kernel_of_max_batch():
    assert step_buckets(_Answers(_gpu_classes), 8, deterministic=True) == [1, 2, 4, 8]
    # a product that changes kernel between 8 and 9 rows splits the fragment range
    assert step_buckets(_Answers(_gpu_classes), 32, deterministic=True) == [16, 32]
    assert step_buckets(_Answers(lambda rows: ("fragment",) if rows <= 32 else None), 32,
                        deterministic=True) == bucket_sizes(32)
    # 33-256 rows: the wgmma kernel's buckets only, never one the fragment kernel takes
    assert step_buckets(_Answers(_gpu_classes), 256, deterministic=True) == [64, 128, 256]
    assert step_buckets(_Answers(_gpu_classes), 48, deterministic=True) == [48]
    # past the row-invariant kernels, or a model that cannot tell: max_batch alone
    assert step_buckets(_Answers(_gpu_classes), 300, deterministic=True) == [300]
    assert step_buckets(_Answers(lambda rows: None), 8, deterministic=True) == [8]
    assert step_buckets(object(), 8, deterministic=True) == [8]
    # bucketed (the default) whatever the model answers
    assert step_buckets(_Answers(lambda rows: None), 8, deterministic=False) == [1, 2, 4, 8]


def _held_4bit(device):
    """The bundled model quantized to 4-bit g64, bf16 on ``device``, weights held in the
    fragment kernel's order where the fast tier takes them (a GPU)."""
    dense, tokenizer = qfuse.load(device="cpu", progress=False)
    model = quantize_model(dense.to(torch.float32), 4, 64).to(device=device,
                                                              dtype=torch.bfloat16).eval()
    model.hold_kernel_forms()
    return model, tokenizer


def test_on_a_cpu_a_deterministic_engine_keeps_one_fixed_batch():
    model, tokenizer = qfuse.load(device="cpu", progress=False)
    assert model.product_kernels(1) is None  # dense weights: nothing is held
    assert Engine(model, tokenizer, max_batch=4, deterministic=True).buckets == [4]
    held, _ = _held_4bit("cpu")
    held.hold_kernel_forms(always=True)  # held, yet the reference multiplies on a CPU
    x = torch.empty(1, held.config.hidden_size, dtype=torch.bfloat16)
    w = held.model.layers[0].mlp.down_proj.held
    assert w is not None and ops.fragment_route(x, w) == "reference"
    assert held.product_kernels(1) is None
    assert Engine(held, tokenizer, max_batch=4, deterministic=True).buckets == [4]


class _RowInvariant:
    """The bundled model, declared row-invariant at every batch size (on a CPU its
    float32 products over these few rows are, as the bucketed engine's tests find), so
    that the deterministic engine's bucketed steps run here."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kw):
        return self._model(*args, **kw)

    def product_kernels(self, rows):
        return ("fragment",)


@pytest.mark.parametrize("paged", [False, True], ids=["slotted", "paged"])
def test_a_deterministic_engine_with_a_row_invariant_model_decodes_bucketed(paged):
    model, tokenizer = qfuse.load(device="cpu", progress=False)
    wrapped = _RowInvariant(model)
    kw = {"max_batch": 4, "deterministic": True, "kv_bits": 4, "kv_group_size": 32,
          **({"kv_page_size": 16} if paged else {})}
    jobs = [(p, m, {}) for p, m in zip(PROMPTS, (12, 8, 4))]
    alone = [run_to_end(Engine(wrapped, tokenizer, **kw), tokenizer, [job]).tokens[0]
             for job in jobs]
    engine = Engine(wrapped, tokenizer, **kw)
    assert engine.buckets == [1, 2, 4]
    together = run_to_end(engine, tokenizer, jobs).tokens
    assert together == alone and [len(t) for t in together] == [12, 8, 4]
    # three busy rows: a bucket of 4, then 2, then 1 as the shorter requests end
    assert {b for b, n in engine.steps_by_batch.items() if n} == {1, 2, 4}
    assert engine.stats()["buckets"] == [1, 2, 4]


@pytest.mark.gpu
def test_gpu_held_4bit_products_are_row_invariant_by_range():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, _ = _held_4bit("cuda")
    kernels = model.product_kernels
    # each weight keeps its kernel (the fragment kernel or the ring) within 1-8 and 9-32
    assert kernels(1) is not None and set(kernels(1)) <= {"fragment", "ring"}
    assert kernels(1) == kernels(2) == kernels(8) and kernels(9) == kernels(17) == kernels(32)
    hopper = torch.cuda.get_device_capability()[0] == 9
    for r in (33, 64, 200, 256):
        assert kernels(r) == ((("wgmma",) * len(kernels(1))) if hopper else None)
    assert kernels(257) is None  # prefill rows: cuBLAS
    assert step_buckets(model, 8, deterministic=True) == [1, 2, 4, 8]
    assert step_buckets(model, 256, deterministic=True) == ([64, 128, 256] if hopper else [256])


@pytest.mark.gpu
@pytest.mark.parametrize("max_batch, company", [(8, 7), (128, 70)], ids=["fragment", "wgmma"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graphs"])
def test_gpu_deterministic_buckets_give_each_request_its_tokens_alone(max_batch, company,
                                                                      graph):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if max_batch > 32 and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("33-256 rows are row-invariant on Hopper's wgmma kernel")
    model, tokenizer = _held_4bit("cuda")
    # max_queue: every job waits at once (70 > the default 64 gave QueueFull on the GPU)
    kw = {"max_batch": max_batch, "deterministic": True, "kv_bits": 4, "kv_group_size": 64,
          "context": 128, "cuda_graph": graph, "max_queue": company}
    # requests of several lengths, the longest in the lowest slots, so that the highest
    # busy slot falls and the steps run through several buckets (with the longest at the
    # top every step ran the largest one: stop 41's H200 run)
    jobs = [(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)),
             4 + (company - 1 - i) % 13, {}) for i in range(company)]
    engine = Engine(model, tokenizer, **kw)
    assert len(engine.buckets) > 1
    together = run_to_end(engine, tokenizer, jobs, timeout=300).tokens
    assert sum(1 for n in engine.steps_by_batch.values() if n) > 1
    for i in (0, 1, company // 2, company - 1):  # a few of them alone, at the smallest bucket
        alone = Engine(model, tokenizer, **kw)
        assert run_to_end(alone, tokenizer, [jobs[i]], timeout=300).tokens[0] == together[i]
