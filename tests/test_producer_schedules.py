"""Producer schedules (gemm_rs / gemm_ar): pure Python, no tensors, no GPU.

The oracle is the contract the producer GEMM relies on: every rank computes
every peer's piece exactly once and reduces each of its own pieces exactly
once, and no rank reduces a piece before every peer has produced it, or the
walk of all ranks' lists stalls (reported by producer_problems with the rank).
That the ops reject sm_copy chunks (which the validator allows) needs a
process group: tests/test_gemm_rs_ar.py checks it.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest

from overlap_kernels.schedules import (
    COPY_ENGINE,
    LOCAL,
    PUSH,
    SM_COPY,
    Chunk,
    ChunkSchedule,
    ScheduleError,
    producer_problems,
    rounds,
    validate_producer,
)
from overlap_kernels.schedules.producers import own_pieces_last

CASES = [(w, p, lag) for w in range(1, 9) for p in range(1, 5) for lag in [None, *range(1, p + 1)]]


def _schedule(world: int, order, name: str = "by hand") -> ChunkSchedule:
    """A user schedule: ``order(rank)`` lists (owner, piece, pieces); remote chunks
    are pushed, each with its own flag, the rank's own chunks are reductions."""
    lists = []
    for rank in range(world):
        flags = itertools.count()
        lists.append(tuple(
            Chunk(o, i, n, LOCAL) if o == rank else Chunk(o, i, n, PUSH, next(flags)) for o, i, n in order(rank)
        ))  # fmt: skip
    return ChunkSchedule(world, tuple(lists), name)


def _rounds_order(world: int, pieces: int, rank: int):
    """The peers' pieces round by round, own pieces last (what rounds(lag=None) does)."""
    peers = [(rank + d) % world for d in range(1, world)]
    return [(p, i, pieces) for i in range(pieces) for p in peers] + [
        (rank, i, pieces) for i in range(pieces)
    ]


@pytest.mark.parametrize("mechanism", [PUSH, COPY_ENGINE])
def test_rounds_produce_every_peer_piece_once_and_reduce_after_the_pushes(mechanism):
    for world, pieces, lag in CASES:
        s = rounds(world, pieces, mechanism, lag)
        assert s.world_size == world and producer_problems(s) == [] and validate_producer(s) is s
        effective_lag = pieces if lag is None else lag
        for rank, chunks in enumerate(s.chunks):
            where = f"world {world}, pieces {pieces}, lag {lag}, rank {rank}"
            assert {c.pieces for c in chunks} == {pieces}, where
            remote = [c for c in chunks if c.mechanism != LOCAL]
            local = [c for c in chunks if c.mechanism == LOCAL]
            assert {c.mechanism for c in remote} <= {mechanism} and all(
                c.src != rank for c in remote
            ), where
            expected = Counter((p, i) for p in range(world) if p != rank for i in range(pieces))
            assert Counter((c.src, c.piece) for c in remote) == expected, where
            assert [(c.src, c.piece) for c in local] == [(rank, i) for i in range(pieces)], where
            for i in range(pieces):
                at = chunks.index(Chunk(rank, i, pieces, LOCAL))
                before = chunks[:at]
                # Own piece i comes after this rank pushed piece i of every peer,
                # and exactly `lag` rounds later (or at the end).
                assert all(c.piece != i for c in chunks[at + 1 :] if c.mechanism != LOCAL), where
                pushed = sum(c.mechanism != LOCAL for c in before)
                assert pushed == min(i + effective_lag + 1, pieces) * (world - 1), where
            if lag is None:
                assert chunks[-pieces:] == tuple(local), f"{where}: own pieces are not last"
        assert own_pieces_last(s) == (effective_lag >= pieces - 1 or world == 1)
        # Every owner receives from one peer at a time: step j of the remote
        # chunks targets a different owner on every rank.
        remote_lists = [[c.src for c in chunks if c.mechanism != LOCAL] for chunks in s.chunks]
        for step in zip(*remote_lists):
            assert len(set(step)) == world, f"world {world}, pieces {pieces}: owners {step} collide"


def test_rounds_accepts_sm_copy_and_rejects_bad_arguments():
    # The validator allows sm_copy; gemm_rs / gemm_ar reject it (test_gemm_rs_ar.py).
    assert producer_problems(rounds(3, 2, SM_COPY)) == []
    with pytest.raises(ValueError, match="pieces >= 1, got 0"):
        rounds(2, 0)
    with pytest.raises(ValueError, match="lag >= 1 .*, got 0"):
        rounds(2, 2, PUSH, lag=0)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_own_piece_first_everywhere_stalls_and_names_every_rank(world):
    """Every rank reduces its own piece 0 first: each waits for peers that wait too."""

    def order(rank):
        rest = _rounds_order(world, 2, rank)
        return [(rank, 0, 2)] + [c for c in rest if c != (rank, 0, 2)]

    s = _schedule(world, order, "own first")
    found = producer_problems(s)
    assert len(found) == world
    for rank, problem in enumerate(found):
        peers = [p for p in range(world) if p != rank]
        assert problem.startswith(f"rank {rank}, chunk 0 (r{rank}[1/2] (local))"), problem
        assert f"its reduction waits for ranks {peers}" in problem
    with pytest.raises(
        ScheduleError, match=r"producer schedule 'own first' is invalid:\n  rank 0, chunk 0 "
    ):
        validate_producer(s)


def test_one_rank_reducing_first_is_not_a_stall():
    """Rank 0 reduces first but its peers push its rows before their own
    reductions: rank 0 only waits, nobody waits for it. Valid, not own-last."""
    world = 3

    def order(rank):
        rest = _rounds_order(world, 1, rank)
        return rest[-1:] + rest[:-1] if rank == 0 else rest

    s = _schedule(world, order)
    assert producer_problems(s) == []
    assert not own_pieces_last(s)


def _broken(world: int, edit):
    """The hand-built rounds order of every rank, with ``edit(rank, order)`` applied to rank 1."""
    return _schedule(
        world, lambda r: edit(_rounds_order(world, 2, r)) if r == 1 else _rounds_order(world, 2, r)
    )


BROKEN = {
    "missing peer piece": (lambda o: [c for c in o if c != (0, 1, 2)], r"rank 1, rows of rank 0: fraction 1/2\.\.1 never arrives"),
    "missing own piece": (lambda o: [c for c in o if c != (1, 0, 2)], r"rank 1, rows of rank 1: fraction 0\.\.1/2 never arrives"),
    "duplicate peer piece": (lambda o: o + [(0, 1, 2)], r"rank 1, rows of rank 0: fraction 1/2\.\.1 arrives twice"),
    "duplicate own piece": (lambda o: o + [(1, 1, 2)], r"rank 1, rows of rank 1: fraction 1/2\.\.1 arrives twice"),
    "mixed piece counts": (
        lambda o: [c for c in o if c[0] != 0] + [(0, 0, 1)],
        r"same number of pieces, found \[1, 2\]",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", BROKEN)
def test_broken_user_schedules_are_reported(name):
    edit, message = BROKEN[name]
    s = _broken(3, edit)
    assert any(re.search(message, p) for p in producer_problems(s)), producer_problems(s)
    with pytest.raises(ScheduleError, match=message):
        validate_producer(s)


def test_own_rows_marked_push_and_peer_rows_marked_local_are_reported():
    s = ChunkSchedule(2, (
        (Chunk(1, 0, 1, PUSH, 0), Chunk(0, 0, 1, PUSH, 1)),
        (Chunk(0, 0, 1, LOCAL), Chunk(1, 0, 1, LOCAL)),
    ))  # fmt: skip
    found = "\n".join(producer_problems(s))
    assert (
        "rank 0, chunk 1 (r0 (push, flag 1)): own rows are already here; use mechanism 'local'"
        in found
    )
    assert (
        "rank 1, chunk 0 (r0 (local)): rows of rank 0 marked 'local': nothing would move them"
        in found
    )
