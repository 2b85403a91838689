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


def test_a_failed_rendezvous_starts_the_ranks_again_once(monkeypatch, capsys):
    """A rank that could not join its peers (gloo's transport dropping a
    connection as they first meet) makes run_ranks start every rank again, once;
    a second failure is reported like any rank's."""
    from overlap_kernels import launch

    runs = []

    def run_once(outcomes):
        def fake(body, world, args, gpus, backend, timeout_s):
            runs.append(world)
            return outcomes[len(runs) - 1]

        return fake

    dropped = (launch.RENDEZVOUS_FAILED, "RuntimeError: Gloo connectFullMesh failed\n...")
    monkeypatch.setattr(launch, "_run_once", run_once([{1: dropped}, {0: ("ok", 7), 1: ("ok", 8)}]))
    assert run_ranks(None, 2) == [7, 8] and len(runs) == 2
    assert "rank 1 could not join its peers (RuntimeError: Gloo connectFullMesh failed)" in (
        capsys.readouterr().err
    )
    runs.clear()
    monkeypatch.setattr(launch, "_run_once", run_once([{1: dropped}, {0: dropped}]))
    with pytest.raises(
        RankFailure, match="rank 0 of 2 failed:\nRuntimeError: Gloo connectFullMesh"
    ):
        run_ranks(None, 2)
    assert len(runs) == 2
