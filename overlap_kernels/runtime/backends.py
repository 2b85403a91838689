"""Symmetric memory backends: one allocation per rank that every rank can address.

A backend turns ``allocate(nbytes)`` (called collectively by every rank of a
group) into a :class:`SymmetricBuffer`: this rank's bytes, a byte view of every
peer's bytes (for copy-engine transfers), and every peer's base address as
this process sees it (for kernels that load and store through peer pointers).

- ``torch``: PyTorch symmetric memory (CUDA peer mappings over NVLink). Default on CUDA.
- ``host``: shared-memory files that every rank process maps. Default on CPU, so
  the same kernels run in Triton's interpreter across real processes.
- ``cupy``: ``cudaMalloc`` + CUDA IPC handles through CuPy (extra ``[cupy]``).
  Works wherever the ranks' processes can open each other's handles: GPUs of
  one host, or several ranks on one GPU.
- ``nvshmem``: the NVSHMEM symmetric heap through nvshmem4py (extra
  ``[nvshmem]``), the road to more than one host. One process group per
  process: NVSHMEM is initialised once, with that group's ranks as its PEs.

The ops never branch on the backend: :func:`overlap_kernels.use_backend` picks
one per process group before its first call.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from .errors import OverlapInputError


@dataclass
class SymmetricBuffer:
    local: torch.Tensor  # uint8 [nbytes]: this rank's bytes
    peers: list[torch.Tensor]  # uint8 [nbytes] per rank (peers[rank] is local)
    peer_addresses: list[int]  # base address of each rank's bytes, valid in this process
    keepalive: object = None  # backend handle that must outlive the views


class Backend(Protocol):
    name: str
    device_type: str  # "cuda" or "cpu": the tensors whose workspace it can hold

    def allocate(
        self, nbytes: int, group: dist.ProcessGroup, device: torch.device
    ) -> SymmetricBuffer:
        """Collective: every rank of ``group`` calls it with the same ``nbytes``."""
        ...


def _shm_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class HostBackend:
    """Every rank writes a file of ``nbytes`` zeros; every rank maps every file."""

    name = "host"
    device_type = "cpu"

    def allocate(
        self, nbytes: int, group: dist.ProcessGroup, device: torch.device
    ) -> SymmetricBuffer:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        folder = [
            tempfile.mkdtemp(prefix="overlap_kernels-", dir=_shm_root()) if rank == 0 else None
        ]
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
    device_type = "cuda"

    def allocate(
        self, nbytes: int, group: dist.ProcessGroup, device: torch.device
    ) -> SymmetricBuffer:
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


def _import_extra(module: str, extra: str, backend: str):
    """``module``, or an error that names the extra which installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise OverlapInputError(
            f"symmetric-memory backend '{backend}' needs the Python module '{module}', which is not "
            f"installed here ({error}): pip install 'overlap_kernels[{extra}]'"
        ) from None


def _peer_bytes(cupy, ptr: int, nbytes: int, owner) -> torch.Tensor:
    """A uint8 torch view of ``nbytes`` device bytes at ``ptr``; the view keeps
    ``owner`` (which frees or closes the memory when collected) alive."""
    memory = cupy.cuda.UnownedMemory(ptr, nbytes, owner)
    array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.as_tensor(array, device="cuda")


class _CudaIpcBlock:
    """One ``cudaMalloc`` of this rank (``opened=False``) or a peer's block
    opened from its IPC handle: freed, or closed, when the last view of it is
    collected, so no view can outlive its memory."""

    def __init__(self, cupy, ptr: int, opened: bool):
        self.ptr = ptr
        release = cupy.cuda.runtime.ipcCloseMemHandle if opened else cupy.cuda.runtime.free
        weakref.finalize(self, release, ptr)


class CupyIpcBackend:
    """Each rank ``cudaMalloc``s its bytes and shares a CUDA IPC handle with
    every peer, which opens it. A process cannot open its own handle, so a
    rank's own entry is its allocation itself."""

    name = "cupy"
    device_type = "cuda"

    def __init__(self):
        self.cupy = _import_extra("cupy", "cupy", self.name)

    def allocate(
        self, nbytes: int, group: dist.ProcessGroup, device: torch.device
    ) -> SymmetricBuffer:
        runtime = self.cupy.cuda.runtime
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        with self.cupy.cuda.Device(device.index):
            ptr = runtime.malloc(nbytes)
            own = _CudaIpcBlock(self.cupy, ptr, opened=False)
            runtime.memset(ptr, 0, nbytes)  # flags must start at 0
            runtime.deviceSynchronize()
            handles = [None] * world
            dist.all_gather_object(handles, bytes(runtime.ipcGetMemHandle(ptr)), group=group)
            blocks = [
                own if r == rank else
                _CudaIpcBlock(self.cupy, runtime.ipcOpenMemHandle(handles[r]), opened=True)
                for r in range(world)
            ]  # fmt: skip
        peers = [_peer_bytes(self.cupy, block.ptr, nbytes, block) for block in blocks]
        dist.barrier(group=group)  # every peer has zeroed its flags before any rank signals
        return SymmetricBuffer(
            peers[rank], peers, [block.ptr for block in blocks], keepalive=blocks
        )


class NvshmemBackend:
    """The NVSHMEM symmetric heap (nvshmem4py). NVSHMEM is initialised once per
    process, on the first group that asks, with that group's ranks as PEs; its
    allocations and frees are collective over those PEs, so buffers are never
    freed one-sidedly: a forgotten workspace's heap memory stays with NVSHMEM
    until the process ends (``NVSHMEM_SYMMETRIC_SIZE`` sizes the heap)."""

    name = "nvshmem"
    device_type = "cuda"
    _group_name: str | None = None  # the group NVSHMEM was initialised with, per process

    def __init__(self):
        self.nvshmem = _import_extra("nvshmem.core", "nvshmem", self.name)
        self.torch_interop = _import_extra("nvshmem.core.interop.torch", "nvshmem", self.name)

    def _init_once(self, group: dist.ProcessGroup, device: torch.device) -> None:
        if NvshmemBackend._group_name is not None:
            if NvshmemBackend._group_name != group.group_name:
                raise OverlapInputError(
                    f"symmetric-memory backend 'nvshmem' serves one process group per process; it was "
                    f"initialised for group '{NvshmemBackend._group_name}', not '{group.group_name}'"
                )
            return
        import numpy as np
        from cuda.core import Device

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        uid = self.nvshmem.get_unique_id(empty=rank != 0)
        uid_bytes = [uid._data.view(np.int8).tobytes() if rank == 0 else None]
        dist.broadcast_object_list(uid_bytes, src=dist.get_global_rank(group, 0), group=group)
        uid._data.view(np.int8)[:] = np.frombuffer(uid_bytes[0], dtype=np.int8)
        self.nvshmem.init(
            device=Device(device.index), uid=uid, rank=rank, nranks=world, initializer_method="uid"
        )
        NvshmemBackend._group_name = group.group_name

    def allocate(
        self, nbytes: int, group: dist.ProcessGroup, device: torch.device
    ) -> SymmetricBuffer:
        self._init_once(group, device)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        local = self.torch_interop.bytetensor(
            (nbytes,)
        )  # tracked by NVSHMEM: not freed when collected
        local.zero_()  # flags must start at 0
        peers = []
        for r in range(world):
            peer = local if r == rank else self.torch_interop.get_peer_tensor(local, r)
            if peer is None or peer.data_ptr() == 0:
                raise OverlapInputError(
                    f"symmetric-memory backend 'nvshmem': rank {r}'s heap cannot be loaded from or stored "
                    f"to directly from rank {rank} (nvshmem_ptr gave no address); the fused ops need "
                    "peers reachable over NVLink or PCIe peer access"
                )
            peers.append(peer)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        return SymmetricBuffer(local, peers, [p.data_ptr() for p in peers])


BACKENDS = {b.name: b for b in (TorchSymmetricBackend, HostBackend, CupyIpcBackend, NvshmemBackend)}


def backend_class(name: str) -> type:
    if name not in BACKENDS:
        raise OverlapInputError(
            f"unknown symmetric-memory backend '{name}'; choose one of {sorted(BACKENDS)}"
        )
    return BACKENDS[name]


def make_backend(name: str, device: torch.device) -> Backend:
    """The backend called ``name`` for tensors on ``device``; a clear error for
    an unknown name, a device it cannot serve or a missing extra."""
    cls = backend_class(name)
    if cls.device_type != device.type:
        raise OverlapInputError(
            f"symmetric-memory backend '{name}' holds {cls.device_type.upper()} memory, but the tensors are "
            f"on {device}; the default for {device.type.upper()} tensors is '{default_backend_name(device)}'"
        )
    return cls()


def default_backend_name(device: torch.device) -> str:
    return TorchSymmetricBackend.name if device.type == "cuda" else HostBackend.name
