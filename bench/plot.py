"""Draw runs of the results store: ``plot`` one run as bar charts (one panel per shape,
each variant's ms, the bound as a line); ``speedups`` several runs of one op as each
variant's speedup over the plain pair per shape (docs/results.md's figures, drawn by
``python -m bench.report --docs``).

    python bench/plot.py ag_gemm_nvidia-h200_x4_20261121T095320Z [-o out.png]

A run id (``python -m bench.report --runs`` lists them) or an op's name, for its
newest run. Reads only the store (bench/store.py), so charts can be redrawn from old runs.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import store
from bench.harness import shape_str

# Ours in one colour, baselines in another, parts alone (GEMM or collective only) in grey.
_PARTS = ("cublas", "nccl_all_gather", "nccl_reduce_scatter", "nccl_all_reduce", "ours_local_gemm",
          "grouped_gemm")  # fmt: skip
# Computed rows, not bars: the bound is drawn as a line; moe's traffic row holds byte counts.
_NOT_BARS = ("bound", "traffic")


def _colour(variant: str) -> str:
    if variant in _PARTS:
        return "#9e9e9e"
    return "#d95f02" if variant.startswith("ours") else "#1b9e77"


def _pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend; SystemExit naming the extra without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on the machines that run this
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"plot.py needs matplotlib (pip install '.[bench]'): {e}") from e
    return plt


def plot(doc: dict[str, Any], out: Path) -> Path:
    """Write one PNG with a panel per shape and return its path."""
    plt = _pyplot()
    shapes: dict[str, list[dict[str, Any]]] = {}
    for row in doc["rows"]:
        shapes.setdefault(shape_str(row["shape"]), []).append(row)
    cols = min(2, len(shapes)) or 1
    nrows = math.ceil(len(shapes) / cols) or 1
    fig, axes = plt.subplots(nrows, cols, figsize=(7 * cols, 4 * nrows), squeeze=False)
    for ax, (shape, rows) in zip(axes.flat, shapes.items()):
        bars = [r for r in rows if r["variant"] not in _NOT_BARS]
        bound = next((r["ms"] for r in rows if r["variant"] == "bound"), None)
        names = [r["variant"] for r in bars]
        heights = [r["ms"] or 0.0 for r in bars]
        ax.bar(names, heights, color=[_colour(n) for n in names])
        for i, r in enumerate(bars):
            if r["ms"] is None:
                label = "ERR" if r["status"] == "error" else "n/a"
            else:
                label = f"{r['ms']:.3f}" + (" WRONG" if r["status"] == "check_failed" else "")
            ax.annotate(label, (i, heights[i]), ha="center", va="bottom", fontsize=8)
        if bound is not None:
            ax.axhline(bound, color="black", linestyle="--", linewidth=1)
            ax.text(
                len(bars) - 0.5, bound, f" bound {bound:.3f}", va="bottom", ha="right", fontsize=8
            )
        dims = "x".join(rows[0]["shape"])  # MxKxN, or TxHxExkxF for moe
        ax.set_title(f"{rows[0]['op']} {shape} ({dims})")
        ax.set_ylabel("ms (lower is better)")
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    for ax in list(axes.flat)[len(shapes) :]:
        ax.axis("off")
    fig.suptitle(
        f"{doc['gpu']} x{doc['world_size']}, torch {doc['versions'].get('torch')}, {doc['date']}"
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def speedup_variants(doc: dict[str, Any], baseline: str) -> list[str]:
    """The variants of ``doc`` that do the whole op (they have a % of the bound), in the
    run's order: the bars of a speedup chart over ``baseline``."""
    whole = [r["variant"] for r in doc["rows"] if r["pct_of_bound"] is not None]
    return [v for v in dict.fromkeys(whole) if v not in (baseline, *_NOT_BARS)]


def speedups(docs: list[dict[str, Any]], baseline: str, out: Path) -> Path:
    """Write one PNG of runs ``docs`` (one op; a panel per run, top to bottom): per shape,
    each whole-op variant's speedup over ``baseline`` (its ms / the variant's ms; > 1 is
    faster), the bound's as a dotted tick (perfect overlap), 1 as a line. A variant keeps
    its colour in every panel; one legend below. Returns the path."""
    plt = _pyplot()
    variants = list(dict.fromkeys(v for d in docs for v in speedup_variants(d, baseline)))
    # ours_auto and PyTorch's op in plot()'s colours; the rest from tab10 without those two.
    # (grey, tab10's 7, is plot()'s colour of the parts alone.)
    others = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i not in (1, 2, 7)]
    colours, n = {}, 0
    for v in variants:
        if v.startswith("ours_auto") or not v.startswith("ours"):
            colours[v] = _colour(v)
        else:
            colours[v], n = others[n % len(others)], n + 1
    fig, axes = plt.subplots(len(docs), 1, figsize=(10, 3.2 * len(docs) + 1.0), squeeze=False)
    for ax, doc in zip(axes.flat, docs):
        by_shape: dict[str, dict[str, dict[str, Any]]] = {}
        for r in doc["rows"]:
            by_shape.setdefault(shape_str(r["shape"]), {})[r["variant"]] = r
        shapes = [s for s, vs in by_shape.items() if (vs.get(baseline) or {}).get("ms")]
        mine = [v for v in variants if v in speedup_variants(doc, baseline)]
        width = 0.8 / max(1, len(mine))
        for i, v in enumerate(mine):
            xs, ys = [], []
            for j, s in enumerate(shapes):
                r = by_shape[s].get(v)
                if r is not None and r["status"] == "ok" and r["ms"]:
                    xs.append(j - 0.4 + (i + 0.5) * width)
                    ys.append(by_shape[s][baseline]["ms"] / r["ms"])
            ax.bar(xs, ys, width, label=v, color=colours[v])
        for j, s in enumerate(shapes):
            bound = (by_shape[s].get("bound") or {}).get("ms")
            if bound:
                ratio = by_shape[s][baseline]["ms"] / bound
                ax.hlines(ratio, j - 0.45, j + 0.45, colors="black", linestyles="dotted")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(shapes)), shapes, fontsize=8)
        ax.set_ylabel(f"x {baseline}")
        ax.set_title(f"{doc['gpu']} x{doc['world_size']}: {doc['run']}", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[v]) for v in variants]
    fig.legend(handles, variants, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(
        f"speedup over {baseline} per shape (dotted: the bound, perfect overlap)", fontsize=10
    )
    rows = -(-len(variants) // 3)
    fig.tight_layout(rect=(0, 0.04 + 0.16 * rows / fig.get_figheight(), 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72, metadata={"Software": None})  # no version stamp: same bytes again
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a run id of the results store, or an op (its newest run)")
    p.add_argument(
        "-o", "--out", type=Path, default=None, help="PNG path (default: ./<run id>.png)"
    )
    p.add_argument("--store", type=Path, default=store.STORE)
    args = p.parse_args(argv)
    found = [
        d for d in store.runs(store.load(args.store)) if args.run in (d["run"], d["rows"][0]["op"])
    ]
    if not found:
        p.error(f"no run '{args.run}' in {args.store}")
    doc = found[-1]
    print(plot(doc, args.out or Path(f"{doc['run']}.png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
