"""What the multi-rank test files share (their rank bodies run in spawned processes)."""

from __future__ import annotations

import collections
import importlib.util
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from overlap_kernels.launch import gpu_count, run_ranks

# (ranks, GPUs they are spread over): several ranks on one GPU run wherever
# there is a GPU (correctness only: their kernels time-slice it), one rank per
# GPU where there are enough.
GPU_PLACEMENTS = ((1, 1), (2, 1), (4, 1), (2, 2), (4, 4))
# Symmetric-memory backends every multi-rank GPU test runs on; "nvshmem" has
# its own tests (tests/test_backends.py): one PE per process, one group.
GPU_BACKENDS = ("torch", "cupy")


def setup_rank(rank: int, use_gpu: bool):
    """(torch.distributed, this rank's device), with a fresh seed: new inputs
    every run, different on every rank. The launcher placed the rank on its
    GPU (overlap_kernels.launch.gpu_placement) and made it current."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
    torch.manual_seed(int(time.time_ns() % 2**31) + 7919 * rank)
    return dist, device


def _placement_param(world: int, gpus: int, backend: str):
    marks = []
    if gpu_count() < gpus:
        marks.append(
            pytest.mark.skip(reason=f"needs {gpus} CUDA GPU{'s' * (gpus > 1)}, found {gpu_count()}")
        )
    elif backend != "torch" and importlib.util.find_spec(backend) is None:
        marks.append(
            pytest.mark.skip(reason=f"backend {backend}: the module '{backend}' is not installed")
        )
    where = "1gpu" if gpus == 1 else f"{gpus}gpus"
    return pytest.param(world, gpus, backend, id=f"{world}ranks-{where}-{backend}", marks=marks)


def gpu_ranks(worlds=(1, 2, 4), backends=GPU_BACKENDS, backend_worlds=(2, 4)):
    """Mark a test ``gpu`` and run it for every placement of ``worlds`` ranks in
    GPU_PLACEMENTS, on the torch backend and on each other of ``backends`` for
    the worlds in ``backend_worlds`` (a single rank maps no peer memory). The
    test takes ``world``, ``gpus`` and ``backend`` and passes them on with
    :func:`run_on_gpus`."""
    params = [
        _placement_param(world, gpus, backend)
        for world, gpus in GPU_PLACEMENTS
        if world in worlds
        for backend in backends
        if backend == "torch" or world in backend_worlds
    ]

    def decorate(test):
        return pytest.mark.gpu(pytest.mark.parametrize(("world", "gpus", "backend"), params)(test))

    return decorate


def run_on_gpus(body, world: int, gpus: int, backend: str, *args, timeout_s: float = 300.0) -> list:
    """``body(rank, world, True, *args)`` on ``world`` ranks spread over ``gpus`` GPUs."""
    return run_ranks(
        body, world, True, *args, use_gpu=True, gpus=gpus, backend=backend, timeout_s=timeout_s
    )


def shares_gpus(world: int, gpus: int) -> bool:
    return world > gpus


# The CPU world sizes over which a case matrix shares its (case, alternative) pairs
# (:func:`runs_here`): one peer, and several. More ranks add peers but no path, and on a
# 2-core machine 4 CPU ranks cost about twice what 3 do (GPUs run 4).
CPU_SHARED_WORLDS = (2, 3)
# Their turns at the pairs, in this order: 2 ranks take two of every three, their bodies
# costing about half what 3 ranks' do.
_CPU_TURNS = (2, 3, 2)


def runs_here(world: int, use_gpu: bool, case: int, alternative: int) -> bool:
    """Whether ``alternative`` (dtypes, say; 0 for a matrix of cases alone) of case
    ``case`` runs in this body. On GPUs and on one CPU rank every one does. On
    CPU_SHARED_WORLDS ranks (Triton's interpreter runs each rank's programs one by
    one: these are the suite's slowest bodies) alternative a of case c runs on
    ``_CPU_TURNS[(c + a) % 3]`` ranks only: every pair runs once over them, and with
    three alternatives or more every case and every alternative run at each."""
    if use_gpu or world == 1:
        return True
    if world not in CPU_SHARED_WORLDS:
        raise ValueError(f"{world} CPU ranks: matrices are shared over {CPU_SHARED_WORLDS} only")
    return _CPU_TURNS[(case + alternative) % len(_CPU_TURNS)] == world


def runs_on_cpu(world: int, cases: int, alternatives: int) -> int:
    """How many (case, alternative) pairs run on ``world`` CPU ranks (:func:`runs_here`)."""
    return sum(runs_here(world, False, c, a) for c in range(cases) for a in range(alternatives))


class OurOpCalls(TorchDispatchMode):
    """Counts the calls of torch.ops.overlap_kernels.* made while it is on, by name."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "overlap_kernels":
            self.calls[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))
