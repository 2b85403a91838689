"""Benchmark entry for the MoE ops: ``moe_dispatch``, ``moe_combine``, ``moe_mlp``.

Per shape (T tokens per rank, hidden H, E experts, top-k, expert intermediate F; bf16), in one
run and one process group. Each rank routes its own T tokens: fresh seeded
``torch.rand(T, E).topk(k)`` (k distinct experts), weights the softmax of the k scores (fp32).
Rank r owns experts [r E/world, (r+1) E/world) with w_gate_up [E/world, H, 2F] and
w_down [E/world, F, H] (``randn / sqrt(fan_in)``).

    nccl_dispatch       counts all_to_all_single, one host sync (.tolist()) to size the buffers,
                        token rows packed once per (token, destination rank) and sent by
                        all_to_all_single, per-pair metadata (local expert, weight, row) by a
                        second one, then the received rows expanded to one per pair in the
                        contract's order (what moe_dispatch returns)
    ours_dispatch       ok.moe_dispatch
    nccl_combine        per received token row, the weighted fp32 sum of its pairs (rounded to
                        bf16), all_to_all_single back, the fp32 sum at home
    ours_combine        ok.moe_combine(recv_x, handle), the handle made once before timing
    grouped_gemm        the expert MLP alone on dispatched rows: gate/up grouped GEMM,
                        silu(gate) * up, down grouped GEMM (compute alone)
    nccl_layer          nccl_dispatch -> grouped_gemm -> nccl_combine
    ours_unfused_layer  ok.moe_mlp, config {"path": "unfused"}
    ours_fused_layer    ok.moe_mlp, config {"path": "fused"}
    ours_auto_layer     ok.moe_mlp with its default config
    symm_mem_layer,     torch's symmetric-memory all-to-all (torchtitan's path) and DeepEP around
    deepep_layer        the same expert MLP, where they run here (bench/moe_baselines.py);
                        symm_mem_graph_layer and deepep_graph_layer: each captured in CUDA
                        graphs (decode sizes)
    nccl_dc, ours_graph_dc, ours_graph_layer   decode: dispatch + combine, and the layer, of our
                        graph mode replayed in CUDA graphs beside the NCCL path (bench/moe_graphs.py);
                        ours_graph_eager_layer: that layer called eagerly
    bound               max(grouped_gemm, nccl_dispatch + nccl_combine): perfect overlap
    traffic             not timed: its ``config`` holds the byte counts and each GB/s

Grouped GEMM: ``torch._grouped_mm`` where it exists and matches the fp32 reference for this
dtype and device (tried once per shape, on every rank), else ``torch.matmul`` per expert; and
in the eager layers (grouped_gemm, nccl_layer, deepep_layer) ``torch.matmul`` per expert also
where our unfused layer takes it (a rank of few experts: config cublas_max_local_experts), so
that those layers differ in their communication alone (the symmetric-memory layer and the
captured ones keep ``torch._grouped_mm``, which reads the counts on the device). The note and
config of ``grouped_gemm`` and ``nccl_layer`` say which ran.

Checks before timing (max over ranks): nccl_dispatch bit for bit against the contract's
definition (built from all-gathered inputs); nccl_combine(recv_x) against x * (sum of the
token's weights), the contract's round trip; grouped_gemm against an fp32 per-expert
reference; nccl_layer against that reference combined. Then ours: ours_dispatch's recv_x bit
for bit against nccl_dispatch's (its handle's counts, sources and weights against the
definition), ours_combine against nccl_combine, each ours_*_layer against nccl_layer.

GB/s (per rank, every dispatch and combine variant alike): bytes of token rows leaving a rank
for other ranks, one H-wide row per (token, destination rank != source rank), averaged over
ranks (dispatch and combine move the same total), divided by the max-over-ranks time.
gloo runs all_to_all_single on CPU tensors (bf16 included; checked with torch 2.13), so
``--cpu-ranks`` runs this same NCCL path, with no fallback.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.common import (
    DTYPE,
    Check,
    check_variants,
    cycled,
    generator,
    input_sets,
    load_ours,
    rel_frobenius,
    run_shapes,
    time_ms,
    unavailable,
)
from bench.harness import RunContext, Settings, Variant, make_row, shape_str
from bench.moe_baselines import BASELINES, baseline_variants
from bench.moe_graphs import graph_variants
from bench.report import Progress, grid, local_goal_line
from bench.report import format_table as _format_table

OP = "moe"
SHAPE_KEYS = ("T", "H", "E", "k", "F")  # tokens per rank, hidden, experts, top-k, intermediate
PRESETS = {  # (hidden, experts, top-k, expert intermediate) of the real models, bf16
    "deepseek_prefill": (4096, 7168, 256, 8, 2048),  # DeepSeek-V3
    "deepseek_decode": (128, 7168, 256, 8, 2048),
    "qwen3_235b_prefill": (4096, 4096, 128, 8, 1536),  # Qwen3-235B-A22B
    "qwen3_235b_decode": (128, 4096, 128, 8, 1536),
    "mixtral_prefill": (4096, 6144, 8, 2, 16384),  # Mixtral-8x22B
    "mixtral_decode": (128, 6144, 8, 2, 16384),
    "qwen3_prefill": (4096, 2048, 128, 8, 768),  # Qwen3-30B-A3B
}
# The models users run at scale, at 128 (decode) and 4096 (prefill) tokens per rank.
DEFAULT_SHAPES: list[tuple[int, ...]] = [v for n, v in PRESETS.items() if n != "qwen3_prefill"]
# Decode: at most this many tokens per rank (as gemm_ar's DECODE_MAX_M); above it, prefill.
DECODE_MAX_T = 256
# The done-when: the layer >= 1.3x nccl_layer and the strongest baseline (DeepEP or
# symmetric memory) on each prefill shape; dispatch and combine GB/s >= NCCL's (prefill);
# decode dispatch + combine faster than NCCL's, and the layer in CUDA graphs faster than
# the symmetric-memory one captured alike.
LAYER_GOAL = 1.3
# NCCL path metadata per pair: int32 local expert, fp32 weight (as int32 bits), int32 row.
META_BYTES_PER_PAIR = 12
LAYERS = ("nccl_layer", *BASELINES, "ours_unfused_layer", "ours_fused_layer", "ours_auto_layer",
          "ours_graph_eager_layer", "ours_graph_layer")  # fmt: skip
MOVES = ("nccl_dispatch", "ours_dispatch", "nccl_combine", "ours_combine")
GRAPHED = ("nccl_dc", "ours_graph_dc", "nccl_layer", "ours_graph_layer")  # the decode grid
__all__ = ["DEFAULT_SHAPES", "DTYPE", "OP", "PRESETS", "format_table", "parse_shape", "run"]


def parse_shape(text: str) -> tuple[int, ...]:
    """A preset name (PRESETS: ``deepseek_decode``, ``mixtral_prefill``, ...) or ``TxHxExKxF``
    -> (T, H, E, k, F)."""
    if text in PRESETS:
        return PRESETS[text]
    parts = text.lower().replace(",", "x").split("x")
    if len(parts) != 5 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(
            f"moe shape {text!r} is neither a preset ({', '.join(PRESETS)}) nor TxHxExKxF "
            "(tokens per rank x hidden x experts x top-k x expert intermediate)"
        )
    t, h, e, k, f = (int(p) for p in parts)
    if min(t, h, e, k, f) < 1 or k > e:
        raise ValueError(f"moe shape {text!r}: every size must be >= 1 and top-k <= experts")
    return t, h, e, k, f


# ----------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor  # [T, H] this rank's tokens
    topk_ids: torch.Tensor  # [T, k] int64 global expert ids, distinct per token
    topk_weights: torch.Tensor  # [T, k] fp32, softmax over the k scores


@dataclasses.dataclass
class Experts:
    w_gate_up: torch.Tensor  # [E_local, H, 2F]
    w_down: torch.Tensor  # [E_local, F, H]


def make_inputs(shape: tuple[int, ...], ctx: RunContext, seed: int) -> Inputs:
    t, h, e, k, _ = shape
    gen = generator(ctx, seed)
    x = torch.randn(t, h, generator=gen, device=ctx.device, dtype=DTYPE)
    scores, ids = torch.rand(t, e, generator=gen, device=ctx.device).topk(k, dim=1)
    return Inputs(x, ids, torch.softmax(scores, dim=1))


def make_experts(shape: tuple[int, ...], ctx: RunContext) -> Experts:
    _, h, e, _, f = shape
    gen, e_local = generator(ctx, 7919), e // ctx.world
    # Made in bf16 directly: the DeepSeek-like w_gate_up alone is 3.8 GB per rank in bf16.
    w1 = torch.randn(e_local, h, 2 * f, generator=gen, device=ctx.device, dtype=DTYPE)
    w2 = torch.randn(e_local, f, h, generator=gen, device=ctx.device, dtype=DTYPE)
    return Experts(w1.mul_(1 / math.sqrt(h)), w2.mul_(1 / math.sqrt(f)))


# ----------------------------------------------------------------------------- the NCCL path


@dataclasses.dataclass
class NcclDispatched:
    recv_x: torch.Tensor  # [R, H] one row per received pair, in the contract's order
    row_of_pair: torch.Tensor  # [R] int64: the received token row each pair reads
    weight_of_pair: torch.Tensor  # [R] fp32
    expert_counts: list[int]  # pairs per local expert
    group_ends: torch.Tensor  # [E_local] int32 cumsum of expert_counts, for torch._grouped_mm
    recv_rows_split: list[int]  # token rows received from each rank
    send_rows_split: list[int]  # token rows sent to each rank
    token_of_send_row: torch.Tensor  # [sum(send_rows_split)] int64: the token of each sent row
    num_tokens: int


def nccl_dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    num_experts: int,
    group: Any = None,
) -> NcclDispatched:
    """The PyTorch + NCCL dispatch: two all_to_all_single of data, one of counts, one host
    sync; every index computed on the device (no nonzero() syncs), the few host-known ones
    copied right after that sync, while the stream is idle (a pageable copy waits for it)."""
    world = dist.get_world_size(group)
    e_local, (t, k), dev = num_experts // world, topk_ids.shape, x.device
    valid = topk_ids >= 0
    owner = torch.where(valid, topk_ids // e_local, world).long()  # world: slot unused
    # to_rank[r, t]: token t has a slot on rank r; one row is sent per True, rank-major.
    to_rank = torch.zeros(world + 1, t, dtype=torch.bool, device=dev)
    to_rank.scatter_(0, owner.t(), True)
    to_rank = to_rank[:world]
    row_in_chunk = to_rank.cumsum(1) - 1  # [world, T]: the row's place among those sent to r
    row_order = torch.argsort((~to_rank).reshape(-1).to(torch.uint8), stable=True)
    flat_owner = owner.reshape(-1)
    pair_order = torch.argsort(flat_owner, stable=True)  # by rank, then (t, j); unused last
    ids_or_none = torch.where(valid, topk_ids, num_experts).reshape(-1)
    pairs_to_expert = torch.bincount(ids_or_none, minlength=num_experts + 1)[:num_experts]
    counts = torch.cat([to_rank.sum(1, keepdim=True), pairs_to_expert.view(world, e_local)], 1)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    host = torch.cat([counts, recv_counts]).tolist()  # the one host sync: buffer sizes
    send_rows = [c[0] for c in host[:world]]
    send_pairs = [sum(c[1:]) for c in host[:world]]
    recv_rows = [c[0] for c in host[world:]]
    recv_pairs = [sum(c[1:]) for c in host[world:]]
    expert_counts = [sum(c[1 + e] for c in host[world:]) for e in range(e_local)]
    src = torch.repeat_interleave(  # the source rank of each arriving pair
        torch.arange(world, device=dev),
        torch.tensor(recv_pairs, device=dev),
        output_size=sum(recv_pairs),
    )
    first_row = torch.tensor([0, *recv_rows[:-1]], device=dev).cumsum(0)
    group_ends = group_ends_of(expert_counts, dev)

    sent = row_order[: sum(send_rows)]
    token_of_send_row = sent % t
    recv_tok = x.new_empty(sum(recv_rows), x.shape[1])
    dist.all_to_all_single(recv_tok, x[token_of_send_row], recv_rows, send_rows, group=group)
    pairs = pair_order[: sum(send_pairs)]
    p_rank, p_token = flat_owner[pairs], pairs // k
    meta = torch.stack(
        [
            (topk_ids.reshape(-1)[pairs] - p_rank * e_local).to(torch.int32),
            topk_weights.reshape(-1)[pairs].float().view(torch.int32),
            row_in_chunk[p_rank, p_token].to(torch.int32),
        ],
        dim=1,
    )
    recv_meta = meta.new_empty(sum(recv_pairs), 3)
    dist.all_to_all_single(recv_meta, meta, recv_pairs, send_pairs, group=group)

    # Expand to one row per pair: arrival order is (source, token, slot), so a stable sort by
    # local expert gives the contract's (expert, source, token, slot).
    perm = torch.argsort(recv_meta[:, 0], stable=True)
    row_of_pair = (first_row[src] + recv_meta[:, 2])[perm]
    return NcclDispatched(
        recv_x=recv_tok[row_of_pair],
        row_of_pair=row_of_pair,
        weight_of_pair=recv_meta[:, 1][perm].view(torch.float32),
        expert_counts=expert_counts,
        group_ends=group_ends,
        recv_rows_split=recv_rows,
        send_rows_split=send_rows,
        token_of_send_row=token_of_send_row,
        num_tokens=t,
    )


def nccl_combine(y: torch.Tensor, d: NcclDispatched, group: Any = None) -> torch.Tensor:
    """y [R, N] in recv_x's order -> [T, N]: each received token row's weighted pairs summed
    in fp32 and rounded once, sent back, summed at home in fp32 (the contract's numerics)."""
    n = y.shape[1]
    per_row = torch.zeros(sum(d.recv_rows_split), n, device=y.device, dtype=torch.float32)
    per_row.index_add_(0, d.row_of_pair, y.float() * d.weight_of_pair[:, None])
    back = y.new_empty(len(d.token_of_send_row), n)
    dist.all_to_all_single(
        back, per_row.to(y.dtype), d.send_rows_split, d.recv_rows_split, group=group
    )
    out = torch.zeros(d.num_tokens, n, device=y.device, dtype=torch.float32)
    return out.index_add_(0, d.token_of_send_row, back.float()).to(y.dtype)


def group_ends_of(counts: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(counts, device=device, dtype=torch.int64).cumsum(0).to(torch.int32)


def _loop_mm(a: torch.Tensor, w: torch.Tensor, counts: list[int], _: Any) -> torch.Tensor:
    out, start = a.new_empty(a.shape[0], w.shape[2]), 0
    for e, c in enumerate(counts):
        if c:
            torch.matmul(a[start : start + c], w[e], out=out[start : start + c])
        start += c
    return out


def _torch_grouped_mm(
    a: torch.Tensor, w: torch.Tensor, _: list[int], ends: torch.Tensor
) -> torch.Tensor:
    return torch._grouped_mm(a, w, offs=ends)


GROUPED_MM = {"torch._grouped_mm": _torch_grouped_mm, "torch.matmul per expert": _loop_mm}


def expert_mlp(
    a: torch.Tensor, counts: list[int], ends: torch.Tensor, experts: Experts, impl: str
) -> torch.Tensor:
    """a [R, H] grouped by local expert (``counts`` rows each, ``ends`` their int32 cumsum on
    a's device) -> y [R, H]: gate/up each rounded to a.dtype, silu(gate) * up in fp32
    rounded, then the down projection."""
    mm, f = GROUPED_MM[impl], experts.w_down.shape[1]
    gate_up = mm(a, experts.w_gate_up, counts, ends)
    act = (F.silu(gate_up[:, :f].float()) * gate_up[:, f:].float()).to(a.dtype)
    return mm(act, experts.w_down, counts, ends)


def dispatched_mlp(d: NcclDispatched, experts: Experts, impl: str) -> torch.Tensor:
    return expert_mlp(d.recv_x, d.expert_counts, d.group_ends, experts, impl)


def nccl_layer(s: Inputs, experts: Experts, num_experts: int, impl: str) -> torch.Tensor:
    d = nccl_dispatch(s.x, s.topk_ids, s.topk_weights, num_experts=num_experts)
    return nccl_combine(dispatched_mlp(d, experts, impl), d)


# ----------------------------------------------------------------------------- references


@dataclasses.dataclass
class ContractDispatch:
    recv_x: torch.Tensor  # [R, H]
    src_rank: torch.Tensor  # [R] int64
    src_token: torch.Tensor  # [R] int64
    weights: torch.Tensor  # [R] fp32
    expert_counts: list[int]


def contract_dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    num_experts: int,
    group: Any = None,
) -> ContractDispatch:
    """moe_dispatch by the contract's definition, from all-gathered inputs (every rank has
    the same T here): no deduplication, no all_to_all, nothing shared with nccl_dispatch."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    e_local = num_experts // world

    def gathered(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.stack(parts)

    x_all, ids_all, w_all = gathered(x), gathered(topk_ids), gathered(topk_weights.float())
    mine = (ids_all >= 0) & (ids_all // e_local == rank)
    s, t, j = mine.nonzero(as_tuple=True)  # (source, token, slot) ascending
    e = ids_all[s, t, j] - rank * e_local
    order = torch.argsort(e, stable=True)
    s, t, j = s[order], t[order], j[order]
    return ContractDispatch(
        recv_x=x_all[s, t],
        src_rank=s,
        src_token=t,
        weights=w_all[s, t, j],
        expert_counts=torch.bincount(e, minlength=e_local).tolist(),
    )


def mlp_reference(
    a: torch.Tensor, counts: list[int], w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """The expert MLP per the contract, each product in fp32 (one expert at a time)."""
    f, out, start = w_down.shape[1], torch.empty_like(a), 0
    for e, c in enumerate(counts):
        rows = a[start : start + c].float()
        gate_up = (rows @ w_gate_up[e].float()).to(a.dtype).float()
        act = (F.silu(gate_up[:, :f]) * gate_up[:, f:]).to(a.dtype).float()
        out[start : start + c] = (act @ w_down[e].float()).to(a.dtype)
        start += c
    return out


def combine_sums(s: Inputs, ctx: RunContext) -> dict[str, int]:
    """A combine's sums, for its per-element check (common.Check): each token's k weighted
    rows, through one rounded partial per owner rank."""
    return {"k": s.topk_ids.shape[1], "partials": ctx.world}


def dispatch_error(out: Any, ref: tuple[torch.Tensor, ContractDispatch]) -> float:
    """0.0 when recv_x is bit for bit nccl_dispatch's and the handle says what the
    definition says; else recv_x's relative error (1.0 when only the handle differs)."""
    recv_x, handle = out
    nccl_recv_x, ref_def = ref
    if recv_x.shape != nccl_recv_x.shape:
        return math.inf
    if not torch.equal(recv_x, nccl_recv_x):
        return max(rel_frobenius(recv_x, nccl_recv_x), 1e-30)
    same = (
        tuple(handle.expert_counts) == tuple(ref_def.expert_counts)
        and torch.equal(handle.recv_src_rank.long(), ref_def.src_rank)
        and torch.equal(handle.recv_src_token.long(), ref_def.src_token)
        and torch.equal(handle.recv_weights.float(), ref_def.weights)
    )
    return 0.0 if same else 1.0


# ----------------------------------------------------------------------------- traffic


def route_counts(topk_ids: torch.Tensor, world: int, num_experts: int) -> list[list[int]]:
    """[token rows, pairs] this rank sends to each rank (itself included)."""
    valid = topk_ids >= 0
    owner = torch.where(valid, topk_ids // (num_experts // world), world).long()
    to_rank = torch.zeros(topk_ids.shape[0], world + 1, dtype=torch.bool, device=owner.device)
    to_rank.scatter_(1, owner, True)
    pairs = torch.bincount(owner.reshape(-1), minlength=world + 1)[:world]
    return [to_rank[:, :world].sum(0).tolist(), pairs.tolist()]


def traffic(
    rows: list[list[int]], pairs: list[list[int]], *, row_bytes: int, e_local: int
) -> dict[str, Any]:
    """Byte counts from ``rows[s][d]`` / ``pairs[s][d]``, what rank s sends rank d."""
    w = len(rows)
    out_rows = [sum(rows[s][d] for d in range(w) if d != s) for s in range(w)]
    back_rows = [sum(rows[s][d] for s in range(w) if s != d) for d in range(w)]
    pairs_out = [sum(pairs[s][d] for d in range(w) if d != s) for s in range(w)]
    return {
        "row_bytes": row_bytes,
        "dispatch_rows_out_per_rank": out_rows,
        "dispatch_bytes_out_per_rank": [r * row_bytes for r in out_rows],
        "combine_bytes_out_per_rank": [r * row_bytes for r in back_rows],
        "local_rows_per_rank": [rows[s][s] for s in range(w)],
        # The GB/s numerator (dispatch and combine alike): mean over ranks of the bytes out.
        "payload_bytes_per_rank": sum(out_rows) * row_bytes / w,
        "pairs_received_per_rank": [sum(pairs[s][d] for s in range(w)) for d in range(w)],
        "nccl_meta_bytes_out_per_rank": [META_BYTES_PER_PAIR * p for p in pairs_out],
        "nccl_counts_bytes_out_per_rank": [8 * (1 + e_local) * (w - 1)] * w,
    }


def _all_ranks(ctx: RunContext, values: list[list[int]]) -> list[list[list[int]]]:
    mine = torch.tensor(values, dtype=torch.int64, device=ctx.device)
    if ctx.world == 1:
        return [values]
    parts = [torch.empty_like(mine) for _ in range(ctx.world)]
    dist.all_gather(parts, mine, group=ctx.group)
    return [p.tolist() for p in parts]


# ----------------------------------------------------------------------------- variants


def _pick_grouped_mm(
    ctx: RunContext, d: ContractDispatch, experts: Experts, ref_y: torch.Tensor, settings: Settings
) -> tuple[str, str]:
    """torch._grouped_mm if it exists and matches the reference on every rank, else the
    loop; and why not, where not."""
    why = ""
    if not hasattr(torch, "_grouped_mm"):
        why = f"torch {torch.__version__} has no torch._grouped_mm"
    else:
        try:
            ends = group_ends_of(d.expert_counts, d.recv_x.device)
            y = expert_mlp(d.recv_x, d.expert_counts, ends, experts, "torch._grouped_mm")
            err = rel_frobenius(y, ref_y)
            why = "" if err < settings.rel_tol else f"torch._grouped_mm rel_err {err:.3g}"
        except Exception as e:  # noqa: BLE001 - not for this dtype / device / layout: the loop
            why = f"torch._grouped_mm raised {type(e).__name__}: {e}"[:300]
    bad = [float(bool(why))]
    if (ctx.reduce_max(bad) if ctx.reduce_max else bad)[0] and not why:
        why = "torch._grouped_mm failed on another rank"
    return ("torch.matmul per expert", why) if why else ("torch._grouped_mm", "")


def _as_ours_runs_it(
    impl: str, ctx: RunContext, s: Inputs, experts: Experts, e: int, ours: dict[str, Any]
) -> tuple[str, str]:
    """(the expert GEMM of the eager layers but symm_mem_layer's, why where it is not
    ``impl``): cuBLAS per expert where our unfused layer takes it over torch._grouped_mm,
    so that those layers differ in their communication alone. The rule is
    overlap_kernels/ops/moe_details/steps.py grouped_gemm's: at most
    cublas_max_local_experts experts per rank."""
    group = ctx.group if ctx.group is not None else dist.group.WORLD
    args = (s.x, s.topk_ids, s.topk_weights, experts.w_gate_up, experts.w_down, group)
    per_expert = _resolved(ours, args, e, None).get("cublas_max_local_experts", 0)
    if impl == "torch._grouped_mm" and e // ctx.world <= per_expert:
        return "torch.matmul per expert", f"as ours: cublas_max_local_experts {per_expert}"
    return impl, ""


def _resolved(ours: dict[str, Any], args: tuple[Any, ...], e: int, cfg: Any) -> dict[str, Any]:
    """The config moe_mlp resolves ``cfg`` to, where the library exposes
    ``overlap_kernels.ops.moe.resolve_config`` taking moe_mlp's arguments; else ``cfg``."""
    try:
        got = ours["resolve_config"](*args, num_experts=e, config=cfg)
    except Exception:  # noqa: BLE001 - absent or another signature: record what was asked
        return dict(cfg or {})
    return dataclasses.asdict(got) if dataclasses.is_dataclass(got) else dict(got)


def _ours_variants(
    ctx: RunContext,
    sets: list[Inputs],
    experts: Experts,
    e: int,
    refs: dict[str, Any],
    ours: dict[str, Any],
    missing: dict[str, str],
) -> tuple[list[Variant], dict[str, Check]]:
    group = ctx.group if ctx.group is not None else dist.group.WORLD

    def lacking(*names: str) -> str:
        return "; ".join(sorted({missing[n] for n in names if n not in ours}))

    def args(s: Inputs) -> tuple[Any, ...]:
        return (s.x, s.topk_ids, s.topk_weights, group)

    variants: list[Variant] = []
    checks: dict[str, Check] = {}
    why = lacking("moe_dispatch")
    if why:
        variants.append(unavailable("ours_dispatch", "skipped", why, whole_op=False))
    else:
        dispatch = ours["moe_dispatch"]
        variants.append(
            Variant(
                "ours_dispatch",
                cycled(sets, lambda s: dispatch(*args(s), num_experts=e)),
                whole_op=False,
            )
        )
        checks["ours_dispatch"] = Check(
            lambda: dispatch(*args(sets[0]), num_experts=e),
            (refs["nccl_recv_x"], refs["definition"]),
            against="nccl_dispatch",
            compare=dispatch_error,
            exact=True,
        )
    why, status, handles = lacking("moe_dispatch", "moe_combine"), "skipped", []
    if not why:
        try:  # made once, outside the timed loop
            handles = [ours["moe_dispatch"](*args(s), num_experts=e) for s in sets]
        except Exception as err:  # noqa: BLE001 - recorded; the other variants still run
            why, status = f"moe_dispatch raised {type(err).__name__}: {err}"[:2000], "error"
    if why:
        variants.append(unavailable("ours_combine", status, why, whole_op=False))
    else:
        combine = ours["moe_combine"]
        variants.append(
            Variant("ours_combine", cycled(handles, lambda h: combine(*h)), whole_op=False)
        )
        checks["ours_combine"] = Check(
            lambda: combine(*handles[0]),
            refs["nccl_combine"],
            against="nccl_combine",
            **combine_sums(sets[0], ctx),
        )
    why, w = lacking("moe_mlp"), (experts.w_gate_up, experts.w_down)

    def layer(cfg: Any) -> Callable[[Inputs], torch.Tensor]:
        mlp = ours["moe_mlp"]
        return lambda s: mlp(s.x, s.topk_ids, s.topk_weights, *w, group, num_experts=e, config=cfg)

    for name, cfg in (
        ("ours_unfused_layer", {"path": "unfused"}),
        ("ours_fused_layer", {"path": "fused"}),
        ("ours_auto_layer", None),
    ):
        if why:
            variants.append(unavailable(name, "skipped", why))
            continue
        call = layer(cfg)
        resolved = _resolved(ours, (*args(sets[0])[:3], *w, group), e, cfg)
        note = ""
        if cfg is None:
            path = resolved.get("path")
            note = f"resolved path={path}" if path else "path not exposed by the library"
        variants.append(Variant(name, cycled(sets, call), config=resolved, note=note))
        checks[name] = Check(lambda call=call: call(sets[0]), refs["nccl_layer"], "nccl_layer")
    return variants, checks


def bench_shape(
    shape: tuple[int, ...],
    ctx: RunContext,
    settings: Settings,
    progress: Progress,
    ours: dict[str, Any],
    missing: dict[str, str],
) -> list[dict[str, Any]]:
    """Rows for one shape: every variant, the bound, then the traffic row."""
    t, h, e, _, f = shape
    dims = dict(zip(SHAPE_KEYS, shape))
    if e % ctx.world:
        raise ValueError(f"moe {shape_str(dims)}: {e} experts do not divide over {ctx.world} ranks")
    experts = make_experts(shape, ctx)
    bytes_per_set = (
        t * h * DTYPE.itemsize + experts.w_gate_up.nbytes + experts.w_down.nbytes
    )  # weights: with them every default set is far larger than L2, so one set
    sets = input_sets(lambda seed: make_inputs(shape, ctx, seed), bytes_per_set, ctx)
    s0 = sets[0]
    nccl = [nccl_dispatch(s.x, s.topk_ids, s.topk_weights, num_experts=e) for s in sets]
    definition = contract_dispatch(s0.x, s0.topk_ids, s0.topk_weights, num_experts=e)
    ref_y = mlp_reference(definition.recv_x, definition.expert_counts, **vars(experts))
    graph_impl, why = _pick_grouped_mm(ctx, definition, experts, ref_y, settings)
    impl, as_ours = _as_ours_runs_it(graph_impl, ctx, s0, experts, e, ours)
    gemm_info = {"grouped_mm": impl}
    gemm_note = f"grouped GEMM: {impl}" + (f" ({why or as_ours})" if why or as_ours else "")
    refs = {
        "nccl_recv_x": nccl[0].recv_x,
        "definition": definition,
        "nccl_combine": nccl_combine(nccl[0].recv_x, nccl[0]),
        "nccl_layer": nccl_layer(s0, experts, e, impl),
    }
    round_trip = s0.x.float() * s0.topk_weights.sum(1, keepdim=True)  # all slots are valid
    variants = [
        Variant(
            "nccl_dispatch",
            cycled(sets, lambda s: nccl_dispatch(s.x, s.topk_ids, s.topk_weights, num_experts=e)),
            whole_op=False,
        ),
        Variant("nccl_combine", cycled(nccl, lambda d: nccl_combine(d.recv_x, d)), whole_op=False),
        Variant(
            "grouped_gemm",
            cycled(nccl, lambda d: dispatched_mlp(d, experts, impl)),
            whole_op=False,
            config=gemm_info,
            note=gemm_note,
        ),
        Variant(
            "nccl_layer",
            cycled(sets, lambda s: nccl_layer(s, experts, e, impl)),
            config=gemm_info,
            note=gemm_note,
        ),
    ]
    checks = {
        "nccl_dispatch": Check(
            lambda: nccl_dispatch(s0.x, s0.topk_ids, s0.topk_weights, num_experts=e).recv_x,
            definition.recv_x,
            against="the contract's definition",
            exact=True,
        ),
        "nccl_combine": Check(
            lambda: nccl_combine(nccl[0].recv_x, nccl[0]),
            round_trip,
            "x * sum(weights)",
            **combine_sums(s0, ctx),
        ),
        "grouped_gemm": Check(
            lambda: dispatched_mlp(nccl[0], experts, impl),
            ref_y,
            against="fp32 reference",
        ),
        "nccl_layer": Check(
            lambda: nccl_layer(s0, experts, e, impl),
            nccl_combine(ref_y, nccl[0]),
            against="fp32 reference, combined",
        ),
    }
    mine, my_checks = _ours_variants(ctx, sets, experts, e, refs, ours, missing)
    counts = _all_ranks(ctx, route_counts(s0.topk_ids, ctx.world, e))
    received = [_all_ranks(ctx, route_counts(s.topk_ids, ctx.world, e)) for s in sets]
    most = max(sum(c[1][d] for c in every) for every in received for d in range(ctx.world))
    others, other_checks = baseline_variants(
        ctx, shape, sets, experts, refs, impl, graph_impl, most
    )
    graphs, graph_checks = graph_variants(ctx, shape, sets, experts, refs, ours, missing)
    variants = (variants[:1] + mine[:1] + variants[1:2] + mine[1:2] + variants[2:] + others
                + mine[2:] + graphs)  # fmt: skip
    checks = {**checks, **my_checks, **other_checks, **graph_checks}
    check_variants(ctx, variants, checks, settings)
    del refs, checks, my_checks, other_checks, graph_checks, definition, ref_y, round_trip
    progress.step(f"{OP} {shape_str(dims)}: checked")

    moved = traffic(
        [c[0] for c in counts],
        [c[1] for c in counts],
        row_bytes=h * DTYPE.itemsize,
        e_local=e // ctx.world,
    )
    mean_pairs = sum(moved["pairs_received_per_rank"]) / ctx.world
    for v in variants:  # 2 FLOPs per multiply-add: gate/up [H, 2F] and down [F, H] per pair
        v.flops = 6.0 * mean_pairs * h * f if v.name in (*LAYERS, "grouped_gemm") else None
    ms = time_ms(OP, dims, variants, ctx, settings, progress)
    comm = ("nccl_dispatch", "nccl_combine")
    bound_ms = (
        max(ms["grouped_gemm"], ms[comm[0]] + ms[comm[1]])
        if {"grouped_gemm", *comm} <= ms.keys()
        else None
    )
    moved["gbps_per_rank"] = {
        n: moved["payload_bytes_per_rank"] / (ms[n] * 1e-3) / 1e9
        for n in MOVES
        if ms.get(n) and ctx.world > 1
    }
    for v in variants:
        if v.name in moved["gbps_per_rank"]:
            gbps = f"{moved['gbps_per_rank'][v.name]:.4g} GB/s per rank"
            v.note = f"{gbps}; {v.note}" if v.note else gbps
    rows = [make_row(OP, dims, v, ms.get(v.name), bound_ms) for v in variants]
    bound_note = "max(grouped_gemm, nccl_dispatch + nccl_combine)"
    bound = Variant("bound", None, flops=6.0 * mean_pairs * h * f, note=bound_note)
    rows.append(make_row(OP, dims, bound, bound_ms, bound_ms))
    rows[-1]["status"] = "ok" if bound_ms is not None else "skipped"
    note = (
        "not timed: byte counts; payload = H-wide token rows leaving a rank for other ranks, "
        "one per (token, destination rank), mean over ranks; gbps_per_rank = payload / ms"
    )
    rows.append(make_row(OP, dims, Variant("traffic", None, config=moved, note=note), None, None))
    return rows


def run(ctx: RunContext, shapes: list[tuple[int, ...]], settings: Settings) -> list[dict[str, Any]]:
    """All shapes; progress on rank 0. Library functions that do not exist (yet) make their
    variants ``skipped``, with the reason; the NCCL variants run regardless."""
    ours, missing = load_ours(
        OP, ("moe_dispatch", "moe_combine", "moe_mlp", "moe_dispatch_graph", "moe_combine_graph")
    )
    shown = {n: why for n, why in missing.items() if n != "resolve_config"}
    return run_shapes(
        OP,
        shapes,
        ctx,
        settings,
        shown,
        lambda shape, progress: bench_shape(shape, ctx, settings, progress, ours, missing),
        missing_status="skipped",
    )


# ----------------------------------------------------------------------------- table


def _cell(r: dict[str, Any] | None, gbps: float | None = None) -> str:
    if r is None or r["status"] == "skipped":
        return "-"
    if r["status"] == "error":
        return "ERR"
    text = "-" if r["ms"] is None else f"{r['ms']:.3f}"
    text += f" ({gbps:.3g})" if gbps is not None else ""
    return text + ("!" if r["status"] == "check_failed" else "")


def _ratio_cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _sum_ms(vs: dict[str, dict[str, Any]], names: tuple[str, ...]) -> float | None:
    rs = [vs.get(n) for n in names]
    if any(r is None or r["status"] != "ok" or r["ms"] is None for r in rs):
        return None
    return sum(r["ms"] for r in rs)


def _goal(label: str, ratios: list[float | None], goal: float, strict: bool = False) -> str:
    got = [x for x in ratios if x is not None]
    ok = all(x > goal if strict else x >= goal for x in got)
    verdict = "-" if not got else "NOT met" if not ok else "met"
    if got and ok and len(got) < len(ratios):
        verdict = "incomplete"
    values = ", ".join(f"{x:.2f}" for x in got) or "-"
    rel = ">" if strict else ">="
    return f"goal: {label} {rel} {goal:g}: {values} ({len(got)} of {len(ratios)} shapes): {verdict}"


def format_table(rows: list[dict[str, Any]], world: int | None = None) -> str:
    """The layers (ms, ours_auto_layer's speedup over nccl_layer and the path it took, % of
    the bound), then dispatch and combine (ms and GB/s per rank), then the issue's goals;
    on one rank (``world`` 1), where no row leaves its rank, the layer within 10% of the
    plain layer's time instead."""
    by_shape: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_shape.setdefault(shape_str(r["shape"]), {})[r["variant"]] = r
    layer_rows = [r for r in rows if r["variant"] in ("grouped_gemm", *LAYERS, "bound")]

    def path_label(r: dict[str, Any]) -> str:
        path = (r.get("config") or {}).get("path")
        return f"({path[0]})" if path in ("fused", "unfused") else ""

    layers = _format_table(
        layer_rows, target="ours_auto_layer", baselines=("nccl_layer",), target_label=path_label
    )
    lines = []
    for shape, vs in by_shape.items():
        moved = (vs.get("traffic") or {}).get("config") or {}
        gbps = moved.get("gbps_per_rank", {})
        payload = moved.get("payload_bytes_per_rank")
        both = [_sum_ms(vs, (f"{w}_dispatch", f"{w}_combine")) for w in ("nccl", "ours")]
        lines.append(
            [shape, "-" if payload is None else f"{payload / 1e6:.2f}"]
            + [_cell(vs.get(n), gbps.get(n)) for n in MOVES]
            + ["-" if x is None else f"{x:.3f}" for x in both]
        )
    head = ["shape", "MB/rank", *MOVES, "nccl d+c", "ours d+c"]
    tokens = {shape: next(iter(vs.values()))["shape"]["T"] for shape, vs in by_shape.items()}
    prefill = [vs for shape, vs in by_shape.items() if tokens[shape] > DECODE_MAX_T]
    decode = [vs for shape, vs in by_shape.items() if tokens[shape] <= DECODE_MAX_T]

    def ratio(vs: dict[str, dict[str, Any]], base: tuple[str, ...], mine: tuple[str, ...]):
        b, m = _sum_ms(vs, base), _sum_ms(vs, mine)
        return None if not b or not m else b / m

    def over_fastest(vs: dict[str, dict[str, Any]], bases: tuple[str, ...], mine: str):
        """``mine``'s speedup over the fastest of ``bases`` that ran."""
        got = [x for x in (ratio(vs, (b,), (mine,)) for b in bases) if x is not None]
        return min(got, default=None)

    if world == 1:
        local = local_goal_line(rows, target="ours_auto_layer", baseline="nccl_layer",
                                what="the plain layer (nccl_layer)")  # fmt: skip
        graphed = _graphed_table(by_shape, tokens, ratio)
        return "\n".join([layers, "", *grid(head, lines), *graphed, local, _LEGEND])
    goals = [
        _goal(f"ours_auto_layer over nccl_layer on each prefill shape (T > {DECODE_MAX_T})",
              [ratio(vs, ("nccl_layer",), ("ours_auto_layer",)) for vs in prefill], LAYER_GOAL),
        _goal("ours_auto_layer over the faster of deepep_layer and symm_mem_layer on each "
              "prefill shape", [over_fastest(vs, ("deepep_layer", "symm_mem_layer"), "ours_auto_layer")
                                for vs in prefill], LAYER_GOAL),
        _goal("ours_dispatch GB/s over nccl_dispatch's on each prefill shape",
              [ratio(vs, ("nccl_dispatch",), ("ours_dispatch",)) for vs in prefill], 1.0),
        _goal("ours_combine GB/s over nccl_combine's on each prefill shape",
              [ratio(vs, ("nccl_combine",), ("ours_combine",)) for vs in prefill], 1.0),
        _goal(f"nccl d+c ms over ours d+c ms on each decode shape (T <= {DECODE_MAX_T})",
              [ratio(vs, MOVES[::2], MOVES[1::2]) for vs in decode], 1.0, strict=True),
        _goal("nccl_dc ms (eager: not capturable) over ours_graph_dc ms (CUDA graphs) on each "
              "decode shape", [ratio(vs, ("nccl_dc",), ("ours_graph_dc",)) for vs in decode], 1.0,
              strict=True),
        _goal("ours_graph_layer over the faster of deepep_graph_layer and symm_mem_graph_layer "
              "(all in CUDA graphs) on each decode shape",
              [over_fastest(vs, ("deepep_graph_layer", "symm_mem_graph_layer"), "ours_graph_layer")
               for vs in decode], 1.0, strict=True),
        _goal("ours_graph_eager_layer over the fastest eager layer (nccl, deepep, symm_mem) on each "
              "decode shape", [over_fastest(vs, ("nccl_layer", "deepep_layer", "symm_mem_layer"),
                                            "ours_graph_eager_layer") for vs in decode], 1.0, strict=True),
    ]  # fmt: skip
    return "\n".join([layers, "", *grid(head, lines), *_graphed_table(by_shape, tokens, ratio), *goals,
                      _LEGEND])  # fmt: skip


def _graphed_table(by_shape, tokens, ratio) -> list[str]:
    """Decode shapes with ours replayed in CUDA graphs (and the NCCL path eager)."""
    graph_lines = [
        [shape] + [_cell(vs.get(n)) for n in GRAPHED]
        + [_ratio_cell(ratio(vs, ("nccl_dc",), ("ours_graph_dc",))),
           _ratio_cell(ratio(vs, ("nccl_layer",), ("ours_graph_layer",)))]
        for shape, vs in by_shape.items() if tokens[shape] <= DECODE_MAX_T
    ]  # fmt: skip
    if not graph_lines:
        return []
    return ["", "decode, ours replayed in CUDA graphs (the NCCL path eager: it syncs the host)",
            *grid(["shape", *GRAPHED, "dc speedup", "layer speedup"], graph_lines)]  # fmt: skip


_LEGEND = (
    "ms per call: median over calls, max over ranks; shape T x H x E x k x F (tokens per "
    "rank, hidden, experts, top-k, expert intermediate). (GB/s per rank): token-row bytes "
    "leaving a rank for other ranks (MB/rank, mean over ranks) / ms; d+c: dispatch + "
    "combine ms. '!' failed its correctness check, ERR raised, '-' not available."
)
