"""The p2p all-reduce kernel on two GPUs (marked `gpu`; skipped with fewer): exact sums,
eager and in replayed graphs, through a torchrun job of `p2p_allreduce_worker.py`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def test_p2p_all_reduce_is_the_exact_sum_on_two_gpus():
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    worker = Path(__file__).with_name("p2p_allreduce_worker.py")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(worker)], check=False, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
