"""The NCCL/gloo collectives the plain paths use, under the names this torch
has, each bounded by the op's deadline: on gloo by a timed wait, on NCCL by the
deadline watchdog of runtime/nccl_watch.py (no host wait).

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` (same arguments) and warns on
the old names; the GPU hosts' torch 2.11 has only the old ones.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..limits import DEFAULT_TIMEOUT_S, finite_wait
from . import nccl_watch, workspace
from .errors import OverlapTimeoutError
from .nccl_watch import watch

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def collective(
    op: str,
    what: str,
    run: Callable[..., dist.Work | None],
    /,
    *args: Any,
    group: dist.ProcessGroup | None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> None:
    """``run(*args, group=group, **kwargs)`` (a c10d collective) for ``op``'s ``what``
    (``op``, ``what`` and ``run`` positional: ``kwargs`` may name the reduction ``op``;
    ``args[0]`` is a tensor of the collective).

    On a gloo group (CPU ranks, ranks sharing a GPU) a peer that does not join
    within ``timeout_s`` gives OverlapTimeoutError instead of a wait as long
    as the group's own timeout; the abandoned collective stays queued and
    completes with the peer's late call, so later calls still pair up. On an
    NCCL group (or the NCCL side of a group with both) the collective is only
    enqueued, and the deadline watchdog (runtime/nccl_watch.py) keeps its
    deadline: past it, the group's communicator is aborted and the next
    collective on the group, or ``raise_if_failed(group)``, raises OverlapTimeoutError."""
    backend, on_cuda = backend_of(group), getattr(args[0], "is_cuda", False)
    if backend == "gloo" or ("gloo" in backend and not on_cuda):
        start_collective(op, what, run, *args, group=group, timeout_s=timeout_s, **kwargs)()
        return
    if "nccl" not in backend or not on_cuda:
        run(*args, group=group, **kwargs)
        return
    group = group if group is not None else dist.group.WORLD
    nccl = watch()
    nccl.check(group)
    run(*args, group=group, **kwargs)
    nccl.note(op, what, group, timeout_s, args[0].get_device())


def start_collective(
    op: str,
    what: str,
    run: Callable[..., dist.Work | None],
    /,
    *args: Any,
    group: dist.ProcessGroup | None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> Callable[[], None]:
    """:func:`collective` started asynchronously: the work the caller enqueues
    next runs beside it (NCCL runs on a stream of its own); the returned
    ``wait()`` orders the caller's stream after it (on gloo: waits, bounded by
    ``timeout_s`` counted from the call of ``wait()``, as :func:`collective` does;
    on NCCL: watched from the call of ``wait()``, on the caller's stream)."""
    backend = backend_of(group)
    if "nccl" in backend and getattr(args[0], "is_cuda", False):
        group = group if group is not None else dist.group.WORLD
        nccl = watch()
        nccl.check(group)
        work = run(*args, group=group, async_op=True, **kwargs)

        def wait_nccl() -> None:
            work.wait()
            nccl.note(op, what, group, timeout_s, args[0].get_device())

        return wait_nccl
    work = run(*args, group=group, async_op=True, **kwargs)
    if "gloo" not in backend:
        return work.wait

    def wait() -> None:
        try:
            work.wait(datetime.timedelta(seconds=finite_wait(timeout_s)))
        except RuntimeError as error:
            if "timed out" not in str(error).lower():
                raise
            raise OverlapTimeoutError(op, dist.get_rank(group), None, -1, None, timeout_s,
                                      where=f"the plain path's {what}") from None  # fmt: skip

    return wait


def raise_if_failed(group: dist.ProcessGroup | None = None) -> None:
    """Raise the timeout any op of ``group`` (None: the default group) recorded on
    this rank: a plain path's NCCL collective past its deadline (waited for without
    a device sync, up to the deadline, when one is still running), then a fused
    kernel's (after a device sync: workspace.raise_if_failed)."""
    nccl_watch.settle(group)
    workspace.raise_if_failed(group)


# id(group) -> (group, its backend's name). torch's query costs a good part of a
# plain decode-size call's own host work; a group's backend never changes, and
# the entry keeps the group, so its id is not reused.
_BACKENDS: dict[int, tuple[object, str]] = {}


def backend_of(group: dist.ProcessGroup | None) -> str:
    """``group``'s backend ("nccl", "gloo", or a device map such as
    "cpu:gloo,cuda:nccl"), lower case; None is the default group."""
    if group is None:
        group = dist.group.WORLD
    entry = _BACKENDS.get(id(group))
    if entry is None or entry[0] is not group:
        entry = _BACKENDS[id(group)] = (group, str(dist.get_backend(group)).lower())
    return entry[1]
