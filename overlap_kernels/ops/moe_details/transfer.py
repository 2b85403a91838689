"""The MoE ops' moves through the symmetric workspace (layout.py says where things live).

Each step is one epoch of the workspace (runtime/signals.py), in that epoch's
buffer half: a rank writes its own memory, announces it (ready flags), and
peers pull what they need with the copy engine. (The fused combine also
writes into peers' halves before announcing: safe because every MoE step
waits for every rank's announcement, so no peer still reads that half.) A
rank can be at most one epoch ahead of a peer's reads (it needs the peer's
announcement of the next epoch first), so the two halves never hold data a
peer still reads.

    exchange_counts  every rank's call word and counts row -> the count matrix,
                     on the host (the one host round trip of a call: it sizes
                     the outputs, and the words show whether the ranks made
                     the same call)
    pull_tokens      token rows and pair records of every source, one flag each
(The combine reads its owners' partials where they lie: steps.py, gather_sum.)
"""

from __future__ import annotations

import numpy as np
import torch

from ...kernels.routing import RECORD_COLUMNS
from ...kernels.transfer import exchange_ready
from ...runtime.errors import signature_word
from ...runtime.workspace import Workspace
from .layout import RECORD_BYTES, Layout


def announce_and_wait(ws: Workspace, epoch: int, budget: int, word: int) -> None:
    """Tell every rank this rank's buffer half holds the epoch's data, wait for all
    of theirs; each with its call's signature ``word`` (runtime/signals.py). On one
    rank nothing: no peer to tell or wait for, and what reads the half is ordered
    after what wrote it by its stream (the communication stream forks from the
    caller's after the write: Workspace.overlap), so the launch would only cost."""
    if ws.world == 1:
        return
    sources = ws.cache.get(("moe", "all ranks"))
    if sources is None:
        sources = ws.cache[("moe", "all ranks")] = torch.arange(
            ws.world, dtype=torch.int32, device=ws.device
        )
    exchange_ready(ws, epoch, budget, sources, ws.world, word)


# The signature word the count exchange's flags carry: one for every op that
# dispatches tokens, so ranks that make different such calls all get through
# the exchange and compare their calls' words on the host (steps.route), while
# a peer at another step at this epoch (a combine) still fails the wait.
COUNTS_WORD = signature_word("the count exchange of an MoE dispatch", {})


def exchange_counts(
    ws: Workspace, row: torch.Tensor, half: int, epoch: int, budget: int, word: int
) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's call signature ``word`` [world] and counts row [world,
    len(row)], on the host. The word leads the row, so it is read right even
    where the rows' lengths differ (the ranks disagree on num_experts). Raises
    a peer's timeout here, before any size is read from a row that never came."""
    sent = ws.data(ws.rank, half, (1 + row.numel(),), torch.int32)
    sent[:1].fill_(word)
    sent[1:].copy_(row)
    announce_and_wait(ws, epoch, budget, COUNTS_WORD)
    rows = torch.stack([ws.data(p, half, tuple(sent.shape), torch.int32) for p in range(ws.world)])
    rows = rows.cpu().numpy().astype(np.int64)
    ws.raise_if_failed()
    return rows[:, 0], rows[:, 1:]


def arrival_order(rank: int, world: int) -> list[int]:
    """Own rows first (no wait), then rank + 1, rank + 2, ...: every source is
    read by a different rank at each step, so no rank's links are the hot spot."""
    return [(rank + i) % world for i in range(world)]


def pull_tokens(
    ws: Workspace,
    lay: Layout,
    half: int,
    epoch: int,
    recv_tokens: torch.Tensor,
    recv_records: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    """Copy each source's token rows and records for this rank into the local
    buffers, in arrival order; flag ``s`` then holds the epoch (call it on the
    communication stream, after :func:`announce_and_wait`)."""
    r, hidden = lay.rank, lay.hidden
    for s in arrival_order(r, lay.world):
        rows, pairs = int(lay.send[s, r]), int(lay.pairs_to[s, r])
        if rows:
            start = int(lay.tok_base[s, r])
            src = ws.data(
                s, half + int(lay.send_off[s, r]) * hidden * lay.itemsize, (rows, hidden), dtype
            )
            recv_tokens[start : start + rows].copy_(src)
            first = int(lay.pair_base[s, r])
            records_at = half + lay.tokens_bytes(s) + int(lay.record_off[s, r]) * RECORD_BYTES
            recv_records[first : first + pairs].copy_(
                ws.data(s, records_at, (pairs, RECORD_COLUMNS), torch.int32)
            )
        ws.signal_from_stream(s, epoch)
