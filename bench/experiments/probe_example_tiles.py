"""Probe: the worked examples' tiles at one rank, each against its split pair.

    python -m bench.experiments.probe_example_tiles [--shapes MxKxN ...] [--reps N]

One GPU, a group of one rank (nothing moves: the examples' local work). For each
example of examples/ and each tile (block_m, block_n, block_k, warps, stages;
block_m and block_n through the op's config, the rest through the launch), the
example's time over its split pair's as ``python -m bench --op examples`` forms
it (our op, here torch's product on one rank, then the compiled elementwise
kernel), do_bench medians with L2 flushed; each result is checked against the
split one. A diagnostic: a tile that wins everywhere goes into the example.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile

import torch
import torch.distributed as dist

TILES = ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 256, 64, 4, 4),
         (128, 128, 128, 8, 2), (256, 128, 64, 8, 3), (64, 128, 64, 4, 4))  # fmt: skip
SHAPES = ((4096, 4096, 3584), (512, 4096, 3584), (4096, 8192, 3584))


@contextlib.contextmanager
def launched_with(overrides: dict):
    """Every FusedOp launch made inside takes ``overrides`` (BLOCK_K, num_warps, num_stages)."""
    from overlap_kernels.ops.custom_details.run import Run

    launch = Run.launch

    def patched(self, kernel, *args, **kwargs):
        return launch(self, kernel, *args, **{**kwargs, **overrides})

    Run.launch = patched
    try:
        yield
    finally:
        Run.launch = launch


def _cases(m: int, k: int, n: int, compiled: dict) -> dict:
    """Per example: (its fused call of a config, the split pair) on fresh bf16 operands."""
    import examples.ag_rmsnorm_gemm as norm_example
    import examples.ag_swiglu as swiglu_example
    import examples.gemm_rs_bias as bias_example
    from bench.examples import EPS

    def randn(*dims, scale=1.0):
        return torch.randn(*dims, device="cuda", dtype=torch.bfloat16) * scale

    x, w_gate, w_up, w = randn(m, k), *(randn(k, n, scale=k**-0.5) for _ in range(3))
    w_gate_up = torch.cat([w_gate, w_up], dim=1).t().contiguous().t()
    gain, bias, residual = (torch.rand(k, device="cuda") + 0.5).bfloat16(), randn(n), randn(m, n)
    swiglu, rmsnorm, add = compiled["swiglu"], compiled["norm"], compiled["bias"]
    return {
        "swiglu": (lambda cfg: swiglu_example.ag_swiglu(x, w_gate, w_up, config=cfg),
                   lambda: swiglu(torch.mm(x, w_gate_up))),
        "norm": (lambda cfg: norm_example.ag_rmsnorm_gemm(x, gain, w, EPS, config=cfg),
                 lambda: torch.mm(rmsnorm(x, gain), w)),
        "bias": (lambda cfg: bias_example.gemm_rs_bias(x, w, bias, residual, config=cfg),
                 lambda: add(torch.mm(x, w), bias, residual)),
    }  # fmt: skip


def _time_tile(name: str, shape: str, fused, split_ms: float, want, tile: tuple, reps: int) -> str:
    import triton.testing

    bm, bn, bk, warps, stages = tile
    cfg = {"block_m": bm, "block_n": bn}
    label = f"{bm}x{bn}x{bk} w{warps} s{stages}"
    with launched_with({"BLOCK_K": bk, "num_warps": warps, "num_stages": stages}):
        try:
            got = fused(cfg).float()
            ms = triton.testing.do_bench(lambda: fused(cfg), rep=reps, return_mode="median")
        except Exception as e:  # (a tile that does not fit: its error, then the next)
            return f"{name:<7} {shape:<16} {label:<20} ERR {type(e).__name__}: {str(e)[:80]}"
    err = ((got - want).norm() / want.norm()).item()
    return f"{name:<7} {shape:<16} {label:<20} {ms:9.4f} {split_ms:9.4f} {split_ms / ms:11.3f}  {err:.1e}"


def main() -> None:
    import triton.testing

    from bench.examples import _add_bias_residual, _rmsnorm, _swiglu

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="*", default=[f"{m}x{k}x{n}" for m, k, n in SHAPES])
    p.add_argument("--reps", type=int, default=50, help="do_bench's rep (ms) per timing")
    args = p.parse_args()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0,
                            world_size=1)  # fmt: skip
    compiled = {name: torch.compile(f, dynamic=False) for name, f in
                (("swiglu", _swiglu), ("norm", _rmsnorm), ("bias", _add_bias_residual))}  # fmt: skip
    print(f"{'example':<7} {'M x K x N':<16} {'tile':<20} {'fused ms':>9} {'split ms':>9} "
          f"{'split/fused':>11}  rel err")  # fmt: skip
    for shape in args.shapes:
        m, k, n = (int(v) for v in shape.split("x"))
        for name, (fused, split) in _cases(m, k, n, compiled).items():
            want = split().float()
            split_ms = triton.testing.do_bench(split, rep=args.reps, return_mode="median")
            for tile in TILES:
                print(_time_tile(name, shape, fused, split_ms, want, tile, args.reps), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
