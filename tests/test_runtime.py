"""Runtime on CPU (compat tier): quantize → load, generation, sampling, errors. On the
GPU (marked `gpu`), a tiny random Gemma 3: fast tier against compat, the CUDA-graph
decode step against eager decode, and a 4-bit model against its CPU logits."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from qfuse import levers
from qfuse.cache import KVCache
from qfuse.convert import quantize_checkpoint, quantize_model
from qfuse.generation import GraphedDecode, SamplingParams, Summary, generate, sample
from qfuse.loading import load_model, load_tokenizer
from qfuse.models import Decoder
from qfuse.quant import QuantizedTensor

VOCAB = 300
TEXT = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n"] * 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=96, eos_token_id=0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    return path


def test_quantized_checkpoint_loads_and_matches_dequantized(checkpoint, tmp_path):
    overrides = {"model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 32},
                 "model.layers.1.self_attn.o_proj": False}
    dst = quantize_checkpoint(checkpoint, tmp_path / "q4", bits=4, group_size=64,
                              overrides=overrides)
    block = json.loads((dst / "config.json").read_text())["quantization"]
    assert block["bits"] == 4 and block["model.layers.1.self_attn.o_proj"] is False
    q = load_model(dst)
    down = q.model.layers[0].mlp.down_proj
    assert (down.bits, down.group_size) == (8, 32)
    assert q.model.layers[1].self_attn.o_proj.bits == 0
    # The same model with every quantized weight dequantized into dense storage.
    dense = Decoder(q.config)
    state = {}
    for name, module in q.named_modules():
        if getattr(module, "bits", 0):
            state[f"{name}.weight"] = module.quantized().dequantize(torch.float32)
    for name, t in q.state_dict().items():
        base = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) or f"{base}.weight" in state:
            continue
        state[name] = t
    dense.load_state_dict(state)
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        assert torch.equal(q(ids), dense(ids))


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


def test_bad_checkpoints_name_the_problem(checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match="lacks"):
        load_model(bad)
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_model(bad)
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match="NaN"):
        load_model(bad, check_finite=True)
    cfg = json.loads((checkpoint / "config.json").read_text())
    for field, value, match in (("model_type", "gpt2", "model_type"),
                                ("num_key_value_heads", 3, "multiple"),
                                ("hidden_size", None, "hidden_size")):
        broken = dict(cfg)
        if value is None:
            del broken[field]
        else:
            broken[field] = value
        (bad / "config.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=match):
            load_model(bad)
    assert QuantizedTensor  # imported for the reader: quantized loading is tested above


def test_cli_quantize_and_generate(checkpoint, tmp_path, capsys):
    from qfuse.cli import main

    dst = tmp_path / "cli-q"
    assert main(["quantize", str(checkpoint), str(dst), "--bits", "8", "--group-size", "32",
                 "--override", "model.layers.0.mlp.down_proj=4:64",
                 "--override", "lm_head=dense"]) == 0
    block = json.loads((dst / "config.json").read_text())["quantization"]
    assert block["model.layers.0.mlp.down_proj"] == {"bits": 4, "group_size": 64}
    assert block["lm_head"] is False
    assert main(["generate", str(dst), "def add", "--max-tokens", "4"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[1].startswith("def add") and "tok/s" in out.err


def test_gate_mechanics(checkpoint, tmp_path):
    from qfuse import gates

    model, tok = load_model(checkpoint), load_tokenizer(checkpoint)
    golden = gates.make_golden(model, tok, prompts=["def add(a, b):"], n_tokens=12)
    path = tmp_path / "golden.json"
    gates.save_golden(golden, path)
    golden = gates.load_golden(path)
    same = gates.run_gate(model, golden, "compat")
    assert same[0].bitwise_equal and same[0].agreement == 12 and same[0].max_kl == 0.0
    assert same[0].compat_matches_golden == 12  # the golden is compat's own trajectory
    assert gates.passes(same, "exact") and gates.passes(same, "fast")
    # ...but compat against compat ran no fused kernel, so it proves nothing.
    assert same[0].kernels == {} and gates.verdict(same, "fast") == "NOT TESTED"
    assert "NOT TESTED" in gates.verdict_line(same, "fast", "cpu")
    assert "12/12" in gates.report(same).splitlines()[2]  # compat reproduces all golden tokens
    # The exact tier under the CPU interpreter uses portable math, so it is close
    # but not bitwise; the gate must say so rather than pass it.
    exact = gates.run_gate(model, golden, "exact")
    assert exact[0].mean_kl < 1e-6
    assert "agree" in gates.report(exact)


def test_sharded_checkpoint_loads(tmp_path):
    torch.manual_seed(1)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = load_model(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    missing_shard = next(iter(set(index["weight_map"].values())))
    (tmp_path / missing_shard).unlink()
    with pytest.raises(ValueError, match="missing"):
        load_model(tmp_path)


def test_pickle_only_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 32}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path)


def test_chat_template_renders(tmp_path):
    from qfuse.loading import load_chat_template, render_chat

    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": {"content": "<s>"}}))
    messages = [{"role": "user", "content": "hi"}]
    got = render_chat(load_chat_template(tmp_path), messages, {"bos_token": "<s>"})
    assert got == "<s><|user|>hi<|end|><|assistant|>"
    bad = "{{ raise_exception('no system role') }}"
    with pytest.raises(ValueError, match="no system role"):
        render_chat(bad, messages)


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


def test_quantization_cost_figures(checkpoint):
    from qfuse import gates

    model, tok = load_model(checkpoint), load_tokenizer(checkpoint)
    golden = gates.make_golden(model, tok, prompts=["def add(a, b):"], n_tokens=8)
    rows = gates.quantization_cost(model, golden, bits=4, group_size=32, kv_bits=(8, 4),
                                   kv_group_size=32)
    by = {r["config"]: r for r in rows}
    assert set(by) == {"4-bit weights, dense KV", "dense weights, 8-bit KV",
                       "dense weights, 4-bit KV", "4-bit weights, 8-bit KV",
                       "4-bit weights, 4-bit KV"}
    # 8-bit KV loses less than 4-bit KV; everything is finite and nonnegative
    # (KL is computed in float64, whose rounding stays far below 1e-12 here.)
    assert -1e-12 <= by["dense weights, 8-bit KV"]["mean_kl"] <= by["dense weights, 4-bit KV"]["mean_kl"]
    assert all(0 <= r["top1_agreement"] <= 1 for r in rows)


def test_quantize_model_matches_quantize_checkpoint(checkpoint, tmp_path):
    dense = load_model(checkpoint)
    on_disk = load_model(quantize_checkpoint(checkpoint, tmp_path / "q", bits=4, group_size=64))
    in_memory = quantize_model(dense, 4, 64)
    ids = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        assert torch.equal(in_memory(ids), on_disk(ids))


def test_cli_gate(checkpoint, tmp_path, capsys):
    import shutil

    from qfuse.cli import main

    model_dir = tmp_path / "m"
    shutil.copytree(checkpoint, model_dir)
    # No golden file and no --make-golden: an error, and nothing written behind the user's back.
    assert main(["gate", str(model_dir), "--tier", "exact"]) == 2
    assert "--make-golden" in capsys.readouterr().err
    assert not (model_dir / "golden.json").exists()
    code = main(["gate", str(model_dir), "--tier", "exact", "--tokens", "6", "--make-golden",
                 "--quantization-cost", "--json", str(tmp_path / "gate.json")])
    out = capsys.readouterr().out
    assert (model_dir / "golden.json").exists() and "quantization cost" in out
    report = json.loads((tmp_path / "gate.json").read_text())
    # Under the Triton interpreter the exact tier's kernels do run on the CPU.
    assert report["kernels_run"] and report["verdict"] in ("PASS", "FAIL")
    assert report["pass"] == (code == 0) and len(report["quantization_cost"]) == 5
    assert report["rows"][0]["compat_matches_golden"] == 6
    # The golden file now exists: a second run reads it and rewrites nothing.
    mtime = (model_dir / "golden.json").stat().st_mtime_ns
    main(["gate", str(model_dir), "--tier", "exact"])
    assert (model_dir / "golden.json").stat().st_mtime_ns == mtime
    assert "wrote golden" not in capsys.readouterr().out


def test_cli_gate_where_no_kernel_runs_says_so(checkpoint, tmp_path, capsys, monkeypatch):
    import shutil

    from qfuse.cli import main

    # Without the interpreter a CPU runs no Triton kernel: the fast tier is all reference.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model_dir = tmp_path / "m"
    shutil.copytree(checkpoint, model_dir)
    code = main(["gate", str(model_dir), "--tokens", "6", "--make-golden",
                 "--json", str(tmp_path / "gate.json")])
    out = capsys.readouterr().out
    assert code == 3
    assert "fast tier: NOT TESTED" in out and "no fused kernel ran on cpu" in out
    assert "PASS" not in out
    report = json.loads((tmp_path / "gate.json").read_text())
    assert report["verdict"] == "NOT TESTED" and not report["pass"] and report["kernels_run"] == {}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=16,
        query_pre_attn_scalar=64, max_position_embeddings=256)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float()
    path = tmp_path_factory.mktemp("gemma")
    hf.save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.gpu
@pytest.mark.parametrize("kv_bits", [0, 4, 8])
def test_graph_decode_equals_eager(gemma, kv_bits, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    model = load_model(gemma, dtype=torch.bfloat16, device="cuda")
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
def test_fast_tier_close_to_compat(gemma, monkeypatch):
    model = load_model(gemma, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 512, (1, 30), device="cuda")
    res = {}
    for tier in ("compat", "fast"):
        monkeypatch.setenv("QFUSE_TIER", tier)
        cache = KVCache(model.config, 1, 48, torch.bfloat16, "cuda", 4)
        with torch.no_grad():
            model(ids, cache=cache)
            res[tier] = torch.stack([model.decode(ids[:, i], cache) for i in range(8)]).float()
    p = torch.log_softmax(res["compat"], -1)
    kl = (p.exp() * (p - torch.log_softmax(res["fast"], -1))).sum(-1)
    assert kl.mean().item() <= 1e-3  # the fast-tier gate target


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["compat", "fast"])
def test_quantized_model_runs_on_cuda(gemma, tier, monkeypatch):
    """A 4-bit model (quantized embedding included: CUDA cannot gather uint32) on the
    GPU gives the logits it gives on the CPU, to bf16 accuracy."""
    monkeypatch.setenv("QFUSE_TIER", tier)
    ids = torch.randint(0, 512, (1, 20))
    with torch.no_grad():
        cpu = quantize_model(load_model(gemma), 4, 64)(ids)
        gpu = quantize_model(load_model(gemma, dtype=torch.bfloat16, device="cuda"), 4, 64)(
            ids.cuda()).float().cpu()
    assert torch.isfinite(gpu).all()
    p = torch.log_softmax(cpu, -1)
    kl = (p.exp() * (p - torch.log_softmax(gpu, -1))).sum(-1)
    assert kl.mean().item() <= 1e-2  # bf16 end to end against float32
