"""What the op entries (``bench/ag_gemm.py``, ``gemm_rs.py``, ``gemm_ar.py``, ``moe.py``) share.

An entry builds, per shape, its input sets and its :class:`~bench.harness.Variant` list
(each variant a no-argument call cycling through the sets, see :func:`cycled`) and a
:class:`Check` for each variant that yields a result; then :func:`check_variants` runs
the checks once (max over ranks) and :func:`measure` times the variants and turns them
into rows. :func:`run_shapes` loops over the shapes with a progress bar on rank 0.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from bench.harness import (
    RunContext,
    Settings,
    Variant,
    l2_bytes,
    make_row,
    max_over_ranks,
    medians,
    n_input_sets,
    time_variants,
)
from bench.report import Progress
from overlap_kernels.reference import _UNIT_ROUNDOFF, results_bound, worst_excess

DTYPE = torch.bfloat16
_STATUS_CODE = {"ok": 0, "check_failed": 1, "error": 2, "skipped": 3}
T = TypeVar("T")


def parse_shape(text: str) -> tuple[int, int, int]:
    """'8192x8192x7168' (or with commas) -> (M, K, N)."""
    parts = text.lower().replace(",", "x").split("x")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"shape {text!r} is not MxKxN, e.g. 8192x8192x7168")
    m, k, n = (int(p) for p in parts)
    return m, k, n


def load_ours(op: str, names: Sequence[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """``names`` from ``overlap_kernels``, and as ``resolve_config`` the op module's
    ``running_config`` (the config its plan for given arguments runs), or its
    ``resolve_config`` where it has none; for each one that is missing, why."""
    found: dict[str, Any] = {}
    missing: dict[str, str] = {}
    try:
        import overlap_kernels as ok
    except Exception as e:  # noqa: BLE001 - any import failure means "not benchable", with the reason
        why = f"overlap_kernels is not importable: {type(e).__name__}: {e}"
        return found, dict.fromkeys((*names, "resolve_config"), why)
    for name in names:
        if hasattr(ok, name):
            found[name] = getattr(ok, name)
        else:
            missing[name] = f"overlap_kernels has no attribute {name!r}"
    try:
        module = importlib.import_module(f"overlap_kernels.ops.{op}")
        found["resolve_config"] = getattr(module, "running_config", None) or module.resolve_config
    except Exception as e:  # noqa: BLE001
        missing["resolve_config"] = (
            f"overlap_kernels.ops.{op}.resolve_config: {type(e).__name__}: {e}"
        )
    return found, missing


def torch_symm_mem_op(ctx: RunContext, name: str) -> tuple[Any, str | None, str]:
    """``torch.ops.symm_mem.<name>`` and the group name to pass it, symmetric memory enabled
    for the group; or ``(None, None, why)`` where it is not available."""
    if ctx.device.type != "cuda":
        return None, None, "torch_fused needs CUDA (symmetric memory)"
    try:
        import torch.distributed._symmetric_memory  # registers torch.ops.symm_mem.*
    except Exception as e:  # noqa: BLE001
        return None, None, f"torch.distributed._symmetric_memory not importable: {e}"
    op = getattr(getattr(torch.ops, "symm_mem", None), name, None)
    if op is None:
        return None, None, f"torch.ops.symm_mem.{name} absent in torch {torch.__version__}"
    group_name = (ctx.group or dist.group.WORLD).group_name
    enable_symm_mem(group_name)
    return op, group_name, ""


def enable_symm_mem(group_name: str) -> None:
    """Let PyTorch's symmetric-memory ops use ``group_name``: needed before torch
    2.11, deprecated since (it warns), still accepted. Harmless either way."""
    import torch.distributed._symmetric_memory as symm_mem

    enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", lambda _: True)
    if not enabled(group_name) and hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)


def rel_frobenius(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in fp32; inf when out has NaN/Inf (e.g. unwritten, poisoned tiles)."""
    if out.shape != ref.shape:
        return math.inf
    err = (
        torch.linalg.vector_norm(out.float() - ref.float()) / torch.linalg.vector_norm(ref.float())
    ).item()
    return err if math.isfinite(err) else math.inf


def input_sets(make: Callable[[int], T], bytes_per_set: int, ctx: RunContext) -> list[T]:
    """``make(seed)`` for as many seeds as it takes for a call never to find its inputs in L2."""
    return [make(seed) for seed in range(n_input_sets(bytes_per_set, l2_bytes(ctx.device)))]


def generator(ctx: RunContext, seed: int) -> torch.Generator:
    """Fresh inputs per seed, different on every rank."""
    return torch.Generator(device=ctx.device).manual_seed(seed * 1009 + ctx.rank)


def cycled(sets: Sequence[T], body: Callable[[T], Any]) -> Callable[[], Any]:
    """A no-argument call that runs ``body`` on the next input set each time."""
    it = itertools.cycle(sets)
    return lambda: body(next(it))


def poisoned(shape: tuple[int, int], ctx: RunContext) -> torch.Tensor:
    """An ``out=`` full of NaN: a tile the op never writes fails the check."""
    return torch.full(shape, float("nan"), device=ctx.device, dtype=DTYPE)


def unavailable(name: str, status: str, why: str, whole_op: bool = True) -> Variant:
    return Variant(name, None, status=status, note=why, whole_op=whole_op)


@dataclasses.dataclass
class Check:
    """One correctness check: ``call()`` once, compared with ``ref`` (``against``'s result).

    ``compare(out, ref)`` gives the error (relative Frobenius by default, the row's
    ``rel_err``); the check fails when it reaches ``Settings.rel_tol``, or, with ``exact``,
    when it is not 0 (a copy must be bit for bit). With ``k`` (the products' accumulation
    length) it also fails when any element lies farther from ``ref`` than another valid
    result may (:func:`element_excess`): one wrong row hides in the norm of a large output,
    not there. ``partials``: the partial sums either result rounds on the way (GEMM_PARTIALS
    for a product by torch.matmul, 2 * world - 1 more when reduced through NCCL). Without ``k``, the norm only: results through an
    activation (the MoE layers, tp_mlp), where a per-element bound would be too loose to
    mean anything (overlap_kernels.reference.moe_mlp_reference)."""

    call: Callable[[], Any]
    ref: Any
    against: str = "sequential"
    compare: Callable[[Any, Any], float] = rel_frobenius
    exact: bool = False
    k: int | None = None
    partials: int = 0


# torch.matmul's cuBLAS GEMMs may reduce split-K partials in bf16 (torch's
# allow_bf16_reduced_precision_reduction is on by default), so a product from torch.matmul
# (the sequential path's, cuBLAS per chunk) may round partial sums on the way: 3 rounded
# partials of results_bound's kind cover 16 split-K pieces reduced in bf16 with room to spare
# (bench/test_harness.py emulates them).
GEMM_PARTIALS = 3


def element_excess(out: Any, ref: torch.Tensor, k: int, partials: int = 0) -> tuple[float, str]:
    """(max over the elements of |out - ref| / the bound on it, where that is): above 1,
    ``out`` is wrong. The bound (overlap_kernels.reference.results_bound) is how far two
    valid results of the same K-long fp32-accumulated products, each rounded to the
    coarser of the two dtypes, may lie apart, estimated from ``ref``'s rows."""
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return math.inf, f"shape {tuple(getattr(out, 'shape', ()))}, expected {tuple(ref.shape)}"
    dtype = max((out.dtype, ref.dtype), key=lambda d: _UNIT_ROUNDOFF.get(d, 0.0))
    bound = results_bound(ref, dtype, k, partials)
    ratio, (row, col) = worst_excess(out, ref, bound)
    where = (
        f"element [{row}, {col}] is {out[row, col].item():.6g}, {ref[row, col].item():.6g} there, "
        f"|difference| <= {bound[row, col].item():.3g} allowed (K = {k})"
    )
    return ratio, where


def check_variants(
    ctx: RunContext, variants: list[Variant], checks: dict[str, Check], settings: Settings
) -> None:
    """Run each check once; set the variant's status and rel_err (relative Frobenius error).

    All ranks then agree (max over ranks) so that every rank times the same variants: a
    variant that raised on one rank only must not be entered by the others.
    """
    excess: dict[str, tuple[float, str]] = {}
    for v in variants:
        if v.name not in checks or v.fn is None:
            continue
        try:
            check = checks[v.name]
            out = check.call()
            v.rel_err = check.compare(out, check.ref)
            if check.k is not None and not check.exact:
                excess[v.name] = element_excess(out, check.ref, check.k, check.partials)
            del out
        except Exception as e:  # noqa: BLE001
            # Capped: a Triton CompilationError carries the kernel's source.
            v.status, v.note, v.rel_err = "error", f"raised {type(e).__name__}: {e}"[:2000], None
    # Agree over ranks (every rank lists the same variants in the same order): worst status,
    # worst error and worst element win.
    n = len(variants)
    local = [float(_STATUS_CODE[v.status]) for v in variants] + [v.rel_err or 0.0 for v in variants]
    local += [excess.get(v.name, (0.0, ""))[0] for v in variants]
    agreed = ctx.reduce_max(local) if ctx.reduce_max else local
    for v, code, err, ratio in zip(variants, agreed[:n], agreed[n : 2 * n], agreed[2 * n :]):
        if code >= _STATUS_CODE["error"] and v.fn is not None:
            if v.status == "ok":
                v.status, v.note = "error", "raised on another rank"
            v.fn = None
        if v.status == "ok" and v.name in checks:
            v.rel_err = err if math.isfinite(err) else None
            exact = checks[v.name].exact
            mine, where = excess.get(v.name, (0.0, ""))
            bad = None
            if v.rel_err is None:
                bad = "non-finite output"
            elif exact and err > 0:
                bad = f"not bit-identical (rel_err {err:.3g})"
            elif not exact and err >= settings.rel_tol:
                bad = f"rel_err {err:.3g} >= {settings.rel_tol:g}"
            elif not ratio <= 1.0:  # (NaN included)
                bad = f"{where} (the worst, {ratio:.3g}x its bound)" if mine >= ratio else \
                    f"an element on another rank is {ratio:.3g}x its bound"  # fmt: skip
            if bad is not None:
                v.status = "check_failed"
                against = checks[v.name].against
                v.note = (v.note + "; " if v.note else "") + f"CHECK FAILED vs {against}: {bad}"


def enqueue_ms(call: Callable[[], Any], calls: int, sleep_cycles: int = 0) -> tuple[float, float]:
    """(host ms to enqueue one of ``calls`` calls back to back, device ms per
    call from the first start to the last end). Behind a GPU sleep of
    ``sleep_cycles`` no call waits for the host, so the device time is the
    calls' own; without one it is their period as the host feeds them."""
    host, device, _ = enqueue_timing(call, calls, sleep_cycles)
    return host, device


def enqueue_timing(
    call: Callable[[], Any], calls: int, sleep_cycles: int = 0
) -> tuple[float, float, bool]:
    """:func:`enqueue_ms`'s two times, and whether the GPU sleep was still running
    when the last call had been enqueued. Only then is the host time the host's
    alone: once the sleep has ended, a call that waits for the device (a host
    sync, a full launch queue, a kernel's first load) adds device time to it."""
    import time

    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if sleep_cycles:
        torch.cuda._sleep(sleep_cycles)
    start.record()  # completes when the sleep ends
    begin = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - begin) * 1e3 / calls
    sleep_outlasted_host = bool(sleep_cycles) and not start.query()
    stop.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(stop) / calls, sleep_outlasted_host


def profile_text(
    call: Callable[[], Any], calls: int = 200, top: int = 15, sort: str = "tottime"
) -> str:
    """cProfile of ``calls`` calls: the ``top`` functions by ``sort`` (own time by default)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(sort).print_stats(top)
    return text.getvalue()


# The config the ``ours_autotune`` variant passes: an empty dict is keyed apart from None
# (ops/checks.config_key), so its plan is the one ``autotune(retune=True)`` measured on its
# first call, while ours_auto keeps the shipped tables' choice beside it.
AUTOTUNED: dict[str, Any] = {}
AUTOTUNE_LEGEND = (
    "xours_autotune: ours_auto's time against the opt-in autotune's choice. Where their configs "
    "differ, under 0.97 says the shipped table lost to autotune on this host class; where they "
    "are the same, the ratio is run-to-run noise (docs/tuning.md)."
)


def ours_variants(
    ctx: RunContext,
    sets: Sequence[T],
    ref: torch.Tensor,
    *,
    op: str,
    ours: dict[str, Any],
    missing: dict[str, str],
    operands: Callable[[T], tuple[torch.Tensor, torch.Tensor]],
    out_shape: tuple[int, int],
    forced: dict[str, dict[str, Any]],
    describe: Callable[[Any], str],
    k: int | None = None,
    partials: int = 0,
) -> tuple[list[Variant], dict[str, Check]]:
    """The library's op ``ours[op]`` with each ``forced`` config (the default config with
    those fields replaced; ``skipped`` with the reason where ``resolve_config`` refuses it),
    then ``ours_auto`` (the default config: template and tuned table; ``describe`` of
    what it runs is its note), then ``ours_autotune`` (what the opt-in autotune picks on
    this host, measured on the first call: docs/tuning.md holds the tables to within 3% of it).
    Each is checked against ``ref`` with a NaN-filled ``out=``, on input set 0 (per
    element too where ``k`` is given: :class:`Check`)."""
    names = [*forced, "ours_auto", "ours_autotune"]
    need = (op, "resolve_config")
    if any(n not in ours for n in need):
        why = "; ".join(sorted({missing[n] for n in need if n in missing}))
        return [unavailable(n, "error", why) for n in names], {}
    fn, resolve, group = ours[op], ours["resolve_config"], ctx.group
    x0, w0 = operands(sets[0])
    try:
        auto = resolve(x0, w0, group)
    except Exception as e:  # noqa: BLE001 - recorded, and the baselines still run
        why = f"resolve_config raised {type(e).__name__}: {e}"
        return [unavailable(n, "error", why) for n in names], {}

    def call(cfg: Any) -> Callable[[], Any]:
        return cycled(sets, lambda s: fn(*operands(s), group, config=cfg))

    def check(cfg: Any) -> Check:
        return Check(
            lambda: fn(x0, w0, group, config=cfg, out=poisoned(out_shape, ctx)),
            ref,
            k=k,
            partials=partials,
        )

    variants: list[Variant] = []
    checks: dict[str, Check] = {}
    for name, changes in forced.items():
        try:  # a field this version's config lacks, or a path that cannot run the shape
            cfg = dataclasses.replace(auto, **changes)
            resolved = resolve(x0, w0, group, config=cfg)
        except Exception as e:  # noqa: BLE001 - recorded as skipped; auto still runs
            variants.append(unavailable(name, "skipped", f"{name} cannot run here: {e}"))
            continue
        variants.append(Variant(name, call(cfg), config=dataclasses.asdict(resolved)))
        checks[name] = check(cfg)
    try:
        running = resolve(x0, w0, group)
    except Exception as e:  # noqa: BLE001 - recorded; the other variants still run
        why = f"running_config raised {type(e).__name__}: {e}"
        variants += [unavailable(n, "error", why) for n in ("ours_auto", "ours_autotune")]
        return variants, checks
    auto_note = f"resolved {describe(running)}"
    variants.append(
        Variant("ours_auto", call(None), config=dataclasses.asdict(running), note=auto_note)
    )
    checks["ours_auto"] = check(None)
    if "autotune" not in ours:
        variants.append(unavailable("ours_autotune", "error", missing["autotune"]))
        return variants, checks
    # autotune's measurement is a collective: a failure on every rank alike (the checks,
    # a peer gone) is recorded here; one on a rank alone (its timeout) leaves its peers
    # in the measurement's collectives, as in the library's own autotune.
    try:
        with ours["autotune"](retune=True):
            fn(x0, w0, group, config=AUTOTUNED)  # the signature's first call measures
        chosen = resolve(x0, w0, group, config=AUTOTUNED)
    except Exception as e:  # noqa: BLE001 - recorded; the other variants still run
        why = f"autotune raised {type(e).__name__}: {e}"
        variants.append(unavailable("ours_autotune", "error", why))
        return variants, checks
    variants.append(
        Variant(
            "ours_autotune",
            call(AUTOTUNED),
            config=dataclasses.asdict(chosen),
            note=f"autotune chose {describe(chosen)}",
        )
    )
    checks["ours_autotune"] = check(AUTOTUNED)
    return variants, checks


def time_ms(
    op: str,
    dims: dict[str, int],
    variants: list[Variant],
    ctx: RunContext,
    settings: Settings,
    progress: Progress,
) -> dict[str, float]:
    """Each runnable variant's ms per call: interleaved rounds (one progress step each), the
    median on each rank, then the max over ranks."""
    label = "x".join(map(str, dims.values()))
    samples = time_variants(
        variants,
        settings,
        ctx.clock,
        ctx.barrier,
        on_round=lambda r: progress.step(f"{op} {label}: round {r + 1}/{settings.rounds}"),
    )
    return max_over_ranks(medians(samples), ctx.reduce_max)


def measure(
    op: str,
    dims: dict[str, int],
    variants: list[Variant],
    ctx: RunContext,
    settings: Settings,
    progress: Progress,
    *,
    flops: float,
    parts: tuple[str, str],
    busbw_bytes: float,
) -> list[dict[str, Any]]:
    """Time the variants; rows for each of them, then the bound: ``max`` of the two ``parts``
    (compute alone, communication alone). The communication variant gets no FLOP count and
    a note of its bus bandwidth, ``busbw_bytes`` / its time (nccl-tests' definition)."""
    compute, comm = parts
    for v in variants:
        v.flops = None if v.name == comm else flops
    ms = time_ms(op, dims, variants, ctx, settings, progress)
    bound_ms = max(ms[compute], ms[comm]) if {compute, comm} <= ms.keys() else None
    if comm in ms and ctx.world > 1:
        busbw = busbw_bytes / (ms[comm] * 1e-3) / 1e9
        next(v for v in variants if v.name == comm).note = f"busbw {busbw:.0f} GB/s"
    rows = [make_row(op, dims, v, ms.get(v.name), bound_ms) for v in variants]
    bound = Variant("bound", None, flops=flops, note=f"max({compute}, {comm})")
    rows.append(make_row(op, dims, bound, bound_ms, bound_ms))
    rows[-1]["status"] = "ok" if bound_ms is not None else "skipped"
    return rows


def run_shapes(
    op: str,
    shapes: list[tuple[int, ...]],
    ctx: RunContext,
    settings: Settings,
    missing: dict[str, str],
    bench_shape: Callable[[tuple[int, ...], Progress], list[dict[str, Any]]],
    *,
    missing_status: str = "error",
) -> list[dict[str, Any]]:
    """``bench_shape`` on every shape, with a progress bar on rank 0 (one step for the
    check, one per round). ``missing_status``: what the entry records for a variant whose
    library function is ``missing`` (said here once, before the baselines run)."""
    if missing and ctx.rank == 0:  # say it now, not only after the baselines have run
        why = "; ".join(sorted(set(missing.values())))
        said = f"ours variants will be recorded as '{missing_status}'"
        print(f"WARNING: {op}: {said}: {why}", flush=True)
    rows: list[dict[str, Any]] = []
    with Progress(total=len(shapes) * (1 + settings.rounds), enabled=ctx.rank == 0) as progress:
        for shape in shapes:
            rows += bench_shape(shape, progress)
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def graphed(
    sets: Sequence[T], body: Callable[[T], Any]
) -> tuple[Callable[[int | None], None], Any]:
    """``body`` captured in one CUDA graph per input set, each after an eager call (which
    loads kernels, makes workspaces and NCCL communicators, and prepares our replay);
    ``replay(i)`` replays set i's graph, ``replay()`` the next in turn. Also set 0's
    captured output."""
    for s in sets:
        body(s)
    torch.cuda.synchronize()
    graphs, outs = [], []
    for s in sets:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(body(s))
        graphs.append(graph)
    turn = itertools.cycle(graphs)

    def replay(i: int | None = None) -> None:
        (graphs[i] if i is not None else next(turn)).replay()

    return replay, outs[0]
