"""CPU tests of the harness's pure logic (its timing is overlap_kernels/timing.py's): no GPU."""

from __future__ import annotations

import datetime as dt
import json
import math
from typing import Any

import pytest
import torch

from bench import common, harness, report, store
from bench.harness import Settings, Variant

# What the end-to-end runs on CPU ranks (bench/test_*_cpu.py) time: one call of each variant,
# after the call its check makes. Their times mean nothing; the warm-up, the interleaved
# rounds and the medians over them are tested here.
CPU_RUN_TIMING = "--iters 1 --rounds 1 --warmup 0"


class FakeClock:
    """A clock that only moves when a fake variant says it spent time."""

    def __init__(self) -> None:
        self.now = 0.0

    def mark(self) -> float:
        return self.now

    def elapsed_ms(self, marks: list[tuple[float, float]]) -> list[float]:
        return [(b - a) * 1e3 for a, b in marks]


def _spender(clock: FakeClock, log: list[str], name: str, seconds: float) -> Any:
    def fn() -> None:
        log.append(name)
        clock.now += seconds

    return fn


def test_round_orders_rotate_and_reverse() -> None:
    orders = harness.round_orders(["a", "b", "c"], 6)
    assert orders[:4] == [["a", "b", "c"], ["c", "b", "a"], ["b", "c", "a"], ["a", "c", "b"]]
    assert len({tuple(o) for o in orders}) == 6  # every order once
    assert harness.round_orders(["a", "b"], 4) == [["a", "b"], ["b", "a"], ["b", "a"], ["a", "b"]]
    assert harness.round_orders([], 3) == []


def test_time_variants_interleaves_and_excludes_warmup() -> None:
    clock, log, barriers, rounds_seen = FakeClock(), [], [], []
    variants = [
        Variant("fast", _spender(clock, log, "fast", 0.001)),
        Variant("slow", _spender(clock, log, "slow", 0.003)),
        Variant("absent", None, status="skipped"),
    ]
    settings = Settings(iters=6, rounds=3, warmup=2)
    samples = harness.time_variants(
        variants, settings, clock, lambda: barriers.append(1), rounds_seen.append
    )
    assert set(samples) == {"fast", "slow"}
    assert len(samples["fast"]) == len(samples["slow"]) == 6
    assert samples["fast"] == pytest.approx([1.0] * 6) and samples["slow"] == pytest.approx(
        [3.0] * 6
    )
    assert log[:4] == ["fast", "fast", "slow", "slow"]  # warm-up first, untimed
    timed = log[4:]
    assert (
        timed
        == ["fast"] * 2 + ["slow"] * 2 + ["slow"] * 2 + ["fast"] * 2 + ["slow"] * 2 + ["fast"] * 2
    )
    assert len(barriers) == 6 and rounds_seen == [0, 1, 2]


def test_settings_split_iters_over_rounds() -> None:
    assert Settings(iters=100, rounds=10).iters_per_round == 10
    assert (
        Settings(iters=101, rounds=10).iters_per_round == 11
    )  # rounded up, never fewer than asked
    assert Settings(iters=1, rounds=0).iters_per_round == 1


def test_median_then_max_over_ranks() -> None:
    rank0 = harness.medians({"a": [1.0, 9.0, 2.0], "b": [4.0, 4.0], "none": []})
    assert rank0 == {"a": 2.0, "b": 4.0}
    rank1 = {"a": 3.0, "b": 1.0}

    # Two ranks' reductions, simulated: max elementwise, keys in sorted order on both.
    def fake_allreduce(xs):
        return [max(x, rank1[k]) for x, k in zip(xs, sorted(rank1))]

    assert harness.max_over_ranks(rank0, fake_allreduce) == {"a": 3.0, "b": 4.0}
    assert harness.max_over_ranks(rank0, None) == rank0


def test_metrics() -> None:
    assert harness.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert harness.tflops(None, 1.0) is None and harness.tflops(1.0, None) is None
    assert harness.pct_of_bound(1.0, 2.0) == pytest.approx(50.0)
    assert harness.speedup(3.0, 2.0) == pytest.approx(1.5)
    assert harness.speedup(None, 2.0) is None
    assert harness.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert harness.geomean([2.0, None, 8.0]) == pytest.approx(4.0)
    assert harness.geomean([]) is None and harness.geomean([None]) is None


def test_n_input_sets_rotates_only_when_inputs_fit_in_l2() -> None:
    l2 = 50 << 20
    assert harness.n_input_sets(400 << 20, l2) == 1
    assert harness.n_input_sets(1 << 20, l2) == 4  # capped
    assert 2 <= harness.n_input_sets(60 << 20, l2) <= 4
    assert harness.n_input_sets(1 << 20, 0) == 1  # CPU: no L2 to defeat


def _rows() -> list[dict[str, Any]]:
    shape_a, shape_b = {"M": 8192, "K": 8192, "N": 7168}, {"M": 2048, "K": 8192, "N": 7168}
    flops = 2.0 * 8192 * 8192 * 7168

    def row(
        shape: dict[str, int],
        name: str,
        ms: float | None,
        bound: float,
        status: str = "ok",
        config: dict[str, Any] | None = None,
        whole_op: bool = True,
    ) -> dict[str, Any]:
        v = Variant(name, None, flops=flops, status=status, config=config, whole_op=whole_op)
        return harness.make_row("ag_gemm", shape, v, ms, bound)

    return [
        row(shape_a, "cublas", 1.2, 1.2, whole_op=False),
        row(shape_a, "sequential", 1.6, 1.2),
        row(shape_a, "torch_fused", 1.5, 1.2),
        row(shape_a, "ours_auto", 1.25, 1.2, config={"path": "fused"}),
        row(shape_a, "bound", 1.2, 1.2),
        row(shape_b, "cublas", 0.4, 0.4, whole_op=False),
        row(shape_b, "sequential", 0.5, 0.4),
        row(shape_b, "torch_fused", None, 0.4, status="skipped"),
        row(shape_b, "ours_auto", 0.25, 0.4, status="check_failed", config={"path": "sequential"}),
        row(shape_b, "bound", 0.4, 0.4),
    ]


def test_make_row_keys_and_statuses() -> None:
    rows = _rows()
    assert all(tuple(r) == harness.ROW_KEYS for r in rows)
    assert rows[0]["pct_of_bound"] is None  # a part alone has no % of bound
    assert rows[3]["pct_of_bound"] == pytest.approx(100 * 1.2 / 1.25)
    assert rows[3]["tflops"] == pytest.approx(2.0 * 8192 * 8192 * 7168 / 1.25e-3 / 1e12)
    err = harness.make_row(
        "op", {"M": 1}, Variant("x", None, status="error", note="boom"), 1.0, 1.0
    )
    assert err["ms"] is None and err["tflops"] is None and err["note"] == "boom"


def test_config_made_json_safe() -> None:
    class Mode:
        def __str__(self) -> str:
            return "Mode.RING"

    cfg = {"path": "fused", "tiles": (128, 256), "timeout_s": math.inf, "mode": Mode(), "n": None}
    row = harness.make_row("op", {"M": 1}, Variant("x", None, config=cfg), 1.0, 1.0)
    assert row["config"] == {
        "path": "fused",
        "tiles": [128, 256],
        "timeout_s": "inf",
        "mode": "Mode.RING",
        "n": None,
    }
    json.dumps(row, allow_nan=False)


def test_format_table() -> None:
    text = report.format_table(
        _rows(),
        target="ours_auto",
        baselines=("sequential", "torch_fused"),
        target_label=lambda r: f"({r['config']['path'][0]})",
    )
    lines = text.splitlines()
    assert lines[0].split() == [
        "shape",
        "cublas",
        "sequential",
        "torch_fused",
        "ours_auto",
        "bound",
        "xsequential",
        "xtorch_fused",
        "%bound",
    ]
    a, b = lines[2].split(), lines[3].split()
    assert a == [
        "8192x8192x7168",
        "1.200",
        "1.600",
        "1.500",
        "1.250(f)",
        "1.200",
        "1.28",
        "1.20",
        "96",
    ]
    assert b[3] == "-" and b[4] == "0.250!(s)"  # skipped, and a failed check shown, not hidden
    # The failed shape does not count in the geomean: only shape a's 1.6 / 1.25 does.
    assert f"over sequential: {1.6 / 1.25:.3f} (1 of 2 shapes" in text
    assert "over torch_fused: 1.200 (1 of 2 shapes" in text


def test_format_table_marks_errors() -> None:
    rows = _rows()
    rows[3]["status"], rows[3]["ms"] = "error", None
    line = (
        report.format_table(rows, target="ours_auto", baselines=("sequential",))
        .splitlines()[2]
        .split()
    )
    assert line[4] == "ERR" and line[-2:] == ["-", "-"]


def test_goal_lines() -> None:
    rows = _rows()  # shape a: 1.6 / 1.25 over sequential; shape b failed its check
    text = report.goal_lines(
        rows,
        target="ours_auto",
        baseline="sequential",
        goals=[
            ("all shapes", lambda _: True, 1.2),
            ("M > 4096", lambda s: s["M"] > 4096, 1.3),
            ("M <= 4096", lambda s: s["M"] <= 4096, 1.3),
        ],
    )
    assert text.splitlines() == [
        f"goal: geomean of ours_auto over sequential >= 1.2 on all shapes: {1.6 / 1.25:.3f}"
        " (1 of 2 shapes): met",
        f"goal: geomean of ours_auto over sequential >= 1.3 on M > 4096: {1.6 / 1.25:.3f}"
        " (1 of 1 shapes): NOT met",
        "goal: geomean of ours_auto over sequential >= 1.3 on M <= 4096: - (0 of 1 shapes): -",
    ]


def _timed(op: str, cells: dict[tuple[int, str], tuple[float | None, str]]) -> list[dict[str, Any]]:
    """Rows of ``op`` from {(M, variant): (ms, status)}."""
    return [
        {**dict.fromkeys(harness.ROW_KEYS), "op": op, "variant": v, "status": status, "ms": ms,
         "shape": {"M": m, "K": 64, "N": 32}, "config": {}}
        for (m, v), (ms, status) in cells.items()
    ]  # fmt: skip


def test_local_goal_line_gives_the_worst_shape_and_counts_only_passed_checks() -> None:
    cells = {(16, "cublas"): (1.0, "ok"), (16, "ours_auto"): (1.08, "ok"),
             (64, "cublas"): (2.0, "ok"), (64, "ours_auto"): (2.1, "ok"),
             (256, "cublas"): (1.0, "ok"), (256, "ours_auto"): (0.5, "check_failed")}  # fmt: skip
    line = report.local_goal_line(
        _timed("gemm_ar", cells), target="ours_auto", baseline="cublas", what="torch.matmul"
    )
    assert line == (
        "goal (one rank: no communication): ours_auto within 10% of torch.matmul on every "
        "shape: worst 1.080x its time at 16x64x32 (2 of 3 shapes): incomplete"
    )
    cells[(64, "ours_auto")] = (2.3, "ok")  # 1.15x: over 10%
    assert report.local_goal_line(
        _timed("gemm_ar", cells), target="ours_auto", baseline="cublas", what="torch.matmul"
    ).endswith("worst 1.150x its time at 64x64x32 (2 of 3 shapes): NOT met")
    del cells[(256, "ours_auto")], cells[(256, "cublas")], cells[(64, "ours_auto")]
    assert report.local_goal_line(
        _timed("gemm_ar", cells), target="ours_auto", baseline="cublas", what="torch.matmul"
    ).endswith("(1 of 2 shapes): incomplete")
    assert report.local_goal_line(
        [], target="ours_auto", baseline="cublas", what="torch.matmul"
    ).endswith("on every shape: - (0 of 0 shapes): -")


def test_names_and_filenames() -> None:
    assert harness.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert harness.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert harness.gpu_slug("") == "unknown"
    date = dt.datetime(2026, 11, 21, 9, 5, 7, tzinfo=dt.UTC)
    assert (
        harness.results_filename("ag_gemm", "NVIDIA H200", 4, date)
        == "ag_gemm_nvidia-h200_x4_20261121T090507Z.json"
    )
    assert harness.shape_str({"M": 1, "K": 2, "N": 3}) == "1x2x3"


def _doc(rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return harness.build_results(
        _rows() if rows is None else rows,
        gpu="NVIDIA H200",
        world=4,
        versions={
            "python": "3.12",
            "torch": "2.11.0",
            "triton": "3.6.0",
            "cuda": "13.0",
            "nccl": "2.27",
            "overlap_kernels": "0.1",
        },
        env={"NCCL_NVLS_ENABLE": "0"},
        settings={"iters": 100},
        date=dt.datetime(2026, 11, 21, 9, 5, 7, tzinfo=dt.UTC),
    )


def test_a_run_goes_to_the_store_and_its_document_to_out(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    written = _doc()
    path = store.write_run(written, tmp_path / "results.jsonl")
    doc = json.loads(
        (tmp_path / "out" / "ag_gemm_nvidia-h200_x4_20261121T090507Z.json").read_text()
    )
    assert doc == written and tuple(doc) == harness.TOP_KEYS
    assert doc["schema"] == 1 and doc["gpu_count"] == doc["world_size"] == 4
    assert doc["date"] == "2026-11-21T09:05:07+00:00"
    assert set(doc["versions"]) == {"python", "torch", "triton", "cuda", "nccl", "overlap_kernels"}
    records = store.load(path)
    assert len(records) == len(doc["rows"]) and all(tuple(r) == store.RECORD_KEYS for r in records)
    assert {r["run"] for r in records} == {"ag_gemm_nvidia-h200_x4_20261121T090507Z"}
    assert records[0]["host"] and records[0]["world"] == 4 and records[0]["dtype"] is None
    (run,) = store.runs(records)
    assert run["rows"] == doc["rows"] and run["versions"] == doc["versions"]
    # A run is stored once: adding the same document again (a second merge of $OUT) adds nothing.
    assert store.append(doc, path, host="h") == 0 and len(store.load(path)) == len(records)
    later = {**doc, "date": "2026-11-22T09:05:07+00:00"}
    assert store.append(later, path, host="h") == len(doc["rows"])
    assert [r["run"][-16:] for r in store.runs(store.load(path))] == [
        "20261121T090507Z",
        "20261122T090507Z",
    ]


def test_the_store_refuses_records_of_another_schema(tmp_path: Any) -> None:
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"op": "ag_gemm", "ms": 1.0}) + "\n")
    with pytest.raises(ValueError, match="results.jsonl:1: keys"):
        store.load(path)


def test_results_schema_rejects_bad_documents(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OUT", raising=False)
    doc = _doc()
    with pytest.raises(ValueError, match="unknown results schema"):
        harness.validate_results({**doc, "schema": 2})
    with pytest.raises(ValueError, match="lacks keys"):
        harness.validate_results({k: v for k, v in doc.items() if k != "gpu"})
    with pytest.raises(ValueError, match="row 0 has keys"):
        harness.validate_results({**doc, "rows": [{"op": "x"}]})
    with pytest.raises(ValueError, match="row 0 has status"):
        harness.validate_results({**doc, "rows": [{**doc["rows"][0], "status": "fast"}]})
    bad = _doc([{**_rows()[0], "ms": math.nan}])
    with pytest.raises(ValueError, match="JSON compliant"):  # NaN would make the file non-JSON
        store.write_run(bad, tmp_path / "results.jsonl")


def test_progress_prints_on_rank0_only(capsys: pytest.CaptureFixture[str]) -> None:
    with report.Progress(total=2, kind="print") as p:
        p.step("one")
        p.step("two")
    with report.Progress(total=2, enabled=False) as p:
        p.step("hidden")
    assert capsys.readouterr().out.splitlines() == ["[1/2] one", "[2/2] two"]


def test_the_summary_is_the_newest_runs_speedups(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """report.summary: a column per (GPU, world); per line, the newest run of the op
    there with its target shapes of that line, the geometric-mean speedup of ours_auto
    over the pair on them; an older run is not shown, nor a newer one without such
    shapes; a run of untuned shapes only has a line of its own."""
    import bench.ag_gemm

    monkeypatch.setattr(bench.ag_gemm, "DEFAULT_SHAPES", [(1024, 8, 8), (2048, 8, 8), (32, 8, 8)])
    path = tmp_path / "results.jsonl"

    def run(date: str, ours_ms: float, ms=(1024, 2048)) -> dict[str, Any]:
        rows = [
            {**row, "shape": {"M": m, "K": 8, "N": 8}, "ms": ms}
            for m in ms
            for row, ms in ((_rows()[0], 2.0), ({**_rows()[0], "variant": "ours_auto"}, ours_ms))
        ]
        for row in rows:
            row["variant"] = row["variant"] if row["variant"] == "ours_auto" else "sequential"
        return {**_doc(rows), "date": date}

    store.append(run("2026-11-21T09:05:07+00:00", 1.0), path, host="h")  # 2x, older
    store.append(run("2026-11-22T09:05:07+00:00", 1.6), path, host="h")  # 1.25x, newest
    store.append(run("2026-11-23T09:05:07+00:00", 0.5, ms=(32,)), path, host="h")  # decode only
    store.append(run("2026-11-24T09:05:07+00:00", 2.5, ms=(4096,)), path, host="h")  # untuned
    table = report.summary(store.runs(store.load(path))).splitlines()
    assert (
        table[-1]
        == "| GEMM ops on shapes no table names | ag_gemm 0.80x (1 shape) (`ag_gemm_nvidia-h200_x4_20261124T090507Z`) |"
    )
    assert table[0] == "| op | 4 x NVIDIA H200 |"
    assert table[2] == \
        "| ag_gemm, M > 512 | 1.250x (2 shapes) (`ag_gemm_nvidia-h200_x4_20261122T090507Z`) |"  # fmt: skip
    assert table[3] == \
        "| ag_gemm, M <= 512 (decode) | 4.000x (1 shapes) (`ag_gemm_nvidia-h200_x4_20261123T090507Z`) |"  # fmt: skip
    assert table[4] == "| gemm_rs | - |"


def test_a_run_names_its_host_and_a_document_without_one_gets_it_from_the_merge(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import platform

    import torch

    monkeypatch.delenv("OUT", raising=False)
    doc = _doc()
    assert doc["host"] == harness.collect_host() == (platform.node() or "unknown")  # no GPU here
    path = tmp_path / "results.jsonl"
    store.write_run(doc, path)
    assert {r["host"] for r in store.load(path)} == {doc["host"]}
    # A document without a host is valid; the merge names it, or leaves it unrecorded.
    anonymous = {k: v for k, v in doc.items() if k != "host"}
    harness.validate_results(anonymous)
    later = {**anonymous, "date": "2026-11-22T09:05:07+00:00"}
    assert (
        store.main(["add", "--store", str(path), "--host", "x4 node", _saved(tmp_path, later)]) == 0
    )
    latest = {**anonymous, "date": "2026-11-23T09:05:07+00:00"}
    assert store.main(["add", "--store", str(path), _saved(tmp_path, latest)]) == 0
    hosts = [run["host"] for run in store.runs(store.load(path))]
    assert hosts == [doc["host"], "x4 node", None]

    # On CUDA: the name and each GPU's UUID, first 8 hex digits.
    class Properties:
        def __init__(self, i: int):
            self.uuid = f"GPU-{i}1234567-89ab-cdef-0123-456789abcdef"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", Properties)
    monkeypatch.setattr(platform, "node", lambda: "node-17")
    assert harness.collect_host() == "node-17; GPUs 01234567,11234567"


def _saved(tmp_path: Any, doc: dict[str, Any]) -> str:
    path = tmp_path / f"{store.run_id(doc)}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _checked(ref: torch.Tensor, outs: dict[str, torch.Tensor], **check: Any) -> dict[str, Variant]:
    """common.check_variants of one variant per output, each checked against ``ref``."""
    variants = {name: Variant(name, lambda out=out: out) for name, out in outs.items()}
    checks = {name: common.Check(v.fn, ref, **check) for name, v in variants.items()}
    ctx = harness.RunContext(0, 1, torch.device("cpu"), None, FakeClock(), lambda: None, None)
    common.check_variants(ctx, list(variants.values()), checks, Settings())
    return variants


def test_the_check_fails_one_wrong_row_or_element_and_passes_valid_bf16_results() -> None:
    """16384 x 64 bf16 products over K = 256, fresh Gaussian inputs (the bench's): results
    that differ from the sequential one only by rounding pass the check (the exact sum
    rounded, the sum in another order, 16 split-K pieces reduced in bf16 as cuBLAS may, a
    product reduced through bf16 partials as NCCL does); one zeroed row, whose relative
    Frobenius error (1/sqrt(16384) = 0.0078) is under rel_tol, fails per element, as does
    one element off by its row's RMS."""
    bf16, world, partials = torch.bfloat16, 4, common.GEMM_PARTIALS
    a, b = torch.randn(16384, 256, dtype=bf16), torch.randn(256, 64, dtype=bf16)
    sequential = (a.float() @ b.float()).to(bf16)  # fp32 sums rounded once
    flipped = (a.float().flip(1) @ b.float().flip(0)).to(bf16)  # the K loop the other way
    split_k = (a[:, :16].float() @ b[:16].float()).to(bf16)
    for piece in range(16, 256, 16):  # 16 pieces, each partial and running sum in bf16
        split_k = split_k + (a[:, piece : piece + 16].float() @ b[piece : piece + 16].float()).to(
            bf16
        )
    valid = {"exact_rounded": (a.double() @ b.double()).to(bf16), "reversed": flipped,
             "split_k": split_k}  # fmt: skip
    wrong_row, wrong_element = flipped.clone(), flipped.clone()
    wrong_row[9000] = 0
    row = wrong_element[77].float()
    wrong_element[77, 5] += row.square().mean().sqrt().item()
    outs = {**valid, "wrong_row": wrong_row, "wrong_element": wrong_element}
    got = _checked(sequential, outs, k=256, partials=partials)
    for name in valid:
        assert got[name].status == "ok", (name, got[name].note)
    assert got["wrong_row"].rel_err < Settings().rel_tol  # what the norm alone let through
    assert got["wrong_row"].status == "check_failed" and "element [9000, " in got["wrong_row"].note
    assert got["wrong_element"].status == "check_failed"
    assert "element [77, 5] " in got["wrong_element"].note, got["wrong_element"].note

    # A reduced product: NCCL's ring rounds each rank's partial and each running sum to bf16.
    parts = [(a[:, r::world].float() @ b[r::world].float()).to(bf16) for r in range(world)]
    reduced = parts[0]
    for part in parts[1:]:
        reduced = reduced + part  # (a bf16 sum: rounded at every step)
    broken = sequential.clone()
    broken[123] /= 2  # a row at half its value
    got = _checked(reduced, {"fp32_sum": sequential, "broken": broken}, k=256,
                   partials=2 * world - 1 + partials)  # fmt: skip
    assert got["fp32_sum"].status == "ok", got["fp32_sum"].note
    assert got["broken"].rel_err < Settings().rel_tol  # (0.5 / sqrt(16384) = 0.0039)
    assert got["broken"].status == "check_failed" and "element [123, " in got["broken"].note
