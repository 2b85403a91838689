"""Opt-in measurement of an op's candidates: ``with overlap_kernels.autotune():``.

Outside it nothing is ever timed on a user's call: a signature's config comes
from defaults, the template, a tuned table (tuned.py) and the caller, the
same on every rank. Inside it (enter it for a warm-up, or in
``python -m overlap_kernels.tune``), the first call of a signature whose
shape no tuned table covers (or every shape, with ``retune``) measures the
op's candidates (ways to compute the call: the op lists them) and keeps the
fastest as the signature's plan, as Triton's autotuner does: losing candidates
never run again. With ``cache=path`` every choice is also recorded in the
tuned table at ``path`` (by the group's rank 0), and that table is consulted
first, in this process and any later one that passes it again or loads it
with ``overlap_kernels.use_table``.

How a candidate is timed: on the call's own inputs, ``WARMUP`` untimed
calls, then ``TIMED`` calls in ``ROUNDS`` interleaved rounds (each round
starts with an untimed call, which pays for the switch from the previous
candidate; each timed call follows an untimed write that evicts L2, as a
model's layer finds its weights in HBM); the median of each, then one
all-reduce takes the maximum over ranks: every rank keeps the same winner.
A peer that never calls makes the first candidate's first call time out; that
call is synchronised and its OverlapTimeoutError raised before the all-reduce.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .. import tuned
from ..runtime.errors import OverlapInputError
from ..runtime.workspace import raise_if_failed

_log = logging.getLogger(__name__)
# The first candidate call compiles and loads kernels: not timed. 24 timed
# calls in 6 rounds order candidates 1-2% apart as the benchmark's 100 calls
# do (docs/performance.md, "How to read the numbers").
WARMUP, TIMED, ROUNDS = 3, 24, 6
# Triton's interpreter takes seconds per call and its times say nothing of a
# GPU's: one call each, enough to exercise the choice.
_CPU_WARMUP, _CPU_TIMED = 0, 1


@dataclass(frozen=True)
class Candidate:
    """One way to compute a call: the config fields it changes and its plan."""

    changes: dict
    plan: Callable

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.changes.items()) or "as configured"


@dataclass(frozen=True)
class Session:
    cache: Path | None
    retune: bool


_sessions: list[Session] = []
# op -> [(label, ms: median, max over ranks)] of the latest signature measured (logged too)
last_measured: dict[str, list[tuple[str, float]]] = {}


@contextlib.contextmanager
def autotune(cache: str | Path | None = None, *, retune: bool = False) -> Iterator[None]:
    """Measure the candidates of each new signature's first call inside this
    block (a collective: every rank of the group must make the same calls).
    ``cache``: a tuned table to read first and to record every choice in.
    ``retune``: measure shapes that a tuned table covers too."""
    path = Path(cache) if cache is not None else None
    if path is not None and path.is_file():
        tuned.use_table(path)
    _sessions.append(Session(path, retune))
    try:
        yield
    finally:
        _sessions.pop()


def session() -> Session | None:
    """The innermost autotune block entered, or None outside every one."""
    return _sessions[-1] if _sessions else None


def fastest_plan(
    op: str,
    plan,
    *,
    shape: dict,
    config,
    changes: Sequence[dict],
    make: Callable[[dict], Callable],
    x: torch.Tensor,
    w: torch.Tensor,
    group: dist.ProcessGroup,
):
    """``plan``, or inside an autotune block where no tuned table covers the
    shape (or with ``retune``), the fastest of the plans ``make(change)`` builds for each of
    ``changes`` (config fields), run on this call's ``x`` and ``w``. Changes to
    a field the caller's ``config`` sets are left out (a choice among the rest
    is not recorded), and so are candidates the checks refuse (an
    OverlapInputError: alike on every rank, since checks read the signature
    only); a whole config object is taken as it is."""
    active = session()
    if active is None or not changes or not isinstance(config, (dict, type(None))):
        return plan
    # Decided locally: a collective here would hang where a peer never calls. Ranks
    # whose tables differ still fail cleanly: the measuring rank's first candidate
    # call times out, as for any absent peer.
    if not active.retune and tuned.tuned_values(op, shape, x.device):
        return plan
    fixed = config or {}
    candidates, restricted = [], False
    for change in changes:
        if any(name in fixed and fixed[name] != value for name, value in change.items()):
            restricted = True
            continue
        try:
            candidates.append(Candidate(change, make(change)))
        except OverlapInputError:
            continue
    if not candidates:
        return plan
    # A choice among the candidates a caller's fields left is not the shape's: not recorded.
    chooser = Session(None, active.retune) if restricted else active
    return fastest(
        op, candidates, lambda c: c.plan(x, w, None), group, x.device, shape, chooser
    ).plan


def fastest(
    op: str,
    candidates: Sequence[Candidate],
    run: Callable[[Candidate], object],
    group: dist.ProcessGroup,
    device: torch.device,
    shape: dict,
    session: Session,
) -> Candidate:
    """The candidate ``run`` is fastest with, over every rank of ``group``;
    recorded in the session's cache table when it has one."""
    if len(candidates) == 1:
        return candidates[0]
    medians = _medians_ms([lambda c=c: run(c) for c in candidates], device, group)
    times = _max_over_ranks(medians, device, group)
    best = min(range(len(times)), key=times.__getitem__)
    measured = [(c.label, round(t, 4)) for c, t in zip(candidates, times)]
    last_measured[op] = measured
    _log.info(
        "%s %s: measured (ms, max over ranks) %s; keeping %s",
        op,
        shape,
        measured,
        candidates[best].label,
    )
    if session.cache is not None and dist.get_rank(group) == 0:
        tuned.record(
            session.cache,
            op,
            shape,
            candidates[best].changes,
            times[best],
            device,
            source="overlap_kernels.autotune",
        )
    return candidates[best]


def _medians_ms(
    calls: Sequence[Callable[[], object]], device: torch.device, group: dist.ProcessGroup
) -> list[float]:
    for call in calls:
        _warm_up(call, device, group)
    if device.type != "cuda":
        return [statistics.median(_elapsed_ms([_timed(call, device) for _ in range(_CPU_TIMED)], device))
                for call in calls]  # fmt: skip
    flush = torch.empty(
        2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.int8, device=device
    )
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
    start = _mark(device)
    call()
    return start, _mark(device)


def _elapsed_ms(marks: Sequence[tuple], device: torch.device) -> list[float]:
    if device.type != "cuda":
        return [1e3 * (stop - start) for start, stop in marks]
    torch.cuda.synchronize(
        device
    )  # every event has completed (the calls may be on several streams)
    return [start.elapsed_time(stop) for start, stop in marks]


def _max_over_ranks(
    values: list[float], device: torch.device, group: dist.ProcessGroup
) -> list[float]:
    times = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return times.tolist()


def _warm_up(call: Callable[[], object], device: torch.device, group: dist.ProcessGroup) -> None:
    """Compile and load a candidate's kernels. Its first call is synchronised and
    checked: a peer that never came raises here, not in the all-reduce."""
    if device.type != "cuda":  # (a timeout raises from the call itself here)
        for _ in range(_CPU_WARMUP):
            call()
        return
    call()
    raise_if_failed(group)
    for _ in range(WARMUP - 1):
        call()
