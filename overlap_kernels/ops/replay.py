"""Fused calls captured in CUDA graphs: the group's replay workspace and a call's entry.

A replay repeats the captured kernels with their arguments, so a captured call
cannot carry a host-counted epoch. It runs in the group's replay workspace
(runtime/workspace.get_workspace with ``replay``), which counts epochs on the
device (runtime/signals.py, "Calls replayed in CUDA graphs"), in one of two ways:

- A call of one launch (gemm_ar's one_shot, gemm_rs's pushed partials from our
  GEMM, ag_gemm's push, the all-reduce ops) is passed limits.NEXT_DEVICE_EPOCH:
  its programs take one past the last call's epoch and pick their buffer half
  by its parity, as an eager call does, so a replay waits only for the data it
  reads; its last program counts the call. A peer can be at most one call
  ahead, for the reason an eager call's halves suffice (Workspace.half_offset).
- A call of several launches (copy-engine steps, cuBLAS producers: addresses a
  graph fixes) enters first (kernels/transfer.enter_replay_kernel): it counts
  the epoch and waits until every rank has entered, which a rank does only once
  its previous call has ended, so one buffer of its own suffices.

The data region, reserved whole on the first preparation so that it never moves
under a captured graph, is laid out for both (REPLAY_MAX_BYTES = R per plan; the
workspace's power-of-two growth makes it 4R, 128 MiB per group and GPU, taken on
the first eager CUDA call of a fused op that a graph could capture)::

    [0, R)    half 0 of the calls of one launch
    [R, 2R)   the calls that enter (never written while a peer reads it: every
              rank has entered, so every earlier call has ended everywhere)
    [2R, 3R)  half 1 of the calls of one launch (the workspace's half_offset)
    [3R, 4R)  unused

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
from ..limits import DEVICE_EPOCH, NEXT_DEVICE_EPOCH, REPLAY_EPOCH_SLOT
from ..runtime.signals import signal_kernel
from ..runtime.workspace import RESERVE_SLACK, Workspace, get_workspace

if TYPE_CHECKING:
    from .ag_gemm_details.plan import TransferPlan
    from .reduce_details.plan import ReducePlan

# Bytes of buffer a plan prepared for replay may take (the layout above holds
# three): plans needing more (prefill and training sizes, which serving engines do
# not capture) take their plain path while a graph is captured, rather than
# growing the symmetric memory of every large call.
REPLAY_MAX_BYTES = 32 << 20
ENTERED_REGION = REPLAY_MAX_BYTES  # byte offset of the calls that enter


class ReplayState:
    """What a capture of one plan runs: its launch plan built in the replay
    workspace, and, for a call of several launches, its entry (relaunched)."""

    def __init__(self, ws: Workspace, plan, budget: int, one_launch: bool):
        self.ws, self.buffer, self.plan, self.budget = ws, ws.buffer, plan, budget
        self.one_launch = one_launch
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
        build: Callable[[Workspace, int], TransferPlan | ReducePlan],
        *,
        one_launch: bool,
    ) -> ReplayState:
        """After an eager call in workspace ``eager`` (every rank makes it): the
        replay workspace (reserved whole: a buffer that grew would move under the
        graphs captured before), the plan ``build(ws, offset)`` makes there at
        byte ``offset`` of the data region (loading its kernels and making the
        streams it runs on; ``nbytes`` of buffer at most REPLAY_MAX_BYTES): half 0
        for a call of ``one_launch``, else the entered region, whose kernels only
        a replay runs are loaded and one entry made (an eager barrier). The
        workspace keeps the state until reset_workspaces(): captured graphs hold
        the addresses of its tensors, however long ago their op's plan left the
        plan cache. An eager call that failed raises its own error first, before
        anything here waits for the peer that failed it."""
        device = eager.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        eager.raise_if_failed()
        ws = get_workspace(eager.group, device, op, timeout_s, replay=True)
        assert nbytes <= REPLAY_MAX_BYTES, "callers prepare only plans a replay workspace holds"
        # (reserve() adds the halves' alignment slack, which the layout needs not)
        ws.reserve(op, 3 * REPLAY_MAX_BYTES - RESERVE_SLACK, timeout_s)
        # Half 1 is where the workspace puts it: at half the power-of-two region.
        assert ws.half_offset(1) == 2 * REPLAY_MAX_BYTES, "the layout of the module docstring"
        ws.replayed[op] = max(timeout_s, ws.replayed.get(op, 0.0))
        state = cls(ws, build(ws, 0 if one_launch else ENTERED_REGION), budget, one_launch)
        ws.replay_states.append(state)
        if not one_launch:
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

    @property
    def epoch(self) -> int:
        """The epoch argument of the call's kernels (limits.py)."""
        return NEXT_DEVICE_EPOCH if self.one_launch else DEVICE_EPOCH

    @property
    def half_bytes(self) -> int:
        """The bytes between a one-launch call's buffer halves (its kernels pick one
        by the epoch's parity); 0 for a call that enters, which has one buffer."""
        return self.ws.half_offset(1) if self.one_launch else 0

    def current(self) -> bool:
        """Whether the plan still lives in the workspace's buffer (a grown one has other addresses)."""
        return self.ws.buffer is self.buffer

    def enter(self, word: int) -> None:
        """A replayed call's first step (calls of several launches): the next device
        epoch, once every rank has entered with the call's signature ``word`` (0 for
        prepare's eager entry, which every rank makes whatever plan it prepares).
        A call of one launch has none."""
        if self.one_launch:
            return
        if self._enter is None or not self._enter(budget=self.budget, word=word):
            self._enter = enter_replay(self.ws, self.everyone, self.ws.world, self.budget, word)
