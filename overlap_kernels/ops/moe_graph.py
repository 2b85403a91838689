"""MoE dispatch and combine that replay in CUDA graphs: fixed capacity, counts on the device.

Problem
    moe_dispatch sizes recv_x from the token counts, which the host reads once
    per call: a CUDA graph cannot hold that. moe_dispatch_graph gives recv_x a
    fixed capacity, sized from the most tokens a rank passes per call
    (``max_tokens_per_rank``, as DeepEP's low-latency mode is), and returns the
    rows per local expert as device tensors; moe_combine_graph brings the
    expert outputs home. Neither synchronises with the host, so a serving engine
    captures dispatch -> grouped GEMM -> combine in one graph.

    recv_x rows [0, handle.expert_ends[-1]) are moe_dispatch's recv_x, in its
    order (local expert, then source rank, token, slot), bit for bit; rows past
    it are not written, nor are the handle's per-row tensors there. The
    capacity (``max_recv_rows``, default world * max_tokens_per_rank * max_topk:
    the most any routing can send one rank) is local to a rank: the ranks
    exchange theirs with the counts. moe_combine_graph gives moe_combine's bits.

Algorithm (kernels/moe_graph.py)
    Dispatch: the local routing (kernels/routing.py: three launches, no host
    sync), then one launch that pushes this rank's counts row, token rows and
    pair records into each destination's block for this rank (fixed offsets:
    max_tokens_per_rank rows per source), signals, waits for every source, and
    places each received pair's row from the count matrix it now holds.
    Combine: one launch; each owner pushes each received token's weighted sum
    (fp32, rounded once) into the token's home, signals; each home sums its
    owners' partials (fp32, rounded once).

Capacity and errors
    From the count matrix every rank checks every rank alike: more tokens than
    max_tokens_per_rank, a top-k above max_topk, a rank receiving more rows
    than its capacity (MoeCapacityError), expert ids outside [-1, E)
    (ValueError). The kernel records the first failure in host memory and drops
    what does not fit (it never writes past a buffer); every rank raises it
    once: at the end of the call on the CPU; on CUDA at the end of a later
    eager call (the first call's in that call: its replay preparation
    synchronises) or in overlap_kernels.raise_if_failed() (which synchronises),
    replays included. Every rank launched every call: the next call works.

Signal contract
    runtime/signals.py. Each op is one launch, so it replays as the other
    one-launch calls do (ops/replay.py): an eager call of its signature (every
    rank) prepares its replay; a captured call is passed
    limits.NEXT_DEVICE_EPOCH, picks its buffer half by the epoch's parity and
    counts itself; no entry barrier. Capturing a signature no eager call
    prepared raises OverlapInputError.

Example (``torchrun --nproc-per-node 4 example.py``; bf16 on sm_90)::

    kw = {"num_experts": 256, "max_tokens_per_rank": 128}
    out = layer(x, ids, weights)  # eager first: plans, kernels, the replay buffers
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_x, handle = moe_dispatch_graph(x, ids, weights, group, **kw)
        h = torch._grouped_mm(recv_x, w_gate_up, offs=handle.expert_ends)
        y = torch._grouped_mm(act(h), w_down, offs=handle.expert_ends)
        out = moe_combine_graph(y, handle)
    graph.replay()  # after new values in x, ids, weights

    moe_mlp(x, ids, weights, w_gate_up, w_down, num_experts=256, max_tokens_per_rank=128)
    is that layer in one call (bf16 on sm_90+ for capture: torch._grouped_mm's GEMMs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton

from ..kernels.activation import silu_mul
from ..kernels.gemm import interpreted_bf16
from ..kernels.moe_graph import (
    CODE_IDS,
    CODE_ROWS,
    CODE_TOKENS,
    CODE_TOPK,
    RECORD_LEN,
    combine_kernel,
    dispatch_kernel,
)
from ..kernels.routing import HEADER, RECORD_COLUMNS
from ..limits import DATA_OFFSET, LOCAL_FLAGS, writer_flags
from ..runtime.platform import FAST_SIGNALS, INTERPRETER, num_sms
from ..runtime.signals import wait_budget
from ..runtime.workspace import Workspace, get_workspace
from .checks import SUPPORTED_DTYPES, check_out, is_row_major, refuse_grad, require
from .moe import (
    MoeConfig,
    _check_routing,
    _check_tokens,
    _check_tokens_of_call,
    _config,
    _shared,
    _signature,
)
from .moe_details.layout import aligned, local_routing
from .moe_details.steps import MoeCapacityError, grouped_gemm, torch_grouped_mm_fits
from .paths import capturing
from .plans import plan_for
from .replay import REPLAY_MAX_BYTES, ReplayState

DISPATCH, COMBINE = "moe_dispatch_graph", "moe_combine_graph"
DEFAULT_MAX_TOPK = 8  # DeepSeek-V3's and Qwen3's top-k: the receive blocks hold 8 pairs per token
# Rows a program copies at once and their columns: 8 x 512 bf16 = 8 KiB, 32 values per
# thread of 4 warps (the one-hot run lookups beside them stay in registers).
BLOCK_ROWS, BLOCK_H, NUM_WARPS = 8, 512, 4
BLOCK_N = 1024  # combine columns per step, as kernels/gather_sum.py's


@dataclass
class MoeGraphHandle:
    """What moe_combine_graph needs: device tensors of fixed size, written by the
    dispatch's kernel. Per-row tensors follow recv_x's rows; rows at and past
    ``expert_ends[-1]`` hold nothing."""

    expert_counts: torch.Tensor  # int32 [E_local]: rows per local expert
    expert_ends: torch.Tensor  # int32 [E_local]: their cumulative ends (torch._grouped_mm's offs)
    recv_src_rank: torch.Tensor  # int32 [capacity]: each row's source rank
    recv_src_token: torch.Tensor  # int32 [capacity]: the token's index on its source rank
    recv_weights: torch.Tensor  # fp32 [capacity]: the pair's routing weight
    num_tokens: int  # T of this rank
    _plan: DispatchPlan = dataclasses.field(repr=False)
    _owner_rows: torch.Tensor = dataclasses.field(
        repr=False
    )  # int32 [world * max_tokens, max_topk]
    _recv_tokens: torch.Tensor = dataclasses.field(
        repr=False
    )  # int32 [world]: token rows from each
    _row_in_block: torch.Tensor = dataclasses.field(repr=False)  # int64 [T, world] (routing's)

    @property
    def capacity(self) -> int:
        """Rows of recv_x (and of y, which moe_combine_graph reads)."""
        return self.recv_weights.shape[0]


def _row_stride(row_bytes: int) -> int:
    """Bytes between two rows of a receive block: 16-byte multiples, so rows move in vectors."""
    return -(-row_bytes // 16) * 16


class _Record:
    """A workspace's record of the dispatch's checks (kernels/moe_graph.py), in host
    memory its kernels write, and what raises it: Workspace.raise_if_failed runs
    :meth:`check` after its own (runtime/workspace.py, op_records)."""

    def __init__(self, ws: Workspace):
        self.tensor = torch.zeros(
            RECORD_LEN, dtype=torch.int32, pin_memory=ws.device.type == "cuda"
        )
        self.view = self.tensor.numpy()  # (no torch call per check)
        self.address = self.tensor.data_ptr()
        ws.op_records[DISPATCH] = self

    @staticmethod
    def of(ws: Workspace) -> _Record:
        return ws.op_records.get(DISPATCH) or _Record(ws)

    def check(self) -> None:
        """Raise what the record holds, once: every rank made the call to its end, so
        the workspace stays usable and the next call works."""
        if self.view[0] == 0:
            return
        code, epoch, who, value, limit = (int(v) for v in self.view)
        self.view[0] = 0
        done = f"every rank raises this for its call #{epoch}, whose outputs are incomplete; the next call works"
        if code == CODE_IDS:
            raise ValueError(f"{DISPATCH}: topk_ids values outside [-1, {limit}) (rank {who}: {value} of them); {done}")  # fmt: skip
        what = {
            CODE_TOKENS: f"rank {who} passed {value} tokens, more than max_tokens_per_rank = {limit}",
            CODE_TOPK: f"rank {who} routes top-{value}, more than max_topk = {limit} (the receive blocks' width)",
            CODE_ROWS: f"rank {who} would receive {value} rows, more than its capacity of {limit} "
            "(max_recv_rows): raise it or route fewer tokens",
        }  # fmt: skip
        raise MoeCapacityError(f"{DISPATCH}: {what.get(code, f'failure code {code}')}; {done}")


class _Launches:
    """A plan's launches in one workspace (eager or replay): the programs' count
    (zero between launches), and the workspace's record."""

    def __init__(self, ws: Workspace):
        self.ws, self.buffer = ws, ws.buffer
        self.done = torch.zeros(1, dtype=torch.int32, device=ws.device)
        self.record = _Record.of(ws)


class _Plan:
    """What a graph-mode op's plans share: the workspace, launches, replay."""

    op: str
    region_bytes: int
    group: dist.ProcessGroup
    cfg: MoeConfig
    word: int = 0

    def _start(self, device: torch.device, replay: bool):
        """(launches, epoch, region, half_bytes, eager workspace or None): a captured call
        (or, with ``replay``, what a replay of one runs: tests on the CPU, where
        Triton's interpreter has no graphs) runs in the replay workspace, an eager
        call in the group's workspace."""
        if replay or capturing(device):
            state = self.replay_state
            require(state is not None and state.current(), self.op,
                    "no eager call of this signature prepared its replay: make one on every rank "
                    "before capturing (ops/replay.py), with the same shapes and config")  # fmt: skip
            return state.plan, state.epoch, 0, state.half_bytes, None
        if self.ws is None:
            self.ws = get_workspace(self.group, device, self.op, self.cfg.timeout_s)
        ws = self.ws
        epoch = ws.begin(self.op, 2 * self.region_bytes, self.cfg.timeout_s, capture_checked=True)
        if self.eager is None or self.eager.buffer is not ws.buffer:
            self.eager = _Launches(ws)
        return self.eager, epoch, ws.half_offset(epoch), 0, ws

    def _end(self, ws: Workspace | None, launches: _Launches, device: torch.device) -> None:
        if ws is None:
            return
        ws.finish()
        if self.replay_state is None and device.type == "cuda":
            # First (collective, and it synchronises: every rank's record is filled by
            # then, and raised there), so that no rank raises before it while a peer,
            # whose host has not seen the record yet, waits for it in the preparation.
            self.prepare_replay()
        launches.record.check()

    def prepare_replay(self) -> None:
        """After an eager call (every rank makes it): what a capture of this plan
        runs, in the group's replay workspace (ops/replay.py; one launch)."""
        self.replay_state = ReplayState.prepare(
            self.ws, self.op, self.region_bytes, self.cfg.timeout_s, self.budget,
            lambda replay_ws, offset: _Launches(replay_ws), one_launch=True,
        )  # fmt: skip

    def _load(self, kernel, args: list, kwargs: dict, device: torch.device) -> None:
        """Load the kernel's module with a launch that has no peer (world 0) before
        the first launch its peers wait for: a module load waits for the kernels
        running on the device (kernels/gemm.py _load)."""
        if device.type != "cuda" or self.loaded:
            return
        idle = list(args)
        idle[kernel.arg_names.index("world")] = 0
        kernel[(self.programs,)](*idle, **kwargs)
        torch.cuda.synchronize(device)
        self.loaded = True

    def _common(self, ws: Workspace, region: int, half_bytes: int) -> list:
        """The launch arguments from peer_table_ptr to half_bytes (both kernels)."""
        return [ws.peer_table, ws.rank, ws.world, DATA_OFFSET + region, half_bytes]

    def _signals(self, ws: Workspace, launches: _Launches, epoch: int) -> list:
        """The launch arguments from local_flags_ptr to the word (both kernels)."""
        return [ws.chunk_flags, LOCAL_FLAGS, writer_flags(ws.world), launches.done, epoch,
                ws.error_address, self.budget, self.word]  # fmt: skip


class DispatchPlan(_Plan):
    """One signature of moe_dispatch_graph: checks, config, the blocks' layout."""

    op = DISPATCH

    def __init__(self, x, group, num_experts: int, max_tokens: int, max_topk: int, config):
        op = self.op
        self.group, world = _check_tokens(op, x, group, num_experts)
        for name, value in (("max_tokens_per_rank", max_tokens), ("max_topk", max_topk)):
            require(isinstance(value, int) and value >= 1, op, f"{name} must be an int >= 1, got {value!r}")  # fmt: skip
        self.cfg = _config(config, x.shape[1], num_experts, world, x.dtype)
        self.world, self.rank = world, dist.get_rank(self.group)
        self.num_experts, self.e_local = num_experts, num_experts // world
        self.hidden, self.dtype = x.shape[1], x.dtype
        self.max_tokens, self.max_topk = max_tokens, max_topk
        self.counts_len = (
            len(HEADER) + world + num_experts
        )  # (kernels/routing.py), then the capacity
        self.tokens_at = aligned(4 * (self.counts_len + 1))
        self.row_stride = _row_stride(x.shape[1] * x.element_size())
        self.records_at = self.tokens_at + aligned(max_tokens * self.row_stride)
        self.block_bytes = self.records_at + aligned(max_tokens * max_topk * 4 * RECORD_COLUMNS)
        self.region_bytes = world * self.block_bytes
        require(self.region_bytes <= REPLAY_MAX_BYTES, op,
                f"max_tokens_per_rank = {max_tokens} needs {self.region_bytes / 2**20:.1f} MiB of receive blocks "
                f"per rank, more than the {REPLAY_MAX_BYTES >> 20} MiB a replay buffer holds: the graph mode "
                "is for decode sizes; use moe_dispatch for larger calls")  # fmt: skip
        self.budget = wait_budget(self.cfg.timeout_s)
        # (Triton's interpreter runs programs one after another: kernels/moe_graph.py.)
        self.programs = 1 if INTERPRETER else num_sms(x.device)
        self.ws: Workspace | None = None
        self.eager: _Launches | None = None
        self.replay_state: ReplayState | None = None
        self.loaded = False
        self.blocks = {
            "BLOCK_ROWS": BLOCK_ROWS, "BLOCK_H": BLOCK_H, "BLOCK_W": triton.next_power_of_2(world),
            "BLOCK_E": triton.next_power_of_2(num_experts),
            "BLOCK_EL": triton.next_power_of_2(self.e_local),
            "BLOCK_C": max(1024, triton.next_power_of_2(self.counts_len + 1)),
            "FAST_SIGNALS": FAST_SIGNALS, "num_warps": NUM_WARPS,
        }  # fmt: skip

    def capacity(self, max_recv_rows: int | None) -> int:
        if max_recv_rows is None:
            return self.world * self.max_tokens * self.max_topk
        require(isinstance(max_recv_rows, int) and max_recv_rows >= 0, self.op,
                f"max_recv_rows must be an int >= 0 or None, got {max_recv_rows!r}")  # fmt: skip
        return max_recv_rows

    def __call__(
        self, x, topk_ids, topk_weights, capacity: int, *, replay: bool = False
    ) -> tuple[torch.Tensor, MoeGraphHandle]:
        device = x.device
        launches, epoch, region, half_bytes, ws = self._start(device, replay)
        world, t = self.world, x.shape[0]
        routing = local_routing(topk_ids, topk_weights, world, self.num_experts, self.hidden, x.element_size())  # fmt: skip
        recv_x = torch.empty((capacity, self.hidden), dtype=x.dtype, device=device)
        # One allocation for the int32 outputs, each piece 16-byte aligned (a pointer's
        # alignment is specialised on: every call must run the kernel the first loaded).
        lengths = [capacity] * 3 + [world * self.max_tokens * self.max_topk, self.e_local, self.e_local, world]  # fmt: skip
        padded = [-(-n // 4) * 4 for n in lengths]
        pieces = torch.empty(sum(padded), dtype=torch.int32, device=device).split(padded)
        src_rank, src_token, bits, owner, counts, ends, recv_tokens = (p[:n] for p, n in zip(pieces, lengths))  # fmt: skip
        lw = launches.ws
        args = [
            x, x.stride(0), t, self.hidden, routing.counts, self.counts_len, routing.records,
            routing.dest_tokens, capacity, recv_x, src_rank, src_token, bits, owner, counts, ends,
            recv_tokens, launches.record.address, self.programs,
            *self._common(lw, region, half_bytes), self.block_bytes, self.tokens_at,
            self.records_at, self.row_stride, *self._signals(lw, launches, epoch),
            self.max_tokens, self.max_topk, self.num_experts, self.e_local,
        ]  # fmt: skip
        self._load(dispatch_kernel, args, self.blocks, device)
        dispatch_kernel[(self.programs,)](*args, **self.blocks)
        handle = MoeGraphHandle(counts, ends, src_rank, src_token, bits.view(torch.float32), t, self,
                                owner.view(world * self.max_tokens, self.max_topk), recv_tokens,
                                routing.row_in_block)  # fmt: skip
        self._end(ws, launches, device)
        return recv_x, handle


class CombinePlan(_Plan):
    """One signature of moe_combine_graph: its rows' width and dtype, and the dispatch's blocks."""

    op = COMBINE

    def __init__(self, y: torch.Tensor, dispatch: DispatchPlan):
        self.dispatch, self.group, self.cfg = dispatch, dispatch.group, dispatch.cfg
        self.row_stride = _row_stride(y.shape[1] * y.element_size())
        self.block_bytes = aligned(dispatch.max_tokens * self.row_stride)
        self.region_bytes = dispatch.world * self.block_bytes
        require(self.region_bytes <= REPLAY_MAX_BYTES, self.op,
                f"rows of {y.shape[1]} {y.dtype} at max_tokens_per_rank = {dispatch.max_tokens} need "
                f"{self.region_bytes / 2**20:.1f} MiB per rank, more than the {REPLAY_MAX_BYTES >> 20} MiB "
                "a replay buffer holds")  # fmt: skip
        self.budget, self.programs = dispatch.budget, dispatch.programs
        self.ws: Workspace | None = None
        self.eager: _Launches | None = None
        self.replay_state: ReplayState | None = None
        self.loaded = False
        self.blocks = {"BLOCK_N": BLOCK_N, "INTERPRETED_BF16": interpreted_bf16(y.dtype),
                       "FAST_SIGNALS": FAST_SIGNALS, "num_warps": NUM_WARPS}  # fmt: skip

    def __call__(
        self, y, handle: MoeGraphHandle, out: torch.Tensor, *, replay: bool = False
    ) -> torch.Tensor:
        device = y.device
        launches, epoch, region, half_bytes, ws = self._start(device, replay)
        d, lw = self.dispatch, launches.ws
        args = [
            y, y.stride(0), y.shape[1], handle.recv_weights, handle._owner_rows, handle._recv_tokens,
            handle._row_in_block, handle.num_tokens, out, out.stride(0), self.programs,
            *self._common(lw, region, half_bytes), self.block_bytes,
            self.row_stride, *self._signals(lw, launches, epoch), d.max_tokens, d.max_topk,
        ]  # fmt: skip
        self._load(combine_kernel, args, self.blocks, device)
        combine_kernel[(self.programs,)](*args, **self.blocks)
        self._end(ws, launches, device)
        return out


def dispatch_plan(
    x, group, num_experts: int, max_tokens: int, max_topk: int, config
) -> DispatchPlan:
    """The plan of a moe_dispatch_graph call (made and agreed on by its first call).
    Its signature leaves out what is local to a rank: T, k, the routing's dtypes
    and the capacity (the ranks exchange it with the counts)."""
    key = _signature(DISPATCH, group, config, (x,), fixed=(num_experts, max_tokens, max_topk))
    return plan_for(
        DISPATCH, key, lambda: DispatchPlan(x, group, num_experts, max_tokens, max_topk, config),
        _shared({"x": x}, num_experts=num_experts, max_tokens_per_rank=max_tokens, max_topk=max_topk),
    )  # fmt: skip


def combine_plan(y: torch.Tensor, handle: MoeGraphHandle) -> CombinePlan:
    """The plan of a moe_combine_graph call: the rows' width and dtype, agreed on
    once (each home reads its owners' partials by that layout)."""
    d = handle._plan
    key = _signature(COMBINE, d.group, d.cfg, (y,), fixed=(d.world, d.num_experts, d.max_tokens, d.max_topk))  # fmt: skip
    return plan_for(COMBINE, key, lambda: CombinePlan(y, d),
                    _shared({"y": y}, max_tokens_per_rank=d.max_tokens, max_topk=d.max_topk))  # fmt: skip


def moe_dispatch_graph(
    x: torch.Tensor,  # [T, H], T <= max_tokens_per_rank
    topk_ids: torch.Tensor,  # [T, k], k <= max_topk
    topk_weights: torch.Tensor,  # [T, k]
    group: dist.ProcessGroup | None = None,
    *,
    num_experts: int,
    max_tokens_per_rank: int,
    max_topk: int = DEFAULT_MAX_TOPK,
    max_recv_rows: int | None = None,
    config: MoeConfig | dict | None = None,
) -> tuple[torch.Tensor, MoeGraphHandle]:
    """Send every token to its experts' ranks, with no host synchronisation:
    (recv_x [capacity, H], handle). Rows [0, handle.expert_ends[-1]) are
    moe_dispatch's recv_x; ``max_recv_rows`` (this rank's capacity) defaults to
    world * max_tokens_per_rank * max_topk, which no routing exceeds. Every rank
    passes the same max_tokens_per_rank, max_topk, num_experts and config."""
    refuse_grad(DISPATCH, x, topk_weights)
    _check_routing(DISPATCH, x, topk_ids, topk_weights)
    plan = dispatch_plan(x, group, num_experts, max_tokens_per_rank, max_topk, config)
    _check_tokens_of_call(DISPATCH, x)
    return plan(x, topk_ids.contiguous(), topk_weights.contiguous(), plan.capacity(max_recv_rows))


def moe_combine_graph(
    y: torch.Tensor, handle: MoeGraphHandle, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Bring expert outputs y [capacity, N] (recv_x's rows; rows past the dispatch's
    are not read) home: out [T, N] = the sum over each token's slots of weight * y,
    moe_combine's bits. Every rank passes the same N and dtype."""
    op = COMBINE
    refuse_grad(op, y)
    require(isinstance(handle, MoeGraphHandle), op, "handle must be the MoeGraphHandle of a moe_dispatch_graph call")  # fmt: skip
    require(
        isinstance(y, torch.Tensor) and y.dim() == 2, op, "y must be a 2-D tensor [capacity, N]"
    )
    require(y.shape[0] == handle.capacity, op,
            f"y has {y.shape[0]} rows but the dispatch's recv_x has {handle.capacity} (its capacity)")  # fmt: skip
    require(y.dtype in SUPPORTED_DTYPES, op, f"y has dtype {y.dtype}; supported: bfloat16, float16, float32")  # fmt: skip
    require(y.device == handle.recv_weights.device, op,
            f"y is on {y.device}, the dispatch ran on {handle.recv_weights.device}")  # fmt: skip
    require(is_row_major(y), op, "y must be contiguous: pass y.contiguous()")
    plan = combine_plan(y, handle)
    shape = (handle.num_tokens, y.shape[1])
    check_out(op, out, shape, y, y)
    out = out if out is not None else torch.empty(shape, dtype=y.dtype, device=y.device)
    return plan(y, handle, out)


def graph_mlp(
    op: str,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,  # [E_local, H, 2F], checked by the caller
    w_down: torch.Tensor,  # [E_local, F, H]
    group: dist.ProcessGroup | None,
    *,
    num_experts: int,
    max_tokens_per_rank: int,
    max_topk: int,
    cfg: MoeConfig,
) -> torch.Tensor:
    """moe_mlp's layer in the graph mode: moe_dispatch_graph -> gate/up grouped GEMM
    -> silu(gate) * up -> down grouped GEMM -> moe_combine_graph. Where
    torch._grouped_mm runs the GEMMs (bf16 on sm_90+, rows a multiple of 16
    bytes) it takes the handle's device expert_ends: no host synchronisation, so
    a CUDA graph holds the whole layer. Elsewhere the host reads the rows per
    expert once for the library's grouped GEMM, which a capture refuses."""
    recv_x, handle = moe_dispatch_graph(
        x, topk_ids, topk_weights, group, num_experts=num_experts,
        max_tokens_per_rank=max_tokens_per_rank, max_topk=max_topk, config=cfg,
    )  # fmt: skip
    if torch_grouped_mm_fits(x, w_gate_up) and torch_grouped_mm_fits(x, w_down):
        h = torch._grouped_mm(recv_x, w_gate_up, offs=handle.expert_ends)
        y = torch._grouped_mm(silu_mul(h), w_down, offs=handle.expert_ends)
        return moe_combine_graph(y, handle)
    require(not capturing(x.device), op,
            "max_tokens_per_rank: a CUDA graph holds the layer where torch._grouped_mm runs its "
            "GEMMs (bf16 on sm_90 or later, rows a multiple of 16 bytes); here the library's "
            "grouped GEMM reads the rows per expert on the host")  # fmt: skip
    counts = handle.expert_counts.tolist()
    h = grouped_gemm(recv_x, w_gate_up, counts, cfg)
    y = grouped_gemm(silu_mul(h), w_down, counts, cfg)
    return moe_combine_graph(y, handle)


__all__ = ["MoeGraphHandle", "moe_combine_graph", "moe_dispatch_graph"]
