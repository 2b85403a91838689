"""MoE expert parallelism: token dispatch and combine, fused with the grouped GEMM.

Problem
    Each rank holds x [T, H] and its tokens' top-k routing (topk_ids [T, k],
    global expert ids or -1 for an unused slot; topk_weights [T, k]). Experts
    are split evenly: rank r owns experts [r * E_local, (r + 1) * E_local).
    Dispatch brings every token to the ranks of its experts (once per rank,
    however many of its experts live there) and lays the rows out by local
    expert; combine brings the expert outputs home and sums each token's top-k,
    weighted. Row order of recv_x (and of every per-row tensor of the handle):
    local expert, then source rank, then token, then slot.

Algorithm (moe_details/: layout.py, transfer.py, steps.py)
    1. Route: each rank orders its pairs by expert on its device (scan
       kernels, kernels/routing.py) and exchanges one row of counts through
       the symmetric workspace; the host reads the count matrix once (the
       call's one host round trip: it sizes recv_x, as NCCL's all_to_all path
       must too). Every rank derives every offset from it, checks topk_ids'
       range and max_recv_tokens on every rank, and reserves the same
       workspace; the per-row tables are expanded on the device (kernels/runs.py).
    2. Send: each rank packs its token rows (destination-major) and pair
       records into its symmetric memory and announces them.
    3. Receive: once every rank has announced, each rank pulls its rows from
       every source with the copy engine (own rows first, then rank + 1, ...),
       one flag per source. The fused moe_dispatch_gemm runs the grouped GEMM
       beside the pulls: each tile waits for the sources of its rows, tiles of
       early sources first.
    4. Combine: the owner sums each token's weighted rows (fp32) and rounds
       once; the home adds its owners' partials (fp32) and rounds once. The
       fused moe_gemm_combine instead stores each weighted GEMM tile straight
       into its tokens' home ranks (one row per pair) from the epilogue.

    Checks and the config are made once per call signature (ops/plans.py):
    everything but what is local to a rank by design (the token count T,
    topk_ids' and topk_weights' dtypes, k), which may differ between ranks
    and change from call to call. What the ranks must share (H, x's dtype,
    the expert count, the weights' shapes, the config; moe_combine's N) is
    compared across the group, so ranks that disagree get an error instead
    of reading rows laid out for other shapes: a dispatching call's signature
    word leads its counts row, and ranks whose words differ all raise
    OverlapInputError in that call, naming what differs (steps.route); a
    combine's new signature is agreed on before it moves anything.

Signal contract
    runtime/signals.py; each moving step is one epoch of the workspace, and a
    timeout raises OverlapTimeoutError naming the op, rank and peer. The host
    reads the count matrix, so no CUDA graph holds these ops: their graph mode,
    fixed capacity and counts on the device, is ops/moe_graph.py.

Example (``torchrun --nproc-per-node 4 example.py``)::

    recv_x, handle = moe_dispatch(x, topk_ids, topk_weights, dist.group.WORLD, num_experts=256)
    y = my_experts(recv_x, handle.expert_counts)        # rows grouped by local expert
    out = moe_combine(y, handle)                         # [T, H], weighted sum over top-k
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..kernels.activation import silu_mul
from ..kernels.grouped_gemm import launch_grouped_gemm
from ..limits import DEFAULT_TIMEOUT_S
from ..runtime.platform import FAST_SIGNALS, num_sms
from ..runtime.workspace import get_workspace
from ..tuning import build_config
from .checks import (
    SUPPORTED_DTYPES,
    check_current_device,
    check_epilogue,
    check_group,
    check_matrix,
    check_out,
    check_tile_knobs,
    check_tiles_fit,
    config_key,
    is_row_major,
    refuse_grad,
    require,
)
from .moe_details.layout import (
    EXPERTS,
    HIDDEN,
    ITEMSIZE,
    TOKENS,
    TOPK,
    Layout,
    LocalRouting,
    counts_row_len,
)
from .moe_details.steps import (
    MoeCapacityError,
    Route,
    combine_partials,
    dispatch_gemm_tiles,
    gemm_push_combine,
    grouped_gemm,
    receive,
    route,
)
from .plans import described, plan_for, shared_config

PATHS = ("auto", "fused", "unfused")

__all__ = ["MoeCapacityError", "MoeConfig", "MoeHandle", "moe_combine", "moe_dispatch", "moe_dispatch_gemm",
           "moe_gemm_combine", "moe_mlp", "resolve_config"]  # fmt: skip


@dataclass(frozen=True)
class MoeConfig:
    """Every knob of the MoE ops; templates/moe.toml explains each value."""

    block_m: int = 128
    block_n: int = 128  # fits fp32 tiles too; the template's [cuda] takes 256 (fp32: block_k 32)
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    path: str = "auto"  # GEMM ops and moe_mlp: "fused", "unfused" (dispatch, GEMM, combine), "auto"
    auto_path: str = "unfused"  # what "auto" takes: the path measured faster (templates/moe.toml)
    fused_max_tokens: int = 0  # ... except where no rank routes more tokens than this: then "fused"
    max_recv_tokens: int | None = None  # the most token rows one rank may receive per call
    timeout_s: float = DEFAULT_TIMEOUT_S
    # SMs the fused dispatch GEMM leaves free: its tiles spin until their rows
    # arrive, and the announcement kernel that starts the transfers needs an SM.
    comm_sms: int = 1
    allow_tf32: bool = False
    tma: bool = (
        True  # grouped GEMM: TMA *loads* of B (and of A when not gathered) where layouts allow
    )
    group_m: int = 1  # grouped GEMM: an expert's row blocks that share one sweep over N (L2 reuse)
    epilogue: str = "pointer"  # grouped GEMM's stored tiles: "pointer", or "tma" for whole blocks
    # The host-sized unfused path's GEMMs where torch._grouped_mm runs: one cuBLAS GEMM per
    # expert instead where a rank holds at most this many experts (0: never).
    cublas_max_local_experts: int = 0

    def validate(self) -> MoeConfig:
        check_tile_knobs("moe", self)
        check_epilogue("moe", self)
        require(
            self.path in PATHS,
            "moe",
            f"config: path must be one of {', '.join(PATHS)}, got '{self.path}'",
        )
        require(
            self.auto_path in PATHS[1:],
            "moe",
            f"config: auto_path must be fused or unfused, got '{self.auto_path}'",
        )
        require(self.max_recv_tokens is None or self.max_recv_tokens >= 0, "moe",
                f"config: max_recv_tokens must be None or >= 0, got {self.max_recv_tokens}")  # fmt: skip
        require(self.timeout_s > 0, "moe", f"config: timeout_s must be > 0, got {self.timeout_s}")
        require(self.cublas_max_local_experts >= 0, "moe",
                f"config: cublas_max_local_experts must be >= 0, got {self.cublas_max_local_experts}")  # fmt: skip
        require(
            self.comm_sms >= 1,
            "moe",
            f"config: comm_sms must be >= 1 (the transfers' kernel needs an SM), got {self.comm_sms}",
        )
        return self


@dataclass
class MoeHandle:
    """What moe_combine needs to bring rows home. Per-row tensors follow recv_x's rows."""

    expert_counts: tuple[int, ...]  # rows per local expert
    recv_src_rank: torch.Tensor  # int64 [R]: source rank of each row
    recv_src_token: torch.Tensor  # int64 [R]: the token's index on its source rank
    recv_weights: torch.Tensor  # fp32 [R]: the pair's routing weight
    num_tokens: int  # T of this rank
    _route: Route = dataclasses.field(repr=False)
    _token_rows: torch.Tensor = dataclasses.field(
        repr=False
    )  # int64 [R]: each row's token row in the receive buffer
    _slot_of_row: torch.Tensor = dataclasses.field(
        repr=False
    )  # int64 [R]: each row's top-k slot j at its source
    _config: MoeConfig = dataclasses.field(
        repr=False, default_factory=MoeConfig
    )  # the dispatch's: combine's default
    _owner_rows: torch.Tensor | None = dataclasses.field(
        repr=False, default=None
    )  # built by the first combine

    @property
    def path(self) -> str:
        """The path the dispatch's GEMM ops take ("fused" or "unfused"; "auto" after a plain dispatch)."""
        return self._config.path

    @property
    def max_topk(self) -> int:
        """The largest top-k of any rank's routing: every rank combines rows of this width."""
        return self._route.layout.max_topk


def _config(config, hidden: int, num_experts: int, world: int, dtype: torch.dtype) -> MoeConfig:
    shape = {
        "h": hidden,
        "experts": num_experts,
        "world": world,
        "dtype": str(dtype).removeprefix("torch."),
    }
    return build_config(MoeConfig, "moe", shape, config)


def _resolved(cfg: MoeConfig, rt: Route) -> MoeConfig:
    """``auto`` resolved from the count matrix, which every rank holds alike
    (the tokens of one rank alone could send ranks down different paths)."""
    return _with_path(cfg, int(rt.layout.tokens.max(initial=0)))


def _with_path(cfg: MoeConfig, max_tokens: int) -> MoeConfig:
    """``auto``: fused where no rank routes more than ``fused_max_tokens`` tokens, else ``auto_path``."""
    if cfg.path != "auto":
        return cfg
    return dataclasses.replace(
        cfg, path="fused" if max_tokens <= cfg.fused_max_tokens else cfg.auto_path
    )


@dataclass
class _MoePlan:
    """What a signature of a MoE op decided (ops/plans.py): its group and config
    ("auto" still open: it is resolved per call from the counts)."""

    group: dist.ProcessGroup
    cfg: MoeConfig
    word: int = 0  # the signature word its signals carry (plans.plan_for sets it)
    shared: dict[str, str] | None = (
        None  # what the word stands for (token ops: plans.plan_for sets it)
    )


def _signature(op: str, group, config, rows=(), weights=(), fixed=()) -> tuple | None:
    """A MoE op's signature: the tensors of ``rows`` (tokens or rows first, whose
    count changes from call to call and may differ between ranks) by their
    other dims, dtype and device; ``weights`` whole, strides too; ``fixed``
    values. None where there is none (ops/plans.signature says why). Row
    tensors' strides stay out: at T = 0 or 1 they vary with how a tensor was
    made, and ranks whose signatures differ would not meet in the agreement."""
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (*rows, *weights)):
        return None
    keyed = config_key(config) if config is not None else None
    if (config is not None and keyed is None) or not dist.is_initialized():
        return None
    group = group if group is not None else dist.group.WORLD
    return (
        op,
        group,
        keyed,
        *fixed,
        *((t.shape[1:], t.dtype, t.device) for t in rows),
        *((t.shape, t.stride(), t.dtype, t.device) for t in weights),
    )


def _shared(tensors: dict[str, torch.Tensor], **values):
    """plans.plan_for's ``shared``: what the ranks must have alike, for the agreement."""

    def shared(key: tuple, plan: _MoePlan) -> dict[str, str]:
        mine = {name: described(["*", *t.shape[1:]], t.dtype) for name, t in tensors.items()}
        return {
            **mine,
            **{k: repr(v) for k, v in values.items()},
            "config": shared_config(plan.cfg),
        }

    return shared


def _token_plan(op: str, x, topk_ids, topk_weights, group, num_experts, config,
                **weights: torch.Tensor) -> _MoePlan:  # fmt: skip
    """The plan of a call that dispatches tokens (moe_dispatch, moe_dispatch_gemm,
    moe_mlp): every check of its signature, made once; each call checks its
    routing and T. The signature leaves out what is local to a rank by design
    (T, topk_ids' and topk_weights' dtypes, k): ranks that differ there, or
    that change it from call to call, make the same plans. The plan is not
    agreed on in a meeting: every call compares its word in the count
    exchange (steps.route), so ranks of which some find their plan cached and
    some make a new one all reach the exchange, and a real disagreement is
    named there on every rank at once."""
    _check_routing(op, x, topk_ids, topk_weights)

    def make() -> _MoePlan:
        checked_group, world = _check_tokens(op, x, group, num_experts)
        k = x.shape[1]
        for name, w in weights.items():  # w1 or w_gate_up takes H; w_down takes F
            _check_weights(op, name, w, num_experts // world, k, x)
            k = w.shape[2]
            if name == "w_gate_up":
                require(k % 2 == 0, op, "w_gate_up must be [E_local, H, 2F]: gate columns, then up columns")  # fmt: skip
                k //= 2
        if "w_down" in weights:
            require(k == x.shape[1], op, f"w_down has shape {tuple(weights['w_down'].shape)}: "
                    f"its outputs must be H = {x.shape[1]} wide")  # fmt: skip
        cfg = _config(config, x.shape[1], num_experts, world, x.dtype)
        if weights:
            check_tiles_fit(op, cfg, x.dtype, x.device, store_buffer=cfg.epilogue == "tma")
        return _MoePlan(checked_group, cfg)

    key = _signature(op, group, config, (x,), tuple(weights.values()), fixed=(num_experts,))
    plan = plan_for(
        op, key, make, _shared({"x": x, **weights}, num_experts=num_experts), meet=False
    )
    _check_tokens_of_call(op, x)
    return plan


def _check_tokens_of_call(op: str, x) -> None:
    """What a call's signature leaves open about x: its layout (its row
    stride is not in the signature) and the current device."""
    require(is_row_major(x), op, "x must be contiguous: pass x.contiguous()")
    check_current_device(op, x)


def _check_routing(op: str, x, topk_ids, topk_weights) -> None:
    """x's kind and the routing of a call (every call: none of the routing is in the signature)."""
    check_matrix(op, "x", x)
    require(
        isinstance(topk_ids, torch.Tensor) and topk_ids.dim() == 2,
        op,
        "topk_ids must be a 2-D tensor [T, k]",
    )
    require(
        topk_ids.dtype in (torch.int32, torch.int64),
        op,
        f"topk_ids must be int32 or int64, got {topk_ids.dtype}",
    )
    require(
        topk_ids.shape[0] == x.shape[0],
        op,
        f"topk_ids has {topk_ids.shape[0]} rows but x has {x.shape[0]} tokens",
    )
    require(topk_ids.shape[1] >= 1, op, "topk_ids needs at least one slot per token (k >= 1)")
    require(isinstance(topk_weights, torch.Tensor) and topk_weights.is_floating_point(), op,
            "topk_weights must be a floating-point tensor")  # fmt: skip
    require(tuple(topk_weights.shape) == tuple(topk_ids.shape), op,
            f"topk_weights has shape {tuple(topk_weights.shape)}, topk_ids {tuple(topk_ids.shape)}: they must match")  # fmt: skip
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        require(t.device == x.device, op, f"{name} is on {t.device}, x on {x.device}")


def resolve_config(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    num_experts: int,
    config: MoeConfig | dict | None = None,
    max_tokens: int | None = None,
) -> MoeConfig:
    """The config a moe_mlp call with these arguments uses, ``path`` resolved.
    "auto" depends on the most tokens any rank routes, which the op learns in
    its count exchange: pass it as ``max_tokens`` (default: this rank's T,
    right when every rank routes as many). Nothing is launched or exchanged."""
    group = check_group("moe_mlp", group, x.device)
    cfg = _config(config, x.shape[1], num_experts, dist.get_world_size(group), x.dtype)
    return _with_path(cfg, x.shape[0] if max_tokens is None else max_tokens)


def _check_tokens(op: str, x, group, num_experts) -> tuple[dist.ProcessGroup, int]:
    """x's layout and the group (x's kind and the routing: :func:`_check_routing`, every call)."""
    require(is_row_major(x), op, "x must be contiguous: pass x.contiguous()")
    group = check_group(op, group, x.device)
    world = dist.get_world_size(group)
    require(isinstance(num_experts, int) and num_experts > 0 and num_experts % world == 0, op,
            f"num_experts must be a positive multiple of the {world} ranks, got {num_experts}")  # fmt: skip
    check_current_device(op, x)
    return group, world


def _check_weights(op: str, name: str, w, e_local: int, k: int, like: torch.Tensor) -> None:
    """w [E_local, K, N]: rows contiguous along N or along K (a transposed view)."""
    require(
        isinstance(w, torch.Tensor) and w.dim() == 3,
        op,
        f"{name} must be a 3-D tensor [E_local, K, N]",
    )
    require(w.shape[0] == e_local and w.shape[1] == k, op,
            f"{name} has shape {tuple(w.shape)}, expected [{e_local} local experts, {k}, N]")  # fmt: skip
    require(w.dtype == like.dtype, op, f"{name} is {w.dtype} but the activations are {like.dtype}")
    require(
        w.device == like.device, op, f"{name} is on {w.device}, the activations on {like.device}"
    )
    require(
        w.stride(2) == 1 or w.stride(1) == 1,
        op,
        f"{name} must be contiguous in its last two dims (or their transpose)",
    )


def _handle(rt: Route, recv_records: torch.Tensor, num_tokens: int, cfg: MoeConfig) -> MoeHandle:
    columns = recv_records[rt.slots].t().contiguous()  # [RECORD_COLUMNS, R]: each field contiguous
    # Clamped: after a peer's timeout the records are stale, and an index out of
    # range would poison the device for every later call.
    token_rows = columns[0].long().clamp_(0, max(rt.layout.recv_tokens - 1, 0))
    slot_of_row = columns[3].long().clamp_(0, rt.layout.max_topk - 1)
    return MoeHandle(
        expert_counts=rt.layout.expert_counts,
        recv_src_rank=rt.sources,
        recv_src_token=columns[1].long(),
        recv_weights=columns[2].view(torch.float32).clone(),  # its own (aligned) storage
        num_tokens=num_tokens,
        _route=rt,
        _token_rows=token_rows,
        _slot_of_row=slot_of_row,
        _config=cfg,
    )


# ---- a handle as tensors, for the custom ops (integrations/torch_ops.py) ----------


def _handle_tensors(handle: MoeHandle) -> tuple[torch.Tensor, ...]:
    """(count matrix, row_in_block, token rows, slots): with ``handle.recv_weights``,
    the tensors :func:`_combine_handle` rebuilds ``handle`` from. The count
    matrix is int64 [W, counts_row_len(W, E)] on the host, as far as this
    rank's Layout reads it (pairs to other ranks only summed: in their first
    expert's column); row_in_block int64 [T, W]; token rows and slots int64 [R]."""
    lay = handle._route.layout
    world, e_local = lay.world, lay.e_local
    counts = np.zeros((world, counts_row_len(world, world * e_local)), dtype=np.int64)
    header = ((TOKENS, lay.tokens), (TOPK, lay.topk), (HIDDEN, lay.hidden),
              (ITEMSIZE, lay.itemsize), (EXPERTS, world * e_local))  # fmt: skip
    for column, value in header:
        counts[:, column] = value
    first = counts.shape[1] - world - world * e_local  # after the header: rows to each rank
    counts[:, first : first + world] = lay.send
    pairs = counts[:, first + world :].reshape(world, world, e_local)  # a view: [s, d, e]
    pairs[:, :, 0] = lay.pairs_to
    pairs[:, lay.rank] = lay.recv_pairs
    rows = handle._route.routing.row_in_block
    return torch.from_numpy(counts), rows, handle._token_rows, handle._slot_of_row


def _combine_handle(counts, row_in_block, token_rows, slot_of_row, recv_weights, group,
                    config: dict | None, dtype: torch.dtype) -> MoeHandle:  # fmt: skip
    """A handle for :func:`moe_combine` rebuilt from :func:`_handle_tensors`'
    tensors and per-row weights (the dispatch's, or others: ones sum a token's
    rows). It holds what a combine reads, nothing else (not for moe_gemm_combine)."""
    counts = counts.numpy()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    num_experts, hidden, itemsize = (int(counts[0, c]) for c in (EXPERTS, HIDDEN, ITEMSIZE))
    lay = Layout(counts, rank, world, num_experts, hidden, itemsize)
    cfg = _config(config, hidden, num_experts, world, dtype)
    ws = get_workspace(group, row_in_block.device, "moe_combine", cfg.timeout_s)
    routing = LocalRouting(None, None, row_in_block, None, None)
    return MoeHandle(lay.expert_counts, None, None, recv_weights, row_in_block.shape[0],
                     _route=Route(ws, routing, lay, None, None, None, None, 0), _token_rows=token_rows,
                     _slot_of_row=slot_of_row, _config=cfg)  # fmt: skip


def moe_dispatch(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
    group: dist.ProcessGroup | None = None,
    *,
    num_experts: int,
    config: MoeConfig | dict | None = None,
) -> tuple[torch.Tensor, MoeHandle]:
    """Send every token to its experts' ranks: (recv_x [R, H] grouped by local expert, handle)."""
    op = "moe_dispatch"
    refuse_grad(op, x, topk_weights)
    plan = _token_plan(op, x, topk_ids, topk_weights, group, num_experts, config)
    cfg = plan.cfg
    rt = route(op, x, topk_ids, topk_weights, plan.group, num_experts, cfg, plan.word, plan.shared)
    recv_tokens, recv_records = receive(op, rt, x, cfg)
    handle = _handle(rt, recv_records, x.shape[0], cfg)
    return recv_tokens[handle._token_rows], handle


def moe_combine(
    y: torch.Tensor, handle: MoeHandle, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Bring expert outputs y [R, N] (recv_x's rows) home: out [T, N] = sum over
    each token's slots of weight * y. Every rank passes the same N and dtype
    (an empty y included): each home reads its owners' rows by that layout."""
    op = "moe_combine"
    refuse_grad(op, y)
    _check_rows(op, "y", y, handle)
    plan = _rows_plan(op, handle, handle._config, y)
    check_out(op, out, (handle.num_tokens, y.shape[1]), y, y)
    out = (
        out
        if out is not None
        else torch.empty((handle.num_tokens, y.shape[1]), dtype=y.dtype, device=y.device)
    )
    return combine_partials(op, handle, y, out, handle._config, plan.word)


def moe_dispatch_gemm(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,  # [E_local, H, N]
    group: dist.ProcessGroup | None = None,
    *,
    num_experts: int,
    config: MoeConfig | dict | None = None,
) -> tuple[torch.Tensor, MoeHandle]:
    """Dispatch, then h[rows of e] = recv_x[rows of e] @ w1[e]: (h [R, N], handle).
    Fused: each GEMM tile starts as soon as its rows' sources have arrived."""
    op = "moe_dispatch_gemm"
    refuse_grad(op, x, topk_weights, w1)
    plan = _token_plan(op, x, topk_ids, topk_weights, group, num_experts, config, w1=w1)
    return _dispatch_gemm(op, x, topk_ids, topk_weights, w1, plan, num_experts)


def _dispatch_gemm(op: str, x, topk_ids, topk_weights, w1, plan: _MoePlan, num_experts: int):
    rt = route(
        op, x, topk_ids, topk_weights, plan.group, num_experts, plan.cfg, plan.word, plan.shared
    )
    cfg = plan.cfg
    cfg = _resolved(cfg, rt)
    if cfg.path == "unfused":
        recv_tokens, recv_records = receive(op, rt, x, cfg)
        handle = _handle(rt, recv_records, x.shape[0], cfg)
        h = grouped_gemm(recv_tokens[handle._token_rows], w1, handle.expert_counts, cfg)
    else:
        h = torch.empty((rt.layout.recv_rows, w1.shape[2]), dtype=x.dtype, device=x.device)
        tiles = dispatch_gemm_tiles(rt, cfg, w1.shape[2])
        ws = rt.ws

        def gemm(
            recv_tokens: torch.Tensor, recv_records: torch.Tensor, epoch: int, budget: int
        ) -> None:
            launch_grouped_gemm(
                recv_tokens, w1, tiles, cfg, num_sms(x.device) - cfg.comm_sms, out=h, slots=rt.slots, records=recv_records,
                flags=ws.chunk_flags, epoch=epoch, err_addr=ws.error_address, budget=budget, fast_signals=FAST_SIGNALS,
            )  # fmt: skip

        _, recv_records = receive(op, rt, x, cfg, gemm)
        handle = _handle(rt, recv_records, x.shape[0], cfg)
    return h, handle


def moe_gemm_combine(
    h: torch.Tensor,  # [R, N]
    w2: torch.Tensor,  # [E_local, N, H2]
    handle: MoeHandle,
    *,
    config: MoeConfig | dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T, H2] = moe_combine(h[rows of e] @ w2[e], handle). Fused: each GEMM
    tile, weighted, is stored straight into its tokens' home ranks."""
    op = "moe_gemm_combine"
    refuse_grad(op, h, w2)
    _check_rows(op, "h", h, handle)
    lay = handle._route.layout

    def config_of_call() -> MoeConfig:
        _check_weights(op, "w2", w2, lay.e_local, h.shape[1], h)
        cfg = (
            _config(config, lay.hidden, lay.e_local * lay.world, lay.world, h.dtype)
            if config is not None
            else handle._config
        )
        check_tiles_fit(op, cfg, h.dtype, h.device, store_buffer=cfg.epilogue == "tma")
        return cfg

    plan = _rows_plan(op, handle, config, h, w2, make=config_of_call)
    cfg = _resolved(plan.cfg, handle._route)
    check_out(op, out, (handle.num_tokens, w2.shape[2]), h, h, w2)
    out = (
        out
        if out is not None
        else torch.empty((handle.num_tokens, w2.shape[2]), dtype=h.dtype, device=h.device)
    )
    return _gemm_combine(op, h, w2, handle, cfg, out, plan.word)


def _gemm_combine(
    op: str, h, w2, handle: MoeHandle, cfg: MoeConfig, out, word: int
) -> torch.Tensor:
    if cfg.path == "unfused":
        y = grouped_gemm(h, w2, handle.expert_counts, cfg)
        return combine_partials(op, handle, y, out, cfg, word)
    return gemm_push_combine(op, handle, h, w2, out, cfg, word)


def moe_mlp(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,  # [E_local, H, 2F]
    w_down: torch.Tensor,  # [E_local, F, H]
    group: dist.ProcessGroup | None = None,
    *,
    num_experts: int,
    config: MoeConfig | dict | None = None,
    max_tokens_per_rank: int | None = None,
    max_topk: int | None = None,
) -> torch.Tensor:
    """The expert-parallel MoE layer: dispatch -> gate/up GEMM -> silu(gate) * up
    -> down GEMM -> combine, with the fused steps where config.path says.

    ``max_tokens_per_rank`` (the most tokens any rank passes per call, the same on
    every rank): the layer runs the graph mode instead (moe_dispatch_graph and
    moe_combine_graph around torch._grouped_mm, whose errors name them), which
    never waits for the device on the host where torch._grouped_mm runs (bf16 on
    sm_90+): a CUDA graph holds the whole layer, and at decode sizes, where the
    host-sized layer's count read is most of its time, it is the faster eager
    layer too (docs/performance.md, MoE). ``max_topk``: the
    most slots per token any rank passes (default this call's k, which every rank
    must then pass alike). config.path must stay "auto" and max_recv_tokens unset."""
    op = "moe_mlp"
    # Every input is checked before the dispatch moves anything.
    refuse_grad(op, x, topk_weights, w_gate_up, w_down)
    plan = _token_plan(op, x, topk_ids, topk_weights, group, num_experts, config,
                       w_gate_up=w_gate_up, w_down=w_down)  # fmt: skip
    if max_tokens_per_rank is not None:
        require(plan.cfg.path == "auto", op, f"config path '{plan.cfg.path}' is not taken with "
                "max_tokens_per_rank, which runs the graph mode: leave path 'auto'")  # fmt: skip
        require(plan.cfg.max_recv_tokens is None, op, "config max_recv_tokens bounds the host-sized "
                "layer; with max_tokens_per_rank a rank receives at most world * "
                "max_tokens_per_rank * max_topk rows: leave it unset")  # fmt: skip
        from .moe_graph import graph_mlp  # (moe_graph builds on this module)

        return graph_mlp(op, x, topk_ids, topk_weights, w_gate_up, w_down, group,
                         num_experts=num_experts, max_tokens_per_rank=max_tokens_per_rank,
                         max_topk=topk_ids.shape[1] if max_topk is None else max_topk, cfg=plan.cfg)  # fmt: skip
    h, handle = _dispatch_gemm(op, x, topk_ids, topk_weights, w_gate_up, plan, num_experts)
    act = silu_mul(h)  # gate and up, each already rounded to h's dtype by the GEMM
    out = torch.empty((x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    # (the path the dispatch took)
    return _gemm_combine(op, act, w_down, handle, handle._config, out, plan.word)


def _check_rows(op: str, name: str, t, handle) -> None:
    require(
        isinstance(handle, MoeHandle), op, "handle must be the MoeHandle of a moe_dispatch call"
    )
    require(isinstance(t, torch.Tensor) and t.dim() == 2, op, f"{name} must be a 2-D tensor [R, N]")
    rows = sum(handle.expert_counts)
    require(
        t.shape[0] == rows, op, f"{name} has {t.shape[0]} rows but the dispatch delivered {rows}"
    )
    require(
        t.dtype in SUPPORTED_DTYPES,
        op,
        f"{name} has dtype {t.dtype}; supported: bfloat16, float16, float32",
    )
    require(
        t.device == handle.recv_weights.device,
        op,
        f"{name} is on {t.device}, the dispatch ran on {handle.recv_weights.device}",
    )
    require(is_row_major(t), op, f"{name} must be contiguous: pass {name}.contiguous()")


def _rows_plan(op: str, handle: MoeHandle, config, rows: torch.Tensor, *weights,
               make=None) -> _MoePlan:  # fmt: skip
    """The plan of a call that brings rows home (moe_combine, moe_gemm_combine):
    its signature is the rows' width, dtype and device, the weights and the
    config, agreed on across the group once (each home reads its owners'
    rows by that layout). ``make()``: the config, checking what it needs."""
    ws = handle._route.ws

    def made() -> _MoePlan:
        return _MoePlan(ws.group, make() if make is not None else handle._config)

    lay = handle._route.layout  # (what the dispatch decided: the weights' checks read it)
    key = _signature(op, ws.group, config if config is not None else handle._config, (rows,), weights,
                     fixed=(lay.e_local, lay.world, lay.hidden))  # fmt: skip
    tensors = {"rows": rows, **{f"w{i + 2}": w for i, w in enumerate(weights)}}
    return plan_for(op, key, made, _shared(tensors))
