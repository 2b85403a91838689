"""The templates' numbers have sources a reader can look up: every ``--run ID``
they cite is a run in the results store, which ``python -m bench.report --run
ID`` prints, and every log they cite under bench/logs/ is there."""

from __future__ import annotations

import re
from pathlib import Path

from bench import report, store

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
RUN = re.compile(r"--run\s+(?:#\s+)?([a-z0-9_-]+_x\d+_\d{8}T\d{6}Z)")
LOG = re.compile(r"(?<![:\w])bench/logs/([A-Za-z0-9_][A-Za-z0-9_.*-]*)")


def _cited(pattern: re.Pattern) -> dict[str, list[str]]:
    """What the templates cite: each match -> the templates that cite it."""
    cited: dict[str, list[str]] = {}
    for path in sorted(TEMPLATES.glob("*.toml")):
        for found in pattern.findall(path.read_text()):
            cited.setdefault(found, []).append(path.name)
    return cited


def test_every_run_a_template_cites_is_in_the_store_and_printed_by_report(capsys):
    cited = _cited(RUN)
    assert len(cited) > 20  # (the pattern still finds the templates' citations)
    runs = {d["run"] for d in store.runs(store.load(store.STORE))}
    missing = {run: where for run, where in cited.items() if run not in runs}
    assert not missing, f"runs cited by templates but not in {store.STORE}: {missing}"
    run = sorted(cited)[0]
    assert report.main(["--run", run]) == 0
    assert f"run {run} (" in capsys.readouterr().out


def test_every_log_a_template_cites_is_in_bench_logs():
    logs = Path(__file__).resolve().parent / "logs"
    missing = [name for name in _cited(LOG) if not list(logs.glob(name))]
    assert not missing, f"logs cited by templates but not in {logs}: {missing}"
