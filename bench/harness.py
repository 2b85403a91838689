"""Op-agnostic benchmark harness: timing, aggregation, results schema, table.

Every op entry (``bench/<op>.py``) builds a list of :class:`Variant` for one
shape and hands it to :func:`time_variants`; the harness times the variants in
interleaved rounds, takes each variant's median per rank and then the max over
ranks (the slowest rank is the time a tensor-parallel step takes), and turns
the numbers into rows of one fixed schema (:data:`ROW_KEYS`).

This module imports only the standard library at import time, so its pure
functions are testable without torch; torch is imported where a GPU is used.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

SCHEMA_VERSION = 1
TOP_KEYS = ("schema", "date", "gpu", "gpu_count", "world_size", "versions", "env", "settings", "rows")
ROW_KEYS = ("op", "shape", "variant", "status", "ms", "tflops", "pct_of_bound", "rel_err", "config", "note")
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
DEFAULT_RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Settings:
    """How long to measure. ``iters`` timed calls per variant, split over ``rounds``."""

    iters: int = 100
    rounds: int = 10
    warmup: int = 10
    rel_tol: float = 1e-2  # bf16 GEMM with K=8192, fp32 accumulate: ~3e-3 observed is typical

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


# ----------------------------------------------------------------------------- timing


class WallClock:
    """Host timer: for CPU runs and tests. GPU work is timed with :class:`CudaClock`."""

    def start(self) -> float:
        return time.perf_counter()

    def stop(self) -> float:
        return time.perf_counter()

    def elapsed_ms(self, marks: list[tuple[Any, Any]]) -> list[float]:
        return [(b - a) * 1e3 for a, b in marks]


class CudaClock:
    """CUDA events on the current stream: no host sync between iterations, one at the end."""

    def __init__(self) -> None:
        import torch

        self._torch = torch

    def _event(self) -> Any:
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self) -> Any:
        return self._event()

    def stop(self) -> Any:
        return self._event()

    def elapsed_ms(self, marks: list[tuple[Any, Any]]) -> list[float]:
        self._torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in marks]


def round_orders(names: Sequence[str], rounds: int) -> list[list[str]]:
    """Variant order per round, rotated so that no variant always runs first or after the same one."""
    n = len(names)
    return [[names[(r + i) % n] for i in range(n)] for r in range(rounds)] if n else []


def time_variants(
    variants: Sequence[Variant],
    settings: Settings,
    clock: Any,
    barrier: Callable[[], None] = lambda: None,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, list[float]]:
    """Per-iteration times (ms) of every runnable variant on this rank, warm-up excluded.

    ``barrier`` aligns the ranks before each block of iterations, so a collective's time
    is not inflated by one rank still finishing the previous variant.
    """
    runnable = {v.name: v.fn for v in variants if v.fn is not None}
    for fn in runnable.values():  # warm-up: compilation, autotuning, NCCL channel setup
        for _ in range(settings.warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in runnable}
    for r, order in enumerate(round_orders(list(runnable), settings.rounds)):
        for name in order:
            fn = runnable[name]
            barrier()
            marks = []
            for _ in range(settings.iters_per_round):
                t0 = clock.start()
                fn()
                marks.append((t0, clock.stop()))
            samples[name].extend(clock.elapsed_ms(marks))
        if on_round is not None:
            on_round(r)
    return samples


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(xs) for name, xs in samples.items() if xs}


def max_over_ranks(values: dict[str, float], reduce_max: Callable[[list[float]], list[float]] | None) -> dict[str, float]:
    """Elementwise max over ranks; every rank must pass the same keys (same variants ran)."""
    names = sorted(values)
    if reduce_max is None:
        return dict(values)
    return dict(zip(names, reduce_max([values[n] for n in names])))


def torch_reduce_max(group: Any = None) -> Callable[[list[float]], list[float]] | None:
    """all_reduce(MAX) over ``group`` when torch.distributed is up with more than one rank."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def reduce(xs: list[float]) -> list[float]:
        t = torch.tensor(xs, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.tolist()

    return reduce


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


def n_input_sets(bytes_per_set: int, l2_bytes: int, max_sets: int = 4) -> int:
    """How many input sets to rotate through so a call never finds its inputs in L2."""
    if l2_bytes <= 0 or bytes_per_set >= 2 * l2_bytes:
        return 1
    return min(max_sets, max(2, math.ceil(3 * l2_bytes / max(1, bytes_per_set))))


def shape_str(shape: dict[str, int]) -> str:
    return "x".join(str(v) for v in shape.values())


def make_row(op: str, shape: dict[str, int], v: Variant, ms: float | None, bound_ms: float | None) -> dict[str, Any]:
    timed = ms is not None and v.status in ("ok", "check_failed")
    return {
        "op": op,
        "shape": dict(shape),
        "variant": v.name,
        "status": v.status,
        "ms": ms if timed else None,
        "tflops": tflops(v.flops, ms) if timed else None,
        "pct_of_bound": pct_of_bound(bound_ms, ms) if timed else None,
        "rel_err": v.rel_err,
        "config": v.config,
        "note": v.note,
    }


# ----------------------------------------------------------------------------- results file


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (file-name safe)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)


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
    doc = {
        "schema": SCHEMA_VERSION,
        "date": date.isoformat(),
        "gpu": gpu,
        "gpu_count": world,  # one process per GPU
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
    missing = [k for k in TOP_KEYS if k not in doc]
    if missing:
        raise ValueError(f"results document lacks keys {missing}")
    for i, row in enumerate(doc["rows"]):
        if tuple(sorted(row)) != tuple(sorted(ROW_KEYS)):
            raise ValueError(f"row {i} has keys {sorted(row)}, expected {sorted(ROW_KEYS)}")
        if row["status"] not in STATUSES:
            raise ValueError(f"row {i} has status {row['status']!r}, expected one of {STATUSES}")


def write_results(doc: dict[str, Any], results_dir: Path | str = DEFAULT_RESULTS_DIR) -> Path:
    """Write ``doc`` under ``results_dir``, and a copy into ``$OUT`` when that is set."""
    validate_results(doc)
    op = doc["rows"][0]["op"] if doc["rows"] else "bench"
    date = _dt.datetime.fromisoformat(doc["date"])
    path = Path(results_dir) / results_filename(op, doc["gpu"], doc["world_size"], date)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / path.name)
    return path


def collect_versions(extra: dict[str, str | None] | None = None) -> dict[str, str | None]:
    """Python, torch, triton, CUDA, NCCL and overlap_kernels versions (None where absent)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    try:
        import torch

        versions["torch"] = torch.__version__
        versions["cuda"] = torch.version.cuda
        nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        versions["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else (str(nccl) if nccl else None)
    except Exception:  # noqa: BLE001 - a version probe must never stop a benchmark
        versions.update(torch=None, cuda=None, nccl=None)
    for mod in ("triton", "overlap_kernels"):
        try:
            versions[mod] = getattr(__import__(mod), "__version__", "unknown")
        except Exception:  # noqa: BLE001
            versions[mod] = None
    versions.update(extra or {})
    return versions


def collect_env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ENV_KEYS}


# ----------------------------------------------------------------------------- table


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(
    rows: list[dict[str, Any]],
    *,
    target: str,
    baselines: Sequence[str],
    bound: str = "bound",
    target_label: Callable[[dict[str, Any]], str] | None = None,
) -> str:
    """One line per shape: each variant's ms, ``target``'s speedup over each baseline and its
    % of the bound; then the geometric-mean speedup over each baseline.

    A cell reads '-' when the variant did not run, 'ERR' when it raised, and ends in '!'
    when it ran but failed its correctness check.
    """
    variants: list[str] = []
    by_shape: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["variant"] not in variants:
            variants.append(r["variant"])
        by_shape.setdefault(shape_str(r["shape"]), {})[r["variant"]] = r

    def cell(r: dict[str, Any] | None) -> str:
        if r is None or r["status"] == "skipped":
            return "-"
        if r["status"] == "error":
            return "ERR"
        return _fmt(r["ms"], ".3f") + ("!" if r["status"] == "check_failed" else "")

    head = ["shape"] + variants + [f"x{b}" for b in baselines] + ["%bound"]
    lines, ratios = [], {b: [] for b in baselines}
    for shape, vs in by_shape.items():
        t = vs.get(target)
        t_ms = t["ms"] if t is not None else None
        line = [shape] + [cell(vs.get(v)) for v in variants]
        if t is not None and target_label is not None and line[1 + variants.index(target)] not in ("-", "ERR"):
            line[1 + variants.index(target)] += target_label(t)
        for b in baselines:
            s = speedup(vs[b]["ms"] if b in vs else None, t_ms)
            ratios[b].append(s)
            line.append(_fmt(s, ".2f"))
        line.append(_fmt(pct_of_bound(vs[bound]["ms"] if bound in vs else None, t_ms), ".0f"))
        lines.append(line)
    widths = [max(len(str(x[i])) for x in [head] + lines) for i in range(len(head))]
    out = ["  ".join(str(x).rjust(w) for x, w in zip(line, widths)) for line in [head] + lines]
    out.insert(1, "-" * len(out[0]))
    for b in baselines:
        out.append(f"geomean speedup of {target} over {b}: {_fmt(geomean(ratios[b]), '.3f')}")
    return "\n".join(out)


# ----------------------------------------------------------------------------- progress


@dataclass
class Progress:
    """A progress bar on rank 0: rich if installed, else tqdm, else one printed line per step."""

    total: int
    enabled: bool = True
    _impl: Any = field(default=None, init=False)
    _task: Any = field(default=None, init=False)
    _n: int = field(default=0, init=False)

    def __enter__(self) -> Progress:
        if not self.enabled:
            return self
        try:
            from rich.progress import Progress as RichProgress

            self._impl = ("rich", RichProgress(transient=False))
            self._impl[1].start()
            self._task = self._impl[1].add_task("bench", total=self.total)
        except ImportError:
            try:
                from tqdm import tqdm

                self._impl = ("tqdm", tqdm(total=self.total, dynamic_ncols=True))
            except ImportError:
                self._impl = ("print", None)
        return self

    def step(self, desc: str) -> None:
        if not self.enabled:
            return
        self._n += 1
        kind, bar = self._impl
        if kind == "rich":
            bar.update(self._task, advance=1, description=desc)
        elif kind == "tqdm":
            bar.set_description(desc)
            bar.update(1)
        else:
            print(f"[{self._n}/{self.total}] {desc}", flush=True)

    def __exit__(self, *exc: object) -> None:
        if self.enabled and self._impl[0] in ("rich", "tqdm"):
            self._impl[1].stop() if self._impl[0] == "rich" else self._impl[1].close()
