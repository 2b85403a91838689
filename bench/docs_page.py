"""docs/results.md and its figures, made from the results store: ``python -m bench.report --docs``.

The page holds the README's summary (``report.summary``), then for each op, GPU and
world size the table ``python -m bench.report`` prints of the newest run, as Markdown,
and per op one figure (bench/plot.py ``speedups``: each whole-op variant's speedup over
the plain pair per shape, a panel per GPU and world size) in docs/img/. It names the
command and the run ids it was made from and nothing else that changes (no date of
its own), so the same store makes the same page: bench/test_docs_page.py fails when
the committed page is not what the committed store makes. Without matplotlib the page
is written and the figures are left as they are (a line on stderr says so).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench import report, store

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "results.md"
IMG = ROOT / "docs" / "img"
COMMAND = "python -m bench.report --docs"
# Page order of the ops; ops not named here follow by name.
OP_ORDER = ("ag_gemm", "gemm_rs", "gemm_ar", "moe", "tp_mlp", "matmul", "host_time")
# The baseline of each op's figure: the plain path it is measured against.
FIGURE_BASELINE = {
    "ag_gemm": "sequential",
    "gemm_rs": "sequential",
    "gemm_ar": "sequential",
    "moe": "nccl_layer",
}

INTRO = """\
Made by `{command}` from the results store `bench/results.jsonl`; do not
edit it by hand: add runs to the store (`python -m bench.store add`) and run the command
again (`bench/test_docs_page.py` fails while this page is not what the store makes). For
each op, GPU and world size it shows the newest run, its table as `python -m bench.report`
prints it. Older runs: `python -m bench.report --all` or `--run ID`. What the numbers
mean and why they are what they are, with the older runs that show it:
[performance.md](performance.md); every variant: [bench/README.md](../bench/README.md).

- ms per call: the median over calls of each rank, the max over ranks; every variant of
  a shape in the same run, in interleaved rounds. `sequential` is the plain pair (cuBLAS
  and the NCCL collective, one after the other); `bound` = max(the GEMM alone, the
  collective alone), perfect overlap. `x<variant>`: the speedup of the op's own choice
  (`ours_auto`) over that variant (its ms / ours); `%bound`: bound ms / ours ms x 100.
- `ours_auto` is what the library chose at the time of the run: the runs made before
  the tuned tables chose by timing the candidates on a shape's first call
  ([performance.md](performance.md#how-to-read-the-numbers), [tuning.md](tuning.md)).
- Hosts of one GPU kind differ: on some H200 hosts the copy-engine paths ran slow
  ([performance.md](performance.md#hosts-of-one-kind-differ) names their runs).
"""


def newest_runs(docs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest of ``docs`` (store.runs: oldest first) per op, GPU, world size and
    report.run_kind (the target shapes, then untuned ones), in page order: by OP_ORDER,
    then GPU, then the larger world first."""
    newest = report.newest_of_each(list(docs))

    def order(key: tuple[str, str, int, str]) -> tuple[int, str, str, int, bool]:
        op, gpu, world, kind = key
        rank = OP_ORDER.index(op) if op in OP_ORDER else len(OP_ORDER)
        return rank, op, gpu, -world, kind != report.TARGET

    return [newest[k] for k in sorted(newest, key=order)]


def _escape(cell: str) -> str:
    return cell.replace("|", r"\|").replace("*", r"\*")


def _in_grid(row: str, head: str, ends: Sequence[int]) -> bool:
    """Whether ``row`` is a line of the grid under ``head``: as long, and two spaces
    before each column (a note under the grid is neither)."""
    return len(row) == len(head) and all(row[e : e + 2] == "  " for e in ends[:-1])


def markdown(text: str) -> list[str]:
    """``text`` as ``report.grid`` and the op tables lay it out, in Markdown: each grid (a
    header line over a rule of dashes, right-aligned columns two spaces apart, rows up to a
    blank line) becomes a table; every other line becomes a list item."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        rule = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() and rule and set(rule) == {"-"}:
            # Every cell, header too, is right-aligned to its column's width, so a column
            # ends where its header's text ends (a header name has no double space).
            ends = [m.end() for m in re.finditer(r"\S+(?: \S+)*", line)]
            starts = [0, *ends[:-1]]
            rows = []
            i += 2
            while i < len(lines) and _in_grid(lines[i], line, ends):
                rows.append([lines[i][a:b].strip() for a, b in zip(starts, ends)])
                i += 1
            head = [line[a:b].strip() for a, b in zip(starts, ends)]
            if out and out[-1] != "":
                out.append("")
            out.append("| " + " | ".join(_escape(c) for c in head) + " |")
            out.append("|" + "---|" * len(head))
            out.extend("| " + " | ".join(_escape(c) for c in row) + " |" for row in rows)
            out.append("")
            continue
        if line.strip():
            out.append("- " + _escape(line.strip()))
        elif out and out[-1] != "":
            out.append("")
        i += 1
    while out and out[-1] == "":
        out.pop()
    return out


def figure_name(op: str) -> str:
    return f"{op}_speedup.png"


def page(docs: Sequence[dict[str, Any]]) -> str:
    """The page's Markdown for the newest runs of ``docs`` (store.runs' documents)."""
    runs = newest_runs(docs)
    out = [
        "# Benchmark results",
        "",
        f"<!-- Generated by `{COMMAND}` from bench/results.jsonl. Do not edit. -->",
        "",
        INTRO.format(command=COMMAND),
        "Runs: " + ", ".join(f"`{d['run']}`" for d in runs) + ".",
        "",
        "## Where it stands",
        "",
        "Speedup of `ours_auto` over the plain pair, geometric mean over each line's shapes "
        "(MoE: T tokens per rank), the newest run per line, GPU and world size: the "
        "README's table (`python -m bench.report --summary`).",
        "",
        report.summary(docs),
    ]
    for op in dict.fromkeys(d["rows"][0]["op"] for d in runs):
        out += ["", f"## {op}", ""]
        if op in FIGURE_BASELINE:
            out += [
                f"![{op}: speedup over {FIGURE_BASELINE[op]} per shape and variant]"
                f"(img/{figure_name(op)})",
                "",
            ]
        for d in (d for d in runs if d["rows"][0]["op"] == op):
            versions = ", ".join(
                f"{k} {v}"
                for k, v in d["versions"].items()
                if k in ("torch", "triton", "nccl") and v
            )
            out += [
                f"### {d['world_size']} x {d['gpu']}",
                "",
                f"Run `{d['run']}` ({d['date']}; {versions}).",
                "",
                *markdown(report.run_table(d)),
                "",
            ]
        while out[-1] == "":
            out.pop()
    return "\n".join(out) + "\n"


def figures(docs: Sequence[dict[str, Any]], img: Path) -> list[Path]:
    """Draw each FIGURE_BASELINE op's figure of the newest runs of ``docs`` into ``img``;
    the paths written. Raises SystemExit without matplotlib."""
    from bench import plot

    runs = newest_runs(docs)
    written = []
    for op, baseline in FIGURE_BASELINE.items():
        mine = [d for d in runs if d["rows"][0]["op"] == op]
        if mine:
            written.append(plot.speedups(mine, baseline, img / figure_name(op)))
    return written


def write(
    store_path: Path | str = store.STORE, page_path: Path = PAGE, img: Path = IMG
) -> list[Path]:
    """Write the page of ``store_path`` to ``page_path`` and its figures into ``img``;
    the paths written (the page alone where matplotlib is missing: stderr says so)."""
    docs = store.runs(store.load(store_path))
    page_path.parent.mkdir(parents=True, exist_ok=True)
    page_path.write_text(page(docs))
    try:
        return [page_path, *figures(docs, img)]
    except SystemExit as e:  # plot.py's message: matplotlib missing
        print(f"{page_path}: written; figures not drawn: {e}", file=sys.stderr)
        return [page_path]


def main(store_path: Path | str = store.STORE) -> int:
    for path in write(store_path):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return 0
