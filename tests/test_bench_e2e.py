"""The e2e benchmark's model construction and byte counting, on CPU with tiny shapes."""

import pytest
import torch

from qfuse.bench.e2e import fill_cache, random_model, step_bytes
from qfuse.runtime.cache import KVCache

TINY = {"model_type": "gemma3_text", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "vocab_size": 512, "sliding_window": 16, "sliding_window_pattern": 6,
        "max_position_embeddings": 1024}


def test_random_models_run_and_count_bytes():
    for bits in (0, 4):
        model = random_model(TINY, bits, "cpu", dtype=torch.float32)
        assert all(m.bits == bits for m in model.modules() if hasattr(m, "bits"))
        for kv_bits in (0, 8):
            cache = KVCache(model.config, 2, 40, torch.float32, "cpu", kv_bits, 64)
            fill_cache(cache, 32)
            with torch.no_grad():
                logits = model.decode(torch.tensor([1, 2]), cache)
            assert torch.isfinite(logits).all()
            # weights: 6 layers × (q, k, v, o, gate, up, down) + the tied head
            per_layer = 128 * 256 + 2 * 128 * 128 + 256 * 128 + 3 * 128 * 256
            n_weights = 6 * per_layer + 512 * 128
            weight_bytes = n_weights * 4 if bits == 0 else n_weights // 2 + n_weights // 64 * 2 * 4
            # KV: 5 sliding layers see 16 tokens, 1 global layer sees all 32
            token_bytes = 2 * 2 * (64 * 4 if kv_bits == 0 else 64 + 2 * 4)
            kv_bytes = 2 * token_bytes * (5 * 16 + 32)
            assert step_bytes(model, cache, 32) == weight_bytes + kv_bytes


def _rows():
    return [{"model": "gemma3-12b", "weights": w, "kv": k, "context": c, "batch": 1, "tier": t,
             "tokens_per_s": tps, "roofline_share": 0.5, "step_bytes": 8e9}
            for (w, k, c, t, tps) in [("4-bit", "4-bit", 8192, "fast", 100.0),
                                      ("bf16", "bf16", 8192, "fast", 40.0),
                                      ("4-bit", "4-bit", 32768, "fast", 90.0),
                                      ("4-bit", "4-bit", 32768, "compat", 3.0)]]


def test_quick_configurations_cover_the_figures():
    from qfuse.bench.e2e import configurations, figures

    configs = configurations(quick=True)
    assert ("gemma3-12b", 4, 4, 8192, 1, "fast") in configs
    assert ("gemma3-12b", 0, 0, 8192, 1, "fast") in configs
    assert ("gemma3-12b", 4, 4, 32768, 1, "compat") in configs
    assert {("gemma3-12b", 4, 4, 8192, B, "fast") for B in (8, 32)} <= set(configs)
    assert ("llama3-8b", 4, 4, 8192, 1, "fast") in configs
    assert ("llama3-8b", 4, 0, 8192, 1, "fast") in configs
    names = [c[0] for c in configs]  # model-major: each model is built once
    assert names == sorted(names, key=names.index) and len(set(names)) == 2
    assert len(configurations(quick=False)) == 2 * 2 * 3 * 3 * 2 * 2
    rows = _rows() + [{**_rows()[0], "batch": 8, "tokens_per_s": 400.0},
                      {**_rows()[0], "batch": 32, "tokens_per_s": 800.0, "ms_per_token": 30.0}]
    rows[0].update(ms_per_token=10.0, resident_vs_model_and_cache=1.05)
    profile = {"weight_bytes": 4e9, "launches_per_step": 480, "top_kernels": [
        {"name": "_qmm_mma_kernel", "ms_per_step": 1.5}, {"name": "_rms_norm_kernel",
                                                          "ms_per_step": 0.5},
        {"name": "_gate_up_act_gemv_kernel", "ms_per_step": 0.5}]}
    figs = figures(rows, {"tokens_per_s": 10.0}, profile, 4000.0)
    # 4 GB of weights in 2 ms of product kernels: 2000 GB/s, half of copy
    # 480 launches over 48 layers; batch 32's step 3x batch 1's; no Llama rows.
    assert list(figs.values()) == [0.5, 2.5, 0.5, 10.0, 30.0, 0.5, 10.0, 3.0, 1.05, 4.0, 8.0,
                                   None, None, None]
    assert figures(rows, {})["weight_products_share_of_copy_in_step (>= 0.85)"] is None
    assert figures(rows, {})["launches_per_layer_in_step (<= 5)"] is None


def test_e2e_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from qfuse.bench.e2e import plot

    plot(_rows(), 4000.0, str(tmp_path / "e2e.png"))
    assert (tmp_path / "e2e.png").stat().st_size > 1000


def test_mlp_figures_from_rows():
    from qfuse.bench.mlp import figures

    def row(method, M, us, **extra):
        return {"shape": "gemma3-12b", "bits": 4, "M": M, "method": method, "us": us,
                "_wq_bytes": 4000e3 * 20, **extra}

    lin, mlp = "qfuse ops.linear (up proj, as dispatched)", "qfuse ops.mlp (as dispatched)"
    rows = [row(lin, 1, 10.0, share_of_copy=0.7), row("tinygemm int4 (up proj)", 1, 20.0),
            row(lin, 16, 12.5), row(lin, 64, 25.0), row(lin, 2048, 375.0),
            row("bf16 F.linear (up proj)", 16, 50.0), row("bf16 F.linear (up proj)", 64, 50.0),
            row("bf16 F.linear (up proj)", 2048, 300.0),
            row(lin, 128, 40.0), row("bf16 F.linear (up proj)", 128, 48.0),
            row(lin, 256, 80.0), row("bf16 F.linear (up proj)", 256, 80.0),
            row(mlp, 64, 50.0), row("bf16 F.linear MLP", 64, 75.0),
            row(mlp, 256, 200.0), row("bf16 F.linear MLP", 256, 200.0),
            row(mlp, 1, 25.0), row("bf16 F.linear MLP", 1, 100.0)]
    frag = "qfuse fragment kernel (up proj)"
    rows += [row(frag, 32, 60.0), row("qfuse wgmma kernel (up proj)", 32, 24.0)]
    figs = figures(rows, 4000.0)
    assert {k: v for k, v in figs.items() if v is not None} == {
        "up_proj_4bit_1row_share_of_copy": 0.7, "up_proj_4bit_1row_vs_tinygemm (>= 1.6)": 2.0,
        "up_proj_4bit_16rows_vs_bf16 (>= 2.5)": 4.0,
        "up_proj_4bit_32rows_wgmma_vs_fragment": 2.5,
        "up_proj_4bit_64rows_vs_bf16 (>= 1.5)": 2.0, "up_proj_4bit_128rows_vs_bf16 (>= 1.2)": 1.2,
        "up_proj_4bit_256rows_vs_bf16 (>= 1.0)": 1.0, "mlp_4bit_64rows_vs_bf16_mlp": 1.5,
        "mlp_4bit_256rows_vs_bf16_mlp": 1.0, "mlp_4bit_1row_vs_bf16_mlp (>= 3)": 4.0,
        "prefill_2048_rows_vs_bf16_linear": 0.8}
    # rows not measured (16 and 24 side by side) give None, not a made-up figure
    assert figs["up_proj_4bit_16rows_wgmma_vs_fragment"] is None
    rows.pop(0)  # a path that did not run gives None too
    assert list(figures(rows, 4000.0).values())[:2] == [None, None]
