"""quant.quantize on CUDA is bit-identical to quant.quantize on CPU (one format everywhere)."""

import pytest
import torch

from qfuse.quant import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, quantize


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("group_size", SUPPORTED_GROUP_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_matches_cpu(bits, group_size, dtype):
    g = torch.Generator().manual_seed(bits * 131 + group_size)
    w = (torch.randn(64, 512, generator=g) * torch.logspace(-3, 2, 64)[:, None]).to(dtype)
    cpu = quantize(w, group_size, bits)
    gpu = quantize(w.cuda(), group_size, bits)
    assert torch.equal(cpu[0].view(torch.int32), gpu[0].cpu().view(torch.int32))
    assert torch.equal(cpu[1], gpu[1].cpu())
    assert torch.equal(cpu[2], gpu[2].cpu())
