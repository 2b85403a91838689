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

The first call's timing can misjudge: on some H200 hosts a copy-engine path
it kept ran 20-25% over the plain pair in the benchmark, and on others it kept
cuBLAS per chunk where our GEMM ran 15% faster (bench/NOTES.md). So where the
kept candidate is not the plain path (or whichever it is, where the op asks:
gemm_ar's decode choice, ``settle_plain``), the choice settles in place: the
signature's calls, from the measuring one on, run every candidate in turn,
``SETTLE_ROUNDS`` interleaved blocks of ``SETTLE_BLOCK`` calls each, each call
timed on the caller's stream as the caller makes it (an op wrapped in
:func:`timed_in_place`); at the end of the last one (a call count every rank
reaches alike) one all-reduce takes the maximum over ranks of each
candidate's median (a block's first call, which pays for the switch, left
out) and every rank switches to the fastest where it beats the first call's
choice by more than ``SWITCH_MARGIN``. (On the hosts measured so far the calls
in place agreed with the first call, and the benchmark's context still slowed
cuBLAS per chunk at the small shapes: bench/NOTES.md.) What the calls
measured is logged and added to ``last_measured``; :func:`unsettled_calls`
says how many calls of an op's latest signature are still to come.

While a CUDA graph is being captured the ops take their plain path
(ops/paths.py) and measure nothing; asked then, :func:`fastest` returns the
first candidate and keeps nothing (nothing can be timed or synchronized).

A peer that never calls makes the first candidate's first call time out;
that call is synchronized and its OverlapTimeoutError raised before any
further call, and long before the all-reduce, which would wait forever.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from ..runtime.errors import OverlapInputError, OverlapTimeoutError
from ..runtime.workspace import raise_if_failed
from .paths import capturing

_log = logging.getLogger(__name__)
C = TypeVar("C")
# The first candidate call compiles and loads kernels: not timed. 24 timed
# calls in 6 rounds (15 in 5 before): fewer did not order candidates 1-2%
# apart the way the benchmark's 100 calls did (bench/NOTES.md).
WARMUP, TIMED, ROUNDS = 3, 24, 6
# Triton's interpreter takes seconds per call and its times say nothing of a
# GPU's: one call each, enough to exercise the choice.
_CPU_WARMUP, _CPU_TIMED = 0, 1

# Once a fused candidate is kept, every candidate runs SETTLE_ROUNDS blocks
# of SETTLE_BLOCK calls in place: 32 calls each, as many as the first call
# times, in blocks of back-to-back calls as a model makes them. On CPU, where
# calls run in the interpreter, two blocks of two exercise the settling.
SETTLE_ROUNDS, SETTLE_BLOCK = 4, 8
_CPU_SETTLE_ROUNDS, _CPU_SETTLE_BLOCK = 2, 2
# In place a candidate replaces the first call's only when it is this much
# faster: on H200 x4 the two orders of close candidates (3%) disagreed with
# each other and with the benchmark's (gemm_rs 16384: copy engine 3.068 ms
# first, 3.288 in place, 3.156 in the benchmark; push 3.113 / 3.187 / 3.249).
SWITCH_MARGIN = 0.05

_choices: dict[Hashable, _Choice] = {}
_latest: dict[str, _Choice] = {}  # op -> the choice of its latest measured signature
# op -> the calls in place of the op call running now (innermost): (choice, candidate, start mark)
_pending: dict[str, list | None] = {}
# op -> [(candidate, ms: median, max over ranks)]: the latest measured signature's
# first call, then (once settled) its calls in place, labelled "... in place"
last_measured: dict[str, list[tuple[str, float]]] = {}


@dataclasses.dataclass
class _Choice:
    """A signature's candidates, the one kept, what was measured and, until it
    settles, the marks of the calls timed in place (``timed[i]``: candidate
    i's, block by block; None for a call that raised)."""

    op: str
    candidates: Sequence
    labels: list[str]
    kept: int
    measured: list[tuple[str, float]]
    group: dist.ProcessGroup
    device: torch.device
    rounds: int = 0  # blocks per candidate still to time in place: 0 once settled
    block: int = 1
    timed: list[list] = dataclasses.field(default_factory=list)

    def unsettled_calls(self) -> int:
        return self.rounds * self.block * len(self.candidates) - sum(map(len, self.timed))

    def for_call(self, pending: list | None):
        """The candidate this call runs; timed into ``pending`` while settling
        (outside a call, as for ``running_config``, the one kept so far)."""
        if self.unsettled_calls() <= 0 or pending is None:
            return self.candidates[self.kept]
        # (The ops take their plain path while capturing, before they ask.)
        if capturing(self.device):
            return self.candidates[self.kept]
        turn = sum(map(len, self.timed)) // self.block % len(self.candidates)
        pending.append((self, turn, _mark(self.device)))
        return self.candidates[turn]

    def call_finished(self, turn: int, start, raised: BaseException | None) -> None:
        """Count the call (a call that raised too: every rank must count alike)
        and settle after the last one, unless a peer timed out (the group is
        unusable: a collective would wait forever)."""
        self.timed[turn].append(None if raised else (start, _mark(self.device)))
        if self.unsettled_calls() == 0 and not isinstance(raised, OverlapTimeoutError):
            self._settle()

    def _settle(self) -> None:
        """Keep the fastest, over every rank, of the candidates timed in place,
        where it is clearly faster than the one kept."""
        medians = [_median_in_place(marks, self.block, self.device) for marks in self.timed]
        times = _max_over_ranks(medians, self.device, self.group)
        fastest = min(range(len(times)), key=times.__getitem__)
        if times[fastest] * (1 + SWITCH_MARGIN) < times[self.kept]:
            self.kept = fastest
        in_place = [(f"{label} in place", round(t, 4)) for label, t in zip(self.labels, times)]
        self.measured.extend(in_place)  # last_measured's list while this is the op's latest
        _log.info("%s: %d calls each in place (ms, max over ranks) %s; keeping %s",
                  self.op, self.rounds * self.block, in_place, self.labels[self.kept])  # fmt: skip
        self.rounds, self.timed = 0, []


def _median_in_place(marks: list, block: int, device: torch.device) -> float:
    """The median ms of one candidate's calls in place, each block's first call
    (which pays for the switch from the previous candidate) and calls that
    raised left out; infinite when none is left."""
    finished = [m for i, m in enumerate(marks) if i % block and m is not None]
    return statistics.median(_elapsed_ms(finished, device)) if finished else float("inf")


def timed_in_place(op: str) -> Callable:
    """Decorates the op ``op``: a call that runs a choice still settling is timed
    from :func:`fastest`'s answer to the op's return (on the caller's stream)."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            outer = _pending.get(op)  # the first call's measurement calls the op inside the op
            _pending[op] = pending = []
            raised = None
            try:
                return fn(*args, **kwargs)
            except BaseException as e:
                raised = e
                raise
            finally:
                _pending[op] = outer
                for choice, turn, start in pending:
                    choice.call_finished(turn, start, raised)

        return call

    return decorate


def timing_in_place(op: str) -> bool:
    """Whether the call of ``op`` running now is one timed in place (its
    candidate is a turn of a settling choice, not the signature's answer)."""
    return bool(_pending.get(op))


def unsettled_calls(op: str) -> int:
    """How many more calls of ``op``'s latest measured signature are timed in
    place before its choice settles (0 once it has)."""
    choice = _latest.get(op)
    return choice.unsettled_calls() if choice is not None else 0


def fastest(
    op: str,
    key: Hashable,
    candidates: Callable[[], Sequence[C]],
    run: Callable[[C], object],
    group: dist.ProcessGroup,
    device: torch.device,
    label: Callable[[C], str] = str,
    is_plain: Callable[[C], bool] = lambda c: False,
    settle_plain: bool = False,
) -> C:
    """Of ``candidates()`` (built only on the first call of ``key``: later calls
    are one dict lookup), the one ``run`` is fastest with over every rank of
    ``group``, measured on the first call of ``key`` (a collective: every rank
    calls it), then settled in place where a candidate ``is_plain`` names
    lost to another, or with ``settle_plain`` whichever was kept. ``label``
    names a candidate in the log and in ``last_measured``.

    ``settle_plain`` is for calls whose host time is their time (decode
    sizes): each call the first call times follows an L2 flush that keeps the
    device busy while the host enqueues it, so that timing sees device time
    only, and a fused candidate that needs less host time than the plain path
    can lose there and win in place (gemm_ar at M = 64 on H200 x4: one_shot
    0.066 ms against the pair's 0.063 at the first call, 0.060 against 0.078
    in the benchmark, gemm_ar_nvidia-h200_x4_20261122T073708Z.json)."""
    found = _choices.get(key)
    if found is not None:
        return found.for_call(_pending.get(op))
    candidates = candidates()
    if capturing(device):
        return candidates[0]
    medians = _medians_ms([lambda c=c: run(c) for c in candidates], device, group)
    times = _max_over_ranks(medians, device, group)
    best = min(range(len(times)), key=times.__getitem__)
    labels = [label(c) for c in candidates]
    measured = [(name, round(t, 4)) for name, t in zip(labels, times)]
    _log.info("%s: measured (ms, max over ranks) %s; keeping %s", op, measured, labels[best])
    if len(_choices) >= 256:  # shapes that vary call to call must not grow it forever
        _choices.clear()
    choice = _Choice(op, candidates, labels, best, measured, group, device)
    last_measured[op] = measured
    if len(candidates) > 1 and any(is_plain(c) for c in candidates) and (settle_plain or not is_plain(candidates[best])):
        cuda = device.type == "cuda"
        choice.rounds = SETTLE_ROUNDS if cuda else _CPU_SETTLE_ROUNDS
        choice.block = SETTLE_BLOCK if cuda else _CPU_SETTLE_BLOCK
        choice.timed = [[] for _ in candidates]
    _choices[key] = _latest[op] = choice
    return choice.for_call(_pending.get(op))


def fastest_config(
    op: str,
    key: Hashable,
    cfg: C,
    changes: Sequence[dict],
    check: Callable[[C], object],
    run: Callable[[C], object],
    group: dist.ProcessGroup,
    device: torch.device,
    settle_plain: bool = False,
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

    return fastest(op, key, candidates, run, group, device, label=label,
                   is_plain=lambda c: c.path == "sequential", settle_plain=settle_plain)  # fmt: skip


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
        return [statistics.median(_elapsed_ms([_timed(call, device) for _ in range(_CPU_TIMED)], device))
                for call in calls]  # fmt: skip
    # Each timed call starts with a cold L2 (an untimed write of twice its
    # size), as a model's layer does: its weights come from HBM. Timed on warm
    # inputs, cuBLAS's paths measured up to 75% faster than in the benchmark,
    # which cycles input sets, and were kept where they lost there. (Calls in
    # place, fastest's settling, may still disagree with the benchmark's
    # context: bench/NOTES.md.)
    flush = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.int8, device=device)
    marks = [[] for _ in calls]
    for _ in range(ROUNDS):
        for call, timed in zip(calls, marks):
            call()
            for _ in range(TIMED // ROUNDS):
                flush.zero_()
                timed.append(_timed(call, device))
    medians = [statistics.median(_elapsed_ms(timed, device)) for timed in marks]
    del flush
    return medians


def _mark(device: torch.device):
    """A point in time of the caller's stream (the host's clock on CPU)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _timed(call: Callable[[], object], device: torch.device) -> tuple:
    """One call of ``call`` between two marks."""
    start = _mark(device)
    call()
    return start, _mark(device)


def _elapsed_ms(marks: Sequence[tuple], device: torch.device) -> list[float]:
    if device.type != "cuda":
        return [1e3 * (stop - start) for start, stop in marks]
    torch.cuda.synchronize(device)  # every event has completed (the calls may be on several streams)
    return [start.elapsed_time(stop) for start, stop in marks]


def _max_over_ranks(values: list[float], device: torch.device, group: dist.ProcessGroup) -> list[float]:
    times = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return times.tolist()


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
