"""The TMA-ring product (Gluon, Hopper only; marked `gpu`): within twice the compat
path's error against float64 at odd shapes, 1-32 rows, groups 64/128, bias and residual;
bitwise equal to the fragment kernel at the same split of K (the same steps in the same
order); split K, bitwise reproducible, rows independent of their batch, CUDA-graph
replay; and what it refuses."""

import pytest
import torch

from qfuse.kernels.products import fragments
from qfuse.kernels.products import qmatmul_ring as ring
from qfuse.kernels.products.qmatmul_mma import qmatmul_mma
from qfuse.testing import check_bf16_product, linear_case, on_hopper
from qfuse.testing import cuda_4bit_case as case

needs_hopper = pytest.mark.skipif(not on_hopper(), reason="the ring kernel needs sm_90")


check = check_bf16_product


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("M", [1, 3, 9, 32])  # one to four column tiles of 8 rows
@pytest.mark.parametrize("N,K", [(15360, 3840), (3840, 15360), (37, 128), (5, 64), (1000, 640)])
def test_within_twice_compat_error_and_equal_to_fragment_kernel(group, M, N, K):
    if K % group:
        pytest.skip("K not a multiple of the group")
    if N * K > 1 << 24 and M not in (1, 32):
        pytest.skip("large shapes at the ends of the row range only (compile time)")
    x, w = case(M, N, K, group, seed=M + N + K + group)
    f = fragments.repack(w)
    ls = ring.ring_shape(N, K, group, x.device)
    out = ring.qmatmul_ring(x, f)
    check(out, x, w)
    same = qmatmul_mma(x, f, chunk=ls["CB"], split=ls["SPLIT"])
    assert torch.equal(out, same)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("cb,stages,split,kw", [(1, 2, 1, 1), (2, 4, 3, 1), (4, 3, 8, 1),
                                                (8, 4, 3, 1), (2, 4, 1, 2), (8, 3, 3, 2)])
@pytest.mark.parametrize("M", [3, 20])
def test_launch_shapes(cb, stages, split, kw, M):
    x, w = case(M, 1000, 1536, 64, seed=cb + split)
    f = fragments.repack(w)
    shape = {"cb": cb, "stages": stages, "split": split, "kw": kw}
    out = ring.qmatmul_ring(x, f, **shape)
    check(out, x, w)
    assert torch.equal(out, ring.qmatmul_ring(x, f, **shape))
    if kw == 1:  # the same steps in the same order as the fragment kernel's
        ls = ring.ring_shape(1000, 1536, 64, x.device, cb=cb, stages=stages, split=split)
        assert torch.equal(out, qmatmul_mma(x, f, chunk=ls["CB"], split=ls["SPLIT"]))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("group", [64, 128])
def test_two_warps_a_tile_rows_independent(group):
    x, w = case(32, 3840, 4096, group, seed=group)
    f = fragments.repack(w)
    full = ring.qmatmul_ring(x, f, kw=2)
    check(full, x, w)
    for rows in (1, 9):
        assert torch.equal(ring.qmatmul_ring(x[:rows], f, kw=2), full[:rows])


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("pdl", [False, True])
def test_bias_residual_reproducible(pdl):
    x, w = case(4, 777, 1024, 64, seed=9)
    bias = torch.randn(777, device="cuda").bfloat16()
    res = torch.randn(4, 777, device="cuda").bfloat16()
    f = fragments.repack(w)
    out = ring.qmatmul_ring(x, f, bias, res, pdl=pdl)
    check(out, x, w, bias, res)
    for _ in range(3):
        assert torch.equal(out, ring.qmatmul_ring(x, f, bias, res, pdl=pdl))


@pytest.mark.gpu
@needs_hopper
def test_rows_independent_and_graph_replay():
    x, w = case(32, 3840, 4096, 64, seed=3)
    f = fragments.repack(w)
    full = ring.qmatmul_ring(x, f)
    for rows in (1, 5, 8, 16, 31):
        assert torch.equal(ring.qmatmul_ring(x[:rows], f), full[:rows])
    xs = x[:1].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ring.qmatmul_ring(xs, f)
    for i in range(3):
        xs.copy_(x[i:i + 1])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, full[i:i + 1])


def test_refusals_name_the_reason():
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    w = fragments.repack(linear_case(1, 32, 128, 4, 64, 0)[1])
    reason = ring.unsupported_reason(x, w)
    assert reason and ("CUDA" in reason or "Gluon" in reason or "sm_90" in reason)
    with pytest.raises(ValueError, match="qmatmul_ring cannot take"):
        ring.qmatmul_ring(x, w)


@pytest.mark.gpu
@needs_hopper
def test_decode_path_takes_it_where_preferred(monkeypatch):
    from qfuse import levers, ops

    # 16384 rows: 256 programs, K unsplit (the ring kernel takes 1-8 rows only then)
    x, w = case(1, 16384, 1024, 64, seed=5)
    f = fragments.repack(w)
    assert ring.ring_shape(16384, 1024, 64, x.device)["SPLIT"] == 1
    x9 = torch.randn(9, 1024, device="cuda").bfloat16()
    # a one-wave grid: the mma kernel at 1-8 rows, the ring kernel at 9-32
    levers.reset_counters()
    ops.linear(x, f)
    assert "qmatmul_ring" not in levers.counters() and levers.counters()["qmatmul_mma"] == 1
    levers.reset_counters()
    assert torch.equal(ops.linear(x9, f), ring.qmatmul_ring(x9, f))
    assert levers.counters().get("qmatmul_ring") == 1
    # as if the grid were many waves deep: the other way round
    monkeypatch.setattr(ring, "MANY_WAVES_PROGRAMS_PER_SM", 0)
    levers.reset_counters()
    out = ops.linear(x, f)
    assert levers.counters().get("qmatmul_ring") == 1
    assert torch.equal(out, ring.qmatmul_ring(x, f))
    levers.reset_counters()
    ops.linear(x9, f)
    assert "qmatmul_ring" not in levers.counters() and levers.counters()["qmatmul_mma"] == 1
    monkeypatch.setenv("QFUSE_QMATMUL_RING", "0")
    levers.reset_counters()
    ops.linear(x, f)
    assert "qmatmul_ring" not in levers.counters()
