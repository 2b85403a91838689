"""The tp_mlp entry on CPU: ``python -m bench --op tp_mlp`` on 2 gloo ranks with the real
library (Triton's interpreter), float32, one tiny shape; then its shape syntax, its place in
``--op all`` and its table, in-process.

The numbers of a CPU run mean nothing. What is checked: every variant runs (the three
compiled ones included, the routed one with its collectives in our ops, forward and
backward), its loss, output and gradients agree with the same fp64 reference and so with
each other, and the run lands in a temporary results store and ``$OUT``, never in
bench/results.jsonl. ~30 s with Inductor's cache warm, ~50 s cold, most of it compiling.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import cli, harness, store, tp_mlp
from bench.test_harness import CPU_RUN_TIMING

REPO = Path(__file__).resolve().parent.parent
T, H, F, WORLD = 16, 32, 64, 2
VARIANTS = ["cublas", "nccl_collectives", "torch", "ours", "ours_regather", "torch_compiled", "ours_compiled",
            "torch_compiled_routed", "bound"]  # fmt: skip
# fp32 (unit roundoff u = 2**-24). Each checked result (loss, y, dx, dW_up, dW_down) ends a
# chain of at most four matmuls whose dot products have H, F, H and F terms (dx; dW: T, after
# two), with the reduce-scatters' sums over WORLD inside them: at most 2 (T + H + F) roundings
# per element along the way (Higham: an n-term dot product is off by <= n u sum|a b|). For
# Gaussian data sum|a b| / |sum a b| is about sqrt(n) in the Frobenius norm, n <= max(T, H, F).
# The measured errors are ~2e-7; the bound, 1.1e-4, stays 36x below one bf16 rounding
# (2**-9) and 4x below a TF32 one (2**-11): a variant that rounds to either anywhere fails, as
# does one with a wrong shard or row (an O(1) error).
TOL = 2 * (T + H + F) * 2.0**-24 * max(T, H, F) ** 0.5


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    """One ``--op tp_mlp`` run on 2 CPU ranks; the process and the run's document."""
    tmp = tmp_path_factory.mktemp("tp_mlp")
    args = shlex.split(f"--op tp_mlp --cpu-ranks {WORLD} --shapes {T}x{H}x{F} {CPU_RUN_TIMING}")
    cmd = [sys.executable, "-m", "bench", *args, "--store", str(tmp / "store.jsonl")]
    # One compile worker per rank: with 2 ranks on 2 cores, a pool per rank only oversubscribes.
    env = {**os.environ, "OUT": str(tmp / "out"), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    proc = subprocess.run(
        cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    paths = list((tmp / "out").glob(f"tp_mlp_cpu_x{WORLD}_*.json"))
    assert len(paths) == 1, (paths, proc.stdout[-3000:], proc.stderr[-3000:])
    doc = json.loads(paths[0].read_text())
    (stored,) = store.runs(store.load(tmp / "store.jsonl"))  # the run's rows, in the store
    assert stored["run"] == paths[0].stem and stored["rows"] == doc["rows"]
    return proc, doc


def test_runs_end_to_end(smoke: tuple[Any, dict[str, Any]]) -> None:
    proc, doc = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAILED" not in proc.stderr
    harness.validate_results(doc)
    assert doc["world_size"] == WORLD and doc["settings"]["shapes"] == [f"{T}x{H}x{F}"]
    rows = {r["variant"]: r for r in doc["rows"]}
    assert [r["variant"] for r in doc["rows"]] == VARIANTS
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["shape"] == {"T": T, "H": H, "F": F}
        assert r["ms"] is not None and r["ms"] > 0
    flops = 12 * T * H * F / WORLD  # per rank: 2 GEMMs forward, 4 backward, 2 T H F/W each
    for name in ("cublas", *tp_mlp.WHOLE):
        assert rows[name]["config"]["dtype"] == "float32"  # CPU ranks: fp32, not bf16
        assert rows[name]["tflops"] == pytest.approx(flops / (rows[name]["ms"] * 1e-3) / 1e12)
    assert (
        rows["nccl_collectives"]["tflops"] is None and "busbw" in rows["nccl_collectives"]["note"]
    )
    assert rows["bound"]["ms"] == max(rows["cublas"]["ms"], rows["nccl_collectives"]["ms"])
    assert rows["ours"]["pct_of_bound"] is not None and rows["cublas"]["pct_of_bound"] is None
    # The pass ran on the forward and the backward graph, each time routing its gather and
    # its reduce-scatter (all-reduces, where counted: none).
    note = rows["torch_compiled_routed"]["note"]
    assert note.startswith("routed ag/rs") and note.split(": ")[1].startswith("1/1"), note
    assert note.count(", ") == 1, note
    out = proc.stdout[proc.stdout.index("\ntp_mlp\n") :]
    assert "geomean speedup of ours over torch" in out and "torch_compiled_routed" in out


def test_variants_agree(smoke: tuple[Any, dict[str, Any]]) -> None:
    """Every variant's loss, output, input gradient and weight-gradient shards against the
    same fp64 reference (largest relative Frobenius error of the five, max over ranks):
    each within TOL, so any two within 2 TOL of each other."""
    _, doc = smoke
    errs = {r["variant"]: r["rel_err"] for r in doc["rows"] if r["variant"] in tp_mlp.WHOLE}
    assert set(errs) == set(tp_mlp.WHOLE)
    assert all(e is not None and e <= TOL for e in errs.values()), (errs, TOL)


def test_parse_shape() -> None:
    assert tp_mlp.parse_shape("16x32x64") == (16, 32, 64)
    assert tp_mlp.parse_shape("llama3_70b_t8192") == (8192, 8192, 28672)
    assert list(tp_mlp.PRESETS.values()) == tp_mlp.DEFAULT_SHAPES
    assert set(tp_mlp.QUICK_SHAPES) <= set(tp_mlp.DEFAULT_SHAPES)
    for bad in ("16x32", "0x32x64", "8x32x4x2x16", "llama3"):
        with pytest.raises(ValueError, match="tp_mlp shape"):
            tp_mlp.parse_shape(bad)


def test_only_run_when_named() -> None:
    """Not in --op all (its TxHxF would take every GEMM op's MxKxN); --op tp_mlp runs it."""

    def shapes(argv: str) -> dict[str, list[tuple[int, ...]]]:
        return cli.shapes_by_op(cli.parse_args(shlex.split(argv)))

    assert "tp_mlp" not in shapes("") and "tp_mlp" not in shapes("--shapes 32x64x48")
    assert "tp_mlp" not in shapes("--shapes tp_mlp:16x32x64 gemm_ar:16x64x48")
    assert shapes("--op tp_mlp") == {"tp_mlp": tp_mlp.DEFAULT_SHAPES}
    assert shapes("--op tp_mlp --shapes 16x32x64 llama3_8b_t4096") == {
        "tp_mlp": [(16, 32, 64), (4096, 4096, 14336)]
    }


def test_table_marks_and_speedups() -> None:
    def row(variant: str, ms: float | None, status: str = "ok", note: str = "") -> dict[str, Any]:
        return {"op": "tp_mlp", "shape": {"T": 8, "H": 4, "F": 4}, "variant": variant,
                "status": status, "ms": ms, "tflops": None, "pct_of_bound": None,
                "rel_err": None, "config": None, "note": note}  # fmt: skip

    rows = [row("torch", 2.0), row("ours", 1.0), row("ours_compiled", 4.0, "check_failed"),
            row("torch_compiled", None, "error", "raised RuntimeError: no")]  # fmt: skip
    table = tp_mlp.format_table(rows)
    assert "geomean speedup of ours over torch: 2.000 (1 of 1 shapes)" in table
    assert "geomean speedup of ours_compiled over torch: - (0 of 1 shapes)" in table
    assert "4.000!" in table and "ERR" in table and "raised RuntimeError" in table
