"""The tokens-as-M wgmma decode-attention kernel (kernels/decode_attention_wgmma.py).

CPU cases: the module imports without a GPU and refuses with one-line reasons; the
two code expansions (emulated in Python from their PTX) and the slot/row orders the
kernel stores q and reads Oᵀ in agree; the ablations' shared-memory pads. `gpu` cases
need an sm_90 device (the first ones passed in stop 38; the soft-cap, `late_v` and
ablation cases are stop 39's and have not run): the error rule against compat (the
kernel's max-abs error against the float32 reference at most twice compat's) at lengths
off the 64-token tile and split grid, length 0, a window, soft-capped scores."""

import pytest
import torch

from qfuse.quant import batch_rows
from qfuse.testing import errors, make_case, on_hopper

wg = pytest.importorskip("qfuse.kernels.decode_attention_wgmma")

HOPPER = on_hopper()
gpu = pytest.mark.gpu
hopper = pytest.mark.skipif(not HOPPER, reason="needs CUDA on an sm_90 (Hopper) GPU")

SHAPES = [(16, 8, 256), (32, 8, 128)]  # Gemma 3 12B, Llama 3 8B: (Hq, Hkv, D)
LENGTHS = [0, 1, 63, 64, 77, 300, 1000, 1061]  # 0 first: the length-0 check reads out[0]
N_MAX = 2048


# ---- CPU ----

def test_module_imports_and_refuses_cpu_tensors():
    q, k, v, _ = make_case(1, 16, 8, 256, 64, [10], 4, torch.bfloat16, "cpu")
    reason = wg.unsupported_reason(q, k, v)
    assert isinstance(reason, str) and reason and "\n" not in reason
    assert isinstance(wg.unsupported_reason(q, k.dequantize(torch.bfloat16),
                                            v.dequantize(torch.bfloat16)), str)


def test_the_wgmma_launch_path_refuses_what_the_kernel_refuses():
    from qfuse.kernels.decode_attention import AttentionLaunch, decode_attention_quantized_kv

    q, k, v, lengths = make_case(1, 16, 8, 256, 64, [10], 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"^decode attention \(wgmma kernel\): "):
        decode_attention_quantized_kv(q, k, v, lengths, 0.0625,
                                      launch=AttentionLaunch(path="wgmma"))


def test_slot_and_row_orders_are_permutations_of_a_group():
    assert sorted(wg.code_slot_dim(c) for c in range(64)) == list(range(64))
    assert sorted(wg.value_row_dim(m) for m in range(64)) == list(range(64))


def _k_pairs(word):
    """_K_ASM in Python: register j = (nibble j, nibble j + 4) as (low, high) values."""
    return [(((word >> 4 * j) & 0xF) | 0x4300, ((word >> (4 * j + 16)) & 0xF) | 0x4300)
            for j in range(4)]


def test_k_expansion_matches_the_slot_order():
    # slot 32·j1 + 16·j0 + 8·u + 2q + e is half e of register j0 + 2·j1 of word 2q + u
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 2**32, (8,), generator=g, dtype=torch.int64).tolist()
    codes = [(words[d // 8] >> 4 * (d % 8)) & 0xF for d in range(64)]
    for col in range(64):
        j1, j0, u, q, e = col >> 5 & 1, col >> 4 & 1, col >> 3 & 1, col >> 1 & 3, col & 1
        half = _k_pairs(words[2 * q + u])[j0 + 2 * j1][e]
        assert half - 0x4300 == codes[wg.code_slot_dim(col)]


def _prmt(a, b, sel):
    src = a | (b << 32)
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def test_v_expansion_matches_the_row_order():
    # row 16w + 8r + g of Oᵀ: byte w of word g, nibble r of that byte, from two tokens
    g = torch.Generator().manual_seed(1)
    t0, t1 = (torch.randint(0, 2**32, (8,), generator=g, dtype=torch.int64).tolist()
              for _ in range(2))
    for m in range(64):
        w, r, word = m // 16, (m // 8) % 2, m % 8
        sel = w | (w << 4) | ((w + 4) << 8) | ((w + 4) << 12)
        t = _prmt(t0[word], t1[word], sel) >> (4 * r)
        reg = (t & 0x000F000F) | 0x43004300
        d = wg.value_row_dim(m)
        for tok, half in ((t0, reg & 0xFFFF), (t1, reg >> 16)):
            assert half - 0x4300 == (tok[d // 8] >> 4 * (d % 8)) & 0xF


@pytest.mark.parametrize("D, stages", [(128, 4), (256, 3)])
def test_default_ring_fits(D, stages):
    assert wg.DEFAULT_STAGES[D] == stages
    assert wg.shared_bytes(D, stages) <= wg.SMEM_BYTES


def test_an_ablation_is_padded_to_the_complete_kernels_programs_per_sm():
    # The complete Llama-shape kernel: 126 registers (128 allocated) hold 4 programs.
    full = type("K", (), {"n_regs": 126, "metadata": type("M", (), {"shared": 41120})})()
    assert wg.programs_per_sm(full) == 4
    # An ablation of 67 registers and 38944 bytes would hold 5 (by shared memory): padded,
    # an SM holds 4 again, and not fewer.
    def kernel(n_regs, shared):
        return type("K", (), {"n_regs": n_regs, "metadata": type("M", (), {"shared": shared})})()

    assert wg.programs_per_sm(kernel(67, 38944)) == 5
    for full, shared in ((4, 38944), (4, 20000), (2, 30000), (7, 9000)):
        a, b = wg.ablation_pad(full, shared)
        assert all(x == 0 or (x >= 512 and x & (x - 1) == 0) for x in (a, b)), (a, b)
        assert wg.programs_per_sm(kernel(40, shared + a + b)) == full, (full, shared, a, b)
    assert wg.ablation_pad(4, 60000) == (0, 0)  # already at most 4


def test_late_v_is_an_option_of_the_wgmma_path_only():
    from qfuse.kernels.decode_attention import AttentionLaunch

    AttentionLaunch(path="wgmma", late_v=True, maxnreg=96)
    with pytest.raises(ValueError, match="late_v is an option of the wgmma path"):
        AttentionLaunch(path="codes", late_v=True)


def test_upto_is_an_option_of_the_wgmma_path_only():
    from qfuse.kernels.decode_attention import WGMMA_STAGES, AttentionLaunch

    assert list(wg.UPTO) == list(WGMMA_STAGES) and sorted(wg.UPTO.values()) == [1, 2, 3]
    AttentionLaunch(path="wgmma", upto="scores")
    for options in ({"path": "ws", "upto": "ring"}, {"path": "wgmma", "upto": "values"}):
        with pytest.raises(ValueError, match="upto is an option of the wgmma path"):
            AttentionLaunch(**options)


# ---- GPU (sm_90) ----

@gpu
@hopper
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [None, 700])
@pytest.mark.parametrize("variant", ["default", "late_v", "late_v capped"])
def test_gpu_error_rule(shape, window, variant):
    Hq, Hkv, D = shape
    q, k, v, lengths = make_case(len(LENGTHS), Hq, Hkv, D, N_MAX, LENGTHS, 4, torch.bfloat16,
                                 "cuda")
    assert wg.unsupported_reason(q, k, v) is None
    scale = D ** -0.5
    # V expanded after the score products; capped: at the registers of one more program
    # an SM (a few bytes of spills offline)
    options = {"default": {}, "late_v": {"late_v": True},
               "late_v capped": {"late_v": True, "maxnreg": 96 if D == 128 else 168}}[variant]
    out = wg.decode_attention_wgmma(q, k, v, lengths, scale, window, **options)
    assert not out.isnan().any()
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # length 0
    err, err_compat = errors(out[1:], q[1:], batch_rows(k, 1), batch_rows(v, 1),
                             lengths[1:], scale, window)
    assert err <= 2 * err_compat, (err, err_compat)


@gpu
@hopper
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [None, 700])
def test_gpu_error_rule_soft_capped(shape, window):
    """Soft-capped scores (Gemma 2's 50), through the dispatch's wgmma path too."""
    from qfuse.kernels.decode_attention import AttentionLaunch, decode_attention_quantized_kv

    Hq, Hkv, D = shape
    q, k, v, lengths = make_case(len(LENGTHS), Hq, Hkv, D, N_MAX, LENGTHS, 4, torch.bfloat16,
                                 "cuda")
    scale, cap = D ** -0.5, 50.0
    q = q * 8  # scores large enough that the cap bends them
    out = wg.decode_attention_wgmma(q, k, v, lengths, scale, window, softcap=cap)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # length 0
    err, err_compat = errors(out[1:], q[1:], batch_rows(k, 1), batch_rows(v, 1),
                             lengths[1:], scale, window, cap)
    assert err <= 2 * err_compat, (err, err_compat)
    via = decode_attention_quantized_kv(q, k, v, lengths, scale, window, cap,
                                        launch=AttentionLaunch(path="wgmma"))
    assert torch.equal(via, out)


@gpu
@hopper
@pytest.mark.parametrize("G", [2, 3, 4])
def test_gpu_error_rule_gqa_groups(G):
    Hkv, D = 4, 128
    lengths = [5, 64, 129, 517]
    q, k, v, lengths = make_case(len(lengths), G * Hkv, Hkv, D, 1024, lengths, 4,
                                 torch.bfloat16, "cuda")
    out = wg.decode_attention_wgmma(q, k, v, lengths, D ** -0.5)
    err, err_compat = errors(out, q, k, v, lengths, D ** -0.5)
    assert err <= 2 * err_compat, (err, err_compat)


@gpu
@hopper
def test_gpu_refuses_in_one_line():
    q, k, v, _ = make_case(1, 16, 8, 256, 64, [10], 8, torch.bfloat16, "cuda")
    reason = wg.unsupported_reason(q, k, v)
    assert reason and "\n" not in reason
    with pytest.raises(ValueError):
        wg.decode_attention_wgmma(q, k, v, torch.tensor([10], dtype=torch.int32,
                                                        device="cuda"), 0.0625)


@gpu
@hopper
@pytest.mark.parametrize("upto", ["ring", "scores", "softmax"])
def test_gpu_ablations_run_at_the_complete_kernels_occupancy(upto):
    """Timing only: each stage prefix launches, at the complete kernel's programs per SM,
    and leaves the complete kernel's results as they were."""
    from qfuse.kernels.decode_attention import AttentionLaunch, decode_attention_quantized_kv

    q, k, v, lengths = make_case(2, 32, 8, 128, 4096, [4000, 1500], 4, torch.bfloat16, "cuda")
    before = decode_attention_quantized_kv(q, k, v, lengths, 0.088,
                                           launch=AttentionLaunch(path="wgmma"))
    decode_attention_quantized_kv(q, k, v, lengths, 0.088,
                                  launch=AttentionLaunch(path="wgmma", upto=upto))
    torch.cuda.synchronize()
    after = decode_attention_quantized_kv(q, k, v, lengths, 0.088,
                                          launch=AttentionLaunch(path="wgmma"))
    assert torch.equal(before, after)
    pads = [pad for key, pad in wg.ABLATION_PADS.items() if key[-1] == upto]
    assert pads and all(min(pad) >= 0 for pad in pads)
