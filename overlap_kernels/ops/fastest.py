"""Choosing among an op's ways to compute a call by timing them, where the
template asks for it (gemm_rs: ``mechanism = "fastest"``, ag_gemm:
``gemm = "fastest"``; their templates say why: the copy engine's speed
differs between hosts of one kind, and which GEMM wins differs by shape).

On the first call of a signature (shapes, strides, dtype, device, group,
config) every rank runs every candidate on that call's own inputs, ``WARMUP``
untimed calls each, then ``TIMED`` timed ones each in ``ROUNDS`` interleaved
rounds (each after one untimed call; each timed call after an untimed write
that evicts the inputs from L2), takes the median of each, and one
all-reduce takes the maximum over ranks: every rank then sees the same times
and keeps the same winner, which later calls of the signature run directly.
The first call runs each candidate ``WARMUP + ROUNDS + TIMED`` times, then the winner once.
What was measured is logged (logger ``overlap_kernels.ops.fastest``, INFO) and
kept in ``last_measured[op]`` for the latest shape of each op (the benchmark
records it beside what the op ran).

While a CUDA graph is being captured the ops take their plain path
(ops/paths.py) and measure nothing; asked then, :func:`fastest` returns the
first candidate and keeps nothing (nothing can be timed or synchronized).

A peer that never calls makes the first candidate's first call time out;
that call is synchronized and its OverlapTimeoutError raised before any
further call, and long before the all-reduce, which would wait forever.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from ..runtime.errors import OverlapInputError
from ..runtime.workspace import raise_if_failed

_log = logging.getLogger(__name__)
C = TypeVar("C")
# The first candidate call compiles and loads kernels: not timed. 24 timed
# calls in 6 rounds (15 in 5 before): fewer did not order candidates 1-2%
# apart the way the benchmark's 100 calls did (bench/NOTES.md).
WARMUP, TIMED, ROUNDS = 3, 24, 6
# Triton's interpreter takes seconds per call and its times say nothing of a
# GPU's: one call each, enough to exercise the choice.
_CPU_WARMUP, _CPU_TIMED = 0, 1

_winners: dict[Hashable, object] = {}
# op -> [(candidate, ms: median, max over ranks)] of the latest measurement
last_measured: dict[str, list[tuple[str, float]]] = {}


def fastest(
    op: str,
    key: Hashable,
    candidates: Callable[[], Sequence[C]],
    run: Callable[[C], object],
    group: dist.ProcessGroup,
    device: torch.device,
    label: Callable[[C], str] = str,
) -> C:
    """Of ``candidates()`` (built only on the first call of ``key``: later calls
    are one dict lookup), the one ``run`` is fastest with over every rank of
    ``group``, measured on the first call of ``key`` (a collective: every rank
    calls it). ``label`` names a candidate in the log and in ``last_measured``."""
    found = _winners.get(key)
    if found is not None:
        return found
    candidates = candidates()
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return candidates[0]
    medians = _medians_ms([lambda c=c: run(c) for c in candidates], device, group)
    times = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    best = int(times.argmin())
    last_measured[op] = [(label(c), round(t, 4)) for c, t in zip(candidates, times.tolist())]
    _log.info("%s: measured (ms, max over ranks) %s; keeping %s", op, last_measured[op], label(candidates[best]))
    if len(_winners) >= 256:  # shapes that vary call to call must not grow it forever
        _winners.clear()
    _winners[key] = candidates[best]
    return candidates[best]


def fastest_config(
    op: str,
    key: Hashable,
    cfg: C,
    changes: Sequence[dict],
    check: Callable[[C], object],
    run: Callable[[C], object],
    group: dist.ProcessGroup,
    device: torch.device,
) -> C:
    """:func:`fastest` over ``cfg`` with each of ``changes`` applied. A candidate
    ``check`` refuses (an OverlapInputError: a shape it cannot run) is left out,
    alike on every rank, since checks see only shapes and the config."""

    def candidates() -> list[C]:
        runnable = []
        for change in changes:
            candidate = dataclasses.replace(cfg, **change)
            try:
                check(candidate)
            except OverlapInputError:
                continue
            runnable.append(candidate)
        return runnable

    def label(candidate: C) -> str:  # the fields it changes
        changed = [f.name for f in dataclasses.fields(candidate) if getattr(candidate, f.name) != getattr(cfg, f.name)]
        return " ".join(f"{name}={getattr(candidate, name)}" for name in changed) or "as configured"

    return fastest(op, key, candidates, run, group, device, label=label)


def _medians_ms(calls: Sequence[Callable[[], object]], device: torch.device, group: dist.ProcessGroup) -> list[float]:
    """Each call's median time (ms): all warmed up first, then timed in ROUNDS
    interleaved rounds, so that a host whose speed drifts (copy engines that slow
    down for a while were seen) weighs on every candidate alike. Each round of a
    candidate starts with an untimed call: the switch from another candidate
    (ranks out of step, a path that waits for every peer's announcement before
    its first kernel) costs that call, not the candidate's steady state."""
    for call in calls:
        _warm_up(call, device, group)
    if device.type != "cuda":
        return [_wall_ms(call) for call in calls]
    # Each timed call starts with a cold L2 (an untimed write of twice its
    # size), as a model's layer does: its weights come from HBM. Timed on warm
    # inputs, cuBLAS's paths measured up to 75% faster than in the benchmark,
    # which cycles input sets, and were kept where they lost there. (Hosts
    # whose copy engine is slow in a sustained run but not in this burst are
    # still misjudged: bench/NOTES.md.)
    flush = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.int8, device=device)
    events = [[] for _ in calls]
    for _ in range(ROUNDS):
        for call, timed in zip(calls, events):
            call()
            for _ in range(TIMED // ROUNDS):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                flush.zero_()
                start.record()
                call()
                stop.record()
                timed.append((start, stop))
    torch.cuda.synchronize(device)
    del flush
    return [statistics.median(start.elapsed_time(stop) for start, stop in timed) for timed in events]


def _warm_up(call: Callable[[], object], device: torch.device, group: dist.ProcessGroup) -> None:
    """Compile and load a candidate's kernels. Its first call is synchronized and
    checked: a peer that never came raises here, not in the all-reduce."""
    if device.type != "cuda":  # (a timeout raises from the call itself here)
        for _ in range(_CPU_WARMUP):
            call()
        return
    call()
    raise_if_failed(group)
    for _ in range(WARMUP - 1):
        call()


def _wall_ms(call: Callable[[], object]) -> float:
    times = []
    for _ in range(_CPU_TIMED):
        start = time.perf_counter()
        call()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)
