"""Generation: greedy and seeded decoding, stop strings, sampling filters, the context
and cache limits, and a quantized KV cache, on a tiny Llama in the compat tier; edge
cases with a scripted model and tokenizer. On the GPU (marked `gpu`), a tiny random
Gemma 3: the CUDA-graph decode step against eager decode, the fast tier against compat,
and a 4-bit model against its CPU logits."""

import pytest
import torch
from torch import nn

from qfuse import levers
from qfuse.convert import quantize_model
from qfuse.gates import measures
from qfuse.loading import load_model, load_tokenizer
from qfuse.models import ModelConfig
from qfuse.runtime.cache import KVCache
from qfuse.runtime.generation import Summary, generate, peak_memory_gb
from qfuse.runtime.sampling import SamplingParams, sample
from qfuse.runtime.slotted_graphs import GraphedDecode

from .conftest import VOCAB


def test_greedy_generation_is_deterministic_and_batch_consistent(checkpoint):
    model, tok = load_model(checkpoint), load_tokenizer(checkpoint)
    prompts = ["def add(a, b):", "import os\nprint("]

    def run(ps, **kw):
        events = list(generate(model, tok, ps, max_tokens=8, **kw))
        summary = events[-1]
        assert isinstance(summary, Summary)
        return summary

    both = run(prompts)
    assert both.outputs == run(prompts).outputs
    for i, p in enumerate(prompts):  # prompts of different lengths in one batch
        assert run([p]).outputs[0] == both.outputs[i]
    assert both.generation_tokens > 0 and both.prompt_tps > 0


def test_seeded_sampling_repeats(checkpoint):
    model, tok = load_model(checkpoint), load_tokenizer(checkpoint)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01,
                            repetition_penalty=1.1, seed=7)
    out = [list(generate(model, tok, ["def"], max_tokens=10, params=params))[-1].outputs
           for _ in range(2)]
    assert out[0] == out[1]


def test_stop_string_and_max_tokens(checkpoint):
    model, tok = load_model(checkpoint), load_tokenizer(checkpoint)
    max_tokens = 16
    free = list(generate(model, tok, ["def add"], max_tokens=max_tokens))
    ids, text = [e.tokens[0] for e in free[:-1]], free[-1].outputs[0]
    # Without a stop string (and no end-of-sequence token from this model), max_tokens ends it.
    assert free[-1].finish_reasons == ["length"] and free[-1].generation_tokens == max_tokens
    assert len(ids) == max_tokens
    # A stop string whose first occurrence is at a known position p in the middle of the
    # greedy text, and the first token count n after which the engine can see it (it looks
    # only when the decoded text does not end inside a multi-byte character).
    p = next(i for i in range(len(text) // 3, len(text) - 2) if text.find(text[i:i + 2]) == i)
    stop = text[p:p + 2]
    n = next(k for k in range(1, max_tokens + 1)
             if stop in tok.decode(ids[:k]) and not tok.decode(ids[:k]).endswith("\ufffd"))
    assert n < max_tokens
    stopped = list(generate(model, tok, ["def add"], max_tokens=max_tokens, stop=[stop]))
    summary = stopped[-1]
    assert summary.finish_reasons == ["stop"] and summary.outputs == [text[:p]]
    assert summary.generation_tokens == n < max_tokens  # stopped there, not at max_tokens
    assert [e.tokens[0] for e in stopped[:-1]] == ids[:n]
    assert "".join(e.texts[0] for e in stopped[:-1]) == text[:p]  # streamed text, cut too


def test_overflowing_the_context_is_refused_before_compute(checkpoint):
    model, tok = load_model(checkpoint), load_tokenizer(checkpoint)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        next(generate(model, tok, ["def add(a, b):"], max_tokens=96))


def test_sampling_filters():
    logits = torch.tensor([[5.0, 4.0, 1.0, -3.0]])
    g = torch.Generator().manual_seed(0)
    assert sample(logits, SamplingParams(), None, None).item() == 0
    draws = {sample(logits, SamplingParams(temperature=1.0, top_k=2), None, g).item()
             for _ in range(200)}
    assert draws <= {0, 1}
    draws = {sample(logits, SamplingParams(temperature=1.0, top_p=0.5), None, g).item()
             for _ in range(50)}
    assert draws == {0}  # token 0 alone holds ~73% of the mass
    # repetition penalty divides positive logits of seen tokens
    seen = torch.tensor([[True, False, False, False]])
    assert sample(logits, SamplingParams(repetition_penalty=10.0), seen, None).item() == 1
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_quantized_kv_cache_generation_runs(checkpoint):
    model, tok = load_model(checkpoint), load_tokenizer(checkpoint)
    for bits in (4, 8):
        s = list(generate(model, tok, ["def add(a, b):"], max_tokens=4, kv_bits=bits,
                          kv_group_size=32))[-1]
        assert s.generation_tokens >= 1


def test_decoding_past_the_cache_is_refused(checkpoint):

    model = load_model(checkpoint)
    cache = KVCache(model.config, 1, max_tokens=6, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 5)), cache=cache)
        model.decode(torch.tensor([1]), cache)  # the 6th token fits
        with pytest.raises(ValueError, match="full"):
            model.decode(torch.tensor([1]), cache)
        with pytest.raises(ValueError, match="does not fit"):
            model(torch.randint(0, VOCAB, (1, 7)), cache=cache)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_bits", [0, 4, 8])
def test_graph_decode_equals_eager(gemma_checkpoint, kv_bits, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    model = load_model(gemma_checkpoint, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 512, (2, 40), device="cuda")
    lengths = torch.tensor([40, 23], device="cuda")
    outs = []
    for graphed in (False, True):
        cache = KVCache(model.config, 2, 64, torch.bfloat16, "cuda", kv_bits)
        with torch.no_grad():
            model(ids, lengths, cache)
            step = GraphedDecode(model, cache, 2) if graphed else (
                lambda t, c=cache: model.decode(t, c))
            tok = ids[:, 0]
            logits = []
            for _ in range(6):
                out = step(tok)
                logits.append(out.clone())
                tok = out.argmax(-1)
        outs.append(torch.stack(logits))
    assert torch.equal(outs[0], outs[1])
    assert levers.counters().get("decode_attention", 0) > 0


@pytest.mark.gpu
def test_fast_tier_close_to_compat(gemma_checkpoint, monkeypatch):
    model = load_model(gemma_checkpoint, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 512, (1, 30), device="cuda")
    res = {}
    for tier in ("compat", "fast"):
        monkeypatch.setenv("QFUSE_TIER", tier)
        cache = KVCache(model.config, 1, 48, torch.bfloat16, "cuda", 4)
        with torch.no_grad():
            model(ids, cache=cache)
            res[tier] = torch.stack([model.decode(ids[:, i], cache) for i in range(8)]).float()
    kl = measures.kl_divergence(res["compat"], res["fast"])
    assert kl.mean().item() <= 1e-3  # the fast-tier gate target


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["compat", "fast"])
def test_quantized_model_runs_on_cuda(gemma_checkpoint, tier, monkeypatch):
    """A 4-bit model (quantized embedding included: CUDA cannot gather uint32) on the
    GPU gives the logits it gives on the CPU, to bf16 accuracy."""
    monkeypatch.setenv("QFUSE_TIER", tier)
    ids = torch.randint(0, 512, (1, 20))
    with torch.no_grad():
        cpu = quantize_model(load_model(gemma_checkpoint), 4, 64)(ids)
        on_gpu = load_model(gemma_checkpoint, dtype=torch.bfloat16, device="cuda")
        gpu = quantize_model(on_gpu, 4, 64)(ids.cuda()).float().cpu()
    assert torch.isfinite(gpu).all()
    kl = measures.kl_divergence(cpu, gpu)
    assert kl.mean().item() <= 1e-2  # bf16 end to end against float32


V = 16
CFG = ModelConfig.from_dict({"model_type": "llama", "vocab_size": V, "hidden_size": 8,
                             "intermediate_size": 16, "num_hidden_layers": 1,
                             "num_attention_heads": 1, "max_position_embeddings": 64})


class Scripted(nn.Module):
    """Always predicts `logits` (the same row for every sequence)."""

    def __init__(self, logits):
        super().__init__()
        self.config = CFG
        self.model = nn.Module()
        self.model.norm = nn.Module()
        self.model.norm.weight = nn.Parameter(torch.ones(8))
        self.row = torch.tensor(logits, dtype=torch.float32)

    dtype = torch.float32

    def forward(self, ids, lengths, cache, logits="all"):
        if logits == "last":  # each row's last real token, as `Decoder.forward` gives it
            return self.row.expand(ids.shape[0], V).clone()
        return self.row.expand(ids.shape[0], ids.shape[1], V).clone()

    def decode(self, tokens, cache):
        return self.row.expand(tokens.shape[0], V).clone()


class CharTok:
    """Token i <-> chr(ord('a') + i); encode maps each char of the prompt."""

    class _E:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, s):
        return self._E([ord(c) - ord("a") for c in s])

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def _outputs(model, prompts, **kw):
    return next(e for e in generate(model, CharTok(), prompts, **kw)
                if isinstance(e, Summary)).outputs


def test_repetition_penalty_ignores_right_padding():
    """Token 0 ('a') is the argmax; neither prompt contains it. Batched with a longer
    prompt, the short one is right-padded with id 0 and `history = batch` penalises 0."""
    row = [0.0] * V
    row[0], row[5] = 2.0, 1.9
    model = Scripted(row)
    params = SamplingParams(repetition_penalty=1.3)
    alone = _outputs(model, ["bc"], max_tokens=1, params=params)
    batched = _outputs(model, ["bc", "bcdefg"], max_tokens=1, params=params)
    assert alone[0] == "a"
    assert batched[0] == alone[0]


def test_stop_string_is_not_streamed():
    """Streamed Step.texts should add up to the final output, without the stop string."""
    row = [0.0] * V
    row[3] = 5.0  # always 'd'
    model = Scripted(row)
    streamed = ""
    for e in generate(model, CharTok(), ["b"], max_tokens=5, stop=["dd"]):
        if isinstance(e, Summary):
            final = e.outputs[0]
        else:
            streamed += e.texts[0]
    assert final == ""
    assert streamed == final, f"streamed {streamed!r} though the output is {final!r}"


@pytest.mark.parametrize("stats", [{}, {"allocated_bytes": {"all": {"peak": 3_000_000_000,
                                                                  "current": 5}}}])
def test_gpu_peak_memory_is_max_memory_allocated(stats, monkeypatch):
    """The GPU figure (read at every streamed token, from the allocator's nested stats)
    is torch.cuda.max_memory_allocated's: 0 before CUDA starts. CPU CI has no CUDA, so
    the allocator's stats are given."""
    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict",
                        lambda device=None: stats)
    expected = torch.cuda.max_memory_allocated() / 1e9
    assert peak_memory_gb(torch.device("cuda")) == expected == (3.0 if stats else 0.0)
