"""The wgmma product with the fragment kernel's arithmetic (`qmatmul_wgmma_factored`,
Gluon, Hopper only; its GPU cases marked `gpu`).

CPU: its A operand is made by the fragment kernel's own lines. GPU: within twice the
compat path's error against float64 at 1-256 rows, odd and split-K shapes, bias and
residual; a row's bits independent of the rows beside it over 1-256 rows; and the claim it
exists for: bit for bit `qmatmul_mma`'s output at 1-32 rows. That last one holds only if
wgmma adds a k16 chunk's products as mma.sync does; if it fails, `bench/mma_agreement.py`
says how the two differ (bench/NOTES.md, "Batched rows" → Open).
"""

import pytest
import torch

from qfuse.kernels import fragments, qmatmul_mma
from qfuse.kernels import qmatmul_wgmma_factored as fm
from qfuse.testing import check_bf16_product, on_hopper
from qfuse.testing import cuda_4bit_case as case


def test_the_codes_operand_is_the_fragment_kernels():
    lines = fm.CODES_ASM.splitlines()
    assert lines[1:-1] == qmatmul_mma.pair_lines("$4", ["$0", "$1", "$2", "$3"])
    assert not any("fma" in line for line in lines)  # 128 + code, not dequantized


needs_hopper = pytest.mark.skipif(not on_hopper(), reason="the wgmma kernels need sm_90")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("M", [1, 9, 32, 33, 100, 256])
@pytest.mark.parametrize("N,K", [(15360, 3840), (3840, 15360), (1000, 640), (37, 128)])
def test_gpu_within_twice_compat_error(group, M, N, K):
    if K % group:
        pytest.skip("K not a multiple of the group")
    if N * K > 1 << 24 and M not in (1, 256):
        pytest.skip("large shapes at the ends of the row range only (compile time)")
    x, w = case(M, N, K, group, seed=M + N + K)
    bias = torch.randn(N, device="cuda").bfloat16()
    res = torch.randn(M, N, device="cuda").bfloat16()
    out = fm.qmatmul_wgmma_factored(x, fragments.repack(w), bias, res)
    check_bf16_product(out, x, w, bias, res)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("wg", [1, 2])
def test_gpu_rows_independent_of_the_batch(wg):
    x, w = case(256, 3840, 4096, 64, seed=wg)
    f = fragments.repack(w)
    full = fm.qmatmul_wgmma_factored(x, f, wg=wg)
    for rows in (1, 8, 9, 32, 33, 64, 65, 200):
        assert torch.equal(fm.qmatmul_wgmma_factored(x[:rows], f, wg=wg), full[:rows]), rows


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("M", [1, 8, 9, 32])
@pytest.mark.parametrize("N,K", [(3840, 3840), (3840, 15360), (1000, 640)])
def test_gpu_bit_for_bit_the_fragment_kernel(M, N, K, group):
    """The same split of K (several at 3840 × 15360), the same blocks, the same fold:
    `qmatmul_mma`'s bits, if the two instructions sum a k16 chunk alike."""
    x, w = case(M, N, K, group, seed=M * N + K)
    f = fragments.repack(w)
    bias = torch.randn(N, device="cuda").bfloat16()
    res = torch.randn(M, N, device="cuda").bfloat16()
    want = qmatmul_mma.qmatmul_mma(x, f, bias, res)
    assert torch.equal(fm.qmatmul_wgmma_factored(x, f, bias, res), want)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("N,K", [(4096, 3840), (3840, 15360)])  # Gemma 3 12B Q/K/V, down
def test_gpu_dispatched_1_to_256_rows_are_one_class(monkeypatch, N, K):
    """With it dispatched and the ring at the fragment kernel's split, `ops.linear` gives
    a row the same bits at every batch size from 1 to 256 (issue 30, item 5)."""
    from qfuse import ops
    from qfuse.kernels import qmatmul_ring

    monkeypatch.setattr(fm, "DISPATCHED", True)
    monkeypatch.setattr(qmatmul_ring, "AT_FRAGMENT_SPLIT", True)
    x, w = case(256, N, K, 64, seed=N)
    f = fragments.repack(w)
    assert ops.summing_class(ops.fragment_route(x, f)) == "fragment"
    full = ops.linear(x, f)
    for rows in (1, 8, 9, 32, 33, 64, 255):
        assert torch.equal(ops.linear(x[:rows], f), full[:rows]), rows


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("N,K", [(3840, 3840), (3840, 15360)])
def test_gpu_overlapped_blocks_give_the_same_bits(N, K):
    """With each block's products issued before the previous block's fold (``overlap``),
    the same sums in the same order: `qmatmul_mma`'s bits at 1-32 rows, and the
    non-overlapped kernel's at 33-256."""
    x, w = case(256, N, K, 64, seed=K)
    f = fragments.repack(w)
    full = fm.qmatmul_wgmma_factored(x, f, overlap=True)
    assert torch.equal(full, fm.qmatmul_wgmma_factored(x, f, overlap=False))
    for rows in (1, 9, 32):
        assert torch.equal(fm.qmatmul_wgmma_factored(x[:rows], f, overlap=True),
                           qmatmul_mma.qmatmul_mma(x[:rows], f))
