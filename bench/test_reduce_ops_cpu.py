"""The gemm_rs and gemm_ar entries on CPU: ``python -m bench --op all`` on 2 gloo ranks with
the real library (Triton's interpreter), then the shared pieces they rely on, in-process.

The numbers of a CPU run mean nothing; what is checked is that every variant runs, passes
its check against ``sequential``, records the path it took, and lands in a valid results
file per op. The run also gives ``moe`` one tiny shape of its own syntax, so ``--op all``
writes its file too (its rows are tested in test_moe_cpu.py). ~10 s, most of it the
interpreter.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import common, gemm_rs, harness, store
from bench.harness import RunContext, Settings, WallClock
from bench.test_harness import CPU_RUN_TIMING

REPO = Path(__file__).resolve().parent.parent
SHAPES = ("32x64x48", "16x64x48")  # gemm_ar: 32 rows take two_shot, 16 one_shot (interpreter)
MOE_SHAPE = "8x32x4x2x16"  # TxHxExKxF: only moe takes it, and moe takes only it
OPS = ("ag_gemm", "gemm_rs", "gemm_ar", "decode", "moe")


@pytest.fixture(scope="module")
def all_ops_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    """One ``--op all`` run; the process and each op's results document."""
    tmp = tmp_path_factory.mktemp("bench_all")
    shapes = " ".join((*SHAPES, MOE_SHAPE))
    args = shlex.split(f"--op all --cpu-ranks 2 --shapes {shapes} {CPU_RUN_TIMING}")
    cmd = [sys.executable, "-m", "bench", *args, "--store", str(tmp / "store.jsonl")]
    env = {**os.environ, "OUT": str(tmp / "out")}
    proc = subprocess.run(
        cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    docs = {}
    stored = {run["rows"][0]["op"]: run for run in store.runs(store.load(tmp / "store.jsonl"))}
    for op in OPS:
        paths = list((tmp / "out").glob(f"{op}_cpu_x2_*.json"))  # each run's document, in $OUT
        assert len(paths) == 1, (op, paths, proc.stdout[-3000:], proc.stderr[-3000:])
        docs[op] = json.loads(paths[0].read_text())
        assert stored[op]["rows"] == docs[op]["rows"]  # and its rows in the store
    return proc, docs


def _rows(doc: dict[str, Any]) -> dict[tuple[int, str], dict[str, Any]]:
    harness.validate_results(doc)  # schema 1: every row has exactly ROW_KEYS
    assert doc["world_size"] == 2 and doc["settings"]["dtype"] == "bfloat16"
    assert doc["settings"]["shapes"] == list(SHAPES)
    return {(r["shape"]["M"], r["variant"]): r for r in doc["rows"]}


def _check_common(rows: dict[tuple[int, str], dict[str, Any]], variants: list[str], comm: str):
    for m in (32, 16):
        assert [v for (mm, v) in rows if mm == m] == variants + ["bound"]
        # The opt-in autotune's choice: one of the op's candidates, named in its note.
        tuned = rows[(m, "ours_autotune")]
        assert tuned["note"].startswith(f"autotune chose path={tuned['config']['path']}"), tuned
        for v in variants:
            r = rows[(m, v)]
            if v == "torch_fused":
                assert r["status"] == "skipped" and "CUDA" in r["note"]
                continue
            assert r["status"] == "ok", r
            assert r["ms"] is not None and r["ms"] > 0
            if v.startswith("ours"):
                assert r["rel_err"] is not None and r["rel_err"] < 1e-2, r
        parts = [rows[(m, "cublas")]["ms"], rows[(m, comm)]["ms"]]
        assert rows[(m, "bound")]["ms"] == max(parts)
        assert rows[(m, comm)]["tflops"] is None and "busbw" in rows[(m, comm)]["note"]
        assert rows[(m, "ours_auto")]["pct_of_bound"] is not None
        assert rows[(m, "cublas")]["pct_of_bound"] is None


def test_all_ops_exit_ok(all_ops_run: tuple[Any, dict[str, Any]]) -> None:
    proc, _ = all_ops_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAILED" not in proc.stderr
    # The tables come last, one per op, in OPS order.
    tail = proc.stdout[proc.stdout.index("\nag_gemm\n") :]
    assert (
        tail.index("\ngemm_rs\n")
        < tail.index("\ngemm_ar\n")
        < tail.index("\ndecode\n")
        < tail.index("\nmoe\n")
    )
    assert "not run" not in proc.stdout


def test_all_ops_run_moe_on_its_own_shape(all_ops_run: tuple[Any, dict[str, Any]]) -> None:
    _, docs = all_ops_run
    doc = docs["moe"]
    harness.validate_results(doc)
    assert doc["settings"]["shapes"] == [MOE_SHAPE]
    rows = {r["variant"]: r for r in doc["rows"]}
    for v in ("nccl_dispatch", "nccl_combine", "grouped_gemm", "nccl_layer"):
        assert rows[v]["status"] == "ok", rows[v]


def test_gemm_rs_rows(all_ops_run: tuple[Any, dict[str, Any]]) -> None:
    proc, docs = all_ops_run
    rows = _rows(docs["gemm_rs"])
    variants = ["cublas", "nccl_reduce_scatter", "sequential", "torch_fused", "ours_local_gemm",
                "ours_push", "ours_copy_engine", "ours_copy_engine_p4", "ours_cublas_producer", "ours_push_cublas",
                "ours_push_cublas_p4", "ours_auto", "ours_autotune"]  # fmt: skip
    _check_common(rows, variants, "nccl_reduce_scatter")
    for m in (32, 16):
        assert rows[(m, "ours_push")]["config"]["mechanism"] == "push"
        ce = rows[(m, "ours_copy_engine")]["config"]
        assert ce["mechanism"] == "copy_engine" and ce["comm_sms"] == 1 and ce["path"] == "fused"
        assert rows[(m, "ours_copy_engine_p4")]["config"]["pieces"] == 4
        cublas = rows[(m, "ours_cublas_producer")]["config"]
        assert cublas["mechanism"] == "copy_engine" and cublas["producer"] == "cublas"
        pushed = rows[(m, "ours_push_cublas")]["config"]
        assert (
            pushed["mechanism"] == "push"
            and pushed["producer"] == "cublas"
            and pushed["lag"] is None
        )
        assert pushed["pieces"] == 1 and rows[(m, "ours_push_cublas_p4")]["config"]["pieces"] == 4
        auto = rows[(m, "ours_auto")]
        path, mechanism = auto["config"]["path"], auto["config"]["mechanism"]
        assert path in ("fused", "sequential")
        producer = auto["config"]["producer"]
        described = f"path={path}" + (
            f" mechanism={mechanism} producer={producer}" if path == "fused" else ""
        )
        assert auto["note"] == f"resolved {described}"
    assert "goal: geomean of ours_auto over sequential >= 1.15 on all shapes" in proc.stdout


def test_gemm_ar_rows(all_ops_run: tuple[Any, dict[str, Any]]) -> None:
    proc, docs = all_ops_run
    rows = _rows(docs["gemm_ar"])
    variants = ["cublas", "nccl_all_reduce", "sequential", "ours_one_shot", "ours_two_shot",
                "ours_two_shot_one_gather_stream", "ours_two_shot_ce", "ours_two_shot_push_cublas", "ours_auto", "ours_autotune"]  # fmt: skip
    _check_common(rows, variants, "nccl_all_reduce")
    for m in (32, 16):
        assert rows[(m, "ours_one_shot")]["config"]["path"] == "one_shot"
        for name in (
            "ours_two_shot",
            "ours_two_shot_one_gather_stream",
            "ours_two_shot_ce",
            "ours_two_shot_push_cublas",
        ):
            assert rows[(m, name)]["config"]["path"] == "two_shot"
        assert rows[(m, "ours_two_shot_ce")]["config"]["mechanism"] == "copy_engine"
        by_cublas = rows[(m, "ours_two_shot_push_cublas")]["config"]
        assert (by_cublas["mechanism"], by_cublas["producer"], by_cublas["lag"]) == (
            "push",
            "cublas",
            None,
        )
        assert rows[(m, "ours_two_shot_one_gather_stream")]["config"]["gather_streams"] == 1
        auto = rows[(m, "ours_auto")]
        assert auto["note"].startswith(f"resolved path={auto['config']['path']}")
    assert "on large shapes (M > 256): - (0 of 0 shapes)" in proc.stdout
    assert "goal: geomean of ours_auto over sequential >= 1.3 on decode shapes" in proc.stdout


def test_ag_gemm_rows_with_the_real_library(all_ops_run: tuple[Any, dict[str, Any]]) -> None:
    _, docs = all_ops_run
    variants = ["cublas", "nccl_all_gather", "sequential", "torch_fused", "ours_local_gemm",
                "ours_local_gemm_whole_tiles", "ours_local_gemm_tma", "ours_fused", "ours_fused_tma", "ours_fused_chunk_groups",
                "ours_fused_push", "ours_fused_sm_copy",
                "ours_fused_cublas", "ours_fused_cublas_one_stream", "ours_fused_cublas_two_streams",
                "ours_fused_cublas_in_turn", "ours_auto", "ours_autotune"]  # fmt: skip
    _check_common(_rows(docs["ag_gemm"]), variants, "nccl_all_gather")


# ----------------------------------------------------------------------------- in-process


def _one_rank() -> RunContext:
    return RunContext(0, 1, torch.device("cpu"), None, WallClock(), lambda: None, None)


def test_ours_variants_skips_a_path_resolve_config_refuses() -> None:
    """A forced path that resolve_config rejects is skipped with its reason; the others and
    ours_auto run and are checked against the reference with a NaN-filled out=."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Cfg:
        path: str = "auto"

    def resolve(x, w, group, config=None):
        cfg = config or Cfg()
        if cfg.path == "one_shot":
            raise ValueError("path='one_shot' cannot run: too many tiles for one flag each")
        return Cfg("two_shot") if cfg.path == "auto" else cfg

    tuned_calls = []

    @contextlib.contextmanager
    def autotune(retune=False):
        tuned_calls.append(("enter", retune))
        yield
        tuned_calls.append(("exit", retune))

    def op(x, w, group, *, config=None, out=None):
        tuned_calls.append(config)
        result = x @ w
        return result if out is None else out.copy_(result)

    x, w = torch.randn(8, 4), torch.randn(4, 6)
    variants, checks = common.ours_variants(
        _one_rank(),
        [(x, w)],
        x @ w,
        op="gemm_ar",
        ours={"gemm_ar": op, "resolve_config": resolve, "autotune": autotune},
        missing={},
        operands=lambda s: s,
        out_shape=(8, 6),
        forced={"ours_one_shot": {"path": "one_shot"}, "ours_two_shot": {"path": "two_shot"}},
        describe=lambda cfg: f"path={cfg.path}",
    )
    by_name = {v.name: v for v in variants}
    assert list(by_name) == ["ours_one_shot", "ours_two_shot", "ours_auto", "ours_autotune"]
    assert by_name["ours_one_shot"].status == "skipped"
    assert "too many tiles" in by_name["ours_one_shot"].note
    assert by_name["ours_auto"].note == "resolved path=two_shot"
    # autotune's variant: one call inside a retuning session, with its own signature's config
    assert tuned_calls == [("enter", True), common.AUTOTUNED, ("exit", True)]
    assert by_name["ours_autotune"].note == "autotune chose path=two_shot"
    assert set(checks) == {"ours_two_shot", "ours_auto", "ours_autotune"}
    common.check_variants(_one_rank(), variants, checks, Settings())
    assert by_name["ours_two_shot"].status == by_name["ours_auto"].status == "ok"
    assert by_name["ours_autotune"].status == "ok"


def test_torch_fused_rs_tries_the_argument_forms() -> None:
    """A schema that refuses the positional form (torch raises RuntimeError naming the
    Declaration) is called with keywords, and the form that worked is recorded."""
    calls = []

    def op(a, b, *args, **kwargs):
        calls.append((args, kwargs))
        if args[1:]:
            raise RuntimeError("op() expected at most 3 argument(s). Declaration: op(...)")
        return a @ b

    fused = gemm_rs.TorchFusedRS(op, "0")
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    torch.testing.assert_close(fused(a, b), a @ b)
    assert fused.form is not None and "scatter_dim=0" in fused.form
    assert fused.note == f"called as {fused.form}"
    fused(a, b)
    assert len(calls) == 3  # the refused form is not tried again

    def broken(a, b, *args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access")  # not a schema mismatch

    with pytest.raises(RuntimeError, match="illegal memory access"):
        gemm_rs.TorchFusedRS(broken, "0")(a, b)


def test_gemm_ar_table_has_a_goal_line_for_the_graphs() -> None:
    """With captured variants (CUDA runs, decode shapes) gemm_ar's table gives the
    geomean of ours_graph over sequential_graph against the decode goal."""
    from bench import gemm_ar

    def row(variant: str, ms: float, m: int) -> dict[str, Any]:
        return {**dict.fromkeys(harness.ROW_KEYS), "op": "gemm_ar", "variant": variant,
                "status": "ok", "ms": ms, "shape": {"M": m, "K": 64, "N": 32}, "config": {}}  # fmt: skip

    rows = [row(v, ms, m) for m in (16, 64)
            for v, ms in (("sequential", 2.0), ("ours_auto", 1.0), ("sequential_graph", 1.2),
                          ("ours_graph", 1.0 if m == 16 else 1.2))]  # fmt: skip
    table = gemm_ar.format_table(rows)
    # sqrt(1.2 * 1.0) = 1.095: below the decode goal of 1.3
    assert (
        "goal: geomean of ours_graph over sequential_graph >= 1.3 on decode shapes in CUDA graphs: "
        "1.095 (2 of 2 shapes): NOT met" in table
    )
    assert "ours_graph" not in gemm_ar.format_table(
        [r for r in rows if "graph" not in r["variant"]]
    )


def test_decode_rows(all_ops_run: tuple[Any, dict[str, Any]]) -> None:
    """The decode entry on CPU ranks: every variant runs eagerly and passes its check
    (the layer's against nccl_norm's, an all-reduce alone against NCCL's), but torch's
    one-shot all-reduce, which needs CUDA's symmetric memory; the table names a winner."""
    proc, docs = all_ops_run
    rows = _rows(docs["decode"])
    variants = ["cublas", "nccl_all_reduce", "symm_one_shot", "nccl_norm", "symm_norm",
                "ours_all_reduce", "ours_all_reduce_rmsnorm", "cublas_ours_norm", "ours"]  # fmt: skip
    for m in (32, 16):
        assert [v for (mm, v) in rows if mm == m] == variants + ["bound"]
        for v in variants:
            r = rows[(m, v)]
            if v.startswith("symm"):
                assert r["status"] == "skipped" and "CUDA" in r["note"], r
                continue
            assert r["status"] == "ok" and r["ms"] > 0, r
            if v not in ("cublas", "nccl_all_reduce"):
                assert r["rel_err"] is not None, r
    table = proc.stdout[proc.stdout.index("\ndecode\n") :]
    assert "fastest layer variant per shape: 32x64x48: " in table


# ----------------------------------------------------------------------------- goals by world


MULTI_RANK_GOAL = "goal: "  # how every multi-rank goal line starts (report.goal_lines, moe)
ONE_RANK_GOAL = "goal (one rank: no communication): "


def test_two_rank_tables_state_the_multi_rank_goals_only(
    all_ops_run: tuple[Any, dict[str, Any]],
) -> None:
    proc, _ = all_ops_run
    assert MULTI_RANK_GOAL in proc.stdout and ONE_RANK_GOAL not in proc.stdout


def test_one_rank_run_states_the_one_rank_goal_only(tmp_path: Path) -> None:
    """``--cpu-ranks 1``: gemm_ar's table (printed, and drawn again from the store) gives
    ours_auto against torch.matmul's time, none of the multi-rank goals."""
    from bench import report

    args = f"--op gemm_ar --cpu-ranks 1 --shapes 16x64x48 {CPU_RUN_TIMING}"
    cmd = [sys.executable, "-m", "bench", *shlex.split(args), "--store", str(tmp_path / "s.jsonl")]
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    proc = subprocess.run(
        cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("\ngemm_ar\n") :]
    wanted = f"{ONE_RANK_GOAL}ours_auto within 10% of torch.matmul (cublas) on every shape: worst "
    assert wanted in table and MULTI_RANK_GOAL not in table, table
    (doc,) = store.runs(store.load(tmp_path / "s.jsonl"))
    assert doc["world_size"] == 1
    stored = report.run_table(doc)
    assert wanted in stored and MULTI_RANK_GOAL not in stored


def _entry_rows(op: str, variants: dict[str, float], shapes: list[dict[str, int]]) -> list:
    return [
        {**dict.fromkeys(harness.ROW_KEYS), "op": op, "variant": v, "status": "ok", "ms": ms,
         "shape": shape, "config": {"path": "sequential"}}
        for shape in shapes for v, ms in variants.items()
    ]  # fmt: skip


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar", "moe"])
def test_each_entry_states_the_goals_of_its_world(op: str) -> None:
    """One rank: the one-rank goal (ours within 10% of torch.matmul's time; MoE: of the
    plain layer's) and no multi-rank goal; more ranks: no one-rank goal."""
    import importlib

    entry = importlib.import_module(f"bench.{op}")
    if op == "moe":
        variants = dict.fromkeys(("grouped_gemm", "nccl_dispatch", "ours_dispatch",
                                  "nccl_combine", "ours_combine", "bound"), 1.0)  # fmt: skip
        variants.update(nccl_layer=2.0, ours_auto_layer=2.1)  # 1.05x: met
        shapes = [{"T": 8, "H": 32, "E": 4, "k": 2, "F": 16}]
        target, what = "ours_auto_layer", "the plain layer (nccl_layer)"
    else:
        variants = {"cublas": 1.0, "sequential": 1.5, "ours_auto": 1.2, "bound": 1.0}  # 1.2x
        if op == "gemm_ar":
            variants.update(sequential_graph=1.0, ours_graph=1.05)
        shapes = [{"M": 16, "K": 64, "N": 32}, {"M": 4096, "K": 64, "N": 32}]
        target, what = "ours_auto", "torch.matmul (cublas)"
    rows = _entry_rows(op, variants, shapes)
    one = entry.format_table(rows, world=1)
    goal = f"{ONE_RANK_GOAL}{target} within 10% of {what} on every shape: worst "
    verdict = "met" if op == "moe" else "NOT met"
    assert goal in one and one.split(goal)[1].splitlines()[0].endswith(f": {verdict}"), one
    assert MULTI_RANK_GOAL not in one
    if op == "gemm_ar":  # and the captured calls against torch.matmul captured
        assert f"{ONE_RANK_GOAL}ours_graph within 10% of torch.matmul in CUDA graphs" in one
    more = entry.format_table(rows, world=4)
    assert ONE_RANK_GOAL not in more
    assert (MULTI_RANK_GOAL in more) == (op != "ag_gemm")  # (ag_gemm states no goal)
