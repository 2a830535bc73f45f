"""Test setup: without CUDA, Triton kernels run under the CPU interpreter, and tests
marked `gpu` (`@pytest.mark.gpu`, or a `pytest.param(..., marks=pytest.mark.gpu)`)
are skipped; `pytest -m gpu` runs those alone.

TRITON_INTERPRET is read when a kernel is decorated, so it must be set before
any qfuse.kernels module is imported: here, at collection start.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_levers(monkeypatch):
    """Each test starts with clean counters and no tier/kernel variables set."""
    from qfuse import levers

    for name in list(os.environ):
        if name.startswith("QFUSE_"):
            monkeypatch.delenv(name)
    levers.reset_counters()
    yield
