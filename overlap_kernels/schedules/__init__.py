"""Chunk schedules (pure Python: no torch.cuda) and their factories."""

from .chunks import (
    COPY_ENGINE,
    LOCAL,
    MECHANISMS,
    PUSH,
    SM_COPY,
    Chunk,
    ChunkSchedule,
    ScheduleError,
)
from .factories import bidirectional, by_name, direct, local_first, ring, split, with_mechanism
from .producers import producer_problems, rounds, validate_producer

__all__ = [
    "COPY_ENGINE",
    "LOCAL",
    "MECHANISMS",
    "PUSH",
    "SM_COPY",
    "Chunk",
    "ChunkSchedule",
    "ScheduleError",
    "bidirectional",
    "by_name",
    "direct",
    "local_first",
    "producer_problems",
    "ring",
    "rounds",
    "split",
    "validate_producer",
    "with_mechanism",
]
