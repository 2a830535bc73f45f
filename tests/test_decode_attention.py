"""Decode attention: each split kernel against the compat error rule, edge cases,
reproducibility, batch independence, launch options, dispatch and input validation.
CPU cases run under the Triton interpreter (fp16, small shapes); `gpu` cases take bf16,
every head dim, long contexts and CUDA graphs."""

import pytest
import torch

from qfuse import levers, ops
from qfuse.quant import QuantizedTensor, batch_rows
from qfuse.testing import errors, kernel_device, make_case, refill_

DEVICE = kernel_device()
kernels = pytest.importorskip("qfuse.kernels.attention.decode_attention")
gpu = pytest.mark.gpu


def run_kernel(q, k, v, lengths, scale, window=None, softcap=None, path=None):
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    kernels.decode_attention_quantized_kv(q, k, v, lengths, scale, window, softcap, out=out,
                                          launch=kernels.AttentionLaunch(path=path))
    return out


@pytest.mark.parametrize("bits,path,D,Hq", [
    (0, None, 64, 4), (4, "tensor_cores", 64, 4), (8, "tensor_cores", 64, 4),
    # the codes kernel needs ≥ 16 words per token; Hq 4 and 8 are G = 2 and 4
    (4, "codes", 128, 4), (4, "codes", 128, 8), (8, "codes", 64, 4), (8, "codes", 64, 8)])
@pytest.mark.parametrize("window,softcap", [(None, None), (50, None), (None, 20.0)])
def test_within_twice_compat_error(bits, path, D, Hq, window, softcap):
    # Nmax 320: two splits of 256; lengths cross split and tile boundaries, one is 0.
    q, k, v, lengths = make_case(4, Hq, 2, D, 320, [1, 97, 0, 300], bits, torch.float16, DEVICE)
    out = run_kernel(q, k, v, lengths, 0.125, window, softcap, path)
    assert not out.isnan().any()
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # length 0: defined zeros
    err, err_compat = errors(out, q, k, v, lengths, 0.125, window, softcap)
    assert err <= 2 * err_compat, (err, err_compat)


@pytest.mark.parametrize("Hq,D,path", [(4, 64, None), (8, 64, None), (4, 128, None)])
def test_bitwise_reproducible_and_batch_independent(Hq, D, path):
    q, k, v, lengths = make_case(3, Hq, 2, D, 300, [260, 5, 77], 4, torch.float16, DEVICE)
    a = run_kernel(q, k, v, lengths, 0.1, path=path)
    b = run_kernel(q, k, v, lengths, 0.1, path=path)
    assert torch.equal(a, b)
    alone = run_kernel(q[:1], batch_rows(k, 0, 1), batch_rows(v, 0, 1), lengths[:1], 0.1, path=path)
    assert torch.equal(alone[0], a[0])


def test_a_path_that_cannot_take_the_inputs_is_refused():
    q, k, v, lengths = make_case(1, 4, 2, 64, 40, [33], 4, torch.float16, DEVICE)
    with pytest.raises(ValueError, match="codes kernel.*8 words per token"):
        run_kernel(q, k, v, lengths, 0.1, path="codes")  # kv4 at D=64: 8 words
    qd, kd, vd, _ = make_case(1, 4, 2, 64, 40, [33], 0, torch.float16, DEVICE)
    with pytest.raises(ValueError, match="codes kernel.*dense"):
        run_kernel(qd, kd, vd, lengths, 0.1, path="codes")
    q4, k4, v4, _ = make_case(1, 16, 8, 256, 64, [33], 4, torch.float16, "cpu")
    with pytest.raises(ValueError, match="ws kernel"):  # Hopper only; never on the CPU
        run_kernel(q4, k4, v4, lengths.cpu(), 0.1, path="ws")
    with pytest.raises(ValueError, match="tensor_cores kernel.*head dim 32"):
        q32, k32, v32, _ = make_case(1, 4, 2, 32, 40, [33], 0, torch.float16, DEVICE)
        run_kernel(q32, k32, v32, lengths, 0.1)


def test_a_split_of_partial_tiles_is_refused():
    q, k, v, lengths = make_case(1, 4, 2, 64, 400, [390], 8, torch.float16, DEVICE)
    with pytest.raises(ValueError, match="split 300 is not a multiple of block_n 64"):
        kernels.decode_attention_quantized_kv(q, k, v, lengths, 0.1, launch=kernels.AttentionLaunch(
            path="tensor_cores", split=300, block_n=64))


@pytest.mark.parametrize("options,match", [({"path": "cuda_cores"}, "path must be one of"),
                                           ({"path": "ws", "num_warps": 8}, "its own warps"),
                                           ({"block_n": 0}, "block_n must be a positive"),
                                           ({"split": 2.5}, "split must be a positive")])
def test_launch_options_are_checked(options, match):
    with pytest.raises(ValueError, match=match):
        kernels.AttentionLaunch(**options)


def test_default_paths():
    def path(Hq, Hkv, D, bits, group=64):
        q, k, v, _ = make_case(1, Hq, Hkv, D, 8, [8], bits, torch.float16, "cpu",
                               group_size=group)
        return kernels.choose_path(q, k, v)

    assert path(16, 8, 256, 4) == "codes" and path(32, 8, 128, 8) == "codes"
    assert path(32, 8, 128, 4) == "codes"  # WS_BY_DEFAULT, but the ws kernel needs Hopper
    assert path(16, 8, 256, 0) == "tensor_cores"  # dense
    assert path(4, 2, 64, 4) == "tensor_cores"  # 8 words per token


def test_dispatch_counts(monkeypatch):
    q, k, v, lengths = make_case(1, 2, 1, 64, 40, [33], 8, torch.float16, DEVICE)
    monkeypatch.setenv("QFUSE_TIER", "fast")
    ops.decode_attention(q, k, v, lengths, 0.125)
    monkeypatch.setenv("QFUSE_TIER", "exact")  # not bit-exact: not admitted
    ops.decode_attention(q, k, v, lengths, 0.125)
    monkeypatch.setenv("QFUSE_TIER", "fast")
    monkeypatch.setenv("QFUSE_DECODE_ATTENTION", "0")
    ops.decode_attention(q, k, v, lengths, 0.125)
    assert levers.counters() == {"decode_attention": 1, "ref:decode_attention": 2}


@pytest.mark.parametrize("case", ["head dim 32", "dense k, quantized v", "k g32, v g64"])
def test_unsupported_inputs_fall_back(case, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    D = 32 if case == "head dim 32" else 64
    q, k, v, lengths = make_case(1, 2, 1, D, 40, [33], 0 if D == 32 else 4, torch.float16,
                                 DEVICE)
    fresh = torch.randn(1, 1, 40, D, dtype=torch.float16, device=DEVICE)
    if case == "dense k, quantized v":
        k = fresh
    if case == "k g32, v g64":
        k = QuantizedTensor.from_float(fresh, 32, 4)
    out = ops.decode_attention(q, k, v, lengths, 0.125)
    assert levers.counters() == {"ref:decode_attention": 1}
    assert not out.isnan().any()


def test_bad_inputs_are_refused():
    B, Hq, Hkv, N, D = 2, 4, 2, 8, 16
    q = torch.zeros(B, Hq, D)
    k = v = torch.zeros(B, Hkv, N, D)
    L = torch.tensor([3, 8], dtype=torch.int32)
    cases = [
        ((torch.zeros(B, Hq, D + 1), k, v, L), {}, "k has head dim 16 but q has head dim 17"),
        ((q, k, torch.zeros(B, Hkv, N, D + 1), L), {}, "v has head dim 17 but q has head dim 16"),
        ((torch.zeros(B, 3, D), k, v, L), {}, r"q heads \(3\) must be a multiple of kv heads \(2\)"),
        ((q, k, v, torch.tensor([3, 9], dtype=torch.int32)), {}, r"lengths must lie in \[0, Nmax=8\]"),
        ((q, k, v, torch.tensor([-1, 2], dtype=torch.int32)), {}, r"lengths must lie in \[0, Nmax=8\]"),
        ((q, k, v, torch.tensor([3, 8, 1], dtype=torch.int32)), {}, "lengths must be int32/int64 of shape"),
        ((q, k, v, torch.tensor([[3, 8]], dtype=torch.int32)), {}, "lengths must be int32/int64 of shape"),
        ((q, k, v, torch.tensor([3.0, 8.0])), {}, "lengths must be int32/int64 of shape"),
        ((q, k, v, L), {"window": 0}, "window must be a positive number"),
        ((q, k, v, L), {"window": -2}, "window must be a positive number"),
        ((q, k, v, L), {"softcap": 0.0}, "softcap must be positive"),
        ((q, torch.zeros(3, Hkv, N, D), v, L), {}, "k has batch 3 but q has batch 2"),
        ((q, torch.zeros(B, Hkv, D), v, L), {}, r"k must be \[B, Hkv, Nmax, D\]"),
        ((q[None], k, v, L), {}, r"q must be \[B, Hq, D\]"),
        ((q, torch.zeros(B, Hkv, N + 1, D), v, L), {}, "must have one shape"),
    ]
    # The same checks hold for a quantized cache (head dim 32 vs q's 16).
    kq = QuantizedTensor.from_float(torch.zeros(B, Hkv, N, 32), group_size=32, bits=4)
    cases.append(((q, kq, kq, L), {}, "k has head dim 32 but q has head dim 16"))
    for args, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            ops.decode_attention(*args, 1.0, **kwargs)


def test_codes_kernel_takes_and_launch_policy():
    assert kernels.codes_rows(2, 256, 64) == 16 and kernels.codes_rows(8, 512, 64) == 64
    assert kernels.codes_path_reason(2, 256, 4, 64) is None  # Gemma 3 12B kv4
    assert kernels.codes_path_reason(4, 128, 8, 64) is None  # Llama 3 8B kv8
    assert "dense" in kernels.codes_path_reason(2, 256, 0, 64)
    assert "words per token" in kernels.codes_path_reason(2, 64, 4, 64)  # 8 words
    assert "accumulators" in kernels.codes_path_reason(8, 512, 4, 64)  # R·D = 32768
    # long splits at D=256: 64-token tiles capped at 128 registers; else ≤ 32k codes
    assert kernels.codes_launch(256, 4, 1024) == (64, 128)
    assert kernels.codes_launch(256, 4, 256) == (128, None)
    assert kernels.codes_launch(128, 8, 1024) == (128, None)
    assert kernels.codes_launch(512, 4, 256) == (64, None)


# ---- GPU: bf16, every head dim, long contexts, CUDA graphs ----


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,path", [(0, None), (4, "tensor_cores"), (8, "tensor_cores"),
                                       (4, "codes"), (8, "codes")])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 8, 8), (128, 32, 8), (256, 16, 8), (512, 8, 1)])
def test_gpu_within_twice_compat_error(dtype, bits, path, D, Hq, Hkv):
    """codes (the default for quantized caches) takes ≥ 16 words per token and R·D ≤ 8192:
    not kv4 D=64, nor 512/8/1 at g=64 (R=64); those cases are skipped."""
    q, k, v, lengths = make_case(5, Hq, Hkv, D, 4200, [1, 97, 1025, 4097, 0], bits, dtype, "cuda")
    if path and kernels.path_reason(path, q, k, v):
        pytest.skip(f"{path}: {kernels.path_reason(path, q, k, v)}")
    out = run_kernel(q, k, v, lengths, D**-0.5, path=path)
    assert not out.isnan().any()
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    err, err_compat = errors(out, q, k, v, lengths, D**-0.5)
    assert err <= 2 * err_compat, (err, err_compat)


@gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("Hq,Hkv,D,group_size", [(2, 1, 512, 64), (4, 1, 64, 32), (8, 2, 128, 128)])
def test_gpu_codes_kernel_other_shapes(bits, Hq, Hkv, D, group_size):
    """Head dims 512 (64 tokens per tile) and 64 (kv8 only: kv4 has 8 words per token),
    group sizes 32 and 128, G = 4."""
    q, k, v, lengths = make_case(3, Hq, Hkv, D, 3000, [2999, 1, 1500], bits, torch.bfloat16,
                                 "cuda", group_size=group_size)
    path = None if kernels.path_reason("codes", q, k, v) else "codes"
    out = run_kernel(q, k, v, lengths, D**-0.5, path=path)
    err, err_compat = errors(out, q, k, v, lengths, D**-0.5)
    assert not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)


@gpu
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("window,softcap", [(1024, None), (None, 50.0), (700, 30.0)])
@pytest.mark.parametrize("path", ["tensor_cores", "codes"])
def test_gpu_window_softcap_groups(group_size, window, softcap, path):
    q, k, v, lengths = make_case(3, 16, 8, 256, 3000, [2999, 600, 1500], 4, torch.bfloat16,
                                 "cuda", group_size=group_size)
    out = run_kernel(q, k, v, lengths, 0.0625, window, softcap, path)
    err, err_compat = errors(out, q, k, v, lengths, 0.0625, window, softcap)
    assert not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)


@gpu
@pytest.mark.parametrize("path", [None, "tensor_cores"])
def test_gpu_long_context_128k(path):
    q, k, v, lengths = make_case(1, 16, 8, 256, 131072, [131072], 4, torch.bfloat16, "cuda")
    out = run_kernel(q, k, v, lengths, 0.0625, path=path)
    err, err_compat = errors(out, q, k, v, lengths, 0.0625)
    assert err <= 2 * err_compat, (err, err_compat)


@gpu
@pytest.mark.parametrize("Hq,D,path", [(32, 128, None), (16, 256, None), (16, 256, "tensor_cores")])
def test_gpu_reproducible_and_batch_independent(Hq, D, path):
    q, k, v, lengths = make_case(8, Hq, 8, D, 5000, [4999, 3, 77, 1024, 2048, 4097, 1, 256],
                                 4, torch.bfloat16, "cuda")
    a = run_kernel(q, k, v, lengths, 0.088, path=path)
    assert torch.equal(a, run_kernel(q, k, v, lengths, 0.088, path=path))
    for i in (0, 5):
        alone = run_kernel(q[i:i + 1], batch_rows(k, i, i + 1), batch_rows(v, i, i + 1), lengths[i:i + 1],
                           0.088, path=path)
        assert torch.equal(alone[0], a[i])


@gpu
def test_gpu_cuda_graph_replay_with_growing_lengths(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    q, k, v, lengths = make_case(2, 16, 8, 256, 2048, [100, 500], 4, torch.bfloat16, "cuda")
    static_len = lengths.clone()
    ops.decode_attention(q, k, v, static_len, 0.0625)  # warm-up compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.decode_attention(q, k, v, static_len, 0.0625)
    for n in ([100, 500], [101, 777], [1000, 1300]):
        static_len.copy_(torch.tensor(n, dtype=torch.int32))
        for i, t in enumerate((k, v)):  # real data in the newly valid slots (NaN before)
            refill_(t, seed=i + n[1])
        graph.replay()
        torch.cuda.synchronize()
        eager = kernels.decode_attention_quantized_kv(q, k, v, static_len, 0.0625)
        assert torch.equal(out, eager)
    assert levers.counters()["decode_attention"] >= 2
