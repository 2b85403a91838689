"""Tuned tables (overlap_kernels/tuned.py): which table applies to this host,
which entry matches a shape, where their values land between the template and
the caller, what record() writes, and the tables the package ships.

CPU only: tables made here name gpu "cpu"; no process group is needed.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import tomllib
from pathlib import Path

import pytest
import torch

import overlap_kernels as ok
from overlap_kernels import tuned
from overlap_kernels.tuning import build_config, load_template, shape_key

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent
SHAPE = shape_key(2, 64, 32, 48, torch.float32)
CONFIGS = {"ag_gemm": ok.AgGemmConfig, "gemm_rs": ok.GemmRsConfig, "gemm_ar": ok.GemmArConfig}


@pytest.fixture(autouse=True)
def no_user_tables():
    tuned.forget_tables()
    yield
    tuned.forget_tables()


def _header(**changes) -> str:
    host = {
        **tuned.host_identity(CPU),
        "world": 2,
        "date": "2026-11-22",
        "source": "test",
        **changes,
    }
    toml = {k: v if isinstance(v, int) else f'"{v}"' for k, v in host.items()}
    return "[host]\n" + "".join(f"{k} = {v}\n" for k, v in toml.items())


def _table(tmp_path: Path, body: str, name: str = "t.toml", **host) -> Path:
    path = tmp_path / name
    path.write_text(_header(**host) + body)
    return path


COPY_ENGINE_AT_64 = """
[[gemm_rs]]
m = 64
k = 32
n = 48
dtype = "float32"
mechanism = "copy_engine"
comm_sms = 1
pieces = 2
none = ["lag"]
measured_ms = 0.25
"""


def test_host_identity_on_cpu():
    import triton  # after overlap_kernels (it turns the interpreter on first)

    expected = {"gpu": "cpu", "torch": torch.__version__, "triton": triton.__version__, "nccl": ""}
    assert tuned.host_identity(CPU) == tuned.host_identity("cpu") == expected


def test_a_matching_entry_lands_between_the_template_and_the_caller(tmp_path):
    tuned.use_table(_table(tmp_path, COPY_ENGINE_AT_64))
    expected = {"mechanism": "copy_engine", "comm_sms": 1, "pieces": 2, "lag": None}
    assert tuned.tuned_values("gemm_rs", SHAPE, CPU) == expected
    assert tuned.tuned_values("gemm_rs", {**SHAPE, "m": 65}, CPU) == {}
    assert tuned.tuned_values("gemm_ar", SHAPE, CPU) == {}

    template = build_config(ok.GemmRsConfig, "gemm_rs", SHAPE, {})
    assert (template.mechanism, template.pieces) == ("push", 1)  # the interpreter's template
    cfg = build_config(ok.GemmRsConfig, "gemm_rs", SHAPE, {}, CPU)
    assert (cfg.mechanism, cfg.comm_sms, cfg.pieces, cfg.lag) == ("copy_engine", 1, 2, None)
    assert cfg.block_m == template.block_m  # fields the table does not name stay the template's
    cfg = build_config(ok.GemmRsConfig, "gemm_rs", SHAPE, {"pieces": 3}, CPU)
    assert (cfg.mechanism, cfg.pieces) == ("copy_engine", 3)  # the caller wins


def test_the_default_config_follows_the_tables_in_use(tmp_path):
    """build_config caches configs built without an override: adding or dropping
    a table must not leave the old one in use."""
    assert build_config(ok.GemmRsConfig, "gemm_rs", SHAPE, None, CPU).mechanism == "push"
    tuned.use_table(_table(tmp_path, COPY_ENGINE_AT_64))
    assert build_config(ok.GemmRsConfig, "gemm_rs", SHAPE, None, CPU).mechanism == "copy_engine"
    assert (
        build_config(ok.GemmRsConfig, "gemm_rs", SHAPE, None).mechanism == "push"
    )  # no device: no table
    tuned.forget_tables()
    assert build_config(ok.GemmRsConfig, "gemm_rs", SHAPE, None, CPU).mechanism == "push"


@pytest.mark.parametrize(
    "host, why",
    [
        ({"triton": "3.5.0"}, "made with triton 3.5.0, running {triton}"),
        ({"torch": "2.10"}, "made with torch 2.10, running {torch}"),
        ({"gpu": "NVIDIA H200", "nccl": "2.28.9"}, "made on NVIDIA H200, running on cpu"),
        ({"world": 4}, "made for 4 ranks, this group has 2"),
    ],
)
def test_a_table_of_another_host_is_ignored_with_one_warning(tmp_path, caplog, host, why):
    path = _table(tmp_path, COPY_ENGINE_AT_64, **host)
    tuned.use_table(path)
    caplog.set_level(logging.INFO, logger="overlap_kernels.tuned")
    for m in (64, 64, 128):
        assert tuned.tuned_values("gemm_rs", {**SHAPE, "m": m}, CPU) == {}
        assert (
            build_config(ok.GemmRsConfig, "gemm_rs", {**SHAPE, "m": m}, None, CPU).mechanism
            == "push"
        )
    ours = [r for r in caplog.records if str(path) in r.getMessage()]
    assert (
        len(ours) == 1
        and ours[0].levelno == logging.WARNING
        and ours[0].name == "overlap_kernels.tuned"
    )
    assert ours[0].getMessage() == f"ignoring tuned table {path}: " + why.format(
        **tuned.host_identity(CPU)
    )
    shipped = [r for r in caplog.records if "nvidia-h200" in r.getMessage()]
    assert shipped and {r.levelno for r in shipped} == {
        logging.INFO
    }  # other GPUs' tables are normal


def test_versions_match_equal_or_by_prefix_up_to_a_dot_or_plus(tmp_path):
    running = tuned.host_identity(CPU)["torch"]  # such as "2.13.0+cpu"
    release = running.split("+")[0]
    major_minor = ".".join(release.split(".")[:2])
    cases = {running: True, release: True, major_minor: True,
             major_minor[:-1]: False, release + "+cu130": False}  # fmt: skip
    for i, (made, applies) in enumerate(cases.items()):
        tuned.forget_tables()
        tuned.use_table(_table(tmp_path, COPY_ENGINE_AT_64, name=f"t{i}.toml", torch=made))
        assert bool(tuned.tuned_values("gemm_rs", SHAPE, CPU)) is applies, made


def test_later_tables_come_first_and_user_tables_before_shipped_ones(tmp_path, monkeypatch):
    first = _table(
        tmp_path, COPY_ENGINE_AT_64.replace("pieces = 2", "pieces = 5"), name="first.toml"
    )
    second = _table(tmp_path, COPY_ENGINE_AT_64, name="second.toml")
    shipped = _table(
        tmp_path, COPY_ENGINE_AT_64.replace("pieces = 2", "pieces = 7"), name="shipped.toml"
    )
    monkeypatch.setattr(
        tuned, "shipped_tables", lambda: ((str(shipped), tuned.read_table(shipped)),)
    )
    tuned.forget_tables()  # lookups made with the real shipped tables are forgotten too
    assert tuned.tuned_values("gemm_rs", SHAPE, CPU)["pieces"] == 7
    tuned.use_table(first)
    assert tuned.tuned_values("gemm_rs", SHAPE, CPU)["pieces"] == 5
    tuned.use_table(second)
    assert tuned.tuned_values("gemm_rs", SHAPE, CPU)["pieces"] == 2
    tuned.use_table(first)  # again: first again
    assert tuned.tuned_values("gemm_rs", SHAPE, CPU)["pieces"] == 5
    assert tuned.lookup("gemm_rs", SHAPE, CPU)[1] == str(first.resolve())


def test_bounds_match_like_the_templates_and_the_first_matching_entry_wins(tmp_path):
    body = """
[[gemm_rs]]
m_min = 100
m_max = 200
k = 32
n_min = 48
dtype = "float32"
path = "sequential"

[[gemm_rs]]
m = 150
k = 32
n = 48
dtype = "float32"
path = "fused"
"""
    tuned.use_table(_table(tmp_path, body))
    found = {m: tuned.tuned_values("gemm_rs", {**SHAPE, "m": m}, CPU).get("path")
             for m in (99, 100, 150, 200, 201)}  # fmt: skip
    assert found == {99: None, 100: "sequential", 150: "sequential", 200: "sequential", 201: None}
    assert tuned.tuned_values("gemm_rs", {**SHAPE, "m": 150, "n": 4096}, CPU) == {
        "path": "sequential"
    }
    assert tuned.tuned_values("gemm_rs", {**SHAPE, "m": 150, "n": 47}, CPU) == {}
    assert tuned.tuned_values("gemm_rs", {**SHAPE, "m": 150, "dtype": "bfloat16"}, CPU) == {}


def test_record_creates_replaces_and_keeps_entries_sorted(tmp_path):
    path = tmp_path / "made" / "cpu_x2.toml"
    for m, k in ((256, 64), (64, 64), (128, 32)):
        tuned.record(
            path, "gemm_rs", shape_key(2, m, k, 48, torch.bfloat16), {"pieces": 1}, 0.5, CPU
        )
    tuned.record(
        path, "ag_gemm", shape_key(2, 64, 64, 48, torch.bfloat16), {"gemm": "triton"}, None, CPU
    )
    tuned.record(path, "gemm_rs", shape_key(2, 64, 64, 48, torch.float32), {"pieces": 1}, 0.5, CPU)
    tuned.record(
        path, "gemm_rs", shape_key(2, 64, 64, 48, torch.bfloat16), {"pieces": 4}, 0.25, CPU
    )

    table = tuned.read_table(path)
    assert table["host"] == {**tuned.host_identity(CPU), "world": 2, "date": table["host"]["date"],
                             "source": "overlap_kernels.tune"}  # fmt: skip
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", table["host"]["date"])
    keys = [(e["dtype"], e["k"], e["n"], e["m"]) for e in table["gemm_rs"]]
    assert keys == [("bfloat16", 32, 48, 128), ("bfloat16", 64, 48, 64), ("bfloat16", 64, 48, 256),
                    ("float32", 64, 48, 64)]  # fmt: skip
    assert table["gemm_rs"][1] == {
        "m": 64,
        "k": 64,
        "n": 48,
        "dtype": "bfloat16",
        "pieces": 4,
        "measured_ms": 0.25,
    }
    assert table["ag_gemm"] == [{"m": 64, "k": 64, "n": 48, "dtype": "bfloat16", "gemm": "triton"}]
    text = path.read_text()
    assert text.index("[[ag_gemm]]") < text.index("[[gemm_rs]]")
    tuned.record(
        path, "gemm_rs", shape_key(2, 64, 64, 48, torch.bfloat16), {"pieces": 4}, 0.25, CPU
    )
    assert path.read_text() == text  # the same entry again: the same bytes (on the same day)


def test_record_round_trips_none_floats_and_strings(tmp_path):
    path = tmp_path / "t.toml"
    values = {"lag": None, "min_fused_flops": 1e11, "timeout_s": 0.1 + 0.2, "allow_tf32": True,
              "producer": 'a "quoted" \\ \n\t\x7f é', "pieces": -3}  # fmt: skip
    tuned.record(path, "gemm_rs", SHAPE, values, 1 / 3, CPU)
    assert 'none = ["lag"]' in path.read_text()
    (entry,) = tuned.read_table(path)["gemm_rs"]
    assert entry == {"m": 64, "k": 32, "n": 48, "dtype": "float32", **values, "measured_ms": 1 / 3}
    tuned.use_table(path)
    assert tuned.tuned_values("gemm_rs", SHAPE, CPU) == values


def test_record_updates_a_table_in_use(tmp_path):
    path = tmp_path / "t.toml"
    tuned.record(path, "gemm_rs", SHAPE, {"pieces": 2}, None, CPU)
    tuned.use_table(path)
    assert tuned.tuned_values("gemm_rs", SHAPE, CPU) == {"pieces": 2}
    tuned.record(path, "gemm_rs", SHAPE, {"pieces": 3}, None, CPU)
    assert tuned.tuned_values("gemm_rs", SHAPE, CPU) == {"pieces": 3}


def test_record_into_a_table_of_another_host_or_world_raises(tmp_path):
    other = _table(tmp_path, "", name="h200.toml", gpu="NVIDIA H200", nccl="2.28.9")
    with pytest.raises(
        ok.OverlapInputError, match=re.escape(f"tuned table {other}: it was made on NVIDIA H200")
    ):
        tuned.record(other, "gemm_rs", SHAPE, {"pieces": 2}, None, CPU)
    ours = tmp_path / "cpu_x2.toml"
    tuned.record(ours, "gemm_rs", SHAPE, {"pieces": 2}, None, CPU)
    with pytest.raises(ok.OverlapInputError, match="made for 2 ranks, this group has 4"):
        tuned.record(ours, "gemm_rs", {**SHAPE, "world": 4}, {"pieces": 2}, None, CPU)
    with pytest.raises(ok.OverlapInputError, match=r"\['m'\] are not config fields"):
        tuned.record(ours, "gemm_rs", SHAPE, {"m": 2}, None, CPU)


ENTRY = '\n[[gemm_rs]]\nm = 64\nk = 32\nn = 48\ndtype = "float32"\n'


@pytest.mark.parametrize(
    "text, problem",
    [
        ("m = 1\n", "no [host] table"),
        (_header().replace('triton = "', 'tritn = "'), "[host] lacks triton"),
        (_header() + 'cuda = "13.0"\n', "[host] has unknown field(s) ['cuda']"),
        (_header(world=0), "[host] world must be an integer >= 1, got 0"),
        (
            _header().replace("world = 2", 'world = "2"'),
            "[host] world must be an integer >= 1, got '2'",
        ),
        ("gemm_rs = 3\n" + _header(), "'gemm_rs' must be an array of tables"),
        (
            _header() + ENTRY.replace("k = 32\n", ""),
            "[[gemm_rs]] entry 1: no k (nor k_min / k_max)",
        ),
        (
            _header() + ENTRY.replace("m = 64", "m_max = 64.0"),
            "[[gemm_rs]] entry 1: m_max must be an integer",
        ),
        (
            _header() + ENTRY.replace('dtype = "float32"\n', ""),
            "[[gemm_rs]] entry 1: dtype must be a string",
        ),
        (_header() + ENTRY + ENTRY + "world = 2\n", "[[gemm_rs]] entry 2: world belongs in [host]"),
        (
            _header() + ENTRY + "pieces = [1, 2]\n",
            "[[gemm_rs]] entry 1: pieces must be a string, number or boolean",
        ),
        (
            _header() + ENTRY + 'none = "lag"\n',
            "[[gemm_rs]] entry 1: none must be a list of field names",
        ),
        (
            _header() + ENTRY + 'lag = 1\nnone = ["lag"]\n',
            "[[gemm_rs]] entry 1: lag is in none and is also set",
        ),
        (
            _header() + ENTRY + 'measured_ms = "1"\n',
            "[[gemm_rs]] entry 1: measured_ms must be a number",
        ),
        (_header() + "[[gemm_rs]\n", "not valid TOML"),
    ],
)
def test_a_malformed_table_is_an_input_error_naming_the_file(tmp_path, text, problem):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(
        ok.OverlapInputError, match=re.escape(f"tuned table {path.resolve()}: {problem}")
    ):
        tuned.use_table(path)


def test_an_unknown_field_from_a_table_names_the_table(tmp_path):
    path = _table(tmp_path, ENTRY + "pices = 2\n")
    tuned.use_table(path)
    with pytest.raises(
        ok.OverlapInputError, match=rf"tuned table {re.escape(str(path.resolve()))}: .*'pices'"
    ):
        build_config(ok.GemmRsConfig, "gemm_rs", SHAPE, None, CPU)
    tuned.forget_tables()
    tuned.use_table(_table(tmp_path, ENTRY + 'mechanism = "teleport"\n', name="t2.toml"))
    with pytest.raises(
        ok.OverlapInputError, match=r"mechanism .*teleport.* from tuned table .*t2.toml"
    ):
        build_config(ok.GemmRsConfig, "gemm_rs", SHAPE, None, CPU)


def test_the_shipped_tables_are_h200_x2_and_x4_with_valid_fields_of_each_op():
    """Each entry, over the CUDA template as tuning.py merges it for that shape,
    makes a valid config of its op."""
    shipped = {Path(name).name: table for name, table in tuned.shipped_tables()}
    assert set(shipped) == {"nvidia-h200_x2.toml", "nvidia-h200_x4.toml"}
    for name, table in shipped.items():
        host = table["host"]
        assert (host["gpu"], f"nvidia-h200_x{host['world']}.toml") == ("NVIDIA H200", name)
        assert host["torch"] and host["triton"] and host["nccl"] and host["source"]
        assert set(table) == {"host", *CONFIGS}
        for op, entries in (item for item in table.items() if item[0] != "host"):
            cls, template = CONFIGS[op], load_template(op)
            fields = set(cls.__dataclass_fields__)
            cuda = {
                **template["common"],
                **{k: v for k, v in template["cuda"].items() if k != "shapes"},
            }
            assert entries, (name, op)
            for entry in entries:
                values = tuned.config_values(entry)
                assert set(values) <= fields and "fastest" not in values.values(), (name, op, entry)
                assert entry["dtype"] == "bfloat16" and entry["measured_ms"] > 0
                shape = shape_key(host["world"], entry["m"], entry["k"], entry["n"], entry["dtype"])
                shapes = template["cuda"].get("shapes", [])
                matching = next((e for e in shapes if tuned.entry_matches(e, shape)), {})
                merged = {**cuda, **{k: v for k, v in matching.items() if k in fields}, **values}
                cls(**merged).validate()


@pytest.fixture(scope="module")
def script():
    """bench/tables_from_results.py as a module."""
    spec = importlib.util.spec_from_file_location(
        "tables_from_results", ROOT / "bench" / "tables_from_results.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(variant, ms, shape=(16, 7168, 8192), op="gemm_ar", status="ok", **config):
    m, k, n = shape
    return {"op": op, "variant": variant, "status": status, "ms": ms,
            "shape": {"M": m, "K": k, "N": n}, "config": config}  # fmt: skip


def test_tables_take_each_benchmarked_shape_from_the_newest_run_that_ran_it(script):
    """A run of a few shapes replaces those shapes' entries and keeps the others';
    a shape the benchmark no longer runs stays out."""

    def run(name, shapes_ms):
        rows = [
            _row("ours_auto", ms, shape, "ag_gemm", path="sequential") for shape, ms in shapes_ms
        ]
        return {"run": name, "dtype": "bfloat16", "rows": rows}

    old = run("old", [((8192, 8192, 7168), 1.0), ((32, 7168, 8192), 2.0), ((7, 7, 7), 3.0)])
    new = run("new", [((32, 7168, 8192), 0.5)])
    made, used = script.entries("ag_gemm", [old, new])
    assert [(e["m"], e["measured_ms"]) for e in made] == [(8192, 1.0), (32, 0.5)]
    assert [doc["run"] for doc in used] == ["old", "new"]


@pytest.mark.parametrize(
    ("tuned_ms", "tuned_path", "auto_status", "taken"),
    [
        (0.95, "sequential", "ok", "ours_autotune"),  # another config, > 3% faster
        (0.98, "sequential", "ok", "ours_auto"),  # another config, within 3%: not a flip
        (0.50, "one_shot", "ok", "ours_auto"),  # the same config: noise
        (2.00, "one_shot", "check_failed", "ours_autotune"),  # the library's choice failed
    ],
)
def test_a_table_takes_autotunes_choice_only_where_it_won(
    script, tuned_ms, tuned_path, auto_status, taken
):
    rows = [
        _row("ours_auto", 1.0, status=auto_status, path="one_shot"),
        _row("ours_autotune", tuned_ms, path=tuned_path),
    ]
    (chosen,) = script._auto_rows({"rows": rows})
    assert chosen["variant"] == taken


@pytest.mark.parametrize(
    ("runs", "taken"),
    [
        ([0.5, 0.5], "one_shot"),  # beat the choice by > 3% in both runs
        ([None, 0.5], "sequential"),  # one run only: not a flip
        ([0.99, 0.5], "sequential"),  # within 3% in the older run
        ([0.5, 0.99, 0.5], "sequential"),  # the two newest decide: lost in the middle one
        ([0.99, 0.5, 0.5], "one_shot"),  # an older loss beyond the two newest does not count
        ([0.5, "chosen", 0.5], "one_shot"),  # a run whose choice was one_shot compares nothing
        ([0.5, "renamed", 0.5], "one_shot"),  # the config counts, not the variant's name
        ([0.5, "other versions", 0.5], "one_shot"),  # the same versions only: the first counts
        (["other versions", 0.5], "sequential"),  # the only other win had other versions
        ([0.5, {"pieces": 2}], "sequential"),  # a field a table does not hold differs
    ],
)
def test_a_table_takes_a_named_variant_only_where_it_won_in_repeated_runs(script, runs, taken):
    """A named variant of the benchmark whose config a table can express replaces the
    library's choice where it ran more than 3% faster in each of the two newest runs with
    the same versions that timed both (oldest run first)."""
    template = {"path": "sequential", "pieces": 4}

    def run(name, how):
        versions, auto, variant, ms, extra = "v1", template, "ours_one_shot", how, {}
        if how == "chosen":  # the library already ran one_shot: nothing to compare
            auto, ms = {**template, "path": "one_shot"}, 0.5
        elif how == "renamed":
            variant, ms = "ours_one_shot_again", 0.5
        elif how == "other versions":
            versions, ms = "v0", 0.5
        elif isinstance(how, dict):
            extra, ms = how, 0.5
        rows = [_row("ours_auto", 1.0, **auto)]
        if ms is not None:
            rows.append(_row(variant, ms, **{**template, "path": "one_shot", **extra}))
        return {"run": name, "dtype": "bfloat16", "versions": versions, "rows": rows}

    docs = [run(f"run{i}", how) for i, how in enumerate(runs)]
    ((entry,), _) = script.entries("gemm_ar", docs)
    assert entry["path"] == taken
    assert entry["measured_ms"] == (0.5 if taken == "one_shot" else 1.0)


@pytest.mark.parametrize(
    ("pair_ms", "ours_ms", "sequential"),
    [(0.045, 0.051, True), (0.054, 0.055, False), (0.079, 0.058, False)],  # fmt: skip
)
def test_captured_calls_go_to_the_pair_where_it_replayed_faster(
    script, pair_ms, ours_ms, sequential
):
    """graph_path "sequential" where the captured pair replayed more than 3% faster
    than the library's captured choice (the runs' decode numbers); not on a path
    that is the pair anyway, nor on an entry that takes another config."""
    rows = [_row("ours_auto", 0.09, path="one_shot"), _row("sequential_graph", pair_ms),
            _row("ours_graph", ours_ms)]  # fmt: skip
    run = {"run": "r", "dtype": "bfloat16", "rows": rows}
    ((entry,), _) = script.entries("gemm_ar", [run])
    assert (entry.get("graph_path") == "sequential") is sequential
    rows[0]["config"] = {"path": "sequential"}
    ((entry,), _) = script.entries("gemm_ar", [run])
    assert "graph_path" not in entry
    # ours_graph captured the library's choice: an entry that takes another config
    # (autotune's, here) has no replay measured, so no graph_path.
    rows[0]["config"] = {"path": "one_shot"}
    rows.append(_row("ours_autotune", 0.05, path="two_shot"))
    ((entry,), _) = script.entries("gemm_ar", [run])
    assert entry["path"] == "two_shot" and "graph_path" not in entry


def test_a_run_that_captured_the_pair_keeps_sending_captured_calls_there(script):
    """A run whose choice already sent captured calls to the pair (graph_path
    "sequential") replayed the pair twice: level times say nothing of the fused
    path's replay, so the entry keeps graph_path; a run that captured the fused
    path and found it level drops it."""
    rows = [_row("ours_auto", 0.09, path="one_shot", graph_path="sequential"),
            _row("sequential_graph", 0.060), _row("ours_graph", 0.060)]  # fmt: skip
    run = {"run": "r", "dtype": "bfloat16", "rows": rows}
    ((entry,), _) = script.entries("gemm_ar", [run])
    assert entry["path"] == "one_shot" and entry["graph_path"] == "sequential"
    rows[0]["config"]["graph_path"] = "same"
    ((entry,), _) = script.entries("gemm_ar", [run])
    assert "graph_path" not in entry


def test_the_shipped_tables_are_what_the_results_give_and_are_installed(script, tmp_path):
    """bench/tables_from_results.py, run on the committed results, writes the committed tables."""
    for world in (2, 4):
        tuned.write_table(tmp_path / "made.toml", script.table(world))
        shipped = ROOT / "overlap_kernels" / "tables" / f"nvidia-h200_x{world}.toml"
        assert (tmp_path / "made.toml").read_text() == shipped.read_text()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    assert package_data["overlap_kernels.tables"] == ["*.toml"]
