"""Draw a run of the results store as bar charts: one panel per shape, each variant's ms,
the bound as a line.

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


def plot(doc: dict[str, Any], out: Path) -> Path:
    """Write one PNG with a panel per shape and return its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on the machines that run this
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"plot.py needs matplotlib (pip install '.[bench]'): {e}") from e
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
