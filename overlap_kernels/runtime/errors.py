"""Errors the library raises, and the error record kernels write when a wait fails."""

from __future__ import annotations

import ast
import json
import zlib


class OverlapError(RuntimeError):
    """Base class of every error raised by overlap_kernels."""


class OverlapInputError(OverlapError, ValueError):
    """An argument was rejected before anything was launched."""


class OverlapTimeoutError(OverlapError, TimeoutError):
    """A kernel waited past its deadline for a flag that a peer should have set,
    or a plain path's collective did not complete by it.

    The workspace of the group is unusable afterwards (ranks disagree on how far
    they got); call :func:`overlap_kernels.reset_workspaces` on every rank, or
    restart the processes. An NCCL collective's timeout (``aborted``) has also
    aborted the group's NCCL communicator (runtime/nccl_watch.py): every rank
    leaves the group and makes a new one first.
    """

    def __init__(self, op: str, rank: int, peer: int | None, chunk: int, epoch: int | None,
                 deadline_s: float, where: str = "", aborted: bool = False):  # fmt: skip
        self.op, self.rank, self.peer, self.chunk, self.epoch = op, rank, peer, chunk, epoch
        self.aborted = aborted
        where = where or (f"chunk {chunk}" if chunk >= 0 else "its ready flag")
        call = "" if epoch is None else f", call #{epoch}"  # (None: a step before any call's epoch)
        whom = (
            "its peers" if peer is None else f"rank {peer}"
        )  # (None: a collective, which cannot say)
        super().__init__(
            f"{op}: rank {rank} waited more than {deadline_s:g} s for {whom} "
            f"({where}{call}). The peer never arrived: it is stuck, crashed, "
            f"or did not call {op} with the same arguments. Raise `timeout_s` in the config "
            f"if the peer is only slow." + (ABORTED if aborted else "")
        )


# What an NCCL collective's timeout adds to its message (runtime/nccl_watch.py).
ABORTED = (
    " This rank aborted the group's NCCL communicator at the deadline (NCCL cannot cancel one "
    "collective): on every rank, destroy the group (torch.distributed.destroy_process_group(group); "
    "where its communicator is still live, group.abort() first) and make a new one, then call "
    "overlap_kernels.reset_workspaces()."
)


class OverlapMismatchError(OverlapError):
    """A peer's kernels served another call than this rank's: the ranks made
    different calls (or the same calls in another order) after each had made
    both before, so no new plan's agreement could catch it. Its signals carried
    the signature word of its call (runtime/signals.py), which this rank's
    waits found different from their own. The workspace is unusable afterwards,
    as after a timeout."""

    def __init__(self, op: str, rank: int, peer: int, epoch: int, mine: int, theirs: int):
        self.op, self.rank, self.peer, self.epoch = op, rank, peer, epoch
        own, other = described_word(mine), described_word(theirs)
        differs = ""
        if own is not None and other is not None:
            differs = " They differ in " + "; ".join(_differences(own, other)) + "."
        super().__init__(
            f"{op}: rank {rank} and rank {peer} ran different calls as call #{epoch}: rank {rank} "
            f"ran {_call_text(own, mine)}; rank {peer} ran {_call_text(other, theirs)}.{differs} "
            "Every rank must make the same calls, in the same order, with the same shapes, dtypes "
            "and config. Call overlap_kernels.reset_workspaces() on every rank before the next call."
        )


def _differences(own: tuple[str, dict[str, str]], other: tuple[str, dict[str, str]]) -> list[str]:
    """What two calls' shared fields differ in, config values by key."""
    if own[0] != other[0]:
        return [f"op ({own[0]} vs {other[0]})"]
    found = []
    for field in {**own[1], **other[1]}:
        a, b = own[1].get(field), other[1].get(field)
        if a == b:
            continue
        try:  # a config: its keys that differ
            a_dict, b_dict = ast.literal_eval(a), ast.literal_eval(b)
            keys = [k for k in {**a_dict, **b_dict} if a_dict.get(k) != b_dict.get(k)]
            found.append(
                f"{field} ({', '.join(f'{k} {a_dict.get(k)} vs {b_dict.get(k)}' for k in keys)})"
            )
        except (ValueError, SyntaxError, AttributeError, TypeError):
            found.append(f"{field} ({a} vs {b})")
    return found


# Signature words: word -> (op, what the ranks must share), for naming what a
# mismatch differs in; the oldest dropped past _WORDS_KEPT.
_words: dict[int, tuple[str, dict[str, str]]] = {}
_WORDS_KEPT = 4096


def signature_word(op: str, shared: dict[str, str]) -> int:
    """The signature word of a call: what every rank of its group must share
    (ops/plans.py), as a positive int32 (a kernel argument); the same in every
    process (a CRC, not Python's salted hash)."""
    word = zlib.crc32(json.dumps([op, shared], sort_keys=True).encode()) & 0x7FFFFFFF or 1
    _words[word] = (op, shared)
    if len(_words) > _WORDS_KEPT:
        del _words[next(iter(_words))]
    return word


def described_word(word: int) -> tuple[str, dict[str, str]] | None:
    """The op and shared fields of a word this process made, or None."""
    return _words.get(word)


def _call_text(known: tuple[str, dict[str, str]] | None, word: int) -> str:
    if word == 0:
        return "a call with no signature word (a signal of no planned call, or a stale one)"
    if known is None:
        return f"a call this rank has not planned lately (signature word {word:#x})"
    op, shared = known
    operands = [f"{field} {value}" for field, value in shared.items() if field != "config"]
    return f"{op} ({', '.join(operands)})" if operands else op


# Layout of the error record (int32[7]) that a failed wait fills in. Host
# memory that the GPU can write (pinned) or a CPU tensor in the interpreter, so
# the host reads it without synchronising the device. A mismatch also records
# both signature words; a timeout the deadline the wait had, in milliseconds
# (a replayed call's is known only to its kernels).
ERR_CODE, ERR_EPOCH, ERR_PEER, ERR_CHUNK, ERR_THEIRS, ERR_MINE, ERR_DEADLINE_MS = range(7)
ERR_RECORD_LEN = 7
CODE_OK, CODE_TIMEOUT, CODE_MISMATCH = 0, 1, 2
