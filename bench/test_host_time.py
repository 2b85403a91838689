"""``python -m bench.host_time --cpu`` end to end (Triton's interpreter, 2 gloo ranks),
then its pure pieces in-process. The times of a CPU run mean nothing; what is checked is
that every op and M yields positive, finite times, the path the fused ops ran, and a
valid results file. ~15 s, most of it the interpreter.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import harness, host_time
from bench.host_time import OpTimes

REPO = Path(__file__).resolve().parent.parent
M_VALUES = (16, 32)
# Timed batches per call: two, the calls in one order and then in the other; each rank's
# median is of them (the interpreter's ~0.1 s per call is the test's time).
REPS = 2


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    """One CPU run: its rows into a store in a fresh directory, which is also $OUT
    (where the run's document goes)."""
    out = tmp_path_factory.mktemp("host_time")
    m_values = [str(m) for m in M_VALUES]
    few = ["--warmup", "1", "--reps", str(REPS)]
    cmd = [
        sys.executable,
        "-m",
        "bench.host_time",
        "--cpu",
        "--m",
        *m_values,
        *few,
        "--pin-cores",  # (its code path; on CPU ranks the times mean nothing either way)
        "--store",
        str(out / "store.jsonl"),
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, "OUT": str(out)}, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    paths = list(out.glob("host_time_cpu_x2_*.json"))
    assert len(paths) == 1, (paths, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc, json.loads(paths[0].read_text())


def test_exits_ok_and_prints_the_table_last(cpu_run: tuple[Any, dict[str, Any]]) -> None:
    proc, _ = cpu_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("host time per call") :]
    assert "these times mean nothing" in table
    for op in host_time.OPS:
        for m in M_VALUES:
            assert any(line.split()[:2] == [op, str(m)] for line in table.splitlines()), table


def test_every_op_and_m_has_positive_times(cpu_run: tuple[Any, dict[str, Any]]) -> None:
    _, doc = cpu_run
    harness.validate_results(doc)
    assert doc["world_size"] == 2 and doc["gpu"] == "cpu" and doc["settings"]["cpu"] is True
    rows = {(r["shape"]["M"], r["variant"]): r for r in doc["rows"]}
    expected = {
        (m, f"{who}_{op}_{what}")
        for op in host_time.OPS
        for m in M_VALUES
        for who in ("ours", "torch")  # (a fused op's torch: its pair)
        for what in ("enqueue", "b2b")
    }
    assert set(rows) == expected
    for key, r in rows.items():
        assert r["op"] == "host_time" and r["shape"] == {"M": key[0], "K": 64, "N": 64}
        assert r["status"] == "ok", r
        assert r["ms"] is not None and math.isfinite(r["ms"]) and r["ms"] > 0, r
        assert all(us > 0 for us in r["config"]["per_rank_us"]), r
    for op in host_time.FUSED_OPS:
        for m in M_VALUES:
            r = rows[(m, f"ours_{op}_enqueue")]
            assert len(r["config"]["per_rank_us"]) == 2  # each rank's median
            assert r["ms"] == pytest.approx(max(r["config"]["per_rank_us"]) * 1e-3)
            batches = r["config"]["per_rank_batches_us"]  # the batches each median is of
            assert [len(b) for b in batches] == [REPS, REPS]
            assert [statistics.median(b) for b in batches] == r["config"]["per_rank_us"]
            pair_us = rows[(m, f"torch_{op}_enqueue")]["ms"] * 1e3
            path = r["config"]["path"]
            bound = 1.1 * pair_us if path == "sequential" else host_time.FUSED_BOUND_US
            assert r["config"]["bound_us"] == pytest.approx(bound), path
            assert isinstance(path, str) and path
            assert r["pct_of_bound"] == pytest.approx(100 * bound * 1e-3 / r["ms"])
    for m in M_VALUES:
        ours, cublas = rows[(m, "ours_matmul_enqueue")], rows[(m, "torch_matmul_enqueue")]
        assert ours["config"]["bound_us"] == pytest.approx(2 * cublas["ms"] * 1e3)


def test_over_ranks_takes_the_max_and_names_differing_paths() -> None:
    ranks = [
        [OpTimes("gemm_ar", 16, ours_enqueue_us=10.0, ours_b2b_us=30.0, path="one_shot")],
        [OpTimes("gemm_ar", 16, ours_enqueue_us=12.0, ours_b2b_us=20.0, path="sequential",
                 sleep_outlasted_host=False)],
    ]  # fmt: skip
    (merged,) = host_time.over_ranks(ranks)
    assert (merged.ours_enqueue_us, merged.ours_b2b_us) == (12.0, 30.0)
    assert merged.path == "one_shot/sequential" and not merged.sleep_outlasted_host
    assert merged.met() is True


def test_a_failed_op_gives_error_rows_and_a_marked_table() -> None:
    s = host_time.HostTimeSettings(m_values=(16,), ops=("gemm_rs",))
    failed = OpTimes("gemm_rs", 16, error="RuntimeError: boom")
    slow = OpTimes(
        "gemm_rs", 64, ours_enqueue_us=40.0, ours_b2b_us=50.0, sleep_outlasted_host=False
    )
    rows = host_time.rows_of([failed, slow], s)
    harness.validate_results({**_doc_frame(), "rows": rows})
    assert [r["status"] for r in rows] == ["error", "error", "ok", "ok"]
    assert rows[2]["config"]["met"] is False and "ran out" in rows[2]["note"]
    table = host_time.format_table([failed, slow], s)
    assert "ERR" in table and "40.0*" in table and "raise --sleep-ms" in table


def test_the_table_gives_each_enqueue_as_a_multiple_of_torch_matmuls_at_its_m() -> None:
    s = host_time.HostTimeSettings(m_values=(16, 64), ops=("matmul", "gemm_ar"))
    times = [
        OpTimes("matmul", 16, ours_enqueue_us=30.0, ours_b2b_us=40.0, torch_enqueue_us=20.0),
        OpTimes("gemm_ar", 16, ours_enqueue_us=35.0, ours_b2b_us=50.0),
        OpTimes("gemm_ar", 64, ours_enqueue_us=35.0, ours_b2b_us=50.0),  # no matmul row at 64
    ]
    ratios = [line.split()[4] for line in host_time.format_table(times, s).splitlines()[3:6]]
    assert ratios == ["1.50", "1.75", "-"]


def test_the_plain_path_is_bounded_by_its_pair_and_a_fused_path_by_25_us() -> None:
    """A fused op's sequential path (every op on one rank) within 1.1x its pair's
    enqueue, timed beside it; a fused path within 25 us; no bound without a pair."""
    times = [
        OpTimes("gemm_ar", 16, ours_enqueue_us=21.0, ours_b2b_us=30.0, path="sequential",
                torch_enqueue_us=20.0, torch_b2b_us=25.0),  # 1.05x: met
        OpTimes("ag_gemm", 16, ours_enqueue_us=23.0, ours_b2b_us=30.0, path="sequential",
                torch_enqueue_us=20.0, torch_b2b_us=25.0),  # 1.15x: not met
        OpTimes("gemm_rs", 16, ours_enqueue_us=24.0, ours_b2b_us=30.0, path="fused",
                torch_enqueue_us=20.0, torch_b2b_us=25.0),  # a fused path: 25 us
        OpTimes("gemm_rs", 64, ours_enqueue_us=21.0, ours_b2b_us=30.0, path="sequential"),
    ]  # fmt: skip
    assert [t.bound_us() for t in times] == pytest.approx([22.0, 22.0, 25.0, None])
    assert [t.met() for t in times] == [True, False, True, None]
    s = host_time.HostTimeSettings(m_values=(16, 64), world=1)
    rows = {(r["variant"], r["shape"]["M"]): r for r in host_time.rows_of(times, s)}
    assert rows[("ours_gemm_ar_enqueue", 16)]["config"]["bound_us"] == pytest.approx(22.0)
    assert rows[("ours_ag_gemm_enqueue", 16)]["config"]["met"] is False
    assert rows[("torch_gemm_ar_enqueue", 16)]["ms"] == pytest.approx(20e-3)  # the pair's row
    assert ("torch_gemm_rs_enqueue", 64) not in rows  # no pair timed
    table = host_time.format_table(times, s)
    assert "<= 1.1x the pair's (a fused op's sequential path, one rank's included)" in table


def test_shapes_that_do_not_split_over_the_ranks_are_refused() -> None:
    with pytest.raises(SystemExit):
        host_time.parse_args(["--cpu", "--m", "15"])
    with pytest.raises(SystemExit):
        host_time.parse_args(["--cpu", "--k", "63", "--ops", "gemm_ar"])
    s, _ = host_time.parse_args(["--cpu", "--m", "15", "--ops", "matmul", "gemm_ar"])
    assert s.m_values == (15,) and s.sleep_ms == 0.0


def _doc_frame() -> dict[str, Any]:
    return {
        "schema": harness.SCHEMA_VERSION,
        **{k: None for k in harness.TOP_KEYS if k not in ("schema", "rows")},
    }
