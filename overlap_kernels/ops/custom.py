"""FusedOp: a user's own Triton kernel plus a chunk schedule, as a fused multi-GPU op.

Problem
    A user's kernel computes an [M, N] output tile by tile and must overlap a
    collective with it: an all-gather of its input rows in front (kind
    ``"gather"``: x_local [M_local, K] on each rank, the kernel reads the
    gathered [M_local * world, K]), or a reduce-scatter of its output behind
    (kind ``"reduce"``: every rank computes partials of all M rows, rank r
    returns its rows [r * M // world, (r + 1) * M // world) of the sum).

Algorithm
    The user's kernel walks its tiles with overlap_kernels.language (the
    device API) in the schedule's order. Gather: x is published into this
    rank's rows of a gathered buffer in symmetric memory, peers' rows come by
    the schedule's chunks (copy engine or SM pulls: ag_gemm's transfer steps,
    ops/ag_gemm_details/transfer.py), and each tile waits for its chunk. Reduce
    (a producer schedule, schedules/producers.py, mechanism ``push``): the
    kernel puts each tile of a peer's rows into the owner's slot and signals
    it, then sums its own rows' partials as they arrive (gemm_rs's layout,
    ops/reduce_details/plan.py). Checks, agreement and the signature word once
    per call signature (ops/plans.py); deadlines, OverlapTimeoutError and
    OverlapMismatchError as our ops have them; CUDA graph replay after an eager
    call of the signature (ops/replay.py: a reduce op is one launch, a gather
    op enters first).

Signal contract
    runtime/signals.py, behind overlap_kernels.language; the kernel never sees
    an epoch, a word or a flag slot.

Example (docs/writing_fused_ops.md walks through it; examples/ has three)::

    def launch(run, x, w):  # run: this call's Run; x, w: the call's arguments
        run.launch(my_kernel, run.gathered, w, run.out, w.shape[1], x.shape[1], run.ctx,
                   BLOCK_M=run.block_m, BLOCK_N=run.block_n, BLOCK_K=32)

    op = FusedOp("my_ag_gemm", launch, kind="gather")
    out = op(x, w, n=w.shape[1])  # [M_local * world, N] on every rank
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..limits import DEFAULT_TIMEOUT_S
from ..schedules import ChunkSchedule
from .checks import check_group, check_matrix, is_row_major, require
from .custom_details.gather import GatherPlan
from .custom_details.reduce import ReducePlan
from .custom_details.run import Run
from .plans import described, plan_for, shared_config

GATHER, REDUCE = "gather", "reduce"
KINDS = (GATHER, REDUCE)


@dataclass(frozen=True)
class FusedConfig:
    """The knobs of a FusedOp; the op's ``config`` sets its defaults, a call's overrides them."""

    block_m: int = 64  # rows of a tile: the tile table's, and what run.block_m tells the kernel
    block_n: int = 64  # columns of a tile
    group_m: int = 8  # row blocks (of one chunk) that share one sweep over N (L2 reuse)
    comm_sms: int = 1  # gather: SMs the kernel's grid leaves to SM pulls and the announcement
    programs: int = 0  # the kernel's grid (0: one program per SM left, at most one per tile)
    timeout_s: float = DEFAULT_TIMEOUT_S
    # Read by the reduce plan (reduce_details/plan.py): every tile is the user's kernel's.
    producer: str = "triton"

    def validate(self, op: str) -> FusedConfig:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            require(value >= 16 and value & (value - 1) == 0, op,
                    f"config: {name} must be a power of two >= 16, got {value}")  # fmt: skip
        require(self.group_m >= 1, op, f"config: group_m must be >= 1, got {self.group_m}")
        require(self.comm_sms >= 1, op, f"config: comm_sms must be >= 1 (the announcement of "
                f"gathered rows runs on an SM beside the kernel), got {self.comm_sms}")  # fmt: skip
        require(self.programs >= 0, op, f"config: programs must be >= 0, got {self.programs}")
        require(self.timeout_s > 0, op, f"config: timeout_s must be > 0, got {self.timeout_s}")
        require(self.producer == "triton", op, "config: producer is 'triton' (the op's own kernel)")
        return self


def _merged(op: str, base: FusedConfig, config: FusedConfig | dict | None) -> FusedConfig:
    if config is None:
        return base
    if isinstance(config, FusedConfig):
        return config.validate(op)
    require(isinstance(config, dict), op,
            f"config must be a FusedConfig or a dict of its fields, got {type(config).__name__}")  # fmt: skip
    fields = {f.name for f in dataclasses.fields(FusedConfig)}
    require(set(config) <= fields, op,
            f"unknown FusedConfig field(s) {sorted(set(config) - fields)}; fields are {sorted(fields)}")  # fmt: skip
    return dataclasses.replace(base, **config).validate(op)


class FusedOp:
    """A user's kernel and a schedule as a fused op (module docstring).

    ``launch(run, x, *operands)`` enqueues the kernel with ``run.launch``
    (:class:`Run`), passing ``run.ctx`` as its context argument. ``kind`` is
    ``"gather"`` or ``"reduce"``; ``config`` sets the op's FusedConfig
    defaults; ``own_rows`` lists the operands (by position) that hold this
    rank's rows of the output, such as a residual: their first dimension is
    the output's rows, which may differ between ranks (uneven M).

    Call the op as ``op(x, *operands, n=N, group=None, schedule=None,
    config=None, out=None)``: x is the gathered rows (gather: this rank's
    [M_local, K]) or the rows of the product (reduce: [M, *]); the output is
    [M_local * world, N] (gather) or this rank's rows of the sum [r * M //
    world : (r + 1) * M // world, N] (reduce), in x's dtype. Every rank calls
    it with the same shapes (own_rows aside), dtypes, n, schedule and config.
    Operands go to ``launch`` as they are: tensors (keyed by shape, strides,
    dtype and device) or hashable values. Records no gradient."""

    def __init__(self, name: str, launch: Callable[..., None], *, kind: str,
                 config: FusedConfig | dict | None = None, own_rows: tuple[int, ...] = ()):  # fmt: skip
        require(kind in KINDS, name, f"kind must be 'gather' or 'reduce', got {kind!r}")
        require(callable(launch), name, "launch must be a function launch(run, x, *operands)")
        self.name, self.launch, self.kind, self.own_rows = name, launch, kind, tuple(own_rows)
        self.config = _merged(name, FusedConfig(), config)

    def __call__(self, x: torch.Tensor, *operands: Any, n: int,
                 group: dist.ProcessGroup | None = None, schedule: ChunkSchedule | None = None,
                 config: FusedConfig | dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        op = self.name
        if torch.is_grad_enabled() and any(
            getattr(t, "requires_grad", False) for t in (x, *operands)
        ):
            require(False, op, f"an operand requires grad, and {op} records no gradient: "
                    "call it under torch.no_grad()")  # fmt: skip
        key = self._signature(x, operands, n, group, schedule, config)
        plan = plan_for(op, key, lambda: self._make_plan(x, operands, n, group, schedule, config),
                        self._shared)  # fmt: skip
        return plan(x, operands, out)

    def _signature(self, x, operands, n, group, schedule, config) -> tuple | None:
        """(op, group, this op, x, operands, n, schedule, config): a call's plan key
        (ops/plans.py); None where a part cannot be a key (the plan is then not kept)."""
        if group is None and dist.is_initialized():
            group = dist.group.WORLD
        config_key = tuple(sorted(config.items())) if isinstance(config, dict) else config
        key = (self.name, group, self, _key(x), tuple(_key(v) for v in operands), n, schedule,
               config_key)  # fmt: skip
        try:
            hash(key)
        except TypeError:
            return None
        return key if group is not None and isinstance(x, torch.Tensor) else None

    def _make_plan(self, x, operands, n, group, schedule, config) -> GatherPlan | ReducePlan:
        op = self.name
        check_matrix(op, "x", x)
        require(is_row_major(x), op, "x must be contiguous (row-major): pass x.contiguous()")
        require(
            isinstance(n, int) and n >= 1,
            op,
            f"n (the output's columns) must be an int >= 1, got {n!r}",
        )
        for i, v in enumerate(operands):
            require(i not in self.own_rows or isinstance(v, torch.Tensor), op,
                    f"operand {i} (own_rows) must be a tensor, got {type(v).__name__}")  # fmt: skip
            if isinstance(v, torch.Tensor):
                require(v.device == x.device, op, f"operand {i} is on {v.device}, x on {x.device}")
        group = check_group(op, group, x.device)
        world = dist.get_world_size(group)
        require(schedule is None or isinstance(schedule, ChunkSchedule), op,
                "schedule must be a ChunkSchedule (overlap_kernels.schedules)")  # fmt: skip
        require(schedule is None or schedule.world_size == world, op,
                f"schedule is for {getattr(schedule, 'world_size', None)} ranks, group has {world}")  # fmt: skip
        cfg = _merged(op, self.config, config)
        plan = (GatherPlan if self.kind == GATHER else ReducePlan)(self, x, n, group, schedule, cfg)
        rows = plan.out_shape[0]
        for i in self.own_rows:
            require(i < len(operands) and operands[i].dim() >= 1 and operands[i].shape[0] == rows, op,
                    f"operand {i} holds this rank's rows of the output (own_rows): its first "
                    f"dimension must be {rows}")  # fmt: skip
        return plan

    def _shared(self, key: tuple, plan: GatherPlan | ReducePlan) -> dict[str, str]:
        """What the ranks must share: x's and the operands' shapes (own_rows: but the
        first dimension) and dtypes, or their values; n; the schedule; the resolved
        config (its deadline aside)."""
        _, _, _, x, operands, n, _, _ = key

        def text(i: int, v) -> str:
            if not (isinstance(v, tuple) and v[:1] == ("tensor",)):
                return repr(v)
            shape = ("rows", *v[1][1:]) if i in self.own_rows else v[1]
            return described(shape, v[3])

        return {"x": text(-1, x), "operands": ", ".join(text(i, v) for i, v in enumerate(operands)),
                "n": str(n), "schedule": repr(plan.schedule), "config": shared_config(plan.cfg)}  # fmt: skip


def _key(v: Any) -> Hashable:
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.stride(), v.dtype, v.device)
    return v


__all__ = ["FusedConfig", "FusedOp", "Run"]
