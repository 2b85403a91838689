"""Meeting the peers of a group within a deadline, through the process group's store.

A collective has no deadline of its own: a rank absent from it holds the
others there. Steps every rank takes once, not per call (the symmetric
workspace's allocation, the agreement on a new call signature), meet through
the default store instead: each rank posts a value under the step's key,
then reads its peers', giving up past the deadline and naming the first rank
missing.

A rank that gives up takes its value back, so a peer arriving later waits
for it in turn; the two can still cross (a peer that read the value just
before it went on alone), a window of one store round trip.
"""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from ..limits import finite_wait

# (topic, group name) -> meetings passed: advanced on success only, so alike on
# every rank, and kept across reset_workspaces() (the store keeps its keys).
_STEPS: dict[tuple[str, str], int] = {}


class PeerMissing(Exception):
    """A peer did not post its value within the deadline."""

    def __init__(self, peer: int):
        super().__init__(f"rank {peer} did not arrive")
        self.peer = peer


def meet(group: dist.ProcessGroup, topic: str, value: bytes, deadline_s: float) -> list[bytes]:
    """Every rank's ``value`` of this meeting, in group rank order, once every
    rank of ``group`` has posted its own; :class:`PeerMissing` past ``deadline_s``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    store = dist.distributed_c10d._get_default_store()
    step = _STEPS.get((topic, group.group_name), 0)
    prefix = f"overlap_kernels/{topic}/{group.group_name}/{step}/rank"
    store.set(f"{prefix}{rank}", value)
    deadline = time.monotonic() + finite_wait(deadline_s)
    for peer in range(world):
        left = max(deadline - time.monotonic(), 1e-3)
        try:
            store.wait([f"{prefix}{peer}"], datetime.timedelta(seconds=left))
        except RuntimeError:  # the store's timeout (DistStoreError is one)
            store.delete_key(f"{prefix}{rank}")
            raise PeerMissing(peer) from None
    _STEPS[(topic, group.group_name)] = step + 1
    values = [value if peer == rank else store.get(f"{prefix}{peer}") for peer in range(world)]
    if step > 0:  # every peer has posted this step, so has read the step before: its key can go
        store.delete_key(f"overlap_kernels/{topic}/{group.group_name}/{step - 1}/rank{rank}")
    return values
