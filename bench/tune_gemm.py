"""Our GEMM cores against the vendor library on one GPU: ratios, and what the templates should say.

``python -m bench.tune_gemm [--core NAME]... [--decode] [--graphs] [--models] [--dgrad]
[--rounds R] [--no-held-out] [--template-only] [SHAPE ...]``
runs, per core (bench/gemm_cores.py: matmul, chunked_gemm, reduce_gemm, grouped_gemm; all by
default) and shape: the vendor kernel (cuBLAS, or ``torch._grouped_mm``), the config the op's
template and tuned table give the shape (``template``), and on the tuned-on shapes each swept
config. Times are ``triton.testing.do_bench`` medians (L2 flushed before each call), or with
``--graphs`` medians of CUDA-graph replays, each graph one call per operand copy, the copies'
weights twice the L2 (gemm_cores.replayed_medians: decode as servers run it); with R rounds,
every variant once per round, interleaved, and the median of the rounds' medians.
Printed: each variant's time ratio to the vendor's (<= 1.02 is the bar), then a summary per
shape (template's ratio, the best config and its ratio). Each core's run goes to the results
store (bench/store.py; op = the core, a variant per config, the vendor's, ``template``).
Held-out shapes run the template alone: no choice is made on them; ``--template-only``
runs every shape so (a kernel change's before and after, each against the vendor). Given
shapes (MxKxN for the dense cores, ExMxKxN for the grouped one), ``--decode`` and ``--models``
(the GEMMs of bench/model_shapes.py: Llama-3-8B/70B, Qwen2.5-32B, Mistral-Large at TP 2/4/8; M
<= 256 with ``--decode``, 777-8192 without; the dense cores) replace the default shapes and
leave the held-out ones out. ``--dgrad`` runs the dense cores on the backward's dgrad layout,
``dy @ weight`` with the weight row-major as our autograd passes it (with ``--models``: each
projection's K and N swapped), instead of the forward's ``x @ weight.t()``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch

from bench import gemm_cores, harness, model_shapes, store

BAR = 1.02  # our time / the vendor's, at most (issue: "GEMM cores at vendor speed")
TEMPLATE = "template"


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.split("x"))
    except ValueError:
        shape = ()
    if len(shape) not in (3, 4) or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f"a shape is MxKxN or ExMxKxN of positive ints, got '{text}'"
        )
    return shape


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tune_gemm", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--core", action="append", choices=sorted(gemm_cores.CORES),
                        help="a core to run (repeat --core for several; default: all)")  # fmt: skip
    parser.add_argument("--decode", action="store_true", help="decode shapes and tiles")
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="time CUDA-graph replays, no call finding its weight in L2 (as servers run decode)",
    )
    parser.add_argument(
        "--dgrad",
        action="store_true",
        help="the backward's dgrad layout, dy @ weight (B row-major), not x @ weight.t() (dense cores)",
    )
    parser.add_argument(
        "--models",
        action="store_true",
        help="the shapes of bench/model_shapes.py (M <= 256 with --decode, else larger)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (>= 1)")
    parser.add_argument("--no-held-out", action="store_true", help="the tuned-on shapes only")
    parser.add_argument("--template-only", action="store_true",
                        help="no swept configs: the template's alone on every shape run")  # fmt: skip
    parser.add_argument("shapes", nargs="*", type=_shape, metavar="SHAPE",
                        help="MxKxN (dense cores) or ExMxKxN (grouped_gemm)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    names = args.core or [n for n in gemm_cores.CORES if not (args.dgrad and _dims(n) == 4)]
    if args.dgrad and any(_dims(n) == 4 for n in names):
        parser.error("--dgrad: the dense cores only (the grouped core's experts have one layout)")
    layout = gemm_cores.DGRAD if args.dgrad else gemm_cores.FORWARD
    fits = {name: [s for s in args.shapes if len(s) == _dims(name)] for name in names}
    unused = [s for s in args.shapes if not any(s in given for given in fits.values())]
    if unused:
        parser.error(f"no selected core takes shape {'x'.join(map(str, unused[0]))} "
                     "(dense cores: MxKxN; grouped_gemm: ExMxKxN)")  # fmt: skip
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the cores' CPU tests: bench/test_gemm_cores_cpu.py)")
    if "reduce_gemm" in names:
        why = _one_rank_group()
        if why:
            parser.error(why)
    device = torch.device("cuda", torch.cuda.current_device())
    for name in names:
        core = gemm_cores.CORES[name]
        if args.shapes and not fits[name]:
            continue
        tuned = fits[name] or _default_shapes(core, args.decode, args.models, args.dgrad)
        held = [] if (args.shapes or args.decode or args.models or args.no_held_out) else list(core.held_out)  # fmt: skip
        if not tuned and not held:
            print(f"{name}: no decode shapes (bench/gemm_cores.py says why)", flush=True)
            continue
        configs = () if args.template_only else core.decode_configs if args.decode else core.configs
        results = [sweep(core, shape, configs, args.rounds, device, graphs=args.graphs, layout=layout)
                   for shape in tuned]  # fmt: skip
        results += [sweep(core, shape, (), args.rounds, device, held_out=True, layout=layout) for shape in held]  # fmt: skip
        print_summary(core, results, template_only=args.template_only)
        doc = harness.build_results(
            rows_of(core, results), gpu=torch.cuda.get_device_name(), world=1,
            versions=harness.collect_versions(), env=harness.collect_env(),
            settings={"rounds": args.rounds, "decode": args.decode, "template_only": args.template_only,
                      "dtype": "bfloat16", "bar": BAR, "models": args.models, "layout": layout,
                      "timer": "CUDA-graph replay median, weights past L2" if args.graphs else "do_bench median",
                      "template_world": 1 if name == "matmul" else gemm_cores.WORLD},
            date=harness.utc_now(),
        )  # fmt: skip
        print(f"results: {store.run_id(doc)} in {store.write_run(doc)}", flush=True)


def _default_shapes(core: gemm_cores.Core, decode: bool, models: bool, dgrad: bool) -> list[tuple]:
    """The core's tuned-on shapes (decode ones with ``decode``), or with ``models`` the
    models' GEMMs of bench/model_shapes.py at decode or larger M (dense cores only; with
    ``dgrad`` their backward's dgrad, dy @ weight: the forward's K and N swapped)."""
    if not models:
        return list(core.decode_shapes if decode else core.shapes)
    if _dims(core.name) != 3:
        return []
    shapes = model_shapes.shapes(ms=model_shapes.DECODE_M if decode else model_shapes.PREFILL_M)
    return sorted((m, n, k) for m, k, n in shapes) if dgrad else shapes


def _dims(core: str) -> int:
    return 4 if core == "grouped_gemm" else 3


def _one_rank_group() -> str:
    """The reduce core's group, this process alone (its workspace is made on it); why
    not, where a process group of several ranks is already set up ('' when fine)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        # (an in-memory store: no rendezvous file to outlive, nothing to reach)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        return (f"reduce_gemm runs on a group of this process alone, but a group of "
                f"{dist.get_world_size()} ranks is set up: run tune_gemm as one process")  # fmt: skip
    return ""


def sweep(
    core: gemm_cores.Core,
    shape: tuple,
    configs,
    rounds: int,
    device: torch.device,
    *,
    held_out: bool = False,
    graphs: bool = False,
    layout: str = gemm_cores.FORWARD,
) -> dict[str, Any]:
    """One shape's variants on ``device``, timed in interleaved rounds (``graphs``: replayed
    in CUDA graphs, gemm_cores.replayed_medians): {variant: {"ms", "ms_rounds", "err"} or
    {"error"}}, with the shape and whether it was held out."""
    problem = core.problem(shape, device, layout)
    # (graphs: a call per operand copy, so that no call finds its weight in L2)
    copies = [problem]
    if graphs:
        more = gemm_cores.copies_past_l2(problem, device) - 1
        copies += [core.problem(shape, device, layout) for _ in range(more)]
    template = gemm_cores.template_knobs(core.name, problem.shape, device)
    variants: dict[str, dict] = {TEMPLATE: template}
    for values in configs:
        knobs = gemm_cores.knobs_of(core.name, values)
        if knobs != template:
            variants[gemm_cores.config_name(knobs)] = knobs
    row: dict[str, Any] = {"shape": problem.shape, "held_out": held_out, "flops": problem.flops,
                           "template_config": gemm_cores.config_name(template), "layout": layout}  # fmt: skip
    runs = {}
    if problem.vendor is not None:
        runs[core.vendor] = [p.vendor for p in copies]
        row[core.vendor] = {}
    for name, knobs in variants.items():
        try:
            runs[name] = [core.ours(p, knobs) for p in copies]
            row[name] = {"err": max(_checked(p, run) for p, run in zip(copies, runs[name]))}
        # A config that does not fit (shared memory, flags) is reported, not fatal.
        except Exception as e:
            runs.pop(name, None)
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    if graphs:
        timed, errors = gemm_cores.replayed_medians(runs, rounds)
    else:
        timed, errors = gemm_cores.interleaved_medians({n: r[0] for n, r in runs.items()}, rounds)
    for name, error in errors.items():  # reported in its row; the sweep goes on
        row[name] = {"error": error}
    for name, ms_rounds in timed.items():
        row[name].update(ms_rounds=ms_rounds, ms=statistics.median(ms_rounds))
    _print_shape(core, row)
    return row


def _checked(problem: gemm_cores.Problem, run) -> float:
    """``run``'s relative error (Frobenius) on ``problem``, its output poisoned first."""
    problem.out.fill_(float("nan"))
    run()
    return ((problem.out.float() - problem.reference).norm() / problem.reference.norm()).item()


def ratio(row: dict[str, Any], core: gemm_cores.Core, name: str) -> float | None:
    """``name``'s time over the vendor's in ``row`` (None where either has none)."""
    ours, vendor = row.get(name, {}).get("ms"), row.get(core.vendor, {}).get("ms")
    return ours / vendor if ours and vendor else None


def best(row: dict[str, Any], core: gemm_cores.Core) -> str | None:
    """The fastest of our variants in ``row`` whose error is within bf16's (an fp32-accumulated
    bf16 GEMM is off by ~2^-8 relative at most: a config past 1e-2 is wrong, not fast)."""
    ours = [(v["ms"], name) for name, v in row.items()
            if isinstance(v, dict) and name != core.vendor and "ms" in v and v.get("err", 1) < 1e-2]  # fmt: skip
    return min(ours)[1] if ours else None


def _print_shape(core: gemm_cores.Core, row: dict[str, Any]) -> None:
    shape = "x".join(str(v) for v in row["shape"].values())
    cells = []
    for name, v in row.items():
        if not isinstance(v, dict) or name == "shape":
            continue
        if "error" in v:
            cells.append(f"{name} FAILED {v['error'][:60]}")
        elif "ms" in v:
            r = ratio(row, core, name)
            tf = row["flops"] / v["ms"] / 1e9
            cells.append(f"{name} {v['ms']:.3f} ms {tf:.0f} TF" + (f" x{r:.3f}" if r and name != core.vendor else "")
                         + (f" err {v['err']:.1e}" if "err" in v else ""))  # fmt: skip
    print(
        f"{core.name} {shape}{' (held out)' if row['held_out'] else ''}: " + " | ".join(cells),
        flush=True,
    )


def print_summary(
    core: gemm_cores.Core, results: list[dict[str, Any]], *, template_only: bool = False
) -> None:
    """A line per shape: the vendor's ms, the template's ratio, the best config and its ratio."""
    print(f"\n{core.name}: time / {core.vendor} (bar <= {BAR})")
    print(f"{'shape':>22}  {core.vendor + ' ms':>18}  {'template':>8}  {'best':>8}  best config")
    for row in results:
        shape = "x".join(str(v) for v in row["shape"].values()) + ("*" if row["held_out"] else "")
        vendor = row.get(core.vendor, {}).get("ms")
        top = best(row, core)
        cells = [f"{vendor:.3f}" if vendor else "-", _fmt(ratio(row, core, TEMPLATE)),
                 _fmt(ratio(row, core, top) if top else None)]  # fmt: skip
        label = row["template_config"] if top == TEMPLATE else (top or "-")
        print(f"{shape:>22}  {cells[0]:>18}  {cells[1]:>8}  {cells[2]:>8}  {label}")
    legend = "no configs swept: every shape ran" if template_only else "* held out:"
    print(f"({legend} the template's config alone)\n", flush=True)


def _fmt(r: float | None) -> str:
    return "-" if r is None else f"{r:.3f}" + ("" if r <= BAR else "!")


def rows_of(core: gemm_cores.Core, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Schema-1 rows (bench/harness.py) of a core's sweep: the vendor's, ``template`` (its
    config named) and one per swept config (its name, e.g. ``128x256x64w8s3g8+tma``)."""
    rows = []
    for row in results:
        for name, v in row.items():
            if not isinstance(v, dict) or name == "shape":
                continue
            ms = v.get("ms")
            config = (
                {}
                if name == core.vendor
                else {"tiles": row["template_config"] if name == TEMPLATE else name}
            )
            if row["held_out"]:
                config["held_out"] = True
            if row.get("layout", gemm_cores.FORWARD) != gemm_cores.FORWARD:
                config["layout"] = row["layout"]
            rows.append({
                "op": core.name, "shape": row["shape"], "variant": name,
                "status": "ok" if ms is not None else "error", "ms": ms,
                "tflops": harness.tflops(row["flops"], ms), "pct_of_bound": None, "rel_err": v.get("err"),
                "config": config,
                "note": v.get("error", "") or (f"medians of the rounds: {v['ms_rounds']}" if "ms_rounds" in v else ""),
            })  # fmt: skip
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
