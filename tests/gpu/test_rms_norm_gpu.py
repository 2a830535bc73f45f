"""The one-launch RMSNorm kernel on the GPU (bf16, the Gemma 3 12B widths): within one
rounding step of compat (two for the Llama form) and mostly equal, deterministic, and
dispatched by ops by default in the fast tier. First passed on the H200 on 2026-11-30."""

import pytest
import torch

from qfuse import levers, ops, reference
from qfuse.kernels.rms_norm import rms_norm


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("rows,D", [(1, 3840), (48, 3840), (16, 256), (8, 4096)])
def test_bf16_matches_compat(unit_offset, rows, D):
    g = torch.Generator(device="cuda").manual_seed(rows + D)
    x = (torch.randn(rows, D, generator=g, device="cuda") * 4).bfloat16()
    w = (torch.randn(D, generator=g, device="cuda") * 0.1).bfloat16()
    out = rms_norm(x, w, 1e-6, unit_offset)
    ref = reference.rms_norm(x, w, 1e-6, unit_offset)
    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(1e-30)
    assert ((out.float() - ref.float()).abs() / ulp).max() <= (1 if unit_offset else 2)
    assert (out == ref).float().mean() >= 0.97
    assert torch.equal(out, rms_norm(x, w, 1e-6, unit_offset))


def test_dispatch(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    x = torch.randn(1, 3840, device="cuda").bfloat16()
    w = torch.randn(3840, device="cuda").bfloat16()
    with torch.no_grad():
        ops.rms_norm(x, w, 1e-6, True)
    assert levers.counters() == {"rms_norm": 1}


@pytest.mark.parametrize("rows,D", [(1, 3840), (32, 3840), (7, 4096), (3, 8192)])
def test_residual_joint_is_bitwise_the_three_launches(rows, D):
    unit_offset = True  # the form the joint takes a post-norm in (Gemma's sandwich)
    from qfuse.kernels.rms_norm import residual_rms_norm

    g = torch.Generator(device="cuda").manual_seed(rows + D)
    a = (torch.randn(rows, D, generator=g, device="cuda") * 4).bfloat16()
    res = torch.randn(rows, D, generator=g, device="cuda").bfloat16()
    w1, w2 = ((torch.randn(D, generator=g, device="cuda") * 0.1).bfloat16() for _ in range(2))
    h, n = residual_rms_norm(a, res, w1, w2, 1e-6, unit_offset)
    want = res + rms_norm(a, w1, 1e-6, unit_offset)
    assert torch.equal(h, want)
    assert torch.equal(n, rms_norm(want, w2, 1e-6, unit_offset))
