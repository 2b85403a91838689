"""Benchmark entry for ``overlap_kernels.gemm_ar``: all_reduce(x @ w).

Per shape (M, K_local, N; bf16; every rank holds x [M, K_local], its slice of K; weight
stored [N, K_local] as in nn.Linear and passed as ``w.t()``; every rank gets the [M, N]
sum), in one run and one process group:

    cublas           torch.matmul [M, K_local] @ [K_local, N]     (compute alone)
    nccl_all_reduce  dist.all_reduce of an [M, N] tensor          (communication alone)
    sequential       torch.matmul, then the all-reduce            (what overlap must beat)
    ours_one_shot    gemm_ar, path "one_shot"  (skipped, with the reason, where it cannot run)
    ours_two_shot    gemm_ar, path "two_shot", partials pushed (mechanism "push")
    ours_two_shot_one_gather_stream  the same, every gather on the one communication stream
    ours_two_shot_ce           two_shot, partials pulled by the owners' copy engines
    ours_two_shot_push_cublas  two_shot, torch.matmul pushing peers' partials (producer "cublas")
    ours_auto        gemm_ar with its default config (the path it resolved to is recorded)
    ours_autotune    gemm_ar with the config the opt-in autotune picks on this host
    sequential_graph, ours_graph   at decode sizes on CUDA: sequential and ours_auto, each
                     captured in CUDA graphs and replayed (as serving engines run decode)
    bound            max(cublas, nccl_all_reduce): perfect overlap (computed, not run)

PyTorch has no fused matmul all-reduce to compare with. Before timing, every variant that
produces the sum is checked against ``sequential`` (relative Frobenius error, max over ranks).
The default shapes are of two kinds, each with its own goal: large (prefill, training) and
decode (M <= DECODE_MAX_M tokens).
"""

from __future__ import annotations

import dataclasses
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
    graphed,
    input_sets,
    load_ours,
    measure,
    ours_variants,
    parse_shape,
    run_shapes,
    unavailable,
)
from bench.harness import RunContext, Settings, Variant
from bench.report import Progress, goal_lines, local_goal_line
from bench.report import format_table as _format_table

OP = "gemm_ar"
LARGE_SHAPES = [(8192, 7168, 8192), (16384, 7168, 8192), (4096, 2048, 8192), (2048, 7168, 8192)]
DECODE_SHAPES = [(16, 7168, 8192), (64, 7168, 8192), (256, 7168, 8192)]
DEFAULT_SHAPES: list[tuple[int, int, int]] = LARGE_SHAPES + DECODE_SHAPES
# Decode: a batch of at most this many tokens (the largest decode shape above).
DECODE_MAX_M = 256
# The targets: geomean speedup of ours_auto over sequential, per kind of shape.
GOALS = {"large": 1.2, "decode": 1.3}
__all__ = ["DEFAULT_SHAPES", "DTYPE", "OP", "format_table", "parse_shape", "run"]


@dataclasses.dataclass
class _Inputs:
    x: torch.Tensor  # [M, K_local], this rank's slice of K
    w: torch.Tensor  # [K_local, N], a transposed view of the [N, K_local] weight
    zeros: torch.Tensor  # [M, N], the collective-alone variant's buffer (reduced in place)


def _make_inputs(m: int, k: int, n: int, ctx: RunContext, seed: int) -> _Inputs:
    gen = generator(ctx, seed)
    x = torch.randn(m, k, generator=gen, device=ctx.device, dtype=DTYPE)
    w = torch.randn(n, k, generator=gen, device=ctx.device, dtype=DTYPE).t()  # nn.Linear layout
    # Zeros: reduced in place call after call, they stay finite (a product would overflow).
    return _Inputs(x, w, torch.zeros(m, n, device=ctx.device, dtype=DTYPE))


def _all_reduce(t: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    if ctx.world > 1:
        dist.all_reduce(t, group=ctx.group)
    return t


# two_shot with partials pulled by the owners' copy engines (own pieces last).
_PULLED = {"mechanism": "copy_engine", "comm_sms": 1}


def _described(cfg: Any) -> str:
    if cfg.path != "two_shot":
        return f"path={cfg.path}"
    mechanism = getattr(cfg, "mechanism", "push")  # (a version without the knob pushes)
    gathers = getattr(
        cfg, "gather_streams", 1
    )  # (a version without the knob gathers on one stream)
    producer = getattr(cfg, "producer", "triton")  # (a version without the knob: our GEMM)
    return f"path=two_shot mechanism={mechanism} producer={producer} pieces={cfg.pieces} gather_streams={gathers}"


def _variants(
    ctx: RunContext,
    sets: list[_Inputs],
    ref: torch.Tensor,
    ours: dict[str, Any],
    missing: dict[str, str],
) -> tuple[list[Variant], dict[str, Check]]:
    """Each variant as a no-argument call cycling through the input sets, and for each
    variant that yields the sum, its check on input set 0 against ``ref``."""
    # Checked per element too (common.Check): the sum of every rank's K_local products,
    # through world rounded partials and world - 1 rounded running sums (NCCL's ring), and
    # the GEMMs' own (common.GEMM_PARTIALS).
    k, partials = ctx.world * sets[0].x.shape[1], 2 * ctx.world - 1 + GEMM_PARTIALS
    out: list[Variant] = [
        Variant("cublas", cycled(sets, lambda s: torch.matmul(s.x, s.w)), whole_op=False),
        Variant(
            "nccl_all_reduce", cycled(sets, lambda s: _all_reduce(s.zeros, ctx)), whole_op=False
        ),
        Variant("sequential", cycled(sets, lambda s: _all_reduce(torch.matmul(s.x, s.w), ctx))),
    ]
    mine, checks = ours_variants(
        ctx,
        sets,
        ref,
        op=OP,
        ours=ours,
        missing=missing,
        operands=lambda s: (s.x, s.w),
        out_shape=tuple(ref.shape),
        k=k,
        partials=partials,
        forced={
            "ours_one_shot": {"path": "one_shot"},
            "ours_two_shot": {"path": "two_shot", "mechanism": "push", "producer": "triton"},
            "ours_two_shot_one_gather_stream": {
                "path": "two_shot",
                "mechanism": "push",
                "producer": "triton",
                "gather_streams": 1,
            },
            "ours_two_shot_ce": {"path": "two_shot", **_PULLED},
            "ours_two_shot_push_cublas": {
                "path": "two_shot",
                "mechanism": "push",
                "producer": "cublas",
                "lag": None,
            },
        },
        describe=_described,
    )
    if ctx.device.type == "cuda" and sets[0].x.shape[0] <= DECODE_MAX_M:
        in_graphs = {
            "sequential_graph": lambda s: _all_reduce(torch.matmul(s.x, s.w), ctx),
            "ours_graph": lambda s: ours["gemm_ar"](s.x, s.w, ctx.group),
        }
        for name, body in in_graphs.items():
            try:  # capture failures agree in check_variants: no collective runs in between
                replay, out0 = graphed(sets, body)
            except Exception as e:  # noqa: BLE001 - recorded; the other variants still run
                mine.append(unavailable(name, "error", f"capture raised {type(e).__name__}: {e}"))
                continue
            mine.append(Variant(name, replay, note="captured once per input set, replayed"))
            checks[name] = Check(
                lambda replay=replay, out0=out0: _replayed(replay, out0),
                ref,
                k=k,
                partials=partials,
            )
    return out + mine, checks


def _replayed(replay: Callable[[int | None], None], out0: torch.Tensor) -> torch.Tensor:
    """Set 0's graph replayed into its output, NaN-filled first: a tile the replay
    does not write shows."""
    out0.fill_(float("nan"))
    replay(0)
    return out0


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
    bytes_per_set = (m * k + n * k + m * n) * DTYPE.itemsize
    sets = input_sets(lambda seed: _make_inputs(m, k, n, ctx, seed), bytes_per_set, ctx)
    ref = _all_reduce(torch.matmul(sets[0].x, sets[0].w), ctx)  # [M, N], sequential
    variants, checks = _variants(ctx, sets, ref, ours, missing)
    check_variants(ctx, variants, checks, settings)
    del ref, checks
    progress.step(f"{OP} {m}x{k}x{n}: checked")
    # Bus bandwidth as nccl-tests report it: 2 (world - 1) / world of the tensor's bytes.
    return measure(
        OP,
        {"M": m, "K": k, "N": n},
        variants,
        ctx,
        settings,
        progress,
        flops=2.0 * m * k * n,
        parts=("cublas", "nccl_all_reduce"),
        busbw_bytes=2 * (ctx.world - 1) / ctx.world * m * n * DTYPE.itemsize,
    )


def run(
    ctx: RunContext, shapes: list[tuple[int, int, int]], settings: Settings
) -> list[dict[str, Any]]:
    """All shapes; progress on rank 0."""
    ours, missing = load_ours(OP, ("gemm_ar", "GemmArConfig", "autotune"))
    return run_shapes(
        OP,
        shapes,
        ctx,
        settings,
        missing,
        lambda shape, progress: bench_shape(shape, ctx, settings, progress, ours, missing),
    )


_PATH_LABELS = {"one_shot": "(1)", "two_shot": "(2)", "sequential": "(s)"}


def path_label(row: dict[str, Any]) -> str:
    """'(1)' one_shot, '(s)' sequential, two_shot by mechanism: '(2 push)', '(2 ce)'
    (copy engine), '(2 push+cublas)' (cuBLAS producing)."""
    cfg = row.get("config") or {}
    label = _PATH_LABELS.get(str(cfg.get("path")), "(?)")
    if label != "(2)":
        return label
    mechanism = "ce" if cfg.get("mechanism") == "copy_engine" else cfg.get("mechanism", "?")
    return f"(2 {mechanism}+cublas)" if cfg.get("producer") == "cublas" else f"(2 {mechanism})"


def format_table(rows: list[dict[str, Any]], world: int | None = None) -> str:
    """The summary table: ours_auto against sequential, its % of the bound, and the geomean
    over sequential for the large and the decode shapes, each against its goal; on one
    rank (``world`` 1), which moves nothing, ours_auto against torch.matmul's time (and
    ours_graph against torch.matmul captured) instead."""
    table = _format_table(
        rows, target="ours_auto", baselines=("sequential", "ours_autotune"), target_label=path_label
    )
    member = {"large": lambda s: s["M"] > DECODE_MAX_M, "decode": lambda s: s["M"] <= DECODE_MAX_M}
    where = {"large": f"M > {DECODE_MAX_M}", "decode": f"M <= {DECODE_MAX_M}"}
    graphs = any(r["variant"] == "ours_graph" for r in rows)
    if world == 1:
        goals = local_goal_line(
            rows, target="ours_auto", baseline="cublas", what="torch.matmul (cublas)"
        )
        if graphs:  # (sequential_graph on one rank: torch.matmul alone, captured)
            graphed = local_goal_line(rows, target="ours_graph", baseline="sequential_graph",
                                      what="torch.matmul in CUDA graphs (sequential_graph)")  # fmt: skip
            goals = f"{goals}\n{graphed}"
        return f"{table}\n{goals}\n{_LEGEND}\n{AUTOTUNE_LEGEND}"
    goals = goal_lines(
        rows,
        target="ours_auto",
        baseline="sequential",
        goals=[(f"{kind} shapes ({where[kind]})", member[kind], GOALS[kind]) for kind in GOALS],
    )
    if graphs:
        graphed = goal_lines(
            rows,
            target="ours_graph",
            baseline="sequential_graph",
            goals=[("decode shapes in CUDA graphs", member["decode"], GOALS["decode"])],
        )
        goals = f"{goals}\n{graphed}"
    return f"{table}\n{goals}\n{_LEGEND}\n{AUTOTUNE_LEGEND}"


_LEGEND = (
    "ms per call: median over calls, max over ranks; M x K_local x N. ours_auto took the "
    "(1) one_shot, (2) two_shot (partials by push or the ce copy engine; +cublas: peers' "
    "partials by torch.matmul) or (s)equential path. '!' failed its correctness check, "
    "ERR raised, '-' not available."
)
