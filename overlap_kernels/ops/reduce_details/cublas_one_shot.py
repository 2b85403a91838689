"""gemm_ar's one_shot path with ``one_shot_gemm = "cublas"`` (decode sizes).

Three launches, no flags per tile:

    1. torch.matmul writes this rank's partial [M, N] into its symmetric memory
       (this call's buffer half);
    2. one one-program kernel announces it to every rank and waits for all
       their announcements (kernels/transfer.py: ``announce_and_wait``);
    3. every rank sums all ranks' partials where they lie, read over NVLink,
       into ``out`` (kernels/gather_sum.py).

At decode sizes the GEMM is a read of the weight at memory speed, which cuBLAS
does best; what the plain pair loses is NCCL's all-reduce latency, and that is
what steps 2 and 3 replace.

Numerics: as the Triton one_shot. Every rank sums the same rounded partials in
rank order, in fp32, rounded once, so every rank gets the same bits.

Buffer halves alternate between calls (runtime/workspace.py ``half_offset``):
a rank overwrites a half two calls later, after every peer has announced the
call in between, which each peer does only after its sum of this call ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...kernels.gather_sum import gather_sum
from ...kernels.transfer import announce_and_wait
from ...runtime.signals import wait_budget
from ...runtime.workspace import DATA_OFFSET, Workspace, get_workspace
from .plan import align_bytes


@dataclass(frozen=True)
class SumPlan:
    partial: torch.Tensor  # [M, N]: this rank's partial, in this call's buffer half
    rows: torch.Tensor  # int64 [M, world]: row i of every rank's partial, for gather_sum
    bases: torch.Tensor  # int64 [world]: where each rank's partial starts
    # "announce" / "sum" -> the Relaunch of that step (kernels/relaunch.py): at
    # decode sizes Triton's per-launch host work would be most of a call's time.
    relaunches: dict = field(default_factory=dict, compare=False)


def one_shot_by_cublas(op: str, x: torch.Tensor, w: torch.Tensor, group, cfg, out: torch.Tensor) -> None:
    """``out`` = the sum over ranks of ``x @ w``, by the three steps above."""
    ws = get_workspace(group, x.device)
    m, n = x.shape[0], w.shape[1]
    epoch = ws.begin(op, 2 * align_bytes(m * n * x.element_size()), cfg.timeout_s)  # a partial per half
    half = ws.half_offset(epoch)
    budget = wait_budget(cfg.timeout_s)
    key = (op, "one_shot cublas", m, n, x.dtype, x.stride(), w.stride(), out.data_ptr() % 16, budget, half)
    plan = ws.cache.get(key)
    if plan is None:
        plan = ws.cache[key] = _plan(ws, m, n, x.dtype, half)
        _load_modules(ws, plan, x, w, out, budget)
    torch.matmul(x, w, out=plan.partial)
    announce, add_up = plan.relaunches.get("announce"), plan.relaunches.get("sum")
    if announce is None or not announce(epoch=epoch):
        plan.relaunches["announce"] = announce_and_wait(ws, epoch, budget, relaunchable=True)
    if add_up is None or not add_up(out_ptr=out):
        plan.relaunches["sum"] = gather_sum(plan.rows, plan.bases, n * x.element_size(), out, x.dtype, relaunchable=True)
    ws.finish()


def _plan(ws: Workspace, m: int, n: int, dtype: torch.dtype, half: int) -> SumPlan:
    rows = torch.arange(m, dtype=torch.int64, device=ws.device)[:, None].expand(m, ws.world).contiguous()
    bases = [address + DATA_OFFSET + half for address in ws.buffer.peer_addresses]
    return SumPlan(
        partial=ws.data(ws.rank, half, (m, n), dtype),
        rows=rows,
        bases=torch.tensor(bases, dtype=torch.int64, device=ws.device),
    )


def _load_modules(ws: Workspace, plan: SumPlan, x, w, out, budget: int) -> None:
    """Load cuBLAS's kernels and ours for this shape before the first call waits
    on a peer (a module load waits for the device's running kernels, and one of
    them may be a wait that only a peer's loaded kernel would end). Nothing here
    touches what a peer reads: this half's partial is rewritten by the call.
    The call's own budget: an i32 and an i64 argument are different variants."""
    if x.device.type != "cuda":
        return
    torch.matmul(x, w, out=plan.partial)
    announce_and_wait(ws, epoch=0, budget=budget)  # flags are >= 0: sets nothing, returns at once
    own = torch.full_like(plan.bases, plan.partial.data_ptr())
    gather_sum(plan.rows, own, w.shape[1] * x.element_size(), out, x.dtype)
    torch.cuda.synchronize(x.device)
