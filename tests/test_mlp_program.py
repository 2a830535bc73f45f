"""A layer from the attention on as one persistent launch (`kernels.steps.mlp_program`):
bit for bit the fused launches it replaces (O with its joint, gate/up with the
activation, down with the residual joint), under the CPU interpreter (one program
walking every instruction) and on the GPU (one program per SM, the waits real); split K
on every product, 1-5 rows, 4/8-bit weights, Gemma's and Llama's joints, biases;
counters zero after each call, so calls repeat, and a CUDA graph replays it."""

import pytest
import torch

from qfuse.testing import assert_bitwise_equal, kernel_device, linear_case

DEVICE = kernel_device()
program = pytest.importorskip("qfuse.kernels.steps.mlp_program")
fused_mlp = pytest.importorskip("qfuse.kernels.products.fused_mlp")
joint = pytest.importorskip("qfuse.kernels.steps.joint_step")
DTYPE = torch.float16  # the interpreter's bf16 is wrong: bf16 runs on the GPU
DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")


def _case(M, H, I, bits, group, post, nxt, bias, act, dtype, seed=0):
    x, gate = linear_case(M, I, H, bits, group, seed, dtype, DEVICE)
    _, up = linear_case(M, I, H, bits, group, seed + 1, dtype, DEVICE)
    _, down = linear_case(M, H, I, bits, group, seed + 2, dtype, DEVICE)
    g = torch.Generator().manual_seed(seed + 3)
    residual = torch.randn(M, H, generator=g).to(dtype).to(DEVICE)
    pw = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(DEVICE) if post else None
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(DEVICE) if nxt else None
    b = (0.1 * torch.randn(H, generator=g)).to(dtype).to(DEVICE) if bias else None
    unit_offset = post  # Gemma's norms (1 + w) where it has a post norm

    def two_launches(x, residual):
        hidden = fused_mlp.gate_up_act_gemv(x, gate, up, act)
        return joint.joint_step(hidden, down, b, residual, pw, nw, 1e-6, unit_offset)

    prog = program.MlpProgram(gate, up, down, b, act, pw, nw, 1e-6, unit_offset, M, dtype,
                              x.device)
    return x, residual, prog, two_launches


@pytest.mark.parametrize("M,H,I,bits,group,post,nxt,bias,act", [
    # H=128, I=384: gate/up whole K, down split in 2 (uneven); Gemma's joints
    (1, 128, 384, 4, 64, True, True, False, "gelu_tanh"),
    # H=256, I=768: down split in 3; Llama's joint (no post norm), a bias, SwiGLU
    (3, 256, 768, 4, 32, False, True, True, "silu"),
    # 8-bit weights, Gemma's last joint (no next norm), 5 rows
    (5, 128, 384, 8, 64, True, False, False, "gelu_tanh"),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_program_is_the_two_launches_bit_for_bit(M, H, I, bits, group, post, nxt, bias,
                                                     act, dtype):
    x, residual, prog, two_launches = _case(M, H, I, bits, group, post, nxt, bias, act, dtype)
    splits = prog.d_ls["SPLIT"], prog.g_ls["SPLIT"]
    h_ref, n_ref = two_launches(x, residual)
    for _ in range(2):  # the counters are zero again after a call: it repeats
        h, n = prog(x, residual)
        assert_bitwise_equal(h, h_ref)
        if nxt:
            assert_bitwise_equal(n, n_ref)
        else:
            assert n is None
        assert int(prog.counters.abs().sum()) == 0, prog.counters
    if (H, I) != (128, 384) or bits == 4:
        assert splits[0] > 1, splits  # the case covers the down product's split of K


def test_a_split_gate_up_gives_the_two_launches_bits():
    """Gate/up split in K too (H = 768: 3 splits), their partials summed in order."""
    x, residual, prog, two_launches = _case(2, 768, 256, 4, 64, False, True, False, "silu",
                                            DTYPE, seed=5)
    assert prog.g_ls["SPLIT"] > 1
    h_ref, n_ref = two_launches(x, residual)
    h, n = prog(x, residual)
    assert_bitwise_equal(h, h_ref)
    assert_bitwise_equal(n, n_ref)


@pytest.mark.parametrize("M,post,bias", [(1, True, False), (3, False, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_from_the_attention_on_it_is_the_three_launches_bit_for_bit(M, post, bias, dtype):
    """With the O product and its joint first (Gemma's sandwich norms; Llama's joint and
    an O bias): O + joint, gate/up, down + joint, three launches, bit for bit; the O
    product split in K (Hq·D = 512: 2 splits)."""
    H, I, KO = 128, 384, 512
    x, residual, _, two_launches = _case(M, H, I, 4, 64, post, True, bias, "gelu_tanh", dtype)
    attn, o_w = linear_case(M, H, KO, 4, 64, 9, dtype, DEVICE)
    g = torch.Generator().manual_seed(10)
    o_post = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(DEVICE) if post else None
    o_next = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(DEVICE)
    o_bias = (0.1 * torch.randn(H, generator=g)).to(dtype).to(DEVICE) if bias else None
    base = _case(M, H, I, 4, 64, post, True, bias, "gelu_tanh", dtype)[2]
    prog = program.MlpProgram(base.gate, base.up, base.down, base.bias, "gelu_tanh",
                              base.post_weight, base.next_weight, 1e-6, post, M, dtype,
                              x.device, o=program.OPart(o_w, o_bias, o_post, o_next))
    assert prog.o_ls["SPLIT"] > 1
    h_mid, n_mid = joint.joint_step(attn, o_w, o_bias, residual, o_post, o_next, 1e-6, post)
    h_ref, n_ref = two_launches(n_mid, h_mid)
    for _ in range(2):
        h, n = prog(attn, residual)
        assert_bitwise_equal(h, h_ref)
        assert_bitwise_equal(n, n_ref)
        assert int(prog.counters.abs().sum()) == 0


def test_the_tables_deal_every_instruction_once_in_order():
    table = program.deal([(0, t, s) for t in range(3) for s in range(2)] + [(2, 0, 0)], 4)
    assert table.shape == (4, 2, 3)
    flat = [tuple(r) for p in range(4) for r in table[p].tolist() if r[0] >= 0]
    assert sorted(flat) == sorted([(0, t, s) for t in range(3) for s in range(2)] + [(2, 0, 0)])
    for p in range(4):  # each list keeps the order: instruction i at position i // 4
        ops = [r[0] for r in table[p].tolist() if r[0] >= 0]
        assert ops == sorted(ops)
    assert table[3, 1].tolist() == [-1, -1, -1]


@pytest.mark.gpu
def test_the_program_replays_in_a_cuda_graph():
    x, residual, prog, two_launches = _case(2, 1024, 2816, 4, 64, True, True, False,
                                            "gelu_tanh", torch.bfloat16)
    assert prog.programs > 1
    h_ref, n_ref = two_launches(x, residual)
    prog(x, residual)  # eager first: warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, n = prog(x, residual)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(h, h_ref)
        assert_bitwise_equal(n, n_ref)
    assert int(prog.counters.abs().sum()) == 0


@pytest.mark.skipif(DEVICE == "cuda", reason="the layer-level bits are the CPU test's")
@pytest.mark.parametrize("raw,bits,kv_bits", [("GEMMA3", 4, 4), ("QWEN2", 8, 0)])
def test_a_decoder_decodes_with_the_program_as_with_the_two_steps(raw, bits, kv_bits):
    """Three decode steps of a two-layer Gemma 3 and Qwen 2 in fused steps, O and the MLP as one
    persistent launch: the two-step MLP's logits and hidden states bit for bit, and the
    plan counts the program at every layer."""
    from qfuse import levers
    from tests import test_fused_steps as steps

    raw = getattr(steps, raw)
    two, two_hidden, _ = steps._decoded(raw, bits, kv_bits, fused=True)
    with levers.setting("QFUSE_MLP_PROGRAM", "1"):
        levers.reset_counters()
        one, one_hidden, choice = steps._decoded(raw, bits, kv_bits, fused=True)
        assert choice.kernel == "fused_steps"
        counted = levers.counters().get("mlp_program", 0)
    assert counted == 3 * raw["num_hidden_layers"], counted
    assert_bitwise_equal(one, two)
    for a, b in zip(one_hidden, two_hidden, strict=True):
        assert_bitwise_equal(a, b)
