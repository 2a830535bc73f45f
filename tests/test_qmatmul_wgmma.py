"""The batched-rows product on warpgroup tensor cores (Gluon, Hopper only; marked `gpu`):
within twice the compat path's error against float64 at odd shapes, 17-256 rows (the
decode path sends it 33 and more), groups
64/128, bias and residual; a row's bits independent of the rows beside it and of the row
block; split K, other launch shapes, the warp-specialized variant bitwise equal to the
default, bitwise reproducible, CUDA-graph replay; the decode path's dispatch. On the CPU: that x permuted as the kernel permutes it meets the
fragment order's k slots (the layout contract the kernel's mma relies on), and the
refusals."""

import pytest
import torch

from qfuse.kernels.products import fragments
from qfuse.kernels.products import qmatmul_wgmma as wg
from qfuse.testing import check_bf16_product, linear_case, on_hopper
from qfuse.testing import cuda_4bit_case as case

needs_hopper = pytest.mark.skipif(not on_hopper(), reason="the wgmma kernel needs sm_90")
check = check_bf16_product


def _slot_matrix(f: fragments.FragmentWeight, qw) -> torch.Tensor:
    """The dense weight [N, K] with each 64-column block in the mma's slot order: codes
    read from the fragment words as the kernel reads them (lane 4g + q's word j, pair
    r' = 2h + r, nibbles r' and r' + 4 for e = 0 and 1, is row 16t + 8r + g at slot
    16j + 8h + 2q + e), scales and biases from the quantized weight ``qw`` it came from."""
    T, KB = f.words.shape[:2]
    out = torch.zeros(16 * T, 64 * KB, dtype=torch.float64)
    words = f.words.long() & 0xFFFFFFFF
    for g in range(8):
        for q in range(4):
            for j in range(4):
                w = words[:, :, 4 * g + q, j]  # [T, KB]
                for h in range(2):
                    for r in range(2):
                        for e in range(2):
                            code = (w >> (4 * (2 * h + r + 4 * e))) & 0xF
                            rows = torch.arange(T) * 16 + 8 * r + g
                            slots = torch.arange(KB) * 64 + 16 * j + 8 * h + 2 * q + e
                            out[rows[:, None], slots[None, :]] = code.double()
    k_group = (torch.arange(64 * KB) // 64) * 64 // f.group_size  # slots stay in their block
    return out[:f.n] * qw.scales.double()[:, k_group] + qw.biases.double()[:, k_group]


@pytest.mark.parametrize("group", [64, 128])
def test_permuted_rows_meet_the_fragment_slots(group):
    x, w = linear_case(5, 40, 256, 4, group, seed=group)
    f = fragments.repack(w)
    xp = wg.permuted_rows(x)
    assert xp.shape == x.shape and xp.is_contiguous()
    got = xp.double() @ _slot_matrix(f, w).T
    want = x.double() @ w.dequantize(torch.float32).double().T
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("N,K,group", [(15360, 3840, 64), (3840, 15360, 128), (1000, 640, 64),
                                       (96, 4160, 64), (4096, 4096, 128)])
def test_the_split_of_k_is_the_same_for_every_row_block(N, K, group):
    """Row invariance across row counts rests on this: the row block changes the step
    and the stages, never the shares of K (so never a row's order of sums)."""
    shapes = [wg.launch_shape(N, K, group, bm, torch.device("cpu")) for bm in (64, 128, 256)]
    assert len({(s["SPLIT"], s["BPP"]) for s in shapes}) == 1, shapes
    for bm, s in zip((64, 128, 256), shapes):
        assert (K // 64) % s["CB"] == 0 and s["BPP"] % s["CB"] == 0 and s["CB"] * 64 % group == 0
        assert 2 <= s["STAGES"] and s["STAGES"] * wg.stage_bytes(bm, s["WG"], s["CB"], group) \
            <= wg.SMEM_BUDGET


def test_a_ring_too_large_for_shared_memory_is_refused():
    with pytest.raises(ValueError, match="do not fit"):
        wg.launch_shape(15360, 3840, 64, 256, torch.device("cpu"), cb=8)
    with pytest.raises(ValueError, match="do not make whole groups"):
        wg.launch_shape(64, 192, 128, 64, torch.device("cpu"))
    # overrides that would drop blocks, leave an operand in flight, or fit no layout
    for bad, match in (({"cb": 3}, "power of two"), ({"inflight": 2}, "0 or 1"),
                       ({"wg": 3}, "1 or 2")):
        with pytest.raises(ValueError, match=match):
            wg.launch_shape(1024, 576, 64, 64, torch.device("cpu"), **bad)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("M", [17, 32, 33, 64, 100, 256])
@pytest.mark.parametrize("N,K", [(15360, 3840), (3840, 15360), (37, 128), (1000, 640)])
def test_within_twice_compat_error(group, M, N, K):
    if K % group:
        pytest.skip("K not a multiple of the group")
    if N * K > 1 << 24 and M not in (17, 33, 256):
        pytest.skip("large shapes at the ends of the row range only (compile time)")
    x, w = case(M, N, K, group, seed=M + N + K + group)
    check(wg.qmatmul_wgmma(x, fragments.repack(w)), x, w)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("group", [64, 128])
def test_rows_independent_of_the_batch_and_the_row_block(group):
    x, w = case(256, 3840, 4096, group, seed=group)
    f = fragments.repack(w)
    full = wg.qmatmul_wgmma(x, f)
    check(full, x, w)
    for rows in (1, 16, 17, 32, 33, 64, 65, 130, 200):
        assert torch.equal(wg.qmatmul_wgmma(x[:rows], f), full[:rows]), rows
    for bm in (64, 128):  # the same rows in narrower row blocks
        assert torch.equal(wg.qmatmul_wgmma(x, f, block_m=bm), full), bm


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("wgs,cb,stages,split,bm,ws", [
    (1, 1, 2, 1, None, False), (2, 2, 4, 3, None, False), (1, 4, 3, 8, None, False),
    (2, 4, 2, 1, None, False), (1, 8, 2, 2, 64, False), (2, 2, 3, 3, None, True),
    (1, 4, 2, 8, 64, True)])
def test_launch_shapes(wgs, cb, stages, split, bm, ws):
    x, w = case(70, 1000, 1536, 64, seed=cb + split)
    f = fragments.repack(w)
    shape = {"wg": wgs, "cb": cb, "stages": stages, "split": split, "block_m": bm, "per_sm": 1,
             "ws": ws}
    out = wg.qmatmul_wgmma(x, f, **shape)
    check(out, x, w)
    assert torch.equal(out, wg.qmatmul_wgmma(x, f, **shape))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("M", [33, 100, 256])
@pytest.mark.parametrize("N,K", [(15360, 3840), (3840, 15360), (1000, 640)])
def test_the_warp_specialized_variant_gives_the_same_bits(M, N, K):
    """The same k order and split, another pipeline: bitwise the default's output, with
    the bias and the residual, split K (the down projection's shape) included."""
    x, w = case(M, N, K, 64, seed=M + N)
    f = fragments.repack(w)
    bias = torch.randn(N, device="cuda").bfloat16()
    res = torch.randn(M, N, device="cuda").bfloat16()
    want = wg.qmatmul_wgmma(x, f, bias, res, ws=False)
    check(want, x, w, bias, res)
    assert torch.equal(wg.qmatmul_wgmma(x, f, bias, res, ws=True), want)
    assert torch.equal(wg.qmatmul_wgmma(x, f, bias, res, ws=True, wg=1, per_sm=1), want)


@pytest.mark.gpu
@needs_hopper
def test_bias_residual_reproducible_and_graph_replay():
    x, w = case(48, 777, 1024, 64, seed=9)
    bias = torch.randn(777, device="cuda").bfloat16()
    res = torch.randn(48, 777, device="cuda").bfloat16()
    f = fragments.repack(w)
    out = wg.qmatmul_wgmma(x, f, bias, res)
    check(out, x, w, bias, res)
    for _ in range(3):
        assert torch.equal(out, wg.qmatmul_wgmma(x, f, bias, res))
    xs = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = wg.qmatmul_wgmma(xs, f, bias, res)
    xs.copy_(x.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, wg.qmatmul_wgmma(x.flip(0), f, bias, res))


@pytest.mark.gpu
@needs_hopper
def test_decode_path_takes_it_for_batched_rows(monkeypatch):
    from qfuse import levers, ops

    x, w = case(96, 2048, 1024, 64, seed=5)
    f = fragments.repack(w)
    assert ops.fragment_route(x[:32], f) in ("fragment", "ring")
    assert ops.fragment_route(x, f) == "wgmma"
    levers.reset_counters()
    out = ops.linear(x, f)
    assert levers.counters().get("qmatmul_wgmma") == 1
    assert torch.equal(out, wg.qmatmul_wgmma(x, f))
    levers.reset_counters()  # an MLX-layout weight: repacked once, the same kernel
    assert torch.equal(ops.linear(x, w), out)
    assert levers.counters().get("qmatmul_wgmma") == 1
    monkeypatch.setenv("QFUSE_QMATMUL_WGMMA", "0")
    levers.reset_counters()
    check(ops.linear(x, f), x, w)
    assert "qmatmul_wgmma" not in levers.counters()


@pytest.mark.gpu
@needs_hopper
def test_the_mlp_and_stacked_products_take_it_stacked():
    """Batched rows: gate and up as one product over their stack, then down with the
    residual (two wgmma launches); Q/K/V-like parts as one launch."""
    from qfuse import levers, ops
    from qfuse.testing import mlp_errors

    H, I = 1024, 2048
    x, gate = case(64, I, H, 64, seed=1)
    _, up = case(1, I, H, 64, seed=2)
    _, down = case(1, H, I, 64, seed=3)
    res = torch.randn(64, H, device="cuda").bfloat16()
    levers.reset_counters()
    with torch.no_grad():  # as decoding runs it: with grad on, ops.mlp keeps autograd's path
        out = ops.mlp(x, gate, up, down, "silu", res)
    assert levers.counters().get("qmatmul_wgmma") == 2
    err, err_compat = mlp_errors(out, x, gate, up, down, "silu", res, torch.float64)
    assert err <= 2 * err_compat, (err, err_compat)
    levers.reset_counters()
    parts = ops.linear_stacked(x, [gate, up], [None, None])
    assert levers.counters().get("qmatmul_wgmma") == 1
    for got, w in zip(parts, (gate, up)):
        check(got, x, w)


@pytest.mark.gpu
@needs_hopper
def test_a_refused_batch_repacks_nothing(monkeypatch):
    """The lever off: 64 rows over an MLX-layout weight take the old path, and no
    fragment copy of the weight is made for a kernel that will not run."""
    from qfuse import levers, ops

    x, w = case(64, 2048, 1024, 64, seed=7)
    repacked = []
    real = fragments.repack
    monkeypatch.setattr(fragments, "repack", lambda w, *a: repacked.append(w) or real(w, *a))
    monkeypatch.setenv("QFUSE_QMATMUL_WGMMA", "0")
    levers.reset_counters()
    check(ops.linear(x, w), x, w)
    assert "qmatmul_wgmma" not in levers.counters() and not repacked


def test_refusals_name_the_reason():
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    _, w = linear_case(1, 32, 128, 4, 64, 0)
    for weight in (fragments.repack(w), w):  # held, or the MLX layout it would repack from
        reason = wg.unsupported_reason(x, weight)
        assert reason and ("CUDA" in reason or "Gluon" in reason or "sm_90" in reason)
    if wg.gluon is not None:
        assert "neither quantized" in wg.unsupported_reason(x, torch.zeros(32, 128))
        assert "features" in wg.unsupported_reason(x[:, :64], w)
    with pytest.raises(ValueError, match="qmatmul_wgmma cannot take"):
        wg.qmatmul_wgmma(x, fragments.repack(w))
