"""Shipped tuned tables from the committed benchmark results.

    python -m bench.tables_from_results

For each world (2, 4): overlap_kernels/tables/nvidia-h200_x<world>.toml, with,
for ag_gemm, gemm_rs and gemm_ar, per shape the newest H200 run of that op and
world in the results store (bench/store.py) that ran it, and the library's own
choice there (variant ``ours_auto``: the table's) or the opt-in autotune's
(``ours_autotune``, measured on that host) where that ran another config more
than MARGIN faster; or instead a named variant of the benchmark
(``ours_one_shot``, ``ours_fused``, ...) whose config a table can ask for,
where that beat the run's choice by more than MARGIN in each of the REPEATS
newest runs with the same versions that timed both. An entry holds the config
fields a measurement decides and the time they took. Where a run captured
gemm_ar in CUDA graphs and the captured pair replayed more than MARGIN faster
than the library's choice captured, an entry that keeps that choice sends
captured calls to the pair (``graph_path``); so does one whose run captured the
pair already (its config's ``graph_path``): that replay says nothing of the fused
path's, which an earlier run found slower (a run with ``graph_path`` "same" in
the config, or the table entry removed, measures it again). Per shape, so that a run of a few
shapes (decode sizes, say) does not drop the others; only the shapes the
benchmark runs now (each op's DEFAULT_SHAPES), so that shapes an older run
tried stay out. The bench's shapes are what ``tuning.shape_key`` matches on:
M x K x N with M the gathered M for ag_gemm and K the per-rank K_local for
gemm_rs and gemm_ar; dtype from the file's settings.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from bench import store
from overlap_kernels.tuned import config_values, write_table

ROOT = Path(__file__).resolve().parent.parent
TABLES = ROOT / "overlap_kernels" / "tables"
GPU = "NVIDIA H200"
WORLDS = (2, 4)
# Per op: the config fields a table sets (those autotune chooses among, and
# group_by_chunk, which a named variant sets) and the path they run on (pieces,
# streams and the like are the template's). Off that path only `path` is kept:
# nothing else ran.
MEASURED = {
    "ag_gemm": (("path", "gemm", "mechanism", "comm_sms", "group_by_chunk"), "fused"),
    "gemm_rs": (("path", "mechanism", "producer", "comm_sms", "lag"), "fused"),
    "gemm_ar": (("path", "mechanism", "producer", "comm_sms", "lag"), "two_shot"),
}
UNDECIDED = (
    "fastest"  # a field the measurement left as it was: a table must not ask to measure again
)
MS_DIGITS = 4  # 0.1 us: run-to-run noise is larger


# A run's choice for a table: the library's or autotune's (named variants may replace it:
# REPEATS).
CHOICES = ("ours_auto", "ours_autotune")
# How much faster another choice must have run to replace the library's (docs/tuning.md's
# bar for a table against autotune).
MARGIN = 0.03
# How many of the newest runs (the entry's own included) that timed a named variant's
# config against their choice it must have beaten in each by MARGIN to replace it: a
# run times up to ten variants, so one of them beating the choice by 3% in one run is as
# likely noise as a real win.
REPEATS = 2
# The captured pair and the library's choice captured (bench/gemm_ar.py, decode shapes).
GRAPHED = ("sequential_graph", "ours_graph")


def runs_of(op: str, world: int) -> list[dict[str, Any]]:
    """The H200 runs of ``op`` on ``world`` ranks that ran ``ours_auto``, oldest first."""
    found = [
        doc
        for doc in store.runs(store.load())
        if doc["gpu"] == GPU
        and doc["world_size"] == world
        and doc["rows"][0]["op"] == op
        and _auto_rows(doc)
    ]
    if not found:
        raise SystemExit(
            f"no {GPU} runs of {op} on {world} ranks with ours_auto rows in {store.STORE}"
        )
    return found


def _auto_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per shape, the run's ``ours_auto`` row that passed its check; or its
    ``ours_autotune`` row where that ran another config (measured fields) and was more
    than MARGIN faster, or where ours_auto failed. The same config timed twice differs
    by noise (docs/tuning.md): a table does not flip on it."""
    by_shape: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in doc.get("rows", []):
        if r["variant"] in CHOICES and r["status"] == "ok" and r["ms"] is not None:
            by_shape.setdefault((r["shape"]["M"], r["shape"]["K"], r["shape"]["N"]), {})[
                r["variant"]
            ] = r
    chosen = []
    for rows in by_shape.values():
        auto, tuned = rows.get("ours_auto"), rows.get("ours_autotune")
        better = (
            tuned is not None
            and auto is not None
            and _measured(auto) != _measured(tuned)
            and tuned["ms"] < (1 - MARGIN) * auto["ms"]
        )
        chosen.append(tuned if auto is None or better else auto)
    return chosen


def _expressible(row: dict[str, Any], auto: dict[str, Any]) -> bool:
    """Whether a table can ask for ``row``'s config: it differs from ``auto``'s (the
    library's choice in the same run) only in fields a table holds (MEASURED)."""
    mine, theirs = row["config"], auto["config"]
    differ = {f for f in mine.keys() | theirs.keys() if mine.get(f) != theirs.get(f)}
    return differ <= set(MEASURED[row["op"]][0])


def _variants(doc: dict[str, Any], shape: dict[str, int]) -> list[dict[str, Any]]:
    """``doc``'s rows at ``shape`` of the named variants a table can ask for,
    fastest first (none where the run's ``ours_auto`` row failed)."""
    at_shape = [r for r in doc["rows"] if r["shape"] == shape and r["status"] == "ok"
                and r["ms"] is not None and r.get("config")]  # fmt: skip
    auto = next((r for r in at_shape if r["variant"] == "ours_auto"), None)
    if auto is None:
        return []
    named = [r for r in at_shape if r["variant"] not in CHOICES and _expressible(r, auto)]
    return sorted(named, key=lambda r: r["ms"])


def _won(doc: dict[str, Any], choice: dict[str, Any], measured: dict[str, Any]) -> bool | None:
    """Whether a named variant with config ``measured`` ran more than MARGIN faster
    than ``choice`` (the run's table choice) in ``doc``; None where ``doc`` did not
    time that config against another."""
    if _measured(choice) == measured:
        return None
    timed = [r for r in _variants(doc, choice["shape"]) if _measured(r) == measured]
    return None if not timed else timed[0]["ms"] < (1 - MARGIN) * choice["ms"]


def _repeated_win(
    docs: list[dict[str, Any]], doc: dict[str, Any], choice: dict[str, Any]
) -> dict[str, Any] | None:
    """The fastest of ``doc``'s named variants at ``choice``'s shape (``choice``:
    ``doc``'s) that beat the run's choice by more than MARGIN in each of the REPEATS
    newest of ``docs`` (oldest first; ``doc`` and older ones with its versions) that
    timed its config against their choice; or None."""
    shape = choice["shape"]
    older = [d for d in docs[: docs.index(doc)] if d.get("versions") == doc.get("versions")]
    for row in _variants(doc, shape):
        measured = _measured(row)
        if not _won(doc, choice, measured):
            continue
        outcomes = []
        for run in reversed(older):
            choices = [r for r in _auto_rows(run) if r["shape"] == shape]
            won = _won(run, choices[0], measured) if choices else None
            if won is not None:
                outcomes.append(won)
        if len(outcomes) >= REPEATS - 1 and all(outcomes[: REPEATS - 1]):
            return row
    return None


def _measured(row: dict[str, Any]) -> dict[str, Any]:
    """The config fields a table takes from ``row`` (MEASURED; only ``path`` off the
    fused path)."""
    fields, fused_path = MEASURED[row["op"]]
    config = row["config"]
    kept = fields if config["path"] == fused_path else ("path",)
    return {f: config[f] for f in kept if f in config and config[f] != UNDECIDED}


def _pair_replays_faster(doc: dict[str, Any], shape: dict[str, int]) -> bool:
    """In ``doc``, at ``shape``, the plain pair captured in CUDA graphs
    (``sequential_graph``) replayed more than MARGIN faster than the library's choice
    captured (``ours_graph``; gemm_ar's decode shapes): captured calls take the pair
    there (gemm_ar's ``graph_path``)."""
    graphed = {r["variant"]: r for r in doc["rows"]
               if r["shape"] == shape and r["variant"] in GRAPHED and r["status"] == "ok"}  # fmt: skip
    return (
        len(graphed) == 2
        and graphed["sequential_graph"]["ms"] < (1 - MARGIN) * graphed["ours_graph"]["ms"]
    )


def entries(
    op: str, docs: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One table entry per shape, from the newest of ``docs`` (oldest first) that ran
    it: the measured fields of the faster of its CHOICES, or of a named variant that
    beat that choice in the newest REPEATS runs that timed both; and the runs the
    entries came from."""
    benched = set(importlib.import_module(f"bench.{op}").DEFAULT_SHAPES)
    newest: dict[tuple, tuple[dict[str, Any], dict[str, Any]]] = {}
    for doc in docs:
        for row in _auto_rows(doc):
            shape = (row["shape"]["M"], row["shape"]["K"], row["shape"]["N"])
            if shape in benched:
                newest.pop(shape, None)  # (a newer run's goes last)
                newest[shape] = (doc, row)
    out, used = [], []
    for doc, row in sorted(newest.values(), key=lambda dr: docs.index(dr[0])):
        if doc not in used:
            used.append(doc)
        row = _repeated_win(docs, doc, row) or row
        values = _measured(row)
        # (ours_graph captured the library's choice: it says nothing of another config's replays)
        captured = row["variant"] == "ours_auto"
        pair_kept = row["config"].get("graph_path") == "sequential"
        if (captured and values["path"] != "sequential"
                and (pair_kept or _pair_replays_faster(doc, row["shape"]))):  # fmt: skip
            values["graph_path"] = "sequential"
        shape = row["shape"]
        out.append({"m": shape["M"], "k": shape["K"], "n": shape["N"], "dtype": doc["dtype"],
                    **values, "measured_ms": round(row["ms"], MS_DIGITS)})  # fmt: skip
    return out, used


def table(world: int) -> dict[str, Any]:
    """The table of ``world`` H200s; the runs it comes from must agree on versions (one header)."""
    made = {op: entries(op, runs_of(op, world)) for op in MEASURED}
    sources = [doc for _, used in made.values() for doc in used]
    versions = {(doc["versions"]["torch"], doc["versions"]["triton"], doc["versions"]["nccl"])
                for doc in sources}  # fmt: skip
    if len(versions) != 1:
        names = ", ".join(doc["run"] for doc in sources)
        raise SystemExit(
            f"{names} were made with different versions {sorted(versions)}: one table holds one"
        )
    ((torch, triton, nccl),) = versions
    host = {
        "gpu": GPU, "world": world, "torch": torch, "triton": triton, "nccl": nccl,
        "date": max(doc["date"] for doc in sources)[:10],
        "source": "bench/results.jsonl runs " + ", ".join(doc["run"] for doc in sources),
    }  # fmt: skip
    return {"host": host, **{op: made_entries for op, (made_entries, _) in made.items()}}


def summary(name: str, tab: dict[str, Any]) -> list[str]:
    host = tab["host"]
    lines = [f"{name}: {host['gpu']} x{host['world']}, torch {host['torch']}, triton {host['triton']}, "
             f"nccl {host['nccl']}, {host['date']}"]  # fmt: skip
    for op in MEASURED:
        for e in tab[op]:
            chosen = " ".join(f"{k}={v}" for k, v in config_values(e).items())
            shape = f"{e['m']}x{e['k']}x{e['n']} {e['dtype']}"
            lines.append(f"  {op:8} {shape}: {chosen} ({e['measured_ms']} ms)")
    return lines


def main() -> None:
    for world in WORLDS:
        path = TABLES / f"nvidia-h200_x{world}.toml"
        tab = table(world)
        write_table(path, tab)
        print("\n".join(summary(str(path.relative_to(ROOT)), tab)))


if __name__ == "__main__":
    main()
