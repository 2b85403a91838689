"""``python -m bench [--op all|ag_gemm|gemm_rs|gemm_ar|decode|moe|tp_mlp|examples] [--shapes SHAPE ...] [--iters N] [--quick]``

With CUDA GPUs: one process per GPU (spawned here, or the ones torchrun started), NCCL,
each op's entry measured on every shape (``--op all``, the default: every op in ``OPS`` but
those in ``NOT_IN_ALL``, in one process group), a JSON per op written by rank 0 and the
tables printed last.
Each ``--shapes`` item goes to every op whose shape syntax it fits (``MxKxN`` for the GEMM
ops, ``TxHxExKxF`` or a preset name for ``moe``), or, written ``op:SHAPE``, to that op
alone; under ``--op all`` an op that none fits is not run (and says so).
Without a GPU: runs ``overlap_kernels.demo.main()``, the CPU emulated-rank correctness demo.
Exit status: 0 if every variant ran and passed its check, 2 if one raised or failed it.

This module, not ``__main__``, holds the code: spawned processes must be able to import
the worker function by its module name.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import harness, store

# Entries by op name: each module has DTYPE, DEFAULT_SHAPES, parse_shape, run and
# format_table(rows, world=...), whose goals are those of that many ranks.
OPS = {
    "ag_gemm": "bench.ag_gemm",
    "gemm_rs": "bench.gemm_rs",
    "gemm_ar": "bench.gemm_ar",
    "decode": "bench.decode",
    "moe": "bench.moe",
    "tp_mlp": "bench.tp_mlp",
    "examples": "bench.examples",
}
# Run only when named: tp_mlp (a training step per shape with three torch.compile variants,
# minutes of compiling; its TxHxF shapes would take every GEMM op's MxKxN) and examples (the
# worked examples of user fused ops, examples/, not the library's ops).
NOT_IN_ALL = ("tp_mlp", "examples")
ALL = "all"
EXIT_FAILED = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[1])
    p.add_argument(
        "--op",
        default=ALL,
        choices=[ALL, *OPS],
        help="the op to measure (default: all of them but tp_mlp and examples, one after the "
        "other); decode: a decoder layer's reduction point with residual add + RMSNorm, in CUDA "
        "graphs; examples: the worked user fused ops of examples/ against our op + the kernel "
        "each fuses",
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        metavar="SHAPE",
        help="shapes to run (default: each op's list). ag_gemm, gemm_rs, gemm_ar: MxKxN (for "
        "ag_gemm M is the total, gathered M; for gemm_rs and gemm_ar K is each rank's K_local). "
        "moe: TxHxExKxF (tokens per rank x hidden x experts x top-k x expert intermediate) or "
        "a preset (deepseek_, qwen3_235b_, mixtral_ + prefill or decode; qwen3_prefill). tp_mlp: TxHxF (total "
        "tokens x hidden x FFN width) or a preset (llama3_8b_t4096, ...). Each item goes to every "
        "op it fits; 'op:SHAPE' sends it to that op alone",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed calls per variant (default 100; 20 with --quick)",
    )
    p.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds the calls are split into"
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per variant first")
    p.add_argument(
        "--quick", action="store_true", help="few iterations: a smoke run, not numbers to quote"
    )
    p.add_argument(
        "--store",
        type=Path,
        default=store.STORE,
        help="the results store the runs are appended to (default bench/results.jsonl; "
        "each run's JSON also goes to $OUT when set)",
    )
    p.add_argument(
        "--symm-mem-backend",
        default=None,
        choices=("NVSHMEM", "CUDA", "NCCL"),
        help="torch's symmetric-memory backend for the run, set in every rank before anything "
        "allocates (our ops' torch backend allocates through it too); NVSHMEM lets the moe "
        "entry run its all_to_all_vdev_2d baseline (symm_mem_layer)",
    )
    p.add_argument(
        "--cpu-ranks",
        type=int,
        default=0,
        metavar="N",
        help="test the harness itself on N CPU ranks (gloo, wall clock; use tiny --shapes): "
        "the numbers mean nothing",
    )
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> harness.Settings:
    base = harness.Settings(iters=20, rounds=4, warmup=3) if args.quick else harness.Settings()
    return harness.Settings(
        iters=args.iters if args.iters is not None else base.iters,
        rounds=args.rounds if args.rounds is not None else base.rounds,
        warmup=args.warmup if args.warmup is not None else base.warmup,
    )


def _context(rank: int, world: int, cuda: bool) -> harness.RunContext:
    import torch

    from overlap_kernels.timing import group_barrier

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    clock = harness.CudaClock() if cuda else harness.WallClock()
    barrier = group_barrier(None, device)
    return harness.RunContext(rank, world, device, None, clock, barrier, harness.torch_reduce_max())


def ops_of(args: argparse.Namespace) -> list[str]:
    return [op for op in OPS if op not in NOT_IN_ALL] if args.op == ALL else [args.op]


def shapes_by_op(args: argparse.Namespace) -> dict[str, list[tuple[int, ...]]]:
    """The shapes each op runs, in ``ops_of`` order; an op left out runs nothing.

    Without ``--shapes``: every op its ``DEFAULT_SHAPES``. Each ``--shapes`` item goes to
    every op whose ``parse_shape`` takes it, or, written ``op:SHAPE``, to that op alone
    (dropped when that op is not run). ValueError for an item that no op takes, and for
    ``--op X`` when no item is X's."""
    entries = {op: importlib.import_module(OPS[op]) for op in ops_of(args)}
    if not args.shapes:
        return {op: list(entry.DEFAULT_SHAPES) for op, entry in entries.items()}
    picked: dict[str, list[tuple[int, ...]]] = {op: [] for op in entries}
    for item in args.shapes:
        op, sep, spec = item.partition(":")
        if sep:
            if op not in OPS:
                raise ValueError(f"--shapes {item!r}: no op {op!r} (ops: {', '.join(OPS)})")
            if op in entries:
                picked[op].append(entries[op].parse_shape(spec))
            continue
        refusals = []
        for op, entry in entries.items():
            try:
                picked[op].append(entry.parse_shape(item))
            except ValueError as e:
                refusals.append(f"{op}: {e}")
        if len(refusals) == len(entries):
            raise ValueError(f"--shapes {item!r} fits no op run: " + "; ".join(refusals))
    if args.op != ALL and not picked[args.op]:
        raise ValueError(f"--shapes gives no shape for {args.op}")
    return {op: shapes for op, shapes in picked.items() if shapes}


def bench_main(rank: int, world: int, args: argparse.Namespace) -> int:
    """Measure each op, and on rank 0 write its JSON, then print the tables. Returns the
    exit status."""
    import torch

    settings = settings_from(args)
    if args.symm_mem_backend:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend(args.symm_mem_backend)
    ctx = _context(rank, world, cuda=not args.cpu_ranks)
    tables, bad = [], []
    by_op = shapes_by_op(args)
    if rank == 0 and len(by_op) < len(ops_of(args)):
        left = [op for op in ops_of(args) if op not in by_op]
        print(f"not run: {', '.join(left)} (no --shapes item in their syntax)", flush=True)
    for op, shapes in by_op.items():
        entry: Any = importlib.import_module(OPS[op])
        rows = entry.run(ctx, shapes, settings)
        bad += [r for r in rows if r["status"] in ("error", "check_failed")]
        if rank != 0:
            continue
        doc = harness.build_results(
            rows,
            gpu=torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
            world=world,
            versions=harness.collect_versions(),
            env=harness.collect_env(),
            settings={
                **vars(settings),
                "dtype": str(entry.DTYPE).removeprefix("torch."),
                "shapes": ["x".join(map(str, s)) for s in shapes],
                **({"symm_mem_backend": args.symm_mem_backend} if args.symm_mem_backend else {}),
            },
            date=harness.utc_now(),
        )
        # Written as soon as the op is done: a later op that crashes cannot lose it.
        print(f"results: {store.run_id(doc)} in {store.write_run(doc, args.store)}", flush=True)
        tables.append(f"{op}\n" + entry.format_table(rows, world=world))
    if rank == 0:
        print("\n" + "\n\n".join(tables))
        for r in bad:  # loud, last, where it cannot be missed; the JSON has the whole note
            note = " ".join(r["note"].split())
            where = f"{r['variant']} at {harness.shape_str(r['shape'])}"
            print(f"FAILED  {where}: {r['status']}: {r['op']}: {note[:300]}", file=sys.stderr)
    return EXIT_FAILED if bad else 0


def _worker(rank: int, world: int, tmp: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    if args.cpu_ranks:
        # One thread per rank, as overlap_kernels.launch does for its CPU ranks: with several
        # ranks on a 2-core machine, OpenMP's spinning threads made one tiny index_add_ ~80 ms.
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world
        )
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl",
            init_method=f"file://{tmp}/store",
            rank=rank,
            world_size=world,
            device_id=torch.device("cuda", rank),
        )
    try:
        code = bench_main(rank, world, args)
        if rank == 0:  # every rank saw the same agreed rows; rank 0 reports the status
            Path(tmp, "exit_code").write_text(str(code))
        # No rank exits before the status is on disk: see _spawn on crashes at exit.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _under_torchrun(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        return bench_main(rank, world, args)
    finally:
        dist.destroy_process_group()


def _spawn(args: argparse.Namespace, world: int) -> int:
    import torch.multiprocessing as mp

    # The rendezvous is a file in a fresh directory: no port to collide with another run.
    tmp = tempfile.mkdtemp(prefix="bench_rdzv_")
    try:
        mp.spawn(_worker, args=(world, tmp, args), nprocs=world, join=True)
        return int(Path(tmp, "exit_code").read_text())
    except mp.ProcessExitedException as e:  # a rank crashed (its traceback is printed above)
        status = Path(tmp, "exit_code")
        if not status.exists():
            return e.exit_code or 1
        # The run had finished (results written) when the rank died: on CPU ranks, about one
        # run in eight aborts in C++ teardown after Python has exited ("terminate called
        # without an active exception", no Python frame). The results stand.
        why = e.signal_name or f"exit code {e.exit_code}"
        print(f"warning: rank {e.error_index} died at exit ({why}) after the run finished; "
              "results and status stand", file=sys.stderr)  # fmt: skip
        return int(status.read_text())
    except mp.ProcessRaisedException as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cpu_demo() -> int:
    try:
        from overlap_kernels import demo
    except ImportError as e:
        print(f"no CUDA GPU here, and the CPU demo is not available: {e}", file=sys.stderr)
        return 1
    print("no CUDA GPU: running overlap_kernels.demo.main() (CPU emulated ranks, correctness only)")
    result = demo.main()
    return result if isinstance(result, int) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # here, before any rank is spawned: a typo must not cost a GPU start-up
        shapes_by_op(args)
    except ValueError as e:
        print(f"python -m bench: {e}", file=sys.stderr)
        return EXIT_FAILED
    from overlap_kernels.launch import NO_MULTICAST_ENV

    os.environ.update(NO_MULTICAST_ENV)  # before NCCL or symmetric memory are initialised
    import torch

    if args.cpu_ranks:
        return _spawn(args, args.cpu_ranks)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _under_torchrun(args)
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return _cpu_demo()
    print(
        f"{datetime.datetime.now():%H:%M:%S} spawning {torch.cuda.device_count()} ranks for "
        + ", ".join(ops_of(args)),
        flush=True,
    )
    return _spawn(args, torch.cuda.device_count())
