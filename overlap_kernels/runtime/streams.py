"""CUDA streams as a fused call switches and joins them, with few host calls.

torch.cuda's stream API builds a Stream object per ``current_stream()``
query, an Event per ``wait_stream()`` and two stream queries per ``with
torch.cuda.stream(...)``; a fused call switches streams a few times, and at
decode sizes host time is the op's time (docs/performance.md, "Host time"). The helpers
here query the raw current stream once, keep the Stream objects and events
they make, and set the current stream directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


class Streams:
    """One device's streams as the ops use them: the caller's current stream
    (its Stream object kept per raw handle), forks and joins by events made once."""

    def __init__(self, device: torch.device):
        self.device = device
        self._known: dict[int, torch.cuda.Stream] = {}  # raw handle -> its Stream object
        self._fork = torch.cuda.Event()
        self._joins: list[torch.cuda.Event] = []

    def current(self) -> torch.cuda.Stream:
        """The current stream of the device (the caller's)."""
        raw = torch._C._cuda_getCurrentRawStream(self.device.index)
        stream = self._known.get(raw)
        if stream is None:
            stream = self._known[raw] = torch.cuda.current_stream(self.device)
        return stream

    def fork(self, main: torch.cuda.Stream, streams: Sequence[torch.cuda.Stream]) -> None:
        """Each of ``streams`` waits for the work enqueued on ``main`` so far."""
        self._fork.record(main)
        for stream in streams:
            stream.wait_event(self._fork)

    def join(self, main: torch.cuda.Stream, streams: Sequence[torch.cuda.Stream]) -> None:
        """``main`` waits for the work enqueued on each of ``streams`` so far."""
        while len(self._joins) < len(streams):
            self._joins.append(torch.cuda.Event())
        for stream, event in zip(streams, self._joins):
            event.record(stream)
            main.wait_event(event)

    @staticmethod
    @contextlib.contextmanager
    def on(stream: torch.cuda.Stream, back: torch.cuda.Stream) -> Iterator[None]:
        """Enqueue on ``stream`` inside, then on ``back`` again (the current stream before)."""
        _set(stream)
        try:
            yield
        finally:
            _set(back)


def _set(stream: torch.cuda.Stream) -> None:
    torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                             device_type=stream.device_type)  # fmt: skip
