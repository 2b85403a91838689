"""Per-row tables from per-run values, made on the device in one launch.

The MoE layout knows, on the host, tables such as "row i of the output reads
record slots[i]" only as runs: run q covers ``lengths[q]`` consecutive rows,
each taking ``values[q]`` (plus the row's own index, where the table counts
up). Copying the expanded tables would move O(rows) bytes from host to device
on every call, and a copy that is not small or not pinned can hold the host
until the stream drains; so the host copies the runs (a few KiB, packed into
one array) and this kernel expands every table at once::

    table j, row i:  out_j[i] = values_j[q] (+ i),  q = the last run with start_j[q] <= i

Packed table (int64): for each table j, five header words (where its runs
start in the array, how many runs, where its rows start in ``out``, its row
count, 1 if it counts up), then every table's run starts and values.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ..runtime.platform import to_device

_HEADER_WORDS = tl.constexpr(5)
_BLOCK = 128  # rows per program
_NO_RUN = tl.constexpr(2**62)  # start of a padded run: after every row


@triton.jit
def expand_runs_kernel(table_ptr, out_ptr, BLOCK: tl.constexpr, RUNS: tl.constexpr):
    head = table_ptr + tl.program_id(1) * _HEADER_WORDS
    runs_at = tl.load(head)
    num_runs = tl.load(head + 1)
    out_at = tl.load(head + 2)
    total = tl.load(head + 3)
    count_up = tl.load(head + 4)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inside = rows < total
    q = tl.arange(0, RUNS)
    starts = tl.load(table_ptr + runs_at + q, mask=q < num_runs, other=_NO_RUN)
    run = tl.sum((starts[None, :] <= rows[:, None]).to(tl.int32), axis=1) - 1
    value = tl.load(table_ptr + runs_at + num_runs + run, mask=inside, other=0)
    tl.store(out_ptr + out_at + rows, value + rows * count_up, mask=inside)


def expand_runs(
    tables: list[tuple[np.ndarray, np.ndarray, bool]], device: torch.device
) -> list[torch.Tensor]:
    """For each (lengths, values, count_up): int64 [sum(lengths)] on ``device``,
    ``values[q]`` repeated ``lengths[q]`` times (plus each row's index where
    ``count_up``). One small host-to-device copy and one launch for all."""
    totals = [int(np.sum(lengths)) for lengths, _, _ in tables]
    header, body = [], []
    runs_at, out_at = _HEADER_WORDS.value * len(tables), 0
    for (lengths, values, count_up), total in zip(tables, totals):
        lengths = np.asarray(lengths, dtype=np.int64)
        header += [runs_at, lengths.size, out_at, total, int(count_up)]
        body += [np.cumsum(lengths) - lengths, np.asarray(values, dtype=np.int64)]
        runs_at, out_at = runs_at + 2 * lengths.size, out_at + total
    out = torch.empty(out_at, dtype=torch.int64, device=device)
    if out_at:
        packed = np.concatenate([np.asarray(header, dtype=np.int64), *body])
        most_runs = max(np.size(lengths) for lengths, _, _ in tables)
        expand_runs_kernel[(triton.cdiv(max(totals), _BLOCK), len(tables))](
            to_device(packed, device),
            out,
            BLOCK=_BLOCK,
            RUNS=max(16, triton.next_power_of_2(most_runs)),
        )
    return list(out.split(totals))
