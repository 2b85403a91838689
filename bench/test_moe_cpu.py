"""The moe entry on CPU: ``python -m bench --op moe`` on 2 gloo ranks with the real library,
the same against a fake library (its forced fused path wrong on purpose), the NCCL path
against the contract's definition on adversarial routings, and the pure pieces in-process.

The numbers of a CPU run mean nothing; what is checked is that every NCCL variant and, with
the real library, every ours variant (each MoE op and path runs in Triton's interpreter)
runs and passes its check, and that the byte counts are those of the routing. ~30 s.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import cli, common, moe, store
from bench.harness import RunContext, Settings, Variant, WallClock, validate_results
from bench.test_ag_gemm_cpu import FAKE_LAUNCH
from bench.test_harness import CPU_RUN_TIMING

REPO = Path(__file__).resolve().parent.parent
SHAPES = ("24x32x8x2x16", "6x32x8x3x16")  # T x H x E x k x F, tiny; k = 3 is odd
VARIANTS = ["nccl_dispatch", "ours_dispatch", "nccl_combine", "ours_combine", "grouped_gemm",
            "nccl_layer", "symm_mem_layer", "symm_mem_graph_layer", "deepep_layer", "deepep_graph_layer", "ours_unfused_layer", "ours_fused_layer",
            "ours_auto_layer", "nccl_dc", "ours_graph_dc", "ours_graph_layer", "ours_graph_eager_layer", "bound", "traffic"]  # fmt: skip
NCCL = ("nccl_dispatch", "nccl_combine", "grouped_gemm", "nccl_layer", "nccl_dc")
BASELINES = {"symm_mem_layer": "CPU ranks: torch.ops.symm_mem.all_to_all_vdev_2d runs on CUDA",
             "symm_mem_graph_layer": "CPU ranks: torch.ops.symm_mem.all_to_all_vdev_2d runs on CUDA",
             "deepep_layer": "CPU ranks: DeepEP runs on CUDA",
             "deepep_graph_layer": "CPU ranks: DeepEP runs on CUDA"}  # fmt: skip
OURS = [v for v in VARIANTS if v.startswith("ours")]


def _run(args: str, results: Path, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "bench",
        *shlex.split(args),
        "--store",
        str(results / "store.jsonl"),
    ]
    return subprocess.run(
        cmd, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _doc(out: Path, proc: subprocess.CompletedProcess) -> dict[str, Any]:
    """The run's document, which the run writes into $OUT (``out``)."""
    paths = list(out.glob("moe_cpu_x2_*.json"))
    assert len(paths) == 1, (paths, proc.stdout[-3000:], proc.stderr[-3000:])
    doc = json.loads(paths[0].read_text())
    validate_results(doc)  # schema 1: every row has exactly ROW_KEYS
    return doc


def _by_shape(doc: dict[str, Any]) -> dict[tuple[int, ...], dict[str, dict[str, Any]]]:
    out: dict[tuple[int, ...], dict[str, dict[str, Any]]] = {}
    for r in doc["rows"]:
        out.setdefault(tuple(r["shape"].values()), {})[r["variant"]] = r
    return out


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("bench_moe")
    args = f"--op moe --cpu-ranks 2 --shapes {' '.join(SHAPES)} {CPU_RUN_TIMING}"
    proc = _run(args, tmp / "res", REPO, {**os.environ, "OUT": str(tmp / "out")})
    doc = _doc(tmp / "out", proc)  # the run's document, in $OUT
    (stored,) = store.runs(store.load(tmp / "res" / "store.jsonl"))  # and its rows in the store
    assert stored["rows"] == doc["rows"]
    return proc, doc


def test_moe_run_exit_ok(moe_run: tuple[Any, dict[str, Any]]) -> None:
    proc, doc = moe_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAILED" not in proc.stderr
    assert doc["world_size"] == 2 and doc["settings"]["dtype"] == "bfloat16"
    assert doc["settings"]["shapes"] == list(SHAPES)
    tail = proc.stdout[proc.stdout.index("\nmoe\n") :]  # the table comes last
    assert "geomean speedup of ours_auto_layer over nccl_layer" in tail
    assert "goal: ours_auto_layer over nccl_layer on each prefill shape (T > 256) >= 1.3" in tail
    assert "goal: nccl d+c ms over ours d+c ms on each decode shape (T <= 256) > 1" in tail
    assert "goal: nccl_dc ms (eager: not capturable) over ours_graph_dc ms" in tail
    assert "decode, ours replayed in CUDA graphs" in tail


def test_moe_rows(moe_run: tuple[Any, dict[str, Any]]) -> None:
    _, doc = moe_run
    shapes = _by_shape(doc)
    assert list(shapes) == [moe.parse_shape(s) for s in SHAPES]
    for rows in shapes.values():
        assert list(rows) == VARIANTS
        for v in NCCL:
            assert rows[v]["status"] == "ok" and rows[v]["ms"] > 0, rows[v]
            assert rows[v]["rel_err"] is not None and rows[v]["rel_err"] < 1e-2, rows[v]
        assert rows["nccl_dispatch"]["rel_err"] == 0.0  # bit for bit the contract's definition
        for v in ("grouped_gemm", "nccl_layer"):
            assert rows[v]["config"]["grouped_mm"] in moe.GROUPED_MM
            assert rows[v]["note"].startswith("grouped GEMM: ")
            assert rows[v]["tflops"] > 0
        assert rows["nccl_dispatch"]["tflops"] is None
        assert rows["nccl_layer"]["pct_of_bound"] is not None
        assert rows["nccl_dispatch"]["pct_of_bound"] is None
        parts = rows["grouped_gemm"]["ms"], rows["nccl_dispatch"]["ms"] + rows["nccl_combine"]["ms"]
        assert rows["bound"]["ms"] == max(parts)
        # The library has every MoE op and each path runs on CPU (Triton's interpreter):
        # no ours variant may be skipped there; each ran, was timed and passed its check.
        for v in OURS:
            r = rows[v]
            assert r["status"] == "ok" and r["ms"] > 0, r
            assert r["rel_err"] == 0.0 if v == "ours_dispatch" else r["rel_err"] < 1e-2, r
        assert rows["ours_unfused_layer"]["config"]["path"] == "unfused"
        assert rows["ours_fused_layer"]["config"]["path"] == "fused"
        # The baselines users run at scale need CUDA: skipped, saying why. The graph mode
        # runs eagerly on CPU ranks (no CUDA graphs), the NCCL path beside it eagerly anyway.
        for v, why in BASELINES.items():
            assert rows[v]["status"] == "skipped" and rows[v]["note"].startswith(why), rows[v]
        assert rows["ours_graph_dc"]["note"] == "eager: CPU ranks have no CUDA graphs"
        assert ".tolist()" in rows["nccl_dc"]["note"], rows["nccl_dc"]


def test_moe_traffic_is_the_routings(moe_run: tuple[Any, dict[str, Any]]) -> None:
    """The recorded byte counts are those of the routing each rank made (recomputed here
    from the same seeds), and GB/s is the mean payload over the variant's ms."""
    _, doc = moe_run
    for shape, rows in _by_shape(doc).items():
        t, h, e, k, _ = shape
        counts = []
        for rank in range(2):
            ctx = RunContext(rank, 2, torch.device("cpu"), None, WallClock(), lambda: None, None)
            counts.append(moe.route_counts(moe.make_inputs(shape, ctx, 0).topk_ids, 2, e))
        expect = moe.traffic(
            [c[0] for c in counts], [c[1] for c in counts], row_bytes=2 * h, e_local=e // 2
        )
        got = dict(rows["traffic"]["config"])
        gbps = got.pop("gbps_per_rank")
        assert got == expect
        assert sum(got["pairs_received_per_rank"]) == 2 * t * k  # every slot is used
        assert sum(got["dispatch_bytes_out_per_rank"]) == sum(got["combine_bytes_out_per_rank"])
        for v in ("nccl_dispatch", "nccl_combine"):
            want = got["payload_bytes_per_rank"] / (rows[v]["ms"] * 1e-3) / 1e9
            assert gbps[v] == pytest.approx(want) and "GB/s per rank" in rows[v]["note"]


# ----------------------------------------------------------------------------- fake library

FAKE_MOE_INIT = '''
"""A fake overlap_kernels with the contract's MoE ops, built from the bench's reference
pieces; the forced "fused" path of moe_mlp is wrong on purpose."""
import dataclasses
import importlib

import torch
import torch.distributed as dist

__version__ = "0.0.fake"


class _Bench:
    """bench.moe, imported on first use: bench's harness imports this package's timing
    module, so importing bench while this package initialises would be circular."""

    def __getattr__(self, name):
        return getattr(importlib.import_module("bench.moe"), name)


_bm = _Bench()


@dataclasses.dataclass
class MoeHandle:
    expert_counts: tuple
    recv_src_rank: torch.Tensor
    recv_src_token: torch.Tensor
    recv_weights: torch.Tensor
    num_tokens: int


def moe_dispatch(x, topk_ids, topk_weights, group, *, num_experts, config=None):
    d = _bm.contract_dispatch(x, topk_ids, topk_weights, num_experts=num_experts, group=group)
    handle = MoeHandle(tuple(d.expert_counts), d.src_rank, d.src_token, d.weights, len(x))
    return d.recv_x, handle


def moe_combine(y, handle, *, out=None):
    world, t = dist.get_world_size(), handle.num_tokens  # the same T on every rank here
    part = torch.zeros(world * t, y.shape[1])
    rows = handle.recv_src_rank * t + handle.recv_src_token
    part.index_add_(0, rows, y.float() * handle.recv_weights[:, None])
    back = torch.empty_like(part.to(y.dtype))
    dist.all_to_all_single(back, part.to(y.dtype))
    return back.float().view(world, t, -1).sum(0).to(y.dtype)


def moe_mlp(x, topk_ids, topk_weights, w_gate_up, w_down, group, *, num_experts, config=None):
    recv_x, handle = moe_dispatch(x, topk_ids, topk_weights, group, num_experts=num_experts)
    out = moe_combine(_bm.mlp_reference(recv_x, handle.expert_counts, w_gate_up, w_down), handle)
    return 2 * out if (config or {}).get("path") == "fused" else out
'''

FAKE_MOE_OPS = """
import dataclasses


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    path: str = "auto"
    block_m: int = 64


def resolve_config(x, topk_ids, topk_weights, w_gate_up, w_down, group, *, num_experts,
                   config=None):
    path = (config or {}).get("path", "auto")
    return MoeConfig("unfused" if path == "auto" else path)
"""


def test_moe_with_a_fake_library(tmp_path: Path) -> None:
    """With the ops present, every ours variant is checked against the NCCL path: dispatch
    bit for bit, the layers within rel_tol (the wrong fused path fails the run, exit 2), and
    ours_auto_layer records the path resolve_config gives."""
    pkg = tmp_path / "fake" / "overlap_kernels"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_MOE_INIT))
    (pkg / "launch.py").write_text(textwrap.dedent(FAKE_LAUNCH))
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "moe.py").write_text(textwrap.dedent(FAKE_MOE_OPS))
    # The harness times with the library's op-agnostic timing module (torch only): the real one.
    (pkg / "timing.py").write_text((REPO / "overlap_kernels" / "timing.py").read_text())
    # ... and checks with its oracle's bound (torch only): the real one too.
    (pkg / "reference.py").write_text((REPO / "overlap_kernels" / "reference.py").read_text())
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path / 'fake'}{os.pathsep}{REPO}",
        "OUT": str(tmp_path / "out"),
    }
    args = f"--op moe --cpu-ranks 2 --shapes moe:8x32x4x2x16 {CPU_RUN_TIMING}"
    # cwd outside the repo so the fake, first on PYTHONPATH, wins over the real library.
    proc = _run(args, tmp_path / "res", tmp_path, env)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = _doc(tmp_path / "out", proc)
    assert doc["versions"]["overlap_kernels"] == "0.0.fake"
    (rows,) = _by_shape(doc).values()
    for v in (*NCCL, "ours_dispatch", "ours_combine", "ours_unfused_layer", "ours_auto_layer"):
        assert rows[v]["status"] == "ok" and rows[v]["ms"] > 0, rows[v]
    assert rows["ours_dispatch"]["rel_err"] == 0.0
    assert rows["ours_combine"]["rel_err"] < 1e-2 and rows["ours_unfused_layer"]["rel_err"] < 1e-2
    fused = rows["ours_fused_layer"]
    assert fused["status"] == "check_failed" and "CHECK FAILED vs nccl_layer" in fused["note"]
    assert fused["config"] == {"path": "fused", "block_m": 64}
    auto = rows["ours_auto_layer"]
    assert auto["config"]["path"] == "unfused" and auto["note"] == "resolved path=unfused"
    assert "FAILED  ours_fused_layer at 8x32x4x2x16: check_failed" in proc.stderr
    gbps = rows["traffic"]["config"]["gbps_per_rank"]
    assert set(gbps) == {"nccl_dispatch", "ours_dispatch", "nccl_combine", "ours_combine"}


# ----------------------------------------------------------------------------- the NCCL path


def _nccl_path_body(rank: int, world: int) -> int:
    """nccl_dispatch against the definition and nccl_combine's round trip, on routings with
    unused slots (-1) and an expert twice in a token, including a rank with no pair."""
    torch.manual_seed(0)
    checked = 0
    for trial, (t, h, e, k) in enumerate([(13, 8, 2 * world, 3), (5, 16, 4 * world, 5)]):
        gen = torch.Generator().manual_seed(1000 * trial + rank)
        ids = torch.randint(-1, e, (t, k), generator=gen)
        if trial == 1:
            ids[:, :] = torch.where(ids >= e // world, ids, -1)  # nothing for rank 0's experts
        weights = torch.rand(t, k, generator=gen)
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        got = moe.nccl_dispatch(x, ids, weights, num_experts=e)
        ref = moe.contract_dispatch(x, ids, weights, num_experts=e)
        assert torch.equal(got.recv_x, ref.recv_x)
        assert got.expert_counts == ref.expert_counts
        assert torch.equal(got.weight_of_pair, ref.weights)
        out = moe.nccl_combine(got.recv_x, got)
        weight_sum = (weights * (ids >= 0)).sum(1, keepdim=True)
        expect = x.double() * weight_sum.double()
        # The contract's bound: two roundings to bf16 (the owner's sum, the home's).
        bound = 2 * 2.0**-8 * (expect.abs() + x.double().abs() * weight_sum.double()) + 1e-6
        assert ((out.double() - expect).abs() <= bound).all()
        checked += len(ref.recv_x)
    return checked


@pytest.mark.parametrize("world", [1, 2, 3])
def test_nccl_path_against_the_definition(world: int) -> None:
    from overlap_kernels.launch import run_ranks

    assert sum(run_ranks(_nccl_path_body, world, timeout_s=120)) > 0


# ----------------------------------------------------------------------------- in-process


def test_traffic_by_hand() -> None:
    """World 2, 4 experts (2 per rank). Rank 0: token 0 -> experts 0, 1 (rank 0 twice),
    token 1 -> 0, 2 (both ranks), token 2 -> 3, unused, token 3 -> 2, 3 (rank 1 twice).
    Rank 1: one token -> 1, 3 (both ranks)."""
    rank0 = moe.route_counts(torch.tensor([[0, 1], [0, 2], [3, -1], [2, 3]]), 2, 4)
    rank1 = moe.route_counts(torch.tensor([[1, 3]]), 2, 4)
    assert rank0 == [[2, 3], [3, 4]] and rank1 == [[1, 1], [1, 1]]  # [rows, pairs] per rank
    moved = moe.traffic([rank0[0], rank1[0]], [rank0[1], rank1[1]], row_bytes=10, e_local=2)
    assert moved == {
        "row_bytes": 10,
        "dispatch_rows_out_per_rank": [3, 1],
        "dispatch_bytes_out_per_rank": [30, 10],
        "combine_bytes_out_per_rank": [10, 30],
        "local_rows_per_rank": [2, 1],
        "payload_bytes_per_rank": 20.0,
        "pairs_received_per_rank": [4, 5],
        "nccl_meta_bytes_out_per_rank": [48, 12],
        "nccl_counts_bytes_out_per_rank": [24, 24],
    }


def test_parse_shape() -> None:
    assert moe.parse_shape("deepseek_prefill") == (4096, 7168, 256, 8, 2048)
    assert moe.parse_shape("deepseek_decode") == (128, 7168, 256, 8, 2048)
    assert moe.parse_shape("qwen3_prefill") == (4096, 2048, 128, 8, 768)
    assert moe.parse_shape("24x32x8x2x16") == (24, 32, 8, 2, 16)
    # By default the models users run at scale (DeepSeek-V3, Qwen3-235B-A22B, Mixtral-8x22B),
    # at 128 and 4096 tokens per rank.
    models = {(7168, 256, 8, 2048), (4096, 128, 8, 1536), (6144, 8, 2, 16384)}
    assert sorted(moe.DEFAULT_SHAPES) == sorted((t, *m) for m in models for t in (128, 4096))
    assert set(moe.DEFAULT_SHAPES) <= set(moe.PRESETS.values())
    for bad in ("32x64x48", "8x32x4x5x16", "0x32x4x2x16", "deepseek"):
        with pytest.raises(ValueError, match="moe shape"):
            moe.parse_shape(bad)


def test_shapes_go_to_the_ops_whose_syntax_they_fit() -> None:
    def shapes(argv: str) -> dict[str, list[tuple[int, ...]]]:
        return cli.shapes_by_op(cli.parse_args(shlex.split(argv)))

    gemm = ("ag_gemm", "gemm_rs", "gemm_ar", "decode")  # (decode takes MxKxN too)
    got = shapes("--shapes 32x64x48 8x32x4x2x16")
    assert got == {**{op: [(32, 64, 48)] for op in gemm}, "moe": [(8, 32, 4, 2, 16)]}
    assert list(shapes("--shapes 32x64x48")) == list(gemm)  # moe: none fits, not run
    got = shapes("--shapes moe:qwen3_prefill gemm_ar:16x64x48")
    assert got == {"gemm_ar": [(16, 64, 48)], "moe": [(4096, 2048, 128, 8, 768)]}
    assert shapes("--op moe --shapes gemm_ar:16x64x48 moe:deepseek_decode") == {
        "moe": [(128, 7168, 256, 8, 2048)]
    }
    assert shapes("--op moe")["moe"] == moe.DEFAULT_SHAPES
    assert list(shapes("")) == [*gemm, "moe"]
    for bad, why in (
        ("--op moe --shapes 32x64x48", "fits no op run"),
        ("--op moe --shapes gemm_ar:16x64x48", "no shape for moe"),
        ("--shapes bogus:1x2x3", "no op 'bogus'"),
        ("--shapes moe:32x64x48", "moe shape"),
    ):
        with pytest.raises(ValueError, match=why):
            shapes(bad)


def _one_rank() -> RunContext:
    return RunContext(0, 1, torch.device("cpu"), None, WallClock(), lambda: None, None)


def test_exact_checks_fail_on_any_difference() -> None:
    """A copy must be bit for bit: an error far below rel_tol still fails an exact check;
    recv_x right but a handle field wrong gives error 1."""
    t = torch.randn(6, 4)
    close = t.clone()
    close[0, 0] += 1e-6
    variants = [Variant("same", lambda: t), Variant("close", lambda: close)]
    checks = {n: common.Check(lambda v=v: v.fn(), t, "ref", exact=True) for n, v in
              zip(("same", "close"), variants)}  # fmt: skip
    common.check_variants(_one_rank(), variants, checks, Settings())
    assert variants[0].status == "ok" and variants[0].rel_err == 0.0
    assert variants[1].status == "check_failed" and "not bit-identical" in variants[1].note

    ids = torch.tensor([[0, 1], [1, 0]])
    ref = moe.ContractDispatch(t[:4], torch.zeros(4, dtype=torch.long),
                               torch.tensor([0, 1, 0, 1]), torch.rand(4), [2, 2])  # fmt: skip
    handle = type("H", (), {"expert_counts": (2, 2), "recv_src_rank": ref.src_rank,
                            "recv_src_token": ref.src_token, "recv_weights": ref.weights})  # fmt: skip
    assert moe.dispatch_error((t[:4], handle), (t[:4], ref)) == 0.0
    assert moe.dispatch_error((close[:4], handle), (t[:4], ref)) > 0
    handle.recv_src_token = ids.reshape(-1)
    assert moe.dispatch_error((t[:4], handle), (t[:4], ref)) == 1.0
    assert math.isinf(moe.dispatch_error((t[:3], handle), (t[:4], ref)))


def test_eager_layers_run_the_expert_gemm_ours_runs() -> None:
    """Where our config takes cuBLAS per expert over torch._grouped_mm (at most
    cublas_max_local_experts experts per rank), the eager baselines run it too; elsewhere,
    with a library that does not say, or where torch._grouped_mm cannot run, they keep theirs."""
    from types import SimpleNamespace

    ctx = SimpleNamespace(group="g", world=2)
    s = SimpleNamespace(x=None, topk_ids=None, topk_weights=None)
    experts = SimpleNamespace(w_gate_up=None, w_down=None)

    def ours(bound: int | None) -> dict[str, Any]:
        said = {} if bound is None else {"cublas_max_local_experts": bound}
        return {"resolve_config": lambda *args, num_experts, config: said}

    grouped, loop = "torch._grouped_mm", "torch.matmul per expert"
    assert moe._as_ours_runs_it(grouped, ctx, s, experts, 8, ours(4)) == (
        loop,
        "as ours: cublas_max_local_experts 4",
    )  # 4 per rank
    assert moe._as_ours_runs_it(grouped, ctx, s, experts, 10, ours(4)) == (
        grouped,
        "",
    )  # 5 per rank
    assert moe._as_ours_runs_it(grouped, ctx, s, experts, 8, ours(None)) == (grouped, "")
    assert moe._as_ours_runs_it(grouped, ctx, s, experts, 8, {}) == (
        grouped,
        "",
    )  # no resolve_config
    assert moe._as_ours_runs_it(loop, ctx, s, experts, 64, ours(4)) == (loop, "")
