"""The NCCL/gloo collectives the plain paths use, under the names this torch
has, and bounded by the op's deadline where the backend allows.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` (same arguments) and warns on
the old names; the GPU hosts' torch 2.11 has only the old ones.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..limits import DEFAULT_TIMEOUT_S
from .errors import OverlapTimeoutError

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
    (``op``, ``what`` and ``run`` positional: ``kwargs`` may name the reduction ``op``).

    On a gloo group (CPU ranks, ranks sharing a GPU) a peer that does not join
    within ``timeout_s`` gives OverlapTimeoutError instead of a wait as long
    as the group's own timeout; the abandoned collective stays queued and
    completes with the peer's late call, so later calls still pair up. NCCL
    collectives are only enqueued: bounding them here would block the host
    until the device is done, so the process group's timeout (NCCL's watchdog,
    ``init_process_group(timeout=...)``) bounds them."""
    if backend_of(group) != "gloo":
        run(*args, group=group, **kwargs)
        return
    start_collective(op, what, run, *args, group=group, timeout_s=timeout_s, **kwargs)()


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
    ``timeout_s`` counted from the call of ``wait()``, as :func:`collective` does)."""
    work = run(*args, group=group, async_op=True, **kwargs)
    if backend_of(group) != "gloo":
        return work.wait

    def wait() -> None:
        try:
            work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as error:
            if "timed out" not in str(error).lower():
                raise
            raise OverlapTimeoutError(op, dist.get_rank(group), None, -1, None, timeout_s,
                                      where=f"the plain path's {what}") from None  # fmt: skip

    return wait


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
