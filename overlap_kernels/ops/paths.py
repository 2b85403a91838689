"""Choosing between an op's fused kernel and its plain path (NCCL + cuBLAS).

Decided from shapes, dtypes, layouts and the config only, never from addresses
or timings, so that every rank of a group decides alike; and from whether the
current stream is capturing a CUDA graph (every rank captures the same calls).
On a group of one rank a GEMM op is the local product alone (:class:`LocalGemm`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .checks import SUPPORTED_DTYPES, GemmKnobs, check_out, require, tma_layout_blocker

if TYPE_CHECKING:
    from .ag_gemm import AgGemmConfig
    from .gemm_rs import GemmRsConfig

_log = logging.getLogger(__name__)


def fused_blocker(
    x: torch.Tensor, w: torch.Tensor, world: int, verb: str, min_rows: int = 1
) -> str | None:
    """Why a fused kernel cannot compute ``x @ w`` over ``world`` ranks (None when it can)."""
    if world == 1:
        return f"one rank: nothing to {verb}"
    if min(x.shape[0], x.shape[1], w.shape[1]) == 0:
        return "an empty dimension"
    if x.shape[0] < min_rows:
        return f"M = {x.shape[0]} < {min_rows} ranks: some rank owns no rows"
    return tma_layout_blocker(x, w)


def caller_set(config: GemmKnobs | dict | None, field: str) -> bool:
    """Whether the caller's ``config`` (a dict of fields, or a whole config) sets ``field``."""
    return config is not None and (not isinstance(config, dict) or field in config)


def fused_or_sequential(
    op: str,
    cfg: AgGemmConfig | GemmRsConfig,
    blocker: str | None,
    flops: float,
    shape: tuple,
    *,
    forced: bool = True,
) -> AgGemmConfig | GemmRsConfig:
    """``cfg`` with ``path`` "auto" resolved: "fused" unless ``blocker`` or fewer
    than ``cfg.min_fused_flops`` FLOP. A "fused" the caller ``forced`` that
    cannot run is an input error; one a tuned table asked for gives way."""
    if cfg.path == "fused" and (blocker is None or forced):
        require(blocker is None, op, f"path='fused' cannot run: {blocker}; use path='auto'")
        return cfg
    if cfg.path == "sequential":
        return cfg
    if blocker is None and cfg.path == "auto" and flops < cfg.min_fused_flops:
        blocker = f"{flops:.3g} FLOP < min_fused_flops {cfg.min_fused_flops:.3g}"
    if blocker is not None:
        _log.info("%s %s: sequential path (%s)", op, shape, blocker)
    return dataclasses.replace(cfg, path="sequential" if blocker else "fused")


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` captures a CUDA graph."""
    return device.type == "cuda" and stream_capturing()


# torch.cuda.is_current_stream_capturing() without its lazy-init check, a third of its
# host time (a caller with a CUDA tensor has CUDA up): torch's C query itself.
stream_capturing = torch._C._cuda_isCurrentStreamCapturing


def say_plain_while_capturing(op: str) -> None:
    """Log why a fused plan runs its plain path while a CUDA graph is captured:
    no eager call of its signature prepared its replay (ops/replay.py), or its
    buffers are larger than a replay workspace holds. NCCL's collectives and
    cuBLAS replay correctly."""
    _log.info("%s: sequential path (a CUDA graph is being captured)", op)


# group id -> (the group, whether it has one rank): a group's size never changes, and
# the entry keeps its group alive, so its id is not reused while the entry stands.
_ONE_RANK: dict[int, tuple[dist.ProcessGroup, bool]] = {}
_PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))


def one_rank(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` (None: the default group) has one rank; False where
    torch.distributed is not initialised (the op's own checks say so)."""
    if group is None:
        group = dist.group.WORLD
        if group is None:
            return False
    entry = _ONE_RANK.get(id(group))
    if entry is None or entry[0] is not group:
        entry = _ONE_RANK[id(group)] = (group, dist.get_world_size(group) == 1)
    return entry[1]


def local_product(
    op: str, group: dist.ProcessGroup | None, x: object, w: object, out: torch.Tensor | None
) -> torch.Tensor | None:
    """``x @ w`` (into ``out`` if given) where ``group`` has one rank: what
    :class:`LocalGemm` returns for a call of a GEMM op with no config or schedule,
    without finding the op's plan by its signature: on one rank that lookup was
    most of what the op cost over torch.matmul (bench/experiments/probe_plain_host.py).
    None on more ranks, and where a check of the op's might refuse the operands or
    torch.mm does: the op's own path then checks them and refuses with its message
    (or makes the LocalGemm plan). The layouts it passes are the op's: x row-major,
    w row-major or a row-major matrix transposed."""
    if not one_rank(group):
        return None
    if not (type(x) in _PLAIN_TENSORS and type(w) in _PLAIN_TENSORS):
        return None
    if (x.requires_grad or w.requires_grad) and torch.is_grad_enabled():
        return None
    try:
        (m, k), (k_w, n) = x.shape, w.shape
        (x_row, x_col), (w_row, w_col) = x.stride(), w.stride()
    except ValueError:  # (not matrices)
        return None
    if x.dtype not in SUPPORTED_DTYPES or k != k_w or not (x_col == 1 and x_row == k):
        return None
    if not (w_col == 1 and w_row == n or w_row == 1 and w_col == k):
        return None
    try:
        if out is None:
            return torch.mm(x, w)
        check_out(op, out, (m, n), x, x, w)
        return torch.mm(x, w, out=out)
    except RuntimeError:  # (dtypes or devices that do not match)
        return None


class LocalGemm:
    """The plan of ag_gemm, gemm_rs or gemm_ar on a group of one rank
    (ops/plans.py): the op is ``x @ w``, since an all-gather, reduce-scatter or
    all-reduce of one rank moves nothing (gemm_rs's "avg" divides by 1). A call
    is torch's product and nothing else: no collective of one rank (NCCL's
    cost as much host time as the product), no gathered buffer or copy, no
    workspace; torch.mm, which torch.matmul calls for two matrices (the same
    bits, one dispatch less). The plan was made by the op's own checks; a call
    checks ``out`` as every plan does."""

    word = 0  # the signature word (plans.plan_for sets it): no signal carries it here

    def __init__(self, op: str, cfg: GemmKnobs, out_shape: tuple[int, int]):
        self.op, self.cfg, self.out_shape = op, cfg, out_shape

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, return_gathered=False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if out is None:
            out = torch.mm(x, w)
        else:
            check_out(self.op, out, self.out_shape, x, x, w)
            torch.mm(x, w, out=out)
        # (ag_gemm's gathered x, a new tensor as on more ranks)
        return (out, x.clone()) if return_gathered else out
