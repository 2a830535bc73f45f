"""A prefill's K/V written all rows at once (`prompt_write`) holds the bits a row-by-row
quantize would: full and ring layers, whole prompts and a chunk after cached tokens,
rows of different lengths (an empty one too), dense and 4/8-bit stores; on the GPU the
kv_append kernel writes them."""

import pytest
import torch

from qfuse.quant import QuantizedTensor, quantize
from qfuse.runtime.cache import LayerCache

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def expected_store(layer, chunks, dtype):
    """The store a row-by-row write gives: every kept position quantized alone."""
    want = {}
    for k, lengths, past in chunks:
        for b, L in enumerate(lengths):
            first = max(past, L - layer.capacity) if layer.ring else past
            for p in range(first, L):
                want[(b, p % layer.capacity if layer.ring else p)] = k[b, :, p - past]
    return want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [0, 4, 8])
@pytest.mark.parametrize("capacity,ring", [(64, False), (16, True)])
def test_prompt_write_equals_row_by_row(device, bits, capacity, ring):
    if device == "cuda":
        pytest.importorskip("triton")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    B, Hkv, D = 3, 2, 64
    layer = LayerCache(B, Hkv, capacity, D, dtype, device, bits, 32, ring)
    first = torch.randn(B, Hkv, 20, D, dtype=dtype, device=device)
    second = torch.randn(B, Hkv, 12, D, dtype=dtype, device=device)
    lengths1, lengths2 = [20, 7, 0], [32, 28, 21]  # the second chunk after 20 cached
    layer.write_prompt(first, first, lengths1)
    layer.write_prompt(second, second, lengths2, past=20)
    want = expected_store(layer, [(first, lengths1, 0), (second, lengths2, 20)], dtype)
    # Row 1 holds 7 tokens, then the chunk's positions 20..27: 7..19 never written.
    for (b, slot), x in want.items():
        if isinstance(layer.k, QuantizedTensor):
            packed, scales, biases = quantize(x, 32, bits)
            assert torch.equal(layer.k.packed[b, :, slot], packed), (b, slot)
            assert torch.equal(layer.k.scales[b, :, slot], scales.to(dtype))
            assert torch.equal(layer.k.biases[b, :, slot], biases.to(dtype))
        else:
            assert torch.equal(layer.k[b, :, slot], x), (b, slot)
    untouched = [(b, s) for b in range(B) for s in range(capacity) if (b, s) not in want]
    assert untouched, "the case leaves some slots unwritten"
    for b, s in untouched:  # nothing written where no kept token goes
        store = layer.v.packed if isinstance(layer.v, QuantizedTensor) else layer.v
        assert not store[b, :, s].any(), (b, s)
