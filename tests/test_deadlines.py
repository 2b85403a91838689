"""Deadlines are measured in time on every platform (the interpreter reads a
host clock), and every wait of a call is bounded, the workspace's set-up and
the agreement on a new plan included: a peer late by less than ``timeout_s`` is waited for, an absent one
fails the call in ``timeout_s`` (+/- 10%) with an error naming it, and after
``reset_workspaces()`` a fresh call on every rank is right."""

from __future__ import annotations

import math
import time

import pytest
import torch
from ranks import gpu_ranks, run_on_gpus, setup_rank
from test_ag_gemm import _gather
from test_gemm_rs_ar import _rows, check_sum

from overlap_kernels.launch import run_ranks
from overlap_kernels.reference import check_matmul
from overlap_kernels.runtime import OverlapTimeoutError, nccl_watch

DEADLINE_S = 3.0
LATE_S = 2.0  # within the deadline
SLACK = 0.1  # of the deadline, either way


def _calls(ok, dist, rank, world, device, group=None):
    """op name -> (call(config) -> out, check(out)), the calls on ``group`` (the
    checks on the default group). Each names its path and mechanism: a tuned
    table's choice could otherwise be the plain path, whose collectives are
    bounded otherwise (plain_collective_body, plain_nccl_collective_body)."""
    x, w = torch.randn(4, 16, device=device), torch.randn(16, 8, device=device)
    x_all = torch.randn(8, 16, device=device)
    return {
        "ag_gemm": (lambda c: ok.ag_gemm(x, w, group, config={"path": "fused", "gemm": "triton", **c}),
                    lambda out: check_matmul(out, _gather(dist, x), w, "ag_gemm")),
        "gemm_rs": (lambda c: ok.gemm_rs(x_all, w, group, config={"path": "fused", "mechanism": "push", **c}),
                    lambda out: check_sum(dist, out, x_all, w, _rows(rank, 8, world), what="gemm_rs")),
        "gemm_ar one_shot": (lambda c: ok.gemm_ar(x_all, w, group, config={"path": "one_shot", **c}),
                             lambda out: check_sum(dist, out, x_all, w, what="gemm_ar one_shot")),
        "gemm_ar two_shot": (lambda c: ok.gemm_ar(x_all, w, group, config={"path": "two_shot", "mechanism": "push", **c}),
                             lambda out: check_sum(dist, out, x_all, w, what="gemm_ar two_shot")),
    }  # fmt: skip


def late_and_absent_body(rank, world, use_gpu, op):
    """Rank 1 is late by LATE_S (every rank right), then absent (rank 0 fails
    in DEADLINE_S); both reset and call again (right)."""
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    call, check = _calls(ok, dist, rank, world, device)[op]
    check(call({}))  # the workspace exists, the kernels are loaded
    dist.barrier()
    if rank == 1:
        time.sleep(LATE_S)
    check(call({"timeout_s": DEADLINE_S}))
    dist.barrier()
    failed_after = None
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(
            ok.OverlapTimeoutError,
            match=rf"{op.split()[0]}: rank 0 waited more than 3 s for rank 1",
        ):
            call({"timeout_s": DEADLINE_S})
            ok.raise_if_failed()
        failed_after = time.monotonic() - start
    dist.barrier()  # rank 1 stays (mapped) while rank 0 waits in vain
    ok.reset_workspaces()
    check(call({}))
    return failed_after


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar one_shot", "gemm_ar two_shot"])
def test_a_late_peer_is_waited_for_and_an_absent_one_fails_in_time_cpu(op):
    failed_after, _ = run_ranks(late_and_absent_body, 2, False, op, timeout_s=120)
    assert abs(failed_after - DEADLINE_S) <= SLACK * DEADLINE_S, failed_after


def absent_from_set_up_body(rank, world, use_gpu):
    """Rank 1 agrees on ag_gemm's plans but misses their first call (nothing
    allocated yet), then a call that grows the workspace: rank 0's set-up
    gives up in time, naming rank 1. A peer absent from a new signature's
    first call is named as promptly by the agreement on the plan."""
    import overlap_kernels as ok
    from overlap_kernels.ops.ag_gemm import running_config

    dist, device = setup_rank(rank, use_gpu)
    config = {"path": "fused", "gemm": "triton", "timeout_s": DEADLINE_S}

    def right(x, w):
        check_matmul(ok.ag_gemm(x, w, config=config), _gather(dist, x), w, "ag_gemm")

    def rank_0_fails(match, x, w):
        if rank == 0:
            start = time.monotonic()
            with pytest.raises(ok.OverlapTimeoutError, match=match):
                ok.ag_gemm(x, w, config=config)
            took.append(time.monotonic() - start)
        dist.barrier()  # rank 1 stays (mapped) while rank 0 waits in vain
        ok.reset_workspaces()

    took = []
    x, w = torch.randn(4, 16, device=device), torch.randn(16, 8, device=device)
    running_config(x, w, None, config)  # every rank: the plan, agreed on
    set_up = r"rank 0 waited more than 3 s for rank 1 \(the symmetric workspace's set-up, call #1\)"
    rank_0_fails(set_up, x, w)
    right(x, w)  # every rank: a fresh workspace
    # A plan that needs more memory than the workspace has, agreed on; rank 0
    # alone calls it: its growth gives up in time instead of holding it.
    big = torch.randn(4096, 128, device=device), torch.randn(128, 8, device=device)
    running_config(*big, None, config)
    rank_0_fails(r"set-up, call #2", *big)
    right(x, w)
    rank_0_fails(
        r"rank 0 waited more than 3 s for rank 1 \(agreement on a new call signature", x[:2], w
    )
    right(x, w)
    return took


def test_a_rank_absent_from_set_up_is_named_in_time_cpu():
    took, none = run_ranks(absent_from_set_up_body, 2, False, timeout_s=120)
    assert none == [] and len(took) == 3, took
    assert all(abs(t - DEADLINE_S) <= SLACK * DEADLINE_S for t in took), took


PLAIN = {"ag_gemm": "all-gather", "gemm_rs": "all-reduce", "gemm_ar two_shot": "all-reduce"}


def plain_collective_body(rank, world, use_gpu, op):
    """The plain path's collective on a gloo group: rank 1 comes DEADLINE_S +
    LATE_S late. Rank 0 fails in DEADLINE_S naming the collective; rank 1's
    late call meets the collective rank 0 left queued, so its result is the
    one the same inputs gave before (bit for bit: NCCL/gloo and cuBLAS are
    deterministic here), and the next call on both ranks is right."""
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    call, check = _calls(ok, dist, rank, world, device)[op]
    plain = {"path": "sequential", "timeout_s": DEADLINE_S}
    before = call(plain)
    check(before)
    dist.barrier()
    failed_after = None
    if rank == 0:
        start = time.monotonic()
        name, what = op.split()[0], PLAIN[op]
        with pytest.raises(ok.OverlapTimeoutError, match=rf"{name}: rank 0 waited more than 3 s "
                           rf"for its peers \(the plain path's {what}\)"):  # fmt: skip
            call(plain)
        failed_after = time.monotonic() - start
    else:
        time.sleep(DEADLINE_S + LATE_S)
        assert torch.equal(call(plain), before)
    dist.barrier()
    check(call(plain))
    return failed_after


def no_deadline_body(rank, world, use_gpu):
    """Every op, fused and plain, with ``timeout_s = inf`` (no deadline of the
    library's own): a new signature's agreement, the workspace's set-up, the
    kernels' waits and the plain collectives all take it, and every result is right."""
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    for op, (call, check) in _calls(ok, dist, rank, world, device).items():
        check(call({"timeout_s": math.inf}))
        if op in PLAIN:
            check(call({"path": "sequential", "timeout_s": math.inf}))
    dist.barrier()


def test_no_deadline_is_a_valid_timeout_cpu():
    run_ranks(no_deadline_body, 2, False, timeout_s=300)


@pytest.mark.parametrize("op", sorted(PLAIN))
def test_a_plain_path_collective_fails_in_time_and_pairs_up_again_cpu(op):
    failed_after, _ = run_ranks(plain_collective_body, 2, False, op, timeout_s=120)
    assert abs(failed_after - DEADLINE_S) <= SLACK * DEADLINE_S, failed_after


@gpu_ranks(worlds=(2,))
def test_a_plain_path_collective_fails_in_time_and_pairs_up_again_gpu(world, gpus, backend):
    if gpus == world:
        pytest.skip(
            "one rank per GPU: an NCCL group (test_a_plain_path_nccl_collective_fails_in_time_gpu)"
        )
    for op in sorted(PLAIN):
        failed_after, _ = run_on_gpus(plain_collective_body, world, gpus, backend, op)
        assert abs(failed_after - DEADLINE_S) <= SLACK * DEADLINE_S, (op, failed_after)


# The plain path's collective on NCCL: the collective each op's plain path issues there.
PLAIN_NCCL = {
    "ag_gemm": "all-gather",
    "gemm_rs": "reduce-scatter",
    "gemm_ar two_shot": "all-reduce",
}
# How much later than its deadline the watchdog finds a missing NCCL collective, at
# most: a record's span, a poll period, and a wake-up on a busy host.
NCCL_LAG_S = nccl_watch.SPAN_S + nccl_watch.POLL_S + 0.5


def plain_nccl_collective_body(rank, world, use_gpu, op):
    """The plain path's collective on an NCCL group of its own (the default
    group stays for the checks and barriers): rank 1 skips a call. Rank 0's call
    returns at once (NCCL only enqueues); its raise_if_failed(group) raises
    OverlapTimeoutError naming the op and the collective DEADLINE_S after the
    call (plus the watchdog's lag), not after the group's own timeout. The
    group's communicator is aborted then, so a further call on it is refused at
    once and the stream goes on (the barrier after it returns). Every rank
    leaves the group as the error says and makes a new one; after
    reset_workspaces() the call on it is right."""
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    group = dist.new_group(backend="nccl")
    plain = {"path": "sequential", "timeout_s": DEADLINE_S}
    call, check = _calls(ok, dist, rank, world, device, group)[op]
    check(call(plain))
    ok.raise_if_failed(group)  # every watched collective done: returns
    torch.cuda.synchronize()
    dist.barrier()
    failed_after = None
    if rank == 0:
        name, what = op.split()[0], PLAIN_NCCL[op]
        match = (rf"{name}: rank 0 waited more than 3 s for its peers \(the plain path's {what}\)"
                 r".*aborted the group's NCCL communicator")  # fmt: skip
        start = time.monotonic()
        with pytest.raises(ok.OverlapTimeoutError, match=match) as raised:
            call(plain)
            ok.raise_if_failed(group)
        failed_after = time.monotonic() - start
        assert raised.value.aborted
        with pytest.raises(ok.OverlapTimeoutError, match=match):
            call(plain)  # refused before anything is enqueued on the aborted group
    dist.barrier()  # rank 1 waits here while rank 0 waits in vain
    if rank == 1:
        group.abort()  # (its communicator is live: the destroy must not wait for rank 0)
    dist.destroy_process_group(group)
    group = dist.new_group(backend="nccl")
    ok.reset_workspaces()
    call, check = _calls(ok, dist, rank, world, device, group)[op]
    check(call(plain))
    ok.raise_if_failed(group)
    return failed_after


@gpu_ranks(worlds=(2,), backends=("torch",))
def test_a_plain_path_nccl_collective_fails_in_time_gpu(world, gpus, backend):
    if gpus < world:
        pytest.skip(
            "ranks sharing a GPU: a gloo group (test_a_plain_path_collective_fails_in_time_and_pairs_up_again_gpu)"
        )
    for op in sorted(PLAIN_NCCL):
        failed_after, _ = run_on_gpus(plain_nccl_collective_body, world, gpus, backend, op)
        assert DEADLINE_S <= failed_after <= DEADLINE_S + NCCL_LAG_S, (op, failed_after)


@gpu_ranks(worlds=(2,))
def test_a_late_peer_is_waited_for_and_an_absent_one_fails_in_time_gpu(world, gpus, backend):
    for op in ("ag_gemm", "gemm_rs", "gemm_ar one_shot", "gemm_ar two_shot"):
        failed_after, _ = run_on_gpus(late_and_absent_body, world, gpus, backend, op)
        assert abs(failed_after - DEADLINE_S) <= SLACK * DEADLINE_S, (op, failed_after)


@gpu_ranks(worlds=(2,))
def test_a_rank_absent_from_set_up_is_named_in_time_gpu(world, gpus, backend):
    took, none = run_on_gpus(absent_from_set_up_body, world, gpus, backend)
    assert none == [] and len(took) == 3, took
    assert all(abs(t - DEADLINE_S) <= SLACK * DEADLINE_S for t in took), took


class _Stream:
    """A fake device stream: the work enqueued on it so far completes at ``done_at``
    (time.monotonic(); math.inf: never, as behind a collective whose peer never comes)."""

    def __init__(self):
        self.done_at = 0.0


class _Event:
    def __init__(self):
        self.done_at = 0.0

    def record(self, stream):
        self.done_at = stream.done_at

    def query(self):
        return time.monotonic() >= self.done_at


def _fake_watch(stream, aborted, capturing=lambda: False):
    """A Watch of the NCCL deadlines (runtime/nccl_watch.py) over a fake stream."""
    return nccl_watch.Watch(new_event=_Event, stream_of=lambda device: (0, stream),
                            abort=aborted.append, capturing=capturing, rank_of=lambda group: 0,
                            enter_thread=lambda: None, span_s=0.02, poll_s=0.02)  # fmt: skip


def test_the_nccl_deadline_watch_fails_a_missing_collective_in_time_and_only_it_cpu():
    """The watchdog behind the plain paths' NCCL collectives, on a fake stream:
    collectives that complete within the deadline (the device behind the host
    by a fraction of it) are retired without a word; one that never completes
    fails its group DEADLINE past its call, within the watchdog's lag, with
    OverlapTimeoutError naming op and collective, which the next check raises
    again; its group is aborted, once, and no other group is touched."""
    deadline = 0.5
    stream, aborted = _Stream(), []
    watch = _fake_watch(stream, aborted)
    healthy, missing = object(), object()
    ends = time.monotonic() + 4 * deadline
    while time.monotonic() < ends:  # a steady stream of calls, each done 0.2 x deadline later
        stream.done_at = time.monotonic() + 0.2 * deadline
        watch.check(healthy)
        watch.note("gemm_ar", "all-reduce", healthy, deadline, 0)
        time.sleep(0.002)
    watch.settle(healthy)
    assert aborted == []
    stream.done_at = math.inf
    start = time.monotonic()
    watch.note("ag_gemm", "all-gather", missing, deadline, 0)
    match = r"ag_gemm: rank 0 waited more than 0.5 s for its peers \(the plain path's all-gather\).*aborted"
    with pytest.raises(OverlapTimeoutError, match=match) as raised:
        watch.settle(missing)
    took = time.monotonic() - start
    assert deadline <= took <= deadline + watch.span_s + watch.poll_s + 0.5, took
    assert raised.value.aborted and aborted == [missing]
    with pytest.raises(OverlapTimeoutError, match=match):
        watch.check(missing)
    watch.check(healthy)
    stream.done_at = 0.0
    watch.note("gemm_ar", "all-reduce", healthy, deadline, 0)
    watch.settle(healthy)
    time.sleep(watch.span_s + 3 * watch.poll_s)
    assert aborted == [missing]


def test_the_nccl_deadline_watch_records_nothing_while_capturing_or_unbounded_cpu():
    """A collective enqueued while a CUDA graph is captured is not watched (its
    replays run without a host call), nor one with an infinite timeout_s."""
    stream, aborted, capturing = _Stream(), [], [True]
    watch = _fake_watch(stream, aborted, capturing=lambda: capturing[0])
    stream.done_at = math.inf
    group = object()
    watch.note("gemm_ar", "all-reduce", group, 0.1, 0)
    capturing[0] = False
    watch.note("gemm_ar", "all-reduce", group, math.inf, 0)
    watch.settle(group)  # nothing watched: returns at once
    time.sleep(0.3)
    watch.check(group)
    assert aborted == []
