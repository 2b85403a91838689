"""Does the order of a sweep's interleaved calls bias their times?

``bench.tune_gemm`` times the vendor's kernel, then the template's config, then each swept
config, round after round. In sweeps where several names ran one and the same config (the
grouped core's group_m was not applied: bench/logs/tune_gemm_grouped_*_20261126T2053.log to
``..._2103.log``), the one timed right after the vendor's was up to 15% slower than its twins.
This probe times the vendor's kernel and four copies of the template's launch, twice: in
one fixed order, round after round, and with the copies following the vendor's in turn
(``bench.gemm_cores.interleaved_medians``, ``vary_order``). If the copy after the vendor is
the slow one in the fixed order and none stands out in the varied order, the order is the
cause.

``python -m bench.experiments.probe_timing_order [--rounds R] [--json PATH]`` (one GPU).
"""

from __future__ import annotations

import statistics

import torch

from bench import gemm_cores
from bench.experiments import gemm_probe_parser, write_json

CASES = (("matmul", (8192, 8192, 7168)), ("matmul", (2048, 8192, 7168)),
         ("grouped_gemm", (64, 512, 7168, 4096)), ("grouped_gemm", (64, 512, 2048, 7168)))  # fmt: skip
COPIES = 4


def main() -> None:
    parser = gemm_probe_parser(__doc__)
    parser.set_defaults(rounds=5)
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    found = []
    for core_name, shape in CASES:
        core = gemm_cores.CORES[core_name]
        problem = core.problem(shape, device)
        knobs = gemm_cores.template_knobs(core_name, problem.shape, device)
        calls = {core.vendor: problem.vendor}
        calls |= {f"template #{i + 1}": core.ours(problem, knobs) for i in range(COPIES)}
        label = "x".join(map(str, shape))
        record = {"core": core_name, "shape": label}
        for vary in (False, True):
            times, errors = gemm_cores.interleaved_medians(calls, args.rounds, vary_order=vary)
            assert not errors, errors
            vendor = statistics.median(times[core.vendor])
            cells = [f"{name} x{statistics.median(t) / vendor:.3f} (rounds "
                     + ", ".join(f"{ms / vendor:.3f}" for ms in t) + ")"
                     for name, t in times.items() if name != core.vendor]  # fmt: skip
            order = "varied" if vary else "fixed"
            print(f"{core_name} {label}, {order} order, x {core.vendor} ({vendor:.3f} ms):")
            print("  " + "\n  ".join(cells), flush=True)
            record[order] = times
        found.append(record)
    write_json(args.json, found)


if __name__ == "__main__":
    main()
