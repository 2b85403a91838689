"""Chunk schedules (pure Python: no torch.cuda) and their factories."""

from .chunks import COPY_ENGINE, LOCAL, MECHANISMS, SM_COPY, Chunk, ChunkSchedule, ScheduleError
from .factories import bidirectional, by_name, direct, local_first, ring, split, with_mechanism

__all__ = [
    "COPY_ENGINE",
    "LOCAL",
    "MECHANISMS",
    "SM_COPY",
    "Chunk",
    "ChunkSchedule",
    "ScheduleError",
    "bidirectional",
    "by_name",
    "direct",
    "local_first",
    "ring",
    "split",
    "with_mechanism",
]
