"""One-question experiments (ablations, probes, timelines), apart from the benchmark suite;
their findings are recorded in docs/performance.md.

The GEMM probes share what they do with their variants: keep those that run and match the
fp32 reference (:func:`working`), time them beside cuBLAS in interleaved rounds and print
them fastest first (:func:`ranked_against_cublas`), and write every time (:func:`write_json`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

# bf16 output: 2^-8 relative rounding, plus fp32 sums in another order than the reference's.
TOLERANCE = 2**-7


def gemm_probe_parser(doc: str) -> argparse.ArgumentParser:
    """A GEMM probe's command line: its docstring's first line, --rounds and --json."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--json", default=None, help="write every time here")
    return parser


def working(
    problem, candidates: dict[str, Callable[[], object]]
) -> dict[str, Callable[[], object]]:
    """The candidates that run on ``problem`` (a bench.gemm_cores.Problem) and write its
    product within TOLERANCE of the fp32 reference (largest error over the largest
    entry); each other one printed, refused or WRONG, as a row and not the end."""
    import torch

    kept = {}
    for name, call in candidates.items():
        try:
            problem.out.zero_()
            call()
            if problem.out.is_cuda:
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (a config the GPU or compiler refuses)
            print(
                f"{tuple(problem.shape.values())} {name}: refused ({type(e).__name__}: {e})"[:200]
            )
            continue
        reference = problem.reference
        err = ((problem.out.float() - reference).abs().max() / reference.abs().max()).item()
        if err > TOLERANCE:
            print(f"{tuple(problem.shape.values())} {name}: WRONG (relative error {err:.2e})")
            continue
        kept[name] = call
    return kept


def ranked_against_cublas(
    label: str, calls: dict[str, Callable[[], object]], rounds: int, top: int | None = None
) -> dict[str, Any]:
    """Time ``calls`` (one of them "cublas") in interleaved rounds, print the ``top``
    fastest (all: None) against cuBLAS, and return the record a probe's JSON keeps."""
    from bench.gemm_cores import interleaved_medians

    times, errors = interleaved_medians(calls, rounds)
    for name, error in errors.items():
        print(f"{label} {name}: failed while timed ({error})")
    vendor = statistics.median(times["cublas"])
    ranked = sorted((statistics.median(t), name) for name, t in times.items())
    print(f"\n{label}: cublas {vendor * 1e3:.1f} us")
    for ms, name in ranked[:top]:
        print(f"  {ms * 1e3:8.1f} us  x{ms / vendor:.3f}  {name}")
    return {"shape": label, "cublas_ms": vendor,
            "ours": {name: statistics.median(t) for name, t in times.items() if name != "cublas"}}  # fmt: skip


def write_json(path: str | None, runs: list[dict[str, Any]]) -> None:
    """A probe's records with the GPU and versions, at ``path`` (nothing where None)."""
    if path is None:
        return
    import torch
    import triton

    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "runs": runs}, f, indent=1)  # fmt: skip
