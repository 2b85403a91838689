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

How a candidate is timed (overlap_kernels/timing.py, as the benchmark times
its variants): on the call's own inputs (rotated with copies where they fit in
L2: :func:`input_sets`), first ``warmup`` untimed calls, the
first of them synchronised and checked: a peer that never calls makes the
first candidate's first call time out, and its OverlapTimeoutError is raised
there, before any barrier or all-reduce. Then ``rounds`` interleaved rounds of
one block of ``calls`` back-to-back calls per candidate, each block after a
barrier of the group; the median per rank, then one all-reduce takes the
maximum over ranks: every rank keeps the same winner.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from .. import timing, tuned
from ..runtime.errors import OverlapInputError
from ..runtime.workspace import raise_if_failed

if TYPE_CHECKING:
    from .checks import GemmKnobs

_log = logging.getLogger(__name__)
P = TypeVar("P", bound=Callable)  # an op's plan


@dataclass(frozen=True)
class Schedule:
    """How many calls time each candidate: ``warmup`` untimed (the first one
    synchronised and checked), then ``rounds`` interleaved rounds of one block
    of ``calls`` back-to-back calls per candidate."""

    warmup: int
    rounds: int
    calls: int

    def __post_init__(self) -> None:
        if min(self.warmup, self.rounds, self.calls) < 1:
            raise ValueError(f"a schedule needs at least one call of each kind: {self}")


# 48 timed calls (the benchmark takes 100) in 6 rounds, which show three candidates
# in all six orders; blocks of 8, so the median skips the first calls after a
# barrier's synchronise. Five candidates at 3 ms a call: about a second a shape.
GPU_SCHEDULE = Schedule(warmup=3, rounds=6, calls=8)
# Triton's interpreter takes ~0.1 s a call and its times say nothing of a GPU's: the
# checked call and two one-call rounds (the second reversed) exercise the choice.
CPU_SCHEDULE = Schedule(warmup=1, rounds=2, calls=1)


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
    plan: P,
    *,
    shape: dict,
    config: GemmKnobs | dict | None,
    changes: Sequence[dict],
    make: Callable[[dict], P],
    x: torch.Tensor,
    w: torch.Tensor,
    group: dist.ProcessGroup,
) -> P:
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
    sets = itertools.cycle(input_sets(x, w, timing.l2_bytes(x.device)))
    return fastest(
        op, candidates, lambda c: c.plan(*next(sets), None), group, x.device, shape, chooser
    ).plan


def input_sets(x: torch.Tensor, w: torch.Tensor, l2_bytes: int) -> list[tuple]:
    """(x, w), and where they fit in L2 copies of them (same layout), for candidates'
    calls to rotate through (timing.n_input_sets: as the benchmark's variants do)."""
    count = timing.n_input_sets(x.nbytes + w.nbytes, l2_bytes)
    return [(x, w)] + [(x.clone(), w.clone()) for _ in range(count - 1)]


def fastest(
    op: str,
    candidates: Sequence[Candidate],
    run: Callable[[Candidate], object],
    group: dist.ProcessGroup,
    device: torch.device,
    shape: dict,
    session: Session,
    schedule: Schedule | None = None,
) -> Candidate:
    """The candidate ``run`` is fastest with, over every rank of ``group``, timed
    as ``schedule`` says (None: GPU_SCHEDULE on a GPU, CPU_SCHEDULE elsewhere);
    recorded in the session's cache table when it has one."""
    if len(candidates) == 1:
        return candidates[0]
    if schedule is None:
        schedule = GPU_SCHEDULE if device.type == "cuda" else CPU_SCHEDULE
    times = _times_ms([lambda c=c: run(c) for c in candidates], device, group, schedule)
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


def _times_ms(
    calls: Sequence[Callable[[], object]],
    device: torch.device,
    group: dist.ProcessGroup,
    schedule: Schedule,
) -> list[float]:
    """Each call's median ms on this rank, then its maximum over the ranks of ``group``."""
    for call in calls:
        _warm_up(call, schedule.warmup, group)
    samples = timing.time_calls(
        dict(enumerate(calls)),
        schedule.rounds,
        schedule.calls,
        timing.clock_for(device),
        timing.group_barrier(group, device),
    )
    times = timing.max_over_ranks(timing.medians(samples), timing.torch_reduce_max(group, device))
    return [times[i] for i in range(len(calls))]


def _warm_up(call: Callable[[], object], calls: int, group: dist.ProcessGroup) -> None:
    """Compile and load a candidate's kernels. Its first call is synchronised and
    checked: a peer that never came raises here, not in a barrier or the all-reduce
    (in Triton's interpreter the call itself raises)."""
    call()
    raise_if_failed(group)
    for _ in range(calls - 1):
        call()
