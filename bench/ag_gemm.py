"""Benchmark entry for ``overlap_kernels.ag_gemm``: all_gather(x) @ w.

Per shape (M total, K, N; bf16; x sharded over ranks by rows; weight stored [N, K]
as in nn.Linear and passed as ``w.t()``), in one run and one process group:

    cublas           torch.matmul of the full [M, K] @ [K, N]     (compute alone)
    nccl_all_gather  dist.all_gather_into_tensor of the shards     (communication alone)
    sequential       all_gather, then torch.matmul                 (what overlap must beat)
    torch_fused      torch.ops.symm_mem.fused_all_gather_matmul    (PyTorch async TP)
    ours_local_gemm  overlap_kernels.matmul on the full [M, K]     (our GEMM, no comm)
    ours_local_gemm_whole_tiles  the same with whole tiles only (no split tail)
    ours_local_gemm_tma  the same with the "tma" epilogue (whole blocks stored by TMA)
    ours_fused       ag_gemm with path "fused", gemm "triton" (our GEMM waits on chunk flags)
    ours_fused_tma   the same with the "tma" epilogue
    ours_fused_chunk_groups  the same with group_by_chunk (no tile group spans two chunks)
    ours_fused_push  the same with mechanism "push" (this rank's rows pushed by our GEMM itself)
    ours_fused_sm_copy  the same with peers' rows pulled by 16 SMs (mechanism "sm_copy")
    ours_fused_cublas  ag_gemm with path "fused", gemm "cublas" (torch.matmul per arrived chunk;
                       the template's cublas_streams)
    ours_fused_cublas_one_stream   the same with every chunk's matmul on the caller's stream
    ours_fused_cublas_two_streams  the same with consecutive chunks on two streams
    ours_fused_cublas_in_turn      the template's streams, each chunk's copy on its matmul's
                                   stream just before it (PyTorch's fused op's order)
    ours_auto        ag_gemm with its default config (what it runs, measured where the
                     template says "fastest", is recorded)
    bound            max(cublas, nccl_all_gather): perfect overlap (computed, not run)

Before timing, every variant that produces the product is checked against
``sequential`` (relative Frobenius error, max over ranks).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bench.common import (
    AUTOTUNE_LEGEND,
    DTYPE,
    GEMM_PARTIALS,
    Check,
    check_variants,
    cycled,
    generator,
    input_sets,
    load_ours,
    measure,
    ours_variants,
    parse_shape,
    run_shapes,
    torch_symm_mem_op,
    unavailable,
)
from bench.harness import RunContext, Settings, Variant
from bench.report import Progress, local_goal_line
from bench.report import format_table as _format_table

OP = "ag_gemm"
LARGE_SHAPES: list[tuple[int, int, int]] = [
    (8192, 8192, 7168),
    (16384, 8192, 7168),
    (4096, 8192, 2560),
    (2048, 8192, 7168),
]
# Decode sizes (gathered M <= 512, where the template pushes: templates/ag_gemm.toml).
DECODE_SHAPES: list[tuple[int, int, int]] = [(32, 7168, 8192), (128, 7168, 8192), (512, 7168, 8192)]
DEFAULT_SHAPES = LARGE_SHAPES + DECODE_SHAPES
__all__ = ["DEFAULT_SHAPES", "DTYPE", "OP", "format_table", "parse_shape", "run"]


def torch_fused_op(
    ctx: RunContext,
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None, str]:
    """PyTorch's fused all-gather matmul, or None and the reason it is not available."""
    op, group_name, why = torch_symm_mem_op(ctx, "fused_all_gather_matmul")
    if op is None:
        return None, why

    # return_A=False: like ours, return only the product, not the gathered input.
    def fused(x_local: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return op(x_local, [w], 0, group_name, return_A=False)[1][0]

    return fused, "return_A=False"


@dataclasses.dataclass
class _Inputs:
    x_local: torch.Tensor  # [M/world, K], this rank's shard
    x_full: torch.Tensor  # [M, K], the gathered x (same on every rank)
    w: torch.Tensor  # [K, N], a transposed view of the [N, K] weight
    gathered: torch.Tensor  # [M, K], the all-gather's output buffer


def _make_inputs(m: int, k: int, n: int, ctx: RunContext, seed: int) -> _Inputs:
    gen = generator(ctx, seed)
    x_local = torch.randn(m // ctx.world, k, generator=gen, device=ctx.device, dtype=DTYPE)
    w_nk = torch.randn(n, k, generator=gen, device=ctx.device, dtype=DTYPE)  # nn.Linear layout
    x_full = torch.empty(m, k, device=ctx.device, dtype=DTYPE)
    _all_gather(x_full, x_local, ctx)
    return _Inputs(x_local, x_full, w_nk.t(), torch.empty_like(x_full))


# torch 2.13 renames all_gather_into_tensor (same arguments) and warns on the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather(out: torch.Tensor, x_local: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    if ctx.world == 1:
        return out.copy_(x_local)
    _all_gather_single(out, x_local, group=ctx.group)
    return out


def _variants(
    ctx: RunContext,
    sets: list[_Inputs],
    ref: torch.Tensor,
    ours: dict[str, Any],
    missing: dict[str, str],
) -> tuple[list[Variant], dict[str, Check]]:
    """Each variant as a no-argument call cycling through the input sets, and for each
    variant that yields the product, its check on input set 0 against ``ref``."""
    s0 = sets[0]
    k, partials = s0.w.shape[0], GEMM_PARTIALS  # every check also per element (common.Check)
    checks: dict[str, Check] = {}
    out: list[Variant] = [
        Variant("cublas", cycled(sets, lambda s: torch.matmul(s.x_full, s.w)), whole_op=False),
        Variant(
            "nccl_all_gather",
            cycled(sets, lambda s: _all_gather(s.gathered, s.x_local, ctx)),
            whole_op=False,
        ),
        Variant(
            "sequential",
            cycled(sets, lambda s: torch.matmul(_all_gather(s.gathered, s.x_local, ctx), s.w)),
        ),
    ]
    fused, why = torch_fused_op(ctx)
    if fused is None:
        out.append(unavailable("torch_fused", "skipped", why))
    else:
        out.append(Variant("torch_fused", cycled(sets, lambda s: fused(s.x_local, s.w)), note=why))
        checks["torch_fused"] = Check(lambda: fused(s0.x_local, s0.w), ref, k=k, partials=partials)

    # Our GEMM alone: its default config, whole tiles only, the TMA epilogue.
    for name, config in (
        ("ours_local_gemm", None),
        ("ours_local_gemm_whole_tiles", {"split_tail": False}),
        ("ours_local_gemm_tma", {"epilogue": "tma"}),
    ):
        if "matmul" not in ours:
            out.append(unavailable(name, "error", missing["matmul"], whole_op=False))
            continue
        matmul = ours["matmul"]
        call = functools.partial(matmul, config=config)
        out.append(
            Variant(name, cycled(sets, lambda s, call=call: call(s.x_full, s.w)), whole_op=False)
        )
        checks[name] = Check(lambda call=call: call(s0.x_full, s0.w), ref, k=k, partials=partials)
    mine, my_checks = ours_variants(
        ctx,
        sets,
        ref,
        op="ag_gemm",
        ours=ours,
        missing=missing,
        operands=lambda s: (s.x_local, s.w),
        out_shape=(s0.x_full.shape[0], s0.w.shape[1]),
        k=k,
        partials=partials,
        forced={
            "ours_fused": {"path": "fused", "gemm": "triton"},
            "ours_fused_tma": {"path": "fused", "gemm": "triton", "epilogue": "tma"},
            "ours_fused_chunk_groups": {"path": "fused", "gemm": "triton", "group_by_chunk": True},
            "ours_fused_push": {"path": "fused", "gemm": "triton", "mechanism": "push"},
            "ours_fused_sm_copy": {
                "path": "fused",
                "gemm": "triton",
                "mechanism": "sm_copy",
                "comm_sms": 16,
            },
            "ours_fused_cublas": {"path": "fused", "gemm": "cublas", "mechanism": "copy_engine"},
            "ours_fused_cublas_one_stream": {
                "path": "fused",
                "gemm": "cublas",
                "mechanism": "copy_engine",
                "cublas_streams": 1,
            },
            "ours_fused_cublas_two_streams": {
                "path": "fused",
                "gemm": "cublas",
                "mechanism": "copy_engine",
                "cublas_streams": 2,
            },
            "ours_fused_cublas_in_turn": {
                "path": "fused",
                "gemm": "cublas",
                "mechanism": "copy_engine",
                "cublas_copies": "in_turn",
            },
        },
        describe=lambda cfg: (
            f"path={cfg.path}"
            + (f", gemm={cfg.gemm}, epilogue={cfg.epilogue}" if cfg.path == "fused" else "")
        ),
    )
    return out + mine, {**checks, **my_checks}


def bench_shape(
    shape: tuple[int, int, int],
    ctx: RunContext,
    settings: Settings,
    progress: Progress,
    ours: dict[str, Any],
    missing: dict[str, str],
) -> list[dict[str, Any]]:
    """Rows for one shape: every variant, then the bound."""
    m, k, n = shape
    if m % ctx.world:
        raise ValueError(f"M={m} is not divisible by world size {ctx.world}")
    bytes_per_set = (m // ctx.world + 2 * m + n) * k * DTYPE.itemsize
    sets = input_sets(lambda seed: _make_inputs(m, k, n, ctx, seed), bytes_per_set, ctx)
    s0 = sets[0]
    ref = torch.matmul(_all_gather(s0.gathered, s0.x_local, ctx), s0.w)  # [M, N], sequential
    variants, checks = _variants(ctx, sets, ref, ours, missing)
    check_variants(ctx, variants, checks, settings)
    del ref, checks
    progress.step(f"{OP} {m}x{k}x{n}: checked")
    # Bus bandwidth as nccl-tests report it: (world - 1) / world of the gathered bytes.
    gathered_bytes = m * k * DTYPE.itemsize
    return measure(
        OP,
        {"M": m, "K": k, "N": n},
        variants,
        ctx,
        settings,
        progress,
        flops=2.0 * m * k * n,
        parts=("cublas", "nccl_all_gather"),
        busbw_bytes=(ctx.world - 1) / ctx.world * gathered_bytes,
    )


def run(
    ctx: RunContext, shapes: list[tuple[int, int, int]], settings: Settings
) -> list[dict[str, Any]]:
    """All shapes; progress on rank 0."""
    ours, missing = load_ours(OP, ("ag_gemm", "matmul", "AgGemmConfig", "autotune"))
    return run_shapes(
        OP,
        shapes,
        ctx,
        settings,
        missing,
        lambda shape, progress: bench_shape(shape, ctx, settings, progress, ours, missing),
    )


def format_table(rows: list[dict[str, Any]], world: int | None = None) -> str:
    """The summary table: ours_auto against sequential and torch_fused, and its % of the
    bound; on one rank (``world`` 1) the goal of one rank: torch.matmul's time."""

    def path(r: dict[str, Any]) -> str:
        config = r.get("config") or {}
        taken = str(config.get("path", "?"))
        if taken == "fused" and config.get("gemm") == "cublas":
            return "(c)"
        if taken == "fused" and config.get("mechanism") == "sm_copy":
            return "(f sm)"
        return f"({taken[:1]})"

    table = _format_table(
        rows,
        target="ours_auto",
        baselines=("sequential", "torch_fused", "ours_autotune"),
        target_label=path,
    )
    legend = (
        "ms per call: median over calls, max over ranks. ours_auto took the (f)used path "
        "(our GEMM; 'f sm': peers' rows pulled by SMs), the fused path with (c)uBLAS per chunk, or the (s)equential path. '!' failed its correctness check, ERR raised, '-' not available."
    )
    goal = (
        local_goal_line(rows, target="ours_auto", baseline="cublas", what="torch.matmul (cublas)")
        + "\n"
        if world == 1
        else ""
    )
    return f"{table}\n{goal}{legend}\n{AUTOTUNE_LEGEND}"
