"""The library's GEMM cores, each launched alone on one GPU as its fused op launches it,
beside the vendor kernel it must match: what ``python -m bench.tune_gemm`` sweeps.

``matmul``        ``overlap_kernels.matmul``: the persistent GEMM, no waits.
``chunked_gemm``  ag_gemm's consumer: the same kernel over the gathered rows in a ring's
                  arrival order (this rank's rows first), each tile waiting once on its
                  chunk's flag, every flag set before the launch: the waits' cost is in.
                  Not at decode sizes, where ag_gemm pushes the rows and its GEMM runs
                  one M-block over all of them (the matmul core's layout).
``reduce_gemm``   gemm_rs's producer (gemm_ar's one-shot where gemm_ar takes it, M <=
                  its one_shot_max_m) on a group of one rank: its tile table, epilogue
                  and flag protocol, with no peer to push to.
``grouped_gemm``  the MoE ops' grouped GEMM, rows grouped by expert, against
                  ``torch._grouped_mm``.

A core's ``problem(shape, device)`` makes the operands, the vendor call and the fp32
reference; ``ours(problem, knobs)`` returns the call of our kernel with those knobs (a
config's fields). Every call writes the same ``problem.out``, so configs compare alike.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# ag_gemm's and gemm_rs's world on the hosts they are tuned for: the chunked core's
# arrival order has this many chunks, and every core's template is read for it.
WORLD = 4


@dataclass
class Problem:
    shape: dict[str, int]
    a: torch.Tensor
    b: torch.Tensor  # [K, N] (a weight's transpose), or [E, K, N] for the grouped GEMM
    out: torch.Tensor
    vendor: Callable[[], torch.Tensor]
    reference: torch.Tensor  # fp32
    keep: dict[str, Any] = dataclasses.field(default_factory=dict)  # what launches point into

    @property
    def flops(self) -> float:
        s = self.shape
        return 2.0 * s["M"] * s["K"] * s["N"] * s.get("E", 1)


def interleaved_medians(
    calls: dict[str, Callable[[], object]], rounds: int, *, vary_order: bool = True
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Every call's ``triton.testing.do_bench`` median (ms, L2 flushed before each call)
    in ``rounds`` interleaved rounds, so that a slow phase of the GPU falls on every call
    alike: ({name: [ms per round]}, {name: error}) for a call that raised (dropped).
    With ``vary_order`` the first call (the vendor's) opens every round and the others
    follow it in turn, round r starting from the r-th: a kernel timed right after the
    vendor's ran 1-7% slower than its twins timed later
    (`python -m bench.experiments.probe_timing_order`, docs/performance.md), so no call
    may take that place every round. (With one call beside the vendor's, it does.)"""
    import triton

    times: dict[str, list[float]] = {name: [] for name in calls}
    errors: dict[str, str] = {}
    first, *others = list(calls)
    for r in range(rounds):
        start = r % len(others) if vary_order and others else 0
        for name in [first, *others[start:], *others[:start]]:
            call = calls[name]
            if name in errors:
                continue
            try:
                times[name].append(
                    triton.testing.do_bench(call, warmup=10, rep=40, return_mode="median")
                )
            except Exception as e:  # noqa: BLE001 (reported by the caller; the others go on)
                errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
                del times[name]
    return times, errors


def replayed_medians(
    calls: dict[str, Sequence[Callable[[], object]]], rounds: int, replays: int = 30
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """As :func:`interleaved_medians`, timed as a server runs decode: each name's calls (one
    per operand copy: :func:`copies_past_l2`) captured in one CUDA graph after an eager
    pass, and one call's time the median replay's over the calls. No host time is in it,
    and no call finds its weight in L2, as in a graph of a model's layers."""
    times: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    graphs = {}
    for name, seq in calls.items():
        try:
            for call in seq:  # (loads kernels; prepares our replays)
                call()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for call in seq:
                    call()
            graphs[name] = (graph, len(seq))
            times[name] = []
        except Exception as e:  # noqa: BLE001 (reported by the caller; the others go on)
            errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
    first, *others = list(graphs) or [None]
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(replays)]  # fmt: skip
    for r in range(rounds if first else 0):
        start = r % len(others) if others else 0
        for name in [first, *others[start:], *others[:start]]:
            graph, count = graphs[name]
            graph.replay()  # (warm: the replay after another graph's)
            for begin, end in events:
                begin.record()
                graph.replay()
                end.record()
            torch.cuda.synchronize()
            ms = statistics.median(begin.elapsed_time(end) for begin, end in events)
            times[name].append(ms / count)
    return times, errors


def copies_past_l2(problem: Problem, device, *, at_most: int = 32) -> int:
    """Operand copies whose weights together are at least twice the device's L2, so that
    a graph's calls, each on the next copy, each read their weight from memory."""
    weight = problem.b.numel() * problem.b.element_size()
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(2, min(at_most, -(-2 * l2 // weight)))


# B's layout: the forward's, a layer's weight [N, K] transposed (``x @ weight.t()``), or the
# backward's dgrad, a weight [K, N] as it is stored (``dy @ weight``: integrations/autograd.py
# passes the ops ``w.t()`` of the [K, N] view they were given).
FORWARD, DGRAD = "forward", "dgrad"


def _dense(shape: tuple[int, int, int], device, layout: str = FORWARD) -> Problem:
    m, k, n = shape
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    if layout == FORWARD:
        b = torch.randn(n, k, device=device, dtype=torch.bfloat16).t()
    else:
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    return Problem(
        {"M": m, "K": k, "N": n}, a, b, torch.empty(m, n, device=device, dtype=torch.bfloat16),
        lambda: a @ b, a.float() @ b.float(),
    )  # fmt: skip


def _tile_config(op: str, knobs: dict, m: int, k: int, n: int, device):
    """The op's config for a call of this shape on WORLD ranks, with ``knobs`` over its
    template's (matmul's: ops.matmul.matmul_config, ag_gemm's template at world 1)."""
    from overlap_kernels.ops.ag_gemm import AgGemmConfig
    from overlap_kernels.ops.gemm_ar import GemmArConfig
    from overlap_kernels.ops.gemm_rs import GemmRsConfig
    from overlap_kernels.tuning import build_config, shape_key

    cls = {"ag_gemm": AgGemmConfig, "gemm_rs": GemmRsConfig, "gemm_ar": GemmArConfig}[op]
    return build_config(cls, op, shape_key(WORLD, m, k, n, torch.bfloat16), knobs, device=device)


def template_knobs(core: str, shape: dict[str, int], device) -> dict[str, Any]:
    """The tile knobs the op's template (and tuned table) give this shape."""
    from overlap_kernels.ops.checks import GemmKnobs

    if core == "grouped_gemm":
        from overlap_kernels.ops.moe import _config

        # The MoE template matches on the hidden size and the expert count: K stands
        # for the hidden size here (gate/up's; a down projection's is its N).
        cfg = _config(None, shape["K"], shape["E"] * WORLD, WORLD, torch.bfloat16)
        names = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m", "tma",
                 "epilogue")  # fmt: skip
        return {name: getattr(cfg, name) for name in names}
    if core == "matmul":  # (its tiles chosen for the shape, as overlap_kernels.matmul's plan does)
        from overlap_kernels.ops.matmul import matmul_config

        cfg = matmul_config(shape["M"], shape["K"], shape["N"], torch.bfloat16, device)
    else:
        op = _op_of(core, shape, device)
        cfg = _tile_config(op, {}, shape["M"], shape["K"], shape["N"], device)
    # (wave_fill_tiles left out: the tiles chosen are what runs, and what a swept config names)
    names = [f.name for f in dataclasses.fields(GemmKnobs) if f.name != "wave_fill_tiles"]
    return {name: getattr(cfg, name) for name in names} | {"epilogue": cfg.epilogue}


def _op_of(core: str, shape: dict[str, int], device) -> str:
    """The op whose template a core reads: the reduce core runs gemm_ar's one-shot
    plan where gemm_ar takes it (M <= its one_shot_max_m), else gemm_rs's two-shot."""
    if core != "reduce_gemm":
        return "ag_gemm"
    m, k, n = shape["M"], shape["K"], shape["N"]
    return (
        "gemm_ar" if m <= _tile_config("gemm_ar", {}, m, k, n, device).one_shot_max_m else "gemm_rs"
    )


# ---- matmul -----------------------------------------------------------------


def _matmul(p: Problem, knobs: dict) -> Callable[[], object]:
    import overlap_kernels as ok

    return lambda: ok.matmul(p.a, p.b, knobs, out=p.out)


# ---- chunked_gemm -----------------------------------------------------------


def _chunked(p: Problem, knobs: dict) -> Callable[[], object]:
    from overlap_kernels.kernels.gemm import chunk_mblocks, launch_chunked_gemm, mblock_table
    from overlap_kernels.ops.checks import check_tiles_fit
    from overlap_kernels.runtime.platform import FAST_SIGNALS, num_sms
    from overlap_kernels.runtime.signals import wait_budget

    m, k, n = p.shape["M"], p.shape["K"], p.shape["N"]
    device = p.a.device
    cfg = _tile_config("ag_gemm", knobs, m, k, n, device)
    check_tiles_fit("chunked_gemm", cfg, p.a.dtype, device, store_buffer=cfg.epilogue == "tma")
    rows = -(-m // WORLD)
    # Rank 0's ring: its own rows (no flag: ag_gemm's own chunk has none), then each
    # peer's as the ring brings them, each behind its flag.
    order = [0, *range(WORLD - 1, 0, -1)]
    spans = [(src * rows, min(m, (src + 1) * rows), src if src else -1, src) for src in order]
    epoch = 1
    flags = torch.full((WORLD,), epoch, dtype=torch.int32, device=device)  # every chunk arrived
    errors = torch.zeros(16, dtype=torch.int32, device=device)  # written only on a timeout
    table = mblock_table(spans, cfg.block_m, device)
    p.keep.update(flags=flags, errors=errors, table=table)
    programs = num_sms(device) - cfg.comm_sms
    kw = {"chunk_flags": flags, "epoch": epoch, "err_addr": errors.data_ptr(),
          "wait_budget": wait_budget(cfg.timeout_s), "fast_signals": FAST_SIGNALS,
          "group_span": chunk_mblocks(spans, cfg.block_m) if cfg.group_by_chunk else None}  # fmt: skip
    state = {"again": None}

    def call() -> None:
        again = state["again"]
        if again is None or not again(p.a, p.b, p.out):
            state["again"] = launch_chunked_gemm(p.a, p.b, p.out, table, cfg, programs, **kw)

    return call


# ---- reduce_gemm ------------------------------------------------------------


def _reduce(p: Problem, knobs: dict) -> Callable[[], object]:
    import torch.distributed as dist

    from overlap_kernels.ops.checks import check_tiles_fit
    from overlap_kernels.ops.paths import capturing
    from overlap_kernels.ops.reduce_details.plan import build_one_shot, build_two_shot
    from overlap_kernels.ops.reduce_details.run import FusedReduce
    from overlap_kernels.schedules.producers import rounds_by_config

    m, k, n = p.shape["M"], p.shape["K"], p.shape["N"]
    device = p.a.device
    op = _op_of("reduce_gemm", p.shape, device)
    cfg = _tile_config(op, knobs, m, k, n, device)
    check_tiles_fit("reduce_gemm", cfg, p.a.dtype, device)
    group = dist.group.WORLD
    require_one_rank(group)
    one_shot = op == "gemm_ar"
    if one_shot:
        schedule = None

        def build(ws, half):
            return build_one_shot(ws, m, n, p.a.dtype, cfg, half)
    else:
        schedule = rounds_by_config(1, cfg.pieces, cfg.mechanism, cfg.lag)

        def build(ws, half):
            return build_two_shot(ws, schedule, m, n, p.a.dtype, cfg, half, publish=False)

    fused = FusedReduce(op, p.a, p.b, group, cfg, schedule, build, one_shot=one_shot)
    prepared = []

    def call() -> None:
        """An eager call, or (replayed_medians) its capture: the op's replay, which the
        first eager call prepared as the op's plan does (ops/replay.py)."""
        if capturing(device):
            if not fused.replay(p.a, p.b, p.out, 0, cfg):
                raise RuntimeError("reduce core: no eager call prepared its replay")
            return
        fused(p.a, p.b, p.out, cfg, 0)
        if not prepared and device.type == "cuda":
            fused.prepare_replay(p.a, p.b, p.out, cfg)
            prepared.append(True)

    return call


def require_one_rank(group) -> None:
    import torch.distributed as dist

    if dist.get_world_size(group) != 1:
        raise ValueError("the reduce core runs on a group of one rank (bench.tune_gemm makes it)")


# ---- grouped_gemm -----------------------------------------------------------


def _grouped_problem(shape: tuple[int, int, int, int], device, layout: str = FORWARD) -> Problem:
    if layout != FORWARD:
        raise ValueError(f"the grouped core's experts are [K, N] each: no {layout} layout")
    experts, rows, k, n = shape
    a = torch.randn(experts * rows, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(experts, k, n, device=device, dtype=torch.bfloat16) / 30
    ends = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows
    reference = torch.cat(
        [a[e * rows : (e + 1) * rows].float() @ b[e].float() for e in range(experts)]
    )
    vendor = (lambda: torch._grouped_mm(a, b, offs=ends)) if hasattr(torch, "_grouped_mm") else None
    return Problem(
        {"E": experts, "M": rows, "K": k, "N": n}, a, b,
        torch.empty(experts * rows, n, device=device, dtype=torch.bfloat16), vendor, reference,
    )  # fmt: skip


def _grouped(p: Problem, knobs: dict) -> Callable[[], object]:
    from overlap_kernels.kernels.grouped_gemm import launch_grouped_gemm
    from overlap_kernels.ops.moe import MoeConfig
    from overlap_kernels.ops.moe_details.layout import grouped_tiles
    from overlap_kernels.runtime.platform import num_sms

    cfg = dataclasses.replace(MoeConfig(), **knobs).validate()
    counts = [p.shape["M"]] * p.shape["E"]
    table = grouped_tiles(counts, cfg.block_m, cfg.block_n, p.shape["N"], group_m=cfg.group_m)
    table = torch.from_numpy(table)
    table = table.to(p.a.device)
    p.keep["table"] = table
    programs = num_sms(p.a.device)
    return lambda: launch_grouped_gemm(p.a, p.b, table, cfg, programs, out=p.out)


# ---- the cores --------------------------------------------------------------


@dataclass(frozen=True)
class Core:
    name: str  # the results store's op
    vendor: str  # the vendor kernel's variant name
    problem: Callable[..., Problem]  # (shape, device, layout=FORWARD)
    ours: Callable[[Problem, dict], Callable[[], object]]
    shapes: tuple  # tuned-on shapes
    held_out: tuple  # shapes no choice is made on: reported, met or not
    decode_shapes: tuple
    configs: tuple  # knobs tuples: see knobs_of
    decode_configs: tuple


# ag_gemm's four target shapes, gemm_rs's and gemm_ar's short-K 4096x2048x8192, and a
# Llama-3-70B down projection on 4 ranks.
DENSE = ((8192, 8192, 7168), (16384, 8192, 7168), (4096, 8192, 2560), (2048, 8192, 7168),
         (4096, 2048, 8192), (8192, 7168, 8192))  # fmt: skip
# Never tuned on (their template config alone is run): Llama-3-8B's MLP on 4 ranks, Llama-3-70B's
# down projection on 8, Qwen2-72B's on 4, GPT-3-175B's on 8; M from 1024 to 16384, odd M.
DENSE_HELD_OUT = ((1024, 4096, 7168), (1024, 3584, 4096), (16384, 3584, 8192), (3000, 8192, 14784),
                  (16384, 7392, 8192), (12288, 12288, 6144), (5000, 6144, 12288), (1537, 4096, 3584))  # fmt: skip
DENSE_DECODE = ((1, 7168, 8192), (16, 7168, 8192), (64, 7168, 8192), (128, 8192, 7168),
                (256, 7168, 8192), (256, 2048, 8192))  # fmt: skip
# (block_m, block_n, block_k, num_warps, num_stages, group_m[, marks]): marks "tma" (the TMA
# epilogue) and "pointer_loads" (config loads="pointer")
DENSE_CONFIGS = (
    (128, 256, 64, 8, 3, 8), (128, 256, 64, 8, 3, 8, "tma"), (128, 256, 64, 8, 4, 8),
    (128, 128, 64, 8, 4, 8), (128, 128, 64, 4, 4, 8), (128, 128, 64, 4, 4, 8, "tma"),
    (128, 128, 128, 8, 3, 8), (64, 256, 64, 4, 4, 8), (256, 128, 64, 8, 3, 8),
    (128, 256, 64, 8, 3, 4), (128, 256, 64, 8, 3, 16), (256, 128, 64, 8, 4, 8),
    (128, 256, 64, 8, 3, 4, "tma"), (256, 128, 64, 8, 3, 8, "tma"),
    # Short waves and odd M (777 rows: 6 whole 128-row blocks and 9 rows): smaller tiles fill
    # more of the SMs; whole tiles leave a short wave unsplit.
    (64, 128, 64, 4, 4, 8), (128, 64, 64, 4, 4, 8), (128, 128, 64, 8, 4, 8, "whole_tiles"),
)  # fmt: skip
# Decode: the weight read is the cost: how many SMs stream it at once (N / block_n tiles
# per M-block, and K pieces where a short wave's tiles are split: kernels/gemm.py) and how
# many bytes each keeps in flight (block_k x stages).
DENSE_DECODE_CONFIGS = (
    (64, 64, 128, 4, 4, 1), (64, 64, 128, 4, 6, 1), (64, 32, 128, 4, 6, 1), (16, 64, 128, 4, 6, 1),
    (32, 64, 128, 4, 6, 1), (32, 32, 128, 4, 6, 1), (16, 32, 256, 4, 4, 1), (32, 128, 128, 4, 4, 1),
    (64, 128, 128, 4, 4, 1), (128, 64, 64, 4, 4, 1), (128, 128, 64, 8, 4, 1), (128, 128, 128, 8, 3, 1),
    (16, 128, 128, 4, 4, 1), (32, 256, 64, 4, 4, 1), (128, 256, 64, 8, 3, 8),
    # One M-block over 129-256 rows, so every weight column is read by one tile (the split
    # tail's K pieces fill the SMs), and 128x64 tiles: twice the 128x128 tiles' programs.
    (256, 128, 64, 8, 3, 1), (256, 128, 64, 8, 4, 1), (256, 64, 64, 8, 4, 1), (256, 128, 128, 8, 2, 1),
    (128, 64, 128, 4, 4, 1), (128, 64, 128, 8, 4, 1),
    # Operands read by masked loads (config loads="pointer"), pipelined as asynchronous copies
    # (unpipelined, at one stage, they ran far behind: docs/performance.md, the GEMM cores).
    (16, 64, 128, 4, 4, 1, "pointer_loads"), (16, 64, 128, 4, 6, 1, "pointer_loads"),
    (16, 64, 256, 4, 3, 1, "pointer_loads"), (32, 64, 128, 4, 4, 1, "pointer_loads"),
    (64, 64, 128, 4, 4, 1, "pointer_loads"), (64, 64, 128, 4, 6, 1, "pointer_loads"),
    # 32-column tiles: a 128- or 256-row block's weight read spread over twice the programs.
    (128, 32, 128, 4, 4, 1), (128, 32, 128, 4, 4, 1, "pointer_loads"), (256, 32, 128, 8, 3, 1),
    (64, 32, 128, 4, 4, 1, "pointer_loads"), (128, 64, 64, 4, 6, 1),
    # Whole tiles in a short wave (no K pieces: no partial sums to add; matmul and chunked only).
    (128, 64, 128, 4, 4, 1, "whole_tiles"), (64, 64, 128, 4, 6, 1, "pointer_loads", "whole_tiles"),
)  # fmt: skip
# (experts, rows per expert, K, N): DeepSeek-V3-like gate/up and down (64 local experts),
# Qwen3-30B-like (32 local experts); held out: Mixtral-like (8 experts), 1000 rows an expert.
GROUPED = (
    (64, 512, 7168, 4096),
    (64, 512, 2048, 7168),
    (32, 256, 2048, 1536),
    (32, 256, 768, 2048),
    # Gate/up with few experts a rank and many rows each (large-batch prefill), and with a
    # wide N (Mixtral-8x22B-like: 128 column blocks, a wave's worth, in each row block's sweep):
    # the cases for the tile order (group_m).
    (16, 4096, 7168, 4096),
    (8, 2048, 6144, 32768),
)
GROUPED_HELD_OUT = ((8, 2048, 4096, 28672), (8, 2048, 14336, 4096), (16, 1000, 5120, 3072))
GROUPED_DECODE = ((64, 8, 7168, 4096), (64, 8, 2048, 7168), (32, 16, 2048, 1536))
# As the dense cores' tuples; "pointer_loads" is config tma=False (B, and A, by masked loads).
# group_m > 1: an expert's B column blocks are read once per group of row blocks while in
# L2, not once per row block (docs/performance.md, the grouped GEMM's tile order).
GROUPED_CONFIGS = (
    (128, 128, 64, 8, 3, 1), (128, 128, 64, 8, 3, 1, "pointer_loads"), (128, 256, 64, 8, 3, 1),
    (128, 128, 64, 4, 4, 1), (64, 128, 64, 4, 4, 1), (128, 256, 64, 8, 4, 1),
    (256, 128, 64, 8, 3, 1), (128, 128, 128, 8, 3, 1),
    (128, 256, 64, 8, 3, 1, "tma"), (128, 256, 64, 8, 3, 8),
    (128, 256, 64, 8, 3, 4, "tma"), (128, 256, 64, 8, 3, 8, "tma"), (128, 256, 64, 8, 3, 16, "tma"),
    (256, 128, 64, 8, 3, 1, "tma"), (256, 128, 64, 8, 3, 8, "tma"),
)  # fmt: skip
GROUPED_DECODE_CONFIGS = (
    (64, 64, 128, 4, 4, 1), (64, 128, 64, 4, 4, 1), (16, 64, 128, 4, 4, 1),
    (64, 128, 128, 4, 3, 1), (128, 128, 64, 8, 3, 1),
)  # fmt: skip


def knobs_of(core: str, values: tuple) -> dict[str, Any]:
    """A config tuple of a core, (block_m, block_n, block_k, num_warps, num_stages, group_m,
    *marks), as the knobs its config takes: marks "tma" (the TMA epilogue),
    "pointer_loads" (operands by masked loads: a dense config's loads="pointer", the
    grouped config's tma=False) and "whole_tiles" (split_tail=False: the chunked GEMM's)."""
    bm, bn, bk, warps, stages, gm, *marks = values
    pointer_loads = "pointer_loads" in marks
    extra = {"tma": not pointer_loads} if core == "grouped_gemm" else \
        {"loads": "pointer" if pointer_loads else "tma"}  # fmt: skip
    if "whole_tiles" in marks:
        extra["split_tail"] = False
    return {"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages,
            "group_m": gm, "epilogue": "tma" if "tma" in marks else "pointer", **extra}  # fmt: skip


def config_name(knobs: dict[str, Any]) -> str:
    """e.g. ``128x256x64w8s3g8+tma`` (``+tma``: the TMA epilogue; ``+ptr``: operands by
    pointer loads; ``+whole``: no split tail)."""
    k = knobs
    name = f"{k['block_m']}x{k['block_n']}x{k['block_k']}w{k['num_warps']}s{k['num_stages']}"
    name += f"g{k['group_m']}" + ("+tma" if k.get("epilogue") == "tma" else "")
    name += "+ptr" if k.get("loads") == "pointer" or not k.get("tma", True) else ""
    return name + ("+whole" if k.get("split_tail") is False else "")


_DENSE = {"problem": _dense, "shapes": DENSE, "held_out": DENSE_HELD_OUT, "decode_shapes": DENSE_DECODE,
          "configs": DENSE_CONFIGS, "decode_configs": DENSE_DECODE_CONFIGS}  # fmt: skip
CORES = {
    "matmul": Core("matmul", "cublas", ours=_matmul, **_DENSE),
    "chunked_gemm": Core(
        "chunked_gemm", "cublas", ours=_chunked, **{**_DENSE, "decode_shapes": ()}
    ),
    "reduce_gemm": Core("reduce_gemm", "cublas", ours=_reduce, **_DENSE),
    "grouped_gemm": Core(
        "grouped_gemm",
        "torch._grouped_mm",
        _grouped_problem,
        _grouped,
        GROUPED,
        GROUPED_HELD_OUT,
        GROUPED_DECODE,
        GROUPED_CONFIGS,
        GROUPED_DECODE_CONFIGS,
    ),  # fmt: skip
}
