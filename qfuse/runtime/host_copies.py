"""Small index tensors from the host to the device without waiting for the GPU.

A tensor made on the device from a list, or copied there from pageable memory, makes
PyTorch synchronize the stream: the host waits for every kernel queued before it. Copied
from pinned memory with ``non_blocking``, the copy instead waits behind the stream's work
and the host goes on (PyTorch's pinned-memory cache keeps the block until its copy has
run). The serving engine's decode step and a prefill's token plan use it.
"""

from __future__ import annotations

import torch


def to_device(values, device) -> torch.Tensor:
    """``values`` (a list of ints, made int64, or a CPU tensor) on ``device``, copied
    behind the stream's work on CUDA; on a CPU the host tensor itself."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    host = values if isinstance(values, torch.Tensor) else \
        torch.tensor(values, dtype=torch.int64, pin_memory=cuda)
    if not cuda:
        return host
    if not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
