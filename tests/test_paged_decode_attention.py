"""Decode attention over a paged KV cache (a pool of pages read through a block table):
the reference and each split kernel against the slotted cache holding the same tokens,
with the pages scattered in the pool, ragged lengths, length 0, GQA, windows; batch
independence; dispatch and refusals. CPU cases run under the Triton interpreter (fp16,
small shapes); the `gpu` case takes bf16."""

import pytest
import torch

from qfuse import levers, ops, reference
from qfuse.testing import errors, kernel_device, make_case, paged_copy

DEVICE = kernel_device()
kernels = pytest.importorskip("qfuse.kernels.attention.decode_attention")


def run_kernel(q, k, v, lengths, scale, window=None, softcap=None, path=None, table=None):
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    kernels.decode_attention_quantized_kv(q, k, v, lengths, scale, window, softcap, out=out,
                                          launch=kernels.AttentionLaunch(path=path),
                                          block_table=table)
    return out


@pytest.mark.parametrize("bits", [0, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("window", [None, 40])
def test_paged_reference_equals_slotted(bits, dtype, window):
    q, k, v, lengths = make_case(3, 4, 2, 64, 96, [0, 37, 96], bits, dtype, DEVICE)
    kp, table = paged_copy(k, lengths, 16, seed=1, window=window)
    vp, _ = paged_copy(v, lengths, 16, seed=1, window=window)
    assert (table == -1).any()  # pages past the lengths (and before a window) are not held
    slotted = reference.decode_attention(q, k, v, lengths, 0.125, window)
    paged = reference.paged_decode_attention(q, kp, vp, table, lengths, 0.125, window)
    assert torch.equal(paged, slotted)
    assert not paged.isnan().any()


@pytest.mark.parametrize("bits,path,D,Hq,page", [
    (0, None, 64, 4, 16), (0, None, 64, 8, 64), (4, "tensor_cores", 64, 4, 16),
    (8, "tensor_cores", 64, 8, 32),
    # the codes kernel needs ≥ 16 words per token; Hq 4 and 8 are G = 2 and 4
    (4, "codes", 128, 4, 16), (4, "codes", 128, 8, 64), (8, "codes", 64, 4, 32)])
@pytest.mark.parametrize("window,softcap", [(None, None), (50, None), (None, 20.0)])
def test_paged_kernel_is_the_slotted_kernel(bits, path, D, Hq, page, window, softcap):
    # Nmax 320: two splits of 256; lengths cross split, tile and page boundaries, one is 0.
    q, k, v, lengths = make_case(4, Hq, 2, D, 320, [1, 97, 0, 300], bits, torch.float16, DEVICE)
    kp, table = paged_copy(k, lengths, page, seed=2, window=window)
    vp, _ = paged_copy(v, lengths, page, seed=2, window=window)
    paged = run_kernel(q, kp, vp, lengths, 0.125, window, softcap, path, table)
    slotted = run_kernel(q, k, v, lengths, 0.125, window, softcap, path)
    # Same tokens in the same splits and tiles: the same bits, whatever the pages' order.
    assert torch.equal(paged, slotted)
    assert torch.equal(paged[2], torch.zeros_like(paged[2]))  # length 0: defined zeros
    err, err_compat = errors(paged, q, k, v, lengths, 0.125, window, softcap)
    assert err <= 2 * err_compat, (err, err_compat)


def test_a_page_size_that_straddles_tiles():
    """24-token pages: a tile of the kernel reads from two or three pages."""
    q, k, v, lengths = make_case(2, 4, 2, 64, 240, [239, 50], 8, torch.float16, DEVICE)
    kp, table = paged_copy(k, lengths, 24, seed=3)
    vp, _ = paged_copy(v, lengths, 24, seed=3)
    paged = run_kernel(q, kp, vp, lengths, 0.1, path="tensor_cores", table=table)
    assert torch.equal(paged, run_kernel(q, k, v, lengths, 0.1, path="tensor_cores"))


@pytest.mark.parametrize("bits,D", [(0, 64), (4, 128)])
def test_paged_result_is_a_function_of_the_sequence_alone(bits, D):
    q, k, v, lengths = make_case(3, 4, 2, D, 288, [260, 5, 77], bits, torch.float16, DEVICE)
    kp, table = paged_copy(k, lengths, 32, seed=4)
    vp, _ = paged_copy(v, lengths, 32, seed=4)
    together = run_kernel(q, kp, vp, lengths, 0.1, table=table)
    for b in range(3):  # each sequence alone, its pages where they are in the same pool
        alone = run_kernel(q[b:b + 1], kp, vp, lengths[b:b + 1], 0.1, table=table[b:b + 1])
        assert torch.equal(alone[0], together[b])


def test_ops_dispatches_a_paged_cache(monkeypatch):
    q, k, v, lengths = make_case(2, 4, 2, 64, 64, [33, 64], 8, torch.float16, DEVICE)
    kp, table = paged_copy(k, lengths, 16, seed=5)
    vp, _ = paged_copy(v, lengths, 16, seed=5)
    monkeypatch.setenv("QFUSE_TIER", "fast")
    fast = ops.decode_attention(q, kp, vp, lengths, 0.125, block_table=table)
    monkeypatch.setenv("QFUSE_TIER", "compat")
    compat = ops.decode_attention(q, kp, vp, lengths, 0.125, block_table=table)
    assert levers.counters() == {"decode_attention": 1, "ref:decode_attention": 1}
    assert torch.equal(compat, reference.decode_attention(q, k, v, lengths, 0.125))
    err, err_compat = errors(fast, q, k, v, lengths, 0.125)
    assert err <= 2 * err_compat, (err, err_compat)


def test_bad_block_tables_are_refused():
    q, k, v, lengths = make_case(2, 4, 2, 64, 64, [33, 64], 0, torch.float16, DEVICE)
    kp, table = paged_copy(k, lengths, 16, seed=6)
    vp, _ = paged_copy(v, lengths, 16, seed=6)
    with pytest.raises(ValueError, match="block_table must be int32 of shape"):
        ops.decode_attention(q, kp, vp, lengths, 0.1, block_table=table.long())
    with pytest.raises(ValueError, match="block_table must be int32 of shape"):
        ops.decode_attention(q, kp, vp, lengths, 0.1, block_table=table[:1])
    holed = table.clone()
    holed[0, 2] = -1  # tokens 32..47: sequence 0 attends token 32
    with pytest.raises(ValueError, match=r"block_table\[0, 2\] = -1 is not a page"):
        ops.decode_attention(q, kp, vp, lengths, 0.1, block_table=holed)
    holed[0, 2] = kp.shape[0]
    with pytest.raises(ValueError, match="is not a page of the pool"):
        ops.decode_attention(q, kp, vp, lengths, 0.1, block_table=holed)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, Nmax=64\]"):
        ops.decode_attention(q, kp, vp, lengths + 1, 0.1, block_table=table)
    with pytest.raises(ValueError, match="ws kernel.*paged cache"):
        run_kernel(q, kp, vp, lengths, 0.1, path="ws", table=table)
    assert kernels.unsupported_reason(q, kp, vp, table.long()) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("bits,path", [(0, None), (4, "codes"), (8, "codes"),
                                       (4, "tensor_cores")])
def test_gpu_paged_kernel_is_the_slotted_kernel(bits, path):
    q, k, v, lengths = make_case(8, 16, 8, 256, 4096, [1, 4096, 0, 3000, 17, 2049, 256, 999],
                                 bits, torch.bfloat16, "cuda")
    for window in (None, 1024):
        kp, table = paged_copy(k, lengths, 64, seed=7, window=window)
        vp, _ = paged_copy(v, lengths, 64, seed=7, window=window)
        paged = run_kernel(q, kp, vp, lengths, 0.0625, window, path=path, table=table)
        assert torch.equal(paged, run_kernel(q, k, v, lengths, 0.0625, window, path=path))
