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

The first call's burst can misjudge: on hosts whose copy engine is slow in a
sustained run but not in a burst, a copy-engine path measured 25-35% under the
plain pair there and ran 20-25% over it afterwards (bench/NOTES.md). So where
the kept candidate is not the plain path, it settles in place: the
signature's next ``SETTLE_CALLS`` calls run it, the ``SETTLE_CALLS`` after
them run the plain path, each timed on the caller's stream as the caller makes
them (an op wrapped in :func:`timed_in_place`); at the end of the last one
(a call count every rank reaches alike) one all-reduce takes the maximum over
ranks of both medians and every rank keeps the faster. What the calls measured
is logged and added to ``last_measured``; :func:`unsettled_calls` says how many
calls of an op's latest signature are still to come.

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

# Calls timed in place per block once a non-plain candidate is kept (the
# benchmark's blocks of 10 back-to-back calls showed the copy engine's
# slowdown that the first call's burst missed); on CPU, where calls run in
# the interpreter, two are enough to exercise the settling.
SETTLE_CALLS = 32
_CPU_SETTLE_CALLS = 2

_choices: dict[Hashable, _Choice] = {}
_latest: dict[str, _Choice] = {}  # op -> the choice of its latest measured signature
# op -> the calls of the op running now (innermost) that settle a choice: (choice, block, start mark)
_in_call: dict[str, list | None] = {}
# op -> [(candidate, ms: median, max over ranks)] of the latest measurement
last_measured: dict[str, list[tuple[str, float]]] = {}


@dataclasses.dataclass
class _Choice:
    """A signature's candidates, the one kept and, until it settles, the marks
    of its calls timed in place: ``timed[0]`` the kept candidate's,
    ``timed[1]`` the plain path's (``settle_calls`` each)."""

    op: str
    candidates: Sequence
    labels: list[str]
    kept: int
    plain: int | None  # the plain path's index; None: no plain candidate
    group: dist.ProcessGroup
    device: torch.device
    settle_calls: int = 0
    timed: tuple[list, list] = dataclasses.field(default_factory=lambda: ([], []))

    def unsettled_calls(self) -> int:
        return 2 * self.settle_calls - len(self.timed[0]) - len(self.timed[1])

    def for_call(self, pending: list | None):
        """The candidate this call runs; timed into ``pending`` while settling."""
        if self.unsettled_calls() <= 0 or pending is None:
            return self.candidates[self.kept]
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return self.candidates[self.kept]
        block = 0 if len(self.timed[0]) < self.settle_calls else 1
        pending.append((self, block, _mark(self.device)))
        return self.candidates[self.kept if block == 0 else self.plain]

    def call_finished(self, block: int, start) -> None:
        self.timed[block].append((start, _mark(self.device)))
        if self.unsettled_calls() == 0:
            self._settle()

    def _settle(self) -> None:
        """Keep the faster, over every rank, of the two blocks timed in place."""
        # Each block's first call pays for the switch from the other candidate.
        medians = [statistics.median(_elapsed_ms(marks)[1:]) for marks in self.timed]
        times = _max_over_ranks(medians, self.device, self.group)
        before = self.labels[self.kept]
        if times[1] < times[0]:
            self.kept = self.plain
        measured = [(f"{label} in place", round(t, 4)) for label, t in zip((before, self.labels[self.plain]), times)]
        last_measured[self.op] = last_measured.get(self.op, []) + measured
        _log.info("%s: %d calls each in place (ms, max over ranks) %s; keeping %s",
                  self.op, self.settle_calls, measured, self.labels[self.kept])  # fmt: skip
        self.timed = ([], [])
        self.settle_calls = 0


def timed_in_place(op: str) -> Callable:
    """Decorates the op ``op``: a call that runs a choice still settling is timed
    from :func:`fastest`'s answer to the op's return (on the caller's stream)."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            outer = _in_call.get(op)  # the first call's measurement calls the op inside the op
            _in_call[op] = pending = []
            try:
                result = fn(*args, **kwargs)
            finally:
                _in_call[op] = outer
            for choice, block, start in pending:
                choice.call_finished(block, start)
            return result

        return call

    return decorate


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
) -> C:
    """Of ``candidates()`` (built only on the first call of ``key``: later calls
    are one dict lookup), the one ``run`` is fastest with over every rank of
    ``group``, measured on the first call of ``key`` (a collective: every rank
    calls it), then settled in place against the candidate ``is_plain`` names,
    if any. ``label`` names a candidate in the log and in ``last_measured``."""
    found = _choices.get(key)
    if found is not None:
        return found.for_call(_in_call.get(op))
    candidates = candidates()
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return candidates[0]
    medians = _medians_ms([lambda c=c: run(c) for c in candidates], device, group)
    times = _max_over_ranks(medians, device, group)
    best = min(range(len(times)), key=times.__getitem__)
    last_measured[op] = [(label(c), round(t, 4)) for c, t in zip(candidates, times)]
    _log.info("%s: measured (ms, max over ranks) %s; keeping %s", op, last_measured[op], label(candidates[best]))
    if len(_choices) >= 256:  # shapes that vary call to call must not grow it forever
        _choices.clear()
    plain = next((i for i, c in enumerate(candidates) if is_plain(c)), None)
    settle_calls = 0 if plain in (None, best) else SETTLE_CALLS if device.type == "cuda" else _CPU_SETTLE_CALLS
    labels = [label(c) for c in candidates]
    choice = _choices[key] = _latest[op] = _Choice(op, candidates, labels, best, plain, group, device, settle_calls)
    return choice.for_call(_in_call.get(op))


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

    return fastest(op, key, candidates, run, group, device, label=label, is_plain=lambda c: c.path == "sequential")


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
    marks = [[] for _ in calls]
    for _ in range(ROUNDS):
        for call, timed in zip(calls, marks):
            call()
            for _ in range(TIMED // ROUNDS):
                flush.zero_()
                start = _mark(device)
                call()
                timed.append((start, _mark(device)))
    medians = [statistics.median(_elapsed_ms(timed)) for timed in marks]
    del flush
    return medians


def _mark(device: torch.device):
    """A point in time of the caller's stream (the host's clock on CPU)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed_ms(marks: Sequence[tuple]) -> list[float]:
    if marks and isinstance(marks[0][0], float):
        return [1e3 * (stop - start) for start, stop in marks]
    torch.cuda.synchronize()  # (the caller may have switched streams between calls)
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


def _wall_ms(call: Callable[[], object]) -> float:
    times = []
    for _ in range(_CPU_TIMED):
        start = time.perf_counter()
        call()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)
