"""The one-launch RMSNorm kernel under the CPU interpreter (fp32, fp16 and bf16 through
its bit-exact rounding) and on the GPU (marked `gpu`: bf16 at the Gemma 3 12B widths,
first passed on the H200 on 2026-11-30): against compat, Llama and Gemma forms, odd
widths, many rows, deterministic; the residual joint bit for bit the three launches;
dispatch by default in the fast tier (QFUSE_RMS_NORM=0 opts out), never in the exact tier
or under autograd; bad input."""

import pytest
import torch

from qfuse import levers, ops, reference
from qfuse.testing import kernel_device

DEVICE = kernel_device()
k = pytest.importorskip("qfuse.kernels.pointwise.rms_norm")


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of b's last place (of a's dtype)."""
    ulp = torch.finfo(a.dtype).eps * b.float().abs().clamp_min(torch.finfo(a.dtype).tiny)
    return (a.float() - b.float()).abs() / ulp


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 64), (5, 100), (33, 256), (2, 3840)]
GPU_SHAPES = [(1, 3840), (48, 3840), (16, 256), (8, 4096)]  # bf16 at the model's widths


@pytest.mark.parametrize("dtype,rows,D", [
    *((dtype, rows, D) for dtype in DTYPES for rows, D in SHAPES),
    *(pytest.param(torch.bfloat16, rows, D, marks=pytest.mark.gpu) for rows, D in GPU_SHAPES)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_matches_compat(dtype, unit_offset, rows, D):
    torch.manual_seed(rows * D)
    x = (torch.randn(rows, D, device=DEVICE) * 3).to(dtype)
    w = (torch.randn(D, device=DEVICE) * 0.1).to(dtype)
    out = k.rms_norm(x, w, 1e-6, unit_offset)
    ref = reference.rms_norm(x, w, 1e-6, unit_offset)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        # float32 out: the sum's order and rsqrt's last bits show directly
        assert ulps_apart(out, ref).max() <= 4
    else:
        # Only the float32 sum of squares is ordered differently: at most one rounding
        # step apart (two for the Llama form, which rounds twice), and rarely.
        assert ulps_apart(out, ref).max() <= (1 if unit_offset else 2)
        assert (out == ref).float().mean() >= 0.97
    assert torch.equal(out, k.rms_norm(x, w, 1e-6, unit_offset))


def test_leading_dims_and_determinism():
    x = torch.randn(2, 3, 4, 128, device=DEVICE).half()
    w = torch.randn(128, device=DEVICE).half()
    out = k.rms_norm(x, w, 1e-5, True)
    assert out.shape == x.shape
    assert torch.equal(out, k.rms_norm(x, w, 1e-5, True))
    assert k.rms_norm(x[:0], w, 1e-5, True).shape == (0, 3, 4, 128)


def test_dispatch_on_by_default_and_opt_out(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    x = torch.randn(3, 64, device=DEVICE).half()
    w = torch.randn(64, device=DEVICE).half()
    with torch.no_grad():
        ops.rms_norm(x, w, 1e-6, True)
        ops.rms_norm(x, w.float(), 1e-6)  # Llama form with a weight of another dtype
        assert levers.counters() == {"rms_norm": 1, "ref:rms_norm": 1}
        levers.reset_counters()
        monkeypatch.setenv("QFUSE_RMS_NORM", "0")
        ops.rms_norm(x, w, 1e-6)
        assert levers.counters() == {"ref:rms_norm": 1}
        levers.reset_counters()
        monkeypatch.delenv("QFUSE_RMS_NORM")
        monkeypatch.setenv("QFUSE_TIER", "exact")  # not bit-exact: not admitted
        ops.rms_norm(x, w, 1e-6)
        assert levers.counters() == {"ref:rms_norm": 1}
        levers.reset_counters()
        monkeypatch.setenv("QFUSE_TIER", "fast")
    wp = torch.nn.Parameter(w.float())
    ops.rms_norm(x.float(), wp, 1e-6).sum().backward()  # training: the reference
    assert levers.counters() == {"ref:rms_norm": 1} and wp.grad is not None


@pytest.mark.gpu
def test_dispatch_bf16_at_the_model_width(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    x = torch.randn(1, 3840, device="cuda").bfloat16()
    w = torch.randn(3840, device="cuda").bfloat16()
    with torch.no_grad():
        ops.rms_norm(x, w, 1e-6, True)
    assert levers.counters() == {"rms_norm": 1}


def test_bad_input_names_the_problem():
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        k.rms_norm(x, torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="last dim"):
        k.rms_norm(torch.randn(1, k.MAX_DIM + 1, device=DEVICE), torch.ones(k.MAX_DIM + 1), 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        k.rms_norm(x.double(), torch.ones(64, device=DEVICE), 1e-6)


# dtype, unit_offset, post, after, rows, D. The GPU's: the Gemma sandwich's form, bf16.
RESIDUAL_CASES = [
    *((dtype, unit_offset, post, after, rows, D) for dtype in DTYPES
      for unit_offset in (False, True) for post, after in [(True, True), (False, True), (True, False)]
      for rows, D in SHAPES),
    *(pytest.param(torch.bfloat16, True, True, True, rows, D, marks=pytest.mark.gpu)
      for rows, D in [(1, 3840), (32, 3840), (7, 4096), (3, 8192)])]


@pytest.mark.parametrize("dtype,unit_offset,post,after,rows,D", RESIDUAL_CASES)
def test_residual_joint_equals_the_three_launches(dtype, unit_offset, post, after, rows, D):
    torch.manual_seed(rows * D + post + 2 * after)
    a = (torch.randn(rows, D, device=DEVICE) * 3).to(dtype)
    res = torch.randn(rows, D, device=DEVICE).to(dtype)
    w1 = (torch.randn(D, device=DEVICE) * 0.1).to(dtype) if post else None
    w2 = (torch.randn(D, device=DEVICE) * 0.1).to(dtype) if after else None
    norm = k.rms_norm
    if post and (not unit_offset or dtype == torch.float32):
        assert k.residual_unsupported_reason(a, res, w1, w2, unit_offset) is not None
        with torch.no_grad():  # ops takes the three ops apart instead
            h, n = ops.residual_rms_norm(a, res, w1, w2, 1e-6, unit_offset)
            norm = ops.rms_norm
    else:
        h, n = k.residual_rms_norm(a, res, w1, w2, 1e-6, unit_offset)
    with torch.no_grad():
        want_h = res + (norm(a, w1, 1e-6, unit_offset) if post else a)
        want_n = norm(want_h, w2, 1e-6, unit_offset) if after else None
    assert h.dtype == dtype and torch.equal(h, want_h)
    if after:
        assert torch.equal(n, want_n)
    else:
        assert n is None
    # and near compat, spelled out in PyTorch, on the scale of the terms added
    ref_s = reference.rms_norm(a, w1, 1e-6, unit_offset) if post else a
    scale = res.float().abs() + ref_s.float().abs()
    err = (h.float() - (res + ref_s).float()).abs()
    assert (err <= 4 * torch.finfo(dtype).eps * scale).all()


def test_residual_joint_dispatch_and_bad_input(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    a, res = torch.randn(2, 3, 64, device=DEVICE).half(), torch.randn(2, 3, 64, device=DEVICE).half()
    w = torch.randn(64, device=DEVICE).half()
    with torch.no_grad():
        h, n = ops.residual_rms_norm(a, res, w, w, 1e-6, True)
        assert levers.counters() == {"rms_norm": 1}  # apart, two norms would count 2
        assert h.shape == n.shape == a.shape
        levers.reset_counters()
        monkeypatch.setenv("QFUSE_TIER", "exact")
        h2, n2 = ops.residual_rms_norm(a, res, w, w, 1e-6, True)
        assert "rms_norm" not in levers.counters()
    want = res + reference.rms_norm(a, w, 1e-6, True)
    assert torch.equal(h2, want) and torch.equal(n2, reference.rms_norm(want, w, 1e-6, True))
    with pytest.raises(ValueError, match="differ"):
        k.residual_rms_norm(a, res[:1], w, w, 1e-6, True)
    with pytest.raises(ValueError, match="no norm"):
        k.residual_rms_norm(a, res, None, None, 1e-6, True)
