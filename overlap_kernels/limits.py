"""Sizes fixed by the workspace layout (runtime/workspace.py), in pure Python so
that schedules can be validated against them without importing torch's CUDA side."""

MAX_WORLD = 64  # ranks per group: one ready flag per rank
DEFAULT_TIMEOUT_S = 30.0  # every op's config.timeout_s unless set: how long a rank waits for a peer
# The longest wait the library counts (11.6 days). ``timeout_s = inf`` sets no
# deadline of the library's own, but the timers that keep one (the store's and
# gloo's timedelta, a kernel's ns budget, the error record's int32 ms) take
# finite numbers: this one stands for "never" there (finite_wait).
LONGEST_WAIT_S = 1e6
NUM_FLAGS = 4096  # int32 flags at the start of every rank's symmetric buffer
MAX_CHUNK_FLAGS = NUM_FLAGS - MAX_WORLD  # chunk flags per rank
# Chunk flags come in two ranges by who writes them, and no slot is ever
# written by both: a stream write (cuStreamWriteValue32) is a plain store, so
# this rank's late write of an old epoch could otherwise overwrite a peer's
# newer one and lose it. Signals from kernels are atomic max: never backwards.
LOCAL_FLAGS = 1024  # [0, LOCAL_FLAGS): set by this rank's own streams (a schedule's flags)
# The last 2 * MAX_WORLD chunk flags hold signature words, not epochs: slot
# WORD_SLOTS + 2 * writer + (epoch & 1) holds the word of the call whose signals
# writer sent here (runtime/signals.py, "Signature words").
WORD_SLOTS = MAX_CHUNK_FLAGS - 2 * MAX_WORLD
REMOTE_FLAGS = WORD_SLOTS - LOCAL_FLAGS  # [LOCAL_FLAGS, WORD_SLOTS): set by peers' kernels


def word_slot(writer: int, epoch: int) -> int:
    """The chunk-flag slot of ``writer``'s signature word for call ``epoch`` (as kernels compute it)."""
    return WORD_SLOTS + 2 * writer + (epoch & 1)


def writer_flags(world: int) -> int:
    """Remote flag slots each rank of ``world`` may set at its peers: rank ``src``
    sets only [LOCAL_FLAGS + src * writer_flags(world), + writer_flags(world)),
    whatever the op, so a slot has one writer across calls of different ops and
    a writer's signal for a later call implies its kernel of this call has ended."""
    return REMOTE_FLAGS // world


# A replay workspace (runtime/workspace.py: for fused calls captured in CUDA
# graphs) keeps its device-side epoch in the last local chunk flag, which no
# schedule uses: the epoch of the last call replayed there (runtime/signals.py,
# "Calls replayed in CUDA graphs").
REPLAY_EPOCH_SLOT = LOCAL_FLAGS - 1
# Set (to 1) by a one-launch call's kernel whose wait failed: later launches of
# the workspace give up their waits at once, so that a call, or a replayed graph
# of several such calls, fails after one deadline, not one per launch. A device
# word (the error record lives in host memory, too slow to read per launch).
GAVE_UP_SLOT = LOCAL_FLAGS - 2
SCHEDULE_FLAGS = GAVE_UP_SLOT  # a schedule's flags: [0, SCHEDULE_FLAGS)
# Epoch arguments of replayed kernels. DEVICE_EPOCH: the one the call's entry
# counted into REPLAY_EPOCH_SLOT (calls of several launches). NEXT_DEVICE_EPOCH:
# one past the slot's, and the launch's last program stores it there (calls of
# one launch, which need no entry).
DEVICE_EPOCH = 0
NEXT_DEVICE_EPOCH = -1

# Byte layout of every rank's symmetric buffer (runtime/workspace.py draws it).
READY_FLAGS_OFFSET = 0  # the ready flags: peer p stores its epoch at slot p
CHUNK_FLAGS_OFFSET = MAX_WORLD * 4  # the chunk flags
FLAG_BYTES = NUM_FLAGS * 4
# The fused ops' eager launches keep Triton's per-launch scratch (the device-side
# TMA descriptors: up to 1152 B per program, 148 programs on the largest GPUs)
# in one slot per CUDA stream here: an allocation per launch costs host time a
# decode-size call cannot hide (docs/performance.md, host time); launches on
# one stream run in order, so they may share its slot.
SCRATCH_OFFSET = FLAG_BYTES
SCRATCH_SLOTS = 4  # streams with a slot; launches on others allocate as Triton does
SCRATCH_SLOT_BYTES = 256 * 1024
DATA_OFFSET = (
    SCRATCH_OFFSET + SCRATCH_SLOTS * SCRATCH_SLOT_BYTES
)  # aligned for TMA and vector copies


def finite_wait(deadline_s: float) -> float:
    """``deadline_s`` in seconds as a timer takes it: at most LONGEST_WAIT_S."""
    return min(deadline_s, LONGEST_WAIT_S)
