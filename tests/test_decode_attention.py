"""Decode attention under the Triton CPU interpreter (fp16, small shapes), the
KV append op, dispatch and input validation. Big shapes and bf16: tests/gpu."""

import pytest
import torch

from qfuse import levers, ops
from qfuse.quant import QuantizedTensor, quantize

from qfuse.testing import errors, make_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = pytest.importorskip("qfuse.kernels.decode_attention")


def run_kernel(q, k, v, lengths, scale, window=None, softcap=None, path=None):
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    # "prefetch": the tensor-core kernel with scales/biases one tile ahead (opt-in)
    kernels.decode_attention_quantized_kv(q, k, v, lengths, scale, window, softcap, out=out,
                                          _path=None if path == "prefetch" else path,
                                          _prefetch=path == "prefetch")
    return out


@pytest.mark.parametrize("bits,path,D,Hq", [
    (0, None, 64, 4), (4, "cuda_cores", 64, 4), (4, "tensor_cores", 64, 4),
    (8, "cuda_cores", 64, 4), (8, "tensor_cores", 64, 4), (4, "prefetch", 64, 4),
    (8, "prefetch", 64, 4),
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
    one = QuantizedTensor(k.packed[:1], k.scales[:1], k.biases[:1], k.group_size, k.bits)
    one_v = QuantizedTensor(v.packed[:1], v.scales[:1], v.biases[:1], v.group_size, v.bits)
    alone = run_kernel(q[:1], one, one_v, lengths[:1], 0.1, path=path)
    assert torch.equal(alone[0], a[0])


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


def test_unsupported_head_dim_falls_back(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    q, k, v, lengths = make_case(1, 2, 1, 32, 40, [33], 0, torch.float16, DEVICE)
    ops.decode_attention(q, k, v, lengths, 0.125)
    assert levers.counters() == {"ref:decode_attention": 1}


@pytest.mark.parametrize(
    "change,match",
    [
        ({"Hkv": 3}, "multiple of kv heads"),
        ({"D_kv": 32}, "head dim"),
        ({"lengths": [41]}, "lengths must lie"),
        ({"lengths": [-1]}, "lengths must lie"),
    ],
)
def test_bad_input_raises(change, match):
    D_kv = change.get("D_kv", 64)
    q = torch.randn(1, 4, 64, dtype=torch.float16)
    k = torch.randn(1, change.get("Hkv", 2), 40, D_kv, dtype=torch.float16)
    lengths = torch.tensor(change.get("lengths", [3]), dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        ops.decode_attention(q, k, k, lengths, 0.125)


def test_bad_lengths_dtype_and_window_raise():
    q = torch.randn(1, 2, 64, dtype=torch.float16)
    k = torch.randn(1, 1, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="lengths"):
        ops.decode_attention(q, k, k, torch.tensor([3.0]), 0.1)
    with pytest.raises(ValueError, match="window"):
        ops.decode_attention(q, k, k, torch.tensor([3], dtype=torch.int32), 0.1, window=0)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kv_append_bit_exact_with_quantize(bits, dtype, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    B, H, N, D = 3, 2, 16, 128
    cache = QuantizedTensor.from_float(torch.randn(B, H, N, D, dtype=dtype, device=DEVICE), 32, bits)
    x = torch.randn(B, H, D, dtype=dtype, device=DEVICE) * 3
    x[0, 0, :32] = 0.5  # a constant group: the q0 == 0 branch
    x[1, 1, 32:64] = -torch.rand(32, device=DEVICE).to(dtype)  # all negative
    positions = torch.tensor([0, 7, 15], dtype=torch.int32, device=DEVICE)
    before = cache.packed.clone()
    ops.kv_append(x, positions, cache)
    assert levers.counters() == {"kv_append": 1}
    p, s, b = quantize(x, 32, bits)
    for i, pos in enumerate(positions.tolist()):
        assert torch.equal(cache.packed[i, :, pos].view(torch.int32), p[i].view(torch.int32))
        assert torch.equal(cache.scales[i, :, pos], s[i])
        assert torch.equal(cache.biases[i, :, pos], b[i])
    untouched = torch.ones(B, N, dtype=torch.bool)
    untouched[torch.arange(B), positions.long()] = False
    assert torch.equal(cache.packed.view(torch.int32)[untouched.nonzero(as_tuple=True)[0], :,
                                                      untouched.nonzero(as_tuple=True)[1]],
                       before.view(torch.int32)[untouched.nonzero(as_tuple=True)[0], :,
                                                untouched.nonzero(as_tuple=True)[1]])


def test_kv_append_reference_path_matches_kernel(monkeypatch):
    x = torch.randn(2, 2, 64, dtype=torch.float16, device=DEVICE)
    positions = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)
    caches = [QuantizedTensor.from_float(torch.zeros(2, 2, 4, 64, dtype=torch.float16,
                                                     device=DEVICE), 64, 4) for _ in range(2)]
    monkeypatch.setenv("QFUSE_TIER", "compat")
    ops.kv_append(x, positions, caches[0])
    monkeypatch.setenv("QFUSE_TIER", "fast")
    ops.kv_append(x, positions, caches[1])
    assert levers.counters() == {"ref:kv_append": 1, "kv_append": 1}
    assert torch.equal(caches[0].packed.view(torch.int32), caches[1].packed.view(torch.int32))
    assert torch.equal(caches[0].scales, caches[1].scales)


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
