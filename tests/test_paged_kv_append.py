"""KV append through a block table: one token per sequence written into its page of a
paged pool, bit-exact with `quant.quantize`, every other page untouched; the reference
path the same; a table entry that names no page writes nothing (kernel) or is refused
(reference). CPU cases run under the Triton interpreter."""

import pytest
import torch

from qfuse import levers, ops
from qfuse.quant import QuantizedTensor, quantize
from qfuse.testing import kernel_device

DEVICE = kernel_device()
PAGE = 16


def pool_and_table(bits, dtype, num_pages=12, B=3, P=4, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    data = torch.randn(num_pages, 2, PAGE, 64, generator=g).to(dtype).to(DEVICE)
    pool = QuantizedTensor.from_float(data, 32, bits) if bits else data
    table = torch.randperm(num_pages, generator=g)[:B * P].reshape(B, P).to(torch.int32)
    return pool, table.to(DEVICE)


def words(t):
    return t.packed.view(torch.int32) if isinstance(t, QuantizedTensor) else t


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_paged_append_bit_exact_with_quantize(bits, dtype, monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    pool, table = pool_and_table(bits, dtype)
    x = torch.randn(3, 2, 64, dtype=dtype, device=DEVICE) * 3
    x[0, 0, :32] = 0.5  # a constant group: the q0 == 0 branch
    positions = torch.tensor([0, 17, 63], dtype=torch.int32, device=DEVICE)  # pages 0, 1, 3
    before = words(pool).clone()
    ops.kv_append(x, positions, pool, block_table=table)
    assert levers.counters() == {"kv_append": 1}
    p, s, b = quantize(x, 32, bits)
    written = torch.zeros(pool.shape[:3], dtype=torch.bool)
    for i, pos in enumerate(positions.tolist()):
        page, place = int(table[i, pos // PAGE]), pos % PAGE
        assert torch.equal(pool.packed[page, :, place].view(torch.int32), p[i].view(torch.int32))
        assert torch.equal(pool.scales[page, :, place], s[i])
        assert torch.equal(pool.biases[page, :, place], b[i])
        written[page, :, place] = True
    assert torch.equal(words(pool)[~written], before[~written])  # nothing else moved


@pytest.mark.parametrize("bits", [0, 4])
def test_paged_reference_matches_kernel(bits, monkeypatch):
    x = torch.randn(3, 2, 64, dtype=torch.float16, device=DEVICE)
    positions = torch.tensor([15, 16, 40], dtype=torch.int32, device=DEVICE)
    (a, table), (b, _) = pool_and_table(bits, torch.float16), pool_and_table(bits, torch.float16)
    monkeypatch.setenv("QFUSE_TIER", "compat")
    ops.kv_append(x, positions, a, block_table=table)
    monkeypatch.setenv("QFUSE_TIER", "fast")
    ops.kv_append(x, positions, b, block_table=table)
    kernel = "kv_append" if bits else "ref:kv_append"  # the kernel writes quantized caches
    assert levers.counters().get(kernel) == (1 if bits else 2)
    assert torch.equal(words(a), words(b))
    if bits:
        assert torch.equal(a.scales, b.scales) and torch.equal(a.biases, b.biases)
    page = int(table[1, 1])  # position 16: the second page's first place
    assert torch.equal(a[page, :, 0] if not bits else a.dequantize()[page, :, 0],
                       x[1] if not bits else quantize_dequantize(x[1]))


def quantize_dequantize(x):
    return QuantizedTensor.from_float(x, 32, 4).dequantize()


def test_a_page_not_held_is_never_written(monkeypatch):
    pool, table = pool_and_table(4, torch.float16)
    table[1, 2] = -1
    x = torch.randn(3, 2, 64, dtype=torch.float16, device=DEVICE)
    positions = torch.tensor([1, 33, 2], dtype=torch.int32, device=DEVICE)  # row 1: page -1
    monkeypatch.setenv("QFUSE_TIER", "fast")
    before = words(pool).clone()
    ops.kv_append(x, positions, pool, block_table=table)
    changed = (words(pool) != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == sorted([int(table[0, 0]), int(table[2, 0])])
    monkeypatch.setenv("QFUSE_TIER", "compat")
    with pytest.raises(ValueError, match="the block table names pages in \\[-1,"):
        ops.kv_append(x, positions, pool, block_table=table)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 64\)"):
        ops.kv_append(x, positions + 40, pool, block_table=table)
    with pytest.raises(ValueError, match="block_table must be int32"):
        ops.kv_append(x, positions, pool, block_table=table.long())
