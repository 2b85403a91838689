"""Symmetric memory backends: one allocation per rank that every rank can address.

A backend turns ``allocate(nbytes)`` (called collectively by every rank of a
group) into a :class:`SymmetricBuffer`: this rank's bytes, a byte view of every
peer's bytes (for copy-engine transfers), and every peer's base address as
this process sees it (for kernels that load and store through peer pointers).

- ``torch``: PyTorch symmetric memory (CUDA peer mappings over NVLink). Default on CUDA.
- ``host``: shared-memory files that every rank process maps. Default on CPU, so
  the same kernels run in Triton's interpreter across real processes.
- ``nvshmem`` (nvshmem4py) and ``cupy`` (CUDA IPC) plug in here with the same
  three members; they are not written yet.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist


@dataclass
class SymmetricBuffer:
    local: torch.Tensor  # uint8 [nbytes]: this rank's bytes
    peers: list[torch.Tensor]  # uint8 [nbytes] per rank (peers[rank] is local)
    peer_addresses: list[int]  # base address of each rank's bytes, valid in this process
    keepalive: object = None  # backend handle that must outlive the views


class Backend(Protocol):
    name: str

    def allocate(self, nbytes: int, group: dist.ProcessGroup, device: torch.device) -> SymmetricBuffer:
        """Collective: every rank of ``group`` calls it with the same ``nbytes``."""
        ...


def _shm_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class HostBackend:
    """Every rank writes a file of ``nbytes`` zeros; every rank maps every file."""

    name = "host"

    def allocate(self, nbytes: int, group: dist.ProcessGroup, device: torch.device) -> SymmetricBuffer:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        folder = [tempfile.mkdtemp(prefix="overlap_kernels-", dir=_shm_root()) if rank == 0 else None]
        dist.broadcast_object_list(folder, src=dist.get_global_rank(group, 0), group=group)
        paths = [os.path.join(folder[0], f"rank{r}") for r in range(world)]
        with open(paths[rank], "wb") as f:
            f.truncate(nbytes)  # a sparse file of zeros: flags start at 0
        dist.barrier(group=group)
        peers = [torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8) for p in paths]
        dist.barrier(group=group)
        # Mappings outlive the names: unlink now so nothing is left behind on a crash.
        os.unlink(paths[rank])
        dist.barrier(group=group)
        if rank == 0:
            os.rmdir(folder[0])
        return SymmetricBuffer(peers[rank], peers, [p.data_ptr() for p in peers])


class TorchSymmetricBackend:
    """PyTorch symmetric memory: ``symm_mem.empty`` + ``rendezvous``."""

    name = "torch"

    def allocate(self, nbytes: int, group: dist.ProcessGroup, device: torch.device) -> SymmetricBuffer:
        import torch.distributed._symmetric_memory as symm_mem

        local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(local, group.group_name)
        world = dist.get_world_size(group)
        # buffer_ptrs are the bases of the symmetric allocations, which may hold
        # our tensor at an offset (PyTorch pools symmetric allocations).
        offset = int(getattr(handle, "offset", 0))
        peers = [handle.get_buffer(r, (nbytes,), torch.uint8, offset) for r in range(world)]
        addresses = [int(p) + offset for p in handle.buffer_ptrs]
        local.zero_()  # flags must start at 0; symmetric memory is not zeroed
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        return SymmetricBuffer(local, peers, addresses, keepalive=handle)


def default_backend(device: torch.device) -> Backend:
    return TorchSymmetricBackend() if device.type == "cuda" else HostBackend()

