"""Run a function on several rank processes: gloo + host backend on CPU, NCCL on GPUs.

``run_ranks(body, world, *args)`` spawns ``world`` processes, each calling
``body(rank, world, *args)`` after ``init_process_group`` (rendezvous on a
fresh file, never a port). With ``use_gpu`` the ranks are placed round-robin
on ``gpus`` GPUs (default: one per rank, as many as there are); where ranks
share a GPU, NCCL (which refuses two ranks on one device) gives way to gloo,
and symmetric memory is told to accept ranks on one device
(:data:`SHARED_GPU_ENV`). Shared-GPU runs check correctness: kernels of
different processes time-slice the GPU, so their times mean nothing.
``backend`` names the symmetric-memory backend every rank uses
(:func:`overlap_kernels.use_backend`); by default the device's own.

It returns the bodies' results in rank order and raises the first failure
with its rank and traceback. A process that does not
finish within ``timeout_s`` is reported as a hang, with the Python stack of
every thread of each late rank (where it waits: each rank writes them itself
just before the deadline, from a watchdog thread, so a main thread blocked in
C code or in the GPU driver is caught too), and killed: nothing that uses it
(the tests, the CPU demo, the benchmark) can hang.

``body`` must be importable by name (a module-level function): ranks are
spawned, not forked, because forking a process that has run torch's thread
pools can deadlock.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

# NVLink multicast stays off in every process we start: on the shared hosts we
# measure on, a program that uses it can take the host's GPUs out of service.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# Spawned CPU ranks keep to one thread each: a CI machine has 2 cores.
_CHILD_ENV = {"OMP_NUM_THREADS": "1", **NO_MULTICAST_ENV}
# PyTorch symmetric memory refuses allocations of several ranks on one device
# unless told that this is meant (its own tests set the same variable).
SHARED_GPU_ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}


class RankFailure(AssertionError):
    """A rank raised, or did not finish in time."""


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_placement(world: int, gpus: int) -> list[int]:
    """The GPU index of each rank: round-robin over ``gpus`` GPUs."""
    if world < 1 or gpus < 1:
        raise ValueError(f"need at least one rank and one GPU, got world={world}, gpus={gpus}")
    return [rank % gpus for rank in range(world)]


def process_group_backend(world: int, gpus: int) -> str:
    """NCCL with one rank per GPU; gloo where ranks share a GPU (NCCL refuses
    that) or there is no GPU. gloo moves CUDA tensors too, slowly."""
    return "nccl" if gpus > 0 and world <= gpus else "gloo"


_DUMP_LEAD_S = 3.0  # a rank writes its stacks this long before the deadline
_STACK_LINES = 40  # of each late rank's dump, in the hang report


def _stacks_file(init_file: str, rank: int) -> str:
    return os.path.join(os.path.dirname(init_file), f"stacks.{rank}")


def _child(rank, world, init_file, gpus, backend, body, args, results, deadline_wall):
    import torch.distributed as dist

    use_gpu = gpus > 0
    stacks = open(_stacks_file(init_file, rank), "w")  # noqa: SIM115 (open for the process's life)
    faulthandler.enable()  # a rank killed by a signal shows its Python stack on stderr
    faulthandler.dump_traceback_later(
        max(0.1, deadline_wall - time.time() - _DUMP_LEAD_S), file=stacks
    )
    os.environ.update(_CHILD_ENV)
    if use_gpu and world > gpus:
        os.environ.update(SHARED_GPU_ENV)
    # CPU threads: one per CPU rank (the interpreter's ranks share the cores);
    # a GPU rank's share of the cores. The environment above is read too late
    # for this process's torch, and ranks that each start a thread per core
    # oversubscribe the host in every parallel CPU op (a test's fp64 CPU
    # reference, say), which then runs world times slower, toward the deadline.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world) if use_gpu else 1)
    try:
        group_backend = process_group_backend(world, gpus)
        kwargs = {}
        if use_gpu:
            device = torch.device("cuda", gpu_placement(world, gpus)[rank])
            torch.cuda.set_device(device)
            if group_backend == "nccl":
                kwargs["device_id"] = device
        try:
            dist.init_process_group(group_backend, init_method=f"file://{init_file}", rank=rank,
                                    world_size=world, **kwargs)  # fmt: skip
        except Exception as error:  # (a rendezvous the parent may try again: run_ranks)
            faulthandler.cancel_dump_traceback_later()
            results.put((rank, RENDEZVOUS_FAILED, f"{type(error).__name__}: {error}"))
            return
        if backend is not None:
            from .runtime.workspace import use_backend

            use_backend(backend)
        result = body(rank, world, *args)
    except BaseException as error:  # report everything, including assertion failures
        # Reported, and the group left as it is: with peers still waiting in a
        # collective this rank never joins, destroy_process_group may never
        # return (the parent kills what is left of a failed run).
        faulthandler.cancel_dump_traceback_later()
        results.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        return
    results.put((rank, "ok", result))
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


def _raise_if_dead_or_late(
    procs, by_rank: dict, deadline: float, timeout_s: float, init_file: str
) -> None:
    """A rank killed by a signal (or out of memory) never reports: notice it at once."""
    dead = [r for r, p in enumerate(procs) if r not in by_rank and p.exitcode is not None]
    if dead:
        codes = ", ".join(f"rank {r}: exit code {procs[r].exitcode}" for r in dead)
        raise RankFailure(f"rank processes died without reporting ({codes})")
    if time.monotonic() > deadline:
        missing = sorted(set(range(len(procs))) - set(by_rank))
        raise RankFailure(f"ranks {missing} did not finish within {timeout_s} s (hang)\n"
                          + _late_stacks(missing, init_file))  # fmt: skip


def _late_stacks(ranks: list[int], init_file: str) -> str:
    """Where each of ``ranks`` was just before the deadline: its threads' Python
    stacks (innermost frame first), as the rank wrote them."""
    reports = []
    for r in ranks:
        try:
            with open(_stacks_file(init_file, r)) as f:
                lines = [line for line in f.read().splitlines() if not line.startswith("Timeout (")]
        except OSError:
            lines = []
        shown = "\n".join(lines[:_STACK_LINES]) or "(no stack written)"
        reports.append(f"--- rank {r}:\n{shown}")
    return "\n".join(reports)


RENDEZVOUS_FAILED = "rendezvous failed"  # a rank's status when it could not join the group
RENDEZVOUS_TRIES = 2


def _run_once(body, world: int, args: tuple, gpus: int, backend, timeout_s: float) -> dict:
    """Start the ranks once; rank -> (status, value) as far as they got (the
    first failure ends the run: every rank left is killed)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        deadline_wall = time.time() + timeout_s  # the ranks' clock for their stack dumps
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world, init_file, gpus, backend, body, args, results, deadline_wall),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        by_rank: dict[int, tuple[str, object]] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(by_rank) < world:
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue.Empty:
                    _raise_if_dead_or_late(procs, by_rank, deadline, timeout_s, init_file)
                    continue
                by_rank[rank] = (status, value)
                if status in ("error", RENDEZVOUS_FAILED):
                    break
        finally:
            all_ok = len(by_rank) == world and all(status == "ok" for status, _ in by_rank.values())
            for p in procs:
                p.join(timeout=30 if all_ok else 1)
                if p.is_alive():
                    p.kill()
    return by_rank


def run_ranks(
    body: Callable[..., Any],
    world: int,
    *args: Any,
    use_gpu: bool = False,
    gpus: int | None = None,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> list:
    if use_gpu:
        if gpu_count() == 0:
            raise ValueError("run_ranks: use_gpu=True, but this host has no CUDA GPU")
        gpus = min(world, gpu_count()) if gpus is None else gpus
        if not 0 < gpus <= gpu_count():
            raise ValueError(
                f"run_ranks: asked for ranks on {gpus} GPUs, this host has {gpu_count()}"
            )
    else:
        gpus = 0
    for attempt in range(1, RENDEZVOUS_TRIES + 1):
        by_rank = _run_once(body, world, args, gpus, backend, timeout_s)
        failed = [r for r, (status, _) in by_rank.items() if status == RENDEZVOUS_FAILED]
        if not failed or attempt == RENDEZVOUS_TRIES:
            break
        # gloo's TCP transport can drop a connection while the ranks first meet
        # ("connectFullMesh failed"); the failed rank ran nothing of the body and
        # its peers, waiting for it, were stopped: all start again in a fresh rendezvous.
        print(f"run_ranks: rank {failed[0]} could not join its peers "
              f"({by_rank[failed[0]][1].splitlines()[0]}); starting the ranks again", file=sys.stderr)  # fmt: skip
    for rank in sorted(by_rank):
        status, value = by_rank[rank]
        if status in ("error", RENDEZVOUS_FAILED):
            raise RankFailure(f"rank {rank} of {world} failed:\n{value}")
    return [by_rank[r][1] for r in range(world)]
