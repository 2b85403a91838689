"""The examples entry (``python -m bench --op examples``) on 1 and 2 CPU ranks: every worked
example and its split baseline run, each fused result passes its check against the split
one, the rows land in a valid results document, and the table states each example's goal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import examples, harness
from bench.test_harness import CPU_RUN_TIMING

REPO = Path(__file__).resolve().parent.parent
SHAPE = "20x32x40"  # 20 rows: 10 per rank at 2, not a multiple of a tile; N not of 16


@pytest.mark.parametrize("world", [1, 2])
def test_examples_entry(world: int, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench", "--op", "examples", "--cpu-ranks", str(world),
           "--shapes", SHAPE, *CPU_RUN_TIMING.split(),
           "--store", str(tmp_path / "store.jsonl")]  # fmt: skip
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    (path,) = (tmp_path / "out").glob(f"examples_cpu_x{world}_*.json")
    doc = json.loads(path.read_text())
    harness.validate_results(doc)
    rows = {r["variant"]: r for r in doc["rows"]}
    assert list(rows) == [f"{e}_{kind}" for e in examples.EXAMPLES for kind in ("fused", "split")]
    for name, r in rows.items():
        assert r["status"] == "ok" and r["ms"] > 0, r
        if name.endswith("_fused"):  # checked against its split pair
            assert r["rel_err"] is not None and r["rel_err"] < 1e-2, r
    for e in examples.EXAMPLES:
        line = f"goal: {e}_fused at least as fast as {e}_split on every shape: worst "
        assert line in proc.stdout, proc.stdout[-3000:]
