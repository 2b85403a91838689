"""Ranks called with different arguments get an error, never a wrong result
or a hang (ops/plans.py: a new plan is agreed on by the group before its
first launch).

- Each way rank 0 can differ from its peers (ag_gemm M_local, K, dtype;
  gemm_rs N and pieces; gemm_ar M, which would also split one_shot from
  two_shot; a fused path on one rank, the plain one on the others): every rank
  raises OverlapInputError naming the field and a rank that differs; nothing
  is launched, so the next call with agreeing arguments is right.
- Deadlines may differ: ranks agree on everything else.
- Ranks that disagree on ag_gemm's chunk schedule (an argument, or the config's
  factory name) all raise OverlapInputError naming it.
- A rank whose peers call a signature they already hold (so make no new plan)
  gets OverlapTimeoutError past its deadline; its peers' fused call times out
  too; after reset_workspaces() an agreeing call is right.
- Ranks that each made two signatures before and now call different ones (no
  new plan, so no agreement meets): every rank's fused kernels find the peer's
  signature word in its signals, and every rank raises OverlapMismatchError
  naming both ranks and what differs, well within the deadline (the words, not
  a timeout, stopped the call); after reset_workspaces() an agreeing call is right.
"""

from __future__ import annotations

import time

import pytest
import torch
from ranks import gpu_ranks, run_on_gpus, setup_rank
from test_gemm_rs_ar import _gather, _rows, check_op

from overlap_kernels.launch import run_ranks
from overlap_kernels.reference import check_matmul


def disagreement_body(rank, world, use_gpu):
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)

    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, dtype=dtype, device=device)

    first = rank == 0  # rank 0 calls one way, its peers the other
    other = 1 if first else 0  # the first rank that differs from this one
    low = torch.bfloat16 if first else torch.float32
    cases = [
        ("x", lambda: ok.ag_gemm(t(8 if first else 10, 32), t(32, 16))),
        ("x", lambda: ok.ag_gemm(t(8, 16 if first else 24), t(16 if first else 24, 16))),
        ("x", lambda: ok.ag_gemm(t(8, 32, dtype=low), t(32, 16, dtype=low))),
        ("w", lambda: ok.gemm_rs(t(16, 32), t(32, 16 if first else 24))),
        (
            "config",
            lambda: ok.gemm_rs(
                t(16, 32), t(32, 16), config={"path": "fused", "pieces": 1 if first else 2}
            ),
        ),
        ("x", lambda: ok.gemm_ar(t(8 if first else 24, 32), t(32, 16))),
        (
            "config",
            lambda: ok.ag_gemm(
                t(8, 32), t(32, 16), config={"path": "fused" if first else "sequential"}
            ),
        ),
    ]
    for field, call in cases:
        with pytest.raises(
            ok.OverlapInputError,
            match=rf"disagree on {field}: rank {rank} has .*, rank {other} has",
        ):
            call()
    # Harmless: deadlines differ. Then every rank is right.
    x, w = t(8, 32), t(32, 16)
    out = ok.ag_gemm(x, w, config={"path": "fused", "timeout_s": 20.0 + rank})
    check_matmul(out, torch.cat(_gather(dist, x)), w, "agreeing call")
    return len(cases)


def no_new_plan_body(rank, world, use_gpu):
    import overlap_kernels as ok
    from overlap_kernels.runtime.signals import wait_budget

    dist, device = setup_rank(rank, use_gpu)
    x, w = torch.randn(8, 32, device=device), torch.randn(32, 16, device=device)
    config = {"path": "fused", "timeout_s": 1.0}
    # The workspaces' set-up (and the kernels' loading) within the default deadline:
    # at 1 s a rank slow to allocate (cupy, shared GPU) failed its peer's set-up.
    ok.ag_gemm(x, w, config={"path": "fused"})
    ok.ag_gemm(x, w, config=config)  # every rank: the plan exists
    start = time.monotonic()
    if rank == 0:
        expected = (
            r"ag_gemm: rank 0 waited more than 1 s for rank 1 \(agreement on a new call signature"
        )
        with pytest.raises(ok.OverlapTimeoutError, match=expected):
            ok.ag_gemm(torch.randn(10, 32, device=device), w, config=config)
    else:  # the signature called before: a fused call that waits in vain for rank 0's rows
        # The message states the deadline the device wait applied: on CUDA at least
        # 2**31 ns (signals.wait_budget), whole milliseconds in the error record.
        applied_s = wait_budget(1.0) // 1_000_000 / 1000
        expected = rf"ag_gemm: rank \d waited more than {applied_s:g} s for rank 0"
        with pytest.raises(ok.OverlapTimeoutError, match=expected):
            ok.ag_gemm(x, w, config=config)
            ok.raise_if_failed()
    elapsed = time.monotonic() - start
    dist.barrier()
    ok.reset_workspaces()
    check_matmul(ok.ag_gemm(x, w, config=config), torch.cat(_gather(dist, x)), w, "after reset")
    return elapsed


def mismatch_body(rank, world, use_gpu):
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    torch.manual_seed(rank)

    def t(*shape):
        return torch.randn(*shape, device=device)

    deadline = 20.0
    fused = {"path": "fused", "timeout_s": deadline}
    one_shot = {"path": "one_shot", "timeout_s": deadline}
    # Each way a peer's signal reaches a rank: a kernel's (above), a copy engine's pull
    # gated by a wait kernel, a stream write after a cuBLAS product, a chunk's copy.
    pulled = {**fused, "mechanism": "copy_engine", "comm_sms": 1}
    by_cublas = {**fused, "mechanism": "push", "producer": "cublas"}
    chunks_by_cublas = {**fused, "mechanism": "copy_engine", "gemm": "cublas"}
    w = t(32, 16)
    # (op, what differs, the call of one size, rank 0's size, its peers' size)
    cases = [
        ("ag_gemm", "x", lambda m: ok.ag_gemm(t(m, 32), w, config=fused), 8, 10),
        ("ag_gemm", r"config .block_m (16 vs 32|32 vs 16)", lambda m: ok.ag_gemm(t(8, 32), w, config={**fused, "mechanism": "push", "block_m": m}), 16, 32),
        ("gemm_rs", "w", lambda n: ok.gemm_rs(t(16, 32), t(32, n), config=fused), 16, 24),
        ("gemm_rs", "w", lambda n: ok.gemm_rs(t(16, 32), t(32, n), config=pulled), 16, 24),
        ("gemm_rs", "w", lambda n: ok.gemm_rs(t(16, 32), t(32, n), config=by_cublas), 16, 24),
        ("ag_gemm", "x", lambda m: ok.ag_gemm(t(m, 32), w, config=chunks_by_cublas), 8, 10),
        ("gemm_ar", "x", lambda m: ok.gemm_ar(t(m, 32), w, config=one_shot), 8, 16),
        ("gemm_ar", "x", lambda m: ok.gemm_ar(t(m, 32), w, config={**fused, "path": "two_shot"}), 16, 32),
    ]  # fmt: skip
    # No false alarm: known signatures in turn, over both epoch parities, every result right
    # (the sums checked after the last call: their checks' collectives would line the ranks up).
    x, x_rs, x_ar = t(8, 32), t(16, 32), t(8, 32)
    gathered = torch.cat(_gather(dist, x))
    sums = []
    for i, step in enumerate("abcacbab"):
        if step == "a":
            check_matmul(ok.ag_gemm(x, w, config=fused), gathered, w, "ag_gemm in turn")
        elif step == "b":
            own = _rows(rank, 16, world)
            out = torch.full((own.stop - own.start, 16), float("nan"), device=device)  # poisoned
            sums.append(("gemm_rs", ok.gemm_rs(x_rs, w, config=fused, out=out), x_rs, f"call {i}"))
        else:
            out = torch.full((8, 16), float("nan"), device=device)
            sums.append(
                ("gemm_ar", ok.gemm_ar(x_ar, w, config=one_shot, out=out), x_ar, f"call {i}")
            )
    ok.raise_if_failed()
    for op, out, x_op, what in sums:
        check_op(dist, op, out, x_op, w, f"{op} in turn, {what}")
    took = []
    peer = r"\d+" if rank == 0 else "0"  # (rank 0 differs from every peer; its peers agree)
    for op, field, call, first, others in cases:
        call(first), call(others)  # every rank: both plans made and agreed on
        ok.raise_if_failed()
        start = time.monotonic()
        with pytest.raises(
            ok.OverlapMismatchError,
            match=rf"{op}: rank {rank} and rank {peer} ran different calls as call #\d+: .* They differ in {field}",
        ):
            call(first if rank == 0 else others)
            ok.raise_if_failed()
        took.append(time.monotonic() - start)
        dist.barrier()
        ok.reset_workspaces()
    x = t(8, 32)
    check_matmul(ok.ag_gemm(x, w, config=fused), torch.cat(_gather(dist, x)), w, "after reset")
    return max(took)


def schedule_body(rank, world, use_gpu):
    """ag_gemm's chunk schedule, a ChunkSchedule argument or the config's factory name:
    ranks that disagree on it all raise OverlapInputError naming it, before anything
    is launched; the next call, with one schedule everywhere, is right."""
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    x, w = torch.randn(8, 32, device=device), torch.randn(32, 16, device=device)
    first, other = rank == 0, 1 if rank == 0 else 0
    ring, direct = ok.schedules.ring(world), ok.schedules.direct(world)
    pulled = {"path": "fused", "mechanism": "copy_engine"}
    cases = [  # (what differs, rank 0's schedule, its peers', the call)
        ("flags and schedule", "name='ring'", "name='direct'",
         lambda: ok.ag_gemm(x, w, schedule=ring if first else direct, config=pulled)),
        ("flags and schedule", "name='ring'", r"\(None,\)",
         lambda: ok.ag_gemm(x, w, schedule=ring if first else None, config=pulled)),
        ("config", "'schedule': 'ring'", "'schedule': 'bidirectional'",
         lambda: ok.ag_gemm(x, w, config={**pulled, "schedule": "ring" if first else "bidirectional"})),
    ]  # fmt: skip
    for field, zero, peers, call in cases:
        mine, theirs = (zero, peers) if first else (peers, zero)
        with pytest.raises(
            ok.OverlapInputError,
            match=rf"disagree on {field}: rank {rank} has .*{mine}.*, rank {other} has .*{theirs}",
        ):
            call()
    gathered = torch.cat(_gather(dist, x))
    check_matmul(ok.ag_gemm(x, w, schedule=direct, config=pulled), gathered, w, "one schedule")
    return len(cases)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_on_a_schedule_all_raise_cpu(world):
    assert run_ranks(schedule_body, world, False) == [3] * world


@pytest.mark.parametrize("world", [2, 3])  # (GPUs: 2 and 4)
def test_ranks_that_call_different_known_signatures_all_raise_cpu(world):
    # Far within the 20 s deadline: the interpreter's slack only.
    assert all(t < 10.0 for t in run_ranks(mismatch_body, world, False))


@pytest.mark.parametrize("world", [2, 3])  # (GPUs: 2 and 4)
def test_ranks_that_disagree_all_raise_cpu(world):
    assert run_ranks(disagreement_body, world, False) == [7] * world


def test_a_peer_with_no_new_plan_gives_the_timeout_cpu():
    elapsed = run_ranks(no_new_plan_body, 2, False)
    assert all(t < 1.0 + 5.0 for t in elapsed), (
        elapsed
    )  # the deadline, plus the interpreter's slack


@gpu_ranks(worlds=(2, 4))
def test_ranks_that_disagree_all_raise_gpu(world, gpus, backend):
    assert run_on_gpus(disagreement_body, world, gpus, backend) == [7] * world


@gpu_ranks(worlds=(2, 4))
def test_ranks_that_disagree_on_a_schedule_all_raise_gpu(world, gpus, backend):
    assert run_on_gpus(schedule_body, world, gpus, backend) == [3] * world


@gpu_ranks(worlds=(2, 4))
def test_ranks_that_call_different_known_signatures_all_raise_gpu(world, gpus, backend):
    assert all(t < 10.0 for t in run_on_gpus(mismatch_body, world, gpus, backend))


@gpu_ranks(worlds=(2,))
def test_a_peer_with_no_new_plan_gives_the_timeout_gpu(world, gpus, backend):
    elapsed = run_on_gpus(no_new_plan_body, world, gpus, backend)
    assert all(t < 1.0 + 5.0 for t in elapsed), elapsed
