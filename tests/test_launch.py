"""The rank launcher itself: a rank that never finishes is reported with where it waits."""

from __future__ import annotations

import time

import pytest

from overlap_kernels.launch import RankFailure, run_ranks


def _rank_one_waits_forever(rank, world):
    if rank == 1:
        _waits_forever()
    return rank


def _waits_forever():
    while True:
        time.sleep(0.1)


def test_a_late_rank_is_reported_with_its_stack():
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        # Stacks are written 3 s before the deadline: 10 s leaves a loaded
        # 2-core machine time to spawn the ranks and import torch first.
        run_ranks(_rank_one_waits_forever, 2, timeout_s=10.0)
    message = str(failure.value)
    assert "ranks [1] did not finish within 10.0 s (hang)" in message
    # The late rank's own stack says where it waits; the rank that finished has none.
    assert "--- rank 1:" in message and "_waits_forever" in message.split("--- rank 1:")[1]
    assert "--- rank 0" not in message
    assert time.monotonic() - start < 60  # reported and killed, not waited for


def _rank_zero_fails_while_one_waits(rank, world):
    import torch.distributed as dist

    if rank == 0:
        # Tearing the group down would wait for the peer stuck in its collective
        # (as NCCL's may); gloo's returns at once, so it is made to wait here.
        dist.destroy_process_group = _waits_forever
        raise ValueError("rank 0 gives up")
    dist.barrier()  # waits for rank 0, which never comes
    return rank


def test_a_failing_rank_is_reported_while_its_peer_waits():
    # The failure is reported before (instead of) tearing the group down, and
    # the peer is killed: not a hang reported at the deadline.
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 0 of 2 failed:\nValueError: rank 0 gives up"):
        run_ranks(_rank_zero_fails_while_one_waits, 2, timeout_s=60.0)
    assert time.monotonic() - start < 30
