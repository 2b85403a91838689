"""Host time per call at decode sizes: ``python -m bench.host_time [--cpu] [--store FILE]``.

At decode sizes (M = 16, 64, 256) a call's time is its host time (Python and
launches), not its device time. For a call repeated with one signature, after
warm-up, this measures two times per call:

    enqueue   host us per call while the GPU is held busy by a long
              ``torch.cuda._sleep`` enqueued first, so the host never waits for
              the device (bench.common.enqueue_timing). A batch whose sleep ran
              out before the host was done is flagged (``*`` in the table): the
              host may have waited for the device, so its time may hold device time;
    b2b       synchronize, the calls back to back, synchronize: wall us per call.

Ops: ``matmul`` in this process on one GPU, ``overlap_kernels.matmul(a, b)``
against ``torch.matmul(a, b)`` (b = weight.t(), the nn.Linear layout); bound:
ours' enqueue <= 2x torch's. ``ag_gemm`` (x [M/world, K]), ``gemm_rs`` and
``gemm_ar`` (x [M, K/world], w [K/world, N]) on ``--world`` ranks sharing one
GPU (overlap_kernels.launch.run_ranks, gloo between them), where device times
mean nothing and host times do, or spread over ``--gpus`` GPUs (whose drivers
are not shared then), each beside its pair (torch.matmul then the NCCL
collective, each output allocated; torch.matmul alone on one rank, where the
op is torch's product alone); bound: enqueue <= 25 us on a fused path, <= 1.1x
the pair's on the plain one (``--world 1``: every op). Every rank makes the
same calls in the same order: a fused call waits for its peers on the device,
and every rank's sleep delays all alike. Every call (each op at each M) is
warmed up first, then timed in ``--reps`` rounds in which each takes one batch
in turn: a phase of the host that slows everything (they last seconds on
shared hosts) falls on every call alike. Each rank takes the median of a
call's batches; the table and the rows give the max over ranks.

Rows (schema 1, op ``host_time``): variant ``<who>_<op>_<measure>``
(``ours_gemm_ar_enqueue``, ``torch_matmul_b2b``, ``torch_gemm_ar_enqueue`` the pair's, ...). ``shape`` is the whole
problem (M, K, N); each rank holds its slice. ``ms`` is milliseconds, as in
every schema-1 file; the note gives us. The ``ours_*_enqueue`` rows'
``pct_of_bound`` is bound / time x 100 (>= 100: met), and their ``config``
holds the bound, whether it was met, the path the op ran and its config.

``--pin-cores`` times each rank on a physical core of its own (the OS may
otherwise run a rank beside another rank or a library's threads); the rows
keep every batch's time per rank (``per_rank_batches_us``), so a median that
one rank's slow batches decided shows.

``--cpu`` (automatic without CUDA): tiny shapes through Triton's interpreter on
gloo ranks, no GPU sleep. It shows the code paths work; its times mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import harness, store
from bench.report import grid

DTYPE = torch.bfloat16
FUSED_OPS = ("ag_gemm", "gemm_rs", "gemm_ar")
OPS = ("matmul", *FUSED_OPS)
# The goals set for a repeated call's host time: our GEMM core within twice
# cuBLAS's, a fused call within 25 us, and a call of the plain path (the only
# path on one rank, where the op is torch's product alone: ops/paths.LocalGemm)
# within 10% of its pair's (torch.matmul and the collective; torch.matmul alone
# on one rank) timed beside it.
MATMUL_BOUND_X = 2.0
FUSED_BOUND_US = 25.0
PLAIN_BOUND_X = 1.1
# torch.cuda._sleep counts SM clock cycles; H100 and H200 top out at 1.98 GHz,
# so at 2e6 cycles per ms a sleep lasts at least the time asked.
_CYCLES_PER_MS = 2_000_000


@dataclasses.dataclass(frozen=True)
class HostTimeSettings:
    """What one run measures (plain data: it is passed to the rank processes)."""

    m_values: tuple[int, ...] = (16, 64, 256)
    k: int = 7168
    n: int = 8192
    world: int = 2
    gpus: int = 1  # GPUs the fused ops' ranks are spread over (1: they share one)
    ops: tuple[str, ...] = OPS
    warmup: int = 20
    calls: int = 50  # per timed batch: few enough that the launch queue never fills
    reps: int = 9  # medians of more batches: one slow batch on one rank must not decide
    # 50 calls at up to 200 us of host time each take 10 ms: a 5x margin.
    sleep_ms: float = 50.0
    cpu: bool = False
    # Each rank's timing thread on a physical core of its own while it times: the
    # scheduler then cannot put it beside another rank or a library's threads.
    pin_cores: bool = False
    # (op, JSON object) pairs: a config passed to that op's calls, e.g.
    # ("ag_gemm", '{"path": "fused"}') where decode sizes take the plain path.
    configs: tuple[tuple[str, str], ...] = ()

    def config_of(self, op: str) -> dict[str, Any] | None:
        return next((json.loads(text) for name, text in self.configs if name == op), None)


# Tiny shapes, few calls: the interpreter takes ~0.1 s per call.
CPU_DEFAULTS = {"m_values": (16,), "k": 64, "n": 64, "world": 2, "warmup": 2, "calls": 2, "reps": 2}


@dataclasses.dataclass
class OpTimes:
    """One op at one M: us per call (max over ranks for the fused ops)."""

    op: str
    m: int
    ours_enqueue_us: float | None = None
    ours_b2b_us: float | None = None
    torch_enqueue_us: float | None = None
    torch_b2b_us: float | None = None
    sleep_outlasted_host: bool = True  # in every batch, on every rank
    path: str = "-"
    config: dict[str, Any] | None = None
    per_rank_us: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    batches_us: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # this rank's
    warmup_calls: int = 0
    error: str | None = None

    def bound_us(self) -> float | None:
        """matmul: MATMUL_BOUND_X torch.matmul's enqueue; a fused op's plain path
        (``path`` sequential): PLAIN_BOUND_X its pair's (the torch_* times); a fused call:
        FUSED_BOUND_US."""
        if self.op != "matmul" and self.path != "sequential":
            return FUSED_BOUND_US
        torch_us = self.torch_enqueue_us
        times = MATMUL_BOUND_X if self.op == "matmul" else PLAIN_BOUND_X
        return None if torch_us is None else times * torch_us

    def met(self) -> bool | None:
        bound = self.bound_us()
        if bound is None or self.ours_enqueue_us is None:
            return None
        return self.ours_enqueue_us <= bound


# ----------------------------------------------------------------------------- measuring


def operands(
    op: str, m: int, s: HostTimeSettings, world: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (x, w) for ``op`` at M = ``m``; w is an nn.Linear weight [N, K], transposed."""
    rows = m // world if op == "ag_gemm" else m
    k = s.k // world if op in ("gemm_rs", "gemm_ar") else s.k
    x = torch.randn(rows, k, device=device, dtype=DTYPE)
    weight = torch.randn(s.n, k, device=device, dtype=DTYPE)
    return x, weight.t()


def warm_up(op: str, call: Callable[[], Any], count: int) -> int:
    """``count`` calls (compilation, the signature's plan); the number made."""
    for _ in range(count):
        call()
    return count


def enqueue_us(
    call: Callable[[], Any], s: HostTimeSettings, device: torch.device
) -> tuple[float, bool]:
    """(host us per call behind a GPU sleep, whether the sleep outlasted the host).
    On CPU, the calls' wall time: there is nothing to enqueue behind."""
    if device.type != "cuda":
        begin = time.perf_counter()
        for _ in range(s.calls):
            call()
        return (time.perf_counter() - begin) * 1e6 / s.calls, True
    from bench.common import enqueue_timing

    host_ms, _, outlasted = enqueue_timing(call, s.calls, int(s.sleep_ms * _CYCLES_PER_MS))
    return host_ms * 1e3, outlasted


def back_to_back_us(call: Callable[[], Any], calls: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    begin = time.perf_counter()
    for _ in range(calls):
        call()
    sync()
    return (time.perf_counter() - begin) * 1e6 / calls


def physical_cores() -> list[int]:
    """One logical CPU of each physical core this process may run on."""
    seen, cores = set(), []
    for cpu in sorted(os.sched_getaffinity(0)):
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        key = siblings.read_text().strip() if siblings.exists() else str(cpu)
        if key not in seen:
            seen.add(key)
            cores.append(cpu)
    return cores


@contextlib.contextmanager
def pinned(index: int | None):
    """The calling thread on physical core ``index + 1`` (core 0 left to the
    system) while inside; ``None``: nothing changes. Threads started earlier (a
    process group's, NCCL's) keep their CPUs; a thread's mask is its own on Linux."""
    if index is None:
        yield
        return
    before = os.sched_getaffinity(0)
    cores = physical_cores()
    if index + 1 >= len(cores):
        print(f"host_time: {len(cores)} physical cores: rank {index} shares one", file=sys.stderr)
    os.sched_setaffinity(0, {cores[(index + 1) % len(cores)]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def timed_batches(
    calls: dict[str, Callable[[], Any]],
    s: HostTimeSettings,
    device: torch.device,
    barrier: Callable[[], None],
    core: int | None = None,
) -> tuple[dict[str, tuple[float, float]], dict[str, bool], dict[str, list[float]]]:
    """Each call's (enqueue, b2b) us, medians over ``s.reps`` rounds in which every
    call takes a batch in turn (the order reversed every other round: a phase of
    the host that slows everything falls on every call alike), whether every
    sleep outlasted the host in each call's batches, and each call's enqueue us
    of every batch (their spread); timed on physical core ``core`` (:func:`pinned`)
    where ``s.pin_cores``."""
    enqueue: dict[str, list[float]] = {name: [] for name in calls}
    b2b: dict[str, list[float]] = {name: [] for name in calls}
    outlasted = dict.fromkeys(calls, True)
    with pinned(core if s.pin_cores else None):
        for rep in range(s.reps):
            for name in list(calls)[:: -1 if rep % 2 else 1]:
                barrier()
                us, held = enqueue_us(calls[name], s, device)
                enqueue[name].append(us)
                outlasted[name] &= held
                barrier()
                b2b[name].append(back_to_back_us(calls[name], s.calls, device))
    med = statistics.median
    return {name: (med(enqueue[name]), med(b2b[name])) for name in calls}, outlasted, enqueue


def running_path(
    op: str, x: torch.Tensor, w: torch.Tensor, config: dict[str, Any] | None
) -> tuple[str, dict[str, Any] | None]:
    """The path a call of ``op`` runs and its config, from the op module's
    ``running_config`` or ``resolve_config`` where this version has one, else
    "unknown". Every rank calls it: where it measures, it is a collective."""
    try:
        module = importlib.import_module(f"overlap_kernels.ops.{op}")
        resolve = getattr(module, "running_config", None) or module.resolve_config
        cfg = resolve(x, w, config=config)
    except Exception:  # noqa: BLE001 - what ran is a note; the times stand without it
        return "unknown", None
    as_dict = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None
    return str(getattr(cfg, "path", "unknown")), as_dict


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]  # a Triton CompilationError carries the source


def measure_matmul(s: HostTimeSettings, device: torch.device) -> list[OpTimes]:
    """Ours against torch.matmul at every M, in this process (one GPU, no process
    group), all of them timed in the same rounds."""
    import overlap_kernels as ok

    cfg = s.config_of("matmul")
    out, calls = [], {}
    for m in s.m_values:
        a, b = operands("matmul", m, s, 1, device)
        mine = {
            f"ours@{m}": lambda a=a, b=b: ok.matmul(a, b, cfg),
            f"torch@{m}": lambda a=a, b=b: torch.matmul(a, b),
        }
        times = OpTimes("matmul", m)
        try:
            times.warmup_calls = max(warm_up("matmul", fn, s.warmup) for fn in mine.values())
        except Exception as e:  # noqa: BLE001 - recorded; the other shapes still run
            times.error = _error(e)
        else:
            calls.update(mine)
        out.append(times)
    try:
        medians, outlasted, batches = timed_batches(calls, s, device, lambda: None, core=0)
    except Exception as e:  # noqa: BLE001 - recorded; the fused ops still run
        for times in out:
            times.error = times.error or _error(e)
        return out
    for times in out:
        if times.error is not None:
            continue
        ours, theirs = f"ours@{times.m}", f"torch@{times.m}"
        (oe, ob), (te, tb) = medians[ours], medians[theirs]
        times.ours_enqueue_us, times.ours_b2b_us = oe, ob
        times.torch_enqueue_us, times.torch_b2b_us = te, tb
        times.sleep_outlasted_host = outlasted[ours] and outlasted[theirs]
        times.per_rank_us = [
            {"ours_enqueue": oe, "ours_b2b": ob, "torch_enqueue": te, "torch_b2b": tb,
             "ours_batches": batches[ours], "torch_batches": batches[theirs]}
        ]  # fmt: skip
    return out


def _on_any_rank(flag: bool) -> bool:
    import torch.distributed as dist

    on = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([float(flag)], device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def pair(op: str, x: torch.Tensor, w: torch.Tensor, world: int) -> Callable[[], torch.Tensor]:
    """``op``'s pair as a caller writes it: torch.matmul and the collective (c10d's, on
    the default group), each output allocated; torch.matmul alone on one rank, where
    the collective moves nothing. gloo has no reduce-scatter: gemm_rs's pair there
    all-reduces and keeps its rows, as the op's plain path does."""
    import torch.distributed as dist

    from overlap_kernels.runtime.collectives import all_gather_single, reduce_scatter_single

    if world == 1:
        return lambda: torch.matmul(x, w)
    rank, m = dist.get_rank(), x.shape[0]

    def ag_gemm() -> torch.Tensor:
        gathered = torch.empty((m * world, x.shape[1]), dtype=x.dtype, device=x.device)
        all_gather_single(gathered, x)
        return torch.matmul(gathered, w)

    def gemm_rs() -> torch.Tensor:
        full = torch.matmul(x, w)
        if dist.get_backend() != "nccl":
            dist.all_reduce(full)
            return full[rank * m // world : (rank + 1) * m // world].clone()
        out = torch.empty((m // world, w.shape[1]), dtype=x.dtype, device=x.device)
        reduce_scatter_single(out, full)
        return out

    def gemm_ar() -> torch.Tensor:
        out = torch.matmul(x, w)
        dist.all_reduce(out)
        return out

    return {"ag_gemm": ag_gemm, "gemm_rs": gemm_rs, "gemm_ar": gemm_ar}[op]


def fused_rank(rank: int, world: int, use_gpu: bool, s: HostTimeSettings) -> list[OpTimes]:
    """One rank's times of each fused op at each M, and of its pair (:func:`pair`)
    in the same rounds (the body ``run_ranks`` runs)."""
    import torch.distributed as dist

    import overlap_kernels as ok

    device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
    torch.manual_seed(1009 * rank + 1)

    def barrier() -> None:
        if use_gpu:
            torch.cuda.synchronize()
        dist.barrier()

    cases = []  # (times, call, x, w, config): every op at every M
    for op in (o for o in s.ops if o in FUSED_OPS):
        fn, cfg = getattr(ok, op), s.config_of(op)
        for m in s.m_values:
            x, w = operands(op, m, s, world, device)
            call = lambda fn=fn, x=x, w=w, cfg=cfg: fn(x, w, config=cfg)
            times = OpTimes(op, m)
            try:
                times.warmup_calls = warm_up(op, call, s.warmup)
                warm_up(op, pair(op, x, w, world), s.warmup)
            except Exception as e:  # noqa: BLE001 - recorded; every rank goes on to the next shape
                times.error = _error(e)
            # All ranks agree, so that none times a shape a peer gave up.
            if _on_any_rank(times.error is not None) and times.error is None:
                times = OpTimes(op, m, error="raised on another rank")
            cases.append((times, call, x, w, cfg))
    # A later shape's warm-up may have grown the workspace, which an earlier shape's
    # next call adapts to (once, with a device sync): one more untimed call of each.
    for times, call, *_ in cases:
        if times.error is None:
            try:
                call()
                times.warmup_calls += 1
            except Exception as e:  # noqa: BLE001 - recorded, as in the warm-up
                times.error = _error(e)
        if _on_any_rank(times.error is not None) and times.error is None:
            times.error = "raised on another rank"
    timed = [case for case in cases if case[0].error is None]
    calls = {}
    for t, call, x, w, _ in timed:
        calls[f"{t.op}@{t.m}"], calls[f"pair {t.op}@{t.m}"] = call, pair(t.op, x, w, world)
    try:
        medians, outlasted, batches = timed_batches(calls, s, device, barrier, core=rank)
    except Exception as e:  # noqa: BLE001 - recorded on every shape it timed
        for t, *_ in timed:
            t.error = _error(e)
    else:
        for t, _, x, w, cfg in timed:
            ours, theirs = f"{t.op}@{t.m}", f"pair {t.op}@{t.m}"
            t.ours_enqueue_us, t.ours_b2b_us = medians[ours]
            t.torch_enqueue_us, t.torch_b2b_us = medians[theirs]
            t.sleep_outlasted_host = outlasted[ours] and outlasted[theirs]
            t.batches_us = {"ours": batches[ours], "torch": batches[theirs]}
            t.path, t.config = running_path(t.op, x, w, cfg)
    if _on_any_rank(any(t.error is not None for t, *_ in timed)):
        for t, *_ in timed:
            t.error = t.error or "raised on another rank"
    return [t for t, *_ in cases]


def _max(values: list[float | None]) -> float | None:
    return None if None in values else max(values)


def over_ranks(per_rank: list[list[OpTimes]]) -> list[OpTimes]:
    """Max over ranks of each time (the pair's: None where a rank has none); rank 0's
    path, or every rank's where they differ."""
    merged = []
    for same in zip(*per_rank):
        first = same[0]
        errors = [t.error for t in same if t.error]
        if errors:
            merged.append(OpTimes(first.op, first.m, error=errors[0]))
            continue
        paths = [t.path for t in same]
        merged.append(
            OpTimes(
                first.op,
                first.m,
                ours_enqueue_us=max(t.ours_enqueue_us for t in same),
                ours_b2b_us=max(t.ours_b2b_us for t in same),
                torch_enqueue_us=_max([t.torch_enqueue_us for t in same]),
                torch_b2b_us=_max([t.torch_b2b_us for t in same]),
                sleep_outlasted_host=all(t.sleep_outlasted_host for t in same),
                path=paths[0] if len(set(paths)) == 1 else "/".join(paths),
                config=first.config,
                per_rank_us=[
                    {
                        "ours_enqueue": t.ours_enqueue_us,
                        "ours_b2b": t.ours_b2b_us,
                        "ours_batches": t.batches_us.get("ours"),
                        "torch_enqueue": t.torch_enqueue_us,
                        "torch_b2b": t.torch_b2b_us,
                        "torch_batches": t.batches_us.get("torch"),
                    }
                    for t in same
                ],  # fmt: skip
                warmup_calls=first.warmup_calls,
            )
        )
    return merged


def measure_fused(s: HostTimeSettings, timeout_s: float) -> list[OpTimes]:
    from overlap_kernels.launch import run_ranks

    if not any(op in FUSED_OPS for op in s.ops):
        return []
    use_gpu = not s.cpu
    try:
        per_rank = run_ranks(
            fused_rank, s.world, use_gpu, s,
            use_gpu=use_gpu, gpus=s.gpus if use_gpu else None, timeout_s=timeout_s,
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a rank crashed or hung: recorded; matmul's rows stand
        print(f"host_time: the fused ops' ranks failed: {e}", file=sys.stderr, flush=True)
        return [
            OpTimes(op, m, error=_error(e)) for op in s.ops if op in FUSED_OPS for m in s.m_values
        ]
    return over_ranks(per_rank)


# ----------------------------------------------------------------------------- reporting


def _how(what: str, s: HostTimeSettings, outlasted: bool) -> str:
    if what == "b2b":
        return "back to back, wall time between two synchronizations"
    if s.cpu:
        return "on CPU: wall time, no GPU to enqueue behind"
    ran_out = (
        "" if outlasted else "; the sleep ran out before the host was done: may hold device time"
    )
    return f"enqueued behind a {s.sleep_ms:g} ms GPU sleep{ran_out}"


def rows_of(times: list[OpTimes], s: HostTimeSettings) -> list[dict[str, Any]]:
    """Schema-1 rows: per op and M, ours' enqueue and b2b, and torch's where timed
    (matmul: torch.matmul; a fused op: its pair, ``torch_<op>_*``)."""
    rows = []
    for t in times:
        shape = {"M": t.m, "K": s.k, "N": s.n}
        over = "" if t.op == "matmul" else f", max over {s.world} ranks"
        measured = {("ours", "enqueue"): t.ours_enqueue_us, ("ours", "b2b"): t.ours_b2b_us}
        if t.op == "matmul" or t.torch_enqueue_us is not None:
            measured.update(
                {("torch", "enqueue"): t.torch_enqueue_us, ("torch", "b2b"): t.torch_b2b_us}
            )
        for (who, what), us in measured.items():
            name = f"{who}_{t.op}_{what}"
            if t.error is not None:
                failed = harness.Variant(name, None, status="error", note=t.error)
                rows.append(harness.make_row("host_time", shape, failed, None, None))
                continue
            config: dict[str, Any] = {
                "per_rank_us": [r.get(f"{who}_{what}") for r in t.per_rank_us],
                # how the run was made: ranks sharing a GPU or not, each on a core of its own or not
                "gpus": s.gpus,
                "pin_cores": s.pin_cores,
            }
            if what == "enqueue":
                config["sleep_outlasted_host"] = t.sleep_outlasted_host
                # every batch, per rank: a median that one rank's slow batches decide shows here
                config["per_rank_batches_us"] = [r.get(f"{who}_batches") for r in t.per_rank_us]
            bound = t.bound_us() if (who, what) == ("ours", "enqueue") else None
            if bound is not None:
                config.update(bound_us=bound, met=t.met(), path=t.path, warmup_calls=t.warmup_calls)
                config.update(asked=s.config_of(t.op), config=t.config)
            note = f"{us:.2f} us per call, {_how(what, s, t.sleep_outlasted_host)}; "
            note += f"median of {s.reps} batches of {s.calls} calls{over}"
            v = harness.Variant(
                name, lambda: None, config=config, note=note, whole_op=bound is not None
            )
            bound_ms = None if bound is None else bound * 1e-3
            rows.append(harness.make_row("host_time", shape, v, us * 1e-3, bound_ms))
    return rows


def _us(x: float | None, flag: str = "") -> str:
    return "-" if x is None else f"{x:.1f}{flag}"


def format_table(times: list[OpTimes], s: HostTimeSettings) -> str:
    head = [
        "op",
        "M",
        "ours enqueue us",
        "torch enqueue us",
        "x torch.matmul",
        "ours b2b us",
        "bound us",
        "met",
        "path",
    ]
    # Hosts of one kind enqueue 1.5-2x apart (docs/performance.md, "Host time"): each
    # op's enqueue beside torch.matmul's at the same M in this run says how much of a
    # time is the host's speed.
    matmul_us = {t.m: t.torch_enqueue_us for t in times if t.op == "matmul" and t.error is None}
    lines = []
    for t in times:
        if t.error is not None:
            lines.append([t.op, t.m, "ERR", "-", "-", "ERR", _us(t.bound_us()), "-", "-"])
            continue
        star = "" if t.sleep_outlasted_host else "*"
        met = {True: "yes", False: "no", None: "-"}[t.met()]
        enqueue = [_us(t.ours_enqueue_us, star), _us(t.torch_enqueue_us, star)]
        torch_us = matmul_us.get(t.m)
        ratio = "-" if not torch_us else f"{t.ours_enqueue_us / torch_us:.2f}"
        lines.append([t.op, t.m, *enqueue, ratio, _us(t.ours_b2b_us), _us(t.bound_us()), met,
                      t.path])  # fmt: skip
    where = (
        "CPU, Triton's interpreter: these times mean nothing, the run only shows the code paths work"
        if s.cpu
        else "matmul and the fused ops on one GPU, the fused ops on one rank (NCCL)"
        if s.world == 1
        else f"matmul on one GPU; the fused ops on {s.world} ranks sharing it, so their b2b "
        "includes the peers' time slices"
        if s.gpus == 1
        else f"matmul on one GPU; the fused ops on {s.world} ranks over {s.gpus} GPUs"
    )
    if s.pin_cores:
        where += "; each rank timed on a physical core of its own"
    out = [f"host time per call, K={s.k} N={s.n} bf16 ({where})", *grid(head, lines)]
    out.append(
        f"torch: torch.matmul (matmul); a fused op's pair: torch.matmul then the collective "
        f"(torch.matmul alone on one rank). bound: ours' enqueue <= {MATMUL_BOUND_X:g}x "
        f"torch.matmul's (matmul), <= {PLAIN_BOUND_X:g}x the pair's (a fused op's sequential "
        f"path, one rank's included), <= {FUSED_BOUND_US:g} us (a fused path)"
    )
    if not s.cpu and any(t.error is None and not t.sleep_outlasted_host for t in times):
        out.append(
            "* the GPU sleep ran out before the host was done in some batch: the host may have "
            "waited for the device (a host sync, e.g. gloo's collectives on the plain path); "
            "if not, raise --sleep-ms"
        )
    return "\n".join(out)


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> tuple[HostTimeSettings, argparse.Namespace]:
    p = argparse.ArgumentParser(
        prog="python -m bench.host_time", description=__doc__.split("\n\n")[0]
    )
    add = p.add_argument
    add("--m", type=int, nargs="+", help="M values (default 16 64 256; CPU 16)")
    add("--k", type=int, help="K, the whole reduction dimension (default 7168; CPU 64)")
    add("--n", type=int, help="N (default 8192; CPU 64)")
    add("--world", type=int, help="ranks of the fused ops (default 2)")
    add(
        "--gpus",
        type=int,
        help="GPUs the fused ops' ranks are spread over (default 1: they share it)",
    )
    add("--ops", nargs="+", choices=OPS, default=list(OPS), help="what to measure (default all)")
    add("--warmup", type=int, help="untimed calls first (default 20; CPU 2)")
    add("--calls", type=int, help="calls per timed batch (default 50; CPU 2)")
    add("--reps", type=int, help="timed batches, of which the median (default 9; CPU 2)")
    add("--sleep-ms", type=float, help="GPU sleep ahead of each enqueue batch (default 50)")
    add("--config", nargs="+", default=[], metavar="OP=JSON",
        help="""a config for one op's calls, e.g. ag_gemm='{"path": "fused"}'""")  # fmt: skip
    add(
        "--pin-cores",
        action="store_true",
        help="time each rank's calls on a physical core of its own (default: where the OS puts them)",
    )
    add(
        "--cpu",
        action="store_true",
        help="tiny shapes in Triton's interpreter (automatic without CUDA)",
    )
    add(
        "--store",
        type=Path,
        default=store.STORE,
        help="the results store (default bench/results.jsonl; the run's JSON also goes to $OUT when set)",
    )
    add(
        "--timeout-s",
        type=float,
        default=480.0,
        help="the fused ops' ranks are stopped after this (default 480)",
    )
    args = p.parse_args(argv)

    cpu = args.cpu or not torch.cuda.is_available()
    base = dataclasses.replace(HostTimeSettings(), **CPU_DEFAULTS) if cpu else HostTimeSettings()
    fields = ("k", "n", "world", "gpus", "warmup", "calls", "reps", "sleep_ms")
    given = {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
    configs = []
    for item in args.config:
        op, _, text = item.partition("=")
        try:
            if op not in OPS or not isinstance(json.loads(text), dict):
                raise ValueError(f"needs OP=JSON, OP one of {', '.join(OPS)}, JSON an object")
        except ValueError as e:
            p.error(f"--config {item!r}: {e}")
        configs.append((op, text))
    s = dataclasses.replace(
        base, **given, cpu=cpu, ops=tuple(args.ops), configs=tuple(configs), pin_cores=args.pin_cores,
        m_values=tuple(dict.fromkeys(args.m)) if args.m else base.m_values,
    )  # fmt: skip
    if cpu:
        s = dataclasses.replace(s, sleep_ms=0.0)  # no GPU to sleep
    if min(s.k, s.n, s.world, s.calls, s.reps, *s.m_values) < 1 or s.warmup < 0:
        p.error("shapes, --world, --calls and --reps must be >= 1, --warmup >= 0")
    if {"ag_gemm", "gemm_rs"} & set(s.ops) and any(m % s.world for m in s.m_values):
        p.error(f"ag_gemm and gemm_rs split M over {s.world} ranks: every M must divide")
    if {"gemm_rs", "gemm_ar"} & set(s.ops) and s.k % s.world:
        p.error(f"gemm_rs and gemm_ar split K over {s.world} ranks: K {s.k} does not divide")
    return s, args


def main(argv: list[str] | None = None) -> int:
    s, args = parse_args(argv)
    if s.cpu:  # on a GPU host too; the spawned ranks inherit it
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Before anything loads triton: the library decides on the interpreter as it is imported.
    import overlap_kernels  # noqa: F401

    device = torch.device("cpu") if s.cpu else torch.device("cuda", torch.cuda.current_device())
    gpu = "cpu" if s.cpu else torch.cuda.get_device_name(device)
    print(f"host_time: {', '.join(s.ops)} at M {list(s.m_values)} on {gpu}", flush=True)
    times = measure_matmul(s, device) if "matmul" in s.ops else []
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the ranks share this GPU
    times += measure_fused(s, args.timeout_s)
    settings = {
        **dataclasses.asdict(s),
        "dtype": str(DTYPE).removeprefix("torch."),
        "shapes": [f"{m}x{s.k}x{s.n}" for m in s.m_values],
        "units": "'ms' holds ms per call; each note gives us",
    }
    doc = harness.build_results(
        rows_of(times, s),
        gpu=gpu,
        world=s.world,
        versions=harness.collect_versions(),
        env=harness.collect_env(),
        settings=settings,
        date=harness.utc_now(),
    )
    doc["gpu_count"] = 0 if s.cpu else s.gpus
    print(f"results: {store.run_id(doc)} in {store.write_run(doc, args.store)}", flush=True)
    print("\n" + format_table(times, s))
    failed = [t for t in times if t.error is not None]
    for t in failed:
        print(f"FAILED  {t.op} at M={t.m}: {' '.join(t.error.split())[:300]}", file=sys.stderr)
    return 2 if failed else 0


if __name__ == "__main__":
    # Through the module's own name, not __main__: the spawned ranks import
    # fused_rank by that name.
    from bench.host_time import main as _main

    sys.exit(_main())
