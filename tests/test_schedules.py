"""Chunk schedules: pure Python, no tensors, no GPU.

The oracle for every factory is the contract a fused kernel relies on: on every
rank, every source rank's rows arrive exactly once (checked on real row ranges,
including ragged shard sizes), own rows come first with no flag, every remote
chunk has its own flag, and the arrival order is the one the factory promises.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import itertools
import pathlib
import re
import sys

import pytest

from overlap_kernels.schedules import (
    COPY_ENGINE,
    LOCAL,
    MECHANISMS,
    PUSH,
    SM_COPY,
    Chunk,
    ChunkSchedule,
    ScheduleError,
    bidirectional,
    by_name,
    direct,
    local_first,
    ring,
    split,
    with_mechanism,
)
from overlap_kernels.schedules.chunks import MAX_FLAGS

FACTORIES = {"ring": ring, "direct": direct, "bidirectional": bidirectional}
WORLDS = range(1, 9)
# Ragged on purpose: 1 and 7 do not divide into 2, 3 or 4 equal pieces; 13 is prime.
ROWS_PER_RANK = (1, 2, 7, 13, 128)
REMOTE_MECHANISMS = (COPY_ENGINE, SM_COPY)


def _variants():
    """(id, build(world) -> schedule, pieces per source) for every factory and wrapper.

    Builds are cached: schedules are immutable values, and validating them
    (Fractions) is what costs time here."""
    out = []
    for name, factory in FACTORIES.items():
        out.append((name, factory, 1))
        out.append((f"local_first({name})", lambda w, f=factory: local_first(f(w)), 1))
        for n in range(1, 5):
            out.append((f"split({name},{n})", lambda w, f=factory, n=n: split(f(w), n), n))
        out.append(
            (f"split(local_first({name}),3)", lambda w, f=factory: split(local_first(f(w)), 3), 3)
        )
        out.append((f"split(split({name},2),2)", lambda w, f=factory: split(split(f(w), 2), 2), 4))
    return [(name, functools.cache(build), pieces) for name, build, pieces in out]


VARIANTS = _variants()
VARIANT_IDS = [v[0] for v in VARIANTS]


def _factory_of(variant_id: str) -> str:
    """The factory inside a variant id: 'split(local_first(direct),3)' -> 'direct'."""
    return re.search(r"(?:^|\()(ring|direct|bidirectional)\b", variant_id).group(1)


def _expected_offsets(factory: str, world: int) -> list[int]:
    """(src - rank) % world of the sources in arrival order, own rows first."""
    if factory == "ring":
        return [(-k) % world for k in range(world)]
    if factory == "direct":
        return [k % world for k in range(world)]
    # bidirectional: +1, -1, +2, -2, ...; the farthest peer of an even world once.
    return [0] + [(k + 1) // 2 if k % 2 else world - k // 2 for k in range(1, world)]


def _arrived_rows(chunks, rows_per_rank: int) -> list[int]:
    rows = []
    for c in chunks:
        start, stop = c.rows(rows_per_rank)
        rows.extend(range(start, stop))
    return rows


def _source_order(chunks) -> list[int]:
    return list(dict.fromkeys(c.src for c in chunks))


def _hand_built(world: int, order, mechanism: str = COPY_ENGINE) -> ChunkSchedule:
    """A user-written schedule: ``order(rank)`` lists whole-shard sources."""
    lists = []
    for rank in range(world):
        chunks, flag = [], 0
        for src in order(rank):
            if src == rank:
                chunks.append(Chunk(src, mechanism=LOCAL))
            else:
                chunks.append(Chunk(src, mechanism=mechanism, flag=flag))
                flag += 1
        lists.append(tuple(chunks))
    return ChunkSchedule(world, tuple(lists))


def _with_chunks(schedule: ChunkSchedule, rank: int, chunks) -> ChunkSchedule:
    """``schedule`` with rank ``rank``'s chunk list replaced."""
    lists = list(schedule.chunks)
    lists[rank] = tuple(chunks)
    return ChunkSchedule(schedule.world_size, tuple(lists))


# --------------------------------------------------------------------------- factories


@pytest.mark.parametrize("variant_id, build, pieces", VARIANTS, ids=VARIANT_IDS)
def test_factory_every_row_arrives_exactly_once(variant_id, build, pieces):
    for world in WORLDS:
        _check_exactly_once(build(world), world)


def _check_exactly_once(schedule, world):
    assert schedule.validate() is schedule
    assert schedule.problems() == []
    assert schedule.world_size == world
    assert len(schedule.chunks) == world
    for rows_per_rank in ROWS_PER_RANK:
        for rank in range(world):
            chunks = schedule.for_rank(rank)
            for c in chunks:  # each chunk stays inside its source's shard
                start, stop = c.rows(rows_per_rank)
                assert c.src * rows_per_rank <= start <= stop <= (c.src + 1) * rows_per_rank
            arrived = _arrived_rows(chunks, rows_per_rank)
            where = f"world {world}, rank {rank}, {rows_per_rank} rows per rank"
            assert len(arrived) == len(set(arrived)), f"{where}: a row arrives twice"
            assert sorted(arrived) == list(range(world * rows_per_rank)), where


@pytest.mark.parametrize("variant_id, build, pieces", VARIANTS, ids=VARIANT_IDS)
def test_factory_own_rows_first_then_flagged_remote_chunks(variant_id, build, pieces):
    for world in WORLDS:
        _check_own_rows_first(build(world), pieces, world)


def _check_own_rows_first(schedule, pieces, world):
    for rank in range(world):
        chunks = schedule.for_rank(rank)
        assert len(chunks) == world * pieces
        own, remote = chunks[:pieces], chunks[pieces:]
        assert [(c.src, c.piece, c.pieces) for c in own] == [
            (rank, i, pieces) for i in range(pieces)
        ]
        assert all(c.mechanism == LOCAL and c.flag is None for c in own)
        assert all(c.src != rank and c.mechanism == COPY_ENGINE for c in remote)
        flags = [c.flag for c in remote]
        assert None not in flags
        assert len(set(flags)) == len(flags)
        assert flags == list(range(len(remote)))  # numbered in arrival order
        assert all(0 <= f < MAX_FLAGS for f in flags)


@pytest.mark.parametrize("variant_id, build, pieces", VARIANTS, ids=VARIANT_IDS)
def test_factory_source_order(variant_id, build, pieces):
    for world in WORLDS:
        _check_source_order(build(world), _factory_of(variant_id), pieces, world)


def _check_source_order(schedule, factory, pieces, world):
    expected = _expected_offsets(factory, world)
    for rank in range(world):
        chunks = schedule.for_rank(rank)
        sources = _source_order(chunks)
        assert [(src - rank) % world for src in sources] == expected, f"world {world}, rank {rank}"
        # A source's pieces arrive together, in piece order.
        assert [c.src for c in chunks] == [src for src in sources for _ in range(pieces)]
        for src in sources:
            assert [c.piece for c in chunks if c.src == src] == list(range(pieces))


def test_source_order_examples():
    """The order formula above, spelled out for a few cases."""
    assert _source_order(ring(5).for_rank(0)) == [0, 4, 3, 2, 1]
    assert _source_order(ring(4).for_rank(2)) == [2, 1, 0, 3]
    assert _source_order(direct(5).for_rank(0)) == [0, 1, 2, 3, 4]
    assert _source_order(direct(4).for_rank(3)) == [3, 0, 1, 2]
    assert _source_order(bidirectional(5).for_rank(0)) == [0, 1, 4, 2, 3]
    assert _source_order(bidirectional(4).for_rank(1)) == [1, 2, 0, 3]
    assert _source_order(bidirectional(8).for_rank(3)) == [3, 4, 2, 5, 1, 6, 0, 7]
    assert _source_order(bidirectional(2).for_rank(1)) == [1, 0]
    assert _source_order(ring(1).for_rank(0)) == [0]


@pytest.mark.parametrize("variant_id, build, pieces", VARIANTS, ids=VARIANT_IDS)
def test_factory_no_peer_read_twice_at_one_position(variant_id, build, pieces):
    """At every position the sources over ranks are a permutation (promised by
    direct's docstring; ring and bidirectional have the same property)."""
    for world in WORLDS:
        schedule = build(world)
        for position in range(world * pieces):
            sources = [schedule.for_rank(rank)[position].src for rank in range(world)]
            assert sorted(sources) == list(range(world)), f"world {world}, position {position}"


@pytest.mark.parametrize("mechanism", REMOTE_MECHANISMS)
@pytest.mark.parametrize("factory", FACTORIES.values(), ids=FACTORIES.keys())
def test_factory_mechanism_argument(factory, mechanism):
    for world in WORLDS:
        schedule = factory(world, mechanism)
        for rank in range(world):
            for c in schedule.for_rank(rank):
                assert c.mechanism == (LOCAL if c.src == rank else mechanism)


@pytest.mark.parametrize("factory", FACTORIES.values(), ids=FACTORIES.keys())
@pytest.mark.parametrize("world", [0, -1])
def test_factory_rejects_world_below_one(factory, world):
    with pytest.raises(ScheduleError, match=rf"world_size must be >= 1, got {world}"):
        factory(world)


@pytest.mark.parametrize("factory", FACTORIES.values(), ids=FACTORIES.keys())
@pytest.mark.parametrize("mechanism", ["nvshmem", LOCAL])
def test_factory_rejects_bad_mechanism(factory, mechanism):
    with pytest.raises(ScheduleError):
        factory(4, mechanism)


@pytest.mark.parametrize("factory", FACTORIES.values(), ids=FACTORIES.keys())
def test_local_first_is_identity_on_factories(factory):
    for world in WORLDS:
        schedule = factory(world)
        moved = local_first(schedule)
        assert moved.chunks == schedule.chunks
        assert moved.name == f"local_first({schedule.name})"


def test_local_first_moves_own_rows_to_front_stably():
    # Own rows last, peers in descending rank order.
    schedule = _hand_built(4, lambda r: [s for s in reversed(range(4)) if s != r] + [r]).validate()
    moved = local_first(schedule)
    for rank in range(4):
        before, after = schedule.for_rank(rank), moved.for_rank(rank)
        assert after[0] == Chunk(rank, mechanism=LOCAL)
        assert after[1:] == before[:-1]  # remote chunks untouched, flags included


# --------------------------------------------------------------------------- split


@pytest.mark.parametrize("n", range(1, 5))
@pytest.mark.parametrize("factory", FACTORIES.values(), ids=FACTORIES.keys())
def test_split_keeps_order_and_multiplies_chunks(factory, n):
    for world in WORLDS:
        _check_split(factory(world), n, world)


def _check_split(schedule, n, world):
    cut = split(schedule, n)
    assert cut.name == f"split({schedule.name}, {n})"
    for rank in range(world):
        before, after = schedule.for_rank(rank), cut.for_rank(rank)
        assert len(after) == n * len(before)
        for k, c in enumerate(before):
            group = after[k * n : (k + 1) * n]
            assert [(p.src, p.mechanism) for p in group] == [(c.src, c.mechanism)] * n
            assert [(p.piece, p.pieces) for p in group] == [(i, n) for i in range(n)]


@pytest.mark.parametrize("a, b", [(2, 3), (3, 2), (1, 4), (4, 1), (2, 2)])
@pytest.mark.parametrize("factory", FACTORIES.values(), ids=FACTORIES.keys())
def test_split_of_split_composes(factory, a, b):
    for world in (1, 2, 5):
        twice = split(split(factory(world), a), b)
        once = split(factory(world), a * b)
        assert twice.chunks == once.chunks
        for rows_per_rank in ROWS_PER_RANK:
            for rank in range(world):
                assert [c.rows(rows_per_rank) for c in twice.for_rank(rank)] == [
                    c.rows(rows_per_rank) for c in once.for_rank(rank)
                ]


def test_split_of_uneven_user_pieces():
    """Splitting pieces that are already unequal halves each of them."""
    user = ChunkSchedule(
        2,
        (
            (
                Chunk(0, mechanism=LOCAL),
                Chunk(1, 0, 2, flag=0),
                Chunk(1, 2, 4, flag=1),
                Chunk(1, 3, 4, flag=2),
            ),
            (Chunk(1, mechanism=LOCAL), Chunk(0, flag=0)),
        ),
    ).validate()
    cut = split(user, 2)
    assert [(c.src, c.piece, c.pieces) for c in cut.for_rank(0)] == [
        (0, 0, 2), (0, 1, 2), (1, 0, 4), (1, 1, 4), (1, 4, 8), (1, 5, 8), (1, 6, 8), (1, 7, 8),
    ]  # fmt: skip
    for rows_per_rank in ROWS_PER_RANK:
        arrived = _arrived_rows(cut.for_rank(0), rows_per_rank)
        assert arrived == list(range(2 * rows_per_rank))


@pytest.mark.parametrize("n", [0, -1, -4])
def test_split_rejects_n_below_one(n):
    with pytest.raises(ValueError, match=rf"split needs n >= 1, got {n}"):
        split(ring(4), n)


# --------------------------------------------------------------------------- with_mechanism


@pytest.mark.parametrize("mechanism", REMOTE_MECHANISMS)
@pytest.mark.parametrize("variant_id, build, pieces", VARIANTS, ids=VARIANT_IDS)
def test_with_mechanism_switches_remote_chunks_only(variant_id, build, pieces, mechanism):
    for world in (1, 2, 3, 8):
        schedule = build(world)
        switched = with_mechanism(schedule, mechanism)
        assert switched.name == schedule.name
        for rank in range(world):
            for old, new in zip(schedule.for_rank(rank), switched.for_rank(rank), strict=True):
                if old.mechanism == LOCAL:
                    assert new == old
                else:
                    assert new == dataclasses.replace(old, mechanism=mechanism)


def test_with_mechanism_rejects_bad_mechanisms():
    with pytest.raises(ScheduleError, match=r"unknown mechanism 'nvshmem'"):
        with_mechanism(ring(3), "nvshmem")
    with pytest.raises(ScheduleError, match=r"rows of rank \d marked 'local'"):
        with_mechanism(ring(3), LOCAL)


# --------------------------------------------------------------------------- by_name


@pytest.mark.parametrize("pieces", range(1, 5))
@pytest.mark.parametrize("name", FACTORIES)
def test_by_name_builds_the_named_schedule(name, pieces):
    for world in (1, 2, 5, 8):
        for mechanism in REMOTE_MECHANISMS:
            schedule = by_name(name, world, mechanism, pieces)
            expected = split(FACTORIES[name](world, mechanism), pieces)
            assert schedule.chunks == expected.chunks
            assert name in schedule.name
            assert by_name(name, world, mechanism=mechanism, pieces=pieces) == schedule


def test_by_name_defaults():
    assert by_name("ring", 4) == ring(4)
    assert by_name("direct", 4).for_rank(1)[1].mechanism == COPY_ENGINE


@pytest.mark.parametrize("name", ["tree", "Ring", "", "ring "])
def test_by_name_unknown_names_the_choices(name):
    with pytest.raises(
        ValueError,
        match=rf"unknown schedule '{re.escape(name)}': one of ring, direct, bidirectional",
    ):
        by_name(name, 4)


@pytest.mark.parametrize("pieces", [0, -1])
def test_by_name_rejects_pieces_below_one(pieces):
    """A config asking for 0 or -1 pieces is a mistake; it must not silently mean 1."""
    with pytest.raises(ValueError, match=rf">= 1, got {pieces}"):
        by_name("ring", 4, pieces=pieces)


# --------------------------------------------------------------------------- describe


@pytest.mark.parametrize("variant_id, build, pieces", VARIANTS[:8], ids=VARIANT_IDS[:8])
def test_describe_one_line_per_rank_with_every_chunk(variant_id, build, pieces):
    for rows_per_rank in (None, 1, 13, 128):
        _check_describe(build(4), 4, rows_per_rank)


def _check_describe(schedule, world, rows_per_rank):
    text = schedule.describe(rows_per_rank)
    header, *lines = text.splitlines()
    assert schedule.name in header and f"world {world}" in header
    assert len(lines) == world
    for rank, line in enumerate(lines):
        assert line.strip().startswith(f"rank {rank}:")
        chunks = schedule.for_rank(rank)
        assert line.count(" -> ") == len(chunks) - 1
        labels = [c.label(rows_per_rank) for c in chunks]
        assert line.endswith(" -> ".join(labels))
        for c in chunks:
            if c.flag is not None:
                assert f"flag {c.flag}" in c.label()
            if rows_per_rank is not None:
                start, stop = c.rows(rows_per_rank)
                assert f"rows {start}:{stop}" in c.label(rows_per_rank)
    assert ("rows" in text) == (rows_per_rank is not None)


def test_describe_example_and_str():
    text = split(ring(2), 2).describe(7)
    assert text.splitlines() == [
        "ChunkSchedule 'split(ring, 2)' (world 2)",
        (
            "  rank 0: r0[1/2] rows 0:3 (local) -> r0[2/2] rows 3:7 (local)"
            " -> r1[1/2] rows 7:10 (copy_engine, flag 0) -> r1[2/2] rows 10:14 (copy_engine, flag 1)"
        ),
        (
            "  rank 1: r1[1/2] rows 7:10 (local) -> r1[2/2] rows 10:14 (local)"
            " -> r0[1/2] rows 0:3 (copy_engine, flag 0) -> r0[2/2] rows 3:7 (copy_engine, flag 1)"
        ),
    ]
    assert str(ring(3)) == ring(3).describe()


# --------------------------------------------------------------------------- Chunk.rows


@pytest.mark.parametrize("pieces", range(1, 7))
def test_chunk_pieces_tile_the_shard(pieces):
    src = 3
    for rows_per_rank in ROWS_PER_RANK + (0, 3, 1000):
        spans = [Chunk(src, i, pieces).rows(rows_per_rank) for i in range(pieces)]
        assert spans[0][0] == src * rows_per_rank
        assert spans[-1][1] == (src + 1) * rows_per_rank
        for (_, stop), (start, _) in itertools.pairwise(spans):
            assert stop == start
        sizes = [stop - start for start, stop in spans]
        assert max(sizes) - min(sizes) <= 1  # equal pieces, up to one row


# --------------------------------------------------------------------------- user schedules


@pytest.mark.parametrize("world", WORLDS)
def test_user_schedule_reversed_order(world):
    """Peers from the highest rank down, own rows last: valid, if not wise."""
    schedule = _hand_built(world, lambda r: [s for s in reversed(range(world)) if s != r] + [r])
    assert schedule.validate() is schedule
    assert schedule.name == "custom"
    for rows_per_rank in ROWS_PER_RANK:
        for rank in range(world):
            arrived = _arrived_rows(schedule.for_rank(rank), rows_per_rank)
            assert sorted(arrived) == list(range(world * rows_per_rank))
            assert len(arrived) == len(set(arrived))


@pytest.mark.parametrize(
    "order",
    [
        [(0, 2), (2, 4), (3, 4)],  # 1/2 + 1/4 + 1/4
        [(3, 4), (0, 2), (2, 4)],  # same pieces, out of order
        [(0, 4), (1, 4), (1, 2)],  # 1/4 + 1/4 + 1/2
        [(0, 3), (2, 6), (3, 6), (2, 3)],  # thirds and sixths
    ],
)
def test_user_schedule_uneven_pieces(order):
    remote = [
        Chunk(1, piece, pieces, SM_COPY, flag=10 + i) for i, (piece, pieces) in enumerate(order)
    ]
    schedule = ChunkSchedule(
        2,
        (
            (Chunk(0, mechanism=LOCAL), *remote),
            (Chunk(1, 0, 3, LOCAL), Chunk(1, 1, 3, LOCAL), Chunk(1, 2, 3, LOCAL), Chunk(0, flag=0)),
        ),
        name="uneven",
    )
    assert schedule.validate() is schedule
    for rows_per_rank in ROWS_PER_RANK:
        for rank in range(2):
            arrived = _arrived_rows(schedule.for_rank(rank), rows_per_rank)
            assert sorted(arrived) == list(range(2 * rows_per_rank))
            assert len(arrived) == len(set(arrived))


def test_user_schedule_flag_edges_accepted():
    schedule = ChunkSchedule(2, ((Chunk(0, mechanism=LOCAL), Chunk(1, flag=MAX_FLAGS - 1)),
                                 (Chunk(1, mechanism=LOCAL), Chunk(0, flag=0))))  # fmt: skip
    assert schedule.validate() is schedule


def test_user_schedule_same_flag_on_different_ranks_accepted():
    """Flags are per consumer rank: two ranks may both wait on slot 0."""
    assert _hand_built(3, lambda r: [r, (r + 1) % 3, (r + 2) % 3]).validate()


# --------------------------------------------------------------------------- validation errors

# Built by hand (the same chunks as ring(3)) so that a factory bug cannot break collection.
BASE = _hand_built(
    3, lambda r: [r, (r - 1) % 3, (r - 2) % 3]
)  # rank 0: r0, r2 (flag 0), r1 (flag 1)
L0 = Chunk(0, mechanism=LOCAL)

INVALID = {
    "world_below_one": (
        ChunkSchedule(0, ()),
        r"world_size must be >= 1, got 0",
    ),
    "too_few_rank_lists": (
        ChunkSchedule(3, BASE.chunks[:2]),
        r"needs one chunk list per rank: 3 ranks, 2 lists",
    ),
    "too_many_rank_lists": (
        ChunkSchedule(2, BASE.chunks),
        r"needs one chunk list per rank: 2 ranks, 3 lists",
    ),
    "source_above_world": (
        _with_chunks(BASE, 0, [*BASE.chunks[0], Chunk(3, flag=7)]),
        r"rank 0, chunk 3 \(r3 \(copy_engine, flag 7\)\): source rank 3 is outside 0\.\.2",
    ),
    "source_negative": (
        _with_chunks(BASE, 0, [*BASE.chunks[0], Chunk(-1, flag=7)]),
        r"source rank -1 is outside 0\.\.2",
    ),
    "piece_equal_to_pieces": (
        _with_chunks(
            BASE, 0, [L0, Chunk(2, flag=0), Chunk(1, 0, 2, flag=1), Chunk(1, 2, 2, flag=2)]
        ),
        r"rank 0, chunk 3 .*: piece 2 of 2 does not exist",
    ),
    "piece_negative": (
        _with_chunks(BASE, 0, [L0, Chunk(2, flag=0), Chunk(1, flag=1), Chunk(1, -1, 2, flag=2)]),
        r"piece -1 of 2 does not exist",
    ),
    "zero_pieces": (
        _with_chunks(BASE, 0, [L0, Chunk(2, flag=0), Chunk(1, 0, 0, flag=1)]),
        r"piece 0 of 0 does not exist",
    ),
    "unknown_mechanism": (
        _with_chunks(BASE, 0, [L0, Chunk(2, mechanism="nvshmem", flag=0), Chunk(1, flag=1)]),
        r"rank 0, chunk 1 .*: unknown mechanism 'nvshmem' \(one of local, copy_engine, sm_copy, push\)",
    ),
    "own_rows_not_local": (
        _with_chunks(BASE, 0, [Chunk(0, mechanism=SM_COPY, flag=5), *BASE.chunks[0][1:]]),
        r"rank 0, chunk 0 .*: own rows are already here; use mechanism 'local'",
    ),
    "remote_rows_local": (
        _with_chunks(BASE, 0, [L0, Chunk(2, mechanism=LOCAL), Chunk(1, flag=1)]),
        r"rank 0, chunk 1 .*: rows of rank 2 marked 'local': nothing would move them",
    ),
    "local_chunk_with_flag": (
        _with_chunks(BASE, 0, [Chunk(0, mechanism=LOCAL, flag=3), *BASE.chunks[0][1:]]),
        r"rank 0, chunk 0 .*: a local chunk has no producer to set flag 3; use flag=None",
    ),
    "remote_chunk_without_flag": (
        _with_chunks(BASE, 0, [L0, Chunk(2), Chunk(1, flag=1)]),
        r"rank 0, chunk 1 .*: a remote chunk needs a flag slot to wait on",
    ),
    "flag_too_large": (
        _with_chunks(BASE, 0, [L0, Chunk(2, flag=MAX_FLAGS), Chunk(1, flag=1)]),
        rf"rank 0, chunk 1 .*: flag {MAX_FLAGS} is outside 0\.\.{MAX_FLAGS - 1}",
    ),
    "flag_negative": (
        _with_chunks(BASE, 0, [L0, Chunk(2, flag=-1), Chunk(1, flag=1)]),
        rf"flag -1 is outside 0\.\.{MAX_FLAGS - 1}",
    ),
    "duplicate_flag": (
        _with_chunks(BASE, 0, [L0, Chunk(2, flag=4), Chunk(1, flag=4)]),
        r"rank 0, chunk 2 .*: flag 4 is already announced by chunk 1",
    ),
    "gap_at_end": (
        _with_chunks(BASE, 0, [L0, Chunk(2, flag=0), Chunk(1, 0, 2, flag=1)]),
        r"rank 0, rows of rank 1: fraction 1/2\.\.1 never arrives",
    ),
    "gap_in_middle": (
        _with_chunks(
            BASE, 0, [L0, Chunk(2, flag=0), Chunk(1, 0, 3, flag=1), Chunk(1, 2, 3, flag=2)]
        ),
        r"rank 0, rows of rank 1: fraction 1/3\.\.2/3 never arrives",
    ),
    "gap_at_start": (
        _with_chunks(
            BASE, 0, [L0, Chunk(2, flag=0), Chunk(1, 1, 4, flag=1), Chunk(1, 1, 2, flag=2)]
        ),
        r"rank 0, rows of rank 1: fraction 0\.\.1/4 never arrives",
    ),
    "piece_twice": (
        _with_chunks(
            BASE,
            0,
            [
                L0,
                Chunk(2, flag=0),
                Chunk(1, 0, 2, flag=1),
                Chunk(1, 0, 2, flag=2),
                Chunk(1, 1, 2, flag=3),
            ],
        ),
        r"rank 0, rows of rank 1: fraction 0\.\.1/2 arrives twice",
    ),
    "pieces_overlap": (
        _with_chunks(
            BASE,
            0,
            [
                L0,
                Chunk(2, flag=0),
                Chunk(1, 0, 2, flag=1),
                Chunk(1, 1, 4, flag=2),
                Chunk(1, 1, 2, flag=3),
            ],
        ),
        r"rank 0, rows of rank 1: fraction 1/4\.\.1/2 arrives twice",
    ),
    "own_rows_twice": (
        _with_chunks(BASE, 0, [L0, L0, *BASE.chunks[0][1:]]),
        r"rank 0, rows of rank 0: fraction 0\.\.1 arrives twice",
    ),
    "peer_never_arrives": (
        _with_chunks(BASE, 0, [L0, Chunk(1, flag=1)]),
        r"rank 0, rows of rank 2: never arrive",
    ),
    "own_rows_never_arrive": (
        _with_chunks(BASE, 2, BASE.chunks[2][1:]),
        r"rank 2, rows of rank 2: never arrive",
    ),
}


@pytest.mark.parametrize("schedule, message", INVALID.values(), ids=INVALID.keys())
def test_validate_rejects(schedule, message):
    with pytest.raises(ScheduleError, match=message) as info:
        schedule.validate()
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(f"schedule '{schedule.name}' is invalid:\n  ")
    assert any(re.search(message, p) for p in schedule.problems())
    # The wrappers validate what they return: a broken schedule cannot pass through them.
    if len(schedule.chunks) != schedule.world_size or schedule.world_size < 1:
        return  # they iterate rank lists; nothing to wrap
    with pytest.raises(ScheduleError):
        local_first(schedule)
    if "unknown mechanism" not in message:  # with_mechanism replaces that one
        with pytest.raises(ScheduleError):
            with_mechanism(schedule, SM_COPY)


def test_base_is_valid():
    assert BASE.validate().chunks == ring(3).chunks


def test_problems_lists_every_problem():
    schedule = ChunkSchedule(
        3,
        (
            # source out of range, duplicate flag, rank 1's rows never arrive
            (L0, Chunk(2, flag=0), Chunk(5, flag=1), Chunk(2, flag=0)),
            BASE.chunks[1],
            # own rows not local, remote chunk with no flag
            (Chunk(2, mechanism=COPY_ENGINE, flag=9), Chunk(1), Chunk(0, flag=1)),
        ),
        name="broken",
    )
    problems = schedule.problems()
    expected = [
        r"rank 0, chunk 2 .*: source rank 5 is outside 0\.\.2",
        r"rank 0, chunk 3 .*: flag 0 is already announced by chunk 1",
        r"rank 0, rows of rank 2: fraction 0\.\.1 arrives twice",
        r"rank 0, rows of rank 1: never arrive",
        r"rank 2, chunk 0 .*: own rows are already here",
        r"rank 2, chunk 1 .*: a remote chunk needs a flag slot",
    ]
    for pattern in expected:
        assert sum(bool(re.search(pattern, p)) for p in problems) == 1, (pattern, problems)
    assert len(problems) == len(expected)
    with pytest.raises(ScheduleError) as info:
        schedule.validate()
    lines = str(info.value).splitlines()
    assert lines[0] == "schedule 'broken' is invalid:"
    assert [line.strip() for line in lines[1:]] == problems


@pytest.mark.parametrize("variant_id, build, pieces", VARIANTS, ids=VARIANT_IDS)
def test_valid_schedules_have_no_problems(variant_id, build, pieces):
    assert build(4).problems() == []


# --------------------------------------------------------------------------- values


def test_chunk_is_frozen():
    c = Chunk(1, flag=0)
    for field, value in [
        ("src", 2),
        ("piece", 1),
        ("pieces", 2),
        ("mechanism", SM_COPY),
        ("flag", 3),
    ]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(c, field, value)
    assert c == Chunk(1, 0, 1, COPY_ENGINE, 0)
    assert dataclasses.fields(Chunk)[0].name == "src"


def test_schedule_is_frozen():
    s = ring(3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.world_size = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.chunks = ()
    assert isinstance(s.chunks, tuple)
    assert all(isinstance(rank_chunks, tuple) for rank_chunks in s.chunks)


@pytest.mark.parametrize("variant_id, build, pieces", VARIANTS, ids=VARIANT_IDS)
def test_schedules_are_hashable_cache_keys(variant_id, build, pieces):
    first = build(4)
    again = ChunkSchedule(
        4, tuple(tuple(map(dataclasses.replace, cs)) for cs in first.chunks), first.name
    )
    assert again is not first
    assert first == again and hash(first) == hash(again)
    cache = {first: "compiled"}
    assert cache[again] == "compiled"
    other = with_mechanism(first, SM_COPY)
    assert other != first and other not in cache


def test_distinct_schedules_are_distinct_keys():
    keys = {
        by_name(name, world, mechanism, pieces)
        for name in FACTORIES
        for world in (3, 4)
        for mechanism in REMOTE_MECHANISMS
        for pieces in (1, 2)
    }
    assert len(keys) == len(FACTORIES) * 2 * 2 * 2


def test_mechanism_constants():
    assert MECHANISMS == (LOCAL, COPY_ENGINE, SM_COPY, PUSH)
    assert issubclass(ScheduleError, ValueError)


def test_schedules_package_imports_no_torch():
    """``overlap_kernels.schedules`` is pure Python: only the standard library
    and its own modules (no torch, so no torch.cuda)."""
    import overlap_kernels.schedules as package

    folder = pathlib.Path(package.__file__).parent
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top == "__future__", f"{path.name}: {name}"


def test_mechanisms_name_how_remote_rows_move():
    assert ring(4).mechanisms == {COPY_ENGINE}
    assert with_mechanism(ring(4), SM_COPY).mechanisms == {SM_COPY}
    assert ring(1).mechanisms == frozenset()  # one rank: only its own rows


def test_hand_written_lists_are_taken_as_tuples():
    """A schedule written with lists keys caches like its tuple twin; anything
    else as chunks is refused with a message saying what to pass."""
    as_lists = ChunkSchedule(
        2,
        [
            [Chunk(0, mechanism=LOCAL), Chunk(1, flag=0)],
            [Chunk(1, mechanism=LOCAL), Chunk(0, flag=0)],
        ],
    )
    as_tuples = ChunkSchedule(
        2,
        (
            (Chunk(0, mechanism=LOCAL), Chunk(1, flag=0)),
            (Chunk(1, mechanism=LOCAL), Chunk(0, flag=0)),
        ),
    )
    assert as_lists == as_tuples and hash(as_lists) == hash(as_tuples) and not as_lists.problems()
    with pytest.raises(ScheduleError, match="one list \\(or tuple\\) of Chunk per rank"):
        ChunkSchedule(2, [Chunk(0, mechanism=LOCAL), Chunk(1, flag=0)])
