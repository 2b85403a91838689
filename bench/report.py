"""What a person sees: the summary tables and the progress bar (rank 0 only).

``python -m bench.report [--op OP] [--gpu TEXT] [--world N] [--all | --run ID | --runs | --summary | --docs]``
prints, from the results store (bench/store.py), each op's table of its newest
run per GPU and world size (``--all``: every run; ``--runs``: list the runs;
``--summary``: the README's table of where the library stands, in Markdown;
``--docs``: writes docs/results.md and its figures from every op's newest runs,
bench/docs_page.py).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

from bench.harness import geomean, pct_of_bound, shape_str, speedup


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def grid(head: Sequence[str], lines: Sequence[Sequence[Any]]) -> list[str]:
    """Right-aligned columns under ``head``, a rule below it."""
    widths = [max(len(str(x[i])) for x in [head, *lines]) for i in range(len(head))]
    out = ["  ".join(str(x).rjust(w) for x, w in zip(line, widths)) for line in [head, *lines]]
    out.insert(1, "-" * len(out[0]))
    return out


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
        if (
            t is not None
            and target_label is not None
            and line[1 + variants.index(target)] not in ("-", "ERR")
        ):
            line[1 + variants.index(target)] += target_label(t)
        for b in baselines:
            s = speedup(vs[b]["ms"] if b in vs else None, t_ms)
            if t is not None and t["status"] == "ok":  # a wrong result's speed does not count
                ratios[b].append(s)
            line.append(_fmt(s, ".2f"))
        line.append(_fmt(pct_of_bound(vs[bound]["ms"] if bound in vs else None, t_ms), ".0f"))
        lines.append(line)
    out = grid(head, lines)
    for b in baselines:
        n = sum(x is not None for x in ratios[b])
        out.append(
            f"geomean speedup of {target} over {b}: {_fmt(geomean(ratios[b]), '.3f')}"
            f" ({n} of {len(lines)} shapes; failed checks excluded)"
        )
    return "\n".join(out)


def goal_lines(
    rows: list[dict[str, Any]],
    *,
    target: str,
    baseline: str,
    goals: Sequence[tuple[str, Callable[[dict[str, int]], bool], float]],
) -> str:
    """One line per goal (which shapes, in words and as a test on the shape; the least
    geometric-mean speedup of ``target`` over ``baseline`` on them): the speedup reached and
    whether it meets the goal. A shape whose ``target`` failed its check does not count."""
    by_shape: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_shape.setdefault(shape_str(r["shape"]), {})[r["variant"]] = r
    out = []
    for label, member, goal in goals:
        shapes = [vs for vs in by_shape.values() if member(next(iter(vs.values()))["shape"])]
        ratios = [
            speedup(vs[baseline]["ms"] if baseline in vs else None, vs[target]["ms"])
            for vs in shapes
            if target in vs and vs[target]["status"] == "ok"
        ]
        g, n = geomean(ratios), sum(x is not None for x in ratios)
        verdict = "-" if g is None else "met" if g >= goal else "NOT met"
        out.append(
            f"goal: geomean of {target} over {baseline} >= {goal:g} on {label}: "
            f"{_fmt(g, '.3f')} ({n} of {len(shapes)} shapes): {verdict}"
        )
    return "\n".join(out)


# One rank moves nothing: an op is its local product, and its goal is torch's time within 10%.
LOCAL_WITHIN = 1.10


def local_goal_line(rows: list[dict[str, Any]], *, target: str, baseline: str, what: str) -> str:
    """The goal of a one-rank run, in place of the multi-rank ones (which need
    communication to hide): ``target`` within 10% of ``baseline``'s time (``what``
    names it) on every shape; the worst ratio of times and its shape."""
    head = (
        f"goal (one rank: no communication): {target} within {LOCAL_WITHIN - 1:.0%} of {what} "
        "on every shape:"
    )
    return every_shape_goal_line(rows, target=target, baseline=baseline, within=LOCAL_WITHIN,
                                 head=head)  # fmt: skip


def every_shape_goal_line(
    rows: list[dict[str, Any]], *, target: str, baseline: str, within: float, head: str
) -> str:
    """``head``, then the worst ratio of ``target``'s time to ``baseline``'s over the
    shapes, its shape, and whether it is at most ``within`` on every shape. A shape
    whose ``target`` failed its check does not count."""
    by_shape: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_shape.setdefault(shape_str(r["shape"]), {})[r["variant"]] = r
    ratios = {}
    for shape, vs in by_shape.items():
        mine, theirs = vs.get(target), vs.get(baseline)
        if mine and theirs and mine["status"] == "ok" and mine["ms"] and theirs["ms"]:
            ratios[shape] = mine["ms"] / theirs["ms"]
    if not ratios:
        return f"{head} - (0 of {len(by_shape)} shapes): -"
    shape, worst = max(ratios.items(), key=lambda item: item[1])
    verdict = "met" if worst <= within else "NOT met"
    if verdict == "met" and len(ratios) < len(by_shape):
        verdict = "incomplete"
    return (
        f"{head} worst {worst:.3f}x its time at {shape} ({len(ratios)} of {len(by_shape)} "
        f"shapes): {verdict}"
    )


class Progress:
    """Progress on rank 0: a rich bar if installed, else tqdm, else one printed line per step."""

    def __init__(self, total: int, enabled: bool = True, kind: str | None = None) -> None:
        self.total, self._n, self._bar, self._task = total, 0, None, None
        found = [m for m in ("rich", "tqdm") if importlib.util.find_spec(m) is not None]
        self.kind = "off" if not enabled else kind or (found[0] if found else "print")

    def __enter__(self) -> Self:
        if self.kind == "rich":
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress()
            self._bar.start()
            self._task = self._bar.add_task("bench", total=self.total)
        elif self.kind == "tqdm":
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, dynamic_ncols=True)
        return self

    def step(self, desc: str) -> None:
        self._n += 1
        if self.kind == "rich":
            self._bar.update(self._task, advance=1, description=desc)
        elif self.kind == "tqdm":
            self._bar.set_description(desc, refresh=False)
            self._bar.update(1)
        elif self.kind == "print":
            print(f"[{self._n}/{self.total}] {desc}", flush=True)

    def __exit__(self, *exc: object) -> None:
        if self.kind == "rich":
            self._bar.stop()
        elif self.kind == "tqdm":
            self._bar.close()


# ----------------------------------------------------------------------------- from the store


def run_table(doc: dict[str, Any]) -> str:
    """A run's table: its op entry's (bench/cli.py OPS), else ms per shape and variant."""
    from bench.cli import OPS

    op = doc["rows"][0]["op"] if doc["rows"] else "-"
    if op in OPS:
        return importlib.import_module(OPS[op]).format_table(doc["rows"], world=doc["world_size"])
    variants = list(dict.fromkeys(r["variant"] for r in doc["rows"]))
    by_shape: dict[str, dict[str, Any]] = {}
    for r in doc["rows"]:
        by_shape.setdefault(shape_str(r["shape"]), {})[r["variant"]] = r
    lines = [
        [shape, *(_fmt(cells.get(v, {}).get("ms"), ".4f") for v in variants)]
        for shape, cells in by_shape.items()
    ]
    return "\n".join(grid(["shape", *variants], lines))


TARGET, UNTUNED = "target", "untuned"
GEMM_OPS = ("ag_gemm", "gemm_rs", "gemm_ar")


def run_kind(doc: dict[str, Any]) -> str:
    """TARGET for a run of any of its op's DEFAULT_SHAPES (the shapes the tables and goals
    are made on), UNTUNED for a run of other shapes only (``--shapes``): each kind has its
    own newest run. A GEMM core's run is TARGET where it has every tuned-on shape of the
    core (``bench.tune_gemm``'s default sweep; its --decode, --models and given shapes are
    other kinds of runs)."""
    from bench import gemm_cores
    from bench.cli import OPS

    op = doc["rows"][0]["op"] if doc["rows"] else None
    shapes = {tuple(r["shape"].values()) for r in doc["rows"]}
    if op in gemm_cores.CORES:
        return TARGET if set(gemm_cores.CORES[op].shapes) <= shapes else UNTUNED
    if op not in OPS:
        return TARGET
    defaults = {tuple(s) for s in importlib.import_module(OPS[op]).DEFAULT_SHAPES}
    return TARGET if shapes & defaults else UNTUNED


def newest_of_each(docs: Sequence[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """The newest of ``docs`` (oldest first) per op, GPU, world size and run_kind."""
    newest: dict[tuple, dict[str, Any]] = {}
    for d in docs:
        if d["rows"]:
            newest[(d["rows"][0]["op"], d["gpu"], d["world_size"], run_kind(d))] = d
    return newest


def _moe_decode(shape: dict[str, int]) -> bool:
    """Whether a MoE shape is a decode one: T (tokens per rank) <= bench/moe.py's DECODE_MAX_T."""
    from bench.moe import DECODE_MAX_T  # (bench.moe imports this module)

    return shape["T"] <= DECODE_MAX_T


# The README's summary: per op, (label, target, baseline, which shapes) of the speedups it gives.
SUMMARY = (
    ("ag_gemm, M > 512", "ag_gemm", "ours_auto", "sequential", lambda s: s["M"] > 512),
    ("ag_gemm, M <= 512 (decode)", "ag_gemm", "ours_auto", "sequential", lambda s: s["M"] <= 512),
    ("gemm_rs", "gemm_rs", "ours_auto", "sequential", lambda s: True),
    ("gemm_ar, M > 256", "gemm_ar", "ours_auto", "sequential", lambda s: s["M"] > 256),
    ("gemm_ar, M <= 256 (decode)", "gemm_ar", "ours_auto", "sequential", lambda s: s["M"] <= 256),
    ("MoE layer vs the NCCL path, T > 256", "moe", "ours_auto_layer", "nccl_layer",
     lambda s: not _moe_decode(s)),
    ("MoE layer vs the NCCL path, T <= 256 (decode)", "moe", "ours_auto_layer", "nccl_layer", _moe_decode),
)  # fmt: skip


def summary(docs: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: a row per SUMMARY line, a column per (GPU, world > 1); each cell,
    from the newest run in ``docs`` with shapes of that line, the geometric-mean speedup
    of ``ours_auto`` over the plain pair on those shapes, and the run's id."""
    newest: dict[tuple, dict[str, Any]] = {}
    for label, op, _, _, member in SUMMARY:
        for d in docs:
            if (
                d["rows"][0]["op"] == op
                and run_kind(d) == TARGET
                # One rank moves nothing: no pair's communication to hide (its runs'
                # tables hold the one-rank goal instead).
                and d["world_size"] > 1
                and any(member(r["shape"]) for r in d["rows"])
            ):
                newest[(label, d["gpu"], d["world_size"])] = d
    columns = sorted({(gpu, world) for _, gpu, world in newest}, key=lambda c: (c[0], -c[1]))
    out = ["| op | " + " | ".join(f"{world} x {gpu}" for gpu, world in columns) + " |"]
    out.append("|---" * (len(columns) + 1) + "|")
    for label, _, target, baseline, member in SUMMARY:
        cells = []
        for gpu, world in columns:
            doc = newest.get((label, gpu, world))
            if doc is None:
                cells.append("-")
                continue
            ratios = _speedups(doc, target, baseline, member)
            text = f"{_fmt(geomean(ratios.values()), '.3f')}x ({len(ratios)} shapes)"
            cells.append(f"{text} (`{doc['run']}`)")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    untuned = newest_of_each(
        [d for d in docs if d["rows"][0]["op"] in GEMM_OPS and run_kind(d) == UNTUNED]
    )
    cells = []
    for gpu, world in columns:
        parts = []
        for (op, g, w, _), doc in untuned.items():
            if (g, w) == (gpu, world):
                ratios = _speedups(doc, "ours_auto", "sequential")
                count = f"{len(ratios)} shape" + ("" if len(ratios) == 1 else "s")
                parts.append(f"{op} {_fmt(geomean(ratios.values()), '.2f')}x ({count})"
                             f" (`{doc['run']}`)")  # fmt: skip
        cells.append(", ".join(parts) or "-")
    if any(c != "-" for c in cells):
        out.append("| GEMM ops on shapes no table names | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _speedups(
    doc: dict[str, Any],
    target: str,
    baseline: str,
    member: Callable[[dict[str, int]], bool] | None = None,
) -> dict[str, float | None]:
    """Per shape of the run (those ``member`` takes), ``target``'s speedup over ``baseline``;
    a shape whose target failed its check is left out."""
    by_shape: dict[str, dict[str, Any]] = {}
    for r in doc["rows"]:
        by_shape.setdefault(shape_str(r["shape"]), {})[r["variant"]] = r
    return {
        shape: speedup(vs[baseline]["ms"], vs[target]["ms"])
        for shape, vs in by_shape.items()
        if target in vs and baseline in vs and vs[target]["status"] == "ok"
        and (member is None or member(vs[target]["shape"]))
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    from bench import store

    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--op", help="only this op (ag_gemm, gemm_rs, gemm_ar, moe, host_time, matmul)")
    p.add_argument("--gpu", help="only GPUs whose name contains this")
    p.add_argument("--world", type=int, help="only runs on this many ranks")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--all",
        action="store_true",
        help="every run, not only the newest per op, GPU, world and kind (target or untuned shapes)",
    )
    which.add_argument("--run", help="one run, by id")
    which.add_argument("--runs", action="store_true", help="list the runs, one line each")
    which.add_argument(
        "--summary", action="store_true", help="the README's table (Markdown) of the newest runs"
    )
    which.add_argument(
        "--docs",
        action="store_true",
        help="write docs/results.md and docs/img/ from the newest runs (--op, --gpu, --world ignored)",
    )
    p.add_argument("--store", type=Path, default=store.STORE)
    args = p.parse_args(argv)
    if args.docs:
        from bench import docs_page

        return docs_page.main(args.store)
    docs = [
        d
        for d in store.runs(store.load(args.store))
        if d["rows"]
        and (args.op is None or d["rows"][0]["op"] == args.op)
        and (args.gpu is None or args.gpu.lower() in d["gpu"].lower())
        and (args.world is None or d["world_size"] == args.world)
        and (args.run is None or d["run"] == args.run)
    ]
    if args.runs:
        for d in docs:
            print(
                f"{d['run']}  {d['date']}  {d['gpu']} x{d['world_size']}  {len(d['rows'])} rows  host {d['host'] or '-'}"
            )
        return 0
    if args.summary:
        print(summary(docs))
        return 0
    if not (args.all or args.run):
        docs = list(newest_of_each(docs).values())
    if not docs:
        print(f"no run matches in {args.store}", file=sys.stderr)
        return 1
    for d in docs:
        versions = ", ".join(
            f"{k} {v}" for k, v in d["versions"].items() if k in ("torch", "triton", "nccl") and v
        )
        print(
            f"{d['rows'][0]['op']} on {d['gpu']} x{d['world_size']}: run {d['run']} ({d['date']}; {versions})"
        )
        print(run_table(d) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
