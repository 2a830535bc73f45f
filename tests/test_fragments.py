"""Repacking 4-bit MLX weights into mma fragment order: back to MLX words bit for bit at odd
shapes (on the GPU too, marked `gpu`, at the Gemma 3 12B shape), the documented position of
every code, and the inputs it refuses. The product on the GPU: test_qmatmul_mma.py."""

import gc
import weakref

import pytest
import torch

from qfuse.kernels.products import fragments
from qfuse.quant import QuantizedTensor, unpack


@pytest.mark.parametrize("N,K,group,device", [
    (5, 128, 64, "cpu"), (37, 256, 128, "cpu"), (16, 64, 64, "cpu"), (33, 384, 64, "cpu"),
    pytest.param(15360, 3840, 64, "cuda", marks=pytest.mark.gpu),
    pytest.param(37, 256, 128, "cuda", marks=pytest.mark.gpu)])
def test_round_trip_to_mlx_words(N, K, group, device):
    torch.manual_seed(N + K)
    w = QuantizedTensor.from_float(torch.randn(N, K).bfloat16().to(device), group, 4)
    f = fragments.repack(w)
    assert f.words.shape == (-(-N // 16), K // 64, 32, 4) and f.scales.shape[1] == K // group
    assert torch.equal(fragments.repack(w, tiles_per_chunk=1).words, f.words)  # chunked
    back = fragments.to_mlx(f)
    assert torch.equal(back.packed.view(torch.int32), w.packed.view(torch.int32))
    assert torch.equal(back.scales.view(torch.int16), w.scales.view(torch.int16))
    assert torch.equal(back.biases.view(torch.int16), w.biases.view(torch.int16))


def test_the_words_kernels_tile_rows_as_fragments_does():
    fragment_words = pytest.importorskip("qfuse.kernels.products.fragment_words")  # needs Triton
    assert fragment_words.TILE_ROWS == fragments.TILE_N


def test_code_positions_follow_the_docstring():
    """Nibble p = 4e + 2h + r of word j, lane 4g + q, block (t, kb) holds the code of row
    16t + 8r + g at k = 64kb + 16q + 4j + 2h + e; scales pair rows g and g + 8."""
    torch.manual_seed(0)
    N, K = 40, 192
    w = QuantizedTensor.from_float(torch.randn(N, K).bfloat16(), 64, 4)
    codes = unpack(w.packed, 4)
    f = fragments.repack(w)
    words = f.words.to(torch.int64) & 0xFFFFFFFF
    for t, kb, g, q, j, e, h, r in [(0, 0, 0, 0, 0, 0, 0, 0), (1, 2, 5, 3, 2, 1, 0, 1),
                                    (2, 1, 7, 1, 3, 1, 1, 0), (0, 2, 3, 2, 1, 0, 1, 1)]:
        row, k = 16 * t + 8 * r + g, 64 * kb + 16 * q + 4 * j + 2 * h + e
        nibble = (words[t, kb, 4 * g + q, j] >> (4 * (4 * e + 2 * h + r))) & 0xF
        expected = codes[row, k] if row < N else 0
        assert nibble == expected, (t, kb, g, q, j, e, h, r)
    s = f.scales.to(torch.int64) & 0xFFFFFFFF
    lo = (s[1, 2, 3] & 0xFFFF).to(torch.int16).view(torch.bfloat16)
    hi = (s[1, 2, 3] >> 16).to(torch.int16).view(torch.bfloat16)
    assert lo == w.scales[16 + 3, 2] and hi == w.scales[16 + 8 + 3, 2]


@pytest.mark.parametrize("bits,group,dtype,match", [
    (8, 64, torch.bfloat16, "8-bit"), (4, 32, torch.bfloat16, "group size 32"),
    (4, 64, torch.float16, "scales")])
def test_refuses_what_the_kernel_cannot_take(bits, group, dtype, match):
    w = QuantizedTensor.from_float(torch.randn(16, 128).to(dtype), group, bits)
    assert match in fragments.unsupported_reason(w)
    with pytest.raises(ValueError, match=match):
        fragments.repack(w)


def _bf16_pair(word: int) -> tuple[float, float]:
    """An int32 register as the two bf16 values it holds (low half first)."""
    halves = torch.tensor([word & 0xFFFF, (word >> 16) & 0xFFFF], dtype=torch.int32)
    return tuple(halves.to(torch.int16).view(torch.bfloat16).double().tolist())


def test_fragment_math_reproduces_the_product():
    """The fragment kernel's arithmetic, emulated register by register with the PTX ISA's
    mma.m16n8k16 fragment layouts (A: a0a1 row g cols 2q+{0,1}, a2a3 row g+8, a4..a7 cols
    +8; B: b0b1 rows 2q+{0,1}, b2b3 rows +8, column g; C: c0c1 row g cols 2q+{0,1},
    c2c3 row g+8): 128 + c from one LOP3 per pair, B from the thread's 16 consecutive x,
    Σx from an all-ones A, then s·D + (b − 128·s)·Σx. It must give x·dequant(W)ᵀ."""
    torch.manual_seed(3)
    N, K, M = 20, 128, 3
    w = QuantizedTensor.from_float(torch.randn(N, K).bfloat16(), 64, 4)
    x = torch.randn(M, K).bfloat16()
    f = fragments.repack(w)
    T, KB = f.words.shape[:2]
    xi = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [M, K/2] bf16 pairs
    words = f.words.to(torch.int64) & 0xFFFFFFFF
    y = torch.zeros(M, T * 16, dtype=torch.float64)
    for t in range(T):
        for kb in range(KB):
            D = torch.zeros(16, 8, dtype=torch.float64)
            E = torch.zeros(16, 8, dtype=torch.float64)
            for j in range(4):
                A = torch.zeros(16, 16, dtype=torch.float64)
                B = torch.zeros(16, 8, dtype=torch.float64)
                for lane in range(32):
                    g, q = lane // 4, lane % 4
                    word = int(words[t, kb, lane, j])
                    a = [v for r in range(4)
                         for v in _bf16_pair(((word >> (4 * r)) & 0x000F000F) | 0x43004300)]
                    A[g, 2 * q:2 * q + 2] = torch.tensor(a[0:2], dtype=torch.float64)
                    A[g + 8, 2 * q:2 * q + 2] = torch.tensor(a[2:4], dtype=torch.float64)
                    A[g, 2 * q + 8:2 * q + 10] = torch.tensor(a[4:6], dtype=torch.float64)
                    A[g + 8, 2 * q + 8:2 * q + 10] = torch.tensor(a[6:8], dtype=torch.float64)
                    if g < M:  # B column g is row g of x; the kernel's x registers 2j, 2j+1
                        b = (_bf16_pair(int(xi[g, kb * 32 + 8 * q + 2 * j]))
                             + _bf16_pair(int(xi[g, kb * 32 + 8 * q + 2 * j + 1])))
                        B[[2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9], g] = torch.tensor(
                            b, dtype=torch.float64)
                D += A @ B
                E += torch.ones(16, 16, dtype=torch.float64) @ B
            for lane in range(32):
                g, q = lane // 4, lane % 4
                s_lo, s_hi = _bf16_pair(int(f.scales[t, kb, g]) & 0xFFFFFFFF)
                b_lo, b_hi = _bf16_pair(int(f.biases[t, kb, g]) & 0xFFFFFFFF)
                for i in range(4):  # c0..c3 of this lane
                    row, col = g + 8 * (i // 2), 2 * q + i % 2
                    s, b = (s_lo, b_lo) if i < 2 else (s_hi, b_hi)
                    if col < M:
                        y[col, 16 * t + row] += s * D[row, col] + (b - 128 * s) * E[row, col]
    ref = x.double() @ w.dequantize(torch.float32).double().T
    torch.testing.assert_close(y[:, :N], ref, rtol=0, atol=1e-9)


def test_stacked_fragments_are_the_parts_back_to_back():
    """fragments.concat of Q/K/V-like parts gives, back in MLX words, the parts stacked
    along N bit for bit; a part with rows past a whole tile (not last) is refused."""
    parts = [QuantizedTensor.from_float(torch.randn(n, 256).bfloat16(), 64, 4) for n in (64, 32, 37)]
    stacked = fragments.to_mlx(fragments.concat([fragments.repack(w) for w in parts]))
    for name in ("packed", "scales", "biases"):
        want = torch.cat([getattr(w, name).view(torch.int32 if name == "packed" else
                                                torch.int16) for w in parts])
        got = getattr(stacked, name).view(torch.int32 if name == "packed" else torch.int16)
        assert torch.equal(got, want), name
    with pytest.raises(ValueError, match="not whole tiles"):
        fragments.concat([fragments.repack(parts[2]), fragments.repack(parts[0])])


def test_linear_stacked_off_the_gpu_is_the_separate_products():
    """Where the fragment kernel cannot run, ops.linear_stacked is each linear on its own,
    bit for bit, biases included."""
    from qfuse import ops
    x = torch.randn(3, 256)
    ws = [QuantizedTensor.from_float(torch.randn(n, 256), 64, 4) for n in (32, 16)]
    biases = [torch.randn(32), None]
    for got, w, b in zip(ops.linear_stacked(x, ws, biases), ws, biases):
        assert torch.equal(got, ops.linear(x, w, b))


def test_write_counts_generations():
    """A rewritten weight changes generation, which keys forms built from several."""
    w = QuantizedTensor.from_float(torch.randn(16, 64), 64, 4)
    before = w.generation
    w.write_((slice(0, 1),), torch.zeros(1, 64))
    assert w.generation == before + 1


def test_stacked_form_follows_a_changed_part():
    """The stacked Q/K/V form is rebuilt when a later part's words change in place (the
    storage's version, not the tensor's id, keys it), and only the latest is kept."""
    from qfuse.kernels.products.qmatmul_mma import stacked_fragments_of

    q, k = (QuantizedTensor.from_float(torch.randn(n, 128).bfloat16(), 64, 4) for n in (32, 16))
    first = stacked_fragments_of([q, k])
    assert stacked_fragments_of([q, k]) is first  # built once
    k.packed.view(torch.int32)[0, 0] ^= 1  # in place, as a checkpoint reload would
    second = stacked_fragments_of([q, k])
    assert second is not first and not torch.equal(second.words, first.words)
    assert torch.equal(fragments.to_mlx(second).packed.view(torch.int32)[32:],
                       k.packed.view(torch.int32))
    stale = weakref.ref(first)
    del first
    gc.collect()
    assert stale() is None  # the superseded version is not kept with q


def test_stacked_bias_is_kept_and_follows_its_parts():
    """The stacked biases: zeros where a part has none, built once, rebuilt when a bias
    changes in place."""
    from qfuse.kernels.products.qmatmul_mma import stacked_bias

    ws = [QuantizedTensor.from_float(torch.randn(n, 64).bfloat16(), 64, 4) for n in (16, 8)]
    b = torch.randn(16).bfloat16()
    assert stacked_bias(ws, [None, None]) is None
    first = stacked_bias(ws, [b, None])
    assert torch.equal(first, torch.cat([b, torch.zeros(8).bfloat16()]))
    assert stacked_bias(ws, [b, None]) is first
    b.add_(1)
    assert torch.equal(stacked_bias(ws, [b, None])[:16], b)
