"""The fragment-order product (mma.sync over repacked 4-bit codes), on the GPU only
(marked `gpu`: inline PTX has no interpreter): within twice the compat path's error
against float64, odd shapes (N not a multiple of 16, K of one or two blocks), 1-32 rows,
groups 64/128, bias and residual, split K, bitwise reproducible, CUDA-graph replay, and
its dispatch from ops. Repacking (on the CPU and the GPU): test_fragments.py."""

import pytest
import torch

from qfuse.kernels.products import fragments
from qfuse.kernels.products.qmatmul_mma import qmatmul_mma
from qfuse.testing import check_bf16_product, mlp_errors
from qfuse.testing import cuda_4bit_case as case

pytestmark = pytest.mark.gpu


check = check_bf16_product


@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 9, 16, 27, 32])
@pytest.mark.parametrize("N,K", [(15360, 3840), (3840, 15360), (37, 128), (5, 64), (1000, 640)])
def test_within_twice_compat_error(group, M, N, K):
    if K % group:
        pytest.skip("K not a multiple of the group")
    x, w = case(M, N, K, group, seed=M + N + K + group)
    check(qmatmul_mma(x, fragments.repack(w)), x, w)


@pytest.mark.parametrize("chunk", [1, 2, 4])
@pytest.mark.parametrize("split", [1, 3, 8])
@pytest.mark.parametrize("tiles", [1, 2])
def test_launch_shapes(chunk, split, tiles):
    x, w = case(3, 1000, 1344, 64, seed=chunk + split)  # 21 blocks: a short last share
    f = fragments.repack(w)
    out = qmatmul_mma(x, f, chunk=chunk, split=split, tiles=tiles)
    check(out, x, w)
    assert torch.equal(out, qmatmul_mma(x, f, chunk=chunk, split=split, tiles=tiles))


@pytest.mark.parametrize("pdl", [False, True])
def test_bias_residual_reproducible(pdl):
    x, w = case(4, 777, 1024, 64, seed=9)
    bias = torch.randn(777, device="cuda").bfloat16()
    res = torch.randn(4, 777, device="cuda").bfloat16()
    f = fragments.repack(w)
    out = qmatmul_mma(x, f, bias, res, pdl=pdl)
    check(out, x, w, bias, res)
    for _ in range(3):
        assert torch.equal(out, qmatmul_mma(x, f, bias, res, pdl=pdl))


def test_rows_independent_and_graph_replay():
    """A row's result is bit for bit the same alone and in a batch of 8 or 32 (one or
    four column tiles, x loaded ahead or just in time); graph replay reads new x."""
    x, w = case(32, 4096, 3840, 64, seed=3)
    f = fragments.repack(w)
    full = qmatmul_mma(x, f)
    for m in (0, 5, 7, 9, 20, 31):
        assert torch.equal(full[m], qmatmul_mma(x[m:m + 1], f)[0])
    assert torch.equal(full[:8], qmatmul_mma(x[:8], f))
    x = x[:8].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qmatmul_mma(x, f)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, qmatmul_mma(x, f))


def test_dispatch_takes_the_fragment_kernel(monkeypatch):
    """ops.linear and ops.mlp on 1-8 bf16 rows of 4-bit g64 weights run the fragment kernel
    in the fast tier (counters), within twice compat's error; QFUSE_QMATMUL_MMA=0 opts out;
    a weight rewritten in place is repacked again."""
    from qfuse import levers, ops

    monkeypatch.setenv("QFUSE_TIER", "fast")
    x, gate = case(2, 1024, 512, 64, seed=4)
    _, up = case(2, 1024, 512, 64, seed=5)
    _, down = case(2, 512, 1024, 64, seed=6)
    res = torch.randn(2, 512, device="cuda").bfloat16()
    levers.reset_counters()
    check(ops.linear(x, gate), x, gate)
    with torch.no_grad():  # as in decoding (with grad, ops.mlp spells out the three linears)
        out = ops.mlp(x, gate, up, down, "gelu_tanh", res)
    assert levers.counters()["qmatmul_mma"] == 3  # the linear; the MLP's gate+up and down
    err, err_compat = mlp_errors(out, x, gate, up, down, "gelu_tanh", res, torch.float64)
    assert err <= 2 * err_compat, (err, err_compat)
    gate.write_((slice(0, 16),), torch.zeros(16, 512, device="cuda").bfloat16())
    check(ops.linear(x, gate), x, gate)
    monkeypatch.setenv("QFUSE_QMATMUL_MMA", "0")
    levers.reset_counters()
    ops.linear(x, gate)
    assert "qmatmul_mma" not in levers.counters()


def test_stacked_products_one_launch(monkeypatch):
    """ops.linear_stacked over Q/K/V-like weights (the last not whole tiles) runs one
    fragment-kernel launch in the fast tier; each output within twice compat's error,
    biases included, and the same as its own product where the split matches."""
    from qfuse import levers, ops

    monkeypatch.setenv("QFUSE_TIER", "fast")
    x, wq = case(3, 512, 768, 64, seed=21)
    _, wk = case(3, 128, 768, 64, seed=22)
    _, wv = case(3, 37, 768, 64, seed=23)
    biases = [torch.randn(512, device="cuda").bfloat16(), None,
              torch.randn(37, device="cuda").bfloat16()]
    levers.reset_counters()
    outs = ops.linear_stacked(x, [wq, wk, wv], biases)
    assert levers.counters()["qmatmul_mma"] == 1
    for out, w, b in zip(outs, [wq, wk, wv], biases):
        check(out, x, w, b)
    assert torch.equal(outs[0], ops.linear_stacked(x, [wq, wk, wv], biases)[0])
