"""Benchmark entry for the worked examples of user fused ops (examples/, written on
overlap_kernels.language and made ops by FusedOp), each against our built-in op followed by
the separate kernel it fuses away.

Per shape (M, K, N; bf16; every baseline in the same run and process group):

    swiglu_fused  examples.ag_swiglu: all-gather of x [M / world, K], then silu(x w_gate) * (x w_up)
                  in the GEMM's epilogue (w_gate, w_up [K, N])
    swiglu_split  ag_gemm of x with [w_gate | w_up] (one [K, 2N] weight, nn.Linear's layout),
                  then silu(gate) * up (compiled: one kernel)
    norm_fused    examples.ag_rmsnorm_gemm: all-gather of x [M / world, K], RMSNorm of each
                  arrived chunk inside the GEMM's K loop, times w [K, N]
    norm_split    RMSNorm of the local rows (compiled: one kernel), then ag_gemm
    bias_fused    examples.gemm_rs_bias: x [M, K] (K: this rank's slice) @ w [K, N],
                  reduce-scattered, plus bias [N] and residual [this rank's rows, N] in the epilogue
    bias_split    gemm_rs, then + bias + residual (compiled: one kernel)

Each ``*_fused`` is checked against its ``*_split`` on input set 0 (the reduce example per
element too; the other two through an activation or a norm: the relative norm). On CPU
ranks (``--cpu-ranks``) the elementwise parts are torch's, uncompiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import (
    DTYPE,
    GEMM_PARTIALS,
    Check,
    check_variants,
    cycled,
    generator,
    input_sets,
    load_ours,
    parse_shape,
    run_shapes,
    time_ms,
)
from bench.harness import RunContext, Settings, Variant, make_row
from bench.report import Progress, every_shape_goal_line
from bench.report import format_table as _format_table

OP = "examples"
EXAMPLES = ("swiglu", "norm", "bias")
EPS = 1e-5
# A Llama-3-8B MLP at TP 4 (hidden 4096, FFN 14336: each rank's gate/up width 3584) at
# prefill and at a short batch, and a 70B-wide one at TP 8 (hidden 8192, FFN 28672).
DEFAULT_SHAPES: list[tuple[int, int, int]] = [
    (4096, 4096, 3584),
    (512, 4096, 3584),
    (4096, 8192, 3584),
]
__all__ = ["DEFAULT_SHAPES", "DTYPE", "OP", "format_table", "parse_shape", "run"]


@dataclasses.dataclass
class _Inputs:
    x_local: torch.Tensor  # [M / world, K]: this rank's rows (the gather examples)
    w_gate: torch.Tensor  # [K, N]
    w_up: torch.Tensor  # [K, N]
    w_gate_up: torch.Tensor  # [K, 2N]: [w_gate | w_up] as a transposed [2N, K] nn.Linear weight
    gain: torch.Tensor  # [K]: the RMSNorm's weight
    w: torch.Tensor  # [K, N]
    x: torch.Tensor  # [M, K]: the rows of the product (the reduce example; K its slice)
    bias: torch.Tensor  # [N]
    residual: torch.Tensor  # [this rank's rows, N]


def _make_inputs(m: int, k: int, n: int, ctx: RunContext, seed: int) -> _Inputs:
    gen = generator(ctx, seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=ctx.device, dtype=DTYPE) * scale

    w_gate, w_up = randn(k, n, scale=k**-0.5), randn(k, n, scale=k**-0.5)
    w_gate_up = torch.cat([w_gate, w_up], dim=1).t().contiguous().t()
    # The norm's weight is replicated (the split path norms each rank's rows with its own).
    shared = torch.Generator(device=ctx.device).manual_seed(seed)
    gain = (torch.rand(k, generator=shared, device=ctx.device) + 0.5).to(DTYPE)
    own = (ctx.rank + 1) * m // ctx.world - ctx.rank * m // ctx.world
    return _Inputs(randn(m // ctx.world, k), w_gate, w_up, w_gate_up, gain,
                   randn(k, n, scale=k**-0.5), randn(m, k), randn(n), randn(own, n))  # fmt: skip


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=1)
    return F.silu(gate) * up


def _rmsnorm(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), gain, EPS)


def _add_bias_residual(out: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor):
    return out + bias + residual


def _variants(
    ctx: RunContext, sets: list[_Inputs], ours: dict[str, Any]
) -> tuple[list[Variant], dict[str, Check]]:
    import examples.ag_rmsnorm_gemm as norm_example
    import examples.ag_swiglu as swiglu_example
    import examples.gemm_rs_bias as bias_example

    cuda = ctx.device.type == "cuda"
    compiled = (lambda f: torch.compile(f, dynamic=False)) if cuda else (lambda f: f)
    swiglu, rmsnorm, add = compiled(_swiglu), compiled(_rmsnorm), compiled(_add_bias_residual)
    ag_gemm, gemm_rs, group = ours["ag_gemm"], ours["gemm_rs"], ctx.group
    bodies: dict[str, Callable[[_Inputs], Any]] = {
        "swiglu_fused": lambda s: swiglu_example.ag_swiglu(s.x_local, s.w_gate, s.w_up, group),
        "swiglu_split": lambda s: swiglu(ag_gemm(s.x_local, s.w_gate_up, group)),
        "norm_fused": lambda s: norm_example.ag_rmsnorm_gemm(s.x_local, s.gain, s.w, EPS, group),
        "norm_split": lambda s: ag_gemm(rmsnorm(s.x_local, s.gain), s.w, group),
        "bias_fused": lambda s: bias_example.gemm_rs_bias(s.x, s.w, s.bias, s.residual, group),
        "bias_split": lambda s: add(gemm_rs(s.x, s.w, group), s.bias, s.residual),
    }
    s0 = sets[0]
    checks = {}
    for name in EXAMPLES:
        ref = bodies[f"{name}_split"](s0)
        # The reduce example per element: world partials of K-long products, reduced and
        # rounded on the way (our reduce sums in fp32: world roundings at most, and the
        # split path's GEMM_PARTIALS), then bias and residual added (two roundings).
        k, partials = (
            (ctx.world * s0.x.shape[1], 2 * ctx.world + 1 + GEMM_PARTIALS)
            if name == "bias"
            else (None, 0)
        )
        body = bodies[f"{name}_fused"]
        checks[f"{name}_fused"] = Check(
            lambda body=body: body(s0), ref, against=f"{name}_split", k=k, partials=partials
        )
    return [Variant(name, cycled(sets, body)) for name, body in bodies.items()], checks


def bench_shape(
    shape: tuple[int, int, int],
    ctx: RunContext,
    settings: Settings,
    progress: Progress,
    ours: dict[str, Any],
) -> list[dict[str, Any]]:
    """Rows for one shape: every variant (no bound: each example has its own baseline)."""
    m, k, n = shape
    if m % ctx.world:
        raise ValueError(f"M={m} is not divisible by world size {ctx.world}")
    bytes_per_set = (2 * m * k + 6 * k * n + 2 * m * n) * DTYPE.itemsize
    sets = input_sets(lambda seed: _make_inputs(m, k, n, ctx, seed), bytes_per_set, ctx)
    variants, checks = _variants(ctx, sets, ours)
    check_variants(ctx, variants, checks, settings)
    del checks
    progress.step(f"{OP} {m}x{k}x{n}: checked")
    dims = {"M": m, "K": k, "N": n}
    flops = {"swiglu": 4.0 * m * k * n, "norm": 2.0 * m * k * n, "bias": 2.0 * m * k * n}
    for v in variants:
        v.flops = flops[v.name.split("_")[0]]
    ms = time_ms(OP, dims, variants, ctx, settings, progress)
    return [make_row(OP, dims, v, ms.get(v.name), None) for v in variants]


def run(
    ctx: RunContext, shapes: list[tuple[int, int, int]], settings: Settings
) -> list[dict[str, Any]]:
    """All shapes; progress on rank 0."""
    ours, missing = load_ours("ag_gemm", ("ag_gemm", "gemm_rs"))
    missing.pop("resolve_config", None)  # (no variant here resolves a config)
    if missing:
        raise RuntimeError("examples: the built-in ops are missing: " + "; ".join(missing.values()))
    return run_shapes(
        OP, shapes, ctx, settings, missing,
        lambda shape, progress: bench_shape(shape, ctx, settings, progress, ours),
    )  # fmt: skip


def format_table(rows: list[dict[str, Any]], world: int | None = None) -> str:
    """Per example, its ms per call beside the built-in op + separate kernel it replaces,
    and the goal: at least as fast on every shape."""
    lines = []
    for name in EXAMPLES:
        mine = [r for r in rows if r["variant"].startswith(f"{name}_")]
        lines.append(f"{name}:")
        lines.append(_format_table(mine, target=f"{name}_fused", baselines=(f"{name}_split",)))
        lines.append(every_shape_goal_line(
            mine, target=f"{name}_fused", baseline=f"{name}_split", within=1.0,
            head=f"goal: {name}_fused at least as fast as {name}_split on every shape:",
        ))  # fmt: skip
    lines.append(
        "ms per call (eager): median over calls, max over ranks; M x K x N (gather examples: M "
        f"gathered rows; bias: K each rank's slice); world {world}. '!' failed its check, ERR "
        "raised, '-' not available."
    )
    return "\n".join(lines)
