"""Producer schedules: the order in which each rank computes the rows other ranks reduce.

gemm_rs and gemm_ar read a :class:`ChunkSchedule` from the producer's side.
``chunks[rank]`` lists the pieces of the product that ``rank`` computes, in
order; ``chunk.src`` names the *owner* of the rows (the rank that reduces
them: rows ``[owner * M // world, (owner + 1) * M // world)`` of the product,
piece ``piece`` of ``pieces``), and ``chunk.mechanism`` says how the partial
reaches the owner:

    ``push``         the GEMM's epilogue stores it into the owner's memory;
    ``copy_engine``  the owner pulls it with a peer-view copy on its
                     communication stream (gemm_rs only);
    ``local``        a chunk of the rank's own rows: the reduction, which waits
                     for every peer's partial of that piece.
(The validator also accepts ``sm_copy``; no op moves partials that way yet,
and the ops reject it.)

The ops assign flag slots themselves, one per (producer, piece) at the owner
(ops/reduce_details/plan.py), so ``chunk.flag`` is not read; :func:`rounds`
still numbers remote chunks so that the generic validator accepts them. On top of :meth:`ChunkSchedule.problems` a
producer schedule must cut every segment into the same number of pieces and
must *make progress*: when every rank walks its list and stops at a reduction
whose partials are not all produced yet, every rank still reaches the end.
:func:`producer_problems` checks both by walking the lists.
"""

from __future__ import annotations

import functools

from .chunks import LOCAL, PUSH, Chunk, ChunkSchedule, ScheduleError


def rounds(
    world_size: int, pieces: int = 1, mechanism: str = PUSH, lag: int | None = None
) -> ChunkSchedule:
    """Each rank's rows cut into ``pieces``. In round ``i`` rank r computes
    piece ``i`` of the rows of r+1, r+2, ..., r-1 (every rank sends to a
    different owner at a time); it reduces its own piece ``i`` ``lag`` rounds
    later (default ``pieces``: all own pieces last, which gives peers the most
    time). ``lag=1`` finishes own pieces early, for ops that pass sums on."""
    if pieces < 1:
        raise ValueError(f"rounds needs pieces >= 1, got {pieces}")
    lag = pieces if lag is None else lag
    if lag < 1:
        raise ValueError(
            f"rounds needs lag >= 1 (a reduction waits for the round that feeds it), got {lag}"
        )
    lists = []
    for rank in range(world_size):
        chunks: list[Chunk] = []
        for i in range(pieces + lag):
            if i < pieces:
                for distance in range(1, world_size):
                    chunks.append(Chunk((rank + distance) % world_size, i, pieces, mechanism))
            if 0 <= i - lag < pieces:
                chunks.append(Chunk(rank, i - lag, pieces, LOCAL))
        lists.append(_number_flags(chunks))
    name = f"rounds(pieces={pieces}, lag={lag}, {mechanism})"
    return validate_producer(ChunkSchedule(world_size, tuple(lists), name))


def _number_flags(chunks: list[Chunk]) -> tuple[Chunk, ...]:
    # Remote chunks carry distinct flag slots so that the generic validator
    # accepts them; the ops use their own (producer, piece) slots.
    numbered, slot = [], 0
    for c in chunks:
        if c.mechanism == LOCAL:
            numbered.append(c)
        else:
            numbered.append(Chunk(c.src, c.piece, c.pieces, c.mechanism, slot))
            slot += 1
    return tuple(numbered)


def producer_problems(schedule: ChunkSchedule) -> list[str]:
    """Everything that makes ``schedule`` unusable as a producer schedule."""
    return list(_producer_problems(schedule))


@functools.lru_cache(maxsize=128)
def _producer_problems(schedule: ChunkSchedule) -> tuple[str, ...]:
    found = schedule.problems()
    if found:
        return tuple(found)
    piece_counts = {c.pieces for chunks in schedule.chunks for c in chunks}
    if len(piece_counts) > 1:
        return (
            f"every chunk must cut its segment into the same number of pieces, found {sorted(piece_counts)}",
        )
    return tuple(_stalls(schedule))


def _stalls(schedule: ChunkSchedule) -> list[str]:
    """Walk every rank's list; a reduction passes once every peer has passed
    its own chunk of the same rows. Report the ranks left waiting."""
    world = schedule.world_size
    position_of = [
        {(c.src, c.piece): i for i, c in enumerate(chunks)} for chunks in schedule.chunks
    ]
    reached = [0] * world
    moved = True
    while moved:
        moved = False
        for rank, chunks in enumerate(schedule.chunks):
            while reached[rank] < len(chunks):
                c = chunks[reached[rank]]
                key = (c.src, c.piece)
                if c.mechanism == LOCAL and any(
                    reached[p] <= position_of[p][key] for p in range(world) if p != rank
                ):
                    break
                reached[rank] += 1
                moved = True
    found = []
    for rank, chunks in enumerate(schedule.chunks):
        if reached[rank] < len(chunks):
            c = chunks[reached[rank]]
            waiting_on = [
                p
                for p in range(world)
                if p != rank and reached[p] <= position_of[p][(c.src, c.piece)]
            ]
            found.append(
                f"rank {rank}, chunk {reached[rank]} ({c.label()}): its reduction waits for ranks {waiting_on}, "
                "which are themselves waiting: put every rank's own (local) pieces after the peers' same pieces"
            )
    return found


def validate_producer(schedule: ChunkSchedule) -> ChunkSchedule:
    """Raise :class:`ScheduleError` unless ``schedule`` is a valid producer schedule."""
    found = producer_problems(schedule)
    if found:
        raise ScheduleError(
            f"producer schedule '{schedule.name}' is invalid:\n  " + "\n  ".join(found)
        )
    return schedule


def own_pieces_last(schedule: ChunkSchedule) -> bool:
    """True when every rank reduces only after all of its partials have left."""
    for chunks in schedule.chunks:
        first_local = next(i for i, c in enumerate(chunks) if c.mechanism == LOCAL)
        if any(c.mechanism != LOCAL for c in chunks[first_local:]):
            return False
    return True


@functools.lru_cache(maxsize=128)
def rounds_by_config(
    world_size: int, pieces: int, mechanism: str, lag: int | None
) -> ChunkSchedule:
    """:func:`rounds`, cached: the ops build their default schedule on every call."""
    return rounds(world_size, pieces, mechanism, lag)


__all__ = ["own_pieces_last", "producer_problems", "rounds", "validate_producer"]
