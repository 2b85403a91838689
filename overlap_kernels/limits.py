"""Sizes fixed by the workspace layout (runtime/workspace.py), in pure Python so
that schedules can be validated against them without importing torch's CUDA side."""

MAX_WORLD = 64  # ranks per group: one ready flag per rank
NUM_FLAGS = 4096  # int32 flags at the start of every rank's symmetric buffer
MAX_CHUNK_FLAGS = NUM_FLAGS - MAX_WORLD  # flag slots a schedule may name per call
