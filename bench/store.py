"""The results store: every benchmark run's rows, one JSON record per line, in one file.

``bench/results.jsonl`` holds every run this repository has measured. A record
is one row of a run (harness.ROW_KEYS: op, shape, variant, status, ms, ...)
with what says where, when and how it ran (RUN_KEYS: the run's id, date, host,
GPU, world size, versions, operand dtype). Runs append; nothing is rewritten. ``python -m
bench.report`` prints tables from it, ``bench/plot.py`` draws them.

A GPU session writes each run's schema-1 document into ``$OUT`` as well (the
device machine's store does not come back); merge those here with
``python -m bench.store add FILE...`` (runs already in the store are skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench import harness

STORE = Path(__file__).resolve().parent / "results.jsonl"
RUN_KEYS = ("run", "date", "host", "gpu", "world", "versions", "dtype")
RECORD_KEYS = RUN_KEYS + harness.ROW_KEYS


def run_id(doc: dict[str, Any]) -> str:
    """A run's id: op, GPU, world size and start time (harness.results_filename's stem)."""
    op = doc["rows"][0]["op"] if doc["rows"] else "bench"
    date = harness._dt.datetime.fromisoformat(doc["date"])
    return harness.results_filename(op, doc["gpu"], doc["world_size"], date).removesuffix(".json")


def records(doc: dict[str, Any], host: str | None) -> list[dict[str, Any]]:
    """The store's records of schema-1 document ``doc``, run on ``host`` (None: the host
    the document names, if any)."""
    harness.validate_results(doc)
    run = {
        "run": run_id(doc),
        "date": doc["date"],
        "host": host if host is not None else doc.get("host"),
        "gpu": doc["gpu"],
        "world": doc["world_size"],
        "versions": doc["versions"],
        "dtype": doc["settings"].get("dtype"),
    }
    return [{**run, **row} for row in doc["rows"]]


def write_run(doc: dict[str, Any], store: Path | str = STORE) -> Path:
    """A finished run: its records appended to ``store`` (with the document's host),
    and its schema-1 document written into ``$OUT`` when that is set (what a GPU
    session brings home, for ``python -m bench.store add``). Returns ``store``."""
    append(doc, store)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        path = Path(out) / f"{run_id(doc)}.json"
        path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")  # strict JSON: no NaN
    return Path(store)


def append(doc: dict[str, Any], store: Path | str = STORE, host: str | None = None) -> int:
    """Append ``doc``'s rows, run on ``host`` (None: the document's), to ``store``
    unless its run is there already; the number of records added."""
    store = Path(store)
    new = records(doc, host)
    if new and new[0]["run"] in {r["run"] for r in load(store)}:
        return 0
    lines = "".join(
        json.dumps(r, allow_nan=False) + "\n" for r in new
    )  # all or nothing: NaN raises first
    store.parent.mkdir(parents=True, exist_ok=True)
    with store.open("a") as f:
        f.write(lines)
    return len(new)


def load(store: Path | str = STORE) -> list[dict[str, Any]]:
    """Every record of ``store`` (none where it does not exist), each checked for the schema."""
    store = Path(store)
    if not store.exists():
        return []
    out = []
    for n, line in enumerate(store.read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if tuple(record) != RECORD_KEYS:
            raise ValueError(f"{store}:{n}: keys {list(record)}, expected {list(RECORD_KEYS)}")
        out.append(record)
    return out


def runs(records_: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records grouped back into one schema-1-like document per run, oldest first:
    ``run``, ``date``, ``host``, ``gpu``, ``world_size``, ``versions``, ``dtype`` and ``rows``."""
    by_run: dict[str, dict[str, Any]] = {}
    for r in records_:
        doc = by_run.setdefault(
            r["run"],
            {"run": r["run"], "date": r["date"], "host": r["host"], "gpu": r["gpu"], "world_size": r["world"],
             "versions": r["versions"], "dtype": r["dtype"], "rows": []},
        )  # fmt: skip
        doc["rows"].append({k: r[k] for k in harness.ROW_KEYS})
    return sorted(by_run.values(), key=lambda d: d["date"])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.store", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser(
        "add", help="append runs' schema-1 JSON files (a GPU session's $OUT) to the store"
    )
    add.add_argument("files", nargs="+", type=Path)
    add.add_argument("--host", help="the host they ran on (default: the one each file names)")
    add.add_argument("--store", type=Path, default=STORE)
    args = p.parse_args(argv)
    for path in args.files:
        doc = json.loads(path.read_text())
        n = append(doc, args.store, host=args.host)
        print(f"{path.name}: {n} records added" if n else f"{path.name}: run already in the store")
    return 0


if __name__ == "__main__":
    sys.exit(main())
