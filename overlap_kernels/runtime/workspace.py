"""The symmetric workspace of a process group: created once, reused by every call.

Layout of the one symmetric allocation each rank holds (byte offsets, from
limits.py)::

    [0, FLAG_BYTES)          int32 flags
        [0, MAX_WORLD)           ready flags: peer p stores its epoch at slot p
        [MAX_WORLD, NUM_FLAGS)   chunk flags: "chunk c of this call has arrived here",
                                 the last 2 * MAX_WORLD the senders' signature words
    [SCRATCH_OFFSET, DATA_OFFSET)  launch scratch, a slot per stream (never read by peers)
    [DATA_OFFSET, capacity)  data: ops carve their buffers from here

Besides it: a device table of every rank's base address (kernels index it by
rank), high-priority communication streams, an epoch counter (signals.py)
and an error record in host memory the GPU can write, so the host reads a
timeout (or a peer's other call) without synchronising the device.

The data region grows by doubling when an op asks for more; growth is
collective, which is safe because every rank makes the same calls with the
same shapes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..limits import (
    CHUNK_FLAGS_OFFSET,
    DATA_OFFSET,
    DEFAULT_TIMEOUT_S,
    DEVICE_EPOCH,
    FLAG_BYTES,
    MAX_WORLD,
    NUM_FLAGS,
    SCRATCH_OFFSET,
    SCRATCH_SLOT_BYTES,
    SCRATCH_SLOTS,
    word_slot,
)
from .backends import Backend, SymmetricBuffer, backend_class, default_backend_name, make_backend
from .errors import (
    CODE_MISMATCH,
    CODE_OK,
    ERR_CHUNK,
    ERR_CODE,
    ERR_DEADLINE_MS,
    ERR_EPOCH,
    ERR_MINE,
    ERR_PEER,
    ERR_RECORD_LEN,
    ERR_THEIRS,
    OverlapInputError,
    OverlapMismatchError,
    OverlapTimeoutError,
)
from .meeting import PeerMissing, meet
from .signals import signal_kernel
from .streams import Streams

# torch.cuda.is_current_stream_capturing() without its lazy-init check (a workspace
# on CUDA has CUDA up): torch's C query itself, a third of the host time.
_stream_capturing = torch._C._cuda_isCurrentStreamCapturing


class PlanCache(OrderedDict):
    """Per-shape plans, the least recently used dropped past ``limit`` (shapes
    that vary from call to call, as in inference, must not grow it forever)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def get(self, key: Hashable, default: Any = None) -> Any:
        try:
            self.move_to_end(key)  # (a key's hash is computed per lookup: one less than `in`)
        except KeyError:
            return default
        return self[key]

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if len(self) > self.limit:
            self.popitem(last=False)


_MIN_DATA_BYTES = 1 << 20
_SCRATCH_LOCK = threading.Lock()
RESERVE_SLACK = 512  # bytes reserve() adds: the second buffer half is 256-byte aligned


@dataclass
class Workspace:
    group: dist.ProcessGroup
    device: torch.device
    backend: Backend
    rank: int
    world: int
    buffer: SymmetricBuffer | None = None
    peer_table: torch.Tensor | None = None  # int64 [world] on device: base addresses
    error_record: torch.Tensor | None = (
        None  # int32 [ERR_RECORD_LEN], host memory the device can write
    )
    epoch: int = 0
    cache: PlanCache = field(default_factory=lambda: PlanCache(64))  # per-shape plans
    _calls: dict = field(default_factory=dict)  # epoch -> (op, deadline_s), the last 64 calls
    _failure: OverlapTimeoutError | OverlapMismatchError | None = None
    # Outgrown buffers stay mapped (a backend may not free symmetric memory
    # safely while peers map it); doubling keeps them smaller than the live one.
    _retired: list = field(default_factory=list)
    _retired_tables: list = field(default_factory=list)  # their address tables, kept likewise
    _error_view: object = None
    _comm_streams: list = field(
        default_factory=list
    )  # high priority; [0] is the communication stream
    _side_stream: torch.cuda.Stream | None = None
    _streams: Streams | None = None  # switches and joins (streams.py); made with the first stream
    ready_flags: torch.Tensor | None = None
    chunk_flags: torch.Tensor | None = None
    _chunk_flags_u32: torch.Tensor | None = None
    # Local piece counters of the producer GEMM (kernels/reduce_gemm.py): zero
    # between launches, each reset by the tile that completes its piece.
    counters: torch.Tensor | None = None
    # A replay workspace (fused calls captured in CUDA graphs): op -> deadline of
    # each op prepared here. Its epochs are counted on the device, and the error
    # record does not say whose replay wrote it: a timeout names them all.
    replayed: dict = field(default_factory=dict)
    replay_states: list = field(
        default_factory=list
    )  # what captured graphs address (ops/replay.py)
    # Records that ops' kernels fill beside the error record, in host memory, each
    # with a check() that raises what it holds (the MoE graph mode's routing checks:
    # ops/moe_graph.py): raise_if_failed() runs them after its own.
    op_records: dict = field(default_factory=dict)
    _scratch_base: int = 0  # address of this rank's launch scratch (limits.SCRATCH_OFFSET)
    _scratch_slots: dict = field(default_factory=dict)  # raw CUDA stream -> its slot
    # Byte offset of the data region's second half (256-byte aligned), and the data
    # region's size, set as the buffer is made: every call reads them.
    _half_bytes: int = 0
    _capacity: int = 0
    _cuda: bool = False  # device.type == "cuda", read by every call

    def __post_init__(self) -> None:
        self._cuda = self.device.type == "cuda"

    # ---- memory -------------------------------------------------------------
    @property
    def data_capacity(self) -> int:
        return self._capacity

    def half_offset(self, epoch: int) -> int:
        """Where epoch ``epoch``'s buffers start: consecutive epochs alternate
        between the two halves of the data region, so a peer still reading the
        previous epoch's data is never overwritten (it cannot be two epochs
        behind: this epoch waited for its announcement of the last one)."""
        return (epoch % 2) * self._half_bytes

    def _grow(self, data_bytes: int, op: str, deadline_s: float) -> None:
        capacity = max(_MIN_DATA_BYTES, 1 << (data_bytes - 1).bit_length())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing in flight may touch the old buffer
        self._meet(op, deadline_s)
        if self.buffer is not None:
            self._retired.append(self.buffer)
            self._retired_tables.append(self.peer_table)  # captured graphs may hold its address
        self.buffer = self.backend.allocate(DATA_OFFSET + capacity, self.group, self.device)
        # Kernels reach this rank's flags through the address table, the host through
        # the tensor: they must be the same bytes, or signals go astray.
        if self.buffer.peer_addresses[self.rank] != self.buffer.local.data_ptr() or \
                self.buffer.peers[self.rank].data_ptr() != self.buffer.local.data_ptr():  # fmt: skip
            raise RuntimeError(
                f"{self.backend.name} backend: this rank's symmetric buffer is at "
                f"{self.buffer.local.data_ptr():#x} but its address table says "
                f"{self.buffer.peer_addresses[self.rank]:#x}"
            )
        self.peer_table = torch.tensor(
            self.buffer.peer_addresses, dtype=torch.int64, device=self.device
        )
        self._scratch_base = self.buffer.local.data_ptr() + SCRATCH_OFFSET
        self._capacity = self.buffer.local.numel() - DATA_OFFSET
        self._half_bytes = self._capacity // 2 // 256 * 256
        flags = self.buffer.local[:FLAG_BYTES].view(torch.int32)
        self.ready_flags = flags[:MAX_WORLD]  # slot p: the epoch rank p last announced here
        self.chunk_flags = flags[
            CHUNK_FLAGS_OFFSET // 4 :
        ]  # slot c: the epoch whose chunk c has arrived here
        self._chunk_flags_u32 = self.chunk_flags.view(torch.uint32)  # what stream writes take
        self.cache.clear()

    def _meet(self, op: str, deadline_s: float) -> None:
        """Return once every rank of the group has reached this set-up step, or
        raise OverlapTimeoutError naming the first rank missing past
        ``deadline_s``. Allocation is collective and its rendezvous has no
        deadline of its own: a rank absent from its first call (or one that
        grows the workspace alone, its shapes differing from its peers') would
        hold the others there (meeting.py)."""
        if self.world == 1:
            return
        try:
            meet(self.group, "setup", b"1", deadline_s)
        except PeerMissing as missing:
            raise OverlapTimeoutError(op, self.rank, missing.peer, -1, self.epoch + 1, deadline_s,
                                      where="the symmetric workspace's set-up") from None  # fmt: skip

    def data(
        self, rank: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """A view of ``rank``'s data region at byte ``offset`` (peer views are for copies)."""
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        assert offset + nbytes <= self.data_capacity, "op asked for more than it reserved"
        start = DATA_OFFSET + offset
        return self.buffer.peers[rank][start : start + nbytes].view(dtype).view(shape)

    def peer_chunk_flags(self, rank: int) -> torch.Tensor:
        """The chunk flags of ``rank`` (a peer view for peers), int32: where a
        kernel launched after a producer's work signals that peer."""
        return self.buffer.peers[rank][CHUNK_FLAGS_OFFSET:FLAG_BYTES].view(torch.int32)

    def launch_scratch(self, stream: int, nbytes: int) -> int | None:
        """The address of raw CUDA stream ``stream``'s slot of the launch scratch,
        for a launch that needs ``nbytes`` (Triton's global scratch); None where it
        gets none: too large, or every slot held by other streams. For eager calls
        only, never while a stream captures a CUDA graph (a graph keeps the address,
        and graphs may replay at once on several streams): the ops pass it to eager
        launches alone. Launches on one stream run one after another, so they share
        its slot. A raw handle keeps its slot for the workspace's life
        (torch's streams are never destroyed; an external stream destroyed while its
        work runs and its handle reused at once would share a slot)."""
        if nbytes > SCRATCH_SLOT_BYTES:
            return None
        slot = self._scratch_slots.get(stream)
        if slot is None:
            with _SCRATCH_LOCK:  # (two threads' first launches on new streams)
                slot = self._scratch_slots.get(stream)
                if slot is None:
                    if len(self._scratch_slots) == SCRATCH_SLOTS:
                        return None
                    slot = self._scratch_slots[stream] = len(self._scratch_slots)
        return self._scratch_base + slot * SCRATCH_SLOT_BYTES

    # ---- calls --------------------------------------------------------------
    def begin(
        self, op: str, data_bytes: int, deadline_s: float, *, capture_checked: bool = False
    ) -> int:
        """Start a call of ``op``: raise an earlier failure, reserve ``data_bytes``
        (an even number of halves when the op alternates two buffers), next epoch.
        Refused while a CUDA graph is being captured: a replay would repeat this
        epoch, and its waits would pass on the flags of the replay before
        (``capture_checked``: the caller has just seen that none is, and the query
        costs host time a decode-size call cannot hide)."""
        if self._failure is not None or self._error_view[ERR_CODE] != CODE_OK:
            self.raise_if_failed()
        if self._cuda and not capture_checked and _stream_capturing():
            raise OverlapInputError(
                f"{op}: its symmetric-memory steps cannot be captured in a CUDA graph (each call's flags "
                "carry the call's own epoch, which a replay would repeat); call it outside the capture"
            )
        if data_bytes + RESERVE_SLACK > self._capacity:  # (reserve(), inline: every call asks)
            self._grow(data_bytes + RESERVE_SLACK, op, deadline_s)
        epoch = self.epoch = self.epoch + 1
        self._calls[epoch] = (op, deadline_s)  # to name a timeout of this call later
        self._calls.pop(epoch - 64, None)
        return epoch

    def reserve(self, op: str, data_bytes: int, deadline_s: float) -> None:
        """Grow the data region (collectively) to hold ``data_bytes``."""
        if data_bytes + RESERVE_SLACK > self._capacity:  # + alignment of the second half
            self._grow(data_bytes + RESERVE_SLACK, op, deadline_s)

    def finish(self) -> None:
        """End a call: on CPU the work is done, so a timeout is raised right here."""
        if not self._cuda:
            self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Raise the failure a kernel recorded, if any: a timeout, or a peer's call
        that was another than this rank's; then what an op's record holds
        (``op_records``). Reads host memory; no device sync."""
        if self._failure is None and self._error_view[ERR_CODE] != CODE_OK:
            rec = self.error_record.tolist()
            epoch = rec[ERR_EPOCH]
            op, deadline_s = self._calls.get(epoch) or self._replayed_call()
            if rec[ERR_DEADLINE_MS]:  # the deadline the wait that timed out had
                deadline_s = rec[ERR_DEADLINE_MS] / 1000
            if rec[ERR_CODE] == CODE_MISMATCH:
                self._failure = OverlapMismatchError(
                    op, self.rank, rec[ERR_PEER], epoch, rec[ERR_MINE], rec[ERR_THEIRS]
                )
            else:
                self._failure = OverlapTimeoutError(
                    op, self.rank, rec[ERR_PEER], rec[ERR_CHUNK], epoch, deadline_s
                )
        if self._failure is not None:
            raise self._failure
        for record in self.op_records.values():
            record.check()

    def _replayed_call(self) -> tuple[str, float]:
        if not self.replayed:
            return "overlap_kernels op", float("nan")
        return " or ".join(sorted(self.replayed)) + " (replayed in a CUDA graph)", max(
            self.replayed.values()
        )

    @property
    def error_address(self) -> int:
        return self.error_record.data_ptr()

    # ---- streams ------------------------------------------------------------
    def overlap(
        self,
        communicate: Callable[[], object],
        compute: Callable[[], object],
        beside: Sequence[Callable[[], object]] = (),
    ) -> None:
        """Run ``communicate()`` on the communication stream beside ``compute()``,
        and each of ``beside`` (more communication) on a communication stream of
        its own, so that copies gated by different peers' flags run at once.

        The communication is enqueued first, ordered after everything enqueued
        before this call (the publish step); the compute kernel then waits for
        its chunks' flags. This order is not a matter of taste: loading a
        kernel's module (its first launch) waits for the kernels running on the
        device, so a compute kernel enqueued first could spin on flags that a
        not-yet-loaded transfer kernel will set only after it ends: the first
        call would time out. Transfers depend only on peers'
        announcements, never on the compute kernel, so this order cannot stall.
        On the CPU there are no streams: the transfers run to completion first.
        """
        if self.device.type != "cuda":
            communicate()
            for more in beside:
                more()
            compute()
            return
        streams = self.streams
        main = streams.current()
        comm = self.comm_streams(1 + len(beside))
        streams.fork(main, comm)
        for stream, lane in zip(comm, (communicate, *beside)):
            with streams.on(stream, back=main):
                lane()
        compute()
        streams.join(main, comm)  # later work on main sees the transfers done

    def comm_streams(self, count: int) -> list:
        """The first ``count`` communication streams (high priority), made where
        missing; none on the CPU."""
        while self.device.type == "cuda" and len(self._comm_streams) < count:
            self._comm_streams.append(torch.cuda.Stream(self.device, priority=-1))
        return self._comm_streams[:count]

    @property
    def streams(self) -> Streams:
        """Switches and joins of this device's streams (streams.py; CUDA only)."""
        if self._streams is None:
            self._streams = Streams(self.device)
        return self._streams

    def compute_streams(self, count: int) -> tuple:
        """The caller's current stream, then up to ``count - 1`` more for compute
        beside it (one at most, created once, normal priority); empty on the CPU."""
        if self.device.type != "cuda":
            return ()
        main = self.streams.current()
        if count < 2:
            return (main,)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        return (main, self._side_stream)

    def signal_from_stream(
        self, slot: int, epoch: int, flags: torch.Tensor | None = None, word: int = 0
    ) -> None:
        """Set chunk flag ``slot`` to ``epoch`` in stream order after the work enqueued
        before it: this rank's flag, or one of ``flags`` (a peer's, from
        :meth:`peer_chunk_flags`), with the call's signature ``word`` (signals.py).

        CUDA: stream memory operations (cuStreamWriteValue32, each with a system-wide
        fence first; the word's before the flag's): no SM, no kernel launch. CPU, and
        calls replayed in CUDA graphs (``epoch`` == DEVICE_EPOCH: a stream write's value
        is fixed at capture): the release kernel, which reads the replay's epoch on the device.
        """
        if flags is None:
            word = 0  # (this rank's own flag: its waits check no word)
        if self.device.type == "cuda" and epoch != DEVICE_EPOCH:
            words = self._chunk_flags_u32 if flags is None else flags.view(torch.uint32)
            if word:
                torch.ops.symm_mem.stream_write_value32_(words, word_slot(self.rank, epoch), word)
            torch.ops.symm_mem.stream_write_value32_(words, slot, epoch)
        else:
            signal_kernel[(1,)](
                self.chunk_flags if flags is None else flags, slot, epoch, self.chunk_flags,
                self.rank, word,
            )  # fmt: skip


_WORKSPACES: dict[tuple, Workspace] = {}
_CHOSEN_BACKENDS: dict[str, str] = {}  # group name -> backend name, set by use_backend()


def use_backend(name: str, group: dist.ProcessGroup | None = None) -> None:
    """Hold ``group``'s symmetric workspace in backend ``name`` ("torch", "cupy",
    "nvshmem" on CUDA; "host" on CPU). Call it on every rank before the group's
    first op; without it CUDA tensors use "torch" and CPU tensors "host".

    A missing extra (cupy, nvshmem4py) is reported here. Changing the backend
    of a group whose workspace exists needs :func:`reset_workspaces` first."""
    cls = backend_class(name)
    if group is None and not dist.is_initialized():
        raise OverlapInputError(
            "use_backend: torch.distributed is not initialised: call dist.init_process_group first"
        )
    group = group if group is not None else dist.group.WORLD
    for (group_name, _), ws in _WORKSPACES.items():
        if group_name == group.group_name and ws.backend.name != name:
            raise OverlapInputError(
                f"group '{group_name}' already holds its workspace in backend '{ws.backend.name}'; "
                f"call overlap_kernels.reset_workspaces() on every rank before switching to '{name}'"
            )
    if cls.device_type == "cuda":
        cls()  # a missing extra is reported now, not at the first op
    _CHOSEN_BACKENDS[group.group_name] = name


def get_workspace(
    group: dist.ProcessGroup | None,
    device: torch.device,
    op: str = "overlap_kernels",
    deadline_s: float = DEFAULT_TIMEOUT_S,
    *,
    replay: bool = False,
) -> Workspace:
    """The workspace of ``group`` on ``device``, created (collectively) on first
    use: by a call of ``op``, whose peers must all arrive within ``deadline_s``.
    ``replay``: the group's second workspace, for fused calls captured in CUDA
    graphs (its own flags and buffer: a replay counts epochs on the device,
    which must never meet the host-counted epochs of eager calls)."""
    group = group if group is not None else dist.group.WORLD
    key = (group.group_name, f"{device}/replay" if replay else str(device))
    ws = _WORKSPACES.get(key)
    if ws is None:
        world = dist.get_world_size(group)
        if world > MAX_WORLD:
            raise ValueError(
                f"overlap_kernels supports at most {MAX_WORLD} ranks per group, got {world}"
            )
        pin = device.type == "cuda"
        backend = make_backend(
            _CHOSEN_BACKENDS.get(group.group_name, default_backend_name(device)), device
        )
        ws = Workspace(group, device, backend, dist.get_rank(group), world)
        ws.error_record = torch.zeros(ERR_RECORD_LEN, dtype=torch.int32, pin_memory=pin)
        ws._error_view = ws.error_record.numpy()  # reads host memory with no torch call per check
        ws.counters = torch.zeros(NUM_FLAGS, dtype=torch.int32, device=device)
        ws._grow(_MIN_DATA_BYTES, op, deadline_s)
        _WORKSPACES[key] = ws
    return ws


def is_current(ws: Workspace) -> bool:
    """Whether ``ws`` is still its group's workspace (not forgotten by reset_workspaces())."""
    return _WORKSPACES.get((ws.group.group_name, str(ws.device))) is ws


_on_reset: list = []  # callables run by reset_workspaces(): holders of workspaces let go of them


def on_reset(forget: Callable[[], object]) -> None:
    """Have reset_workspaces() call ``forget()``: for what keeps a workspace
    between calls (the ops' plans, ops/plans.py), which must not use it again."""
    _on_reset.append(forget)


def reset_workspaces() -> None:
    """Forget every workspace (collective on the next call): the way out after a timeout."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for forget in _on_reset:
        forget()
    _WORKSPACES.clear()


def raise_if_failed(group: dist.ProcessGroup | None = None) -> None:
    """Synchronise and raise the timeout any op of ``group`` recorded on this rank."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    group = group if group is not None else dist.group.WORLD
    for (name, _), ws in _WORKSPACES.items():
        if name == group.group_name:
            ws.raise_if_failed()


__all__ = ["Workspace", "get_workspace", "raise_if_failed", "reset_workspaces", "use_backend"]
