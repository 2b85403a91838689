"""Benchmark entry for ``overlap_kernels.ag_gemm``: all_gather(x) @ w.

Per shape (M total, K, N; bf16; x sharded over ranks by rows; weight stored [N, K]
as in nn.Linear and passed as ``w.t()``), in one run and one process group:

    cublas           torch.matmul of the full [M, K] @ [K, N]     (compute alone)
    nccl_all_gather  dist.all_gather_into_tensor of the shards     (communication alone)
    sequential       all_gather, then torch.matmul                 (what overlap must beat)
    torch_fused      torch.ops.symm_mem.fused_all_gather_matmul    (PyTorch async TP)
    ours_local_gemm  overlap_kernels.matmul on the full [M, K]     (our GEMM, no comm)
    ours_fused       ag_gemm with path forced to "fused"
    ours_auto        ag_gemm with its default config (the path it resolved to is recorded)
    bound            max(cublas, nccl_all_gather): perfect overlap (computed, not run)

Before timing, every variant that produces the product is checked against
``sequential`` (relative Frobenius error, max over ranks).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bench.harness import (
    RunContext,
    Settings,
    Variant,
    make_row,
    max_over_ranks,
    medians,
    n_input_sets,
    time_variants,
)
from bench.report import Progress
from bench.report import format_table as _format_table

OP = "ag_gemm"
DEFAULT_SHAPES: list[tuple[int, int, int]] = [
    (8192, 8192, 7168),
    (16384, 8192, 7168),
    (4096, 8192, 2560),
    (2048, 8192, 7168),
]
DTYPE = torch.bfloat16
_STATUS_CODE = {"ok": 0, "check_failed": 1, "error": 2, "skipped": 3}


def parse_shape(text: str) -> tuple[int, int, int]:
    """'8192x8192x7168' (or with commas) -> (M, K, N)."""
    parts = text.lower().replace(",", "x").split("x")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"shape {text!r} is not MxKxN, e.g. 8192x8192x7168")
    m, k, n = (int(p) for p in parts)
    return m, k, n


def load_ours() -> tuple[dict[str, Any], dict[str, str]]:
    """The library's entry points, and for each one that is missing, why."""
    found: dict[str, Any] = {}
    missing: dict[str, str] = {}
    try:
        import overlap_kernels as ok
    except Exception as e:  # noqa: BLE001 - any import failure means "not benchable", with the reason
        why = f"overlap_kernels is not importable: {type(e).__name__}: {e}"
        return found, {n: why for n in ("ag_gemm", "matmul", "AgGemmConfig", "resolve_config")}
    for name in ("ag_gemm", "matmul", "AgGemmConfig"):
        if hasattr(ok, name):
            found[name] = getattr(ok, name)
        else:
            missing[name] = f"overlap_kernels has no attribute {name!r}"
    try:
        from overlap_kernels.ops.ag_gemm import resolve_config

        found["resolve_config"] = resolve_config
    except Exception as e:  # noqa: BLE001
        missing["resolve_config"] = (
            f"overlap_kernels.ops.ag_gemm.resolve_config: {type(e).__name__}: {e}"
        )
    return found, missing


def torch_fused_op(
    ctx: RunContext,
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None, str]:
    """PyTorch's fused all-gather matmul, or None and the reason it is not available."""
    if ctx.device.type != "cuda":
        return None, "torch_fused needs CUDA (symmetric memory)"
    try:
        import torch.distributed._symmetric_memory as symm_mem  # registers torch.ops.symm_mem.*
    except Exception as e:  # noqa: BLE001
        return None, f"torch.distributed._symmetric_memory not importable: {e}"
    op = getattr(getattr(torch.ops, "symm_mem", None), "fused_all_gather_matmul", None)
    if op is None:
        return (
            None,
            f"torch.ops.symm_mem.fused_all_gather_matmul absent in torch {torch.__version__}",
        )
    group_name = (ctx.group or dist.group.WORLD).group_name
    # Needed before torch 2.11; deprecated since (it warns), still accepted. Harmless either way.
    enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", lambda _: True)
    if not enabled(group_name) and hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)

    # return_A=False: like ours, return only the product, not the gathered input.
    def fused(x_local: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return op(x_local, [w], 0, group_name, return_A=False)[1][0]

    return fused, "return_A=False"


def rel_frobenius(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in fp32; inf when out has NaN/Inf (e.g. unwritten, poisoned tiles)."""
    if out.shape != ref.shape:
        return math.inf
    err = (
        torch.linalg.vector_norm(out.float() - ref.float()) / torch.linalg.vector_norm(ref.float())
    ).item()
    return err if math.isfinite(err) else math.inf


@dataclasses.dataclass
class _Inputs:
    x_local: torch.Tensor  # [M/world, K], this rank's shard
    x_full: torch.Tensor  # [M, K], the gathered x (same on every rank)
    w: torch.Tensor  # [K, N], a transposed view of the [N, K] weight
    gathered: torch.Tensor  # [M, K], the all-gather's output buffer


def _make_inputs(m: int, k: int, n: int, ctx: RunContext, seed: int) -> _Inputs:
    gen = torch.Generator(device=ctx.device).manual_seed(seed * 1009 + ctx.rank)
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
    ctx: RunContext, sets: list[_Inputs], ours: dict[str, Any], missing: dict[str, str]
) -> tuple[list[Variant], dict[str, Callable[[], torch.Tensor]]]:
    """Each variant as a no-argument call cycling through the input sets, and for each
    variant that yields the product, a call on input set 0 for the correctness check."""

    def cycled(body: Callable[[_Inputs], Any]) -> Callable[[], Any]:
        it = itertools.cycle(sets)
        return lambda: body(next(it))

    def unavailable(name: str, status: str, why: str) -> Variant:
        return Variant(name, None, status=status, note=why)

    s0 = sets[0]

    def poisoned() -> torch.Tensor:  # an unwritten tile stays NaN and fails the check
        return torch.full(
            (s0.x_full.shape[0], s0.w.shape[1]), float("nan"), device=ctx.device, dtype=DTYPE
        )

    checks: dict[str, Callable[[], torch.Tensor]] = {}
    out: list[Variant] = [
        Variant("cublas", cycled(lambda s: torch.matmul(s.x_full, s.w)), whole_op=False),
        Variant(
            "nccl_all_gather",
            cycled(lambda s: _all_gather(s.gathered, s.x_local, ctx)),
            whole_op=False,
        ),
        Variant(
            "sequential",
            cycled(lambda s: torch.matmul(_all_gather(s.gathered, s.x_local, ctx), s.w)),
        ),
    ]
    fused, why = torch_fused_op(ctx)
    if fused is None:
        out.append(unavailable("torch_fused", "skipped", why))
    else:
        out.append(Variant("torch_fused", cycled(lambda s: fused(s.x_local, s.w)), note=why))
        checks["torch_fused"] = lambda: fused(s0.x_local, s0.w)

    if "matmul" in ours:
        matmul = ours["matmul"]
        out.append(
            Variant("ours_local_gemm", cycled(lambda s: matmul(s.x_full, s.w)), whole_op=False)
        )
        checks["ours_local_gemm"] = lambda: matmul(s0.x_full, s0.w)
    else:
        out.append(
            Variant("ours_local_gemm", None, status="error", note=missing["matmul"], whole_op=False)
        )
    need = ("ag_gemm", "resolve_config")
    if any(n not in ours for n in need):
        why = "; ".join(sorted({missing[n] for n in need if n in missing}))
        return out + [
            unavailable("ours_fused", "error", why),
            unavailable("ours_auto", "error", why),
        ], checks
    ag_gemm, resolve, group = ours["ag_gemm"], ours["resolve_config"], ctx.group
    try:
        auto_cfg = resolve(s0.x_local, s0.w, group)
    except Exception as e:  # noqa: BLE001 - recorded, and the baselines still run
        why = f"resolve_config raised {type(e).__name__}: {e}"
        return out + [
            unavailable("ours_fused", "error", why),
            unavailable("ours_auto", "error", why),
        ], checks
    forced = dataclasses.replace(auto_cfg, path="fused")
    try:
        fused_cfg = resolve(s0.x_local, s0.w, group, config=forced)
    except Exception as e:  # noqa: BLE001 - the fused kernel cannot run this shape; auto still can
        out.append(unavailable("ours_fused", "skipped", f"fused path cannot run: {e}"))
    else:
        out.append(
            Variant(
                "ours_fused",
                cycled(lambda s: ag_gemm(s.x_local, s.w, group, config=forced)),
                config=dataclasses.asdict(fused_cfg),
            )
        )
        checks["ours_fused"] = lambda: ag_gemm(s0.x_local, s0.w, group, config=forced, out=poisoned())
    out.append(
        Variant(
            "ours_auto",
            cycled(lambda s: ag_gemm(s.x_local, s.w, group)),
            config=dataclasses.asdict(auto_cfg),
            note=f"resolved path={auto_cfg.path}",
        )
    )
    checks["ours_auto"] = lambda: ag_gemm(s0.x_local, s0.w, group, out=poisoned())
    return out, checks


def _check(
    ctx: RunContext,
    variants: list[Variant],
    checks: dict[str, Callable[[], Any]],
    ref: torch.Tensor,
    settings: Settings,
) -> None:
    """Run each product variant once against ``sequential``'s ``ref``; set status and rel_err.

    All ranks then agree (max over ranks) so that every rank times the same variants: a
    variant that raised on one rank only must not be entered by the others.
    """
    for v in variants:
        if v.name not in checks or v.fn is None:
            continue
        try:
            v.rel_err = rel_frobenius(checks[v.name](), ref)
        except Exception as e:  # noqa: BLE001
            # Capped: a Triton CompilationError carries the kernel's source.
            v.status, v.note, v.rel_err = "error", f"raised {type(e).__name__}: {e}"[:2000], None
    # Agree over ranks (every rank lists the same variants in the same order): worst status
    # and worst error win.
    n = len(variants)
    local = [float(_STATUS_CODE[v.status]) for v in variants] + [v.rel_err or 0.0 for v in variants]
    agreed = ctx.reduce_max(local) if ctx.reduce_max else local
    for v, code, err in zip(variants, agreed[:n], agreed[n:]):
        if code >= _STATUS_CODE["error"] and v.fn is not None:
            if v.status == "ok":
                v.status, v.note = "error", "raised on another rank"
            v.fn = None
        if v.status == "ok" and v.name in checks:
            v.rel_err = err if math.isfinite(err) else None
            if v.rel_err is None or err >= settings.rel_tol:
                v.status = "check_failed"
                bad = (
                    f"rel_err {err:.3g} >= {settings.rel_tol:g}"
                    if v.rel_err is not None
                    else "non-finite output"
                )
                v.note = (v.note + "; " if v.note else "") + f"CHECK FAILED vs sequential: {bad}"


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
    dims = {"M": m, "K": k, "N": n}
    bytes_per_set = (m // ctx.world + 2 * m + n) * k * DTYPE.itemsize
    l2 = (
        torch.cuda.get_device_properties(ctx.device).L2_cache_size
        if ctx.device.type == "cuda"
        else 0
    )
    sets = [_make_inputs(m, k, n, ctx, seed) for seed in range(n_input_sets(bytes_per_set, l2))]
    variants, checks = _variants(ctx, sets, ours, missing)
    s0 = sets[0]
    ref = torch.matmul(_all_gather(s0.gathered, s0.x_local, ctx), s0.w)  # [M, N], sequential
    _check(ctx, variants, checks, ref, settings)
    del ref
    progress.step(f"{OP} {m}x{k}x{n}: checked")
    flops = 2.0 * m * k * n
    for v in variants:
        v.flops = None if v.name == "nccl_all_gather" else flops
    samples = time_variants(
        variants,
        settings,
        ctx.clock,
        ctx.barrier,
        on_round=lambda r: progress.step(f"{OP} {m}x{k}x{n}: round {r + 1}/{settings.rounds}"),
    )
    ms = max_over_ranks(medians(samples), ctx.reduce_max)
    bound_ms = (
        max(ms["cublas"], ms["nccl_all_gather"])
        if {"cublas", "nccl_all_gather"} <= ms.keys()
        else None
    )
    if "nccl_all_gather" in ms and ctx.world > 1:  # bus bandwidth, as nccl-tests report it
        gathered_bytes = m * k * DTYPE.itemsize
        busbw = (ctx.world - 1) / ctx.world * gathered_bytes / (ms["nccl_all_gather"] * 1e-3) / 1e9
        next(v for v in variants if v.name == "nccl_all_gather").note = f"busbw {busbw:.0f} GB/s"
    rows = [make_row(OP, dims, v, ms.get(v.name), bound_ms) for v in variants]
    bound = Variant("bound", None, flops=flops, note="max(cublas, nccl_all_gather)")
    rows.append(make_row(OP, dims, bound, bound_ms, bound_ms))
    rows[-1]["status"] = "ok" if bound_ms is not None else "skipped"
    del sets
    return rows


def run(
    ctx: RunContext, shapes: list[tuple[int, int, int]], settings: Settings
) -> list[dict[str, Any]]:
    """All shapes; progress on rank 0."""
    ours, missing = load_ours()
    if missing and ctx.rank == 0:  # say it now, not only after the baselines have run
        why = "; ".join(sorted(set(missing.values())))
        print(f"WARNING: ours variants will be recorded as errors: {why}", flush=True)
    rows: list[dict[str, Any]] = []
    with Progress(total=len(shapes) * (1 + settings.rounds), enabled=ctx.rank == 0) as progress:
        for shape in shapes:
            rows += bench_shape(shape, ctx, settings, progress, ours, missing)
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The summary table: ours_auto against sequential and torch_fused, and its % of the bound."""

    def path(r: dict[str, Any]) -> str:
        return "(" + str((r.get("config") or {}).get("path", "?"))[:1] + ")"

    table = _format_table(
        rows, target="ours_auto", baselines=("sequential", "torch_fused"), target_label=path
    )
    legend = (
        "ms per call: median over calls, max over ranks. ours_auto took the (f)used or "
        "(s)equential path. '!' failed its correctness check, ERR raised, '-' not available."
    )
    return table + "\n" + legend
