"""Sweep the local GEMM core's tiles against cuBLAS on one GPU: what the template should say.

``python -m bench.tune_gemm [--decode] [--rounds R] [MxKxN ...]`` prints, per shape, cuBLAS
and each config's median ms (``triton.testing.do_bench``, which flushes L2; with R
interleaved rounds, the median of the rounds' medians and their range) and appends
the run to the results store (bench/store.py; op ``matmul``, a variant per config
and ``cublas``). Weight in nn.Linear layout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch

from bench import harness, store

# ag_gemm's four target shapes, then two with a short K (the K loop is short
# beside each tile's epilogue): 4096x2048x8192 is gemm_rs's and gemm_ar's.
SHAPES = [
    (8192, 8192, 7168), (16384, 8192, 7168), (4096, 8192, 2560), (2048, 8192, 7168),
    (2048, 2048, 7168), (4096, 2048, 8192),
]  # fmt: skip
# (block_m, block_n, block_k, num_warps, num_stages, group_m[, epilogue])
CONFIGS = [
    (128, 256, 64, 8, 3, 8),
    (128, 256, 64, 8, 3, 8, "tma"),
    (128, 256, 64, 8, 4, 8),
    (128, 128, 64, 8, 4, 8),
    (128, 128, 64, 4, 4, 8),
    (128, 128, 64, 4, 4, 8, "tma"),
    (128, 128, 128, 8, 3, 8),
    (64, 256, 64, 4, 4, 8),
    (64, 256, 64, 4, 4, 8, "tma"),
    (256, 128, 64, 8, 3, 8),
]
# Decode (gemm_ar at M <= 256, ag_gemm at gathered M <= 512): the weight read is the cost, so what matters is
# how many SMs stream it at once (N / block_n tiles per M-block) and how many
# bytes each keeps in flight (block_k x stages).
DECODE_SHAPES = [(16, 7168, 8192), (64, 7168, 8192), (256, 7168, 8192)]
DECODE_CONFIGS = [
    (64, 64, 128, 4, 4, 1),
    (64, 64, 128, 4, 6, 1),
    (64, 32, 128, 4, 6, 1),
    (64, 128, 64, 4, 4, 1),
    (16, 64, 128, 4, 6, 1),
    (32, 64, 128, 4, 6, 1),
    (32, 128, 128, 4, 4, 1),
    (64, 128, 128, 4, 4, 1),
    (128, 64, 64, 4, 4, 1),
    (128, 128, 64, 8, 4, 1),
]


def _config_name(bm, bn, bk, warps, stages, *epilogue) -> str:
    return f"{bm}x{bn}x{bk}w{warps}s{stages}" + (f"+{epilogue[0]}" if epilogue else "")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tune_gemm", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--decode", action="store_true", help="decode shapes and tiles")
    parser.add_argument(
        "--rounds", type=int, default=1, help="interleaved rounds (>= 1); the median is reported"
    )
    parser.add_argument("shapes", nargs="*", metavar="MxKxN")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    rounds = args.rounds
    import triton

    import overlap_kernels as ok

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] or (
        DECODE_SHAPES if args.decode else SHAPES
    )
    configs = DECODE_CONFIGS if args.decode else CONFIGS
    results = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ weight.float().t()
        runs = {"cublas": lambda a=a, weight=weight: a @ weight.t()}
        row = {"shape": [m, k, n]}
        for bm, bn, bk, warps, stages, gm, *epilogue in configs:
            cfg = {"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages, "group_m": gm,
                       "epilogue": epilogue[0] if epilogue else "pointer"}  # fmt: skip
            name = _config_name(bm, bn, bk, warps, stages, *epilogue)
            try:
                out = ok.matmul(a, weight.t(), cfg)
                row[name] = {"err": ((out.float() - ref).norm() / ref.norm()).item()}
                runs[name] = lambda a=a, weight=weight, cfg=cfg: ok.matmul(a, weight.t(), cfg)
            # A config that does not fit (shared memory) is reported, not fatal.
            except Exception as e:
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        # Interleaved rounds: every config once per round, so that a clock or
        # neighbour change between configs shows as spread, not as a difference.
        timed = {name: [] for name in runs}
        for _ in range(rounds):
            for name, run in list(runs.items()):
                try:
                    timed[name].append(triton.testing.do_bench(run, return_mode="median"))
                except Exception as e:  # reported in its row; the sweep goes on
                    row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                    del runs[name], timed[name]
        row["cublas_ms"] = statistics.median(timed.pop("cublas"))
        for name, ms_rounds in timed.items():
            row[name].update(ms_rounds=ms_rounds, ms=statistics.median(ms_rounds))
        results.append(row)
        flops = 2 * m * n * k
        cells = [f"cublas {row['cublas_ms']:.3f} ({flops / row['cublas_ms'] / 1e9:.0f} TF)"]
        for key, v in row.items():
            if isinstance(v, dict) and "ms" in v:
                spread = (
                    f", {min(v['ms_rounds']):.3f}-{max(v['ms_rounds']):.3f}" if rounds > 1 else ""
                )
                cells.append(
                    f"{key} {v['ms']:.3f} ({100 * row['cublas_ms'] / v['ms']:.0f}%{spread}, err {v['err']:.1e})"
                )
            elif isinstance(v, dict):
                cells.append(f"{key} FAILED {v['error'][:80]}")
        print(f"{m}x{k}x{n}: " + " | ".join(cells), flush=True)
    doc = harness.build_results(
        rows_of(results),
        gpu=torch.cuda.get_device_name(),
        world=1,
        versions=harness.collect_versions(),
        env=harness.collect_env(),
        settings={
            "rounds": rounds,
            "decode": args.decode,
            "dtype": "bfloat16",
            "timer": "do_bench median",
        },
        date=harness.utc_now(),
    )
    print(f"results: {store.run_id(doc)} in {store.write_run(doc)}", flush=True)


def rows_of(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Schema-1 rows (bench/harness.py) of a sweep's per-shape results: ``cublas``
    and one variant per config (its name, e.g. ``128x256x64w8s3+tma``)."""
    rows = []
    for row in results:
        m, k, n = row["shape"]
        shape = {"M": m, "K": k, "N": n}
        timed = {"cublas": {"ms": row["cublas_ms"]}} if "cublas_ms" in row else {}
        timed.update({name: v for name, v in row.items() if isinstance(v, dict)})
        for name, v in timed.items():
            ms = v.get("ms")
            rows.append({
                "op": "matmul", "shape": shape, "variant": name, "status": "ok" if ms is not None else "error",
                "ms": ms, "tflops": harness.tflops(2.0 * m * k * n, ms), "pct_of_bound": None,
                "rel_err": v.get("err"), "config": {"tiles": name} if name != "cublas" else {},
                "note": v.get("error", "") or (f"medians of the rounds: {v['ms_rounds']}" if "ms_rounds" in v else ""),
            })  # fmt: skip
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
