"""`qfuse bench e2e`: decode tokens/s of real-sized models against the memory roofline.

Models are the Gemma 3 12B text and Llama 3 8B shapes with random weights
created directly on the GPU in the target format (no checkpoint is needed: the
decode step's speed does not depend on the values). For every configuration —
weights bf16 or 4-bit g64, KV cache bf16/8-bit/4-bit, context 1k/8k/32k, batch
1/8, tier compat/fast — the cache is filled with random contents up to the
context (prefill is not what is measured), then decode steps are timed after
warm-up (the fast tier replays a CUDA graph). Reported: tokens/s, ms per
token, peak memory, the bytes one step must read (every weight once plus the
KV actually attended: sliding-window layers see at most their window), the
achieved GB/s, and the share of the roofline (those bytes over the copy
bandwidth measured in the same run).

Baselines: Hugging Face transformers `generate` in bf16 on the Gemma 3 12B shape
at 8k context, batch 1 (random weights too), in three modes: its static cache, its
default dynamic cache, and the static cache compiled with torch.compile (its
fastest, and the slowest to start: it runs last, after the results are written);
decode time per token is the difference between generating 33 and 1 tokens, over 32.

`--quick` runs the configurations the headline figures name (Gemma 3 12B shape,
batch 1, bf16 or 4-bit weights, bf16 or 4-bit KV, 8k and 32k, fast and
compat; 4-bit weights and KV at batch 8 and 32; the Llama 3 8B shape at 8k)
instead of the whole grid. The figures include the weight products' share of copy
inside the step, from the profile (their kernels' summed time over the weights'
bytes). The model construction and byte counting
are tested on CPU (tests/test_bench_e2e.py).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

from .. import levers
from ..models import Decoder, ModelConfig
from ..models.decoder import Linear
from ..quant import QuantizedTensor
from ..runtime.cache import KVCache
from . import common

GEMMA3_12B = {
    "model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
    "vocab_size": 262144, "sliding_window": 1024, "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256, "max_position_embeddings": 131072,
}
LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
}
MODELS = {"gemma3-12b": GEMMA3_12B, "llama3-8b": LLAMA3_8B}
GROUP = 64


@contextmanager
def _default(device, dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def random_model(raw_config: dict, weight_bits: int, device, dtype=torch.bfloat16) -> Decoder:
    """A Decoder of this shape whose Linears (and embedding) are dense or MLX-quantized
    with random contents, allocated directly on ``device``."""
    raw = dict(raw_config)
    if weight_bits:
        raw["quantization"] = {"group_size": GROUP, "bits": weight_bits}
    cfg = ModelConfig.from_dict(raw)
    spec = (lambda path: (GROUP, weight_bits)) if weight_bits else (lambda path: (0, 0))
    with _default(device, dtype), torch.no_grad():
        model = Decoder(cfg, spec)
        for module in model.modules():
            if isinstance(module, Linear):
                if module.bits:
                    unit = module.n_in ** -0.5 / 8
                    common.fill_random_quantized_(module.quantized(), 0.5 * unit, 1.5 * unit)
                else:
                    module.weight.normal_(0, module.n_in ** -0.5)
        model.hold_kernel_forms()  # as `loading.load_model` does: each weight held once
    return model.eval()


def resident_bytes(model: Decoder) -> int:
    """Bytes of the model's own tensors (parameters, buffers, held fragment weights), each
    storage once (the parts of a stacked weight are views of it)."""
    storages = {}
    tensors = list(model.parameters()) + list(model.buffers())
    for m in model.modules():
        if isinstance(m, Linear) and m.held is not None:
            f = m.held.parent or m.held
            tensors += [f.words, f.scales, f.biases]
    for t in tensors:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def fill_cache(cache: KVCache, context: int) -> None:
    """Random cache contents for `context` tokens per sequence, as if prefilled."""
    with torch.no_grad():
        for layer in cache.layers:
            for t in (layer.k, layer.v):
                if isinstance(t, QuantizedTensor):
                    common.fill_random_quantized_(t, 0.01, 0.05)
                else:
                    t.normal_()
    cache.lengths.fill_(context)
    cache.host_lengths = [context] * len(cache.host_lengths)


def step_bytes(model: Decoder, cache: KVCache, context: int) -> int:
    """Bytes one decode step must read: every weight once (the embedding: one row per
    sequence, ignored) plus the K/V each layer attends to."""
    total = sum(m.effective_weight().nbytes for name, m in model.named_modules()
                if isinstance(m, Linear) and name != "model.embed_tokens")
    if model.config.tie_word_embeddings:  # the embedding doubles as the head
        total += model.model.embed_tokens.effective_weight().nbytes
    B = cache.lengths.numel()
    for layer in cache.layers:
        attended = min(context, layer.capacity)
        per_token = layer.nbytes // (B * layer.capacity)  # K and V, one token, one sequence
        total += B * attended * per_token
    return total


def time_decode(model: Decoder, cache: KVCache, steps: int, graph: bool) -> float:
    """Milliseconds per decode step (the cache grows by `steps` tokens)."""
    from ..runtime.slotted_graphs import GraphedDecode

    B = cache.lengths.numel()
    tokens = torch.zeros(B, dtype=torch.int64, device=cache.lengths.device)
    with torch.no_grad():
        step = GraphedDecode(model, cache, B) if graph else (lambda t: model.decode(t, cache))
        step(tokens)  # warm-up
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step(tokens)
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / steps


def filled_cache(model, B: int, kv_bits: int, context: int, steps: int) -> KVCache:
    """A cache holding ``context`` random tokens per sequence, room for ``steps`` more."""
    cache = KVCache(model.config, B, context + steps + 2, torch.bfloat16, "cuda", kv_bits, GROUP)
    fill_cache(cache, context)
    return cache


def run_config(model, name, weight_bits, kv_bits, context, B, tier, copy_gbs, steps) -> dict:
    """One configuration's row; ``tier`` compat or fast."""
    row = {"model": name, "weights": f"{weight_bits}-bit" if weight_bits else "bf16",
           "kv": f"{kv_bits}-bit" if kv_bits else "bf16", "context": context, "batch": B,
           "tier": tier}
    try:
        with levers.use_tier(tier):
            cache = filled_cache(model, B, kv_bits, context, steps)
            torch.cuda.reset_peak_memory_stats()
            ms = time_decode(model, cache, steps, graph=tier == "fast")
            nbytes = step_bytes(model, cache, context)
            # What stays allocated after the steps (model, cache, the graph's buffers),
            # against what must: the model's tensors and the cache.
            needed = resident_bytes(model) + cache.nbytes
            resident = torch.cuda.memory_allocated()
        row.update(tokens_per_s=B * 1000 / ms, ms_per_token=ms,
                   peak_memory_GB=torch.cuda.max_memory_allocated() / 1e9,
                   resident_GB=resident / 1e9, model_and_cache_GB=needed / 1e9,
                   resident_vs_model_and_cache=resident / needed, step_bytes=nbytes,
                   GBps=nbytes / (ms * 1e-3) / 1e9, roofline_share=nbytes / (ms * 1e-3) / 1e9 / copy_gbs)
        del cache
    except Exception as exc:  # noqa: BLE001 -- a configuration that cannot run is reported
        row["not_run"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    finally:
        torch.cuda.empty_cache()
    return row


HEADLINE = ("gemma3-12b", 4, 4, 8192, 1, "fast")  # the configuration `figures` centres on


def profile_step(model, kv_bits: int, context: int, steps: int = 3) -> dict:
    """Per-kernel GPU time of one decode step (eager, so each kernel shows; CUDA graphs
    replay the same kernels without the launch gaps): the breakdown behind a figure."""
    try:
        with levers.use_tier("fast"), torch.no_grad():
            cache = filled_cache(model, 1, kv_bits, context, steps)
            tokens = torch.zeros(1, dtype=torch.int64, device="cuda")
            model.decode(tokens, cache)  # warm-up
            profile = common.gpu_profile(lambda: model.decode(tokens, cache), steps, top=15)
            profile["weight_bytes"] = step_bytes(model, cache, 0)  # no KV: the weights alone
            return profile
    except Exception as exc:  # noqa: BLE001 -- reported, not hidden
        return {"not_run": f"{type(exc).__name__}: {str(exc)[:200]}"}
    finally:
        torch.cuda.empty_cache()


def configurations(quick: bool):
    """(model name, weight bits, kv bits, context, batch, tier) in model-major order."""
    if quick:
        gemma = [("gemma3-12b", wb, kb, ctx, 1, tier) for wb in (0, 4) for kb in (0, 4)
                 for ctx in (8192, 32768) for tier in ("fast", "compat")
                 if tier == "fast" or (wb, kb) in ((4, 4), (0, 0))]
        batches = [("gemma3-12b", 4, 4, 8192, B, "fast") for B in (8, 32)]
        llama = [("llama3-8b", wb, kb, 8192, 1, "fast") for wb, kb in ((0, 0), (4, 0), (4, 4))]
        return gemma + batches + llama
    return [(name, wb, kb, ctx, B, tier) for name in MODELS for wb in (0, 4) for kb in (0, 8, 4)
            for ctx in (1024, 8192, 32768) for B in (1, 8) for tier in ("fast", "compat")]


HF_MODES = {"static": ("static", True), "dynamic": (None, True),
            "static+compile": ("static", False)}  # cache_implementation, disable_compile


def transformers_baseline(raw_config: dict, context: int, steps: int = 32,
                          mode: str = "static") -> dict:
    """ms per decode token of HF transformers `generate` (bf16, greedy) in ``mode``
    (HF_MODES: its static cache, its dynamic cache, or the static cache compiled)."""
    cache_implementation, disable_compile = HF_MODES[mode]
    try:
        import transformers
    except ImportError as exc:
        return {"not_run": f"transformers is not installed ({exc})"}
    try:
        cfg = transformers.AutoConfig.for_model(**raw_config)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.eval()
        ids = torch.randint(0, cfg.vocab_size, (1, context), device="cuda")

        def seconds(n: int, model=model) -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                # With a static cache generate compiles the model unless told not to
                # (minutes: it once ran out our time), so only that mode compiles.
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               cache_implementation=cache_implementation,
                               disable_compile=disable_compile)
            torch.cuda.synchronize()
            return time.perf_counter() - t

        # Warm-up at both lengths timed below: a compiled static cache recompiles for a
        # new length, which must not fall inside the timing.
        seconds(1), seconds(steps + 1)
        ms = (seconds(steps + 1) - seconds(1)) / steps * 1e3
        del model
        torch.cuda.empty_cache()
        return {"mode": mode, "ms_per_token": ms, "tokens_per_s": 1e3 / ms,
                "transformers": transformers.__version__}
    except Exception as exc:  # noqa: BLE001 -- reported, not hidden
        torch.cuda.empty_cache()
        return {"mode": mode, "not_run": f"{type(exc).__name__}: {str(exc)[:200]}"}


PRODUCT_KERNELS = ("_qmm_mma_kernel", "_qmm_ring_kernel", "_qmm_wgmma_kernel",
                   "_qmm_wgmma_ws_kernel", "_qgemv_kernel",
                   "_gate_up_act_gemv_kernel", "_qmm_tc_kernel", "_gate_up_act_kernel")


def product_share(profile: dict | None, copy_gbs: float) -> float | None:
    """The weight products' share of copy inside the profiled step: the weights' bytes
    over the summed time of the product kernels (None without a profile)."""
    if not profile or "weight_bytes" not in profile:
        return None
    ms = sum(k["ms_per_step"] for k in profile.get("top_kernels", [])
             if k["name"] in PRODUCT_KERNELS)
    return profile["weight_bytes"] / (ms * 1e-3) / 1e9 / copy_gbs if ms else None


def figures(rows: list[dict], hf: dict, profile: dict | None = None,
            copy_gbs: float | None = None) -> dict:
    """The headline figures from the rows, each key naming its target (None where a
    configuration did not run)."""
    def tps(weights, kv, ctx, tier, B=1, model="gemma3-12b"):
        for r in rows:
            if (r["model"], r["weights"], r["kv"], r["context"], r["batch"], r["tier"]) == (
                    model, weights, kv, ctx, B, tier) and "tokens_per_s" in r:
                return r
        return None

    def over(a, b):
        return a and b and a["tokens_per_s"] / b["tokens_per_s"]

    head = tps("4-bit", "4-bit", 8192, "fast")
    bf16 = tps("bf16", "bf16", 8192, "fast")
    fast32, compat32 = tps("4-bit", "4-bit", 32768, "fast"), tps("4-bit", "4-bit", 32768, "compat")
    llama = tps("4-bit", "4-bit", 8192, "fast", model="llama3-8b")
    llama_bf16kv = tps("4-bit", "bf16", 8192, "fast", model="llama3-8b")
    llama_bf16 = tps("bf16", "bf16", 8192, "fast", model="llama3-8b")
    b32 = tps("4-bit", "4-bit", 8192, "fast", 32)
    layers = GEMMA3_12B["num_hidden_layers"]
    return {
        "gemma_4bit_kv4_8k_roofline_share (>= 0.70)": head and head["roofline_share"],
        "gemma_4bit_kv4_8k_vs_qfuse_bf16 (>= 2.8)": over(head, bf16),
        "gemma_bf16_8k_roofline_share (>= 0.85)": bf16 and bf16["roofline_share"],
        "gemma_4bit_kv4_8k_vs_transformers_bf16 (>= 5)":
            head and "tokens_per_s" in hf and head["tokens_per_s"] / hf["tokens_per_s"],
        "gemma_4bit_kv4_32k_fast_vs_compat (>= 10)": over(fast32, compat32),
        "weight_products_share_of_copy_in_step (>= 0.85)":
            product_share(profile, copy_gbs) if copy_gbs else None,
        "launches_per_layer_in_step (<= 5)":
            profile["launches_per_step"] / layers if profile and "launches_per_step" in profile
            else None,
        "gemma_4bit_kv4_8k_batch32_step_time_vs_batch1 (<= 2)":
            head and b32 and b32["ms_per_token"] / head["ms_per_token"],
        "gemma_4bit_kv4_8k_resident_vs_model_and_cache (<= 1.1)":
            head and head.get("resident_vs_model_and_cache"),
        "gemma_4bit_kv4_8k_batch8_tokens_per_s_vs_batch1":
            over(tps("4-bit", "4-bit", 8192, "fast", 8), head),
        "gemma_4bit_kv4_8k_batch32_tokens_per_s_vs_batch1":
            over(tps("4-bit", "4-bit", 8192, "fast", 32), head),
        "llama_4bit_kv4_8k_roofline_share (>= 0.70)": llama and llama["roofline_share"],
        "llama_4bit_bf16kv_8k_roofline_share (>= 0.70)":
            llama_bf16kv and llama_bf16kv["roofline_share"],
        "llama_bf16_8k_roofline_share (>= 0.85)": llama_bf16 and llama_bf16["roofline_share"],
    }


def main(out_dir: str = "bench/results", quick: bool = False) -> int:
    meta = common.metadata()
    copy_gbs = common.copy_bandwidth_gbs()
    rows = []
    profile = None
    model, built = None, None
    for name, weight_bits, kv_bits, context, B, tier in configurations(quick):
        if built != (name, weight_bits):
            del model
            torch.cuda.empty_cache()
            model, built = random_model(MODELS[name], weight_bits, "cuda"), (name, weight_bits)
        steps = 3 if tier == "compat" else 20
        rows.append(run_config(model, name, weight_bits, kv_bits, context, B, tier, copy_gbs,
                               steps))
        print(rows[-1], flush=True)
        if (name, weight_bits, kv_bits, context, B, tier) == HEADLINE:
            profile = profile_step(model, kv_bits, context)
            print("decode-step profile:", profile, flush=True)
    del model
    torch.cuda.empty_cache()
    # Written before the baseline, which is the slowest step and the likeliest to run out
    # of time (it once did: generate compiled the model).
    partial = {"meta": meta, "copy_GBps": copy_gbs, "quick": quick, "rows": rows,
               "profile": profile}
    common.write_results(out_dir, "e2e", partial)
    baselines = []
    for mode in HF_MODES:  # the compiled mode last: it is the slowest to start
        baselines.append(transformers_baseline(GEMMA3_12B, 8192, mode=mode))
        print("transformers baseline (gemma3-12b, bf16, 8k, batch 1):", baselines[-1], flush=True)
        # against the fastest mode measured: what an informed user would compare with
        fastest = max((b for b in baselines if "tokens_per_s" in b),
                      key=lambda b: b["tokens_per_s"], default=baselines[0])
        figs = figures(rows, fastest, profile, copy_gbs)
        payload = {"meta": meta, "copy_GBps": copy_gbs, "quick": quick,
                   "note": "random weights created on the GPU in the target format; no checkpoint",
                   "transformers_baseline": {"model": "gemma3-12b", "context": 8192, "batch": 1,
                                             **fastest},
                   "transformers_baselines": baselines,
                   "figures": figs, "profile": partial["profile"], "rows": rows}
        common.write_results(out_dir, "e2e", payload)
    plot(rows, copy_gbs, os.path.join(out_dir, "e2e.png"))
    common.print_table(rows, ["model", "weights", "kv", "context", "batch", "tier", "tokens_per_s",
                              "ms_per_token", "GBps", "roofline_share", "not_run"])
    for k, v in figs.items():
        print(f"{k}: {v if v is None else round(v, 3)}")
    return 0


def plot(rows: list[dict], copy_gbs: float, path: str) -> None:
    """tokens/s against context per configuration (fast tier, batch 1), with the roofline
    (copy bandwidth over the step's bytes) drawn for each."""
    plt = common.pyplot(path)
    if plt is None:
        return

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, name in zip(axes[0], models):
        keys = dict.fromkeys((r["weights"], r["kv"], r["batch"], r["tier"]) for r in rows
                             if r["model"] == name)
        for i, (wts, kv, B, tier) in enumerate(keys):
            pts = sorted((r["context"], r["tokens_per_s"], r["step_bytes"]) for r in rows
                         if r["model"] == name and (r["weights"], r["kv"], r["batch"], r["tier"])
                         == (wts, kv, B, tier) and "tokens_per_s" in r)
            if not pts:
                continue
            color = f"C{i % 10}"
            ctx, tok, nbytes = zip(*pts)
            ax.plot(ctx, tok, marker="o", color=color, ls="-" if tier == "fast" else ":",
                    label=f"{wts} w, {kv} KV, B={B}, {tier}")
            ax.plot(ctx, [B * copy_gbs * 1e9 / b for b in nbytes], color=color, ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{name} (dashed: roofline at the copy bandwidth)", fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
