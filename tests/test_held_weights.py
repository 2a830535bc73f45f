"""Weights held once: a loaded model keeps each 4-bit weight in the fragment kernel's
order alone (`Decoder.hold_kernel_forms`), and everything that reads the MLX layout
gets it back bit for bit.

CPU: the reference dequantizes the held form, so a held model's compat logits (prefill
and decode, the embedding lookup and the tied head included) are bitwise those of the
same model holding MLX words; `state_dict` gives back the MLX words; the MLX-words
kernel (interpreter) matches the torch permutation. GPU: after loading and the first
decode step no MLX word buffer is resident, the memory is about the fragments', and
the fast path's tokens equal those of a model that keeps MLX words and repacks lazily.
"""

import pytest
import torch

from qfuse import levers
from qfuse.convert import quantize_model
from qfuse.kernels.products import fragments
from qfuse.models import Decoder
from qfuse.models.config import ModelConfig
from qfuse.models.decoder import Linear
from qfuse.quant import QuantizedTensor
from qfuse.runtime.cache import KVCache

# Gemma 3 shape in miniature: q/k norms, sandwich norms, tied embeddings (the head is
# the held embedding), a vocabulary that is not whole tiles of 16.
RAW = {"model_type": "gemma3_text", "vocab_size": 200, "hidden_size": 128,
       "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 64,
       "sliding_window": 16, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}


def _models(device="cpu"):
    """The same 4-bit g64 bf16 model twice: one to hold, one keeping MLX words."""
    torch.manual_seed(0)
    dense = Decoder(ModelConfig.from_dict(RAW)).to(torch.float32)
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0, 0.05)
    held = quantize_model(dense, 4, 64).to(device=device, dtype=torch.bfloat16).eval()
    mlx = quantize_model(dense, 4, 64).to(device=device, dtype=torch.bfloat16).eval()
    return held, mlx


def _logits(model, ids, steps=3, kv_bits=0):
    """Prefill logits of ids [B, T], then `steps` greedy decode steps' logits."""
    B, T = ids.shape
    cache = KVCache(model.config, B, T + steps, model.dtype, ids.device, bits=kv_bits)
    out = [model(ids, cache=cache)[:, -1]]
    tok = out[0].argmax(-1)
    for _ in range(steps):
        out.append(model.decode(tok, cache))
        tok = out[-1].argmax(-1)
    return torch.stack(out)


def test_held_model_gives_the_mlx_models_compat_logits_bit_for_bit():
    held, mlx = _models()
    assert held.hold_kernel_forms(always=True) == 2 * 7 + 1
    for name, m in held.named_modules():
        if isinstance(m, Linear) and m.bits:
            assert m.held is not None and m.weight is None, name
    attn = held.model.layers[0].self_attn
    assert attn.q_proj.held.parent is attn.k_proj.held.parent is attn.v_proj.held.parent
    parts = [attn.q_proj.held, attn.k_proj.held, attn.v_proj.held]
    assert fragments.stacked_parent(parts) is attn.q_proj.held.parent  # one launch over it
    assert fragments.stacked_parent(parts[:2]) is None  # not the whole stack
    assert fragments.stacked_parent(parts[::-1]) is None  # not in order
    ids = torch.tensor([[5, 17, 42, 199, 3, 8], [1, 2, 3, 4, 5, 6]])
    with torch.no_grad(), levers.use_tier("compat"):
        assert torch.equal(_logits(held, ids), _logits(mlx, ids))
        assert torch.equal(_logits(held, ids, kv_bits=4), _logits(mlx, ids, kv_bits=4))


def test_held_state_dict_is_the_mlx_words():
    held, mlx = _models()
    held.hold_kernel_forms(always=True)
    got, want = held.state_dict(), mlx.state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        a, b = got[key], value
        if a.dtype == torch.uint32:
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert torch.equal(a, b), key


def test_hold_skips_what_the_fragment_kernel_does_not_take():
    held, _ = _models()
    held = held.float()  # float32 scales: the fragments store bf16
    assert held.hold_kernel_forms(always=True) == 0
    # And without `always`, a CPU model is never held: its products run the reference.
    cpu, _ = _models()
    assert cpu.hold_kernel_forms() == 0


@pytest.mark.parametrize("N,K,group", [(48, 128, 64), (20, 256, 128), (5, 64, 64)])
def test_mlx_words_kernel_matches_the_permutation(N, K, group):
    from qfuse.kernels.products.fragment_words import mlx_words
    from qfuse.testing import kernel_device

    torch.manual_seed(N)
    w = QuantizedTensor.from_float(torch.randn(N, K).to(torch.bfloat16).to(kernel_device()),
                                   group, 4)
    f = fragments.repack(w)
    assert torch.equal(mlx_words(f).view(torch.int32), w.packed.view(torch.int32))
    if N % 16 == 0:  # the second part of a stack: a view whose tiles start mid-tensor
        view = fragments.concat([f, f]).rows(N, N)
        assert torch.equal(mlx_words(view).view(torch.int32), w.packed.view(torch.int32))


@pytest.mark.parametrize("N,K,group", [(48, 128, 64), (20, 256, 128), (5, 64, 64),
                                     pytest.param(15360, 3840, 64, marks=pytest.mark.gpu)])
def test_bf16_kernel_is_the_mlx_dequantization(N, K, group):
    from qfuse.kernels.products.fragment_words import dequantize_bf16
    from qfuse.testing import kernel_device

    torch.manual_seed(N)
    w = QuantizedTensor.from_float(torch.randn(N, K).to(torch.bfloat16).to(kernel_device()),
                                   group, 4)
    f = fragments.repack(w)
    want = w.dequantize(torch.bfloat16).view(torch.int16)
    assert torch.equal(dequantize_bf16(f).view(torch.int16), want)
    if N % 16 == 0:  # the second part of a stack: a view whose tiles start mid-tensor
        view = fragments.concat([f, f]).rows(N, N)
        assert torch.equal(dequantize_bf16(view).view(torch.int16), want)


def test_fragment_rows_and_lookup_are_the_dequantized_rows():
    torch.manual_seed(1)
    w = QuantizedTensor.from_float(torch.randn(40, 128).to(torch.bfloat16), 64, 4)
    f = fragments.repack(w)
    dense = w.dequantize(torch.float32)
    assert torch.equal(f.dequantize(torch.float32), dense)
    ids = torch.tensor([[0, 39, 16], [15, 17, 31]])
    assert torch.equal(fragments.dequantize_rows(f, ids, torch.float32), dense[ids])
    assert torch.equal(f.rows(16, 24).dequantize(torch.float32), dense[16:])
    with pytest.raises(ValueError, match="whole tiles"):
        f.rows(8, 16)


@pytest.mark.gpu
def test_gpu_held_model_keeps_no_mlx_words_and_decodes_as_before():
    torch.cuda.empty_cache()
    held, mlx = _models("cuda")
    assert held.hold_kernel_forms() == 2 * 7 + 1  # a GPU in the fast tier holds them
    ids = torch.tensor([[5, 17, 42, 199, 3, 8]], device="cuda")
    levers.reset_counters()
    with torch.no_grad():
        got = _logits(held, ids, steps=4, kv_bits=4)
        want = _logits(mlx, ids, steps=4, kv_bits=4)
    assert levers.counters()["qmatmul_mma"] > 0
    assert torch.equal(got, want)  # the same codes, the same kernel: the same bits
    for name, m in held.named_modules():
        if isinstance(m, Linear) and m.bits:
            assert m.weight is None and m._quantized is None, name
            assert m.held.words.is_cuda
    # Back to MLX words bit for bit, on the GPU (the integer kernel).
    for name, m in mlx.named_modules():
        if isinstance(m, Linear) and m.bits:
            back = dict(held.named_modules())[name].quantized()
            assert torch.equal(back.packed.view(torch.int32), m.weight.view(torch.int32)), name
            assert torch.equal(back.scales, m.scales) and torch.equal(back.biases, m.biases)
