"""Each block's Σx made once ahead (`kernels/block_sums.py`) for the fragment kernels at
9-32 rows (``sums=True``): the same bits as the all-ones mma they make in every warp.

CPU: the step that takes the sums is the fragment kernel's step with the all-ones mma
lines replaced by moves of the given sums, instruction for instruction otherwise (so the
fold of the scales and biases is unchanged); the sums kernel chains the very lines the
step drops; one column tile (1-8 rows) never takes them. GPU (marked `gpu`): the sums
against float64; `qmatmul_mma` and the TMA-ring kernel (Hopper) bitwise equal with and
without them at 9-32 rows over odd and split-K shapes, bias and residual; a row of a
32-row product with them bitwise that row alone; CUDA-graph replay.
"""

import pytest
import torch

from qfuse.kernels import fragments
from qfuse.kernels import qmatmul_mma as mm
from qfuse.testing import check_bf16_product, on_hopper
from qfuse.testing import cuda_4bit_case as case


def test_the_step_with_sums_is_the_step_less_its_all_ones_mma():
    plain = mm.column_step_asm().splitlines()
    given = mm.column_step_asm(sums=(34, 35, 34, 35)).splitlines()
    sum_lines = [line for line in plain if "{one, one, one, one}" in line]
    assert len(sum_lines) == 4  # one per k16 step
    moves = ["mov.f32 e0, $34;", "mov.f32 e1, $35;", "mov.f32 e2, $34;", "mov.f32 e3, $35;"]
    # the same lines in the same order, but the four Σx mmas, with the moves before the fold
    assert [line for line in plain if line not in sum_lines] == [
        line for line in given if line not in moves]
    assert given.index(moves[0]) == plain.index(sum_lines[-1]) - 3
    # the sums kernel chains those four mmas from zero over the same B registers
    ahead = mm.sums_asm().splitlines()
    chained = [line for line in ahead if "{one, one, one, one}" in line]
    for j, (mine, theirs) in enumerate(zip(chained, sum_lines)):
        assert mine.replace("$0, $1, $2, $3", "e0, e1, e2, e3").replace(
            f"${4 + 2 * j}, ${5 + 2 * j}", f"${20 + 2 * j}, ${21 + 2 * j}") == theirs
    assert [line for line in ahead if line.startswith("mov.f32")] == [
        f"mov.f32 ${i}, 0f00000000;" for i in range(4)]


def test_one_column_tile_makes_its_own_sums():
    x = torch.zeros(8, 128, dtype=torch.bfloat16)
    assert mm.x_sums(x, True, pdl=False) is None  # 1-8 rows: nothing is launched
    assert mm.x_sums(torch.zeros(9, 128, dtype=torch.bfloat16), False, pdl=False) is None


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("M", [9, 17, 32])
def test_gpu_block_sums_against_float64(M):
    from qfuse.kernels.block_sums import block_sums

    x = torch.randn(M, 640, device="cuda").bfloat16()
    e = block_sums(x)
    nt = -(-M // 8)
    assert e.shape == (10, 8 * nt) and e.dtype == torch.float32
    rows = torch.arange(8 * nt, device="cuda").clamp(max=M - 1)  # past M: the last row
    exact = x.double()[rows].reshape(8 * nt, 10, 64).sum(-1).T
    assert torch.allclose(e.double(), exact, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("M", [9, 16, 24, 32])
@pytest.mark.parametrize("N,K", [(15360, 3840), (3840, 15360), (1000, 640), (37, 128)])
@pytest.mark.parametrize("kernel", ["mma", "ring"])
def test_gpu_sums_ahead_give_the_same_bits(kernel, N, K, M, group):
    if kernel == "ring" and not on_hopper():
        pytest.skip("the ring kernel needs sm_90")
    if K % group:
        pytest.skip("K not a multiple of the group")
    if N * K > 1 << 24 and M not in (9, 32):
        pytest.skip("large shapes at the ends of the row range only (compile time)")
    from qfuse.kernels import qmatmul_ring

    product = mm.qmatmul_mma if kernel == "mma" else qmatmul_ring.qmatmul_ring
    x, w = case(M, N, K, group, seed=M + N + K)
    f = fragments.repack(w)
    bias = torch.randn(N, device="cuda").bfloat16()
    res = torch.randn(M, N, device="cuda").bfloat16()
    made = product(x, f, bias, res, sums=False)
    ahead = product(x, f, bias, res, sums=True)
    check_bf16_product(ahead, x, w, bias, res)
    assert torch.equal(ahead, made)


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_row_with_sums_ahead_is_that_row_alone():
    x, w = case(32, 3840, 3840, 64, seed=3)
    f = fragments.repack(w)
    full = mm.qmatmul_mma(x, f, sums=True)
    for row in (0, 7, 8, 31):
        assert torch.equal(mm.qmatmul_mma(x[row:row + 1], f), full[row:row + 1]), row


@pytest.mark.gpu
@needs_cuda
def test_gpu_sums_ahead_replay_from_a_graph():
    x, w = case(20, 1000, 1024, 64, seed=5)
    f = fragments.repack(w)
    want = mm.qmatmul_mma(x, f, sums=True)  # eager first: the semaphores
    xs = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mm.qmatmul_mma(xs, f, sums=True)
    xs.copy_(x.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, mm.qmatmul_mma(x.flip(0), f, sums=False))
    assert not torch.equal(want, y)  # it did read the new rows
