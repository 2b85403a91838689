"""Op-agnostic benchmark harness: timing, aggregation, the results schema.

Every op entry (``bench/<op>.py``) builds a list of :class:`Variant` for one
shape and hands it to :func:`time_variants`; the harness times the variants in
interleaved rounds, takes each variant's median per rank and then the max over
ranks (the slowest rank is the time a tensor-parallel step takes), and turns
the numbers into rows of one fixed schema (:data:`ROW_KEYS`). The table and the
progress bar for people live in ``bench/report.py``.

The timing itself (clocks, rounds, medians, max over ranks) is
``overlap_kernels/timing.py``, which ``overlap_kernels.autotune`` times its
candidates with too; its names are importable from here as before. Importing
this module imports overlap_kernels (and torch); its pure functions need no GPU.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# Re-exported: the op entries, bench/cli.py and the tests take these names from here.
from overlap_kernels.timing import (  # noqa: F401
    CudaClock,
    WallClock,
    call_marks,
    l2_bytes,
    max_over_ranks,
    medians,
    n_input_sets,
    round_orders,
    time_calls,
    torch_reduce_max,
)

SCHEMA_VERSION = 1
TOP_KEYS = (
    "schema",
    "date",
    "host",
    "gpu",
    "gpu_count",
    "world_size",
    "versions",
    "env",
    "settings",
    "rows",
)
# A document without a host is still valid: ``python -m bench.store add --host`` names it.
OPTIONAL_KEYS = ("host",)
ROW_KEYS = (
    "op",
    "shape",
    "variant",
    "status",
    "ms",
    "tflops",
    "pct_of_bound",
    "rel_err",
    "config",
    "note",
)
# "ok": timed and checked (or nothing to check); "check_failed": timed, but its output is wrong;
# "error": it raised, so it was not timed; "skipped": not available here (reason in "note").
STATUSES = ("ok", "check_failed", "error", "skipped")
# Recorded because each one changes what NCCL / symmetric memory do (multicast must stay off).
ENV_KEYS = (
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
    "TORCH_SYMM_MEM_ENABLE_NATIVE_ASYNC_TP",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "CUDA_VISIBLE_DEVICES",
    "TRITON_INTERPRET",
)


@dataclass
class Settings:
    """How long to measure. ``iters`` timed calls per variant, split over ``rounds``."""

    iters: int = 100
    rounds: int = 10
    warmup: int = 10
    # Ours vs the sequential (cuBLAS) result, both fp32-accumulated and rounded
    # to bf16 (unit roundoff 2**-8): each is ~1e-3 (RMS) from the exact product,
    # so they differ by ~2e-3 (1.7e-3 measured by bench/tune_gemm.py); 1e-2 is
    # 5x that, while a missing or misplaced chunk gives an O(1) error.
    rel_tol: float = 1e-2

    @property
    def iters_per_round(self) -> int:
        return max(1, math.ceil(self.iters / max(1, self.rounds)))


@dataclass
class RunContext:
    """Where an op entry runs: this rank, the group, and how to time and sync there."""

    rank: int
    world: int
    device: Any  # torch.device
    group: Any  # torch.distributed.ProcessGroup, or None for the default group
    clock: Any  # CudaClock or WallClock
    barrier: Callable[[], None]
    reduce_max: Callable[[list[float]], list[float]] | None  # None: one rank, nothing to reduce


@dataclass
class Variant:
    """One thing to time for one shape. ``fn`` is None when the variant cannot run."""

    name: str
    fn: Callable[[], Any] | None
    flops: float | None = None
    status: str = "ok"
    note: str = ""
    rel_err: float | None = None
    config: dict[str, Any] | None = None
    whole_op: bool = True  # False for a part alone (GEMM or collective): no % of bound then


# ----------------------------------------------------------------------------- timing


def time_variants(
    variants: Sequence[Variant],
    settings: Settings,
    clock: Any,
    barrier: Callable[[], None] = lambda: None,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, list[float]]:
    """Per-iteration times (ms) of every runnable variant on this rank, warm-up excluded:
    ``settings.warmup`` untimed calls each, then :func:`overlap_kernels.timing.time_calls`.

    ``barrier`` aligns the ranks before each block of iterations, so a collective's time
    is not inflated by one rank still finishing the previous variant.
    """
    runnable = {v.name: v.fn for v in variants if v.fn is not None}
    for fn in runnable.values():  # warm-up: compilation, autotuning, NCCL channel setup
        for _ in range(settings.warmup):
            fn()
    return time_calls(runnable, settings.rounds, settings.iters_per_round, clock, barrier, on_round)


# ----------------------------------------------------------------------------- metrics


def tflops(flops: float | None, ms: float | None) -> float | None:
    return None if not flops or not ms else flops / (ms * 1e-3) / 1e12


def pct_of_bound(bound_ms: float | None, ms: float | None) -> float | None:
    """100 = at the bound (perfect overlap); 50 = twice as slow as the bound."""
    return None if not bound_ms or not ms else 100.0 * bound_ms / ms


def speedup(base_ms: float | None, ms: float | None) -> float | None:
    return None if not base_ms or not ms else base_ms / ms


def geomean(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in vals) / len(vals)) if vals else None


def shape_str(shape: dict[str, int]) -> str:
    return "x".join(str(v) for v in shape.values())


def jsonable(x: Any) -> Any:
    """``x`` with anything strict JSON cannot hold (enums, dtypes, inf) turned into strings,
    so that one odd config field can never lose a whole run's results at write time."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x if x is None or isinstance(x, (bool, int, float, str)) else str(x)


def make_row(
    op: str, shape: dict[str, int], v: Variant, ms: float | None, bound_ms: float | None
) -> dict[str, Any]:
    timed = ms is not None and v.status in ("ok", "check_failed")
    return {
        "op": op,
        "shape": dict(shape),
        "variant": v.name,
        "status": v.status,
        "ms": ms if timed else None,
        "tflops": tflops(v.flops, ms) if timed else None,
        "pct_of_bound": pct_of_bound(bound_ms, ms) if timed and v.whole_op else None,
        "rel_err": v.rel_err,
        "config": jsonable(v.config),
        "note": v.note,
    }


# ----------------------------------------------------------------------------- results file


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (file-name safe)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0)


def results_filename(op: str, gpu: str, world: int, date: _dt.datetime) -> str:
    # Seconds in the stamp: two runs on one day must not overwrite each other.
    return f"{op}_{gpu_slug(gpu)}_x{world}_{date.strftime('%Y%m%dT%H%M%SZ')}.json"


def build_results(
    rows: list[dict[str, Any]],
    *,
    gpu: str,
    world: int,
    versions: dict[str, str | None],
    env: dict[str, str | None],
    settings: dict[str, Any],
    date: _dt.datetime,
) -> dict[str, Any]:
    """The schema-1 document of one run (bench/store.py keeps its rows), made on the
    machine that ran it (its host: :func:`collect_host`); one process per GPU, so
    gpu_count == world_size."""
    doc = {
        "schema": SCHEMA_VERSION,
        "date": date.isoformat(),
        "host": collect_host(),
        "gpu": gpu,
        "gpu_count": world,
        "world_size": world,
        "versions": versions,
        "env": env,
        "settings": settings,
        "rows": rows,
    }
    validate_results(doc)
    return doc


def validate_results(doc: dict[str, Any]) -> None:
    """Raise ValueError if ``doc`` is not a schema-1 results document."""
    if doc.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"unknown results schema {doc.get('schema')!r}, expected {SCHEMA_VERSION}")
    missing = [k for k in TOP_KEYS if k not in doc and k not in OPTIONAL_KEYS]
    if missing:
        raise ValueError(f"results document lacks keys {missing}")
    for i, row in enumerate(doc["rows"]):
        if tuple(sorted(row)) != tuple(sorted(ROW_KEYS)):
            raise ValueError(f"row {i} has keys {sorted(row)}, expected {sorted(ROW_KEYS)}")
        if row["status"] not in STATUSES:
            raise ValueError(f"row {i} has status {row['status']!r}, expected one of {STATUSES}")


def collect_host() -> str:
    """The machine's name and, where CUDA has GPUs, the first 8 hex digits of each GPU's
    UUID: hosts of one GPU kind differ (docs/performance.md), and a container's name
    alone may not tell two machines apart."""
    name = platform.node() or "unknown"
    try:
        import torch

        if torch.cuda.is_available():
            uuids = [str(torch.cuda.get_device_properties(i).uuid).removeprefix("GPU-")[:8]
                     for i in range(torch.cuda.device_count())]  # fmt: skip
            return f"{name}; GPUs {','.join(uuids)}"
    except Exception:  # noqa: BLE001 - a host probe must never stop a benchmark
        pass
    return name


def collect_versions() -> dict[str, str | None]:
    """Python, torch, triton, CUDA, NCCL and overlap_kernels versions (None where absent)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    try:
        import torch

        versions["torch"] = torch.__version__
        versions["cuda"] = torch.version.cuda
        nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        versions["nccl"] = (
            ".".join(map(str, nccl)) if isinstance(nccl, tuple) else (str(nccl) if nccl else None)
        )
    except Exception:  # noqa: BLE001 - a version probe must never stop a benchmark
        versions.update(torch=None, cuda=None, nccl=None)
    for mod in ("triton", "overlap_kernels"):
        try:
            versions[mod] = getattr(__import__(mod), "__version__", "unknown")
        except Exception:  # noqa: BLE001
            versions[mod] = None
    return versions


def collect_env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ENV_KEYS}
