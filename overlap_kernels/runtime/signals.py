"""The signal contract: epoch-valued flags, release signals, bounded acquire waits.

Every kernel of the library that hands data to another kernel or rank follows
this contract; kernels refer to it instead of re-explaining it.

What a flag holds
    An int32 in symmetric memory (or in the local part of it). Each call of a
    fused op gets the next *epoch* (1, 2, 3, ... per workspace, the same on every
    rank because every rank makes the same calls). A producer stores the epoch;
    a consumer waits until ``flag >= epoch``. Flags are never reset between
    calls, so a value left by an earlier call (smaller epoch) can never satisfy
    a wait. 2**31 - 1 calls per workspace are possible before wrap-around.

Who writes it, with which ordering
    Release (:func:`signal_release`): a CTA barrier (so every thread's stores of
    the data are issued before), then one ``atomic_max`` with ``sem="release"``
    and ``scope="sys"`` (another GPU or another process reads it). Max, not a
    plain store: a late signal of an earlier call never takes a flag backwards.
    (Stream writes are plain stores: limits.py keeps them to flags no peer writes.)
    A producer that sets several flags at once does the barrier, one sys-scope
    fence (:func:`release_fence`) and then relaxed atomics (:func:`signal_one`):
    each is a release all the same (fence + relaxed write is PTX's release
    pattern), and their round trips to the peers overlap instead of each
    release waiting for the one before it.
    Acquire (:func:`wait_flag`): a spin of ``sys``-scope acquire loads; on CUDA
    an ``ld.acquire.sys`` in inline PTX (no CTA barriers per spin) followed by a
    proxy fence so that TMA loads issued afterwards see the data; in the
    interpreter ``atomic_add(flag, 0, sem="acquire", scope="sys")``.

When a wait gives up
    Past ``budget`` nanoseconds (:func:`wait_budget`; %globaltimer on CUDA, in
    the interpreter, which has no clock of its own, a host clock word that a
    thread of this process keeps current: :func:`_host_clock`) the wait fills
    the error record (errors.py: code, epoch, peer, chunk) and returns False.
    Within a kernel a program that timed out once gives up its later waits at
    once; a chain of wait kernels (``kernels/transfer.wait_kernel``) checks the
    record first. So a call fails after one deadline, not one per wait.
    The caller then proceeds without the data (its output is garbage) rather
    than hang, and producers that failed still release their consumers. The
    host raises :class:`~overlap_kernels.runtime.errors.OverlapTimeoutError`.
    A wait that finds a peer's other signature word (below) fails the same
    way, at once; its record replaces a timeout's (it is the likelier cause)
    and no later timeout replaces it.

Calls replayed in CUDA graphs
    A replay repeats a captured call's kernels with their arguments, so it
    cannot carry a host-counted epoch. Such calls run in a replay workspace
    (runtime/workspace.py) and count their epochs on the device, in this
    rank's flag limits.REPLAY_EPOCH_SLOT, which holds the last call's
    (:func:`call_epoch`). A call of one launch passes ``epoch`` =
    limits.NEXT_DEVICE_EPOCH: its programs read one past the slot's, and the
    last of them to finish stores it there (:func:`count_replayed_call`). A
    call of several launches passes limits.DEVICE_EPOCH: its first kernel
    (kernels/transfer.enter_replay_kernel) counts the epoch into the slot and
    the later ones read it. Flags set from the host's streams are set by
    :func:`signal_kernel` instead of stream writes, for the same reason.

Signature words
    Flags say that data came, not which call sent it: two ranks that each
    made the same two calls before, and now make different ones, would read
    bytes their peers never wrote for them. So every signal to a peer also
    carries the *signature word* of the sender's call (a CRC of what the ranks
    must share: ops/plans.py), stored by :func:`post_word` before the release,
    in the receiver's slot limits.WORD_SLOTS + 2 * sender + (epoch & 1). A wait
    for a peer's flag given the call's own word compares the slot after the
    acquire; a different word fills the error record (code CODE_MISMATCH, both
    words) and fails the wait as a timeout does, and the host raises
    :class:`~overlap_kernels.runtime.errors.OverlapMismatchError`. Two slots per
    sender by epoch parity, as the data's buffer halves: a sender cannot be two
    calls ahead of a receiver that has not read its word. Waits for this rank's
    own flags (chunk flags below limits.LOCAL_FLAGS: :func:`word_for_slot`), and
    calls with no group signature, pass word 0: no check.

Where a wait may stand
    Once per tile or per chunk, never inside a software-pipelined loop: the
    pipeliner would issue later iterations' loads before the wait (a silent
    race). And never on a later program of the same launch: the interpreter
    runs a grid's programs one after another.
"""

from __future__ import annotations

import functools
import threading
import time

import torch
import triton
import triton.language as tl

from ..limits import (
    DEVICE_EPOCH,
    GAVE_UP_SLOT,
    LOCAL_FLAGS,
    NEXT_DEVICE_EPOCH,
    REPLAY_EPOCH_SLOT,
    WORD_SLOTS,
    finite_wait,
)
from .errors import (
    CODE_MISMATCH,
    CODE_TIMEOUT,
    ERR_CHUNK,
    ERR_CODE,
    ERR_DEADLINE_MS,
    ERR_EPOCH,
    ERR_MINE,
    ERR_PEER,
    ERR_THEIRS,
)
from .platform import FAST_SIGNALS, INTERPRETER

_DEVICE_EPOCH = tl.constexpr(DEVICE_EPOCH)
_NEXT_DEVICE_EPOCH = tl.constexpr(NEXT_DEVICE_EPOCH)
_REPLAY_EPOCH_SLOT = tl.constexpr(REPLAY_EPOCH_SLOT)
_GAVE_UP_SLOT = tl.constexpr(GAVE_UP_SLOT)
_WORD_SLOTS = tl.constexpr(WORD_SLOTS)
_LOCAL_FLAGS = tl.constexpr(LOCAL_FLAGS)


# The interpreter's clock: an int64 of this process's memory holding
# time.monotonic_ns(), kept current by a thread (_host_clock), read by waits
# through its address, a constexpr (kernels read module globals only so). Triton
# hashes a kernel's constexpr globals into its cache key, and the address differs
# per process: compiled, it is 0, so that a process loads the waiting kernels an
# earlier one compiled. (Kernels compiled with FAST off, such as the local GEMM's,
# keep the clock branch but never wait; the interpreter has no cache.)
_CLOCK = torch.zeros(1, dtype=torch.int64)
_CLOCK_ADDR = tl.constexpr(_CLOCK.data_ptr() if INTERPRETER else 0)
_CLOCK_PERIOD_S = (
    0.002  # its resolution: deadlines are seconds, and each tick costs every rank process a wake-up
)


@functools.cache
def _host_clock() -> None:
    """Start the thread that keeps ``_CLOCK`` current (once per process, before
    the first interpreted wait: every budget comes from :func:`wait_budget`)."""
    now = _CLOCK.numpy()

    def tick() -> None:
        while True:
            now[0] = time.monotonic_ns()
            time.sleep(_CLOCK_PERIOD_S)

    now[0] = time.monotonic_ns()
    threading.Thread(target=tick, name="overlap_kernels-clock", daemon=True).start()


@triton.jit
def _load_acquire(flag_ptr, FAST: tl.constexpr):
    if FAST:
        value = tl.inline_asm_elementwise(
            "ld.acquire.sys.global.b32 $0, [$1];",
            "=r,l",
            [flag_ptr],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    return value


@triton.jit
def _globaltimer(anchor):
    # ``anchor`` only gives the asm an operand (and a shape); its value is unused.
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [anchor], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _now(anchor, FAST: tl.constexpr):
    """Nanoseconds: %globaltimer compiled, the host clock word interpreted."""
    if FAST:
        now = _globaltimer(anchor)
    else:
        now = tl.load(
            tl.full((), _CLOCK_ADDR, tl.int64).to(tl.pointer_type(tl.int64)), volatile=True
        )
    return now


@triton.jit
def _fence_for_async_loads(anchor, FAST: tl.constexpr):
    # Data that arrived through the generic proxy (a peer's stores, the copy
    # engine) must be fenced before this thread's TMA (async proxy) loads read it.
    if FAST:
        tl.inline_asm_elementwise(
            "fence.proxy.async; mov.u32 $0, $1;",
            "=r,r",
            [anchor],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


# The error record's layout (errors.py), as constants a kernel may read.
_ERR_CODE = tl.constexpr(ERR_CODE)
_ERR_EPOCH = tl.constexpr(ERR_EPOCH)
_ERR_PEER = tl.constexpr(ERR_PEER)
_ERR_CHUNK = tl.constexpr(ERR_CHUNK)
_ERR_THEIRS = tl.constexpr(ERR_THEIRS)
_ERR_MINE = tl.constexpr(ERR_MINE)
_ERR_DEADLINE_MS = tl.constexpr(ERR_DEADLINE_MS)
_CODE_TIMEOUT = tl.constexpr(CODE_TIMEOUT)
_CODE_MISMATCH = tl.constexpr(CODE_MISMATCH)


@triton.jit
def record_timeout(err_addr, epoch, peer, chunk, budget):
    """Fill the error record at ``err_addr`` (an int64 address; errors.py layout)
    for a wait of ``budget`` ns that timed out; a wait given up at once (budget
    0, after an earlier failure) leaves the record to that failure's.

    Plain stores, not a compare-and-swap: the record lives in host memory, where
    a GPU's atomics need PCIe atomics that a host may not offer. When several
    waits time out together, one of their records is kept, each a true report;
    a recorded mismatch is kept (the waits it failed time out after it)."""
    # The address may arrive as an i32 (Triton narrows small integer arguments, e.g. 0).
    err_ptr = err_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
    if (budget > 0) & (tl.load(err_ptr + _ERR_CODE, volatile=True) != _CODE_MISMATCH):
        tl.store(err_ptr + _ERR_DEADLINE_MS, (budget // 1000000).to(tl.int32))
        _fill_record(err_ptr, _CODE_TIMEOUT, epoch, peer, chunk)


@triton.jit
def _record_mismatch(err_addr, epoch, peer, chunk, theirs, mine):
    """Fill the error record: ``peer``'s signals of call ``epoch`` carried word
    ``theirs`` where this rank's call has ``mine`` (plain stores: record_timeout)."""
    err_ptr = err_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
    tl.store(err_ptr + _ERR_THEIRS, theirs)
    tl.store(err_ptr + _ERR_MINE, mine)
    _fill_record(err_ptr, _CODE_MISMATCH, epoch, peer, chunk)


@triton.jit
def _fill_record(err_ptr, code, epoch, peer, chunk):
    """The record's fields, then (after a barrier) its code, which the host reads first."""
    tl.store(err_ptr + _ERR_EPOCH, epoch)
    tl.store(err_ptr + _ERR_PEER, peer)
    tl.store(err_ptr + _ERR_CHUNK, chunk)
    tl.debug_barrier()
    tl.store(err_ptr + _ERR_CODE, code)


@triton.jit
def wait_flag(flag_ptr, epoch, err_addr, budget, peer, chunk, words_ptr, word, FAST: tl.constexpr):
    """Acquire-wait until ``*flag_ptr >= epoch``, a flag ``peer`` sets; True if
    it came with the call's signature ``word`` (module docstring; 0: no check,
    for this rank's own flags), False on timeout or another word. ``words_ptr``:
    this rank's chunk flags, whose last slots hold the senders' words."""
    value = _load_acquire(flag_ptr, FAST)
    start = _now(value, FAST)
    elapsed = start - start
    while (value < epoch) & (elapsed < budget):
        value = _load_acquire(flag_ptr, FAST)
        elapsed = _now(value, FAST) - start
    arrived = value >= epoch
    if not arrived:
        record_timeout(err_addr, epoch, peer, chunk, budget)
    # Nested, not `and`: a literal word 0 drops the check at compile time.
    if word != 0:  # noqa: SIM102
        if arrived:
            theirs = tl.load(words_ptr + _WORD_SLOTS + 2 * peer + (epoch & 1), volatile=True)
            arrived = theirs == word
            if not arrived:
                _record_mismatch(err_addr, epoch, peer, chunk, theirs, word)
    _fence_for_async_loads(value, FAST)
    return arrived


@triton.jit
def launch_budget(budget, local_flags_ptr):
    """A one-launch call's wait budget: ``budget``, or 0 where an earlier launch of
    the workspace (``local_flags_ptr``: its chunk flags) gave up a wait
    (:func:`gave_up`): one deadline per call, not one per launch, read from
    device memory (limits.GAVE_UP_SLOT)."""
    return tl.where(tl.load(local_flags_ptr + _GAVE_UP_SLOT, volatile=True) != 0, 0, budget)


@triton.jit
def gave_up(arrived, local_flags_ptr):
    """After a wait of a one-launch call: where it failed, mark the workspace so
    that later launches give up at once (:func:`launch_budget`)."""
    if not arrived:
        tl.store(local_flags_ptr + _GAVE_UP_SLOT, 1)


@triton.jit
def word_for_slot(slot, word):
    """The word a wait for chunk flag ``slot`` checks: ``word`` where peers set
    the slot, 0 (no check) where this rank's own streams do (limits.LOCAL_FLAGS:
    a copy-engine pull's flag, set after the wait that checked its source)."""
    return tl.where(slot >= _LOCAL_FLAGS, word, 0)


@triton.jit
def post_word(flags_ptr, writer, epoch, word):
    """Store ``writer``'s signature ``word`` for call ``epoch`` in the chunk flags
    at ``flags_ptr`` (a receiver's), ahead of the barrier and release of the
    signals it goes with (module docstring). Word 0 stores nothing."""
    if word != 0:
        tl.store(flags_ptr + _WORD_SLOTS + 2 * writer + (epoch & 1), word)


@triton.jit
def timed_out_before(err_addr):
    """True when the error record already holds a failure, a timeout or a
    mismatch (reads host memory: for waits that stand alone, not for the
    per-tile waits of a GEMM)."""
    return (
        tl.load(err_addr.to(tl.int64).to(tl.pointer_type(tl.int32)) + _ERR_CODE, volatile=True) != 0
    )


@triton.jit
def signal_release(flag_ptr, epoch):
    """Publish ``epoch`` at ``flag_ptr`` after every thread's earlier stores."""
    tl.debug_barrier()
    tl.atomic_max(flag_ptr, epoch, sem="release", scope="sys")


@triton.jit
def release_fence(anchor, FAST: tl.constexpr):
    """A sys-scope fence: this thread's earlier stores (and those a CTA barrier
    gathered from its block) are visible system-wide before its later writes.
    Compiled only: the interpreter's signals are release atomics instead."""
    if FAST:
        tl.inline_asm_elementwise(
            "fence.acq_rel.sys; mov.u32 $0, $1;",
            "=r,r",
            [anchor],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def signal_one(flag_ptr, epoch, FAST: tl.constexpr):
    """Set one of several flags after a barrier and :func:`release_fence`:
    compiled, a relaxed atomic; in the interpreter (no fence), a release atomic."""
    if FAST:
        tl.atomic_max(flag_ptr, epoch, sem="relaxed", scope="sys")
    else:
        tl.atomic_max(flag_ptr, epoch, sem="release", scope="sys")


@triton.jit
def call_epoch(epoch, local_flags_ptr):
    """The epoch of the call a kernel serves: ``epoch``, or for a call replayed in
    a CUDA graph the one counted in this rank's chunk flags (``local_flags_ptr``)
    at REPLAY_EPOCH_SLOT: there (DEVICE_EPOCH, counted by the call's entry), or
    one past it (NEXT_DEVICE_EPOCH: a call of one launch, which counts itself
    as it ends: :func:`count_replayed_call`)."""
    if epoch == _DEVICE_EPOCH:
        epoch = tl.load(local_flags_ptr + _REPLAY_EPOCH_SLOT, volatile=True)
    elif epoch == _NEXT_DEVICE_EPOCH:
        epoch = tl.load(local_flags_ptr + _REPLAY_EPOCH_SLOT, volatile=True) + 1
    return epoch


@triton.jit
def count_replayed_call(epoch_arg, epoch, local_flags_ptr):
    """Called by the last program of a launch to finish (every program has read
    the epoch by then): a replayed call of one launch (``epoch_arg`` ==
    NEXT_DEVICE_EPOCH) stores its ``epoch`` at REPLAY_EPOCH_SLOT, where the next
    call, stream-ordered after this launch, counts on from it."""
    if epoch_arg == _NEXT_DEVICE_EPOCH:
        tl.atomic_max(local_flags_ptr + _REPLAY_EPOCH_SLOT, epoch, sem="relaxed", scope="gpu")


@triton.jit
def half_offset(epoch, half_bytes):
    """Byte offset of call ``epoch``'s buffer half: consecutive calls alternate
    between two halves ``half_bytes`` apart (runtime/workspace.py
    ``Workspace.half_offset`` says why that suffices); 0 where the caller's
    offsets already name the half (``half_bytes`` 0: eager calls)."""
    return (epoch & 1).to(tl.int64) * half_bytes


# The slot is an argument, not part of the pointer: a pointer's 16-byte
# alignment is specialised on, so a pointer per slot would compile (and load,
# mid-call, waiting for running kernels that may spin on this very signal) a
# variant per slot alignment.
@triton.jit(do_not_specialize=["slot", "epoch", "writer", "word"])
def signal_kernel(flags_ptr, slot, epoch, local_flags_ptr, writer, word):
    """Set flag ``slot`` of ``flags_ptr`` (this rank's chunk flags or a peer's) to
    the call's epoch (:func:`call_epoch`), stream-ordered after the work before it
    (a copy, a GEMM); to a peer with this rank's (``writer``'s) signature ``word``."""
    epoch = call_epoch(epoch, local_flags_ptr)
    post_word(flags_ptr, writer, epoch, word)
    signal_release(flags_ptr + slot, epoch)


def wait_budget(deadline_s: float) -> int:
    """The ``budget`` argument of :func:`wait_flag` for a deadline in seconds: nanoseconds."""
    deadline_s = finite_wait(deadline_s)
    if FAST_SIGNALS:
        # At least 2**31 ns (2.1 s): then the argument is always an i64, so every
        # deadline runs the same compiled kernel, which ops load before a call
        # can wait on it (loading a module mid-call waits for the running
        # kernels, which may be waiting for this one: ops/reduce_details/run.py).
        return max(int(deadline_s * 1e9), 2**31)
    _host_clock()
    return max(1, int(deadline_s * 1e9))


__all__ = [
    "call_epoch",
    "count_replayed_call",
    "gave_up",
    "launch_budget",
    "half_offset",
    "post_word",
    "record_timeout",
    "release_fence",
    "signal_kernel",
    "signal_one",
    "signal_release",
    "timed_out_before",
    "wait_budget",
    "wait_flag",
    "word_for_slot",
]
