"""How autotune times its candidates (ops/autotune.py over overlap_kernels/timing.py):
each candidate's first call checked, then interleaved rounds of back-to-back
blocks in rotating order, a barrier before each block, the median per rank and
the maximum over ranks, so every rank keeps the same candidate.

CPU only: 2 gloo ranks, started once for all cases; stub candidates that
record their calls or sleep. The sleeps differ by 20 ms or more and never end
early, so only load far beyond a shared machine's could reorder them.
"""

from __future__ import annotations

import time

import pytest
import torch
from ranks import setup_rank

from overlap_kernels.launch import run_ranks


def _choose(dist, device, delays_s: dict, schedule=None) -> tuple[str, dict]:
    """autotune.fastest over candidates that sleep ``delays_s[name]`` a call:
    (the name kept, the ms it measured by name)."""
    from overlap_kernels.ops import autotune

    candidates = [autotune.Candidate({"name": name}, None) for name in delays_s]
    chosen = autotune.fastest(
        "test",
        candidates,
        lambda c: time.sleep(delays_s[c.changes["name"]]),
        dist.group.WORLD,
        device,
        {},
        autotune.Session(None, retune=True),
        schedule,
    )
    measured = autotune.last_measured.pop("test")
    return chosen.changes["name"], {label.removeprefix("name="): ms for label, ms in measured}


def _call_order(dist, device) -> list[str]:
    """The calls of candidates a, b, c in the order they ran, with "check" where
    a candidate's first call was checked and "|" where a barrier of the group ran."""
    from overlap_kernels import timing
    from overlap_kernels.ops import autotune

    log = []
    barrier, check = timing.group_barrier, autotune.raise_if_failed

    def logged_barrier(group, device):
        real = barrier(group, device)

        def logged():
            log.append("|")
            real()

        return logged

    timing.group_barrier = logged_barrier
    autotune.raise_if_failed = lambda group: log.append("check")
    try:
        candidates = [autotune.Candidate({"name": name}, None) for name in "abc"]
        autotune.fastest("test", candidates, lambda c: log.append(c.changes["name"]),
                         dist.group.WORLD, device, {}, autotune.Session(None, retune=True),
                         autotune.Schedule(warmup=2, rounds=4, calls=2))  # fmt: skip
    finally:
        timing.group_barrier, autotune.raise_if_failed = barrier, check
    return log


def rank_body(rank, world, use_gpu) -> dict:
    """Each case's result on this rank (one start of the ranks for all of them)."""
    from overlap_kernels.ops.autotune import Schedule

    dist, device = setup_rank(rank, use_gpu)
    return {
        "order": _call_order(dist, device),
        "slow": _choose(
            dist,
            device,
            {"slow": 0.025, "fast": 0.0, "slower": 0.05},
            Schedule(warmup=1, rounds=2, calls=3),
        ),  # fmt: skip
        # "uneven" sleeps 50 ms on rank 0 only, "steady" 30 ms everywhere: rank 1
        # alone would keep "uneven", the mean over ranks (25 against 30) too; the
        # maximum (50 against 30) keeps "steady". The default (CPU) schedule.
        "max": _choose(dist, device, {"uneven": 0.05 if rank == 0 else 0.0, "steady": 0.03}),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(rank_body, 2, False)


def test_candidates_run_in_interleaved_rotating_rounds_after_a_checked_warm_up(ranks):
    warm_up = ["a", "check", "a", "b", "check", "b", "c", "check", "c"]
    # Rounds a b c, then reversed, then rotated by one, then that reversed;
    # each candidate's block of 2 calls after a barrier.
    rounds = ["abc", "cba", "bca", "acb"]
    timed = [item for order in rounds for name in order for item in ("|", name, name)]
    assert [r["order"] for r in ranks] == [warm_up + timed] * 2


def test_a_slow_candidate_loses_on_every_rank(ranks):
    (chosen, ms), other = (r["slow"] for r in ranks)
    assert chosen == "fast" and other == (chosen, ms)  # the same times on both ranks
    assert ms["slow"] >= 25 and ms["slower"] >= 50 and ms["fast"] < ms["slow"], ms


def test_the_maximum_over_ranks_decides(ranks):
    (chosen, ms), other = (r["max"] for r in ranks)
    assert chosen == "steady" and other == (chosen, ms)
    assert ms["uneven"] >= 50, ms  # rank 0's time, reported on rank 1 too


def test_a_schedule_needs_a_checked_call_and_a_timed_one():
    from overlap_kernels.ops.autotune import Schedule

    for counts in ((0, 1, 1), (1, 0, 1), (1, 1, 0)):
        with pytest.raises(ValueError, match="at least one call of each kind"):
            Schedule(*counts)


def test_inputs_that_fit_in_l2_are_rotated_through_copies_of_the_same_layout():
    from overlap_kernels.ops.autotune import input_sets

    x, w = torch.randn(8, 16), torch.randn(32, 16).t()  # w as models pass it: weight.t()
    sets = input_sets(x, w, l2_bytes=1 << 20)
    assert len(sets) == 4 and sets[0][0] is x and sets[0][1] is w
    for xi, wi in sets[1:]:
        assert xi.data_ptr() != x.data_ptr() and wi.data_ptr() != w.data_ptr()
        assert (xi.stride(), wi.stride()) == (x.stride(), w.stride())  # the same signature
        assert torch.equal(xi, x) and torch.equal(wi, w)
    assert len(input_sets(x, w, l2_bytes=0)) == 1  # CPU: no L2 to leave
    assert len(input_sets(x, w, l2_bytes=x.nbytes // 4)) == 1  # larger than L2 already
