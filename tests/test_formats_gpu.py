"""Every read checkpoint format through the fast tier on a GPU (bfloat16): AWQ (g64, g128),
GPTQ (g64; act-order on every projection, its orders shared by the projections of one
input or each its own: the gathered inputs of `Linear.input_perm`), compressed-tensors
(asymmetric, symmetric), a GGUF file holding Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K
(held dense) tensors, and the bundled Gemma 3 written as GGUF Q8_0 and Q4_0
(`formats.gguf_writer`). Each small checkpoint (`format_checkpoints`) loads on CUDA in
bfloat16; on that model and device the fast tier's greedy tokens over a short generation
must be compat's, and its logits within the fast-tier gate target, mean KL(compat ‖ fast)
≤ 1e-3 (as tests/test_generation.py's `test_fast_tier_close_to_compat`), with a quantized
product kernel among the kernels that ran.

Greedy tokens can be compared only where the model has no near-tie: on these random
models a top-2 gap of a few hundredths of a logit is common, and bf16's own rounding moves
logits by as much. So the prompt is the first of `CANDIDATES` seeded ones along whose
oracle trajectory (`qfuse.oracle`: the same quantized model in float32) every top-2 gap
is at least `MARGIN` times compat's largest logit error from the oracle, measured on the
same model and device: for fast and compat to part, fast's error would have to be twice
compat's on both tokens at once, in opposite directions (measured on the CPU, bf16
compat against float32: 6–27 of 40 prompts qualify per model). Every case is marked `gpu`
(skipped without CUDA); the GGUF cases write their files with the `gguf` package (skipped
without it).
"""

from __future__ import annotations

import pytest
import torch

from qfuse import levers
from qfuse.gates import measures
from qfuse.loading import load_model
from qfuse.oracle import decode_along, oracle_model, oracle_trajectory

from .format_checkpoints import ALL_PROJECTIONS, CONFIG, LLAMA, write_gguf, write_random

N_TOKENS = 6  # the prefill's token, then five decode steps
PROMPT_TOKENS = 12
CANDIDATES = 64
MARGIN = 6
KL_LIMIT = 1e-3  # the fast-tier gate target, as test_generation.py's fast-against-compat case
PRODUCT_KERNELS = {"qmatmul", "qmatmul_mma", "qmatmul_ring", "qmatmul_wgmma", "fused_mlp",
                   "fused_steps"}

# case → (format, `write_random` arguments)
CASES = {
    "awq-g64": ("awq", {}),
    "awq-g128": ("awq", {"group": 128}),
    "gptq-g64": ("gptq", {}),
    "gptq-act-order": ("gptq", {"act_order": ALL_PROJECTIONS}),
    "gptq-act-order-apart": ("gptq", {"act_order": ALL_PROJECTIONS, "shared": False}),
    "compressed-tensors-asymmetric": ("ct", {}),
    "compressed-tensors-symmetric": ("ct", {"symmetric": True}),
}


def clear_prompt(model, vocab: int) -> list[int]:
    """The first seeded prompt whose oracle trajectory has no near-tie for compat's
    rounding to flip (module docstring)."""
    oracle = oracle_model(model)
    worst = 0.0
    for seed in range(CANDIDATES):
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(3, vocab, (PROMPT_TOKENS,), generator=gen).tolist()
        tokens, logits, _ = oracle_trajectory(oracle, prompt, N_TOKENS)
        with levers.use_tier("compat"):
            compat, _ = measures.teacher_forced(model, prompt, tokens)
        err = float((compat - logits).abs().max())
        top2 = logits.topk(2, -1).values
        ratio = float((top2[:, 0] - top2[:, 1]).min()) / max(err, 1e-30)
        if ratio >= MARGIN:
            return prompt
        worst = max(worst, ratio)
    pytest.fail(f"none of {CANDIDATES} prompts has top-2 gaps of {MARGIN}× compat's error "
                f"(best {worst:.1f}×)")


def assert_fast_says_what_compat_says(model, vocab: int) -> None:
    prompt = clear_prompt(model, vocab)
    with levers.use_tier("compat"):
        compat_tokens, compat_logits, _ = decode_along(model, prompt, N_TOKENS)
    before = levers.counters()
    with levers.use_tier("fast"):
        fast_tokens, fast_logits, _ = decode_along(model, prompt, N_TOKENS)
    ran = measures.kernel_dispatches(before, levers.counters())
    assert PRODUCT_KERNELS & set(ran), f"no quantized product kernel ran: {ran}"
    assert fast_tokens == compat_tokens
    kl = measures.kl_divergence(compat_logits, fast_logits)
    assert torch.isfinite(fast_logits).all()
    assert kl.mean().item() <= KL_LIMIT, kl.tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_fast_tier_gives_compats_tokens_on_each_safetensors_format(tmp_path, case):
    kind, kwargs = CASES[case]
    folder, _ = write_random(tmp_path, kind, **kwargs)
    model = load_model(folder, dtype=torch.bfloat16, device="cuda")
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bits == 4
    if "act_order" in kwargs:  # the gathered path, not only down_proj's folded order
        assert attn.q_proj.input_perm is not None and attn.o_proj.input_perm is not None
    assert_fast_says_what_compat_says(model, CONFIG["vocab_size"])


@pytest.mark.gpu
def test_fast_tier_gives_compats_tokens_on_a_gguf_file(tmp_path):
    pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    write_gguf(path, centered=True)
    model = load_model(path, dtype=torch.bfloat16, device="cuda")
    layer = model.model.layers[0]
    assert (layer.self_attn.q_proj.bits, layer.self_attn.k_proj.bits,
            layer.self_attn.v_proj.bits, model.lm_head.bits) == (4, 5, 8, 0)  # Q6_K: dense
    assert_fast_says_what_compat_says(model, LLAMA["vocab_size"])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gguf-q8_0", "gguf-q4_0"])
def test_fast_tier_gives_compats_tokens_on_a_written_gemma3_gguf(tmp_path, kind):
    pytest.importorskip("gguf")
    from qfuse.formats import gguf_writer
    from qfuse.loading import DEFAULT_MODEL

    path = gguf_writer.write_gguf(DEFAULT_MODEL, tmp_path / kind, kind)
    model = load_model(path, dtype=torch.bfloat16, device="cuda")
    assert model.config.model_type == "gemma3_text"
    assert model.model.layers[0].self_attn.q_proj.bits == gguf_writer.bits(kind)
    assert_fast_says_what_compat_says(model, model.config.vocab_size)
