"""The steps of the MoE ops: route (count exchange), send, receive (+ GEMM), combine.

moe.py strings them together; layout.py says where every row lives and
transfer.py moves them. Each step that moves data is one workspace epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from ...kernels.gather_sum import gather_sum
from ...kernels.grouped_gemm import launch_grouped_gemm
from ...kernels.routing import RECORD_COLUMNS
from ...kernels.runs import expand_runs
from ...limits import DATA_OFFSET
from ...runtime.errors import OverlapInputError
from ...runtime.platform import num_sms, to_device
from ...runtime.signals import wait_budget
from ...runtime.workspace import Workspace, get_workspace, is_current
from ..paths import capturing
from ..plans import agree
from .layout import (
    EXPERTS,
    HIDDEN,
    INVALID,
    ITEMSIZE,
    Layout,
    LocalRouting,
    aligned,
    counts_row_len,
    grouped_tiles,
    local_routing,
)
from .transfer import announce_and_wait, arrival_order, exchange_counts, pull_tokens

if TYPE_CHECKING:
    from ..moe import MoeConfig, MoeHandle


class MoeCapacityError(ValueError):
    """A rank would receive more token rows than ``max_recv_tokens`` allows
    (raised on every rank of the call, which then stays usable)."""


@dataclass
class Route:
    """One dispatch's routing: what every rank knows after the count exchange."""

    ws: Workspace
    routing: LocalRouting
    layout: Layout
    slots: torch.Tensor  # int64 [R] on the device: each output row's record
    sources: torch.Tensor  # int64 [R] on the device: each output row's source rank
    sent_rows: torch.Tensor  # int64 [S]: this rank's sent tokens in routing.dest_tokens viewed flat
    record_shift: torch.Tensor  # int64 [P]: per pair, its destination block's first row there
    word: int  # the dispatch's signature word (runtime/signals.py): its data step carries it too


def route(
    op: str,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    group: dist.ProcessGroup | None,
    num_experts: int,
    cfg: MoeConfig,
    word: int,
    shared: dict[str, str],
) -> Route:
    """Sort this rank's pairs, exchange the count rows with the call's signature
    ``word`` (what the ranks must share: ``shared``), check them on every rank.
    Ranks whose words differ made different calls: every rank raises
    OverlapInputError naming what differs (:func:`refuse_other_calls`)."""
    refuse_capture(op, x.device)
    ws = get_workspace(group, x.device, op, cfg.timeout_s)
    world = ws.world
    routing = local_routing(
        topk_ids, topk_weights, world, num_experts, x.shape[1], x.element_size()
    )
    row_len = 1 + counts_row_len(world, num_experts)  # the word, then the counts
    epoch = ws.begin(op, 2 * aligned(row_len * 4), cfg.timeout_s)
    half = ws.half_offset(epoch)
    words, counts = exchange_counts(
        ws, routing.counts, half, epoch, wait_budget(cfg.timeout_s), word
    )
    if (words != word).any():
        refuse_other_calls(op, ws, words, shared, cfg.timeout_s)
    check_agreement(op, counts, num_experts)
    bad = [(r, int(n)) for r, n in enumerate(counts[:, INVALID]) if n]
    if bad:
        which = ", ".join(f"rank {r}: {n}" for r, n in bad)
        raise ValueError(
            f"{op}: topk_ids values outside [-1, {num_experts}) ({which} of them); every rank raises this"
        )
    layout = Layout(counts, ws.rank, world, num_experts, x.shape[1], x.element_size())
    if cfg.max_recv_tokens is not None:
        received = layout.send.sum(0)
        over = [(r, int(n)) for r, n in enumerate(received) if n > cfg.max_recv_tokens]
        if over:
            which = ", ".join(f"rank {r} would receive {n}" for r, n in over)
            raise MoeCapacityError(
                f"{op}: {which} token rows, more than max_recv_tokens = {cfg.max_recv_tokens}; "
                "raise it or route fewer tokens (every rank raises this)"
            )
    # Made now, while the stream is idle after the count read (a host copy then never waits).
    lengths, first_records, sources = layout.output_runs()
    tables = expand_runs(
        [(lengths, first_records, True), (lengths, sources, False), (*layout.sent_runs(), True),
         (*layout.record_shift_runs(), False)], x.device,
    )  # fmt: skip
    return Route(ws, routing, layout, *tables, word)


def refuse_capture(op: str, device: torch.device) -> None:
    """The host-sized steps read the count matrix on the host: no CUDA graph holds them."""
    if capturing(device):
        raise OverlapInputError(
            f"{op}: its symmetric-memory steps cannot be captured in a CUDA graph (each call reads the "
            "token counts on the host to size its outputs); capture moe_dispatch_graph and "
            "moe_combine_graph instead: fixed-capacity buffers, counts on the device (ops/moe_graph.py)"
        )


def refuse_other_calls(
    op: str, ws: Workspace, words: np.ndarray, shared: dict[str, str], timeout_s: float
) -> None:
    """Raise OverlapInputError on every rank: the ranks' calls have other
    signature words. Every rank read the same words, so every rank is here:
    they meet at once (through the store, plans.agree) to name what differs.
    The exchange itself completed on every rank, so the next call is fine."""
    agree(op, ws.group, {"op": op, **shared}, timeout_s, topic="moe calls",
          done="only the token counts were exchanged, no token was sent")  # fmt: skip
    which = ", ".join(f"rank {r}: {int(w):#x}" for r, w in enumerate(words))
    raise OverlapInputError(
        f"{op}: the ranks of the group made different calls (signature words {which}); every rank "
        f"must call {op} with the same shapes, dtypes and config (no token was sent)"
    )


def check_agreement(op: str, counts: np.ndarray, num_experts: int) -> None:
    """Every rank's hidden size, item size and expert count must agree (each
    rank's offsets and workspace growth are computed from them): raised on
    every rank alike, before anything is sized from the counts."""
    for column, what in (
        (HIDDEN, "hidden size H"),
        (ITEMSIZE, "x's bytes per element"),
        (EXPERTS, "num_experts"),
    ):
        values = counts[:, column]
        if (values != values[0]).any():
            which = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(values))
            raise ValueError(
                f"{op}: the ranks disagree on {what} ({which}); every rank raises this"
            )


def send(op: str, rt: Route, x: torch.Tensor, cfg: MoeConfig) -> tuple[int, int]:
    """Pack this rank's token rows and pair records into its symmetric memory
    (the caller's stream); the epoch and buffer half of the data step."""
    ws, lay, routing = rt.ws, rt.layout, rt.routing
    epoch = ws.begin(op, 2 * lay.dispatch_bytes(), cfg.timeout_s)
    half = ws.half_offset(epoch)
    rank = ws.rank
    tokens = ws.data(rank, half, (rt.sent_rows.numel(), x.shape[1]), x.dtype)
    torch.index_select(x, 0, routing.dest_tokens.view(-1)[rt.sent_rows], out=tokens)
    pairs = int(lay.pairs_to[rank].sum())
    records = ws.data(rank, half + lay.tokens_bytes(rank), (pairs, RECORD_COLUMNS), torch.int32)
    records.copy_(routing.records[:pairs])
    records[:, 0] += rt.record_shift  # rows in the receivers' buffers
    return epoch, half


def receive(
    op: str,
    rt: Route,
    x: torch.Tensor,
    cfg: MoeConfig,
    gemm: Callable[[torch.Tensor, torch.Tensor, int, int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move every source's rows here; ``gemm(recv_tokens, recv_records, epoch,
    budget)``, if given, runs beside the moves and waits per source.
    Returns (recv_tokens, recv_records)."""
    ws, lay = rt.ws, rt.layout
    epoch, half = send(op, rt, x, cfg)
    budget = wait_budget(cfg.timeout_s)
    recv_tokens = torch.empty((lay.recv_tokens, x.shape[1]), dtype=x.dtype, device=x.device)
    recv_records = torch.empty(
        (int(lay.pairs_to[:, ws.rank].sum()), RECORD_COLUMNS), dtype=torch.int32, device=x.device
    )

    def communicate() -> None:
        announce_and_wait(ws, epoch, budget, rt.word)
        pull_tokens(ws, lay, half, epoch, recv_tokens, recv_records, x.dtype)

    ws.overlap(
        communicate, lambda: gemm(recv_tokens, recv_records, epoch, budget) if gemm else None
    )
    ws.finish()
    return recv_tokens, recv_records


def dispatch_gemm_tiles(rt: Route, cfg: MoeConfig, n: int) -> torch.Tensor:
    lay = rt.layout
    lengths, _, run_sources = lay.output_runs()
    sources = np.repeat(run_sources, lengths)
    table = grouped_tiles(
        lay.expert_counts, cfg.block_m, cfg.block_n, n, group_m=cfg.group_m, sources=sources,
        arrival=arrival_order(lay.rank, lay.world),
    )  # fmt: skip
    return to_device(table, rt.slots.device)


def grouped_gemm(
    a: torch.Tensor, b: torch.Tensor, counts: tuple[int, ...], cfg: MoeConfig
) -> torch.Tensor:
    """[rows of e] = a[rows of e] @ b[e], rows grouped by expert (no waits).
    The unfused path takes PyTorch's grouped GEMM where it has one, or cuBLAS
    per expert where a rank holds few (config cublas_max_local_experts): nothing
    waits there, so the fastest kernel available is the right one. The choice
    depends on shapes every rank shares (never on this rank's row count), so a
    rank cannot fail where its peers go on."""
    if a.shape[0] == 0:
        return torch.empty((0, b.shape[2]), dtype=a.dtype, device=a.device)
    if torch_grouped_mm_fits(a, b):
        if b.shape[0] <= cfg.cublas_max_local_experts:
            return gemm_per_expert(a, b, counts)
        ends = to_device(np.cumsum(counts), a.device, torch.int32)
        return torch._grouped_mm(a, b, offs=ends)
    out = torch.empty((a.shape[0], b.shape[2]), dtype=a.dtype, device=a.device)
    table = _plain_tiles(counts, cfg, b.shape[2], a.device)
    launch_grouped_gemm(a, b, table, cfg, num_sms(a.device), out=out)
    return out


def gemm_per_expert(a: torch.Tensor, b: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
    """[rows of e] = a[rows of e] @ b[e] by one torch.mm per expert (cuBLAS): ahead of
    torch._grouped_mm where a rank holds few experts (config cublas_max_local_experts)."""
    out = torch.empty((a.shape[0], b.shape[2]), dtype=a.dtype, device=a.device)
    start = 0
    for e, rows in enumerate(counts):
        if rows:
            torch.mm(a[start : start + rows], b[e], out=out[start : start + rows])
        start += rows
    return out


def torch_grouped_mm_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch._grouped_mm's own conditions for a @ b[e]: bf16 on sm_90+, 16-byte
    aligned rows (K and N from b, so ``a`` may be any tensor of a's device and dtype)."""
    if not (
        a.device.type == "cuda" and a.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
    ):
        return False
    aligned = b.shape[1] % 8 == 0 and b.shape[2] % 8 == 0 and (b.stride(2) == 1 or b.stride(1) == 1)
    return aligned and torch.cuda.get_device_capability(a.device) >= (9, 0)


def _plain_tiles(counts, cfg: MoeConfig, n: int, device: torch.device) -> torch.Tensor:
    return to_device(
        grouped_tiles(counts, cfg.block_m, cfg.block_n, n, group_m=cfg.group_m), device
    )


def current_route(op: str, handle: MoeHandle) -> Route:
    """The handle's route, if its workspace is still the group's (not from before reset_workspaces())."""
    rt = handle._route
    if not is_current(rt.ws):
        raise OverlapInputError(
            f"{op}: this handle is from before reset_workspaces(); dispatch again"
        )
    return rt


def owner_rows(handle: MoeHandle) -> torch.Tensor:
    """int64 [recv_tokens, max k]: each received token row's output rows, one
    column per top-k slot (-1: none), for kernels/gather_sum.py. Built by a
    handle's first combine, from its rows' token rows and slots (a scatter)."""
    if handle._owner_rows is None:
        lay = handle._route.layout
        width, device = lay.max_topk, handle._token_rows.device
        rows = torch.full((lay.recv_tokens * width,), -1, dtype=torch.int64, device=device)
        rows[handle._token_rows * width + handle._slot_of_row] = torch.arange(
            handle._token_rows.numel(), device=device
        )
        handle._owner_rows = rows.view(lay.recv_tokens, width)
    return handle._owner_rows


def pair_rows(rt: Route, num_tokens: int) -> torch.Tensor:
    """int64 [T, k]: each slot's pair's record index here (-1: unused slot), the
    row its pushed output lands in (the fused combine)."""
    lay, slots = rt.layout, rt.routing.pair_slots
    pairs = int(lay.pairs_to[lay.rank].sum())
    rows = torch.full((slots.numel(),), -1, dtype=torch.int64, device=slots.device)
    rows[slots[:pairs]] = torch.arange(pairs, device=slots.device)
    return rows.view(num_tokens, int(lay.topk[lay.rank]))


def combine_partials(
    op: str, handle: MoeHandle, y: torch.Tensor, out: torch.Tensor, cfg: MoeConfig, word: int
) -> torch.Tensor:
    """Each owner sums its rows of a token (weighted, fp32), rounds once into
    its symmetric memory; each home sums its owners' partials (fp32, read
    where they lie; the routing's row_in_block names them) and rounds once."""
    refuse_capture(op, y.device)
    rt = current_route(op, handle)
    ws, lay = rt.ws, rt.layout
    width, row_bytes = y.shape[1], y.shape[1] * y.element_size()
    epoch = ws.begin(
        op, 2 * lay.combine_bytes(width, y.element_size(), per_pair=False), cfg.timeout_s
    )
    half = ws.half_offset(epoch)
    partials = ws.data(ws.rank, half, (lay.recv_tokens, width), y.dtype)
    gather_sum(owner_rows(handle), y.data_ptr(), row_bytes, partials, y.dtype, handle.recv_weights)
    announce_and_wait(ws, epoch, wait_budget(cfg.timeout_s), word)
    # Owner d holds this rank's token rows from tok_base[rank, d] on.
    owner_blocks = (
        np.asarray(ws.buffer.peer_addresses)
        + DATA_OFFSET
        + half
        + lay.tok_base[ws.rank] * row_bytes
    )
    gather_sum(rt.routing.row_in_block, to_device(owner_blocks, y.device), row_bytes, out, y.dtype)
    ws.finish()
    return out


def gemm_push_combine(
    op: str,
    handle: MoeHandle,
    h: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
    cfg: MoeConfig,
    word: int,
) -> torch.Tensor:
    """The fused combine: each GEMM tile, weighted, is stored straight into
    its pairs' home ranks (one row per pair); after every rank's kernel is
    done (announcement), each home sums its pairs' rows in fp32."""
    refuse_capture(op, h.device)
    rt = current_route(op, handle)
    ws, lay = rt.ws, rt.layout
    width, itemsize = w2.shape[2], h.element_size()
    row_bytes = width * itemsize
    epoch = ws.begin(op, 2 * lay.combine_bytes(width, itemsize, per_pair=True), cfg.timeout_s)
    half = ws.half_offset(epoch)
    r = ws.rank
    # A row's place at its home: the home's records for this rank start at
    # record_off[s, r] and arrived here at pair_base[s, r], in the same order.
    shift = to_device(lay.record_off[:, r] - lay.pair_base[:, r], h.device)
    home_row = rt.slots + shift[rt.sources]
    dst_addr = ws.peer_table[rt.sources] + (DATA_OFFSET + half) + home_row * row_bytes
    table = _plain_tiles(handle.expert_counts, cfg, width, h.device)
    launch_grouped_gemm(
        h,
        w2,
        table,
        cfg,
        num_sms(h.device),
        out_dtype=h.dtype,
        weights=handle.recv_weights,
        dst_addr=dst_addr,
    )
    announce_and_wait(ws, epoch, wait_budget(cfg.timeout_s), word)
    gather_sum(
        pair_rows(rt, handle.num_tokens),
        ws.buffer.peer_addresses[r] + DATA_OFFSET + half,
        row_bytes,
        out,
        h.dtype,
    )
    ws.finish()
    return out
