"""The warp-specialized split kernel (kernels/attention/decode_attention_ws.py).

CPU cases (CI): the module imports without a GPU, refuses CPU tensors with a reason,
and its code-extraction bit tricks decode to OFF + code (emulated in Python). `gpu`
cases need an sm_90 device: the error rule against compat, ragged lengths (0 and
lengths off the split and stage grid), window, soft-cap, NaN in unused slots,
bitwise reproducibility, batch invariance and CUDA-graph replay."""

import pytest
import torch

from qfuse.quant import batch_rows
from qfuse.testing import errors, make_case, on_hopper, refill_

ws = pytest.importorskip("qfuse.kernels.attention.decode_attention_ws")

HOPPER = on_hopper()
gpu = pytest.mark.gpu
hopper = pytest.mark.skipif(not HOPPER, reason="needs CUDA on an sm_90 (Hopper) GPU")

SHAPES = [(16, 8, 256), (32, 8, 128)]  # Gemma 3 12B, Llama 3 8B: (Hq, Hkv, D)
LENGTHS = [0, 1, 77, 300, 1000, 1061]  # none a multiple of the 256-token split or the stage
N_MAX = 2048


# ---- CPU ----

def test_module_imports_and_refuses_cpu_tensors():
    q, k, v, _ = make_case(1, 16, 8, 256, 64, [10], 4, torch.bfloat16, "cpu")
    reason = ws.ws_unsupported_reason(q, k, v)
    assert isinstance(reason, str) and reason
    assert isinstance(ws.ws_unsupported_reason(q, k.dequantize(torch.bfloat16),
                                               v.dequantize(torch.bfloat16)), str)


@pytest.mark.parametrize("G, D, bits, group, ok", [
    (2, 256, 4, 64, True), (4, 128, 4, 64, True), (2, 256, 8, 64, True), (4, 128, 8, 64, True),
    (2, 64, 4, 64, False),  # 8 words per token
    (3, 256, 4, 64, False),  # 12 mma columns
    (1, 256, 4, 64, False),  # 4 columns
])
def test_shape_reasons(G, D, bits, group, ok):
    reason = ws.shape_reason(G, D, bits, group)
    assert (reason is None) == ok, reason


def _prmt(a, b, sel):
    src = a | (b << 32)
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _emulate_codes(w0, w1, lo_base, hi_base):
    """The PTX of nibbles_asm on one word pair, in Python: 8 registers."""
    lo, hi = lo_base | (lo_base << 16), hi_base | (hi_base << 16)
    out = []
    for j in range(4):
        sel = j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12)
        t = _prmt(w0, w1, sel)
        out.append((t & 0x000F000F) | lo)
        out.append(((t >> 4) & 0x000F000F) | hi)
    return out


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_code_extraction_gives_offset_plus_code(bits, dtype):
    lo_base, hi_base, off = ws.code_bases(bits, dtype)
    asm = ws.nibbles_asm(lo_base, hi_base)
    assert asm.count("prmt") == 4 and asm.count("lop3") == 8
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 2**32, (64, 2), generator=g, dtype=torch.int64)
    for w0, w1 in words.tolist():
        regs = _emulate_codes(w0, w1, lo_base, hi_base)
        halves = torch.tensor([[r & 0xFFFF, r >> 16] for r in regs], dtype=torch.int32)
        vals = halves.to(torch.int16).view(dtype).float()  # [8 outputs, 2 words]
        for col, w in enumerate((w0, w1)):
            codes = [(w >> (bits * i)) & ((1 << bits) - 1) for i in range(32 // bits)]
            if bits == 4:
                assert vals[:, col].tolist() == [off + c for c in codes]
            else:  # outputs 2j, 2j + 1 are code j's two nibbles; their sum is OFF + code
                assert (vals[0::2, col] + vals[1::2, col]).tolist() == [off + c for c in codes]


def test_score_layout_matches_the_mma_accumulator():
    layout = ws.score_layout(16, 2, 4)
    assert layout.shape == [16, 2, 4]
    assert layout.reg_bases == [[0, 0, 1], [8, 0, 0]]
    assert layout.lane_bases == [[0, 0, 2], [0, 1, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]


# ---- GPU (sm_90) ----

def run_ws(q, k, v, lengths, scale, window=None, softcap=None, out=None, **options):
    """Through the public launcher, on the ws path (options: AttentionLaunch fields)."""
    from qfuse.kernels.attention.decode_attention import (
        AttentionLaunch,
        decode_attention_quantized_kv,
    )

    out = torch.full_like(q, float("nan")) if out is None else out  # poisoned: all written
    return decode_attention_quantized_kv(q, k, v, lengths, scale, window, softcap, out=out,
                                         launch=AttentionLaunch(path="ws", **options))


@gpu
@hopper
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window, softcap", [(None, None), (700, None), (None, 50.0), (257, 30.0)])
def test_gpu_error_rule(shape, bits, dtype, window, softcap):
    Hq, Hkv, D = shape
    q, k, v, lengths = make_case(len(LENGTHS), Hq, Hkv, D, N_MAX, LENGTHS, bits, dtype, "cuda")
    assert ws.ws_unsupported_reason(q, k, v) is None
    scale = D ** -0.5
    out = run_ws(q, k, v, lengths, scale, window, softcap)
    assert not out.isnan().any()
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # length 0
    err, err_compat = errors(out[1:], q[1:], batch_rows(k, 1), batch_rows(v, 1),
                             lengths[1:], scale, window, softcap)
    assert err <= 2 * err_compat, (err, err_compat)


@gpu
@hopper
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_reproducible_and_batch_invariant(shape, bits):
    Hq, Hkv, D = shape
    q, k, v, lengths = make_case(len(LENGTHS), Hq, Hkv, D, N_MAX, LENGTHS, bits, torch.bfloat16,
                                 "cuda", seed=1)
    a = run_ws(q, k, v, lengths, 0.088, window=300)
    assert torch.equal(a, run_ws(q, k, v, lengths, 0.088, window=300))
    for i in (2, 5):
        alone = run_ws(q[i:i + 1], batch_rows(k, i, i + 1), batch_rows(v, i, i + 1), lengths[i:i + 1], 0.088,
                       window=300)
        assert torch.equal(alone[0], a[i])


@gpu
@hopper
@pytest.mark.parametrize("stages, tpw", [(3, None), (6, None), (None, 32)])
def test_gpu_launch_variants_agree(stages, tpw):
    q, k, v, lengths = make_case(3, 16, 8, 256, N_MAX, [5, 700, 2048], 4, torch.bfloat16, "cuda")
    base = run_ws(q, k, v, lengths, 0.0625)
    other = run_ws(q, k, v, lengths, 0.0625, num_stages=stages,
                   block_n=tpw and tpw * ws.CONSUMERS)
    err, err_compat = errors(other, q, k, v, lengths, 0.0625)
    assert err <= 2 * err_compat
    if tpw is None:  # the stage count changes nothing in the arithmetic
        assert torch.equal(base, other)


@gpu
@hopper
def test_gpu_cuda_graph_replay_with_changed_lengths():
    q, k, v, lengths = make_case(2, 16, 8, 256, N_MAX, [100, 500], 4, torch.bfloat16, "cuda")
    static_len = lengths.clone()
    out = torch.empty_like(q)
    run_ws(q, k, v, static_len, 0.0625, out=out)  # warm-up compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_ws(q, k, v, static_len, 0.0625, out=out)
    for n in ([100, 500], [101, 777], [0, 2048]):
        static_len.copy_(torch.tensor(n, dtype=torch.int32))
        for i, t in enumerate((k, v)):  # real data in the newly valid slots
            refill_(t, seed=i + n[1])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run_ws(q, k, v, static_len, 0.0625))


@gpu
@hopper
@pytest.mark.parametrize("shape, bits, want", [((32, 8, 128), 4, "ws"), ((32, 8, 128), 8, "codes"),
                                               ((16, 8, 256), 4, "codes")])
def test_gpu_default_path_is_ws_for_4bit_head_dim_128(shape, bits, want, monkeypatch):
    """`WS_BY_DEFAULT`: the op takes the ws kernel for 4-bit caches of head dim 128 (its
    output bitwise the ws launch's) under the Triton it was measured with, the codes
    kernel for the other caches."""
    import triton

    from qfuse import ops
    from qfuse.kernels.attention.decode_attention import WS_TRITON, choose_path

    if not triton.__version__.startswith(WS_TRITON):
        want = "codes"

    Hq, Hkv, D = shape
    q, k, v, lengths = make_case(len(LENGTHS), Hq, Hkv, D, N_MAX, LENGTHS, bits, torch.bfloat16,
                                 "cuda", seed=2)
    assert choose_path(q, k, v) == want
    monkeypatch.setenv("QFUSE_TIER", "fast")
    out = ops.decode_attention(q, k, v, lengths, D ** -0.5)
    assert torch.equal(out, run_ws(q, k, v, lengths, D ** -0.5)) == (want == "ws")
