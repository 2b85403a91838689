"""Benchmark entry for a decoder layer's reduction point at decode, as servers run it:
every variant captured in CUDA graphs and replayed.

Per shape (M tokens, K_local, N = hidden; bf16; every rank holds x [M, K_local] and its
o_proj / down_proj slice, weight stored [N, K_local] as in nn.Linear; a replicated
residual [M, N] and RMSNorm weight [N]), in one run and one process group:

    cublas                 torch.matmul alone                                   (compute alone)
    nccl_all_reduce        dist.all_reduce of [M, N] alone
    symm_one_shot          torch.ops.symm_mem.one_shot_all_reduce alone (the unicast one-shot
                           kernel vLLM's custom all-reduce is built like; input in symmetric memory)
    ours_all_reduce        overlap_kernels.all_reduce alone (one_shot)
    ours_all_reduce_rmsnorm  overlap_kernels.all_reduce_rmsnorm alone (one_shot)
    nccl_norm              cuBLAS, the NCCL all-reduce, then residual add + RMSNorm compiled
                           by torch.compile (what a compiled model without fusions runs)
    symm_norm              cuBLAS into symmetric memory, torch's one-shot all-reduce, the same
                           compiled add + RMSNorm
    cublas_ours_norm       cuBLAS, then overlap_kernels.all_reduce_rmsnorm (one_shot)
    ours                   overlap_kernels.gemm_ar_rmsnorm with its default config
    bound                  max(cublas, nccl_all_reduce) (computed, not run)

On CUDA each variant is captured in one CUDA graph per input set after an eager call and
replayed (the times are replays: no host time); on CPU ranks (``--cpu-ranks``) the calls
run eagerly and the add + RMSNorm is torch's, uncompiled. Before timing, every variant that
yields the layer's output (normed rows and the new residual) is checked against
``nccl_norm``'s, and every all-reduce alone against ``nccl_all_reduce``'s.

The default shapes are the two reduction points of Llama-3-8B (hidden 4096, FFN 14336) and
Llama-3-70B (hidden 8192, FFN 28672) at the run's tensor-parallel size (its world size):
o_proj K = hidden / TP, down_proj K = FFN / TP, N = hidden, for M in DECODE_MS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.common import (
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
    parse_shape,
    run_shapes,
    torch_symm_mem_op,
    unavailable,
)
from bench.harness import RunContext, Settings, Variant
from bench.report import Progress, goal_lines, local_goal_line
from bench.report import format_table as _format_table

OP = "decode"
DECODE_MS = (1, 8, 32, 64, 128, 256)
MODELS = {"llama3_8b": (4096, 14336), "llama3_70b": (8192, 28672)}  # hidden, FFN
EPS = 1e-5
# Goals (issue 45; multi-rank runs): ours within cuBLAS alone + 3 us at M <= 64, and
# ahead of both baselines (NCCL and torch's one-shot, each with the compiled norm) on every M.
SLACK_MS = 0.003
__all__ = ["DEFAULT_SHAPES", "DTYPE", "OP", "format_table", "parse_shape", "run"]


def default_shapes(world: int) -> list[tuple[int, int, int]]:
    """(M, K_local, N) of both reduction points of every model at TP ``world``."""
    return [
        (m, k // world, hidden)
        for hidden, ffn in MODELS.values()
        for k in (hidden, ffn)
        for m in DECODE_MS
    ]


def _world() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


# (bench/cli.py reads DEFAULT_SHAPES before any rank exists: the TP of a run over every GPU.)
DEFAULT_SHAPES = default_shapes(max(1, _world()))


@dataclasses.dataclass
class _Inputs:
    x: torch.Tensor  # [M, K_local]
    w: torch.Tensor  # [K_local, N], a transposed view of the [N, K_local] weight
    residual: torch.Tensor  # [M, N], the same on every rank
    weight: torch.Tensor  # [N], the same on every rank
    partial: torch.Tensor  # [M, N]: x @ w, the all-reduce-alone variants' input


def _make_inputs(m: int, k: int, n: int, ctx: RunContext, seed: int) -> _Inputs:
    gen = generator(ctx, seed)
    x = torch.randn(m, k, generator=gen, device=ctx.device, dtype=DTYPE)
    w = torch.randn(n, k, generator=gen, device=ctx.device, dtype=DTYPE).t() / k**0.5
    residual = torch.randn(m, n, device=ctx.device, dtype=DTYPE)
    weight = torch.rand(n, device=ctx.device, dtype=DTYPE) + 0.5
    if ctx.world > 1:
        for t in (residual, weight):
            dist.broadcast(t, 0, group=ctx.group)
    return _Inputs(x, w, residual, weight, torch.matmul(x, w))


def _add_rmsnorm(summed: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
    r = summed + residual
    return F.rms_norm(r, (r.shape[-1],), weight, EPS), r


def _all_reduce(t: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    if ctx.world > 1:
        dist.all_reduce(t, group=ctx.group)
    return t


def _layer_out(result: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A layer variant's output as one tensor for its check: normed rows, then the residual."""
    return torch.cat(result)


class _SymmOneShot:
    """torch's one-shot all-reduce: its input a symmetric-memory buffer per input set,
    which cuBLAS writes the product into (as vLLM's custom all-reduce registers its
    graph's buffers)."""

    def __init__(self, ctx: RunContext, sets: list[_Inputs]):
        self.op, self.group_name, self.why = torch_symm_mem_op(ctx, "one_shot_all_reduce")
        self.buffers: dict[int, torch.Tensor] = {}
        if ctx.world == 1:
            # Nothing to reduce; and replays of torch 2.11's one-shot kernel at one rank
            # fault (bench/experiments/probe_decode_replays.py).
            self.op, self.why = None, "one rank: nothing to all-reduce"
        if self.op is None:
            return
        import torch.distributed._symmetric_memory as symm_mem

        for s in sets:
            buffer = symm_mem.empty(s.partial.shape, dtype=DTYPE, device=ctx.device)
            symm_mem.rendezvous(buffer, self.group_name)
            self.buffers[id(s)] = buffer

    def reduce(self, s: _Inputs, product: torch.Tensor | None = None) -> torch.Tensor:
        buffer = self.buffers[id(s)]
        if product is None:
            buffer.copy_(s.partial)
        else:
            torch.matmul(s.x, s.w, out=buffer)
        return self.op(buffer, "sum", self.group_name)


def _variants(
    ctx: RunContext, sets: list[_Inputs], ours: dict[str, Any], missing: dict[str, str]
) -> tuple[list[Variant], dict[str, Check]]:
    cuda = ctx.device.type == "cuda"
    # One compile for every shape: M and N are dynamic.
    norm = torch.compile(_add_rmsnorm, dynamic=True) if cuda else _add_rmsnorm
    symm = _SymmOneShot(ctx, sets)
    one_shot = {"path": "one_shot"}
    bodies: dict[str, Callable[[_Inputs], Any] | str] = {
        "cublas": lambda s: torch.matmul(s.x, s.w),
        "nccl_all_reduce": lambda s: _all_reduce(s.partial.clone(), ctx),
        "symm_one_shot": (lambda s: symm.reduce(s)) if symm.op else symm.why,
        "nccl_norm": lambda s: norm(_all_reduce(torch.matmul(s.x, s.w), ctx), s.residual, s.weight),
        "symm_norm": (lambda s: norm(symm.reduce(s, product=True), s.residual, s.weight))
        if symm.op
        else symm.why,
    }
    if "all_reduce" in ours and "all_reduce_rmsnorm" in ours and "gemm_ar_rmsnorm" in ours:
        ar, ar_norm, fused = ours["all_reduce"], ours["all_reduce_rmsnorm"], ours["gemm_ar_rmsnorm"]
        bodies.update({
            "ours_all_reduce": lambda s: ar(s.partial, ctx.group, config=one_shot),
            "ours_all_reduce_rmsnorm": lambda s: ar_norm(
                s.partial, s.residual, s.weight, EPS, ctx.group, config=one_shot
            ),
            "cublas_ours_norm": lambda s: ar_norm(
                torch.matmul(s.x, s.w), s.residual, s.weight, EPS, ctx.group, config=one_shot
            ),
            "ours": lambda s: fused(s.x, s.w, s.residual, s.weight, EPS, ctx.group),
        })  # fmt: skip
    else:
        why = "; ".join(sorted(set(missing.values())))
        for name in ("ours_all_reduce", "ours_all_reduce_rmsnorm", "cublas_ours_norm", "ours"):
            bodies[name] = why
    parts = {"cublas", "nccl_all_reduce", "symm_one_shot", "ours_all_reduce"}
    variants, checks = [], {}
    s0 = sets[0]
    ref_sum = _all_reduce(s0.partial.clone(), ctx)
    ref_layer = _layer_out(_add_rmsnorm(ref_sum.clone(), s0.residual, s0.weight))
    for name, body in bodies.items():
        whole = name not in parts
        if isinstance(body, str):
            variants.append(unavailable(name, "skipped", body, whole_op=whole))
            continue
        try:  # capture failures agree in check_variants: no collective runs in between
            replay, out0 = graphed(sets, body) if cuda else (cycled(sets, body), None)
        except Exception as e:  # noqa: BLE001 - recorded; the other variants still run
            variants.append(
                unavailable(name, "error", f"capture raised {type(e).__name__}: {e}", whole)
            )
            continue
        note = "captured once per input set, replayed" if cuda else "eager (CPU ranks)"
        variants.append(Variant(name, replay, note=note, whole_op=whole))
        if name == "cublas":
            continue
        layer = name.endswith("norm") or name == "ours"
        ref = ref_layer if layer else ref_sum
        if cuda:

            def result(replay=replay, out0=out0, layer=layer):
                replay(0)
                return _layer_out(out0) if layer else out0
        else:

            def result(body=body, layer=layer):
                out = body(s0)
                return _layer_out(out) if layer else out

        # Per element too: a layer's output from products of K * world terms, reduced and
        # rounded on the way as NCCL's (2 world - 1 partials) and cuBLAS's (GEMM_PARTIALS)
        # are, then the residual added and the norm taken (two roundings more); an
        # all-reduce alone sums world rounded partials.
        world = ctx.world
        if layer:
            k, partials = s0.x.shape[1] * world, GEMM_PARTIALS + 2 * world + 1
        else:
            k, partials = world, 2 * world - 1
        against = "nccl_norm" if layer else "nccl_all_reduce"
        checks[name] = Check(result, ref, against=against, k=k, partials=partials)
    return variants, checks


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
    bytes_per_set = (m * k + n * k + 3 * m * n + n) * DTYPE.itemsize
    sets = input_sets(lambda seed: _make_inputs(m, k, n, ctx, seed), bytes_per_set, ctx)
    variants, checks = _variants(ctx, sets, ours, missing)
    check_variants(ctx, variants, checks, settings)
    del checks
    progress.step(f"{OP} {m}x{k}x{n}: checked")
    return measure(
        OP, {"M": m, "K": k, "N": n}, variants, ctx, settings, progress,
        flops=2.0 * m * k * n, parts=("cublas", "nccl_all_reduce"),
        busbw_bytes=2 * (ctx.world - 1) / ctx.world * m * n * DTYPE.itemsize,
    )  # fmt: skip


def run(
    ctx: RunContext, shapes: list[tuple[int, int, int]], settings: Settings
) -> list[dict[str, Any]]:
    """All shapes; progress on rank 0."""
    ours, missing = load_ours("all_reduce", ("all_reduce", "all_reduce_rmsnorm", "gemm_ar_rmsnorm"))
    missing.pop("resolve_config", None)  # (no variant here resolves a config)
    return run_shapes(
        OP, shapes, ctx, settings, missing,
        lambda shape, progress: bench_shape(shape, ctx, settings, progress, ours, missing),
    )  # fmt: skip


def format_table(rows: list[dict[str, Any]], world: int | None = None) -> str:
    """ms per replay for every variant, ours' speedup over each baseline, the winner per
    shape, and the goals of the run's world size: more ranks, ours ahead of both baselines
    and within cuBLAS alone + 3 us at M <= 64; one rank (nothing to reduce: ours is cuBLAS
    and the fused add + RMSNorm), ours within 10% of cuBLAS + the compiled norm."""
    table = _format_table(
        rows, target="ours", baselines=("nccl_norm", "symm_norm", "cublas_ours_norm")
    )
    layer = ("nccl_norm", "symm_norm", "cublas_ours_norm", "ours")
    by_shape: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_shape.setdefault(tuple(r["shape"].values()), {})[r["variant"]] = r
    winners, slack_lines = [], []
    for shape, vs in by_shape.items():
        timed = {
            v: vs[v]["ms"] for v in layer if v in vs and vs[v]["status"] == "ok" and vs[v]["ms"]
        }
        if timed:
            best = min(timed, key=timed.get)
            winners.append(f"{'x'.join(map(str, shape))}: {best}")
        ours_ms, cublas_ms = timed.get("ours"), (vs.get("cublas") or {}).get("ms")
        if shape[0] <= 64 and ours_ms and cublas_ms:
            extra_us = (ours_ms - cublas_ms) * 1e3
            verdict = "met" if ours_ms <= cublas_ms + SLACK_MS else "NOT met"
            slack_lines.append(f"{'x'.join(map(str, shape))}: +{extra_us:.1f} us ({verdict})")
    lines = [table, "fastest layer variant per shape: " + "; ".join(winners)]
    if world == 1:
        lines.append(local_goal_line(rows, target="ours", baseline="nccl_norm",
                                     what="cuBLAS + the compiled add + RMSNorm (nccl_norm)"))  # fmt: skip
    else:
        lines.append(
            "ours over cuBLAS alone at M <= 64 (goal: + 3 us at most): " + "; ".join(slack_lines)
        )
        for baseline, what in (("nccl_norm", "NCCL"), ("symm_norm", "torch's one-shot")):
            lines.append(goal_lines(
                rows, target="ours", baseline=baseline,
                goals=[(f"every shape (ahead of {what} + the compiled norm)", lambda s: True, 1.0)],
            ))  # fmt: skip
    lines.append(
        "ms per replay of a captured CUDA graph: median over replays, max over ranks; M x K_local "
        "x N. '!' failed its check, ERR raised, '-' not available."
    )
    return "\n".join(lines)
