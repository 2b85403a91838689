"""Errors the library raises, and the error record kernels write when a wait times out."""

from __future__ import annotations


class OverlapError(RuntimeError):
    """Base class of every error raised by overlap_kernels."""


class OverlapInputError(OverlapError, ValueError):
    """An argument was rejected before anything was launched."""


class OverlapTimeoutError(OverlapError, TimeoutError):
    """A kernel waited past its deadline for a flag that a peer should have set.

    The workspace of the group is unusable afterwards (ranks disagree on how far
    they got); call :func:`overlap_kernels.reset_workspaces` on every rank, or
    restart the processes.
    """

    def __init__(self, op: str, rank: int, peer: int | None, chunk: int, epoch: int | None,
                 deadline_s: float, where: str = ""):  # fmt: skip
        self.op, self.rank, self.peer, self.chunk, self.epoch = op, rank, peer, chunk, epoch
        where = where or (f"chunk {chunk}" if chunk >= 0 else "its ready flag")
        call = "" if epoch is None else f", call #{epoch}"  # (None: a step before any call's epoch)
        whom = (
            "its peers" if peer is None else f"rank {peer}"
        )  # (None: a collective, which cannot say)
        super().__init__(
            f"{op}: rank {rank} waited more than {deadline_s:g} s for {whom} "
            f"({where}{call}). The peer never arrived: it is stuck, crashed, "
            f"or did not call {op} with the same arguments. Raise `timeout_s` in the config "
            f"if the peer is only slow."
        )


# Layout of the error record (int32[4]) that a timed-out wait fills in. Host
# memory that the GPU can write (pinned) or a CPU tensor in the interpreter, so
# the host reads it without synchronising the device.
ERR_CODE, ERR_EPOCH, ERR_PEER, ERR_CHUNK = 0, 1, 2, 3
ERR_RECORD_LEN = 4
CODE_OK, CODE_TIMEOUT = 0, 1
