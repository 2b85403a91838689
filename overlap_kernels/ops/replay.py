"""Fused calls captured in CUDA graphs: the group's replay workspace and a call's entry.

A replay repeats the captured kernels with their arguments, so a captured call
can neither carry a host-counted epoch nor alternate buffer halves. It runs in
the group's replay workspace instead (runtime/workspace.get_workspace with
``replay``): its first kernel counts the epoch on the device and waits until
every rank has entered the call, which a rank does only once its previous
call has ended, so one buffer suffices; every later kernel of the call is
passed limits.DEVICE_EPOCH and reads that epoch (runtime/signals.py, "Calls
replayed in CUDA graphs").

What a capture may not do (allocate symmetric memory, build a plan, load a
kernel, create a stream, synchronise) is done beforehand by
:meth:`ReplayState.prepare`, on an eager call of the same signature, which
every rank makes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..kernels.transfer import enter_replay, load_wait_kernel
from ..limits import DEVICE_EPOCH, REPLAY_EPOCH_SLOT
from ..runtime.signals import signal_kernel
from ..runtime.workspace import RESERVE_SLACK, Workspace, get_workspace

if TYPE_CHECKING:
    from .ag_gemm_details.plan import TransferPlan
    from .reduce_details.plan import ReducePlan

# A replay workspace holds one buffer of every plan prepared there; plans
# needing more (prefill and training sizes, which serving engines do not
# capture) take their plain path while a graph is captured, rather than
# growing the symmetric memory of every large call.
REPLAY_MAX_BYTES = 32 << 20


class ReplayState:
    """What a capture of one plan runs: its launch plan built in the replay
    workspace, and the call's entry (relaunched)."""

    def __init__(self, ws: Workspace, plan, budget: int):
        self.ws, self.buffer, self.plan, self.budget = ws, ws.buffer, plan, budget
        self.everyone = torch.arange(ws.world, dtype=torch.int32, device=ws.device)
        self._enter = None

    @classmethod
    def prepare(
        cls,
        eager: Workspace,
        op: str,
        nbytes: int,
        timeout_s: float,
        budget: int,
        build: Callable[[Workspace], TransferPlan | ReducePlan],
    ) -> ReplayState:
        """After an eager call in workspace ``eager`` (every rank makes it): the
        replay workspace (REPLAY_MAX_BYTES, reserved once: a buffer that grew would
        move under the graphs captured before), the plan ``build(ws)`` makes there
        (loading its kernels and making the streams it runs on; ``nbytes`` of
        buffer at most REPLAY_MAX_BYTES), the kernels only a replay runs loaded,
        and one entry made (an eager barrier). The workspace keeps the state until
        reset_workspaces(): captured graphs hold the addresses of its tensors, however
        long ago their op's plan left the plan cache. An eager call that failed
        raises its own error first, before anything here waits for the peer that failed it."""
        device = eager.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        eager.raise_if_failed()
        ws = get_workspace(eager.group, device, op, timeout_s, replay=True)
        assert nbytes <= REPLAY_MAX_BYTES, "callers prepare only plans a replay workspace holds"
        # (reserve() adds the second half's alignment slack: without it taken off, the
        # power-of-two growth would double the buffer for a half it never uses here)
        ws.reserve(op, REPLAY_MAX_BYTES - RESERVE_SLACK, timeout_s)
        ws.replayed[op] = max(timeout_s, ws.replayed.get(op, 0.0))
        state = cls(ws, build(ws), budget)
        ws.replay_states.append(state)
        # No-ops that load the kernels: the epoch word is raised to itself, and waited for.
        signal_kernel[(1,)](
            ws.chunk_flags, REPLAY_EPOCH_SLOT, DEVICE_EPOCH, ws.chunk_flags, ws.rank, 0
        )
        load_wait_kernel(ws, budget)
        state.enter(0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ws.raise_if_failed()
        return state

    def current(self) -> bool:
        """Whether the plan still lives in the workspace's buffer (a grown one has other addresses)."""
        return self.ws.buffer is self.buffer

    def enter(self, word: int) -> None:
        """A replayed call's first step: the next device epoch, once every rank has
        entered with the call's signature ``word`` (0 for prepare's eager entry,
        which every rank makes whatever plan it prepares)."""
        if self._enter is None or not self._enter(budget=self.budget, word=word):
            self._enter = enter_replay(self.ws, self.everyone, self.ws.world, self.budget, word)
