"""all_reduce and all_reduce_rmsnorm: a one-shot all-reduce over peer memory,
alone or with a decoder layer's residual add and RMSNorm fused after it.

Problem
    Each rank holds x [M, N]. ``all_reduce(x)`` returns the sum over ranks.
    ``all_reduce_rmsnorm(x, residual, norm_weight, eps)`` returns
    ``(normed, residual_out)`` with ``residual_out = residual + sum_r x_r`` and
    ``normed = rmsnorm(residual_out) * norm_weight``: what a tensor-parallel
    decoder layer does after its o_proj and down_proj (vLLM's
    ``fused_add_rms_norm`` after its all-reduce). ``residual`` may be None
    (``residual_out`` is then the sum).

Algorithm (kernels/all_reduce.py), by config ``path``:
    ``one_shot``: one launch. Every program pushes its blocks of x into every
        peer's slot for this rank and signals each; then sums, for the rows it
        owns, every rank's partial as they land (in rank order, in fp32), adds
        the residual and normalises. A call costs a launch, one NVLink write and
        one flag round trip: what decode sizes (8 KiB - a few MiB) need. Every
        rank sends (world - 1) copies of x, so large tensors go to NCCL instead.
    ``sequential``: the NCCL (gloo on CPU) all-reduce, then the residual add and
        RMSNorm in one local launch of the same kernel.
    ``auto``: one_shot up to ``one_shot_max_bytes`` of x, else sequential. At one
        rank there is nothing to reduce: the local launch alone.

Numerics
    Partials are summed in fp32 in rank order, so every rank returns the same
    bits. ``residual_out`` is the sum plus the residual, rounded once to x's
    dtype; the RMSNorm's statistics are taken in fp32 from that rounded
    ``residual_out`` (so ``normed`` is what an unfused rms_norm of the returned
    ``residual_out`` gives, up to its own rounding), and ``normed`` is rounded once.

Signal contract
    runtime/signals.py; the flags in kernels/all_reduce.py. Waits are bounded by
    ``config.timeout_s`` (OverlapTimeoutError). A call replays in CUDA graphs after
    an eager call of its signature (ops/replay.py): one launch, no entry barrier.

Example (``torchrun --nproc-per-node 4 example.py``)::

    import torch, torch.distributed as dist
    from overlap_kernels import all_reduce_rmsnorm
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    x = torch.randn(32, 8192, device="cuda", dtype=torch.bfloat16)  # this rank's o_proj partial
    residual = torch.randn(32, 8192, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(8192, device="cuda", dtype=torch.bfloat16)
    normed, residual = all_reduce_rmsnorm(x, residual, weight, 1e-5)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton

from ..kernels.all_reduce import all_reduce_kernel
from ..kernels.gemm import interpreted_bf16
from ..kernels.relaunch import launch
from ..limits import DATA_OFFSET, DEFAULT_TIMEOUT_S, LOCAL_FLAGS, writer_flags
from ..runtime.collectives import collective
from ..runtime.platform import FAST_SIGNALS, INTERPRETER, num_sms
from ..runtime.signals import wait_budget
from ..runtime.workspace import Workspace, get_workspace
from ..tuning import build_config
from .checks import (
    SUPPORTED_DTYPES,
    check_current_cuda,
    check_group,
    check_out,
    new_out,
    refuse_grad,
    require,
)
from .paths import capturing, say_plain_while_capturing
from .plans import described, plan_for, shared_config, signature
from .replay import REPLAY_MAX_BYTES, ReplayState

OP, NORM_OP = "all_reduce", "all_reduce_rmsnorm"
PATHS = ("auto", "one_shot", "sequential")
# Elements of a block a program moves and sums at once: 8 KiB of bf16, 32
# values per thread of 4 warps (a larger tile spills the fp32 sums).
BLOCK_ELEMS = 4096


@dataclass(frozen=True)
class AllReduceConfig:
    """Every knob of all_reduce and all_reduce_rmsnorm; templates/all_reduce.toml
    explains each value."""

    path: str = "auto"
    one_shot_max_bytes: int = 8 << 20  # "auto" takes one_shot up to this many bytes of x
    block_cols: int = 2048  # columns of a block (a power of two; at most N rounded up)
    programs: int = 0  # programs of a launch, at most one per SM (0: one per block)
    num_warps: int = 4
    timeout_s: float = DEFAULT_TIMEOUT_S

    def validate(self) -> AllReduceConfig:
        require(self.path in PATHS, OP,
                f"config: path must be one of {', '.join(PATHS)}, got '{self.path}'")  # fmt: skip
        require(self.one_shot_max_bytes >= 0, OP,
                f"config: one_shot_max_bytes must be >= 0, got {self.one_shot_max_bytes}")  # fmt: skip
        cols = self.block_cols
        require(cols >= 16 and cols & (cols - 1) == 0, OP,
                f"config: block_cols must be a power of two >= 16, got {cols}")  # fmt: skip
        require(self.programs >= 0, OP, f"config: programs must be >= 0, got {self.programs}")
        require(self.num_warps in (1, 2, 4, 8, 16), OP,
                f"config: num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")  # fmt: skip
        require(self.timeout_s > 0, OP, f"config: timeout_s must be > 0, got {self.timeout_s}")
        return self


def all_reduce(
    x: torch.Tensor,  # [M, N]
    group: dist.ProcessGroup | None = None,
    *,
    config: AllReduceConfig | dict | None = None,
    out: torch.Tensor | None = None,  # [M, N]
) -> torch.Tensor:
    """The sum over the ranks of ``group`` of every rank's ``x``, the same bits on
    every rank. Every rank calls it with the same shape, dtype and config."""
    refuse_grad(OP, x)
    key = signature(OP, x, x, group, config)
    plan = plan_for(OP, key, lambda: AllReducePlan(OP, x, None, None, 0.0, group, config),
                    _shared)  # fmt: skip
    return plan(x, None, None, out, None)[0]


def all_reduce_rmsnorm(
    x: torch.Tensor,  # [M, N]
    residual: torch.Tensor | None,  # [M, N]
    norm_weight: torch.Tensor,  # [N]
    eps: float = 1e-6,
    group: dist.ProcessGroup | None = None,
    *,
    config: AllReduceConfig | dict | None = None,
    out: torch.Tensor | None = None,  # [M, N]: normed
    residual_out: torch.Tensor | None = None,  # [M, N]; may be ``residual`` itself
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, residual_out)``: ``residual_out = residual + sum_r x_r`` (the sum
    alone where ``residual`` is None), ``normed = rmsnorm(residual_out, eps) *
    norm_weight``, the same bits on every rank."""
    refuse_grad(NORM_OP, x, residual, norm_weight)
    flags = _norm_flags(residual, norm_weight, eps)
    key = signature(NORM_OP, x, norm_weight, group, config, *flags)
    plan = plan_for(NORM_OP, key,
                    lambda: AllReducePlan(NORM_OP, x, residual, norm_weight, eps, group, config),
                    _shared)  # fmt: skip
    return plan(x, residual, norm_weight, out, residual_out)


def _norm_flags(residual, norm_weight, eps) -> tuple:
    """What of a norm call besides x and the weight its plan depends on (and checks:
    a cached plan's call checks only its outputs)."""
    described = None
    if isinstance(residual, torch.Tensor):
        described = (residual.shape, residual.stride(), residual.dtype, residual.device)
    return (residual is not None, described, eps)


def _shared(key: tuple, plan: AllReducePlan) -> dict[str, str]:
    """What the ranks must share: x's shape and dtype, the weight's, eps and the
    config (residual strides may differ; ranks without a residual differ from
    ranks with one, which the flags say)."""
    _, _, x_shape, _, x_dtype, _, w_shape, _, w_dtype, _, _, *flags = key
    shared = {"x": described(x_shape, x_dtype), "config": shared_config(plan.cfg)}
    if plan.norm:
        has_residual, _, eps = flags
        shared.update(weight=described(w_shape, w_dtype), residual=str(has_residual), eps=repr(eps))
    return shared


def check_norm_operands(op: str, x: object, residual: object, norm_weight: object, eps: object):
    """x [M, N] with unit column stride; residual None or like x; norm_weight [N]; eps > 0."""
    require(isinstance(x, torch.Tensor), op, f"x must be a torch.Tensor, got {type(x).__name__}")
    require(x.dim() == 2, op, f"x must be 2-D [M, N], got shape {tuple(x.shape)}")
    require(x.dtype in SUPPORTED_DTYPES, op,
            f"x has dtype {x.dtype}; supported: bfloat16, float16, float32")  # fmt: skip
    require(x.device.type in ("cuda", "cpu", "meta"), op,
            f"x is on {x.device}: CUDA or CPU tensors only")  # fmt: skip
    require(x.stride(1) == 1 or x.shape[1] <= 1, op,
            "x's rows must be contiguous (x.stride(1) == 1): pass x.contiguous()")  # fmt: skip
    if norm_weight is None:
        return
    if residual is not None:
        require(isinstance(residual, torch.Tensor), op,
                f"residual must be a torch.Tensor or None, got {type(residual).__name__}")  # fmt: skip
        require(tuple(residual.shape) == tuple(x.shape), op,
                f"residual has shape {tuple(residual.shape)}, expected x's {tuple(x.shape)}")  # fmt: skip
        require(residual.dtype == x.dtype, op,
                f"residual is {residual.dtype} but x is {x.dtype}; cast one of them")  # fmt: skip
        require(residual.device == x.device or x.is_meta, op,
                f"residual is on {residual.device}, expected {x.device}")  # fmt: skip
        require(residual.stride(1) == 1 or x.shape[1] <= 1, op,
                "residual's rows must be contiguous: pass residual.contiguous()")  # fmt: skip
    require(isinstance(norm_weight, torch.Tensor), op,
            f"norm_weight must be a torch.Tensor, got {type(norm_weight).__name__}")  # fmt: skip
    require(tuple(norm_weight.shape) == (x.shape[1],), op,
            f"norm_weight has shape {tuple(norm_weight.shape)}, expected [N] = [{x.shape[1]}]")  # fmt: skip
    require(norm_weight.dtype in SUPPORTED_DTYPES, op,
            f"norm_weight has dtype {norm_weight.dtype}; supported: bfloat16, float16, float32")  # fmt: skip
    require(norm_weight.device == x.device or x.is_meta, op,
            f"norm_weight is on {norm_weight.device}, expected {x.device}")  # fmt: skip
    require(norm_weight.stride(0) == 1 or x.shape[1] <= 1, op,
            "norm_weight must be contiguous: pass norm_weight.contiguous()")  # fmt: skip
    require(isinstance(eps, (int, float)) and eps > 0, op, f"eps must be a number > 0, got {eps!r}")


def block_shape(m: int, n: int, world: int, cfg: AllReduceConfig) -> tuple[int, int]:
    """(rows, columns) of a block: BLOCK_ELEMS values, at most ``cfg.block_cols``
    columns and M's rows; rows doubled until every block has a flag of its own
    in each writer's range (limits.writer_flags)."""
    cols = min(cfg.block_cols, triton.next_power_of_2(max(n, 1)))
    rows = max(1, min(BLOCK_ELEMS // cols, triton.next_power_of_2(max(m, 1))))
    while -(-m // rows) * -(-n // cols) > writer_flags(world):
        rows *= 2
    return rows, cols


class AllReducePlan:
    """What a call of one signature runs (ops/plans.py): its checks, config and
    path, and the launches of its one-shot kernel, eager and replayed."""

    def __init__(self, op, x, residual, norm_weight, eps, group, config, *, device=None):
        """``x``: the operand reduced (a meta tensor of its shape where ``device``,
        the call's, is given: gemm_ar_rmsnorm's product)."""
        self.op, self.norm = op, norm_weight is not None
        check_norm_operands(op, x, residual, norm_weight, eps)
        if not self.norm:
            require(x.stride(0) == x.shape[1] or x.shape[0] <= 1, op,
                    "x must be contiguous (row-major): pass x.contiguous()")  # fmt: skip
        device = device or x.device
        self.group = check_group(op, group, device)
        world = self.world = dist.get_world_size(self.group)
        m, n = x.shape
        nbytes = m * n * x.element_size()
        shape = {"world": world, "m": m, "n": n, "dtype": str(x.dtype).removeprefix("torch.")}
        cfg = build_config(AllReduceConfig, "all_reduce", shape, config, device=device)
        path = cfg.path
        if path == "auto":
            path = "one_shot" if 0 < nbytes <= cfg.one_shot_max_bytes else "sequential"
        if world == 1 or m * n == 0:
            path = "sequential"  # (nothing to reduce: the local step alone)
        self.cfg = dataclasses.replace(cfg, path=path)
        self.out_shape = (m, n)
        self.eps, self.has_residual = float(eps), residual is not None
        self.block = block_shape(m, n, world, cfg)
        blocks = -(-m // self.block[0]) * -(-n // self.block[1])
        programs = min(blocks, cfg.programs or num_sms(device), num_sms(device))
        # (Triton's interpreter runs programs one after another: kernels/all_reduce.py.)
        self.programs = 1 if INTERPRETER else max(1, programs)
        self.slot_bytes = -(-nbytes // 256) * 256  # (kernels/all_reduce.py: vector moves)
        self.slots_bytes = world * self.slot_bytes  # one buffer half
        self.budget = wait_budget(cfg.timeout_s)
        self.ws: Workspace | None = None
        self.eager: _Launches | None = None
        self.local: _Launches | None = None  # the norm alone, after a collective or at one rank
        self.replay_state: ReplayState | None = None
        self.word = 0  # the signature word (plans.plan_for sets it)

    # ---- a call ---------------------------------------------------------------
    def __call__(self, x, residual, weight, out, residual_out):
        check_out(self.op, out, self.out_shape, x, x, *([residual] if residual is not None else []))
        if residual_out is not None and residual_out is not residual:
            check_out(self.op, residual_out, self.out_shape, x, x,
                      *(t for t in (residual, out) if t is not None))  # fmt: skip
        device = x.device
        if device.type == "cuda":
            check_current_cuda(self.op, device)
        out = out if out is not None else new_out(self.out_shape, x)
        if self.norm and residual_out is None:
            residual_out = new_out(self.out_shape, x)
        summed = residual_out if self.norm else out
        if self.cfg.path == "sequential" or min(self.out_shape) == 0:
            return self._plain(x, residual, weight, out, residual_out)
        if capturing(device):
            if self.replay_state is None or not self.replay_state.current():
                say_plain_while_capturing(self.op)
                return self._plain(x, residual, weight, out, residual_out)
            state = self.replay_state
            state.plan.run(self, state.epoch, x, residual, weight, summed, out, state.half_bytes)
            return out, residual_out
        if self.ws is None:
            self.ws = get_workspace(self.group, device, self.op, self.cfg.timeout_s)
        ws = self.ws
        epoch = ws.begin(self.op, 2 * self.slots_bytes, self.cfg.timeout_s, capture_checked=True)
        if self.eager is None or self.eager.ws is not ws or self.eager.buffer is not ws.buffer:
            self.eager = _Launches(ws)
        self.eager.run(self, epoch, x, residual, weight, summed, out, ws.half_offset(1))
        ws.finish()
        if self.replay_state is None and device.type == "cuda":
            self.prepare_replay()
        return out, residual_out

    def prepare_replay(self) -> None:
        """After an eager call (every rank makes it): what a capture of this plan
        runs, in the group's replay workspace (ops/replay.py), where it fits."""
        if self.slots_bytes <= REPLAY_MAX_BYTES:
            self.replay_state = ReplayState.prepare(
                self.ws, self.op, self.slots_bytes, self.cfg.timeout_s, self.budget,
                lambda replay_ws, offset: _Launches(replay_ws), one_launch=True,
            )  # fmt: skip

    def _plain(self, x, residual, weight, out, residual_out):
        """The collective (none at one rank), then, for the norm, the local launch."""
        if self.world == 1 or min(self.out_shape) == 0:
            if not self.norm:
                return out.copy_(x), None
            partial = x
        else:
            # Reduced in ``out``: the norm reads a row block whole before it writes
            # its normed rows there, and ``residual_out`` may be the residual it reads.
            partial = out.copy_(x)
            collective(self.op, "all-reduce", dist.all_reduce, partial, group=self.group,
                       timeout_s=self.cfg.timeout_s)  # fmt: skip
            if not self.norm:
                return out, None
        if min(self.out_shape) == 0:
            return out, residual_out
        if self.local is None:
            self.local = _Launches(None)
        self.local.run(self, 1, partial, residual, weight, residual_out, out, 0)
        return out, residual_out


class _Launches:
    """The kernel's launches in one workspace (None: the local launch, which
    pushes to and waits for no peer), its arguments bound once and relaunched
    (kernels/relaunch.py)."""

    def __init__(self, ws: Workspace | None):
        self.ws, self.buffer = ws, ws.buffer if ws is not None else None
        self.done: torch.Tensor | None = None  # the kernel's count of finished programs
        self.again = None

    def run(self, plan: AllReducePlan, epoch: int, x, residual, weight, summed, normed, half_bytes):
        """One launch into ``summed`` (the sum, or residual_out) and ``normed``."""
        changed = {"x_ptr": x, "out_ptr": summed, "epoch": epoch}
        if plan.norm:
            changed.update(normed_ptr=normed, weight_ptr=weight)
            if residual is not None:
                changed["residual_ptr"] = residual
        if self.again is not None and self.again(None, **changed):
            return
        device, ws = x.device, self.ws
        if self.done is None:
            self.done = torch.zeros(1, dtype=torch.int32, device=device)
        if ws is None:  # (kept: the relaunch passes their addresses; the kernel reads the flags)
            self.local_peers = torch.zeros(1, dtype=torch.int64, device=device)
            self.local_flags = torch.zeros(LOCAL_FLAGS, dtype=torch.int32, device=device)
            peers, rank, world, flags, err = self.local_peers, 0, 1, self.local_flags, 0
        else:
            peers, rank, world, flags = ws.peer_table, ws.rank, ws.world, ws.chunk_flags
            err = ws.error_address
        programs = plan.programs  # (the local launch waits for nobody: any grid would do)
        m, n = plan.out_shape
        res = residual if residual is not None else x
        norm_out = normed if plan.norm else summed
        args = [
            x, x.stride(0), summed, summed.stride(0), m, n,
            res, res.stride(0), norm_out, norm_out.stride(0), weight if plan.norm else x, plan.eps,
            programs, peers, rank, world, DATA_OFFSET, plan.slot_bytes, half_bytes, flags, LOCAL_FLAGS,
            writer_flags(world), self.done, epoch, err, plan.budget, plan.word,
        ]  # fmt: skip
        kwargs = {"BLOCK_ROWS": plan.block[0], "BLOCK_COLS": plan.block[1], "NORM": plan.norm,
                  "RESIDUAL": residual is not None, "INTERPRETED_BF16": interpreted_bf16(x.dtype),
                  "FAST_SIGNALS": FAST_SIGNALS, "num_warps": plan.cfg.num_warps}  # fmt: skip
        if ws is not None and device.type == "cuda" and not capturing(device):
            # Load the module with no rows to move before the call's launch, which peers
            # wait for: a module load waits for the kernels running on the device, and
            # ranks sharing a GPU would wait on each other's (kernels/gemm.py _load).
            idle = list(args)
            idle[all_reduce_kernel.arg_names.index("M")] = 0
            all_reduce_kernel[(programs,)](*idle, **kwargs)
            torch.cuda.synchronize(device)
        self.again = launch(all_reduce_kernel, (programs,), tuple(args), kwargs, device)


__all__ = ["AllReduceConfig", "all_reduce", "all_reduce_rmsnorm"]
