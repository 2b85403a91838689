"""Chunk schedules: which piece of which rank's rows arrives when, how, under which flag.

A schedule is a plain immutable value, independent of tensor shapes: a chunk
names a piece of a source rank's shard (piece ``i`` of ``n`` equal pieces), so
the same schedule serves any number of rows. For each rank it lists the chunks
that rank consumes, in the order they arrive; the fused kernel walks its output
tiles in that order and waits on a chunk's flag once per tile.

Mechanisms:
    ``local``        the rows are this rank's own: present before the launch, no flag.
    ``copy_engine``  pulled by a peer-view copy on the communication stream, then
                     the chunk's flag is set on that stream.
    ``sm_copy``      pulled by a Triton copy kernel on the communication stream,
                     which sets the flag itself (release after the stores).
    ``push``         stored into the consumer's memory by the producing kernel
                     itself (producer schedules only: producers.py).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction

from ..limits import SCHEDULE_FLAGS

LOCAL = "local"
COPY_ENGINE = "copy_engine"
SM_COPY = "sm_copy"
PUSH = "push"
MECHANISMS = (LOCAL, COPY_ENGINE, SM_COPY, PUSH)

# Chunk flags available per call (the workspace layout).
MAX_FLAGS = SCHEDULE_FLAGS


class ScheduleError(ValueError):
    """A schedule that cannot run: every problem found, one per line."""


@dataclass(frozen=True)
class Chunk:
    """Piece ``piece`` of ``pieces`` equal pieces of rank ``src``'s rows."""

    src: int
    piece: int = 0
    pieces: int = 1
    mechanism: str = COPY_ENGINE
    flag: int | None = None  # chunk-flag slot that announces it; None for local chunks

    def rows(self, rows_per_rank: int) -> tuple[int, int]:
        """[start, stop) of this chunk in the gathered row space."""
        base = self.src * rows_per_rank
        start = base + self.piece * rows_per_rank // self.pieces
        stop = base + (self.piece + 1) * rows_per_rank // self.pieces
        return start, stop

    @property
    def fraction(self) -> tuple[Fraction, Fraction]:
        return Fraction(self.piece, self.pieces), Fraction(self.piece + 1, self.pieces)

    def label(self, rows_per_rank: int | None = None) -> str:
        piece = f"[{self.piece + 1}/{self.pieces}]" if self.pieces > 1 else ""
        rows = ""
        if rows_per_rank is not None:
            start, stop = self.rows(rows_per_rank)
            rows = f" rows {start}:{stop}"
        how = "local" if self.mechanism == LOCAL else f"{self.mechanism}, flag {self.flag}"
        return f"r{self.src}{piece}{rows} ({how})"


@dataclass(frozen=True)
class ChunkSchedule:
    """For each rank, the ordered chunks it consumes. Build with a factory or by hand."""

    world_size: int
    chunks: tuple[
        tuple[Chunk, ...], ...
    ]  # chunks[rank] in arrival order (lists are taken as tuples)
    name: str = "custom"

    def __post_init__(self) -> None:
        # A value that keys caches: hand-written lists become the tuples they stand for.
        if not isinstance(self.chunks, (list, tuple)) or not all(
            isinstance(c, (list, tuple)) for c in self.chunks
        ):
            raise ScheduleError("chunks must be one list (or tuple) of Chunk per rank")
        object.__setattr__(self, "chunks", tuple(tuple(rank_chunks) for rank_chunks in self.chunks))

    def for_rank(self, rank: int) -> tuple[Chunk, ...]:
        return self.chunks[rank]

    def __hash__(self) -> int:
        # Schedules key the ops' per-call caches: hash the nested chunks once.
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.world_size, self.chunks, self.name))

    @functools.cached_property
    def mechanisms(self) -> frozenset[str]:
        """How this schedule moves rows between ranks (``local`` left out)."""
        return frozenset(c.mechanism for chunks in self.chunks for c in chunks) - {LOCAL}

    def problems(self) -> list[str]:
        """Everything that makes this schedule unusable (empty when it is valid)."""
        return list(_problems(self))

    def validate(self) -> ChunkSchedule:
        """Raise :class:`ScheduleError` unless every row arrives exactly once and
        every wait has a producer; return the schedule for chaining."""
        found = self.problems()
        if found:
            raise ScheduleError(f"schedule '{self.name}' is invalid:\n  " + "\n  ".join(found))
        return self

    def describe(self, rows_per_rank: int | None = None) -> str:
        """A readable timeline: one line per rank, chunks in arrival order."""
        lines = [f"ChunkSchedule '{self.name}' (world {self.world_size})"]
        for rank, chunks in enumerate(self.chunks):
            steps = " -> ".join(c.label(rows_per_rank) for c in chunks)
            lines.append(f"  rank {rank}: {steps}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


@functools.lru_cache(maxsize=256)
def _problems(schedule: ChunkSchedule) -> tuple[str, ...]:
    """Cached: a schedule is immutable, and checking one with exact fractions
    costs milliseconds at 8 ranks x 4 pieces, which ops pay on every call."""
    if schedule.world_size < 1:
        return (f"world_size must be >= 1, got {schedule.world_size}",)
    if len(schedule.chunks) != schedule.world_size:
        return (
            f"needs one chunk list per rank: {schedule.world_size} ranks, {len(schedule.chunks)} lists",
        )
    found: list[str] = []
    for rank, chunks in enumerate(schedule.chunks):
        found += _rank_problems(rank, chunks, schedule.world_size)
    return tuple(found)


def _rank_problems(rank: int, chunks: tuple[Chunk, ...], world: int) -> list[str]:
    found: list[str] = []
    pieces_by_src: dict[int, list[tuple[Fraction, Fraction]]] = defaultdict(list)
    flags_seen: dict[int, int] = {}
    for i, c in enumerate(chunks):
        where = f"rank {rank}, chunk {i} ({c.label()})"
        if not 0 <= c.src < world:
            found.append(f"{where}: source rank {c.src} is outside 0..{world - 1}")
            continue
        if c.pieces < 1 or not 0 <= c.piece < c.pieces:
            found.append(f"{where}: piece {c.piece} of {c.pieces} does not exist")
            continue
        if c.mechanism not in MECHANISMS:
            found.append(
                f"{where}: unknown mechanism '{c.mechanism}' (one of {', '.join(MECHANISMS)})"
            )
        if c.src == rank and c.mechanism != LOCAL:
            found.append(f"{where}: own rows are already here; use mechanism 'local'")
        if c.src != rank and c.mechanism == LOCAL:
            found.append(f"{where}: rows of rank {c.src} marked 'local': nothing would move them")
        if c.mechanism == LOCAL and c.flag is not None:
            found.append(
                f"{where}: a local chunk has no producer to set flag {c.flag}; use flag=None"
            )
        if c.src != rank and c.flag is None:
            found.append(f"{where}: a remote chunk needs a flag slot to wait on")
        if c.flag is not None:
            if not 0 <= c.flag < MAX_FLAGS:
                found.append(f"{where}: flag {c.flag} is outside 0..{MAX_FLAGS - 1}")
            elif c.flag in flags_seen:
                found.append(
                    f"{where}: flag {c.flag} is already announced by chunk {flags_seen[c.flag]}"
                )
            else:
                flags_seen[c.flag] = i
        pieces_by_src[c.src].append(c.fraction)
    for src in range(world):
        found += _coverage_problems(rank, src, sorted(pieces_by_src.get(src, [])))
    return found


def _coverage_problems(rank: int, src: int, spans: list[tuple[Fraction, Fraction]]) -> list[str]:
    """Spans of a shard that arrive must cover [0, 1) once: no gap, no overlap."""
    where = f"rank {rank}, rows of rank {src}"
    if not spans:
        return [f"{where}: never arrive"]
    found, reached = [], Fraction(0)
    for start, stop in spans:
        if start > reached:
            found.append(f"{where}: fraction {reached}..{start} never arrives")
        elif start < reached:
            found.append(f"{where}: fraction {start}..{min(stop, reached)} arrives twice")
        reached = max(reached, stop)
    if reached < 1:
        found.append(f"{where}: fraction {reached}..1 never arrives")
    return found
