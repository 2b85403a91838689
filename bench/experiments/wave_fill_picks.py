"""The matmul core's wave-fill choice (templates/ag_gemm.toml ``wave_fill_tiles``) replayed
on stored runs: no GPU.

``python -m bench.experiments.wave_fill_picks --wide RUN --narrow RUN [--new RUN] [--sms 132]``
takes two ``bench.tune_gemm`` matmul runs of the same shapes, one with the template's own
tiles (``--wide``) and one with its ``wave_fill_tiles`` (``--narrow``), and prints per
shape the tiles the CUDA template's rule takes on ``--sms`` SMs (ops/matmul.py
``tiles_by_wave_fill``) and each run's time over cuBLAS's; then the geometric means of
the wide, the narrow and the picked ratios, and how many picks are more than 3% slower
than the wide tiles. ``--new``: a run made with the rule, its template's tiles per shape
against the pick and its geometric mean.
"""

from __future__ import annotations

import argparse
import math

import torch

from bench import store

SLOWER = 1.03  # a pick more than 3% slower than the template's own tiles counts as a loss


def ratios(records: list[dict], run: str) -> dict[tuple[int, int, int], tuple[str, float]]:
    """(M, K, N) -> (the template variant's tiles, its time over cuBLAS's) in ``run``."""
    rows = [r for r in records if r["run"] == run and r["op"] == "matmul" and r["status"] == "ok"]
    if not rows:
        raise SystemExit(f"no matmul rows of run {run} in {store.STORE}")
    times: dict[tuple, dict] = {}
    for r in rows:
        s = r["shape"]
        times.setdefault((s["M"], s["K"], s["N"]), {})[r["variant"]] = r
    return {
        shape: (v["template"]["config"].get("tiles", "?"), v["template"]["ms"] / v["cublas"]["ms"])
        for shape, v in times.items()
        if "template" in v and "cublas" in v
    }


def picked_tiles(m: int, k: int, n: int, sms: int) -> str:
    """The tiles the CUDA template's config takes at this shape on ``sms`` SMs, named as
    bench.gemm_cores names them."""
    from bench.gemm_cores import config_name
    from overlap_kernels import tuning
    from overlap_kernels.ops.ag_gemm import AgGemmConfig
    from overlap_kernels.ops.matmul import tiles_by_wave_fill

    before = tuning.INTERPRETER
    tuning.INTERPRETER = False  # (the [cuda] section, as on a GPU)
    tuning._template_values.cache_clear()
    try:
        key = tuning.shape_key(1, m, k, n, torch.bfloat16)
        cfg = tiles_by_wave_fill(tuning.build_config(AgGemmConfig, "ag_gemm", key, None), m, n, sms)
    finally:
        tuning.INTERPRETER = before
        tuning._template_values.cache_clear()
    return config_name(vars(cfg))


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wide", required=True, help="a run with the template's own tiles")
    parser.add_argument("--narrow", required=True, help="a run with its wave_fill_tiles")
    parser.add_argument("--new", help="a run made with the wave-fill choice")
    parser.add_argument("--sms", type=int, default=132, help="SMs of the GPU (H200: 132)")
    args = parser.parse_args()
    records = store.load(store.STORE)
    wide, narrow = ratios(records, args.wide), ratios(records, args.narrow)
    new = ratios(records, args.new) if args.new else {}
    shapes = sorted(set(wide) & set(narrow))
    picked, losses = [], []
    for shape in shapes:
        tiles = picked_tiles(*shape, args.sms)
        ratio = narrow[shape][1] if tiles == narrow[shape][0] else wide[shape][1]
        picked.append(ratio)
        if ratio > SLOWER * wide[shape][1]:
            losses.append((ratio / wide[shape][1], shape))
        seen = f" | new {new[shape][0]} x{new[shape][1]:.3f}" if shape in new else ""
        print(f"{'x'.join(map(str, shape))}: takes {tiles} | wide x{wide[shape][1]:.3f} "
              f"narrow x{narrow[shape][1]:.3f}{seen}")  # fmt: skip
    print(f"{len(shapes)} shapes, geomean x cuBLAS: wide {geomean([wide[s][1] for s in shapes]):.3f}, "
          f"narrow {geomean([narrow[s][1] for s in shapes]):.3f}, picked {geomean(picked):.3f}; "
          f"{len(losses)} picks more than 3% slower than wide"
          + (f", the worst {max(losses)[0]:.3f}x at {'x'.join(map(str, max(losses)[1]))}" if losses else ""))  # fmt: skip
    if new:
        mismatched = [s for s in shapes if s in new and new[s][0] != picked_tiles(*s, args.sms)]
        print(f"new run: geomean x{geomean([new[s][1] for s in shapes if s in new]):.3f}; "
              f"{len(mismatched)} shapes ran other tiles than the pick {mismatched[:5]}")  # fmt: skip


if __name__ == "__main__":
    main()
