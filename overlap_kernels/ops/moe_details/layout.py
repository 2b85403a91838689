"""Where every token and pair of an MoE call lives, on the sender and on the receiver.

Words: a *pair* is one routed slot (source rank s, token t, slot j) whose
expert g = topk_ids[t, j] is owned by rank g // E_local. A *token row* is
token t sent once to a destination rank (whatever the number of its pairs
there). Every rank computes its own routing on its device
(:func:`local_routing`); one row of counts per rank (:func:`counts_row`) is all
that the ranks exchange before the data moves, and from the full count matrix
every rank derives every buffer offset of every rank (:class:`Layout`), so no
further agreement is needed.

Sender s, in its symmetric memory (one call's buffer half):
    tokens   [sum_d send[s, d], H]   token rows, destination-major, tokens ascending
    records  [pairs of s, 4] int32   pairs sorted by (expert g, token, slot): the
             receiver's token row of the pair, the token t, the weight's fp32
             bits, the slot j
Receiver r, in local memory:
    recv_tokens  [sum_s send[s, r], H]   source-major (block of s at tok_base[s])
    recv_records [sum_s pairs s->r, 3]   source-major (block of s at pair_base[s])
Output rows (recv_x, the dispatch GEMM's rows, y of the combine) are ordered by
(local expert, source, token, slot); ``slots[i]`` is row i's record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...kernels.grouped_gemm import TILE_COLUMNS
from ...kernels.routing import HEADER, RECORD_COLUMNS, route_pairs

RECORD_BYTES = 4 * RECORD_COLUMNS
ALIGN = 256  # bytes: every buffer in the data region starts aligned for vector and TMA access


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class LocalRouting:
    """This rank's routing, on its device (kernels/routing.py). Built without a
    host sync, so the tensors are as long as the slots: the first
    ``Layout.pairs_to[rank].sum()`` records and slots are the pairs, the first
    ``Layout.send[rank, d]`` tokens of ``dest_tokens[d]`` those sending d a row."""

    records: (
        torch.Tensor
    )  # int32 [T * k, RECORD_COLUMNS]: pairs in (g, t, j) order; row field block-relative
    pair_slots: torch.Tensor  # int64 [T * k]: each pair's slot t * k + j
    row_in_block: (
        torch.Tensor
    )  # int64 [T, world]: the token's row in each destination's block (-1: none)
    dest_tokens: torch.Tensor  # int64 [world, T]
    counts: torch.Tensor  # int32 [counts_row_len()]: the row this rank sends


def local_routing(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    world: int,
    num_experts: int,
    hidden: int,
    itemsize: int,
) -> LocalRouting:
    counts = torch.empty(
        counts_row_len(world, num_experts), dtype=torch.int32, device=topk_ids.device
    )
    records, pair_slots, row_in_block, dest_tokens = route_pairs(
        topk_ids.contiguous(),
        topk_weights.contiguous(),
        world,
        num_experts,
        counts,
        hidden,
        itemsize,
    )
    return LocalRouting(records, pair_slots, row_in_block, dest_tokens, counts)


# The counts row (kernels/routing.py writes it): HEADER, token rows to each rank, pairs to each global expert.
INVALID, TOKENS, HIDDEN, ITEMSIZE, EXPERTS, TOPK = map(
    HEADER.index, ("invalid", "tokens", "hidden", "itemsize", "experts", "topk")
)
_HEADER = len(HEADER)


def counts_row_len(world: int, num_experts: int) -> int:
    return _HEADER + world + num_experts


class Layout:
    """Every offset of one call, derived alike on every rank from the count matrix."""

    def __init__(
        self,
        counts: np.ndarray,
        rank: int,
        world: int,
        num_experts: int,
        hidden: int,
        itemsize: int,
    ):
        self.rank, self.world, self.e_local = rank, world, num_experts // world
        self.invalid = counts[:, INVALID]
        self.tokens = counts[:, TOKENS]  # [s]: T of rank s
        self.topk = counts[:, TOPK]  # [s]: k of rank s
        self.max_topk = int(self.topk.max(initial=1))
        self.send = counts[:, _HEADER : _HEADER + world]  # [s, d]: token rows s -> d
        pairs = counts[:, _HEADER + world :].reshape(world, world, self.e_local)  # [s, d, e]
        self.pairs_to = pairs.sum(2)  # [s, d]
        self.recv_pairs = pairs[:, rank, :]  # [s, e]: pairs this rank gets from s for its expert e
        self.tok_base = _exclusive(
            self.send, axis=0
        )  # [s, d]: first row of s's block in d's recv_tokens
        self.pair_base = _exclusive(self.pairs_to, axis=0)  # [s, d]: first record of s's block at d
        self.send_off = _exclusive(
            self.send, axis=1
        )  # [s, d]: first row of d's block in s's tokens
        self.record_off = _exclusive(
            self.pairs_to, axis=1
        )  # [s, d]: first record for d in s's records
        self.expert_counts = tuple(int(c) for c in self.recv_pairs.sum(0))
        self.hidden, self.itemsize = hidden, itemsize

    # ---- sizes --------------------------------------------------------------
    @property
    def recv_tokens(self) -> int:
        return int(self.send[:, self.rank].sum())

    @property
    def recv_rows(self) -> int:
        return int(self.recv_pairs.sum())

    def tokens_bytes(self, s: int) -> int:
        """Bytes of rank s's token buffer (its records follow, aligned)."""
        return aligned(int(self.send[s].sum()) * self.hidden * self.itemsize)

    def dispatch_bytes(self) -> int:
        """The largest send region of any rank: every rank reserves the same."""
        return max(
            self.tokens_bytes(s) + aligned(int(self.pairs_to[s].sum()) * RECORD_BYTES)
            for s in range(self.world)
        )

    def combine_bytes(self, width: int, itemsize: int, per_pair: bool) -> int:
        """Largest combine buffer of any rank: its owners' partials per received
        token row, or (``per_pair``, the fused combine) its own pairs' rows."""
        rows = self.pairs_to.sum(1) if per_pair else self.send.sum(0)
        return aligned(int(rows.max(initial=0)) * width * itemsize)

    # ---- per-row tables as runs (kernels/runs.py expands them on the device) --
    def sent_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """Where this rank's sent tokens are in LocalRouting.dest_tokens viewed
        flat (count up): destination-major, d's first send[rank, d] of row d."""
        r, t = self.rank, int(self.tokens[self.rank])
        return self.send[r], np.arange(self.world) * t - self.send_off[r]

    def record_shift_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """Per pair of this rank (in record order): its destination block's first
        row there, which turns a block-relative row into the receiver's row."""
        return self.pairs_to[self.rank], self.tok_base[self.rank]

    def output_runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The output rows in (expert, source, token, slot) order come in runs,
        one per (local expert, source): (lengths, each run's first record in
        recv_records minus its first row (count up: the rows' records), its source)."""
        lengths = self.recv_pairs.T.reshape(-1)  # (e, s) order
        first_record = (
            self.pair_base[:, self.rank][None, :] + _exclusive(self.recv_pairs, axis=1).T
        )  # [e, s]
        first_row = np.cumsum(lengths) - lengths
        return (
            lengths,
            first_record.reshape(-1) - first_row,
            np.tile(np.arange(self.world), self.e_local),
        )


def grouped_tiles(
    counts: Sequence[int] | np.ndarray,
    block_m: int,
    block_n: int,
    n: int,
    *,
    group_m: int = 1,
    sources: np.ndarray | None = None,
    arrival: Sequence[int] | None = None,
) -> np.ndarray:
    """Tiles [num_tiles, TILE_COLUMNS] over rows grouped by expert (``counts``
    rows each). An expert's row blocks go in groups of ``group_m``; a group's
    tiles sweep N once, column block by column block, each column block's tiles
    one after another, so that the B columns they share are read from L2 (with
    group_m = 1: each row block followed by its column blocks, its A rows kept
    in L2). No group spans two experts: they share no B. With ``sources`` (each
    row's source rank), a tile records the range of its rows' sources, and the
    tiles are stably sorted by the latest arrival among them (``arrival``:
    source ranks in the order they arrive): arrival order comes first, so a
    group whose row blocks wait for different sources is split there."""
    counts = np.asarray(counts, dtype=np.int64)
    ends = np.cumsum(counts)
    per_expert = -(-counts // block_m)  # row blocks of each expert
    expert = np.repeat(np.arange(counts.size), per_expert)
    index = np.arange(expert.size) - np.repeat(np.cumsum(per_expert) - per_expert, per_expert)
    row_start = ends[expert] - counts[expert] + index * block_m
    row_stop = np.minimum(row_start + block_m, ends[expert])
    col_blocks = -(-n // block_n)
    # Tiles as (row block, column block), ordered by group, then column, then row block.
    block = np.repeat(np.arange(expert.size), col_blocks)
    col = np.tile(np.arange(col_blocks), expert.size)
    group_first = block - index[block] % group_m
    order = np.lexsort((block, col, group_first))
    block, col = block[order], col[order]
    table = np.zeros((block.size, TILE_COLUMNS), dtype=np.int32)
    table[:, 0] = expert[block]
    table[:, 1] = row_start[block]
    table[:, 2] = row_stop[block]
    table[:, 3] = col * block_n
    if sources is None or table.shape[0] == 0:
        return table
    lo, hi = sources[row_start], sources[row_stop - 1]
    table[:, 4], table[:, 5] = lo[block], hi[block]
    position = np.empty(len(arrival), dtype=np.int64)
    position[arrival] = np.arange(len(arrival))
    # The latest arrival among sources lo..hi, for every (lo, hi).
    latest = np.maximum.accumulate(np.triu(np.broadcast_to(position, (len(arrival),) * 2)), axis=1)
    keys = latest[lo, hi][block]
    return table[np.argsort(keys, kind="stable")]


def _exclusive(a: np.ndarray, axis: int) -> np.ndarray:
    return np.cumsum(a, axis=axis) - a
