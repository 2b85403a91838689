"""What the multi-rank test files share (their rank bodies run in spawned processes)."""

from __future__ import annotations

import time

import pytest
import torch

from overlap_kernels.launch import gpu_count


def setup_rank(rank: int, use_gpu: bool):
    """(torch.distributed, this rank's device), with a fresh seed: new inputs
    every run, different on every rank."""
    import torch.distributed as dist

    device = torch.device("cuda", rank) if use_gpu else torch.device("cpu")
    torch.manual_seed(int(time.time_ns() % 2**31) + 7919 * rank)
    return dist, device


def skip_without_gpus(world: int) -> None:
    if gpu_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, found {gpu_count()}")
