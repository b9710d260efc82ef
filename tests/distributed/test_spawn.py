"""The processes multi-process tests start are CPU processes, also on a machine with CUDA and fewer GPUs than
processes (the first GPU run failed there with "invalid device ordinal": rank 1 -> cuda:1).

This machine has no GPU: the parent below pretends to have one (`torch.cuda.is_available`, `device_count` patched),
which changes nothing in what the workers see; what hiding the GPUs does on a real one (CUDA reads
`CUDA_VISIBLE_DEVICES` when it starts) is CUDA's documented behaviour, not checked here.
"""

import os

import pytest
import torch
import torch.distributed as dist

from . import spawn


def report_devices(rank: int, world_size: int) -> dict:
    # How Accelerate's `wait_for_everyone` calls it: torch allocates the barrier's tensor on the machine's accelerator.
    dist.barrier(device_ids=[rank])
    return {
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda devices": torch.cuda.device_count(),
        "accelerator": torch._C._get_accelerator().type,
        "backend": dist.get_backend(),
    }


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_workers_run_on_cpu_with_gloo_whatever_the_gpus(tmp_path, monkeypatch, gpus):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert spawn.run(report_devices, 2, tmp_path) == {
        "CUDA_VISIBLE_DEVICES": "",
        "cuda devices": 0,
        "accelerator": "cpu",
        "backend": "gloo",
    }
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before  # the test process's own environment is left as it was
