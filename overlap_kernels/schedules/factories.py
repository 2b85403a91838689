"""Schedule factories. Every factory returns a validated :class:`ChunkSchedule`.

On a full NVLink mesh every transfer goes straight from its source to its
consumer: the factories differ only in the order peers' rows arrive, which is
the order the kernel consumes them in. Every rank starts with its own rows,
which need no transfer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import replace

from .chunks import COPY_ENGINE, LOCAL, Chunk, ChunkSchedule


def _number_flags(chunks: list[Chunk]) -> tuple[Chunk, ...]:
    """Give remote chunks flag slots 0, 1, 2, ... in arrival order."""
    numbered, slot = [], 0
    for c in chunks:
        if c.mechanism == LOCAL:
            numbered.append(replace(c, flag=None))
        else:
            numbered.append(replace(c, flag=slot))
            slot += 1
    return tuple(numbered)


def from_source_order(
    world_size: int, order: Callable[[int], Iterable[int]], name: str, mechanism: str = COPY_ENGINE
) -> ChunkSchedule:
    """Build a schedule from ``order(rank) -> [source ranks in arrival order]``."""
    lists = []
    for rank in range(world_size):
        sources = list(order(rank))
        chunks = [Chunk(src, mechanism=LOCAL if src == rank else mechanism) for src in sources]
        lists.append(_number_flags(chunks))
    return ChunkSchedule(world_size, tuple(lists), name).validate()


def ring(world_size: int, mechanism: str = COPY_ENGINE) -> ChunkSchedule:
    """Own rows, then rank-1, rank-2, ...: the order a ring all-gather delivers."""
    return from_source_order(
        world_size, lambda r: [(r - s) % world_size for s in range(world_size)], "ring", mechanism
    )


def direct(world_size: int, mechanism: str = COPY_ENGINE) -> ChunkSchedule:
    """Own rows, then rank+1, rank+2, ...: at every position each rank reads a
    different peer, so no peer's links serve two readers at once."""
    return from_source_order(
        world_size, lambda r: [(r + s) % world_size for s in range(world_size)], "direct", mechanism
    )


def bidirectional(world_size: int, mechanism: str = COPY_ENGINE) -> ChunkSchedule:
    """Own rows, then rank+1, rank-1, rank+2, rank-2, ...: both directions of a ring at once."""

    def order(rank: int) -> list[int]:
        sources = [rank]
        for distance in range(1, world_size):
            for src in ((rank + distance) % world_size, (rank - distance) % world_size):
                if src not in sources:
                    sources.append(src)
        return sources

    return from_source_order(world_size, order, "bidirectional", mechanism)


def local_first(schedule: ChunkSchedule) -> ChunkSchedule:
    """The same chunks with each rank's own rows moved to the front (stable otherwise)."""
    lists = []
    for chunks in schedule.chunks:
        ordered = [c for c in chunks if c.mechanism == LOCAL] + [
            c for c in chunks if c.mechanism != LOCAL
        ]
        lists.append(tuple(ordered))
    return ChunkSchedule(
        schedule.world_size, tuple(lists), f"local_first({schedule.name})"
    ).validate()


def split(schedule: ChunkSchedule, n: int) -> ChunkSchedule:
    """Each chunk cut into ``n`` consecutive pieces (finer arrival, more flags)."""
    if n < 1:
        raise ValueError(f"split needs n >= 1, got {n}")
    lists = []
    for chunks in schedule.chunks:
        pieces = [
            replace(c, piece=c.piece * n + i, pieces=c.pieces * n) for c in chunks for i in range(n)
        ]
        lists.append(_number_flags(pieces))
    return ChunkSchedule(
        schedule.world_size, tuple(lists), f"split({schedule.name}, {n})"
    ).validate()


def with_mechanism(schedule: ChunkSchedule, mechanism: str) -> ChunkSchedule:
    """The same order with every transfer made by ``mechanism``."""
    lists = [
        tuple(c if c.mechanism == LOCAL else replace(c, mechanism=mechanism) for c in chunks)
        for chunks in schedule.chunks
    ]
    return ChunkSchedule(schedule.world_size, tuple(lists), schedule.name).validate()


FACTORIES = {"ring": ring, "direct": direct, "bidirectional": bidirectional}


@functools.lru_cache(maxsize=128)
def by_name(
    name: str, world_size: int, mechanism: str = COPY_ENGINE, pieces: int = 1
) -> ChunkSchedule:
    """The schedule a config names: a factory, its mechanism, each chunk in ``pieces``.

    Cached: schedules are immutable, and building and validating one is Python
    work per chunk and piece, which a decode-size call's host time (its time)
    cannot hide."""
    if name not in FACTORIES:
        raise ValueError(f"unknown schedule '{name}': one of {', '.join(FACTORIES)}")
    if pieces < 1:
        raise ValueError(f"pieces must be >= 1, got {pieces}")
    schedule = FACTORIES[name](world_size, mechanism)
    return split(schedule, pieces) if pieces > 1 else schedule
