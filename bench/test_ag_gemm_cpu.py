"""End-to-end check of `python -m bench` on 2 CPU ranks (gloo) against a fake overlap_kernels.

The fake stands in for the library so that the harness's own logic is tested whatever state
the library is in: spawning, the correctness check (a poisoned ``out=`` with an unwritten row
must fail loudly), agreement over ranks, the table, the JSON and the exit status. ~5 s.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

from bench import store

REPO = Path(__file__).resolve().parent.parent

FAKE_INIT = '''
"""A fake overlap_kernels for bench tests: correct when auto, wrong when a config is forced."""
import dataclasses

import torch
import torch.distributed as dist

__version__ = "0.0.fake"


@dataclasses.dataclass(frozen=True)
class AgGemmConfig:
    path: str = "auto"
    block_m: int = 128
    split_tail: bool = True
    gemm: str = "triton"
    epilogue: str = "pointer"


def matmul(a, b, config=None):
    return a @ b


def ag_gemm(x, w, group, *, schedule=None, config=None, out=None, return_gathered=False):
    gathered = x.new_empty(x.shape[0] * dist.get_world_size(group), x.shape[1])
    dist.all_gather_into_tensor(gathered, x, group=group)
    result = gathered @ w
    if out is None:
        return result
    rows = out.shape[0] - 1 if config is not None else out.shape[0]  # forced: last row unwritten
    out[:rows].copy_(result[:rows])
    return out
'''

# bench/cli.py takes the no-multicast variables from the library, so the fake has them too.
FAKE_LAUNCH = """
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}
"""

FAKE_OPS = """
import dataclasses

import torch.distributed as dist

from overlap_kernels import AgGemmConfig


def resolve_config(x, w, group, config=None):
    cfg = config or AgGemmConfig()
    if cfg.path == "auto":
        big = x.shape[0] * dist.get_world_size(group) >= 64
        cfg = dataclasses.replace(cfg, path="fused" if big else "sequential")
    return cfg
"""


def test_bench_cli_on_cpu_ranks(tmp_path: Path) -> None:
    pkg = tmp_path / "fake" / "overlap_kernels"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_INIT))
    (pkg / "launch.py").write_text(textwrap.dedent(FAKE_LAUNCH))
    # The harness times with the library's op-agnostic timing module (torch only): the real one.
    (pkg / "timing.py").write_text((REPO / "overlap_kernels" / "timing.py").read_text())
    # ... and checks with its oracle's bound (torch only): the real one too.
    (pkg / "reference.py").write_text((REPO / "overlap_kernels" / "reference.py").read_text())
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "ag_gemm.py").write_text(textwrap.dedent(FAKE_OPS))
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path / 'fake'}{os.pathsep}{REPO}",
        "OUT": str(tmp_path / "out"),
    }
    args = shlex.split(
        "--op ag_gemm --cpu-ranks 2 --shapes 64x32x48 16x32x24 --iters 4 --rounds 2 --warmup 1"
    )
    cmd = [sys.executable, "-m", "bench", *args, "--store", str(tmp_path / "store.jsonl")]
    # cwd outside the repo so the fake, first on PYTHONPATH, wins over the real library.
    proc = subprocess.run(
        cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr  # a failed check fails the run

    (path,) = (tmp_path / "out").glob("ag_gemm_cpu_x2_*.json")  # the run's document, in $OUT
    doc = json.loads(path.read_text())
    (stored,) = store.runs(store.load(tmp_path / "store.jsonl"))  # and its rows in the store
    assert stored["run"] == path.stem and stored["rows"] == doc["rows"]
    assert doc["world_size"] == 2 and doc["versions"]["overlap_kernels"] == "0.0.fake"
    assert doc["env"]["NCCL_NVLS_ENABLE"] == "0"
    rows = {(r["shape"]["M"], r["variant"]): r for r in doc["rows"]}
    for m, path_taken in ((64, "fused"), (16, "sequential")):
        auto, forced = rows[(m, "ours_auto")], rows[(m, "ours_fused")]
        assert auto["status"] == "ok" and auto["rel_err"] < 1e-2
        assert auto["config"]["path"] == path_taken and forced["config"]["path"] == "fused"
        assert forced["status"] == "check_failed" and "non-finite" in forced["note"]
        assert rows[(m, "torch_fused")]["status"] == "skipped"
        assert rows[(m, "ours_local_gemm")]["status"] == "ok"
        parts = [rows[(m, "cublas")]["ms"], rows[(m, "nccl_all_gather")]["ms"]]
        assert rows[(m, "bound")]["ms"] == max(parts)
    assert "FAILED  ours_fused at 64x32x48: check_failed" in proc.stderr
    assert "!" in proc.stdout and "geomean speedup of ours_auto over sequential" in proc.stdout
