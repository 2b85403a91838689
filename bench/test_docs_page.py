"""CPU tests of docs/results.md's generator (bench/docs_page.py): its tables from a tiny
store, and that the committed page is what the committed store makes. The figures need
matplotlib (the [bench] extra); where it is missing their test is skipped, the rest run."""

from __future__ import annotations

import datetime as dt
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from bench import docs_page, harness, report, store

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _row(shape: dict[str, int], variant: str, ms: float, **fields: Any) -> dict[str, Any]:
    row = dict.fromkeys(harness.ROW_KEYS)
    whole_op = variant not in ("cublas", "nccl_all_gather")
    pct = 100.0 if whole_op else None
    return {**row, "op": "ag_gemm", "shape": shape, "variant": variant, "status": "ok",
            "ms": ms, "pct_of_bound": pct, **fields}  # fmt: skip


def _run(date: dt.datetime, world: int, auto_ms: float) -> dict[str, Any]:
    """An ag_gemm run of two shapes: the pair 2 ms, PyTorch's op 1.6, ours ``auto_ms``."""
    rows = []
    for m in (512, 1024):
        shape = {"M": m, "K": 64, "N": 32}
        rows += [
            _row(shape, "cublas", 1.0),
            _row(shape, "nccl_all_gather", 0.5),
            _row(shape, "sequential", 2.0),
            _row(shape, "torch_fused", 1.6),
            _row(shape, "ours_auto", auto_ms, config={"path": "fused", "gemm": "triton"}),
            _row(shape, "bound", 1.0),
        ]
    versions = {"python": "3.12", "torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0",
                "nccl": "2.28.9", "overlap_kernels": "0.1"}  # fmt: skip
    return harness.build_results(
        rows, gpu="NVIDIA H200", world=world, versions=versions, env={},
        settings={"iters": 100, "dtype": "bfloat16"}, date=date,
    )  # fmt: skip


@pytest.fixture
def tiny_store(tmp_path: Path) -> Path:
    path = tmp_path / "results.jsonl"
    day = dt.datetime(2026, 11, 21, 9, 0, 0, tzinfo=dt.UTC)
    store.append(_run(day, 4, 1.0), path)  # older x4 run: must not be shown
    store.append(_run(day + dt.timedelta(hours=1), 4, 1.6), path)  # newest x4
    store.append(_run(day + dt.timedelta(hours=2), 2, 0.8), path)  # newest x2
    return path


def _tables(page: str) -> list[list[list[str]]]:
    """Every Markdown table of ``page``, as rows of cells (header first, rule dropped)."""
    tables, current = [], []
    for line in [*page.splitlines(), ""]:
        if line.startswith("|"):
            if not set(line) <= set("|-"):
                current.append([c.strip() for c in line.strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    return tables


def test_the_page_holds_the_newest_runs_tables_with_their_numbers(
    tiny_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per GPU and world size the newest run's table as bench.report prints it (ms, the
    path, the speedups, % of the bound) and the README's summary; the older run is not
    shown, and the page names the command and the runs it was made from."""
    import bench.ag_gemm

    monkeypatch.setattr(bench.ag_gemm, "DEFAULT_SHAPES", [(512, 64, 32), (1024, 64, 32)])
    page = docs_page.page(store.runs(store.load(tiny_store)))
    x4, x2 = "ag_gemm_nvidia-h200_x4_20261121T100000Z", "ag_gemm_nvidia-h200_x2_20261121T110000Z"
    assert "`python -m bench.report --docs`" in page.splitlines()[2]
    assert f"Runs: `{x4}`, `{x2}`." in page
    assert "20261121T090000Z" not in page

    summary, table4, table2 = _tables(page)
    assert summary[0] == ["op", "4 x NVIDIA H200", "2 x NVIDIA H200"]
    assert summary[1] == [
        "ag_gemm, M > 512",
        f"1.250x (1 shapes) (`{x4}`)",
        f"2.500x (1 shapes) (`{x2}`)",
    ]
    assert summary[2] == ["ag_gemm, M <= 512 (decode)", f"1.250x (1 shapes) (`{x4}`)",
                          f"2.500x (1 shapes) (`{x2}`)"]  # fmt: skip
    head = ["shape", "cublas", "nccl_all_gather", "sequential", "torch_fused", "ours_auto",
            "bound", "xsequential", "xtorch_fused", "xours_autotune", "%bound"]  # fmt: skip
    assert table4[0] == head and table2[0] == head
    assert table4[1] == ["512x64x32", "1.000", "0.500", "2.000", "1.600", "1.600(f)", "1.000",
                         "1.25", "1.00", "-", "62"]  # fmt: skip
    assert table2[2] == ["1024x64x32", "1.000", "0.500", "2.000", "1.600", "0.800(f)", "1.000",
                         "2.50", "2.00", "-", "125"]  # fmt: skip
    assert "- geomean speedup of ours_auto over sequential: 2.500 (2 of 2 shapes;" in page
    assert page.index("### 4 x NVIDIA H200") < page.index("### 2 x NVIDIA H200")
    assert "![ag_gemm: speedup over sequential per shape and variant]" in page


def test_grids_become_markdown_and_notes_list_items() -> None:
    """docs_page.markdown: a right-aligned grid (cells with single spaces, '|' and '*'
    escaped) becomes a table; a note right under it is not a row."""
    text = "\n".join(
        [
            "shape  ms (GB/s)  flag",
            "----------------------",
            "  4x8  1.0 (2.5)    a*",
            "  8x8       0.25   b|c",
            "a note under the grid",
        ]
    )
    assert docs_page.markdown(text) == [
        "| shape | ms (GB/s) | flag |",
        "|---|---|---|",
        r"| 4x8 | 1.0 (2.5) | a\* |",
        r"| 8x8 | 0.25 | b\|c |",
        "",
        "- a note under the grid",
    ]


def test_the_committed_page_is_what_the_committed_store_makes() -> None:
    """docs/results.md cannot go stale: regenerate it with ``python -m bench.report --docs``
    whenever bench/results.jsonl or the generator changes, and commit both."""
    made = docs_page.page(store.runs(store.load()))
    committed = docs_page.PAGE.read_text()
    assert committed == made, (
        "docs/results.md is not what bench/results.jsonl makes: run "
        "`python -m bench.report --docs` (figures need the [bench] extra) and commit "
        "docs/results.md and docs/img/"
    )
    for image in re.findall(r"\]\((img/[^)]+)\)", committed):
        assert (docs_page.PAGE.parent / image).is_file(), f"docs/{image} is missing"


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="the figures need matplotlib (the [bench] extra)")
def test_the_figures_are_drawn_small(tiny_store: Path, tmp_path: Path) -> None:
    """write(): the page and one figure per op, each a PNG well under 100 KB."""
    page_path, img = tmp_path / "results.md", tmp_path / "img"
    written = docs_page.write(tiny_store, page_path, img)
    assert written == [page_path, img / "ag_gemm_speedup.png"]
    png = written[1].read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) < 100_000


def test_without_matplotlib_the_page_is_still_written(
    tiny_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page does not depend on the figures: without matplotlib it is written, and
    stderr says the figures were not drawn."""

    def no_matplotlib(*args: Any) -> list[Path]:
        raise SystemExit("plot.py needs matplotlib (pip install '.[bench]')")

    monkeypatch.setattr(docs_page, "figures", no_matplotlib)
    page_path = tmp_path / "results.md"
    assert docs_page.write(tiny_store, page_path, tmp_path / "img") == [page_path]
    assert page_path.read_text() == docs_page.page(store.runs(store.load(tiny_store)))


def test_the_summary_has_no_column_for_one_rank(
    tiny_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-rank run (nothing to overlap: its tables hold the one-rank goal) gets its
    table on the page but no column in the README's summary of speedups over the pair."""
    import bench.ag_gemm

    monkeypatch.setattr(bench.ag_gemm, "DEFAULT_SHAPES", [(512, 64, 32), (1024, 64, 32)])
    store.append(_run(dt.datetime(2026, 11, 21, 12, 0, 0, tzinfo=dt.UTC), 1, 1.9), tiny_store)
    docs = store.runs(store.load(tiny_store))
    assert report.summary(docs).splitlines()[0] == "| op | 4 x NVIDIA H200 | 2 x NVIDIA H200 |"
    assert "### 1 x NVIDIA H200" in docs_page.page(docs)
