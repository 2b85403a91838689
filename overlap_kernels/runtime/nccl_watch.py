"""Per-call deadlines for the plain paths' NCCL collectives, kept without a host wait.

Problem. An NCCL collective is only enqueued: the call returns at once and its
kernel runs on the device, where a peer that never comes leaves it spinning,
with everything enqueued behind it. The host finds out when it next waits for
the device, and then waits as long as the kernel spins. ``timeout_s`` must bound
that, on the plain paths as on the fused ones, without the host waiting for the
device on the hot path (a plain call's host time is judged against
``torch.matmul`` plus the collective, which only enqueue) and without waiting on
anything while a CUDA graph is captured.

What torch offers, and why it is not used (ProcessGroupNCCL.cpp, torch 2.11-2.13):

- ``Work.wait(timeout)``: makes the current stream wait for the collective and
  then, given a timeout, blocks the host thread, polling the work every few ms,
  until it completes or the timeout passes; on a timeout it aborts the
  communicator and raises. Every plain call would hold the host for its whole
  device time, and no host wait is possible during a capture.
- The group's timeout (``init_process_group(timeout=...)``, the backend's
  ``_set_default_timeout``): each Work takes its deadline from the group's options
  when it is enqueued; the per-call ``AllreduceOptions.timeout`` is not read by
  NCCL's watchdog. A per-call deadline would mean changing the group's timeout
  around every call, the caller's own collectives on the group included. And on
  a timeout the watchdog dumps its flight recorder, sleeps for the dump, aborts
  the communicators and, under the default ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``,
  takes the process down: no error the caller could catch.
- Checking only on the next call or in ``raise_if_failed()``, as a fused call's
  device timeout is raised: costs no host wait, but the kernel keeps spinning, so
  a host that waits for the device first (reading a result, a full launch queue)
  blocks in CUDA and never reaches the check.

So this module does the check of the last option from a deadline watchdog of its
own, which can also end the spinning kernel. After enqueueing a collective (not
while capturing, and not with ``timeout_s`` infinite), a call records a CUDA
event on its stream: the *record* of its group and stream, which the calls of the
next ``SPAN_S`` share (each re-records its event and may push its deadline later,
never earlier), then a new one starts. A daemon thread (:class:`Watch`) wakes every
``POLL_S`` while anything is watched, closes records older than ``SPAN_S`` and
queries their events. A record whose event is not complete past its deadline
fails its group: the thread stores an ``OverlapTimeoutError`` naming the op, the
rank and the collective, then aborts the group's NCCL backend
(``ProcessGroupNCCL.abort()``: ``ncclCommAbort`` of its communicators, its watchdog
stopped, the process left up). The abort ends the spinning kernel, so the stream
and a host waiting on it go on; the next collective the library issues on the
group, or ``raise_if_failed(group)``, raises the error. It is found at most
``SPAN_S`` + ``POLL_S`` after the deadline; a deadline counts from the call on the
host, as NCCL's watchdog counts its own, so a collective enqueued behind long
device work is given less.

Cost on the hot path: no host wait. Per call, a capture query, a raw stream
query, a clock read, a lock, a dict lookup and one ``cudaEventRecord``; a new
event once per ``SPAN_S``; the thread takes the GIL every ``POLL_S`` while a
record is open or pending, and sleeps otherwise.

The communicator after a timeout is aborted for good: NCCL cannot cancel one
collective, and a live communicator would pair the abandoned collective with the
peer's late call and write into ``out`` whenever it came. Results of work
enqueued behind it are garbage. Every rank leaves the group
(``dist.destroy_process_group(group)``; a rank whose communicator is still live
calls ``group.abort()`` first, so that nothing waits for the missing peer) and
makes a new one (``dist.new_group(...)``; for the default group,
``init_process_group`` again), then calls ``reset_workspaces()``; CUDA graphs that
captured the group's collectives are captured again.

Not watched: collectives captured in a CUDA graph (a replay runs them without a
host call; NCCL's watchdog does not watch them either), and calls with
``timeout_s`` infinite (the group's own timeout then bounds them).
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .errors import OverlapTimeoutError

_log = logging.getLogger("overlap_kernels")

# How long one record takes the calls of its group and stream (host time): a
# missing collective is found at most this much later than its deadline, and a
# process holds about (device lag + POLL_S) / SPAN_S records' events at a time.
SPAN_S = 0.05
# The watchdog's period while a record is open or pending.
POLL_S = 0.05
# How often raise_if_failed() polls the records of its group.
SETTLE_POLL_S = 0.001


class _Record:
    """The calls of one group on one stream within SPAN_S: an event re-recorded
    after each call's collective, and the latest deadline among the calls."""

    __slots__ = ("deadline", "event", "group", "op", "opened", "rank", "timeout_s", "what")

    def __init__(self, group, op: str, what: str, rank: int, opened: float, event: Any):
        self.group, self.op, self.what, self.rank = group, op, what, rank
        self.opened, self.deadline, self.timeout_s, self.event = opened, -math.inf, 0.0, event


class Watch:
    """The records of one process and the thread that keeps their deadlines.

    ``new_event()`` makes an event (``record(stream)``, ``query()``),
    ``stream_of(device_index)`` gives ``(key, stream)`` for the current stream,
    ``abort(group)`` aborts a group's NCCL backend, ``capturing()`` says whether the
    current stream captures a CUDA graph, ``rank_of(group)`` is this rank in the
    group, and ``enter_thread()`` runs first in the watchdog thread. The defaults
    are CUDA's and torch.distributed's; a test passes its own."""

    def __init__(
        self,
        new_event: Callable[[], Any] | None = None,
        stream_of: Callable[[int], tuple[int, Any]] | None = None,
        abort: Callable[[Any], None] | None = None,
        capturing: Callable[[], bool] | None = None,
        rank_of: Callable[[Any], int] = dist.get_rank,
        enter_thread: Callable[[], None] | None = None,
        span_s: float = SPAN_S,
        poll_s: float = POLL_S,
    ):
        self._new_event = new_event or (lambda: torch.cuda.Event())
        self._stream_of = stream_of or _CudaStreams().current
        self._abort = abort or _abort_nccl
        self._capturing = capturing or torch._C._cuda_isCurrentStreamCapturing
        self._rank_of, self._enter_thread = rank_of, enter_thread or _thread_local_capture_mode
        self.span_s, self.poll_s = span_s, poll_s
        self._lock = threading.Lock()
        self._open: dict[tuple[int, int], _Record] = {}  # (id(group), stream key) -> its record
        self._closed: list[_Record] = []  # no longer re-recorded, not yet seen complete
        self._spare: list[Any] = []  # events of records seen complete
        # id(group) -> (group, its error); the group is kept, so its id is not reused
        self._failed: dict[int, tuple[Any, OverlapTimeoutError]] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the hot path ----------------------------------------------------------
    def check(self, group) -> None:
        """Raise the timeout recorded for ``group``, if any (before enqueueing on it)."""
        if self._failed:
            entry = self._failed.get(id(group))
            if entry is not None and entry[0] is group:
                raise entry[1]

    def note(self, op: str, what: str, group, timeout_s: float, device_index: int) -> None:
        """After ``op`` enqueued ``what`` on ``group`` from the current stream of
        device ``device_index``: watch it until ``timeout_s`` from now."""
        if timeout_s == math.inf or self._capturing():
            return
        key, stream = self._stream_of(device_index)
        now = time.monotonic()
        with self._lock:
            record = self._open.get((id(group), key))
            if record is None or now - record.opened >= self.span_s:
                if record is not None:
                    self._closed.append(record)
                event = self._spare.pop() if self._spare else self._new_event()
                record = _Record(group, op, what, self._rank_of(group), now, event)
                self._open[(id(group), key)] = record
                self._start()
            if now + timeout_s > record.deadline:
                record.deadline, record.timeout_s = now + timeout_s, timeout_s
            record.event.record(stream)

    # ---- off the hot path ------------------------------------------------------
    def settle(self, group) -> None:
        """Wait until every collective watched on ``group`` has completed, or raise
        its timeout (which the watchdog thread records by the deadline)."""
        while True:
            self.check(group)
            with self._lock:
                records = [r for r in (*self._open.values(), *self._closed) if r.group is group]
            if all(r.event.query() for r in records):
                return
            time.sleep(SETTLE_POLL_S)

    def _start(self) -> None:
        """(Under the lock.) Run the watchdog thread, and wake it if it sleeps."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="overlap_kernels NCCL deadlines", daemon=True
            )
            self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        self._enter_thread()
        while True:
            self._wake.wait()
            self._wake.clear()
            busy = True
            while busy:
                try:
                    busy = self.sweep()
                except Exception:  # noqa: BLE001 - the thread must outlive a bad sweep
                    _log.exception("NCCL deadlines: a sweep failed")
                time.sleep(self.poll_s)

    def sweep(self) -> bool:
        """Close the records older than ``span_s``, retire those complete, fail the
        groups of those past their deadline; whether anything is still watched."""
        now = time.monotonic()
        with self._lock:
            for key, record in list(self._open.items()):
                if now - record.opened >= self.span_s:
                    del self._open[key]
                    self._closed.append(record)
            closed = list(self._closed)
        done, late = [], []
        for record in closed:  # (queries outside the lock: nothing re-records a closed record)
            if record.event.query():
                done.append(record)
            elif now >= record.deadline:
                late.append(record)
        failed = []
        with self._lock:
            for record in done:
                self._closed.remove(record)
                self._spare.append(record.event)
            for record in late:
                group = record.group
                if id(group) in self._failed:
                    continue
                error = OverlapTimeoutError(
                    record.op, record.rank, None, -1, None, record.timeout_s,
                    where=f"the plain path's {record.what}", aborted=True,
                )  # fmt: skip
                self._failed[id(group)] = (group, error)
                failed.append(group)
                # The group's records end here: the abort ends their collectives.
                self._closed = [r for r in self._closed if r.group is not group]
                for key in [k for k, r in self._open.items() if r.group is group]:
                    del self._open[key]
            busy = bool(self._open or self._closed)
        for group in failed:
            try:
                self._abort(group)
            except Exception:  # noqa: BLE001 - the timeout is recorded; the abort is best effort
                _log.exception("aborting the NCCL communicator of a group past its deadline failed")
        return busy


class _CudaStreams:
    """The current CUDA stream as (raw handle, Stream object), the object made
    once per handle (torch.cuda.current_stream() builds one per query)."""

    def __init__(self):
        self._known: dict[int, torch.cuda.Stream] = {}

    def current(self, device_index: int) -> tuple[int, torch.cuda.Stream]:
        raw = torch._C._cuda_getCurrentRawStream(device_index)
        stream = self._known.get(raw)
        if stream is None:
            stream = self._known[raw] = torch.cuda.current_stream(device_index)
        return raw, stream


def _abort_nccl(group) -> None:
    """Abort ``group``'s NCCL backend: its communicators end every kernel they run;
    the group stays registered (the caller destroys it)."""
    group._get_backend(torch.device("cuda")).abort()


_CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1


def _thread_local_capture_mode() -> None:
    """This thread's CUDA calls ignore other threads' captures: in the default
    (global) mode an event query here, during another thread's capture, would be
    refused and end that capture. torch's NCCL watchdog queries its events under
    the same mode (CUDAStreamCaptureModeGuard)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        mode = ctypes.c_int(_CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        libcuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))
    except (OSError, AttributeError):
        _log.warning("NCCL deadlines: no libcuda to set this thread's capture mode")


_WATCH: Watch | None = None


def watch() -> Watch:
    """The process's watch (made on the first NCCL collective)."""
    global _WATCH
    if _WATCH is None:
        _WATCH = Watch()
    return _WATCH


def settle(group: dist.ProcessGroup | None) -> None:
    """:meth:`Watch.settle` for ``group`` (None: the default group), if anything was watched."""
    if _WATCH is not None:
        _WATCH.settle(group if group is not None else dist.group.WORLD)
