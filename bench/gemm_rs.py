"""Benchmark entry for ``overlap_kernels.gemm_rs``: reduce_scatter(x @ w).

Per shape (M, K_local, N; bf16; every rank holds x [M, K_local], its slice of K; weight
stored [N, K_local] as in nn.Linear and passed as ``w.t()``; rank r gets rows
[r * M / world, (r + 1) * M / world) of the sum), in one run and one process group:

    cublas               torch.matmul [M, K_local] @ [K_local, N]             (compute alone)
    nccl_reduce_scatter  dist.reduce_scatter_tensor of an [M, N] tensor        (communication alone)
    sequential           torch.matmul, then the reduce-scatter                 (what overlap must beat)
    torch_fused          torch.ops.symm_mem.fused_matmul_reduce_scatter        (PyTorch async TP)
    ours_local_gemm      overlap_kernels.matmul on [M, K_local]               (our GEMM, no comm)
    ours_push            gemm_rs, path "fused", mechanism "push"
    ours_copy_engine     gemm_rs, path "fused", mechanism "copy_engine", comm_sms 1
    ours_copy_engine_p4  the same with each owner's rows in 4 pieces (pulls and reductions start sooner)
    ours_cublas_producer copy_engine, producer "cublas": torch.matmul computes peers' pieces
    ours_push_cublas     push, producer "cublas": one torch.matmul per owner writes its rows into
                         this rank's slot there (one piece per owner)
    ours_push_cublas_p4  the same with 4 pieces: still one matmul per owner, 4 flags, own rows
                         reduced in 4 pieces
    ours_auto            gemm_rs with its default config (path and mechanism recorded)
    bound                max(cublas, nccl_reduce_scatter): perfect overlap (computed, not run)

Before timing, every variant that produces a result is checked (relative Frobenius error,
max over ranks): ours_local_gemm against cublas's partial product, the others against
``sequential``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

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
from bench.report import Progress, goal_lines, local_goal_line
from bench.report import format_table as _format_table

OP = "gemm_rs"
DEFAULT_SHAPES: list[tuple[int, int, int]] = [
    (8192, 7168, 8192),
    (16384, 7168, 8192),
    (4096, 2048, 8192),
    (2048, 7168, 8192),
]
# The target: geomean speedup of ours_auto over sequential on DEFAULT_SHAPES.
GOAL = 1.15
__all__ = ["DEFAULT_SHAPES", "DTYPE", "OP", "format_table", "parse_shape", "run"]


class TorchFusedRS:
    """``torch.ops.symm_mem.fused_matmul_reduce_scatter(A, B, "sum", scatter_dim=0, group)``.

    Its schema is ``(Tensor A, Tensor B, str reduce_op, int scatter_dim, str group_name)
    -> Tensor`` in torch 2.13 and in the older sources we read; should a release differ,
    the first call tries each form in :attr:`FORMS` and keeps the first one whose arguments
    the schema accepts (argument parsing fails alike on every rank, before any
    communication). ``form`` is the one that worked.
    """

    FORMS: ClassVar[dict[str, Callable[..., torch.Tensor]]] = {
        "(A, B, 'sum', 0, group_name)": lambda op, a, b, g: op(a, b, "sum", 0, g),
        "(A, B, reduce_op='sum', scatter_dim=0, group_name=group_name)": (
            lambda op, a, b, g: op(a, b, reduce_op="sum", scatter_dim=0, group_name=g)
        ),
    }

    def __init__(self, op: Any, group_name: str) -> None:
        self.op, self.group_name, self.form = op, group_name, None
        overload = getattr(op, "default", None)
        self.schema = str(overload._schema) if overload is not None else "unknown"

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.form is not None:
            return self.FORMS[self.form](self.op, a, b, self.group_name)
        refused = []
        for form, call in self.FORMS.items():
            try:
                result = call(self.op, a, b, self.group_name)
            except (TypeError, RuntimeError) as e:
                if isinstance(e, RuntimeError) and "Declaration:" not in str(e):
                    raise  # not a schema mismatch: a real failure
                refused.append(f"{form}: {str(e).splitlines()[0]}")
                continue
            self.form = form
            return result
        raise TypeError(f"no argument form fits {self.schema}: " + "; ".join(refused))

    @property
    def note(self) -> str:
        return f"called as {self.form}" if self.form else f"schema {self.schema}"


def torch_fused_op(ctx: RunContext) -> tuple[TorchFusedRS | None, str]:
    """PyTorch's fused matmul reduce-scatter, or None and the reason it is not available."""
    op, group_name, why = torch_symm_mem_op(ctx, "fused_matmul_reduce_scatter")
    return (None, why) if op is None else (TorchFusedRS(op, group_name), "")


@dataclasses.dataclass
class _Inputs:
    x: torch.Tensor  # [M, K_local], this rank's slice of K
    w: torch.Tensor  # [K_local, N], a transposed view of the [N, K_local] weight
    partial: torch.Tensor  # [M, N], x @ w: the collective-alone variant's input
    out: torch.Tensor  # [M / world, N], the reduce-scatter's output buffer


def _make_inputs(m: int, k: int, n: int, ctx: RunContext, seed: int) -> _Inputs:
    gen = generator(ctx, seed)
    x = torch.randn(m, k, generator=gen, device=ctx.device, dtype=DTYPE)
    w = torch.randn(n, k, generator=gen, device=ctx.device, dtype=DTYPE).t()  # nn.Linear layout
    out = torch.empty(m // ctx.world, n, device=ctx.device, dtype=DTYPE)
    return _Inputs(x, w, torch.matmul(x, w), out)


# torch 2.13 renames reduce_scatter_tensor (same arguments) and warns on the old name.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _reduce_scatter(out: torch.Tensor, partial: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    if ctx.world == 1:
        return out.copy_(partial)
    _reduce_scatter_single(out, partial, group=ctx.group)
    return out


def _variants(
    ctx: RunContext,
    sets: list[_Inputs],
    ref: torch.Tensor,
    ours: dict[str, Any],
    missing: dict[str, str],
) -> tuple[list[Variant], dict[str, Check], TorchFusedRS | None]:
    """Each variant as a no-argument call cycling through the input sets, and for each
    variant that yields a result, its check on input set 0."""
    s0 = sets[0]
    # Checked per element too (common.Check): the sum of every rank's K_local products,
    # through world rounded partials and world - 1 rounded running sums (NCCL's ring), and
    # the GEMMs' own (common.GEMM_PARTIALS).
    k, partials = ctx.world * s0.x.shape[1], 2 * ctx.world - 1 + GEMM_PARTIALS
    checks: dict[str, Check] = {}
    out: list[Variant] = [
        Variant("cublas", cycled(sets, lambda s: torch.matmul(s.x, s.w)), whole_op=False),
        Variant(
            "nccl_reduce_scatter",
            cycled(sets, lambda s: _reduce_scatter(s.out, s.partial, ctx)),
            whole_op=False,
        ),
        Variant(
            "sequential",
            cycled(sets, lambda s: _reduce_scatter(s.out, torch.matmul(s.x, s.w), ctx)),
        ),
    ]
    fused, why = torch_fused_op(ctx)
    if fused is None:
        out.append(unavailable("torch_fused", "skipped", why))
    else:
        out.append(Variant("torch_fused", cycled(sets, lambda s: fused(s.x, s.w)), note=why))
        checks["torch_fused"] = Check(lambda: fused(s0.x, s0.w), ref, k=k, partials=partials)
    if "matmul" in ours:
        matmul = ours["matmul"]
        out.append(
            Variant("ours_local_gemm", cycled(sets, lambda s: matmul(s.x, s.w)), whole_op=False)
        )
        checks["ours_local_gemm"] = Check(
            lambda: matmul(s0.x, s0.w),
            s0.partial,
            "cublas",
            k=s0.x.shape[1],
            partials=GEMM_PARTIALS,
        )
    else:
        out.append(unavailable("ours_local_gemm", "error", missing["matmul"], whole_op=False))
    mine, my_checks = ours_variants(
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
            "ours_push": {"path": "fused", "mechanism": "push", "producer": "triton"},
            "ours_copy_engine": {
                "path": "fused",
                "mechanism": "copy_engine",
                "comm_sms": 1,
                "producer": "triton",
            },
            "ours_copy_engine_p4": {
                "path": "fused",
                "mechanism": "copy_engine",
                "comm_sms": 1,
                "pieces": 4,
                "producer": "triton",
            },
            "ours_cublas_producer": {
                "path": "fused",
                "mechanism": "copy_engine",
                "comm_sms": 1,
                "producer": "cublas",
            },
            "ours_push_cublas": {
                "path": "fused",
                "mechanism": "push",
                "producer": "cublas",
                "lag": None,
                "pieces": 1,
            },
            "ours_push_cublas_p4": {
                "path": "fused",
                "mechanism": "push",
                "producer": "cublas",
                "lag": None,
                "pieces": 4,
            },
        },
        describe=describe,
    )
    return out + mine, {**checks, **my_checks}, fused


def describe(cfg: Any) -> str:
    """'path=fused mechanism=push producer=triton' (both only matter on the fused path)."""
    return f"path={cfg.path}" + (
        f" mechanism={cfg.mechanism} producer={cfg.producer}" if cfg.path == "fused" else ""
    )


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
    bytes_per_set = (m * k + n * k + m * n + m // ctx.world * n) * DTYPE.itemsize
    sets = input_sets(lambda seed: _make_inputs(m, k, n, ctx, seed), bytes_per_set, ctx)
    s0 = sets[0]
    ref = _reduce_scatter(torch.empty_like(s0.out), torch.matmul(s0.x, s0.w), ctx)  # sequential
    variants, checks, fused = _variants(ctx, sets, ref, ours, missing)
    check_variants(ctx, variants, checks, settings)
    del ref, checks
    if fused is not None:  # the argument form its first call found
        v = next(v for v in variants if v.name == "torch_fused")
        v.note = "; ".join(x for x in (fused.note, v.note) if x)
    progress.step(f"{OP} {m}x{k}x{n}: checked")
    # Bus bandwidth as nccl-tests report it: (world - 1) / world of the input's bytes.
    return measure(
        OP,
        {"M": m, "K": k, "N": n},
        variants,
        ctx,
        settings,
        progress,
        flops=2.0 * m * k * n,
        parts=("cublas", "nccl_reduce_scatter"),
        busbw_bytes=(ctx.world - 1) / ctx.world * m * n * DTYPE.itemsize,
    )


def run(
    ctx: RunContext, shapes: list[tuple[int, int, int]], settings: Settings
) -> list[dict[str, Any]]:
    """All shapes; progress on rank 0."""
    ours, missing = load_ours(OP, ("gemm_rs", "matmul", "GemmRsConfig", "autotune"))
    return run_shapes(
        OP,
        shapes,
        ctx,
        settings,
        missing,
        lambda shape, progress: bench_shape(shape, ctx, settings, progress, ours, missing),
    )


def path_label(row: dict[str, Any]) -> str:
    """'(push)' / '(ce)' for the fused path by mechanism ('+cublas' with the cuBLAS
    producer), '(s)' for the sequential path."""
    cfg = row.get("config") or {}
    if cfg.get("path") != "fused":
        return "(" + str(cfg.get("path", "?"))[:1] + ")"
    mechanism = "ce" if cfg.get("mechanism") == "copy_engine" else cfg.get("mechanism", "?")
    return f"({mechanism}+cublas)" if cfg.get("producer") == "cublas" else f"({mechanism})"


def format_table(rows: list[dict[str, Any]], world: int | None = None) -> str:
    """The summary table: ours_auto against sequential and torch_fused, its % of the bound,
    and the geomean over sequential against the goal; on one rank (``world`` 1), which
    moves nothing, ours_auto against torch.matmul's time instead."""
    table = _format_table(
        rows,
        target="ours_auto",
        baselines=("sequential", "torch_fused", "ours_autotune"),
        target_label=path_label,
    )
    if world == 1:
        goal = local_goal_line(
            rows, target="ours_auto", baseline="cublas", what="torch.matmul (cublas)"
        )
    else:
        goal = goal_lines(
            rows,
            target="ours_auto",
            baseline="sequential",
            goals=[("all shapes", lambda _: True, GOAL)],
        )
    legend = (
        "ms per call: median over calls, max over ranks; M x K_local x N. ours_auto took the "
        "fused path by (push) or (ce) copy engine (+cublas: peers' pieces by torch.matmul), or the (s)equential one. '!' failed its "
        "correctness check, ERR raised, '-' not available."
    )
    return f"{table}\n{goal}\n{legend}\n{AUTOTUNE_LEGEND}"
